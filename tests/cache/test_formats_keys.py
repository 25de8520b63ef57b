"""Key-aware storage: int4 / int2 asymmetric pages, channel-granular scales (fp8, fp4 micro
scales along tokens, int), their layouts and sizes, bit-exact writes of whole pages against the
codecs, appends (sticky scales), non-finite confinement, copies and errors."""

from __future__ import annotations

import pytest
import torch

from kvcompile.cache.formats import KVFormat, PagedTensor
from kvcompile.cache.fp4 import (
    E2M1_VALUES,
    FP4_SCALE_DIVISOR,
    e2m1_codes,
    micro_scale,
    pack_e2m1,
    unpack_e2m1,
)
from kvcompile.cache.fp8 import fp8_encode
from kvcompile.cache.intq import int_decode, int_encode, int_params
from kvcompile.errors import KVConfigError, UnsupportedShapeError
from kvcompile.testing import SQNR_FLOOR_DB, sqnr_db

INT_GRANS = [(n, g) for n in ("int4", "int3", "int2") for g in ("page", "token", "channel")]
CHANNEL = [("fp8_e4m3", "channel"), ("fp8_e5m2", "channel"), ("fp4_e2m1", "channel"),
           ("int4", "channel"), ("int2", "channel")]
ALL_NEW = sorted(set(INT_GRANS + CHANNEL))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _tokens(t: PagedTensor, n_pages: int) -> torch.Tensor:
    pages = t.read(torch.arange(n_pages))                               # [n, H, P, D]
    return pages.permute(0, 2, 1, 3).reshape(-1, t.num_heads, t.head_dim)


def _keys(n: int, h: int, d: int, seed: int = 0) -> torch.Tensor:
    """Key-like data [n, h, d]: Gaussian plus two outlier channels with a large offset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g)
    x[..., 3] = 12.0 + 0.5 * x[..., 3]
    x[..., 7] *= 9.0
    return x


# --- layout and sizes --------------------------------------------------------------------------

@pytest.mark.parametrize("name, gran", ALL_NEW)
def test_allocate_layout(name, gran):
    N, H, P, D = 5, 3, 16, 32
    fmt = KVFormat(name, gran)
    t = fmt.allocate(N, H, P, D)
    bits = {"int4": 4, "int3": 3, "int2": 2, "fp4_e2m1": 4}.get(name, 8)
    assert t.data.shape == (N, H, P, D * bits // 8)
    sdt = torch.float16 if fmt.is_int else torch.float32
    shape = {"page": (N, H), "token": (N, H, P), "channel": (N, H, D)}[gran]
    if name == "fp4_e2m1":
        shape = (N, H)
        assert t.micro.shape == (N, H, P // 16, D) and t.micro.dtype == torch.float8_e4m3fn
    assert t.scale.shape == shape and t.scale.dtype == sdt
    assert (t.zero is not None) == fmt.is_int
    if fmt.is_int:
        assert t.zero.shape == shape and t.zero.dtype == torch.float16
    assert t.nbytes() == pytest.approx(N * P * fmt.bytes_per_token(H, D, P), abs=1e-6)


def test_bytes_per_token():
    h, d, p = 8, 128, 16
    assert KVFormat("int4", "token").bytes_per_token(h, d, p) == 8 * (64 + 4)
    assert KVFormat("int2", "token").bytes_per_token(h, d, p) == 8 * (32 + 4)
    assert KVFormat("int3", "token").bytes_per_token(h, d, p) == 8 * (48 + 4)
    assert KVFormat("int4", "page").bytes_per_token(h, d, p) == 8 * (64 + 4 / 16)
    assert KVFormat("int4", "channel").bytes_per_token(h, d, p) == 8 * (64 + 4 * 128 / 16)
    assert KVFormat("int4", "channel").bytes_per_token(h, d, 128) == 8 * (64 + 4)
    assert KVFormat("fp8_e4m3", "channel").bytes_per_token(h, d, p) == 8 * (128 + 4 * 128 / 16)
    assert KVFormat("fp4_e2m1", "channel").bytes_per_token(h, d, p) == 8 * (64 + 8 + 4 / 16)
    assert KVFormat("int4", "token").bits_per_element(d, p) == 4.25
    assert KVFormat("fp4_e2m1", "page").bits_per_element(64, 16) == 4.53125


def test_format_errors():
    with pytest.raises(KVConfigError, match="scale_granularity"):
        KVFormat("int2", "tensor")
    with pytest.raises(KVConfigError, match="static_scale"):
        KVFormat("int4", "page", static_scale=1.0)
    with pytest.raises(UnsupportedShapeError, match="multiple of 16"):
        KVFormat("fp4_e2m1", "channel").allocate(2, 1, 8, 32)        # page of 8 tokens
    with pytest.raises(UnsupportedShapeError, match="multiple of 4"):
        KVFormat("int2", "token").allocate(2, 1, 16, 30)
    KVFormat("fp4_e2m1", "channel").allocate(2, 1, 16, 40)            # D needs only be even


# --- whole pages: bit-exact against the codecs ---------------------------------------------------

@pytest.mark.parametrize("name, gran", INT_GRANS)
def test_int_write_matches_codec(name, gran):
    N, H, P, D = 3, 2, 16, 32
    x = _keys(N * P, H, D)
    t = KVFormat(name, gran).allocate(N, H, P, D)
    t.write(torch.arange(N * P), x)
    bits = t.fmt.int_bits
    blocks = x.reshape(N, P, H, D).transpose(1, 2)                     # [N, H, P, D]
    dims = {"page": (2, 3), "token": (3,), "channel": (2,)}[gran]
    s, z = int_params(blocks, dims, bits)
    assert torch.equal(t.data, int_encode(blocks, s, z, bits))
    squeeze = {"page": lambda a: a[..., 0, 0], "token": lambda a: a[..., 0],
               "channel": lambda a: a[:, :, 0, :]}[gran]
    assert torch.equal(t.scale, squeeze(s)) and torch.equal(t.zero, squeeze(z))
    dec = t.read(torch.arange(N))
    assert torch.equal(dec, int_decode(int_encode(blocks, s, z, bits), s, z, bits))
    assert ((dec - blocks).abs() <= s.float() / 2 * (1 + 1e-5) + 1e-5).all()


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_channel_write_matches_codec(name):
    N, H, P, D = 2, 2, 16, 32
    x = _keys(N * P, H, D, seed=2)
    t = KVFormat(name, "channel").allocate(N, H, P, D)
    t.write(torch.arange(N * P), x)
    blocks = x.reshape(N, P, H, D).transpose(1, 2)
    fmax = t.fmt.fmax
    scale = blocks.abs().amax(2, keepdim=True) / fmax                   # [N, H, 1, D]
    assert torch.equal(t.scale, scale[:, :, 0])
    codes = fp8_encode(blocks, scale, t.fmt.storage_dtype)
    assert torch.equal(_bytes(t.data), _bytes(codes))
    assert torch.equal(t.read(torch.arange(N)), codes.float() * scale)


def test_fp4_channel_write_matches_codec():
    N, H, P, D = 2, 2, 32, 32
    x = _keys(N * P, H, D, seed=3)
    t = KVFormat("fp4_e2m1", "channel").allocate(N, H, P, D)
    t.write(torch.arange(N * P), x)
    blocks = x.reshape(N, P, H, D).transpose(1, 2)                     # [N, H, P, D]
    scale = blocks.abs().amax((2, 3)) / FP4_SCALE_DIVISOR               # [N, H]
    assert torch.equal(t.scale, scale)
    groups = blocks.view(N, H, P // 16, 16, D)
    micro = micro_scale(groups.abs().amax(3), scale[:, :, None, None])  # [N, H, G, D]
    assert torch.equal(_bytes(t.micro), _bytes(micro))
    m = micro.float().repeat_interleave(16, 2)
    codes = e2m1_codes(blocks, m * scale[:, :, None, None])
    assert torch.equal(t.data, pack_e2m1(codes))
    want = E2M1_VALUES[unpack_e2m1(t.data).long()] * m * scale[:, :, None, None]
    assert torch.equal(t.read(torch.arange(N)), want)


# --- appends -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_channel_growth_keeps_earlier_tokens_exact(name):
    H, P, D = 2, 16, 32
    t = KVFormat(name, "channel").allocate(1, H, P, D)
    x = _keys(P, H, D, seed=4) * torch.linspace(1, 30, P)[:, None, None]
    for o in range(P):
        before = t.read(torch.arange(1))[:, :, :o].clone()
        t.write(torch.tensor([o]), x[o:o + 1])
        assert torch.equal(t.read(torch.arange(1))[:, :, :o], before)
    assert sqnr_db(x, _tokens(t, 1)) > SQNR_FLOOR_DB[name] - 1


@pytest.mark.parametrize("name, gran", [("int4", "page"), ("int4", "channel"),
                                        ("int2", "channel"), ("fp4_e2m1", "channel")])
def test_grouped_scales_are_sticky(name, gran):
    # Tokens inside the range already covered leave the earlier tokens' bytes untouched; a token
    # outside it re-encodes them (within one step of their values).
    H, P, D = 2, 16, 32
    t = KVFormat(name, gran).allocate(1, H, P, D)
    x = _keys(P, H, D, seed=5)
    x[1] = -x[0]                                                        # every channel: [-a, a]
    g = torch.Generator().manual_seed(0)
    x[2:8] = x[0] * (torch.rand(6, H, D, generator=g) * 1.6 - 0.8)      # inside that range
    t.write(torch.arange(2), x[:2])
    first = _bytes(t.data).clone()
    for o in range(2, 8):
        t.write(torch.tensor([o]), x[o:o + 1])
    assert torch.equal(_bytes(t.data)[:, :, :2], first[:, :, :2])
    x[8] *= 5.0                                                         # outside: widens
    for o in range(8, P):
        t.write(torch.tensor([o]), x[o:o + 1])
    whole = KVFormat(name, gran).allocate(1, H, P, D)
    whole.write(torch.arange(P), x)
    one, all_at_once = sqnr_db(x, _tokens(t, 1)), sqnr_db(x, _tokens(whole, 1))
    assert one > all_at_once - 3.5, (one, all_at_once)


@pytest.mark.parametrize("name, gran", ALL_NEW)
def test_partial_pages_and_reuse(name, gran):
    # Three and a half pages, then the pages reused from offset 0 by other data: stale contents
    # (and stale scales) never leak into the new tokens.
    N, H, P, D = 4, 2, 16, 32
    t = KVFormat(name, gran).allocate(N, H, P, D)
    x = _keys(N * P, H, D, seed=6) * 100
    t.write(torch.arange(N * P - P // 2), x[:N * P - P // 2])
    y = _keys(N * P, H, D, seed=7)
    t.write(torch.arange(N * P), y)
    fresh = KVFormat(name, gran).allocate(N, H, P, D)
    fresh.write(torch.arange(N * P), y)
    assert torch.equal(t.read(torch.arange(N)), fresh.read(torch.arange(N)))


@pytest.mark.parametrize("name, gran", ALL_NEW)
def test_nonfinite_confined(name, gran):
    N, H, P, D = 2, 2, 16, 32
    x = _keys(N * P, H, D, seed=8)
    x[5, 1, 9] = float("nan")
    t = KVFormat(name, gran).allocate(N, H, P, D)
    t.write(torch.arange(N * P), x)
    out = _tokens(t, N)
    nan = torch.isnan(out)
    assert nan[5, 1, 9]
    # the NaN stays inside its scale group: head 1 of page 0 at most
    nan[0:P, 1] = False
    assert not nan.any()
    assert torch.isfinite(out[P:]).all() and torch.isfinite(out[:, 0]).all()


@pytest.mark.parametrize("name, gran", ALL_NEW)
def test_copy_pages(name, gran):
    N, H, P, D = 4, 2, 16, 32
    t = KVFormat(name, gran).allocate(N, H, P, D)
    t.write(torch.arange(2 * P), _keys(2 * P, H, D, seed=9))
    t.copy_pages([0, 1], [3, 2])
    got = t.read(torch.tensor([3, 2]))
    assert torch.equal(got, t.read(torch.tensor([0, 1])))


def test_channel_scales_beat_page_scales_on_key_outliers():
    N, H, P, D = 8, 2, 64, 64
    x = _keys(N * P, H, D, seed=10)
    res = {}
    for name, gran in [("int4", "page"), ("int4", "token"), ("int4", "channel"),
                       ("fp8_e4m3", "page"), ("fp8_e4m3", "channel")]:
        t = KVFormat(name, gran).allocate(N, H, P, D)
        t.write(torch.arange(N * P), x)
        res[name, gran] = sqnr_db(x, _tokens(t, N))
    assert res["int4", "channel"] > res["int4", "token"] + 6 > res["int4", "page"] + 6
    assert res["fp8_e4m3", "channel"] >= res["fp8_e4m3", "page"]
