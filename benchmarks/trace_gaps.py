"""Where the device waits on the host: the idle gaps of a torch.profiler trace and what the
host was doing in them.

    python benchmarks/trace_gaps.py TRACE.json [--min-us 20 --top 25]

TRACE.json: `prof.export_chrome_trace(...)` of a run profiled with CPU and CUDA activities
(`with_stack=True` adds the Python functions). The device's busy time is the union of its
kernels, copies and sets; a gap is a stretch between them of at least --min-us (and the stretch
from the first host event to the first device event). Prints the gaps' total and count, the
largest gaps with the kernel that ends each (and, with stacks, the innermost Python frames
the host was in at each one's middle), and, summed over the gaps, how long each host
event overlapped them (inclusive: a function and its callees each count): Python functions,
aten ops and CUDA runtime calls. `gap_report` is what profile_engine.py --gaps calls.
"""

from __future__ import annotations

import argparse
import bisect
import json

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
HOST = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def _events(trace: dict) -> tuple[list, list]:
    dev, host = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        if cat in DEVICE:
            dev.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "")))
        elif cat in HOST:
            host.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), cat,
                         e.get("name", "")))
    return sorted(dev), sorted(host)


def gaps(dev: list, host: list, min_us: float) -> list[tuple[float, float, str]]:
    """[(start, end, name of the device event that ends the gap)], in trace time (us)."""
    out = []
    t = min((h[0] for h in host), default=dev[0][0] if dev else 0.0)
    for s, e, name in dev:
        if s - t >= min_us:
            out.append((t, s, name))
        t = max(t, e)
    return out


STACK_FRAMES = 5   # innermost Python frames shown under each of the largest gaps


def _stack_at(host: list, t: float) -> list[str]:
    """Names of the Python functions running at time t, outermost first (those of the
    profiler's own machinery and of other threads' bootstraps left out)."""
    live = [(h0, name) for h0, h1, cat, name in host
            if cat == "python_function" and h0 <= t <= h1
            and not name.startswith(("threading.py", "torch/profiler", "<built-in"))]
    return [name for _, name in sorted(live)]


def gap_report(trace: dict, min_us: float = 20.0, top: int = 25, out=print) -> float:
    """Prints the report; -> the gaps' total in ms."""
    dev, host = _events(trace)
    if not dev:
        out("no device events in the trace")
        return 0.0
    gs = gaps(dev, host, min_us)
    total = sum(e - s for s, e, _ in gs)
    span = dev[-1][1] - min(h[0] for h in host) if host else dev[-1][1] - dev[0][0]
    out(f"device idle in gaps of >= {min_us:.0f} us: {total / 1e3:.2f} ms in {len(gs)} gaps "
        f"of a {span / 1e3:.1f} ms span")
    out("largest gaps (us, then the device event after it; with Python stacks, the innermost "
        "frames the host was in at the gap's middle):")
    for s, e, name in sorted(gs, key=lambda g: g[0] - g[1])[:min(top, 12)]:
        out(f"  {e - s:9.1f}  at {(s - gs[0][0]) / 1e3:8.2f} ms  -> {name[:80]}")
        for frame in _stack_at(host, (s + e) / 2)[-STACK_FRAMES:]:
            out(f"      in {frame[:100]}")
    sums: dict[tuple[str, str], float] = {}
    ends = [e for _, e, _ in gs]
    for h0, h1, cat, name in host:   # the gaps each host event overlaps (gaps are disjoint)
        i = bisect.bisect_right(ends, h0)
        ov = 0.0
        while i < len(gs) and gs[i][0] < h1:
            ov += min(h1, gs[i][1]) - max(h0, gs[i][0])
            i += 1
        if ov > 0:
            sums[(cat, name)] = sums.get((cat, name), 0.0) + ov
    for cat in ("python_function", "cpu_op", "cuda_runtime"):
        rows = sorted(((v, n) for (c, n), v in sums.items() if c == cat), reverse=True)
        if not rows:
            continue
        out(f"host {cat} overlapping the gaps (inclusive ms, top {top}):")
        for v, n in rows[:top]:
            out(f"  {v / 1e3:8.2f}  {n[:110]}")
    return total / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.trace) as f:
        gap_report(json.load(f), a.min_us, a.top)


if __name__ == "__main__":
    main()
