"""FP8 causal prefill on Hopper's FP8 tensor cores, in Gluon (triton.experimental.gluon).

    reason = unsupported(q, k8, vt8, out, causal, window, sinks, softcap, cu_seqlens_k)
    launch_prefill_fp8_sm90(q, k8, vt8, scales, cu_seqlens, out, scale, max_seqlen)

Inputs as `prefill.quantize_fp8_prefill` writes them: q [T, Hq, D], k8 [T, Hkv, D] and V
transposed, vt8 [Hkv * Dv, NB * 128] (its tokens in P's lane order within 32-token chunks:
`prefill_quant.vt_column`), E4M3, with an fp32 descale per (sequence, 128-token block, kv head)
for each. q may instead come in bf16 (`quantize_fp8_prefill(..., with_q=False)`): the kernel
then quantizes its 64 query rows itself, a scale per row, and Q's separate pass is gone.
Causal self-attention of each packed sequence (no window, sinks, softcap or separate key
lengths: `unsupported` says which is missing, and launch_prefill runs the Triton kernel then).

Why Gluon below Triton's tiles: the Triton FP8 kernel is issue-bound (benchmarks/RESULTS.md,
"What limits the prefill kernels": 1994 issue cycles of softmax against 1108 of FP8 MMA a
128 x 128 tile) and its tile abstraction leaves the instruction stream to the compiler. Here
each step is placed by hand. The default order within a warpgroup, for key tile j:

    issue S[j] = Q K[j]^T; wait for it (and for the last tile's P V)
    softmax of S[j] -> P[j] in E4M3
    rescale O; issue O += P[j] V[j]   (async, P from registers; it runs into tile j + 1)

Two CTAs share each SM (255 registers a thread at head_dim 128), so one's softmax runs while
the other's products do. P is made and consumed in one iteration: carried across the loop (as
FlashAttention-3's order needs), Triton keeps an E4M3 tensor as single bytes and repacks them
for the wgmma, 192 more instructions a tile and warp (the loop body 718 -> 515 SASS
instructions); on the H200 the serial order runs 1.17-1.32x cuDNN SDPA bf16 against
FlashAttention-3's order's 1.00-1.14x in the same run. `overlap=True` keeps that order (tile
j - 1's P V issued after S[j], running during tile j's softmax; O rescaled before it, else
ptxas serializes the wgmma: C7514, which tests/kernels/test_prefill_sm90.py fails on).
Two opt-in builds of the serial order: `lazy=True` rescales O only when a row's max or V's
scale grows (fewer instructions, measured no faster: the serial chain, not issue, bounds the
loop), `pipe=True` walks 64-key tiles with each tile's q.k issued a tile ahead, so that a
tile's softmax runs while the next tile's scores are on the tensor cores (0.72-0.85x the
default on the H100: the halved tile costs more than the overlap wins).
Numbers: benchmarks/RESULTS.md.

One CTA of 4 warps (one warpgroup; 8 warps: two, 128 rows) owns 64 query rows of one query
head of one sequence and walks its keys in 128-token tiles: Q arrives by one TMA copy, K and V^T
tiles through two-stage rings of TMA copies with an mbarrier each, issued two tiles (K) or one
(V) ahead; one CTA barrier a tile frees the stages for the next copies. Tile 0 and the
diagonal tile (the last) are masked. P enters the second product as 256 * p in E4M3 (small
weights stay normal), from registers; the running O is kept in units of the current V block's
scale (rescaled by alpha * v_prev / v_scale), as the Triton kernel does. The grid runs the
longest query tiles first, the heads of a kv head side by side (K / V shared in L2).
"""

from __future__ import annotations

import torch

BLOCK_N = 128   # keys a tile (= the scale block: one k / v descale a tile)
# one warpgroup, 64 query rows a CTA, two CTAs a SM: in the serial order on the H200
# 1.17-1.32x cuDNN SDPA bf16 against 0.97-1.12x with 8 warps (two warpgroups, 128 rows a CTA,
# one CTA a SM); in FlashAttention-3's order on the H100 1.00-1.09x against 0.95-0.97x
# (benchmarks/RESULTS.md, thirty-first and thirty-second sessions)
NUM_WARPS = 4
HEAD_DIMS = (64, 128)


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    GLUON_ERROR = None
    # a CTA-wide barrier: gl.thread_barrier in triton 3.6, gl.barrier from 3.7 on
    cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    # a TMA copy into shared memory: async_copy_global_to_shared in 3.6, async_load from 3.7
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
except ImportError as e:   # pragma: no cover - a triton without Gluon
    GLUON_ERROR = f"triton.experimental.gluon is not importable ({e})"


if GLUON_ERROR is None:
    @gluon.jit
    def _load_k(k_desc, k_smem, k_bar, row, col, j, NBYTES: gl.constexpr,
                BN: gl.constexpr = 128):
        s = j % 2
        mbarrier.expect(k_bar.index(s), NBYTES)
        tma_load(k_desc, [row + j * BN, col], k_bar.index(s), k_smem.index(s))

    @gluon.jit
    def _load_v(v_desc, v_smem, v_bar, row, col, j, NBYTES: gl.constexpr,
                BN: gl.constexpr = 128):
        s = j % 2
        mbarrier.expect(v_bar.index(s), NBYTES)
        tma_load(v_desc, [row, col + j * BN], v_bar.index(s), v_smem.index(s))

    @gluon.jit
    def _row_reduce(x, row_layout: gl.constexpr, SUM: gl.constexpr, TREE: gl.constexpr):
        # a row's max (SUM: sum) over a wgmma accumulator [BM, BN] (a thread holds key 8i + 2q
        # + p of its rows for i < BN / 8, p < 2; q: its lane % 4). Triton reduces a thread's
        # values in one dependent chain (31 steps a row); TREE splits the keys as 64h + 8i +
        # 2q + p and reduces over i first: eight independent chains of 7 a thread, then h,
        # then p and q
        if TREE:
            BM: gl.constexpr = x.shape[0]
            BN: gl.constexpr = x.shape[1]
            y = gl.reshape(x, [BM, 2, BN // 16, 8])
            if SUM:
                y = gl.sum(gl.sum(gl.sum(y, 2), 1), 1)
            else:
                y = gl.max(gl.max(gl.max(y, 2), 1), 1)
            return gl.convert_layout(y, row_layout)
        elif SUM:
            return gl.sum(x, 1)
        else:
            return gl.max(x, 1)

    @gluon.jit
    def _softmax(s, c, m_i, l_i, keys, pos, MASKED: gl.constexpr, P_SH: gl.constexpr,
                 TREE: gl.constexpr):
        # s: raw FP8 q.k sums [BM, BN]; c [BM]: each row's multiplier (descales * scale *
        # log2 e)
        row: gl.constexpr = m_i.type.layout
        if MASKED:
            s = gl.where(keys[None, :] <= pos[:, None], s * c[:, None], float("-inf"))
            m_new = gl.maximum(m_i, _row_reduce(s, row, False, TREE))
            p = gl.exp2(s - (m_new - P_SH)[:, None])
        else:
            m_new = gl.maximum(m_i, _row_reduce(s, row, False, TREE) * c)
            p = gl.exp2(s * c[:, None] - (m_new - P_SH)[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + _row_reduce(p, row, True, TREE)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _p_operand(p, p_layout: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
        # P as the A operand of the P V wgmma, its keys in the order each thread already holds
        # them in the q.k accumulator (within a 32-key chunk, position 16h + 4q + 2j + p holds
        # key 16h + 8j + 2q + p), which is the order vt8 stores V's tokens in
        # (prefill_quant.vt_column): no value crosses lanes
        x = gl.reshape(p.to(gl.float8e4nv), [BM, BN // 32, 2, 2, 4, 2])
        x = gl.reshape(gl.permute(x, [0, 1, 2, 4, 3, 5]), [BM, BN])
        return gl.convert_layout(x, p_layout)

    @gluon.jit
    def _scores(q_smem, k_smem, k_bar, zero_s, acc, j, KD, VD, kblk0, stride_sb, hkv):
        # the serial orders' start of a 128-key tile j: S = Q K[j]^T issued, the tile's K / V
        # descales loaded meanwhile, then S and the last tile's P V waited for
        mbarrier.wait(k_bar.index(j % 2), (j // 2) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(j % 2).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        blk = (kblk0 + j) * stride_sb + hkv
        kd = gl.load(KD + blk)
        vs = gl.load(VD + blk)
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
        return s, acc, kd, vs

    @gluon.jit
    def _pv_refill(acc, p, p_layout: gl.constexpr, k_desc, k_smem, k_bar, v_desc, v_smem, v_bar,
                   j, n_tiles, q_start, hkv, v_col, HEAD_DIM: gl.constexpr,
                   KV_BYTES: gl.constexpr, BN: gl.constexpr):
        # the serial orders' end of tile j: P in E4M3, O += P V[j] issued (left running into
        # the next tile); then every warp is past tile j's q.k and tile j - 1's P V: K stage
        # j % 2 and V stage (j + 1) % 2 are free for tiles j + 2 and j + 1 (V of tiles 0 and
        # 1: the prologue's)
        p8 = _p_operand(p, p_layout, p.shape[0], p.shape[1])
        mbarrier.wait(v_bar.index(j % 2), (j // 2) & 1)
        acc = warpgroup_mma(p8, v_smem.index(j % 2).permute((1, 0)), acc, is_async=True)
        cta_barrier()
        if j + 2 < n_tiles:
            _load_k(k_desc, k_smem, k_bar, q_start, hkv * HEAD_DIM, j + 2, KV_BYTES, BN)
        if j > 0 and j + 1 < n_tiles:
            _load_v(v_desc, v_smem, v_bar, hkv * HEAD_DIM, v_col, j + 1, KV_BYTES, BN)
        return acc

    @gluon.jit
    def _tile(q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, p8, m_i, l_i, v_prev,
              r, kd, vs, zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start, v_col,
              keys0, pos, row_o: gl.constexpr, p_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
              KV_BYTES: gl.constexpr, MASKED: gl.constexpr, P_SH: gl.constexpr,
              SYNC: gl.constexpr, TREE: gl.constexpr):
        # key tile j: its scores and the last tile's P V on the tensor cores, back to back;
        # this tile's softmax while P V runs (FlashAttention-3's order within a warpgroup).
        # r: the last softmax's rescale of O (its max's growth, the V scale's change), applied
        # before P V so that nothing but P's conversion waits for P V
        mbarrier.wait(k_bar.index(j % 2), (j // 2) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(j % 2).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        acc = acc * r[:, None]
        # the next tile's descales, a tile ahead (an L2 round trip off the softmax's path)
        nxt = (kblk0 + gl.minimum(j + 1, n_tiles - 1)) * stride_sb + hkv
        kd_n = gl.load(KD + nxt)
        vs_n = gl.load(VD + nxt)
        jp = j - 1
        mbarrier.wait(v_bar.index(jp % 2), (jp // 2) & 1)
        if SYNC:   # diagnostic: no overlap of the softmax with the tensor cores
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        acc = warpgroup_mma(p8, v_smem.index(jp % 2).permute((1, 0)), acc, is_async=True)
        if SYNC:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p, alpha, m_i, l_i = _softmax(s, c_q * kd, m_i, l_i, j * 128 + keys0, pos, MASKED,
                                      P_SH, TREE)
        # O is kept in units of the current V block's scale
        r = gl.convert_layout(alpha * (v_prev / vs), row_o)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        p8 = _p_operand(p, p_layout, p.shape[0], p.shape[1])
        # every warp is past tile j's q.k and tile j - 1's P V: K stage j % 2 and V stage
        # (j + 1) % 2 are free for tiles j + 2 and j + 1
        cta_barrier()
        if j + 2 < n_tiles:
            _load_k(k_desc, k_smem, k_bar, q_start, hkv * HEAD_DIM, j + 2, KV_BYTES)
        if j + 1 < n_tiles:
            _load_v(v_desc, v_smem, v_bar, hkv * HEAD_DIM, v_col, j + 1, KV_BYTES)
        return acc, p8, m_i, l_i, vs, r, kd_n, vs_n

    @gluon.jit
    def _tile_serial(q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, m_i, l_i,
                     v_prev, zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start,
                     v_col, keys0, pos, row_o: gl.constexpr, p_layout: gl.constexpr,
                     HEAD_DIM: gl.constexpr, KV_BYTES: gl.constexpr, MASKED: gl.constexpr,
                     P_SH: gl.constexpr, TREE: gl.constexpr):
        # key tile j in order: its scores (the last tile's P V completes first), its softmax,
        # then its P V, left running into the next tile. P is made and consumed in one
        # iteration: carried across the loop, Triton keeps an E4M3 tensor as single bytes and
        # repacks them for the wgmma (112 PRMT + 64 LOP3 + 32 SHF a tile and warp, against 16
        # PRMT here: the loop body 718 -> 515 SASS instructions at head_dim 128)
        s, acc, kd, vs = _scores(q_smem, k_smem, k_bar, zero_s, acc, j, KD, VD, kblk0,
                                 stride_sb, hkv)
        p, alpha, m_i, l_i = _softmax(s, c_q * kd, m_i, l_i, j * 128 + keys0, pos, MASKED,
                                      P_SH, TREE)
        acc = acc * gl.convert_layout(alpha * (v_prev / vs), row_o)[:, None]
        acc = _pv_refill(acc, p, p_layout, k_desc, k_smem, k_bar, v_desc, v_smem, v_bar, j,
                         n_tiles, q_start, hkv, v_col, HEAD_DIM, KV_BYTES, 128)
        return acc, m_i, l_i, vs

    @gluon.jit
    def _tile_pipe(q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, s, acc, m_i, l_i,
                   v_prev, zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start,
                   v_col, keys0, pos, row_o: gl.constexpr, p_layout: gl.constexpr,
                   HEAD_DIM: gl.constexpr, KV_BYTES: gl.constexpr, MASKED: gl.constexpr,
                   P_SH: gl.constexpr, NEXT: gl.constexpr, BN: gl.constexpr):
        # key tile j of BN (64) keys, its scores s issued a tile ahead: wait for them (the
        # last tile's P V, issued after them, may run on), issue the next tile's scores, the
        # softmax of these while both products run on the tensor cores, then wait for the
        # last P V (the next scores may run on), rescale O, issue this tile's P V. What
        # crosses the loop is the next tile's fp32 scores (in the wgmma's own layout: no
        # repacking, unlike P in FlashAttention-3's order); a 128-key tile would need 64 more
        # registers a thread than the 255 there are
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
        s_next = s
        if NEXT:
            jn = j + 1
            mbarrier.wait(k_bar.index(jn % 2), (jn // 2) & 1)
            s_next = warpgroup_mma(q_smem, k_smem.index(jn % 2).permute((1, 0)), zero_s,
                                   use_acc=False, is_async=True)
        blk = (kblk0 + (j * BN) // 128) * stride_sb + hkv   # (a descale per 128 keys)
        kd = gl.load(KD + blk)
        vs = gl.load(VD + blk)
        p, alpha, m_i, l_i = _softmax(s, c_q * kd, m_i, l_i, j * BN + keys0, pos, MASKED,
                                      P_SH, False)
        acc = acc * gl.convert_layout(alpha * (v_prev / vs), row_o)[:, None]
        acc = _pv_refill(acc, p, p_layout, k_desc, k_smem, k_bar, v_desc, v_smem, v_bar, j,
                         n_tiles, q_start, hkv, v_col, HEAD_DIM, KV_BYTES, BN)
        return acc, s_next, m_i, l_i, vs

    @gluon.jit
    def _tile_one(q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, m_i, l_i, v_prev,
                  zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start, v_col, keys0,
                  pos, row_o: gl.constexpr, p_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
                  KV_BYTES: gl.constexpr, MASKED: gl.constexpr, P_SH: gl.constexpr,
                  TREE: gl.constexpr, LAZY: gl.constexpr, TAU: gl.constexpr):
        # a tile in the serial order: `_tile_lazy` (P shifted by 2^(P_SH - TAU)) or
        # `_tile_serial`
        if LAZY:
            acc, m_i, l_i, v_prev = _tile_lazy(
                q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, m_i, l_i, v_prev,
                zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start, v_col, keys0,
                pos, row_o, p_layout, HEAD_DIM, KV_BYTES, MASKED, P_SH - TAU, TAU)
        else:
            acc, m_i, l_i, v_prev = _tile_serial(
                q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, m_i, l_i, v_prev,
                zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start, v_col, keys0,
                pos, row_o, p_layout, HEAD_DIM, KV_BYTES, MASKED, P_SH, TREE)
        return acc, m_i, l_i, v_prev

    @gluon.jit
    def _lg2(x):
        return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                         dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _tile_lazy(q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, m_i, l_i, v_ref,
                   zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start, v_col, keys0,
                   pos, row_o: gl.constexpr, p_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
                   KV_BYTES: gl.constexpr, MASKED: gl.constexpr, P_SH: gl.constexpr,
                   TAU: gl.constexpr):
        # _tile_serial with O rescaled only when it must be (FlashAttention-4's conditional
        # rescale): O and l stay in the units of a reference max m_i per row and a reference V
        # scale v_ref, moved (O and l rescaled, one test for the whole CTA) only where a row's
        # max grew by more than TAU (log2 units) or this tile's V scale exceeds v_ref. Between
        # moves P = 2^(s c - m_i + P_SH) * vs / v_ref, the V scale ratio folded into P's
        # exponent (at most 2^(P_SH + TAU) <= 448: E4M3's range); l gets P's sum without the
        # ratio. In steady state a tile skips the rescale's 64 FMUL a thread and 2 MUFU.EX2.
        s, acc, kd, vs = _scores(q_smem, k_smem, k_bar, zero_s, acc, j, KD, VD, kblk0,
                                 stride_sb, hkv)
        c = c_q * kd
        if MASKED:
            s = gl.where((j * 128 + keys0)[None, :] <= pos[:, None], s * c[:, None],
                         float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * c)
        grow = gl.max(m_new - m_i, 0)   # (the first tile: m_i is -inf, grow +inf)
        if (grow > TAU) | (vs > v_ref):
            v_new = gl.maximum(v_ref, vs)
            alpha = gl.exp2(m_i - m_new)
            acc = acc * gl.convert_layout(alpha * (v_ref / v_new), row_o)[:, None]
            l_i = l_i * alpha
            m_i = m_new
            v_ref = v_new
        # <= 1; floored where V's scale is 2^24 below v_ref (its values then weigh at most
        # 2^-24 of O's units too much; l stays consistent with P)
        ratio = gl.maximum(gl.fdiv(vs, v_ref, ieee_rounding=False), 5.9604645e-08)
        e = _lg2(ratio)                  # MUFU.LG2 (libdevice's log2: 25 instructions)
        sub = m_i - (P_SH + e)
        if MASKED:
            p = gl.exp2(s - sub[:, None])
        else:
            p = gl.exp2(s * c[:, None] - sub[:, None])
        l_i = l_i + gl.sum(p, 1) * gl.exp2(-e)
        acc = _pv_refill(acc, p, p_layout, k_desc, k_smem, k_bar, v_desc, v_smem, v_bar, j,
                         n_tiles, q_start, hkv, v_col, HEAD_DIM, KV_BYTES, 128)
        return acc, m_i, l_i, v_ref

    @gluon.jit
    def prefill_fp8_sm90_kernel(q_desc, k_desc, v_desc, Out, cu_seqlens, cu_blocks, QD, KD, VD,
                                sm_scale_log2, stride_ot, stride_oh, stride_sb, ratio,
                                HEAD_DIM: gl.constexpr, SYNC: gl.constexpr,
                                num_warps: gl.constexpr, OVERLAP: gl.constexpr,
                                TREE: gl.constexpr, Q_BF16: gl.constexpr,
                                q8_layout: gl.constexpr, LAZY: gl.constexpr = False,
                                TAU: gl.constexpr = 3.0, PIPE: gl.constexpr = False,
                                BLOCK: gl.constexpr = 128):
        BM: gl.constexpr = 16 * num_warps   # 64 rows a warpgroup
        BN: gl.constexpr = BLOCK            # keys a tile: 128 (64 for PIPE)
        P_SH: gl.constexpr = 8.0
        h = gl.program_id(0)
        tile = gl.num_programs(1) - 1 - gl.program_id(1)   # the longest tiles first
        b = gl.program_id(2)
        hkv = h // ratio
        q_start = gl.load(cu_seqlens + b)
        q_len = gl.load(cu_seqlens + b + 1) - q_start
        t0 = tile * BM
        if t0 < q_len:
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 32])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 32])
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                         k_width=4)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BM, HEAD_DIM], q8_layout)
            k_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BN, HEAD_DIM], k_desc.layout)
            v_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, HEAD_DIM, BN], v_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            v_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            for i in gl.static_range(2):
                mbarrier.init(k_bar.index(i), count=1)
                mbarrier.init(v_bar.index(i), count=1)
            fence_async_shared()

            KV_BYTES: gl.constexpr = BN * HEAD_DIM
            kblk0 = gl.load(cu_blocks + b)
            v_col = kblk0 * 128                      # (vt8's columns: 128 per block)
            hi = gl.minimum(q_len, t0 + BM)          # keys the tile's last row may see
            n_tiles = gl.cdiv(hi, BN)                # the last one is the diagonal tile
            if Q_BF16:   # Q's rows in bf16, quantized below
                q_raw = gl.allocate_shared_memory(gl.bfloat16, [BM, HEAD_DIM], q_desc.layout)
                mbarrier.expect(q_bar, BM * HEAD_DIM * 2)
                tma_load(q_desc, [q_start + t0, h * HEAD_DIM], q_bar, q_raw)
            else:
                mbarrier.expect(q_bar, BM * HEAD_DIM)
                tma_load(q_desc, [q_start + t0, h * HEAD_DIM], q_bar, q_smem)
            _load_k(k_desc, k_smem, k_bar, q_start, hkv * HEAD_DIM, 0, KV_BYTES, BN)
            _load_v(v_desc, v_smem, v_bar, hkv * HEAD_DIM, v_col, 0, KV_BYTES, BN)
            if n_tiles > 1:
                _load_k(k_desc, k_smem, k_bar, q_start, hkv * HEAD_DIM, 1, KV_BYTES, BN)
                _load_v(v_desc, v_smem, v_bar, hkv * HEAD_DIM, v_col, 1, KV_BYTES, BN)

            mbarrier.wait(q_bar, 0)
            if Q_BF16:
                # a scale per query row, amax / 448, codes RN(x / scale) clamped to +-448 (an
                # all-zero row: scale 1); rows past the sequence are quantized and not stored
                TPC: gl.constexpr = HEAD_DIM // 8   # 16-byte pieces a row
                q_reg: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC],
                                                       [num_warps, 1], [1, 0])
                x = q_raw.load(q_reg).to(gl.float32)
                amax = gl.max(gl.abs(x), 1)
                qs = gl.where(amax > 0.0, gl.div_rn(amax, gl.full_like(amax, 448.0)), 1.0)
                q_smem.store(gl.div_rn(x, gl.expand_dims(qs, 1) + gl.zeros_like(x))
                             .to(gl.float8e4nv))
                fence_async_shared()
                cta_barrier()   # every warp's codes are in q_smem before the first wgmma
                c_q = sm_scale_log2 * gl.convert_layout(qs, row_s)
            else:
                c_q = gl.full([BM], sm_scale_log2, gl.float32, row_s) * gl.load(
                    QD + (kblk0 + t0 // 128) * stride_sb + hkv)
            m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
            l_i = gl.zeros([BM], gl.float32, row_s)
            zero_s = gl.zeros([BM, BN], gl.float32, s_layout)
            keys0 = gl.arange(0, BN, col_s)
            pos = t0 + gl.arange(0, BM, row_s)

            if PIPE:   # 64-key tiles, each tile's scores issued a tile ahead (_tile_pipe)
                acc = gl.zeros([BM, HEAD_DIM], gl.float32, o_layout)
                v_prev = gl.load(VD + kblk0 * stride_sb + hkv)
                if n_tiles == 1:
                    a1, m_i, l_i, v_prev = _tile_serial(
                        q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, m_i, l_i,
                        v_prev, zero_s, 0, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start,
                        v_col, keys0, pos, row_o, p_layout, HEAD_DIM, KV_BYTES, True, P_SH,
                        TREE)
                    o_one = warpgroup_mma_wait(num_outstanding=0, deps=(a1,))
                else:
                    mbarrier.wait(k_bar.index(0), 0)
                    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s,
                                      use_acc=False, is_async=True)
                    ac, s, m_i, l_i, v_prev = _tile_pipe(
                        q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, s, acc, m_i, l_i,
                        v_prev, zero_s, 0, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv,
                        q_start, v_col, keys0, pos, row_o, p_layout, HEAD_DIM, KV_BYTES, True,
                        P_SH, True, BN)
                    # the middle tiles two at a time: the scores in flight alternate between
                    # two variables, each dead before the other is issued into, so that the
                    # loop carries them without register moves (a move of an in-flight
                    # accumulator makes ptxas serialize every wgmma: C7514)
                    for jj in range(0, (n_tiles - 2) // 2):
                        j = 1 + 2 * jj
                        ac, s2, m_i, l_i, v_prev = _tile_pipe(
                            q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, s, ac, m_i,
                            l_i, v_prev, zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb,
                            hkv, q_start, v_col, keys0, pos, row_o, p_layout, HEAD_DIM,
                            KV_BYTES, False, P_SH, True, BN)
                        ac, s, m_i, l_i, v_prev = _tile_pipe(
                            q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, s2, ac, m_i,
                            l_i, v_prev, zero_s, j + 1, n_tiles, c_q, KD, VD, kblk0, stride_sb,
                            hkv, q_start, v_col, keys0, pos, row_o, p_layout, HEAD_DIM,
                            KV_BYTES, False, P_SH, True, BN)
                    jl = n_tiles - 1
                    if (n_tiles - 2) % 2 == 1:   # an odd middle tile left, then the last
                        a2, s2, m_i, l_i, v_prev = _tile_pipe(
                            q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, s, ac, m_i,
                            l_i, v_prev, zero_s, jl - 1, n_tiles, c_q, KD, VD, kblk0, stride_sb,
                            hkv, q_start, v_col, keys0, pos, row_o, p_layout, HEAD_DIM,
                            KV_BYTES, False, P_SH, True, BN)
                        a2, s2, m_i, l_i, v_prev = _tile_pipe(
                            q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, s2, a2, m_i,
                            l_i, v_prev, zero_s, jl, n_tiles, c_q, KD, VD, kblk0, stride_sb,
                            hkv, q_start, v_col, keys0, pos, row_o, p_layout, HEAD_DIM,
                            KV_BYTES, True, P_SH, False, BN)
                        o_fin = warpgroup_mma_wait(num_outstanding=0, deps=(a2,))
                    else:
                        a2, s2, m_i, l_i, v_prev = _tile_pipe(
                            q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, s, ac, m_i,
                            l_i, v_prev, zero_s, jl, n_tiles, c_q, KD, VD, kblk0, stride_sb,
                            hkv, q_start, v_col, keys0, pos, row_o, p_layout, HEAD_DIM,
                            KV_BYTES, True, P_SH, False, BN)
                        o_fin = warpgroup_mma_wait(num_outstanding=0, deps=(a2,))
                    o_one = o_fin
                acc = o_one
            elif not OVERLAP:   # P made and used in one iteration (LAZY: O rescaled lazily)
                acc = gl.zeros([BM, HEAD_DIM], gl.float32, o_layout)
                v_prev = gl.load(VD + kblk0 * stride_sb + hkv)
                acc, m_i, l_i, v_prev = _tile_one(
                    q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, m_i, l_i, v_prev,
                    zero_s, 0, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start, v_col, keys0,
                    pos, row_o, p_layout, HEAD_DIM, KV_BYTES, True, P_SH, TREE, LAZY,
                    TAU)
                for j in range(1, n_tiles - 1):
                    acc, m_i, l_i, v_prev = _tile_one(
                        q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, m_i, l_i,
                        v_prev, zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv, q_start,
                        v_col, keys0, pos, row_o, p_layout, HEAD_DIM, KV_BYTES, False, P_SH,
                        TREE, LAZY, TAU)
                if n_tiles > 1:
                    acc, m_i, l_i, v_prev = _tile_one(
                        q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, m_i, l_i,
                        v_prev, zero_s, n_tiles - 1, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv,
                        q_start, v_col, keys0, pos, row_o, p_layout, HEAD_DIM, KV_BYTES, True,
                        P_SH, TREE, LAZY, TAU)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            else:   # FlashAttention-3's order: P V of tile j - 1 during tile j's softmax
                # tile 0: its scores, then its softmax (masked: it may be the diagonal tile)
                mbarrier.wait(k_bar.index(0), 0)
                s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                cta_barrier()   # every warp is past tile 0's q.k: K stage 0 is free
                if n_tiles > 2:
                    _load_k(k_desc, k_smem, k_bar, q_start, hkv * HEAD_DIM, 2, KV_BYTES)
                v_prev = gl.load(VD + kblk0 * stride_sb + hkv)
                p, alpha, m_i, l_i = _softmax(s, c_q * gl.load(KD + kblk0 * stride_sb + hkv), m_i,
                                              l_i, keys0, pos, True, P_SH, TREE)
                p8 = _p_operand(p, p_layout, p.shape[0], p.shape[1])
                acc = gl.zeros([BM, HEAD_DIM], gl.float32, o_layout)
                r = gl.convert_layout(alpha, row_o)   # 0: O is empty
                nxt = (kblk0 + gl.minimum(1, n_tiles - 1)) * stride_sb + hkv
                kd = gl.load(KD + nxt)
                vs = gl.load(VD + nxt)

                for j in range(1, n_tiles - 1):
                    acc, p8, m_i, l_i, v_prev, r, kd, vs = _tile(
                        q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, p8, m_i, l_i,
                        v_prev, r, kd, vs, zero_s, j, n_tiles, c_q, KD, VD, kblk0, stride_sb, hkv,
                        q_start, v_col, keys0, pos, row_o, p_layout, HEAD_DIM, KV_BYTES, False,
                        P_SH, SYNC, TREE)
                if n_tiles > 1:   # the diagonal tile, masked
                    acc, p8, m_i, l_i, v_prev, r, kd, vs = _tile(
                        q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, acc, p8, m_i, l_i,
                        v_prev, r, kd, vs, zero_s, n_tiles - 1, n_tiles, c_q, KD, VD, kblk0,
                        stride_sb, hkv, q_start, v_col, keys0, pos, row_o, p_layout, HEAD_DIM,
                        KV_BYTES, True, P_SH, SYNC, TREE)
                jl = n_tiles - 1
                acc = acc * r[:, None]
                mbarrier.wait(v_bar.index(jl % 2), (jl // 2) & 1)
                acc = warpgroup_mma(p8, v_smem.index(jl % 2).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

            mbarrier.invalidate(q_bar)
            for i in gl.static_range(2):
                mbarrier.invalidate(k_bar.index(i))
                mbarrier.invalidate(v_bar.index(i))
            o = acc * gl.convert_layout(v_prev / l_i, row_o)[:, None]
            rows = gl.arange(0, BM, row_o)
            cols = gl.arange(0, HEAD_DIM, col_o)
            ptrs = (Out + (q_start + t0 + rows).to(gl.int64)[:, None] * stride_ot
                    + h * stride_oh + cols[None, :])
            gl.store(ptrs, o.to(Out.dtype.element_ty), mask=(t0 + rows < q_len)[:, None])


def unsupported(q8, k8, vt8, out, causal, window, sinks, softcap, cu_seqlens_k) -> str | None:
    """Why the Gluon FP8 kernel cannot take this prefill (None: it can)."""
    if not causal or window or sinks or softcap or cu_seqlens_k is not None:
        return "causal self-attention only (no window, sinks, softcap or cu_seqlens_k)"
    T, Hq, D = q8.shape
    Hkv = k8.shape[1]
    dv = vt8.shape[0] // max(Hkv, 1)
    if D not in HEAD_DIMS or dv != D:
        return f"head_dim {D} / {dv}: takes {HEAD_DIMS} with equal q.k and v dims"
    if out.dtype not in (torch.bfloat16, torch.float16) or out.stride(2) != 1:
        return f"output {out.dtype}: takes bf16 / fp16 with contiguous rows"
    f8 = torch.float8_e4m3fn
    if q8.dtype not in (f8, torch.bfloat16) or k8.dtype != f8 or vt8.dtype != f8:
        return (f"q {q8.dtype}, k {k8.dtype}, vt {vt8.dtype}: takes E4M3 k and vt, q E4M3 or "
                "bf16 (quantized in the kernel)")
    if not (q8.is_contiguous() and k8.is_contiguous() and vt8.is_contiguous()):
        return "non-contiguous FP8 inputs"
    if any(t.data_ptr() % 16 for t in (q8, k8, vt8)):
        return "FP8 inputs not 16-byte aligned (TMA)"
    return _device_reason(q8)


def _device_reason(t) -> str | None:
    """Why the kernel cannot run where t lives (None: a Hopper GPU, and Gluon importable)."""
    if GLUON_ERROR is not None:
        return GLUON_ERROR
    if not t.is_cuda or torch.cuda.get_device_capability(t.device)[0] != 9:
        return "not a Hopper (sm_90) GPU"
    return None


def takes_bf16_q(q, k, v, out_dtype, causal, window, sinks, softcap,
                 cu_seqlens_k) -> str | None:
    """Why this kernel could not take the prefill with q left in bf16 for it to quantize (None:
    it could), asked before K and V are quantized (prefill_attention(fp8=True))."""
    if q.dtype != torch.bfloat16:
        return f"q {q.dtype}: the kernel quantizes bf16 queries"
    if not causal or window or sinks or softcap or cu_seqlens_k is not None:
        return "causal self-attention only (no window, sinks, softcap or cu_seqlens_k)"
    D, Dv = q.shape[-1], v.shape[-1]
    if q.dim() != 3 or D not in HEAD_DIMS or Dv != D or k.shape[-1] != D:
        return f"head_dim {D} / {Dv}: takes {HEAD_DIMS} with equal q.k and v dims"
    if out_dtype not in (torch.bfloat16, torch.float16):
        return f"output {out_dtype}: takes bf16 / fp16"
    if not q.is_contiguous() or q.data_ptr() % 16:
        return "q not contiguous and 16-byte aligned (TMA)"
    return _device_reason(q)


def launch_prefill_fp8_sm90(q, k8, vt8, scales, cu_seqlens, out, scale: float,
                            max_seqlen: int, warps: int = NUM_WARPS, overlap: bool = False,
                            sync: bool = False, tree: bool = False, lazy: bool = False,
                            pipe: bool = False):
    """Run the kernel (unsupported(...) is None): out [T, Hq, D] written, returned. q: E4M3
    with its block scales in `scales`, or bf16 (scales' q descale None or ignored): the kernel
    quantizes each query row itself (a scale per row; `quantize_fp8_prefill(..., with_q=False)`
    then quantizes K and V alone). warps: 8 (128 query rows a CTA, two warpgroups) or 4 (64
    rows, one warpgroup, two CTAs a SM); overlap: FlashAttention-3's order within a warpgroup
    (tile j - 1's P V runs during tile j's softmax; P crosses the loop as single bytes) instead
    of the serial order; sync (with overlap): a diagnostic build that waits for each wgmma at
    once; tree: the rows' max and sum in four chains a row instead of Triton's one (fewer
    dependent steps, yet 2-8% slower on the H200 in three of four shapes: not the default);
    lazy (serial order only): O rescaled only when a row's max grows by more than 2^3 or a V
    block's scale exceeds the largest so far (`_tile_lazy`: 453 SASS instructions a tile
    and warp in steady state against 497, yet 0.98-0.99x the default's speed on the H100,
    0.91-0.94x with Q quantized in the kernel: the loop is bound by its serial chain, not by
    its instruction count; not the default);
    pipe (4 warps): 64-key tiles, each tile's q.k issued a tile ahead so that a tile's
    softmax runs while the next tile's scores and the last tile's P V are on the tensor cores
    (`_tile_pipe`; 0.72-0.85x the default's speed on the H100 with 128-key tiles, 37th
    session: halving the tile halves each wgmma's N and doubles the per-tile softmax and
    barrier work, more than the overlap wins back; not the default)."""
    if lazy and overlap or pipe and (lazy or overlap or warps != 4):
        raise ValueError("launch_prefill_fp8_sm90: lazy rescaling and the pipelined tiles are "
                         "built for the serial order, the latter with 4 warps")
    import triton

    TD = TensorDescriptor
    T, Hq, D = q.shape
    Hkv = k8.shape[1]
    B = cu_seqlens.numel() - 1
    if T == 0 or B == 0 or max_seqlen == 0:
        return out
    q_bf16 = q.dtype == torch.bfloat16
    q2 = q.reshape(T, Hq * D)
    k2 = k8.reshape(T, Hkv * D)
    bm = 16 * warps   # query rows a CTA
    lay_q8 = gl.NVMMASharedLayout.get_default_for([bm, D], gl.float8e4nv)
    lay_q = gl.NVMMASharedLayout.get_default_for([bm, D], gl.bfloat16) if q_bf16 else lay_q8
    bn = 64 if pipe else BLOCK_N   # keys a tile
    lay_k = gl.NVMMASharedLayout.get_default_for([bn, D], gl.float8e4nv)
    lay_v = gl.NVMMASharedLayout.get_default_for([D, bn], gl.float8e4nv)
    qd = TD(q2, list(q2.shape), list(q2.stride()), [bm, D], lay_q)
    kd = TD(k2, list(k2.shape), list(k2.stride()), [bn, D], lay_k)
    vd = TD(vt8, list(vt8.shape), list(vt8.stride()), [D, bn], lay_v)
    q_ds, k_ds, v_ds, cu_blocks = scales
    if q_bf16:
        q_ds = k_ds   # not read
    grid = (Hq, triton.cdiv(max_seqlen, bm), B)
    prefill_fp8_sm90_kernel[grid](qd, kd, vd, out, cu_seqlens, cu_blocks, q_ds, k_ds, v_ds,
                                  float(scale) * 1.4426950408889634, out.stride(0),
                                  out.stride(1), k_ds.stride(0), Hq // Hkv, HEAD_DIM=D,
                                  SYNC=sync, OVERLAP=overlap, TREE=tree, Q_BF16=q_bf16,
                                  q8_layout=lay_q8, LAZY=lazy, PIPE=pipe, BLOCK=bn,
                                  num_warps=warps)
    return out
