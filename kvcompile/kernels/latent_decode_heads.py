"""Layout "heads" of the absorbed MLA decode (kernels/latent_decode.py): issue 22's first
tensor-core rebuild, heads as the M of QK^T. Kept for the benchmark's comparison and for fewer
than 64 heads, where it is the measured pick; at 64 heads both warpgroups of 8 warps (or both
programs of a v_split pair) compute the same scores. latent_decode.py launches it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _latent_tile_kernel(QL, CD, CS, RD, RS, BT, SL, OUT, ACC, ML, stride_qb, stride_qh,
                        stride_bt, H, num_splits, tiles_per_split, qk_scale, R: tl.constexpr,
                        DR: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_N: tl.constexpr, V_SPLIT: tl.constexpr, C_SCALED: tl.constexpr,
                        R_SCALED: tl.constexpr, DT: tl.constexpr, DIRECT: tl.constexpr,
                        KMASK=None, n_kmask=0, HAS_KMASK: tl.constexpr = False,
                        SCORES=None, scores_len=0, WRITE_SCORES: tl.constexpr = False):
    # V_SPLIT 2: two programs share a head block; each scores all r + dr columns but
    # accumulates only its half of the latent ("own" columns v0..v0+RV, the "other" half
    # only enters the scores), which halves the accumulator's registers
    RV: tl.constexpr = R // V_SPLIT
    hb = tl.program_id(0) // V_SPLIT
    v0 = (tl.program_id(0) % V_SPLIT) * RV
    split = tl.program_id(1)
    b = tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    rv = tl.arange(0, RV)
    dd = tl.arange(0, DR)
    t = tl.arange(0, BLOCK_N)
    q_row = QL + b * stride_qb + h[:, None] * stride_qh                       # [BLOCK_H, 1]
    # q stays as loaded (a dot operand Triton keeps in shared memory for the whole loop);
    # the softmax scale multiplies the scores instead
    q_c = tl.load(q_row + v0 + rv[None, :], mask=h_ok[:, None], other=0.0).to(DT)  # [BH, RV]
    q_r = tl.load(q_row + R + dd[None, :], mask=h_ok[:, None], other=0.0).to(DT)   # [BH, DR]
    if V_SPLIT == 2:
        o0 = RV - v0
        q_o = tl.load(q_row + o0 + rv[None, :], mask=h_ok[:, None], other=0.0).to(DT)
    L = tl.load(SL + b)
    n_lo = split * tiles_per_split * BLOCK_N
    n_hi = tl.minimum(n_lo + tiles_per_split * BLOCK_N, L)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RV], tl.float32)
    bt_row = BT + b * stride_bt
    for n0 in range(n_lo, n_hi, BLOCK_N):
        j = n0 + t                                                            # token ids
        ok = j < n_hi
        if HAS_KMASK:   # key_mask[b, j] False hides key j (j >= n_kmask: seen)
            km = tl.load(KMASK + b * n_kmask + j, mask=ok & (j < n_kmask), other=1)
            ok = ok & (km != 0)
        page = tl.load(bt_row + j // P, mask=ok, other=0).to(tl.int64)
        tok = page * P + (j % P)                                              # [BLOCK_N]
        c = tl.load(CD + tok[:, None] * R + v0 + rv[None, :], mask=ok[:, None],
                    other=0.0).to(DT)                                         # [BLOCK_N, RV]
        kr = tl.load(RD + tok[:, None] * DR + dd[None, :], mask=ok[:, None], other=0.0)
        s_c = tl.dot(q_c, tl.trans(c))                                        # [BH, BLOCK_N]
        if V_SPLIT == 2:
            c_o = tl.load(CD + tok[:, None] * R + o0 + rv[None, :], mask=ok[:, None],
                          other=0.0).to(DT)
            s_c = tl.dot(q_o, tl.trans(c_o), s_c)
        s_r = tl.dot(q_r, tl.trans(kr.to(DT)))
        if C_SCALED:
            cs = tl.load(CS + page, mask=ok, other=0.0)                       # [BLOCK_N]
            s_c = s_c * (cs * qk_scale)[None, :]
        else:
            s_c = s_c * qk_scale
        if R_SCALED:
            s_r = s_r * (tl.load(RS + page, mask=ok, other=0.0) * qk_scale)[None, :]
        else:
            s_r = s_r * qk_scale
        s = tl.where(ok[None, :], s_c + s_r, float("-inf"))
        if WRITE_SCORES:   # H2O (latent_decode.py): each key's score, by the first half only
            s_dst = SCORES + (b * H + h[:, None]).to(tl.int64) * scores_len + j[None, :]
            s_ok = (ok & (j < scores_len))[None, :] & (h_ok & (h * 0 + v0 == 0))[:, None]
            tl.store(s_dst, s, mask=s_ok)
        m_new = tl.maximum(m_i, tl.max(s, 1))      # finite: every tile has a token below n_hi
        m_use = m_new
        if HAS_KMASK:   # ... unless the key mask hid every key so far (m stays -inf)
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if C_SCALED:
            p = p * cs[None, :]
        acc = tl.dot(p.to(DT), c, acc * alpha[:, None])
        m_i = m_new
    cols = v0 + rv[None, :]
    if DIRECT:
        inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        tl.store(OUT + (b * H + h)[:, None] * R + cols, acc * inv[:, None], mask=h_ok[:, None])
        if WRITE_SCORES:   # (max, sum) for the scores' lse
            first = h_ok & (h * 0 + v0 == 0)
            tl.store(ML + (b * H + h) * 2, m_i, mask=first)
            tl.store(ML + (b * H + h) * 2 + 1, l_i, mask=first)
    else:
        row = (b * num_splits + split) * H + h
        tl.store(ACC + row[:, None] * R + cols, acc, mask=h_ok[:, None])
        # both halves hold the same m and l (h * 0 + v0: the interpreter takes no scalar here)
        first = h_ok & (h * 0 + v0 == 0)
        tl.store(ML + row * 2, m_i, mask=first)
        tl.store(ML + row * 2 + 1, l_i, mask=first)
