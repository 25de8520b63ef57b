"""The prompt-mass kernels (kernels/prompt_mass.py) compiled for sm_90 on a machine without a
GPU (tests/kernels/sm90_compile.py): bf16 and fp32 operands, head_dim 64 / 128 / 96 (padded)
and 576 (an MLA layer's absorbed query over its latent pages, in chunks; 128 query heads on
one latent), with and without causality, window and soft-capping. Not a substitute for the CUDA run
(tests/gpu/test_prompt_mass_gpu.py)."""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import compile_rows, compile_sm90

pytestmark = pytest.mark.slow   # 10 compiles

ROW = dict(q_off="*i64", q_len="*i32", lse_start="*i32", k_start="*i32", k_lens="*i32",
           pos0="*i32", starts="*i32", stride_qh="i64", stride_qt="i64", stride_kh="i64",
           stride_kt="i64", stride_lh="i64", stride_mh="i64", qk_scale="fp32",
           softcap="fp32", inv_softcap="fp32", window="i32", LSE="*fp32", MASS="*fp32")


def _compile(fn, consts: dict, dt: str) -> str:
    types = dict(ROW, Q=f"*{dt}", K=f"*{dt}")
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    return compile_sm90(fn, sig, consts, num_warps=4)


def _cases():
    from kvcompile.kernels import prompt_mass as M

    for dt, d, causal, window, softcap in [("bf16", 128, True, False, False),
                                           ("bf16", 64, True, True, True),
                                           ("fp32", 96, False, False, False),
                                           ("fp16", 128, True, True, False),
                                           ("bf16", 576, True, False, False)]:
        consts = dict(GROUP=128 if d > M.WIDE_D else 4, HEAD_DIM=d, CAUSAL=causal,
                      WINDOW=window, SOFTCAP=softcap, BM=M.BLOCK_M, BN=M.BLOCK_N,
                      **M.d_tiles(d))
        for fn in (M._row_lse_kernel, M._key_mass_kernel):
            yield f"{fn.fn.__name__} {dt} D{d} c{causal:d}w{window:d}s{softcap:d}", fn, consts, dt


def _main() -> None:
    for name, fn, consts, dt in _cases():
        print(json.dumps([name, _compile(fn, consts, dt)]), flush=True)


def test_prompt_mass_kernels_compile_for_sm90():
    rows = compile_rows("tests.kernels.test_prompt_mass_sm90")
    bad = [f"{name}: {msg}" for name, msg in rows if msg != "ok"]
    assert len(rows) == 10 and not bad, "\n".join(bad) or f"{len(rows)} of 10 compiled"
