"""Where an Engine decode step goes, synchronous vs overlapped steps (issue 16 item 5).

    python benchmarks/profile_engine.py [--batch 16 --prompt 4096 --new 64 --modes sync,async]
    python benchmarks/profile_engine.py --smoke    # CPU: a tiny model through every line
    python benchmarks/profile_engine.py --prefill [--smoke] [--gaps]   # the first token
                                   # instead: the Engine's packed prefill against generate's,
                                   # by part (--gaps: the device's idle gaps, trace_gaps.py)

bench_generate's model (8-layer Llama-3-8B shape, random bf16 weights) through
`kvcompile.Engine` with fp8 pages, CUDA-graph decode steps, as bench_generate's engine_b. Per
mode (`async_steps` False / True): the step time without the profiler ((t_new - t_1) / (new -
1): two `generate` calls, the prefill cancels), then the same difference under torch.profiler:

- device busy per step by category (GEMM, attention, KV append, sampling, memcpy, inductor's
  fused pointwise / norm kernels, other), summed kernel times;
- device idle per step: profiled step wall - device busy (the gaps between replays);
- host: time the host spent blocked on the device (cudaEventSynchronize, cudaStreamSynchronize,
  blocking copies' sync) and the rest (host active: scheduling, input preparation, sampling
  launches, stop checks), per step. In the synchronous loop the host work adds to the step;
  overlapped, it runs while the device runs the step before.

Prints a markdown table per mode and the roofline share of each mode's unprofiled step
(bench_generate.add_roofline: weights + stored KV bytes over --peak-tbs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_generate as bg  # noqa: E402
from step_profile import part_of  # noqa: E402

import kvcompile  # noqa: E402
from kvcompile import Engine, KVConfig, SamplingParams  # noqa: E402

WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def make_engine(model, a, B, async_steps: bool) -> Engine:
    cfg = bg._kvc_config(a, "fp8_e4m3")
    c = model.config
    per_token = c.num_hidden_layers * c.num_key_value_heads * (
        c.hidden_size // c.num_attention_heads) * 2 * 1.05
    need = int(1.25 * B * (a.prompt + a.new + 64) * per_token)
    cfg = KVConfig(**{**cfg.__dict__, "max_kv_bytes": max(cfg.max_kv_bytes, need)})
    return Engine(model, None, cfg, max_num_batched_tokens=min(B * a.prompt, 131072),
                  max_num_seqs=B, enable_prefix_caching=False, async_steps=async_steps)


def run(eng, prompts, n):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    bg.sync(eng.runner.device)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp)
    bg.sync(eng.runner.device)
    return time.perf_counter() - t0, outs


def profiled(call, device, trace: str | None = None, stack: bool = False):
    """`call()` under torch.profiler -> (wall s, {kernel: device us}, host us blocked on the
    device, graph launches, us from the first profiled event to the first kernel or None).
    trace: a path to export the chrome trace to; stack: with the Python tracer (functions in
    the trace, more host time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with prof(activities=acts, with_stack=stack) as p:
        bg.sync(device)
        t0 = time.perf_counter()
        call()
        bg.sync(device)
        wall = time.perf_counter() - t0
    if trace:
        p.export_chrome_trace(trace)
    kernels, waits, launches, first = {}, 0.0, 0, None
    start = min((e.time_range.start for e in p.events()), default=0)
    for e in p.events():
        if e.device_type == DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total
            t = e.time_range.start - start
            first = t if first is None else min(first, t)
        elif any(w in e.name for w in WAITS):
            waits += e.cpu_time_total
        elif e.name == "cudaGraphLaunch":
            launches += 1
    return wall, kernels, waits, launches, first


def _categories(kernels: dict) -> dict:
    """{kernel: time} -> {part (step_profile.part_of): summed time}, in the same unit."""
    cats: dict[str, float] = {}
    for name, t in kernels.items():
        cats[part_of(name)] = cats.get(part_of(name), 0.0) + t
    return cats


def step_table(eng, prompts, new, label):
    dev = eng.runner.device
    w1, k1, s1, g1, _ = profiled(lambda: run(eng, prompts, 1), dev)
    wn, kn, sn, gn, _ = profiled(lambda: run(eng, prompts, new), dev)
    steps = new - 1
    wall = (wn - w1) / steps * 1e3
    diff = {k: (v - k1.get(k, 0.0)) / steps / 1e3 for k, v in kn.items()}   # ms per step
    cats = _categories(diff)
    busy = sum(cats.values())
    waits = (sn - s1) / steps / 1e3
    print(f"\n#### {label}: one decode step (generate of {new} minus 1 token, profiled; "
          f"{(gn - g1) / steps:.2f} graph launches a step)")
    print("| part | ms / step | % of step |\n|---|---|---|")
    for c, ms in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"| device: {c} | {ms:.3f} | {100 * ms / wall:.0f}% |")
    print(f"| **device busy** (sum of kernels) | {busy:.3f} | {100 * busy / wall:.0f}% |")
    print(f"| **device idle** (wall - busy) | {wall - busy:.3f} | "
          f"{100 * (wall - busy) / wall:.0f}% |")
    print(f"| host blocked on the device (event / stream syncs) | {waits:.3f} | "
          f"{100 * waits / wall:.0f}% |")
    print(f"| host active (wall - blocked) | {wall - waits:.3f} | "
          f"{100 * (wall - waits) / wall:.0f}% |")
    print(f"| step wall (profiled) | {wall:.3f} | 100% |")
    print(f"#### {label}: top kernels per step")
    for name, ms in sorted(diff.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {ms:8.3f} ms  {name[:100]}")
    return dict(wall_ms=wall, busy_ms=busy, idle_ms=wall - busy, blocked_ms=waits, **cats)


def _gaps(call, device, label: str) -> None:
    """--gaps: the device's idle gaps in one profiled `call()` and the host work in them
    (trace_gaps.py), once without the Python tracer (the gaps as they are) and once with it
    (which functions; its own cost widens the gaps)."""
    import json
    import tempfile

    from trace_gaps import gap_report
    for stack in (False, True):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            profiled(call, device, trace=f.name, stack=stack)
            with open(f.name) as g:
                trace = json.load(g)
        print(f"\n#### {label}: device gaps, {'with' if stack else 'without'} Python stacks")
        gap_report(trace, min_us=20.0, top=30 if stack else 15)


def prefill_tables(model, a, ids, prompts, gaps: bool = False) -> None:
    """--prefill: the time to the first token, the Engine's prefill (all B prompts packed in
    one step) against HF `generate`'s through kvcompile (a padded [B, prompt] forward), the
    same model, fp8 pages, each a 1-token call after a warm-up, under torch.profiler: device
    time by part, host time blocked, and the host's time before the first kernel."""
    def one(label, call):
        call()
        call()   # warm-up: compile, autotune
        walls = []
        for _ in range(2):
            bg.sync(ids.device)
            t0 = time.perf_counter()
            call()
            bg.sync(ids.device)
            walls.append(time.perf_counter() - t0)
        pwall, kernels, waits, _, first = profiled(call, ids.device)
        cats = {c: us / 1e3 for c, us in _categories(kernels).items()}   # ms
        busy = sum(cats.values())
        print(f"\n#### {label}: first token {1e3 * min(walls):.1f} ms (unprofiled, best of 2); "
              f"profiled {1e3 * pwall:.1f} ms, first kernel at "
              f"{(first or 0) / 1e3:.1f} ms of it")
        print("| part | ms | % of profiled wall |\n|---|---|---|")
        for c, ms in sorted(cats.items(), key=lambda kv: -kv[1]):
            print(f"| device: {c} | {ms:.2f} | {100 * ms / (1e3 * pwall):.0f}% |")
        print(f"| **device busy** | {busy:.2f} | {100 * busy / (1e3 * pwall):.0f}% |")
        print(f"| host blocked on the device | {waits / 1e3:.2f} | |")
        print(f"#### {label}: top kernels")
        for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {us / 1e3:8.2f} ms  {name[:100]}")
        if gaps:
            _gaps(call, ids.device, label)

    bg.uncompile(model)
    eng = make_engine(model, a, a.batch, async_steps=True)
    one(f"Engine prefill, {a.batch} x {a.prompt} packed",
        lambda: run(eng, prompts, 1))
    eng.close()
    bg.uncompile(model)
    kvcompile.compile(model, bg._kvc_config(a, "fp8_e4m3"))
    am = torch.ones_like(ids)
    one(f"generate prefill through kvcompile, [{a.batch}, {a.prompt}]",
        lambda: model.generate(input_ids=ids, attention_mask=am, max_new_tokens=1,
                               do_sample=False, pad_token_id=0))
    bg.uncompile(model)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--no-profile", action="store_true", help="step times only")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--prefill", action="store_true",
                    help="the first token instead: the Engine's prefill against generate's")
    ap.add_argument("--gaps", action="store_true",
                    help="with --prefill: the device's idle gaps and the host work in them")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.prompt, args.new, args.layers = 3, 40, 8, 2
        torch.set_num_threads(1)
    a = bg.parse_args(["--batch", str(args.batch), "--prompt", str(args.prompt), "--new",
                       str(args.new), "--layers", str(args.layers)]
                      + (["--smoke"] if args.smoke else []))
    dev = torch.device("cpu" if args.smoke else "cuda")
    model = bg.make_model(a, dev, torch.float32 if args.smoke else torch.bfloat16)
    ids, _ = bg._inputs(a, dev, model.config.vocab_size)
    prompts = [row.tolist() for row in ids.cpu()]
    if args.prefill:
        prefill_tables(model, a, ids, prompts, args.gaps)
        return
    rows, tokens = [], {}
    for mode in args.modes.split(","):
        bg.uncompile(model)
        t0 = time.perf_counter()
        eng = make_engine(model, a, args.batch, async_steps=(mode == "async"))
        run(eng, prompts, 3)
        warm = time.perf_counter() - t0
        t1 = min(run(eng, prompts, 1)[0] for _ in range(2))
        tn, outs = [], None
        for _ in range(3):
            t, outs = run(eng, prompts, args.new)
            tn.append(t)
        step_ms = (statistics.median(tn) - t1) / (args.new - 1) * 1e3
        tokens[mode] = [o.token_ids for o in outs]
        row = dict(decode_tok_s=args.batch / step_ms * 1e3, pct_roofline=float("nan"),
                   roofline_ms=float("nan"))
        if kvcompile.stats(model).get("bytes_per_token"):
            bg.add_roofline(row, model, a, kvcompile.stats(model)["bytes_per_token"])
        host = [s.duration_s * 1e3 for s in eng.history
                if not s.prefill_tokens and s.decode_tokens == args.batch]
        print(f"== {mode}: warm-up {warm:.1f} s, {step_ms:.3f} ms a decode step "
              f"({row['pct_roofline']:.0f}% of the {row['roofline_ms']:.3f} ms roofline), "
              f"step() call p50 {statistics.median(host) if host else float('nan'):.3f} ms; "
              f"launched "
              f"{eng.stats.launched_steps}, overlapped {eng.stats.overlapped_steps}, sync "
              f"reasons {eng.stats.sync_reasons}", flush=True)
        prof = {} if args.no_profile else step_table(eng, prompts, min(args.new, 32), mode)
        rows.append((mode, step_ms, row["pct_roofline"], prof))
        eng.close()
    print("\n| mode | ms / decode step | % roofline | device busy | device idle | host blocked |"
          "\n|---|---|---|---|---|---|")
    for mode, ms, pct, pr in rows:
        cells = [f"{pr[k]:.3f}" if k in pr else "-" for k in ("busy_ms", "idle_ms", "blocked_ms")]
        print(f"| {mode} | {ms:.3f} | {pct:.0f}% | " + " | ".join(cells) + " |")
    if len(tokens) == 2:
        a_, b_ = tokens.values()
        print(f"same tokens sync vs async: {a_ == b_}")


if __name__ == "__main__":
    main()
