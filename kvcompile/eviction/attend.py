"""Attention over the tokens a policy kept, in plain PyTorch (fp32): what eviction layers run on
the CPU, and where no kernel applies.

After eviction a sequence's stored slots no longer match logical positions: slot j of kv head h
holds the token at logical index `pos[h, j]` (-1: a hole), and heads may hold different tokens.
Every structural rule is therefore applied to logical indices: causality (`pos <= q_pos`), the
model's sliding window, left padding (`pos >= start`), and the model's own mask, whose columns
are logical indices (left-aligned when at least as long as the sequence, else right-aligned).

The same pass over the probabilities yields the bookkeeping the policies need: `mass` (H2O: the
attention each slot received, summed over the group's query heads and the queries) and `obs`
(SnapKV: per query for the last `obs_rows` queries, [Hkv, obs_rows, L], so that a policy
with a shorter observation window can use the tail of it).

Sink re-rotation (StreamingLLM's positions within the cache): keys are stored after RoPE at
their original positions. To make sink key i appear at position `p_i + shift` instead, its score
uses the query rotated by -shift (RoPE scores depend on the difference of positions only), so
the stored, quantized key is never rewritten.
"""

from __future__ import annotations

import torch

from kvcompile.kernels.reference import masked_softmax

_Q_BLOCK = 1024  # queries per block: bounds the [Hq, S, L] score tensor of long prefills


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotation(inv_freq: torch.Tensor, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [D] of a RoPE rotation by `shift` positions (HF rotate_half layout)."""
    ang = inv_freq.double() * shift
    ang = torch.cat([ang, ang])
    return ang.cos().float(), ang.sin().float()


def mask_columns(mask_b: torch.Tensor, pos: torch.Tensor, total: int, group: int):
    """The model's mask for one batch row, mapped onto slots.

    mask_b [Hm, S, Lm] bool or additive (Hm 1 or Hq); pos [Hkv, L]; total: logical length.
    -> (allowed [Hkv|1, G|1, S, L] bool or None, additive [.., S, L] fp32 or None)."""
    hm, s, lm = mask_b.shape
    offset = max(0, total - lm)
    col = pos - offset                                                   # [Hkv, L]
    inside = (col >= 0) & (col < lm)
    idx = col.clamp(0, lm - 1)
    hkv, L = pos.shape
    if hm == 1:
        g = mask_b[0][:, idx]                                            # [S, Hkv, L]
        g = g.permute(1, 0, 2)[:, None]                                  # [Hkv, 1, S, L]
    else:
        idx_q = idx.repeat_interleave(group, 0)                          # [Hq, L]
        g = torch.gather(mask_b, 2, idx_q[:, None, :].expand(hm, s, L))
        g = g.view(hkv, group, s, L)
    ins = inside[:, None, None, :]
    if g.dtype == torch.bool:
        return g & ins, None
    return ins.expand_as(g), g.float()


def attend_kept(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                q_pos: torch.Tensor, scale: float, *, causal: bool = True, window: int = 0,
                start: int = 0, softcap: float = 0.0, mask_b: torch.Tensor | None = None,
                total: int = 0, sink_slots: torch.Tensor | None = None,
                sink_rot: tuple | None = None, want_mass: bool = False, obs_rows: int = 0):
    """q [Hq, S, D], k [Hkv, L, D], v [Hkv, L, Dv] (fp32), pos [Hkv, L] int64, q_pos [S] int64.

    sink_slots [Hkv, n] int64 + sink_rot (cos, sin) [D]: score those slots with the rotated
    query. Returns out [Hq, S, Dv] fp32, mass [Hkv, L] or None, obs [Hkv, R, L] or None."""
    Hq, S, D = q.shape
    Hkv, L, _ = k.shape
    G = Hq // Hkv
    qg = q.float().view(Hkv, G, S, D)
    kf, vf = k.float(), v.float()
    ok_key = pos >= start                                                 # [Hkv, L]
    vf = torch.where(ok_key[..., None] & torch.isfinite(vf), vf, 0.0)
    mass = torch.zeros(Hkv, L, dtype=torch.float32, device=q.device) if want_mass else None
    obs = (torch.zeros(Hkv, obs_rows, L, dtype=torch.float32, device=q.device)
           if obs_rows else None)
    out = torch.empty(Hq, S, v.shape[-1], dtype=torch.float32, device=q.device)
    for lo in range(0, S, _Q_BLOCK):
        hi = min(S, lo + _Q_BLOCK)
        qb = qg[:, :, lo:hi]                                              # [Hkv, G, s, D]
        s = torch.einsum("hgsd,hld->hgsl", qb, kf) * scale
        if sink_slots is not None and sink_slots.numel():
            cos, sin = sink_rot
            qr = qb * cos + rotate_half(qb) * sin
            ks = torch.gather(kf, 1, sink_slots[..., None].expand(-1, -1, D))
            sr = torch.einsum("hgsd,hnd->hgsn", qr, ks) * scale
            idx = sink_slots[:, None, None, :].expand(-1, G, hi - lo, -1)
            s = s.scatter(-1, idx, sr)
        p = masked_softmax(*_block_scores(s, ok_key, pos, q_pos[lo:hi], causal, window, softcap,
                                          mask_b, lo, hi, total, G))
        out[:, lo:hi] = torch.einsum("hgsl,hld->hgsd", p, vf).reshape(Hq, hi - lo, -1)
        if mass is not None:
            mass += p.sum((1, 2))
        if obs is not None and hi > S - obs_rows:
            first = max(lo, S - obs_rows)
            obs[:, first - (S - obs_rows):hi - (S - obs_rows)] = p[:, :, first - lo:].sum(1)
    return out, mass, obs


def _block_scores(s, ok_key, pos, qp, causal: bool, window: int, softcap: float, mask_b, lo: int,
                  hi: int, total: int, G: int):
    """One query block's scores s [Hkv, G, hi - lo, L] (softcapped, the mask's additive part
    added) and the slots each query may see [Hkv, 1|G, hi - lo, L]: real slots (ok_key
    [Hkv, L]), causality and the window by stored position pos [Hkv, L] against the block's
    query positions qp, and the model's mask rows mask_b [B-row, S, total] or None."""
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    Hkv, L = ok_key.shape
    allowed = ok_key[:, None, None, :].expand(Hkv, 1, hi - lo, L)
    if causal:
        allowed = allowed & (pos[:, None, None, :] <= qp[None, None, :, None])
    if window:
        allowed = allowed & (qp[None, None, :, None] - pos[:, None, None, :] < window)
    if mask_b is not None:
        m_allowed, m_add = mask_columns(mask_b[:, lo:hi], pos, total, G)
        allowed = allowed & m_allowed
        if m_add is not None:
            s = s + m_add
    return s, allowed


_MASS_ELEMS = 1 << 24   # scores per query block of `prompt_mass`: [Hq, s, L] fp32, 64 MiB


def prompt_mass(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, q_pos: torch.Tensor,
                scale: float, *, causal: bool = True, window: int = 0, start: int = 0,
                softcap: float = 0.0, mask_b: torch.Tensor | None = None,
                total: int = 0) -> torch.Tensor:
    """`attend_kept`'s mass alone (no values, no output): q [Hq, S, D], k [Hkv, L, D],
    pos [Hkv, L], q_pos [S] -> mass [Hkv, L] fp32, the probabilities each slot receives summed
    over the group's query heads and the queries. Query blocks bound the scores to
    _MASS_ELEMS elements, so a long prompt's [S, L] is never made whole. The CPU path of a
    prompt that attended through the plain kernels (kernels/prompt_mass.py on CUDA)."""
    Hq, S, D = q.shape
    Hkv, L, _ = k.shape
    G = Hq // Hkv
    qg = q.float().view(Hkv, G, S, D)
    kf = k.float()
    ok_key = pos >= start
    mass = torch.zeros(Hkv, L, dtype=torch.float32, device=q.device)
    block = max(1, min(_Q_BLOCK, _MASS_ELEMS // max(1, Hq * L)))
    for lo in range(0, S, block):
        hi = min(S, lo + block)
        s = torch.einsum("hgsd,hld->hgsl", qg[:, :, lo:hi], kf) * scale
        mass += masked_softmax(*_block_scores(s, ok_key, pos, q_pos[lo:hi], causal, window,
                                              softcap, mask_b, lo, hi, total, G)).sum((1, 2))
    return mass
