"""FP4 E2M1 (NVFP4-style) codec: table, rounding, packing, micro scales, non-finite input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile.cache.fp4 import (
    E2M1_VALUES,
    FP4_SCALE_DIVISOR,
    fp4_decode,
    fp4_encode,
    fp4_scale,
    unpack_e2m1,
)
from kvcompile.errors import UnsupportedShapeError

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitudes of codes 0..7


def _e2m1_from_bits(code: int) -> float:
    # Bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa; exponent 0 is subnormal.
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return sign * mag


def _rne_codes(q: torch.Tensor) -> torch.Tensor:
    """Brute force: nearest magnitude on the grid (ties to the even code), saturating, sign bit
    from q. q: [M] fp32 finite."""
    mag = q.abs().clamp(max=6.0)
    dist = (mag[:, None] - GRID[None, :]).abs()                       # [M, 8]
    best = dist == dist.min(dim=1, keepdim=True).values
    even = best & (torch.arange(8)[None, :] % 2 == 0)
    code = torch.where(even.any(1), even.float().argmax(1), best.float().argmax(1))
    return code.to(torch.uint8) | (torch.signbit(q).to(torch.uint8) << 3)


def _encode_plain(values: torch.Tensor) -> torch.Tensor:
    """Encode values in 16-blocks whose first element is 6 (so micro = 1, scale 1 gives q = x);
    returns the 4-bit codes of values (the other 15 elements of each block)."""
    v = values.reshape(-1, 15)
    x = torch.cat([torch.full((v.shape[0], 1), 6.0), v], dim=1)       # [B, 16]
    packed, micro = fp4_encode(x, torch.ones(v.shape[0]))
    assert (micro.float() == 1.0).all()
    return unpack_e2m1(packed)[:, 1:].reshape(values.shape)


def test_e2m1_table_matches_bit_definition():
    expected = torch.tensor([_e2m1_from_bits(c) for c in range(16)])
    assert torch.equal(E2M1_VALUES, expected)
    assert torch.equal(torch.signbit(E2M1_VALUES), torch.arange(16) >= 8)  # code 8 is -0.0
    assert E2M1_VALUES.dtype == torch.float32


def test_decode_every_byte_low_nibble_first():
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)     # [16 vectors, 32 values]
    micro = torch.ones(16, 2, dtype=torch.float8_e4m3fn)
    out = fp4_decode(packed, micro, torch.ones(16))                   # [16, 32]
    byte = torch.arange(256).reshape(16, 16)
    assert torch.equal(out[:, 0::2], E2M1_VALUES[byte & 15])
    assert torch.equal(out[:, 1::2], E2M1_VALUES[byte >> 4])


def test_decode_applies_micro_then_scale():
    packed = torch.full((2, 8), 0x75, dtype=torch.uint8)              # codes 5 (3.0) and 7 (6.0)
    micro = torch.tensor([[0.5], [448.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.1, 3.0])
    out = fp4_decode(packed, micro, scale)
    assert torch.equal(out[0, :2], torch.tensor([3.0 * 0.5, 6.0 * 0.5]) * 0.1)
    assert torch.equal(out[1, :2], torch.tensor([3.0 * 448, 6.0 * 448]) * 3.0)


@pytest.mark.parametrize("x, code", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),   # ties to even
    (0.2, 0), (0.3, 1), (0.74, 1), (1.3, 3), (2.6, 5), (3.4, 5), (4.9, 6), (5.1, 7), (6.0, 7),
    (-0.25, 8), (-0.75, 10), (-1.25, 10), (-1.75, 12), (-2.5, 12), (-3.5, 14), (-5.0, 14),
    (-0.1, 8), (-6.0, 15), (0.0, 0), (-0.0, 8),
])
def test_encode_round_to_nearest_even(x, code):
    assert int(_encode_plain(torch.full((15,), x))[0]) == code


def test_encode_saturates_at_six():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2] = 100.0, -100.0, 50.0
    packed, micro = fp4_encode(x, torch.tensor([1.0]))
    assert float(micro[0, 0]) == 16.0                                  # e4m3(100 / 6) rounds down
    codes = unpack_e2m1(packed)[0]
    assert codes[:3].tolist() == [7, 15, 5]                            # 6.25 -> 6, 3.125 -> 3
    # A static scale too small for the data: micro clamps at 448, codes saturate at +-6.
    packed, micro = fp4_encode(torch.tensor([[1e6, -1e6] + [0.0] * 14]), torch.tensor([1.0]))
    assert float(micro[0, 0]) == 448.0
    assert unpack_e2m1(packed)[0, :2].tolist() == [7, 15]


def test_encode_matches_brute_force_rne():
    g = torch.Generator().manual_seed(0)
    mids = (GRID[1:] + GRID[:-1]) / 2
    ulp = torch.nextafter(mids, torch.tensor(10.0)) - mids
    special = torch.cat([GRID, mids, mids + ulp, mids - ulp, torch.tensor([5.999, 6.0])])
    rand = torch.rand(15 * 2000, generator=g) * 6.0
    values = torch.cat([special, -special, rand, -rand])
    values = torch.cat([values, torch.zeros((-values.numel()) % 15)])
    assert torch.equal(_encode_plain(values), _rne_codes(values))


def test_packing_order_element_2i_low_nibble():
    x = torch.tensor([[6.0, 1.0, 0.5, -2.0] + [0.0] * 12])
    packed, _ = fp4_encode(x, torch.tensor([1.0]))
    assert packed.shape == (1, 8) and packed.dtype == torch.uint8
    assert packed[0, 0].item() == (7 | 2 << 4) and packed[0, 1].item() == (1 | 12 << 4)


def test_micro_scale_is_e4m3_of_block_amax_over_6_over_scale():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    scale = fp4_scale(x, -1)                                           # [64, 1]
    _, micro = fp4_encode(x, scale)
    amax16 = x.abs().unflatten(-1, (8, 16)).amax(-1)                   # [64, 8]
    expected = (amax16 / 6.0 / scale).to(torch.float8_e4m3fn)
    assert torch.equal(micro.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scale[:, 0], x.abs().amax(-1) / FP4_SCALE_DIVISOR)


def test_scale_forms_agree():
    x = torch.randn(3, 5, 32)
    s = fp4_scale(x, -1)                                               # keepdim [3, 5, 1]
    a, b = fp4_encode(x, s), fp4_encode(x, s[..., 0])                  # per-vector [3, 5]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
    assert torch.equal(fp4_decode(*a, s), fp4_decode(*a, s[..., 0]))
    assert fp4_scale(torch.zeros(4, 32), -1).eq(1.0).all()


def test_roundtrip_of_stored_values_is_identity():
    # Any stored block whose largest code is +-6 re-encodes to the same bytes (idempotence).
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (500, 64), generator=g, dtype=torch.uint8)
    codes[:, ::16] = torch.where(torch.rand(500, 4, generator=g) < 0.5, 7, 15).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    micro = (2.0 ** torch.randint(-6, 8, (500, 4), generator=g)).to(torch.float8_e4m3fn)
    scale = torch.rand(500, generator=g) + 0.5
    x = fp4_decode(packed, micro, scale)
    packed2, micro2 = fp4_encode(x, scale)
    assert torch.equal(micro2.view(torch.uint8), micro.view(torch.uint8))
    assert torch.equal(packed2, packed)


def test_nonfinite_stays_in_its_micro_block():
    x = torch.randn(4, 64)
    x[1, 20] = float("nan")                                            # block 1 of vector 1
    x[2, 3] = float("inf")
    x[3, 40] = -float("inf")
    scale = fp4_scale(x, -1)
    assert torch.isfinite(scale).all()
    clean = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    assert torch.equal(scale, fp4_scale(clean, -1))
    out = fp4_decode(*fp4_encode(x, scale), scale)
    nan = torch.isnan(out)
    assert nan[1, 16:32].all() and nan.sum() == 16                     # exactly its own block
    ref = fp4_decode(*fp4_encode(clean, scale), scale)
    keep = ~nan
    keep[2, 3] = keep[3, 40] = False
    assert torch.equal(out[keep], ref[keep])
    _, micro = fp4_encode(x, scale)
    assert out[2, 3] == 6.0 * float(micro[2, 0]) * scale[2, 0]         # +Inf saturates
    assert out[3, 40] == -6.0 * float(micro[3, 2]) * scale[3, 0]


def test_micro_underflow_decodes_to_zero():
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    x[0, 16] = 1e-7                                                    # amax16/6/scale < 2^-10
    scale = fp4_scale(x, -1)
    packed, micro = fp4_encode(x, scale)
    assert float(micro[0, 1]) == 0.0
    out = fp4_decode(packed, micro, scale)
    assert out[0, 16] == 0.0 and torch.isfinite(out).all()


def test_head_dim_must_be_multiple_of_16():
    with pytest.raises(UnsupportedShapeError, match="multiple of 16"):
        fp4_encode(torch.randn(2, 24), torch.ones(2))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6), blocks=st.integers(1, 4),
    log_mag=st.floats(-40, 37), outlier=st.floats(-30, 30),
    kind=st.sampled_from(["gauss", "zeros", "tiny", "outlier", "sparse"]), seed=st.integers(0, 99),
)
def test_error_bound_property(rows, blocks, log_mag, outlier, kind, seed):
    # |decoded - x| <= 0.25 * max(|x|, micro * scale) (half a grid step, relative 1/4 at worst),
    # plus 6 * scale * 2^-6 for blocks whose micro falls in E4M3's subnormal range.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16 * blocks, generator=g) * 10.0 ** log_mag
    if kind == "zeros":
        x.zero_()
    elif kind == "tiny":
        x *= 1e-38
    elif kind == "outlier":
        x[0, 0] = 10.0 ** outlier * (1.0 + abs(log_mag))
    elif kind == "sparse":
        x *= torch.rand(x.shape, generator=g) < 0.1
    x = x.clamp(-3e38, 3e38)
    scale = fp4_scale(x, -1)
    packed, micro = fp4_encode(x, scale)
    out = fp4_decode(packed, micro, scale)
    denom = (micro.float().repeat_interleave(16, -1) * scale)
    bound = 0.25 * torch.maximum(x.abs(), denom) * (1 + 1e-5) + 6 * scale * 2.0 ** -6 + 1e-44
    assert ((out - x).abs() <= bound).all()
    assert torch.isfinite(out).all()
