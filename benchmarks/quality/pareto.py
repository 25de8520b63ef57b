"""Key-aware KV quantization on SmolLM2-135M: bits per element (scales included) against the
change in teacher-forced perplexity, through the real cache, for every format x granularity x
rotation (and the mixed K/V configurations worth having). CPU, fp32 model.

    python benchmarks/quality/pareto.py                      # the whole grid, resumable
    python benchmarks/quality/pareto.py --only 'int4*'       # configs whose name matches
    python benchmarks/quality/pareto.py --report             # table (markdown) + pareto.png

Each configuration compiles a fresh copy of the model with kvcompile (the rotation pass folds
into the copy's weights), then runs one forward over the first T tokens of each corpus: every
layer's attention op stores K/V into the paged pool in the configured format and attends over
the stored (quantized) pages. Attention over the stored pages is computed with PyTorch's SDPA
(a RuntimeHook; same math as the reference path, which materializes [Hq, T, T] scores and is
~5x slower on the CPU). Corpora: gensim's Lee background corpus (news) and the text of Python's
pydoc_data topics (technical prose and code). Results accumulate in pareto.json next to this
script.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import kvcompile  # noqa: E402
from kvcompile.cache.formats import resolve_format  # noqa: E402
from kvcompile.config import KVConfig  # noqa: E402
from kvcompile.models import load_smollm2  # noqa: E402
from kvcompile.runtime.hooks import RuntimeHook  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quality_data import lee_corpus_ids  # noqa: E402  (benchmarks/: the Lee corpus, tokenized)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "pareto.json")
HEAD_DIM, KV_HEADS, N_LAYERS = 64, 3, 30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- model and text ----------------------------------------------------------------------------

def load_model():
    """SmolLM2-135M-Instruct (GGUF Q4_1 weights, dequantized to fp32) and its tokenizer."""
    model, tok, _ = load_smollm2(torch.float32)
    return model, tok


def corpora(tok, n_tokens: int, windows: int = 1, offset: int = 0) -> dict[str, torch.Tensor]:
    """{"lee": ids [1, n_tokens], "pydoc": ...}; with windows > 1 also "lee@1", "lee@2", ...:
    the following non-overlapping windows of each text. offset: tokens skipped first."""
    import pydoc_data.topics as topics

    pydoc_text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    out = {}
    for name, ids in (("lee", lee_corpus_ids(tok)[None]),
                      ("pydoc", tok(pydoc_text, return_tensors="pt").input_ids)):
        for w in range(windows):
            key = name if w == 0 else f"{name}@{w}"
            out[key] = ids[:, offset + w * n_tokens:offset + (w + 1) * n_tokens]
    return out


# --- the grid ----------------------------------------------------------------------------------

def grid() -> dict[str, dict]:
    """name -> KVConfig fields. Same format for K and V over every granularity x rotation,
    then mixed K/V formats, larger pages for channel scales, the residual page, and per-layer
    mixes."""
    cfgs: dict[str, dict] = {"fp32": dict(kv_dtype="fp32"), "bf16": dict(kv_dtype="bf16")}
    grans = {"fp8_e4m3": ("page", "token", "tensor", "channel"),
             "fp8_e5m2": ("page", "token", "channel"),
             "fp4_e2m1": ("page", "token", "tensor", "channel"),
             "int4": ("page", "token", "channel"), "int2": ("page", "token", "channel")}
    for fmt, gs in grans.items():
        for g in gs:
            for rot in (None, "hadamard"):
                name = f"{fmt}/{g}" + ("+rot" if rot else "")
                cfgs[name] = dict(kv_dtype=fmt, scale_granularity=g, rotate=rot)
    mixed = {  # (k_dtype, v_dtype, granularity, page size)
        "K fp8_e4m3/V fp4": ("fp8_e4m3", "fp4_e2m1", "page", 16),
        "K fp8_e4m3/V int4": ("fp8_e4m3", "int4", "token", 16),
        "K int4/V fp4": ("int4", "fp4_e2m1", "channel", 16),
        "K int4/V int4 P64": ("int4", "int4", "channel", 64),
        "K int4/V int4 P128": ("int4", "int4", "channel", 128),
        "K int4/V fp4 P64": ("int4", "fp4_e2m1", "channel", 64),
        "K int4/V int2 P64": ("int4", "int2", "channel", 64),
        "K int4/V int2 P128": ("int4", "int2", "channel", 128),
        "K fp4/V int2 P64": ("fp4_e2m1", "int2", "channel", 64),
        "K int2/V int2 P64": ("int2", "int2", "channel", 64),
        "K fp8_e4m3/V int2": ("fp8_e4m3", "int2", "token", 16),
        "K int3/V int3 P64": ("int3", "int3", "channel", 64),
        "K int3/V int3 P128": ("int3", "int3", "channel", 128),
        "K int4/V int3 P64": ("int4", "int3", "channel", 64),
    }
    for name, (k, v, g, p) in mixed.items():
        for rot in (None, "hadamard"):
            cfgs[name + ("+rot" if rot else "")] = dict(
                kv_dtype=k, k_dtype=k, v_dtype=v, scale_granularity=g, page_size=p, rotate=rot)
    for name in ("K int4/V int2 P64", "K int4/V int4 P64"):
        base = dict(cfgs[name + "+rot"])
        cfgs[name + "+rot+residual"] = dict(base, residual=True)
    # second search (targets missed by the grid above): larger pages, fp8 page sizes, and
    # per-layer mixes (`kvcompile.configure` on layers[i].self_attn; "layers": {"a-b": fields})
    more = {  # (k_dtype, v_dtype, granularity, page size)
        "K int4/V fp4 P128": ("int4", "fp4_e2m1", "channel", 128),
        "K int4/V int3 P128": ("int4", "int3", "channel", 128),
    }
    for name, (k, v, g, p) in more.items():
        for rot in (None, "hadamard"):
            cfgs[name + ("+rot" if rot else "")] = dict(
                kv_dtype=k, k_dtype=k, v_dtype=v, scale_granularity=g, page_size=p, rotate=rot)
    for p in (64, 128):
        cfgs[f"fp8_e4m3/page+rot P{p}"] = dict(kv_dtype="fp8_e4m3", scale_granularity="page",
                                               rotate="hadamard", page_size=p)
    # fp8 with key treatment (target: <= +0.5% perplexity): keys and values with their own scale
    # granularities (v_scale_granularity), rotated (channel-scaled keys stay unrotated: only V)
    for kg, vg, p in (("page", "token", 16), ("token", "page", 16), ("page", "token", 64),
                      ("channel", "token", 16), ("channel", "token", 64),
                      ("channel", "page", 64), ("token", "page", 64), ("token", "tensor", 16)):
        cfgs[f"fp8_e4m3 K {kg}/V {vg}+rot" + (f" P{p}" if p != 16 else "")] = dict(
            kv_dtype="fp8_e4m3", scale_granularity=kg, v_scale_granularity=vg,
            rotate="hadamard", page_size=p)
    k3v3 = dict(cfgs["K int3/V int3 P64+rot"])
    k4 = {"k_dtype": "int4"}
    for label, ranges in (("0-5", ("0-5",)), ("24-29", ("24-29",)), ("0-2,27-29", ("0-2", "27-29")),
                          ("0-1", ("0-1",)), ("0", ("0",))):
        cfgs[f"K int3/V int3 P64+rot, K int4 in layers {label}"] = dict(
            k3v3, layers={r: k4 for r in ranges})
    k3v3 = dict(cfgs["K int3/V int3 P128+rot"])
    for label, ranges in (("0-12", ("0-12",)), ("0-7,25-29", ("0-7", "25-29"))):
        cfgs[f"K int3/V int3 P128+rot, K int4 in layers {label}"] = dict(
            k3v3, layers={r: k4 for r in ranges})
    return cfgs


def layer_indices(spec: str) -> range:
    """'7' -> range(7, 8); '0-5' -> range(0, 6) (inclusive)."""
    a, _, b = spec.partition("-")
    return range(int(a), int(b or a) + 1)


def split_layers(fields: dict) -> tuple[dict, dict[int, dict]]:
    """fields -> (KVConfig fields, {layer index: per-layer overrides})."""
    fields = dict(fields)
    per = {}
    for spec, ov in (fields.pop("layers", None) or {}).items():
        for i in layer_indices(spec):
            per[i] = dict(ov)
    return fields, per


def bits_per_element(fields: dict) -> float:
    """Storage bits per cached K/V element, scales and zero points included (the residual's
    per-sequence bf16 page is not per token and is not counted), averaged over the layers when
    some have their own formats."""
    fields, per = split_layers(fields)
    if per:
        return sum(bits_per_element({**fields, **per.get(i, {})})
                   for i in range(N_LAYERS)) / N_LAYERS
    cfg = KVConfig(**fields)
    p, g = cfg.page_size, cfg.scale_granularity
    kf = resolve_format(cfg.key_dtype, torch.float32, g)
    vf = resolve_format(cfg.value_dtype, torch.float32, cfg.value_granularity)
    return (kf.bits_per_element(HEAD_DIM, p) + vf.bits_per_element(HEAD_DIM, p)) / 2


# --- attention over the stored pages, with SDPA ------------------------------------------------

class SdpaOverPages(RuntimeHook):
    """Attention of a one-sequence forward over its stored (dequantized) pages via SDPA."""

    def __init__(self, state):
        self.state = state

    def attend(self, ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale, extras):
        if plan.packed or len(plan.seq_ids) != 1 or window or softcap or plan.kv_start[0]:
            return None
        pool = self.state.pool
        total = plan.seq_lens_list[0]
        ids = torch.as_tensor(pool.pages_of(plan.seq_ids[0]), dtype=torch.long)
        kt, vt = pool.k[layer], pool.v[layer]
        k = kt.read(ids).permute(1, 0, 2, 3).reshape(kt.num_heads, -1, kt.head_dim)[:, :total]
        v = vt.read(ids).permute(1, 0, 2, 3).reshape(vt.num_heads, -1, vt.head_dim)[:, :total]
        S = q.shape[2]
        mask = None
        if S != total:  # queries are the last S positions
            qp = torch.arange(total - S, total)[:, None]
            mask = torch.arange(total)[None, :] <= qp
        rep = q.shape[1] // k.shape[0]  # repeated heads: CPU SDPA's GQA path is the slow math one
        out = F.scaled_dot_product_attention(
            q.float(), k.repeat_interleave(rep, 0)[None], v.repeat_interleave(rep, 0)[None],
            attn_mask=mask, is_causal=mask is None and S > 1, scale=scale)
        return out


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True).logits[0, :-1].float()
    nll = F.cross_entropy(logits, ids[0, 1:], reduction="mean")
    return math.exp(nll.item())


def decode_tail_ppl(model, ids: torch.Tensor, tail: int) -> float:
    """Perplexity of the last `tail` tokens of ids [1, T] predicted one decode step at a time
    after a prefill of the rest: every query sees the cache as decode leaves it (the current,
    partly filled page in bf16 when `residual` is on)."""
    T = ids.shape[1]
    nll = 0.0
    with torch.no_grad():
        out = model(input_ids=ids[:, :T - tail], use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        for t in range(T - tail, T):
            nll += F.cross_entropy(logits.float()[None], ids[0, t:t + 1]).item()
            if t == T - 1:
                break
            out = model(input_ids=ids[:, t:t + 1], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
    return math.exp(nll / tail)


def run_config(base, fields: dict, texts: dict, reference_path: bool = False,
               decode_tail: int = 0) -> dict:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    fields, per = split_layers(fields)
    for i, ov in per.items():
        kvcompile.configure(model.model.layers[i].self_attn, **ov)
    cfg = KVConfig(inner="eager", kernels="reference", max_kv_bytes=1 << 30, **fields)
    model = kvcompile.compile(model, cfg)
    state = kvcompile.api.state_of(model)
    if not reference_path:
        state.hooks.append(SdpaOverPages(state))
    out = {}
    t0 = time.time()
    for name, ids in texts.items():
        out[name] = perplexity(model, ids)
    if decode_tail:
        out["lee_tail"] = decode_tail_ppl(model, texts["lee"], decode_tail)
    rep = kvcompile.report(model)
    out["seconds"] = time.time() - t0
    out["rewritten"] = len(rep.rewritten)
    out["rotation"] = sorted({s.rotate for s in rep.sites})
    out["formats"] = sorted({f"{s.k_format}/{s.v_format}" for s in rep.sites})
    return out


# --- report ------------------------------------------------------------------------------------

def report(results: dict) -> str:
    base = results.get("eager")
    if base is None:
        return "no baseline yet"
    rows = []
    for name, r in results.items():
        if name == "eager" or "lee" not in r:
            continue
        d = {c: 100 * (r[c] / base[c] - 1) for c in ("lee", "pydoc") if c in r}
        rows.append((r["bits"], name, r, d))
    rows.sort(key=lambda t: (t[0], t[3].get("lee", 0)))
    lines = [f"Baseline (fp32, no kvcompile): Lee {base['lee']:.3f}, pydoc {base['pydoc']:.3f}",
             "", "| config | bits/elem | ppl Lee | Δppl Lee | ppl pydoc | Δppl pydoc | rotated |",
             "|---|---|---|---|---|---|---|"]
    for bits, name, r, d in rows:
        lines.append(f"| {name} | {bits:.3f} | {r['lee']:.3f} | {d['lee']:+.2f}% | "
                     f"{r.get('pydoc', float('nan')):.3f} | {d.get('pydoc', float('nan')):+.2f}% "
                     f"| {rotated(r['rotation'])} |")
    return "\n".join(lines)


def rotated(rotation: list[str]) -> str:
    """What the rotate pass rotated, from the report's per-site strings: "q,k+V", "V" or "-"
    (V folded into v_proj/o_proj unless marked "explicit"); "/" joins layers that differ."""
    out = []
    for x in rotation:
        if x == "none":
            out.append("-")
            continue
        what = "V" if "V only" in x else "q,k+V"
        out.append(what + (" (V explicit)" if "explicitly" in x else ""))
    return "/".join(sorted(set(out))) or "-"


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    front, best = [], float("inf")
    for b, d, n in sorted(points):
        if d < best:
            front.append((b, d, n))
            best = d
    return front


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results["eager"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=False)
    for ax, corpus in zip(axes, ("lee", "pydoc")):
        pts = []
        for name, r in results.items():
            if name == "eager" or corpus not in r or r["bits"] > 17:
                continue
            d = 100 * (r[corpus] / base[corpus] - 1)
            pts.append((r["bits"], d, name))
            ax.scatter(r["bits"], max(d, 0.05), s=14,
                       c="tab:red" if "rot" in name else "tab:blue")
        front = pareto_front(pts)
        ax.plot([p[0] for p in front], [max(p[1], 0.05) for p in front], "k--", lw=0.8)
        for b, d, n in front:
            ax.annotate(n, (b, max(d, 0.05)), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per K/V element (scales included)")
        ax.set_ylabel("Δ perplexity, % (log)")
        ax.set_title(f"SmolLM2-135M, {corpus} ({'blue' if True else ''}: no rotation, "
                     f"red: Hadamard)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="*",
                    help="fnmatch pattern of config names ('|' separates several)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=RESULTS, help="results JSON")
    ap.add_argument("--windows", type=int, default=1,
                    help="windows of --tokens tokens per corpus (the spread of Δppl over "
                         "windows measures the noise)")
    ap.add_argument("--offset", type=int, default=0,
                    help="skip this many tokens of each corpus (e.g. held-out text)")
    ap.add_argument("--decode-tail", type=int, default=0,
                    help="also the perplexity of the last N Lee tokens decoded one at a time")
    ap.add_argument("--check-reference", action="store_true",
                    help="also run each config through the reference attention path")
    args = ap.parse_args(argv)
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    if args.report:
        print(report(results))
        plot(results, os.path.join(HERE, "pareto.png"))
        return
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    log("loading SmolLM2")
    base, tok = load_model()
    texts = corpora(tok, args.tokens, args.windows, args.offset)
    eager = results.setdefault("eager", {})
    missing = [c for c in texts if c not in eager or args.redo]
    if missing:
        eager.update({c: perplexity(base, texts[c]) for c in missing})
        log(f"eager baseline {eager}")
    if args.decode_tail and ("lee_tail" not in eager or args.redo):
        eager["lee_tail"] = decode_tail_ppl(base, texts["lee"], args.decode_tail)
    for name, fields in grid().items():
        have = results.get(name, {})
        want = list(texts) + (["lee_tail"] if args.decode_tail else [])
        if not any(fnmatch.fnmatch(name, p) for p in args.only.split("|")) or (
                all(c in have for c in want) and not args.redo):
            continue
        try:
            r = run_config(base, fields, texts, decode_tail=args.decode_tail)
        except Exception as e:  # a config that fails is recorded, not fatal to the grid
            log(f"{name}: FAILED {type(e).__name__}: {e}")
            results[name] = {"error": f"{type(e).__name__}: {e}", "fields": fields}
            continue
        r["bits"] = bits_per_element(fields)
        r["fields"] = fields
        results[name] = {**have, **r}
        d = {c: f"{100 * (r[c] / results['eager'][c] - 1):+.2f}%" for c in texts}
        log(f"{name}: bits {r['bits']:.3f} ppl {d} ({r['seconds']:.0f}s) {r['rotation']}")
        if args.check_reference:
            ref = run_config(base, fields, texts, reference_path=True)
            r["reference_path"] = {c: ref[c] for c in texts}
            log(f"{name}: reference path {r['reference_path']}")
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
