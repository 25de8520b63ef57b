"""The plain-PyTorch attention used at run time: the fp32 path and the SDPA path agree."""

import pytest
import torch

from kvcompile.kernels.dense import attend_fp32, attend_sdpa
from kvcompile.testing import assert_rel_close


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive"])
def test_sdpa_path_matches_fp32_path(hq, hkv, mask):
    g = torch.Generator().manual_seed(hq * 10 + len(mask))
    S, L, D = 7, 23, 32
    q = torch.randn(hq, S, D, generator=g)
    k = torch.randn(hkv, L, D, generator=g)
    v = torch.randn(hkv, L, D, generator=g)
    allowed = additive = None
    causal = False
    if mask == "causal":
        allowed = torch.arange(L)[None] <= torch.arange(L - S, L)[:, None]
    elif mask == "bool":
        allowed = torch.rand(S, L, generator=g) > 0.3
        allowed[2] = False  # a query that sees no key gives 0 in both paths
    elif mask == "additive":
        additive = torch.randn(S, L, generator=g)
    ref = attend_fp32(q, k, v, allowed, additive, 0.17, 0.0)
    got = attend_sdpa(q, k, v, allowed, additive, 0.17, causal)
    assert_rel_close(got, ref, torch.float32, factor=10, what=f"sdpa path, {mask}")
    if mask == "bool":
        assert torch.equal(got[:, 2], torch.zeros_like(got[:, 2]))


def test_sdpa_causal_fast_path():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 16, 32, generator=g) for _ in range(3))
    allowed = torch.ones(16, 16).tril().bool()
    ref = attend_fp32(q, k, v, allowed, None, 0.2, 0.0)
    assert_rel_close(attend_sdpa(q, k, v, allowed, None, 0.2, causal=True), ref, torch.float32,
                     factor=10)
