"""The absorbed MLA decode kernel compiled for sm_90 (Hopper) on a machine without a GPU:
every candidate tile at DeepSeek-V3 shape (r 512, rope 64, page 16), bf16 and fp8 pages,
split and unsplit, must compile through the installed Triton's NVIDIA backend, fit the SM's
shared memory, and put both GEMMs of the 64-head tiles on wgmma (Hopper tensor cores). The
interpreter cannot tell any of that; this does not replace the CUDA run (tests/gpu/), and its
Triton may differ from the GPU image's."""

from __future__ import annotations

import json

import pytest

from kvcompile.kernels.latent_decode import CANDIDATES
from tests.kernels.sm90_compile import compile_rows

SMEM_LIMIT = 232448   # bytes of shared memory one block may use on sm_90 (227 KiB)
TYPES = dict(QL="*bf16", CS="*fp32", RS="*fp32", BT="*i32", SL="*i32", OUT="*fp32",
             ACC="*fp32", ML="*fp32", stride_qb="i32", stride_qh="i32", stride_bt="i32",
             H="i32", num_splits="i32", tiles_per_split="i32", qk_scale="fp32")
DIV16 = ("stride_qb", "stride_qh", "H")   # as a launch at 128 heads specializes them
pytestmark = pytest.mark.slow   # 24 compiles: 60-90 s on the shared 2-core machine
PAGES = ("bf16", "fp8e4nv")


def _compile(tiles, page: str, direct: bool) -> dict:
    """One compile for sm_90 -> {shared, wgmma, pipelined} or {error}. Runs in a process
    without TRITON_INTERPRET (the interpreter patches triton.language for the process)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcompile.kernels import latent_decode as ld

    fn = ld._latent_tile_kernel
    scaled = page != "bf16"
    consts = dict(R=512, DR=64, P=16, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
                  V_SPLIT=tiles.v_split, C_SCALED=scaled, R_SCALED=scaled, DT=tl.bfloat16,
                  DIRECT=direct)
    types = dict(TYPES, CD=f"*{page}", RD=f"*{page}")
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n in DIV16)}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    except Exception as e:  # reported to the test, which fails with it
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    ttgir = k.asm["ttgir"]
    return {"shared": k.metadata.shared, "wgmma": ttgir.count("ttng.warp_group_dot "),
            "pipelined": "async_copy_global_to_local" in ttgir}


def _main() -> None:
    for i, tiles in enumerate(CANDIDATES):
        for page in PAGES:
            for direct in (False, True):
                print(json.dumps([i, page, direct, _compile(tiles, page, direct)]), flush=True)


@pytest.fixture(scope="module")
def compiled():
    rows = compile_rows("tests.kernels.test_latent_decode_sm90")
    if all("ptxas" in row[3].get("error", "") for row in rows):
        pytest.skip(f"no working ptxas for sm_90 here: {rows[0][3]['error'][:300]}")
    return {(i, page, direct): res for i, page, direct, res in rows}


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("i", range(len(CANDIDATES)))
def test_candidate_compiles_for_sm90(compiled, i, page):
    tiles = CANDIDATES[i]
    for direct in (False, True):
        res = compiled[(i, page, direct)]
        assert "error" not in res, f"{tiles} {page} direct={direct}: {res.get('error')}"
        assert res["shared"] <= SMEM_LIMIT, f"{tiles}: {res['shared']} B of shared memory"
        if tiles.block_h == 64:
            assert res["wgmma"] >= 3, f"{tiles}: the GEMMs are not on wgmma"
        assert res["pipelined"] or tiles.num_stages == 1, f"{tiles}: page loads not pipelined"

