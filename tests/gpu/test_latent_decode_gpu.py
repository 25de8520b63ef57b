"""The absorbed MLA decode kernel (kernels/latent_decode.py) on CUDA at DeepSeek-V3 shape
(128 heads, kv_lora_rank 512, rope 64) against the paged reference over the same pages
(kernels/dense.py, latent=True): bf16 and fp8 pages (an fp8 latent beside a bf16 rotary key
and the reverse: the once kernel's fp16 dots for one and bf16 for the other), odd lengths,
the rule's tiles and every candidate, split-K on and off (CUDA only: the fp8 widening of
widen "tile" tiles is inline PTX there, .to() in the interpreter); and at 16 / 32 heads
(DeepSeek-V3's tensor-parallel shards, the memory-bound setting) the rule's tiles at its own
splits and at several others, over a ragged batch.

    pytest -s -q -m gpu tests/gpu/test_latent_decode_gpu.py
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.kernels.dense import paged_reference_attention
from kvcompile.kernels.latent_decode import (
    CANDIDATES,
    SWEEP_CANDIDATES,
    LatentTiles,
    latent_decode_attention,
    pick_tiles,
    sm_count,
)
from kvcompile.testing import assert_rel_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, R, DR, P = 128, 512, 64, 16


def _case(c_fmt, r_fmt, lens, heads=H, seed=None):
    """(pool, plan, q, lens, paged reference) of a ragged batch over one layer's latent pages
    (tests/gpu/test_latent_sm90_gpu.py uses it too)."""
    g = torch.Generator(device="cuda").manual_seed(len(lens) if seed is None else seed)
    spec = LayerSpec(num_kv_heads=1, head_dim=R, v_head_dim=DR,
                     k_format=KVFormat(c_fmt, "page"), v_format=KVFormat(r_fmt, "page"))
    pool = PagePool([spec], sum(math.ceil(n / P) for n in lens) + 1, P, device="cuda")
    seqs = pool.allocate(len(lens))
    for s, n in zip(seqs, lens):
        pool.write(0, pool.reserve([s], n),
                   torch.randn(n, 1, R, device="cuda", generator=g).bfloat16(),
                   torch.randn(n, 1, DR, device="cuda", generator=g).bfloat16())
    plan = SimpleNamespace(packed=False, batch=len(lens), seq_lens_list=lens,
                           kv_start=[0] * len(lens), cache={},
                           block_tables=pool.block_table(seqs, device="cuda"))
    q = (torch.randn(len(lens), heads, R + DR, device="cuda", generator=g) / 8).bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref = paged_reference_attention(pool.k[0], pool.v[0], q.float()[:, :, None], plan, None,
                                    True, 0, 0.0, 0.07, latent=True)[:, :, 0]
    return pool, plan, q, lens_t, ref


@pytest.mark.parametrize("c_fmt,r_fmt", [("bf16", "bf16"), ("fp8_e4m3", "fp8_e4m3"),
                                         ("fp8_e4m3", "bf16"), ("bf16", "fp8_e4m3")])
@pytest.mark.parametrize("lens", [[1, 17, 1000], [4096] * 4])
def test_kernel_matches_reference_on_cuda(c_fmt, r_fmt, lens):
    pool, plan, q, lens_t, ref = _case(c_fmt, r_fmt, lens)
    out = latent_decode_attention(q, pool.k[0], pool.v[0], plan.block_tables, lens_t, 0.07)
    assert_rel_close(out, ref, torch.bfloat16, what=f"{c_fmt}/{r_fmt} {lens}")


@pytest.mark.parametrize("tiles", CANDIDATES, ids=str)
@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("c_fmt", ["bf16", "fp8_e4m3"])
def test_every_candidate_on_cuda(tiles, splits, c_fmt):
    if tiles.widen != "dot" and c_fmt == "bf16":
        pytest.skip("widen 'tile' / 'bits' take fp8 latent pages (the launcher refuses bf16)")
    pool, plan, q, lens_t, ref = _case(c_fmt, c_fmt, [3, 300, 2049])
    out = latent_decode_attention(q, pool.k[0], pool.v[0], plan.block_tables, lens_t, 0.07,
                                  num_splits=splits, tiles=tiles)
    assert_rel_close(out, ref, torch.bfloat16, what=f"{c_fmt} {tiles} x {splits}")


@pytest.mark.parametrize("heads", [16, 32])
@pytest.mark.parametrize("splits", [None, 1, 3, 16])
@pytest.mark.parametrize("c_fmt,r_fmt", [("bf16", "bf16"), ("fp8_e4m3", "fp8_e4m3"),
                                         ("fp8_e4m3", "bf16")])
def test_tensor_parallel_shards_on_cuda(heads, splits, c_fmt, r_fmt):
    pool, plan, q, lens_t, ref = _case(c_fmt, r_fmt, [1, 63, 4097, 700], heads)
    tiles = pick_tiles(heads, R, c_fmt != "bf16", 4, sm_count(q.device))   # as the launcher
    out = latent_decode_attention(q, pool.k[0], pool.v[0], plan.block_tables, lens_t, 0.07,
                                  num_splits=splits)
    assert_rel_close(out, ref, torch.bfloat16, what=f"{c_fmt}/{r_fmt} {tiles} x {splits}")


def test_prefetch_variants_are_refused_on_cuda():
    """The prefetch variants (LatentTiles.ahead) faulted on the H200 (illegal memory access,
    triton 3.6, 2026-12-04): the launcher refuses them on CUDA, naming why, before any launch."""
    from kvcompile.errors import UnsupportedShapeError
    from kvcompile.kernels.latent_decode import PREFETCH_VARIANTS

    pool, plan, q, lens_t, ref = _case("bf16", "bf16", [1, 63, 4097, 700], 16)
    for tiles in PREFETCH_VARIANTS:
        with pytest.raises(UnsupportedShapeError, match="prefetch variant"):
            latent_decode_attention(q, pool.k[0], pool.v[0], plan.block_tables, lens_t, 0.07,
                                    tiles=tiles)


@pytest.mark.parametrize("tiles", [*SWEEP_CANDIDATES,
                                   LatentTiles(16, 128, 8, 2, layout="once", widen="bits"),
                                   LatentTiles(16, 64, 4, 2, layout="once_t", widen="bits")],
                         ids=str)
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("c_fmt,r_fmt", [("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3", "bf16"),
                                         ("fp8_e5m2", "fp8_e5m2")])
def test_tensor_parallel_fp8_sweep_tiles_on_cuda(tiles, splits, c_fmt, r_fmt):
    """The benchmark's fp8 tiles at 16 heads (SWEEP_CANDIDATES and widen "bits", whose
    integer PTX runs on CUDA only), over a ragged batch."""
    if (tiles.block_n, tiles.num_warps, tiles.widen, r_fmt) == (128, 8, "bits", "bf16"):
        # H200, triton 3.6 (2026-12-04): this tile over a bf16 rotary part asks for 252,416 B
        # of shared memory (limit 232,448) and triton raises OutOfResources before the launch;
        # the rule never picks it (it is a benchmark candidate; the bench prints such rows as failed)
        pytest.skip("over sm_90's shared memory with a bf16 rotary part on triton 3.6")
    pool, plan, q, lens_t, ref = _case(c_fmt, r_fmt, [1, 63, 4097, 700], 16)
    out = latent_decode_attention(q, pool.k[0], pool.v[0], plan.block_tables, lens_t, 0.07,
                                  num_splits=splits, tiles=tiles)
    assert_rel_close(out, ref, torch.bfloat16, what=f"{c_fmt}/{r_fmt} {tiles} x {splits}")


@pytest.mark.parametrize("route", ["triton", "cuda"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("c_fmt", ["bf16", "fp8_e4m3"])
def test_folded_chunk_matches_reference_on_cuda(route, heads, c_fmt, monkeypatch):
    """A chunk of several queries a row over latent pages (runtime/dispatch.py
    `_latent_kernel`, layout "fold"): each query a kernel row of its own, on the Triton and
    the CUDA latent kernels (latent_sm90.ROUTE forced; where the CUDA kernel does not take the
    shape, Triton), against the paged reference of the whole chunk, causal from each row's
    past, over a ragged batch with a left-padded row."""
    from kvcompile.kernels import latent_sm90
    from kvcompile.kernels.masks import MaskInfo
    from kvcompile.runtime.dispatch import _latent_kernel

    monkeypatch.setattr(latent_sm90, "ROUTE", route)
    S, lens = 7, [40, 1031, 4100]
    pool, plan, _, _, _ = _case(c_fmt, c_fmt, lens, heads, seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    q = (torch.randn(len(lens), heads, S, R + DR, device="cuda", generator=g) / 8).bfloat16()
    plan.kv_start = [0, 5, 0]
    plan.q_lens, plan.new_tokens, plan.past_lens = [], S, [n - S for n in lens]
    plan.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    notes: list[str] = []
    state = SimpleNamespace(kernels=SimpleNamespace(use_triton=lambda d: True,
                                                    _fallback=notes.append))
    got, used = _latent_kernel(state, q, pool.k[0], pool.v[0], plan,
                               MaskInfo(None, plan.kv_start, 0, True), torch.ones(1), 0, 0.0,
                               0.07)
    ref = paged_reference_attention(pool.k[0], pool.v[0], q.float(), plan, None, True, 0, 0.0,
                                    0.07, latent=True)
    assert not notes and used.endswith("_rows"), (notes, used)
    if route == "cuda" and not latent_sm90.unsupported(q[:, :, 0], pool.k[0], pool.v[0]):
        assert used == "cuda_rows", used
    assert_rel_close(got, ref, torch.bfloat16, what=f"{route} {heads} heads {c_fmt} ({used})")
