"""Moving tokens inside one layer's paged storage, per kv head: the data side of compaction.

    move_slots(paged, src, dst, heads)   # src, dst: [M] global slots (page * P + offset)
                                         # heads:    [M] kv head of each move

Token `m` of head `heads[m]` is copied from slot `src[m]` to slot `dst[m]`, with its scale:
- unquantized, token-scaled and tensor-scaled formats copy codes (and per-token scales / fp4
  micro-scales) bit for bit: compaction is exact;
- page-scaled formats decode the moved tokens, then re-encode each destination (page, head) whose
  scale must grow to cover them (`grow_page_scale`, a power of two, so the tokens already there
  keep their decoded values); only the moved tokens are quantized a second time.
All sources are read before any destination is written, so src and dst may overlap.
"""

from __future__ import annotations

import torch

from kvcompile.cache.formats import PagedTensor, grow_page_scale
from kvcompile.cache.fp4 import finite_amax, scale_from_amax


def move_slots(paged: PagedTensor, src: torch.Tensor, dst: torch.Tensor,
               heads: torch.Tensor) -> None:
    # src, dst, heads: [M] int64 on the storage device
    if src.numel() == 0:
        return
    P = paged.page_size
    ps, os_, pd, od = src // P, src % P, dst // P, dst % P
    fmt = paged.fmt
    if not fmt.is_quantized or fmt.granularity in ("token", "tensor"):
        paged.data[pd, heads, od] = paged.data[ps, heads, os_]
        if paged.micro is not None:
            paged.micro[pd, heads, od] = paged.micro[ps, heads, os_]
        if fmt.is_quantized and fmt.granularity == "token":
            paged.scale[pd, heads, od] = paged.scale[ps, heads, os_]
        return
    _move_page_scaled(paged, ps, os_, pd, od, heads)


def _move_page_scaled(paged, ps, os_, pd, od, heads) -> None:
    up, inv = torch.unique(ps, return_inverse=True)
    vals = paged.read(up)[inv, heads, os_]                               # [M, D] fp32
    ud, dinv = torch.unique(pd, return_inverse=True)
    tiles = paged.read(ud)                                               # [U, H, P, D]
    H = paged.num_heads
    old = paged.scale[ud]                                                # [U, H]
    need = torch.zeros_like(old).view(-1).scatter_reduce(
        0, dinv * H + heads, finite_amax(vals, -1, keepdim=False), "amax").view_as(old)
    div = paged.fmt.scale_divisor
    # A (page, head) whose scale is still the initial 1.0 placeholder of an unused page cannot
    # occur here: destinations are slots of pages the sequence already holds.
    new = grow_page_scale(old, need / div)
    new = torch.where(old > 0, new, scale_from_amax(need, div))
    tiles[dinv, heads, od] = vals
    codes, micro = paged._encode(tiles, new[:, :, None, None])
    paged.data[ud] = codes
    if micro is not None:
        paged.micro[ud] = micro
    paged.scale[ud] = new
