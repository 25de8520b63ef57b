"""The absorbed MLA decode kernel (kernels/latent_decode.py) against the paged reference over
the same latent pages (kernels/dense.py, latent=True), on fresh random inputs: odd lengths,
several splits, head counts that do not fill a block, fp32 and fp8 pages (the same stored
values: the fp8 case checks the page scales are applied, not quantization error)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels.dense import paged_reference_attention
from kvcompile.kernels.latent_decode import latent_decode_attention
from kvcompile.testing import assert_rel_close

R, DR, P = 32, 16, 16


def _pool(fmt: str, lens: list[int], g):
    kf = KVFormat(fmt, "page")
    spec = LayerSpec(num_kv_heads=1, head_dim=R, v_head_dim=DR, k_format=kf, v_format=kf)
    pool = PagePool([spec], sum(math.ceil(n / P) for n in lens) + 3, P)
    seqs = pool.allocate(len(lens))
    pool.allocate(1)   # a sequence between them: block tables are not the identity
    for s, n in zip(seqs, lens):
        pool.write(0, pool.reserve([s], n), torch.randn(n, 1, R, generator=g) * 3,
                   torch.randn(n, 1, DR, generator=g))
    plan = SimpleNamespace(packed=False, batch=len(lens), seq_lens_list=lens,
                           kv_start=[0] * len(lens), cache={},
                           block_tables=pool.block_table(seqs), new_tokens=1,
                           past_lens=[n - 1 for n in lens])
    return pool, plan


@pytest.mark.parametrize("fmt", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize("heads,lens,splits", [(4, [1, 17, 50], None), (20, [64, 33], 3)])
def test_kernel_matches_paged_reference(fmt, heads, lens, splits):
    g = torch.Generator().manual_seed(len(lens) * heads)
    pool, plan = _pool(fmt, lens, g)
    q_lat = torch.randn(len(lens), heads, R + DR, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables, seq_lens,
                                  0.2, num_splits=splits)
    ref = paged_reference_attention(pool.k[0], pool.v[0], q_lat[:, :, None], plan, None, True,
                                    0, 0.0, 0.2, latent=True)[:, :, 0]
    assert out.shape == (len(lens), heads, R)
    assert_rel_close(out, ref, torch.float32, factor=4)


def test_refuses_pages_it_cannot_read():
    g = torch.Generator().manual_seed(0)
    pool, plan = _pool("fp4_e2m1", [20], g)
    with pytest.raises(UnsupportedShapeError, match="fp4_e2m1"):
        latent_decode_attention(torch.randn(1, 4, R + DR), pool.k[0], pool.v[0],
                                plan.block_tables, torch.tensor([20], dtype=torch.int32), 0.2)
