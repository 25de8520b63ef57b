"""FP8 prefill inputs in one kernel: q, k, v to E4M3 with a scale per (sequence, 128-token block,
kv head), V written transposed, as `prefill.quantize_fp8_prefill` specifies.

    q8, k8, vt8, scales = quantize_fp8_prefill(q, k, v, cu_seqlens)   # prefill.py dispatches

One program owns one scale block of one kv head: it reads the block's q rows of the kv head's
query heads, its k rows and its v rows once for their max |x| (NaN-propagating), then again
(from L2) to write the codes, RN(x / scale) clamped to +-448, bit for bit the torch form's
(`reference.quantize_fp8_prefill_ref`; under the interpreter the E4M3 rounding is done by
integer ops, as the append kernels do, since its own fp8 cast rounds some values wrongly).
Blocks are numbered across sequences as `cu_blocks` says; the grid covers floor(T / 128) + B
blocks (an upper bound known without a device sync); the programs past the last block write
zero columns of vt and unit scales, so every output is fully written and its shape depends on
T and B alone. vt's tokens are in `vt_column` order within each 32-token chunk (the Hopper
kernel's P order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.kernels.append import _div_const, _encode_fp8, _interpreting
from kvcompile.kernels.append_int import max_nan

SCALE_BLOCK = 128   # tokens per scale (prefill_varlen.SCALE_BLOCK: the kernels' tiles divide it)
FP8_MAX = 448.0
_BLOCK = tl.constexpr(SCALE_BLOCK)   # the kernels read globals only as constexpr
_FMAX = tl.constexpr(FP8_MAX)


def vt_column(t):
    """The column (within its sequence's run of vt8) of token t (an int or an int tensor):
    within each 32-token chunk, t = 16h + 8j + 2q + p is stored at 16h + 4q + 2j + p, the order
    in which a thread of the Hopper kernel holds P's keys (kernels/prefill_sm90.py), so that P
    enters its P V product without crossing lanes."""
    return (t & ~0xE) | (((t >> 3) & 1) << 1) | (((t >> 1) & 3) << 2)


@triton.jit
def vt_column_jit(t):
    # vt_column in a kernel
    return (t & ~0xE) | (((t >> 3) & 1) << 1) | (((t >> 1) & 3) << 2)


def vt_token(c):
    """The inverse of vt_column: the token (within its sequence's run) stored at column c."""
    return (c & ~0xE) | (((c >> 1) & 1) << 3) | (((c >> 2) & 3) << 1)


@triton.jit
def vt_token_jit(c):
    # vt_token in a kernel
    return (c & ~0xE) | (((c >> 1) & 1) << 3) | (((c >> 2) & 3) << 1)


@triton.jit
def _amax_rows(X, t0, n, stride_t, col0, C: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    # max |x| (NaN if any) over rows t0 .. t0 + n - 1, columns col0 .. col0 + C - 1
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BC)
    a = tl.zeros([BT], tl.float32)
    for r0 in range(0, _BLOCK, BT):
        r = r0 + rows
        ok = (r < n)[:, None] & (cols < C)[None, :]
        x = tl.load(X + (t0 + r).to(tl.int64)[:, None] * stride_t + col0 + cols[None, :],
                    mask=ok, other=0.0).to(tl.float32)
        a = max_nan(a, tl.reduce(tl.abs(x), 1, max_nan))
    return tl.reduce(a, 0, max_nan)


@triton.jit
def _descale(amax, RECIP: tl.constexpr):
    # torch's where(amax > 0, amax / 448, 1): a NaN block gets 1 (NaN > 0 is false); amax / 448
    # as torch divides a tensor by a python float (on CUDA by the fp32 reciprocal)
    return tl.where(amax > 0.0, _div_const(amax, _FMAX, RECIP), 1.0)


@triton.jit
def _write_codes(X, Y, t0, n, stride_t, stride_y, col0, ycol0, d, C: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr, TRANSPOSE: tl.constexpr,
                 EXPLICIT: tl.constexpr, ycol_t=0):
    # codes of rows t0 .. t0 + SCALE_BLOCK - 1 (zeros past n); TRANSPOSE: Y[ycol0 + c, ycol_t +
    # vt_column(r)] (vt: tokens in P's lane order within 32-token chunks; ycol_t: the block's
    # first column, a multiple of 128, so that the compiler sees the rows' alignment), else
    # Y[t, ycol0 + c] (rows past n not written). TRANSPOSE walks vt's columns in order and
    # gathers their tokens (vt_token), so that each of vt's rows is written in contiguous runs
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BC)
    for r0 in range(0, _BLOCK, BT):
        if TRANSPOSE:
            r = vt_token_jit(r0 + rows)   # the token of vt's column r0 + rows
        else:
            r = r0 + rows
        ok = (r < n)[:, None] & (cols < C)[None, :]
        x = tl.load(X + (t0 + r).to(tl.int64)[:, None] * stride_t + col0 + cols[None, :],
                    mask=ok, other=0.0).to(tl.float32)
        code = _encode_fp8(x, tl.zeros([BT], tl.float32) + d, tl.reduce(tl.abs(x), 1, max_nan),
                           1, _FMAX, EXPLICIT)
        if TRANSPOSE:
            ptr = (Y + (ycol0 + cols).to(tl.int64)[None, :] * stride_y
                   + (ycol_t + r0 + rows)[:, None])
            tl.store(ptr, code, mask=(cols < C)[None, :])
        else:
            ptr = Y + (t0 + r).to(tl.int64)[:, None] * stride_y + ycol0 + cols[None, :]
            tl.store(ptr, code, mask=ok)


@triton.jit
def quantize_fp8_prefill_kernel(Q, K, V, Q8, K8, VT8, QD, KD, VD, cu_seqlens, cu_blocks,
                                block_seq, num_seqs, stride_qt, stride_kt, stride_vt, stride_q8,
                                stride_k8, stride_vt8, stride_sb,
                                GD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                                BGD: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                                BTQ: tl.constexpr, BTK: tl.constexpr, BTV: tl.constexpr,
                                RECIP: tl.constexpr, EXPLICIT: tl.constexpr,
                                WITH_Q: tl.constexpr):
    # Q [T, Hq, D] as [T, Hq * D] (a kv head's query heads: GD = group * D columns), K [T, Hkv,
    # D], V [T, Hkv, Dv]; Q8 / K8 like them (E4M3 codes as uint8), VT8 [Hkv * Dv, NB * 128];
    # QD / KD / VD [NB, Hkv] fp32; block_seq [NB]: each block's sequence (num_seqs: none);
    # WITH_Q False: K and V alone (Q8 and QD not written)
    blk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(block_seq + blk)
    n = 0
    t0 = 0
    if b < num_seqs:
        s0 = tl.load(cu_seqlens + b)
        local = (blk - tl.load(cu_blocks + b)) * _BLOCK
        n = tl.minimum(tl.load(cu_seqlens + b + 1) - s0 - local, _BLOCK)
        t0 = s0 + local
    if WITH_Q:
        qd = _descale(_amax_rows(Q, t0, n, stride_qt, h * GD, GD, BTQ, BGD), RECIP)
        tl.store(QD + blk * stride_sb + h, qd)
        _write_codes(Q, Q8, t0, n, stride_qt, stride_q8, h * GD, h * GD, qd, GD, BTQ, BGD,
                     False, EXPLICIT)
    kd = _descale(_amax_rows(K, t0, n, stride_kt, h * D, D, BTK, BD), RECIP)
    vd = _descale(_amax_rows(V, t0, n, stride_vt, h * DV, DV, BTV, BDV), RECIP)
    tl.store(KD + blk * stride_sb + h, kd)
    tl.store(VD + blk * stride_sb + h, vd)
    _write_codes(K, K8, t0, n, stride_kt, stride_k8, h * D, h * D, kd, D, BTK, BD, False,
                 EXPLICIT)
    # vt's columns: block blk's SCALE_BLOCK columns, whoever's (zeros past n)
    _write_codes(V, VT8, t0, n, stride_vt, stride_vt8, h * DV, h * DV, vd, DV, BTV, BDV, True,
                 EXPLICIT, blk * _BLOCK)


def block_bound(T: int, B: int, block: int = SCALE_BLOCK) -> int:
    """Scale blocks that T tokens in B sequences can take, without reading their lengths: each
    sequence of n tokens takes ceil(n / block) <= n / block + 1."""
    return T // block + B


def block_layout(cu_seqlens: torch.Tensor, block: int = SCALE_BLOCK):
    """cu_blocks [B+1] int32: each sequence's first scale block (on the device, no sync)."""
    B = cu_seqlens.numel() - 1
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    nblk = (lens + block - 1) // block
    cu_blocks = torch.zeros(B + 1, dtype=torch.int32, device=cu_seqlens.device)
    cu_blocks[1:] = torch.cumsum(nblk, 0)
    return cu_blocks


def quantize_fp8_prefill_triton(q, k, v, cu_seqlens, num_blocks: int, with_q: bool = True):
    """The kernel's launch (prefill.quantize_fp8_prefill checks the inputs and dispatches):
    -> q8, k8, vt8, (q_descale, k_descale, v_descale, cu_blocks); with_q=False: q returned as
    it came and q_descale all ones (K and V alone quantized)."""
    T, Hq, D = q.shape
    Hkv, Dv = v.shape[1], v.shape[2]
    B = cu_seqlens.numel() - 1
    dev = q.device
    cu_blocks = block_layout(cu_seqlens)
    block_seq = torch.searchsorted(cu_blocks[1:], torch.arange(num_blocks, device=dev,
                                                               dtype=torch.int32), right=True)
    block_seq = block_seq.to(torch.int32)
    q_in = q
    q = q.contiguous().reshape(T, Hq * D)
    k = k.contiguous().reshape(T, Hkv * D)
    v = v.contiguous().reshape(T, Hkv * Dv)
    q8 = torch.empty(T, Hq * D if with_q else 0, dtype=torch.uint8, device=dev)
    k8 = torch.empty(T, Hkv * D, dtype=torch.uint8, device=dev)
    vt8 = torch.empty(Hkv * Dv, max(num_blocks, 1) * SCALE_BLOCK, dtype=torch.uint8, device=dev)
    scales = torch.empty(3, max(num_blocks, 1), Hkv, dtype=torch.float32, device=dev)
    gd = (Hq // Hkv) * D
    p2 = triton.next_power_of_2

    def rows(c):   # rows a step: 4096 values of the block (16 a thread; 128 registers, sm_90)
        return max(1, min(SCALE_BLOCK, 4096 // p2(c)))
    if num_blocks:
        quantize_fp8_prefill_kernel[(num_blocks, Hkv)](
            q, k, v, q8, k8, vt8, scales[0], scales[1], scales[2], cu_seqlens, cu_blocks,
            block_seq, B, q.stride(0), k.stride(0), v.stride(0), q8.stride(0), k8.stride(0),
            vt8.stride(0), scales.stride(1), GD=gd, D=D, DV=Dv, BGD=p2(gd), BD=p2(D),
            BDV=p2(Dv), BTQ=rows(gd), BTK=rows(D), BTV=rows(Dv), RECIP=q.is_cuda,
            EXPLICIT=_interpreting(), WITH_Q=with_q, num_warps=8)
        if not with_q:
            scales[0].fill_(1.0)
    else:
        vt8.zero_()
        scales.fill_(1.0)
    f8 = torch.float8_e4m3fn
    q_out = q8.view(f8).reshape(T, Hq, D) if with_q else q_in
    return (q_out, k8.view(f8).reshape(T, Hkv, D), vt8.view(f8),
            (scales[0], scales[1], scales[2], cu_blocks))
