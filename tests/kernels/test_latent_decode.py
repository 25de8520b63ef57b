"""The absorbed MLA decode kernel (kernels/latent_decode.py) against the paged reference over
the same latent pages (kernels/dense.py, latent=True), on fresh random inputs: ragged lengths,
split-K on and off (empty splits included), head counts that do not fill a head block, tiles
spanning several pages or part of one, fp32 / bf16 / fp8 pages and an fp8 latent beside a bf16
rotary key (the same stored values: fp8 cases check that page scales are folded into the scores
and probabilities, not quantization error). Queries are fp32: the interpreter's bf16 dots are
wrong (shared/REFERENCE.md), so the dots run in fp32 here; tests/gpu/ runs bf16 on CUDA."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels import latent_decode as ld
from kvcompile.kernels.dense import paged_reference_attention
from kvcompile.kernels.latent_decode import (
    CANDIDATES,
    PREFETCH_VARIANTS,
    SWEEP_CANDIDATES,
    LatentTiles,
    latent_decode_attention,
    pick_splits,
    pick_tiles,
    programs_per_sm,
)
from kvcompile.testing import assert_rel_close, rel_err

R, DR = 64, 16


def _pool(c_fmt: str, r_fmt: str, lens: list[int], g, page: int = 16, r: int = R,
          dr: int = DR):
    """(pool, plan) of one layer's latent pages (width r, rotary dr) holding `lens` tokens of
    random latents (tests/kernels/test_latent_sm90.py uses it too, at DeepSeek's widths)."""
    spec = LayerSpec(num_kv_heads=1, head_dim=r, v_head_dim=dr,
                     k_format=KVFormat(c_fmt, "page"), v_format=KVFormat(r_fmt, "page"))
    pool = PagePool([spec], sum(math.ceil(n / page) for n in lens) + 3, page)
    seqs = pool.allocate(len(lens))
    pool.allocate(1)   # a sequence between them: block tables are not the identity
    for s, n in zip(seqs, lens):
        pool.write(0, pool.reserve([s], n), torch.randn(n, 1, r, generator=g) * 3,
                   torch.randn(n, 1, dr, generator=g))
    plan = SimpleNamespace(packed=False, batch=len(lens), seq_lens_list=lens,
                           kv_start=[0] * len(lens), cache={},
                           block_tables=pool.block_table(seqs), new_tokens=1,
                           past_lens=[n - 1 for n in lens])
    return pool, plan


def _run(pool, plan, q_lat, lens, **kw):
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables, seq_lens,
                                  0.2, **kw)
    ref = paged_reference_attention(pool.k[0], pool.v[0], q_lat[:, :, None], plan, None, True,
                                    0, 0.0, 0.2, latent=True)[:, :, 0]
    return out, ref


SMALL = LatentTiles(16, 16, 4, 1, layout="heads")
WIDE = LatentTiles(16, 32, 4, 2, layout="heads")
HALVES = LatentTiles(16, 16, 4, 2, v_split=2, layout="heads")   # two programs, 32 columns each
ONCE = LatentTiles(16, 64, 4, 1)                    # scores once: tokens over the warps
ONCE_T = LatentTiles(16, 64, 4, 1, layout="once_t")   # the same, accumulating r x heads


@pytest.mark.parametrize("c_fmt,r_fmt", [("fp32", "fp32"), ("bf16", "bf16"),
                                         ("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3", "bf16"),
                                         ("fp8_e5m2", "fp32")])
@pytest.mark.parametrize("heads,lens,splits,tiles,page", [
    (16, [1, 17, 50, 100], 1, WIDE, 16),        # no split: the kernel normalizes itself
    (16, [1, 17, 50, 100], 3, WIDE, 16),        # split-K; row 0 has empty splits
    (20, [64, 33], None, SMALL, 16),            # 20 heads in blocks of 16; rule's splits
    (16, [70, 5], 2, SMALL, 32),                # a tile is half a page
    (32, [45, 90], 2, LatentTiles(32, 32, 4, 1, layout="heads"), 8),   # a tile spans 4 pages
    (16, [1, 17, 50, 100], 3, HALVES, 16),      # value halves, split-K
    (20, [64, 33], 1, HALVES, 16),              # value halves, no split, partial head block
    (16, [1, 17, 50, 100], 3, ONCE, 16),        # scores once, split-K, empty splits
    (20, [64, 33, 130], 1, ONCE, 8),            # scores once, no split, partial head block
    (20, [1, 17, 50, 100], 2, ONCE_T, 32),      # r x heads accumulator, split-K
    (32, [129, 7], 1, ONCE_T, 16),              # r x heads, no split, a ragged last tile
    # the prefetch variants: block-table entries (and the rotary key) a tile ahead, across
    # page boundaries, splits with empty and one-token ranges, a partial last tile
    (20, [1, 17, 50, 200], 3, LatentTiles(16, 64, 4, 3, layout="once_t", ahead="rope"), 16),
    (16, [129, 7, 64], 1, LatentTiles(16, 64, 4, 2, layout="once", ahead="bt"), 8),
    (16, [1, 17, 50, 200], 2, LatentTiles(16, 64, 4, 1, layout="once", ahead="rope"), 32),
])
def test_kernel_matches_paged_reference(c_fmt, r_fmt, heads, lens, splits, tiles, page):
    g = torch.Generator().manual_seed(len(lens) * heads + page)
    pool, plan = _pool(c_fmt, r_fmt, lens, g, page)
    q_lat = torch.randn(len(lens), heads, R + DR, generator=g)
    out, ref = _run(pool, plan, q_lat, lens, num_splits=splits, tiles=tiles)
    assert out.shape == (len(lens), heads, R) and out.dtype == torch.float32
    assert_rel_close(out, ref, torch.float32, factor=4, what=f"{c_fmt}/{r_fmt} {lens}")


def _row_latents(pool, plan, b: int, n: int):
    """Row b's first n latents c [n, r] and rotary keys [n, dr], read back from its pages
    (any widths: test_latent_sm90.py takes the references below at DeepSeek's)."""
    P, r, dr = pool.k[0].page_size, pool.k[0].head_dim, pool.v[0].head_dim
    pages = plan.block_tables[b, :math.ceil(n / P)]
    return (pool.k[0].read(pages)[:, 0].reshape(-1, r)[:n],
            pool.v[0].read(pages)[:, 0].reshape(-1, dr)[:n])


def _masked_reference(pool, plan, q_lat, lens, key_mask, scale=0.2):
    """Plain torch: each row's latent and rotary key read back from its pages, the keys that
    key_mask hides (key_mask[b, j] False, j < its width) dropped; a row with none: zeros."""
    out = torch.zeros(q_lat.shape[0], q_lat.shape[1], pool.k[0].head_dim)
    for b, n in enumerate(lens):
        c, kr = _row_latents(pool, plan, b, n)
        seen = torch.ones(n, dtype=torch.bool)
        w = min(n, key_mask.shape[1])
        seen[:w] = key_mask[b, :w]
        if not seen.any():
            continue
        s = (q_lat[b].float() @ torch.cat([c, kr], 1)[seen].T) * scale
        out[b] = torch.softmax(s, -1) @ c[seen]
    return out


@pytest.mark.parametrize("tiles,splits", [(ONCE, 3), (ONCE, 1), (ONCE_T, 2), (WIDE, 3),
                                          (HALVES, 1)], ids=str)
def test_key_mask_hides_keys(tiles, splits):
    """key_mask (an HF decode step's mask: left padding, holes, a row hidden whole, a mask
    narrower than the longest row) against a plain-torch reference; without the mask the
    same launch attends to the hidden keys, so the mask is what the output depends on."""
    g = torch.Generator().manual_seed(11 + splits)
    lens = [100, 37, 64, 5]
    pool, plan = _pool("fp8_e4m3", "bf16", lens, g)
    q_lat = torch.randn(len(lens), 16, R + DR, generator=g)
    km = torch.rand(len(lens), 80, generator=g) > 0.3   # holes; keys 80..99 of row 0 seen
    km[1, :20] = False                                  # left padding
    km[3] = False                                       # row 3: every key hidden
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables, seq_lens,
                                  0.2, num_splits=splits, tiles=tiles, key_mask=km)
    ref = _masked_reference(pool, plan, q_lat, lens, km)
    assert torch.isfinite(out).all()
    assert (out[3] == 0).all()
    assert_rel_close(out, ref, torch.float32, factor=4, what=str(tiles))
    unmasked = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables,
                                       seq_lens, 0.2, num_splits=splits, tiles=tiles)
    assert rel_err(unmasked[:3], ref[:3]) > 1e-2   # negative: the mask is applied
    full = torch.ones(len(lens), 100, dtype=torch.bool)
    same = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables, seq_lens,
                                   0.2, num_splits=splits, tiles=tiles, key_mask=full)
    assert_rel_close(same, unmasked, torch.float32, what="an all-True mask")


def test_key_mask_refusals():
    g = torch.Generator().manual_seed(3)
    pool, plan = _pool("bf16", "bf16", [20, 9], g)
    q = torch.randn(2, 16, R + DR, generator=g)
    sl = torch.tensor([20, 9], dtype=torch.int32)
    for bad in (torch.ones(2, 20, dtype=torch.uint8), torch.ones(3, 20, dtype=torch.bool),
                torch.ones(2, 1, 20, dtype=torch.bool)):
        with pytest.raises(UnsupportedShapeError, match="key_mask must be a bool tensor"):
            latent_decode_attention(q, pool.k[0], pool.v[0], plan.block_tables, sl, 0.2,
                                    key_mask=bad)


def _mass_reference(pool, plan, q_lat, lens, key_mask, length, scale=0.2):
    """Each row's attention probabilities over its keys (plain torch, `_masked_reference`'s
    keys), summed over the query heads: [B, 1, length] (keys past a row's length: 0)."""
    mass = torch.zeros(q_lat.shape[0], 1, length)
    for b, n in enumerate(lens):
        c, kr = _row_latents(pool, plan, b, n)
        s = (q_lat[b].float() @ torch.cat([c, kr], 1).T) * scale            # [H, n]
        if key_mask is not None:
            w = min(n, key_mask.shape[1])
            s[:, :w] = s[:, :w].masked_fill(~key_mask[b, :w], float("-inf"))
        if torch.isinf(s).all():
            continue
        p = torch.softmax(s, -1).sum(0)
        w = min(n, length)
        mass[b, 0, :w] = p[:w]
    return mass


@pytest.mark.parametrize("tiles,splits,masked", [
    (ONCE, 3, False), (ONCE, 1, True), (ONCE_T, 2, False), (ONCE_T, 1, False),
    (WIDE, 3, True), (HALVES, 1, False), (HALVES, 3, False)], ids=str)
def test_attn_mass_adds_each_keys_probability(tiles, splits, masked):
    """attn_mass (H2O on latent pages): += each key's probability summed over every query
    head, for keys below the mass' width (shorter than the longest row, longer than the
    others), under split-K and a key mask (a row hidden whole adds nothing), on top of what
    the mass held; the output is the launch's without a mass."""
    g = torch.Generator().manual_seed(5 + splits + 7 * masked)
    lens = [100, 37, 64, 5]
    pool, plan = _pool("fp8_e4m3", "bf16", lens, g)
    q_lat = torch.randn(len(lens), 20, R + DR, generator=g)
    km = None
    if masked:
        km = torch.rand(len(lens), 80, generator=g) > 0.3
        km[3] = False
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    before = torch.rand(len(lens), 1, 90, generator=g)
    mass = before.clone()
    out = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables, seq_lens,
                                  0.2, num_splits=splits, tiles=tiles, key_mask=km,
                                  attn_mass=mass)
    plain = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables, seq_lens,
                                    0.2, num_splits=splits, tiles=tiles, key_mask=km)
    assert torch.equal(out, plain)
    ref = _mass_reference(pool, plan, q_lat, lens, km, 90)
    assert_rel_close(mass - before, ref, torch.float32, factor=4, what=str(tiles))
    assert rel_err(mass - before, _mass_reference(pool, plan, q_lat * 1.5, lens, km, 90)) > 1e-2
    for b, n in enumerate(lens):   # past a row's keys, and every key of a hidden row: unchanged
        assert torch.equal(mass[b, :, n:], before[b, :, n:])
    if masked:
        assert torch.equal(mass[3], before[3])


def test_attn_mass_refusals():
    g = torch.Generator().manual_seed(4)
    pool, plan = _pool("bf16", "bf16", [20, 9], g)
    q = torch.randn(2, 16, R + DR, generator=g)
    sl = torch.tensor([20, 9], dtype=torch.int32)
    for bad in (torch.zeros(2, 2, 20), torch.zeros(2, 1, 20, dtype=torch.float16),
                torch.zeros(2, 1, 40)[:, :, ::2], torch.zeros(3, 1, 20)):
        with pytest.raises(UnsupportedShapeError, match="attn_mass must be contiguous fp32"):
            latent_decode_attention(q, pool.k[0], pool.v[0], plan.block_tables, sl, 0.2,
                                    attn_mass=bad)


BITS = LatentTiles(16, 64, 4, 1, widen="bits")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("tiles", [ONCE, ONCE_T, LatentTiles(16, 64, 4, 2, widen="tile"),
                                   *SWEEP_CANDIDATES, *PREFETCH_VARIANTS,
                                   LatentTiles(16, 64, 4, 2, layout="once_t", widen="bits")],
                         ids=str)
def test_fp8_pages_take_fp16_dots_under_bf16_queries(tiles, fmt):
    """bf16 queries over fp8 latent and rotary pages: the once kernel runs its dots in fp16
    with the query shifted by 2^-8 (the interpreter's fp16 dots are right, its bf16 ones are
    not, so only this all-fp8 case runs on the CPU), within fp16's bound. widen "bits": the
    tile is the latent times 2^-8 (e4m3), taken back by the score rows and the output."""
    g = torch.Generator().manual_seed(5)
    lens = [1, 17, 50, 100]
    pool, plan = _pool(fmt, fmt, lens, g)
    q_lat = (torch.randn(len(lens), 16, R + DR, generator=g) * 40).bfloat16()
    out, ref = _run(pool, plan, q_lat, lens, num_splits=2, tiles=tiles)
    # the paged reference with fp32 queries (widen "bits" takes only fp16 dots: ONCE runs)
    _, ref = _run(pool, plan, q_lat.float(), lens, num_splits=2,
                  tiles=ONCE if tiles.widen == "bits" else tiles)
    assert_rel_close(out, ref, torch.float16, what=str(tiles))


@pytest.mark.parametrize("heads", [16, 64])   # the rule's "heads" and "once" layouts
def test_default_tiles_and_splits(heads):
    """The launcher's own choice (pick_tiles / pick_splits) on a non-contiguous query."""
    g = torch.Generator().manual_seed(7)
    lens = [300, 3, 129]
    pool, plan = _pool("fp8_e4m3", "bf16", lens, g)
    q_lat = torch.randn(len(lens), 2 * (R + DR), heads, generator=g).transpose(1, 2)[..., ::2]
    out, ref = _run(pool, plan, q_lat, lens)
    assert_rel_close(out, ref, torch.float32, factor=4)


@pytest.mark.parametrize("tiles", [SMALL, ONCE, ONCE_T, LatentTiles(16, 64, 4, 3, layout="once_t")],
                         ids=str)
def test_scales_are_applied(tiles):
    """Negative control: the same codes read as if every page scale were 1 give another
    answer, so the fp8 cases above can fail."""
    g = torch.Generator().manual_seed(3)
    lens = [40, 20]
    pool, plan = _pool("fp8_e4m3", "fp8_e4m3", lens, g)
    q_lat = torch.randn(2, 16, R + DR, generator=g)
    out, ref = _run(pool, plan, q_lat, lens, tiles=tiles)
    pool.k[0].scale.fill_(1.0)
    wrong, _ = _run(pool, plan, q_lat, lens, tiles=tiles)
    assert rel_err(out, ref) < 1e-4 < rel_err(wrong, ref)


def test_rule_picks():
    """DeepSeek-V3 shape on the H200 (132 SMs): 64 heads a program, scores computed once by 8
    warps of 16 tokens each, all 512 value columns (128 accumulator registers a thread); B16
    splits 4 ways, B64 does not split. Under 64 heads, the measured layout of the first
    rebuild."""
    t = pick_tiles(128, 512)
    assert (t.layout, t.block_h, t.block_n, t.num_warps, t.v_split) == ("once", 64, 128, 8, 1)
    assert t.acc_regs(512) == 128
    assert pick_splits(16, 128, 8192, t, 132) == 4
    assert pick_splits(64, 128, 32768, t, 132) == 1
    assert pick_splits(1, 128, 131072, t, 132) == 64          # capped at MAX_SPLITS
    assert pick_splits(1, 128, 100, t, 132) == 1              # too short to split
    assert pick_tiles(8, 64).block_h == 16
    assert all(c.acc_regs(512) <= 128 for c in CANDIDATES)


def test_refuses_what_it_cannot_read():
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([20], dtype=torch.int32)
    pool, plan = _pool("fp4_e2m1", "fp4_e2m1", [20], g)
    with pytest.raises(UnsupportedShapeError, match="fp4_e2m1"):
        latent_decode_attention(torch.randn(1, 4, R + DR), pool.k[0], pool.v[0],
                                plan.block_tables, lens, 0.2)
    pool, plan = _pool("fp32", "fp32", [20], g)
    with pytest.raises(UnsupportedShapeError, match="width"):
        latent_decode_attention(torch.randn(1, 4, R), pool.k[0], pool.v[0],
                                plan.block_tables, lens, 0.2)
    with pytest.raises(UnsupportedShapeError, match="block_tables"):
        latent_decode_attention(torch.randn(1, 4, R + DR), pool.k[0], pool.v[0],
                                plan.block_tables.long(), lens, 0.2)
    with pytest.raises(UnsupportedShapeError, match="seq_lens"):
        latent_decode_attention(torch.randn(1, 4, R + DR), pool.k[0], pool.v[0],
                                plan.block_tables, lens.long(), 0.2)
    with pytest.raises(UnsupportedShapeError, match="num_splits"):
        latent_decode_attention(torch.randn(1, 4, R + DR), pool.k[0], pool.v[0],
                                plan.block_tables, lens, 0.2, num_splits=0)
    with pytest.raises(ValueError, match="power of two"):
        LatentTiles(24, 32, 4, 1)
    with pytest.raises(ValueError, match="power of two"):
        LatentTiles(64, 8, 8, 1)
    with pytest.raises(ValueError, match="v_split"):
        LatentTiles(64, 16, 4, 1, v_split=4)
    with pytest.raises(ValueError, match="16 x num_warps"):   # 8 warps over 64 tokens: twice
        LatentTiles(64, 64, 8, 1, layout="once")
    with pytest.raises(ValueError, match="v_split 1"):
        LatentTiles(64, 64, 4, 1, v_split=2, layout="once_t")
    with pytest.raises(ValueError, match="layout"):
        LatentTiles(64, 64, 4, 1, layout="twice")
    with pytest.raises(ValueError, match="widen"):
        LatentTiles(16, 32, 8, 2, layout="heads", widen="tile")
    with pytest.raises(ValueError, match="ahead"):
        LatentTiles(16, 32, 8, 2, layout="heads", ahead="bt")
    with pytest.raises(ValueError, match="ahead"):
        LatentTiles(16, 64, 4, 2, ahead="two")
    with pytest.raises(UnsupportedShapeError, match="widen"):   # "tile" is for fp8 pages
        latent_decode_attention(torch.randn(1, 4, R + DR), pool.k[0], pool.v[0],
                                plan.block_tables, lens, 0.2,
                                tiles=LatentTiles(16, 64, 4, 2, widen="tile"))


def test_rule_picks_for_tensor_parallel_shards():
    """16 and 32 heads a GPU (DeepSeek-V3 at TP 8 / TP 4, memory-bound): for bf16 pages
    4-warp "once_t" tiles of the whole head count (64 tokens a tile, a cp.async ring); for
    fp8 pages the 16-head, 8-warp "once" tile that widens each fp8 tile once (widen "tile");
    splits fill the 132 SMs once."""
    for heads in (16, 32):
        t = pick_tiles(heads, 512)
        assert (t.layout, t.block_h, t.block_n, t.num_warps) == ("once_t", heads, 64, 4)
        assert t.num_stages >= 2 and t.widen == "dot"
        assert programs_per_sm(t) == 1 and programs_per_sm(t, widened=True) == 2
        assert pick_splits(16, heads, 8192, t, 132) == 8        # 16 x 8 = 128 programs
        assert pick_splits(16, heads, 8192, t, 132, widened=True) == 16
        assert pick_splits(64, heads, 32768, t, 132) == 2
        f = pick_tiles(heads, 512, widened=True)
        assert (f.layout, f.block_h, f.block_n, f.num_warps, f.num_stages, f.widen) == (
            "once", 16, 64, 4, 1, "bits")
        assert programs_per_sm(f, widened=True) == 2
        assert pick_splits(16, heads, 8192, f, 132, widened=True) == 16 * 16 // heads
        f = pick_tiles(heads, 512, widened=True, q_fp32=True)   # fp32 queries
        assert (f.layout, f.block_h, f.block_n, f.num_warps, f.num_stages, f.widen) == (
            "once", 16, 128, 8, 2, "tile")
        assert programs_per_sm(f, widened=True) == 1
        assert pick_splits(16, heads, 8192, f, 132, widened=True) == 8 * 16 // heads
    assert pick_tiles(20, 512).block_h == 16                  # a partial second block
    assert pick_tiles(48, 512).block_h == 32
    # the 128-head picks do not change with the page format
    once = pick_tiles(128, 512)
    assert pick_tiles(128, 512, widened=True) == once
    assert pick_splits(16, 128, 8192, once, 132, widened=True) == 4
    # too narrow a latent for latent halves of 16 columns: the "heads" layout
    assert pick_tiles(16, 16).layout == "heads"


# DeepSeek-V3's latent (r 512, rope 64) at 16 / 32 heads, the rule's tiles (and one other
# candidate), several splits, a ragged batch (one token, a partial page, a partial tile)
RF, DRF = 512, 64


@pytest.mark.parametrize("c_fmt,r_fmt", [("bf16", "bf16"), ("fp8_e4m3", "fp8_e4m3"),
                                         ("fp8_e4m3", "bf16")])
@pytest.mark.parametrize("heads,splits", [(16, 1), (16, 3), (16, None), (32, 2), (32, None)])
def test_tensor_parallel_shards_match_reference(c_fmt, r_fmt, heads, splits):
    g = torch.Generator().manual_seed(heads + (splits or 0))
    lens = [1, 70, 200, 129]
    spec = LayerSpec(num_kv_heads=1, head_dim=RF, v_head_dim=DRF,
                     k_format=KVFormat(c_fmt, "page"), v_format=KVFormat(r_fmt, "page"))
    pool = PagePool([spec], sum(math.ceil(n / 16) for n in lens) + 2, 16)
    seqs = pool.allocate(len(lens))
    for s, n in zip(seqs, lens):
        pool.write(0, pool.reserve([s], n), torch.randn(n, 1, RF, generator=g),
                   torch.randn(n, 1, DRF, generator=g))
    plan = SimpleNamespace(packed=False, batch=len(lens), seq_lens_list=lens,
                           kv_start=[0] * len(lens), cache={},
                           block_tables=pool.block_table(seqs), new_tokens=1,
                           past_lens=[n - 1 for n in lens])
    q_lat = torch.randn(len(lens), heads, RF + DRF, generator=g) / 8
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = paged_reference_attention(pool.k[0], pool.v[0], q_lat[:, :, None], plan, None, True,
                                    0, 0.0, 0.07, latent=True)[:, :, 0]
    # as the launcher picks for these fp32 queries (fp32 dots: no widen "bits")
    tiles = pick_tiles(heads, RF, widened=c_fmt.startswith("fp8"), q_fp32=True)
    assert tiles.layout == ("once" if c_fmt.startswith("fp8") else "once_t")
    out = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables, seq_lens,
                                  0.07, num_splits=splits)
    assert_rel_close(out, ref, torch.float32, factor=4, what=f"{c_fmt}/{r_fmt} {tiles}")
    # negative control: the last sequence's rows with its last token dropped differ
    short = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables,
                                    seq_lens - torch.tensor([0, 0, 0, 1], dtype=torch.int32),
                                    0.07, num_splits=splits)
    assert rel_err(short[3], ref[3]) > 1e-4


def _run_ptx(asm: str, word: int) -> tuple:
    """The few PTX integer instructions of latent_decode._BITS on one 32-bit register $2 of
    four fp8 codes -> ($0, $1); an instruction outside that set fails the test."""
    import re
    regs, mask = {"$2": word}, 0xFFFFFFFF
    for op, args in re.findall(r"(prmt|shr|and|or|add)\.[bu]32 ([^;]+);", asm):
        d, *src = [x.strip() for x in args.split(",")]
        val = [regs[x] if x in regs else int(x, 0) for x in src]
        if op == "prmt":   # bytes of {b, a}: 0-3 from a, 4-7 from b; a selector nibble each
            pool = val[0] | (val[1] << 32)
            regs[d] = sum(((pool >> (8 * ((val[2] >> (4 * k)) & 7))) & 0xFF) << (8 * k)
                          for k in range(4))
        else:
            regs[d] = {"shr": lambda a, b: a >> b, "and": lambda a, b: a & b,
                       "or": lambda a, b: a | b, "add": lambda a, b: a + b}[op](*val) & mask
    assert len(re.findall(r"\b(?:prmt|shr|and|or|add)\.[bu]32", asm)) == len(
        re.findall(r"\w+\.\w+(?:\.\w+)? ", asm.replace(".reg .b32", ""))), asm
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("fmt,dtype", [("fp8_e4m3", torch.float8_e4m3fn),
                                       ("fp8_e5m2", torch.float8_e5m2)])
def test_bits_ptx_widens_every_code(fmt, dtype):
    """widen "bits" runs inline PTX on CUDA only: its integer operations, read here from the
    same string, give every finite fp8 code's value / C_MUL as fp16 bits (subnormals and
    -0 included); the interpreter's Triton version (_widen_bits_tl) runs in the kernel tests
    above. Negative control: swapped codes (byte selector 0x0414) do not."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(dtype).float()
    finite = torch.isfinite(want)
    for asm, ok in ((ld._BITS[fmt], True), (ld._BITS[fmt].replace("0x1404", "0x0414"), False)):
        got = []
        for w in range(0, 256, 4):
            lo, hi = _run_ptx(asm, int.from_bytes(bytes(range(w, w + 4)), "little"))
            got += [(lo & 0xFFFF), lo >> 16, (hi & 0xFFFF), hi >> 16]
        half = torch.tensor(got, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
        match = torch.equal(half[finite] * ld._BITS_MUL[fmt], want[finite])
        assert match == ok, f"{fmt} {asm}"


def test_rule_takes_the_measured_fp8_tiles():
    """The H200's measured fastest fp8 tiles at 16 heads (RESULTS.md, mla22g's fifth call):
    once h16 n64 w4 s1 widen "bits", two programs an SM, at few and at many sequences: B16 x
    8k at 16 splits (0.068 ms; once_t h16 n64 w4 s3 x 16 took 0.091, the widen "tile" tile x
    8 0.104), B64 x 32k at 4 (0.676 ms; the widen "tile" tile x 2 0.810-0.814). fp32 queries
    cannot take "bits" (fp32 dots): there mla22g's rule stays (few sequences: once_t x 2 an
    SM; many: the widen "tile" tile)."""
    for batch, ctx, splits in ((16, 8192, 16), (64, 32768, 4), (1, 8192, 32),
                               (16, 32768, 16), (64, 8192, 4), (128, 32768, 2)):
        t, sp = ld.pick_launch(16, 512, batch, ctx, 132, widened=True)
        assert str(t) == "once h16 n64 w4 s1 widen-bits" and sp == splits, (batch, ctx)
        assert sp == pick_splits(batch, 16, ctx, t, 132, widened=True)
    # edge: a short context caps the splits (256 tokens a split at least)
    assert ld.pick_launch(16, 512, 1, 512, 132, widened=True)[1] == 2
    # the bf16 pick is the measured fastest at B16 x 8k (x 8) and B64 x 32k (x 2)
    once_t = LatentTiles(16, 64, 4, 3, layout="once_t")
    assert ld.pick_launch(16, 512, 16, 8192, 132) == (once_t, 8)
    assert ld.pick_launch(16, 512, 64, 32768, 132) == (once_t, 2)
    # fp32 dots: never "bits" (the launcher would refuse it), mla22g's rule instead
    few = pick_tiles(16, 512, True, 16, 132, q_fp32=True)
    assert str(few) == "once_t h16 n64 w4 s3"
    many = pick_tiles(16, 512, True, 64, 132, q_fp32=True)
    assert str(many) == "once h16 n128 w8 s2 widen-tile"
    # bf16 pages never take a widening tile, whatever the batch; 128 heads keep the once tile
    for batch in (1, 16, 64):
        assert pick_tiles(16, 512, False, batch, 132) == pick_tiles(16, 512)
        assert pick_tiles(128, 512, True, batch, 132) == pick_tiles(128, 512)
    # fp32 queries at 64+ heads: no 64-head tile (fp32 operands exceed shared memory at r
    # 512, tests/kernels/test_latent_decode_sm90.py), 32-head blocks instead; at r 64 (the
    # interpreter tests' width) the 64-head once tile stays
    assert str(pick_tiles(128, 512, q_fp32=True)) == "once_t h32 n64 w4 s3"
    assert str(pick_tiles(128, 512, True, q_fp32=True)) == "once h16 n128 w8 s2 widen-tile"
    for widened in (False, True):
        assert pick_tiles(128, 64, widened, q_fp32=True) == pick_tiles(128, 64)
    assert pick_tiles(8, 512, True).widen == "bits"    # fewer than 16 heads: one 16-head block
    assert pick_tiles(32, 512, True).block_h == 16     # 32 heads: two 16-head blocks
    assert pick_tiles(16, 16, True).layout == "heads"  # too narrow for latent halves


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_rule_launch_over_fp8_pages_under_bf16_queries(fmt):
    """The launcher's own pick (tiles=None) for bf16 queries over fp8 pages at 16 heads is
    the widen "bits" tile, and it matches the reference at fp16's bound; negative control:
    the same launch with the 2^8 fold of "bits" dropped (C_MUL 1) is off by far more."""
    g = torch.Generator().manual_seed(11)
    lens = [1, 17, 50, 100]
    pool, plan = _pool(fmt, fmt, lens, g)
    q_lat = (torch.randn(len(lens), 16, R + DR, generator=g) * 4).bfloat16()
    assert pick_tiles(16, R, True, len(lens), ld.sm_count(q_lat.device)).widen == "bits"
    out, _ = _run(pool, plan, q_lat, lens)
    _, ref = _run(pool, plan, q_lat.float(), lens, tiles=ONCE)
    assert_rel_close(out, ref, torch.float16, what=fmt)
    if fmt == "fp8_e4m3":
        saved = ld._BITS_MUL[fmt]
        ld._BITS_MUL[fmt] = 1.0
        try:
            wrong, _ = _run(pool, plan, q_lat, lens)
        finally:
            ld._BITS_MUL[fmt] = saved
        assert rel_err(wrong, ref) > 0.1


def test_every_tile_the_rule_returns_is_compiled_for_sm90():
    """What tests/kernels/test_latent_decode_sm90.py compiles (CANDIDATES + SWEEP_CANDIDATES)
    covers every tile the rule returns at DeepSeek-V3's r 512 over heads, batches, contexts,
    formats, query dtypes and SM counts (the "smallest accumulator" fallback cannot happen at
    r 512); the sweep-only tiles are never returned."""
    seen = set()
    for heads in (1, 8, 16, 20, 32, 48, 64, 96, 128):
        for batch in (1, 2, 8, 16, 64, 256):
            for ctx in (16, 1000, 8192, 131072):
                for sms in (8, 78, 132):
                    for widened in (False, True):
                        for q32 in (False, True):
                            t, sp = ld.pick_launch(heads, 512, batch, ctx, sms, widened, q32)
                            assert t in CANDIDATES and t not in SWEEP_CANDIDATES, str(t)
                            assert t not in PREFETCH_VARIANTS and not t.ahead, str(t)
                            assert 1 <= sp <= ld.MAX_SPLITS
                            seen.add(t)
    assert len(seen) >= 5, sorted(map(str, seen))


def test_bits_refusals():
    """widen "bits" needs fp8 pages and fp16 dots (bf16 / fp16 queries): each refusal says
    what to pass instead."""
    g = torch.Generator().manual_seed(1)
    lens = [20]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    pool, plan = _pool("fp8_e4m3", "fp8_e4m3", lens, g)
    with pytest.raises(UnsupportedShapeError, match="fp16"):
        latent_decode_attention(torch.randn(1, 16, R + DR), pool.k[0], pool.v[0],
                                plan.block_tables, seq_lens, 0.2, tiles=BITS)
    pool, plan = _pool("bf16", "bf16", lens, g)
    with pytest.raises(UnsupportedShapeError, match="widen"):
        latent_decode_attention(torch.randn(1, 16, R + DR).bfloat16(), pool.k[0], pool.v[0],
                                plan.block_tables, seq_lens, 0.2, tiles=BITS)
    with pytest.raises(ValueError, match="widen"):
        LatentTiles(16, 32, 8, 2, layout="heads", widen="bits")
