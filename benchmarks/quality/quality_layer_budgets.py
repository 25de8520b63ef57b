"""Per-layer eviction budgets (PyramidKV-style) against one budget for every layer, on
SmolLM2-135M: the measurement behind issue 19's item 4 ("a per-layer or per-head budget option
where it helps quality").

    python benchmarks/quality/quality_layer_budgets.py [--lengths 1024,2048] [--ratios 0.5,0.75]

kvcompile's pool shares page ids across layers and kv heads (one block table per sequence), so a
sequence holds as many pages as its *largest* per-layer (or per-head) count: budgets that differ
by layer save no memory below their maximum. Two per-layer rows are therefore measured:

    pyramid         layer l keeps B * (1.5 - l / (L - 1)) tokens: the same average B as the
                    uniform row, 1.5 B at layer 0 (so it holds 1.5x the uniform row's pages)
    pyramid-capped  the same shape scaled to a maximum of B: the uniform row's pages, 2/3 of
                    its tokens on average

Policy: SnapKV (the harness's default settings) at each compression ratio; the prompt minus its
last token is prefilled and compressed, then the answer is decoded (benchmarks/quality/quality.py's
protocol). Passkey at --lengths x 5 depths, and perplexity of 256 Lee-corpus tokens after a
1024-token context (2 windows). The per-layer rows are set through the run time's per-sequence
policy (patched here for the measurement; kvcompile itself has no per-layer budget option).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from quality import _retrieval, load_model  # noqa: E402
from quality_data import lee_corpus_ids, passkey_prompt  # noqa: E402
from quality_eval import Evaluator, nll_and_agreement, ppl  # noqa: E402

from kvcompile.config import SnapKV  # noqa: E402
from kvcompile.eviction.runtime import EvictionRuntime  # noqa: E402


class PerLayer(tuple):
    """One policy per layer (the patched policy_of below reads it)."""


def _patch_policy_of() -> None:
    orig = EvictionRuntime.policy_of

    def policy_of(self, seq_id, layer):
        p = orig(self, seq_id, layer)
        return p[layer] if isinstance(p, PerLayer) else p

    EvictionRuntime.policy_of = policy_of


def rows_at(ratio: float, n: int, layers: int) -> dict:
    b = max(8, round((1 - ratio) * n))
    shape = [1.5 - li / (layers - 1) for li in range(layers)]
    pct = int(100 * ratio)
    return {
        f"uniform {pct}%": SnapKV(budget=b),
        f"pyramid {pct}%": PerLayer(SnapKV(budget=max(8, round(b * s))) for s in shape),
        f"pyramid-capped {pct}%": PerLayer(SnapKV(budget=max(8, round(b * s / 1.5)))
                                           for s in shape),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--ratios", default="0.5,0.75")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--windows", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    _patch_policy_of()
    model, tok = load_model("cpu")
    layers = model.config.num_hidden_layers
    ratios = [float(r) for r in a.ratios.split(",")]
    ev = Evaluator(model).compile("auto")
    t0 = time.time()
    # passkey
    rng = random.Random(0)
    hits: dict = {}
    for length in [int(x) for x in a.lengths.split(",")]:
        for depth in (0.1, 0.3, 0.5, 0.7, 0.9):
            key = rng.randint(10000, 99999)
            text, ans = passkey_prompt(tok, length, depth, key)
            n = len(tok(text).input_ids) - 1
            pols = {"full": None}
            for r in ratios:
                pols.update(rows_at(r, n, layers))
            h = _retrieval(ev, tok, [(str(length), text, ans)], pols, 8, "passkey")
            for k, v in h.items():
                hits.setdefault(k, []).extend(v[str(length)])
    # perplexity after a compressed context, with pages and tokens kept
    ids = lee_corpus_ids(tok)
    stride = (len(ids) - a.ctx - a.cont) // a.windows
    pols = {"full": None}
    for r in ratios:
        pols.update(rows_at(r, a.ctx, layers))
    acc = {k: [0.0, 0] for k in pols}
    pages = {k: 0.0 for k in pols}
    tokens = {k: 0.0 for k in pols}
    for w in range(a.windows):
        s = w * stride
        rows = ev.prefill_and_fork(ids[s:s + a.ctx], pols)
        pool, rt = ev.state.pool, ev.rt
        for lab, sid in zip(rows.labels, rows.seq_ids):
            pages[lab] += pool.seq_len(sid) / a.ctx / a.windows
            book = rt.books.get(sid)
            kept = ([float((p >= 0).sum(-1).float().mean()) for p in book.pos.values()]
                    if book is not None else [float(pool.seq_len(sid))])
            tokens[lab] += sum(kept) / len(kept) / a.ctx / a.windows
        prev, tgt = rows.last_logits, ids[s + a.ctx:s + a.ctx + a.cont]
        for i in range(0, a.cont, 64):
            x = tgt[i:i + 64]
            lg = ev.step(rows, x)
            preds = torch.cat([prev[:, None], lg[:, :-1]], 1)
            nll, _, _ = nll_and_agreement(preds, x)
            for r, k in enumerate(rows.labels):
                acc[k][0] += float(nll[r])
                acc[k][1] += x.numel()
            prev = lg[:, -1]
        rows.cache = None
    print(f"\nSmolLM2-135M, SnapKV, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s")
    print(f"\n| row | passkey (hits) | ppl ({a.ctx} ctx, {a.cont * a.windows} tokens) | "
          "stored slots / ctx | mean tokens per layer / ctx |")
    print("|---|---|---|---|---|")
    for k in pols:
        print(f"| {k} | {sum(hits[k])}/{len(hits[k])} | {ppl(*acc[k]):.2f} | "
              f"{pages[k]:.3f} | {tokens[k]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
