"""Quantize-and-append: store new tokens' K or V into their pages, in the page's format.

    quantize_append(cache, slots, x)   # cache: PagedTensor; slots [T] int64 (page * P + offset);
                                       # x [T, Hkv, D]. Same result as cache.write(slots, x).

Semantics are PagedTensor.write's (formats.py), bit for bit:
- plain formats: a cast.  token scales: one per (token, head) from that token's amax.
- tensor scale: calibrated from the first write's amax when it is still 0, then fixed.
- page scales grow: a write that raises a (page, head) scale (by a power of two, as
  `grow_page_scale`) re-encodes that page's earlier tokens: decode with the old scale, encode
  with the new. The page's valid tokens before the write are its slots [0, min new offset).

Page-scaled writes sort the slots on the device (no host sync; `grouped=True` skips the sort for
slots in PagePool.reserve's order). Bulk writes (more than BULK_TOKENS tokens) run one program
per (window of W tokens, head) that writes the window's fresh whole pages as blocks of one tile
in one pass over x (`_append_pages_tiles_kernel`, PAGE_BULK); decode steps run one program per
(run of one page, head). Other writes run one program per (block of tokens, head).
fp4 loads each pair of input elements as one word (`_load_pairs`).
Encoding divides by a reciprocal plus one residual fma, bit-exact with the reference's division
(`append_int.rn_quotient`), and rounds to e2m1 by one fp32 add at the value's exponent and
integer arithmetic on its bits (`_e2m1_magnitude`).
Under TRITON_INTERPRET=1 the fp8 / bf16 roundings are done in explicit fp32 arithmetic (the
interpreter's casts round wrongly); on the GPU they are the hardware's RNE-satfinite casts.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvcompile.cache.registry import format_spec
from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels.append_int import (
    launch_append_int,
    rn_quotient,
    uncovered_starts,
    window_runs,
)
from kvcompile.kernels.append_int import max_nan as _max_nan
from kvcompile.kernels.decode_tiles import (
    FMT_E2M1,
    FMT_E4M3,
    FMT_E5M2,
    FMT_PLAIN,
    FORMAT_CODES,
    fp8_specials,
)
from kvcompile.kernels.decode_tiles import e2m1_to_f16 as _e2m1_value

_PLAIN_BF16, _PLAIN_FP16, _PLAIN_FP32 = 10, 11, 12
# Page-scaled writes of more tokens than this scan a window of P sorted slots per program
# (bulk prefill); fewer, one slot per program (decode steps).
BULK_TOKENS = 4096
# "windows": tokens x head_dim of one bulk page-scaled program's tile (128 tokens at D 128).
BULK_TILE_ELEMS = 16384
# Which kernel writes bulk page-scaled appends:
# - "tiles" (_append_pages_tiles_kernel, branch append16b, the default): program (window of W
#   sorted slots, head) writes the fresh whole pages of its window as blocks of P rows of one
#   [W, D] tile in one pass (amax, scale, encode in registers; no scan); the other runs of the
#   window (pages with earlier tokens, partial pages) take the per-run path;
# - "runs" (_append_pages_kernel, WIN = P: one program per window of P sorted slots, each page
#   a serial amax -> scale -> encode, x read twice): 0.44x copy for fp8 and 0.13x for fp4 on the
#   H200 (2026-12-03, bench_append.py, T 65536, grouped), the default before append16b;
# - "windows" (_append_pages_bulk_kernel: a window of whole pages with segmented scans): 0.37x
#   fp8, 0.13x fp4 (then 255 registers and 0.9-1.7 KB of stack spills in the sm_90 build;
#   178 / 218 registers, no spills with append16b's pair loads: benchmarks/append_sass.py).
# The tests and bench_append.py run all three. "tiles" is not yet timed on the GPU: by its sm_90
# build (126-128 registers, no spills, 16-byte loads, x read once) it should beat "runs"; if
# bench_append.py says otherwise, set "runs" here.
# "tiles" is the default: on the H200 (2026-12-04) it wrote fp8 pages at 0.62x copy against
# 0.41x ("runs"), fp4 0.33x against 0.17x, and every bit-exactness test of the append files
# passed there (the 2-3 failures of the tenth session were the negative test's own device
# mix, fixed; benchmarks/RESULTS.md, "Eleventh session's device calls").
PAGE_BULK = "tiles"
# - "split" (append14i, not yet timed): the "tiles" kernel in two launches, full pages (PART 1)
#   then the other runs (PART 2): without the per-run path's code the fp8 tile kernel builds
#   with 71 registers / 1,440 SASS instructions instead of 96 / 2,928 (fp4: 116 / 2,456 against
#   114 / 5,064; D 128, P 16, 32 x 128 tiles, sm_90, triton 3.9), like the token-scale row kernel
#   (72 / 1,360) that reaches 0.80x copy. bench_append.py times it beside "tiles".
# "tiles": tokens x head_dim of a program's tile, and its warps (fp8, fp4): 32 / 64 values a
# thread in the sm_90 build
# (H200, bench_append --sweep, 2026-12-04: 32 x 128 with 4 warps fastest for both, fp8 0.62x
# copy against 0.58x at 64 x 128, fp4 0.33x against 0.26x at 64 x 128 with 8 warps; then for
# fp4 on an H100, thirtieth session, with the register cap below: 32 x 128 with 2 warps
# 0.1066 ms = 0.54x copy against 0.1238 ms = 0.47x with 4; 16 x 128 with 2 warps 0.48x,
# 8 warps 0.28x; the 2-warp build: 128 registers, 272 bytes of stack a thread, 8 programs a SM)
PAGE_TILE_ELEMS = 4096
PAGE_TILE_WARPS = (4, 2)
# "tiles": a register cap (ptxas maxnreg) of its sm_90 build, (fp8, fp4); None: ptxas chooses.
# The thirtieth session's encode (fewer instructions a value) let ptxas give the fp4 build 150
# registers at 4 warps (3 programs a SM) where the build before had 128 and 56 bytes of stack
# (4 a SM); capped at 128 it built with 124 and no stack (triton 3.6, D 128, page 16), and ran
# at 0.47x copy against 0.40x uncapped. At 2 warps (the fp4 default above) the cap gives 128
# registers and 272 bytes of stack; 2 warps uncapped (241 registers) is not timed.
PAGE_TILE_MAXNREG = (None, 128)
# "tiles": read x before the full-page test (SPEC): Nsight (H100, 2026-12-06) put the fp4 tiles
# kernel's stalls on the x loads (0.45x copy, 4 programs of 4 warps a SM), behind a chain of
# three dependent loads a program (window starts, page test, x). Not yet timed on a GPU (no
# device time was left), so off; bench_append.py times it (", tiles, x read before ...").
PAGE_TILE_SPEC = False
# row kernels (plain, token and tensor scales): tokens x head_dim of a program's tile, and
# the warps of the quantizing ones (token and tensor scales)
ROW_TILE_ELEMS = 4096
ROW_TILE_WARPS = 4
# fp4 (e2m1) token and tensor rows: (elements, warps) of a program. 16 tokens x 128 in 2 warps
# ran at 0.61x copy against 0.55 (token) / 0.58 (tensor) for 32 x 128 in 4 (bench_append.py
# --sweep, H100, thirty-third session); 1 warp 0.62 / 0.60
FP4_ROW_TILE = (2048, 2)
# fp4 writes load each pair of input elements as one word (_load_pairs: 16-byte loads, no
# shuffles). False: the earlier [.., 8, 2] tile and tl.split (2 elements a load), kept to time
# against it (bench_append.py); the "windows" and "tiles" kernels always load pairs.
FP4_PAIR_LOADS = True    # 0.39x copy against 0.26x (H200); bit-exact there (eleventh session)
# tensor scales: programs of the first write's amax pass (_calibrate_amax_kernel), each
# striding over blocks (1 << 30: one program per block, as before append16b)
CALIBRATE_PROGRAMS = 1024


@triton.jit
def _exp2i(k):
    # 2^k as fp32 for integer k in [-126, 127], exact
    e = (k + 127) + tl.zeros([], tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_fp8_bits(y, MB: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr):
    # y: fp32 within the format's range (or NaN) -> uint8 code, round to nearest even, in fp32
    # arithmetic (the interpreter's own fp8 casts round wrongly)
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_e = tl.maximum(e, EMIN) - MB
    c = _exp2i(ulp_e + 23) * 1.5
    r = (a + c) - c  # RNE to a multiple of 2^ulp_e
    rb = r.to(tl.int32, bitcast=True)
    normal = ((((rb >> 23) & 0xFF) - 127 + BIAS) << MB) | ((rb >> (23 - MB)) & ((1 << MB) - 1))
    sub = (r * _exp2i(MB - EMIN)).to(tl.int32)
    code = tl.where(r >= _exp2i(EMIN), normal, sub)
    code = tl.where(a != a, 0x7F, code)
    return code.to(tl.uint8) | sign


# Fast encode paths (GPU and interpreter alike). A block whose values are all finite, and whose
# divisor d (fp8: the scale; fp4: micro * scale) lies in [2^-80, 2^80] or is 0 (fp4), divides by
# multiplying with y = RN(1 / d) and one residual step (`append_int.rn_quotient`, shared with the
# int kernels), the reference's quotient bit for bit (tests/kernels/test_append_codes.py checks
# it on dense sets around every rounding boundary). Other blocks (NaN, Inf, extreme d) take the
# exact division.
_SAFE_LO, _SAFE_HI = tl.constexpr(2.0 ** -80), tl.constexpr(2.0 ** 80)
_MIN_SCALE = tl.constexpr(2.0 ** -126)  # cache/fp4.py MIN_SCALE: scales are never subnormal


@triton.jit
def _scale_of(cover):
    # cache/fp4.py scale_from_amax on amax / divisor: 1.0 where 0, else at least 2^-126
    return tl.where(cover > 0, tl.maximum(cover, _MIN_SCALE), 1.0)


@triton.jit
def _e2m1_magnitude(m):
    # m: fp32 >= 0, not NaN -> e2m1 magnitude code 0..7, round to nearest even, saturating at 6.
    # With m' = min(m, 6) and E = max(exponent of m', 0), e2m1's step at m' is 2^(E - 1) (0.5
    # below 2), the ulp of c = 2^(E + 22): the sum m' + c rounds m' to that step, ties to an
    # even multiple, and its bits less c's are that multiple k. The code is k + 2 E (E = 0:
    # 0, 0.5, 1, 1.5, 2 -> 0..4; E = 1: 2, 3, 4 -> 4..6; E = 2: 4, 6 -> 6, 7), and k's parity
    # is the code's, so ties go to the even code. One exponent a value, no branch on the range.
    m = tl.minimum(m, 6.0)
    mb = tl.maximum(m.to(tl.int32, bitcast=True), 0x3F800000) & 0x7F800000   # (E + 127) << 23
    s = (m + (mb + 0x0B000000).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    return (s - mb - 0x0B0000FE) + (mb >> 22)        # s - c + 2 (E + 127) - 254


@triton.jit
def _fp8_cast(q, FMT: tl.constexpr, EXPLICIT: tl.constexpr):
    # q: fp32 within +-fmax (or NaN) -> uint8 code, round to nearest even
    if EXPLICIT:
        if FMT == 1:
            return _round_fp8_bits(q, 3, -6, 7)
        return _round_fp8_bits(q, 2, -14, 15)
    if FMT == 1:
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return q.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def _in_safe_range(d):
    return (d >= _SAFE_LO) & (d <= _SAFE_HI)


@triton.jit
def _encode_fp8(x, scale, arow, FMT: tl.constexpr, FMAX: tl.constexpr, EXPLICIT: tl.constexpr):
    # x [R, D] fp32, scale [R] fp32, arow [R]: max |x| of each row, NaN if the row has a NaN
    # -> codes of clamp(x / scale, -fmax, fmax) [R, D] uint8; NaN stays NaN
    fast = (tl.reduce(arow, 0, _max_nan) < float("inf")) & (
        tl.min(_in_safe_range(scale).to(tl.int32), 0) > 0)
    if fast:
        y = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        q = rn_quotient(x, y[:, None], scale[:, None], True)
        q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
    else:
        q = tl.math.div_rn(x, scale[:, None])
        q = tl.where(q > FMAX, FMAX, tl.where(q < -FMAX, -FMAX, q))
    return _fp8_cast(q, FMT, EXPLICIT)


@triton.jit
def _div_const(x, DIV: tl.constexpr, RECIP: tl.constexpr):
    # x / DIV as torch computes `tensor / python_float`: on CUDA a multiplication by the fp32
    # reciprocal (RECIP), on the CPU a true division; so storage stays bit-exact with
    # PagedTensor.write on either device
    if RECIP:
        return x * (1.0 / DIV)
    else:
        return tl.math.div_rn(x, DIV)


@triton.jit
def _decode_fp8(code, scale, FMT: tl.constexpr, DATA_DT: tl.constexpr):
    # (NaN / Inf codes stay NaN / Inf under the interpreter too: decode_tiles.fp8_specials)
    x = code.to(DATA_DT, bitcast=True)
    return fp8_specials(x, x.to(tl.float32)) * scale


@triton.jit
def _group_amax_nan(xe, xo):
    # [R, G, 8] even / odd values -> max |x| of each 16-value micro-block [R, G], NaN if it has one
    return tl.reduce(tl.maximum(tl.abs(xe), tl.abs(xo), propagate_nan=tl.PropagateNan.ALL), 2,
                     _max_nan)


@triton.jit
def _all_finite(a):
    # a [R, G] of amax values (NaN propagated) -> scalar: every one finite
    return tl.reduce(tl.reduce(a, 1, _max_nan), 0, _max_nan) < float("inf")


@triton.jit
def _group_amax_finite(xe, xo):
    return tl.max(tl.maximum(_finite_abs(xe), _finite_abs(xo)), 2)


@triton.jit
def _fp4_half_codes(x, y, d, smask, FAST: tl.constexpr):
    # x [R, G, 8]; d: fp32 micro * scale (> 0 where smask is 8), y its reciprocal -> codes
    # (FAST: every x finite, y = 0 where d is 0, so that q is 0 there)
    sign = (x.to(tl.int32, bitcast=True) >> 28) & smask
    if FAST:
        c = _e2m1_magnitude(tl.abs(rn_quotient(x, y, d))) | sign
    else:
        c = _e2m1_magnitude(tl.where(smask != 0, tl.abs(tl.math.div_rn(x, d)), 0.0)) | sign
        c = tl.where(x != x, 0, c)
    return c


@triton.jit
def _encode_fp4(xe, xo, scale, a16, EXPLICIT: tl.constexpr, RECIP: tl.constexpr):
    # xe, xo: [R, G, 8] even / odd elements of each 16-value micro-block; scale: [R];
    # a16 [R, G]: _group_amax_nan -> (packed bytes [R, G, 8] uint8, micro codes [R, G] uint8)
    fin = _all_finite(a16)
    if fin:
        amax16 = a16
    else:
        amax16 = _group_amax_finite(xe, xo)
    s2 = scale[:, None]
    mic = tl.minimum(tl.math.div_rn(_div_const(amax16, 6.0, RECIP), s2), 448.0)
    if EXPLICIT:
        mcode = _round_fp8_bits(mic, 3, -6, 7)
    else:
        mcode = mic.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    d = mcode.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s2              # [R, G]
    good = _in_safe_range(d)
    smask = tl.where(d > 0, 8, 0)[:, :, None]
    if fin & (tl.min(tl.min(((d == 0) | good).to(tl.int32), 1), 0) > 0):
        # (both branches give dd and y the same shape: compiled Triton requires it)
        d1 = tl.where(good, d, 1.0)
        y = tl.where(good, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d1), 0.0)[:, :, None]
        dd = d1[:, :, None]
        ce = _fp4_half_codes(xe, y, dd, smask, True)
        co = _fp4_half_codes(xo, y, dd, smask, True)
    else:
        dd = tl.where(d > 0, d, 1.0)[:, :, None]
        y = dd
        ce = _fp4_half_codes(xe, dd, dd, smask, False)
        co = _fp4_half_codes(xo, dd, dd, smask, False)
    mcode = tl.where(a16 != a16, 0x7F, mcode)
    return (ce | (co << 4)).to(tl.uint8), mcode.to(tl.uint8)


@triton.jit
def _round_bf16_bits(x):
    # fp32 -> bf16 bits (int16), round to nearest even; NaN stays (quiet) NaN
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x != x, (b >> 16) | 0x40, r)
    return r.to(tl.int16)


@triton.jit
def _finite_abs(x):
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _seg_fwd(i1, v1, i2, v2):
    # runs of equal, non-decreasing ids: (the later id, max of the values of that id)
    return tl.maximum(i1, i2), tl.where(i1 == i2, tl.maximum(v1, v2), tl.where(i1 > i2, v1, v2))


@triton.jit
def _seg_bwd(i1, v1, i2, v2):
    return tl.minimum(i1, i2), tl.where(i1 == i2, tl.maximum(v1, v2), tl.where(i1 < i2, v1, v2))


@triton.jit
def _run_max(key, v):
    # key [R]: non-decreasing run ids; v [R] -> the max of v over each element's run
    _, f = tl.associative_scan((key, v), 0, _seg_fwd)           # max over run start .. i
    _, b = tl.associative_scan((key, f), 0, _seg_bwd, reverse=True)  # .. its last element
    return b


@triton.jit
def _block_max(v, BLK: tl.constexpr):
    # v [R] -> the max of v over each element's block of BLK consecutive elements
    R: tl.constexpr = v.shape[0]
    m = tl.max(tl.reshape(v, [R // BLK, BLK]), 1)
    return tl.reshape(tl.broadcast_to(m[:, None], [R // BLK, BLK]), [R])


@triton.jit
def _load_pairs(X, xrow, ok, g, j):
    # x[xrow[r] + 16 g + 2 j + (0, 1)] as fp32 -> (even, odd) [R, G, 8]: each pair of elements
    # loaded as one word of twice their width (16-byte vector loads; a [.., 2] tile with
    # tl.split loads 2 elements at a time), its halves bitcast back
    XT: tl.constexpr = X.dtype.element_ty
    if XT.primitive_bitwidth == 16:
        HT: tl.constexpr = tl.int16
        WT: tl.constexpr = tl.int32
    else:
        HT: tl.constexpr = tl.int32
        WT: tl.constexpr = tl.int64
    W = X.to(tl.pointer_type(WT), bitcast=True)
    w = tl.load(W + (xrow // 2)[:, None, None] + g[None, :, None] * 8 + j[None, None, :],
                mask=ok[:, None, None], other=0)
    lo = w.to(HT).to(XT, bitcast=True).to(tl.float32)
    hi = (w >> XT.primitive_bitwidth).to(HT).to(XT, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _store_rows(X, DATA, SCALE, MICRO, src, dst, ok, scale, run, H, h,
                D: tl.constexpr, FMT: tl.constexpr, SMODE: tl.constexpr,
                EXPLICIT: tl.constexpr, FMAX: tl.constexpr, DIV: tl.constexpr,
                RECIP: tl.constexpr, BLK: tl.constexpr = 1, PAIRS: tl.constexpr = True,
                LOAD_ALL: tl.constexpr = False):
    # Encode rows x[src[r], h, :] and store them at page rows dst[r] (row = (page*H+h)*P+off).
    # SMODE 0: scale [R] given; 1 (token scales): each row's from its amax, stored at SCALE +
    # dst; 2 (runs): each row's from the amax of its run (rows of equal `run` id, adjacent);
    # 4 (blocks): each row's from the amax of its block of BLK consecutive rows.
    # LOAD_ALL: every row of x is read (src must be a valid row everywhere), `ok` only masks
    # the stores (rows not stored may hold anything). Returns the scales [R] used.
    xrow = (src * H + h).to(tl.int64) * D
    drow = dst.to(tl.int64)
    if LOAD_ALL:
        lok = src >= 0
    else:
        lok = ok
    if FMT == 3:
        G: tl.constexpr = D // 16
        g = tl.arange(0, G)
        j = tl.arange(0, 8)
        if PAIRS:
            xe, xo = _load_pairs(X, xrow, lok, g, j)
        else:   # the earlier load (FP4_PAIR_LOADS = False): a [R, G, 8, 2] tile, split
            e = tl.arange(0, 2)
            offs = (g[None, :, None, None] * 16 + j[None, None, :, None] * 2
                    + e[None, None, None, :])
            x = tl.load(X + xrow[:, None, None, None] + offs, mask=lok[:, None, None, None],
                        other=0.0).to(tl.float32)
            xe, xo = tl.split(x)
        a16 = _group_amax_nan(xe, xo)                                          # [R, G]
        if SMODE != 0:
            if _all_finite(a16):
                arow = tl.max(a16, 1)
            else:
                arow = tl.max(_group_amax_finite(xe, xo), 1)
            if SMODE == 2:
                arow = _run_max(run, arow)
            if SMODE == 4:
                arow = _block_max(arow, BLK)
            scale = _scale_of(_div_const(arow, DIV, RECIP))
        packed, mcode = _encode_fp4(xe, xo, scale, a16, EXPLICIT, RECIP)
        tl.store(DATA + drow[:, None, None] * (D // 2) + g[None, :, None] * 8
                 + j[None, None, :], packed, mask=ok[:, None, None])
        tl.store(MICRO + drow[:, None] * G + g[None, :], mcode, mask=ok[:, None])
    else:
        d = tl.arange(0, D)
        x = tl.load(X + xrow[:, None] + d[None, :], mask=lok[:, None], other=0.0)
        if FMT >= 10:
            if FMT == 10:
                if EXPLICIT:
                    y = _round_bf16_bits(x.to(tl.float32))
                else:
                    y = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
                tl.store(DATA + drow[:, None] * D + d[None, :], y, mask=ok[:, None])
            else:
                tl.store(DATA + drow[:, None] * D + d[None, :],
                         x.to(DATA.dtype.element_ty), mask=ok[:, None])
        else:
            x = x.to(tl.float32)
            anan = tl.reduce(tl.abs(x), 1, _max_nan)                            # [R]
            if SMODE != 0:
                if tl.reduce(anan, 0, _max_nan) < float("inf"):
                    arow = anan
                else:
                    arow = tl.max(_finite_abs(x), 1)
                if SMODE == 2:
                    arow = _run_max(run, arow)
                if SMODE == 4:
                    arow = _block_max(arow, BLK)
                scale = _scale_of(_div_const(arow, DIV, RECIP))
            code = _encode_fp8(x, scale, anan, FMT, FMAX, EXPLICIT)
            tl.store(DATA + drow[:, None] * D + d[None, :], code, mask=ok[:, None])
    if SMODE == 1:
        tl.store(SCALE + drow, scale, mask=ok)
    return scale


@triton.jit(do_not_specialize=["N"])
def _calibrate_amax_kernel(X, N, SCALE, AMAX, BLOCK: tl.constexpr):
    # tensor scale not yet calibrated (0): AMAX = finite amax of all of x (else nothing to do)
    # (a grid of at most CALIBRATE_PROGRAMS, each striding over blocks: once calibrated, every
    # later write launches few programs that only read SCALE)
    if tl.load(SCALE) == 0.0:
        a = tl.zeros([BLOCK], tl.float32)
        for b in range(tl.program_id(0), tl.cdiv(N, BLOCK), tl.num_programs(0)):
            i = tl.arange(0, BLOCK).to(tl.int64) + b * BLOCK
            x = tl.load(X + i, mask=i < N, other=0.0).to(tl.float32)
            a = tl.maximum(a, _finite_abs(x))
        tl.atomic_max(AMAX, tl.max(a, 0))


@triton.jit(do_not_specialize=["T", "H"])
def _append_rows_kernel(X, SLOTS, DATA, SCALE, MICRO, AMAX, T, H, D: tl.constexpr,
                        P: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr, SM: tl.constexpr,
                        EXPLICIT: tl.constexpr, FMAX: tl.constexpr, DIV: tl.constexpr,
                        RECIP: tl.constexpr, PAIRS: tl.constexpr = True):
    # plain formats, token scales (SM == 3) or one tensor scale (SM == 1): R tokens of head h
    h = tl.program_id(1)
    t = tl.program_id(0) * R + tl.arange(0, R)
    ok = t < T
    slot = tl.load(SLOTS + t, mask=ok, other=0)
    dst = ((slot // P) * H + h) * P + slot % P
    if SM == 1:
        s0 = tl.load(SCALE)
        s0 = tl.where(s0 == 0.0, _scale_of(_div_const(tl.load(AMAX), DIV, RECIP)), s0)
        scale = tl.zeros([R], tl.float32) + s0
        if (tl.program_id(0) == 0) & (h == 0):
            tl.store(SCALE, s0)
    else:
        scale = tl.full([R], 1.0, tl.float32)
    _store_rows(X, DATA, SCALE, MICRO, t, dst, ok, scale, t, H, h, D, FMT, 1 if SM == 3 else 0,
                EXPLICIT, FMAX, DIV, RECIP, 1, PAIRS)


@triton.jit
def _row_amax(DATA, MICRO, rows, ok, scale, D: tl.constexpr, FMT: tl.constexpr,
              DATA_DT: tl.constexpr):
    # finite amax of the decoded values of page rows `rows` [R] (ok: rows to include)
    rows = rows.to(tl.int64)
    if FMT == 3:
        G: tl.constexpr = D // 16
        g = tl.arange(0, G)
        j = tl.arange(0, 8)
        byte = tl.load(DATA + rows[:, None, None] * (D // 2) + g[None, :, None] * 8
                       + j[None, None, :], mask=ok[:, None, None], other=0)
        mic = tl.load(MICRO + rows[:, None] * G + g[None, :], mask=ok[:, None], other=0)
        mval = mic.to(tl.float8e4nv, bitcast=True).to(tl.float32)[:, :, None]
        lo = _e2m1_value(byte & 15).to(tl.float32) * mval * scale
        hi = _e2m1_value(byte >> 4).to(tl.float32) * mval * scale
        return tl.max(tl.max(tl.max(tl.maximum(_finite_abs(lo), _finite_abs(hi)), 2), 1), 0)
    else:
        d = tl.arange(0, D)
        code = tl.load(DATA + rows[:, None] * D + d[None, :], mask=ok[:, None], other=0)
        return tl.max(tl.max(_finite_abs(_decode_fp8(code, scale, FMT, DATA_DT)), 1), 0)


@triton.jit
def _reencode_rows(DATA, MICRO, rows, ok, old, new, D: tl.constexpr, FMT: tl.constexpr,
                   DATA_DT: tl.constexpr, EXPLICIT: tl.constexpr, FMAX: tl.constexpr,
                   RECIP: tl.constexpr):
    # page rows decoded with scale `old`, encoded again with `new`
    rows = rows.to(tl.int64)
    if FMT == 3:
        G: tl.constexpr = D // 16
        g = tl.arange(0, G)
        j = tl.arange(0, 8)
        bptr = DATA + rows[:, None, None] * (D // 2) + g[None, :, None] * 8 + j[None, None, :]
        mptr = MICRO + rows[:, None] * G + g[None, :]
        byte = tl.load(bptr, mask=ok[:, None, None], other=0)
        mic = tl.load(mptr, mask=ok[:, None], other=0)
        mval = mic.to(tl.float8e4nv, bitcast=True).to(tl.float32)[:, :, None]
        xe = _e2m1_value(byte & 15).to(tl.float32) * mval * old
        xo = _e2m1_value(byte >> 4).to(tl.float32) * mval * old
        R: tl.constexpr = rows.shape[0]
        packed, mcode = _encode_fp4(xe, xo, tl.zeros([R], tl.float32) + new,
                                    _group_amax_nan(xe, xo), EXPLICIT, RECIP)
        tl.store(bptr, packed, mask=ok[:, None, None])
        tl.store(mptr, mcode, mask=ok[:, None])
    else:
        d = tl.arange(0, D)
        ptr = DATA + rows[:, None] * D + d[None, :]
        code = tl.load(ptr, mask=ok[:, None], other=0)
        x = _decode_fp8(code, old, FMT, DATA_DT)
        R: tl.constexpr = rows.shape[0]
        code = _encode_fp8(x, tl.zeros([R], tl.float32) + new, tl.reduce(tl.abs(x), 1, _max_nan),
                           FMT, FMAX, EXPLICIT)
        tl.store(ptr, code, mask=ok[:, None])


@triton.jit
def _grow_scale(scale, cover):
    # formats.grow_page_scale on fp32 scalars: scale * 2^k, the smallest k with result >= cover
    tiny = 1.1754943508222875e-38
    s2 = tl.where(scale < tiny, scale * 4294967296.0, scale)
    c2 = tl.where(cover < tiny, cover * 4294967296.0, cover)
    sb = s2.to(tl.int32, bitcast=True)
    cb = c2.to(tl.int32, bitcast=True)
    e_s = ((sb >> 23) & 0xFF) - tl.where(scale < tiny, 32, 0)
    e_c = ((cb >> 23) & 0xFF) - tl.where(cover < tiny, 32, 0)
    k = e_c - e_s + ((cb & 0x7FFFFF) > (sb & 0x7FFFFF)).to(tl.int32)
    k1 = k // 2
    grown = scale * _exp2i(k1) * _exp2i(k - k1)
    return tl.where(cover > scale, grown, scale)


@triton.jit
def _append_page_run(X, SORTED, ORDER, DATA, SCALE, MICRO, i, T, H, h, D: tl.constexpr,
                     P: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr, DATA_DT: tl.constexpr,
                     EXPLICIT: tl.constexpr, FMAX: tl.constexpr, DIV: tl.constexpr,
                     RECIP: tl.constexpr, PAIRS: tl.constexpr = True):
    # the run of sorted slots starting at i (all in one page), head h
    slot = tl.load(SORTED + i)
    page = slot // P
    k = tl.arange(0, P)
    nxt = tl.load(SORTED + i + k, mask=i + k < T, other=-1)
    n = tl.sum(((nxt >= 0) & (nxt // P == page)).to(tl.int32), 0)
    min_off = (slot % P).to(tl.int32)
    base = (page * H + h) * P  # page row of offset 0 for head h
    old_scale = tl.load(SCALE + page * H + h)
    r = tl.arange(0, R)
    new_amax = 0.0
    for c in range(0, n, R):
        ok = c + r < n
        src = tl.load(ORDER + i + c + r, mask=ok, other=0)
        x = tl.load(X + (src * H + h).to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        new_amax = tl.maximum(new_amax, tl.max(tl.max(_finite_abs(x), 1), 0))
    old_amax = 0.0
    for c in range(0, min_off, R):
        ok = c + r < min_off
        old_amax = tl.maximum(old_amax, _row_amax(DATA, MICRO, base + c + r, ok, old_scale, D,
                                                  FMT, DATA_DT))
    cover = _div_const(new_amax, DIV, RECIP)
    new_scale = tl.where(old_amax == 0, _scale_of(cover), _grow_scale(old_scale, cover))
    if new_scale != old_scale:
        for c in range(0, min_off, R):
            ok = c + r < min_off
            _reencode_rows(DATA, MICRO, base + c + r, ok, old_scale, new_scale, D, FMT, DATA_DT,
                           EXPLICIT, FMAX, RECIP)
    for c in range(0, n, R):
        ok = c + r < n
        src = tl.load(ORDER + i + c + r, mask=ok, other=0)
        s = tl.load(SORTED + i + c + r, mask=ok, other=0)
        _store_rows(X, DATA, SCALE, MICRO, src, base + (s % P), ok,
                    tl.zeros([R], tl.float32) + new_scale, r, H, h, D, FMT, 0, EXPLICIT, FMAX,
                    DIV, RECIP, 1, PAIRS)
    tl.store(SCALE + page * H + h, new_scale)
    return n


@triton.jit(do_not_specialize=["T", "H"])
def _append_pages_kernel(X, SORTED, ORDER, DATA, SCALE, MICRO, T, H, D: tl.constexpr,
                         P: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr,
                         DATA_DT: tl.constexpr, EXPLICIT: tl.constexpr, FMAX: tl.constexpr,
                         DIV: tl.constexpr, RECIP: tl.constexpr, WIN: tl.constexpr,
                         PAIRS: tl.constexpr = True):
    # page scales: program (w, h) handles the runs of sorted slots (one page each) that start
    # in positions [w * WIN, (w + 1) * WIN): WIN = 1 for decode steps (one token per page),
    # WIN = P for bulk writes; runs are visited start to start, so no position is polled
    h = tl.program_id(1)
    base_i = tl.program_id(0) * WIN
    idx = base_i + tl.arange(0, WIN)
    pg = tl.load(SORTED + idx, mask=idx < T, other=-1) // P
    prv = tl.load(SORTED + idx - 1, mask=(idx >= 1) & (idx < T), other=-1) // P
    starts = (idx < T) & ((idx == 0) | (pg != prv))
    i = tl.min(tl.where(starts, idx, base_i + WIN), 0)
    while i < tl.minimum(base_i + WIN, T):
        n = _append_page_run(X, SORTED, ORDER, DATA, SCALE, MICRO, i, T, H, h, D, P, R, FMT,
                             DATA_DT, EXPLICIT, FMAX, DIV, RECIP, PAIRS)
        i = i + n


@triton.jit(do_not_specialize=["T", "H"])
def _append_pages_bulk_kernel(X, SORTED, ORDER, DATA, SCALE, MICRO, T, H, D: tl.constexpr,
                              P: tl.constexpr, W: tl.constexpr, R: tl.constexpr,
                              FMT: tl.constexpr, DATA_DT: tl.constexpr, EXPLICIT: tl.constexpr,
                              FMAX: tl.constexpr, DIV: tl.constexpr, RECIP: tl.constexpr,
                              GROUPED: tl.constexpr):
    # Page scales, bulk writes: program (w, h) owns the runs of sorted slots (one page each)
    # that start in positions [w * W, (w + 1) * W). The runs that lie inside the window and
    # start a page (offset 0: no earlier tokens to keep) are written as one [W, D] tile, in one
    # pass over x: row amax, each run's amax by two segmented scans, scale, encode, store. The
    # others (a page with earlier tokens, the run that crosses the window's end) go through
    # _append_page_run, one after another.
    h = tl.program_id(1)
    i0 = tl.program_id(0) * W
    idx = i0 + tl.arange(0, W)
    live = idx < T
    slot = tl.load(SORTED + idx, mask=live, other=0)
    pg = slot // P
    prv = tl.load(SORTED + idx - 1, mask=live & (idx > 0), other=0)
    start = live & ((idx == 0) | (prv // P != pg))
    fresh = start & (slot % P == 0)
    # run key of each position: 2 * (its run's start - i0) + (that run starts a page); -1 for
    # positions whose run started before the window (the previous program's)
    key = tl.associative_scan(tl.where(start, (idx - i0) * 2 + fresh.to(tl.int32), -1), 0,
                              _max_i32)
    # (vector forms throughout: the interpreter mis-broadcasts scalar booleans into masks)
    zero = tl.zeros([W], tl.int32)
    last = tl.load(SORTED + i0 + W - 1 + zero, mask=i0 + W - 1 + zero < T, other=0)
    after = tl.load(SORTED + i0 + W + zero, mask=i0 + W + zero < T, other=-P)
    last_key = tl.max(tl.where(idx == i0 + W - 1, key, -1), 0)
    crossing = (after // P == last // P) & (key == last_key)
    vec = live & (key >= 0) & ((key & 1) == 1) & (crossing == 0)
    if GROUPED:
        src = idx
    else:
        src = tl.load(ORDER + idx, mask=vec, other=0)
    dst = (pg * H + h) * P + slot % P
    scale = _store_rows(X, DATA, SCALE, MICRO, src, dst, vec, tl.full([W], 1.0, tl.float32),
                        key, H, h, D, FMT, 2, EXPLICIT, FMAX, DIV, RECIP)
    tl.store(SCALE + pg * H + h, scale, mask=vec & start)
    rest = start & (vec == 0)
    i = tl.min(tl.where(rest, idx, i0 + W), 0)
    while i < i0 + W:
        _append_page_run(X, SORTED, ORDER, DATA, SCALE, MICRO, i, T, H, h, D, P, R, FMT,
                         DATA_DT, EXPLICIT, FMAX, DIV, RECIP)
        i = tl.min(tl.where(rest & (idx > i), idx, i0 + W), 0)


@triton.jit(do_not_specialize=["T", "H"])
def _append_pages_tiles_kernel(X, SORTED, ORDER, DATA, SCALE, MICRO, T, H, D: tl.constexpr,
                               P: tl.constexpr, W: tl.constexpr, R: tl.constexpr,
                               FMT: tl.constexpr, DATA_DT: tl.constexpr,
                               EXPLICIT: tl.constexpr, FMAX: tl.constexpr, DIV: tl.constexpr,
                               RECIP: tl.constexpr, GROUPED: tl.constexpr,
                               PART: tl.constexpr = 0, SPEC: tl.constexpr = False):
    # Page scales, bulk writes: program (w, h) owns the runs of sorted slots (one page each)
    # that start in positions [w * W, (w + 1) * W). Let s0 be the first run start there. The
    # tile is positions s0 + [0, W) in W / P blocks of P; a block whose first position starts
    # a page (offset 0) and whose P positions are that whole page (last slot = first + P - 1:
    # slots are increasing within a page's run) is a fresh full page, written in one pass:
    # row amax, block max, scale, encode, store -- no scan, the P rows of a page contiguous in
    # the tile and in the pool. Runs that are not such blocks (a page with earlier tokens, a
    # partial page, a run off the s0 + k P grid after one) go through _append_page_run.
    # SPEC: the tile's rows are read whether or not their block is a full page (positions past
    # T read row T - 1), so the loads of x need not wait for the full-page test's two dependent
    # loads of the sorted slots (`_store_rows` LOAD_ALL; only its stores are masked).
    h = tl.program_id(1)
    i0, idx, live, slot, start, s0 = window_runs(SORTED, T, P, W)
    r = tl.arange(0, W)
    qb = s0 + (r // P) * P          # each tile row's block's first position
    first = tl.load(SORTED + qb, mask=qb < T, other=1)
    last = tl.load(SORTED + qb + P - 1, mask=qb + P - 1 < T, other=-1)
    full = (qb < i0 + W) & (qb + P - 1 < T) & (first % P == 0) & (last == first + P - 1)
    if SPEC:
        src = tl.minimum(s0 + r, T - 1)
        if not GROUPED:
            src = tl.load(ORDER + src)
    elif GROUPED:
        src = s0 + r
    else:
        # masked by the bounds, not by `full` (triton 3.6 refused `mask=full` here: "mask type
        # matches ptr type", then a layout mismatch with tl.where; 3.9 takes both); rows outside
        # a full block are masked by `full` where _store_rows reads x
        src = tl.load(ORDER + s0 + r, mask=s0 + r < T, other=0)
    pg = first // P
    if PART != 2:
        scale = _store_rows(X, DATA, SCALE, MICRO, src, (pg * H + h) * P + r % P, full,
                            tl.full([W], 1.0, tl.float32), r, H, h, D, FMT, 4, EXPLICIT, FMAX,
                            DIV, RECIP, P, LOAD_ALL=SPEC)
        tl.store(SCALE + pg * H + h, scale, mask=full & (r % P == 0))
    if PART != 1:
        rest = uncovered_starts(SORTED, T, idx, live, slot, start, s0, P)
        i = tl.min(tl.where(rest, idx, i0 + W), 0)
        while i < i0 + W:
            _append_page_run(X, SORTED, ORDER, DATA, SCALE, MICRO, i, T, H, h, D, P, R, FMT,
                             DATA_DT, EXPLICIT, FMAX, DIV, RECIP)
            i = tl.min(tl.where(rest & (idx > i), idx, i0 + W), 0)


@triton.jit
def _max_i32(a, b):
    return tl.maximum(a, b)


# --- launcher ------------------------------------------------------------------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_append(x, slots, data, scale, micro, fmt_name: str, granularity: str,
                  grouped: bool = False, zero=None) -> None:
    """Check, then store x [T, H, D] at slots [T] into data / scale / micro (mutated);
    int formats: data / scale / zero (kernels/append_int.py).
    grouped: the caller guarantees that the slots of each page are adjacent and increasing
    (PagePool.reserve's order), so page-scaled writes skip the device sort."""
    if fmt_name not in FORMAT_CODES:
        raise UnsupportedShapeError(f"quantize_append: format {fmt_name!r} has no kernel; "
                                    f"supported {', '.join(FORMAT_CODES)}")
    fmt = FORMAT_CODES[fmt_name]
    spec = format_spec(fmt_name)
    N, H, P = data.shape[:3]
    D = data.shape[3] * (2 if fmt == FMT_E2M1 else 1)
    if spec.family == "int":
        D = data.shape[3] * 8 // spec.bits
    if x.dim() != 3 or tuple(x.shape[1:]) != (H, D) or not x.is_floating_point():
        raise UnsupportedShapeError(f"quantize_append: x must be float [T, {H}, {D}], got "
                                    f"{x.dtype} {tuple(x.shape)}")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0] or slots.dtype not in (torch.int64,
                                                                                torch.int32):
        raise UnsupportedShapeError(f"quantize_append: slots must be int64 [{x.shape[0]}]")
    takes = spec.kernels.append
    if fmt != FMT_PLAIN and granularity not in takes:
        raise UnsupportedShapeError(f"quantize_append: granularity {granularity!r} has no "
                                    f"kernel; supported {', '.join(takes)}")
    if D % 16 or D > 512 or D & (D - 1):
        raise UnsupportedShapeError(f"quantize_append: head_dim {D} must be a power of two "
                                    f"in 16..512")
    if P & (P - 1):
        raise UnsupportedShapeError(f"quantize_append: page size {P} must be a power of two")
    if not data.is_contiguous():
        raise UnsupportedShapeError("quantize_append: page storage must be contiguous")
    if x.device.type != "cuda" and not _interpreting():
        raise UnsupportedShapeError("quantize_append: Triton kernels need CUDA tensors (or "
                                    "TRITON_INTERPRET=1); use PagedTensor.write")
    T = x.shape[0]
    if T == 0:
        return
    if fmt == FMT_E2M1 and x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.float()  # fp4 loads element pairs as one word (_load_pairs); the encode is fp32
    x = x.contiguous()
    slots = slots.to(torch.int64)
    explicit = _interpreting()
    if spec.family == "int":
        if zero is None or scale is None or scale.dtype != torch.float16:
            raise UnsupportedShapeError("quantize_append: int pages need fp16 scale and zero")
        launch_append_int(x, slots, data, scale, zero, spec.bits, granularity, grouped,
                          torch.sort, _iota, explicit)
        return
    recip = not explicit  # torch divides by a python float through its reciprocal on CUDA
    R = max(1, min(64, ROW_TILE_ELEMS // D))
    if fmt == FMT_PLAIN:
        code = {torch.bfloat16: _PLAIN_BF16, torch.float16: _PLAIN_FP16,
                torch.float32: _PLAIN_FP32}[data.dtype]
        dst = data.view(torch.int16) if data.dtype == torch.bfloat16 else data
        _append_rows_kernel[(triton.cdiv(T, R), H)](
            x, slots, dst, x, x, x, T, H, D=D, P=P, R=R, FMT=code, SM=0, EXPLICIT=explicit,
            FMAX=1.0, DIV=1.0, RECIP=recip, num_warps=4)
        return
    fmax = 6.0 if fmt == FMT_E2M1 else float(torch.finfo(data.dtype).max)
    div = 6.0 * 448.0 if fmt == FMT_E2M1 else fmax
    d8 = data.view(torch.uint8)
    m8 = micro.view(torch.uint8) if micro is not None else d8
    data_dt = {FMT_E4M3: tl.float8e4nv, FMT_E5M2: tl.float8e5}.get(fmt, tl.float8e4nv)
    if granularity == "page":
        if grouped:  # runs of one page are already adjacent: identity order
            sorted_slots, order = slots, _iota(T, x.device)
        else:
            sorted_slots, order = torch.sort(slots)
        if T <= BULK_TOKENS or PAGE_BULK == "runs":
            win = 1 if T <= BULK_TOKENS else P
            _append_pages_kernel[(triton.cdiv(T, win), H)](
                x, sorted_slots, order, d8, scale, m8, T, H, D=D, P=P, R=min(R, P), FMT=fmt,
                DATA_DT=data_dt, EXPLICIT=explicit, FMAX=fmax, DIV=div, RECIP=recip, WIN=win,
                PAIRS=FP4_PAIR_LOADS, num_warps=4)
            return
        if PAGE_BULK in ("tiles", "split"):
            W = max(P, PAGE_TILE_ELEMS // D)
            reg = PAGE_TILE_MAXNREG[fmt == FMT_E2M1]
            cap = {"maxnreg": reg} if reg and not explicit else {}
            # "split": the full pages in one launch, the other runs in a second (the two touch
            # disjoint pages); each kernel then builds without the other's code
            for part in ((1, 2) if PAGE_BULK == "split" else (0,)):
                _append_pages_tiles_kernel[(triton.cdiv(T, W), H)](
                    x, sorted_slots, order, d8, scale, m8, T, H, D=D, P=P, W=W, R=min(R, P),
                    FMT=fmt, DATA_DT=data_dt, EXPLICIT=explicit, FMAX=fmax, DIV=div,
                    RECIP=recip, GROUPED=grouped, PART=part, SPEC=PAGE_TILE_SPEC,
                    num_warps=PAGE_TILE_WARPS[fmt == FMT_E2M1], **cap)
            return
        W = max(2 * P, BULK_TILE_ELEMS // D)
        _append_pages_bulk_kernel[(triton.cdiv(T, W), H)](
            x, sorted_slots, order, d8, scale, m8, T, H, D=D, P=P, W=W, R=min(R, P), FMT=fmt,
            DATA_DT=data_dt, EXPLICIT=explicit, FMAX=fmax, DIV=div, RECIP=recip,
            GROUPED=grouped, num_warps=8)
        return
    amax = scale
    elems, warps = FP4_ROW_TILE if fmt == FMT_E2M1 else (ROW_TILE_ELEMS, ROW_TILE_WARPS)
    R = max(1, min(64, elems // D))
    if granularity == "tensor":
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        blk = 4096
        _calibrate_amax_kernel[(min(triton.cdiv(x.numel(), blk), CALIBRATE_PROGRAMS),)](
            x, x.numel(), scale, amax, BLOCK=blk, num_warps=4)
    _append_rows_kernel[(triton.cdiv(T, R), H)](
        x, slots, d8, scale, m8, amax, T, H, D=D, P=P, R=R, FMT=fmt,
        SM=3 if granularity == "token" else 1, EXPLICIT=explicit, FMAX=fmax, DIV=div,
        RECIP=recip, PAIRS=FP4_PAIR_LOADS, num_warps=warps)


_IOTA: dict[torch.device, torch.Tensor] = {}
# grown-out buffers, kept: a CUDA graph captured with a slice of one reads it at every replay
# (freed, its memory went to other tensors and the replayed append read garbage order
# indices: an illegal memory access on the H200, Engine decode graphs of fp8 page-scaled
# pages after a prompt chunk longer than the buffer, 2026-12-05)
_IOTA_RETIRED: list[torch.Tensor] = []


def _iota(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) int64 on device, sliced from a buffer kept per device (no launch per call).
    During a CUDA graph capture a buffer too short is not replaced: the graph gets its own."""
    buf = _IOTA.get(device)
    if buf is None or buf.shape[0] < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.arange(n, dtype=torch.int64, device=device)
        if buf is not None:
            _IOTA_RETIRED.append(buf)
        size = max(n, 1024 if buf is None else 2 * buf.shape[0])
        buf = _IOTA[device] = torch.arange(size, dtype=torch.int64, device=device)
    return buf[:n]


@torch.library.custom_op("kvcompile::quantize_append",
                         mutates_args=("data", "scale", "micro", "zero"))
def quantize_append_op(x: torch.Tensor, slots: torch.Tensor, data: torch.Tensor,
                       scale: torch.Tensor | None, micro: torch.Tensor | None, fmt: str,
                       granularity: str, zero: torch.Tensor | None) -> None:
    # (zero without a default: torch 2.11's dispatcher drops a trailing argument equal to its
    # default from the boxed call, and the version bump of the mutated `zero` then indexes
    # past the arguments -- IndexError on every call through the op, GPU tests, 2026-12-06)
    launch_append(x, slots, data, scale, micro, fmt, granularity, zero=zero)


@quantize_append_op.register_fake
def _(x, slots, data, scale, micro, fmt, granularity, zero):
    return None


def quantize_append(cache, slots: torch.Tensor, x: torch.Tensor, grouped: bool = False, *,
                    direct: bool = False) -> None:
    """Store x [T, Hkv, D] at slots [T] (page * P + offset) of a PagedTensor, as cache.write.

    Through the custom op (traceable), unless direct=True: the runtime's writer, which runs
    eagerly inside kvcompile.attention, launches without the op's dispatch and may pass
    grouped=True (slots in PagePool.reserve's order, see launch_append)."""
    if direct:
        launch_append(x, slots, cache.data, cache.scale, cache.micro, cache.fmt.name,
                      cache.fmt.granularity, grouped, zero=cache.zero)
        return
    torch.ops.kvcompile.quantize_append(x, slots, cache.data, cache.scale, cache.micro,
                                        cache.fmt.name, cache.fmt.granularity, cache.zero)
