"""skinny_linear (kernels/skinny.py) against F.linear in float64, on fresh random inputs:
every M up to 16, narrow and wide N, K not a multiple of the tile, bias, the split-K pass,
leading dims; and the inputs it refuses. On the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from kvcompile.kernels.skinny import pick, skinny_linear  # noqa: E402
from kvcompile.testing import REL_ERR, rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # M, N, K, bias, config (None: the rule's)
    (1, 96, 200, False, None),
    (5, 64, 256, True, None),
    (16, 160, 384, False, dict(BN=32, BK=64, split=1, stages=2, warps=4)),
    (16, 40, 640, True, dict(BN=32, BK=64, split=4, stages=2, warps=4)),   # split-K, ragged N
    (7, 33, 130, False, dict(BN=32, BK=64, split=2, stages=2, warps=4)),   # K not of whole tiles
    (3, 128, 64, True, dict(BN=64, BK=64, split=1, stages=2, warps=4)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,bias,cfg", CASES)
def test_matches_linear(M, N, K, bias, cfg, dtype):
    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("the interpreter's bf16 tl.dot returns garbage (REFERENCE.md): a GPU case")
    g = torch.Generator().manual_seed(hash((M, N, K, bias, str(dtype))) % 2**31)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    y = skinny_linear(x, w, b, config=cfg)
    assert y.shape == (M, N) and y.dtype == dtype
    tol = REL_ERR[torch.float16] if dtype == torch.float32 and DEV == "cuda" else REL_ERR[dtype]
    assert rel_err(y, ref) <= tol, (rel_err(y, ref), tol)


def test_leading_dims_and_no_rows():
    x = torch.randn(2, 3, 64).to(DEV, torch.float32)
    w = torch.randn(48, 64).to(DEV, torch.float32)
    y = skinny_linear(x, w, config=dict(BN=32, BK=32, split=1, stages=2, warps=4))
    assert y.shape == (2, 3, 48)
    assert rel_err(y, F.linear(x.double(), w.double())) <= REL_ERR[torch.float16]
    assert skinny_linear(x[:0], w).shape == (0, 3, 48)


def test_refuses_what_it_does_not_take():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="more than its 16"):
        skinny_linear(torch.randn(17, 64), w)
    with pytest.raises(ValueError, match="contiguous rows"):
        skinny_linear(torch.randn(4, 64), torch.randn(64, 32).t())
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(torch.randn(4, 64), w.half())


def test_the_rule_fills_the_gpu():
    # wide N: no split, at least two programs an SM; narrow N with a long K: split
    assert pick(16, 28672, 4096, 132) == dict(BN=64, BK=128, split=1, stages=4, warps=4)
    assert pick(16, 4096, 4096, 132)["split"] == 4   # 128 column blocks x 4 >= 264
    c = pick(16, 4096, 14336, 132)
    assert c["BN"] == 32 and c["split"] >= 2
    assert pick(16, 512, 256, 132)["split"] == 1   # too few K tiles to split
