"""The append kernels of branch append16b vs PagedTensor.write, bit for bit:

- the page-scaled bulk "tiles" kernel (`append.PAGE_BULK = "tiles"`), forced on for small
  writes with small tiles (4 pages of 4 tokens): fresh full pages on and off the tile grid,
  sequences of lengths not a multiple of the page, runs that start mid-page (a second and third
  chunk), several sequences, reserve order or shuffled (the device sort), bf16 / fp32 input,
  NaN / Inf, tiny and all-zero pages;
- fp4 rows loaded as element pairs in one word (`_load_pairs`) from bf16 / fp16 / fp32 input;
- a negative case: storage one ulp off in a page scale, or one code off, is told apart.
Runs under TRITON_INTERPRET=1 on the CPU; on CUDA with the hardware casts.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.kernels.append import quantize_append  # noqa: E402
from tests.kernels.kernel_cases import (  # noqa: E402
    DEV,
    assert_same_storage,
    make_format,
    storage_pair,
)

H, D, P = 2, 32, 4


def _tiles(monkeypatch, kernel="tiles"):
    import kvcompile.kernels.append as app

    monkeypatch.setattr(app, "PAGE_BULK", kernel)
    monkeypatch.setattr(app, "BULK_TOKENS", 0)            # every write takes the bulk kernel
    monkeypatch.setattr(app, "PAGE_TILE_ELEMS", 4 * P * D)  # tiles of 4 pages


def _pool_writes(name, grouped, dtype, writes, seed):
    """PagePool writes of the given per-sequence lengths; returns (ref, got) after each."""
    from kvcompile.cache.pool import LayerSpec, PagePool

    gen = torch.Generator().manual_seed(seed)
    fmt = make_format(name, "page")
    pool = PagePool([LayerSpec(H, D, D, fmt, fmt)], 64, P, device=DEV)
    got = pool.k[0]
    got.data.view(torch.uint8).fill_(0x5A)        # pages reused: earlier codes are garbage
    ref = copy.deepcopy(got)
    seqs = pool.allocate(len(writes[0]))
    for i, lens in enumerate(writes):
        slots = pool.reserve(seqs, lens)
        x = torch.randn(slots.numel(), H, D, generator=gen) * (1 + 6 * i)
        if i == 1:
            x[3, 1, 7] = float("nan")
            x[9, 0, 2] = float("inf")
        x = x.to(dtype)
        order = torch.arange(slots.numel()) if grouped else torch.randperm(slots.numel(),
                                                                             generator=gen)
        ref.write(slots[order].to(DEV), x[order].to(DEV))
        quantize_append(got, slots[order].to(DEV), x[order].to(DEV), grouped=grouped,
                        direct=True)
        yield i, ref, got


# five sequences: whole pages on the tile grid (4P, 2P), off it after a partial page (P + 3,
# 3P - 1), a single token; then chunks that start mid-page
WRITES = [[4 * P, P + 3, 2 * P, 1, 3 * P - 1], [5, P + 2, 2, 1, 2 * P], [4 * P, 2 * P + 1, P, 3, 1]]


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
@pytest.mark.parametrize("grouped,dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_tiles_kernel_bit_exact(name, grouped, dtype, monkeypatch):
    _tiles(monkeypatch)
    for i, ref, got in _pool_writes(name, grouped, dtype, WRITES, 5):
        assert_same_storage(ref, got, f"write {i}")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1"])
@pytest.mark.parametrize("grouped", [True, False])
def test_tiles_kernel_with_speculative_loads(name, grouped, monkeypatch):
    # PAGE_TILE_SPEC True: every row of x read before the full-page test, stores masked (the
    # default reads under the full-page mask)
    import kvcompile.kernels.append as app

    _tiles(monkeypatch)
    monkeypatch.setattr(app, "PAGE_TILE_SPEC", True)
    for i, ref, got in _pool_writes(name, grouped, torch.bfloat16, WRITES, 14):
        assert_same_storage(ref, got, f"write {i}")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1"])
def test_split_tiles_kernel_bit_exact(name, monkeypatch):
    # "split": full pages and the other runs in two launches of the tiles kernel
    _tiles(monkeypatch, "split")
    for i, ref, got in _pool_writes(name, False, torch.bfloat16, WRITES, 12):
        assert_same_storage(ref, got, f"write {i}")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1"])
def test_runs_kernel_still_bit_exact(name, monkeypatch):
    # "runs", the default before "tiles" (eleventh session), stays selectable: still exact
    _tiles(monkeypatch, "runs")
    for i, ref, got in _pool_writes(name, False, torch.float32, WRITES, 9):
        assert_same_storage(ref, got, f"write {i}")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1"])
def test_tiles_kernel_tiny_and_zero_pages(name, monkeypatch):
    # amax / divisor below 2^-126 (the scale is clamped there), an all-zero page (scale 1.0)
    _tiles(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    ref, got = storage_pair(make_format(name, "page"), 6, H, P, D)
    x = torch.randn(4 * P, H, D, generator=gen)
    x[:P] *= 1e-38
    x[P:2 * P] = 0.0
    slots = torch.arange(4 * P, device=DEV)
    ref.write(slots, x.to(DEV))
    quantize_append(got, slots, x.to(DEV), grouped=True, direct=True)
    assert_same_storage(ref, got, "tiny pages")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1"])
def test_tiles_wrong_scale_or_code_is_caught(name, monkeypatch):
    # the comparison the tests above rest on: one page scale one ulp off, or one code byte
    # off, must fail it (else a kernel writing a wrong scale could pass)
    _tiles(monkeypatch)
    *_, (_, ref, got) = _pool_writes(name, True, torch.bfloat16, [[4 * P, 2 * P]], 7)
    assert_same_storage(ref, got, "before")
    s = got.scale.view(-1)
    k = int(s.argmax())
    bad = copy.deepcopy(got)
    bad.scale.view(-1)[k] = torch.nextafter(s[k].cpu(), torch.tensor(float("inf"))).item()
    with pytest.raises(AssertionError, match="scale differs"):
        assert_same_storage(ref, bad, "one ulp")
    bad = copy.deepcopy(got)
    bad.data.view(torch.uint8).view(-1)[0] ^= 1
    with pytest.raises(AssertionError, match="data differs"):
        assert_same_storage(ref, bad, "one code")


@pytest.mark.parametrize("gran", ["token", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp4_rows_pair_loads_bit_exact(gran, dtype, monkeypatch):
    # fp4 rows from each input width (pairs loaded as int32 / int64 words), slots mid-page
    import kvcompile.kernels.append as app

    monkeypatch.setattr(app, "FP4_PAIR_LOADS", True)
    gen = torch.Generator().manual_seed(8)
    ref, got = storage_pair(make_format("fp4_e2m1", gran), 6, H, P, 64)
    for i, slots in enumerate([torch.tensor([2, 3, 9, 10, 11, 12, 20]), torch.tensor([4, 13])]):
        x = (torch.randn(slots.numel(), H, 64, generator=gen) * (1 + 5 * i)).to(dtype)
        x[0, 1, 5] = float("nan") if i else x[0, 1, 5]
        ref.write(slots.to(DEV), x.to(DEV))
        quantize_append(got, slots.to(DEV), x.to(DEV))
        assert_same_storage(ref, got, f"write {i}")
