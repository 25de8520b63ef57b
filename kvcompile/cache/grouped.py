"""Scale updates of scale groups that span tokens ("page" and "channel" granularity), for
appends: which parameters the new tokens of a page force to change, and nothing else.

A write hands the touched pages as a tile [U, H, P, D] fp32: earlier valid tokens decoded,
new tokens raw, other slots zero; `old` [U, P] marks the earlier valid slots, `new` [U, P] the
new ones. Every rule is sticky: a parameter changes only when the new tokens need it, so
re-encoding a (page, head) whose parameters did not change reproduces its codes exactly.

- fp8 / fp4 scales (page: [U, H]; fp8 channel: [U, H, D]) grow by powers of two
  (formats.grow_page_scale): earlier tokens re-encode by an exponent shift, bit-identically.
- fp4 "channel" micro scales [U, H, P/16, D] (one E4M3 scale per channel per 16 tokens) follow
  the page scale's growth exactly (micro * old / new) and are recomputed from the group's values
  only when its new tokens overflow it (earlier tokens of that group are rounded again).
- int (scale, zero) per page [U, H] or per channel [U, H, D] are kept while
  [zero, zero + levels * scale] holds the new tokens, else recomputed from all valid tokens
  (earlier tokens of that group are rounded again). With `residual`, a page is quantized once,
  whole, and none of this re-rounding happens.
"""

from __future__ import annotations

import torch

from kvcompile.cache.fp4 import E2M1_MAX, MICRO_BLOCK, finite_amax, micro_scale, scale_from_amax
from kvcompile.cache.fp8 import grow_page_scale
from kvcompile.cache.intq import covers, int_params


def reduce_dims(granularity: str) -> tuple[int, ...]:
    """Dims of a [U, H, P, D] tile that one scale group spans."""
    return (2, 3) if granularity == "page" else (2,)


def update_float_scale(old_scale: torch.Tensor, tile: torch.Tensor, old: torch.Tensor,
                       new: torch.Tensor, granularity: str, divisor: float) -> torch.Tensor:
    """New fp32 scales [U, H] (page) or [U, H, D] (channel) of fp8, or of fp4's page scale."""
    red = reduce_dims(granularity)
    old_amax = finite_amax(torch.where(old[:, None, :, None], tile, 0.0), red, keepdim=False)
    new_amax = finite_amax(torch.where(new[:, None, :, None], tile, 0.0), red, keepdim=False)
    # A group with no finite non-zero earlier value takes its scale from the new tokens alone
    # (this also discards whatever a reused page held); otherwise the scale only grows.
    return torch.where(old_amax == 0, scale_from_amax(new_amax, divisor),
                       grow_page_scale(old_scale, new_amax / divisor))


def update_fp4_channel_micro(old_micro: torch.Tensor, old_scale: torch.Tensor,
                             new_scale: torch.Tensor, tile: torch.Tensor, old: torch.Tensor,
                             new: torch.Tensor) -> torch.Tensor:
    """New micro scales [U, H, G, D] (G = P / 16) for the fp4 channel layout."""
    U, H, P, D = tile.shape
    G = P // MICRO_BLOCK
    valid = (old | new)[:, None, :, None]
    blocks = lambda m: torch.where(m, tile, 0.0).view(U, H, G, MICRO_BLOCK, D)  # noqa: E731
    amax_all = finite_amax(blocks(valid), 3, keepdim=False)                       # [U, H, G, D]
    amax_new = finite_amax(blocks(new[:, None, :, None]), 3, keepdim=False)
    s = new_scale[:, :, None, None]
    shifted = (old_micro.float() * (old_scale / new_scale)[:, :, None, None]).to(
        torch.float8_e4m3fn)
    had_old = old.view(U, G, MICRO_BLOCK).any(-1)[:, None, :, None]              # [U, 1, G, 1]
    covered = amax_new <= E2M1_MAX * shifted.float() * s
    redo = ~had_old | ~covered | ~torch.isfinite(shifted.float())
    fresh = micro_scale(amax_all, s)
    micro = torch.where(redo, fresh.float(), shifted.float())
    has_nan = torch.isnan(torch.where(valid, tile, 0.0)).view(U, H, G, MICRO_BLOCK, D).any(3)
    return torch.where(has_nan, torch.nan, micro).to(torch.float8_e4m3fn)


def update_int_params(old_scale: torch.Tensor, old_zero: torch.Tensor, tile: torch.Tensor,
                      old: torch.Tensor, new: torch.Tensor, granularity: str, bits: int):
    """New fp16 (scale, zero), [U, H] (page) or [U, H, D] (channel), of an int format."""
    red = reduce_dims(granularity)
    valid = (old | new)[:, None, :, None]
    newm = new[:, None, :, None].expand_as(tile)
    fin = torch.isfinite(tile) & newm
    lo_new = torch.where(fin, tile, torch.inf).amin(dim=red)
    hi_new = torch.where(fin, tile, -torch.inf).amax(dim=red)
    had_old = old.any(-1)
    had_old = had_old.view(-1, *([1] * (lo_new.dim() - 1)))
    ok = covers(old_scale, old_zero, lo_new, hi_new, bits) & torch.isfinite(old_scale.float())
    nan_new = torch.isnan(torch.where(newm, tile, 0.0)).any(dim=red)
    keep = had_old & ok & ~nan_new
    scale, zero = int_params(tile, red, bits, keepdim=False, mask=valid.expand_as(tile))
    return torch.where(keep, old_scale, scale), torch.where(keep, old_zero, zero)


def changed_heads(pairs, granularity: str) -> torch.Tensor:
    """[U, H] bool: (page, head)s any of whose parameters changed. pairs: (old, new) tensors
    shaped [U, H, ...]; NaN == NaN counts as unchanged."""
    out = None
    for a, b in pairs:
        same = (a.float() == b.float()) | (torch.isnan(a.float()) & torch.isnan(b.float()))
        diff = ~same
        while diff.dim() > 2:
            diff = diff.any(-1)
        out = diff if out is None else out | diff
    return out
