"""kernels/move_cells.py compiled for sm_90 on a machine without a GPU
(tests/kernels/sm90_compile.py): the three launches, fp8 e4m3 and e5m2, head_dim 128 with page
16 and head_dim 64 with page 64, with the GPU's rounding (not the interpreter's explicit one).
Not a substitute for tests/gpu/test_move_cells_gpu.py."""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import compile_rows, compile_sm90

pytestmark = pytest.mark.slow   # 12 compiles

TYPES = dict(VALS="*fp32", SEG="*i64", REAL="*i1", PS="*i64", OS="*i64", HS="*i64",
             AMAX="*fp32", DATA="*u8", SCALE="*fp32", PG="*i64", HD="*i64", LAST="*i64",
             NEWS="*fp32", OD="*i64", H="i32")


def _cases():
    import triton.language as tl

    from kvcompile.kernels import move_cells as M
    from kvcompile.kernels.decode_tiles import FMT_E4M3, FMT_E5M2

    for fmt, dt, fmax in ((FMT_E4M3, tl.float8e4nv, 448.0), (FMT_E5M2, tl.float8e5, 57344.0)):
        for D, P in ((128, 16), (64, 64)):
            full = dict(P=P, D=D, FMT=fmt, DATA_DT=dt, EXPLICIT=False, FMAX=fmax, DIV=fmax,
                        RECIP=True)
            for fn in (M._move_amax_kernel, M._move_cells_kernel, M._move_store_kernel):
                consts = {k: v for k, v in full.items() if k in fn.arg_names}
                yield f"{fn.fn.__name__} fmt{fmt} D{D} P{P}", fn, consts


def _main() -> None:
    for name, fn, consts in _cases():
        sig = {n: "constexpr" if n in consts else TYPES[n] for n in fn.arg_names}
        print(json.dumps([name, compile_sm90(fn, sig, consts, num_warps=4)]), flush=True)


def test_move_cells_kernels_compile_for_sm90():
    rows = compile_rows("tests.kernels.test_move_cells_sm90")
    bad = [f"{name}: {msg}" for name, msg in rows if msg != "ok"]
    assert len(rows) == 12 and not bad, "\n".join(bad) or f"{len(rows)} of 12 compiled"
