"""Deterministic cost of one CPU decode step: tensor ops and Python calls, kvcompile vs HF.

    python benchmarks/cpu_decode_counts.py                 # hf, bf16 and fp8_e4m3 pages
    python benchmarks/cpu_decode_counts.py --kv fp8_e4m3 fp4_e2m1

Wall and CPU times on the shared 2-core machine move by 20-50% with the other processes;
these counts do not. Per decode step = (count of generate(1 + n) - count of generate(1)) / n,
SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads, head_dim 64) with random weights (no
model file needed), a 256-token prompt, greedy, 1 thread, inner eager:

    aten ops      events of torch.profiler (an op and the ops it calls, as the profiler counts)
    Python calls  function calls seen by cProfile (Python and built-in functions)
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import kvcompile  # noqa: E402


def smollm2_shaped():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def counts(model, ids, n: int) -> tuple[int, int]:
    """(profiler op events, cProfile calls) of one generate(n)."""
    from torch.profiler import ProfilerActivity, profile

    def gen():
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)

    with profile(activities=[ProfilerActivity.CPU]) as p:
        gen()
    ops = sum(e.count for e in p.key_averages())
    pr = cProfile.Profile()
    pr.enable()
    gen()
    pr.disable()
    return ops, pstats.Stats(pr).total_calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8_e4m3"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = smollm2_shaped()
    ids = torch.randint(3, 49000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    print("| path | aten ops per decode step | Python calls per decode step |\n|---|---|---|")
    for kv in ["hf"] + args.kv:
        m = model
        if kv != "hf":
            m = copy.deepcopy(model)
            kvcompile.compile(m, kvcompile.KVConfig(kv_dtype=kv, inner="eager",
                                                    max_kv_bytes=1 << 28))
        for _ in range(2):   # compile: prefill, first decode step, dynamic-length decode
            counts(m, ids, 3)
        o1, c1 = counts(m, ids, 1)
        on, cn = counts(m, ids, 1 + args.steps)
        print(f"| {kv} | {(on - o1) / args.steps:.0f} | {(cn - c1) / args.steps:.0f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
