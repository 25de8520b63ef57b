"""Multi-head latent attention (MLA) in plain PyTorch: the expansion the model runs, and the
absorbed form the run time runs over latent pages.

    W = kv_b_proj.weight                                   # [H * (dn + dv), r]
    W_UK, W_UV = W.view(H, dn + dv, r).split([dn, dv], 1)  # [H, dn, r], [H, dv, r]
    expanded:  k = [c W_UK^T, k_rope]   v = c W_UV^T       # [B, H, L, dn + dr], [B, H, L, dv]
    absorbed:  q_lat = [q_nope W_UK, q_rope]               # [B, H, S, r + dr], once per step
               o_lat = softmax(q_lat . [c, k_rope]^T * s) c   # [B, H, S, r]: one kv head (MQA)
               out = o_lat W_UV^T                          # [B, H, S, dv]

q_nope . (W_UK c) = (q_nope W_UK) . c, so both are the same attention; the absorbed one reads
r + dr numbers per cached token instead of H * (dn + dr + dv), and expands nothing.
"""

from __future__ import annotations

import torch

from kvcompile.kernels.dense import _gather, _masks, _pages, compute_dtype, sdpa_attention


def split_weight(w: torch.Tensor, heads: int, nope_dim: int):
    # w: [H * (dn + dv), r] -> W_UK [H, dn, r], W_UV [H, dv, r] (views)
    per_head = w.shape[0] // heads
    if per_head * heads != w.shape[0] or not 0 < nope_dim < per_head:
        raise ValueError(f"kv_b_proj weight {tuple(w.shape)} is not [{heads} heads x (nope "
                         f"{nope_dim} + v), r]")
    w3 = w.view(heads, per_head, w.shape[1])
    return w3[:, :nope_dim], w3[:, nope_dim:]


def expand_latent(latent: torch.Tensor, rope: torch.Tensor, w: torch.Tensor, nope_dim: int,
                  heads: int):
    """The model's own expansion. latent [B, 1, L, r], rope [B, 1, L, dr], w [H*(dn+dv), r]
    -> k [B, H, L, dn + dr], v [B, H, L, dv] in the latent's dtype."""
    B, _, L, r = latent.shape
    w_uk, w_uv = split_weight(w, heads, nope_dim)
    c = latent[:, 0]                                                     # [B, L, r]
    k_nope = torch.einsum("blr,hdr->bhld", c, w_uk.to(c.dtype))
    v = torch.einsum("blr,hdr->bhld", c, w_uv.to(c.dtype))
    k = torch.cat([k_nope, rope.to(k_nope.dtype).expand(B, heads, L, rope.shape[-1])], dim=-1)
    return k, v


def absorb_query(q: torch.Tensor, w: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """q [B, H, S, dn + dr] -> q_lat [B, H, S, r + dr] = [q_nope W_UK, q_rope], in
    compute_dtype(q.dtype)."""
    dt = compute_dtype(q.dtype)
    w_uk, _ = split_weight(w, q.shape[1], nope_dim)
    q_nope, q_rope = q[..., :nope_dim].to(dt), q[..., nope_dim:].to(dt)
    q_abs = torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk.to(dt))
    return torch.cat([q_abs, q_rope], dim=-1)


def latent_output(o_lat: torch.Tensor, w: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """o_lat [B, H, S, r] (attention-weighted latents) -> [B, H, S, dv] = o_lat W_UV^T."""
    _, w_uv = split_weight(w, o_lat.shape[1], nope_dim)
    return torch.einsum("bhsr,hvr->bhsv", o_lat, w_uv.to(o_lat.dtype))


def expand_rows(length: int, heads: int, width: int, elem: int, max_bytes: int) -> int:
    """Rows of an MLA batch whose expanded K/V ([rows, heads, length, width] of `elem`-byte
    elements: dn + dr keys and dv values) fit in max_bytes: at least 1."""
    return max(1, max_bytes // max(1, length * heads * width * elem))


def paged_latent_expanded(kt, vt, q, plan, w, nope_dim: int, scale: float, window: int,
                          max_bytes: int) -> torch.Tensor:
    """An MLA layer's prompt chunk over its latent pages by expansion, as the model attends:
    each row's stored latents (the earlier chunks' and this one's, just written) gathered and
    expanded through kv_b_proj (`expand_latent`) into K [.., dn + dr] and
    V [.., dv], then SDPA of its S queries, the last S of its L positions, causal from its
    kv_start on (left padding) within the window. Rows of one length a group at a time, so
    that the expanded K/V of a group stay under max_bytes (at DeepSeek-V3's 128 heads a
    32k-token row expands to 2.7 GB in bf16). Against the absorbed form (576-wide keys and
    512-wide values for every head) this costs the expansion once per key and a third of the
    attention FLOPs: the cheaper one from a few hundred queries a row.
    q [B, H, S, dn + dr] -> [B, H, S, dv] in compute_dtype(q.dtype)."""
    B, H, S, dqk = q.shape
    dv = w.shape[0] // H - nope_dim
    dt = compute_dtype(q.dtype)
    out = torch.empty((B, H, S, dv), dtype=dt, device=q.device)
    by_len: dict[int, list[int]] = {}
    for b, total in enumerate(plan.seq_lens_list):
        by_len.setdefault(total, []).append(b)
    for total, rows in by_len.items():
        g = expand_rows(total, H, dqk + dv, torch.finfo(dt).bits // 8, max_bytes)
        for r0 in range(0, len(rows), g):
            part = rows[r0:r0 + g]
            idx = _pages(plan.block_tables, part, False, total, kt.page_size)
            c = _gather(kt, idx, len(part), total, dt)                    # [g, 1, L, r]
            rope = _gather(vt, idx, len(part), total, dt)                 # [g, 1, L, dr]
            k, v = expand_latent(c, rope, w, nope_dim, H)
            del c, rope
            allowed, additive, causal = _masks(None, S, total, True, window,
                                               [plan.kv_start[b] for b in part], q.device)
            sel = (slice(part[0], part[-1] + 1) if part[-1] - part[0] == len(part) - 1
                   else torch.tensor(part, device=q.device))   # (a slice: no copy of q)
            out[sel] = sdpa_attention(q[sel], k, v, allowed, additive, scale, causal)
    return out
