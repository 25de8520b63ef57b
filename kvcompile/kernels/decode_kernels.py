"""Triton kernels of paged decode attention (the launcher and ops are in decode.py).

decode_split_kernel: one program per (sequence, kv head, split) runs an online softmax over
its tiles of BLOCK_T keys; combine_splits_kernel merges the splits; attn_mass_kernel turns the saved
scores into per-key probability mass (H2O).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompile.kernels.decode_tiles import load_codes, load_token_scales, widen


@triton.jit
def _tile_meta(t, t1, b, L, lo, lo_t, n_sink, sinks, BT, stride_bt, KMASK, n_kmask,
               P: tl.constexpr, BLOCK_T: tl.constexpr, WINDOW: tl.constexpr,
               HAS_KMASK: tl.constexpr):
    # tile t -> key positions [T], keys some row of the program may see [T], their page ids
    start = tl.where(t < n_sink, t * BLOCK_T, lo_t + (t - n_sink) * BLOCK_T)
    pos = start + tl.arange(0, BLOCK_T)
    seen = (pos < L) & (pos * 0 + t < t1)
    if WINDOW:
        seen = seen & ((pos >= lo) | (pos < sinks))
    if HAS_KMASK:
        km = tl.load(KMASK + b * n_kmask + pos, mask=seen & (pos < n_kmask), other=1)
        seen = seen & (km != 0)
    page = tl.load(BT + b * stride_bt + pos // P, mask=seen, other=0)
    return pos, seen, page


@triton.jit
def _tile_data(KD, KS, KM, VD, VS, VM, pos, seen, page, kvh, H, k_mult, v_mult,
               D: tl.constexpr, DV: tl.constexpr, P: tl.constexpr, KFMT: tl.constexpr,
               VFMT: tl.constexpr, KSM: tl.constexpr, VSM: tl.constexpr, ASM: tl.constexpr,
               BIG: tl.constexpr, SPLIT: tl.constexpr):
    # raw codes and per-token scales of one tile (loads only, nothing waits on them here).
    # (kx, km): fp4 (bytes, micro); SPLIT: the two column halves; else (codes, codes)
    off = pos % P
    tok = (page * H + kvh) * P + off
    if SPLIT and KFMT != 3:
        kx, _ = load_codes(KD, KM, tok, seen, D, KFMT, ASM, BIG, 0, D // 2)
        km, _ = load_codes(KD, KM, tok, seen, D, KFMT, ASM, BIG, D // 2, D // 2)
    else:
        kx, km = load_codes(KD, KM, tok, seen, D, KFMT, ASM, BIG)
    if SPLIT and VFMT != 3:
        vx, _ = load_codes(VD, VM, tok, seen, DV, VFMT, ASM, BIG, 0, DV // 2)
        vm, _ = load_codes(VD, VM, tok, seen, DV, VFMT, ASM, BIG, DV // 2, DV // 2)
    else:
        vx, vm = load_codes(VD, VM, tok, seen, DV, VFMT, ASM, BIG)
    ks = load_token_scales(KS, page, off, kvh, H, P, KSM, seen) * k_mult
    vs = load_token_scales(VS, page, off, kvh, H, P, VSM, seen) * v_mult
    return kx, km, vx, vm, ks, vs


@triton.jit
def _attend_tile(q_a, q_b, kx, km, vx, vm, ks, vs, pos, seen, q_pos, row_ok, q_row, m_i, l_i,
                 w_run, acc_a, acc_b, SCORES, scores_len, qk_scale, cap_in, cap_out, window,
                 sinks, D: tl.constexpr, DV: tl.constexpr, SQ: tl.constexpr,
                 KFMT: tl.constexpr, VFMT: tl.constexpr, KSM: tl.constexpr, VSM: tl.constexpr,
                 CDT: tl.constexpr, SOFTCAP: tl.constexpr, WRITE_SCORES: tl.constexpr,
                 PREC: tl.constexpr, WINDOW: tl.constexpr, ASM: tl.constexpr,
                 SPLIT: tl.constexpr):
    # ---- scores s [M, T] in log2 units; two half-width dots for fp4 (even / odd columns) or
    # SPLIT (first / second half): half the operand registers live at a time
    if SPLIT and KFMT != 3:
        k_a, _ = widen(kx, kx, D // 2, KFMT, CDT, ASM)
        k_b, _ = widen(km, km, D // 2, KFMT, CDT, ASM)
    else:
        k_a, k_b = widen(kx, km, D, KFMT, CDT, ASM)
    s = tl.dot(q_a, tl.trans(k_a), input_precision=PREC)
    if KFMT == 3 or SPLIT:
        s = tl.dot(q_b, tl.trans(k_b), s, input_precision=PREC)
    if KSM != 0:
        s = s * ks[None, :]
    if SOFTCAP:
        x = s * cap_in
        e = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        s = tl.where(x < 0, -th, th) * cap_out
    else:
        s = s * qk_scale
    ok = seen[None, :] & row_ok[:, None]
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
    l_i = l_i * alpha + tl.sum(p, 1)

    # ---- values: each token's scale goes into p, divided by the tile's largest so that the
    # 16-bit p operand keeps its precision; acc is kept in units of that largest
    if SPLIT and VFMT != 3:
        v_a, _ = widen(vx, vx, DV // 2, VFMT, CDT, ASM)
        v_b, _ = widen(vm, vm, DV // 2, VFMT, CDT, ASM)
    else:
        v_a, v_b = widen(vx, vm, DV, VFMT, CDT, ASM)
    if VSM == 0:
        pv = p.to(CDT)
        corr = alpha
    else:
        w_tile = tl.maximum(tl.max(vs, 0), 1e-30)
        pv = (p * (vs / w_tile)[None, :]).to(CDT)
        corr = alpha * (w_run / w_tile)
        w_run = tl.zeros_like(w_run) + w_tile
    acc_a = tl.dot(pv, v_a, acc_a * corr[:, None], input_precision=PREC)
    if VFMT == 3 or SPLIT:
        acc_b = tl.dot(pv, v_b, acc_b * corr[:, None], input_precision=PREC)
    return m_new, l_i, w_run, acc_a, acc_b


# Runtime ints are not specialized (divisibility, == 1): the binary depends on the constexprs
# alone, so a warm-up on small inputs compiles what a large launch uses.
@triton.jit(do_not_specialize=["stride_bt", "n_kmask", "scores_len", "H", "window", "sinks",
                               "NUM_SPLITS"])
def decode_split_kernel(
        Q, KD, KS, KM, VD, VS, VM, BT, SL, KMASK, ACC, LSE, OUT, SCORES,
        stride_bt, n_kmask, scores_len, H, qk_scale, cap_in, cap_out, k_mult, v_mult,
        window, sinks, NUM_SPLITS,
        G: tl.constexpr, SQ: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        P: tl.constexpr, BLOCK_T: tl.constexpr,
        KFMT: tl.constexpr, VFMT: tl.constexpr, KSM: tl.constexpr, VSM: tl.constexpr,
        CDT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr,
        WRITE_SCORES: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
        WINDOW: tl.constexpr, ASM: tl.constexpr, BIG: tl.constexpr, SPLIT: tl.constexpr):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H
    kvh = pid_bh % H
    HQ = H * G
    PREC: tl.constexpr = "ieee" if IEEE else None

    # rows r = g * SQ + i: query i of the group's head g
    r = tl.arange(0, M)
    row_ok = r < G * SQ
    q_row = (b * HQ + kvh * G + r // SQ) * SQ + r % SQ  # row of q / out as [B*Hq*Sq, D]
    L = tl.load(SL + b)
    q_pos = L - SQ + r % SQ
    if KFMT == 3:
        dh = tl.arange(0, D // 2)
        q_a = tl.load(Q + q_row[:, None] * D + 2 * dh[None, :], mask=row_ok[:, None],
                      other=0.0).to(CDT)
        q_b = tl.load(Q + q_row[:, None] * D + 2 * dh[None, :] + 1, mask=row_ok[:, None],
                      other=0.0).to(CDT)
    elif SPLIT:
        dh = tl.arange(0, D // 2)
        q_a = tl.load(Q + q_row[:, None] * D + dh[None, :], mask=row_ok[:, None],
                      other=0.0).to(CDT)
        q_b = tl.load(Q + q_row[:, None] * D + D // 2 + dh[None, :], mask=row_ok[:, None],
                      other=0.0).to(CDT)
    else:
        d = tl.arange(0, D)
        q_a = tl.load(Q + q_row[:, None] * D + d[None, :], mask=row_ok[:, None],
                      other=0.0).to(CDT)
        q_b = q_a

    # key range: [lo_t, L) plus the tiles of the first `sinks` keys when the window cuts them
    if WINDOW:
        lo = tl.maximum(L - SQ + 1 - window, 0)
        lo_t = (lo // BLOCK_T) * BLOCK_T
        n_sink = tl.cdiv(tl.minimum(sinks, lo), BLOCK_T)
        merged = n_sink * BLOCK_T >= lo_t
        n_sink = tl.where(merged, 0, n_sink)
        lo_t = tl.where(merged, 0, lo_t)
    else:
        lo = L * 0
        lo_t = L * 0
        n_sink = L * 0
    n_tiles = n_sink + tl.cdiv(L - lo_t, BLOCK_T)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t0 = split * per_split
    t1 = tl.minimum(t0 + per_split, n_tiles)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    w_run = tl.full([M], 1.0, tl.float32)  # acc holds output * l / w_run (value-scale units)
    if VFMT == 3 or SPLIT:
        acc_a = tl.zeros([M, DV // 2], tl.float32)
        acc_b = tl.zeros([M, DV // 2], tl.float32)
    else:
        acc_a = tl.zeros([M, DV], tl.float32)
        acc_b = acc_a

    for t in range(t0, t1):
        pos, seen, page = _tile_meta(t, t1, b, L, lo, lo_t, n_sink, sinks, BT, stride_bt,
                                     KMASK, n_kmask, P, BLOCK_T, WINDOW, HAS_KMASK)
        kx, km, vx, vm, ks, vs = _tile_data(KD, KS, KM, VD, VS, VM, pos, seen, page, kvh,
                                            H, k_mult, v_mult, D, DV, P, KFMT, VFMT, KSM,
                                            VSM, ASM, BIG, SPLIT)
        m_i, l_i, w_run, acc_a, acc_b = _attend_tile(
            q_a, q_b, kx, km, vx, vm, ks, vs, pos, seen, q_pos, row_ok, q_row, m_i, l_i,
            w_run, acc_a, acc_b, SCORES, scores_len, qk_scale, cap_in, cap_out, window,
            sinks, D, DV, SQ, KFMT, VFMT, KSM, VSM, CDT, SOFTCAP, WRITE_SCORES, PREC,
            WINDOW, ASM, SPLIT)

    # ---- epilogue: normalized partial and lse (log2 units); a split with no key has l = 0
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    inv = tl.where(l_i > 0, w_run / l_safe, 0.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    if VFMT == 3:
        cols_a = 2 * tl.arange(0, DV // 2)
        cols_b = cols_a + 1
    elif SPLIT:
        cols_a = tl.arange(0, DV // 2)
        cols_b = cols_a + DV // 2
    else:
        cols_a = tl.arange(0, DV)
        cols_b = cols_a
    if DIRECT:
        o_ptr = OUT + q_row[:, None] * DV
        tl.store(o_ptr + cols_a[None, :], (acc_a * inv[:, None]).to(OUT.dtype.element_ty),
                 mask=row_ok[:, None])
        if VFMT == 3 or SPLIT:
            tl.store(o_ptr + cols_b[None, :], (acc_b * inv[:, None]).to(OUT.dtype.element_ty),
                     mask=row_ok[:, None])
        tl.store(LSE + q_row, lse, mask=row_ok)
    else:
        part = q_row * NUM_SPLITS + split
        a_ptr = ACC + part[:, None] * DV
        tl.store(a_ptr + cols_a[None, :], acc_a * inv[:, None], mask=row_ok[:, None])
        if VFMT == 3 or SPLIT:
            tl.store(a_ptr + cols_b[None, :], acc_b * inv[:, None], mask=row_ok[:, None])
        tl.store(LSE + part, lse, mask=row_ok)


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def combine_splits_kernel(ACC, PLSE, OUT, LSE, NUM_SPLITS, DV: tl.constexpr, S_PAD: tl.constexpr,
                    CHUNK: tl.constexpr):
    # one program per output row: out = sum_s 2^(lse_s - lse) * acc_s
    row = tl.program_id(0)
    sp = tl.arange(0, S_PAD)
    lse_s = tl.load(PLSE + row * NUM_SPLITS + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse_s - m_safe), 0)
    dv = tl.arange(0, DV)
    ch = tl.arange(0, CHUNK)
    out = tl.zeros([DV], tl.float32)
    for c in range(0, NUM_SPLITS, CHUNK):
        s_idx = c + ch
        ls = tl.load(PLSE + row * NUM_SPLITS + s_idx, mask=s_idx < NUM_SPLITS,
                     other=float("-inf"))
        w = tl.exp2(ls - m_safe)
        a = tl.load(ACC + (row * NUM_SPLITS + s_idx)[:, None] * DV + dv[None, :],
                    mask=(s_idx < NUM_SPLITS)[:, None], other=0.0)
        out += tl.sum(a * w[:, None], 0)
    t_safe = tl.where(total > 0, total, 1.0)
    out = tl.where(total > 0, out / t_safe, 0.0)
    tl.store(OUT + row * DV + dv, out.to(OUT.dtype.element_ty))
    tl.store(LSE + row, tl.where(total > 0, m_safe + tl.log2(t_safe), float("-inf")))


@triton.jit(do_not_specialize=["scores_len", "H"])
def attn_mass_kernel(SCORES, LSE, MASS, SL, scores_len, H, G: tl.constexpr, SQ: tl.constexpr,
                      BLOCK: tl.constexpr):
    # MASS[b, kvh, j] += sum over the group's rows of 2^(s - lse): the probability of key j
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    kvh = pid_bh % H
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = pos < tl.minimum(tl.load(SL + b), scores_len)
    mass = tl.zeros([BLOCK], tl.float32)
    for r in range(G * SQ):
        q_row = (b * H * G + kvh * G + r // SQ) * SQ + r % SQ
        lse = tl.load(LSE + q_row)
        s = tl.load(SCORES + q_row.to(tl.int64) * scores_len + pos, mask=ok,
                    other=float("-inf"))
        mass += tl.where(s == float("-inf"), 0.0, tl.exp2(s - lse))
    dst = MASS + pid_bh.to(tl.int64) * scores_len + pos
    tl.store(dst, tl.load(dst, mask=ok, other=0.0) + mass, mask=ok)
