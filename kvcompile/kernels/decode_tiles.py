"""Triton helpers that read one tile of paged K or V in any storage format, in registers.

Shared by the decode kernel (decode.py) and usable by the prefill kernel. A tile is T tokens of
one kv head, gathered through the block table: `tok` [T] is each token's row in the pages viewed
as [N * H * P] rows (row = (page * H + head) * P + offset).

Codes are widened to the compute dtype and the block scale is NOT applied: callers fold one
multiplier per token (`load_token_scales`; int zero points: `load_token_zeros`) into scores or
probabilities instead, or per channel (`load_channel_params`) into q's columns or the output's,
so the per-element work is the widening alone (int codes: shifts and masks, then an exact
conversion). On the GPU the widening is inline PTX on packed registers:
an asm block is opaque to Triton, so it runs in the load layout (16 contiguous bytes per thread)
instead of being hoisted into byte-wise shared-memory reads of the dot operand, which is what a
plain `.to(tl.float16)` gets for a transposed (value) operand. Measured in SASS (sm_90, 128-token
fp8 tile, 4 warps): 732 instructions per warp per tile instead of 1054.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from kvcompile.cache.registry import (  # noqa: F401  (the kernels' constants, re-exported)
    BUILTIN_NAMES,
    FMT_E2M1,
    FMT_E2M1_TOKMICRO,
    FMT_E4M3,
    FMT_E5M2,
    FMT_INT2,
    FMT_INT3,
    FMT_INT4,
    FMT_PLAIN,
    SCALE_CHANNEL,
    SCALE_CODES,
    SCALE_NONE,
    SCALE_PAGE,
    SCALE_TENSOR,
    SCALE_TOKEN,
    format_spec,
)

# Format codes and scale modes of the kernels, numbered once in cache/registry.py (decode,
# chunked prefill and append take the same constants). FORMAT_CODES: the formats the append
# kernel also writes; DECODE_FORMAT_CODES: those the decode kernel reads.
FORMAT_CODES = {s.name: s.kernels.code for s in map(format_spec, BUILTIN_NAMES)
                if s.kernels.append}
DECODE_FORMAT_CODES = {s.name: s.kernels.code for s in map(format_spec, BUILTIN_NAMES)
                       if s.kernels.decode}
INT_FMT_BITS = {s.kernels.code: s.bits for s in map(format_spec, BUILTIN_NAMES)
                if s.family == "int"}
# The interpreter's fp8 upcast (triton 3.9) reads e4m3fn's NaN code 0x7F as 480 and e5m2's NaN /
# Inf codes as finite numbers (114688, 65536), so a NaN stored in fp8 codes or E4M3 micro
# scales vanished from the output under it while bf16 pages kept it. GPUs convert them right
# (tests/gpu/test_nan_gpu.py checks): the correction runs under the interpreter only.
FP8_SPECIALS = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# The asm fp4 widening yields e2m1 * micro * 2**-7 (see _e2m1_to_f16_asm): callers multiply the
# token scale by this when ASM is on.
FP4_ASM_FOLD = 2.0**7


@triton.jit
def e2m1_to_f16(code):
    # code: uint8 in 0..15 -> e2m1(code) as fp16, exactly: (c & 8) << 12 | (c & 7) << 9 is the
    # fp16 of e2m1 * 2**-14 (subnormals included), and * 2**14 is exact
    c = code.to(tl.int16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def _e4m3_to_f16_asm(x):
    # x: uint8 e4m3 codes -> fp16, two per cvt.rn.f16x2.e4m3x2
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi; }""",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _e5m2_to_f16_asm(x):
    # x: uint8 e5m2 codes -> fp16: an e5m2 code is the high byte of the fp16 of the same value
    return tl.inline_asm_elementwise(
        asm="""prmt.b32 $0, $2, 0, 0x1404;
        prmt.b32 $1, $2, 0, 0x3424;""",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _e2m1_to_f16_asm(x, m):
    # x: uint8, two e2m1 codes per byte; m: uint8, the e4m3 micro scale of each byte's block.
    # -> (low nibble, high nibble) as fp16 e2m1 * micro * 2**-7, exact: (c & 7) << 9 |
    # (c & 8) << 12 is the fp16 of e2m1 * 2**-14 (subnormals included), and micro * 2**7 stays
    # below fp16's max (a table lookup through prmt measured 7% more instructions).
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 y, t, s, m01, m23, k; .reg .b16 ml, mh;
        mov.b32 {ml, mh}, $5;
        cvt.rn.f16x2.e4m3x2 m01, ml;
        cvt.rn.f16x2.e4m3x2 m23, mh;
        mov.b32 k, 0x58005800;
        mul.rn.f16x2 m01, m01, k;
        mul.rn.f16x2 m23, m23, k;
        prmt.b32 y, $4, 0, 0x4140;
        and.b32 t, y, 0x00070007; shl.b32 t, t, 9;
        and.b32 s, y, 0x00080008; shl.b32 s, s, 12; or.b32 t, t, s;
        mul.rn.f16x2 $0, t, m01;
        and.b32 t, y, 0x00700070; shl.b32 t, t, 5;
        and.b32 s, y, 0x00800080; shl.b32 s, s, 8; or.b32 t, t, s;
        mul.rn.f16x2 $2, t, m01;
        prmt.b32 y, $4, 0, 0x4342;
        and.b32 t, y, 0x00070007; shl.b32 t, t, 9;
        and.b32 s, y, 0x00080008; shl.b32 s, s, 12; or.b32 t, t, s;
        mul.rn.f16x2 $1, t, m23;
        and.b32 t, y, 0x00700070; shl.b32 t, t, 5;
        and.b32 s, y, 0x00800080; shl.b32 s, s, 8; or.b32 t, t, s;
        mul.rn.f16x2 $3, t, m23; }""",
        constraints="=r,=r,=r,=r,r,r", args=[x, m], dtype=(tl.float16, tl.float16),
        is_pure=False, pack=4)


@triton.jit
def _int4_to_f16_asm(x):
    # x: uint8, two int4 codes per byte -> (low nibble, high nibble) as fp16, exactly, with no
    # int -> float conversion: (c & 0xF) | 0x6400 is the fp16 of 1024 + c, minus 1024; the high
    # nibble is masked in place, 0x6400 | c << 4 = 1024 + 16 c, and one fma by 1/16 (0x2C00)
    # and -64 (0xD400) gives c (both steps exact). 10 instructions per 8 codes.
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 y, t, k, h, n;
        mov.b32 k, 0x64006400;
        mov.b32 h, 0x2C002C00;
        mov.b32 n, 0xD400D400;
        prmt.b32 y, $4, 0, 0x4140;
        and.b32 t, y, 0x000F000F; or.b32 t, t, k;
        sub.rn.f16x2 $0, t, k;
        and.b32 t, y, 0x00F000F0; or.b32 t, t, k;
        fma.rn.f16x2 $2, t, h, n;
        prmt.b32 y, $4, 0, 0x4342;
        and.b32 t, y, 0x000F000F; or.b32 t, t, k;
        sub.rn.f16x2 $1, t, k;
        and.b32 t, y, 0x00F000F0; or.b32 t, t, k;
        fma.rn.f16x2 $3, t, h, n; }""",
        constraints="=r,=r,=r,=r,r", args=[x], dtype=(tl.float16, tl.float16),
        is_pure=False, pack=4)


@triton.jit
def fp8_specials(x, y):
    # x: fp8 codes (e4m3fn / e5m2), y: x widened -> y with NaN (e5m2: also +-Inf) where x
    # holds them (see FP8_SPECIALS)
    if FP8_SPECIALS:
        b = x.to(tl.uint8, bitcast=True)
        m = b & 0x7F
        if x.dtype == tl.float8e5:
            y = tl.where(m == 0x7C, tl.where(b > 0x7F, float("-inf"), float("inf")), y)
            y = tl.where(m > 0x7C, float("nan"), y)
        else:
            y = tl.where(m == 0x7F, float("nan"), y)
    return y


@triton.jit
def load_token_scales(scale_ptr, page, off, kvh, H, P: tl.constexpr, MODE: tl.constexpr,
                      ok):
    # -> fp32 [T]: the block scale of each token (1 for plain formats; 0 where not ok)
    if MODE == 1:
        s = tl.load(scale_ptr + off * 0)
    elif MODE == 2:
        s = tl.load(scale_ptr + page * H + kvh, mask=ok, other=0.0)
    elif MODE == 3:
        s = tl.load(scale_ptr + (page * H + kvh) * P + off, mask=ok, other=0.0)
    else:
        s = tl.full(off.shape, 1.0, tl.float32)
    return s.to(tl.float32)


@triton.jit
def load_token_zeros(zero_ptr, page, off, kvh, H, P: tl.constexpr, MODE: tl.constexpr, ok):
    # -> fp32 [T]: the int zero point of each token (page / token modes; 0 where not ok)
    if MODE == 2:
        z = tl.load(zero_ptr + page * H + kvh, mask=ok, other=0.0)
    else:
        z = tl.load(zero_ptr + (page * H + kvh) * P + off, mask=ok, other=0.0)
    return z.to(tl.float32)


@triton.jit
def load_channel_params(scale_ptr, zero_ptr, page0, kvh, H, D: tl.constexpr,
                        HAS_ZERO: tl.constexpr, n_ok, HALVES: tl.constexpr = 0):
    # -> (scales, zero points; 0 without) of page page0 (a scalar); n_ok: int scalar, 0 loads
    # nothing (0). HALVES 0: [D] each, as stored; 1 (fp16 params): int32 words [D // 2], each
    # the (even, odd) channel pair of one code byte (channel_pair splits them): elementwise
    # from the load, so the vectors load in the layout their use needs
    row = (page0 * H + kvh).to(tl.int64) * D
    if HALVES == 1:
        tl.static_assert(scale_ptr.dtype.element_ty == tl.float16)
        c = tl.arange(0, D // 2)
        m = c < (D // 2) * n_ok
        s = tl.load(scale_ptr.to(tl.pointer_type(tl.int32)) + row // 2 + c, mask=m, other=0)
        if HAS_ZERO:
            z = tl.load(zero_ptr.to(tl.pointer_type(tl.int32)) + row // 2 + c, mask=m,
                        other=0)
        else:
            z = s * 0
    else:
        c = tl.arange(0, D)
        m = c < D * n_ok
        s = tl.load(scale_ptr + row + c, mask=m, other=0.0)
        if HAS_ZERO:
            z = tl.load(zero_ptr + row + c, mask=m, other=0.0)
        else:
            z = s * 0.0
    return s, z


@triton.jit
def channel_pair(w):
    # int32 words of load_channel_params (HALVES 1) -> (even, odd) channels, fp16
    even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return even, odd


@triton.jit
def load_row_pair(ptr, row, ok, D: tl.constexpr, HALVES: tl.constexpr, CDT: tl.constexpr):
    # rows [T] of D elements (q, bf16 residual pages) -> (a, b) in CDT, 0 where not ok:
    # HALVES 0: all columns [T, D] (b = a); 1: even / odd columns; 2: first / second half
    if HALVES == 0:
        d = tl.arange(0, D)
        a = tl.load(ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(CDT)
        b = a
    else:
        h = tl.arange(0, D // 2)
        if HALVES == 1:
            ca = 2 * h
            cb = ca + 1
        else:
            ca = h
            cb = h + D // 2
        a = tl.load(ptr + row[:, None] * D + ca[None, :], mask=ok[:, None], other=0.0).to(CDT)
        b = tl.load(ptr + row[:, None] * D + cb[None, :], mask=ok[:, None], other=0.0).to(CDT)
    return a, b


@triton.jit
def _rotated_cols(ptr, row, ok, cos_ptr, sin_ptr, cols, D: tl.constexpr):
    # columns `cols` of rows [T] of D elements, RoPE-rotated in fp32 (HF rotate_half layout):
    # x_c * cos_c + sign_c * x_(c + D/2 mod D) * sin_c, sign -1 in the first half
    x = tl.load(ptr + row[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
    y = tl.load(ptr + row[:, None] * D + ((cols + D // 2) % D)[None, :], mask=ok[:, None],
                other=0.0)
    c = tl.load(cos_ptr + cols)
    s = tl.where(cols < D // 2, -1.0, 1.0) * tl.load(sin_ptr + cols)
    return x.to(tl.float32) * c[None, :] + y.to(tl.float32) * s[None, :]


@triton.jit
def load_rotated_pair(ptr, row, ok, cos_ptr, sin_ptr, D: tl.constexpr, HALVES: tl.constexpr,
                      CDT: tl.constexpr):
    # load_row_pair of the rows rotated by RoPE with cos / sin [D] fp32 (the re-rotated sinks'
    # query, eviction/aside.py), in fp32 and rounded once to CDT
    if HALVES == 0:
        a = _rotated_cols(ptr, row, ok, cos_ptr, sin_ptr, tl.arange(0, D), D).to(CDT)
        b = a
    else:
        h = tl.arange(0, D // 2)
        if HALVES == 1:
            ca = 2 * h
            cb = ca + 1
        else:
            ca = h
            cb = h + D // 2
        a = _rotated_cols(ptr, row, ok, cos_ptr, sin_ptr, ca, D).to(CDT)
        b = _rotated_cols(ptr, row, ok, cos_ptr, sin_ptr, cb, D).to(CDT)
    return a, b


@triton.jit
def _codes_to_f16(c):
    # uint8 codes -> fp16, exactly, with no int -> float conversion (I2F runs at 16 per clock
    # and SM on sm_90, an int4 tile would wait on it): 0x6400 | c is the fp16 of 1024 + c, and
    # subtracting 1024 is exact
    return (c.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _bits3(w, shift: tl.constexpr):
    return ((w >> shift) & 7).to(tl.uint8)


@triton.jit
def _unpack_int(x, D: tl.constexpr, BITS: tl.constexpr):
    # packed rows -> codes [T, D] int32 in head_dim order (intq.py): int4 / int2: x uint8
    # [T, D * BITS / 8], element (8 / BITS) * i + j in bits BITS*j of byte i; int3: x int32
    # [T, D / 8], the 24-bit words of three bytes, element 8i + j in bits 3j of word i.
    # The parts are interleaved by nested joins: join's new axis is the fastest.
    # Codes stay 8-bit until the join (a quarter of the registers of int32 parts).
    T: tl.constexpr = x.shape[0]
    if BITS == 4:
        y = tl.join(x & 15, x >> 4)
    elif BITS == 2:
        y = tl.join(tl.join(x & 3, (x >> 4) & 3), tl.join((x >> 2) & 3, (x >> 6) & 3))
    else:
        y = tl.join(tl.join(tl.join(_bits3(x, 0), _bits3(x, 12)),
                            tl.join(_bits3(x, 6), _bits3(x, 18))),
                    tl.join(tl.join(_bits3(x, 3), _bits3(x, 15)),
                            tl.join(_bits3(x, 9), _bits3(x, 21))))
    return tl.reshape(y, [T, D])


@triton.jit
def load_codes(data_ptr, micro_ptr, tok, ok, D: tl.constexpr, FMT: tl.constexpr,
               ASM: tl.constexpr, BIG: tl.constexpr, C0: tl.constexpr = 0, W: tl.constexpr = 0):
    # tok: [T] token rows; ok: [T] rows to read (others read as 0).
    # -> raw (codes, micro): plain / fp8: columns [C0, C0 + W) of each row ([T, W]; W = 0: all
    # D), uint8 for fp8 when ASM, micro unused; int: the packed bytes of those columns (int3:
    # 24-bit words), micro unused; fp4: bytes [T, D // 16, 8] (the 16 codes of one micro block
    # on the last axis, so the micro scale [T, D // 16] broadcasts along it); fp4 with micro
    # scales along tokens: bytes [T, D // 2] and the (even, odd) columns' micro [T, D // 2, 2]
    if BIG:
        tok = tok.to(tl.int64)
    if FMT == 5 or FMT == 7:  # int4 / int2: bytes [T, W * bits / 8]
        PER: tl.constexpr = 2 if FMT == 5 else 4
        WW: tl.constexpr = D if W == 0 else W
        cols = C0 // PER + tl.arange(0, WW // PER)
        x = tl.load(data_ptr + tok[:, None] * (D // PER) + cols[None, :], mask=ok[:, None],
                    other=0)
        return x, x
    elif FMT == 6:  # int3: 24-bit words [T, W / 8] from three strided byte loads
        WW: tl.constexpr = D if W == 0 else W
        base = data_ptr + tok[:, None] * (3 * D // 8) + 3 * (C0 // 8 + tl.arange(0, WW // 8))[
            None, :]
        b0 = tl.load(base, mask=ok[:, None], other=0).to(tl.int32)
        b1 = tl.load(base + 1, mask=ok[:, None], other=0).to(tl.int32)
        b2 = tl.load(base + 2, mask=ok[:, None], other=0).to(tl.int32)
        x = b0 | (b1 << 8) | (b2 << 16)
        return x, x
    elif FMT == 4:  # fp4, micro scales along tokens: bytes [T, D/2], micro (even, odd) cols
        cols = tl.arange(0, D // 2)
        byte = tl.load(data_ptr + tok[:, None] * (D // 2) + cols[None, :], mask=ok[:, None],
                       other=0)
        # micro row of token row tok = (page * H + head) * P + off: (page * H + head) * P/16
        # + off / 16 = tok // 16 (P is a multiple of 16)
        mrow = tok[:, None] // 16 * D
        m_lo = tl.load(micro_ptr + mrow + 2 * cols[None, :], mask=ok[:, None], other=0.0)
        m_hi = tl.load(micro_ptr + mrow + 2 * cols[None, :] + 1, mask=ok[:, None], other=0.0)
        # e4m3 is exact in fp16; joined so that (codes, micro) stay one pair
        return byte, tl.join(fp8_specials(m_lo, m_lo.to(tl.float16)),
                             fp8_specials(m_hi, m_hi.to(tl.float16)))
    elif FMT == 3:
        T: tl.constexpr = tok.shape[0]
        cols = tl.arange(0, D // 2)
        byte = tl.load(data_ptr + tok[:, None] * (D // 2) + cols[None, :], mask=ok[:, None],
                       other=0)
        grp = tl.arange(0, D // 16)
        if ASM:
            micro = tl.load(micro_ptr.to(tl.pointer_type(tl.uint8)) + tok[:, None] * (D // 16)
                            + grp[None, :], mask=ok[:, None], other=0)
        else:
            micro = tl.load(micro_ptr + tok[:, None] * (D // 16) + grp[None, :],
                            mask=ok[:, None], other=0.0)
        return tl.reshape(byte, [T, D // 16, 8]), micro
    else:
        WW: tl.constexpr = D if W == 0 else W
        cols = C0 + tl.arange(0, WW)
        if ASM and (FMT == 1 or FMT == 2):
            x = tl.load(data_ptr.to(tl.pointer_type(tl.uint8)) + tok[:, None] * D
                        + cols[None, :], mask=ok[:, None], other=0)
        else:
            x = tl.load(data_ptr + tok[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
        return x, x


@triton.jit
def widen(x, micro, D: tl.constexpr, FMT: tl.constexpr, CDT: tl.constexpr, ASM: tl.constexpr):
    # raw codes from load_codes -> CDT, unscaled: ([T, D], same) for plain / fp8 / int (int
    # codes: exact integers, zero point not applied); for fp4 the (low, high) nibble halves
    # [T, D // 2] each, i.e. the even and odd elements of head_dim
    if FMT == 5:
        # int4: the (low, high) nibble halves [T, D // 2], i.e. the even and odd elements of
        # head_dim (like fp4), so no nibble interleave is built
        if ASM:
            lo, hi = _int4_to_f16_asm(x)
        else:
            lo = _codes_to_f16(x & 15)
            hi = _codes_to_f16(x >> 4)
        return lo.to(CDT), hi.to(CDT)
    elif FMT == 6 or FMT == 7:
        y = _codes_to_f16(_unpack_int(x, D, 3 if FMT == 6 else 2))
        return y.to(CDT), y.to(CDT)
    elif FMT == 4:
        m_lo, m_hi = tl.split(micro)
        lo = e2m1_to_f16(x & 15).to(CDT) * m_lo.to(CDT)
        hi = e2m1_to_f16(x >> 4).to(CDT) * m_hi.to(CDT)
        return lo, hi
    elif FMT == 3:
        T: tl.constexpr = x.shape[0]
        if ASM:
            lo, hi = _e2m1_to_f16_asm(x, micro[:, :, None])
        else:
            mic = fp8_specials(micro, micro.to(CDT))[:, :, None]
            lo = e2m1_to_f16(x & 15).to(CDT) * mic
            hi = e2m1_to_f16(x >> 4).to(CDT) * mic
        return tl.reshape(lo, [T, D // 2]), tl.reshape(hi, [T, D // 2])
    elif ASM and FMT == 1:
        y = _e4m3_to_f16_asm(x)
        return y, y
    elif ASM and FMT == 2:
        y = _e5m2_to_f16_asm(x)
        return y, y
    else:
        y = x.to(CDT)
        if FMT == 1 or FMT == 2:
            y = fp8_specials(x, y)
        return y, y


@triton.jit
def load_tile(data_ptr, micro_ptr, tok, ok, D: tl.constexpr, FMT: tl.constexpr,
              CDT: tl.constexpr, ASM: tl.constexpr, BIG: tl.constexpr):
    # load_codes + widen
    x, m = load_codes(data_ptr, micro_ptr, tok, ok, D, FMT, ASM, BIG)
    return widen(x, m, D, FMT, CDT, ASM)
