"""Storage formats of the paged KV cache, in plain PyTorch: the reference every kernel is tested
against. Layout and value semantics: docs/architecture.md, "Storage layout".

    fmt = resolve_format("fp8_e4m3", torch.bfloat16)          # page-granular scales
    k = fmt.allocate(num_pages, num_kv_heads, page_size, head_dim, device)
    k.write(slots, k_new)                                     # slots [T]: page * P + offset
    pages = k.read(page_ids)                                  # [n, H, P, D] fp32

fp8: x = float(code) * scale, scale = max(amax / fmax, 2^-126) with amax over the finite values
(1.0 for a zero block); code = clamp(x / scale, -fmax, fmax).to(float8): RNE, saturating,
bit-exact with torch's cast.
fp4: see fp4.py. Page-granular scales grow as tokens are appended (`grow_page_scale`: by powers
of two); a write that raises a (page, head) scale re-encodes that page's earlier tokens (decode
with the old scale, encode with the new), so every token is decoded with its page's one scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.cache.fp4 import (
    E2M1_VALUES,
    FP4_SCALE_DIVISOR,
    MICRO_BLOCK,
    finite_amax,
    fp4_decode,
    fp4_encode,
    fp4_scale,
    scale_from_amax,
)
from kvcompile.errors import CacheStateError, KVConfigError, UnsupportedShapeError

FORMAT_NAMES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
GRANULARITIES = ("page", "token", "tensor")

_STORAGE_DTYPE = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp4_e2m1": torch.uint8,
}
_BITS = {"bf16": 16, "fp16": 16, "fp32": 32, "fp8_e4m3": 8, "fp8_e5m2": 8, "fp4_e2m1": 4}
_AUTO = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

__all__ = [
    "FORMAT_NAMES", "GRANULARITIES", "E2M1_VALUES", "KVFormat", "PagedTensor", "resolve_format",
    "format_table", "find_nonfinite", "fp8_scale", "fp8_encode", "fp8_decode", "fp4_scale",
    "fp4_encode", "fp4_decode", "finite_amax", "grow_page_scale",
]


# --- fp8 codec (fp32 in / out) ---------------------------------------------------------------

def fp8_scale(x: torch.Tensor, dim, fmax: float, keepdim: bool = True) -> torch.Tensor:
    """max(amax / fmax, 2^-126), amax over `dim` of x's finite values; 1.0 where amax is 0."""
    return scale_from_amax(finite_amax(x.float(), dim, keepdim), fmax)


def fp8_encode(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """clamp(x / scale, -fmax, fmax).to(dtype); scale broadcastable to x. NaN stays NaN."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def fp8_decode(codes: torch.Tensor, scale) -> torch.Tensor:
    return codes.float() * scale


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


# --- formats ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVFormat:
    """One storage format: `name` in FORMAT_NAMES; for fp8/fp4 the scale `granularity`
    ("page": one fp32 scale per (page, kv head); "token": per (page, kv head, slot); "tensor": one
    per layer, `static_scale` or calibrated on the first write as its amax / scale_divisor)."""

    name: str
    granularity: str = "page"
    static_scale: float | None = None

    def __post_init__(self):
        if self.name not in FORMAT_NAMES:
            raise KVConfigError("kv_dtype", self.name, ", ".join(map(repr, FORMAT_NAMES)))
        if self.granularity not in GRANULARITIES:
            raise KVConfigError("scale_granularity", self.granularity,
                                ", ".join(map(repr, GRANULARITIES)))
        if self.static_scale is not None:
            v = self.static_scale
            if not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise KVConfigError("static_scale", v, "None or a finite float > 0")
            if self.is_quantized and self.granularity != "tensor":
                raise KVConfigError("static_scale", self.static_scale, "None",
                                    hint="A static scale needs scale_granularity='tensor'.")

    @property
    def is_quantized(self) -> bool:
        return self.name.startswith(("fp8", "fp4"))

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE_DTYPE[self.name]

    @property
    def fmax(self) -> float:
        """Largest code value: 448 / 57344 for fp8, 6 for fp4, the dtype's max otherwise."""
        if self.name == "fp4_e2m1":
            return 6.0
        return float(torch.finfo(self.storage_dtype).max)

    @property
    def scale_divisor(self) -> float:
        """scale = amax / scale_divisor: fmax for fp8, 6 * 448 for fp4."""
        return FP4_SCALE_DIVISOR if self.name == "fp4_e2m1" else self.fmax

    @property
    def bits_per_value(self) -> int:
        return _BITS[self.name]

    @property
    def micro_block(self) -> int | None:
        return MICRO_BLOCK if self.name == "fp4_e2m1" else None

    def bytes_per_token(self, num_heads: int, head_dim: int, page_size: int) -> float:
        """Bytes one token takes in one K (or V) tensor of one layer: data, micro scales, and its
        share of the fp32 scales (a page scale counts 4 / page_size; a tensor scale 0)."""
        per_head = head_dim * self.bits_per_value / 8
        if self.micro_block:
            per_head += head_dim // self.micro_block
        if self.is_quantized:
            per_head += {"page": 4 / page_size, "token": 4.0, "tensor": 0.0}[self.granularity]
        return num_heads * per_head

    def allocate(self, num_pages: int, num_heads: int, page_size: int, head_dim: int,
                 device=None) -> PagedTensor:
        return PagedTensor(self, num_pages, num_heads, page_size, head_dim, device)


def resolve_format(kv_dtype: str, model_dtype: torch.dtype, granularity: str = "page",
                   static_scale: float | None = None) -> KVFormat:
    """KVConfig's kv_dtype ("auto" = the model's dtype) and scale options -> a KVFormat.
    Scale options are ignored for the unquantized formats."""
    if kv_dtype == "auto":
        if model_dtype not in _AUTO:
            raise KVConfigError("kv_dtype", "auto", ", ".join(map(repr, FORMAT_NAMES)),
                                hint=f"The model's dtype {model_dtype} has no storage format of "
                                     f"its own; name one explicitly.")
        kv_dtype = _AUTO[model_dtype]
    if kv_dtype not in FORMAT_NAMES:
        raise KVConfigError("kv_dtype", kv_dtype, "'auto', " + ", ".join(map(repr, FORMAT_NAMES)))
    if kv_dtype in ("bf16", "fp16", "fp32"):
        return KVFormat(kv_dtype)
    return KVFormat(kv_dtype, granularity, static_scale)


def format_table(num_layers: int, num_kv_heads: int, head_dim: int,
                 page_size: int) -> list[dict]:
    """Bytes per token of the whole cache (all layers, K + V) for each format and granularity."""
    bf16 = 2 * num_layers * KVFormat("bf16").bytes_per_token(num_kv_heads, head_dim, page_size)
    rows = []
    for name in FORMAT_NAMES:
        for gran in (GRANULARITIES if name.startswith(("fp8", "fp4")) else ("-",)):
            fmt = KVFormat(name, "page" if gran == "-" else gran)
            nbytes = 2 * num_layers * fmt.bytes_per_token(num_kv_heads, head_dim, page_size)
            rows.append({"format": name, "granularity": gran, "bytes_per_token": nbytes,
                         "bits_per_value": 8 * nbytes / (2 * num_layers * num_kv_heads * head_dim),
                         "ratio_vs_bf16": nbytes / bf16})
    return rows


def find_nonfinite(x: torch.Tensor) -> tuple[int, ...] | None:
    """Index (token, head, dim) of the first NaN/Inf of x [T, H, D] in row-major order, or None."""
    bad = ~torch.isfinite(x)
    if not bool(bad.any()):
        return None
    flat = int(bad.flatten().nonzero()[0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x.shape))


# --- paged storage ---------------------------------------------------------------------------

class PagedTensor:
    """One layer's keys (or values) in pages, as in docs/architecture.md:

    data:  [N, H, P, D] in the storage dtype (fp4: [N, H, P, D//2] uint8, two codes per byte)
    scale: fp32, page [N, H] | token [N, H, P] | tensor [1] (0.0 until calibrated); None if
           unquantized
    micro: fp4 only, [N, H, P, D//16] float8_e4m3fn

    Storage is torch.empty: slots never written hold arbitrary values (NaN included), so readers
    mask them with `where`, never by multiplying with zero.
    """

    def __init__(self, fmt: KVFormat, num_pages: int, num_heads: int, page_size: int,
                 head_dim: int, device=None):
        for what, v in (("num_pages", num_pages), ("num_heads", num_heads),
                        ("page_size", page_size), ("head_dim", head_dim)):
            if not isinstance(v, int) or v < 1:
                raise UnsupportedShapeError(f"PagedTensor {what}={v!r}: must be an int >= 1")
        if fmt.name == "fp4_e2m1" and head_dim % MICRO_BLOCK:
            raise UnsupportedShapeError(
                f"fp4_e2m1 needs head_dim to be a multiple of {MICRO_BLOCK}, got {head_dim}; "
                f"use fp8_e4m3 or bf16 for this layer")
        self.fmt = fmt
        self.num_pages, self.num_heads, self.page_size, self.head_dim = (
            num_pages, num_heads, page_size, head_dim)
        n, h, p, d = num_pages, num_heads, page_size, head_dim
        stored_d = d // 2 if fmt.name == "fp4_e2m1" else d
        self.data = torch.empty(n, h, p, stored_d, dtype=fmt.storage_dtype, device=device)
        self.scale: torch.Tensor | None = None
        self.micro: torch.Tensor | None = None
        if fmt.is_quantized:
            if fmt.granularity == "tensor":
                self.scale = torch.full((1,), float(fmt.static_scale or 0.0), device=device)
            else:
                shape = (n, h) if fmt.granularity == "page" else (n, h, p)
                self.scale = torch.ones(shape, dtype=torch.float32, device=device)
        if fmt.name == "fp4_e2m1":
            self.micro = torch.empty(n, h, p, d // MICRO_BLOCK, dtype=torch.float8_e4m3fn,
                                     device=device)

    def __repr__(self) -> str:
        return (f"PagedTensor({self.fmt.name}/{self.fmt.granularity}, pages={self.num_pages}, "
                f"heads={self.num_heads}, page_size={self.page_size}, head_dim={self.head_dim})")

    # -- codec of this format; scale in keepdim form, broadcastable to x [..., D] --

    def _encode(self, x: torch.Tensor, scale: torch.Tensor):
        if self.fmt.name == "fp4_e2m1":
            return fp4_encode(x, scale)
        return fp8_encode(x, scale, self.fmt.storage_dtype), None

    def _decode(self, codes: torch.Tensor, micro: torch.Tensor | None, scale: torch.Tensor):
        if self.fmt.name == "fp4_e2m1":
            return fp4_decode(codes, micro, scale)
        return fp8_decode(codes, scale)

    def scale_of(self, page_ids: torch.Tensor) -> torch.Tensor:
        """The fp32 scale of every slot of pages page_ids [n], broadcastable to [n, H, P, 1]."""
        g = self.fmt.granularity
        if g == "page":
            return self.scale[page_ids][:, :, None, None]
        if g == "token":
            return self.scale[page_ids][..., None]
        return self.scale.view(1, 1, 1, 1)

    # -- public API --

    def read(self, page_ids: torch.Tensor) -> torch.Tensor:
        """page_ids: [n] -> dequantized pages [n, H, P, D] fp32."""
        page_ids = torch.as_tensor(page_ids, dtype=torch.long, device=self.data.device)
        codes = self.data[page_ids]
        if not self.fmt.is_quantized:
            return codes.float()
        micro = self.micro[page_ids] if self.micro is not None else None
        return self._decode(codes, micro, self.scale_of(page_ids))

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize and append. slots: [T] int (page * P + offset), distinct; x: [T, H, D].

        Within each page touched, the slots before the smallest new offset are the page's valid
        tokens. A page scale is set from the new tokens if the valid ones have no finite non-zero
        value, else raised by `grow_page_scale` when the new tokens need it, re-encoding the
        valid tokens of that (page, head). Token scales come from each token; tensor scales are
        static or calibrated on the first write. NaN / Inf never enter a scale."""
        self._check_write(slots, x)
        if x.shape[0] == 0:
            return
        slots = slots.to(device=self.data.device, dtype=torch.long)
        x = x.to(self.data.device)
        page, off = slots // self.page_size, slots % self.page_size
        if not self.fmt.is_quantized:
            self.data[page, :, off] = x.to(self.fmt.storage_dtype)
            return
        x = x.float()
        g = self.fmt.granularity
        if g == "page":
            self._write_page_scaled(page, off, x)
            return
        if g == "tensor":
            self.calibrate(x)
            scale = self.scale.view(1, 1, 1)
        else:
            scale = scale_from_amax(finite_amax(x, -1), self.fmt.scale_divisor)   # [T, H, 1]
            self.scale[page, :, off] = scale[..., 0]
        codes, micro = self._encode(x, scale)
        self.data[page, :, off] = codes
        if micro is not None:
            self.micro[page, :, off] = micro

    def calibrate(self, x: torch.Tensor) -> None:
        """Tensor granularity without a static scale: on the first write, scale = amax(x) /
        scale_divisor (1.0 if x has no finite non-zero value). Later calls do nothing."""
        if self.fmt.granularity == "tensor" and self.fmt.is_quantized and not bool(self.scale[0]):
            amax = finite_amax(x.float(), tuple(range(x.dim())), keepdim=False)
            self.scale.copy_(scale_from_amax(amax, self.fmt.scale_divisor).view(1))

    def _write_page_scaled(self, page: torch.Tensor, off: torch.Tensor, x: torch.Tensor) -> None:
        # page, off: [T]; x: [T, H, D] fp32. Works on the U distinct pages touched, whole.
        P = self.page_size
        upages, inv = torch.unique(page, return_inverse=True)                     # [U], [T]
        U, dev = upages.numel(), page.device
        min_off = torch.full((U,), P, dtype=torch.long, device=dev)
        min_off = min_off.scatter_reduce(0, inv, off, "amin")
        old_valid = torch.arange(P, device=dev)[None, :] < min_off[:, None]      # [U, P]
        is_new = torch.zeros(U, P, dtype=torch.bool, device=dev)
        is_new[inv, off] = True

        tile = self.read(upages)                                                  # [U, H, P, D]
        old_amax = finite_amax(torch.where(old_valid[:, None, :, None], tile, 0.0), (2, 3),
                               keepdim=False)                                     # [U, H]
        new_amax = torch.zeros_like(old_amax).scatter_reduce(
            0, inv[:, None].expand(-1, self.num_heads), finite_amax(x, -1, keepdim=False), "amax")
        old_scale = self.scale[upages]                                            # [U, H]
        div = self.fmt.scale_divisor
        # A page with no finite non-zero valid value takes its scale from the new tokens alone
        # (this also discards whatever a reused page held); otherwise the scale only grows.
        new_scale = torch.where(old_amax == 0, scale_from_amax(new_amax, div),
                                grow_page_scale(old_scale, new_amax / div))

        tile[inv, :, off] = x
        codes, micro = self._encode(tile, new_scale[:, :, None, None])
        changed = new_scale != old_scale
        take = is_new[:, None, :] | (old_valid[:, None, :] & changed[:, :, None])  # [U, H, P]
        take = take[..., None]
        stored = self.data[upages]
        self.data[upages] = torch.where(take, codes.view(torch.uint8),
                                        stored.view(torch.uint8)).view(stored.dtype)
        if micro is not None:
            self.micro[upages] = torch.where(take, micro.view(torch.uint8),
                                             self.micro[upages].view(torch.uint8)
                                             ).view(torch.float8_e4m3fn)
        self.scale[upages] = new_scale

    def _check_write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        H, D = self.num_heads, self.head_dim
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (H, D):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UnsupportedShapeError(f"PagedTensor.write: x must be [T, {H}, {D}], got {got}")
        if not x.is_floating_point():
            raise UnsupportedShapeError(f"PagedTensor.write: x must be floating, got {x.dtype}")
        if (not isinstance(slots, torch.Tensor) or slots.dim() != 1
                or slots.dtype.is_floating_point or slots.dtype == torch.bool):
            raise UnsupportedShapeError("PagedTensor.write: slots must be a 1-D integer tensor")
        if slots.shape[0] != x.shape[0]:
            raise UnsupportedShapeError(f"PagedTensor.write: {slots.shape[0]} slots for "
                                        f"{x.shape[0]} tokens")
        if slots.numel() == 0:
            return
        s = slots.long().sort().values
        lo, hi, dup = torch.stack([s[0], s[-1], (s[1:] == s[:-1]).sum()]).tolist()
        total = self.num_pages * self.page_size
        if lo < 0 or hi >= total:
            raise CacheStateError(f"PagedTensor.write: slot {lo if lo < 0 else hi} out of range "
                                  f"[0, {total}) ({self.num_pages} pages of {self.page_size})")
        if dup:
            raise CacheStateError(f"PagedTensor.write: {dup} duplicate slot(s); each token of a "
                                  f"write needs its own slot")

    def copy_pages(self, src, dst) -> None:
        """Copy whole pages src[i] -> dst[i] (data and scales), for copy-on-write."""
        dev = self.data.device
        src = torch.as_tensor(src, dtype=torch.long, device=dev).reshape(-1)
        dst = torch.as_tensor(dst, dtype=torch.long, device=dev).reshape(-1)
        if src.shape != dst.shape:
            raise UnsupportedShapeError(f"copy_pages: {src.numel()} sources, {dst.numel()} "
                                        f"destinations")
        if src.numel() == 0:
            return
        lo, hi = torch.cat([src, dst]).aminmax()
        if int(lo) < 0 or int(hi) >= self.num_pages:
            raise CacheStateError(f"copy_pages: page id out of range [0, {self.num_pages})")
        self.data[dst] = self.data[src]
        if self.micro is not None:
            self.micro[dst] = self.micro[src]
        if self.scale is not None and self.fmt.granularity != "tensor":
            self.scale[dst] = self.scale[src]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.micro)
                   if t is not None)
