"""Causal prefill attention over packed variable-length sequences (FlashAttention-style), in
bf16 / fp16 / fp32, or FP8 E4M3 with block scales on Q, K and V as in FlashAttention-3.

One program owns one query tile of one sequence and GROUP query heads of one kv head (packed
into the tile's rows: GROUP = Hq / Hkv, or 1 for the warp-specialized variant) and walks the keys it may see with an online softmax. On Hopper K and V
arrive through TMA tensor descriptors into a software-pipelined (optionally warp-specialized)
loop; elsewhere, and under TRITON_INTERPRET=1, through plain pointer loads.

FP8 (`fp8=True`): q [T, Hq, D], k [T, Hkv, D] E4M3 and v transposed, vt [Hkv * Dv, NB * 128]
E4M3 (tokens in `prefill_quant.vt_column` order within 32-token chunks: the TMA path permutes P
to match, the pointer path gathers), so that both GEMMs run on fp8 tensor cores (Hopper wants
the reduction dim contiguous for fp8 operands). One fp32 descale per (sequence,
SCALE_BLOCK-token block, kv head) for each of q, k, v; `cu_blocks` [B+1] gives each sequence's
first block, and sequence b's token i sits in column cu_blocks[b] * SCALE_BLOCK + vt_column(i)
of vt (aligned starts, as TMA wants). The scale of a V block is folded into the accumulator's
rescale, and P is quantized to E4M3 as 256 * p so that small weights stay normal.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompile.kernels.prefill_quant import vt_column_jit
from kvcompile.kernels.prefill_tiles import (
    key_ranges,
    sink_range,
    softcap_log2,
    softmax_step,
    softmax_step_scaled,
    visible,
)

SCALE_BLOCK = 128  # tokens per fp8 block scale; every BLOCK_N divides it


@triton.jit
def _varlen_tiles(acc, m_i, l_i, v_prev, q, c_q, pos, K, V, k_descale, v_descale, kblk0, hkv,
                  k_start, k_len, lo, hi, window, sinks, softcap_log2e, inv_softcap,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_ks,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                  SINKS: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
                  TMA: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr, SCALE_BLK: tl.constexpr,
                  SCALE_TMA: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    P_SHIFT: tl.constexpr = 8.0 if FP8 else 0.0
    for n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        keys = n + offs_n
        if TMA:
            k = K.load([k_start + n, hkv * HEAD_DIM])  # [BN, D]
        else:
            k_rows = (k_start + keys).to(tl.int64) * stride_kt + hkv * stride_kh
            k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=(keys < k_len)[:, None],
                        other=0.0)
        qk = tl.dot(q, tl.trans(k))
        if FP8:
            if SCALE_TMA:  # diagnostic only: [Hkv * NB, 4] rows (16-byte TMA boxes) fault on
                # triton <= 3.8 once pipelined (misaligned ring stages); stride_ks = NB
                row = hkv * stride_ks + kblk0 + n // SCALE_BLK
                vs = tl.max(v_descale.load([row, 0]))
                c = c_q * tl.max(k_descale.load([row, 0]))
            else:  # scalar loads from [NB, Hkv], stride_ks = Hkv
                blk = (kblk0 + n // SCALE_BLK) * stride_ks + hkv
                vs = tl.load(v_descale + blk)
                c = c_q * tl.load(k_descale + blk)
        else:
            c = c_q
        if MASKED or SOFTCAP:
            s = qk * c[:, None]
            if SOFTCAP:
                s = softcap_log2(s, softcap_log2e, inv_softcap)
            if MASKED:
                vis = visible(pos, keys, 0, k_len, window, sinks, CAUSAL, WINDOW, SINKS)
                s = tl.where(vis, s, float("-inf"))
            p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, MASKED, P_SHIFT)
        else:
            p, alpha, m_i, l_i = softmax_step_scaled(qk, c, m_i, l_i, P_SHIFT)
        if FP8:
            if TMA:   # [BN, Dv], keys in vt_column order within 32-key chunks: so is P then
                v = tl.trans(V.load([hkv * HEAD_DIM_V, kblk0 * SCALE_BLK + n]))
                bm: tl.constexpr = p.shape[0]
                p = tl.reshape(tl.permute(tl.reshape(p, [bm, BLOCK_N // 32, 2, 2, 4, 2]),
                                          [0, 1, 2, 4, 3, 5]), [bm, BLOCK_N])
            else:   # keys in order, gathered from their vt columns
                v_cols = (kblk0 * SCALE_BLK + vt_column_jit(keys)).to(tl.int64) * stride_vt
                v = tl.load(V + (hkv * HEAD_DIM_V + offs_dv)[None, :].to(tl.int64) * stride_vh
                            + v_cols[:, None], mask=(keys < k_len)[:, None], other=0.0)
            # running acc is kept in units of the current V block's scale
            acc = acc * (alpha * (v_prev / vs))[:, None]
            v_prev = vs
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            if TMA:
                v = V.load([k_start + n, hkv * HEAD_DIM_V])  # [BN, Dv]
            else:
                v_rows = (k_start + keys).to(tl.int64) * stride_vt + hkv * stride_vh
                v = tl.load(V + v_rows[:, None] + offs_dv[None, :],
                            mask=(keys < k_len)[:, None], other=0.0)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i, v_prev


@triton.jit
def prefill_varlen_kernel(
        Q, Qd, K, V, Out, cu_seqlens, cu_seqlens_k, cu_blocks, q_descale, k_descale, v_descale,
        sm_scale_c, softcap_log2e, inv_softcap, window, sinks, seq_bucket,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_ks, stride_qs, Lse, stride_lt,
        RATIO: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_V: tl.constexpr,
        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
        FP8: tl.constexpr, TMA: tl.constexpr, Q_TMA: tl.constexpr, SCALE_TMA: tl.constexpr,
        SCALE_BLK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr,
        STORE_LSE: tl.constexpr):
    # Q: [T, Hq, D]  K: [T, Hkv, D]  V: [T, Hkv, Dv] (fp8: [Hkv*Dv, T_pad])  Out: [T, Hq, Dv]
    # Lse: [T, Hq] fp32 (STORE_LSE, not FP8): each row's log2-sum-exp2 of its scores in log2
    # units (-inf where it sees no key), to merge partial attentions over pieces of the keys
    TOK_M: tl.constexpr = BLOCK_M // GROUP
    h0 = tl.program_id(1) * GROUP  # first query head of the tile (GROUP: heads packed in rows)
    hkv = h0 // RATIO
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens + b)
    q_len = tl.load(cu_seqlens + b + 1) - q_start
    k_start = tl.load(cu_seqlens_k + b)  # == q_start unless queries are the tail of longer keys
    k_len = tl.load(cu_seqlens_k + b + 1) - k_start
    pos0 = k_len - q_len  # position of the first query (bottom-right aligned causal mask)
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (causal) tiles start first
    t0 = tile * TOK_M
    live = t0 < q_len  # no early return: warp specialization wants structured control flow
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP
    head = h0 + rows % GROUP
    row_ok = (rows < TOK_M * GROUP) & (tok < q_len)
    tok = tl.minimum(tok, q_len - 1)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    if Q_TMA and TOK_M * GROUP == BLOCK_M:  # one TMA box [TOK_M, GROUP * D]: the tile's rows
        q = tl.reshape(Qd.load([q_start + t0, h0 * HEAD_DIM]), [BLOCK_M, HEAD_DIM])
    else:
        q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    kblk0 = 0
    if FP8:
        kblk0 = tl.load(cu_blocks + b)
        c_q = sm_scale_c * tl.load(q_descale + (kblk0 + tok // SCALE_BLK) * stride_qs + hkv)
    else:
        c_q = tl.full([BLOCK_M], 1.0, tl.float32) * sm_scale_c
    pos = pos0 + tok
    pos_hi = pos0 + tl.minimum(t0 + TOK_M, q_len) - 1
    lo, a, bb, hi = key_ranges(pos0 + t0, pos_hi, 0, k_len, window, live, BLOCK_N, CAUSAL,
                               WINDOW)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], tl.float32)
    v_prev = sm_scale_c * 0.0 + 1.0  # fp32 scalar: the scale of the V block in acc
    if WARP_SPEC:
        # Triton 3.6's Hopper warp specialization takes one loop per kernel: every tile masked
        acc, m_i, l_i, v_prev = _varlen_tiles(
            acc, m_i, l_i, v_prev, q, c_q, pos, K, V, k_descale, v_descale, kblk0, hkv,
            k_start, k_len, lo, hi, window, sinks, softcap_log2e, inv_softcap,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_ks, True, CAUSAL, WINDOW, SINKS,
            SOFTCAP, FP8, TMA, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, SCALE_BLK,
            SCALE_TMA)
    else:
        if WINDOW and SINKS:
            s_lo, s_hi = sink_range(0, sinks, lo, BLOCK_N)
            acc, m_i, l_i, v_prev = _varlen_tiles(
                acc, m_i, l_i, v_prev, q, c_q, pos, K, V, k_descale, v_descale, kblk0, hkv,
                k_start, k_len, s_lo, s_hi, window, sinks, softcap_log2e, inv_softcap,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_ks, True, CAUSAL, WINDOW, SINKS,
                SOFTCAP, FP8, TMA, HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, SCALE_BLK,
                SCALE_TMA)
        if WINDOW:
            acc, m_i, l_i, v_prev = _varlen_tiles(
                acc, m_i, l_i, v_prev, q, c_q, pos, K, V, k_descale, v_descale, kblk0, hkv,
                k_start, k_len, lo, a, window, sinks, softcap_log2e, inv_softcap,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_ks, True, CAUSAL, WINDOW, SINKS,
                SOFTCAP, FP8, TMA, HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, SCALE_BLK,
                SCALE_TMA)
        acc, m_i, l_i, v_prev = _varlen_tiles(
            acc, m_i, l_i, v_prev, q, c_q, pos, K, V, k_descale, v_descale, kblk0, hkv,
            k_start, k_len, a, bb, window, sinks, softcap_log2e, inv_softcap,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_ks, False, CAUSAL, WINDOW, SINKS,
            SOFTCAP, FP8, TMA, HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, SCALE_BLK,
            SCALE_TMA)
        acc, m_i, l_i, v_prev = _varlen_tiles(
            acc, m_i, l_i, v_prev, q, c_q, pos, K, V, k_descale, v_descale, kblk0, hkv,
            k_start, k_len, bb, hi, window, sinks, softcap_log2e, inv_softcap,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_ks, True, CAUSAL, WINDOW, SINKS,
            SOFTCAP, FP8, TMA, HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, SCALE_BLK,
            SCALE_TMA)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a row that sees no key writes zeros
    o = acc * (v_prev / l_i)[:, None]
    if STORE_LSE:
        lse_rows = (q_start + tok).to(tl.int64) * stride_lt + head
        tl.store(Lse + lse_rows, m_i + tl.log2(l_i), mask=row_ok)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(Out + o_rows[:, None] + offs_dv[None, :], o.to(Out.dtype.element_ty),
             mask=row_ok[:, None])
