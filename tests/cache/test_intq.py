"""INT4 / INT2 asymmetric codec (intq.py): packing layout, range coverage, error bound, rounding,
non-finite confinement, fp16 parameter edge cases, SQNR."""

from __future__ import annotations

import pytest
import torch

from kvcompile.cache.intq import (
    PARAM_DTYPE,
    covers,
    int_codes,
    int_decode,
    int_encode,
    int_params,
    levels,
    pack,
    params_from_range,
    unpack,
)
from kvcompile.errors import UnsupportedShapeError
from kvcompile.testing import sqnr_db

BITS = (4, 3, 2)
# SQNR floors (dB), measured on standard Gaussian groups of 64 (min-max range, one scale and
# zero point per group): int4 17.2, int3 10.7, int2 2.7 (int2 has four levels). Set a little
# below.
INT_SQNR_FLOOR_DB = {4: 16.5, 3: 10.0, 2: 2.2}


@pytest.mark.parametrize("bits", BITS)
def test_pack_layout(bits):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, levels(bits) + 1, (5, 3, 32), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (5, 3, 32 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)
    # bit k of the packed row is bit (k % bits) of code k // bits, bytes little-endian
    row = packed[1, 2].tolist()
    stream = [(row[i // 8] >> (i % 8)) & 1 for i in range(8 * len(row))]
    want = [(int(c) >> b) & 1 for c in codes[1, 2] for b in range(bits)]
    assert stream == want


@pytest.mark.parametrize("bits", BITS)
def test_params_cover_range_and_bound_error(bits):
    # groups with large offsets and small spreads (key outlier channels) keep their resolution
    g = torch.Generator().manual_seed(1)
    offset = torch.tensor([0.0, 100.0, -3000.0, 1e-3, 20000.0])[:, None]
    spread = torch.tensor([1.0, 0.5, 2.0, 1e-4, 30.0])[:, None]
    x = offset + spread * torch.rand(5, 64, generator=g)
    s, z = int_params(x, -1, bits)
    assert s.dtype == PARAM_DTYPE and z.dtype == PARAM_DTYPE
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    assert covers(s, z, lo, hi, bits).all()
    # the covered range is at most the fp16 rounding of the offset wider than [lo, hi]
    width = levels(bits) * s.float()
    assert (width <= (hi - lo) * 1.002 + 2 * (z.float() - torch.nextafter(
        z, z.new_tensor(-torch.inf)).float()).abs() + 1e-9).all()
    dec = int_decode(int_encode(x, s, z, bits), s, z, bits)
    assert ((dec - x).abs() <= s.float() / 2 * (1 + 1e-5) + 1e-6 * x.abs()).all()


@pytest.mark.parametrize("bits", BITS)
def test_codes_round_half_to_even_and_saturate(bits):
    s = torch.tensor([[0.5]], dtype=PARAM_DTYPE)
    z = torch.tensor([[-1.0]], dtype=PARAM_DTYPE)
    L = levels(bits)
    q = torch.tensor([[0.0, 0.5, 1.5, 2.5, 0.49, 0.51, -3.0, L + 0.4, L + 7.0]])
    x = q * 0.5 - 1.0                                                    # exact in fp32
    want = torch.round(q).clamp(0, L).to(torch.uint8)                   # 0.5 -> 0, 1.5 -> 2 ...
    assert torch.equal(int_codes(x, s, z, bits), want)
    assert int_codes(x, s, z, bits)[0, 1] == 0 and int_codes(x, s, z, bits)[0, 2] == min(2, L)


@pytest.mark.parametrize("bits", BITS)
def test_nonfinite_confined_to_group(bits):
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[2, 1] = -float("inf")
    s, z = int_params(x, -1, bits)
    dec = int_decode(int_encode(x, s, z, bits), s, z, bits)
    assert torch.isnan(dec[1]).all() and not torch.isnan(dec[[0, 2, 3]]).any()
    fin = x[2, 2:]
    assert dec[2, 0] == pytest.approx(float(fin.max()), abs=float(s[2]) / 2 + 1e-6)
    assert dec[2, 1] == pytest.approx(float(fin.min()), abs=float(s[2]) / 2 + 1e-6)


@pytest.mark.parametrize("bits", BITS)
def test_constant_zero_and_empty_groups(bits):
    x = torch.tensor([[0.0] * 8, [3.25] * 8, [float("inf")] * 8])
    s, z = int_params(x, -1, bits)
    dec = int_decode(int_encode(x, s, z, bits), s, z, bits)
    assert torch.equal(dec[0], torch.zeros(8))
    assert torch.equal(dec[1], torch.full((8,), 3.25))                  # exact in fp16
    assert s[2] == 0 and z[2] == 0                                      # no finite value
    # a constant not representable in fp16 still decodes within one fp16 spacing
    c = torch.full((1, 8), 1000.3)
    s, z = int_params(c, -1, bits)
    assert (int_decode(int_encode(c, s, z, bits), s, z, bits) - c).abs().max() < 0.07


def test_params_saturate_at_fp16_max():
    x = torch.tensor([[-1e6, 0.0, 5.0, 1e6]])
    s, z = int_params(x, -1, 4)
    assert torch.isfinite(s.float()).all() and torch.isfinite(z.float()).all()
    dec = int_decode(int_encode(x, s, z, 4), s, z, 4)
    assert dec[0, 0] == pytest.approx(-65504, rel=1e-3) and dec[0, 3] >= 65000


def test_params_from_range_rounds_outward():
    lo = torch.tensor([100.01, -7.3, 0.0])
    hi = torch.tensor([100.03, 5.1, 0.0])
    s, z = params_from_range(lo, hi, 4)
    assert (z.float() <= lo).all() and (z.float() + 15 * s.float() >= hi).all()


def test_mask_selects_values():
    x = torch.tensor([[1.0, 2.0, 50.0, float("nan")]])
    m = torch.tensor([[True, True, False, False]])
    s, z = int_params(x, -1, 4, mask=m)
    assert float(z) == 1.0 and covers(s, z, torch.tensor(1.0), torch.tensor(2.0), 4).all()
    assert float(s) * 15 < 1.01


def test_head_dim_checks():
    with pytest.raises(UnsupportedShapeError, match="multiple of 8"):
        int_encode(torch.randn(2, 12), torch.ones(2, 1, dtype=PARAM_DTYPE),
                   torch.zeros(2, 1, dtype=PARAM_DTYPE), 3)
    with pytest.raises(UnsupportedShapeError, match="multiple of 4"):
        int_encode(torch.randn(2, 6), torch.ones(2, 1, dtype=PARAM_DTYPE),
                   torch.zeros(2, 1, dtype=PARAM_DTYPE), 2)
    with pytest.raises(UnsupportedShapeError, match="multiple of 2"):
        int_encode(torch.randn(2, 5), torch.ones(2, 1, dtype=PARAM_DTYPE),
                   torch.zeros(2, 1, dtype=PARAM_DTYPE), 4)


@pytest.mark.parametrize("bits", BITS)
def test_sqnr_floor_gaussian(bits):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, 64, generator=g)
    s, z = int_params(x, -1, bits)
    dec = int_decode(int_encode(x, s, z, bits), s, z, bits)
    assert sqnr_db(x, dec) >= INT_SQNR_FLOOR_DB[bits]
