"""`kvcompile bench [NAME] [ARGS]`: the speed benchmarks, benchmarks/bench_NAME.py.

They time Triton kernels against baselines on a GPU, so without CUDA the command stops with
exit code 5 (EXIT_UNAVAILABLE) and says so; `--dry` runs a benchmark's CPU dry run instead
(KVC_BENCH_DRY=1: tiny shapes under the Triton interpreter, timings meaningless), and `--list`
works anywhere. Each benchmark runs in its own Python process (they set up CUDA / Triton state
at import); its exit code becomes ours.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import torch

from kvcompile.cli.benchmarks import benchmarks_dir, split_own_flags
from kvcompile.cli.common import EXIT_UNAVAILABLE, EXIT_USAGE, CLIError, Result


def available(folder: str) -> dict[str, str]:
    return {os.path.basename(p)[len("bench_"):-3]: p
            for p in sorted(glob.glob(os.path.join(folder, "bench_*.py")))}


def run(args) -> Result:
    rest = split_own_flags(args, list(args.args or []))
    folder = benchmarks_dir()
    benches = available(folder)
    if args.list or not args.name:
        text = "benchmarks (kvcompile bench NAME [ARGS]; they need CUDA):\n" + "\n".join(
            f"  {name:16s} {_first_doc_line(path)}" for name, path in benches.items())
        return Result({"benchmarks": {n: p for n, p in benches.items()}}, text, 0)
    if args.name not in benches:
        raise CLIError(f"unknown benchmark {args.name!r}",
                       hint="benchmarks: " + (", ".join(benches) or "none found"),
                       code=EXIT_USAGE)
    dry = getattr(args, "dry", False)
    if not dry and not torch.cuda.is_available():
        raise CLIError("speed benchmarks need CUDA, and this machine has no GPU",
                       hint=f"run it on a GPU machine, or `kvcompile bench {args.name} --dry` "
                            f"for a CPU dry run (timings meaningless)",
                       code=EXIT_UNAVAILABLE)
    env = dict(os.environ)
    if dry:
        env["KVC_BENCH_DRY"] = "1"
        env.setdefault("TRITON_INTERPRET", "1")
    cmd = [sys.executable, benches[args.name], *rest]
    out = 2 if getattr(args, "json", False) else None  # fd 2: keep stdout for the JSON
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, env=env, cwd=os.path.dirname(folder), stdout=out)
    payload = {"benchmark": args.name, "command": cmd, "dry_run": dry, "exit_code": rc,
               "seconds": time.perf_counter() - t0,
               "results": sorted(p for p in glob.glob(os.path.join(folder, "results", "*.json"))
                                 if os.path.getmtime(p) >= t0 - 1)}
    return Result(payload, "", rc)


def _first_doc_line(path: str) -> str:
    try:
        with open(path) as f:
            for line in f:
                line = line.strip().strip('"').strip()
                if line and not line.startswith(("#", "from", "import")):
                    return line[:80]
    except OSError:
        pass
    return ""
