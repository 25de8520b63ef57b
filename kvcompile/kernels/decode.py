"""Paged decode attention: split-K flash-decoding over bf16 / fp16 / FP8 / FP4 pages.

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    # q: [B, Hq, Sq, D] (Sq 1..8); k_cache / v_cache: PagedTensor; -> [B, Hq, Sq, Dv]

One program owns (sequence, kv head, split) and holds the G = Hq / Hkv query heads of the group
times Sq queries as the M rows of its tiles, so every page is read once for the whole group.
Quantized pages are widened in registers (decode_tiles.py), never dequantized in HBM; the fp32
block scales are folded into the scores (keys) and into the probabilities (values) as one factor
per token. FP4 pages split head_dim into even and odd halves (low and high nibbles) and run two
dots, so no nibble interleave is built. Splits write (acc, lse) partials that a Triton combine
kernel merges; with one split the kernel writes the output directly.

Query i of Sq sits at position seq_len - Sq + i and sees keys j <= its position (causal among
the new tokens), with a window: q_pos - j < window, or j < sinks; key_mask[b, j] False hides
key j. A row that sees no key outputs 0. Keys nobody sees are never read (NaN there is inert).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels.decode_tiles import (
    FMT_E2M1,
    FMT_PLAIN,
    FORMAT_CODES,
    FP4_ASM_FOLD,
    SCALE_CODES,
    SCALE_NONE,
    load_codes,
    load_token_scales,
    widen,
)

HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (8, 16, 32, 64, 128)
MAX_SQ = 8
LOG2E = 1.4426950408889634


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
               BIG: tl.constexpr, SPLIT: tl.constexpr, WORDS: tl.constexpr):
    # raw codes and per-token scales of one tile (loads only, nothing waits on them here).
    # (kx, km): fp4 (bytes, micro); SPLIT: the two column halves; else (codes, codes)
    off = pos % P
    tok = (page * H + kvh) * P + off
    if SPLIT and KFMT != 3:
        kx, _ = load_codes(KD, KM, tok, seen, D, KFMT, ASM, BIG, 0, D // 2, WORDS)
        km, _ = load_codes(KD, KM, tok, seen, D, KFMT, ASM, BIG, D // 2, D // 2, WORDS)
    else:
        kx, km = load_codes(KD, KM, tok, seen, D, KFMT, ASM, BIG, 0, 0, WORDS)
    if SPLIT and VFMT != 3:
        vx, _ = load_codes(VD, VM, tok, seen, DV, VFMT, ASM, BIG, 0, DV // 2, WORDS)
        vm, _ = load_codes(VD, VM, tok, seen, DV, VFMT, ASM, BIG, DV // 2, DV // 2, WORDS)
    else:
        vx, vm = load_codes(VD, VM, tok, seen, DV, VFMT, ASM, BIG, 0, 0, WORDS)
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
                 SPLIT: tl.constexpr, WORDS: tl.constexpr):
    # ---- scores s [M, T] in log2 units; two half-width dots for fp4 (even / odd columns) or
    # SPLIT (first / second half): half the operand registers live at a time
    if SPLIT and KFMT != 3:
        k_a, _ = widen(kx, kx, D // 2, KFMT, CDT, ASM, WORDS)
        k_b, _ = widen(km, km, D // 2, KFMT, CDT, ASM, WORDS)
    else:
        k_a, k_b = widen(kx, km, D, KFMT, CDT, ASM, WORDS)
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
        v_a, _ = widen(vx, vx, DV // 2, VFMT, CDT, ASM, WORDS)
        v_b, _ = widen(vm, vm, DV // 2, VFMT, CDT, ASM, WORDS)
    else:
        v_a, v_b = widen(vx, vm, DV, VFMT, CDT, ASM, WORDS)
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
def _decode_split_kernel(
        Q, KD, KS, KM, VD, VS, VM, BT, SL, KMASK, ACC, LSE, OUT, SCORES,
        stride_bt, n_kmask, scores_len, H, qk_scale, cap_in, cap_out, k_mult, v_mult,
        window, sinks, NUM_SPLITS,
        G: tl.constexpr, SQ: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        P: tl.constexpr, BLOCK_T: tl.constexpr,
        KFMT: tl.constexpr, VFMT: tl.constexpr, KSM: tl.constexpr, VSM: tl.constexpr,
        CDT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr,
        WRITE_SCORES: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
        WINDOW: tl.constexpr, ASM: tl.constexpr, BIG: tl.constexpr, PREFETCH: tl.constexpr,
        SPLIT: tl.constexpr, WORDS: tl.constexpr):
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

    if PREFETCH:
        # software pipeline in registers: while tile t is computed, the codes of tile t + 1
        # and the page ids of tile t + 2 are in flight (the block-table -> page address chain
        # is why Triton's own pipeliner waits for every copy at the top of each iteration)
        pos, seen, page = _tile_meta(t0, t1, b, L, lo, lo_t, n_sink, sinks, BT, stride_bt,
                                     KMASK, n_kmask, P, BLOCK_T, WINDOW, HAS_KMASK)
        pos_n, seen_n, page_n = _tile_meta(t0 + 1, t1, b, L, lo, lo_t, n_sink, sinks, BT,
                                           stride_bt, KMASK, n_kmask, P, BLOCK_T, WINDOW,
                                           HAS_KMASK)
        kx, km, vx, vm, ks, vs = _tile_data(KD, KS, KM, VD, VS, VM, pos, seen, page, kvh, H,
                                            k_mult, v_mult, D, DV, P, KFMT, VFMT, KSM, VSM,
                                            ASM, BIG, SPLIT, WORDS)
        for t in range(t0, t1):
            kx_n, km_n, vx_n, vm_n, ks_n, vs_n = _tile_data(
                KD, KS, KM, VD, VS, VM, pos_n, seen_n, page_n, kvh, H, k_mult, v_mult, D, DV,
                P, KFMT, VFMT, KSM, VSM, ASM, BIG, SPLIT, WORDS)
            pos_nn, seen_nn, page_nn = _tile_meta(t + 2, t1, b, L, lo, lo_t, n_sink, sinks,
                                                  BT, stride_bt, KMASK, n_kmask, P, BLOCK_T,
                                                  WINDOW, HAS_KMASK)
            m_i, l_i, w_run, acc_a, acc_b = _attend_tile(
                q_a, q_b, kx, km, vx, vm, ks, vs, pos, seen, q_pos, row_ok, q_row, m_i, l_i,
                w_run, acc_a, acc_b, SCORES, scores_len, qk_scale, cap_in, cap_out, window,
                sinks, D, DV, SQ, KFMT, VFMT, KSM, VSM, CDT, SOFTCAP, WRITE_SCORES, PREC,
                WINDOW, ASM, SPLIT, WORDS)
            kx, km, vx, vm, ks, vs = kx_n, km_n, vx_n, vm_n, ks_n, vs_n
            pos, seen = pos_n, seen_n
            pos_n, seen_n, page_n = pos_nn, seen_nn, page_nn
    else:
        for t in range(t0, t1):
            pos, seen, page = _tile_meta(t, t1, b, L, lo, lo_t, n_sink, sinks, BT, stride_bt,
                                         KMASK, n_kmask, P, BLOCK_T, WINDOW, HAS_KMASK)
            kx, km, vx, vm, ks, vs = _tile_data(KD, KS, KM, VD, VS, VM, pos, seen, page, kvh,
                                                H, k_mult, v_mult, D, DV, P, KFMT, VFMT, KSM,
                                                VSM, ASM, BIG, SPLIT, WORDS)
            m_i, l_i, w_run, acc_a, acc_b = _attend_tile(
                q_a, q_b, kx, km, vx, vm, ks, vs, pos, seen, q_pos, row_ok, q_row, m_i, l_i,
                w_run, acc_a, acc_b, SCORES, scores_len, qk_scale, cap_in, cap_out, window,
                sinks, D, DV, SQ, KFMT, VFMT, KSM, VSM, CDT, SOFTCAP, WRITE_SCORES, PREC,
                WINDOW, ASM, SPLIT, WORDS)

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
def _combine_kernel(ACC, PLSE, OUT, LSE, NUM_SPLITS, DV: tl.constexpr, S_PAD: tl.constexpr,
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
def _attn_mass_kernel(SCORES, LSE, MASS, SL, scores_len, H, G: tl.constexpr, SQ: tl.constexpr,
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


# --- launcher ------------------------------------------------------------------------------

def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _codes(fmt_name: str, granularity: str) -> tuple[int, int]:
    if fmt_name not in FORMAT_CODES:
        raise UnsupportedShapeError(
            f"KV format {fmt_name!r} has no Triton decode kernel; supported: "
            f"{', '.join(FORMAT_CODES)}. Use KVConfig(kernels='reference') for it.")
    code = FORMAT_CODES[fmt_name]
    if code == FMT_PLAIN:
        return code, SCALE_NONE
    if granularity not in SCALE_CODES:
        raise UnsupportedShapeError(
            f"scale granularity {granularity!r} has no Triton decode kernel; supported: "
            f"{', '.join(SCALE_CODES)}. Use KVConfig(kernels='reference') for it.")
    return code, SCALE_CODES[granularity]


def default_config(kfmt: int, d: int, dv: int, m: int) -> dict:
    """Tile shape per format, from the H200 sweeps in benchmarks/RESULTS.md. Quantized pages:
    no Triton software pipelining (num_stages=1: with the block-table -> page address chain its
    pipeliner waits on every copy, so it only costs shared memory), column-split dots (fewer
    live operand registers, so 3-4 programs per SM)."""
    quantized = kfmt != FMT_PLAIN
    block_t = 128
    if max(d, dv) >= 256 or m >= 64:
        block_t = 64
    if quantized:
        return {"BLOCK_T": block_t, "num_warps": 4, "num_stages": 1, "ASM": 3, "waves": 8,
                "PREFETCH": 0, "SPLIT": 1, "WORDS": 0, "maxnreg": None}
    return {"BLOCK_T": block_t, "num_warps": 4, "num_stages": 2, "ASM": 0, "waves": 8,
            "PREFETCH": 0, "SPLIT": 0, "WORDS": 0, "maxnreg": None}


def choose_splits(batch: int, kv_heads: int, max_len: int, block_t: int, sm_count: int,
                  waves: float = 8) -> int:
    """Splits per (sequence, kv head): enough programs for `waves` x SMs, at least 4 tiles each.
    From shapes only (max_len = block-table capacity), so no device sync is needed."""
    tiles = max(1, -(-max_len // block_t))
    want = -(-int(waves * sm_count) // max(1, batch * kv_heads))
    return int(max(1, min(want, tiles // 4, 1024)))


def _check(q, kd, vd, kfmt, vfmt, block_tables, seq_lens, key_mask, attn_mass, out):
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise UnsupportedShapeError("paged_decode: q must be [B, Hq, Sq, D]")
    B, Hq, Sq, D = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UnsupportedShapeError(f"paged_decode: q dtype {q.dtype}; use bf16, fp16 or fp32")
    if not 1 <= Sq <= MAX_SQ:
        raise UnsupportedShapeError(f"paged_decode: Sq={Sq} new tokens; the decode kernel takes "
                                    f"1..{MAX_SQ} (use the prefill kernel for more)")
    N, Hkv, P = kd.shape[:3]
    dk = kd.shape[3] * (2 if kfmt == FMT_E2M1 else 1)
    dv = vd.shape[3] * (2 if vfmt == FMT_E2M1 else 1)
    if dk != D:
        raise UnsupportedShapeError(f"paged_decode: q head_dim {D} != key pages' {dk}")
    for name, d in (("head_dim", D), ("value head_dim", dv)):
        if d not in HEAD_DIMS:
            raise UnsupportedShapeError(f"paged_decode: {name} {d} not supported; the kernel "
                                        f"takes {HEAD_DIMS} (use KVConfig(kernels='reference'))")
    if tuple(vd.shape[:3]) != (N, Hkv, P):
        raise UnsupportedShapeError("paged_decode: key and value pages differ in pages / heads / "
                                    "page size")
    if P not in PAGE_SIZES:
        raise UnsupportedShapeError(f"paged_decode: page size {P}; supported {PAGE_SIZES}")
    if Hq % Hkv:
        raise UnsupportedShapeError(f"paged_decode: {Hq} query heads not a multiple of {Hkv}")
    if not (kd.is_contiguous() and vd.is_contiguous()):
        raise UnsupportedShapeError("paged_decode: page storage must be contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or \
            block_tables.shape[0] != B or block_tables.stride(1) != 1:
        raise UnsupportedShapeError(f"paged_decode: block_tables must be int32 [{B}, max_pages] "
                                    f"with unit stride; got {block_tables.dtype} "
                                    f"{tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (B,):
        raise UnsupportedShapeError(f"paged_decode: seq_lens must be int32 [{B}]")
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.dim() != 2
                                 or key_mask.shape[0] != B):
        raise UnsupportedShapeError(f"paged_decode: key_mask must be bool [{B}, L]")
    if attn_mass is not None and (attn_mass.dtype != torch.float32 or attn_mass.dim() != 3 or
                                  tuple(attn_mass.shape[:2]) != (B, Hkv) or
                                  not attn_mass.is_contiguous()):
        raise UnsupportedShapeError(f"paged_decode: attn_mass must be contiguous fp32 "
                                    f"[{B}, {Hkv}, max_len]")
    if out is not None and (tuple(out.shape) != (B, Hq, Sq, dv) or out.dtype != q.dtype
                            or not out.is_contiguous()):
        raise UnsupportedShapeError(f"paged_decode: out must be contiguous {q.dtype} "
                                    f"[{B}, {Hq}, {Sq}, {dv}]")
    dev = q.device
    if dev.type != "cuda" and not interpreting():
        raise UnsupportedShapeError("paged_decode: Triton kernels need CUDA tensors (or "
                                    "TRITON_INTERPRET=1); use KVConfig(kernels='reference')")
    return B, Hq, Sq, D, dv, N, Hkv, P


def launch_decode(q, kd, ks, km, vd, vs, vm, block_tables, seq_lens, key_mask, attn_mass, out,
                  k_fmt: str, k_gran: str, v_fmt: str, v_gran: str, scale: float,
                  sliding_window: int, sinks: int, softcap: float, num_splits: int,
                  config: dict | None = None) -> torch.Tensor:
    """Check, then launch split kernel (+ combine, + attention-mass pass). Writes `out`."""
    kfmt, ksm = _codes(k_fmt, k_gran)
    vfmt, vsm = _codes(v_fmt, v_gran)
    B, Hq, Sq, D, DV, N, Hkv, P = _check(q, kd, vd, kfmt, vfmt, block_tables, seq_lens,
                                         key_mask, attn_mass, out)
    G = Hq // Hkv
    M = max(16, triton.next_power_of_2(G * Sq))
    interp = interpreting()
    cfg = default_config(kfmt, D, DV, M)
    cfg.update(config or {})
    block_t = cfg["BLOCK_T"]
    if interp:  # the interpreter's bf16 dot is wrong and it cannot run PTX: fp32, plain ops
        cdt, asm = tl.float32, 0
    elif kfmt == FMT_PLAIN and vfmt == FMT_PLAIN and kd.dtype == vd.dtype:
        cdt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
               torch.float32: tl.float32}[kd.dtype]
        asm = 0
    else:
        cdt, asm = tl.float16, cfg["ASM"]
    if kfmt == FMT_PLAIN and vfmt != FMT_PLAIN or vfmt == FMT_PLAIN and kfmt != FMT_PLAIN:
        cdt = tl.float32 if interp else tl.float16
    q = q.contiguous()
    dev = q.device
    max_len = block_tables.shape[1] * P
    if num_splits <= 0:
        num_splits = choose_splits(B, Hkv, max_len, block_t, _sm_count(dev), cfg["waves"])
    window = int(sliding_window) if sliding_window and sliding_window > 0 else 0
    sinks = int(sinks) if window else 0
    if out is None:
        out = torch.empty(B, Hq, Sq, DV, dtype=q.dtype, device=dev)
    rows = B * Hq * Sq
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    direct = num_splits == 1
    if direct:
        acc = plse = lse
    else:
        acc = torch.empty(rows, num_splits, DV, dtype=torch.float32, device=dev)
        plse = torch.empty(rows, num_splits, dtype=torch.float32, device=dev)
    scores_len = attn_mass.shape[2] if attn_mass is not None else 0
    scores = (torch.full((rows, scores_len), float("-inf"), dtype=torch.float32, device=dev)
              if attn_mass is not None else lse)
    kmask = key_mask.view(torch.uint8) if key_mask is not None else seq_lens
    big = max(kd.numel(), vd.numel()) >= 2**31 - 2**20
    fold = FP4_ASM_FOLD if asm else 1.0
    qk_scale = float(scale) * LOG2E
    grid = (B * Hkv, num_splits)
    _decode_split_kernel[grid](
        q, kd, ks if ks is not None else lse, km if km is not None else kd,
        vd, vs if vs is not None else lse, vm if vm is not None else vd,
        block_tables, seq_lens, kmask, acc, plse, out, scores,
        block_tables.stride(0), key_mask.shape[1] if key_mask is not None else 0, scores_len,
        Hkv, qk_scale, float(scale) / softcap if softcap else 0.0, softcap * LOG2E,
        fold if kfmt == FMT_E2M1 else 1.0, fold if vfmt == FMT_E2M1 else 1.0, window, sinks,
        num_splits, G=G, SQ=Sq, M=M, D=D, DV=DV, P=P, BLOCK_T=block_t,
        KFMT=kfmt, VFMT=vfmt, KSM=ksm, VSM=vsm, CDT=cdt, SOFTCAP=bool(softcap),
        HAS_KMASK=key_mask is not None, WRITE_SCORES=attn_mass is not None, DIRECT=direct,
        IEEE=cdt == tl.float32, WINDOW=window > 0, ASM=asm, BIG=big,
        PREFETCH=bool(cfg["PREFETCH"]), SPLIT=bool(cfg["SPLIT"]), WORDS=bool(cfg["WORDS"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interp else {}))
    if not direct:
        _combine_kernel[(rows,)](acc, plse, out, lse, num_splits, DV=DV,
                                 S_PAD=triton.next_power_of_2(num_splits),
                                 CHUNK=min(16, triton.next_power_of_2(num_splits)), num_warps=4)
    if attn_mass is not None and scores_len > 0:
        blk = 256
        _attn_mass_kernel[(B * Hkv, triton.cdiv(scores_len, blk))](
            scores, lse, attn_mass, seq_lens, scores_len, Hkv, G=G, SQ=Sq, BLOCK=blk,
            num_warps=4)
    return out


# --- custom ops ----------------------------------------------------------------------------

@torch.library.custom_op("kvcompile::paged_decode", mutates_args=("attn_mass",))
def paged_decode(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor | None,
                 k_micro: torch.Tensor | None, v_data: torch.Tensor,
                 v_scale: torch.Tensor | None, v_micro: torch.Tensor | None,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 key_mask: torch.Tensor | None, attn_mass: torch.Tensor | None, k_fmt: str,
                 k_gran: str, v_fmt: str, v_gran: str, scale: float, sliding_window: int,
                 sinks: int, softcap: float, num_splits: int) -> torch.Tensor:
    return launch_decode(q, k_data, k_scale, k_micro, v_data, v_scale, v_micro, block_tables,
                         seq_lens, key_mask, attn_mass, None, k_fmt, k_gran, v_fmt, v_gran,
                         scale, sliding_window, sinks, softcap, num_splits)


@paged_decode.register_fake
def _(q, k_data, k_scale, k_micro, v_data, v_scale, v_micro, block_tables, seq_lens, key_mask,
      attn_mass, k_fmt, k_gran, v_fmt, v_gran, scale, sliding_window, sinks, softcap,
      num_splits):
    dv = v_data.shape[3] * (2 if v_fmt == "fp4_e2m1" else 1)
    return q.new_empty((*q.shape[:3], dv))


@torch.library.custom_op("kvcompile::paged_decode_out", mutates_args=("out", "attn_mass"))
def paged_decode_out(out: torch.Tensor, q: torch.Tensor, k_data: torch.Tensor,
                     k_scale: torch.Tensor | None, k_micro: torch.Tensor | None,
                     v_data: torch.Tensor, v_scale: torch.Tensor | None,
                     v_micro: torch.Tensor | None, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, key_mask: torch.Tensor | None,
                     attn_mass: torch.Tensor | None, k_fmt: str, k_gran: str, v_fmt: str,
                     v_gran: str, scale: float, sliding_window: int, sinks: int,
                     softcap: float, num_splits: int) -> None:
    launch_decode(q, k_data, k_scale, k_micro, v_data, v_scale, v_micro, block_tables,
                  seq_lens, key_mask, attn_mass, out, k_fmt, k_gran, v_fmt, v_gran, scale,
                  sliding_window, sinks, softcap, num_splits)


@paged_decode_out.register_fake
def _(out, *args):
    return None


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float, *,
                           key_mask=None, sliding_window: int = 0, sinks: int = 0,
                           softcap: float = 0.0, attn_mass=None, out=None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Decode attention over paged K/V in any storage format.

    q: [B, Hq, Sq, D], Sq in 1..8; k_cache, v_cache: PagedTensor (data [N, Hkv, P, D]);
    block_tables: [B, max_pages] int32; seq_lens: [B] int32 (cached tokens, new ones included).
    key_mask: bool [B, Lm], key j seen iff key_mask[b, j] (j >= Lm: seen).
    sliding_window / sinks: keep keys with q_pos - k_pos < window, plus the first `sinks`.
    attn_mass: fp32 [B, Hkv, Lmax], += each key's attention probability summed over the group's
    query heads (and queries). out: optional [B, Hq, Sq, Dv] buffer. -> [B, Hq, Sq, Dv], q.dtype.
    """
    args = (q, k_cache.data, k_cache.scale, k_cache.micro, v_cache.data, v_cache.scale,
            v_cache.micro, block_tables, seq_lens, key_mask, attn_mass,
            k_cache.fmt.name, k_cache.fmt.granularity, v_cache.fmt.name,
            v_cache.fmt.granularity, float(scale), int(sliding_window or 0), int(sinks or 0),
            float(softcap or 0.0), int(num_splits or 0))
    if out is None:
        return torch.ops.kvcompile.paged_decode(*args)
    torch.ops.kvcompile.paged_decode_out(out, *args)
    return out
