"""Plain-PyTorch attention used at run time where no kernel applies.

`dense_attention` is attention over given k/v (a graph run without a cache binding).
`paged_reference_attention` gathers a layer's pages, dequantizes them with the formats'
reference decoders and attends in fp32, applying any mask exactly as given. It is what the CPU
runs (KVConfig.kernels="reference") and the fallback for masks no kernel can express.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvcompile.kernels.masks import align


def attend_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed, additive,
                scale: float, softcap: float) -> torch.Tensor:
    """q [Hq, S, D], k [Hkv, L, D], v [Hkv, L, Dv] (any float), allowed [.., S, L] bool or None,
    additive [.., S, L] or None -> [Hq, S, Dv] fp32. Rows with no allowed key give 0."""
    hq, hkv = q.shape[0], k.shape[0]
    rep, S, L = hq // hkv, q.shape[1], k.shape[1]
    kf, vf = k.float(), v.float()
    # GQA without repeating K/V: the query heads of a group share one matmul
    qg = q.float().reshape(hkv, rep * S, q.shape[-1])                  # [Hkv, rep*S, D]
    s = torch.matmul(qg, kf.transpose(-1, -2)).reshape(hq, S, L) * scale   # [Hq, S, L]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if additive is not None:
        s = s + additive.float()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    # masked keys contribute exactly zero, even if their stored values are not finite
    vf = torch.where(torch.isfinite(vf), vf, torch.zeros_like(vf)) if allowed is not None else vf
    out = torch.matmul(p.reshape(hkv, rep * S, L), vf)                   # [Hkv, rep*S, Dv]
    return out.reshape(hq, S, vf.shape[-1])


def attend_sdpa(q, k, v, allowed, additive, scale: float, causal: bool = False) -> torch.Tensor:
    """The same contract as `attend_fp32`, through torch SDPA in the model's dtype: the CUDA
    prefill path while the Triton prefill kernels are opt-in (runtime.KernelDispatch)."""
    dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    mask = None
    if additive is not None:
        mask = additive.to(dt)
        if allowed is not None:
            mask = mask.masked_fill(~allowed, float("-inf"))
    elif allowed is not None and not causal:
        mask = allowed
    out = F.scaled_dot_product_attention(
        q[None].to(dt), k[None].to(dt), v[None].to(dt),
        attn_mask=None if mask is None else mask[None], scale=scale,
        is_causal=causal and mask is None, enable_gqa=q.shape[0] != k.shape[0])[0]
    return torch.nan_to_num(out.float(), nan=0.0)  # rows with no key: 0, as attend_fp32


def _attend(q, k, v, allowed, additive, scale, softcap, causal_only: bool):
    if q.is_cuda and not softcap:
        return attend_sdpa(q, k, v, allowed, additive, scale, causal=causal_only)
    return attend_fp32(q, k, v, allowed, additive, scale, softcap)


def _structure(s: int, total: int, is_causal: bool, window: int, device) -> torch.Tensor | None:
    """[S, L] bool from causality (queries are the last S positions) and a sliding window."""
    if not is_causal and not window:
        return None
    q_pos = torch.arange(total - s, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    ok = torch.ones(s, total, dtype=torch.bool, device=device)
    if is_causal:
        ok &= k_pos <= q_pos
    if window:
        ok &= (q_pos - k_pos) < window
    return ok


def _split_mask(mask_b: torch.Tensor | None, s: int, total: int):
    """A row of the model's mask -> (allowed, additive), aligned to `total` keys."""
    if mask_b is None:
        return None, None
    while mask_b.dim() < 3:
        mask_b = mask_b.unsqueeze(0)
    mask_b = mask_b.expand(mask_b.shape[0], s, mask_b.shape[-1])
    if mask_b.dtype == torch.bool:
        return align(mask_b, total), None
    lm = mask_b.shape[-1]
    if lm >= total:
        return None, mask_b[..., :total]
    pad = mask_b.new_full((*mask_b.shape[:-1], total - lm), float("-inf"))
    return None, torch.cat([pad, mask_b], dim=-1)


def dense_attention(q, k, v, attn_mask, scale, is_causal, sliding_window, softcap):
    # q [B, Hq, S, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv] -> [B, Hq, S, Dv]
    if scale is None or scale <= 0:
        scale = 1.0 / math.sqrt(q.shape[-1])
    B, _, S, _ = q.shape
    total = k.shape[2]
    struct = _structure(S, total, is_causal, sliding_window, q.device)
    outs = []
    for b in range(B):
        mb = None if attn_mask is None else attn_mask[b if attn_mask.shape[0] > 1 else 0]
        allowed, additive = _split_mask(mb, S, total)
        if struct is not None:
            allowed = struct if allowed is None else allowed & struct
        outs.append(attend_fp32(q[b], k[b], v[b], allowed, additive, scale, softcap))
    return torch.stack(outs).to(q.dtype)


def paged_reference_attention(pool, layer: int, q, plan, attn_mask, is_causal, sliding_window,
                              softcap, scale):
    """Attention of q over the pool's pages of `layer` for each sequence of the plan."""
    kt, vt = pool.k[layer], pool.v[layer]
    if plan.packed:
        # q [1, Hq, T, D] packed: sequence i owns q columns cu[i]:cu[i+1]
        out = q.new_empty((*q.shape[:-1], vt.head_dim), dtype=torch.float32)
        cu = plan.cu_seqlens_q.tolist()
        for i, sid in enumerate(plan.seq_ids):
            total = plan.seq_lens_list[i]
            k, v = _gather(pool, kt, vt, sid, total)
            s = cu[i + 1] - cu[i]
            allowed = _structure(s, total, True, sliding_window, q.device)
            out[0, :, cu[i]:cu[i + 1]] = _attend(
                q[0, :, cu[i]:cu[i + 1]], k, v, allowed, None, scale, softcap,
                causal_only=s == total and not sliding_window)
        return out
    B, _, S, _ = q.shape
    outs = []
    for b, sid in enumerate(plan.seq_ids):
        total = plan.seq_lens_list[b]
        k, v = _gather(pool, kt, vt, sid, total)
        mb = None if attn_mask is None else attn_mask[b if attn_mask.shape[0] > 1 else 0]
        allowed, additive = _split_mask(mb, S, total)
        struct = _structure(S, total, is_causal, sliding_window, q.device)
        if plan.kv_start[b]:
            start_ok = torch.arange(total, device=q.device) >= plan.kv_start[b]
            struct = start_ok[None].expand(S, total) if struct is None else struct & start_ok
        causal_only = (mb is None and is_causal and not sliding_window and S == total
                       and not plan.kv_start[b])
        if struct is not None:
            allowed = struct if allowed is None else allowed & struct
        outs.append(_attend(q[b], k, v, allowed, additive, scale, softcap, causal_only))
    return torch.stack(outs)


def _gather(pool, kt, vt, seq_id: int, total: int):
    """k [Hkv, L, D], v [Hkv, L, Dv] fp32 of one sequence, dequantized."""
    pages = torch.as_tensor(pool.pages_of(seq_id), dtype=torch.long, device=kt.data.device)
    k = kt.read(pages)   # [n, H, P, D]
    v = vt.read(pages)
    k = k.permute(1, 0, 2, 3).reshape(kt.num_heads, -1, kt.head_dim)[:, :total]
    v = v.permute(1, 0, 2, 3).reshape(vt.num_heads, -1, vt.head_dim)[:, :total]
    return k, v
