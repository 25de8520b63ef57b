"""`kernel_readable`: whether a Triton kernel reads (or writes) a layer's pages.

The run time asks this before it sends pages to a kernel (runtime/dispatch.py) or graphs a
decode step (engine/cudagraph.py, integrations/hf_graphs.py). What each kernel takes is declared
with the format (cache/registry.py, `FormatSpec.kernels`): the decode kernel reads every
built-in format (also int4 / int3 / int2 with page, token and channel scale + zero point,
channel-granular fp8 / fp4, and bf16 residual pages); the append kernels take the float
formats with page / token / tensor scales and the int formats with page / token / channel
scales (kernels/append_int.py), the prefill kernel the float formats with page / token / tensor
scales; neither takes residual pages. Pages a kernel does not take are written by the reference
`PagedTensor.write` (it defines the same bytes) and attended by the reference
(kernels/dense.py) or gathered SDPA.
"""

from __future__ import annotations

from kvcompile.cache.registry import format_spec


def kernel_readable(paged, op: str = "decode") -> bool:
    """Whether the Triton kernel of `op` ("decode", "prefill", "append", "gather": the
    chunked prefill's gather route) takes these pages."""
    f = paged.fmt
    support = format_spec(f.name).kernels
    if support.code is None:
        return False
    if op != "decode" and getattr(f, "residual", False):
        return False
    if op == "gather":
        takes = support.gather or support.prefill
    else:
        takes = support.decode if op == "decode" else getattr(support, op)
    if op == "append" and not _append_shape(paged):
        return False
    if f.is_quantized and f.granularity == "channel" and op == "decode":
        # a channel-scaled tile is one page: >= 16 keys, >= 32 for int codes
        # (kernels/decode.py channel_min_page)
        if paged.page_size < support.channel_min_page:
            return False
    return f.granularity in takes if f.is_quantized else bool(takes)


def _append_shape(paged) -> bool:
    # kernels/append.py launch_append's shape contract: head_dim a power of two in 16..512,
    # page_size a power of two (other shapes are written by the reference)
    d, p = getattr(paged, "head_dim", 0), getattr(paged, "page_size", 0)
    return 16 <= d <= 512 and d & (d - 1) == 0 and p >= 1 and p & (p - 1) == 0


def graph_refusal(k, v, latent: bool = False) -> str:
    """Why a layer's decode steps (K pages k, V pages v) cannot be graphed, "" if they can:
    a CUDA graph needs the decode kernel to read both and the append kernel to write both
    (the reference attention reads the capture's host lengths: replayed, it would attend
    over the wrong keys). latent: an MLA layer (k the latent, v the rotary key), read by
    the latent decode kernel (generate's graphs and the engine's packed steps alike:
    tests/gpu/test_hf_graphs_gpu.py)."""
    if latent:
        from kvcompile.kernels.latent_decode import fast_path_reason

        why = fast_path_reason(None, k, v)
        if why:
            return f"latent (MLA) layer: {why}"
    else:
        from kvcompile.kernels.decode import HEAD_DIMS, PAGE_SIZES

        for c in (k, v):
            if c.head_dim not in HEAD_DIMS or c.page_size not in PAGE_SIZES:
                return (f"pages of head_dim {c.head_dim} / page_size {c.page_size}: the decode "
                        f"kernel takes head_dim {HEAD_DIMS}, page_size {PAGE_SIZES}")
    for c in (k, v):
        if not kernel_readable(c, "decode"):
            return f"{c.fmt.name}/{c.fmt.granularity} pages have no decode kernel"
        if not kernel_readable(c, "append"):
            if getattr(c.fmt, "residual", False):
                return (f"{c.fmt.name} residual pages are written by the reference (their bf16 "
                        f"tail rows are assigned on the host; residual=False has an append "
                        f"kernel)")
            if not _append_shape(c):
                return (f"{c.fmt.name} pages of head_dim {c.head_dim} / page_size "
                        f"{c.page_size} are written by the reference (the append kernel takes "
                        f"powers of two, head_dim 16..512)")
            return f"{c.fmt.name}/{c.fmt.granularity} pages are written by the reference"
    return ""
