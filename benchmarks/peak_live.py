"""What is live at a compiled generate call's memory peak (CUDA), by the line that allocated it.

    python benchmarks/peak_live.py [--kv fp8_e4m3] [--top 16] [bench_generate.py's arguments]

The bench_generate model (8-layer Llama-3-8B shape, random bf16 weights) compiled by kvcompile
(KVCOMPILE_MERGE_PROJECTIONS as the environment says); after a call that compiles, a second
`generate` with torch's allocator history on. The trace's allocations and frees are replayed
to the peak; the blocks live there are listed by size with the frame that allocated each:
the first frame in inductor's generated code (its source line: `bufN = empty_strided_cuda(...)`
names the buffer), else the first in kvcompile or transformers. Two processes (merged or not)
side by side tell which buffers one of them keeps that the other does not.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_generate as bg  # noqa: E402

import kvcompile  # noqa: E402

_MARKS = ("torchinductor", "kvcompile", "transformers")


def _where(frames) -> str:
    """The allocating frame worth naming: inductor's output code first, then kvcompile's,
    then transformers'."""
    for mark in _MARKS:
        for f in frames:
            if mark in f["filename"]:
                src = linecache.getline(f["filename"], f["line"]).strip()
                name = os.path.basename(f["filename"])
                return f"{name}:{f['line']} {f['name']}: {src[:110]}"
    return "?"


def live_at_peak(snapshot) -> tuple[int, list]:
    """(peak bytes, [(size, frames)] live there) from an allocator snapshot's trace."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    cur = peak = 0
    at = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            cur += e["size"]
            if cur > peak:
                peak, at = cur, i
        elif e["action"] == "free_completed":
            cur -= e["size"]
    live = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return peak, sorted(live.values(), key=lambda x: -x[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="fp8_e4m3")
    ap.add_argument("--top", type=int, default=16)
    args, rest = ap.parse_known_args(argv)
    a = bg.parse_args(["--new", "2", "--kv-gib", "24", *rest])
    if not torch.cuda.is_available():
        raise SystemExit("peak_live.py needs CUDA (the allocator's history)")
    dev = torch.device("cuda")
    model = bg.make_model(a, dev, torch.bfloat16)
    ids, am = bg._inputs(a, dev, model.config.vocab_size)
    kvcompile.compile(model, bg._kvc_config(a, args.kv))
    kw = dict(attention_mask=am, max_new_tokens=a.new, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, **kw)                       # compiles, builds the pool
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, live = live_at_peak(snap)
    merged = kvcompile.stats(model).get("counters", {}).get("projections_merged", 0)
    print(f"# B{a.batch} x P{a.prompt}, {args.kv}, merge_projections "
          f"{os.environ.get('KVCOMPILE_MERGE_PROJECTIONS', 'auto')} ({merged} merged GEMMs); "
          f"allocated before the call {base / 2**30:.3f} GiB, max allocated in it "
          f"{torch.cuda.max_memory_allocated() / 2**30:.3f} GiB, the trace's peak above the "
          f"start {peak / 2**30:.3f} GiB")
    by = collections.Counter()
    for size, frames in live:
        by[_where(frames)] += size
    print("| MiB live at the peak | allocated at |\n|---|---|")
    for where, size in by.most_common(args.top):
        print(f"| {size / 2**20:.1f} | {where} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
