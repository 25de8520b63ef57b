"""Prefill attention: causal prefill over packed sequences and chunked prefill over paged KV.

    out = prefill_attention(q, k, v, cu_seqlens, scale)          # q [T, Hq, D] -> [T, Hq, Dv]
    out = prefill_attention(q, k, v, cu_seqlens, scale, fp8=True)  # FP8 E4M3, block scales
    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)

Both are `torch.library.custom_op`s (`torch.ops.kvcompile.prefill`, `...paged_prefill`) with fake
implementations, so they trace under torch.compile. On the CPU without TRITON_INTERPRET=1 they
run the plain-PyTorch references of kernels/reference.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels import prefill_launch as L
from kvcompile.kernels.prefill_tiles import interpreting


class Fp8PrefillScales(NamedTuple):
    """fp32 descales of an FP8 prefill: one per (sequence, SCALE_BLOCK tokens, kv head)."""

    q_descale: torch.Tensor  # [num_blocks, Hkv]  (shared by the kv head's query heads)
    k_descale: torch.Tensor  # [num_blocks, Hkv]
    v_descale: torch.Tensor  # [num_blocks, Hkv]
    cu_blocks: torch.Tensor  # [B+1] int32: first block of each sequence


def _on_kernel_device(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


# --- FP8 inputs -------------------------------------------------------------------------------

def quantize_fp8_prefill(q, k, v, cu_seqlens, block: int | None = None, with_q: bool = True):
    """Quantize q, k, v to E4M3 with one scale per (sequence, block of tokens, kv head).

    q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, Dv] -> (q8 [T, Hq, D], k8 [T, Hkv, D],
    vt8 [Hkv * Dv, NB * block] (V transposed; sequence b from column cu_blocks[b] * block, its
    tokens in `prefill_quant.vt_column` order within each 32-token chunk),
    Fp8PrefillScales). Scale = amax / 448 (1.0 for an all-zero block), codes = clamp(x / scale,
    +-448) rounded to nearest even. NB = T // block + B (`prefill_quant.block_bound`: known
    without reading the lengths); the blocks past the sequences' have unit scales and zero
    columns. On CUDA one Triton kernel does it (kernels/prefill_quant.py); on the CPU the torch
    form (reference.quantize_fp8_prefill_ref), with the same bits (tests/kernels/test_prefill.py
    holds the kernel to it under TRITON_INTERPRET=1). with_q=False: K and V alone, q returned as
    it came and its descales all ones (for the Hopper kernel, which quantizes each query row
    itself: kernels/prefill_sm90.py).
    """
    from kvcompile.kernels import prefill_quant as PQ

    block = block or PQ.SCALE_BLOCK
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2] \
            or q.shape[0] != k.shape[0] or k.shape[2] != q.shape[2] \
            or q.shape[1] % max(k.shape[1], 1):
        raise UnsupportedShapeError(
            f"quantize_fp8_prefill: q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] with Hkv "
            f"dividing Hq; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    nb = PQ.block_bound(q.shape[0], cu_seqlens.numel() - 1, block)
    if block == PQ.SCALE_BLOCK and q.is_cuda:
        q8, k8, vt8, sc = PQ.quantize_fp8_prefill_triton(q, k, v, cu_seqlens, nb, with_q)
    else:
        from kvcompile.kernels.reference import quantize_fp8_prefill_ref

        q8, k8, vt8, sc = quantize_fp8_prefill_ref(q, k, v, cu_seqlens, nb, block)
        if not with_q:
            q8 = q
            sc = (torch.ones_like(sc[0]),) + tuple(sc[1:])
    return q8, k8, vt8, Fp8PrefillScales(*sc)


def dequantize_fp8_prefill(q8, k8, vt8, scales: Fp8PrefillScales, cu_seqlens):
    """Inverse of quantize_fp8_prefill, in fp32: the values the FP8 kernel computes with."""
    from kvcompile.kernels.prefill_varlen import SCALE_BLOCK

    T, Hq, D = q8.shape
    Hkv = k8.shape[1]
    Dv = vt8.shape[0] // Hkv
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=q8.device), lens)
    local = torch.arange(T, device=q8.device) - cu_seqlens[:-1].long()[seq]
    blk = scales.cu_blocks[:-1].long()[seq] + local // SCALE_BLOCK
    g = Hq // Hkv
    if scales.q_descale is None:   # bf16 queries the kernel quantizes, a scale per row
        from kvcompile.kernels.reference import quantize_rows_fp8_ref

        codes, qs = quantize_rows_fp8_ref(q8)
        q = codes.float() * qs
    else:
        q = (q8.float().reshape(T, Hkv, g, D) * scales.q_descale[blk][:, :, None, None])
    k = k8.float() * scales.k_descale[blk][:, :, None]
    from kvcompile.kernels.prefill_quant import vt_column

    col = scales.cu_blocks[:-1].long()[seq] * SCALE_BLOCK + vt_column(local)
    v = vt8[:, col].float().t().reshape(T, Hkv, Dv) * scales.v_descale[blk][:, :, None]
    return q.reshape(T, Hq, D), k, v


# --- contiguous (packed varlen) prefill -----------------------------------------------------

def _max_seqlen(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if cu_seqlens.numel() > 1 else 0


@torch.library.custom_op("kvcompile::prefill", mutates_args=())
def _prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                scale: float, causal: bool, sliding_window: int, sinks: int, softcap: float,
                max_seqlen: int, q_descale: torch.Tensor | None, k_descale: torch.Tensor | None,
                v_descale: torch.Tensor | None, cu_blocks: torch.Tensor | None,
                out_dtype: torch.dtype, cu_seqlens_k: torch.Tensor | None) -> torch.Tensor:
    fp8 = None if k_descale is None else Fp8PrefillScales(q_descale, k_descale, v_descale,
                                                         cu_blocks)
    dv = v.shape[0] // k.shape[1] if fp8 is not None else v.shape[2]
    out = torch.empty(q.shape[0], q.shape[1], dv, dtype=out_dtype, device=q.device)
    if not _on_kernel_device(q):
        from kvcompile.kernels import reference as R

        if fp8 is not None:
            q, k, v = dequantize_fp8_prefill(q, k, v, fp8, cu_seqlens)
            if causal and not (sliding_window or sinks or softcap):   # P rounded as in the kernels
                return out.copy_(R.prefill_attention_fp8_ref(q, k, v, cu_seqlens, scale))
        ref = R.prefill_attention_ref(q, k, v, cu_seqlens, scale, causal=causal,
                                      sliding_window=sliding_window, sinks=sinks, softcap=softcap,
                                      cu_seqlens_k=cu_seqlens_k)
        return out.copy_(ref)
    max_seqlen = max_seqlen if max_seqlen > 0 else _max_seqlen(cu_seqlens)
    return L.launch_prefill(q, k, v, cu_seqlens, out, scale, causal, sliding_window, sinks,
                            softcap, max_seqlen, fp8, cu_seqlens_k=cu_seqlens_k)


@_prefill_op.register_fake
def _(q, k, v, cu_seqlens, scale, causal, sliding_window, sinks, softcap, max_seqlen,
      q_descale, k_descale, v_descale, cu_blocks, out_dtype, cu_seqlens_k):
    dv = v.shape[0] // k.shape[1] if k_descale is not None else v.shape[2]
    return q.new_empty(q.shape[0], q.shape[1], dv, dtype=out_dtype)


def prefill_attention(q, k, v, cu_seqlens, scale: float, *, causal=True, sliding_window=0,
                      sinks=0, softcap=0.0, out=None, max_seqlen: int | None = None,
                      fp8: bool | Fp8PrefillScales = False, out_dtype=None, cu_seqlens_k=None):
    """Causal (or full) attention over packed variable-length sequences.

    q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, Dv], cu_seqlens: [B+1] int32 -> [T, Hq, Dv].
    sliding_window W > 0: a key is seen iff q_pos - k_pos < W; sinks S: the first S keys of each
    sequence stay visible whatever the window. softcap c > 0: scores become c * tanh(s / c).
    fp8=True quantizes q, k, v to E4M3 with block scales first (on Hopper, where its Gluon
    kernel takes the prefill and q is bf16: k and v alone, and the kernel quantizes each query
    row with its own scale); or pass E4M3 q (or bf16 q with q_descale None), k and the
    transposed vt from quantize_fp8_prefill with fp8=<its Fp8PrefillScales>. max_seqlen (the
    longest query sequence) saves a device sync. cu_seqlens_k [B+1] (bf16/fp16/fp32 only): k/v
    hold k_len >= q_len tokens per sequence and the queries are its last q_len positions (the
    contiguous-KV form of chunked prefill).
    """
    if fp8 is True:
        out_dtype = out_dtype or torch.bfloat16
        from kvcompile.kernels import prefill_sm90

        q_in_kernel = prefill_sm90.takes_bf16_q(q, k, v, out_dtype, causal, sliding_window,
                                                sinks, softcap, cu_seqlens_k) is None
        q, k, v, fp8 = quantize_fp8_prefill(q, k, v, cu_seqlens, with_q=not q_in_kernel)
        if q_in_kernel:
            fp8 = fp8._replace(q_descale=None)
    scales = fp8 if isinstance(fp8, Fp8PrefillScales) else None
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else (
            torch.bfloat16 if scales is not None else q.dtype)
    qd, kd, vd, cb = scales if scales is not None else (None, None, None, None)
    if scales is not None and kd is None:
        raise UnsupportedShapeError("prefill_attention: fp8 scales need k_descale, v_descale "
                                    "and cu_blocks (from quantize_fp8_prefill)")
    res = torch.ops.kvcompile.prefill(q, k, v, cu_seqlens, float(scale), bool(causal),
                                      int(sliding_window), int(sinks), float(softcap),
                                      int(max_seqlen or 0), qd, kd, vd, cb, out_dtype,
                                      cu_seqlens_k)
    if out is not None:
        return out.copy_(res)
    return res


# --- chunked prefill over paged KV ------------------------------------------------------------

@torch.library.custom_op("kvcompile::paged_prefill", mutates_args=())
def _paged_prefill_op(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor | None,
                      k_micro: torch.Tensor | None, k_format: str, k_granularity: str,
                      v_data: torch.Tensor, v_scale: torch.Tensor | None,
                      v_micro: torch.Tensor | None, v_format: str, v_granularity: str,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, kv_start: torch.Tensor | None, scale: float,
                      sliding_window: int, sinks: int, softcap: float,
                      max_q_len: int, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    dv = v_data.shape[3] * (2 if v_format == "fp4_e2m1" else 1)
    out = torch.empty(q.shape[0], q.shape[1], dv, dtype=q.dtype, device=q.device)
    k = (k_format, k_granularity, k_data, k_scale, k_micro)
    v = (v_format, v_granularity, v_data, v_scale, v_micro)
    if not _on_kernel_device(q):
        from kvcompile.kernels import reference as R

        ref = R.paged_prefill_attention_ref(
            q, _pages_view(*k), _pages_view(*v), block_tables, cu_seqlens_q, seq_lens, scale,
            sliding_window=sliding_window, sinks=sinks, softcap=softcap, kv_start=kv_start,
            sink_logits=sink_logits)
        return out.copy_(ref)
    max_q_len = max_q_len if max_q_len > 0 else _max_seqlen(cu_seqlens_q)
    return L.launch_paged_prefill(q, out, k, v, block_tables, cu_seqlens_q, seq_lens, kv_start,
                                  scale, sliding_window, sinks, softcap, max_q_len,
                                  sink_logits=sink_logits)


@_paged_prefill_op.register_fake
def _(q, k_data, k_scale, k_micro, k_format, k_granularity, v_data, v_scale, v_micro, v_format,
      v_granularity, block_tables, cu_seqlens_q, seq_lens, kv_start, scale, sliding_window,
      sinks, softcap, max_q_len, sink_logits=None):
    dv = v_data.shape[3] * (2 if v_format == "fp4_e2m1" else 1)
    return q.new_empty(q.shape[0], q.shape[1], dv)


def _pages_view(fmt_name, granularity, data, scale, micro):
    """A PagedTensor over existing storage (for the reference path of the op)."""
    from kvcompile.cache.formats import KVFormat, PagedTensor

    fmt = KVFormat(fmt_name, granularity if granularity in ("page", "token", "tensor")
                   else "page")
    pt = PagedTensor.__new__(PagedTensor)
    pt.fmt, pt.data, pt.scale, pt.micro = fmt, data, scale, micro
    n, h, p, d = data.shape
    pt.num_pages, pt.num_heads, pt.page_size = n, h, p
    pt.head_dim = d * 2 if fmt_name == "fp4_e2m1" else d
    return pt


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                            scale: float, *, sliding_window=0, sinks=0, softcap=0.0,
                            kv_start=None, out=None, max_q_len: int | None = None,
                            sink_logits=None):
    """Chunked prefill: packed chunk queries attend causally over their sequences' pages.

    q: [T, Hq, D] (bf16/fp16/fp32), the chunks of B sequences packed by cu_seqlens_q [B+1] int32;
    k_cache / v_cache: PagedTensor in any stored format; block_tables: [B, max_pages] int32;
    seq_lens: [B] int32, each sequence's length *including* its chunk (whose K/V are already
    written). Query i of sequence b sits at position seq_lens[b] - q_len_b + i and sees keys
    [kv_start[b], position] (kv_start: [B] int32 left padding, default 0), within the sliding
    window if any, the first `sinks` keys from kv_start always. sink_logits [Hq] fp32:
    attention sinks, one logit per query head in each softmax's denominator (kernels/decode.py).
    Returns [T, Hq, Dv] in q's dtype.
    The gathered route (a transient contiguous workspace, then the varlen kernel) and the rule
    that chooses between the two: kernels/prefill_gather.py `chunk_prefill_attention`.
    """
    res = torch.ops.kvcompile.paged_prefill(
        q, k_cache.data, k_cache.scale, k_cache.micro, k_cache.fmt.name,
        k_cache.fmt.granularity, v_cache.data, v_cache.scale, v_cache.micro, v_cache.fmt.name,
        v_cache.fmt.granularity, block_tables, cu_seqlens_q, seq_lens, kv_start, float(scale),
        int(sliding_window), int(sinks), float(softcap), int(max_q_len or 0), sink_logits)
    if out is not None:
        return out.copy_(res)
    return res
