"""kernels/reference.py `masked_softmax`, the one softmax of every reference path, against
torch.softmax, and its rules for masked keys, empty rows and NaN."""

from __future__ import annotations

import torch

from kvcompile.kernels.reference import masked_softmax


def test_matches_torch_softmax_where_rows_see_keys():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 5, 9, generator=g) * 4                   # [B, H, S, L]
    allowed = torch.rand(1, 3, 5, 9, generator=g) > 0.3
    allowed[..., 0] = True                                          # every row sees a key
    want = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(masked_softmax(s, allowed), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(masked_softmax(s, None), torch.softmax(s, -1),
                               rtol=1e-6, atol=1e-7)


def test_masked_nan_is_inert_and_empty_rows_are_zero():
    s = torch.tensor([[1.0, float("nan"), 2.0], [0.5, 0.5, 0.5], [float("nan"), 1.0, 1.0]])
    allowed = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    p = masked_softmax(s, allowed)
    torch.testing.assert_close(p[0], torch.softmax(torch.tensor([1.0, -1e30, 2.0]), -1))
    assert torch.equal(p[1], torch.zeros(3))                        # no key seen: 0, not NaN
    assert bool(torch.isnan(p[2, 0]))           # a seen NaN stays: the row's output p @ v is NaN
    assert bool(torch.isnan(p[2] @ torch.ones(3)))
    # not the contract: a plain softmax over the masked scores
    assert bool(torch.isnan(torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)[1]).all())
