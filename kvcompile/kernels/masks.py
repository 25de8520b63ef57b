"""Reading a model's attention mask as the structure kernels take.

Kernels take masks as structure, not as [B, H, S, L] tensors: per-row `kv_start` (left padding),
causality, a sliding window, and in decode an exact per-key row. `analyze` finds that structure
in the mask the model built and says whether it is *exact*; when it is not (a custom mask, an
ALiBi bias), callers use the dense reference, which applies the mask as given.

Mask columns map to key positions: a mask at least as long as the sequence is left-aligned
(column j is position j, as StaticCache masks are); a shorter one is right-aligned (its last
column is the newest key, as a sliding-window cache's mask is) and older keys are masked.

Memory: the model's own mask is [B, H, S, L] (16 GiB of bool at B16 / S = L = 32k); the
analysis adds O(B x L) plus one block of query rows at a time (`BLOCK_ELEMENTS`), never a
tensor of the mask's size. It reads the mask twice: once for the first key any query sees
(`kv_start`) and the last row (the window), once to compare every real query row with the
structure found, block by block, reducing each block to one flag on the device (two host
syncs per analysis, memoized per forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASKED = -1e4  # additive values at or below this are treated as "masked"

# Elements of one block of mask rows compared at a time: 64 Mi (64 MiB of bool temporaries;
# 64 query rows per block at B16 / L = 32k). Bounds the analysis' memory, whatever S is.
BLOCK_ELEMENTS = 1 << 26

# The sm_90 decode kernel reads a key mask in steps of this many slots: a bool mask whose width
# is a multiple of it is read as it is (decode_sm90.py `_padded_mask`), any other is copied.
KEY_MASK_ALIGN = 16


def key_mask_width(n: int) -> int:
    """n key-mask columns rounded up to KEY_MASK_ALIGN."""
    return -(-n // KEY_MASK_ALIGN) * KEY_MASK_ALIGN


@dataclass
class MaskInfo:
    key_mask: torch.Tensor | None   # [B, Lm] bool: keys the last query may see (Lm: L
    #                                 rounded up to KEY_MASK_ALIGN, True past L)
    kv_start: list[int]             # leading keys masked for every query, per row
    window: int                     # sliding window found in the mask (0 = none)
    exact: bool                     # mask == (j >= kv_start) & causal & window
    reason: str = ""                # why the mask is not exact (for the fallback's message)


class AndMask:
    """`a & b` of two bool masks that broadcast together ([1, 1, S, L] causality / window and
    [B, 1, 1, L] padding, as the rewrite splits HF's mask), never built whole: indexing ANDs
    the same block of both, so the analysis below reads it in O(B x L) plus one block."""

    dtype = torch.bool

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        if a.dtype != torch.bool or b.dtype != torch.bool:
            raise TypeError(f"AndMask takes bool masks, got {a.dtype} and {b.dtype}")
        while a.dim() < 4:
            a = a.unsqueeze(0)
        while b.dim() < 4:
            b = b.unsqueeze(0)
        self.shape = torch.broadcast_shapes(a.shape, b.shape)
        self.a, self.b = a, b
        self.device = a.device

    def dim(self) -> int:
        return len(self.shape)

    def key(self) -> tuple:
        return (self.a.data_ptr(), tuple(self.a.shape), self.b.data_ptr(), tuple(self.b.shape))

    def expand(self, *shape) -> AndMask:
        out = AndMask.__new__(AndMask)
        out.a, out.b = self.a.expand(*shape), self.b.expand(*shape)
        out.shape, out.device = out.a.shape, self.device
        return out

    def slice_keys(self, n: int) -> AndMask:
        """The first n key columns (a view of each part)."""
        out = AndMask.__new__(AndMask)
        out.a = self.a[..., :n] if self.a.shape[-1] != 1 else self.a
        out.b = self.b[..., :n] if self.b.shape[-1] != 1 else self.b
        out.shape, out.device = torch.Size((*self.shape[:-1], n)), self.device
        return out

    def __getitem__(self, idx):
        a, b = self.a, self.b
        if a.shape != self.shape:
            a = a.expand(self.shape)
        if b.shape != self.shape:
            b = b.expand(self.shape)
        return a[idx] & b[idx]

    def materialize(self) -> torch.Tensor:
        return self.a & self.b


def combine(attn_mask, key_mask):
    """One tensor for `attn_mask & key_mask` (either may be None): for the dense paths."""
    if key_mask is None:
        return attn_mask
    if attn_mask is None:
        return key_mask
    return attn_mask & key_mask


def dense(plan, mask):
    """The mask as one tensor, for the paths that apply it as given (the reference, eviction,
    hooks): an AndMask is built once per forward and kept on the plan, so that every layer
    reading the same two parts shares it (and a cache keyed by its address cannot see a
    freed tensor's address reused by another mask)."""
    if not isinstance(mask, AndMask):
        return mask
    key = ("dense_mask",) + mask.key()
    out = plan.cache.get(key)
    if out is None:
        out = plan.cache[key] = mask.materialize()
    return out


def _mask_key(mask) -> tuple:
    if isinstance(mask, AndMask):
        return mask.key()
    return (mask.data_ptr(), tuple(mask.shape))


def to_bool(mask: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(allowed, binary): an additive mask is binary when it holds only 0 and <= -1e4."""
    if mask.dtype == torch.bool:
        return mask, True
    allowed = mask == 0
    binary = bool(((mask == 0) | (mask <= _MASKED)).all())
    return allowed, binary


def align(allowed: torch.Tensor, total_len: int) -> torch.Tensor:
    """[..., S, Lm] -> [..., S, L] with the column convention above."""
    lm = allowed.shape[-1]
    if lm >= total_len:
        return allowed[..., :total_len]
    pad = allowed.new_zeros((*allowed.shape[:-1], total_len - lm))
    return torch.cat([pad, allowed], dim=-1)


def analyze(plan, attn_mask: torch.Tensor, is_causal: bool, sliding_window: int) -> MaskInfo:
    key = ("mask", _mask_key(attn_mask), is_causal, sliding_window)
    if key in plan.cache:
        return plan.cache[key][1]
    info = _analyze(plan, attn_mask, is_causal, sliding_window)
    # the entry holds the mask: keyed by address, it must not see a freed mask's address
    # reused by another layer's mask within the forward (a mask built per layer)
    plan.cache[key] = (attn_mask, info)
    return info


def _view4(attn_mask: torch.Tensor, B: int, S: int, total: int) -> tuple[torch.Tensor, int]:
    """The mask as a [B, H, S, Lc] view (no copy) and the key position of its column 0.

    Lc = min(Lm, total): columns past the sequence are dropped (StaticCache), a shorter mask's
    columns are the last Lc positions. A head dim broadcast by stride 0 becomes H = 1."""
    m = attn_mask
    if isinstance(m, AndMask):
        m = m.expand(B, m.shape[1], S, m.shape[-1])
        lc = min(m.shape[-1], total)
        return (m if lc == m.shape[-1] else m.slice_keys(lc)), total - lc
    while m.dim() < 4:
        m = m.unsqueeze(0)
    m = m.expand(B, m.shape[1], S, m.shape[-1])
    if m.shape[1] > 1 and m.stride(1) == 0:
        m = m[:, :1]
    lc = min(m.shape[-1], total)
    return m[..., :lc], total - lc


def _allowed(block: torch.Tensor) -> torch.Tensor:
    return block if block.dtype == torch.bool else block == 0


def _key_row(m: torch.Tensor, off: int) -> torch.Tensor:
    """[B, Lm] bool: the keys the last query of each row may see (head 0), Lm = off + Lc
    rounded up to KEY_MASK_ALIGN with True columns (keys j >= Lm are seen: the same mask), so
    the sm_90 kernels read it as it is instead of copying it once a layer (decode_sm90.py
    `_padded_mask`)."""
    row = _allowed(m[:, 0, -1])                                          # [B, Lc]
    B, lc = row.shape
    width = key_mask_width(off + lc)
    out = torch.ones(B, width, dtype=torch.bool, device=row.device)
    out[:, :off] = False
    out[:, off:off + lc] = row
    return out   # contiguous: kernels index it [b * Lm + j] (a broadcast row has stride 0)


def _rows_per_block(m: torch.Tensor) -> int:
    B, H, S, lc = m.shape
    return max(1, min(S, BLOCK_ELEMENTS // max(B * H * lc, 1)))


def _analyze(plan, attn_mask, is_causal, sliding_window) -> MaskInfo:
    B, S = plan.batch, plan.new_tokens
    total = max(plan.seq_lens_list)
    m, off = _view4(attn_mask, B, S, total)                              # [B, H, S, Lc]
    if len(set(plan.seq_lens_list)) != 1:
        return MaskInfo(None, [0] * B, 0, False, "rows of different lengths")
    if S == 1 and plan.is_decode:
        return _decode_info(plan, m, off)
    stats = _first_pass(m, off, total).tolist()                          # one transfer
    if stats[0]:
        return MaskInfo(None, [0] * B, 0, False, "mask with per-head structure")
    if stats[1]:
        return MaskInfo(None, [0] * B, 0, False, "additive mask that is not 0 / -inf (a bias)")
    kv_start, last_first, seen = (stats[2 + i * B:2 + (i + 1) * B] for i in range(3))
    window = 0
    for b in range(B):
        if seen[b] and last_first[b] > kv_start[b]:
            window = max(window, (total - 1) - last_first[b] + 1)
    if sliding_window:
        window = sliding_window if not window else min(window, sliding_window)
    key_row = _key_row(m, off)
    exact = _matches(m, off, total, kv_start, window)
    reason = "" if exact else "mask that is not causal + padding + window"
    return MaskInfo(key_row, kv_start, window, exact, reason)


def _decode_info(plan, m, off) -> MaskInfo:
    """One decode query per row: the kernels take the key row as it is, so nothing about the
    mask needs to reach the host for a bool mask (no sync per step); kv_start stays the
    binding's. A per-head or non-binary (bias) mask has no key row: the reference applies it."""
    B = m.shape[0]
    if isinstance(m, AndMask):
        m = m.materialize()                                              # one row per batch row
    allowed = _allowed(m)                                                # [B, H, 1, Lc]
    if m.dtype != torch.bool and not bool(((m == 0) | (m <= _MASKED)).all()):
        return MaskInfo(None, [0] * B, 0, False, "additive mask that is not 0 / -inf (a bias)")
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        return MaskInfo(None, [0] * B, 0, False, "mask with per-head structure")
    return MaskInfo(_key_row(m, off), list(plan.kv_start), 0, False, "decode")


def _first_pass(m: torch.Tensor, off: int, total: int) -> torch.Tensor:
    """[2 + 3B] int64 on the mask's device: per-head-differs flag, not-binary flag, kv_start
    (first key any query sees, `total` if none), first key of the last row, last row non-empty.

    Streams over blocks of query rows: O(B x L) state plus one block's temporaries."""
    B, H, S, lc = m.shape
    dev = m.device
    binary = m.dtype == torch.bool
    seen_any = torch.zeros(B, lc, dtype=torch.bool, device=dev)          # [B, Lc]
    per_head = torch.zeros((), dtype=torch.bool, device=dev)
    not_binary = torch.zeros((), dtype=torch.bool, device=dev)
    rows = _rows_per_block(m)
    for s0 in range(0, S, rows):
        blk = m[:, :, s0:s0 + rows]                                      # [B, H, r, Lc]
        allowed = _allowed(blk)
        if not binary:
            ok = blk <= _MASKED
            ok |= allowed
            not_binary |= ~ok.all()
            del ok
        if H > 1:
            per_head |= (allowed[:, 1:] != allowed[:, :1]).any()
        seen_any |= allowed[:, 0].any(dim=1)
        del allowed, blk
    k_pos = torch.arange(lc, device=dev)
    big = torch.full_like(k_pos, lc)
    first = torch.where(seen_any, k_pos, big).amin(-1) + off             # [B]
    first = torch.where(seen_any.any(-1), first, torch.full_like(first, total))
    last = _allowed(m[:, 0, -1])                                         # [B, Lc]
    last_first = torch.where(last, k_pos, big).amin(-1) + off
    return torch.cat([per_head.long().reshape(1), not_binary.long().reshape(1), first,
                      last_first, last.any(-1).long()])


def _matches(m: torch.Tensor, off: int, total: int, kv_start: list[int], window: int) -> bool:
    """Whether every real query row (position >= kv_start) of head 0 equals
    kv_start <= j <= q_pos (and q_pos - j < window). Head equality was checked before.

    Block by block over query rows; each block reduces to a flag on the device."""
    B, _, S, lc = m.shape
    dev = m.device
    k_pos = (torch.arange(lc, device=dev) + off)[None, None, :]         # [1, 1, Lc]
    q_pos = torch.arange(total - S, total, device=dev)                   # [S]
    start = torch.tensor(kv_start, device=dev)[:, None]                  # [B, 1]
    lo = start.expand(B, S)                                              # [B, S]
    if window:
        lo = torch.maximum(lo, (q_pos - window + 1)[None])
    real = q_pos[None] >= start                                          # [B, S]
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    rows = _rows_per_block(m)
    for s0 in range(0, S, rows):
        s1 = min(s0 + rows, S)
        expect = k_pos >= lo[:, s0:s1, None]                             # [B, r, Lc]
        expect &= k_pos <= q_pos[None, s0:s1, None]
        expect ^= _allowed(m[:, 0, s0:s1])                               # mismatches
        bad |= (expect.any(-1) & real[:, s0:s1]).any()
        del expect
    return not bool(bad)


def token_keep(plan, device) -> torch.Tensor:
    """[B*S] bool: False for left-padding tokens among a forward's new tokens (their K/V are
    stored as zeros). A row's padding may span several prefill chunks."""
    pos = torch.arange(plan.new_tokens, device=device)
    start = torch.tensor(plan.kv_start, device=device)[:, None]
    past = torch.tensor(plan.past_lens, device=device)[:, None]
    return ((pos[None] + past) >= start).reshape(-1)
