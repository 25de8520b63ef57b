"""CPU generate speed: kvcompile (reference kernels) against plain Hugging Face, SmolLM2-135M.

    python benchmarks/bench_cpu_generate.py                       # bf16 and fp8 pages
    python benchmarks/bench_cpu_generate.py --kv fp8_e4m3 --repeats 7 --inner eager inductor

Setup: SmolLM2-135M-Instruct (kvcompile.models, fp32 weights unless --dtype), a prompt of
`--prompt` tokens of the Lee corpus (random ids if gensim is missing), `--new` greedy tokens
(min_new_tokens = max_new_tokens). "hf" is the uncompiled model with its DynamicCache (HF's
default attention, SDPA); each "kvc" row is a deep copy compiled with
`kvcompile.compile(model, KVConfig(kv_dtype=..., inner=...))`, warmed up first (the first
calls compile: their time is printed apart).

The CPU is shared, so every repetition runs each model once, in turn (hf, kvc_a, kvc_b, ...,
the order rotating): the ratio kvc / hf is taken pair by pair, within one repetition; the table
gives min / median over repetitions, and best / best (each path's fastest repetition, the one
least disturbed by other processes).

    tok/s         new tokens / wall time of the whole generate call (prefill included)
    decode tok/s  (new - 1) / (t_new - t_1), t_1 from a max_new_tokens=1 call of the same
                  repetition; also per CPU second of the process (with --threads 1, the figure
                  least moved by other processes on a shared machine)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))  # quality_data

import kvcompile  # noqa: E402
from kvcompile.models import load_smollm2  # noqa: E402


def prompt_ids(tok, n: int) -> torch.Tensor:
    try:
        from quality_data import lee_corpus_ids

        ids = lee_corpus_ids(tok)[:n]
    except Exception as e:  # noqa: BLE001  (gensim missing: any text does)
        print(f"# Lee corpus unavailable ({e}); random token ids", flush=True)
        ids = torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(0))
    return ids[None]


def timed_generate(model, ids, n: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one greedy generate call."""
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert out.shape[1] == ids.shape[1] + n
    return dt, dc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8_e4m3"])
    ap.add_argument("--inner", nargs="+", default=["eager"],
                    help="inner backends to compare (eager, inductor, aot_eager)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tok, _ = load_smollm2(dtype)
    ids = prompt_ids(tok, args.prompt)
    print(f"# SmolLM2-135M {args.dtype}, prompt {ids.shape[1]}, {args.new} new tokens, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    models = {"hf": model}
    for inner in args.inner:
        for kv in args.kv:
            name = f"kvc_{kv}" + ("" if len(args.inner) == 1 else f"_{inner}")
            m = copy.deepcopy(model)
            t0 = time.perf_counter()
            kvcompile.compile(m, kvcompile.KVConfig(kv_dtype=kv, inner=inner,
                                                    max_kv_bytes=1 << 28))
            # the first calls compile: prefill, the first decode step, then the dynamic-length
            # decode graph; two calls reach the steady state
            timed_generate(m, ids, 3)
            first = time.perf_counter() - t0
            timed_generate(m, ids, 3)
            print(f"# {name}: compile + first generate(3) {first:.1f} s, "
                  f"{len(kvcompile.report(m).rewritten)} sites rewritten", flush=True)
            models[name] = m
    timed_generate(model, ids, 3)  # HF warm-up
    names = list(models)
    full = {n: [] for n in names}   # (wall, cpu) of generate(new)
    one = {n: [] for n in names}    # (wall, cpu) of generate(1)
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            one[n].append(timed_generate(models[n], ids, 1))
            full[n].append(timed_generate(models[n], ids, args.new))
        print(f"# repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{n} {args.new / full[n][-1][0]:.2f} tok/s" for n in names), flush=True)

    def tps(n, i=0):
        return [args.new / t[i] for t in full[n]]

    def dps(n, i=0):
        return [(args.new - 1) / max(t[i] - t1[i], 1e-9) for t, t1 in zip(full[n], one[n])]

    def row(name, xs, base):
        pair = [a / b for a, b in zip(xs, base)]
        return (f"{name:24s} {min(xs):8.2f} {statistics.median(xs):8.2f} {max(xs):8.2f} "
                f"{min(pair):8.2f} {statistics.median(pair):8.2f} {max(xs) / max(base):8.2f}")

    head = (f"{'path':24s} {'min':>8s} {'median':>8s} {'best':>8s} {'ratio':>8s} {'ratio':>8s} "
            f"{'ratio':>8s}\n{'':24s} {'':>8s} {'':>8s} {'':>8s} {'min':>8s} {'median':>8s} "
            f"{'best':>8s}")
    for title, f, i in ((f"tok/s, whole generate({args.new})", tps, 0),
                        (f"decode tok/s, (t_{args.new} - t_1) / {args.new - 1}", dps, 0),
                        ("decode tok/s per CPU second (process CPU time, not wall)", dps, 1)):
        print(f"\n{title}; ratio = path / hf, pair by pair (min, median) and best / best")
        print(head)
        for n in names:
            print(row(n, f(n, i), f("hf", i)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
