"""Which storage formats the Triton kernels read or write, and `kernel_readable`.

The run time asks this before it sends pages to a kernel (runtime/dispatch.py) or graphs a
decode step (engine/cudagraph.py, integrations/hf_graphs.py); a format outside these lists is written by the reference
`PagedTensor.write` and attended by the reference (kernels/dense.py).
"""

from __future__ import annotations

# Storage the Triton kernels read or write (kernels/decode.py, prefill*.py, append.py).
# The decode kernel reads every storage format: also int4 / int3 / int2 (page, token and channel
# scale + zero point), channel-granular fp8 / fp4, and bf16 residual pages, dequantized in
# registers. The append kernel and the prefill kernels know only TRITON_FORMATS with
# TRITON_GRANULARITIES and no residual: the other formats are written by the reference
# PagedTensor.write (it defines the same bytes) and prefilled by gathered SDPA / the reference.
TRITON_FORMATS = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
TRITON_GRANULARITIES = ("page", "token", "tensor")
DECODE_FORMATS = TRITON_FORMATS + ("int4", "int3", "int2")
DECODE_GRANULARITIES = TRITON_GRANULARITIES + ("channel",)


def kernel_readable(paged, op: str = "decode") -> bool:
    """Whether the Triton kernel of `op` ("decode", "prefill", "append") takes these pages."""
    f = paged.fmt
    if op != "decode":
        if f.name not in TRITON_FORMATS or getattr(f, "residual", False):
            return False
        return not f.is_quantized or f.granularity in TRITON_GRANULARITIES
    if f.name not in DECODE_FORMATS:
        return False
    if not f.is_quantized:
        return True
    if f.granularity == "channel" and f.name != "fp4_e2m1":
        # a channel-scaled tile is one page: >= 16 keys, >= 32 for int codes
        # (kernels/decode.py channel_min_page)
        if paged.page_size < (32 if f.is_int else 16):
            return False
    return f.granularity in DECODE_GRANULARITIES
