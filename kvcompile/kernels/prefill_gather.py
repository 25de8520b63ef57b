"""Chunked prefill by gathering: dequantize a sequence's paged K/V into a transient contiguous
workspace, then run the dense varlen kernel over it (the route serving systems take for long
chunks over a long prefix).

    out = gathered_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                     scale, workspace_bytes=1 << 30)
    out = chunk_prefill_attention(..., route="auto")   # the rule picks gathered or paged

The in-kernel paged route (kernels/prefill_paged.py) gathers and dequantizes every page tile
inside the attention loop, once per query tile: on the H200 a 2,048-token chunk over a
30,720-token prefix ran at 0.65x the same chunk over contiguous bf16 (bf16 pages) and 0.385x
(fp8 page scales), the page gather being the limiter (benchmarks/RESULTS.md). Here each stored
key is read once, by a bandwidth-bound kernel (`gather_pages_kernel`, one launch per K and V),
into [keys, Hkv, D] in q's dtype, and the chunk attends with `prefill_attention(...,
cu_seqlens_k=...)` (queries at the tail of their keys, the causal offset built in).

Workspace: sequence b's keys [start_b, seq_lens[b]) (start_b: its kv_start, or the first key its
sliding window can reach when there are no sinks), its chunk's own K/V included (read back from
the pages, as the paged kernel does). Sequences are processed in groups whose workspace stays
under `workspace_bytes`; a sequence that alone needs more is attended in pieces of keys merged
by their log-sum-exp. The workspace is freed when the call returns, no full-precision copy of
the cache survives it. `choose_route` picks this route or the paged one (KVConfig
prefill_chunk_route).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvcompile.cache import registry
from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels import prefill_launch as L
from kvcompile.kernels.prefill import (
    _on_kernel_device,
    _pages_view,
    paged_prefill_attention,
    prefill_attention,
)
from kvcompile.kernels.prefill_paged import _page_tile

_TENSOR = tl.constexpr(registry.SCALE_TENSOR)

# Query rows per kv head, weighted by keys, from which the gather pays (choose_route). The
# gather costs ~8 * D bytes per key and kv head (read the codes, write bf16, read them back),
# ~2 ns per key at 4 TB/s for D = 128; attention costs 4 * rows * D flop per key, ~1.3 ps per
# row at 400 TFLOP/s. Measured on the H200 (benchmarks/RESULTS.md, ninth session; fp8 page
# scales, a 30,720-token prefix, GQA 32/8): at 64 tokens (256 rows) the gather route took 0.917
# ms against the paged kernel's 1.204; at 256 tokens 0.889 against 1.221; at 2,048 tokens 2.610
# against 5.959. Shorter chunks were not timed: below 256 rows the paged kernel stays.
GATHER_MIN_ROWS = 256
DEFAULT_WORKSPACE_BYTES = 1 << 30   # KVConfig.prefill_gather_bytes
BLOCK_T = 64                        # keys per program of the gather kernel


@triton.jit
def _int_tile(Data, Scale, Zero, bt_row, keys, ok, hkv, H, sp, sh, st, BITS: tl.constexpr,
              GRAN: tl.constexpr, DIM: tl.constexpr, PAGE: tl.constexpr):
    # int pages (cache/intq.py) -> fp32 [BLOCK, DIM] of `keys`: Data [N, Hkv, P, DIM * BITS /
    # 8] uint8, codes packed along head_dim (int4: element 2i in the low nibble of byte i;
    # int2: element 4i + j in bits 2j of byte i; int3: element 8i + j in bits 3j of the
    # little-endian 24-bit word of bytes 3i..3i+2); Scale / Zero fp16, contiguous: GRAN 0
    # [N, Hkv] (page), 1 [N, Hkv, P] (token), 2 [N, Hkv, DIM] (channel). x = code * scale +
    # zero in fp32 (a NaN scale: NaN), as intq.int_decode.
    page = tl.load(bt_row + keys // PAGE, mask=ok, other=0).to(tl.int64)
    off = keys % PAGE
    d = tl.arange(0, DIM)
    base = page * sp + hkv * sh + off * st
    m = ok[:, None]
    if BITS == 3:
        unit = base[:, None] + 3 * (d // 8)[None, :]
        w = (tl.load(Data + unit, mask=m, other=0).to(tl.int32)
             | (tl.load(Data + unit + 1, mask=m, other=0).to(tl.int32) << 8)
             | (tl.load(Data + unit + 2, mask=m, other=0).to(tl.int32) << 16))
        code = (w >> (3 * (d % 8))[None, :]) & 7
    else:
        PER: tl.constexpr = 8 // BITS
        x = tl.load(Data + base[:, None] + (d // PER)[None, :], mask=m, other=0).to(tl.int32)
        code = (x >> (BITS * (d % PER))[None, :]) & ((1 << BITS) - 1)
    head = page * H + hkv
    if GRAN == 2:
        prm = head[:, None] * DIM + d[None, :]
        sc = tl.load(Scale + prm, mask=m, other=0.0).to(tl.float32)
        zp = tl.load(Zero + prm, mask=m, other=0.0).to(tl.float32)
    else:
        if GRAN == 1:
            prm = head * PAGE + off
        else:
            prm = head
        sc = tl.load(Scale + prm, mask=ok, other=0.0).to(tl.float32)[:, None]
        zp = tl.load(Zero + prm, mask=ok, other=0.0).to(tl.float32)[:, None]
    return code.to(tl.float32) * sc + zp


@triton.jit
def gather_pages_kernel(Data, Scale, Micro, Zero, Out, block_tables, starts, cu_k, stride_bt,
                        sp, sh, st, ssp, ssh, sst, mp, mh, mt, stride_ot, stride_oh, H,
                        FMT: tl.constexpr, GRAN: tl.constexpr, DIM: tl.constexpr,
                        PAGE: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr = 0):
    # Data: [N, Hkv, P, DIM] (fp4: [N, Hkv, P, DIM // 2] uint8; BITS > 0: int codes, GRAN
    # then 0 / 1 / 2 for page / token / channel scales, `_int_tile`)  Out: [Tk, Hkv, DIM]
    # sequence b's keys starts[b] + i, i < cu_k[b + 1] - cu_k[b], go to rows cu_k[b] + i
    tile = tl.program_id(0)
    hkv = tl.program_id(1)
    b = tl.program_id(2)
    k0 = tl.load(cu_k + b)
    n = tl.load(cu_k + b + 1) - k0
    if tile * BLOCK >= n:
        return
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    keys = tl.load(starts + b) + rows
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    if BITS > 0:
        x = _int_tile(Data, Scale, Zero, bt_row, keys, ok, hkv, H, sp, sh, st, BITS, GRAN, DIM,
                      PAGE)
    else:
        x, _ = _page_tile(Data, Scale, Micro, bt_row, keys, ok, hkv, sp, sh, st, ssp, ssh,
                          sst, mp, mh, mt, FMT, GRAN, DIM, PAGE, BLOCK, tl.float32, False)
        if GRAN == _TENSOR:
            x = x * tl.load(Scale)
    offs = tl.arange(0, DIM)
    o = (k0 + rows).to(tl.int64) * stride_ot + hkv * stride_oh
    tl.store(Out + o[:, None] + offs[None, :], x.to(Out.dtype.element_ty), mask=ok[:, None])


_INT_GRAN = {"page": 0, "token": 1, "channel": 2}


def _int_bits(fmt: str) -> int:
    """Bits of an int format's codes, 0 for any other format."""
    spec = registry.format_spec(fmt)
    return spec.bits if spec.family == "int" else 0


def _gathered_dim(fmt: str, data: torch.Tensor) -> int:
    """head_dim of pages whose data is [N, Hkv, P, last]: fp4 and int codes are packed."""
    bits = _int_bits(fmt)
    if bits:
        return data.shape[3] * 8 // bits
    return data.shape[3] * (2 if fmt == "fp4_e2m1" else 1)


# --- the gather op -----------------------------------------------------------------------------

@torch.library.custom_op("kvcompile::gather_pages", mutates_args=())
def _gather_pages_op(data: torch.Tensor, scale: torch.Tensor | None, micro: torch.Tensor | None,
                     zero: torch.Tensor | None, fmt: str, granularity: str,
                     block_tables: torch.Tensor, starts: torch.Tensor, cu_k: torch.Tensor,
                     total: int, max_len: int, out_dtype: torch.dtype) -> torch.Tensor:
    Hkv = data.shape[1]
    dim = _gathered_dim(fmt, data)
    bits = _int_bits(fmt)
    out = torch.empty(total, Hkv, dim, dtype=out_dtype, device=data.device)
    if total == 0:
        return out
    if not _on_kernel_device(data):
        pages = _pages_view(fmt, granularity, data, scale, micro)
        if bits:   # int pages: their own granularities and a zero point (cache/intq.py)
            from kvcompile.cache.formats import KVFormat

            pages.fmt, pages.zero, pages.head_dim = KVFormat(fmt, granularity), zero, dim
        P = pages.page_size
        cu, st = cu_k.tolist(), starts.tolist()
        for b in range(len(st)):
            n = cu[b + 1] - cu[b]
            if n:
                rows = block_tables[b, st[b] // P:(st[b] + n + P - 1) // P].long()
                x = pages.read(rows).permute(0, 2, 1, 3).reshape(-1, Hkv, dim)
                off = st[b] % P
                out[cu[b]:cu[b + 1]] = x[off:off + n].to(out_dtype)
        return out
    op = "gather_pages"
    if out_dtype not in L.FLOAT_DTYPES:
        raise UnsupportedShapeError(f"{op}: the workspace dtype must be bf16/fp16/fp32; got "
                                    f"{out_dtype}")
    if bits:
        if granularity not in _INT_GRAN or scale is None or zero is None:
            raise UnsupportedShapeError(f"{op}: {fmt} pages need page, token or channel "
                                        f"scales and zero points; got {granularity}")
        if data.dtype != torch.uint8 or data.stride(3) != 1:
            raise UnsupportedShapeError(f"{op}: {fmt} codes must be uint8 with unit stride "
                                        f"along head_dim")
        code, gran = 0, _INT_GRAN[granularity]
        scale, zero = scale.contiguous(), zero.contiguous()
        strides = (data.stride(0), data.stride(1), data.stride(2)) + (0,) * 6
    else:
        code, gran, strides = L._page_args(op, "pages", fmt, granularity, data, scale, micro,
                                           Hkv, dim)
    dummy = cu_k
    grid = (triton.cdiv(max(max_len, 1), BLOCK_T), Hkv, starts.numel())
    gather_pages_kernel[grid](
        data, scale if scale is not None else dummy, micro if micro is not None else dummy,
        zero if zero is not None else dummy, out, block_tables, starts, cu_k,
        block_tables.stride(0), *strides, out.stride(0), out.stride(1), Hkv, FMT=code,
        GRAN=gran, DIM=dim, PAGE=data.shape[2], BLOCK=BLOCK_T, BITS=bits, num_warps=4)
    return out


@_gather_pages_op.register_fake
def _(data, scale, micro, zero, fmt, granularity, block_tables, starts, cu_k, total, max_len,
      out_dtype):
    return data.new_empty(total, data.shape[1], _gathered_dim(fmt, data), dtype=out_dtype)


def gather_pages(cache, block_tables, starts, cu_k, total: int, max_len: int, dtype):
    """Dequantize keys [starts[b], starts[b] + cu_k[b+1] - cu_k[b]) of each sequence's pages
    (PagedTensor `cache`, any format the prefill kernel reads, and int pages) into rows
    [cu_k[b], cu_k[b+1]) of a new [total, Hkv, D] `dtype` tensor. starts [B], cu_k [B+1]:
    int32 on the pages' device; max_len: the longest sequence's count."""
    return torch.ops.kvcompile.gather_pages(
        cache.data, cache.scale, cache.micro, cache.zero, cache.fmt.name, cache.fmt.granularity,
        block_tables, starts, cu_k, int(total), int(max_len), dtype)


# --- the route ---------------------------------------------------------------------------------

class HostLens(NamedTuple):
    """The host's copy of a chunked prefill's lengths (the runtime's StepPlan has them)."""
    q_lens: list[int]
    seq_lens: list[int]
    kv_start: list[int]


def host_lens(cu_seqlens_q, seq_lens, kv_start) -> HostLens:
    """Read the lengths back from the device (one sync); pass HostLens to avoid it."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    starts = kv_start.tolist() if kv_start is not None else [0] * len(lens)
    return HostLens([b - a for a, b in zip(cu[:-1], cu[1:])], lens, starts)


def _key_ranges(h: HostLens, window: int, sinks: int) -> list[tuple[int, int]]:
    """(first key, keys) each sequence's workspace holds: from its kv_start (or the first key
    its window reaches, without sinks) to its end; none for a sequence without queries."""
    out = []
    for q, n, s in zip(h.q_lens, h.seq_lens, h.kv_start):
        if q == 0:
            out.append((s, 0))
            continue
        if window > 0 and sinks == 0:
            s = max(s, n - q - window + 1)
        out.append((s, max(n - s, 0)))
    return out


class Route(NamedTuple):
    route: str    # "gather" or "paged"
    reason: str   # why, for the report


def choose_route(choice: str, h: HostLens, group: int, bytes_per_key: int, budget: int, *,
                 window: int = 0, sinks: int = 0, sink_logits: bool = False,
                 paged_ok: bool = True) -> Route:
    """Gather (this module) or the in-kernel paged route, for one chunked prefill.

    choice: KVConfig.prefill_chunk_route ("auto", "gather", "paged"). bytes_per_key: the
    workspace bytes of one key (Hkv * (D + Dv) * q's element size). "auto" gathers when the
    query rows per kv head, weighted by each sequence's keys (the attention work per gathered
    key), reach GATHER_MIN_ROWS. Either way the paged route runs where the gather cannot:
    attention-sink logits (the varlen kernel has none), left padding past a chunk's first
    query, a sequence whose workspace exceeds `budget` bytes and cannot be attended in pieces
    (a sliding window, or a chunk that alone exceeds it). paged_ok False: pages no paged
    kernel reads (int formats): the gather wherever it can run, whatever the chunk's length
    (a "paged" answer then says why it cannot, and the caller attends otherwise)."""
    if choice == "paged":
        return Route("paged", "prefill_chunk_route='paged'")
    if sink_logits:
        return Route("paged", "attention-sink logits (the varlen kernel has no sink column)")
    ranges = _key_ranges(h, window, sinks)
    if any(q > n - s for q, n, s in zip(h.q_lens, h.seq_lens, h.kv_start) if q):
        return Route("paged", "left padding reaches into a chunk")
    big = max((k for _, k in ranges), default=0) * bytes_per_key
    if big > budget and (window or max(h.q_lens) * bytes_per_key > budget):
        return Route("paged", f"one sequence's workspace ({big / 2**20:.0f} MiB) exceeds "
                              f"prefill_gather_bytes ({budget / 2**20:.0f} MiB) and cannot be "
                              f"split (a sliding window, or its chunk alone)")
    if choice == "gather":
        return Route("gather", "prefill_chunk_route='gather'")
    if not paged_ok:
        return Route("gather", "no paged prefill kernel reads these pages")
    keys = sum(k for _, k in ranges)
    rows = group * sum(q * k for q, (_, k) in zip(h.q_lens, ranges)) / max(keys, 1)
    if rows < GATHER_MIN_ROWS:
        return Route("paged", f"short chunk ({rows:.0f} query rows per kv head < "
                              f"{GATHER_MIN_ROWS})")
    return Route("gather", f"long chunk ({rows:.0f} query rows per kv head)")


def _groups(ranges, bytes_per_key: int, budget: int) -> list[tuple[int, int]]:
    """Consecutive sequences [b0, b1) whose workspace fits `budget` together."""
    out, b0, used = [], 0, 0
    for b, (_, n) in enumerate(ranges):
        cost = n * bytes_per_key
        if used and used + cost > budget:
            out.append((b0, b))
            b0, used = b, 0
        used += cost
    out.append((b0, len(ranges)))
    return out


def gathered_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                               scale: float, *, sliding_window=0, sinks=0, softcap=0.0,
                               kv_start=None, host: HostLens | None = None,
                               workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, out=None):
    """Chunked prefill (the contract of kernels/prefill.py `paged_prefill_attention`, without
    sink logits) through a transient contiguous workspace.

    q: [T, Hq, D] bf16/fp16/fp32 packed by cu_seqlens_q [B+1] int32; k_cache / v_cache:
    PagedTensor in a format the prefill kernel reads; block_tables [B, max_pages] int32;
    seq_lens [B] int32 (chunks included, already written); kv_start [B] int32 or None.
    host: the lengths on the host (else read back, one sync). The workspace (q's dtype) holds at
    most `workspace_bytes` at once: a sequence whose keys need more is attended in pieces of
    keys, merged by their log-sum-exp (`_attend_in_pieces`; not with a sliding window, and its
    chunk alone must fit). -> [T, Hq, Dv]."""
    h = host or host_lens(cu_seqlens_q, seq_lens, kv_start)
    T, Hq, _ = q.shape
    Hkv, Dv = k_cache.num_heads, v_cache.head_dim
    if Hkv == 0 or Hq % Hkv:
        raise UnsupportedShapeError(f"gathered prefill: {Hq} query heads is not a multiple of "
                                    f"{Hkv} kv heads")
    if any(qn > n - s for qn, n, s in zip(h.q_lens, h.seq_lens, h.kv_start) if qn):
        raise UnsupportedShapeError("gathered prefill: left padding (kv_start) reaches into a "
                                    "chunk's queries; use paged_prefill_attention")
    res = out if out is not None else torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)
    ranges = _key_ranges(h, sliding_window, sinks)
    per_key = Hkv * (k_cache.head_dim + Dv) * q.element_size()
    cu_q = [0]
    for n in h.q_lens:
        cu_q.append(cu_q[-1] + n)
    dev = q.device
    cap = max(workspace_bytes // per_key, 1)   # keys one workspace may hold
    for b0, b1 in _groups(ranges, per_key, workspace_bytes):
        q0, q1 = cu_q[b0], cu_q[b1]
        if q1 == q0:
            continue
        if ranges[b0][1] > cap and _on_kernel_device(q):   # one sequence, alone in its group
            if sliding_window or h.q_lens[b0] > cap:
                raise UnsupportedShapeError(
                    f"gathered prefill: sequence {b0} needs {ranges[b0][1]} keys in a workspace "
                    f"of {cap} and cannot be split (a sliding window, or a chunk longer than the "
                    f"workspace); raise prefill_gather_bytes or use paged_prefill_attention")
            res[q0:q1] = _attend_in_pieces(q[q0:q1], k_cache, v_cache, block_tables[b0:b0 + 1],
                                           ranges[b0], cap, scale, softcap)
            continue
        part = ranges[b0:b1]
        cu_k = [0]
        for _, n in part:
            cu_k.append(cu_k[-1] + n)
        starts_t = torch.tensor([s for s, _ in part], dtype=torch.int32, device=dev)
        cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=dev)
        cu_q_t = torch.tensor([x - q0 for x in cu_q[b0:b1 + 1]], dtype=torch.int32, device=dev)
        bt = block_tables[b0:b1]
        longest = max(n for _, n in part)
        kw = gather_pages(k_cache, bt, starts_t, cu_k_t, cu_k[-1], longest, q.dtype)
        vw = gather_pages(v_cache, bt, starts_t, cu_k_t, cu_k[-1], longest, q.dtype)
        longest_q = max(h.q_lens[b0:b1])
        if _on_kernel_device(q):   # straight into the output rows (no copy)
            L.launch_prefill(q[q0:q1], kw, vw, cu_q_t, res[q0:q1], scale, True,
                             sliding_window, sinks, softcap, longest_q, None,
                             cu_seqlens_k=cu_k_t)
        else:
            res[q0:q1] = prefill_attention(q[q0:q1], kw, vw, cu_q_t, scale,
                                           sliding_window=sliding_window, sinks=sinks,
                                           softcap=softcap, max_seqlen=longest_q,
                                           cu_seqlens_k=cu_k_t)
        del kw, vw   # the workspace does not outlive its group
    return res


def chunk_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                            scale: float, *, route: str | Route = "auto", sliding_window=0,
                            sinks=0,
                            softcap=0.0, kv_start=None, sink_logits=None,
                            host: HostLens | None = None,
                            workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, out=None):
    """Chunked prefill over pages by either route (the contract of kernels/prefill.py
    `paged_prefill_attention`). route: "paged" (the kernel reads the pages in its tile loop),
    "gather" (`gathered_prefill_attention`; raises UnsupportedShapeError where it cannot run)
    or "auto" (`choose_route`); or a `Route` that `choose_route` already returned for these
    lengths (taken as decided: the runtime picks once per forward and passes it down).
    -> ([T, Hq, Dv], Route taken)."""
    if isinstance(route, Route):
        pick = route
    elif route not in ("paged", "gather", "auto"):
        raise ValueError(f"chunk_prefill_attention: route must be 'paged', 'gather' or 'auto'; "
                         f"got {route!r}")
    else:
        pick = Route("paged", "prefill_chunk_route='paged'")
    if not isinstance(route, Route) and route != "paged":
        host = host or host_lens(cu_seqlens_q, seq_lens, kv_start)
        per_key = k_cache.num_heads * (k_cache.head_dim + v_cache.head_dim) * q.element_size()
        pick = choose_route(route, host, q.shape[1] // max(k_cache.num_heads, 1), per_key,
                            workspace_bytes, window=sliding_window, sinks=sinks,
                            sink_logits=sink_logits is not None)
        if route == "gather" and pick.route != "gather":
            raise UnsupportedShapeError(f"chunk_prefill_attention: route='gather' cannot run "
                                        f"here ({pick.reason}); use route='paged' or 'auto'")
    if pick.route == "gather":
        res = gathered_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
            sliding_window=sliding_window, sinks=sinks, softcap=softcap, kv_start=kv_start,
            host=host, workspace_bytes=workspace_bytes, out=out)
    else:
        res = paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
            sliding_window=sliding_window, sinks=sinks, softcap=softcap, kv_start=kv_start,
            out=out, sink_logits=sink_logits,
            max_q_len=max(host.q_lens, default=0) if host is not None else None)
    return res, pick


def _attend_in_pieces(q, k_cache, v_cache, block_table, key_range, cap: int, scale: float,
                      softcap: float) -> torch.Tensor:
    """One sequence's chunk q [n, Hq, D] over keys [first, first + count) (`key_range`) that do
    not fit one workspace of `cap` keys: the last `cap` keys (the chunk's own, causal at the
    tail) and the earlier ones in pieces of `cap` (all before every query: no mask), each
    gathered, attended with its log-sum-exp (varlen kernel, `lse=`) and merged in fp32.
    -> [n, Hq, Dv] fp32."""
    first, count = key_range
    n, Hq, _ = q.shape
    end = first + count
    dev = q.device
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=dev)
    pieces = [(max(first, end - cap), end, True)]
    pieces += [(a, min(a + cap, end - cap), False) for a in range(first, end - cap, cap)]
    o_acc = lse_acc = None
    for a, z, causal in pieces:
        starts = torch.tensor([a], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, z - a], dtype=torch.int32, device=dev)
        kw = gather_pages(k_cache, block_table, starts, cu_k, z - a, z - a, q.dtype)
        vw = gather_pages(v_cache, block_table, starts, cu_k, z - a, z - a, q.dtype)
        o = torch.empty(n, Hq, v_cache.head_dim, dtype=torch.float32, device=dev)
        lse = torch.empty(n, Hq, dtype=torch.float32, device=dev)
        L.launch_prefill(q, kw, vw, cu_q, o, scale, causal, 0, 0, softcap, n, None,
                         cu_seqlens_k=cu_k, lse=lse)
        del kw, vw
        o_acc, lse_acc = merge_attention(o_acc, lse_acc, o, lse)
    return o_acc


def merge_attention(o_a, lse_a, o_b, lse_b):
    """Attention over the union of two disjoint key sets from each one's output [n, H, Dv] and
    log2-sum-exp2 [n, H] (log2 units; -inf: no key seen). o_a None: (o_b, lse_b)."""
    if o_a is None:
        return o_b, lse_b
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp2(lse_a - m), torch.exp2(lse_b - m)
    tot = wa + wb
    o = (o_a * wa[..., None] + o_b * wb[..., None]) / torch.where(tot > 0, tot, 1.0)[..., None]
    return o, m + torch.log2(tot)
