"""Quantize-and-append: store new tokens' K or V into their pages, in the page's format.

    quantize_append(cache, slots, x)   # cache: PagedTensor; slots [T] int64 (page * P + offset);
                                       # x [T, Hkv, D]. Same result as cache.write(slots, x).

Semantics are PagedTensor.write's (formats.py), bit for bit:
- plain formats: a cast.  token scales: one per (token, head) from that token's amax.
- tensor scale: calibrated from the first write's amax when it is still 0, then fixed.
- page scales grow: a write that raises a (page, head) scale (by a power of two, as
  `grow_page_scale`) re-encodes that page's earlier tokens: decode with the old scale, encode
  with the new. The page's valid tokens before the write are its slots [0, min new offset).

Page-scaled writes sort the slots on the device (no host sync) and run one program per (run of
tokens of one page, head); other writes run one program per (block of tokens, head).
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
from kvcompile.kernels.decode_tiles import FMT_E2M1, FMT_E4M3, FMT_E5M2, FMT_PLAIN, FORMAT_CODES
from kvcompile.kernels.decode_tiles import e2m1_to_f16 as _e2m1_value

_PLAIN_BF16, _PLAIN_FP16, _PLAIN_FP32 = 10, 11, 12
# Page-scaled writes of more tokens than this scan a window of P sorted slots per program
# (bulk prefill); fewer, one slot per program (decode steps).
BULK_TOKENS = 4096


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


@triton.jit
def _encode_fp8(x, scale, FMT: tl.constexpr, FMAX: tl.constexpr, EXPLICIT: tl.constexpr):
    # clamp(x / scale, -fmax, fmax) -> uint8 code; NaN stays NaN
    y = tl.math.div_rn(x, scale)
    y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
    if EXPLICIT:
        if FMT == 1:
            return _round_fp8_bits(y, 3, -6, 7)
        return _round_fp8_bits(y, 2, -14, 15)
    if FMT == 1:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return y.to(tl.float8e5).to(tl.uint8, bitcast=True)


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
    return code.to(DATA_DT, bitcast=True).to(tl.float32) * scale


@triton.jit
def _fp4_codes(q):
    # q: fp32 (x / (micro * scale)) -> e2m1 code: count of grid midpoints passed (ties to even)
    m = tl.abs(q)
    c = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
         + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
         + (m > 5.0).to(tl.int32))
    c = c | ((q.to(tl.int32, bitcast=True) >> 28) & 8)
    return tl.where(q != q, 0, c)


@triton.jit
def _encode_fp4(xe, xo, scale, EXPLICIT: tl.constexpr, RECIP: tl.constexpr):
    # xe, xo: [R, D // 16, 8] even / odd elements of each 16-value micro-block; scale: [R, 1, 1]
    # -> (packed bytes [R, D // 16, 8] uint8, micro codes [R, D // 16] uint8)
    fin_e = tl.where(tl.abs(xe) < float("inf"), tl.abs(xe), 0.0)
    fin_o = tl.where(tl.abs(xo) < float("inf"), tl.abs(xo), 0.0)
    amax16 = tl.max(tl.maximum(fin_e, fin_o), 2)                         # [R, G]
    mic = tl.minimum(tl.math.div_rn(_div_const(amax16, 6.0, RECIP), tl.reshape(scale, [
        scale.shape[0], 1])), 448.0)
    if EXPLICIT:
        mcode = _round_fp8_bits(mic, 3, -6, 7)
    else:
        mcode = mic.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    mval = mcode.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    denom = (mval[:, :, None] * scale)
    ce = _fp4_codes(tl.where(denom > 0, tl.math.div_rn(xe, tl.where(denom > 0, denom, 1.0)),
                             0.0))
    co = _fp4_codes(tl.where(denom > 0, tl.math.div_rn(xo, tl.where(denom > 0, denom, 1.0)),
                             0.0))
    nan_e = xe != xe
    nan_o = xo != xo
    ce = tl.where(nan_e, 0, ce)
    co = tl.where(nan_o, 0, co)
    has_nan = tl.max((nan_e | nan_o).to(tl.int32), 2) > 0
    mcode = tl.where(has_nan, 0x7F, mcode)
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
def _store_rows(X, DATA, SCALE, MICRO, src, dst, ok, scale, H, h,
                D: tl.constexpr, FMT: tl.constexpr, TOKEN_SCALE: tl.constexpr,
                EXPLICIT: tl.constexpr, FMAX: tl.constexpr, DIV: tl.constexpr,
                RECIP: tl.constexpr):
    # Encode rows x[src[r], h, :] and store them at page rows dst[r] (row = (page*H+h)*P+off).
    # scale: [R] fp32 scale of each row (ignored if TOKEN_SCALE: computed from the row's amax)
    xrow = (src * H + h).to(tl.int64) * D
    drow = dst.to(tl.int64)
    if FMT == 3:
        G: tl.constexpr = D // 16
        g = tl.arange(0, G)
        j = tl.arange(0, 8)
        e = tl.arange(0, 2)
        offs = g[None, :, None, None] * 16 + j[None, None, :, None] * 2 + e[None, None, None, :]
        x = tl.load(X + xrow[:, None, None, None] + offs, mask=ok[:, None, None, None],
                    other=0.0).to(tl.float32)
        xe, xo = tl.split(x)
        if TOKEN_SCALE:
            amax = tl.max(tl.max(tl.maximum(_finite_abs(xe), _finite_abs(xo)), 2), 1)
            scale = _div_const(amax, DIV, RECIP)
            scale = tl.where(scale > 0, scale, 1.0)
        sc3 = scale[:, None, None]
        packed, mcode = _encode_fp4(xe, xo, sc3, EXPLICIT, RECIP)
        tl.store(DATA + drow[:, None, None] * (D // 2) + g[None, :, None] * 8
                 + j[None, None, :], packed, mask=ok[:, None, None])
        tl.store(MICRO + drow[:, None] * G + g[None, :], mcode, mask=ok[:, None])
    else:
        d = tl.arange(0, D)
        x = tl.load(X + xrow[:, None] + d[None, :], mask=ok[:, None], other=0.0)
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
            if TOKEN_SCALE:
                scale = _div_const(tl.max(_finite_abs(x), 1), DIV, RECIP)
                scale = tl.where(scale > 0, scale, 1.0)
            code = _encode_fp8(x, scale[:, None], FMT, FMAX, EXPLICIT)
            tl.store(DATA + drow[:, None] * D + d[None, :], code, mask=ok[:, None])
    if TOKEN_SCALE:
        tl.store(SCALE + drow, scale, mask=ok)


@triton.jit(do_not_specialize=["N"])
def _calibrate_amax_kernel(X, N, SCALE, AMAX, BLOCK: tl.constexpr):
    # tensor scale not yet calibrated (0): AMAX = finite amax of all of x (else nothing to do)
    if tl.load(SCALE) == 0.0:
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + i, mask=i < N, other=0.0).to(tl.float32)
        tl.atomic_max(AMAX, tl.max(_finite_abs(x), 0))


@triton.jit(do_not_specialize=["T", "H"])
def _append_rows_kernel(X, SLOTS, DATA, SCALE, MICRO, AMAX, T, H, D: tl.constexpr,
                        P: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr, SM: tl.constexpr,
                        EXPLICIT: tl.constexpr, FMAX: tl.constexpr, DIV: tl.constexpr,
                        RECIP: tl.constexpr):
    # plain formats, token scales (SM == 3) or one tensor scale (SM == 1): R tokens of head h
    h = tl.program_id(1)
    t = tl.program_id(0) * R + tl.arange(0, R)
    ok = t < T
    slot = tl.load(SLOTS + t, mask=ok, other=0)
    dst = ((slot // P) * H + h) * P + slot % P
    if SM == 1:
        s0 = tl.load(SCALE)
        fresh = _div_const(tl.load(AMAX), DIV, RECIP)
        s0 = tl.where(s0 == 0.0, tl.where(fresh > 0, fresh, 1.0), s0)
        scale = tl.zeros([R], tl.float32) + s0
        if (tl.program_id(0) == 0) & (h == 0):
            tl.store(SCALE, s0)
    else:
        scale = tl.full([R], 1.0, tl.float32)
    _store_rows(X, DATA, SCALE, MICRO, t, dst, ok, scale, H, h, D, FMT, SM == 3, EXPLICIT, FMAX,
                DIV, RECIP)


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
        packed, mcode = _encode_fp4(xe, xo, tl.zeros([R, 1, 1], tl.float32) + new, EXPLICIT,
                                    RECIP)
        tl.store(bptr, packed, mask=ok[:, None, None])
        tl.store(mptr, mcode, mask=ok[:, None])
    else:
        d = tl.arange(0, D)
        ptr = DATA + rows[:, None] * D + d[None, :]
        code = tl.load(ptr, mask=ok[:, None], other=0)
        x = _decode_fp8(code, old, FMT, DATA_DT)
        tl.store(ptr, _encode_fp8(x, new, FMT, FMAX, EXPLICIT), mask=ok[:, None])


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
                     RECIP: tl.constexpr):
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
    fresh = tl.where(cover > 0, cover, 1.0)
    new_scale = tl.where(old_amax == 0, fresh, _grow_scale(old_scale, cover))
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
                    tl.zeros([R], tl.float32) + new_scale, H, h, D, FMT, False, EXPLICIT, FMAX,
                    DIV, RECIP)
    tl.store(SCALE + page * H + h, new_scale)
    return n


@triton.jit(do_not_specialize=["T", "H"])
def _append_pages_kernel(X, SORTED, ORDER, DATA, SCALE, MICRO, T, H, D: tl.constexpr,
                         P: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr,
                         DATA_DT: tl.constexpr, EXPLICIT: tl.constexpr, FMAX: tl.constexpr,
                         DIV: tl.constexpr, RECIP: tl.constexpr, WIN: tl.constexpr):
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
                             DATA_DT, EXPLICIT, FMAX, DIV, RECIP)
        i = i + n


# --- launcher ------------------------------------------------------------------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_append(x, slots, data, scale, micro, fmt_name: str, granularity: str,
                  grouped: bool = False) -> None:
    """Check, then store x [T, H, D] at slots [T] into data / scale / micro (mutated).
    grouped: the caller guarantees that the slots of each page are adjacent and increasing
    (PagePool.reserve's order), so page-scaled writes skip the device sort."""
    if fmt_name not in FORMAT_CODES:
        raise UnsupportedShapeError(f"quantize_append: format {fmt_name!r} has no kernel; "
                                    f"supported {', '.join(FORMAT_CODES)}")
    fmt = FORMAT_CODES[fmt_name]
    N, H, P = data.shape[:3]
    D = data.shape[3] * (2 if fmt == FMT_E2M1 else 1)
    if x.dim() != 3 or tuple(x.shape[1:]) != (H, D) or not x.is_floating_point():
        raise UnsupportedShapeError(f"quantize_append: x must be float [T, {H}, {D}], got "
                                    f"{x.dtype} {tuple(x.shape)}")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0] or slots.dtype not in (torch.int64,
                                                                                torch.int32):
        raise UnsupportedShapeError(f"quantize_append: slots must be int64 [{x.shape[0]}]")
    takes = format_spec(fmt_name).kernels.append
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
    x = x.contiguous()
    slots = slots.to(torch.int64)
    explicit = _interpreting()
    recip = not explicit  # torch divides by a python float through its reciprocal on CUDA
    R = max(1, min(64, 4096 // D))
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
        win = 1 if T <= BULK_TOKENS else P
        _append_pages_kernel[(triton.cdiv(T, win), H)](
            x, sorted_slots, order, d8, scale, m8, T, H, D=D, P=P, R=min(R, P), FMT=fmt,
            DATA_DT=data_dt, EXPLICIT=explicit, FMAX=fmax, DIV=div, RECIP=recip, WIN=win,
            num_warps=4)
        return
    amax = scale
    if granularity == "tensor":
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        blk = 4096
        _calibrate_amax_kernel[(triton.cdiv(x.numel(), blk),)](x, x.numel(), scale, amax,
                                                                BLOCK=blk, num_warps=4)
    _append_rows_kernel[(triton.cdiv(T, R), H)](
        x, slots, d8, scale, m8, amax, T, H, D=D, P=P, R=R, FMT=fmt,
        SM=3 if granularity == "token" else 1, EXPLICIT=explicit, FMAX=fmax, DIV=div,
        RECIP=recip, num_warps=4)


_IOTA: dict[torch.device, torch.Tensor] = {}


def _iota(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) int64 on device, sliced from a buffer kept per device (no launch per call)."""
    buf = _IOTA.get(device)
    if buf is None or buf.shape[0] < n:
        buf = _IOTA[device] = torch.arange(max(n, 1024), dtype=torch.int64, device=device)
    return buf[:n]


@torch.library.custom_op("kvcompile::quantize_append", mutates_args=("data", "scale", "micro"))
def quantize_append_op(x: torch.Tensor, slots: torch.Tensor, data: torch.Tensor,
                       scale: torch.Tensor | None, micro: torch.Tensor | None, fmt: str,
                       granularity: str) -> None:
    launch_append(x, slots, data, scale, micro, fmt, granularity)


@quantize_append_op.register_fake
def _(x, slots, data, scale, micro, fmt, granularity):
    return None


def quantize_append(cache, slots: torch.Tensor, x: torch.Tensor, grouped: bool = False, *,
                    direct: bool = False) -> None:
    """Store x [T, Hkv, D] at slots [T] (page * P + offset) of a PagedTensor, as cache.write.

    Through the custom op (traceable), unless direct=True: the runtime's writer, which runs
    eagerly inside kvcompile.attention, launches without the op's dispatch and may pass
    grouped=True (slots in PagePool.reserve's order, see launch_append)."""
    if direct:
        launch_append(x, slots, cache.data, cache.scale, cache.micro, cache.fmt.name,
                      cache.fmt.granularity, grouped)
        return
    torch.ops.kvcompile.quantize_append(x, slots, cache.data, cache.scale, cache.micro,
                                        cache.fmt.name, cache.fmt.granularity)
