"""A `generate` call's decode steps, timed and profiled from inside the call: the clock
(bench_generate.py's rows, profile_generate.py, host_gap.py) and the step by part
(bench_generate.py --step-profile, profile_generate.py --steps).

Both are streamers: HF calls put() once with the prompt, then once a new token, with the
step's tokens already copied to the host (HF waits for that copy). Under a deferred stop
check (KVConfig.deferred_stop) a token reaches the host one step late; t[1] is still the
first token's time (its copy is what the host waited for) and t[N] the last's.
"""

from __future__ import annotations

import time

import torch

# (part, substrings of a kernel's or an op's name), first match wins
CATEGORIES = (
    ("GEMM", ("nvjet", "gemm", "cutlass", "sm90_xmma", "cublas", "mm_", "aten::mm",
              "aten::addmm", "aten::bmm")),
    ("attention", ("decode", "attention", "attn", "flash", "fmha", "sdpa", "cudnn",
                   "combine_splits", "_merge")),
    ("KV append", ("append", "quant", "encode", "scatter")),
    ("sampling / logits", ("argmax", "topk", "sort", "softmax", "multinomial", "max_")),
    ("memcpy / memset", ("memcpy", "memset", "copy")),
    ("fused pointwise / norm (inductor)", ("triton_",)),
)


def part_of(name: str) -> str:
    low = name.lower()
    return next((c for c, subs in CATEGORIES if any(x in low for x in subs)), "other")


class StepClock:
    """A streamer that only reads the clock (no sync of its own, which would stop the host
    from queueing a step ahead): t[0] the prompt, t[k] the k-th new token. The decode steps
    are timed apart from the prefill, whose run-to-run spread (20 ms at B16 x 32k) moved an
    estimate from two calls by 6%."""

    def __init__(self):
        self.t = []

    def put(self, value):
        self.t.append(time.perf_counter())

    def end(self):
        pass

    def step_s(self, new: int) -> float:
        """Seconds a decode step, over tokens 2..new."""
        return (self.t[new] - self.t[1]) / (new - 1)


class DecodeProfiler(StepClock):
    """A StepClock that runs `profiler` over the decode steps only: started when the first
    token reaches the host (after the prefill), stopped when the last one does."""

    def __init__(self, new: int, profiler):
        super().__init__()
        self.new, self.p = new, profiler

    def put(self, value):
        super().put(value)
        if len(self.t) == 2:
            self.p.start()
        elif len(self.t) == self.new + 1:
            self.p.stop()


def decode_step_profile(run, device, new: int, top: int = 12) -> dict:
    """One decode step by part, over steps 2..new of one `generate` call: run(streamer) makes
    the call (`new` tokens). On CUDA the device time of each kernel; elsewhere each op's self
    CPU time (the host is the device there). -> {"wall_ms", "busy_ms", "parts": {part: ms},
    "top": [(ms, name)], "kernels": kernels and copies, "every": [(ms, launches, part, name)]
    of every kernel}, per step (kernels 0 and "every" empty off CUDA)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    p = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    clock = DecodeProfiler(new, p)
    run(clock)
    if len(clock.t) != new + 1:
        raise RuntimeError(f"step profile: {len(clock.t)} puts, expected {new + 1}")
    steps = new - 1
    per: dict[str, float] = {}
    count: dict[str, int] = {}
    launches = 0
    if cuda:
        for e in p.events():
            if e.device_type == DeviceType.CUDA:
                per[e.name] = per.get(e.name, 0.0) + e.device_time_total
                count[e.name] = count.get(e.name, 0) + 1
                launches += 1
    else:
        for e in p.key_averages():
            if "::" in e.key:   # aten:: and custom ops, their own time only
                per[e.key] = per.get(e.key, 0.0) + e.self_cpu_time_total
    ms = {k: v / steps / 1e3 for k, v in per.items()}
    parts: dict[str, float] = {}
    for name, t in ms.items():
        parts[part_of(name)] = parts.get(part_of(name), 0.0) + t
    return dict(wall_ms=clock.step_s(new) * 1e3, busy_ms=sum(parts.values()), parts=parts,
                kernels=launches / steps,
                top=sorted(((t, n) for n, t in ms.items()), reverse=True)[:top],
                # every kernel (CUDA): (ms a step, launches a step, part, name), longest first
                every=sorted(((t, count.get(n, 0) / steps, part_of(n), n)
                              for n, t in ms.items()), reverse=True) if cuda else [])


def profile_table(rows: dict) -> str:
    """{label: decode_step_profile(...)} -> a markdown table, a column per label: ms per step
    by part, the busy sum, the wall time less it, the wall time."""
    labels = list(rows)
    parts = sorted({p for r in rows.values() for p in r["parts"]},
                   key=lambda p: -max(r["parts"].get(p, 0.0) for r in rows.values()))
    out = ["| ms per decode step | " + " | ".join(labels) + " |",
           "|---|" + "---|" * len(labels)]
    for p in parts:
        out.append(f"| {p} | " + " | ".join(f"{rows[k]['parts'].get(p, 0.0):.3f}"
                                            for k in labels) + " |")
    for name, f in (("busy (sum of the parts)", lambda r: r["busy_ms"]),
                    ("wall - busy (host, gaps)", lambda r: r["wall_ms"] - r["busy_ms"]),
                    ("step wall (profiled)", lambda r: r["wall_ms"]),
                    ("kernels and copies a step", lambda r: r.get("kernels", 0.0))):
        out.append(f"| {name} | " + " | ".join(f"{f(rows[k]):.3f}" for k in labels) + " |")
    return "\n".join(out)
