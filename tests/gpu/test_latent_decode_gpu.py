"""The absorbed MLA decode kernel (kernels/latent_decode.py) on CUDA at DeepSeek-V3 shape
(128 heads, kv_lora_rank 512, rope 64) against the paged reference over the same pages
(kernels/dense.py, latent=True), bf16 and fp8 pages, odd lengths (CUDA only).

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
from kvcompile.kernels.latent_decode import latent_decode_attention
from kvcompile.testing import assert_rel_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, R, DR, P = 128, 512, 64, 16


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("lens", [[1, 17, 1000], [4096] * 4])
def test_kernel_matches_reference_on_cuda(fmt, lens):
    g = torch.Generator(device="cuda").manual_seed(len(lens))
    kf = KVFormat(fmt, "page")
    spec = LayerSpec(num_kv_heads=1, head_dim=R, v_head_dim=DR, k_format=kf, v_format=kf)
    pool = PagePool([spec], sum(math.ceil(n / P) for n in lens) + 1, P, device="cuda")
    seqs = pool.allocate(len(lens))
    for s, n in zip(seqs, lens):
        pool.write(0, pool.reserve([s], n),
                   torch.randn(n, 1, R, device="cuda", generator=g).bfloat16(),
                   torch.randn(n, 1, DR, device="cuda", generator=g).bfloat16())
    plan = SimpleNamespace(packed=False, batch=len(lens), seq_lens_list=lens,
                           kv_start=[0] * len(lens), cache={},
                           block_tables=pool.block_table(seqs, device="cuda"))
    q = (torch.randn(len(lens), H, R + DR, device="cuda", generator=g) / 8).bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = latent_decode_attention(q, pool.k[0], pool.v[0], plan.block_tables, lens_t, 0.07)
    ref = paged_reference_attention(pool.k[0], pool.v[0], q.float()[:, :, None], plan, None,
                                    True, 0, 0.0, 0.07, latent=True)[:, :, 0]
    assert_rel_close(out, ref, torch.bfloat16, what=f"{fmt} {lens}")
