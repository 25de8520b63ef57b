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
import re
import subprocess
import sys
import time

import torch

from kvcompile.cli.benchmarks import benchmarks_dir, split_own_flags
from kvcompile.cli.common import EXIT_UNAVAILABLE, EXIT_USAGE, CLIError, Result


def available(folder: str) -> dict[str, str]:
    return {os.path.basename(p)[len("bench_"):-3]: p
            for p in sorted(glob.glob(os.path.join(folder, "bench_*.py")))}


# The CPU dry run of each benchmark: the arguments it gets when none are given (the hint shows
# `kvcompile bench NAME --dry`, which must run as written) and the flag that switches its dry
# mode on where the script has its own (every one also gets KVC_BENCH_DRY=1).
DRY_RUNS = {
    "decode": {"default": ["run", "--out", "{results}/dry"], "flag": None},
    "append": {"default": [], "flag": "--dry"},
    "generate": {"default": [], "flag": "--smoke"},
}


def run(args) -> Result:
    rest = split_own_flags(args, list(args.args or []))
    folder = benchmarks_dir()
    benches = available(folder)
    if args.list or not args.name:
        text = "benchmarks (kvcompile bench NAME [ARGS]; they need CUDA; --dry: a CPU dry " \
               "run where the benchmark has one):\n" + "\n".join(
                   f"  {name:10s} {'(--dry)' if name in DRY_RUNS else '       '} "
                   f"{summary(path)}" for name, path in benches.items())
        return Result({"benchmarks": {n: p for n, p in benches.items()},
                       "dry_run": sorted(n for n in benches if n in DRY_RUNS)}, text, 0)
    if args.name not in benches:
        raise CLIError(f"unknown benchmark {args.name!r}",
                       hint="benchmarks: " + (", ".join(benches) or "none found"),
                       code=EXIT_USAGE)
    dry = getattr(args, "dry", False)
    spec = DRY_RUNS.get(args.name)
    if not dry and not torch.cuda.is_available():
        hint = "run it on a GPU machine"
        if spec is not None:
            hint += (f", or `kvcompile bench {args.name} --dry` for a CPU dry run (timings "
                     f"meaningless)")
        raise CLIError("speed benchmarks need CUDA, and this machine has no GPU", hint=hint,
                       code=EXIT_UNAVAILABLE)
    env = dict(os.environ)
    if dry:
        if spec is None and not _reads_dry_env(benches[args.name]):
            raise CLIError(f"benchmark {args.name!r} has no CPU dry run (it times CUDA "
                           f"kernels only)",
                           hint="dry runs: " + ", ".join(n for n in benches if n in DRY_RUNS),
                           code=EXIT_USAGE)
        env["KVC_BENCH_DRY"] = "1"
        env.setdefault("TRITON_INTERPRET", "1")
        if spec is not None:
            if not rest:
                rest = [a.format(results=os.path.join(folder, "results"))
                        for a in spec["default"]]
            if spec["flag"] and spec["flag"] not in rest:
                rest.append(spec["flag"])
    out_dir = _make_out_dir(rest)
    cmd = [sys.executable, benches[args.name], *rest]
    out = 2 if getattr(args, "json", False) else None  # fd 2: keep stdout for the JSON
    t0, wall0 = time.perf_counter(), time.time()
    rc = subprocess.call(cmd, env=env, cwd=os.path.dirname(folder), stdout=out)
    # the JSON files it wrote (benchmarks/results/ and --out), by modification time
    where = {os.path.join(folder, "results")} | ({out_dir} if out_dir else set())
    written = {p for d in where for p in glob.glob(os.path.join(d, "*.json"))
               if os.path.getmtime(p) >= wall0 - 1}
    payload = {"benchmark": args.name, "command": cmd, "dry_run": dry, "exit_code": rc,
               "seconds": time.perf_counter() - t0, "results": sorted(written)}
    return Result(payload, "", rc)


def _make_out_dir(rest: list[str]) -> str | None:
    """`--out DIR` (or --out=DIR): create DIR now, not find out it is missing when the
    benchmark writes its results at the end. DIR is made absolute in `rest` (the benchmark
    runs from the checkout's root, a relative DIR means the caller's folder). Returns it."""
    found = None
    for i, a in enumerate(rest):
        if a == "--out" and i + 1 < len(rest):
            j, path, prefix = i + 1, rest[i + 1], ""
        elif a.startswith("--out="):
            j, path, prefix = i, a.split("=", 1)[1], "--out="
        else:
            continue
        found = os.path.abspath(path)
        try:
            os.makedirs(found, exist_ok=True)
        except OSError as e:
            raise CLIError(f"--out {path}: cannot create the folder ({e.strerror})",
                           hint="give a folder you can write to", code=EXIT_USAGE) from e
        rest[j] = prefix + found
    return found


def _reads_dry_env(path: str) -> bool:
    try:
        with open(path) as f:
            return "KVC_BENCH_DRY" in f.read()
    except OSError:
        return False


def summary(path: str) -> str:
    """The first sentence of a benchmark's docstring, on one line (at most 90 characters)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    m = re.match(r'\s*(?:"""|\'\'\')(.*?)(?:\n\s*\n|"""|\'\'\')', text, re.S)
    if not m:
        return ""
    line = " ".join(m.group(1).split())
    line = re.split(r"(?<=\.)\s", line, maxsplit=1)[0].rstrip(".")
    return line if len(line) <= 90 else line[:87].rstrip() + "..."
