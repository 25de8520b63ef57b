"""Storage formats of the paged KV cache, in plain PyTorch: the reference every kernel is tested
against. Layout and value semantics: docs/architecture.md, "Storage layout".

    fmt = resolve_format("fp8_e4m3", torch.bfloat16)          # page-granular scales
    k = fmt.allocate(num_pages, num_kv_heads, page_size, head_dim, device)
    k.write(slots, k_new)                                     # slots [T]: page * P + offset
    pages = k.read(page_ids)                                  # [n, H, P, D] fp32

fp8: see fp8.py; fp4 (NVFP4-style): fp4.py; int4 / int3 / int2 asymmetric (scale + zero point):
intq.py. Scale granularities: "page" (one per page and kv head), "token", "tensor" (one static
or calibrated scale per layer), "channel" (per page, kv head and channel, KIVI-style, for keys;
for fp4 the micro-blocks then run along tokens: one E4M3 scale per channel per 16 tokens).
Page- and channel-granular scales change as tokens are appended (grouped.py; fp8/fp4 scales by
powers of two, which keeps earlier tokens bit-identical). `residual` keeps a sequence's partly
filled last page in bf16 until it fills (paged.py).
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
)
from kvcompile.cache.fp8 import fp8_decode, fp8_encode, fp8_scale, grow_page_scale
from kvcompile.cache.intq import INT_BITS, PARAM_DTYPE, check_head_dim, int_decode, int_encode
from kvcompile.cache.paged import PagedTensor
from kvcompile.errors import KVConfigError, UnsupportedShapeError

FORMAT_NAMES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int4", "int3",
                "int2")
GRANULARITIES = ("page", "token", "tensor", "channel")
# The granularities each quantized family supports.
_FAMILY_GRANULARITIES = {"fp": GRANULARITIES, "int": ("page", "token", "channel")}

_STORAGE_DTYPE = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp4_e2m1": torch.uint8,
    "int4": torch.uint8, "int3": torch.uint8, "int2": torch.uint8,
}
_BITS = {"bf16": 16, "fp16": 16, "fp32": 32, "fp8_e4m3": 8, "fp8_e5m2": 8, "fp4_e2m1": 4,
         "int4": 4, "int3": 3, "int2": 2}
_AUTO = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

__all__ = [
    "FORMAT_NAMES", "GRANULARITIES", "E2M1_VALUES", "KVFormat", "PagedTensor", "resolve_format",
    "format_table", "find_nonfinite", "fp8_scale", "fp8_encode", "fp8_decode", "fp4_scale",
    "fp4_encode", "fp4_decode", "int_encode", "int_decode", "finite_amax", "grow_page_scale",
]


# --- formats ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVFormat:
    """One storage format: `name` in FORMAT_NAMES and, for the quantized ones, the scale
    `granularity`: "page" (one scale per (page, kv head)), "token" (per (page, kv head, slot)),
    "tensor" (fp8 / fp4: one per layer, `static_scale` or calibrated on the first write as its
    amax / scale_divisor) or "channel" (per (page, kv head, channel); fp4: an E4M3 micro scale
    per channel per 16 tokens under a page scale). `residual`: keep partly filled pages in bf16
    until they fill (quantized formats only)."""

    name: str
    granularity: str = "page"
    static_scale: float | None = None
    residual: bool = False

    def __post_init__(self):
        if self.name not in FORMAT_NAMES:
            raise KVConfigError("kv_dtype", self.name, ", ".join(map(repr, FORMAT_NAMES)))
        if self.granularity not in GRANULARITIES:
            raise KVConfigError("scale_granularity", self.granularity,
                                ", ".join(map(repr, GRANULARITIES)))
        if self.is_int and self.granularity not in _FAMILY_GRANULARITIES["int"]:
            raise KVConfigError("scale_granularity", self.granularity,
                                "'page', 'token', 'channel' for int4 / int3 / int2",
                                hint="Asymmetric int formats calibrate per block, not per "
                                     "tensor.")
        if self.static_scale is not None:
            v = self.static_scale
            if not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise KVConfigError("static_scale", v, "None or a finite float > 0")
            if self.is_quantized and self.granularity != "tensor":
                raise KVConfigError("static_scale", self.static_scale, "None",
                                    hint="A static scale needs scale_granularity='tensor'.")
        if not isinstance(self.residual, bool):
            raise KVConfigError("residual", self.residual, "True, False")
        if self.residual and not self.is_quantized:
            raise KVConfigError("residual", True, "False for an unquantized format",
                                hint="The residual page keeps quantized formats' last page in "
                                     "bf16.")

    @property
    def is_quantized(self) -> bool:
        return self.name.startswith(("fp8", "fp4", "int"))

    @property
    def is_int(self) -> bool:
        return self.name in INT_BITS

    @property
    def int_bits(self) -> int:
        return INT_BITS[self.name]

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE_DTYPE[self.name]

    @property
    def scale_dtype(self) -> torch.dtype:
        """fp32 for fp8 / fp4 scales; fp16 for int scales and zero points."""
        return PARAM_DTYPE if self.is_int else torch.float32

    @property
    def fmax(self) -> float:
        """Largest code value: 448 / 57344 for fp8, 6 for fp4, 2^bits - 1 for int, the dtype's
        max otherwise."""
        if self.name == "fp4_e2m1":
            return 6.0
        if self.is_int:
            return float((1 << self.int_bits) - 1)
        return float(torch.finfo(self.storage_dtype).max)

    @property
    def scale_divisor(self) -> float:
        """scale = amax / scale_divisor: fmax for fp8, 6 * 448 for fp4 (int: range / fmax)."""
        return FP4_SCALE_DIVISOR if self.name == "fp4_e2m1" else self.fmax

    @property
    def bits_per_value(self) -> int:
        return _BITS[self.name]

    @property
    def micro_block(self) -> int | None:
        return MICRO_BLOCK if self.name == "fp4_e2m1" else None

    def stored_dim(self, head_dim: int) -> int:
        """Last dim of `data`: head_dim codes packed into bytes (or elements)."""
        return head_dim * self.bits_per_value // 8 if self.storage_dtype == torch.uint8 \
            else head_dim

    def check_shape(self, head_dim: int, page_size: int) -> None:
        """UnsupportedShapeError if pages of this head_dim / page_size cannot hold the format."""
        if self.is_int:
            check_head_dim(head_dim, self.int_bits)
        elif self.name == "fp4_e2m1" and self.granularity == "channel":
            if page_size % MICRO_BLOCK or head_dim % 2:
                raise UnsupportedShapeError(
                    f"fp4_e2m1 with channel scales keeps one micro scale per {MICRO_BLOCK} "
                    f"tokens of a channel, so page_size must be a multiple of {MICRO_BLOCK} "
                    f"(got {page_size}) and head_dim even (got {head_dim}); use page_size >= "
                    f"16 or scale_granularity='page'")
        elif self.name == "fp4_e2m1" and head_dim % MICRO_BLOCK:
            raise UnsupportedShapeError(
                f"fp4_e2m1 needs head_dim to be a multiple of {MICRO_BLOCK} (one micro scale per "
                f"{MICRO_BLOCK} values), got {head_dim}; use fp8_e4m3 or bf16 for this layer")

    def bytes_per_token(self, num_heads: int, head_dim: int, page_size: int) -> float:
        """Bytes one token takes in one K (or V) tensor of one layer: codes, micro scales, and
        its share of the scales / zero points (a page's count 1 / page_size, a tensor scale 0).
        The residual's bf16 rows are per sequence, not per token, and not counted."""
        per_head = head_dim * self.bits_per_value / 8
        if self.micro_block:
            per_head += head_dim // self.micro_block
        if self.is_quantized:
            size = 4 if not self.is_int else 2 * PARAM_DTYPE.itemsize  # int: scale + zero
            per_group = {"page": 1 / page_size, "token": 1.0, "tensor": 0.0,
                         "channel": head_dim / page_size}[self.granularity]
            if self.name == "fp4_e2m1" and self.granularity == "channel":
                per_group = 1 / page_size  # the page scale; micro scales counted above
            per_head += size * per_group
        return num_heads * per_head

    def bits_per_element(self, head_dim: int, page_size: int) -> float:
        """Storage bits per cached element, scales included (bytes_per_token * 8 / head_dim)."""
        return 8 * self.bytes_per_token(1, head_dim, page_size) / head_dim

    def allocate(self, num_pages: int, num_heads: int, page_size: int, head_dim: int,
                 device=None) -> PagedTensor:
        return PagedTensor(self, num_pages, num_heads, page_size, head_dim, device)


def resolve_format(kv_dtype: str, model_dtype: torch.dtype, granularity: str = "page",
                   static_scale: float | None = None, residual: bool = False) -> KVFormat:
    """KVConfig's kv_dtype ("auto" = the model's dtype) and scale options -> a KVFormat.
    Scale options and `residual` are ignored for the unquantized formats."""
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
    return KVFormat(kv_dtype, granularity, static_scale, residual)


def format_table(num_layers: int, num_kv_heads: int, head_dim: int,
                 page_size: int) -> list[dict]:
    """Bytes per token of the whole cache (all layers, K + V) for each format and granularity."""
    bf16 = 2 * num_layers * KVFormat("bf16").bytes_per_token(num_kv_heads, head_dim, page_size)
    rows = []
    for name in FORMAT_NAMES:
        fam = "int" if name in INT_BITS else "fp"
        quantized = name.startswith(("fp8", "fp4", "int"))
        for gran in (_FAMILY_GRANULARITIES[fam] if quantized else ("-",)):
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


