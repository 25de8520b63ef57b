"""The gather kernel of the chunked-prefill workspace route (kernels/prefill_gather.py)
compiled for sm_90 (Hopper) on a machine without a GPU, every format and scale mode the paged
prefill reads and each workspace dtype; and the varlen kernel with the log-sum-exp output the
route's pieces merge by (STORE_LSE), through TMA descriptors and pointers. The interpreter accepts what the compiler refuses
(tests/kernels/sm90_compile.py); not a substitute for the CUDA run."""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import compile_rows, compile_sm90

pytestmark = pytest.mark.slow   # 14 compiles

_INTS = ("stride_bt", "sp", "sh", "st", "ssp", "ssh", "sst", "mp", "mh", "mt", "stride_ot",
         "stride_oh")


def _cases():
    from kvcompile.cache import registry as R

    # (name, FMT, GRAN, data type, scale type, micro type, out type, DIM)
    yield "bf16 pages -> bf16", R.FMT_PLAIN, R.SCALE_NONE, "*bf16", "*i32", "*i32", "*bf16", 128
    yield "fp16 pages -> fp16", R.FMT_PLAIN, R.SCALE_NONE, "*fp16", "*i32", "*i32", "*fp16", 64
    yield "fp32 pages -> fp32", R.FMT_PLAIN, R.SCALE_NONE, "*fp32", "*i32", "*i32", "*fp32", 128
    for gran, g in (("page", R.SCALE_PAGE), ("token", R.SCALE_TOKEN),
                    ("tensor", R.SCALE_TENSOR)):
        yield (f"e4m3 {gran} -> bf16", R.FMT_E4M3, g, "*fp8e4nv", "*fp32", "*i32", "*bf16",
               128)
        yield (f"e2m1 {gran} -> bf16", R.FMT_E2M1, g, "*u8", "*fp32", "*fp8e4nv", "*bf16",
               128)
    yield "e5m2 page -> fp16", R.FMT_E5M2, R.SCALE_PAGE, "*fp8e5", "*fp32", "*i32", "*fp16", 256
    # int pages (BITS > 0; GRAN 0 / 1 / 2: page / token / channel scales and zero points)
    yield "int4 channel -> bf16", 0, 2, "*u8", "*fp16", "*i32", "*bf16", 128, 4
    yield "int3 token -> bf16", 0, 1, "*u8", "*fp16", "*i32", "*bf16", 128, 3
    yield "int2 page -> fp16", 0, 0, "*u8", "*fp16", "*i32", "*fp16", 64, 2


def _compile(fmt, gran, data, scale, micro, out, dim, bits=0) -> str:
    from kvcompile.kernels.prefill_gather import BLOCK_T, gather_pages_kernel

    consts = dict(FMT=fmt, GRAN=gran, DIM=dim, PAGE=16, BLOCK=BLOCK_T, BITS=bits)
    types = dict(Data=data, Scale=scale, Micro=micro, Zero=scale if bits else "*i32", Out=out,
                 block_tables="*i32", starts="*i32", cu_k="*i32", H="i32",
                 **{n: "i32" for n in _INTS})
    sig = {n: "constexpr" if n in consts else types[n] for n in gather_pages_kernel.arg_names}
    return compile_sm90(gather_pages_kernel, sig, consts, num_warps=4)


def _compile_varlen(tma: bool, lse: bool) -> str:
    from kvcompile.kernels.prefill_varlen import prefill_varlen_kernel as fn

    consts = dict(RATIO=4, GROUP=4, HEAD_DIM=128, HEAD_DIM_V=128, CAUSAL=True, WINDOW=False,
                  SINKS=False, SOFTCAP=False, FP8=False, TMA=tma, Q_TMA=False, SCALE_TMA=False,
                  SCALE_BLK=128, BLOCK_M=128, BLOCK_N=128, WARP_SPEC=False, STORE_LSE=lse)
    types = dict(Q="*bf16", Qd="*bf16", Out="*bf16", Lse="*fp32", sm_scale_c="fp32",
                 softcap_log2e="fp32", inv_softcap="fp32",
                 K="tensordesc<bf16[128, 128]>" if tma else "*bf16",
                 V="tensordesc<bf16[128, 128]>" if tma else "*bf16",
                 **{n: "*i32" for n in ("cu_seqlens", "cu_seqlens_k", "cu_blocks", "q_descale",
                                        "k_descale", "v_descale")})
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    return compile_sm90(fn, sig, consts, num_warps=8, num_stages=2)


def _main() -> None:
    for name, *args in _cases():
        print(json.dumps([name, _compile(*args)]), flush=True)
    for tma in (False, True):
        for lse in (False, True):
            print(json.dumps([f"varlen tma={tma} lse={lse}", _compile_varlen(tma, lse)]),
                  flush=True)


def test_gather_kernel_compiles_for_sm90():
    rows = compile_rows("tests.kernels.test_prefill_gather_sm90")
    bad = [f"{name}: {msg}" for name, msg in rows if msg != "ok"]
    assert len(rows) == 17 and not bad, "\n".join(bad) or f"{len(rows)} of 17 compiled"
