"""Reading a model's attention mask as the structure kernels take.

Kernels take masks as structure, not as [B, H, S, L] tensors: per-row `kv_start` (left padding),
causality, a sliding window, and in decode an exact per-key row. `analyze` finds that structure
in the mask the model built and says whether it is *exact*; when it is not (a custom mask, an
ALiBi bias), callers use the dense reference, which applies the mask as given.

Mask columns map to key positions: a mask at least as long as the sequence is left-aligned
(column j is position j, as StaticCache masks are); a shorter one is right-aligned (its last
column is the newest key, as a sliding-window cache's mask is) and older keys are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASKED = -1e4  # additive values at or below this are treated as "masked"


@dataclass
class MaskInfo:
    key_mask: torch.Tensor | None   # [B, L] bool: keys the last query may see
    kv_start: list[int]             # leading keys masked for every query, per row
    window: int                     # sliding window found in the mask (0 = none)
    exact: bool                     # mask == (j >= kv_start) & causal & window


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
    key = ("mask", attn_mask.data_ptr(), tuple(attn_mask.shape), is_causal, sliding_window)
    if key in plan.cache:
        return plan.cache[key]
    info = _analyze(plan, attn_mask, is_causal, sliding_window)
    plan.cache[key] = info
    return info


def _analyze(plan, attn_mask, is_causal, sliding_window) -> MaskInfo:
    B, S = plan.batch, plan.new_tokens
    total = max(plan.seq_lens_list)
    allowed, binary = to_bool(attn_mask)
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    allowed = allowed.expand(B, allowed.shape[1], S, allowed.shape[-1])
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        return MaskInfo(None, [0] * B, 0, False)
    if len(set(plan.seq_lens_list)) != 1:
        return MaskInfo(None, [0] * B, 0, False)
    allowed = align(allowed[:, 0], total)                  # [B, S, L]
    key_row = allowed[:, -1]                                # [B, L]
    if not binary:
        return MaskInfo(key_row, [0] * B, 0, False)
    if S == 1 and plan.is_decode:
        # one decode query per row: the kernels take the key row as it is, so nothing about
        # the mask needs to reach the host (no sync per step); kv_start stays the binding's
        return MaskInfo(key_row, list(plan.kv_start), 0, False)
    # kv_start: earliest key any query of the row may see
    any_row = allowed.any(dim=1)                            # [B, L]
    first = torch.where(any_row.any(-1), any_row.float().argmax(-1), torch.full_like(
        any_row[:, 0], total, dtype=torch.long))
    kv_start = [int(x) for x in first.tolist()]
    q_pos = torch.arange(total - S, total, device=allowed.device)[:, None]   # [S, 1]
    k_pos = torch.arange(total, device=allowed.device)[None, :]             # [1, L]
    last_first, seen = torch.stack([key_row.float().argmax(-1),
                                    key_row.any(-1).long()]).tolist()  # one transfer
    window = 0
    for b in range(B):
        if seen[b] and last_first[b] > kv_start[b]:
            window = max(window, (total - 1) - last_first[b] + 1)
    if sliding_window:
        window = sliding_window if not window else min(window, sliding_window)
    start = torch.tensor(kv_start, device=allowed.device)[:, None, None]
    cand = (k_pos[None] >= start) & (k_pos[None] <= q_pos[None])
    if window:
        cand &= (q_pos[None] - k_pos[None]) < window
    real_q = q_pos[None, :, 0] >= start[:, :, 0]                           # [B, S]
    exact = bool(((cand == allowed) | ~real_q[:, :, None]).all())
    return MaskInfo(key_row, kv_start, window, exact)


def token_keep(plan, device) -> torch.Tensor:
    """[B*S] bool: False for left-padding tokens of a prefill (their K/V are stored as zeros)."""
    pos = torch.arange(plan.new_tokens, device=device)
    start = torch.tensor(plan.kv_start, device=device)[:, None]
    past = torch.tensor(plan.past_lens, device=device)[:, None]
    return ((pos[None] + past) >= start).reshape(-1)
