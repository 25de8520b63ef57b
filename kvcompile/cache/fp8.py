"""FP8 (E4M3 / E5M2) codec and power-of-two scale growth, in plain PyTorch.

    x = float(code) * scale,  scale = max(amax / fmax, 2^-126) over the block's finite values
    code = clamp(x / scale, -fmax, fmax).to(float8)   # RNE, saturating, bit-exact with torch

1.0 is the scale of a block with no finite non-zero value. NaN stays NaN in its own slot;
+-Inf saturates to +-fmax (e4m3fn has no Inf).
"""

from __future__ import annotations

import torch

from kvcompile.cache.fp4 import finite_amax, scale_from_amax


def fp8_scale(x: torch.Tensor, dim, fmax: float, keepdim: bool = True) -> torch.Tensor:
    """max(amax / fmax, 2^-126), amax over `dim` of x's finite values; 1.0 where amax is 0."""
    return scale_from_amax(finite_amax(x.float(), dim, keepdim), fmax)


def fp8_encode(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """clamp(x / scale, -fmax, fmax).to(dtype); scale broadcastable to x. NaN stays NaN."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def fp8_decode(codes: torch.Tensor, scale) -> torch.Tensor:
    return fp8_to_float(codes) * scale


# torch's CPU fp8 -> fp32 cast runs element by element (about 4 ns per element on torch 2.13,
# 2026-12: 230 us for one SmolLM2 layer's K at 320 tokens), and a CPU decode step dequantizes
# every cached token of every layer. On the CPU the codes are widened to fp16 by integer ops
# instead (three vectorized passes), with the same values:
# - E5M2 is the top byte of an fp16: code << 8 is that fp16, exactly (Inf and NaN included).
# - E4M3 (s eeee mmm) placed as the fp16 bits s 0eeee mmm0000000 is the code's value times 2^-8,
#   normal and subnormal codes alike (the exponent biases differ by 8; both formats' subnormals
#   have the exponent of their smallest normal). Every placed value is an fp16 whose fp32 widening
#   is normal, so no denormal is read or made (torch.set_flush_denormal changes nothing); the 2^8
#   folds into the scale multiply that follows. The NaN codes (s 1111 111) come out as +-1.875,
#   above every finite code's +-1.75: rare, found by one min/max pass and set to NaN there.
# The fp16 goes into the scale multiply as it is: fp16 x fp32 computes in fp32, exactly the
# widened value times the scale, rounded once.
E4M3_SHIFT = 2.0 ** 8              # E4M3's value = its fp16-placed bits' value * E4M3_SHIFT
_E4M3_LIMIT = 448.0 / E4M3_SHIFT   # the largest finite E4M3, placed
_SIGN_EXP_MANT = -16512            # int16 0xBF80: the sign bit and the 7 bits e4m3 fills
_E4M3_LIMIT_BITS = 0x3F00          # the placed 448's bits: larger magnitudes are the NaN codes
_FP16_NAN = 0x7E00


def fp8_widen(codes: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(w, factor) with float(codes) == float(w) * factor elementwise, NaN kept: w [...] fp16
    on the CPU (integer ops: see above), elsewhere the fp32 cast with factor 1.0."""
    if codes.device.type != "cpu" or codes.numel() == 0 or codes.dtype not in (
            torch.float8_e4m3fn, torch.float8_e5m2):
        return codes.float(), 1.0
    i16 = codes.view(torch.int8).to(torch.int16)   # sign-extended: the sign lands in bit 15
    if codes.dtype == torch.float8_e5m2:
        return i16.bitwise_left_shift_(8).view(torch.float16), 1.0
    i16.bitwise_left_shift_(7).bitwise_and_(_SIGN_EXP_MANT)
    w = i16.view(torch.float16)
    lo, hi = torch.aminmax(w)
    if float(hi) > _E4M3_LIMIT or float(lo) < -_E4M3_LIMIT:   # (fp16 arithmetic is slow
        i16.masked_fill_((i16 & 0x7FFF) > _E4M3_LIMIT_BITS, _FP16_NAN)   # on the CPU: bits)
    return w, E4M3_SHIFT


def fp8_to_float(codes: torch.Tensor) -> torch.Tensor:
    """float(codes): fp8 codes [...] -> fp32 [...], NaN kept."""
    w, factor = fp8_widen(codes)
    w = w.float()
    return w if factor == 1.0 else w.mul_(factor)


def grow_page_scale(scale: torch.Tensor, cover: torch.Tensor) -> torch.Tensor:
    """The page scale after appending tokens that need `cover` (= their amax / scale_divisor):
    unchanged if cover <= scale, else scale * 2^k with the smallest k such that it is >= cover.

    Growing by a power of two makes re-encoding the page's earlier tokens an exponent shift:
    their decoded values stay bit-identical (outside the fp8 subnormal range). Growing to exactly
    amax / fmax instead re-rounds them at every growth and costs 2.4 dB (E4M3) / 2.6 dB (E5M2)
    when tokens arrive one at a time. With frexp (m in [0.5, 1)): k = e_c - e_s + (m_c > m_s)."""
    m_s, e_s = torch.frexp(scale)
    m_c, e_c = torch.frexp(cover)
    k = e_c - e_s + (m_c > m_s).to(e_c.dtype)
    grown = torch.ldexp(m_s.double(), e_s + k).float()  # == scale * 2^k, exact; no fp32 overflow
    return torch.where(cover > scale, grown, scale)
