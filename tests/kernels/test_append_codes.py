"""The append kernel's fast encode arithmetic against the reference encoders, over dense sets.

- `_e2m1_magnitude` (integer e2m1 rounding) vs fp4.e2m1_codes (bucketize on midpoints): every
  fp32 of the binades that hold a rounding boundary ([2^-3, 8): 50M values), plus neighbourhoods
  of every grid point and midpoint, subnormals, +-0, +-Inf, the largest floats, both signs.
- `append_int.rn_quotient` (x * RN(1/d) and one residual fma) vs the correctly rounded x / d (torch's
  division), on x near c * d for every rounding boundary c of e2m1 / e4m3 / e5m2, d with
  extreme mantissas, and random pairs; a plain x * RN(1/d) must differ on the same set, so the
  set tells the two apart.
- The bulk page-scaled kernel with small windows (runs crossing windows, pages with earlier
  tokens, NaN / Inf, tiny amax) vs PagedTensor.write.
Runs under TRITON_INTERPRET=1 on the CPU (numpy fp32, a true fp32 fma); on CUDA with hardware.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvcompile.cache.fp4 import e2m1_codes  # noqa: E402
from kvcompile.kernels.append import _e2m1_magnitude, quantize_append  # noqa: E402
from kvcompile.kernels.append_int import rn_quotient  # noqa: E402
from tests.kernels.kernel_cases import (  # noqa: E402
    DEV,
    assert_same_storage,
    make_format,
    storage_pair,
)

BLOCK = 1 << 20


@triton.jit
def _codes_kernel(Q, OUT, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    q = tl.load(Q + i, mask=i < N, other=0.0)
    c = _e2m1_magnitude(tl.abs(q)) | ((q.to(tl.int32, bitcast=True) >> 28) & 8)
    tl.store(OUT + i, c.to(tl.uint8), mask=i < N)


@triton.jit
def _quotient_kernel(X, Dv, OUT, MAG, NAIVE, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < N, other=1.0)
    d = tl.load(Dv + i, mask=i < N, other=1.0)
    y = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), d)
    tl.store(OUT + i, rn_quotient(x, y, d, True), mask=i < N)
    tl.store(MAG + i, rn_quotient(x, y, d), mask=i < N)
    tl.store(NAIVE + i, x * y, mask=i < N)


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64)


def _kernel_codes(q: torch.Tensor) -> torch.Tensor:
    q = q.to(DEV).contiguous()
    out = torch.empty(q.shape, dtype=torch.uint8, device=DEV)
    _codes_kernel[(triton.cdiv(q.numel(), BLOCK),)](q, out, q.numel(), BLOCK=BLOCK)
    return out.cpu()


def _check_codes(q: torch.Tensor) -> None:
    q = torch.cat([q, -q])
    want = e2m1_codes(q, torch.ones(()))
    got = _kernel_codes(q)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (f"{bad.numel()} codes differ, e.g. q={q[bad[0]].item()!r} "
                              f"kernel {got[bad[0]].item()} reference {want[bad[0]].item()}")


GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def test_e2m1_codes_match_reference_on_every_float_of_the_boundary_binades():
    lo, hi = _bits(torch.tensor([0.125])).item(), _bits(torch.tensor([8.0])).item()
    step = 1 << 24
    for a in range(lo, hi, step):
        _check_codes(_f32(torch.arange(a, min(a + step, hi), dtype=torch.int64)))


def test_e2m1_codes_match_reference_on_specials_and_neighbourhoods():
    pts = torch.tensor(GRID[1:] + MIDPOINTS + [7.0, 8.0, 12.0, 0.125, 2.0 ** -126, 3e38])
    around = (_bits(pts)[:, None] + torch.arange(-4096, 4097)[None, :]).flatten()
    sub = torch.arange(0, 1 << 23, 997, dtype=torch.int64)              # subnormals
    every_exp = (torch.arange(0, 255, dtype=torch.int64)[:, None] << 23) + torch.randint(
        0, 1 << 23, (255, 256), generator=torch.Generator().manual_seed(0))
    specials = torch.tensor([0.0, float("inf"), 3.4028234663852886e38, 1e-45, 1.17549435e-38])
    q = torch.cat([_f32(around), _f32(sub), _f32(every_exp.flatten()), specials])
    assert (q == 0.75).any() and (q == 2.5).any()   # the ties are in the set
    _check_codes(q)


def _boundaries() -> torch.Tensor:
    # e2m1 midpoints, and every rounding boundary of e4m3 / e5m2 (midpoints between codes)
    b = list(MIDPOINTS) + [6.5]
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
        v = v[torch.isfinite(v) & (v > 0)].sort().values
        b += ((v[1:] + v[:-1]) / 2).tolist() + [v[0].item() / 2]
    return torch.tensor(b, dtype=torch.float32)


def test_quotient_is_the_correctly_rounded_division():
    gen = torch.Generator().manual_seed(3)
    # divisors: extreme mantissas (near 1 and near 2), e4m3 values times random scales, random
    edge = torch.cat([0x3F800000 + torch.arange(0, 64), 0x3FFFFFFF - torch.arange(0, 64)])
    e4 = torch.arange(1, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    d = torch.cat([_f32(edge), e4 * torch.rand(e4.shape, generator=gen).add(0.5),
                   torch.rand(192, generator=gen) * 1.5 + 0.5])
    d = d * 2.0 ** torch.randint(-70, 70, d.shape, generator=gen).float()
    bnd = _boundaries()
    # x = RN(c * d) and its neighbours within 8 ulps, for every (boundary c, divisor d)
    x0 = _bits((bnd[:, None] * d[None, :]).flatten())
    x = _f32((x0[:, None] + torch.arange(-8, 9)[None, :]).flatten())
    dd = d[None, :].expand(bnd.numel(), -1).flatten().repeat_interleave(17)
    rx = torch.randn(1 << 18, generator=gen) * 2.0 ** torch.randint(-20, 20, (1 << 18,),
                                                                     generator=gen).float()
    rd = (torch.rand(1 << 18, generator=gen) + 0.5) * 2.0 ** torch.randint(
        -60, 60, (1 << 18,), generator=gen).float()
    x = torch.cat([x, -x, rx, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2.0 ** -101])])
    dd = torch.cat([dd, dd, rd, torch.tensor([3.0, 3.0, 2.0 ** -60, 7.0, 2.0 ** -70])])
    out, mag, naive = (torch.empty_like(x).to(DEV) for _ in range(3))
    _quotient_kernel[(triton.cdiv(x.numel(), BLOCK),)](x.to(DEV), dd.to(DEV), out, mag, naive,
                                                      x.numel(), BLOCK=BLOCK)
    want = x / dd
    got = out.cpu()
    bad = (_bits(got) != _bits(want)).nonzero()
    assert bad.numel() == 0, (f"{bad.numel()} quotients differ, e.g. {x[bad[0]].item()!r} / "
                              f"{dd[bad[0]].item()!r}: {got[bad[0]].item()!r} vs "
                              f"{want[bad[0]].item()!r}")
    # without the sign fix the magnitude is the same (fp4 takes the sign from x)
    assert torch.equal(mag.cpu().abs(), want.abs())
    assert (_bits(naive.cpu()) != _bits(want)).any()   # the set separates x * RN(1/d) from x / d


# --- the bulk page-scaled kernel, small windows ---------------------------------------------

def _bulk(monkeypatch):
    import kvcompile.kernels.append as app

    monkeypatch.setattr(app, "PAGE_BULK", "windows")    # the bulk kernel, not the default
    monkeypatch.setattr(app, "BULK_TOKENS", 0)          # every write takes the bulk kernel
    monkeypatch.setattr(app, "BULK_TILE_ELEMS", 1)      # windows of 2 * page_size tokens


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
@pytest.mark.parametrize("grouped", [True, False])
def test_bulk_page_kernel_small_windows_bit_exact(name, grouped, monkeypatch):
    # sequences of odd lengths (runs cross windows, start mid-page), then a second chunk (pages
    # with earlier tokens, scales that grow), in reserve order or shuffled (the device sort)
    from kvcompile.cache.pool import LayerSpec, PagePool

    _bulk(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    H, D, P = 2, 32, 4
    fmt = make_format(name, "page")
    pool = PagePool([LayerSpec(H, D, D, fmt, fmt)], 40, P, device=DEV)
    got = pool.k[0]
    got.data.view(torch.uint8).fill_(0x5A)        # pages reused: earlier codes are garbage
    ref = copy.deepcopy(got)
    seqs = pool.allocate(4)
    for i, lens in enumerate([[P + 3, 2 * P, 1, 3 * P - 1], [5, P + 2, 2, 1]]):
        slots = pool.reserve(seqs, lens)
        x = torch.randn(slots.numel(), H, D, generator=gen) * (1 + 6 * i)
        if i == 1:
            x[3, 1, 7] = float("nan")
            x[9, 0, 2] = float("inf")
        order = torch.arange(slots.numel()) if grouped else torch.randperm(slots.numel(),
                                                                             generator=gen)
        ref.write(slots[order].to(DEV), x[order].to(DEV))
        quantize_append(got, slots[order].to(DEV), x[order].to(DEV), grouped=grouped,
                        direct=True)
        assert_same_storage(ref, got, f"write {i}")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1"])
def test_bulk_page_kernel_tiny_and_zero_pages(name, monkeypatch):
    # amax / divisor below 2^-126 (the scale is clamped there), an all-zero page (scale 1.0)
    _bulk(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    H, D, P = 2, 32, 4
    ref, got = storage_pair(make_format(name, "page"), 6, H, P, D)
    x = torch.randn(3 * P, H, D, generator=gen)
    x[:P] *= 1e-38
    x[P:2 * P] = 0.0
    slots = torch.arange(3 * P, device=DEV)
    ref.write(slots, x.to(DEV))
    quantize_append(got, slots, x.to(DEV), grouped=True, direct=True)
    assert_same_storage(ref, got, "tiny pages")
