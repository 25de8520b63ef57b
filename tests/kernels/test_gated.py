"""kernels/gated.py `act_mul_`: a gated MLP's product written into its merged gate / up
output. The Triton kernel (TRITON_INTERPRET on the CPU) against plain PyTorch in fp32 within
the dtype's tolerance; the torch path bit for bit the eager product; columns outside the gated
half untouched; bad arguments refused with the reason."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.kernels import gated  # noqa: E402
from kvcompile.testing import assert_rel_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

_ACT = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _case(seed, dtype, rows=(2, 5), width=40, extra=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*rows, 2 * width + extra, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("act", gated.ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["triton", "torch"])
@pytest.mark.parametrize("gate_first", [True, False])
def test_act_mul_matches_the_model_product(act, dtype, kernel, gate_first):
    width = 40 if kernel == "torch" else 1100       # > gated.BLOCK: two column programs
    y = _case(len(act) * 10 + gate_first, dtype, width=width)
    a, b = (0, width) if gate_first else (width, 0)
    before = y.clone()
    g, u = before[..., a:a + width], before[..., b:b + width]
    want32 = _ACT[act](g.float()) * u.float()
    gated.act_mul_(y, a, b, width, act, kernel=kernel)
    out = y[..., a:a + width]
    if kernel == "torch":   # the model's own ops in its dtype: the eager product exactly
        assert torch.equal(out, _ACT[act](g) * u)
    else:
        assert_rel_close(out.float(), want32, dtype, what=f"{act} {kernel}")
    rest = torch.ones(y.shape[-1], dtype=torch.bool)
    rest[a:a + width] = False
    assert torch.equal(y[..., rest], before[..., rest])   # the up half and the tail untouched


def test_rows_not_evenly_spaced_take_the_torch_path():
    """A y whose rows are not one stride apart (a transposed batch): the torch path writes
    through it; the Triton kernel refuses it by name."""
    base = _case(3, torch.float32, rows=(5, 2), width=8, extra=0)
    y = base.transpose(0, 1)                                   # [2, 5, 16], rows uneven
    before = y.clone()
    gated.act_mul_(y, 0, 8, 8, "silu")
    assert torch.equal(y[..., :8], F.silu(before[..., :8]) * before[..., 8:])
    assert torch.equal(base.transpose(0, 1), y)
    with pytest.raises(ValueError, match="fixed stride"):
        gated.act_mul_(y, 0, 8, 8, "silu", kernel="triton")


@pytest.mark.parametrize("args,match", [((0, 4, 8, "silu"), "disjoint"),
                                        ((0, 8, 9, "silu"), "disjoint"),
                                        ((0, 8, 8, "relu"), "not one of")])
def test_bad_arguments_are_refused(args, match):
    y = _case(1, torch.float32, width=8, extra=0)
    before = y.clone()
    with pytest.raises(ValueError, match=match):
        gated.act_mul_(y, *args)
    assert torch.equal(y, before)
