"""The storage formats, declared in one place: what every other part of kvcompile reads.

A format is a `FormatSpec`: its name, code dtype and bits, the scale granularities it takes,
its parts (the tensors a layer's pages hold) and their shapes, its bytes per token, its encoder
and decoder, and which kernels read it with which constants. Config validation (`config.py`),
the pool (`formats.KVFormat`, `paged.PagedTensor`, `compaction.py`), the kernels
(`decode.py`, `prefill_launch.py`, `append.py` number formats and scale modes from here), the
run time's `kernel_readable` and the report (`format_table`, `kvcompile inspect`) ask it.

    register_format(FormatSpec(name="int8_sym", storage_dtype=torch.int8, bits=8,
                               granularities=("token",), parts=..., encode=..., decode=...))
    KVConfig(kv_dtype="int8_sym")             # accepted, stored and read on the reference path

The built-in formats below keep their write paths in paged.py (appends that grow page scales
by powers of two, int ranges that widen: `family` picks the path); a registered format with its
own `encode` / `decode` is written by re-encoding the pages a write touches (paged.py,
`_write_custom`). docs/adding-a-format.md walks through both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from kvcompile.cache.fp4 import FP4_SCALE_DIVISOR, MICRO_BLOCK
from kvcompile.cache.intq import PARAM_DTYPE, check_head_dim
from kvcompile.errors import KVConfigError, UnsupportedShapeError

GRANULARITIES = ("page", "token", "tensor", "channel")
# The parts a page may hold (PagedTensor attributes): codes, scales, int zero points, fp4 micro
# scales. Copy-on-write, swapping and compaction move exactly these.
PART_NAMES = ("data", "scale", "zero", "micro")

# Scale modes, numbered once for every kernel (decode, chunked prefill, append): none (plain
# formats), one static scale per layer, one per (page, head), one per token, one per (page,
# head, channel).
SCALE_NONE, SCALE_TENSOR, SCALE_PAGE, SCALE_TOKEN, SCALE_CHANNEL = 0, 1, 2, 3, 4
SCALE_CODES = {"tensor": SCALE_TENSOR, "page": SCALE_PAGE, "token": SCALE_TOKEN,
               "channel": SCALE_CHANNEL}
# Format codes of the Triton kernels (the FMT constexpr), the same in every kernel. E2M1_TOKMICRO
# is fp4 with "channel" scales: micro scales along tokens, [N, H, P/16, D].
FMT_PLAIN, FMT_E4M3, FMT_E5M2, FMT_E2M1, FMT_E2M1_TOKMICRO, FMT_INT4, FMT_INT3, FMT_INT2 = range(8)


class Part(NamedTuple):
    """One tensor of a layer's pages: its shape, dtype, and initial value (None: torch.empty,
    so readers must mask slots never written)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float | None = None


@dataclass(frozen=True)
class KernelSupport:
    """Which Triton kernels read (decode, prefill) or write (append) a format, per scale
    granularity, and the FMT constant they take. A format with no code is reference-only."""
    code: int | None = None
    decode: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    append: tuple[str, ...] = ()
    channel_code: int | None = None   # the decode code of "channel" scales, if not `code`
    channel_min_page: int = 16        # smallest page of a channel-scaled decode tile
    # granularities the prefill gather (kernels/prefill_gather.py) dequantizes, where they
    # differ from `prefill`'s: int pages, which no paged prefill kernel reads
    gather: tuple[str, ...] = ()


@dataclass(frozen=True)
class FormatSpec:
    """One storage format. `granularities` is empty for unquantized formats. A registered
    format supplies `parts`, `encode` and `decode` (see register_format); the built-ins leave
    `encode` None and are written by their `family`'s path in paged.py."""
    name: str
    storage_dtype: torch.dtype
    bits: int                                  # bits per stored value
    family: str = "custom"                     # "plain" | "fp" | "int" | "custom"
    granularities: tuple[str, ...] = ()
    fmax: float = 0.0                          # largest code value
    scale_divisor: float = 0.0                 # scale = amax / scale_divisor
    scale_dtype: torch.dtype = torch.float32
    micro_block: int | None = None
    default_value_granularity: str = "page"    # values' scales when keys' are "channel"
    kernels: KernelSupport = field(default_factory=KernelSupport)
    # (fmt: KVFormat, n, h, p, d) -> {part name: Part}; fmt carries granularity / static_scale
    parts: Callable | None = None
    # (fmt, tile [U, H, P, D] fp32, valid [U, P] bool) -> {part name: [U, ...]} of those pages
    encode: Callable | None = None
    # (fmt, {part name: [n, ...] (a [1]-shaped part as stored)}) -> [n, H, P, D] fp32
    decode: Callable | None = None
    # (fmt, num_heads, head_dim, page_size) -> bytes; default: measured from `parts`
    bytes_per_token: Callable | None = None
    # (fmt, head_dim, page_size) -> None, or UnsupportedShapeError naming the fix
    check_shape: Callable | None = None

    @property
    def quantized(self) -> bool:
        return bool(self.granularities)

    def stored_dim(self, head_dim: int) -> int:
        """Last dim of `data`: head_dim codes packed into bytes (or elements)."""
        if self.storage_dtype == torch.uint8 and self.bits < 8:
            return head_dim * self.bits // 8
        return head_dim


_FORMATS: dict[str, FormatSpec] = {}
ADD_FORMAT_HINT = ("A new storage format is declared with kvcompile.cache.registry."
                   "register_format (docs/adding-a-format.md).")


def register_format(spec: FormatSpec) -> FormatSpec:
    """Declare a storage format: KVConfig(kv_dtype=spec.name) then stores pages in it. A
    format that is not a built-in needs parts, encode and decode."""
    if not isinstance(spec, FormatSpec):
        raise TypeError(f"register_format takes a FormatSpec, got {type(spec).__name__}")
    if spec.name in _FORMATS or spec.name == "auto":
        raise KVConfigError("kv_dtype", spec.name, "a name not taken yet",
                            hint=f"{spec.name!r} is already a storage format; pick another name "
                                 f"or unregister_format it first.")
    bad = [g for g in spec.granularities if g not in GRANULARITIES]
    if bad:
        raise KVConfigError("granularities", bad[0], ", ".join(map(repr, GRANULARITIES)))
    if spec.family != "custom" or None in (spec.parts, spec.encode, spec.decode):
        raise KVConfigError("FormatSpec", spec.name, "family 'custom' with parts, encode and "
                            "decode all given",
                            hint="The built-in families' write paths (paged.py) are for the "
                                 "built-in formats; a registered format brings its own codec "
                                 "(docs/adding-a-format.md).")
    _FORMATS[spec.name] = spec
    return spec


def unregister_format(name: str) -> None:
    """Remove a registered format (tests). Built-in formats stay."""
    if name in BUILTIN_NAMES:
        raise KVConfigError("kv_dtype", name, "a registered, non-built-in format")
    _FORMATS.pop(name, None)


def format_spec(name: str) -> FormatSpec:
    """The FormatSpec of `name`, or KVConfigError listing the formats and how to add one."""
    spec = _FORMATS.get(name)
    if spec is None:
        raise KVConfigError("kv_dtype", name, ", ".join(map(repr, _FORMATS)),
                            hint=ADD_FORMAT_HINT)
    return spec


def format_names() -> tuple[str, ...]:
    """Every registered format, built-ins first."""
    return tuple(_FORMATS)


def is_quantized(name: str) -> bool:
    """Whether the format `name` has scales ("auto" and unknown names: False)."""
    spec = _FORMATS.get(name)
    return spec is not None and spec.quantized


def measured_bytes_per_token(fmt, num_heads: int, head_dim: int, page_size: int) -> float:
    """Bytes per token from a format's parts: a page's bytes (what grows with the page count)
    over page_size. A part not indexed by page (a tensor scale) counts 0."""
    def total(n):
        return sum(torch.Size(p.shape).numel() * p.dtype.itemsize
                   for p in fmt.parts(n, num_heads, page_size, head_dim).values())
    return (total(2) - total(1)) / page_size


# --- the built-in formats ---------------------------------------------------------------------

def _builtin_parts(fmt, n: int, h: int, p: int, d: int) -> dict[str, Part]:
    # data [N, H, P, Ds]; scale page [N, H] | token [N, H, P] | tensor [1] | channel [N, H, D]
    # (fp4 channel: the page scale [N, H]); int: zero shaped like scale; fp4: micro E4M3
    # [N, H, P, D/16], or [N, H, P/16, D] for "channel" (paged.py's docstring)
    spec, g = fmt.spec, fmt.granularity
    parts = {"data": Part((n, h, p, spec.stored_dim(d)), spec.storage_dtype)}
    if spec.quantized:
        if g == "tensor":
            parts["scale"] = Part((1,), torch.float32, float(fmt.static_scale or 0.0))
        else:
            shape = {"page": (n, h), "token": (n, h, p), "channel": (n, h, d)}[g]
            if spec.micro_block and g == "channel":
                shape = (n, h)
            parts["scale"] = Part(shape, spec.scale_dtype, 1.0)
        if spec.family == "int":
            parts["zero"] = Part(parts["scale"].shape, spec.scale_dtype, 0.0)
    if spec.micro_block:
        mb = spec.micro_block
        parts["micro"] = Part((n, h, p // mb, d) if g == "channel" else (n, h, p, d // mb),
                              torch.float8_e4m3fn)
    return parts


def _builtin_bytes_per_token(fmt, num_heads: int, head_dim: int, page_size: int) -> float:
    # codes, micro scales, and the token's share of the scales / zero points (a page's count
    # 1 / page_size, a tensor scale 0); the residual's bf16 rows are per sequence, not counted
    spec = fmt.spec
    per_head = head_dim * spec.bits / 8
    if spec.micro_block:
        per_head += head_dim // spec.micro_block
    if spec.quantized:
        size = 4 if spec.family != "int" else 2 * PARAM_DTYPE.itemsize  # int: scale + zero
        per_group = {"page": 1 / page_size, "token": 1.0, "tensor": 0.0,
                     "channel": head_dim / page_size}[fmt.granularity]
        if spec.micro_block and fmt.granularity == "channel":
            per_group = 1 / page_size  # the page scale; micro scales counted above
        per_head += size * per_group
    return num_heads * per_head


def _check_fp4_shape(fmt, head_dim: int, page_size: int) -> None:
    if fmt.granularity == "channel":
        if page_size % MICRO_BLOCK or head_dim % 2:
            raise UnsupportedShapeError(
                f"fp4_e2m1 with channel scales keeps one micro scale per {MICRO_BLOCK} "
                f"tokens of a channel, so page_size must be a multiple of {MICRO_BLOCK} "
                f"(got {page_size}) and head_dim even (got {head_dim}); use page_size >= "
                f"16 or scale_granularity='page'")
    elif head_dim % MICRO_BLOCK:
        raise UnsupportedShapeError(
            f"fp4_e2m1 needs head_dim to be a multiple of {MICRO_BLOCK} (one micro scale per "
            f"{MICRO_BLOCK} values), got {head_dim}; use fp8_e4m3 or bf16 for this layer")


def _check_int_shape(fmt, head_dim: int, page_size: int) -> None:
    check_head_dim(head_dim, fmt.spec.bits)


_ALL = GRANULARITIES
_TRITON = ("page", "token", "tensor")   # what the append and prefill kernels take


def _plain(name: str, dtype: torch.dtype) -> FormatSpec:
    return FormatSpec(name, dtype, dtype.itemsize * 8, "plain",
                      fmax=float(torch.finfo(dtype).max),
                      kernels=KernelSupport(FMT_PLAIN, _ALL, _ALL, _ALL))


def _fp8(name: str, dtype: torch.dtype, code: int) -> FormatSpec:
    fmax = float(torch.finfo(dtype).max)
    return FormatSpec(name, dtype, 8, "fp", _ALL, fmax, fmax,
                      kernels=KernelSupport(code, _ALL, _TRITON, _TRITON))


def _int(bits: int, code: int) -> FormatSpec:
    fmax = float((1 << bits) - 1)
    return FormatSpec(f"int{bits}", torch.uint8, bits, "int", ("page", "token", "channel"),
                      fmax, fmax, PARAM_DTYPE, default_value_granularity="token",
                      kernels=KernelSupport(code, ("page", "token", "channel"),
                                            append=("page", "token", "channel"),
                                            channel_min_page=32,
                                            gather=("page", "token", "channel")),
                      check_shape=_check_int_shape)


_BUILTINS = (
    _plain("bf16", torch.bfloat16), _plain("fp16", torch.float16), _plain("fp32", torch.float32),
    _fp8("fp8_e4m3", torch.float8_e4m3fn, FMT_E4M3),
    _fp8("fp8_e5m2", torch.float8_e5m2, FMT_E5M2),
    FormatSpec("fp4_e2m1", torch.uint8, 4, "fp", _ALL, 6.0, FP4_SCALE_DIVISOR,
               micro_block=MICRO_BLOCK, check_shape=_check_fp4_shape,
               kernels=KernelSupport(FMT_E2M1, _ALL, _TRITON, _TRITON,
                                     channel_code=FMT_E2M1_TOKMICRO)),
    _int(4, FMT_INT4), _int(3, FMT_INT3), _int(2, FMT_INT2),
)
for _spec in _BUILTINS:
    _FORMATS[_spec.name] = replace(_spec, parts=_builtin_parts,
                                   bytes_per_token=_builtin_bytes_per_token)
BUILTIN_NAMES = tuple(s.name for s in _BUILTINS)
