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


@pytest.mark.parametrize("c_fmt", ["bf16", "fp8_e4m3"])
def test_engine_step_split_matches_reference_on_cuda(c_fmt, monkeypatch):
    """An engine step (packed) with prompt chunks at the expansion threshold or past it (16
    here) beside decodes and a short chunk (runtime/dispatch.py `_attend_latent_split`): the
    long chunks by expansion over their stored latents, the rest on the latent kernel's rows,
    against the absorbed paged reference of the whole step, W_UV applied to both."""
    from kvcompile.kernels.latent import absorb_query, latent_output
    from kvcompile.runtime import dispatch

    monkeypatch.setattr(dispatch, "LATENT_EXPAND_MIN_QUERIES", 16)
    monkeypatch.setattr(dispatch, "LATENT_EXPAND_MIN_QUERIES_FP8", 16)
    monkeypatch.setattr(dispatch, "LATENT_SPLIT_PACKED", True)
    heads, nope, dv = 16, 128, 128
    q_lens, past = [1, 40, 3, 1, 20], [1000, 200, 17, 4000, 0]
    lens = [p + n for p, n in zip(past, q_lens)]
    pool, plan, _, _, _ = _case(c_fmt, c_fmt, lens, heads, seed=21)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    g = torch.Generator(device="cuda").manual_seed(22)
    plan.packed, plan.q_lens, plan.past_lens, plan.new_tokens = True, q_lens, past, cu[-1]
    plan.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    plan.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device="cuda")
    plan.seq_ids, plan.slots = list(range(len(lens))), torch.zeros(0, dtype=torch.int64)
    w = (torch.randn(heads * (nope + dv), R, device="cuda", generator=g) / 16).bfloat16()
    q = (torch.randn(1, heads, cu[-1], nope + DR, device="cuda", generator=g) / 8).bfloat16()
    counts: list[str] = []
    notes: list[str] = []
    state = SimpleNamespace(pool=pool, count=counts.append, kernels=SimpleNamespace(
        use_triton=lambda d: True, _fallback=notes.append))
    split = dispatch._packed_latent_split(q, pool.k[0], plan, None, 0, 0.0, None)
    assert len(split[0]) == 2 and split[1].q_lens == [1, 3, 1]
    got = dispatch._attend_latent_split(SimpleNamespace(state=state), 0, q, plan, split, 0.07,
                                        w, nope)
    q_lat = absorb_query(q, w, nope).float()
    ref = latent_output(paged_reference_attention(pool.k[0], pool.v[0], q_lat, plan, None,
                                                  True, 0, 0.0, 0.07, latent=True),
                        w.float(), nope)
    assert not notes and "latent_chunk_expanded" in counts, (notes, counts)
    assert any(c.startswith("latent_decode_") for c in counts), counts
    assert_rel_close(got.float(), ref, torch.bfloat16, what=f"{c_fmt} split step")
