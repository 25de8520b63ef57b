"""What a fresh prompt's prefill attends to, and what it costs in quality (SmolLM2-135M, CPU).

    python benchmarks/quality/prefill_attends_quality.py [--context 1024] [--tail 128]

KVConfig.prefill_attends: "fresh" (the default) attends to the prompt's K/V as the model computed
them (torch SDPA) while the pages are written; "stored" attends to the pages just written;
"fresh_fp8" attends to the K/V as computed, quantized to E4M3 with block scales, P rounded to
E4M3 (the FP8 prefill kernels' numbers; on the CPU their reference). The
prompt's own logits are then the model's (fresh) or the quantized cache's (stored), and so are
the hidden states from which each later layer's K/V are computed and stored: the choice changes
what the decode steps read. Protocol (pareto.py's `decode_tail_ppl`): prefill `context` tokens of
the Lee corpus, then predict the next `tail` tokens one decode step at a time, teacher-forced;
perplexity of those tail tokens, against fp32 pages (lossless) of the same model. fp32 weights,
the reference kernels (the CPU path), each configuration compiled on a fresh copy.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pareto import corpora, decode_tail_ppl, load_model  # noqa: E402

import kvcompile  # noqa: E402

CONFIGS = {   # name -> KVConfig fields (the recommended 4-bit: README's storage formats table)
    "fp8_e4m3": dict(kv_dtype="fp8_e4m3"),
    "fp4_e2m1": dict(kv_dtype="fp4_e2m1"),
    "int4 channel K + hadamard, page 64": dict(kv_dtype="int4", scale_granularity="channel",
                                               page_size=64, rotate="hadamard"),
}


def run(base, ids, tail: int, fields: dict) -> float:
    torch._dynamo.reset()
    model = kvcompile.compile(copy.deepcopy(base), kvcompile.KVConfig(
        inner="eager", kernels="reference", max_kv_bytes=1 << 30, **fields))
    ppl = decode_tail_ppl(model, ids, tail)
    st = kvcompile.stats(model)
    fresh, fp8 = st.get("prefill_fresh_sdpa", 0), st.get("prefill_fresh_fp8", 0)
    mode = fields.get("prefill_attends", "fresh")
    if (mode != "stored") != (fresh > 0) or (mode == "fresh_fp8") != (fp8 > 0):
        raise RuntimeError(f"{fields}: the fresh path ran {fresh} times, in E4M3 {fp8}")
    return ppl


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--corpus", default="lee", help="pareto.corpora's text: lee or pydoc")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base, tok = load_model()
    ids = corpora(tok, a.context + a.tail)[a.corpus]
    t0 = time.time()
    ref = run(base, ids, a.tail, dict(kv_dtype="fp32"))
    rows = []
    for name, fields in CONFIGS.items():
        row = dict(config=name)
        for mode in ("fresh", "stored", "fresh_fp8"):
            row[mode] = run(base, ids, a.tail, dict(fields, prefill_attends=mode))
        rows.append(row)
        print(f"{name}: fresh {row['fresh']:.4f}, stored {row['stored']:.4f}, fresh_fp8 "
              f"{row['fresh_fp8']:.4f} (fp32 {ref:.4f})",
              file=sys.stderr, flush=True)
    print(f"SmolLM2-135M, {a.corpus} corpus: prefill {a.context} tokens, {a.tail} teacher-forced decode "
          f"steps; perplexity of the tail tokens (fp32 pages: {ref:.4f}); {time.time() - t0:.0f} s")
    print("| pages | prefill attends fresh | vs fp32 | stored | vs fp32 | fresh_fp8 | vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | " + " | ".join(
            f"{r[m]:.4f} | {100 * (r[m] / ref - 1):+.2f}%" for m in ("fresh", "stored",
                                                                   "fresh_fp8")) + " |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(fp32=ref, rows=rows, context=a.context, tail=a.tail), fh, indent=1)


if __name__ == "__main__":
    main()
