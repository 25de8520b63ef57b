"""FP4 E2M1 codec, NVFP4-style, in plain PyTorch: the reference the fp4 kernels are tested against.

Value of an element (docs/architecture.md, "Storage layout"):

    x = e2m1(code) * float(micro) * scale       # (e2m1 * micro) is exact in fp32; one rounding
    scale = amax / (6 * 448)                     # fp32 (>= 2^-126; 1.0 if amax is 0), per block
    micro = e4m3(min(amax_16 / 6 / scale, 448))  # float8_e4m3fn, one per 16 values along D
    code  = rne_e2m1(x / (float(micro) * scale)) # nearest even on the grid, saturating at 6

The division uses the fp32 product float(micro) * scale; where it is 0 the code is 0. The sign
bit is signbit(q), so a small negative value stores -0 (code 8).
Codes are 4 bits, bit 3 the sign; two per byte, element 2i in the low nibble. E2M1 has no NaN:
a NaN element stores code 0 and turns its micro scale into NaN, so the 16 values of its own
micro-block decode to NaN and nothing else does. +-Inf saturates to +-6 * micro * scale.
A micro-block whose micro rounds to 0 (amax_16 below ~2e-6 of the scale's amax) decodes to 0.
"""

from __future__ import annotations

import torch

from kvcompile.errors import UnsupportedShapeError

E2M1_MAX = 6.0
E4M3_MAX = 448.0
MICRO_BLOCK = 16
# fp32 scale = amax / FP4_SCALE_DIVISOR, so that the largest micro scale is E4M3's max.
FP4_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX

# Values of the 16 E2M1 codes: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Round-to-nearest-even on the magnitude grid {0, .5, 1, 1.5, 2, 3, 4, 6}: the code is the count
# of midpoints passed. A tie goes up when the upper neighbour's code is even (0.75, 1.75, 3.5),
# down otherwise (0.25, 1.25, 2.5, 5): code = (m > .25) + (m >= .75) + (m > 1.25) + (m >= 1.75)
# + (m > 2.5) + (m >= 3.5) + (m > 5). Here as one bucketize (count of boundaries < m), with the
# tie-up midpoints moved one fp32 ulp down.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
_BOUNDARIES = torch.where(_TIE_UP, torch.nextafter(_MIDPOINTS, torch.zeros(7)), _MIDPOINTS)

_tables_on: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    if key not in _tables_on:
        _tables_on[key] = {"values": E2M1_VALUES, "bounds": _BOUNDARIES}[name].to(device)
    return _tables_on[key]


def finite_amax(x: torch.Tensor, dim, keepdim: bool = True) -> torch.Tensor:
    """max |x| over `dim`, ignoring NaN and +-Inf; 0 where no value is finite."""
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=dim, keepdim=keepdim)


# Smallest normal fp32: scales are never subnormal, so that x / scale and code * scale keep full
# precision (it only matters for blocks with amax below ~5e-36).
MIN_SCALE = 2.0 ** -126


def scale_from_amax(amax: torch.Tensor, divisor: float) -> torch.Tensor:
    """fp32 scale of a block: 1.0 if amax is 0 (all-zero or all-non-finite block), else
    max(amax / divisor, 2^-126)."""
    amax = amax.float()
    return torch.where(amax > 0, (amax / divisor).clamp(min=MIN_SCALE), 1.0)


def fp4_scale(x: torch.Tensor, dim, keepdim: bool = True) -> torch.Tensor:
    """fp32 scale amax / (6 * 448) over `dim` (finite values only); 1.0 for zero blocks."""
    return scale_from_amax(finite_amax(x.float(), dim, keepdim), FP4_SCALE_DIVISOR)


def _per_vector(scale, x: torch.Tensor) -> torch.Tensor:
    # One scale per vector along D. Accepts a scale broadcastable to x[..., 0], or the keepdim
    # form (same ndim as x, last dim 1). Returns a [..., 1, 1] view for [..., D/16, 16] blocks.
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if scale.dim() < x.dim():
        scale = scale.unsqueeze(-1)
    return scale.unsqueeze(-1)


def _check_head_dim(d: int) -> None:
    if d % MICRO_BLOCK:
        raise UnsupportedShapeError(
            f"fp4_e2m1 needs head_dim to be a multiple of {MICRO_BLOCK} (one micro scale per "
            f"{MICRO_BLOCK} values), got {d}; use fp8_e4m3 or bf16 for this layer")


def fp4_encode(x: torch.Tensor, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] (any float dtype, computed in fp32); scale: fp32, one per vector (see
    `_per_vector`). Returns (packed uint8 [..., D//2], micro float8_e4m3fn [..., D//16])."""
    _check_head_dim(x.shape[-1])
    blocks = x.float().unflatten(-1, (-1, MICRO_BLOCK))                # [..., D/16, 16]
    s = _per_vector(scale, x)                                         # [..., 1, 1]
    micro = micro_scale(finite_amax(blocks, -1), s)                   # [..., D/16, 1]
    code = e2m1_codes(blocks, micro.float() * s)
    micro = torch.where(torch.isnan(blocks).any(-1, keepdim=True), float("nan"), micro.float())
    return pack_e2m1(code.flatten(-2)), micro.squeeze(-1).to(torch.float8_e4m3fn)


def micro_scale(amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 micro scale of blocks with finite amax `amax` under fp32 `scale`."""
    return (amax / E2M1_MAX / scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """Unpacked E2M1 codes uint8 of x / denom (RNE, saturating at 6; code 0 where denom is 0
    and for NaN; the sign bit is signbit(x / denom))."""
    q = torch.where(denom > 0, x / denom, 0.0)
    code = torch.bucketize(q.abs(), _table("bounds", q.device)).to(torch.uint8)  # saturates at 7
    code |= torch.signbit(q).to(torch.uint8) << 3
    return torch.where(torch.isnan(x), 0, code).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., D] -> packed uint8 [..., D//2], element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of unpacked E2M1 codes (any shape)."""
    # index_select: plain advanced indexing of a 16-entry table is ~1000x slower on the CPU.
    vals = _table("values", codes.device).index_select(0, codes.flatten().long())
    return vals.view(codes.shape)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., D//2] -> codes uint8 [..., D], element 2i from the low nibble."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def fp4_decode(packed: torch.Tensor, micro: torch.Tensor, scale) -> torch.Tensor:
    """packed: [..., D//2] uint8; micro: [..., D//16] float8_e4m3fn; scale: one per vector.
    Returns fp32 [..., D] = (e2m1(code) * micro) * scale."""
    codes = unpack_e2m1(packed)
    vals = e2m1_values(codes).unflatten(-1, (-1, MICRO_BLOCK))
    out = vals * micro.float().unsqueeze(-1) * _per_vector(scale, codes)
    return out.flatten(-2)
