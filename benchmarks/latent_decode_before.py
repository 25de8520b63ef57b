"""The absorbed MLA decode kernel as it was before issue 22's tensor-core rework (main at
63e6f3c, kvcompile/kernels/latent_decode.py), kept only so that bench_latent_decode.py --quick
can time the old kernel against the new one in the same process. Not used by kvcompile.

16 query heads a program, one page (16 tokens) a step, the splits merged in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels.latent_decode import fast_path_reason

BLOCK_H = 16


@triton.jit
def _latent_split_kernel(QL, CD, CS, RD, RS, BT, SL, ACC, ML, stride_bt, H, NUM_SPLITS,
                         pages_per_split, scale, R: tl.constexpr, DR: tl.constexpr,
                         P: tl.constexpr, BH: tl.constexpr, C_SCALED: tl.constexpr,
                         R_SCALED: tl.constexpr, CDT: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(1)
    h = tl.program_id(2) * BH + tl.arange(0, BH)
    h_ok = h < H
    rr = tl.arange(0, R)
    dd = tl.arange(0, DR)
    t = tl.arange(0, P)
    row = (b * H + h)[:, None] * (R + DR)
    q_c = tl.load(QL + row + rr[None, :], mask=h_ok[:, None], other=0.0).to(CDT)   # [BH, R]
    q_r = tl.load(QL + row + R + dd[None, :], mask=h_ok[:, None], other=0.0).to(CDT)
    L = tl.load(SL + b)
    p0 = split * pages_per_split
    p1 = tl.minimum(p0 + pages_per_split, tl.cdiv(L, P))
    m = tl.full([BH], float("-inf"), tl.float32)
    lsum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, R], tl.float32)
    for pi in range(p0, p1):
        page = tl.load(BT + b * stride_bt + pi).to(tl.int64)
        tok_ok = pi * P + t < L
        c = tl.load(CD + page * (P * R) + t[:, None] * R + rr[None, :], mask=tok_ok[:, None],
                    other=0.0).to(tl.float32)                                      # [P, R]
        kr = tl.load(RD + page * (P * DR) + t[:, None] * DR + dd[None, :],
                     mask=tok_ok[:, None], other=0.0).to(tl.float32)               # [P, DR]
        if C_SCALED:
            c = c * tl.load(CS + page)
        if R_SCALED:
            kr = kr * tl.load(RS + page)
        c = c.to(CDT)
        s = tl.dot(q_c, tl.trans(c)) + tl.dot(q_r, tl.trans(kr.to(CDT)))         # [BH, P]
        s = tl.where(tok_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(CDT), c)
        m = m_new
    out = (b * NUM_SPLITS + split) * H + h
    tl.store(ACC + out[:, None] * R + rr[None, :], acc, mask=h_ok[:, None])
    tl.store(ML + out * 2, m, mask=h_ok)
    tl.store(ML + out * 2 + 1, lsum, mask=h_ok)



def latent_decode_before(q_lat, c_pages, r_pages, block_tables, seq_lens, scale: float,
                            num_splits: int | None = None) -> torch.Tensor:
    """q_lat [B, H, r + dr] -> [B, H, r] fp32, as kvcompile/kernels/latent_decode.py."""
    why = fast_path_reason(q_lat, c_pages, r_pages)
    if why:
        raise UnsupportedShapeError(f"latent_decode_before: {why}")
    B, H, W = q_lat.shape
    R, DR, P = c_pages.head_dim, r_pages.head_dim, c_pages.page_size
    if W != R + DR or block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise UnsupportedShapeError(
            f"latent_decode_before: q_lat width {W} != {R} + {DR}, or block tables / "
            f"lengths not int32 ({block_tables.dtype}, {seq_lens.dtype})")
    max_pages = block_tables.shape[1]
    if num_splits is None:
        sms = (torch.cuda.get_device_properties(q_lat.device).multi_processor_count
               if q_lat.is_cuda else 4)
        programs = B * triton.cdiv(H, BLOCK_H)
        num_splits = max(1, min(max_pages, triton.cdiv(3 * sms, programs)))
    per_split = triton.cdiv(max_pages, num_splits)
    q = q_lat.contiguous()
    acc = torch.empty((B, num_splits, H, R), dtype=torch.float32, device=q.device)
    ml = torch.empty((B, num_splits, H, 2), dtype=torch.float32, device=q.device)
    cdt = tl.float32 if q.dtype == torch.float32 else tl.bfloat16
    dummy = torch.empty(1, dtype=torch.float32, device=q.device)
    c_scaled, r_scaled = c_pages.fmt.is_quantized, r_pages.fmt.is_quantized
    grid = (B, num_splits, triton.cdiv(H, BLOCK_H))
    _latent_split_kernel[grid](
        q, c_pages.data, c_pages.scale if c_scaled else dummy, r_pages.data,
        r_pages.scale if r_scaled else dummy, block_tables, seq_lens, acc, ml,
        block_tables.stride(0), H, num_splits, per_split, float(scale),
        R=R, DR=DR, P=P, BH=BLOCK_H, C_SCALED=c_scaled, R_SCALED=r_scaled, CDT=cdt)
    m, lsum = ml[..., 0], ml[..., 1]                                   # [B, splits, H]
    top = m.amax(dim=1, keepdim=True)
    w = torch.where(torch.isfinite(m), torch.exp(m - top), 0.0)
    den = (w * lsum).sum(dim=1)                                        # [B, H]
    return (w[..., None] * acc).sum(dim=1) / den[..., None]
