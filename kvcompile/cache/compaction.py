"""Moving tokens inside one layer's paged storage, per kv head: the data side of compaction.

    move_slots(paged, src, dst, heads)   # src, dst: [M] global slots (page * P + offset)
                                         # heads:    [M] kv head of each move

Token `m` of head `heads[m]` goes from slot `src[m]` to slot `dst[m]` with every part that
holds it (paged.py lists them per format):
- into a page whose tokens wait in a bf16 residual row: the token's value, in bf16 (exact when
  it comes from a residual row, as it does: the residual page is a sequence's last);
- unquantized, token- and tensor-scaled formats: its codes and its own parameters (fp4 micro
  scales, token scales, int zero points) bit for bit, so compaction is exact; a token that comes
  from a residual row is quantized as a write would quantize it;
- page- and channel-scaled formats (one parameter set per (page, head) or (page, head,
  channel), and fp4 "channel" micro scales per 16 tokens of a channel): the moved token is
  encoded under the destination's parameters; those change only where the moved tokens fall
  outside them, and only then is the destination (page, head) re-encoded: fp8 / fp4 scales grow
  by powers of two (`grow_page_scale`, earlier tokens keep their decoded values), int ranges
  widen to cover both (earlier tokens are rounded again, as an append that widens them does),
  fp4 channel micro scales take the larger of theirs and the moved tokens' need. Parameters are
  never derived from a page's stored slots, so slots that hold no token (holes, a partly filled
  page's end) cannot change them. A NaN moved into a group makes that group NaN, as a write does.
All sources are read before any destination is written, so src and dst may overlap.

`move_slots_device` does the same with no host sync (eviction between CUDA-graph decode steps)
for the formats `moves_on_device` takes, every one without residual rows or a registered
codec: a gather and a scatter of each part where tokens move exactly, else the page- and
channel-scaled re-encode above by destination (page, head) cell, the cells ranked by a sort
instead of `unique`, with the same bytes as `move_slots`.
"""

from __future__ import annotations

import torch

from kvcompile.cache import grouped
from kvcompile.cache.fp4 import E2M1_MAX, MICRO_BLOCK, finite_amax, micro_scale, scale_from_amax
from kvcompile.cache.fp8 import grow_page_scale
from kvcompile.cache.intq import (
    _F16_MAX,
    covers,
    int_encode,
    int_params,
    levels,
    params_from_range,
)
from kvcompile.cache.paged import RESIDUAL_DTYPE, PagedTensor
from kvcompile.errors import UnsupportedShapeError


def move_slots(paged: PagedTensor, src: torch.Tensor, dst: torch.Tensor,
               heads: torch.Tensor) -> None:
    # src, dst, heads: [M] int64 on the storage device
    if src.numel() == 0:
        return
    P, fmt = paged.page_size, paged.fmt
    ps, os_, pd, od = src // P, src % P, dst // P, dst % P
    res_src, res_dst = _residual_rows(paged, ps), _residual_rows(paged, pd)
    vals = _values(paged, ps, os_, heads, res_src)                       # [M, D] fp32
    parts = {name: buf[ps, heads, os_] for name, buf in _token_parts(paged).items()}
    to_res = res_dst >= 0
    if bool(to_res.any()):
        paged.res_data[res_dst[to_res], heads[to_res], od[to_res]] = (
            vals[to_res].to(RESIDUAL_DTYPE))
    coded = ~to_res
    if not bool(coded.any()):
        return
    if fmt.spec.encode is not None:
        _move_custom(paged, vals[coded], pd[coded], od[coded], heads[coded])
        return
    if not fmt.is_quantized or fmt.granularity in ("token", "tensor"):
        copy = coded & (res_src < 0)
        _put(paged, {n: t[copy] for n, t in parts.items()}, pd[copy], od[copy], heads[copy])
        enc = coded & (res_src >= 0)
        if bool(enc.any()):
            _put(paged, _encode_tokens(paged, vals[enc]), pd[enc], od[enc], heads[enc])
        return
    _move_grouped(paged, vals[coded], pd[coded], od[coded], heads[coded])


def moves_exactly(paged: PagedTensor) -> bool:
    """Whether a token moves by copying its own stored parts (no residual rows, no parameter
    shared with other tokens): what `move_slots_exact` takes."""
    fmt = paged.fmt
    return (paged.res_slot is None and fmt.spec.encode is None
            and (not fmt.is_quantized or fmt.granularity in ("token", "tensor")))


def moves_on_device(paged: PagedTensor) -> bool:
    """Whether `move_slots_device` takes these pages: every format without a bf16 residual
    row (whose rows are assigned on the host) or a registered codec of its own (whose
    re-encode `unique`s the pages it touches)."""
    return paged.res_slot is None and paged.fmt.spec.encode is None


def plan_moves(src: torch.Tensor, dst: torch.Tensor, heads: torch.Tensor,
               real: torch.Tensor | None, page_size: int, num_heads: int,
               max_cells: int | None = None) -> dict:
    """What a grouped move needs of its moves alone, computed once for the K and the V pages
    of a layer (same moves, same pages): each move's source and destination (page, slot),
    `real`, and its destination cell among the sorted distinct ones (`_cells_by_sort`).

    src / dst / real may carry leading dims ([Ly, M]: every layer's moves planned at once,
    front.py; heads [M] or the same shape), in which case the plan's tensors carry them too
    and `plan_at(plan, i)` is layer i's plan: one sort and scan for all the layers instead
    of one a layer."""
    P, H = page_size, num_heads
    if real is None:
        real = torch.ones_like(src, dtype=torch.bool)
    heads = heads.expand_as(dst).contiguous()   # (one copy for every layer's row)
    seg, pg, hd, last = _cells_by_sort(dst // P * H + heads, H, max_cells)
    return dict(ps=src // P, os=src % P, od=dst % P, heads=heads, real=real, seg=seg, pg=pg,
                hd=hd, last=last, P=P, H=H)


def plan_at(plan: dict, i: int) -> dict:
    """Layer i's plan of a `plan_moves` made with a leading layer dim (views, no copy)."""
    return {k: (v[i] if isinstance(v, torch.Tensor) else v) for k, v in plan.items()}


def move_slots_device(paged: PagedTensor, src: torch.Tensor, dst: torch.Tensor,
                      heads: torch.Tensor, real: torch.Tensor | None = None,
                      max_cells: int | None = None) -> None:
    """`move_slots` with no host sync for the pages `moves_on_device` takes (eviction between
    CUDA-graph decode steps, eviction/front.py). real [M] bool or None (all): the moves that
    count; the others (front.py's padding, a token moved onto itself) change nothing. A
    padding move's destination slot must be no real move's destination.

    Formats that move exactly: one gather and one scatter of each part. Page- and
    channel-scaled ones, bit for bit what `move_slots` does with the real moves: the
    destination (page, head) "cells" are found by a sort instead of `unique` (at most
    `max_cells` of them, default M: front.py passes its tighter bound), each cell's parameters
    change as `_move_cells` says, a cell whose parameters changed is encoded again whole, and
    each moved token is encoded under its cell's new parameters. Each cell's new page is
    written once (the ranks past the distinct count rewrite rank 0's cell with the same
    bytes). Sources are read before any write."""
    if moves_exactly(paged):
        if real is not None:   # a padding move writes its destination's own bytes back
            src = torch.where(real, src, dst)
        move_slots_exact(paged, src, dst, heads)
        return
    move_planned(paged, plan_moves(src, dst, heads, real, paged.page_size, paged.num_heads,
                                   max_cells))


def move_planned(paged: PagedTensor, plan: dict) -> None:
    """`move_slots_device` of page- and channel-scaled pages, the moves given as `plan_moves`
    made them (eviction/front.py plans a layer's moves once for its K and V pages)."""
    if not moves_on_device(paged):
        raise UnsupportedShapeError(
            f"move_slots_device: {paged!r} re-encodes its moves on the host (residual rows or "
            f"a registered codec); use move_slots")
    if (plan["P"], plan["H"]) != (paged.page_size, paged.num_heads):
        raise UnsupportedShapeError(f"move_slots_device: a plan for pages of {plan['P']} x "
                                    f"{plan['H']} heads, given {paged!r}")
    if _cell_kernel(paged):   # fp8 page scales: three launches instead of about 90 ops
        from kvcompile.kernels.move_cells import move_cells

        move_cells(paged, plan)
        return
    od, real, seg, pg, hd, last = (plan[k] for k in ("od", "real", "seg", "pg", "hd", "last"))
    vals = _token_values(paged, plan["ps"], plan["os"], plan["heads"])
    # each cell written once; a rank past the distinct count rewrites rank 0's cell with
    # rank 0's bytes (the same bytes twice: no race)
    ranks = torch.arange(pg.numel(), device=pg.device)
    wc = torch.where(ranks <= last, ranks, 0)
    _move_cells(paged, vals, od, real, seg, pg, hd, (pg[wc], hd[wc], wc))


# kernels/move_cells.py: moves into fp8 page-scaled pages in three launches instead of about 90
# PyTorch ops, bit for bit `_move_cells` (CPU tests, TRITON_INTERPRET=1; on CUDA
# tests/gpu/test_move_cells_gpu.py, passed on an H100 2026-12-05). Per device type: on for
# CUDA; off on the CPU except where a test turns it on (the interpreter runs it slower than
# the PyTorch path).
CELL_KERNEL = {"cuda": True, "cpu": False}


def _cell_kernel(paged: PagedTensor) -> bool:
    """Whether kernels/move_cells.py takes this move (bit for bit `_move_cells`)."""
    if not CELL_KERNEL.get(paged.data.device.type, False):
        return False
    from kvcompile.kernels.move_cells import takes

    return takes(paged) == ""


def move_slots_exact(paged: PagedTensor, src: torch.Tensor, dst: torch.Tensor,
                     heads: torch.Tensor) -> None:
    """`move_slots` for formats that move exactly (`moves_exactly`), with no host sync: every
    part is gathered at the sources, then scattered at the destinations (src and dst may
    overlap; a token moved onto itself is rewritten unchanged). For eviction between CUDA-graph
    decode steps (eviction/runtime.py)."""
    # src, dst, heads: [M] int64 on the storage device
    P = paged.page_size
    move_exact_at(paged, src // P, src % P, dst // P, dst % P, heads)


def move_exact_at(paged: PagedTensor, ps, os_, pd, od, heads) -> None:
    """`move_slots_exact` with the moves given as (page, slot) of each source and destination
    and their head, index tensors of any one shape (eviction/front.py passes [items, heads,
    moves] slices of every layer's, computed once for all layers)."""
    parts = {name: buf[ps, heads, os_] for name, buf in _token_parts(paged).items()}
    _put(paged, parts, pd, od, heads)


def _residual_rows(paged: PagedTensor, pages: torch.Tensor) -> torch.Tensor:
    """[M] the residual row of each page (-1: its tokens are codes)."""
    if paged.res_slot is None:
        return torch.full_like(pages, -1)
    return paged.res_slot[pages].long()


def _values(paged, ps, os_, heads, res_rows) -> torch.Tensor:
    """Decoded value of each source token [M, D] fp32 (its bf16 row where it has one)."""
    up, inv = torch.unique(ps, return_inverse=True)
    vals = paged._decode_pages(up)[inv, heads, os_]
    has = res_rows >= 0
    if bool(has.any()):
        vals[has] = paged.res_data[res_rows[has], heads[has], os_[has]].float()
    return vals


def _token_parts(paged: PagedTensor) -> dict[str, torch.Tensor]:
    """The stored tensors indexed [page, head, slot] that hold one token each."""
    fmt = paged.fmt
    parts = {"data": paged.data}
    if paged.micro is not None and fmt.granularity != "channel":
        parts["micro"] = paged.micro
    if fmt.is_quantized and fmt.granularity == "token":
        parts["scale"] = paged.scale
        if paged.zero is not None:
            parts["zero"] = paged.zero
    return parts


def _put(paged, parts: dict, pd, od, heads) -> None:
    for name, t in parts.items():
        getattr(paged, name)[pd, heads, od] = t


def _encode_tokens(paged: PagedTensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x [M, D] fp32 -> the per-token parts of a token- or tensor-scaled format."""
    fmt = paged.fmt
    if not fmt.is_quantized:
        return {"data": x.to(fmt.storage_dtype)}
    if fmt.is_int:  # token scales
        s, z = int_params(x, -1, fmt.int_bits)                              # [M, 1]
        return {"data": int_encode(x, s, z, fmt.int_bits), "scale": s[:, 0], "zero": z[:, 0]}
    if fmt.granularity == "tensor":
        paged.calibrate(x)   # a tensor scale not set yet: every earlier token was residual
        scale = paged.scale.view(1, 1)
    else:
        scale = scale_from_amax(finite_amax(x, -1), fmt.scale_divisor)      # [M, 1]
    codes, micro = paged._encode(x, scale)
    out = {"data": codes}
    if micro is not None:
        out["micro"] = micro
    if fmt.granularity == "token":
        out["scale"] = scale[:, 0]
    return out


def _move_custom(paged: PagedTensor, vals, pd, od, heads) -> None:
    """A registered format with its own codec (cache/registry.py): the destination pages are
    decoded, the moved tokens placed, and the pages encoded again whole. Kept tokens sit at the
    front of a page, so the slots up to the last one a move fills are the valid ones."""
    P = paged.page_size
    ud, dinv = torch.unique(pd, return_inverse=True)
    tile = paged._decode_pages(ud)                                           # [U, H, P, D]
    tile[dinv, heads, od] = vals
    last = torch.full((ud.numel(),), -1, dtype=torch.long, device=vals.device)
    last = last.scatter_reduce(0, dinv, od, "amax")
    valid = torch.arange(P, device=vals.device)[None, :] <= last[:, None]    # [U, P]
    paged.encode_pages(ud, tile, valid)


# --- page- and channel-scaled formats ----------------------------------------------------------

def _scatter(init: float, shape, index, src, how: str) -> torch.Tensor:
    out = torch.full(shape, init, dtype=torch.float32, device=src.device)
    return out.view(-1).scatter_reduce(0, index.reshape(-1), src.reshape(-1).float(), how,
                                       include_self=True).view(shape)


def _group_stats(vals: torch.Tensor, cell: torch.Tensor, shape, real: torch.Tensor,
                 want: tuple = ("lo", "hi", "amax")):
    """Per parameter group of the moved elements: finite min, finite max, finite amax (those
    in `want`, None for the others), any NaN. vals [M, D]; cell [M, D] the flat index of each
    element's group in `shape`, or [M] where a move's whole row is one group (a page-scaled
    cell): each row is reduced first and only M values are scattered, not M x D (on CUDA a
    scatter_reduce of M x D elements into few groups contends on its atomics); real [M] the
    moves that count (the others leave every statistic at its empty value)."""
    fin = torch.isfinite(vals)
    isnan = torch.isnan(vals)
    parts = {"lo": (torch.inf, "amin", lambda: torch.where(fin, vals, torch.inf)),
             "hi": (-torch.inf, "amax", lambda: torch.where(fin, vals, -torch.inf)),
             "amax": (0.0, "amax", lambda: torch.where(fin, vals.abs(), 0.0))}
    rows = cell.dim() == 1
    out = {}
    for name, (init, how, fn) in parts.items():
        if name not in want:
            out[name] = None
            continue
        x = fn()
        if rows:
            x = x.amin(1) if how == "amin" else x.amax(1)
            x = torch.where(real, x, init)
        else:
            x = torch.where(real[:, None], x, init)
        out[name] = _scatter(init, shape, cell, x, how)
    nan = (isnan.any(1) & real) if rows else (isnan & real[:, None])
    nan = _scatter(0.0, shape, cell, nan.float(), "amax") > 0
    return out["lo"], out["hi"], out["amax"], nan


def _move_grouped(paged: PagedTensor, vals, pd, od, heads) -> None:
    # vals [M, D] fp32; pd, od, heads [M]: destination page, offset and head of each token
    uc, seg = torch.unique(pd * paged.num_heads + heads, return_inverse=True)
    pg, hd = uc // paged.num_heads, uc % paged.num_heads
    real = torch.ones_like(pd, dtype=torch.bool)
    _move_cells(paged, vals, od, real, seg, pg, hd, (pg, hd, torch.arange(uc.numel(),
                                                                          device=uc.device)))


def _cells_by_sort(cell: torch.Tensor, H: int, max_cells: int | None):
    """`unique(cell, return_inverse=True)` along the last dim, with a size known in advance
    (no host sync): seg [..., M] the rank of each move's cell among the distinct ones of its
    row, pg / hd [..., S] the page and head of each rank (S = max_cells or M; the ranks past
    the distinct count hold cell 0), and the last rank [..., 1] (the distinct count - 1).
    Leading dims are independent rows (front.py: one a layer)."""
    M = cell.shape[-1]
    S = M if max_cells is None else max(1, min(M, max_cells))
    order = torch.sort(cell, dim=-1, stable=True)
    key = order.values
    first = torch.ones_like(key, dtype=torch.bool)
    first[..., 1:] = key[..., 1:] != key[..., :-1]
    rank = torch.cumsum(first.to(torch.int64), -1) - 1                      # [..., M] sorted
    seg = torch.empty_like(rank).scatter_(-1, order.indices, rank)
    # a bound below the distinct count would merge cells (ranks past S clamped onto S - 1, so
    # nothing is written out of bounds, but moves would land in another cell): refused on
    # the device, with no host read (the callers' bounds are proven, see front.py)
    last = rank[..., -1:]
    torch._assert_async((last < S).all(), "compaction: more destination cells than max_cells")
    seg = seg.clamp(max=S - 1)
    rep = torch.zeros(*cell.shape[:-1], S, dtype=key.dtype, device=key.device)
    rep = rep.scatter(-1, rank.clamp(max=S - 1), key)
    return seg, rep // H, rep % H, last


def _cell_params(paged: PagedTensor, pg, hd) -> dict[str, torch.Tensor]:
    """The grouped parameters of cells (pg, hd) [S], shaped [S, 1, ...] (a page of one head):
    scale, and zero (int) or micro (fp4) where the format has them."""
    out = {"scale": paged.scale[pg, hd][:, None]}
    if paged.zero is not None:
        out["zero"] = paged.zero[pg, hd][:, None]
    if paged.micro is not None:
        out["micro"] = paged.micro[pg, hd][:, None]
    return out


def _decode_cells(paged: PagedTensor, pg, hd, params) -> torch.Tensor:
    """The values of cells (pg, hd) [S] -> [S, 1, P, D] fp32, as `_decode_pages` gives them,
    with no host read."""
    codes = paged.data[pg, hd][:, None]                                       # [S, 1, P, Ds]
    s = params["scale"].float()
    sb = s[:, :, None, :] if s.dim() == 3 else s[:, :, None, None]
    zb = micro = None
    if "zero" in params:
        z = params["zero"]
        zb = z[:, :, None, :] if z.dim() == 3 else z[:, :, None, None]
    if "micro" in params:
        micro = params["micro"]
        if paged.fmt.granularity == "channel":
            micro = micro.float().repeat_interleave(MICRO_BLOCK, dim=2)
    return paged.decode_codes(codes, sb, zb, micro, host_free=True)


def _token_values(paged: PagedTensor, ps, os_, heads) -> torch.Tensor:
    """Decoded value of each source token [M, D] fp32 with no host sync (no residual rows,
    no registered codec): `_values` without its `unique`."""
    fmt, g = paged.fmt, paged.fmt.granularity
    codes = paged.data[ps, heads, os_]                                        # [M, Ds]
    if not fmt.is_quantized:
        return codes.float()

    def per_token(t):   # a scale-shaped part, broadcastable to [M, D]
        if g == "tensor":
            return t.view(1, 1)
        if g == "token":
            return t[ps, heads, os_][:, None]
        if g == "channel" and fmt.name != "fp4_e2m1":
            return t[ps, heads]                                               # [M, D]
        return t[ps, heads][:, None]

    micro = None
    if paged.micro is not None:   # fp4: per 16 values of the token, or per 16 tokens
        micro = (paged.micro[ps, heads, os_ // MICRO_BLOCK] if g == "channel"
                 else paged.micro[ps, heads, os_])
    zero = per_token(paged.zero) if fmt.is_int else None
    return paged.decode_codes(codes, per_token(paged.scale).float(), zero, micro,
                              host_free=True)


def _move_cells(paged: PagedTensor, vals, od, real, seg, pg, hd, write) -> None:
    """Moves into grouped (page- or channel-scaled) pages, by destination cell: vals [M, D]
    fp32, od [M] offsets, real [M] the moves that count, seg [M] each move's cell in (pg, hd)
    [S]. write (pages, heads, cells): where each new cell goes (each cell once; the device
    path's unused ranks rewrite rank 0's cell with its bytes)."""
    fmt, g = paged.fmt, paged.fmt.granularity
    P, D = paged.page_size, paged.head_dim
    S = pg.numel()
    if g == "channel" and fmt.name != "fp4_e2m1":   # one group per (page, head, channel)
        shape = (S, 1, D)
        cell = seg[:, None] * D + torch.arange(D, device=vals.device)
    else:                                           # one per (page, head): a move's row
        shape = (S, 1)
        cell = seg
    lo, hi, amax, nan = _group_stats(vals, cell, shape, real,
                                     ("lo", "hi") if fmt.is_int else ("amax",))
    old = _cell_params(paged, pg, hd)
    s_old = old["scale"]
    if fmt.is_int:
        z_old = old["zero"]
        lo, hi = lo.clamp(max=_F16_MAX), hi.clamp(min=-_F16_MAX)     # saturate as int_params
        top = z_old.float() + levels(fmt.int_bits) * s_old.float()
        # a group whose range holds the moved tokens keeps it; one that is NaN stays NaN
        keep = covers(s_old, z_old, lo, hi, fmt.int_bits) | torch.isnan(s_old.float())
        s_w, z_w = params_from_range(torch.minimum(lo, z_old.float()).clamp(min=-_F16_MAX),
                                     torch.maximum(hi, top).clamp(max=_F16_MAX), fmt.int_bits)
        s_new = torch.where(keep, s_old, s_w)
        s_new = torch.where(nan, torch.nan, s_new.float()).to(s_old.dtype)
        params = {"scale": s_new, "zero": torch.where(keep, z_old, z_w)}
        pairs = [(s_old, s_new), (z_old, params["zero"])]
    else:
        s_new = grow_page_scale(s_old, amax / fmt.scale_divisor)
        params = {"scale": s_new}
        pairs = [(s_old, s_new)]
        if fmt.name == "fp4_e2m1" and g == "channel":
            params["micro"] = _fp4_channel_micro(old["micro"], s_old, s_new, vals, seg, od,
                                                 real)
            pairs.append((old["micro"], params["micro"]))
    changed = grouped.changed_heads(pairs, g)                                # [S, 1]
    tile = _decode_cells(paged, pg, hd, old)                                 # [S, 1, P, D]
    zero = torch.zeros_like(seg)
    here = tile[seg, zero, od]
    tile = tile.index_put((seg, zero, od), torch.where(real[:, None], vals, here))
    moved = torch.zeros(S, 1, P, dtype=torch.int32, device=vals.device)
    moved = moved.index_put((seg, zero, od), real.to(torch.int32), accumulate=True) > 0
    take = (moved | changed[:, :, None])[..., None]
    wp, wh, wc = write
    for name, codes in paged._encode_tile(tile, params).items():
        cur = getattr(paged, name)[pg, hd][:, None]
        new = torch.where(take, codes.view(torch.uint8), cur.view(torch.uint8)).view(cur.dtype)
        getattr(paged, name)[wp, wh] = new[wc, 0]
    for name, t in params.items():
        getattr(paged, name)[wp, wh] = t[wc, 0]


def _fp4_channel_micro(m_old, s_old, s_new, vals, seg, od, real) -> torch.Tensor:
    """fp4 "channel" micro scales [S, 1, G, D] of the cells after the moves: the old ones
    m_old rescaled to the grown page scale (exact for a power of two), raised where a moved
    token needs more; NaN in a moved token's channel makes its 16-token group NaN."""
    S, _one, G, D = m_old.shape
    shifted = (m_old.float() * (s_old / s_new)[:, :, None, None]).to(torch.float8_e4m3fn)
    shifted = torch.where(torch.isnan(m_old.float()), torch.nan, shifted.float())
    cell = (seg * G + od // MICRO_BLOCK)[:, None] * D + torch.arange(D, device=vals.device)
    _lo, _hi, need, nan = _group_stats(vals, cell, (S, 1, G, D), real, ("amax",))
    s = s_new[:, :, None, None]
    short = need > E2M1_MAX * shifted * s
    micro = torch.where(short, torch.maximum(shifted, micro_scale(need, s).float()), shifted)
    return torch.where(nan, torch.nan, micro).to(torch.float8_e4m3fn)
