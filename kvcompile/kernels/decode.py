"""Paged decode attention: split-K flash-decoding over bf16 / fp16 / FP8 / FP4 / INT4 / INT3 /
INT2 pages, K and V each in its own format, with bf16 residual pages.

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    # q: [B, Hq, Sq, D] (Sq 1..8); k_cache / v_cache: PagedTensor; -> [B, Hq, Sq, Dv]

One program owns (sequence, kv head, split) and holds the G = Hq / Hkv query heads of the group
times Sq queries as the M rows of its tiles, so every page is read once for the whole group.
Quantized pages are widened in registers (decode_tiles.py), never dequantized in HBM; the block
scales are folded into the scores (keys) and into the probabilities (values) as one factor
per token, int zero points as one term per token, and channel scales (fp8 / int, per page) into
q's columns or the output's, with tiles of one page, or for int codes of two pages with each
query row held twice in the padded M rows (one copy per page, merged at the end: PAIR in
decode_kernels.py) (decode_attend.py). FP4 and INT4 pages split head_dim into even and odd
halves (low and high nibbles) and run two dots, so no nibble interleave is built; int3 / int2
codes are unpacked into head_dim order. A page whose tokens live in
the bf16 residual (PagedTensor.res_slot >= 0) is read from its res_data row instead. Splits
write (acc, lse) partials that a Triton combine kernel merges; with one split the kernel writes
the output directly. Kernels: decode_kernels.py; one tile: decode_attend.py; in-register tile
loads and widening: decode_tiles.py.

Query i of Sq sits at position seq_len - Sq + i and sees keys j <= its position (causal among
the new tokens), with a window: q_pos - j < window, or j < sinks; key_mask[b, j] False hides
key j. A row that sees no key outputs 0. Keys nobody sees are never read (NaN there is inert).

Sink logits (sink_logits [Hq] fp32, attention sinks of gpt-oss; not the `sinks` kept tokens of a
window): one more column of each row's softmax, whose probability is dropped. They enter only
where a row's (acc, lse) is final, the direct epilogue or the combine: out *= 2^(lse - lse'),
lse' = log2(2^lse + 2^(sink * log2 e)), and the lse written (H2O's attn_mass) is lse'.

Rotated leading keys (rot = (n_rot [B], cos [B, D], sin [B, D]), the re-rotated sinks of
eviction/aside.py): keys j < n_rot[b] are scored by row b's query rotated by cos / sin (RoPE
scores depend on position differences, so a key stored at position p scored by the query
rotated by -delta is the key scored as if it sat at p + delta). Split 0's program first
attends to those keys in small tiles (`_rot_tile`) with the query rotated in registers (fp32,
rounded once), then runs the plain loop with them unseen: one softmax, attn_mass included, and
the plain loop's code unchanged. A compile-time flag (HAS_ROT): without rot the kernel is the
plain one.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvcompile.cache.registry import format_names, format_spec
from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels.decode_kernels import (
    attn_mass_kernel,
    combine_splits_kernel,
    decode_split_kernel,
)
from kvcompile.kernels.decode_tiles import (
    FMT_E2M1,
    FMT_E2M1_TOKMICRO,
    FMT_PLAIN,
    FP4_ASM_FOLD,
    INT_FMT_BITS,
    SCALE_CHANNEL,
    SCALE_CODES,
    SCALE_NONE,
    SCALE_PAGE,
)
from kvcompile.kernels.prefill_launch import check_sink_logits

HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (8, 16, 32, 64, 128)
MAX_SQ = 8
LOG2E = 1.4426950408889634


# --- launcher ------------------------------------------------------------------------------

def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _codes(fmt_name: str, granularity: str) -> tuple[int, int]:
    """(format code, scale mode) of the kernel for a storage format and scale granularity, as
    the format declares them (cache/registry.py)."""
    support = format_spec(fmt_name).kernels if fmt_name in format_names() else None
    if support is None or support.code is None or not support.decode:
        readable = [n for n in format_names() if format_spec(n).kernels.decode]
        raise UnsupportedShapeError(
            f"KV format {fmt_name!r} has no Triton decode kernel; supported: "
            f"{', '.join(readable)}. Use KVConfig(kernels='reference') for it.")
    if support.code == FMT_PLAIN:
        return support.code, SCALE_NONE
    if granularity not in support.decode:
        raise UnsupportedShapeError(
            f"{fmt_name} with scale granularity {granularity!r} has no Triton decode kernel; "
            f"supported: {', '.join(support.decode)}. Use KVConfig(kernels='reference') for it.")
    if granularity == "channel" and support.channel_code is not None:
        # fp4 "channel": a page scale, and E4M3 micro scales per channel per 16 tokens
        return support.channel_code, SCALE_PAGE
    return support.code, SCALE_CODES[granularity]


def channel_min_page(fmt_name: str) -> int:
    """Smallest page the kernel takes for channel scales of this format (the format declares
    it: KernelSupport.channel_min_page; kernel_readable says the same). Int codes in 16-token
    tiles (pages of 16) gave wrong results on the H200 (triton 3.6; 2026-11-30: relative error
    2-4 in 4 of 4 such cases, while 32- to 128-token tiles and fp8 channel tiles of 16 passed),
    cause not found yet: refused."""
    return format_spec(fmt_name).kernels.channel_min_page


def channel_tile(block_t: int, page: int, pair: bool) -> int:
    """Tile of a kernel with channel scales: one page at most, or two whole pages (2 * page <=
    block_t) when `pair` (int codes and at most M / 2 query rows, see decode_split_kernel's
    PAIR: each query row is held twice, one copy per page). A two-page tile pays the softmax,
    barriers and loop overhead once for both pages: int4 pages of 64 read in 64-token tiles
    took 2.3x the time of fp4's 128-token tiles on the H200."""
    if pair and block_t >= 2 * page:
        return 2 * page
    return min(block_t, page)


def pair_rows(rows: int, m: int) -> bool:
    """Whether `rows` = G * Sq query rows fit twice in M = m padded rows."""
    return 2 * rows <= m


def _head_dim(data: torch.Tensor, fmt: int) -> int:
    """head_dim of pages data [N, H, P, Ds] in kernel format `fmt` (codes packed in bytes)."""
    if fmt in (FMT_E2M1, FMT_E2M1_TOKMICRO):
        return data.shape[3] * 2
    if fmt in INT_FMT_BITS:
        return data.shape[3] * 8 // INT_FMT_BITS[fmt]
    return data.shape[3]


def default_config(kfmt: int, d: int, dv: int, m: int) -> dict:
    """Tile shape per format, from the H200 sweeps (benchmarks/RESULTS.md, "Decode").

    Quantized pages: no Triton software pipelining (num_stages=1: the block-table -> page
    address chain makes its pipeliner wait on every copy at the top of each iteration, so it
    only costs shared memory), column-split dots and a 128-register cap (4 programs per SM
    instead of 2): 2.0 -> 2.8 TB/s on fp8, 1.2 -> 1.6 TB/s on fp4. bf16 keeps the pipeliner."""
    quantized = kfmt != FMT_PLAIN
    block_t = 128
    if max(d, dv) >= 256 or m >= 64:
        block_t = 64
    if quantized:
        cap = 128 if max(d, dv) <= 128 and m <= 16 else None
        # PAIR_MAXNREG: the cap of int channel tiles of two pages (launch_decode), 168 (3
        # programs / SM, 16 spill loads per tile instead of 45): 0.458 ms against 0.490 with
        # 128 (int4 K channel + int4 V token, pages of 64, B16 L32k, H200 2026-11-30)
        return {"BLOCK_T": block_t, "num_warps": 4, "num_stages": 1, "ASM": 3, "waves": 8,
                "SPLIT": 1, "maxnreg": cap, "PAIR_MAXNREG": 168 if cap else None}
    return {"BLOCK_T": block_t, "num_warps": 4, "num_stages": 2, "ASM": 0, "waves": 8,
            "SPLIT": 0, "maxnreg": None}


def choose_splits(batch: int, kv_heads: int, max_len: int, block_t: int, sm_count: int,
                  waves: float = 8) -> int:
    """Splits per (sequence, kv head): enough programs for `waves` x SMs, at least 4 tiles each.
    From shapes only (max_len = block-table capacity), so no device sync is needed."""
    tiles = max(1, -(-max_len // block_t))
    want = -(-int(waves * sm_count) // max(1, batch * kv_heads))
    return int(max(1, min(want, tiles // 4, 1024)))


def _check(q, kd, vd, kfmt, vfmt, block_tables, seq_lens, key_mask, attn_mass, out):
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise UnsupportedShapeError("paged_decode: q must be [B, Hq, Sq, D]")
    B, Hq, Sq, D = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UnsupportedShapeError(f"paged_decode: q dtype {q.dtype}; use bf16, fp16 or fp32")
    if not 1 <= Sq <= MAX_SQ:
        raise UnsupportedShapeError(f"paged_decode: Sq={Sq} new tokens; the decode kernel takes "
                                    f"1..{MAX_SQ} (use the prefill kernel for more)")
    N, Hkv, P = kd.shape[:3]
    dk, dv = _head_dim(kd, kfmt), _head_dim(vd, vfmt)
    if dk != D:
        raise UnsupportedShapeError(f"paged_decode: q head_dim {D} != key pages' {dk}")
    for name, d in (("head_dim", D), ("value head_dim", dv)):
        if d not in HEAD_DIMS:
            raise UnsupportedShapeError(f"paged_decode: {name} {d} not supported; the kernel "
                                        f"takes {HEAD_DIMS} (use KVConfig(kernels='reference'))")
    if tuple(vd.shape[:3]) != (N, Hkv, P):
        raise UnsupportedShapeError("paged_decode: key and value pages differ in pages / heads / "
                                    "page size")
    if P not in PAGE_SIZES:
        raise UnsupportedShapeError(f"paged_decode: page size {P}; supported {PAGE_SIZES}")
    if Hq % Hkv:
        raise UnsupportedShapeError(f"paged_decode: {Hq} query heads not a multiple of {Hkv}")
    if not (kd.is_contiguous() and vd.is_contiguous()):
        raise UnsupportedShapeError("paged_decode: page storage must be contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or \
            block_tables.shape[0] != B or block_tables.stride(1) != 1:
        raise UnsupportedShapeError(f"paged_decode: block_tables must be int32 [{B}, max_pages] "
                                    f"with unit stride; got {block_tables.dtype} "
                                    f"{tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (B,):
        raise UnsupportedShapeError(f"paged_decode: seq_lens must be int32 [{B}]")
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.dim() != 2
                                 or key_mask.shape[0] != B):
        raise UnsupportedShapeError(f"paged_decode: key_mask must be bool [{B}, L]")
    if attn_mass is not None and (attn_mass.dtype != torch.float32 or attn_mass.dim() != 3 or
                                  tuple(attn_mass.shape[:2]) != (B, Hkv) or
                                  not attn_mass.is_contiguous()):
        raise UnsupportedShapeError(f"paged_decode: attn_mass must be contiguous fp32 "
                                    f"[{B}, {Hkv}, max_len]")
    if out is not None and (tuple(out.shape) != (B, Hq, Sq, dv) or out.dtype != q.dtype
                            or not out.is_contiguous()):
        raise UnsupportedShapeError(f"paged_decode: out must be contiguous {q.dtype} "
                                    f"[{B}, {Hq}, {Sq}, {dv}]")
    dev = q.device
    if dev.type != "cuda" and not interpreting():
        raise UnsupportedShapeError("paged_decode: Triton kernels need CUDA tensors (or "
                                    "TRITON_INTERPRET=1); use KVConfig(kernels='reference')")
    return B, Hq, Sq, D, dv, N, Hkv, P


def _rot_tile(block_t: int, pair: bool, int_codes: bool) -> int:
    """Keys per tile of the rotated keys' phase (decode_split_kernel HAS_ROT): few, so that
    the sinks (4 in StreamingLLM) do not pay a whole tile's dots: 16 (tl.dot's least), 32 for
    int codes (launch_decode: no 16-token int tiles), a PAIR tile's two pages as they are.
    The other tiles that hold rotated keys run in a loop of their own (config ROT_PEEL, on by
    default; 0: the split's whole loop masks them, see decode_split_kernel)."""
    if pair:
        return block_t
    return min(block_t, 32 if int_codes else 16)


def _check_rot(rot, B: int, D: int, device, backend: str) -> None:
    """The launcher's contract for rotated leading keys (launch_decode `rot`)."""
    if backend != "triton":
        raise UnsupportedShapeError("paged_decode: rot (rotated leading keys) is read by the "
                                    "Triton kernel only; pass backend='triton'")
    if not (isinstance(rot, tuple) and len(rot) == 3):
        raise UnsupportedShapeError("paged_decode: rot must be (n_rot, cos, sin)")
    n_rot, cos, sin = rot
    if (n_rot.dtype not in (torch.int32, torch.int64) or tuple(n_rot.shape) != (B,)
            or not n_rot.is_contiguous() or n_rot.device != device):
        raise UnsupportedShapeError(f"paged_decode: rot's n_rot must be contiguous int32 / "
                                    f"int64 [{B}] on {device}")
    for name, t in (("cos", cos), ("sin", sin)):
        if (t.dtype != torch.float32 or tuple(t.shape) != (B, D) or not t.is_contiguous()
                or t.device != device):
            raise UnsupportedShapeError(f"paged_decode: rot's {name} must be contiguous fp32 "
                                        f"[{B}, {D}] on {device}")


def _check_residual(name, res, res_slot, N, Hkv, P, D) -> bool:
    """Whether a residual is read: res [R, Hkv, P, D] bf16 with R > 0, res_slot [N] int32."""
    if res is None or res.numel() == 0:  # no row was ever assigned: no page has a residual
        return False
    if (res.dtype != torch.bfloat16 or res.dim() != 4 or tuple(res.shape[1:]) != (Hkv, P, D)
            or not res.is_contiguous() or res_slot is None or res_slot.dtype != torch.int32
            or tuple(res_slot.shape) != (N,)):
        raise UnsupportedShapeError(f"paged_decode: {name}' residual must be contiguous bf16 "
                                    f"[R, {Hkv}, {P}, {D}] with int32 res_slot [{N}]")
    return True


# Formats whose decode runs the CUDA kernel (decode_sm90.py) on sm_90 by default
# (kernels="auto"): the H200 decode matrix (tests/gpu/test_decode_sm90_gpu.py, 334 cases)
# passes on it, and it measured 0.65-0.77x torch SDPA over bf16 for fp8 pages against
# 0.76-0.96x for the Triton kernel. bf16 / fp16 pages stay on Triton, which measured faster
# there (1.03-1.14x against 1.13-1.29x). benchmarks/RESULTS.md, "The CUDA decode kernel runs".
CUDA_DECODE_FORMATS = frozenset({"fp8_e4m3", "fp8_e5m2"})
# (keys, key scales, values, value scales) that also run it by default: int4 with the Pareto
# table's scales (keys per page and channel, values per token; benchmarks/RESULTS.md, "int4 in
# the CUDA decode kernel"), where the Triton kernel measured 0.79-1.01x torch SDPA over bf16.
CUDA_DECODE_GRANULAR = frozenset({("int4", "channel", "int4", "token")})


def cuda_decode_by_default(k_fmt: str, v_fmt: str, k_gran: str = "",
                           v_gran: str = "") -> bool:
    """Whether kernels="auto" asks for the CUDA decode kernel for these pages (fp8 pages of
    any scales; int4 pages only with the scales of CUDA_DECODE_GRANULAR)."""
    if k_fmt in CUDA_DECODE_FORMATS and v_fmt in CUDA_DECODE_FORMATS:
        return True
    return (k_fmt, k_gran, v_fmt, v_gran) in CUDA_DECODE_GRANULAR


def fast_path_reason(q, k_fmt: str, k_gran: str, v_fmt: str, v_gran: str, d: int, dv: int,
                     page: int, rows: int, attn_mass=None, residual: bool = False,
                     sinks: bool = False) -> str:
    """'' when the CUDA kernel (decode_sm90.py, Hopper) runs this decode, else why not."""
    if q.device.type != "cuda":
        return "not on CUDA"
    if sinks:
        return "attention sinks (a per-head sink logit): the CUDA kernel has no sink input"
    from kvcompile.kernels.decode_sm90 import MAX_ROWS, device_ok, unsupported

    ok, why = device_ok(q.device)   # kept per device there
    if not ok:
        return why

    if rows > MAX_ROWS:
        return f"{rows} query rows per kv head (G * Sq > {MAX_ROWS})"
    return unsupported(q, k_fmt, k_gran, v_fmt, v_gran, d, dv, page, attn_mass=attn_mass,
                       residual=residual)


def _combine(acc, plse, out, lse, num_splits: int, dv: int) -> None:
    rows = acc.shape[0]
    combine_splits_kernel[(rows,)](acc, plse, out, lse, lse, num_splits, 1, 1, DV=dv,
                                   S_PAD=triton.next_power_of_2(num_splits),
                                   CHUNK=min(16, triton.next_power_of_2(num_splits)),
                                   HAS_SINK=False, num_warps=4)


def launch_decode(q, kd, ks, km, vd, vs, vm, block_tables, seq_lens, key_mask, attn_mass, out,
                  k_fmt: str, k_gran: str, v_fmt: str, v_gran: str, scale: float,
                  sliding_window: int, sinks: int, softcap: float, num_splits: int,
                  config: dict | None = None, kz=None, vz=None, k_res=None, k_res_slot=None,
                  v_res=None, v_res_slot=None, backend: str = "auto",
                  sink_logits=None, rot=None, qk_fp8: bool = False) -> torch.Tensor:
    """Check, then launch split kernel (+ combine, + attention-mass pass). Writes `out`.
    qk_fp8: the CUDA kernel's opt-in variant with q.k on e4m3 tensor cores (q quantized to
    e4m3; fp8_e4m3 keys on sm_90 only; refused with the reason otherwise).
    kz / vz: int zero points (shaped like the scales); k_res / v_res [R, Hkv, P, D] bf16 and
    k_res_slot / v_res_slot [N] int32: residual pages (PagedTensor.res_data / res_slot);
    sink_logits [Hq] fp32: attention sinks (the module docstring); rot: (n_rot, cos, sin),
    rotated leading keys (the module docstring; Triton kernel only)."""
    kfmt, ksm = _codes(k_fmt, k_gran)
    vfmt, vsm = _codes(v_fmt, v_gran)
    B, Hq, Sq, D, DV, N, Hkv, P = _check(q, kd, vd, kfmt, vfmt, block_tables, seq_lens,
                                         key_mask, attn_mass, out)
    check_sink_logits("paged_decode", sink_logits, Hq, q.device)
    if rot is not None:
        _check_rot(rot, B, D, q.device, backend)
        if sliding_window:
            raise UnsupportedShapeError("paged_decode: rot (rotated leading keys) with a "
                                        "sliding window is not supported; pass one of them")
    if (backend == "cuda" or backend == "auto" and cuda_decode_by_default(
            k_fmt, v_fmt, k_gran, v_gran)) \
            and not interpreting():
        residual = _check_residual("keys", k_res, k_res_slot, N, Hkv, P, D) or \
            _check_residual("values", v_res, v_res_slot, N, Hkv, P, DV)
        why = fast_path_reason(q, k_fmt, k_gran, v_fmt, v_gran, D, DV, P, Hq // Hkv * Sq,
                               attn_mass, residual, sinks=sink_logits is not None)
        if not why:
            from kvcompile.kernels.decode_sm90 import launch_decode_sm90

            return launch_decode_sm90(
                q, kd, ks, vd, vs, block_tables, seq_lens, key_mask, out, k_fmt, k_gran, v_fmt,
                v_gran, scale, sliding_window, sinks, softcap, num_splits, _sm_count(q.device),
                _combine, qk_fp8=qk_fp8, kz=kz, vz=vz)
        if qk_fp8:
            raise UnsupportedShapeError(f"paged_decode: qk_fp8 runs on the CUDA kernel only, "
                                        f"which refuses this call: {why}")
    if qk_fp8:
        raise UnsupportedShapeError("paged_decode: qk_fp8 runs on the CUDA kernel only (sm_90, "
                                    "backend 'cuda' or 'auto'); drop qk_fp8 for this backend")
    for name, code, z in (("keys", kfmt, kz), ("values", vfmt, vz)):
        if code in INT_FMT_BITS and (z is None or z.dtype != torch.float16):
            raise UnsupportedShapeError(f"paged_decode: int {name} need fp16 zero points")
    kres = _check_residual("keys", k_res, k_res_slot, N, Hkv, P, D)
    vres = _check_residual("values", v_res, v_res_slot, N, Hkv, P, DV)
    G = Hq // Hkv
    M = max(16, triton.next_power_of_2(G * Sq))
    interp = interpreting()
    cfg = default_config(kfmt, D, DV, M)
    cfg.update(config or {})
    block_t = cfg["BLOCK_T"]
    if kfmt in INT_FMT_BITS or vfmt in INT_FMT_BITS:
        block_t = max(block_t, 32)  # no 16-token tiles of int codes (see channel_min_page)
    pair = False
    if SCALE_CHANNEL in (ksm, vsm):
        # channel scales are per page: a tile must not cross one (tiles start at multiples of
        # BLOCK_T, both powers of two), and tl.dot needs 16 keys
        min_page = channel_min_page(k_fmt if ksm == SCALE_CHANNEL else v_fmt)
        if ksm == vsm == SCALE_CHANNEL:
            min_page = max(min_page, channel_min_page(v_fmt))
        if P < min_page:
            raise UnsupportedShapeError(
                f"paged_decode: {k_fmt}/{v_fmt} with channel-granular scales needs page_size "
                f">= {min_page} (got {P}); use KVConfig(kernels='reference') or a larger page")
        pair = ((kfmt in INT_FMT_BITS or vfmt in INT_FMT_BITS) and pair_rows(G * Sq, M)
                and cfg.get("PAIR", True))
        block_t = channel_tile(block_t, P, pair)
        pair = block_t > P
        explicit = config is not None and "maxnreg" in config and "PAIR_MAXNREG" not in config
        if pair and cfg.get("PAIR_MAXNREG") and not explicit:
            cfg["maxnreg"] = cfg["PAIR_MAXNREG"]
    if SCALE_CHANNEL in (ksm, vsm) or kres or vres or FMT_E2M1_TOKMICRO in (kfmt, vfmt):
        cfg["SPLIT"] = 0  # these read whole rows (column halves only for the plain formats)
    if interp:  # the interpreter's bf16 dot is wrong and it cannot run PTX: fp32, plain ops
        cdt, asm = tl.float32, 0
    elif kfmt == FMT_PLAIN and vfmt == FMT_PLAIN and kd.dtype == vd.dtype:
        cdt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
               torch.float32: tl.float32}[kd.dtype]
        asm = 0
    else:
        cdt, asm = tl.float16, cfg["ASM"]
    if kfmt == FMT_PLAIN and vfmt != FMT_PLAIN or vfmt == FMT_PLAIN and kfmt != FMT_PLAIN:
        cdt = tl.float32 if interp else tl.float16
    q = q.contiguous()
    dev = q.device
    max_len = block_tables.shape[1] * P
    if num_splits <= 0:
        num_splits = choose_splits(B, Hkv, max_len, block_t, _sm_count(dev), cfg["waves"])
    window = int(sliding_window) if sliding_window and sliding_window > 0 else 0
    sinks = int(sinks) if window else 0
    if out is None:
        out = torch.empty(B, Hq, Sq, DV, dtype=q.dtype, device=dev)
    rows = B * Hq * Sq
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    direct = num_splits == 1
    if direct:
        acc = plse = lse
    else:
        acc = torch.empty(rows, num_splits, DV, dtype=torch.float32, device=dev)
        plse = torch.empty(rows, num_splits, dtype=torch.float32, device=dev)
    scores_len = attn_mass.shape[2] if attn_mass is not None else 0
    scores = (torch.full((rows, scores_len), float("-inf"), dtype=torch.float32, device=dev)
              if attn_mass is not None else lse)
    # (the kernel steps the mask's rows by its width: a non-contiguous one is copied first)
    kmask = key_mask.contiguous().view(torch.uint8) if key_mask is not None else seq_lens
    big = max(kd.numel(), vd.numel(), k_res.numel() if kres else 0,
              v_res.numel() if vres else 0) >= 2**31 - 2**20
    none = lse  # pointer of the arguments a launch does not read
    fold = FP4_ASM_FOLD if asm else 1.0
    qk_scale = float(scale) * LOG2E
    grid = (B * Hkv, num_splits)
    rot_ptrs = (rot[1], rot[2], rot[0]) if rot is not None else (none, none, none)  # cos, sin, n
    decode_split_kernel[grid](
        q, kd, none if ks is None else ks, kd if km is None else km, none if kz is None else kz,
        k_res if kres else none, k_res_slot if kres else none,
        vd, none if vs is None else vs, vd if vm is None else vm, none if vz is None else vz,
        v_res if vres else none, v_res_slot if vres else none,
        block_tables, seq_lens, kmask, acc, plse, out, scores,
        sink_logits if sink_logits is not None else none,
        *rot_ptrs,
        block_tables.stride(0), key_mask.shape[1] if key_mask is not None else 0, scores_len,
        Hkv, qk_scale, float(scale) / softcap if softcap else 0.0, softcap * LOG2E,
        fold if kfmt == FMT_E2M1 else 1.0, fold if vfmt == FMT_E2M1 else 1.0, window, sinks,
        num_splits, G=G, SQ=Sq, M=M, D=D, DV=DV, P=P, BLOCK_T=block_t,
        KFMT=kfmt, VFMT=vfmt, KSM=ksm, VSM=vsm, KRES=kres, VRES=vres, CDT=cdt,
        SOFTCAP=bool(softcap), HAS_SINK=sink_logits is not None and direct,
        HAS_KMASK=key_mask is not None, WRITE_SCORES=attn_mass is not None, DIRECT=direct,
        IEEE=cdt == tl.float32, WINDOW=window > 0, ASM=asm, BIG=big,
        SPLIT=bool(cfg["SPLIT"]), PAIR=pair, HAS_ROT=rot is not None, BLOCK_R=_rot_tile(
            block_t, pair, kfmt in INT_FMT_BITS or vfmt in INT_FMT_BITS),
        ROT_PEEL=bool(cfg.get("ROT_PEEL", 1)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interp else {}))
    if not direct:
        combine_splits_kernel[(rows,)](
            acc, plse, out, lse, sink_logits if sink_logits is not None else lse, num_splits,
            Hq, Sq, DV=DV, S_PAD=triton.next_power_of_2(num_splits),
            CHUNK=min(16, triton.next_power_of_2(num_splits)),
            HAS_SINK=sink_logits is not None, num_warps=4)
    if attn_mass is not None and scores_len > 0:
        blk = 256
        attn_mass_kernel[(B * Hkv, triton.cdiv(scores_len, blk))](
            scores, lse, attn_mass, seq_lens, scores_len, Hkv, G=G, SQ=Sq, BLOCK=blk,
            num_warps=4)
    return out


# --- custom ops ----------------------------------------------------------------------------

@torch.library.custom_op("kvcompile::paged_decode", mutates_args=("attn_mass",))
def paged_decode(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor | None,
                 k_micro: torch.Tensor | None, v_data: torch.Tensor,
                 v_scale: torch.Tensor | None, v_micro: torch.Tensor | None,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 key_mask: torch.Tensor | None, attn_mass: torch.Tensor | None, k_fmt: str,
                 k_gran: str, v_fmt: str, v_gran: str, scale: float, sliding_window: int,
                 sinks: int, softcap: float, num_splits: int,
                 k_zero: torch.Tensor | None = None, v_zero: torch.Tensor | None = None,
                 k_res: torch.Tensor | None = None, k_res_slot: torch.Tensor | None = None,
                 v_res: torch.Tensor | None = None,
                 v_res_slot: torch.Tensor | None = None,
                 sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    return launch_decode(q, k_data, k_scale, k_micro, v_data, v_scale, v_micro, block_tables,
                         seq_lens, key_mask, attn_mass, None, k_fmt, k_gran, v_fmt, v_gran,
                         scale, sliding_window, sinks, softcap, num_splits, None, k_zero,
                         v_zero, k_res, k_res_slot, v_res, v_res_slot, sink_logits=sink_logits)


@paged_decode.register_fake
def _(q, k_data, k_scale, k_micro, v_data, v_scale, v_micro, block_tables, seq_lens, key_mask,
      attn_mass, k_fmt, k_gran, v_fmt, v_gran, scale, sliding_window, sinks, softcap,
      num_splits, *extra):
    dv = _head_dim(v_data, _codes(v_fmt, v_gran)[0])
    return q.new_empty((*q.shape[:3], dv))


@torch.library.custom_op("kvcompile::paged_decode_out", mutates_args=("out", "attn_mass"))
def paged_decode_out(out: torch.Tensor, q: torch.Tensor, k_data: torch.Tensor,
                     k_scale: torch.Tensor | None, k_micro: torch.Tensor | None,
                     v_data: torch.Tensor, v_scale: torch.Tensor | None,
                     v_micro: torch.Tensor | None, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, key_mask: torch.Tensor | None,
                     attn_mass: torch.Tensor | None, k_fmt: str, k_gran: str, v_fmt: str,
                     v_gran: str, scale: float, sliding_window: int, sinks: int,
                     softcap: float, num_splits: int, k_zero: torch.Tensor | None = None,
                     v_zero: torch.Tensor | None = None, k_res: torch.Tensor | None = None,
                     k_res_slot: torch.Tensor | None = None,
                     v_res: torch.Tensor | None = None,
                     v_res_slot: torch.Tensor | None = None,
                     sink_logits: torch.Tensor | None = None) -> None:
    launch_decode(q, k_data, k_scale, k_micro, v_data, v_scale, v_micro, block_tables,
                  seq_lens, key_mask, attn_mass, out, k_fmt, k_gran, v_fmt, v_gran, scale,
                  sliding_window, sinks, softcap, num_splits, None, k_zero, v_zero, k_res,
                  k_res_slot, v_res, v_res_slot, sink_logits=sink_logits)


@paged_decode_out.register_fake
def _(out, *args, **kwargs):
    return None


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float, *,
                           key_mask=None, sliding_window: int = 0, sinks: int = 0,
                           softcap: float = 0.0, attn_mass=None, out=None,
                           num_splits: int | None = None, direct: bool = False,
                           backend: str = "auto", sink_logits=None,
                           rot=None) -> torch.Tensor:
    """Decode attention over paged K/V in any storage format.

    q: [B, Hq, Sq, D], Sq in 1..8; k_cache, v_cache: PagedTensor (data [N, Hkv, P, D]);
    block_tables: [B, max_pages] int32; seq_lens: [B] int32 (cached tokens, new ones included).
    key_mask: bool [B, Lm], key j seen iff key_mask[b, j] (j >= Lm: seen).
    sliding_window / sinks: keep keys with q_pos - k_pos < window, plus the first `sinks`.
    attn_mass: fp32 [B, Hkv, Lmax], += each key's attention probability summed over the group's
    query heads (and queries). out: optional [B, Hq, Sq, Dv] buffer. -> [B, Hq, Sq, Dv], q.dtype.
    sink_logits: fp32 [Hq], attention sinks (a logit per query head in each softmax's
    denominator; the module docstring).
    direct: launch without the custom op's dispatch (for callers that already run eagerly
    inside an op, like kvcompile.attention: the dispatch costs host time on every layer).
    backend (direct only): "triton" = the portable kernel; "cuda" = the CUDA kernel on sm_90
    (decode_sm90.py) where it takes the call, else Triton; "auto" = "cuda" for the formats of
    CUDA_DECODE_FORMATS (fp8 pages) and CUDA_DECODE_GRANULAR (int4 with channel-scaled keys and
    token-scaled values), else "triton".
    rot (direct, backend "triton" only): (n_rot [B] int32 / int64, cos [B, D] fp32, sin [B, D]
    fp32): keys j < n_rot[b] are scored by row b's query rotated by cos / sin (RoPE, HF
    rotate_half layout), the other keys by the query itself, in one softmax (re-rotated sinks,
    eviction/aside.py; the module docstring).
    """
    if rot is not None and not direct:
        raise UnsupportedShapeError("paged_decode_attention: rot needs direct=True")
    if direct:
        return launch_decode(
            q, k_cache.data, k_cache.scale, k_cache.micro, v_cache.data, v_cache.scale,
            v_cache.micro, block_tables, seq_lens, key_mask, attn_mass, out, k_cache.fmt.name,
            k_cache.fmt.granularity, v_cache.fmt.name, v_cache.fmt.granularity, float(scale),
            int(sliding_window or 0), int(sinks or 0), float(softcap or 0.0),
            int(num_splits or 0), None, k_cache.zero, v_cache.zero, k_cache.res_data,
            k_cache.res_slot, v_cache.res_data, v_cache.res_slot, backend=backend,
            sink_logits=sink_logits, rot=rot)
    args = (q, k_cache.data, k_cache.scale, k_cache.micro, v_cache.data, v_cache.scale,
            v_cache.micro, block_tables, seq_lens, key_mask, attn_mass,
            k_cache.fmt.name, k_cache.fmt.granularity, v_cache.fmt.name,
            v_cache.fmt.granularity, float(scale), int(sliding_window or 0), int(sinks or 0),
            float(softcap or 0.0), int(num_splits or 0))
    extra = {}  # int zero points, residual pages: only when the caches have them
    for name, c in (("k", k_cache), ("v", v_cache)):
        if c.zero is not None:
            extra[f"{name}_zero"] = c.zero
        if c.res_data is not None:
            extra[f"{name}_res"], extra[f"{name}_res_slot"] = c.res_data, c.res_slot
    if sink_logits is not None:
        extra["sink_logits"] = sink_logits
    if out is None:
        return torch.ops.kvcompile.paged_decode(*args, **extra)
    torch.ops.kvcompile.paged_decode_out(out, *args, **extra)
    return out
