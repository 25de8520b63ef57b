"""Where a decode step's time goes: kvcompile vs HF StaticCache + inductor, on the
bench_generate model (8-layer Llama-3-8B shape, random bf16 weights).

    python benchmarks/profile_generate.py [--batch 16 --prompt 4096 --new 16]

For each path: wall time per generated token of a `generate` call, then one profiled
`generate` call, with the top host-side ops by self CPU time, the top device kernels, and the
count of host-device synchronizations (cudaStreamSynchronize, item / _local_scalar_dense,
blocking copies). A decode step that syncs cannot run ahead of the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_generate as bg  # noqa: E402
from step_profile import (  # noqa: E402
    DecodeProfiler,
    StepClock,
    decode_step_profile,
    profile_table,
)

import kvcompile  # noqa: E402

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense",
            "cudaMemcpy", "cudaEventSynchronize", "aten::item", "aten::nonzero")


def per_token(model, ids, am, new, **kw):
    """Seconds a decode step, the best of two `new`-token calls, each timed inside the call
    from its first token to its last (step_profile.StepClock: no prefill in it)."""
    best = float("inf")
    for _ in range(2):
        clock = StepClock()
        model.generate(ids, attention_mask=am, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, streamer=clock, **kw)
        best = min(best, clock.step_s(new))
    return best


def profile(model, ids, am, new, label, **kw):
    profile_call(lambda: model.generate(ids, attention_mask=am, max_new_tokens=new,
                                        min_new_tokens=new, do_sample=False, **kw), label, new)


def profile_call(fn, label: str, new: int) -> None:
    """One call of fn under torch.profiler: top host ops by self CPU time, top device kernels
    (on CUDA), and the host-sync events (each stalls the host until the device catches up)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    cuda = torch.cuda.is_available()
    with prof(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        fn()
        if cuda:
            torch.cuda.synchronize()
    ka = p.key_averages()
    print(f"\n#### {label}: top host ops by self CPU time ({new} new tokens)")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    if cuda:
        print(f"\n#### {label}: top device kernels")
        print(ka.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    syncs = {e.key: e.count for e in ka if any(s in e.key for s in SYNC_OPS)}
    print(f"#### {label}: sync-like events {syncs}", flush=True)


def decode_profile(model, ids, am, new, label, **kw):
    """One decode step's device time by part over steps 2..new of one `generate` call
    (step_profile.decode_step_profile: the profiler runs from the first token to the last, no
    prefill in it), against the same steps' wall time."""
    prof = decode_step_profile(
        lambda s: model.generate(ids, attention_mask=am, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, streamer=s, **kw),
        ids.device, new)
    print(f"\n#### {label}: one decode step (steps 2..{new} of one generate call, profiled)")
    print(profile_table({label: prof}))
    print(f"#### {label}: every kernel of a step (ms a step, launches a step, part, name)")
    for ms, n, part, name in prof["every"]:
        print(f"  {ms:8.3f} ms  {n:6.1f}  {part:10s}  {name[:100]}")


def python_breakdown(model, ids, am, label, new=9, **kw):
    """Per decode step: the Python functions (with_stack tracing) and ops of steps 2..new of
    one `generate` call (step_profile.DecodeProfiler: no prefill), divided by new - 1, and the
    steps' wall time under tracing. Tracing inflates Python time; compare rows."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    p = prof(activities=[ProfilerActivity.CPU], with_stack=True)
    clock = DecodeProfiler(new, p)
    model.generate(ids, attention_mask=am, max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, streamer=clock, **kw)
    steps = new - 1
    per = {e.key: (e.self_cpu_time_total / steps, e.cpu_time_total / steps, e.count / steps)
           for e in p.key_averages(group_by_stack_n=0)}
    wall = clock.step_s(new) * 1e6
    mine = [(k, v) for k, v in per.items() if "kvcompile/" in k or "transformers/" in k
            or "torch/_dynamo" in k or "torch/_inductor" in k or "triton/" in k]
    print(f"\n#### {label}: per decode step ({wall:.0f} us wall, traced), Python functions "
          f"by total CPU us")
    for k, v in sorted(mine, key=lambda kv: -kv[1][1])[:45]:
        print(f"{v[1]:9.0f} total {v[0]:8.0f} self {v[2]:6.1f}x  {k[-110:]}")
    print(f"#### {label}: per decode step, top entries by self CPU us")
    for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"{v[0]:9.0f} self {v[1]:9.0f} total {v[2]:6.1f}x  {k[-110:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--paths", default="static,fp8",
                    help="comma-separated: static, eager, or a kv_dtype (fp8 = fp8_e4m3), "
                         "optionally with +snapkv (SnapKV(hold) keeping half the prompt, "
                         "evicting every --evict-interval steps: the prompt-end and decode "
                         "evictions are in the profiled call)")
    ap.add_argument("--scale", default="page", choices=("page", "token", "tensor"),
                    help="fp8 scale granularity of the kvcompile paths")
    ap.add_argument("--evict-interval", type=int, default=8)
    ap.add_argument("--kv-gib", type=float, default=24.0,
                    help="the kvcompile paths' KV budget (bench_generate's --kv-gib; B16 x 32k "
                         "needs about 17 GiB of bf16 pages)")
    ap.add_argument("--stack", action="store_true", help="per-step Python function breakdown")
    ap.add_argument("--steps", action="store_true",
                    help="one decode step's device time by category (GEMM, attention, append, "
                         "...) against its wall time")
    args = ap.parse_args()
    a = bg.parse_args(["--batch", str(args.batch), "--prompt", str(args.prompt), "--new",
                       str(args.new), "--layers", str(args.layers), "--kvc-scale", args.scale,
                       "--kv-gib", str(args.kv_gib)])
    dev = torch.device("cuda")
    model = bg.make_model(a, dev, torch.bfloat16)
    ids, am = bg._inputs(a, dev, model.config.vocab_size)
    rows = []
    for path in args.paths.split(","):
        bg.uncompile(model)
        kw = {}
        if path == "static":
            model.forward = torch.compile(model.forward)
            kw = dict(cache_implementation="static")
        elif path == "eager":
            pass
        else:
            fmt, _, pol = path.partition("+")
            cfg = bg._kvc_config(a, {"fp8": "fp8_e4m3"}.get(fmt, fmt))
            if pol:
                if pol != "snapkv":
                    raise SystemExit(f"unknown policy +{pol}: +snapkv")
                cfg = dataclasses.replace(cfg, eviction=bg._half(a)["snapkv_hold"],
                                          eviction_interval=args.evict_interval)
            kvcompile.compile(model, cfg)
            torch._dynamo.config.assume_static_by_default = False
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=am, max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, **kw)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        s = per_token(model, ids, am, args.new, **kw)
        rows.append((path, warm, s * 1e3, args.batch / s))
        print(f"== {path}: warm-up {warm:.1f} s, {s * 1e3:.2f} ms per decode step, "
              f"{args.batch / s:.0f} decode tok/s", flush=True)
        if path != "eager":
            st = kvcompile.stats(model) if path not in ("static",) else {}
            if st:
                print({k: st.get(k) for k in ("graphs", "reference_fallback",
                                              "prefill_gathered_sdpa")})
            if args.stack:
                python_breakdown(model, ids, am, path, **kw)
            elif args.steps:
                decode_profile(model, ids, am, args.new, path, **kw)
            else:
                profile(model, ids, am, 8, path, **kw)
        torch._dynamo.config.assume_static_by_default = True
    print("\n| path | warm-up s | ms / decode step | decode tok/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]:.2f} | {r[3]:.0f} |")


if __name__ == "__main__":
    main()
