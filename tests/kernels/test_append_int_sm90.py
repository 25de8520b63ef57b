"""The int append kernels (kernels/append_int.py) compiled for sm_90 on a machine without a GPU:
token scales, page / channel scales in decode-step and bulk launches, sorted or grouped, for
int4 / int3 / int2 (the interpreter accepts what the compiler may refuse; see
test_append_sm90.py). Run by hand against the GPU image's Triton too:
`PYTHONPATH=<triton 3.6 dir>:. python -c "import tests.kernels.test_append_int_sm90 as t; t._main()"`.
"""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import compile_rows, compile_sm90

pytestmark = pytest.mark.slow   # 6 compiles

TYPES = dict(X="*bf16", SLOTS="*i64", SORTED="*i64", ORDER="*i64", DATA="*u8", SCALE="*fp16",
             ZERO="*fp16", T="i32", H="i32")


def _cases():
    from kvcompile.kernels import append_int as A

    for bits in (4, 3, 2):
        per, nb = A.unit_shape(bits)
        yield (f"int{bits} tokens", A._append_int_tokens_kernel,
               dict(D=128, P=64, R=32, BITS=bits, PER=per, NB=nb, RECIP=True))
    for bits, ch, win, grouped in ((4, True, 1, False), (4, True, 64, True), (3, False, 1, True)):
        per, nb = A.unit_shape(bits)
        nr = A.DECODE_ROWS if win == 1 else A.BULK_ROWS
        yield (f"int{bits} {'channel' if ch else 'page'} WIN={win} grouped={grouped}",
               A._append_int_pages_kernel,
               dict(D=128, P=64, WIN=win, NR=nr, BITS=bits, PER=per, NB=nb, CH=ch, RECIP=True,
                    GROUPED=grouped))


def _main() -> None:
    for name, fn, consts in _cases():
        sig = {n: "constexpr" if n in consts else TYPES[n] for n in fn.arg_names}
        print(json.dumps([name, compile_sm90(fn, sig, consts, num_warps=4)]), flush=True)


def test_int_append_kernels_compile_for_sm90():
    rows = compile_rows("tests.kernels.test_append_int_sm90")
    bad = [f"{name}: {msg}" for name, msg in rows if msg != "ok"]
    assert len(rows) == 6 and not bad, "\n".join(bad) or f"{len(rows)} of 6 compiled"
