"""Quantize-and-append for the int formats (int4 / int3 / int2, cache/intq.py), on the device.

    launch_append_int(x, slots, data, scale, zero, bits, granularity, grouped)
    # x [T, H, D]; slots [T] int64 (page * P + offset); data [N, H, P, D * bits / 8] uint8;
    # scale, zero fp16: token [N, H, P] | page [N, H] | channel [N, H, D]. Mutated in place.

Same bytes as PagedTensor.write (paged.py `_write_codes` / `_write_grouped`, grouped.py
`update_int_params`), bit for bit:
- token scales: each (token, head) its own (scale, zero) from its finite min / max.
- page and channel scales: a page's earlier tokens are its slots [0, m), m = its smallest new
  offset. A group's (scale, zero) is kept when the page had earlier tokens, its old range
  [zero, zero + levels * scale] holds the new tokens' finite values and neither the old scale
  nor a new value is NaN; otherwise it is recomputed from every valid value, the earlier tokens
  as decoded (code * scale + zero). When any group of a (page, head) changed, that head's earlier
  tokens are decoded with the old parameters and encoded again with the new (every channel, as
  the reference does; unchanged channels give back their codes).

One program per (window of WIN sorted slots, head) walks the runs (one page each) that start
in its window: WIN = 1 for decode steps (one program per token), WIN = P for bulk writes
(PAGE_BULK "runs"). Bulk writes by default (PAGE_BULK "tiles", `_append_int_tiles_kernel`)
write the fresh full pages of a window of TILE_PAGES * P slots row by row, as [TILE_PAGES, D]
tiles of x (statistics, then codes), and walk only the other runs. A run
is visited in chunks of NR rows, twice: min / max first, then encode and store (no host sync,
nothing sized by the data: CUDA-graph capturable). Codes pack along head_dim as intq.pack does,
as [rows, units, codes per unit] tiles (int3: 8 codes in 3 bytes).
Arithmetic follows intq.py op for op: the scale's division by 2^bits - 1 is torch's (a multiply
by the fp32 reciprocal on CUDA, a division on the CPU, `_div_levels`); fp16 roundings are RNE
casts stepped by one ulp on the fp16 bit pattern; `code * scale + zero` may contract to an fma
without changing it (code * scale is exact in fp32). The codes' division by the scale is IEEE
division from a reciprocal per group and two fmas a value (`rn_quotient`), and a tile whose values
are all finite and within fp16's range skips the masks and clamps that cannot change its codes
(`_codes_fresh`); codes round to integers in the float's bits (`_rne_int`). Before these, Nsight
put the int kernels at 58 (token scales) and 92 (channel scales) instructions a value, the
first issue-bound, the second taking CUDA's division slow path on every zero numerator; with the
division and the cheap path (and the row-by-row tiles), 34 and 24 (RESULTS.md, twenty-eighth
session).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

_F16_MAX = tl.constexpr(65504.0)
_RNE_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2^23: (q + M) - M rounds |q| < 2^22 to even
_RNE_BITS = tl.constexpr(0x4B400000)    # the bits of 1.5 * 2^23 as fp32
# rows of a chunk: decode-step launches (WIN = 1, runs of one token) / bulk launches
DECODE_ROWS, BULK_ROWS = 16, 32
DECODE_WARPS = 4   # warps of a decode-step launch (WIN = 1)
# slots per program window of a bulk write (more tokens than this: WIN = P)
BULK_TOKENS = 4096
# page / channel scales, bulk writes: "tiles" (fresh full pages read row by row as
# [TILE_PAGES, D] tiles, a window of W = TILE_PAGES * P slots a program, gcd(P, TILE_UNROLL)
# rows a step; other runs as "runs" does) or "runs" (every run through _append_int_run, a window of P
# slots a program)
PAGE_BULK = "tiles"
TILE_PAGES = 8
TILE_UNROLL = 8
TILE_WARPS = 4
# two launches: the fresh full pages (PART 1), then the other runs (PART 2); the first builds
# with 64 registers against the one launch's 167 (sm_90, D 128, P 16). On an H100
# (bench_append.py, T 65,536, H 8, D 128, P 16, 2026-12-06) int4 channel wrote at 0.66x copy
# bandwidth (0.094 ms) against the one launch's 0.61x (0.101 ms): on
TILE_SPLIT = True
# tiles load x before the full-page test (_tile_rows SPEC): the same run gave 0.63x (0.098
# ms) against 0.61x, less than the split; with the split not yet timed, so off
# (bench_append.py: ", x read before the page test")
TILE_SPEC = False
# token scales: R = TOKEN_TILE_ELEMS / max(D, 128) tokens of one head a program. 4 warps: on
# an H100 (bench_append.py, T 65,536, H 8, D 128, bf16 input, 2026-12-06, after the division
# and the cheap path) 0.087 ms against 8 warps' 0.096 (0.65x / 0.60x copy bandwidth); before
# them 8 warps won (0.148 against 0.192 ms)
TOKEN_TILE_ELEMS = 4096
TOKEN_TILE_WARPS = 4


def unit_shape(bits: int) -> tuple[int, int]:
    """(codes per packing unit, bytes per unit): int4 (2, 1), int2 (4, 1), int3 (8, 3)."""
    return (8, 3) if bits == 3 else (8 // bits, 1)


@triton.jit
def _f16_step(v16, UP: tl.constexpr):
    # the fp16 next to v16 toward +inf (UP) or -inf, for finite v16 (|v16| < 65504 when UP)
    b = v16.to(tl.int16, bitcast=True).to(tl.int32)
    if UP:   # only non-negative values reach here (scales)
        b = tl.where(b == -32768, 1, tl.where(b < 0, b - 1, b + 1))
    else:    # +-0 -> the smallest negative subnormal (0x8001); x > 0: bits - 1; x < 0: + 1
        b = tl.where((b == 0) | (b == -32768), -32767, tl.where(b > 0, b - 1, b + 1))
    return b.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _div_levels(x, LEV: tl.constexpr, RECIP: tl.constexpr):
    # x / LEV as torch computes `tensor / int`: on CUDA a multiplication by the fp32 reciprocal,
    # on the CPU a division (append.py `_div_const`, the same rule)
    if RECIP:
        return x * (1.0 / LEV)
    else:
        return tl.math.div_rn(x, LEV + 0.0)


@triton.jit
def _params(lo, hi, has_nan, LEV: tl.constexpr, RECIP: tl.constexpr):
    # intq.int_params / params_from_range of groups whose finite values span [lo, hi] (fp32;
    # lo = +inf: no finite value) -> (scale, zero) as fp32 holding fp16 values
    empty = lo == float("inf")
    lo = tl.minimum(tl.maximum(tl.where(empty, 0.0, lo), -_F16_MAX), _F16_MAX)
    hi = tl.minimum(tl.maximum(tl.where(empty, 0.0, hi), -_F16_MAX), _F16_MAX)
    z16 = lo.to(tl.float16)
    z16 = tl.where(z16.to(tl.float32) > lo, _f16_step(z16, False), z16)
    zero = z16.to(tl.float32)
    raw = _div_levels(tl.maximum(hi - zero, 0.0), LEV, RECIP)
    s16 = tl.minimum(raw, _F16_MAX).to(tl.float16)
    s16 = tl.where(s16.to(tl.float32) < raw, _f16_step(s16, True), s16)
    scale = tl.where(has_nan, float("nan"), s16.to(tl.float32))
    return scale, zero


@triton.jit
def _divisor(s):
    # the divisor of a group's codes and its reciprocal 1 / s rounded to nearest, once per
    # group: (s, 1 / s) where s > 0, else (1, 0) (intq.int_codes: code 0 where s is not > 0)
    pos = s > 0
    sd = tl.where(pos, s, 1.0)
    return sd, tl.where(pos, tl.math.div_rn(tl.zeros_like(sd) + 1.0, sd), 0.0)


@triton.jit
def rn_quotient(x, y, d, SIGN: tl.constexpr = False):
    # RN(x / d), IEEE division bit for bit, from y = RN(1 / d) without a division a value
    # (Markstein's correction): q0 = RN(x * y) is within an ulp of x / d, the residual
    # x - d * q0 is exact in one fma, and RN(q0 + residual * y) is the correctly rounded
    # quotient, for finite x and d in [2^-80, 2^80] (the fp formats' divisors; the int formats'
    # fp16 scales); y = 0 gives 0. A multiply and two fmas instead of an IEEE division (a
    # reciprocal, four fmas and a branch to a slow path, which CUDA's div.rn takes on every zero
    # numerator: in the int kernels a group's least value when its zero point is that value,
    # one call per warp and page row in Nsight). For |x| < 2^-100 the residual may underflow,
    # but the quotient is then below 2^-20, a zero code in every format. SIGN: a zero quotient
    # takes x's sign (without it only the magnitude is exact). Checked against IEEE division for
    # every fp16 scale (tests/kernels/test_append_int.py) and around every fp rounding boundary
    # (tests/kernels/test_append_codes.py).
    q0 = x * y
    q = tl.fma(tl.fma(q0, -d, x), y, q0)
    if SIGN:
        qb = q.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)
        q = qb.to(tl.float32, bitcast=True)
    return q


@triton.jit
def _rne_int(q):
    # q rounded to the nearest integer, ties to even, as int32, for |q| < 2^22: the sum
    # q + 1.5 * 2^23 has an ulp of 1, so the addition rounds, and the integer is in its low
    # bits (no float-to-int conversion, a quarter-rate instruction, a value)
    return (q + _RNE_MAGIC).to(tl.int32, bitcast=True) - _RNE_BITS


@triton.jit
def _codes(x, sd, rs, z, LEV: tl.constexpr):
    # intq.int_codes: clamp(rne((clamp(x, +-65504) - z) / s), 0, LEV), 0 where s is not > 0
    # or x is NaN -> int32; (sd, rs) = _divisor(s)
    xc = tl.minimum(tl.maximum(x, -_F16_MAX), _F16_MAX)
    q = rn_quotient(xc - z, rs, sd)
    q = tl.minimum(tl.maximum(tl.where(x == x, q, 0.0), -1.0), LEV + 1.0)
    return tl.minimum(tl.maximum(_rne_int(q), 0), LEV)


@triton.jit
def _codes_fresh(x, sd, rs, z, LEV: tl.constexpr):
    # _codes where (s, z) come from these values' own range and every value is finite and
    # within +-65504 (_finite_range): z <= x, so 0 <= x - z and the quotient is at most
    # LEV (1 + 2^-21) (s is rounded up from (hi - z) / LEV): the clamps and the NaN test are
    # no-ops, the result the same bit for bit
    return tl.minimum(_rne_int(rn_quotient(x - z, rs, sd)), LEV)


@triton.jit
def min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _finite_range(lo, hi):
    # whether groups whose values' NaN-propagating min / max are lo / hi hold only finite
    # values within +-65504 (then their masked statistics are lo / hi, no NaN, and
    # _codes_fresh applies): a tile's fast path, a test per group, not per value
    return (tl.abs(lo) <= _F16_MAX) & (tl.abs(hi) <= _F16_MAX)


@triton.jit
def _unpack(DATA, row, ok, G: tl.constexpr, PER: tl.constexpr, NB: tl.constexpr,
            BITS: tl.constexpr):
    # codes [R, G, PER] int32 of page rows `row` [R] (int64, ok: rows to load)
    g = tl.arange(0, G)
    j = tl.arange(0, PER)
    word = tl.zeros([row.shape[0], G], tl.int32)
    for b in tl.static_range(NB):
        byte = tl.load(DATA + row[:, None] * (G * NB) + g[None, :] * NB + b, mask=ok[:, None],
                       other=0)
        word = word | (byte.to(tl.int32) << (8 * b))
    return (word[:, :, None] >> (BITS * j[None, None, :])) & ((1 << BITS) - 1)


@triton.jit
def _pack_store(DATA, row, ok, codes, G: tl.constexpr, PER: tl.constexpr, NB: tl.constexpr,
                BITS: tl.constexpr):
    # codes [R, G, PER] int32 -> packed bytes at page rows `row` [R] (ok: rows to store)
    g = tl.arange(0, G)
    j = tl.arange(0, PER)
    word = tl.sum(codes << (BITS * j[None, None, :]), 2)                 # [R, G], no overlap
    for b in tl.static_range(NB):
        tl.store(DATA + row[:, None] * (G * NB) + g[None, :] * NB + b,
                 ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=ok[:, None])


@triton.jit
def _load_x(X, src, ok, H, h, D: tl.constexpr, G: tl.constexpr, PER: tl.constexpr):
    # x[src[r], h, :] as fp32 [R, G, PER]
    # (loaded as [R, D] rows, then split into packing units: wide loads along head_dim)
    d = tl.arange(0, D)
    xrow = (src.to(tl.int64) * H + h) * D
    x = tl.load(X + xrow[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    return tl.reshape(x, [src.shape[0], G, PER])


@triton.jit
def _fold(v, CH: tl.constexpr, MAX: tl.constexpr):
    # per-channel partials [G, PER] -> the group's value, broadcast back to [G, PER] (page
    # scales: one group per (page, head); channel scales: each channel its own)
    if CH:
        return v
    if MAX:
        return tl.zeros_like(v) + tl.max(tl.max(v, 1), 0)
    return tl.zeros_like(v) + tl.min(tl.min(v, 1), 0)


@triton.jit
def _append_int_run(X, SORTED, ORDER, DATA, SCALE, ZERO, i, T, H, h, D: tl.constexpr,
                    P: tl.constexpr, NR: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                    NB: tl.constexpr, CH: tl.constexpr, RECIP: tl.constexpr,
                    GROUPED: tl.constexpr):
    # the run of sorted slots starting at position i (one page); returns its length
    LEV: tl.constexpr = (1 << BITS) - 1
    G: tl.constexpr = D // PER
    r = tl.arange(0, NR)
    first = tl.load(SORTED + i)
    pg = first // P
    m = (first % P).to(tl.int32)         # earlier tokens: page rows [0, m)
    k = tl.arange(0, P)
    inside = i + k < T
    same = inside & (tl.load(SORTED + i + k, mask=inside, other=0) // P == pg)
    n = tl.sum(same.to(tl.int32), 0)     # the run's length (slots distinct, sorted by page)
    head = pg * H + h
    g = tl.arange(0, G)
    c = g[:, None] * PER + tl.arange(0, PER)[None, :]                    # [G, PER] channel
    if CH:
        pofs = head * D + c
    else:
        pofs = head + c * 0
    s_old = tl.load(SCALE + pofs).to(tl.float32)
    z_old = tl.load(ZERO + pofs).to(tl.float32)
    inf = float("inf")
    # pass 1: min / max of the earlier tokens (decoded) and of the new ones, NaN flags
    lo_o = tl.full([G, PER], inf, tl.float32)
    hi_o = tl.full([G, PER], -inf, tl.float32)
    nan_o = tl.zeros([G, PER], tl.int32)
    for c0 in range(0, m, NR):
        ok = c0 + r < m
        v = _unpack(DATA, head * P + c0 + r, ok, G, PER, NB, BITS).to(tl.float32) * s_old + z_old
        fin = ok[:, None, None] & (tl.abs(v) < inf)
        lo_o = tl.minimum(lo_o, tl.min(tl.where(fin, v, inf), 0))
        hi_o = tl.maximum(hi_o, tl.max(tl.where(fin, v, -inf), 0))
        nan_o = tl.maximum(nan_o, tl.max((ok[:, None, None] & (v != v)).to(tl.int32), 0))
    lo_n = tl.full([G, PER], inf, tl.float32)
    hi_n = tl.full([G, PER], -inf, tl.float32)
    nan_n = tl.zeros([G, PER], tl.int32)
    for c1 in range(0, n, NR):
        ok = c1 + r < n
        if GROUPED:
            src = i + c1 + r
        else:
            src = tl.load(ORDER + i + c1 + r, mask=ok, other=0)
        v = _load_x(X, src, ok, H, h, D, G, PER)
        fin = ok[:, None, None] & (tl.abs(v) < inf)
        lo_n = tl.minimum(lo_n, tl.min(tl.where(fin, v, inf), 0))
        hi_n = tl.maximum(hi_n, tl.max(tl.where(fin, v, -inf), 0))
        nan_n = tl.maximum(nan_n, tl.max((ok[:, None, None] & (v != v)).to(tl.int32), 0))
    lo_o, hi_o, nan_o = _fold(lo_o, CH, False), _fold(hi_o, CH, True), _fold(nan_o, CH, True)
    lo_n, hi_n, nan_n = _fold(lo_n, CH, False), _fold(hi_n, CH, True), _fold(nan_n, CH, True)
    # grouped.update_int_params: keep the old parameters where they cover the new tokens
    covered = (lo_n >= z_old) & (hi_n <= z_old + LEV * s_old) & (tl.abs(s_old) < inf)
    keep = covered & (nan_n == 0) & (c * 0 + m > 0)   # (vector form: see append.py)
    s_new, z_new = _params(tl.minimum(lo_o, lo_n), tl.maximum(hi_o, hi_n),
                           (nan_o | nan_n) != 0, LEV, RECIP)
    s_new = tl.where(keep, s_old, s_new)
    z_new = tl.where(keep, z_old, z_new)
    diff = ((s_new != s_old) & ((s_new == s_new) | (s_old == s_old))) | (z_new != z_old)
    changed = tl.max(tl.max(diff.to(tl.int32), 1), 0) > 0
    # pass 2: encode and store (earlier tokens only where the head's parameters changed)
    sd, rs = _divisor(s_new)
    if changed:
        for c2 in range(0, m, NR):
            ok = c2 + r < m
            rows = head * P + c2 + r
            v = _unpack(DATA, rows, ok, G, PER, NB, BITS).to(tl.float32) * s_old + z_old
            _pack_store(DATA, rows, ok, _codes(v, sd, rs, z_new, LEV), G, PER, NB, BITS)
    for c3 in range(0, n, NR):
        ok = c3 + r < n
        if GROUPED:
            src = i + c3 + r
        else:
            src = tl.load(ORDER + i + c3 + r, mask=ok, other=0)
        off = tl.load(SORTED + i + c3 + r, mask=ok, other=0) % P
        v = _load_x(X, src, ok, H, h, D, G, PER)
        _pack_store(DATA, head * P + off, ok, _codes(v, sd, rs, z_new, LEV), G, PER, NB,
                    BITS)
    if CH:
        smask = c >= 0
    else:
        smask = c == 0
    tl.store(SCALE + pofs, s_new.to(tl.float16), mask=smask)
    tl.store(ZERO + pofs, z_new.to(tl.float16), mask=smask)
    return n


@triton.jit(do_not_specialize=["T", "H"])
def _append_int_pages_kernel(X, SORTED, ORDER, DATA, SCALE, ZERO, T, H, D: tl.constexpr,
                             P: tl.constexpr, WIN: tl.constexpr, NR: tl.constexpr,
                             BITS: tl.constexpr, PER: tl.constexpr, NB: tl.constexpr,
                             CH: tl.constexpr, RECIP: tl.constexpr, GROUPED: tl.constexpr):
    # page / channel scales: program (w, h) writes the runs that start in positions
    # [w * WIN, (w + 1) * WIN), one after another
    h = tl.program_id(1)
    base = tl.program_id(0) * WIN
    idx = base + tl.arange(0, WIN)
    pg = tl.load(SORTED + idx, mask=idx < T, other=-1) // P
    prv = tl.load(SORTED + idx - 1, mask=(idx >= 1) & (idx < T), other=-1) // P
    starts = (idx < T) & ((idx == 0) | (pg != prv))
    i = tl.min(tl.where(starts, idx, base + WIN), 0)
    while i < tl.minimum(base + WIN, T):
        i = i + _append_int_run(X, SORTED, ORDER, DATA, SCALE, ZERO, i, T, H, h, D, P, NR,
                                BITS, PER, NB, CH, RECIP, GROUPED)


@triton.jit
def window_runs(SORTED, T, P: tl.constexpr, W: tl.constexpr):
    # a bulk window's run starts (append.py's tiles kernel and this module's): positions
    # idx = w * W + [0, W) of the sorted slots, live (< T), their slots, which of them start a
    # run (a page's first slot in the order), and s0, the first run start (or the window's end)
    i0 = tl.program_id(0) * W
    idx = i0 + tl.arange(0, W)
    live = idx < T
    slot = tl.load(SORTED + idx, mask=live, other=0)
    prv = tl.load(SORTED + idx - 1, mask=live & (idx > 0), other=0)
    start = live & ((idx == 0) | (prv // P != slot // P))
    s0 = tl.min(tl.where(start, idx, i0 + W), 0)
    return i0, idx, live, slot, start, s0


@triton.jit
def uncovered_starts(SORTED, T, idx, live, slot, start, s0, P: tl.constexpr):
    # the run starts of a window that its tile's fresh full pages did not cover (a start on the
    # s0 + k P grid whose P positions are that whole page: the tiles' `full` test)
    lastw = tl.load(SORTED + idx + P - 1, mask=live & (idx + P - 1 < T), other=-1)
    cov = ((idx - s0) % P == 0) & (idx + P - 1 < T) & (slot % P == 0) & (lastw == slot + P - 1)
    return start & (cov == 0)


@triton.jit
def _tile_rows(X, ORDER, T, H, h, qb, ok, r, D: tl.constexpr, GROUPED: tl.constexpr,
               SPEC: tl.constexpr):
    # row r of the tile's NPG pages: x[src(qb + r), h, :] as fp32 [NPG, D] (ok: pages loaded).
    # SPEC: every page's row is loaded (positions past T read row T - 1), so the loads need
    # not wait for `ok` (the full-page test, two dependent loads of the sorted slots); what
    # the pages that are not full give is not stored, nor does it choose the tile's path
    pos = qb + r
    if SPEC:
        pos = tl.minimum(pos, T - 1)
        if GROUPED:
            src = pos
        else:
            src = tl.load(ORDER + pos)
        lmask = pos >= 0
    else:
        if GROUPED:
            src = pos
        else:
            src = tl.load(ORDER + pos, mask=ok & (pos < T), other=0)
        lmask = ok
    d = tl.arange(0, D)
    return tl.load(X + ((src.to(tl.int64) * H + h) * D)[:, None] + d[None, :],
                   mask=lmask[:, None], other=0.0).to(tl.float32)


@triton.jit
def _tile_encode(X, ORDER, DATA, T, H, h, qb, full, head, sd, rs, zp, D: tl.constexpr,
                 P: tl.constexpr, U: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                 NB: tl.constexpr, GROUPED: tl.constexpr, FRESH: tl.constexpr,
                 SPEC: tl.constexpr):
    # codes of the tile's pages, row by row (U rows unrolled a step), packed and stored
    LEV: tl.constexpr = (1 << BITS) - 1
    G: tl.constexpr = D // PER
    NPG: tl.constexpr = qb.shape[0]
    for r0 in range(0, P, U):
        for u in tl.static_range(U):
            x = _tile_rows(X, ORDER, T, H, h, qb, full, r0 + u, D, GROUPED, SPEC)
            if FRESH:
                codes = _codes_fresh(x, sd, rs, zp, LEV)
            else:
                codes = _codes(x, sd, rs, zp, LEV)
            _pack_store(DATA, head * P + r0 + u, full, tl.reshape(codes, [NPG, G, PER]), G,
                        PER, NB, BITS)


@triton.jit(do_not_specialize=["T", "H"])
def _append_int_tiles_kernel(X, SORTED, ORDER, DATA, SCALE, ZERO, T, H, D: tl.constexpr,
                             P: tl.constexpr, W: tl.constexpr, U: tl.constexpr,
                             NR: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                             NB: tl.constexpr, CH: tl.constexpr, RECIP: tl.constexpr,
                             GROUPED: tl.constexpr, PART: tl.constexpr = 0,
                             SPEC: tl.constexpr = False):
    # page / channel scales, bulk writes (append.py's tiles kernel for the int formats):
    # program (w, h) owns the runs that start in positions [w * W, (w + 1) * W). With s0 its
    # first run start, positions s0 + [0, W) are W / P blocks of P; a block whose first
    # position starts a page (offset 0) and whose P positions are that whole page is a fresh
    # full page: no earlier tokens, so its parameters come from its new values alone (the
    # run path's "keep" needs earlier tokens). The W / P pages are read row by row as
    # [W / P, D] tiles, twice: per-channel min / max first (each thread keeps its channels'
    # running min / max: no reduction across threads), then codes and packed stores (the
    # second read hits the cache). A tile whose values are all finite and within fp16's range
    # (the usual case, _finite_range) takes the cheap statistics and codes; otherwise its
    # statistics are taken again with the finite / NaN masks, and the codes with the clamps.
    # The other runs (a page with earlier tokens, a partial page, a run off the s0 + k P grid)
    # go through _append_int_run, one after another. Bit for bit the run path's: the same
    # _params / codes on the same values. PART 1 writes only the fresh full pages, PART 2 only
    # the other runs, PART 0 both (the two touch disjoint pages): launched as PART 1 then
    # PART 2 (TILE_SPLIT), the full pages' build does without the run path's registers (64
    # against 167 at D 128, P 16, sm_90; 167 allow 3 programs of 4 warps a SM).
    h = tl.program_id(1)
    i0, idx, live, slot, start, s0 = window_runs(SORTED, T, P, W)
    if PART != 2:
        _tile_pages(X, SORTED, ORDER, DATA, SCALE, ZERO, T, H, h, i0, s0, D, P, W, U, BITS, PER,
                    NB, CH, RECIP, GROUPED, SPEC)
    if PART != 1:
        rest = uncovered_starts(SORTED, T, idx, live, slot, start, s0, P)
        i = tl.min(tl.where(rest, idx, i0 + W), 0)
        while i < i0 + W:
            _append_int_run(X, SORTED, ORDER, DATA, SCALE, ZERO, i, T, H, h, D, P, NR, BITS,
                            PER, NB, CH, RECIP, GROUPED)
            i = tl.min(tl.where(rest & (idx > i), idx, i0 + W), 0)


@triton.jit
def _tile_pages(X, SORTED, ORDER, DATA, SCALE, ZERO, T, H, h, i0, s0, D: tl.constexpr,
                P: tl.constexpr, W: tl.constexpr, U: tl.constexpr, BITS: tl.constexpr,
                PER: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr, RECIP: tl.constexpr,
                GROUPED: tl.constexpr, SPEC: tl.constexpr):
    # the fresh full pages of _append_int_tiles_kernel's window
    LEV: tl.constexpr = (1 << BITS) - 1
    NPG: tl.constexpr = W // P
    qb = s0 + tl.arange(0, NPG) * P                                     # [NPG] block starts
    first = tl.load(SORTED + qb, mask=qb < T, other=1)
    last = tl.load(SORTED + qb + P - 1, mask=qb + P - 1 < T, other=-1)
    full = (qb < i0 + W) & (qb + P - 1 < T) & (first % P == 0) & (last == first + P - 1)
    inf = float("inf")
    lo = tl.full([NPG, D], inf, tl.float32)
    hi = tl.full([NPG, D], -inf, tl.float32)
    for r0 in range(0, P, U):
        for u in tl.static_range(U):
            x = _tile_rows(X, ORDER, T, H, h, qb, full, r0 + u, D, GROUPED, SPEC)
            lo = min_nan(lo, x)
            hi = max_nan(hi, x)
    bad = (_finite_range(lo, hi) == 0) & full[:, None]
    fresh = tl.max(tl.max(bad.to(tl.int32), 1), 0) == 0
    nan = tl.zeros([NPG, D], tl.int32)
    if not fresh:   # a NaN, an Inf or a value beyond fp16: the masked statistics
        lo = tl.full([NPG, D], inf, tl.float32)
        hi = tl.full([NPG, D], -inf, tl.float32)
        for r in range(0, P):
            x = _tile_rows(X, ORDER, T, H, h, qb, full, r, D, GROUPED, SPEC)
            fin = tl.abs(x) < inf
            lo = tl.minimum(lo, tl.where(fin, x, inf))
            hi = tl.maximum(hi, tl.where(fin, x, -inf))
            nan = tl.maximum(nan, (x != x).to(tl.int32))
    if not CH:   # one group per (page, head): fold the channels
        lo = tl.zeros_like(lo) + tl.min(lo, 1)[:, None]
        hi = tl.zeros_like(hi) + tl.max(hi, 1)[:, None]
        nan = tl.zeros_like(nan) + tl.max(nan, 1)[:, None]
    sc, zp = _params(lo, hi, nan != 0, LEV, RECIP)                      # [NPG, D]
    sd, rs = _divisor(sc)
    head = tl.where(full, first // P, 0) * H + h                        # [NPG]
    if fresh:
        _tile_encode(X, ORDER, DATA, T, H, h, qb, full, head, sd, rs, zp, D, P, U, BITS, PER,
                     NB, GROUPED, True, SPEC)
    else:
        _tile_encode(X, ORDER, DATA, T, H, h, qb, full, head, sd, rs, zp, D, P, U, BITS, PER,
                     NB, GROUPED, False, SPEC)
    d = tl.arange(0, D)
    if CH:
        pofs = head[:, None] * D + d[None, :]
        smask = full[:, None] & (d[None, :] >= 0)
    else:
        pofs = head[:, None] + d[None, :] * 0
        smask = full[:, None] & (d[None, :] == 0)
    tl.store(SCALE + pofs, sc.to(tl.float16), mask=smask)
    tl.store(ZERO + pofs, zp.to(tl.float16), mask=smask)


@triton.jit(do_not_specialize=["T", "H"])
def _append_int_tokens_kernel(X, SLOTS, DATA, SCALE, ZERO, T, H, D: tl.constexpr,
                              P: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
                              PER: tl.constexpr, NB: tl.constexpr, RECIP: tl.constexpr):
    # token scales: R tokens of head h, each its own (scale, zero) over its head_dim
    LEV: tl.constexpr = (1 << BITS) - 1
    G: tl.constexpr = D // PER
    h = tl.program_id(1)
    t = tl.program_id(0) * R + tl.arange(0, R)
    ok = t < T
    slot = tl.load(SLOTS + t, mask=ok, other=0)
    row = ((slot // P) * H + h) * P + slot % P
    v = _load_x(X, t, ok, H, h, D, G, PER)
    # the cheap path's test a row: NaN-ignoring min / max (an Inf among them fails the range
    # test), and the row's sum, NaN if it holds a NaN (within the range no sum of D values
    # overflows) -- builtin reductions: a combine function of our own, NaN-propagating, made
    # the interpreter's append 20x slower; sum(v - v) cost one more add a value
    lo = tl.min(tl.min(v, 2), 1)                                                  # [R]
    hi = tl.max(tl.max(v, 2), 1)
    tot = tl.sum(tl.sum(v, 2), 1)
    odd = tot != tot
    if tl.max((odd | (_finite_range(lo, hi) == 0)).to(tl.int32), 0) == 0:
        s, z = _params(lo, hi, odd, LEV, RECIP)
        sd, rs = _divisor(s)
        codes = _codes_fresh(v, sd[:, None, None], rs[:, None, None], z[:, None, None], LEV)
    else:   # a NaN, an Inf or a value beyond fp16 in the tile: masked statistics, clamps
        inf = float("inf")
        fin = tl.abs(v) < inf
        lo = tl.min(tl.min(tl.where(fin, v, inf), 2), 1)
        hi = tl.max(tl.max(tl.where(fin, v, -inf), 2), 1)
        has_nan = tl.max(tl.max((v != v).to(tl.int32), 2), 1) > 0
        s, z = _params(lo, hi, has_nan, LEV, RECIP)                              # [R]
        sd, rs = _divisor(s)
        codes = _codes(v, sd[:, None, None], rs[:, None, None], z[:, None, None], LEV)
    _pack_store(DATA, row, ok, codes, G, PER, NB, BITS)
    tl.store(SCALE + row, s.to(tl.float16), mask=ok)
    tl.store(ZERO + row, z.to(tl.float16), mask=ok)


def launch_append_int(x, slots, data, scale, zero, bits: int, granularity: str,
                      grouped: bool, sort, iota, explicit: bool) -> None:
    """x [T, H, D] float (contiguous), slots [T] int64 -> data / scale / zero (mutated).
    sort / iota: append.py's (device sort; arange buffer). Checked by append.launch_append."""
    T, H, D = x.shape
    P = data.shape[2]
    per, nb = unit_shape(bits)
    recip = not explicit
    if granularity == "token":
        R = max(1, min(TOKEN_TILE_ELEMS // 128, TOKEN_TILE_ELEMS // D))
        _append_int_tokens_kernel[(triton.cdiv(T, R), H)](
            x, slots, data, scale, zero, T, H, D=D, P=P, R=R, BITS=bits, PER=per, NB=nb,
            RECIP=recip, num_warps=TOKEN_TILE_WARPS)
        return
    if grouped:
        sorted_slots, order = slots, iota(T, x.device)
    else:
        sorted_slots, order = sort(slots)
    if T > BULK_TOKENS and PAGE_BULK == "tiles":
        W = TILE_PAGES * P
        for part in (1, 2) if TILE_SPLIT else (0,):
            _append_int_tiles_kernel[(triton.cdiv(T, W), H)](
                x, sorted_slots, order, data, scale, zero, T, H, D=D, P=P, W=W,
                U=math.gcd(P, TILE_UNROLL), NR=min(P, BULK_ROWS), BITS=bits, PER=per, NB=nb,
                CH=granularity == "channel", RECIP=recip, GROUPED=grouped, PART=part,
                SPEC=TILE_SPEC, num_warps=TILE_WARPS)
        return
    win = 1 if T <= BULK_TOKENS else P
    nr = min(P, DECODE_ROWS if win == 1 else BULK_ROWS)
    _append_int_pages_kernel[(triton.cdiv(T, win), H)](
        x, sorted_slots, order, data, scale, zero, T, H, D=D, P=P, WIN=win, NR=nr, BITS=bits,
        PER=per, NB=nb, CH=granularity == "channel", RECIP=recip, GROUPED=grouped,
        num_warps=DECODE_WARPS if win == 1 else 4)
