"""CUDA-graph decode steps of HF `generate` (integrations/hf_graphs.py) against the same calls
without graphs (CUDA only).

    python benchmarks/gpu_check_hf_graphs.py

A tiny Llama (fp32 weights, LM head sharpened so greedy decoding is decided by the model) is
compiled with kvcompile; each case runs `generate` twice, graphs on and graphs off, and
compares the tokens and the per-step logits (`output_logits=True`):
greedy with left padding (B=3), a longer prompt after a shorter one (recapture) and a shorter
one after it (reuse: mask columns past the prompt set to 1), beam search (2 beams: forks,
reorder), sampling with num_return_sequences=2 (seeded), and B=1. Per case: graph captures
and replays, largest relative logit difference, token agreement, pages left in the pool after
the call. Formats: bf16, fp8_e4m3. Prints a table; exits 1 on a failure.
"""

from __future__ import annotations

import gc
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kvcompile  # noqa: E402
from kvcompile import KVConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gpu_check_engine_graphs import tiny  # noqa: E402  (the same tiny Llama, seed 0)

TOL = 2e-3   # graph vs eager steps: the same kernels, other split-K partitions


def inputs(B: int, L: int, pad: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (B, L), generator=g)
    am = torch.ones_like(ids)
    if pad:
        for r in range(B):
            n = (r * 5) % max(L - 2, 1)
            ids[r, :n] = 0
            am[r, :n] = 0
    return ids.cuda(), am.cuda()


CASES = [
    ("greedy B=3 left pad", dict(B=3, L=40, pad=True), dict(do_sample=False)),
    ("longer prompt (recapture)", dict(B=3, L=90, pad=True), dict(do_sample=False)),
    ("shorter prompt (reuse)", dict(B=3, L=20, pad=True), dict(do_sample=False)),
    ("beam search 2", dict(B=2, L=30, pad=True), dict(do_sample=False, num_beams=2)),
    ("sampling x2 seqs", dict(B=2, L=30, pad=False),
     dict(do_sample=True, top_k=20, temperature=0.8, num_return_sequences=2)),
    ("greedy B=1", dict(B=1, L=25, pad=False), dict(do_sample=False)),
]


def run(model, ids, am, kw, graphs: bool, seed: int):
    fwd = model.forward
    fwd._why_not = None if graphs else "off (check)"
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=am, max_new_tokens=16, min_new_tokens=16,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    fwd._why_not = None
    toks, logits = out.sequences[:, ids.shape[1]:], [x.float() for x in out.logits]
    del out
    gc.collect()   # the returned cache sits in reference cycles: its pages go with it
    return toks, logits


def main() -> int:
    if not torch.cuda.is_available():
        print("CUDA only")
        return 0
    rows, bad = [], 0
    # one process, two models, many batch shapes: more recompiles than Dynamo's default cap
    torch._dynamo.config.recompile_limit = 64
    for fmt in ("bf16", "fp8_e4m3"):
        torch._dynamo.reset()
        model = tiny()
        kvcompile.compile(model, KVConfig(kv_dtype=fmt, max_kv_bytes=256 << 20, page_size=16))
        fwd = model.forward
        for i, (name, shape, kw) in enumerate(CASES):
            r = dict(fmt=fmt, case=name)
            try:
                ids, am = inputs(seed=i, **shape)
                c0, r0 = fwd.captures, fwd.replays
                tg, lg = run(model, ids, am, kw, True, seed=i)
                r["captures"], r["replays"] = fwd.captures - c0, fwd.replays - r0
                st = kvcompile.stats(model)
                r["pages_left"] = st.get("pages_used")
                te, le = run(model, ids, am, kw, False, seed=i)
                r["no_graph_replays"] = fwd.replays - r0 - r["replays"]
                same = (tg == te).float().mean().item()
                n = len(lg)
                # compare logits on the steps before the first token difference
                first = next((j for j in range(tg.shape[1]) if not torch.equal(tg[:, j],
                                                                                te[:, j])), n)
                rel = max([float((a - b).abs().max() / b.abs().max()) for a, b in
                           zip(lg[:first], le[:first])] or [0.0])
                r.update(same_tokens=same, max_rel=rel, steps_compared=first)
                r["ok"] = (r["replays"] > 0 and r["no_graph_replays"] == 0 and rel <= TOL
                           and same == 1.0 and not r["pages_left"])
            except Exception as e:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                r.update(error=f"{type(e).__name__}: {str(e)[:200]}", ok=False)
            bad += not r["ok"]
            rows.append(r)
            print(r, flush=True)
    cols = ["fmt", "case", "captures", "replays", "no_graph_replays", "same_tokens", "max_rel",
            "steps_compared", "pages_left", "ok"]
    print("| " + " | ".join(cols) + " |")
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else
                                str(r.get(c, r.get("error", "-"))) for c in cols) + " |")
    print(f"hf graph check: {len(rows) - bad}/{len(rows)} passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
