"""FlexAttention over kvcompile's paged layout, the baseline of bench_decode.py.

The pool [N, Hkv, P, D] is viewed, without a copy, as one flat sequence of (page, head) rows:
row (n * Hkv + h) * P + o. Flex runs with batch B * Hkv (one per sequence and kv head) and the
G query heads of the group as its heads, so its decoding kernel shares each page among the
group (GQA). A BlockMask with KV blocks of P rows lists each (sequence, kv head)'s pages: full
pages as full blocks, the last partial page as a masked block; mask_mod is the whole predicate
(owner, kv head, position < length), so eager flex (which ignores block sparsity) agrees.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask


def paged_flex_inputs(k_data, v_data, block_tables, seq_lens, num_q_heads: int):
    """-> (q_view_fn, k view [B*Hkv, 1, N*Hkv*P, D], v view, BlockMask).

    q_view_fn maps q [B, Hq, Sq, D] to [B*Hkv, G, Sq, D]; the output maps back with
    .view(B, Hq, Sq, Dv). kv_indices are as wide as the pool: flex asserts that the block mask
    covers the whole KV length (int32 [B*Hkv, 1, 1, N*Hkv], about 0.5 GB at B=64, L=8192)."""
    N, Hkv, P, D = k_data.shape
    dev = k_data.device
    G = num_q_heads // Hkv
    B, maxp = block_tables.shape
    nblk = N * Hkv
    lens = seq_lens.long()
    n_full = lens // P
    n_all = (lens + P - 1) // P
    j = torch.arange(maxp, device=dev)
    h = torch.arange(Hkv, device=dev)
    rows = block_tables.long()[:, None, :] * Hkv + h[None, :, None]             # [B, Hkv, maxp]
    is_full = j[None, :] < n_full[:, None]                                      # [B, maxp]
    is_part = (j[None, :] >= n_full[:, None]) & (j[None, :] < n_all[:, None])
    width = nblk

    def pack(sel):  # selected pages first -> ([B*Hkv, 1, 1] counts, [B*Hkv, 1, 1, width])
        order = torch.where(sel, j[None, :], maxp + j[None, :]).argsort(dim=1)
        idx = torch.gather(rows, 2, order[:, None, :].expand(-1, Hkv, -1))
        out = torch.zeros(B * Hkv, 1, 1, width, dtype=torch.int32, device=dev)
        out[..., :maxp] = idx.reshape(B * Hkv, 1, 1, maxp).to(torch.int32)
        cnt = sel.sum(1).to(torch.int32)[:, None].expand(B, Hkv).reshape(B * Hkv, 1, 1)
        return cnt.contiguous(), out

    full_num, full_idx = pack(is_full)
    part_num, part_idx = pack(is_part)
    owner = torch.full((nblk,), -1, dtype=torch.long, device=dev)
    logical = torch.zeros(nblk, dtype=torch.long, device=dev)
    valid = j[None, :] < n_all[:, None]
    blk = block_tables.long()[:, :, None] * Hkv + h                               # [B, maxp, Hkv]
    owner[blk[valid].reshape(-1)] = (torch.arange(B, device=dev)[:, None, None] * Hkv
                                     + h).expand(B, maxp, Hkv)[valid].reshape(-1)
    logical[blk[valid].reshape(-1)] = j[None, :, None].expand(B, maxp, Hkv)[valid].reshape(-1)

    def mask_mod(bh, g, q_idx, kv_idx):
        blk_i = kv_idx // P
        return (owner[blk_i] == bh) & (logical[blk_i] * P + kv_idx % P < lens[bh // Hkv])

    bm = BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=(128, P),
                                  mask_mod=mask_mod, seq_lengths=(1, nblk * P),
                                  compute_q_blocks=False)
    kf = k_data.view(1, 1, nblk * P, D).expand(B * Hkv, 1, -1, -1)
    vf = v_data.view(1, 1, nblk * P, v_data.shape[-1]).expand(B * Hkv, 1, -1, -1)
    return (lambda q: q.reshape(B * Hkv, G, q.shape[2], q.shape[3])), kf, vf, bm
