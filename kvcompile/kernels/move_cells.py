"""Compaction moves into fp8 pages with page scales, in three launches (eviction between
CUDA-graph decode steps, cache/compaction.py `move_slots_device`): bit for bit what its
plain-PyTorch path (`_move_cells`, about 90 small device ops a layer's K or V) stores.

    _move_amax_kernel   one program per move: a real move's source row gathered and decoded
                        (kept in VALS for the last launch: sources are read before any
                        write), its finite amax atomically into its destination cell's
                        (page, head) slot of AMAX
    _move_cells_kernel  one program per destination cell: the page scale grows to cover
                        AMAX / fmax (formats.grow_page_scale); a cell whose scale grew is
                        decoded with the old scale and encoded again whole with the new
    _move_store_kernel  one program per move: a real move's values encoded under its cell's
                        new scale, at its destination slot (after the re-encode: last word)

Inputs as `compaction.plan_moves` plans them: each move's source page / slot / head ps / os /
heads [M], its cell rank seg [M], destination slot od [M] and real [M] (bool); the cells'
pages pg / heads hd [S] and the last used rank (device tensors, no host sync). The decode,
encode, re-encode and growth helpers are the append kernels' (kernels/append.py:
`_decode_fp8`, `_encode_fp8`, `_reencode_rows`, `_grow_scale`), bit-exact with the reference
encoder on the GPU and, with explicit rounding, under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.kernels.append import (
    _decode_fp8,
    _div_const,
    _encode_fp8,
    _finite_abs,
    _grow_scale,
    _interpreting,
    _max_nan,
    _reencode_rows,
)
from kvcompile.kernels.decode_tiles import FMT_E4M3, FMT_E5M2


@triton.jit
def _move_amax_kernel(DATA, SCALE, PS, OS, HS, SEG, REAL, VALS, AMAX, H, P: tl.constexpr,
                      D: tl.constexpr, FMT: tl.constexpr, DATA_DT: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    if tl.load(REAL + m) != 0:
        src = tl.load(PS + m) * H + tl.load(HS + m)          # the source's (page, head) cell
        d = tl.arange(0, D)
        code = tl.load(DATA + (src * P + tl.load(OS + m)) * D + d)
        v = _decode_fp8(code, tl.load(SCALE + src), FMT, DATA_DT)
        tl.store(VALS + m * D + d, v)   # read before any write: the later launches use these
        tl.atomic_max(AMAX + tl.load(SEG + m), tl.max(_finite_abs(v), 0))


@triton.jit
def _move_cells_kernel(DATA, SCALE, AMAX, PG, HD, LAST, NEWS, H, P: tl.constexpr,
                       D: tl.constexpr, FMT: tl.constexpr, DATA_DT: tl.constexpr,
                       EXPLICIT: tl.constexpr, FMAX: tl.constexpr, DIV: tl.constexpr,
                       RECIP: tl.constexpr):
    r = tl.program_id(0)
    if r > tl.load(LAST):
        return
    cell = tl.load(PG + r) * H + tl.load(HD + r)
    old = tl.load(SCALE + cell)
    cover = _div_const(tl.load(AMAX + r), DIV, RECIP)
    new = _grow_scale(old, cover)
    tl.store(NEWS + r, new)
    if cover > old:   # grown (NaN scales never grow): the whole page again under the new scale
        rows = cell.to(tl.int64) * P + tl.arange(0, P)
        _reencode_rows(DATA, DATA, rows, tl.full([P], True, tl.int1), old, new, D, FMT,
                       DATA_DT, EXPLICIT, FMAX, RECIP)
        tl.store(SCALE + cell, new)


@triton.jit
def _move_store_kernel(VALS, SEG, REAL, OD, PG, HD, NEWS, DATA, H, P: tl.constexpr,
                       D: tl.constexpr, FMT: tl.constexpr, EXPLICIT: tl.constexpr,
                       FMAX: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    if tl.load(REAL + m) != 0:
        r = tl.load(SEG + m)
        cell = tl.load(PG + r) * H + tl.load(HD + r)
        d = tl.arange(0, D)
        x = tl.load(VALS + m * D + d)[None, :]
        s = tl.zeros([1], tl.float32) + tl.load(NEWS + r)
        code = _encode_fp8(x, s, tl.reduce(tl.abs(x), 1, _max_nan), FMT, FMAX, EXPLICIT)
        tl.store(DATA + (cell * P + tl.load(OD + m)) * D + d[None, :], code)


FORMATS = {"fp8_e4m3": (FMT_E4M3, tl.float8e4nv), "fp8_e5m2": (FMT_E5M2, tl.float8e5)}


def takes(paged) -> str:
    """"" where `move_cells` takes these pages, else why not."""
    fmt = paged.fmt
    if fmt.name not in FORMATS or fmt.granularity != "page":
        return f"{fmt.name}/{fmt.granularity}: fp8 pages with page scales only"
    if paged.micro is not None or getattr(paged, "res_slot", None) is not None:
        return "residual rows"
    D = paged.head_dim
    if D < 16 or D > 512 or D & (D - 1) or paged.page_size & (paged.page_size - 1):
        return f"head_dim {D} / page {paged.page_size}: powers of two, head_dim 16..512"
    if paged.data.device.type != "cuda" and not _interpreting():
        return "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)"
    if paged.scale is None or paged.scale.dtype != torch.float32:
        return "page scales must be fp32"
    if not (paged.data.is_contiguous() and paged.scale.is_contiguous()):
        return "page storage must be contiguous"
    return ""


def move_cells(paged, plan: dict) -> None:
    """`compaction._move_cells` for the pages `takes`, the moves as `compaction.plan_moves`
    planned them (one layer's: ps / os / heads the sources, od / real / seg [M], pg / hd [S],
    last [1]; see the module docstring). The sources are gathered and decoded by the first
    launch, before any write."""
    ps, os_, hs, od, real, seg, pg, hd, last = (
        plan[k] for k in ("ps", "os", "heads", "od", "real", "seg", "pg", "hd", "last"))
    M, S = ps.numel(), pg.numel()
    if M == 0:
        return
    fmt, data_dt = FORMATS[paged.fmt.name]
    H, P, D = paged.num_heads, paged.page_size, paged.head_dim
    explicit = _interpreting()
    fmax = float(torch.finfo(paged.data.dtype).max)
    d8 = paged.data.view(torch.uint8)
    ps, os_, hs, seg, od, pg, hd, last = (
        t.to(torch.int64).contiguous() for t in (ps, os_, hs, seg, od, pg, hd, last))
    real = real.contiguous()
    dev = d8.device
    vals = torch.empty(M, D, dtype=torch.float32, device=dev)
    amax = torch.zeros(S, dtype=torch.float32, device=dev)
    news = torch.empty(S, dtype=torch.float32, device=dev)
    _move_amax_kernel[(M,)](d8, paged.scale, ps, os_, hs, seg, real, vals, amax, H, P=P, D=D,
                            FMT=fmt, DATA_DT=data_dt, num_warps=1)
    _move_cells_kernel[(S,)](d8, paged.scale, amax, pg, hd, last, news, H, P=P, D=D,
                             FMT=fmt, DATA_DT=data_dt, EXPLICIT=explicit, FMAX=fmax, DIV=fmax,
                             RECIP=not explicit, num_warps=4)
    _move_store_kernel[(M,)](vals, seg, real, od, pg, hd, news, d8, H, P=P, D=D, FMT=fmt,
                             EXPLICIT=explicit, FMAX=fmax, num_warps=1)
