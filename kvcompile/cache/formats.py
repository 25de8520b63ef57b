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
    finite_amax,
    fp4_decode,
    fp4_encode,
    fp4_scale,
)
from kvcompile.cache.fp8 import fp8_decode, fp8_encode, fp8_scale, grow_page_scale
from kvcompile.cache.intq import int_decode, int_encode
from kvcompile.cache.paged import PagedTensor
from kvcompile.cache.registry import (
    ADD_FORMAT_HINT,
    BUILTIN_NAMES,
    GRANULARITIES,
    FormatSpec,
    format_names,
    format_spec,
    measured_bytes_per_token,
)
from kvcompile.errors import KVConfigError

# The built-in formats (the registry, cache/registry.py, may hold more: format_names()).
FORMAT_NAMES = BUILTIN_NAMES
_AUTO = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

__all__ = [
    "FORMAT_NAMES", "GRANULARITIES", "E2M1_VALUES", "KVFormat", "PagedTensor", "resolve_format",
    "format_table", "find_nonfinite", "fp8_scale", "fp8_encode", "fp8_decode", "fp4_scale",
    "fp4_encode", "fp4_decode", "int_encode", "int_decode", "finite_amax", "grow_page_scale",
]


# --- formats ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVFormat:
    """One storage format: `name` of a registered format (cache/registry.py) and, for the
    quantized ones, the scale `granularity`: "page" (one scale per (page, kv head)), "token"
    (per (page, kv head, slot)), "tensor" (fp8 / fp4: one per layer, `static_scale` or
    calibrated on the first write as its amax / scale_divisor) or "channel" (per (page, kv
    head, channel); fp4: an E4M3 micro scale per channel per 16 tokens under a page scale).
    `residual`: keep partly filled pages in bf16 until they fill (quantized formats only)."""

    name: str
    granularity: str = "page"
    static_scale: float | None = None
    residual: bool = False

    def __post_init__(self):
        spec = format_spec(self.name)   # KVConfigError naming the formats and how to add one
        if self.granularity not in GRANULARITIES:
            raise KVConfigError("scale_granularity", self.granularity,
                                ", ".join(map(repr, GRANULARITIES)))
        if spec.quantized and self.granularity not in spec.granularities:
            takes = ", ".join(map(repr, spec.granularities))
            if spec.family == "int":
                raise KVConfigError("scale_granularity", self.granularity,
                                    f"{takes} for int4 / int3 / int2",
                                    hint="Asymmetric int formats calibrate per block, not per "
                                         "tensor.")
            raise KVConfigError("scale_granularity", self.granularity, f"{takes} for {self.name}")
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
    def spec(self) -> FormatSpec:
        return format_spec(self.name)

    @property
    def is_quantized(self) -> bool:
        return self.spec.quantized

    @property
    def shares_page(self) -> bool:
        """Whether a token's stored value depends on the other tokens written with it in its
        page: page- or channel-granular scales (set from the tokens of a write, widened by later
        ones), a bf16 residual (a page waits in bf16 until a write fills it), or a registered
        codec (pages encoded whole). Then a prompt chunk that ends inside a page stores and
        attends other values than the same prompt in one piece (the engine's scheduler ends
        partial chunks on page boundaries for such formats)."""
        return self.is_quantized and (self.residual or self.spec.encode is not None
                                      or self.granularity in ("page", "channel"))

    @property
    def is_int(self) -> bool:
        return self.spec.family == "int"

    @property
    def int_bits(self) -> int:
        return self.spec.bits

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.spec.storage_dtype

    @property
    def scale_dtype(self) -> torch.dtype:
        """fp32 for fp8 / fp4 scales; fp16 for int scales and zero points."""
        return self.spec.scale_dtype

    @property
    def fmax(self) -> float:
        """Largest code value: 448 / 57344 for fp8, 6 for fp4, 2^bits - 1 for int, the dtype's
        max otherwise."""
        return self.spec.fmax

    @property
    def scale_divisor(self) -> float:
        """scale = amax / scale_divisor: fmax for fp8, 6 * 448 for fp4 (int: range / fmax)."""
        return self.spec.scale_divisor

    @property
    def bits_per_value(self) -> int:
        return self.spec.bits

    @property
    def micro_block(self) -> int | None:
        return self.spec.micro_block

    def stored_dim(self, head_dim: int) -> int:
        """Last dim of `data`: head_dim codes packed into bytes (or elements)."""
        return self.spec.stored_dim(head_dim)

    def parts(self, num_pages: int, num_heads: int, page_size: int,
              head_dim: int) -> dict:
        """The tensors pages of this format hold: {name: registry.Part(shape, dtype, fill)}."""
        return self.spec.parts(self, num_pages, num_heads, page_size, head_dim)

    def check_shape(self, head_dim: int, page_size: int) -> None:
        """UnsupportedShapeError if pages of this head_dim / page_size cannot hold the format."""
        if self.spec.check_shape is not None:
            self.spec.check_shape(self, head_dim, page_size)

    def bytes_per_token(self, num_heads: int, head_dim: int, page_size: int) -> float:
        """Bytes one token takes in one K (or V) tensor of one layer: codes, micro scales, and
        its share of the scales / zero points (a page's count 1 / page_size, a tensor scale 0).
        The residual's bf16 rows are per sequence, not per token, and not counted."""
        how = self.spec.bytes_per_token or measured_bytes_per_token
        return how(self, num_heads, head_dim, page_size)

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
            raise KVConfigError("kv_dtype", "auto", ", ".join(map(repr, format_names())),
                                hint=f"The model's dtype {model_dtype} has no storage format of "
                                     f"its own; name one explicitly.")
        kv_dtype = _AUTO[model_dtype]
    if kv_dtype not in format_names():
        raise KVConfigError("kv_dtype", kv_dtype, "'auto', " + ", ".join(map(repr, format_names())),
                            hint=ADD_FORMAT_HINT)
    if not format_spec(kv_dtype).quantized:
        return KVFormat(kv_dtype)
    return KVFormat(kv_dtype, granularity, static_scale, residual)


def format_table(num_layers: int, num_kv_heads: int, head_dim: int,
                 page_size: int) -> list[dict]:
    """Bytes per token of the whole cache (all layers, K + V) for each format and granularity."""
    bf16 = 2 * num_layers * KVFormat("bf16").bytes_per_token(num_kv_heads, head_dim, page_size)
    rows = []
    for name in format_names():
        spec = format_spec(name)
        for gran in (spec.granularities or ("-",)):
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


