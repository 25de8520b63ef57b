"""Where the host time of a graphed `generate` decode step goes, and how much of it the GPU
waits for (issue 16 item 5).

    python benchmarks/host_gap.py [--kv fp8_e4m3] [--batch 16 --prompt 4096 --new 32]

The bench_generate model (8-layer Llama-3-8B shape, random bf16 weights) compiled by
kvcompile; after a warm-up call, one `generate` call with clocks at four points of every decode
step n (host `time.perf_counter`, no extra sync):
  a_n  the model's forward entered (kvcompile's GraphedForward)
  b_n  the step's CUDA graph launched (CUDAGraph.replay called)
  c_n  the forward returned
  d_n  the step's tokens reached the host (a streamer's put: HF copies them, a sync)
Per step (medians over the call's steps 2..N-1):
  pre    = a_{n+1} - d_n    HF between steps (kwargs update, prepare_inputs_for_generation)
  setup  = b_n - a_n        kvcompile before the launch (pool bookkeeping, buffer uploads)
  after  = c_n - b_n        kvcompile after the launch (logits, cache stubs)
  post   = d_n - c_n        HF after the forward (logits processors, argmax, stopping
                            criteria) and the wait for the GPU
  step   = d_{n+1} - d_n
With the per-step stop check (KVConfig.deferred_stop=False) the GPU is idle from d_n (it
finished step n; HF synced) until step n+1's graph starts, so pre + setup is on the critical
path of every step; `after` and HF's post-processing overlap the graph's GPU time. A
cudaDeviceSynchronize right after each launch in a second call gives the graph's own GPU time
(gpu), and step - gpu what the host adds. A third call runs with the deferred check (the
default: the host queues step n + 1 while the GPU runs step n, tokens reach the host a step
late): only its step time is shown.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_generate as bg  # noqa: E402
from step_profile import StepClock  # noqa: E402

import kvcompile  # noqa: E402
from kvcompile.api import state_of  # noqa: E402


class Probe(StepClock):
    """The streamer's clock (t: d_n above) and the forward's and the launch's (a, b, c;
    g: the graph's GPU time where each launch is followed by a sync)."""

    def reset(self, sync_after_launch: bool) -> None:
        self.t, self.a, self.b, self.c, self.g = [], [], [], [], []
        self.sync_after_launch = sync_after_launch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other arguments are bench_generate.py's (--batch, --prompt, --new, --layers, "
               "--kv-gib; here --new 32 and --kv-gib 24 unless given).")
    ap.add_argument("--kv", default="fp8_e4m3", help="kv_dtype (int4: the 4-bit format)")
    args, rest = ap.parse_known_args(argv)
    a = bg.parse_args(["--new", "32", "--kv-gib", "24", *rest])   # (the last value wins)
    dev = torch.device("cuda")
    model = bg.make_model(a, dev, torch.bfloat16)
    ids, am = bg._inputs(a, dev, model.config.vocab_size)
    kvcompile.compile(model, dataclasses.replace(bg._kvc_config(a, args.kv),
                                                 deferred_stop=False))
    st = state_of(model)
    torch._dynamo.config.assume_static_by_default = False
    kw = dict(attention_mask=am, max_new_tokens=a.new, min_new_tokens=a.new,
              do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids, **kw)   # compiles and captures
    probe = Probe()
    fwd = model.forward

    @functools.wraps(fwd)   # HF reads its signature (logits_to_keep: else every prompt
    def forward(*x, **k):    # token's logits, 62 GiB at B16 x 32k)
        probe.a.append(time.perf_counter())
        out = fwd(*x, **k)
        probe.c.append(time.perf_counter())
        return out

    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph):
        probe.b.append(time.perf_counter())
        replay(graph)
        if probe.sync_after_launch:
            torch.cuda.synchronize()
            probe.g.append(time.perf_counter() - probe.b[-1])

    model.forward = forward
    torch.cuda.CUDAGraph.replay = timed_replay
    try:
        rows = {}
        for sync, defer in ((False, False), (True, False), (False, True)):
            probe.reset(sync)
            st.config = dataclasses.replace(st.config, deferred_stop=defer)
            torch.cuda.synchronize()
            model.generate(ids, streamer=probe, **kw)
            if defer:   # tokens reach the host a step late: only the step time
                rows["deferred stop check"] = dict(
                    step=1e6 * statistics.median(
                        [y - x for x, y in zip(probe.t[2:-1], probe.t[3:])]))
                continue
            # forward 0 is the prefill (no replay); decode forward i (1..N-1) replays graph
            # i - 1 and its tokens are put d[i + 1] (d[0]: the prompt, d[1]: the prefill's)
            n = len(probe.b)
            assert len(probe.a) == n + 1 == len(probe.c) and len(probe.t) == n + 2, \
                (len(probe.a), n, len(probe.c), len(probe.t))
            A, C, D = probe.a[1:], probe.c[1:], probe.t[2:]
            B = probe.b
            us = lambda xs: 1e6 * statistics.median(xs[1:-1])   # noqa: E731
            r = dict(
                pre=us([A[i] - D[i - 1] for i in range(1, n)]),
                setup=us([B[i] - A[i] for i in range(n)]),
                after=us([C[i] - B[i] for i in range(n)]),
                post=us([D[i] - C[i] for i in range(n)]),
                step=us([D[i] - D[i - 1] for i in range(1, n)]))
            if sync:
                r["gpu"] = 1e6 * statistics.median(probe.g[1:-1])
            rows["launch + sync" if sync else "per-step stop check"] = r
    finally:
        torch.cuda.CUDAGraph.replay = replay
        model.forward = fwd
    print(f"\n{args.kv}, B{a.batch} P{a.prompt}, {a.layers} layers, "
          f"{torch.cuda.get_device_name()}: host time per decode step, us (medians)")
    print("| call | pre (HF) | setup (kvc) | after (kvc) | post (HF + wait) | step | gpu |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        cells = [f"{r[k]:.0f}" if k in r else "-"
                 for k in ("pre", "setup", "after", "post", "step", "gpu")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
