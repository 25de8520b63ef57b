"""The append kernels compiled for sm_90 (Hopper) on a machine without a GPU: every format
and path (row / token / tensor scales, decode-step page scales, the bulk page-scale kernels
"windows" and "tiles", grouped or sorted, the tensor-scale calibration) must get through the
installed Triton's NVIDIA backend. The interpreter
runs a kernel as Python and accepts what the compiler refuses: a non-constexpr global read
in a kernel, a variable whose shape differs between the branches of an `if` (both reached the
H200 on 2026-12-03 and failed there). Not a substitute for the CUDA run (tests/kernels/
test_append.py on the GPU), and this Triton may differ from the GPU image's."""

from __future__ import annotations

import itertools
import json
import os

import pytest

from tests.kernels.sm90_compile import compile_rows, compile_sm90

pytestmark = pytest.mark.slow   # 22 compiles (30 full), about 70 s on the 2-core machine
# int pages (kernels/append_int.py): the 4-bit format's kernels by default (int4 token scales,
# channel scales in a decode step and in a bulk write); KVCOMPILE_TEST_FULL=1 adds int3 / int2
# and the other launches. (Checked against the GPU image's Triton 3.6 too, 2026-12-04, by
# running _main() with its wheel first on PYTHONPATH.)
INT_CASES = [(4, "token", 1, False), (4, "channel", 1, False), (4, "channel", 64, True),
             (3, "token", 1, False), (2, "token", 1, False), (3, "page", 1, True),
             (2, "page", 64, False), (2, "channel", 1, True)]

TYPES = dict(X="*bf16", SLOTS="*i64", SORTED="*i64", ORDER="*i64", DATA="*u8", SCALE="*fp32",
             MICRO="*u8", AMAX="*fp32", ZERO="*fp16", T="i32", H="i32")


def _compile(fn, consts: dict, types: dict | None = None, warps: int = 4,
             maxnreg: int | None = None) -> str:
    types = dict(TYPES, **(types or {}))
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    return compile_sm90(fn, sig, consts, num_warps=warps,
                        **({"maxnreg": maxnreg} if maxnreg else {}))


def _cases():
    import triton.language as tl

    from kvcompile.kernels import append as A

    # e5m2 takes e4m3's paths with another element type: with KVCOMPILE_TEST_FULL=1 (8
    # compiles, ~26 s on the 2-core CI machine)
    fmts = [(A.FMT_E4M3, tl.float8e4nv, 448.0, 448.0),
            *([(A.FMT_E5M2, tl.float8e5, 57344.0, 57344.0)]
              if os.environ.get("KVCOMPILE_TEST_FULL") else []),
            (A.FMT_E2M1, tl.float8e4nv, 6.0, 6.0 * 448.0)]
    for code, dt, fmax, div in fmts:
        base = dict(D=128, P=16, FMT=code, EXPLICIT=False, FMAX=fmax, DIV=div, RECIP=True)
        for sm in (1, 3):
            elems, warps = (A.FP4_ROW_TILE if code == A.FMT_E2M1
                            else (A.ROW_TILE_ELEMS, A.ROW_TILE_WARPS))   # the launcher's
            yield (f"rows fmt{code} scales{sm}", A._append_rows_kernel,
                   dict(base, R=elems // 128, SM=sm, PAIRS=True), None, warps)
        for win in (1, 16):   # a decode step; a bulk write (PAGE_BULK "runs")
            yield (f"pages fmt{code} WIN={win}", A._append_pages_kernel,
                   dict(base, R=16, DATA_DT=dt, WIN=win, PAIRS=True), None, 4)
        for grouped in (False, True):
            yield (f"bulk fmt{code} grouped={grouped}", A._append_pages_bulk_kernel,
                   dict(base, R=16, W=128, DATA_DT=dt, GROUPED=grouped), None, 8)
        # PAGE_BULK "tiles" (PART 0), the launcher's tile, warps and register cap; "split"
        # (PARTs 1, 2) with KVCOMPILE_TEST_FULL=1
        parts = (0, 1, 2) if os.environ.get("KVCOMPILE_TEST_FULL") else (0,)
        for grouped, part in itertools.product((False, True), parts):
            yield (f"tiles fmt{code} grouped={grouped} part={part}",
                   A._append_pages_tiles_kernel,
                   dict(base, R=16, W=A.PAGE_TILE_ELEMS // 128, DATA_DT=dt, GROUPED=grouped,
                        PART=part, SPEC=A.PAGE_TILE_SPEC), None,
                   A.PAGE_TILE_WARPS[code == A.FMT_E2M1], A.PAGE_TILE_MAXNREG[code == A.FMT_E2M1])
    yield ("rows fp4 split loads (FP4_PAIR_LOADS False)", A._append_rows_kernel,
           dict(base, R=32, SM=3, PAIRS=False), None, 4)
    yield ("calibrate amax", A._calibrate_amax_kernel, dict(BLOCK=4096), dict(N="i32"), 4)
    yield ("rows plain bf16", A._append_rows_kernel,
           dict(D=128, P=16, R=32, FMT=A._PLAIN_BF16, SM=0, EXPLICIT=False, FMAX=1.0, DIV=1.0,
                RECIP=True, PAIRS=True),
           dict(DATA="*i16", SCALE="*bf16", MICRO="*bf16", AMAX="*bf16"), 4)
    from kvcompile.kernels import append_int as AI

    for bits, gran, win, grouped in INT_CASES[:None if os.environ.get("KVCOMPILE_TEST_FULL")
                                              else 3]:
        per, nb = AI.unit_shape(bits)
        base = dict(D=128, P=64, BITS=bits, PER=per, NB=nb, RECIP=True)
        if gran == "token":
            yield (f"int{bits} tokens", AI._append_int_tokens_kernel, dict(base, R=32),
                   dict(SCALE="*fp16"), AI.TOKEN_TILE_WARPS)
            continue
        nr = AI.DECODE_ROWS if win == 1 else AI.BULK_ROWS
        if win > 1 and AI.PAGE_BULK == "tiles":   # a bulk write: the tiles kernel (its run
            # path is _append_int_pages_kernel's)
            for part in (1, 2) if AI.TILE_SPLIT else (0,):
                yield (f"int{bits} {gran} tiles grouped={grouped} part={part}",
                       AI._append_int_tiles_kernel,
                       dict(base, W=AI.TILE_PAGES * 64, U=min(64, AI.TILE_UNROLL), NR=nr,
                            CH=gran == "channel", GROUPED=grouped, PART=part,
                            SPEC=AI.TILE_SPEC),
                       dict(SCALE="*fp16"), AI.TILE_WARPS)
            continue
        yield (f"int{bits} {gran} WIN={win} grouped={grouped}", AI._append_int_pages_kernel,
               dict(base, WIN=win, NR=nr, CH=gran == "channel", GROUPED=grouped),
               dict(SCALE="*fp16"), 4)


def _expected() -> int:
    """Compiles _cases yields: 8 a float format (12 full: two more tile parts, grouped or
    not), 2 formats (3 full: e5m2), 3 more, and 3 int cases (all 8 full), a bulk one in
    two parts with append_int.TILE_SPLIT."""
    from kvcompile.kernels import append_int as AI

    full = bool(os.environ.get("KVCOMPILE_TEST_FULL"))
    ints = INT_CASES if full else INT_CASES[:3]
    bulk = sum(win > 1 and gran != "token" for _, gran, win, _ in ints) if AI.TILE_SPLIT else 0
    return (3 if full else 2) * (12 if full else 8) + 3 + len(ints) + bulk


def _main() -> None:
    for name, fn, consts, types, *launch in _cases():   # launch: warps [, register cap]
        print(json.dumps([name, _compile(fn, consts, types, *launch)]), flush=True)


def test_append_kernels_compile_for_sm90():
    rows = compile_rows("tests.kernels.test_append_sm90")
    bad = [f"{name}: {msg}" for name, msg in rows if msg != "ok"]
    n = _expected()
    assert len(rows) == n and not bad, "\n".join(bad) or f"{len(rows)} of {n} compiled"
