"""One tile of the paged decode kernel (decode_kernels.py): its key positions, its loads, and
the online-softmax update it makes.

Block scales are never applied to the codes in HBM or element by element when they can be
factored out of the dots:
- one scale per token (page / token / tensor modes): keys multiply the scores, values the
  probabilities (divided by the tile's largest, see `attend_tile`);
- int zero points per token: keys add zero_t * sum_d q_d to the scores, values add
  sum_t p_t * zero_t to every output column;
- "channel" scales (fp8 / int, per page, kv head and channel; a tile then lies in one page,
  or in two with PAIR, where rows r and r + M/2 are the same query scaled by each page's):
  keys scale q's columns before the dot and add sum_d q_d * zero_d, values scale the dot's
  columns after it and add (sum_t p_t) * zero_d.
Residual pages (a sequence's partly filled page, kept in bf16) are read row by row next to the
codes: each token is either a code (its residual row masked off) or a residual row (its codes
masked off), and one more dot per operand adds the residual rows' share, only in the tiles
that hold residual rows (a runtime branch). Residual rows are widened to the compute dtype
(fp16 on the GPU: bf16 values beyond fp16's range, 65504, would not survive).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompile.kernels.decode_tiles import (
    channel_pair,
    load_channel_params,
    load_codes,
    load_row_pair,
    load_token_scales,
    load_token_zeros,
    widen,
)


@triton.jit
def tile_meta(t, t1, b, L, lo, lo_t, n_sink, sinks, BT, stride_bt, KMASK, n_kmask,
               P: tl.constexpr, BLOCK_T: tl.constexpr, WINDOW: tl.constexpr,
               HAS_KMASK: tl.constexpr, first=0, SKIP: tl.constexpr = False):
    # tile t -> key positions [T], keys some row of the program may see [T], their page ids;
    # SKIP: keys below `first` unseen
    start = tl.where(t < n_sink, t * BLOCK_T, lo_t + (t - n_sink) * BLOCK_T)
    pos = start + tl.arange(0, BLOCK_T)
    seen = (pos < L) & (pos * 0 + t < t1)
    if SKIP:
        seen = seen & (pos >= first)
    if WINDOW:
        seen = seen & ((pos >= lo) | (pos < sinks))
    if HAS_KMASK:
        km = tl.load(KMASK + b * n_kmask + pos, mask=seen & (pos < n_kmask), other=1)
        seen = seen & (km != 0)
    page = tl.load(BT + b * stride_bt + pos // P, mask=seen, other=0)
    return pos, seen, page


@triton.jit
def tile_operand(XD, XS, XM, XZ, XRS, page, off, seen, kvh, H, mult, D: tl.constexpr,
                 P: tl.constexpr, FMT: tl.constexpr, SM: tl.constexpr, RES: tl.constexpr,
                 HALVES: tl.constexpr, CDT: tl.constexpr, ASM: tl.constexpr,
                 BIG: tl.constexpr, SPLIT: tl.constexpr, cpage0, cpage1, cok0, cok1):
    # Loads of one operand (K or V) of a tile: raw codes (x, m) (fp4: bytes and micro; SPLIT:
    # the two column halves), scales sc ([T] per token, or [D] channel), zero points zp (same
    # shape; int only), code_ok [T] (seen and not residual); with RES, each key's row in the
    # residual rows (< 0: none) and how many seen keys have one (their rows are loaded by
    # attend_tile, and only in the tiles that have some)
    tok = (page * H + kvh) * P + off
    if RES:
        rs = tl.load(XRS + page, mask=seen, other=-1)
        code_ok = seen & (rs < 0)
        rrow = (rs * H + kvh) * P + off  # < 0 when rs is -1 (kvh < H, off < P)
        if BIG:
            rrow = rrow.to(tl.int64)
        n_res = tl.sum((seen & (rs >= 0)).to(tl.int32), 0)
    else:
        code_ok = seen
        rrow = off
        n_res = 0
    if HALVES == 2:
        x, _ = load_codes(XD, XM, tok, code_ok, D, FMT, ASM, BIG, 0, D // 2)
        m, _ = load_codes(XD, XM, tok, code_ok, D, FMT, ASM, BIG, D // 2, D // 2)
    else:
        x, m = load_codes(XD, XM, tok, code_ok, D, FMT, ASM, BIG)
    if SM == 4:
        # fp16 params of the tile's page cpage0 (scalars: block-table entry and whether the
        # page holds keys of the sequence), and of cpage1 when the tile has two pages (T > P):
        # then the two pages' bits packed in one integer of twice the width (_pack2; with
        # HALVES == 1, int32 words of channel pairs (load_channel_params), in one int64):
        # elementwise, so the vectors keep the layout of their use
        T: tl.constexpr = page.shape[0]
        sc, zp = load_channel_params(XS, XZ, cpage0, kvh, H, D, FMT >= 5, cok0, HALVES)
        if T > P:
            s1, z1 = load_channel_params(XS, XZ, cpage1, kvh, H, D, FMT >= 5, cok1, HALVES)
            if HALVES == 1:  # two int32 words in one int64 (elementwise: no layout change)
                sc = (sc.to(tl.int64) & 0xFFFFFFFF) | (s1.to(tl.int64) << 32)
                zp = (zp.to(tl.int64) & 0xFFFFFFFF) | (z1.to(tl.int64) << 32)
            else:
                sc = _pack2(sc, s1)
                zp = _pack2(zp, z1)
    else:
        sc = load_token_scales(XS, page, off, kvh, H, P, SM, code_ok) * mult
        if FMT >= 5:
            zp = load_token_zeros(XZ, page, off, kvh, H, P, SM, code_ok)
        else:
            zp = sc
    return x, m, sc, zp, code_ok, rrow, n_res


@triton.jit
def _halves(v, HALVES: tl.constexpr):
    # channel params from load_channel_params -> (even, odd) channels when HALVES == 1
    # ([D // 2, 2] split), else (v, v)
    if HALVES == 1:
        a, b = tl.split(v)
        return a, b
    else:
        return v, v


@triton.jit
def _pages_halves(w, PAIR: tl.constexpr):
    # channel params of tile_operand with HALVES == 1 -> (even, odd) of the first page, and of
    # the second with PAIR (else the first's again)
    if PAIR:
        a0, b0 = channel_pair(w.to(tl.int32))
        a1, b1 = channel_pair((w >> 32).to(tl.int32))
    else:
        a0, b0 = channel_pair(w)
        a1 = a0
        b1 = b0
    return a0, b0, a1, b1


@triton.jit
def _rows2(v0, v1, M: tl.constexpr, PAIR: tl.constexpr):
    # per-row [M, C] values: v0 for the first half of the rows, v1 for the second (PAIR), or
    # v0 as [1, C]
    if PAIR:
        copy = (tl.arange(0, M) >= M // 2)[:, None]
        return tl.where(copy, v1[None, :], v0[None, :])
    else:
        return v0[None, :]


@triton.jit
def _pack2(a, b):
    # two fp16 / fp32 vectors -> their bits in one int32 / int64 vector (a low, b high)
    if a.dtype == tl.float16:
        lo = a.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo | (b.to(tl.int16, bitcast=True).to(tl.int32) << 16)
    else:
        lo = a.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        return lo | (b.to(tl.int32, bitcast=True).to(tl.int64) << 32)


@triton.jit
def _unpack2(w):
    # _pack2's inverse
    if w.dtype == tl.int32:
        a = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        b = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        a = w.to(tl.int32).to(tl.float32, bitcast=True)
        b = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return a, b


@triton.jit
def _rows(v, M: tl.constexpr, PAIR: tl.constexpr):
    # a channel vector of tile_operand (full width; PAIR: the two pages' packed, _pack2) ->
    # its value per row [M, C] (PAIR: rows of the second half take the second page's), or
    # [1, C]
    if PAIR:
        v0, v1 = _unpack2(v)
        return _rows2(v0, v1, M, PAIR)
    else:
        return v[None, :]


@triton.jit
def _scaled(q, s, CDT: tl.constexpr):
    # q [M, C] * s ([M, C] or [1, C]) in the compute dtype, rounded once: fp16 scales multiply
    # in fp16 (exact product rounded once), others in fp32
    if s.dtype == tl.float16:
        return q * s.to(CDT)
    else:
        return (q.to(tl.float32) * s.to(tl.float32)).to(CDT)


@triton.jit
def _channel_scores(q_a, q_b, k_a, k_b, ks, kz, k_ok, D: tl.constexpr, KFMT: tl.constexpr,
                    KH: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
                    PAIR: tl.constexpr):
    # scores [M, T] of keys with channel scales ks (and int zero points kz) from
    # tile_operand: q's columns scaled, plus sum_d q_d * zero_d for the code (non-residual)
    # keys. q * scale (see _scaled): fp16 int scales keep q 16-bit in the dot operand's
    # layout (fp32 q there held 64 registers per thread)
    M: tl.constexpr = q_a.shape[0]
    if KH == 1:
        s0a, s0b, s1a, s1b = _pages_halves(ks, PAIR)
        s = tl.dot(_scaled(q_a, _rows2(s0a, s1a, M, PAIR), CDT), tl.trans(k_a),
                   input_precision=PREC)
        s = tl.dot(_scaled(q_b, _rows2(s0b, s1b, M, PAIR), CDT), tl.trans(k_b), s,
                   input_precision=PREC)
    else:  # full-width tiles
        s = tl.dot(_scaled(q_a, _rows(ks, M, PAIR), CDT), tl.trans(k_a),
                   input_precision=PREC)
    if KFMT >= 5:
        qz = _channel_qz(q_a, q_b, kz, KH, PAIR)
        s = s + qz[:, None] * k_ok.to(tl.float32)[None, :]
    return s


@triton.jit
def _channel_zero_rows(kz, M: tl.constexpr, KH: tl.constexpr, PAIR: tl.constexpr):
    # int channel zero points from tile_operand -> per-row ([M, C] with PAIR, else [1, C])
    # (even, odd) channels (KH == 1), or (all, all)
    if KH == 1:
        z0a, z0b, z1a, z1b = _pages_halves(kz, PAIR)
        return _rows2(z0a, z1a, M, PAIR), _rows2(z0b, z1b, M, PAIR)
    else:
        z = _rows(kz, M, PAIR)
        return z, z


@triton.jit
def _channel_qz(q_a, q_b, kz, KH: tl.constexpr, PAIR: tl.constexpr):
    # sum_d q_d * zero_d per row [M], fp32
    z_a, z_b = _channel_zero_rows(kz, q_a.shape[0], KH, PAIR)
    qz = q_a.to(tl.float32) * z_a.to(tl.float32)
    if KH == 1:
        qz += q_b.to(tl.float32) * z_b.to(tl.float32)
    return tl.sum(qz, 1)


@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _channel_values(pv, p_codes, v_a, v_b, vs, vz, acc_a, acc_b, DV: tl.constexpr,
                    VFMT: tl.constexpr, VH: tl.constexpr, PREC: tl.constexpr,
                    PAIR: tl.constexpr):
    # acc + p @ v with channel scales vs (PAIR: per row copy) on the dot's columns, plus
    # p_codes (sum of p over the code keys) * zero_d for int values; pv: p in the compute dtype
    M: tl.constexpr = pv.shape[0]
    if VH == 1:
        s0a, s0b, s1a, s1b = _pages_halves(vs, PAIR)
        s_a = _rows2(s0a, s1a, M, PAIR)
        s_b = _rows2(s0b, s1b, M, PAIR)
    else:
        s_a = _rows(vs, M, PAIR)
        s_b = s_a
    acc_a = acc_a + tl.dot(pv, v_a, input_precision=PREC) * s_a.to(tl.float32)
    if VH != 0:
        acc_b = acc_b + tl.dot(pv, v_b, input_precision=PREC) * s_b.to(tl.float32)
    if VFMT >= 5:
        z_a, z_b = _channel_zero_rows(vz, M, VH, PAIR)
        acc_a = acc_a + p_codes[:, None] * z_a.to(tl.float32)
        if VH != 0:
            acc_b = acc_b + p_codes[:, None] * z_b.to(tl.float32)
    return acc_a, acc_b


@triton.jit
def attend_tile(q_a, q_b, q_sum, kx, km, vx, vm, ks, vs, kz, vz, k_ok, v_ok, KR, k_row,
                k_nres, VR, v_row, v_nres, pos, seen, q_pos, row_ok, q_row, m_i, l_i, w_run,
                acc_a, acc_b, SCORES, scores_len, qk_scale, cap_in, cap_out, window, sinks,
                D: tl.constexpr, DV: tl.constexpr, SQ: tl.constexpr,
                KFMT: tl.constexpr, VFMT: tl.constexpr, KSM: tl.constexpr, VSM: tl.constexpr,
                KRES: tl.constexpr, VRES: tl.constexpr, KH: tl.constexpr, VH: tl.constexpr,
                CDT: tl.constexpr, SOFTCAP: tl.constexpr, WRITE_SCORES: tl.constexpr,
                PREC: tl.constexpr, WINDOW: tl.constexpr, ASM: tl.constexpr,
                SPLIT: tl.constexpr, P: tl.constexpr, PAIR: tl.constexpr):
    # One tile's update of the online softmax (m_i, l_i, w_run, acc_a, acc_b) from the loads
    # of tile_operand; KR / VR: the residual rows (read here, in tiles with k_nres / v_nres)
    # ---- scores s [M, T] in log2 units; two half-width dots for fp4 (even / odd columns) or
    # SPLIT (first / second half): half the operand registers live at a time
    if SPLIT and KH == 2:
        k_a, _ = widen(kx, kx, D // 2, KFMT, CDT, ASM)
        k_b, _ = widen(km, km, D // 2, KFMT, CDT, ASM)
    else:
        k_a, k_b = widen(kx, km, D, KFMT, CDT, ASM)
    T: tl.constexpr = pos.shape[0]
    M: tl.constexpr = row_ok.shape[0]
    if PAIR:  # rows of the second copy (they see the tile's second page), keys of that page
        copy = tl.arange(0, M) >= M // 2
        second = tl.arange(0, T) >= P
    if KSM == 4:  # channel scales: scale q's columns (PAIR: each copy by its page's)
        s = _channel_scores(q_a, q_b, k_a, k_b, ks, kz, k_ok, D, KFMT, KH, CDT, PREC, PAIR)
    else:
        s = tl.dot(q_a, tl.trans(k_a), input_precision=PREC)
        if KH != 0:
            s = tl.dot(q_b, tl.trans(k_b), s, input_precision=PREC)
        if KSM != 0:
            s = s * ks[None, :]
    if KFMT >= 5 and KSM != 4:  # int zero points per token
        s = s + q_sum[:, None] * kz[None, :]
    if KRES:
        if k_nres > 0:  # residual rows: loaded and multiplied only in the tiles that have some
            kr_a, kr_b = load_row_pair(KR, k_row, seen & (k_row >= 0), D, KH, CDT)
            s = tl.dot(q_a, tl.trans(kr_a), s, input_precision=PREC)
            if KH != 0:
                s = tl.dot(q_b, tl.trans(kr_b), s, input_precision=PREC)
    if SOFTCAP:
        x = s * cap_in
        e = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        s = tl.where(x < 0, -th, th) * cap_out
    else:
        s = s * qk_scale
    ok = seen[None, :] & row_ok[:, None]
    if PAIR:
        ok = ok & (copy[:, None] == second[None, :])
    if SQ > 1:
        ok = ok & (pos[None, :] <= q_pos[:, None])
    if WINDOW:
        ok = ok & ((q_pos[:, None] - pos[None, :] < window) | (pos[None, :] < sinks))
    s = tl.where(ok, s, float("-inf"))
    if WRITE_SCORES:
        tl.store(SCORES + q_row[:, None].to(tl.int64) * scores_len + pos[None, :], s,
                 mask=ok & (pos < scores_len)[None, :])

    # ---- online softmax
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    if VFMT < 5:
        l_i = l_i * alpha + tl.sum(p, 1)
        pz = alpha  # (no zero points)

    # ---- values: each token's scale goes into p, divided by the tile's largest so that the
    # 16-bit p operand keeps its precision; acc is kept in units of that largest (residual
    # rows count as scale 1)
    if SPLIT and VH == 2:
        v_a, _ = widen(vx, vx, DV // 2, VFMT, CDT, ASM)
        v_b, _ = widen(vm, vm, DV // 2, VFMT, CDT, ASM)
    else:
        v_a, v_b = widen(vx, vm, DV, VFMT, CDT, ASM)
    if VSM == 0 or VSM == 4:
        pv = p.to(CDT)
        corr = alpha
        w_tile = w_run
    else:
        f = vs
        if VRES:
            f = tl.where(v_ok, vs, 1.0)
        w_tile = tl.maximum(tl.max(f, 0), 1e-30)
        pv = (p * (f / w_tile)[None, :]).to(CDT)
        corr = alpha * (w_run / w_tile)
        w_run = tl.zeros_like(w_run) + w_tile
    if VFMT >= 5:
        # int zero points: sum_t p_t * z_t (per token, in acc's units) or the sum of p over the
        # code keys (channel zero points, applied per column), in one reduction with l's sum
        if VSM == 4:
            zt = v_ok.to(tl.float32)
        else:
            zt = vz / w_tile
        p_sum, pz = tl.reduce((p, p * zt[None, :]), 1, _add_pair)
        l_i = l_i * alpha + p_sum
    if VSM == 4:  # channel scales: scale the dot's columns (PAIR: each copy by its page's)
        acc_a, acc_b = _channel_values(pv, pz, v_a, v_b, vs, vz, acc_a * corr[:, None],
                                       acc_b * corr[:, None], DV, VFMT, VH, PREC, PAIR)
    else:
        acc_a = tl.dot(pv, v_a, acc_a * corr[:, None], input_precision=PREC)
        if VH != 0:
            acc_b = tl.dot(pv, v_b, acc_b * corr[:, None], input_precision=PREC)
        if VFMT >= 5:  # zero points per token, in acc's units
            acc_a = acc_a + pz[:, None]
            if VH != 0:
                acc_b = acc_b + pz[:, None]
    if VRES:
        if v_nres > 0:
            vr_a, vr_b = load_row_pair(VR, v_row, seen & (v_row >= 0), DV, VH, CDT)
            acc_a = tl.dot(pv, vr_a, acc_a, input_precision=PREC)
            if VH != 0:
                acc_b = tl.dot(pv, vr_b, acc_b, input_precision=PREC)
    return m_new, l_i, w_run, acc_a, acc_b
