"""Mask analysis (kernels/masks.py): exact structure found in HF's masks, anything else refused,
and memory O(B x L) plus one block of rows, never O(B x S x L)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvcompile.kernels import masks
from kvcompile.runtime.context import StepPlan

hf_masks = pytest.importorskip("transformers.masking_utils")


def _plan(B: int, S: int, total: int) -> StepPlan:
    return StepPlan(seq_ids=list(range(B)), batch=B, new_tokens=S, past_lens=[total - S] * B,
                    slots=torch.zeros(B * S, dtype=torch.long),
                    block_tables=torch.zeros(B, 1, dtype=torch.int32),
                    seq_lens=torch.full((B,), total, dtype=torch.int32),
                    seq_lens_list=[total] * B, kv_start=[0] * B)


def _pad2d(pads: list[int], length: int) -> torch.Tensor:
    """[B, length] HF attention_mask: 0 for each row's left padding."""
    am = torch.ones(len(pads), length, dtype=torch.long)
    for b, p in enumerate(pads):
        am[b, :p] = 0
    return am


def first_seen(pads, S, total, window):
    """kv_start as the analysis defines it: the first key any query of the forward sees (the
    padding, or in a windowed chunk the window's start if later; `total` if none)."""
    lo = total - S - window + 1 if window else 0
    return [min(max(p, lo), total) for p in pads]


def hf_mask(pads, S, total, window=0, kv_len=None, additive=False):
    """The mask HF 5.x builds for SDPA (bool) or eager (additive, finfo.min), queries at the last
    S positions of `total`, over kv_len >= total columns (StaticCache: later columns unused)."""
    kv_len = kv_len or total
    fn = (hf_masks.sliding_window_causal_mask_function(window) if window
          else hf_masks.causal_mask_function)
    kwargs = dict(batch_size=len(pads), q_length=S, kv_length=kv_len, q_offset=total - S,
                  mask_function=fn, attention_mask=_pad2d(pads, total).bool(), device="cpu")
    if additive:
        return hf_masks.eager_mask(dtype=torch.float32, **kwargs)
    return hf_masks.sdpa_mask(allow_is_causal_skip=False, **kwargs)


def peak_bytes(fn):
    """(fn(), peak bytes torch allocated on the CPU during the call, over what it held before).

    From the profiler's allocator events, which include the temporaries inside ops (the int64
    copy a bool .sum() makes, say), not only the tensors the ops return."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return out, peak


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows, so that a test of a few hundred rows crosses block boundaries."""
    monkeypatch.setattr(masks, "BLOCK_ELEMENTS", 1)   # one query row per block
    return monkeypatch


# --- exact structure is recognized ------------------------------------------------------------

CASES = [  # pads per row, S (new tokens), total, window, kv columns
    ([0, 3, 17], 40, 40, 0, None),          # fresh prefill, left padding
    ([0, 3, 17], 40, 40, 8, None),          # + sliding window
    ([5, 0], 24, 64, 0, None),              # prefill chunk over a 40-token prefix
    ([5, 50], 24, 64, 16, None),            # chunk, window; row 1 still padding up to 50
    ([2, 0], 30, 30, 0, 48),                # StaticCache: 48 columns, 30 used
    ([0, 0], 33, 33, 0, None),              # no padding
    ([4, 9, 40], 40, 40, 0, None),          # a row of only padding
]


def assert_key_row(got: torch.Tensor, want: torch.Tensor) -> None:
    """MaskInfo.key_mask: `want`'s columns, then True columns up to a multiple of
    KEY_MASK_ALIGN (keys past a key mask are seen: the same mask), contiguous."""
    n = want.shape[1]
    assert got.shape == (want.shape[0], masks.key_mask_width(n)) and got.is_contiguous()
    assert torch.equal(got[:, :n], want) and bool(got[:, n:].all())


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
@pytest.mark.parametrize("pads,S,total,window,kv_len", CASES)
def test_hf_masks_are_exact(pads, S, total, window, kv_len, additive):
    mask = hf_mask(pads, S, total, window, kv_len, additive)
    info = masks.analyze(_plan(len(pads), S, total), mask, True, 0)
    assert info.exact, info.reason
    assert info.kv_start == first_seen(pads, S, total, window)
    assert info.window == (window if window and window < total else 0)
    ref = masks.align(masks.to_bool(mask)[0][:, 0, -1], total)
    assert_key_row(info.key_mask, ref)


def test_exact_across_blocks(small_blocks):
    for pads, S, total, window, kv_len in CASES:
        info = masks.analyze(_plan(len(pads), S, total), hf_mask(pads, S, total, window, kv_len),
                             True, 0)
        assert info.exact, (pads, S, window)
        assert info.kv_start == first_seen(pads, S, total, window), (pads, S, window)


def test_config_window_without_window_in_mask():
    """A model whose config has a window the prompt is shorter than: the mask shows none."""
    info = masks.analyze(_plan(2, 20, 20), hf_mask([0, 4], 20, 20), True, 64)
    assert info.exact and info.window == 64
    # longer than the window, but the mask has no window: not what the kernels would compute
    info = masks.analyze(_plan(2, 20, 20), hf_mask([0, 4], 20, 20), True, 8)
    assert not info.exact


def test_shorter_mask_is_right_aligned():
    """A sliding-window cache's mask covers only its last keys; older keys are masked."""
    full = hf_mask([0, 0], 4, 40, window=16)       # [2, 1, 4, 40]
    short = full[..., -20:]                        # the cache holds the last 20 keys
    info = masks.analyze(_plan(2, 4, 40), short, True, 0)
    assert info.exact and info.window == 16 and info.kv_start == [21, 21]


# --- anything else is refused -----------------------------------------------------------------

def _hole(mask, b, s, j):
    m = mask.clone()
    m[b, :, s, j] = ~m[b, :, s, j] if m.dtype == torch.bool else torch.where(
        m[b, :, s, j] == 0, torch.finfo(m.dtype).min, 0.0)
    return m


@pytest.mark.parametrize("blocks", ["default", "one_row"])
@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
def test_one_hole_is_not_exact(additive, blocks, monkeypatch):
    if blocks == "one_row":
        monkeypatch.setattr(masks, "BLOCK_ELEMENTS", 1)
    pads, S, total = [0, 3, 9], 48, 48
    g = torch.Generator().manual_seed(0)
    base = hf_mask(pads, S, total, additive=additive)
    # random holes inside real rows, plus the edges: a row's first real query (its only key),
    # the last query's last key, a masked key made visible above the diagonal
    spots = [(1, 3, 3), (2, 47, 47), (0, 10, 11), (2, 20, 5)]
    for _ in range(6):
        b = int(torch.randint(0, 3, (1,), generator=g))
        s = int(torch.randint(pads[b], S, (1,), generator=g))
        spots.append((b, s, int(torch.randint(0, total, (1,), generator=g))))
    for b, s, j in spots:
        info = masks.analyze(_plan(3, S, total), _hole(base, b, s, j), True, 0)
        assert not info.exact, (b, s, j)


def test_pad_query_rows_are_ignored():
    """A padding query's row is never read (its output is discarded): any content is exact."""
    mask = hf_mask([6, 0], 16, 16)
    mask[0, 0, :6] = True          # older HF "unmasked" fully masked rows for SDPA
    mask[0, 0, :, :6] = False      # ... but no real query may see padding
    info = masks.analyze(_plan(2, 16, 16), mask, True, 0)
    assert info.exact and info.kv_start == [6, 0]


def test_per_head_differences_are_not_exact():
    mask = hf_mask([0, 2], 12, 12).expand(2, 4, 12, 12).clone()
    mask[1, 2, 7, 3] = False
    info = masks.analyze(_plan(2, 12, 12), mask, True, 0)
    assert not info.exact and info.key_mask is None and "head" in info.reason
    # the same mask broadcast over heads (stride 0) is exact
    info = masks.analyze(_plan(2, 12, 12), hf_mask([0, 2], 12, 12).expand(2, 4, 12, 12),
                         True, 0)
    assert info.exact


def test_alibi_like_bias_is_not_exact():
    S = 16
    mask = hf_mask([0, 3], S, S, additive=True)
    pos = torch.arange(S)
    bias = -0.5 * (pos[:, None] - pos[None, :]).clamp_min(0).float()   # ALiBi slope 1/2
    info = masks.analyze(_plan(2, S, S), mask + bias, True, 0)
    assert not info.exact and info.key_mask is None and "bias" in info.reason


def test_bidirectional_mask_is_not_exact():
    am = _pad2d([0, 3], 10).bool()
    mask = am[:, None, None, :].expand(2, 1, 10, 10)
    assert not masks.analyze(_plan(2, 10, 10), mask, False, 0).exact


def test_decode_rows():
    """Decode: the key row goes to the kernel as is; a bias or per-head mask has none."""
    mask = hf_mask([0, 3], 1, 20)                            # [2, 1, 1, 20]
    plan = _plan(2, 1, 20)
    info = masks.analyze(plan, mask, True, 0)
    assert_key_row(info.key_mask, mask[:, 0, 0])
    # the sm_90 kernels read the row as it is: no copy a layer (its width a multiple of 16)
    from kvcompile.kernels.decode_sm90 import _padded_mask

    assert _padded_mask(info.key_mask, 64).data_ptr() == info.key_mask.data_ptr()
    bias = torch.where(mask, 0.0, float("-inf")) - 0.25 * torch.arange(20.0).flip(0)
    assert masks.analyze(_plan(2, 1, 20), bias, True, 0).key_mask is None
    heads = mask.expand(2, 2, 1, 20).clone()
    heads[0, 1, 0, 5] = False
    assert masks.analyze(_plan(2, 1, 20), heads, True, 0).key_mask is None


# --- memory -----------------------------------------------------------------------------------

def test_peak_bytes_sees_temporaries():
    """The tracker itself: a bool .sum() makes an int64 copy inside the op (8 bytes/element)."""
    x = torch.ones(1 << 20, dtype=torch.bool)
    _, peak = peak_bytes(lambda: x.sum())
    assert peak >= 8 << 20


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
def test_analysis_memory_is_o_b_l(additive, monkeypatch):
    """B=2, S=L=4096: the mask is 32 Mi elements; the analysis may hold O(B x L) plus one
    block of rows (BLOCK_ELEMENTS), never a tensor of the mask's size."""
    B, S = 2, 4096
    mask = hf_mask([0, 1000], S, S, window=1024, additive=additive)
    bl = B * S
    # blocks of 16 rows: everything else the analysis holds must be O(B x L)
    monkeypatch.setattr(masks, "BLOCK_ELEMENTS", 16 * bl)
    info, peak = peak_bytes(lambda: masks.analyze(_plan(B, S, S), mask, True, 0))
    assert info.exact and info.kv_start == [0, 1000] and info.window == 1024
    bound = 4 * 16 * bl + 64 * bl            # a few bool blocks + int64 [B, L] state
    assert peak <= bound, f"analysis peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
    # the default block size: still far below one mask-sized tensor
    monkeypatch.setattr(masks, "BLOCK_ELEMENTS", 1 << 22)
    info, peak = peak_bytes(lambda: masks.analyze(_plan(B, S, S), mask, True, 0))
    assert info.exact
    assert peak < B * S * S // 2, f"analysis peak {peak / 2**20:.1f} MiB"


def test_token_keep_spans_chunks():
    plan = _plan(3, 8, 24)                      # third chunk of 8 over a 16-token prefix
    plan.kv_start = [0, 20, 16]
    keep = masks.token_keep(plan, torch.device("cpu")).reshape(3, 8)
    assert keep[0].all() and not keep[1, :4].any() and keep[1, 4:].all() and keep[2].all()


# --- the split mask (causal part x key part, never multiplied out) ------------------------------

def _split(pads, S, total, window=0, kv_len=None):
    """HF's mask as the rewrite hands it to the op: [1, 1, S, Lk] causality (+ window) and
    [B, 1, 1, Lk] padding, whose AND is hf_mask."""
    kv_len = kv_len or total
    shared = hf_mask([0], S, total, window, kv_len)                     # [1, 1, S, Lk]
    key = torch.zeros(len(pads), 1, 1, kv_len, dtype=torch.bool)
    key[..., :total] = _pad2d(pads, total).bool()[:, None, None]
    key[..., total:] = True
    return shared, key


@pytest.mark.parametrize("pads,S,total,window,kv_len", CASES)
def test_split_mask_reads_as_the_whole(pads, S, total, window, kv_len):
    shared, key = _split(pads, S, total, window, kv_len)
    whole = shared & key
    assert torch.equal(whole, hf_mask(pads, S, total, window, kv_len))
    got = masks.analyze(_plan(len(pads), S, total), masks.AndMask(shared, key), True, 0)
    want = masks.analyze(_plan(len(pads), S, total), whole, True, 0)
    assert (got.exact, got.kv_start, got.window) == (want.exact, want.kv_start, want.window)
    assert torch.equal(got.key_mask, want.key_mask) and got.key_mask.is_contiguous()
    plan = _plan(len(pads), S, total)
    assert torch.equal(masks.dense(plan, masks.AndMask(shared, key)), whole)


def test_split_mask_with_a_hole_is_not_exact(small_blocks):
    shared, key = _split([0, 3], 24, 24)
    shared = shared.clone()
    shared[0, 0, 20, 5] = False
    info = masks.analyze(_plan(2, 24, 24), masks.AndMask(shared, key), True, 0)
    assert not info.exact


def test_split_mask_decode_rows():
    shared, key = _split([2, 0, 5], 1, 30)
    info = masks.analyze(_plan(3, 1, 30), masks.AndMask(shared, key), True, 0)
    assert_key_row(info.key_mask, (shared & key)[:, 0, -1])


def test_split_mask_analysis_memory_is_o_b_l(monkeypatch):
    """B=4, S=L=4096 split: the analysis holds O(B x L) plus one block, and never the
    [B, 1, S, L] product (64 MiB here)."""
    B, S = 4, 4096
    shared, key = _split([0, 1000, 7, 4095], S, S, window=1024)
    monkeypatch.setattr(masks, "BLOCK_ELEMENTS", 16 * B * S)
    info, peak = peak_bytes(lambda: masks.analyze(_plan(B, S, S), masks.AndMask(shared, key),
                                                  True, 0))
    assert info.exact and info.kv_start == [0, 1000, 7, 4095] and info.window == 1024
    bound = 4 * 16 * B * S + 64 * B * S
    assert peak <= bound, f"analysis peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"


def test_row_mask_of_a_split_mask_builds_only_its_rows():
    """eviction/runtime.py `_row_mask` (SnapKV's observed rows, H2O's query blocks) over the
    split mask equals the whole mask's rows lo..hi of that batch row, and builds only those
    (B=4, S=L=2048: the whole product is 16 MiB, one batch row's 4 MiB, 8 rows 16 KiB);
    also over an additive float mask and a mask of one query row (broadcast)."""
    from kvcompile.eviction.runtime import _row_mask

    B, S = 4, 2048
    shared, key = _split([0, 100, 7, 2047], S, S, window=512)
    whole = shared & key
    split = masks.AndMask(shared, key)
    for row, lo, hi in ((1, S - 8, S), (3, 0, 5), (0, 700, 1500)):
        got, peak = peak_bytes(lambda r=row, a=lo, b=hi: _row_mask(split, r, S, a, b))
        assert torch.equal(got, whole[row, :, lo:hi]), (row, lo, hi)
        assert peak <= 4 * (hi - lo) * S, f"{peak} B for {hi - lo} rows"
    add = torch.zeros(B, 1, S, S).masked_fill(~whole, -1e9)
    assert torch.equal(_row_mask(add, 1, S, S - 8), whole[1, :, S - 8:])
    one = whole[:, :, -1:]                                              # [B, 1, 1, L]
    assert torch.equal(_row_mask(one, 2, 6, 2, 5), one[2].expand(1, 3, S))
    assert torch.equal(_row_mask(split, 2, S), whole[2])                # default: all rows
