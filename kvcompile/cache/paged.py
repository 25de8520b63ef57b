"""PagedTensor: one layer's keys (or values) in pages, in any storage format (formats.py).

    data:  [N, H, P, Ds] storage dtype; Ds = D (fp8, plain), D/2 (fp4, int4), D/4 (int2)
    scale: fp8 / fp4: fp32, page [N, H] | token [N, H, P] | tensor [1] | channel [N, H, D]
           (fp4 channel: the page scale [N, H]); int: fp16, page | token | channel
    zero:  int only, fp16, shaped like scale
    micro: fp4 only, E4M3: [N, H, P, D/16] along head_dim, or [N, H, P/16, D] along tokens
           for "channel" (one micro scale per channel per 16 tokens)
    res_data / res_slot: with `residual`, the full-precision tail: res_data [R, H, P, D] bf16,
           res_slot [N] int32 (the res_data row of a page, -1 = none)

Storage is torch.empty: slots never written hold arbitrary values (NaN included), so readers
mask them with `where`, never by multiplying with zero.

Residual: a page that a write leaves partly filled is kept in bf16 in a res_data row; the write
that fills it quantizes the whole page at once (its scales see every token: no re-rounding) and
frees the row. Tokens are rounded to bf16 first in both cases, so a page is quantized from the
same values whichever write fills it. `read` returns the bf16 row for such pages. Rows are per page, so a forked
sequence's shared partial page shares its row, and copy-on-write copies it (`copy_pages`);
the pool frees the rows of pages it releases (`drop_residual`).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from kvcompile.cache import grouped
from kvcompile.cache.fp4 import (
    MICRO_BLOCK,
    MIN_SCALE,
    e2m1_codes,
    e2m1_values,
    finite_amax,
    fp4_decode,
    fp4_encode,
    pack_e2m1,
    scale_from_amax,
    unpack_e2m1,
)
from kvcompile.cache.fp8 import fp8_decode, fp8_encode, fp8_to_float, grow_page_scale
from kvcompile.cache.intq import int_decode, int_encode, int_params
from kvcompile.cache.registry import PART_NAMES
from kvcompile.errors import CacheStateError, UnsupportedShapeError

RESIDUAL_DTYPE = torch.bfloat16


class PagedTensor:
    # Class defaults: views built with __new__ over existing storage (kernels' reference paths)
    # have no zero point and no residual.
    zero: torch.Tensor | None = None
    micro: torch.Tensor | None = None
    res_data: torch.Tensor | None = None
    res_slot: torch.Tensor | None = None

    # fmt: a formats.py KVFormat (not imported: formats.py builds PagedTensors, allocate())
    def __init__(self, fmt, num_pages: int, num_heads: int, page_size: int,
                 head_dim: int, device=None):
        for what, v in (("num_pages", num_pages), ("num_heads", num_heads),
                        ("page_size", page_size), ("head_dim", head_dim)):
            if not isinstance(v, int) or v < 1:
                raise UnsupportedShapeError(f"PagedTensor {what}={v!r}: must be an int >= 1")
        fmt.check_shape(head_dim, page_size)
        self.fmt = fmt
        self.num_pages, self.num_heads, self.page_size, self.head_dim = (
            num_pages, num_heads, page_size, head_dim)
        self.scale: torch.Tensor | None = None
        # the format's parts (cache/registry.py): data, and scale / zero / micro where it has them
        for name, part in fmt.parts(num_pages, num_heads, page_size, head_dim).items():
            if part.fill is None:
                t = torch.empty(part.shape, dtype=part.dtype, device=device)
            else:
                t = torch.full(part.shape, part.fill, dtype=part.dtype, device=device)
            setattr(self, name, t)
        n, h, p, d = num_pages, num_heads, page_size, head_dim
        if fmt.residual:
            self.res_data = torch.empty(0, h, p, d, dtype=RESIDUAL_DTYPE, device=device)
            self.res_slot = torch.full((n,), -1, dtype=torch.int32, device=device)
            self._res_of: dict[int, int] = {}
            self._res_free: list[int] = []

    # -- views of the parts by (page, head) row, for the CPU decode's gathers and writes --

    def rows_view(self, name: str) -> torch.Tensor:
        """A view of part `name` with one row per page-head: "data" [N * H, P, Ds], "codes"
        (fp8 data as uint8) [N * H, P * Ds], "scale" [N * H, ...] (not tensor
        granularity), "tokens" (data with one row per slot of a page-head) [1, N * H * P, 1,
        Ds]. Made once per tensor: a growth that replaces the parts calls `forget_views`."""
        views = self.__dict__.setdefault("_views", {})
        view = views.get(name)
        if view is None:
            n, h = self.num_pages * self.num_heads, self.data.shape[-1]
            if name == "data":
                view = self.data.view(n, self.page_size, h)
            elif name == "codes":
                view = self.data.view(torch.uint8).view(n, -1)
            elif name == "tokens":
                view = self.data.view(1, n * self.page_size, 1, h)
            elif name == "page_scales":   # page granularity: [N, H, 1]
                view = self.scale.view(self.num_pages, self.num_heads, 1)
            else:
                t = getattr(self, name)
                view = t.view(n, *t.shape[2:])
            views[name] = view
        return view

    def forget_views(self) -> None:
        self.__dict__.pop("_views", None)

    def __getstate__(self) -> dict:
        # a copy (deepcopy, pickle) makes its own views: a copied numpy view (`_host_view`)
        # would no longer share the copied tensor's memory
        state = dict(self.__dict__)
        state.pop("_views", None)
        return state

    def one_token_path(self) -> str:
        """The short path of a one-token write this format has (`_write_one`): "plain"
        (unquantized), "fp8" (fp8 with page scales), or "" (none: the general write)."""
        kind = self.__dict__.get("_one_token")
        if kind is None:
            fmt, kind = self.fmt, ""
            if fmt.spec.encode is None and not fmt.residual:
                if not fmt.is_quantized:
                    kind = "plain"
                elif fmt.name.startswith("fp8") and fmt.granularity == "page":
                    kind = "fp8"
            self._one_token = kind
        return kind

    def __repr__(self) -> str:
        res = ", residual" if self.fmt.residual else ""
        return (f"PagedTensor({self.fmt.name}/{self.fmt.granularity}{res}, "
                f"pages={self.num_pages}, heads={self.num_heads}, page_size={self.page_size}, "
                f"head_dim={self.head_dim})")

    # -- scales, broadcastable to [n, H, P, D] --

    def scale_of(self, page_ids: torch.Tensor) -> torch.Tensor:
        """The scale of every element of pages page_ids [n] (fp32), broadcastable to
        [n, H, P, D] (fp8 / int; fp4's outer scale)."""
        return self._bcast(self.scale, page_ids).float()

    def _bcast(self, t: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        g = self.fmt.granularity
        if g == "tensor":
            return t.view(1, 1, 1, 1)
        t = t.index_select(0, page_ids)
        if g == "token":
            return t[..., None]
        if g == "channel" and self.fmt.name != "fp4_e2m1":
            return t[:, :, None, :]
        return t[:, :, None, None]

    # -- codec of this format --

    def _encode(self, x: torch.Tensor, scale: torch.Tensor):
        """fp8 / fp4 with head_dim micro-blocks: (codes, micro or None) of x [..., D] under an
        fp32 scale broadcastable to x (the keepdim form)."""
        if self.fmt.name == "fp4_e2m1":
            return fp4_encode(x, scale)
        return fp8_encode(x, scale, self.fmt.storage_dtype), None

    def _encode_tile(self, tile: torch.Tensor, params: dict) -> dict:
        """Per-token stored tensors of whole pages tile [U, H, P, D] under params (scale,
        zero, micro gathered for these pages)."""
        fmt, g = self.fmt, self.fmt.granularity
        s = params["scale"]
        sb = s[:, :, None, :] if g == "channel" and s.dim() == 3 else s[:, :, None, None]
        if fmt.is_int:
            zb = params["zero"]
            zb = zb[:, :, None, :] if g == "channel" else zb[:, :, None, None]
            return {"data": int_encode(tile, sb, zb, fmt.int_bits)}
        if fmt.name == "fp4_e2m1" and g == "channel":
            m = params["micro"].float().repeat_interleave(MICRO_BLOCK, dim=2)
            return {"data": pack_e2m1(e2m1_codes(tile, m * sb))}
        codes, micro = self._encode(tile, sb)
        return {"data": codes} if micro is None else {"data": codes, "micro": micro}

    def _decode_pages(self, page_ids: torch.Tensor) -> torch.Tensor:
        """[n] -> the stored codes of those pages, dequantized: [n, H, P, D] fp32."""
        fmt = self.fmt
        if fmt.spec.decode is not None:
            return fmt.spec.decode(fmt, self._parts_of(page_ids))
        codes = self.data.index_select(0, page_ids)
        if not fmt.is_quantized:
            return codes.float()
        zero = self._bcast(self.zero, page_ids) if fmt.is_int else None
        micro = None
        if self.micro is not None:
            micro = self.micro[page_ids]
            if fmt.granularity == "channel":
                micro = micro.float().repeat_interleave(MICRO_BLOCK, dim=2)
        return self.decode_codes(codes, self.scale_of(page_ids), zero, micro)

    def decode_codes(self, codes: torch.Tensor, scale, zero=None, micro=None,
                     host_free: bool = False) -> torch.Tensor:
        """This format's decode of gathered parts (no registered codec): codes [..., Ds] ->
        fp32 [..., D], under scale (and int's zero) broadcastable to the values; micro: fp4's
        micro scales, [..., D/16] along head_dim, or for "channel" one per value [..., D].
        host_free: fp8 by the plain cast, not fp8_decode's CPU fast path, which reads a
        min / max on the host (the same values; eviction between CUDA-graph replays)."""
        fmt = self.fmt
        if not fmt.is_quantized:
            return codes.float()
        if fmt.is_int:
            return int_decode(codes, scale, zero, fmt.int_bits)
        if fmt.name == "fp4_e2m1":
            if fmt.granularity == "channel":
                return (e2m1_values(unpack_e2m1(codes)) * micro.float()) * scale
            return fp4_decode(codes, micro, scale)
        return codes.float() * scale if host_free else fp8_decode(codes, scale)

    # -- a registered format's own codec (registry.FormatSpec encode / decode) --

    def _parts_of(self, page_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """{part: its rows of pages page_ids [n]}; a part not indexed by page (a tensor
        scale) as stored."""
        return {name: t if self._unpaged(name) else t.index_select(0, page_ids)
                for name, t in self.parts().items()}

    def _unpaged(self, name: str) -> bool:
        return name in ("scale", "zero") and self.fmt.granularity == "tensor"

    def _write_custom(self, page: torch.Tensor, off: torch.Tensor, x: torch.Tensor) -> None:
        """Appends of a format with its own `encode`: the pages touched are decoded, the new
        tokens placed, and the pages encoded again whole (valid: the slots before the
        smallest new offset and the new ones)."""
        P = self.page_size
        upages, inv = torch.unique(page, return_inverse=True)                     # [U], [T]
        U, dev = upages.numel(), page.device
        min_off = torch.full((U,), P, dtype=torch.long, device=dev)
        min_off = min_off.scatter_reduce(0, inv, off, "amin")
        valid = torch.arange(P, device=dev)[None, :] < min_off[:, None]          # [U, P]
        valid[inv, off] = True
        tile = self._decode_pages(upages)                                         # [U, H, P, D]
        tile[inv, :, off] = x
        self.encode_pages(upages, tile, valid)

    def encode_pages(self, upages: torch.Tensor, tile: torch.Tensor,
                     valid: torch.Tensor) -> None:
        """A registered format's pages upages [U] stored anew from their values tile
        [U, H, P, D] fp32 (valid [U, P]: the slots that hold tokens; the others may hold
        anything, NaN included)."""
        for name, t in self.fmt.spec.encode(self.fmt, tile, valid).items():
            if self._unpaged(name):
                getattr(self, name).copy_(t)
            else:
                getattr(self, name)[upages] = t

    def parts(self) -> dict[str, torch.Tensor]:
        """The stored tensors of these pages, by part name (registry.PART_NAMES)."""
        return {n: t for n in PART_NAMES if (t := getattr(self, n, None)) is not None}

    # -- public API --

    def read(self, page_ids: torch.Tensor) -> torch.Tensor:
        """page_ids: [n] -> dequantized pages [n, H, P, D] fp32 (the bf16 residual of pages
        that have one)."""
        page_ids = torch.as_tensor(page_ids, dtype=torch.long, device=self.data.device)
        out = self._decode_pages(page_ids)
        if self.res_slot is not None and self._res_of:
            r = self.res_slot[page_ids].long()
            tail = self.res_data[r.clamp(min=0)].float()
            out = torch.where((r >= 0)[:, None, None, None], tail, out)
        return out

    def write(self, slots: torch.Tensor, x: torch.Tensor,
              host_slots: list[int] | None = None) -> None:
        """Quantize and append. slots: [T] int (page * P + offset), distinct; x: [T, H, D].

        Within each page touched, the slots before the smallest new offset are the page's valid
        tokens. Page- and channel-granular scales are set from the new tokens if the valid ones
        have no value, else changed only as far as the new tokens need (grouped.py), re-encoding
        the valid tokens of a (page, head) whose scales changed. Token scales come from each
        token; tensor scales are static or calibrated on the first write. NaN / Inf never enter
        a scale. With `residual`, see the module docstring. host_slots: the same slots as
        host ints, where the caller has them (then none is read back from `slots`)."""
        one = self._check_write(slots, x, host_slots)
        if x.shape[0] == 0:
            return
        if one is not None and self._write_one(one, x[0]):
            return
        slots = slots.to(device=self.data.device, dtype=torch.long)
        x = x.to(self.data.device)
        page, off = slots // self.page_size, slots % self.page_size
        if self.fmt.spec.encode is not None and not self.fmt.residual:
            self._write_custom(page, off, x.float())
        elif not self.fmt.is_quantized:
            self.data[page, :, off] = x.to(self.fmt.storage_dtype)
        elif self.fmt.residual:
            self._write_residual(page, off, x.float())
        else:
            self._write_codes(page, off, x.float())

    def _write_codes(self, page: torch.Tensor, off: torch.Tensor, x: torch.Tensor) -> None:
        # page, off: [T]; x: [T, H, D] fp32
        fmt, g = self.fmt, self.fmt.granularity
        if fmt.spec.encode is not None:
            self._write_custom(page, off, x)
            return
        if g in ("page", "channel"):
            if not (g == "page" and fmt.name.startswith("fp8") and self._append_fp8(page, off, x)):
                self._write_grouped(page, off, x)
            return
        if fmt.is_int:  # token
            s, z = int_params(x, -1, fmt.int_bits)                       # [T, H, 1]
            self.scale[page, :, off] = s[..., 0]
            self.zero[page, :, off] = z[..., 0]
            self.data[page, :, off] = int_encode(x, s, z, fmt.int_bits)
            return
        if g == "tensor":
            self.calibrate(x)
            scale = self.scale.view(1, 1, 1)
        else:
            scale = scale_from_amax(finite_amax(x, -1), fmt.scale_divisor)  # [T, H, 1]
            self.scale[page, :, off] = scale[..., 0]
        codes, micro = self._encode(x, scale)
        self.data[page, :, off] = codes
        if micro is not None:
            self.micro[page, :, off] = micro

    # -- one token (a decode step of one sequence), in as few tensor ops as the CPU allows --

    def _write_one(self, slot: int, x: torch.Tensor) -> bool:
        """x [H, D] into `slot`, as write() stores it, for the formats that have a short path
        (unquantized; fp8 with page scales). False: nothing written."""
        kind = self.one_token_path()
        if not kind:
            return False
        p, o = divmod(slot, self.page_size)
        if x.device != self.data.device:
            x = x.to(self.data.device)
        if kind == "plain":
            self.data[p, :, o] = x
            return True
        self._write_one_fp8(p, o, x if x.dtype == torch.float32 else x.float())
        return True

    def write_token(self, p: int, o: int, rows: torch.Tensor, x: torch.Tensor) -> None:
        """A decode step's token x [1, H, 1, D] (any strides, on this tensor's device) at
        offset o of page p, as write() stores it, for a format with a one-token path
        (`one_token_path`). rows [H] int64: the token's rows of rows_view("tokens"),
        (p * H + h) * P + o, which one index_copy_ writes (unquantized formats)."""
        if self.one_token_path() == "plain":
            dt = self.data.dtype
            self.rows_view("tokens").index_copy_(1, rows, x if x.dtype == dt else x.to(dt))
            return
        if x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad:
            # (numpy's reshape: no torch op)
            xn = x.numpy().reshape(self.num_heads, self.head_dim)
            if not (o and self._fp8_token_kept(p, o, xn)):
                self._write_one_fp8(p, o, x, xn, True)
            return
        x = x.reshape(self.num_heads, self.head_dim)
        self._write_one_fp8(p, o, x if x.dtype == torch.float32 else x.float())

    def _write_one_fp8(self, p: int, o: int, x: torch.Tensor,
                       xn: np.ndarray | None = None, tried: bool = False) -> None:
        """One token x [H, D] fp32 at offset o of page p, fp8 page scales: what _write_grouped
        stores (xn: x's numbers as a numpy [H, D] view, where the caller has them: then x may
        have any shape of H x D numbers; tried: the kept fact was tried). The page-heads' scale decisions are taken on the H numbers in Python (a torch
        op on [H] costs as much as one on the whole page at these sizes): a decode step of a
        CPU model writes 2 x layers tokens, and each torch op is a few microseconds. On the
        CPU the page's scales and earlier codes are read (and the scales written) through
        numpy views of the same memory (`_host_view`), which cost no torch op.

        The kept fact (CPU): a write that leaves every head of page p with a finite non-zero
        code among its first o + 1 tokens keeps (p, o + 1, the page's scales, the versions of
        `data` and `scale` after it). The next token, at o + 1 of page p, then neither reads
        the scales nor looks at the earlier codes: if no value of x / scale exceeds the
        scale divisor (a screen a little below it, see `_fp8_token_kept`) no scale grows, and
        the token is the general path's x / scale (no clamp needed). Any other write of these
        tensors by torch bumps a version and the fact is not used; a grown scale, a non-finite
        x or a head without such a code leaves no fact."""
        consts = self._fp8_numbers()
        divisor, fmax = consts[:2]
        host = self._host_view("scale")                        # [N, H] numpy, or None
        # on the CPU: x's numbers read, divided and clamped by numpy (the same fp32 IEEE
        # operations, about 1 us each against a torch op's few), only the fp8 cast by torch
        if xn is None and host is not None and x.device.type == "cpu":
            xn = x.detach().numpy()
        if xn is not None and o and not tried and self._fp8_token_kept(p, o, xn):
            return
        if xn is not None:
            a = np.abs(xn).max(axis=1).tolist()                           # [H] max |x|
        else:
            a = torch.linalg.vector_norm(x, math.inf, -1).tolist()
        finite = all(v < math.inf for v in a)
        if not finite:   # a NaN / Inf: the finite values' amax
            a = x.reshape(len(a), -1).abs().nan_to_num_(0.0, 0.0, 0.0).amax(-1).tolist()
        cover = _as_fp32([v / divisor for v in a])             # amax / divisor, in fp32
        fresh = [max(c, MIN_SCALE) if v > 0 else 1.0 for v, c in zip(a, cover)]
        s_new, s_old, grow, had = fresh, None, None, None
        if o:
            fact = self._fp8_fact(p, o) if xn is not None else None
            if fact is not None:   # (its screen refused x: the scales may grow)
                s_old, had = fact[5][:, 0].tolist(), [True] * len(a)
            else:
                s_old = self.scale[p].tolist() if host is None else host[p].tolist()
                had = self._had_values(p, o)
            grow = [h and c > s for h, c, s in zip(had, cover, s_old)]
            s_new = [(_grown_scale(s, c) if g else s) if h else f
                     for h, g, s, c, f in zip(had, grow, s_old, cover, fresh)]
        if s_new != s_old:
            if grow is not None and any(grow):
                # the scale grows (by a power of two): the earlier tokens of those heads are
                # re-encoded under it, as _write_grouped does (same decode and encode)
                self._reencode_heads(p, o, s_old, s_new, grow)
            if host is None:
                self.scale[p] = torch.tensor(s_new, dtype=torch.float32, device=x.device)
            else:
                host[p] = s_new   # (fp32 values: stored exactly)
        # fp8_encode: clamp(x / scale, -fmax, fmax), cast to fp8 by the copy into the page
        if xn is not None:
            s_col = host[p][:, None].copy()                   # (the scales just stored)
            y = xn / s_col
            self._store_token(p, o, np.clip(y, -fmax, fmax, out=y))
            # every head now holds a finite non-zero code: one that had one keeps it (a grown
            # scale leaves the new token's largest code above fmax / 2), a fresh head's new
            # token has amax / scale = divisor unless its scale is MIN_SCALE (not kept)
            if finite and o + 1 < self.page_size and all(
                    h or (v > 0 and c >= MIN_SCALE)
                    for h, v, c in zip(had or [False] * len(a), a, cover)):
                self._keep_fp8_fact(p, o + 1, s_col)
            else:
                self.__dict__["_views"].pop("fp8_fact", None)
            return
        st = self.rows_view("page_scales")[p]                                 # [H, 1] view
        self.data[p, :, o] = (x / st).clamp_(-fmax, fmax)

    def _fp8_token_kept(self, p: int, o: int, xn: np.ndarray) -> bool:
        """The one-token write by the kept fact (see `_write_one_fp8`): True where it applies
        and the token is stored, False (nothing written) otherwise. Few Python steps: a
        decode step runs it twice per layer."""
        fact = self._fp8_fact(p, o)
        if fact is None:
            return False
        d, views = self.data, self.__dict__["_views"]
        y = xn / fact[5]
        if not np.maximum.reduce(np.abs(y), None) <= fact[6]:   # (NaN: not kept)
            return False
        # the token's H rows of the (contiguous) page as one strided view; the copy casts
        d.as_strided(fact[7], fact[8], fact[9] + o * fact[10]).copy_(torch.from_numpy(y))
        if o + 1 < self.page_size:
            views["fp8_fact"] = (p, o + 1, d, d._version, fact[4], *fact[5:])
        else:
            del views["fp8_fact"]
        return True

    @staticmethod
    def write_tokens_kept(tensors, p: int, o: int, xs, scratch: dict) -> bool:
        """A decode step's tokens xs (numpy [H, Ds] fp32 each) at offset o of page p of
        `tensors` (a layer's K and V: fp8 page scales, one format and shape), all by their
        kept facts (`_write_one_fp8`) with one torch op, the fp8 cast of every token at once
        into a buffer of `scratch` (the caller's, per step), whose bytes numpy places in the
        pages. True: all written; False: nothing written (a fact missing or stale, or a
        value past the screen: then each tensor's own write). The codes' placement does not
        bump `data`'s version: the facts are kept as of it."""
        return PagedTensor.write_tokens_fp8(tensors, p, o, xs, scratch, decide=False)

    @staticmethod
    def write_tokens_fp8(tensors, p: int, o: int, xs, scratch: dict,
                         decide: bool = True) -> bool:
        """`write_tokens_kept`, and with `decide` also where the kept facts' screen refuses
        the tokens (a page scale grows) or o is 0 (a fresh page: no fact needed): the scale
        decisions of `_write_one_fp8` for every head of every tensor at once by numpy, the
        grown heads' earlier codes re-encoded (`_reencode_heads`' operations), and one torch
        op, the fp8 cast of the tokens and the re-encoded codes together. The same bytes and
        scales as each tensor's `_write_one_fp8`. False (nothing written) where a fact is
        missing or stale at o > 0, a token holds NaN / Inf, or a scale would leave fp32:
        then each tensor's own write. Precondition: CPU tensors with contiguous data and
        scales (`dense._widen_rows_applies`)."""
        facts = [t._fp8_fact(p, o) for t in tensors] if o else None
        if o and None in facts:
            return False
        first = tensors[0]
        H, Ds = first.num_heads, first.data.shape[-1]
        key = ("fp8_cast", len(tensors), H, Ds, first.fmt.storage_dtype)
        bufs = scratch.get(key)
        if bufs is None:
            y = np.empty((len(tensors), H, Ds), np.float32)
            c8 = torch.empty(y.shape, dtype=first.fmt.storage_dtype)
            bufs = scratch[key] = (y, torch.from_numpy(y), c8, c8.view(torch.uint8).numpy())
        y, yt, c8, cn = bufs
        if o:
            for i, (x, f) in enumerate(zip(xs, facts)):
                np.divide(x, f[5], out=y[i])
            if not np.maximum.reduce(np.abs(y), None) <= facts[0][6]:   # (NaN: not kept)
                if not decide:
                    return False
                return PagedTensor._write_tokens_decided(tensors, p, o, xs, facts, scratch)
        elif not decide:
            return False
        else:
            return PagedTensor._write_tokens_decided(tensors, p, o, xs, None, scratch)
        c8.copy_(yt)
        last = o + 1 == first.page_size
        for t, f, c in zip(tensors, facts, cn):
            t.host_rows("codes")[p * H:(p + 1) * H, o * Ds:(o + 1) * Ds] = c
            if last:
                del t.__dict__["_views"]["fp8_fact"]
            else:
                t.__dict__["_views"]["fp8_fact"] = (p, o + 1, *f[2:])
        return True

    @staticmethod
    def _write_tokens_decided(tensors, p: int, o: int, xs, facts, scratch: dict) -> bool:
        """`write_tokens_fp8`'s full decision (facts: the tensors' kept facts at o > 0, whose
        scales are the page's and whose heads all hold a value; None at o == 0). The k * H
        amaxes, covers and quotients by numpy over all heads at once; the few grown scales
        (`_grown_scale`) in Python; the token's quotients and the grown heads' re-encoded
        earlier codes in one fp32 buffer of `scratch` (the caller's, per step; made by the
        first call at the largest size, a page of every head), clamped and cast to fp8 by one
        torch op into its fp8 twin."""
        first = tensors[0]
        k, H, Ds, P = len(tensors), first.num_heads, first.data.shape[-1], first.page_size
        divisor, fmax = first._fp8_numbers()[:2]
        kH = k * H
        x = np.concatenate(xs)                                                 # [k*H, Ds]
        a = np.maximum.reduce(np.abs(x), axis=1)                               # [k*H] amax
        if not np.maximum.reduce(a) < math.inf:   # a NaN / Inf: the general path
            return False
        # amax / divisor in fp32: the double quotient rounded to fp32 (as _as_fp32)
        cover = np.divide(a, divisor, dtype=np.float64).astype(np.float32)
        if o:
            s_old = np.concatenate([f[5] for f in facts]).reshape(kH)
            grown = np.flatnonzero(cover > s_old).tolist()
            s_new = s_old.copy()
            for j in grown:
                s_new[j] = g = _grown_scale(float(s_old[j]), float(cover[j]))
                if g == math.inf:
                    return False
            keep = o + 1 < P
        else:   # fresh scales, as _write_one_fp8's
            live = a > 0
            s_new = np.where(live, np.maximum(cover, np.float32(MIN_SCALE)), np.float32(1.0))
            grown = ()
            keep = o + 1 < P and bool((live & (cover >= MIN_SCALE)).all())
        n_tok, n_old = kH * Ds, o * Ds
        m = n_tok + len(grown) * n_old
        key = ("fp8_decided", kH, Ds, P, first.fmt.storage_dtype)
        bufs = scratch.get(key)
        if bufs is None:
            f32 = np.empty(kH * P * Ds, np.float32)
            c8 = torch.empty(f32.shape, dtype=first.fmt.storage_dtype)
            bufs = scratch[key] = (f32, torch.from_numpy(f32), c8, c8.view(torch.uint8).numpy())
        flat = bufs[0][:m]
        np.divide(x, s_new[:, None], out=flat[:n_tok].reshape(kH, Ds))
        rows = [t.host_rows("codes")[p * H:(p + 1) * H] for t in tensors]     # [H, P*Ds]
        if grown:   # the grown heads' first o codes: decoded under s_old, encoded under s_new
            table = _fp8_values(first.fmt.storage_dtype)
            v = flat[n_tok:].reshape(len(grown), n_old)
            for g, j in enumerate(grown):
                np.take(table, rows[j // H][j % H, :n_old], out=v[g])
            v *= s_old[grown][:, None]
            v /= s_new[grown][:, None]
        np.minimum(flat, fmax, out=flat)
        np.maximum(flat, -fmax, out=flat)
        bufs[2][:m].copy_(bufs[1][:m])
        codes = bufs[3]
        at = n_tok
        for j in grown:
            rows[j // H][j % H, :n_old] = codes[at:at + n_old]
            at += n_old
        sn = s_new.reshape(k, H, 1)
        for i, t in enumerate(tensors):
            rows[i][:, o * Ds:(o + 1) * Ds] = codes[i * H * Ds:(i + 1) * H * Ds].reshape(H, Ds)
            t._host_view("scale")[p] = s_new[i * H:(i + 1) * H]
            views = t.__dict__["_views"]
            if not keep:
                views.pop("fp8_fact", None)
            elif o:   # (the placement by numpy bumps no version: the fact stays as of them)
                views["fp8_fact"] = (p, o + 1, *facts[i][2:5], sn[i], *facts[i][6:])
            else:
                t._keep_fp8_fact(p, o + 1, sn[i])
        return True

    def _fp8_numbers(self) -> tuple:
        """(scale divisor, fmax, the largest finite low-7-bit code, the kept fact's screen) of
        this fp8 format, looked up once per tensor."""
        consts = self.__dict__.get("_fp8_consts")
        if consts is None:
            fmt = self.fmt
            fmax = torch.finfo(fmt.storage_dtype).max
            # |x / scale| at most `screen`: amax / divisor <= scale, so no scale grows (x /
            # scale is within 2^-24 of the exact quotient; the margin covers that), and
            # x / scale needs no clamp
            screen = min(fmt.scale_divisor, fmax) * (1.0 - 2.0 ** -20)
            consts = self._fp8_consts = (fmt.scale_divisor, fmax,
                                         self._FP8_FINITE[fmt.storage_dtype], screen)
        return consts

    def _fp8_fact(self, p: int, o: int):
        """The kept fact (`_keep_fp8_fact`) where it is for offset o of page p and neither
        `data` nor `scale` was written by torch since; else None."""
        views = self.__dict__.get("_views")
        fact = None if views is None else views.get("fp8_fact")
        if fact is None or fact[0] != p or fact[1] != o:
            return None
        d = self.data
        if fact[2] is not d or fact[3] != d._version or fact[4] != self.scale._version:
            return None
        return fact

    def _keep_fp8_fact(self, p: int, o: int, s_col: np.ndarray) -> None:
        """Keep the fact that page p's heads hold a finite non-zero code among their first o
        tokens and have the scales s_col [H, 1] (`_write_one_fp8`), as of the tensors'
        current versions, with what `_fp8_token_kept` needs: the screen, the token view's
        size, stride and page p's storage offset. Inference tensors have no version counter
        (and a non-contiguous `data` no such view): nothing is kept."""
        views, d = self.__dict__["_views"], self.data
        if d.is_inference() or self.scale.is_inference() or not d.is_contiguous():
            views.pop("fp8_fact", None)
            return
        H, P, Ds = self.num_heads, self.page_size, d.shape[-1]
        views["fp8_fact"] = (p, o, d, d._version, self.scale._version, s_col,
                             self._fp8_numbers()[3], (H, Ds), (P * Ds, 1),
                             d.storage_offset() + p * H * P * Ds, Ds)

    def _store_token(self, p: int, o: int, y: np.ndarray) -> None:
        """Codes of y [H, Ds] fp32 (numpy, within fp8's range) at offset o of page p: cast to
        fp8 by torch's copy into the page (which bumps the version of `data`)."""
        y = torch.from_numpy(y)
        d = self.data
        if d.is_contiguous():   # the token's H rows as one strided view: 2 torch ops
            H, P, Ds = self.num_heads, self.page_size, d.shape[-1]
            at = d.storage_offset() + ((p * H) * P + o) * Ds
            d.as_strided((H, Ds), (P * Ds, 1), at).copy_(y)
        else:
            d[p, :, o] = y

    def _had_values(self, p: int, o: int) -> list[bool]:
        """Per head of page p: whether its first o tokens hold a finite non-zero code (what
        _write_grouped's old amax sees): the largest low-7-bit code of each head, looked at
        again exactly if that is not a finite one."""
        lim = self._FP8_FINITE[self.fmt.storage_dtype]
        host = self.host_rows("codes")                        # [N * H, P * D] uint8 numpy
        if host is not None:
            H = self.num_heads
            earlier = host[p * H:(p + 1) * H, :o * self.data.shape[-1]]          # [H, o * D]
            top = np.bitwise_and(earlier, 0x7F).max(axis=1).tolist()
        else:
            earlier = self.data[p, :, :o].view(torch.uint8)                    # [H, o, D] view
            top = earlier.bitwise_and(0x7F).amax((1, 2)).tolist()
        if max(top) <= lim:
            return [t > 0 for t in top]
        earlier = self.data[p, :, :o].view(torch.uint8)
        return (((earlier & 0x7F) - 1) < lim).flatten(1).any(-1).tolist()

    def _reencode_heads(self, p: int, o: int, s_old: list[float], s_new: list[float],
                        grow: list[bool]) -> None:
        """Re-encode the first o codes of page p's heads that `grow` under s_new (decoded
        under s_old), as _write_grouped does. On the CPU by numpy on the pool's memory (the
        same fp32 operations: fp8_to_float's values from a 256-entry table, the product, the
        quotient, the clamp) and one torch op, the fp8 cast."""
        heads = [h for h, g in enumerate(grow) if g]
        host = self.host_rows("codes")                        # [N * H, P * Ds] uint8 numpy
        if host is not None:
            H = self.num_heads
            earlier = host[p * H:(p + 1) * H, :o * self.data.shape[-1]]       # [H, o * Ds]
            v = np.take(_fp8_values(self.fmt.storage_dtype), earlier[heads])  # [G, o * Ds]
            v *= np.array([s_old[h] for h in heads], np.float32)[:, None]
            v /= np.array([s_new[h] for h in heads], np.float32)[:, None]
            fmax = self._fp8_numbers()[1]
            np.clip(v, -fmax, fmax, out=v)
            enc = torch.from_numpy(v).to(self.fmt.storage_dtype)
            earlier[heads] = enc.view(torch.uint8).numpy()
            return
        dev = self.data.device
        take = torch.tensor(grow, device=dev)[:, None, None]
        old = torch.tensor(s_old, dtype=torch.float32, device=dev)
        new = torch.tensor(s_new, dtype=torch.float32, device=dev)
        if len(heads) < len(grow):   # only the grown heads' codes
            idx = torch.tensor(heads, device=dev)
            codes = self.data[p, :, :o].index_select(0, idx)
            re = self._reencoded(codes, old[idx], new[idx], take[idx])
            self.data[p, :, :o].view(torch.uint8).index_copy_(0, idx, re)
            return
        codes = self.data[p, :, :o]
        codes.view(torch.uint8).copy_(self._reencoded(codes, old, new, take))

    def _host_view(self, name: str):
        """A numpy view of this CPU tensor's "scale" ([N, H]) or "codes" (data as uint8,
        [N, H, P, Ds]): the same memory, read and written without a torch op. None off the
        CPU. Made once per tensor, as rows_view."""
        if self.data.device.type != "cpu":
            return None
        views = self.__dict__.setdefault("_views", {})
        view = views.get(("numpy", name))
        if view is None:
            t = self.scale if name == "scale" else self.data.view(torch.uint8)
            view = views[("numpy", name)] = t.detach().numpy()
        return view

    def host_rows(self, name: str):
        """`_host_view(name)` ("codes" or "scale", not tensor granularity) with one row per
        page-head: [N * H, ...] numpy, the same memory; None off the CPU."""
        views = self.__dict__.setdefault("_views", {})
        view = views.get(("rows", name))
        if view is None:
            host = self._host_view(name)
            if host is None:
                return None
            view = views[("rows", name)] = host.reshape(self.num_pages * self.num_heads, -1)
        return view

    def _reencoded(self, codes: torch.Tensor, s_old: torch.Tensor, s_new: torch.Tensor,
                   take: torch.Tensor) -> torch.Tensor:
        """fp8 codes [..., H, t, D] as uint8, those where `take` (broadcast to them) decoded
        under s_old [..., H] and encoded under s_new (as _write_grouped does), others kept."""
        re = fp8_encode(fp8_decode(codes, s_old[..., None, None]), s_new[..., None, None],
                        self.fmt.storage_dtype)
        return torch.where(take, re.view(torch.uint8), codes.view(torch.uint8))

    # fp8 codes whose low 7 bits minus 1 fall below this are finite and non-zero
    _FP8_FINITE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}

    def _append_fp8(self, page: torch.Tensor, off: torch.Tensor, x: torch.Tensor) -> bool:
        """fp8 page scales, one new token per page (a decode step): what _write_grouped writes,
        without decoding the pages whose scale does not grow (then no earlier code changes);
        a page-head whose scale grows has its earlier tokens re-encoded. Returns False, having
        written nothing, when two tokens share a page."""
        T, P = page.shape[0], self.page_size
        if T > 1 and torch.unique(page).shape[0] != T:
            return False
        amax = finite_amax(x, -1, keepdim=False)                                   # [T, H]
        s_old = self.scale[page]                                                   # [T, H]
        # earlier valid tokens with a finite non-zero value (those that _write_grouped's
        # old_amax sees): finite non-zero codes, whatever the scale
        u = self.data[page].view(torch.uint8) & 0x7F                               # [T, H, P, D]
        live = (u - 1) < self._FP8_FINITE[self.fmt.storage_dtype]
        before = (torch.arange(P, device=page.device)[None, :] < off[:, None])[:, None, :, None]
        had = (live & before).flatten(2).any(-1)                                   # [T, H]
        cover = amax / self.fmt.scale_divisor
        # a group without such values takes its scale from the new token; its earlier codes
        # (zeros, NaN) encode the same under any scale
        fresh = scale_from_amax(amax, self.fmt.scale_divisor)
        grow = had & (cover > s_old)
        if bool(grow.any()):
            s_new = torch.where(had, grow_page_scale(s_old, cover), fresh)
            codes = self.data[page]                                    # [T, H, P, D], a copy
            take = before & grow[:, :, None, None]          # earlier tokens of grown groups
            self.data[page] = self._reencoded(codes, s_old, s_new, take).view(codes.dtype)
        else:
            s_new = torch.where(had, s_old, fresh)
        self.scale[page] = s_new
        self.data[page, :, off] = fp8_encode(x, s_new[..., None], self.fmt.storage_dtype)
        return True

    def calibrate(self, x: torch.Tensor) -> None:
        """Tensor granularity without a static scale: on the first write, scale = amax(x) /
        scale_divisor (1.0 if x has no finite non-zero value). Later calls do nothing."""
        if self.fmt.granularity == "tensor" and self.fmt.is_quantized and not bool(self.scale[0]):
            amax = finite_amax(x.float(), tuple(range(x.dim())), keepdim=False)
            self.scale.copy_(scale_from_amax(amax, self.fmt.scale_divisor).view(1))

    def _write_grouped(self, page: torch.Tensor, off: torch.Tensor, x: torch.Tensor) -> None:
        # Works on the U distinct pages touched, whole.
        P, fmt, g = self.page_size, self.fmt, self.fmt.granularity
        upages, inv = torch.unique(page, return_inverse=True)                     # [U], [T]
        U, dev = upages.numel(), page.device
        min_off = torch.full((U,), P, dtype=torch.long, device=dev)
        min_off = min_off.scatter_reduce(0, inv, off, "amin")
        old = torch.arange(P, device=dev)[None, :] < min_off[:, None]            # [U, P]
        new = torch.zeros(U, P, dtype=torch.bool, device=dev)
        new[inv, off] = True
        tile = torch.where(old[:, None, :, None], self._decode_pages(upages), 0.0)
        tile[inv, :, off] = x                                                     # [U, H, P, D]
        s_old = self.scale[upages]
        if fmt.is_int:
            z_old = self.zero[upages]
            s_new, z_new = grouped.update_int_params(s_old, z_old, tile, old, new, g,
                                                     fmt.int_bits)
            params = {"scale": s_new, "zero": z_new}
            pairs = [(s_old, s_new), (z_old, z_new)]
        else:
            s_new = grouped.update_float_scale(s_old, tile, old, new,
                                               "page" if s_old.dim() == 2 else g,
                                               fmt.scale_divisor)
            params = {"scale": s_new}
            pairs = [(s_old, s_new)]
            if fmt.name == "fp4_e2m1" and g == "channel":
                m_old = self.micro[upages]
                m_new = grouped.update_fp4_channel_micro(m_old, s_old, s_new, tile, old, new)
                params["micro"] = m_new
                pairs.append((m_old, m_new))
        changed = grouped.changed_heads(pairs, g)                                 # [U, H]
        take = (new[:, None, :] | (old[:, None, :] & changed[:, :, None]))[..., None]
        for name, codes in self._encode_tile(tile, params).items():
            buf = getattr(self, name)
            cur = buf[upages]
            buf[upages] = torch.where(take, codes.view(torch.uint8),
                                      cur.view(torch.uint8)).view(cur.dtype)
        self.scale[upages] = s_new
        if fmt.is_int:
            self.zero[upages] = params["zero"]
        if "micro" in params:
            self.micro[upages] = params["micro"]

    # -- residual: the bf16 tail of partly filled pages --

    def _write_residual(self, page: torch.Tensor, off: torch.Tensor, x: torch.Tensor) -> None:
        # Every token passes through bf16, the residual's precision, whether it waits in a row
        # or fills its page at once: a page is quantized from the same values either way.
        P, H, D = self.page_size, self.num_heads, self.head_dim
        x = x.to(RESIDUAL_DTYPE).float()
        upages, inv = torch.unique(page, return_inverse=True)
        U, dev = upages.numel(), page.device
        max_off = torch.full((U,), -1, dtype=torch.long, device=dev)
        max_off = max_off.scatter_reduce(0, inv, off, "amax")
        min_off = torch.full((U,), P, dtype=torch.long, device=dev)
        min_off = min_off.scatter_reduce(0, inv, off, "amin")
        fills = max_off == P - 1                                                  # [U]
        to_full = fills[inv]                                                      # [T]
        if bool(fills.any()):  # quantize these pages whole, from the residual or stored codes
            fpages = upages[fills]
            where = torch.cumsum(fills.long(), 0) - 1                             # [U]
            full = self.read(fpages)                                              # [F, H, P, D]
            full[where[inv[to_full]], :, off[to_full]] = x[to_full]
            self.drop_residual(fpages)
            F = fpages.numel()
            all_off = torch.arange(P, device=dev).repeat(F)
            self._write_codes(fpages.repeat_interleave(P), all_off,
                              full.permute(0, 2, 1, 3).reshape(F * P, H, D))
        if bool(to_full.all()):
            return
        partial = ~fills
        ppages = upages[partial].tolist()
        starts = min_off[partial].tolist()
        fresh = [(p, s) for p, s in zip(ppages, starts) if p not in self._res_of]
        if fresh:
            rows = self._res_assign([p for p, _ in fresh])
            carry = [(p, r) for (p, s), r in zip(fresh, rows) if s > 0]
            if carry:  # a page quantized earlier (e.g. after a truncation) continues in bf16
                ids = torch.tensor([p for p, _ in carry], dtype=torch.long, device=dev)
                rr = torch.tensor([r for _, r in carry], dtype=torch.long, device=dev)
                self.res_data[rr] = self._decode_pages(ids).to(RESIDUAL_DTYPE)
        keep = ~to_full
        rows = self.res_slot[page[keep]].long()
        self.res_data[rows, :, off[keep]] = x[keep].to(RESIDUAL_DTYPE)

    def _res_assign(self, pages: list[int]) -> list[int]:
        """Give each page a res_data row (growing res_data by doubling); returns the rows."""
        need = len(pages) - len(self._res_free)
        if need > 0:
            cap = self.res_data.shape[0]
            new_cap = max(cap + need, 2 * cap, 4)
            grown = torch.empty(new_cap, *self.res_data.shape[1:], dtype=RESIDUAL_DTYPE,
                                device=self.res_data.device)
            grown[:cap] = self.res_data
            self.res_data = grown
            self._res_free.extend(range(new_cap - 1, cap - 1, -1))
        rows = []
        for p in pages:
            r = self._res_free.pop()
            self._res_of[p] = r
            rows.append(r)
        self.res_slot[torch.tensor(pages, dtype=torch.long, device=self.res_slot.device)] = (
            torch.tensor(rows, dtype=torch.int32).to(self.res_slot.device))
        return rows

    def drop_residual(self, page_ids) -> None:
        """Free the residual rows of these pages (pages released, or quantized whole)."""
        if self.res_slot is None:
            return
        pages = torch.as_tensor(page_ids).reshape(-1).tolist()
        gone = [p for p in pages if p in self._res_of]
        for p in gone:
            self._res_free.append(self._res_of.pop(p))
        if gone:
            self.res_slot[torch.tensor(gone, dtype=torch.long, device=self.res_slot.device)] = -1

    def residual_pages(self) -> list[int]:
        """Pages whose tokens live in the bf16 residual."""
        return sorted(self._res_of) if self.res_slot is not None else []

    # -- checks, copies, sizes --

    def _check_write(self, slots: torch.Tensor, x: torch.Tensor,
                     host_slots: list[int] | None = None) -> int | None:
        H, D = self.num_heads, self.head_dim
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (H, D):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UnsupportedShapeError(f"PagedTensor.write: x must be [T, {H}, {D}], got {got}")
        if not x.is_floating_point():
            raise UnsupportedShapeError(f"PagedTensor.write: x must be floating, got {x.dtype}")
        if (not isinstance(slots, torch.Tensor) or slots.dim() != 1
                or slots.dtype.is_floating_point or slots.dtype == torch.bool):
            raise UnsupportedShapeError("PagedTensor.write: slots must be a 1-D integer tensor")
        if slots.shape[0] != x.shape[0]:
            raise UnsupportedShapeError(f"PagedTensor.write: {slots.shape[0]} slots for "
                                        f"{x.shape[0]} tokens")
        if slots.numel() == 0:
            return None
        if slots.numel() == 1:  # a decode step's token: no duplicates to look for
            lo = hi = int(slots[0]) if host_slots is None else host_slots[0]
            dup = 0
        else:
            s = slots.long().sort().values
            lo, hi, dup = torch.stack([s[0], s[-1], (s[1:] == s[:-1]).sum()]).tolist()
        total = self.num_pages * self.page_size
        if lo < 0 or hi >= total:
            raise CacheStateError(f"PagedTensor.write: slot {lo if lo < 0 else hi} out of range "
                                  f"[0, {total}) ({self.num_pages} pages of {self.page_size})")
        if dup:
            raise CacheStateError(f"PagedTensor.write: {dup} duplicate slot(s); each token of a "
                                  f"write needs its own slot")
        return lo if slots.numel() == 1 else None

    def copy_pages(self, src, dst) -> None:
        """Copy whole pages src[i] -> dst[i] (data, scales, residual), for copy-on-write."""
        dev = self.data.device
        on_host = not isinstance(src, torch.Tensor) and not isinstance(dst, torch.Tensor)
        if on_host:   # page ids checked on the host: no device read (eviction between graphs)
            ids = [int(p) for p in src] + [int(p) for p in dst]
            if ids and (min(ids) < 0 or max(ids) >= self.num_pages):
                raise CacheStateError(f"copy_pages: page id out of range [0, {self.num_pages})")
        src = torch.as_tensor(src, dtype=torch.long, device=dev).reshape(-1)
        dst = torch.as_tensor(dst, dtype=torch.long, device=dev).reshape(-1)
        if src.shape != dst.shape:
            raise UnsupportedShapeError(f"copy_pages: {src.numel()} sources, {dst.numel()} "
                                        f"destinations")
        if src.numel() == 0:
            return
        if not on_host:
            lo, hi = torch.cat([src, dst]).aminmax()
            if int(lo) < 0 or int(hi) >= self.num_pages:
                raise CacheStateError(f"copy_pages: page id out of range [0, "
                                      f"{self.num_pages})")
        for name, t in self.parts().items():
            if not self._unpaged(name):
                t[dst] = t[src]
        if self.res_slot is not None:
            pairs = list(zip(src.tolist(), dst.tolist()))
            self.drop_residual([d for s, d in pairs if s not in self._res_of])
            pairs = [(s, d) for s, d in pairs if s in self._res_of]
            fresh = [d for _, d in pairs if d not in self._res_of]
            if fresh:
                self._res_assign(fresh)
            for s, d in pairs:
                self.res_data[self._res_of[d]] = self.res_data[self._res_of[s]]

    def nbytes(self) -> int:
        """Bytes held: pages (data, scales, zero points, micro scales) and residual rows."""
        return self.residual_nbytes() + sum(
            t.numel() * t.element_size() for t in self.parts().values())

    def residual_nbytes(self) -> int:
        if self.res_slot is None:
            return 0
        return (self.res_data.numel() * self.res_data.element_size()
                + self.res_slot.numel() * self.res_slot.element_size())


_FP32_MAX = float(torch.finfo(torch.float32).max)


_FP8_VALUES: dict[torch.dtype, np.ndarray] = {}


def _fp8_values(dtype: torch.dtype) -> np.ndarray:
    """[256] fp32 numpy: fp8_to_float of every code of `dtype` (the reference decoder's values,
    its NaN included), by code."""
    table = _FP8_VALUES.get(dtype)
    if table is None:
        codes = torch.arange(256, dtype=torch.uint8).view(dtype)
        table = _FP8_VALUES[dtype] = fp8_to_float(codes).numpy().copy()
    return table


def _as_fp32(values: list[float]) -> list[float]:
    """Python floats rounded to fp32 (nearest even), as a torch fp32 op rounds its result:
    for one division of fp32 values, rounding the double quotient again to fp32 is exact."""
    n = len(values)
    return list(struct.unpack(f"{n}f", struct.pack(f"{n}f", *values)))


def _grown_scale(scale: float, cover: float) -> float:
    """fp8.grow_page_scale on one page-head's fp32 numbers (cover > scale > 0): scale * 2^k
    with the smallest k such that it is >= cover (frexp's mantissas in [0.5, 1)); inf past
    fp32's range, as the fp32 cast of torch's double result."""
    m_s, e_s = math.frexp(scale)
    m_c, e_c = math.frexp(cover)
    grown = math.ldexp(m_s, e_c + (m_c > m_s))
    return grown if grown <= _FP32_MAX else math.inf
