"""A storage format added from outside the package, end to end on the reference path.

This file is the "one new module" of docs/adding-a-format.md: it declares a toy format (int8,
symmetric, one fp32 scale per token) with `register_format` and nothing else, then compiles a
tiny HF model with it and generates. No package file names the format (checked below), so
adding a format touches no package module. The format's encode / decode here are also the
plain-PyTorch reference the pages are checked against.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import kvcompile
from kvcompile.api import state_of
from kvcompile.cache.formats import KVFormat, format_table, resolve_format
from kvcompile.cache.registry import (
    FormatSpec,
    Part,
    format_names,
    register_format,
    unregister_format,
)
from kvcompile.config import KVConfig
from kvcompile.errors import KVConfigError
from kvcompile.testing import sqnr_db
from tests.engine.tiny import config, make_hf

NAME = "toy_int8"


# --- the toy format: int8 codes, scale = finite amax / 127 per (page, head, token) -------------

def _parts(fmt, n, h, p, d):
    return {"data": Part((n, h, p, d), torch.int8),          # codes
            "scale": Part((n, h, p), torch.float32, 1.0)}    # one per token


def _token_scale(x):
    # x: [..., D] -> [...]: finite amax / 127, 1.0 for an all-zero (or non-finite) row
    amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(-1)
    return torch.where(amax > 0, amax / 127, 1.0)


def _encode(fmt, tile, valid):
    # tile: [U, H, P, D] fp32; valid: [U, P] (unused: every token has its own scale)
    scale = _token_scale(tile)                                   # [U, H, P]
    codes = torch.round(tile / scale[..., None]).clamp(-127, 127).nan_to_num(0.0)
    return {"data": codes.to(torch.int8), "scale": scale}


def _decode(fmt, parts):
    # parts: data [n, H, P, D] int8, scale [n, H, P] -> [n, H, P, D] fp32
    return parts["data"].float() * parts["scale"][..., None]


TOY = FormatSpec(NAME, torch.int8, 8, granularities=("token",), fmax=127.0,
                 scale_divisor=127.0, default_value_granularity="token",
                 parts=_parts, encode=_encode, decode=_decode)


@pytest.fixture(scope="module", autouse=True)
def toy():
    register_format(TOY)
    yield TOY
    unregister_format(NAME)


def _reference(x):
    # x: [T, H, D] -> its round trip through the toy format, in plain PyTorch
    s = _token_scale(x)[..., None]
    return torch.round(x / s).clamp(-127, 127) * s


# --- the format itself ---------------------------------------------------------------------------

def test_no_package_module_names_the_toy_format():
    root = pathlib.Path(kvcompile.__file__).parent
    assert not [p for p in root.rglob("*.py") if NAME in p.read_text()]


def test_registered_everywhere_that_lists_formats():
    assert NAME in format_names()
    KVConfig(kv_dtype=NAME, scale_granularity="token")      # config validation
    assert resolve_format(NAME, torch.float32, "token").name == NAME
    rows = [r for r in format_table(2, 2, 32, 16) if r["format"] == NAME]
    assert [r["granularity"] for r in rows] == ["token"]
    assert rows[0]["bytes_per_token"] == 2 * 2 * 2 * (32 + 4)  # layers x (K, V) x heads


def test_pages_round_trip_against_reference():
    g = torch.Generator().manual_seed(0)
    pages = KVFormat(NAME, "token").allocate(4, 2, 8, 32)
    x = torch.randn(13, 2, 32, generator=g)
    pages.write(torch.arange(13), x[:13])             # two pages and a partial one
    pages.write(torch.tensor([13, 14]), torch.randn(2, 2, 32, generator=g))
    got = pages.read(torch.tensor([0, 1]))            # [2, H, P, D]
    want = _reference(x[:13])[:8].permute(1, 0, 2), _reference(x[8:13]).permute(1, 0, 2)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1, :, :5], want[1], rtol=0, atol=0)
    assert sqnr_db(x[:8].permute(1, 0, 2), got[0]) > 38.0
    # bytes per token as declared = bytes held per slot
    assert pages.nbytes() == pages.num_pages * pages.page_size * KVFormat(
        NAME, "token").bytes_per_token(2, 32, 8)


def test_compaction_moves_tokens_of_the_toy_format():
    from kvcompile.cache.compaction import move_slots

    g = torch.Generator().manual_seed(2)
    pages = KVFormat(NAME, "token").allocate(3, 2, 8, 32)
    x = torch.randn(16, 2, 32, generator=g)
    pages.write(torch.arange(16), x)
    before = pages.read(torch.tensor([0, 1])).permute(0, 2, 1, 3).reshape(16, 2, 32)
    src = torch.tensor([9, 11, 13, 9])                # page 1's tokens -> page 0's slots 2..
    dst = torch.tensor([2, 3, 4, 2])
    heads = torch.tensor([0, 0, 0, 1])
    move_slots(pages, src, dst, heads)
    after = pages.read(torch.tensor([0])).permute(0, 2, 1, 3).reshape(8, 2, 32)
    for s_, d_, h in zip(src.tolist(), dst.tolist(), heads.tolist()):
        torch.testing.assert_close(after[d_, h], before[s_, h], rtol=0, atol=0)
    torch.testing.assert_close(after[:2], before[:2], rtol=0, atol=0)  # untouched slots


# --- end to end: a tiny HF model compiled with the toy format --------------------------------

def test_generate_with_toy_format():
    ref = make_hf("llama", "sdpa")
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config(kv_dtype=NAME, scale_granularity="token"))
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = model.generate(ids, **kw)
    want = ref.generate(ids, **kw)
    assert out.shape == want.shape == (2, 21)
    assert (out == want).float().mean() > 0.9        # int8 pages: near the eager model
    st = state_of(model)
    pool = st.pool
    fmt = pool.k[0].fmt
    assert fmt.name == NAME and pool.v[0].fmt.name == NAME
    layers, heads, d = len(pool.k), pool.k[0].num_heads, pool.k[0].head_dim
    assert pool.bytes_per_token == 2 * layers * heads * (d + 4)
    assert pool.bytes_per_token == 2 * layers * fmt.bytes_per_token(heads, d, pool.page_size)
    assert kvcompile.stats(model)["attention_rewritten"] > 0
    kvcompile.release(model)


# --- negative cases -------------------------------------------------------------------------------

def test_unknown_format_names_the_fix():
    with pytest.raises(KVConfigError, match="register_format"):
        KVConfig(kv_dtype="toy_int7")
    with pytest.raises(KVConfigError, match="register_format"):
        KVFormat("toy_int7")


def test_granularity_the_format_does_not_take():
    with pytest.raises(KVConfigError, match="'token' with " + NAME):
        KVConfig(kv_dtype=NAME, scale_granularity="page")
    with pytest.raises(KVConfigError, match="scale_granularity"):
        KVFormat(NAME, "page")


def test_register_refuses_duplicates_and_incomplete_specs():
    with pytest.raises(KVConfigError, match="already a storage format"):
        register_format(TOY)
    with pytest.raises(KVConfigError, match="already a storage format"):
        register_format(FormatSpec("fp8_e4m3", torch.int8, 8, parts=_parts, encode=_encode,
                                   decode=_decode))
    with pytest.raises(KVConfigError, match="parts, encode and decode"):
        register_format(FormatSpec("toy_no_codec", torch.int8, 8, granularities=("token",)))
    with pytest.raises(KVConfigError, match="family 'custom'"):
        register_format(FormatSpec("toy_fp", torch.int8, 8, "fp", parts=_parts, encode=_encode,
                                   decode=_decode))
    assert "toy_no_codec" not in format_names() and "toy_fp" not in format_names()
    with pytest.raises(KVConfigError, match="built-in"):
        unregister_format("bf16")
