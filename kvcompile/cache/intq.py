"""INT4 / INT3 / INT2 asymmetric codec (scale and zero point), in plain PyTorch: the reference
the kernels are tested against.

Value of an element, per group (a token's head_dim, a page's channel, or a whole page):

    x = code * float(scale) + float(zero)        # code in [0, 2^bits - 1]; fp16 scale, zero
    zero  = fp16(lo) rounded toward -inf          # lo, hi: min / max of the group's finite values
    scale = fp16((hi - zero) / (2^bits - 1)) rounded toward +inf
    code  = clamp(rne((x - zero) / scale), 0, 2^bits - 1)      # code 0 where scale is 0

Rounding zero down and scale up makes [zero, zero + levels * scale] cover [lo, hi] whatever the
fp16 rounding, so a channel with a large offset and a small spread (a key outlier channel) keeps
its resolution. Values saturate at fp16's max (65504). A NaN stores code 0 and makes its group's
scale NaN, so the group decodes to NaN and nothing else does; +-Inf saturates to the group's
range. Codes pack along head_dim: int4 two per byte (element 2i in the low nibble), int2 four
per byte (element 4i + j in bits 2j..2j+1), int3 eight per three bytes (element 8i + j in bits
3j..3j+2 of the little-endian 24-bit word made of bytes 3i, 3i+1, 3i+2).
"""

from __future__ import annotations

import torch

from kvcompile.errors import UnsupportedShapeError

INT_BITS = {"int4": 4, "int3": 3, "int2": 2}
PARAM_DTYPE = torch.float16
_F16_MAX = 65504.0


def levels(bits: int) -> int:
    return (1 << bits) - 1


def int_params(x: torch.Tensor, dim, bits: int, keepdim: bool = True,
               mask: torch.Tensor | None = None):
    """(scale, zero) fp16 of the groups of x reduced over `dim`, over the finite values where
    `mask` (all if None); a group with none gets scale 0, zero 0; one holding NaN, scale NaN."""
    x = x.float()
    if mask is not None:
        x = torch.where(mask, x, torch.inf)  # ignored like any non-finite value, never NaN
    fin = torch.isfinite(x)
    lo = torch.where(fin, x, torch.inf).amin(dim=dim, keepdim=keepdim)
    hi = torch.where(fin, x, -torch.inf).amax(dim=dim, keepdim=keepdim)
    empty = ~torch.isfinite(lo)
    lo = torch.where(empty, 0.0, lo).clamp(-_F16_MAX, _F16_MAX)
    hi = torch.where(empty, 0.0, hi).clamp(-_F16_MAX, _F16_MAX)
    scale, zero = params_from_range(lo, hi, bits)
    nan = torch.isnan(x).any(dim=dim, keepdim=keepdim)
    return torch.where(nan, torch.nan, scale.float()).to(PARAM_DTYPE), zero


def params_from_range(lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """fp16 (scale, zero) covering [lo, hi] (fp32, finite, lo <= hi)."""
    zero = lo.to(PARAM_DTYPE)
    down = zero.float() > lo
    zero = torch.where(down, torch.nextafter(zero, zero.new_tensor(-torch.inf)), zero)
    raw = (hi - zero.float()).clamp(min=0) / levels(bits)
    scale = raw.clamp(max=_F16_MAX).to(PARAM_DTYPE)
    up = scale.float() < raw
    scale = torch.where(up, torch.nextafter(scale, scale.new_tensor(torch.inf)), scale)
    return scale, zero


def int_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              bits: int) -> torch.Tensor:
    """Unpacked codes uint8 of x [..., D] for (scale, zero) broadcastable to x."""
    s, z = scale.float(), zero.float()
    q = torch.where(s > 0, (x.float().clamp(-_F16_MAX, _F16_MAX) - z) / s, 0.0)
    q = torch.nan_to_num(q, nan=0.0)
    return torch.round(q).clamp(0, levels(bits)).to(torch.uint8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [..., D] -> packed uint8 [..., D * bits / 8]."""
    if bits == 3:
        c = codes.unflatten(-1, (-1, 8)).int()
        word = c[..., 0]
        for j in range(1, 8):
            word = word | (c[..., j] << (3 * j))
        return torch.stack([(word >> (8 * b)) & 0xFF for b in range(3)], -1).flatten(-2).to(
            torch.uint8)
    per = 8 // bits
    c = codes.unflatten(-1, (-1, per))
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [..., D * bits / 8] -> codes uint8 [..., D]."""
    mask = levels(bits)
    if bits == 3:
        b = packed.unflatten(-1, (-1, 3)).int()
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        return torch.stack([(word >> (3 * j)) & mask for j in range(8)], -1).flatten(-2).to(
            torch.uint8)
    per = 8 // bits
    return torch.stack([(packed >> (bits * j)) & mask for j in range(per)], -1).flatten(-2)


def int_encode(x: torch.Tensor, scale, zero, bits: int) -> torch.Tensor:
    """x [..., D] -> packed uint8 [..., D * bits / 8] for (scale, zero) broadcastable to x."""
    check_head_dim(x.shape[-1], bits)
    return pack(int_codes(x, scale, zero, bits), bits)


def int_decode(packed: torch.Tensor, scale, zero, bits: int) -> torch.Tensor:
    """packed uint8 [..., D * bits / 8] -> fp32 [..., D] = code * scale + zero."""
    return unpack(packed, bits).float() * scale.float() + zero.float()


def covers(scale: torch.Tensor, zero: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           bits: int) -> torch.Tensor:
    """Whether the groups' range [zero, zero + levels * scale] holds [lo, hi] (bool)."""
    z, s = zero.float(), scale.float()
    return (lo >= z) & (hi <= z + levels(bits) * s)


def check_head_dim(d: int, bits: int) -> None:
    per = 8 if bits == 3 else 8 // bits   # codes per packed unit (3 bytes for int3)
    if d % per:
        unit = "three bytes" if bits == 3 else "byte"
        raise UnsupportedShapeError(
            f"int{bits} packs {per} codes per {unit} along head_dim, so head_dim must be a "
            f"multiple of {per}, got {d}; use fp8_e4m3 or bf16 for this layer")
