"""Triton kernels of paged decode attention (the launcher and ops are in decode.py).

decode_split_kernel: one program per (sequence, kv head, split) runs an online softmax over
its tiles of BLOCK_T keys; combine_splits_kernel merges the splits; attn_mass_kernel turns the saved
scores into per-key probability mass (H2O). Sink logits (HAS_SINK) join a row's softmax where
it is final: the direct epilogue, or the combine (`add_sink`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompile.kernels.decode_attend import attend_tile, tile_meta, tile_operand
from kvcompile.kernels.decode_tiles import load_rotated_pair, load_row_pair


# Runtime ints are not specialized (divisibility, == 1): the binary depends on the constexprs
# alone, so a warm-up on small inputs compiles what a large launch uses.
@triton.jit(do_not_specialize=["stride_bt", "n_kmask", "scores_len", "H", "window", "sinks",
                               "NUM_SPLITS"])
def decode_split_kernel(
        Q, KD, KS, KM, KZ, KR, KRS, VD, VS, VM, VZ, VR, VRS, BT, SL, KMASK, ACC, LSE, OUT,
        SCORES, SINK, ROT_COS, ROT_SIN, NROT, stride_bt, n_kmask, scores_len, H, qk_scale, cap_in, cap_out, k_mult, v_mult,
        window, sinks, NUM_SPLITS,
        G: tl.constexpr, SQ: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        P: tl.constexpr, BLOCK_T: tl.constexpr,
        KFMT: tl.constexpr, VFMT: tl.constexpr, KSM: tl.constexpr, VSM: tl.constexpr,
        KRES: tl.constexpr, VRES: tl.constexpr,
        CDT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr,
        WRITE_SCORES: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
        WINDOW: tl.constexpr, ASM: tl.constexpr, BIG: tl.constexpr, SPLIT: tl.constexpr,
        PAIR: tl.constexpr = False, HAS_SINK: tl.constexpr = False,
        HAS_ROT: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
        ROT_PEEL: tl.constexpr = True):
    # K / V (KZ, VZ: int zero points; KR, KRS / VR, VRS: bf16 residual rows and the row of
    # each page) in the formats KFMT / VFMT (decode_tiles.py codes) with scale modes KSM / VSM.
    # HAS_ROT: keys j < NROT[b] are scored by the query rotated by ROT_COS / ROT_SIN [B, D]
    # (re-rotated sinks, eviction/aside.py) in tiles of BLOCK_R keys that split 0 runs first;
    # the other tiles skip those keys
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H
    kvh = pid_bh % H
    HQ = H * G
    PREC: tl.constexpr = "ieee" if IEEE else None

    # rows r = g * SQ + i: query i of the group's head g. PAIR (channel scales, tiles of two
    # pages, G * SQ <= M / 2): rows r and r + M / 2 hold the same query, the first scaled by
    # the tile's first page's channel scales and seeing its keys, the second by the second
    # page's; one dot serves both pages, and the two copies' softmax partials merge at the end
    HM: tl.constexpr = M // 2 if PAIR else M
    r = tl.arange(0, M)
    if PAIR:
        rq = r % HM
    else:
        rq = r
    row_ok = rq < G * SQ
    q_row = (b * HQ + kvh * G + rq // SQ) * SQ + rq % SQ  # row of q / out as [B*Hq*Sq, D]
    L = tl.load(SL + b)
    q_pos = L - SQ + rq % SQ
    # column layout of q / K (KH) and of V / out (VH): 1 = even / odd columns (fp4 / int4
    # nibbles), 2 = first / second half (SPLIT), 0 = all
    KH: tl.constexpr = 1 if (KFMT == 3 or KFMT == 4 or KFMT == 5) else (2 if SPLIT else 0)
    VH: tl.constexpr = 1 if (VFMT == 3 or VFMT == 4 or VFMT == 5) else (2 if SPLIT else 0)
    q_a, q_b = load_row_pair(Q, q_row, row_ok, D, KH, CDT)
    q_sum = _row_sums(q_a, q_b, row_ok, KFMT, KH)

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
    if VH != 0:
        acc_a = tl.zeros([M, DV // 2], tl.float32)
        acc_b = tl.zeros([M, DV // 2], tl.float32)
    else:
        acc_a = tl.zeros([M, DV], tl.float32)
        acc_b = acc_a

    # HAS_ROT: phase 0, in split 0's program only, attends to keys [0, n_rot) with the rotated
    # query, in tiles of BLOCK_R keys (no tile then holds both kinds of keys: one dot per
    # tile, and no register of the rotated query outlives phase 0); phase 1, the split's
    # tiles that hold keys below n_rot, with those unseen; phase 2, the plain loop. ROT_PEEL
    # off: phase 1 takes every tile (one masked loop: a few more instructions per tile, but
    # one loop less for the register allocator; which is faster is measured on the GPU,
    # benchmarks/bench_rot_decode.py)
    if HAS_ROT:
        tl.static_assert(not WINDOW, "rotated keys take no window")
        n_rot = tl.minimum(tl.load(NROT + b).to(tl.int32), L)
        if ROT_PEEL:
            t_skip = tl.minimum(tl.maximum(tl.cdiv(n_rot, BLOCK_T), t0), t1)
        else:
            t_skip = t1
    else:
        n_rot = L * 0
        t_skip = t0
    for phase in tl.static_range(0 if HAS_ROT else 2, 3):
        if phase == 0:
            ta = L * 0
            tb = tl.where(split == 0, tl.cdiv(n_rot, BLOCK_R), 0)
            L_p = n_rot
            qp_a, qp_b = load_rotated_pair(Q, q_row, row_ok, ROT_COS + b * D, ROT_SIN + b * D,
                                           D, KH, CDT)
            qp_sum = _row_sums(qp_a, qp_b, row_ok, KFMT, KH)
        else:
            if phase == 1:
                ta = t0
                tb = t_skip
            else:
                ta = t_skip
                tb = t1
            L_p = L
            qp_a = q_a
            qp_b = q_b
            qp_sum = q_sum
        for t in range(ta, tb):
            pos, seen, page = tile_meta(t, tb, b, L_p, lo, lo_t, n_sink, sinks, BT, stride_bt,
                                         KMASK, n_kmask, P, BLOCK_R if phase == 0 else BLOCK_T,
                                         WINDOW, HAS_KMASK, n_rot, phase == 1)
            off = pos % P
            if KSM == 4 or VSM == 4:
                # channel scales: the tile's page(s) from the block table, as scalars (a tile
                # of one page, or of two when BLOCK_T = 2P)
                tile: tl.constexpr = BLOCK_R if phase == 0 else BLOCK_T
                start = tl.where(t < n_sink, t * tile, lo_t + (t - n_sink) * tile)
                cok0 = (start < L).to(tl.int32)
                cok1 = (start + P < L).to(tl.int32)
                cpage0 = tl.load(BT + b * stride_bt + start // P, mask=cok0 != 0, other=0)
                cpage1 = tl.load(BT + b * stride_bt + start // P + 1, mask=cok1 != 0, other=0)
            else:
                cok0 = 0
                cok1 = 0
                cpage0 = 0
                cpage1 = 0
            kx, km, ks, kz, k_ok, k_row, k_nres = tile_operand(
                KD, KS, KM, KZ, KRS, page, off, seen, kvh, H, k_mult, D, P, KFMT, KSM, KRES,
                KH, CDT, ASM, BIG, SPLIT, cpage0, cpage1, cok0, cok1)
            vx, vm, vs, vz, v_ok, v_row, v_nres = tile_operand(
                VD, VS, VM, VZ, VRS, page, off, seen, kvh, H, v_mult, DV, P, VFMT, VSM, VRES,
                VH, CDT, ASM, BIG, SPLIT, cpage0, cpage1, cok0, cok1)
            m_i, l_i, w_run, acc_a, acc_b = attend_tile(
                qp_a, qp_b, qp_sum, kx, km, vx, vm, ks, vs, kz, vz, k_ok, v_ok, KR, k_row,
                k_nres, VR, v_row, v_nres, pos, seen, q_pos, row_ok, q_row, m_i, l_i, w_run,
                acc_a, acc_b, SCORES, scores_len, qk_scale, cap_in, cap_out, window, sinks, D,
                DV, SQ, KFMT, VFMT, KSM, VSM, KRES, VRES, KH, VH, CDT, SOFTCAP, WRITE_SCORES,
                PREC, WINDOW, ASM, SPLIT, P, PAIR)

    if PAIR:  # merge the two copies of each query row (w_run is the same in every row)
        m2 = tl.reshape(m_i, [2, HM])
        m_i = tl.max(m2, 0)
        m_s = tl.where(m_i == float("-inf"), 0.0, m_i)
        wgt = tl.exp2(m2 - m_s[None, :])
        l_i = tl.sum(tl.reshape(l_i, [2, HM]) * wgt, 0)
        acc_a = tl.sum(tl.reshape(acc_a, [2, HM, acc_a.shape[1]]) * wgt[:, :, None], 0)
        if VH != 0:
            acc_b = tl.sum(tl.reshape(acc_b, [2, HM, acc_b.shape[1]]) * wgt[:, :, None], 0)
        w_run = tl.max(tl.reshape(w_run, [2, HM]), 0)
        r = tl.arange(0, HM)
        row_ok = r < G * SQ
        q_row = (b * HQ + kvh * G + r // SQ) * SQ + r % SQ

    # ---- epilogue: normalized partial and lse (log2 units); a split with no key has l = 0;
    # a NaN l (a NaN score) stays NaN in lse, so that the combine keeps it
    l_safe = tl.where(l_i == 0, 1.0, l_i)
    inv = tl.where(l_i == 0, 0.0, w_run / l_safe)
    lse = tl.where(l_i == 0, float("-inf"), m_i + tl.log2(l_safe))
    if VH == 1:
        cols_a = 2 * tl.arange(0, DV // 2)
        cols_b = cols_a + 1
    elif VH == 2:
        cols_a = tl.arange(0, DV // 2)
        cols_b = cols_a + DV // 2
    else:
        cols_a = tl.arange(0, DV)
        cols_b = cols_a
    if DIRECT:
        if HAS_SINK:  # SINK [Hq] fp32: one more softmax column per query head
            sink = tl.load(SINK + kvh * G + r // SQ, mask=row_ok, other=0.0)
            lse, inv = add_sink(lse, inv, sink)
        o_ptr = OUT + q_row[:, None] * DV
        tl.store(o_ptr + cols_a[None, :], (acc_a * inv[:, None]).to(OUT.dtype.element_ty),
                 mask=row_ok[:, None])
        if VH != 0:
            tl.store(o_ptr + cols_b[None, :], (acc_b * inv[:, None]).to(OUT.dtype.element_ty),
                     mask=row_ok[:, None])
        tl.store(LSE + q_row, lse, mask=row_ok)
    else:
        part = q_row * NUM_SPLITS + split
        a_ptr = ACC + part[:, None] * DV
        tl.store(a_ptr + cols_a[None, :], acc_a * inv[:, None], mask=row_ok[:, None])
        if VH != 0:
            tl.store(a_ptr + cols_b[None, :], acc_b * inv[:, None], mask=row_ok[:, None])
        tl.store(LSE + part, lse, mask=row_ok)


@triton.jit
def _row_sums(q_a, q_b, row_ok, KFMT: tl.constexpr, KH: tl.constexpr):
    # sum_d q_d per row (int keys' zero points add zero * sum_d q_d to the scores); unused
    # (row_ok) for the other formats
    q_sum = row_ok.to(tl.float32)
    if KFMT >= 5:
        q_sum = tl.sum(q_a.to(tl.float32), 1)
        if KH != 0:
            q_sum += tl.sum(q_b.to(tl.float32), 1)
    return q_sum


@triton.jit
def add_sink(lse, inv, sink):
    """A row's lse (log2 units) and output factor `inv` with the sink logit `sink` (natural
    units) added to its softmax's denominator: lse' = log2(2^lse + 2^(sink log2 e)), inv *=
    2^(lse - lse'). A row that saw no key (lse -inf) keeps inv 0."""
    s2 = sink * 1.4426950408889634
    top = tl.maximum(lse, s2)
    lse_all = top + tl.log2(tl.exp2(lse - top) + tl.exp2(s2 - top))
    return lse_all, inv * tl.exp2(lse - lse_all)


@triton.jit(do_not_specialize=["NUM_SPLITS", "HQ", "SQ"])
def combine_splits_kernel(ACC, PLSE, OUT, LSE, SINK, NUM_SPLITS, HQ, SQ, DV: tl.constexpr,
                          S_PAD: tl.constexpr, CHUNK: tl.constexpr, HAS_SINK: tl.constexpr):
    # one program per output row (b, head, query): out = sum_s 2^(lse_s - lse) * acc_s, with
    # SINK [HQ] (HAS_SINK) one more term of the denominator
    row = tl.program_id(0)
    sp = tl.arange(0, S_PAD)
    lse_s = tl.load(PLSE + row * NUM_SPLITS + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse_s, 0)
    if HAS_SINK:
        s2 = tl.load(SINK + (row // SQ) % HQ) * 1.4426950408889634
        m = tl.maximum(m, s2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse_s - m_safe), 0)
    if HAS_SINK:
        total += tl.exp2(s2 - m_safe)
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
    # total == 0: no split saw a key (a row that attends to nothing: 0, lse -inf); a NaN total
    # (a split whose scores held a NaN) stays NaN in the output and its lse
    t_safe = tl.where(total == 0, 1.0, total)
    out = tl.where(total == 0, 0.0, out / t_safe)
    tl.store(OUT + row * DV + dv, out.to(OUT.dtype.element_ty))
    tl.store(LSE + row, tl.where(total == 0, float("-inf"), m_safe + tl.log2(t_safe)))


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
