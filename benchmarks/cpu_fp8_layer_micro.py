"""Per-layer CPU cost of the fp8 decode step's two halves: the one-token K + V write and the
K + V gather and decode (SmolLM2-135M's layer shape: 3 KV heads, D 64, pages of 16).

    python benchmarks/cpu_fp8_layer_micro.py                  # fp8_e4m3, 320 tokens
    python benchmarks/cpu_fp8_layer_micro.py --kv bf16 fp8_e4m3 fp8_e5m2 --calls 200
    python benchmarks/cpu_fp8_layer_micro.py --route c       # fp8 pages' C route

write16   the 16 tokens of the last page written in turn (offsets 0..15, values drawn once
          from N(0, 1) with a few larger ones: the page scale grows on some of them), per token
calm16    the same with every head's largest value in the page's first token (no scale grows
          after it), per token
step16    write16 as `CpuDecodeStep` writes K and V (together, one fp8 cast:
          `PagedTensor.write_tokens_fp8` where this checkout has it, else by their kept facts,
          `write_tokens_kept`, else write_token)
gather    `CpuDecodeStep`'s K + V gather and decode of the sequence's 320 tokens

Thread CPU time per call (K and V together), min / median over `--blocks` blocks of `--calls`
calls. A micro-benchmark: a model's step runs these between matmuls that evict the caches, so
in a step each costs more (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)   # (after PYTHONPATH: another checkout can be timed)

from kvcompile.cache.formats import resolve_format  # noqa: E402
from kvcompile.cache.paged import PagedTensor  # noqa: E402
from kvcompile.kernels.dense import _gather, _page_rows  # noqa: E402
from kvcompile.runtime.cpu_decode import CpuDecodeStep  # noqa: E402

H, D, P = 3, 64, 16


def _timed(fn, calls: int, blocks: int) -> tuple[float, float]:
    per = []
    for _ in range(blocks):
        t0 = time.thread_time_ns()
        for _ in range(calls):
            fn()
        per.append((time.thread_time_ns() - t0) / calls / 1e3)
    return min(per), statistics.median(per)


def _c_library(route: str):
    """The cpu_fp8 C library for route "c" (None: the numpy route, or a checkout without it)."""
    try:
        from kvcompile.kernels import cpu_fp8
    except ImportError:
        return None
    return cpu_fp8.library(route)


def _calls(kv: str, tokens: int, toks: torch.Tensor, g: torch.Generator, route: str = "numpy"):
    """(write16, calm16, step16, gather) of one layer's K and V in format kv."""
    n = -(-tokens // P)
    last = n - 1
    fmt = resolve_format(kv, torch.float32)
    kt, vt = fmt.allocate(n + 1, H, P, D), fmt.allocate(n + 1, H, P, D)
    for t in (kt, vt):
        t.data.view(torch.uint8).fill_(0)
        t.write(torch.arange(last * P), torch.randn(last * P, H, D, generator=g))
    pages = torch.arange(n)
    rows = _page_rows(pages, 1, H)

    def token_rows(o):
        return (last * H + torch.arange(H)) * P + o

    trows = [token_rows(o) for o in range(P)]
    ks = [toks[o, 0].view(1, H, 1, D) for o in range(P)]
    vs = [toks[o, 1].view(1, H, 1, D) for o in range(P)]

    def write16():
        for o in range(P):
            kt.write_token(last, o, trows[o], ks[o])
            vt.write_token(last, o, trows[o], vs[o])

    calm = toks.clone()
    calm[0] = calm[0].sign() * 100.0
    kc = [calm[o, 0].view(1, H, 1, D) for o in range(P)]
    vc = [calm[o, 1].view(1, H, 1, D) for o in range(P)]

    def calm16():
        for o in range(P):
            kt.write_token(last, o, trows[o], kc[o])
            vt.write_token(last, o, trows[o], vc[o])

    kn = [toks[o, 0].numpy() for o in range(P)]
    vn = [toks[o, 1].numpy() for o in range(P)]
    both = getattr(PagedTensor, "write_tokens_fp8", None)   # (every offset)
    pair = both or getattr(PagedTensor, "write_tokens_kept", None)
    if not kv.startswith("fp8"):   # (unquantized pages: write_token, as the step does)
        both = pair = None
    lib = _c_library(route) if kv.startswith("fp8") else None
    if lib is not None:   # the C route: one call per token pair
        from kvcompile.kernels import cpu_fp8

        kn, vn = [toks[o, 0] for o in range(P)], [toks[o, 1] for o in range(P)]
        pair = both = lambda ts, p, o, xs, scratch: cpu_fp8.write_tokens(lib, ts, p, o, xs,
                                                                          scratch)
    scratch: dict = {}

    def step16():
        for o in range(P):
            if not ((o or both is not None) and pair is not None
                    and pair((kt, vt), last, o, (kn[o], vn[o]), scratch)):
                kt.write_token(last, o, trows[o], ks[o])
                vt.write_token(last, o, trows[o], vs[o])

    write16()
    step = CpuDecodeStep.__new__(CpuDecodeStep)
    step.pages, step.total, step._scratch, step.start = pages, tokens, {}, 0
    if kv.startswith("fp8") and step._fp8_together(kt, vt):
        if lib is not None:
            def gather():
                step._gather_fp8(kt, vt, rows, torch.float32, lib)
        else:
            def gather():
                step._gather_fp8(kt, vt, rows, torch.float32, *(
                    (None,) if route == "numpy" and _c_library("c") is not None else ()))
    else:
        def gather():
            _gather(kt, pages, 1, tokens, torch.float32, rows)
            _gather(vt, pages, 1, tokens, torch.float32, rows)

    return write16, calm16, step16, gather


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", nargs="+", default=["fp8_e4m3"])
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--route", choices=["numpy", "c"], default="numpy",
                    help="fp8 pages: the numpy route or the C one (kernels/cpu_fp8.py)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    g = torch.Generator().manual_seed(0)
    toks = torch.randn(16, 2, H, D, generator=g)
    toks[torch.rand(16, 2, H, 1, generator=g).expand(-1, -1, -1, D) < 0.2] *= 4
    for kv in args.kv:
        write16, calm16, step16, gather = _calls(kv, args.tokens, toks, g, args.route)
        w16 = [t / 16 for t in _timed(write16, max(1, args.calls // 16), args.blocks)]
        c16 = [t / 16 for t in _timed(calm16, max(1, args.calls // 16), args.blocks)]
        s16 = [t / 16 for t in _timed(step16, max(1, args.calls // 16), args.blocks)]
        ga = _timed(gather, args.calls, args.blocks)
        for what, (lo, med) in (("write16", w16), ("calm16", c16), ("step16", s16),
                                ("gather", ga)):
            print(f"{kv:9s} {what:8s} K+V {lo:7.1f} / {med:7.1f} us  (min / median)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
