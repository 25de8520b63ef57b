"""Chunked prefill: a chunk of new queries attends causally over its sequence's paged KV, read
straight from the stored format (bf16 / fp16 / fp32 pages, FP8 E4M3 / E5M2 codes with page,
token or tensor scales, FP4 E2M1 codes with E4M3 micro scales).

Sequence b's q_len_b queries sit at positions seq_lens[b] - q_len_b + i (their own K/V already
written to the pages) and see keys [kv_start[b], position]. One program owns one tile of a
sequence's chunk and one kv head, with the GROUP query heads packed into its rows, so every page
tile is gathered and dequantized once per group.

Quantized K pages go to the tensor cores as their codes (fp8 -> fp16, or e2m1 * micro in
fp16: exact, one conversion per element), and a key's page / token scale multiplies its column
of q @ k^T (one multiply per score instead of a widen-multiply-narrow per element, as
FlashAttention-3 folds its FP8 descales). V pages are dequantized in registers as they arrive
(code * micro * scale in fp32, then fp16): folded into P's columns instead, P * scale would
fall into fp16's subnormals for small-valued heads. A tensor scale folds into the softmax scale
and the output. fp16 holds every E4M3 / E5M2 / E2M1*E4M3 code exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompile.cache import registry
from kvcompile.kernels.decode_tiles import fp8_specials
from kvcompile.kernels.prefill_tiles import (
    key_ranges,
    sink_range,
    softcap_log2,
    softmax_step,
    softmax_step_scaled,
    visible,
)

# Format codes and scale modes: the registry's, as the decode kernel numbers them (K_FMT /
# V_FMT: plain, E4M3, E5M2, E2M1; K_GRAN / V_GRAN: none, tensor, page, token).
_PLAIN = tl.constexpr(registry.FMT_PLAIN)
_E2M1 = tl.constexpr(registry.FMT_E2M1)
_TENSOR = tl.constexpr(registry.SCALE_TENSOR)
_PAGE = tl.constexpr(registry.SCALE_PAGE)
_TOKEN = tl.constexpr(registry.SCALE_TOKEN)


@triton.jit
def _e2m1_value(codes):
    """E2M1 code (uint8 0..15) -> fp32 value on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    c = codes.to(tl.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _page_tile(Data, Scale, Micro, bt_row, keys, ok, hkv, sp, sh, st, ssp, ssh, sst, mp, mh, mt,
               FMT: tl.constexpr, GRAN: tl.constexpr, DIM: tl.constexpr, PAGE: tl.constexpr,
               BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, FOLD: tl.constexpr):
    """Gather keys' rows [BN, DIM] from their pages as COMPUTE values, and their page / token
    scales [BN] fp32 (1.0 for plain pages and tensor scales). FOLD: the rows are the codes
    (fp4: code * micro), exact in fp16, and the caller folds the scales into its columns; else
    they are dequantized here (code * scale in fp32, in the load layout, where each thread
    holds whole 16-byte row chunks)."""
    page = tl.load(bt_row + keys // PAGE, mask=ok, other=0).to(tl.int64)
    off = keys % PAGE
    base = page * sp + hkv * sh + off * st
    if FMT == _E2M1:
        offs_b = tl.arange(0, DIM // 2)
        byte = tl.load(Data + base[:, None] + offs_b[None, :], mask=ok[:, None], other=0)
        codes = tl.reshape(tl.join(byte & 15, byte >> 4), [BLOCK_N, DIM])  # 2i: low nibble
        offs_u = tl.arange(0, DIM // 16)
        mbase = page * mp + hkv * mh + off * mt
        micro = tl.load(Micro + mbase[:, None] + offs_u[None, :], mask=ok[:, None], other=0.0)
        micro = fp8_specials(micro, micro.to(tl.float32))
        micro = tl.broadcast_to(micro[:, :, None], [BLOCK_N, DIM // 16, 16])
        x = _e2m1_value(codes) * tl.reshape(micro, [BLOCK_N, DIM])
    else:
        offs_d = tl.arange(0, DIM)
        x = tl.load(Data + base[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        if FMT != _PLAIN:  # E4M3 / E5M2: one cvt.rn.f16x2.e4m3x2 per two codes on sm_90
            x = fp8_specials(x, x.to(COMPUTE if FOLD else tl.float32))
    if GRAN == _PAGE:
        sc = tl.load(Scale + page * ssp + hkv * ssh, mask=ok, other=0.0)
    elif GRAN == _TOKEN:
        sc = tl.load(Scale + page * ssp + hkv * ssh + off * sst, mask=ok, other=0.0)
    else:
        sc = tl.full([BLOCK_N], 1.0, tl.float32)
    if GRAN == _PAGE or GRAN == _TOKEN:
        if FOLD:
            x = x.to(COMPUTE)
        else:
            x = x.to(tl.float32) * sc[:, None]
    return x.to(COMPUTE), sc


@triton.jit
def _paged_tiles(acc, m_i, l_i, q, c_q, pos, bt_row, lo, hi, kv_lo, kv_hi, window, sinks,
                 softcap_log2e, inv_softcap, hkv,
                 K_data, K_scale, K_micro, k_sp, k_sh, k_st, k_ssp, k_ssh, k_sst, k_mp, k_mh, k_mt,
                 V_data, V_scale, V_micro, v_sp, v_sh, v_st, v_ssp, v_ssh, v_sst, v_mp, v_mh, v_mt,
                 MASKED: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
                 SOFTCAP: tl.constexpr, K_FMT: tl.constexpr, K_GRAN: tl.constexpr,
                 V_FMT: tl.constexpr, V_GRAN: tl.constexpr, PAGE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                 COMPUTE: tl.constexpr, NUM_STAGES: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        keys = n + offs_n
        if MASKED:  # masked tiles also keep unwritten slots (any bits, NaN too) out of P @ V
            ok = (keys >= kv_lo) & (keys < kv_hi)
        else:
            ok = keys < kv_hi
        k, k_sc = _page_tile(K_data, K_scale, K_micro, bt_row, keys, ok, hkv, k_sp, k_sh, k_st,
                             k_ssp, k_ssh, k_sst, k_mp, k_mh, k_mt, K_FMT, K_GRAN, HEAD_DIM,
                             PAGE, BLOCK_N, COMPUTE, True)
        qk = tl.dot(q, tl.trans(k))
        if K_GRAN == _PAGE or K_GRAN == _TOKEN:  # q . (code * s) = (q . code) * s, per column
            qk = qk * k_sc[None, :]
        if MASKED or SOFTCAP:
            s = qk * c_q[:, None]
            if SOFTCAP:
                s = softcap_log2(s, softcap_log2e, inv_softcap)
            if MASKED:
                vis = visible(pos, keys, kv_lo, kv_hi, window, sinks, True, WINDOW, SINKS)
                s = tl.where(vis, s, float("-inf"))
            p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, MASKED, 0.0)
        else:
            p, alpha, m_i, l_i = softmax_step_scaled(qk, c_q, m_i, l_i, 0.0)
        # V is dequantized per element: folding its scales into P's columns would put P * s
        # (s = amax / 448, small for small-valued heads) into fp16's subnormals for P @ V
        v, _ = _page_tile(V_data, V_scale, V_micro, bt_row, keys, ok, hkv, v_sp, v_sh, v_st,
                          v_ssp, v_ssh, v_sst, v_mp, v_mh, v_mt, V_FMT, V_GRAN, HEAD_DIM_V,
                          PAGE, BLOCK_N, COMPUTE, False)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(COMPUTE), v, acc)
    return acc, m_i, l_i


@triton.jit
def paged_prefill_kernel(
        Q, Out, block_tables, cu_seqlens_q, seq_lens, kv_starts, Sink,
        K_data, K_scale, K_micro, V_data, V_scale, V_micro,
        sm_scale_c, softcap_log2e, inv_softcap, window, sinks, q_bucket,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        k_sp, k_sh, k_st, k_ssp, k_ssh, k_sst, k_mp, k_mh, k_mt,
        v_sp, v_sh, v_st, v_ssp, v_ssh, v_sst, v_mp, v_mh, v_mt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
        PAGE: tl.constexpr, K_FMT: tl.constexpr, K_GRAN: tl.constexpr, V_FMT: tl.constexpr,
        V_GRAN: tl.constexpr, COMPUTE: tl.constexpr, WINDOW: tl.constexpr,
        SINKS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KV_START: tl.constexpr,
        HAS_SINK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Q: [T, Hq, D]  Out: [T, Hq, Dv]  block_tables: [B, max_pages] int32
    # K_data: [N, Hkv, P, D] (fp4: [N, Hkv, P, D//2] uint8)  K_scale: [N, Hkv] | [N, Hkv, P] | [1]
    # Sink: [Hq] fp32 sink logits (HAS_SINK; SINKS is the window's kept first keys)
    TOK_M: tl.constexpr = BLOCK_M // GROUP
    hkv = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    t0 = tile * TOK_M
    live = t0 < q_len  # no early return: warp specialization wants structured control flow
    kv_hi = tl.load(seq_lens + b)
    kv_lo = 0
    if HAS_KV_START:
        kv_lo = tl.load(kv_starts + b)
    pos0 = kv_hi - q_len  # position of the chunk's first query
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP
    head = hkv * GROUP + rows % GROUP
    row_ok = (rows < TOK_M * GROUP) & (tok < q_len)
    tok = tl.minimum(tok, q_len - 1)
    pos = pos0 + tok
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(COMPUTE)
    c_q = tl.full([BLOCK_M], 1.0, tl.float32) * sm_scale_c
    if K_GRAN == _TENSOR:
        c_q = c_q * tl.load(K_scale)
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    pos_hi = pos0 + tl.minimum(t0 + TOK_M, q_len) - 1
    lo, a, bb, hi = key_ranges(pos0 + t0, pos_hi, kv_lo, kv_hi, window, live,
                               BLOCK_N, True, WINDOW)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], tl.float32)
    if WINDOW and SINKS:
        s_lo, s_hi = sink_range(kv_lo, sinks, lo, BLOCK_N)
        acc, m_i, l_i = _paged_tiles(
            acc, m_i, l_i, q, c_q, pos, bt_row, s_lo, s_hi, kv_lo, kv_hi, window, sinks,
            softcap_log2e, inv_softcap, hkv,
            K_data, K_scale, K_micro, k_sp, k_sh, k_st, k_ssp, k_ssh, k_sst, k_mp, k_mh, k_mt,
            V_data, V_scale, V_micro, v_sp, v_sh, v_st, v_ssp, v_ssh, v_sst, v_mp, v_mh, v_mt,
            True, WINDOW, SINKS, SOFTCAP, K_FMT, K_GRAN, V_FMT, V_GRAN, PAGE, HEAD_DIM,
            HEAD_DIM_V, BLOCK_N, COMPUTE, NUM_STAGES)
    acc, m_i, l_i = _paged_tiles(
        acc, m_i, l_i, q, c_q, pos, bt_row, lo, a, kv_lo, kv_hi, window, sinks,
        softcap_log2e, inv_softcap, hkv,
        K_data, K_scale, K_micro, k_sp, k_sh, k_st, k_ssp, k_ssh, k_sst, k_mp, k_mh, k_mt,
        V_data, V_scale, V_micro, v_sp, v_sh, v_st, v_ssp, v_ssh, v_sst, v_mp, v_mh, v_mt,
        True, WINDOW, SINKS, SOFTCAP, K_FMT, K_GRAN, V_FMT, V_GRAN, PAGE, HEAD_DIM,
        HEAD_DIM_V, BLOCK_N, COMPUTE, NUM_STAGES)
    acc, m_i, l_i = _paged_tiles(
        acc, m_i, l_i, q, c_q, pos, bt_row, a, bb, kv_lo, kv_hi, window, sinks,
        softcap_log2e, inv_softcap, hkv,
        K_data, K_scale, K_micro, k_sp, k_sh, k_st, k_ssp, k_ssh, k_sst, k_mp, k_mh, k_mt,
        V_data, V_scale, V_micro, v_sp, v_sh, v_st, v_ssp, v_ssh, v_sst, v_mp, v_mh, v_mt,
        False, WINDOW, SINKS, SOFTCAP, K_FMT, K_GRAN, V_FMT, V_GRAN, PAGE, HEAD_DIM,
        HEAD_DIM_V, BLOCK_N, COMPUTE, NUM_STAGES)
    acc, m_i, l_i = _paged_tiles(
        acc, m_i, l_i, q, c_q, pos, bt_row, bb, hi, kv_lo, kv_hi, window, sinks,
        softcap_log2e, inv_softcap, hkv,
        K_data, K_scale, K_micro, k_sp, k_sh, k_st, k_ssp, k_ssh, k_sst, k_mp, k_mh, k_mt,
        V_data, V_scale, V_micro, v_sp, v_sh, v_st, v_ssp, v_ssh, v_sst, v_mp, v_mh, v_mt,
        True, WINDOW, SINKS, SOFTCAP, K_FMT, K_GRAN, V_FMT, V_GRAN, PAGE, HEAD_DIM,
        HEAD_DIM_V, BLOCK_N, COMPUTE, NUM_STAGES)

    if HAS_SINK:  # one more column of the softmax per head, its probability dropped
        sink = tl.load(Sink + head) * 1.4426950408889634
        l_i += tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a row that sees no key writes zeros
    o = acc / l_i[:, None]
    if V_GRAN == _TENSOR:
        o = o * tl.load(V_scale)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(Out + o_rows[:, None] + offs_dv[None, :], o.to(Out.dtype.element_ty),
             mask=row_ok[:, None])
