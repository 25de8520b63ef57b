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


# torch's CPU fp8 -> fp32 cast of E4M3 runs element by element (about 10 ns per element on
# torch 2.13, 2026-12), and a CPU decode step dequantizes every cached token of every layer: on
# the CPU the codes index a table of the 256 values instead (3-5x faster, the same values).
_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def fp8_to_float(codes: torch.Tensor) -> torch.Tensor:
    """float(codes): fp8 codes [...] -> fp32 [...], NaN kept."""
    if codes.device.type != "cpu":
        return codes.float()
    key = (codes.dtype, codes.device)
    if key not in _TABLES:
        _TABLES[key] = torch.arange(256, dtype=torch.uint8).view(codes.dtype).float()
    flat = codes.reshape(-1).view(torch.uint8).int()
    return _TABLES[key].index_select(0, flat).view(codes.shape)


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
