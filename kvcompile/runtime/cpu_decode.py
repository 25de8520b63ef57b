"""A CPU decode step of one sequence on the reference path, in few tensor ops.

    out = step.attend(layer, q, k, v, scale, window)    # q [1, Hq, 1, D], k / v [1, Hkv, 1, D]

On the CPU every torch op of a decode step costs a few microseconds of dispatch whatever its
size, and several times that inside a model's step, where each layer's matmuls evict the caches
that dispatch runs from. `attention_op` + `dispatch.attend` + `dense.paged_reference_attention`
reach the reference attention of a decode step through about 25 tensor ops and 90 Python calls
per layer (bf16 pages), against HF's 2 `torch.cat` and 1 SDPA. This path computes the same
bytes in the pool and the same output, bit for bit, with what one forward's layers share built
once (`for_forward`): the new token's page and slot, the sequence's page-head rows. Per layer it
writes K and V with one index_copy_ each (unquantized pages; fp8 pages together,
`PagedTensor.write_tokens_fp8`: by their kept facts, else both scale decisions by numpy, one
fp8 cast for both; a NaN / Inf token PagedTensor._write_one_fp8),
gathers each with one index_select (plus the dtype pass: fp8 pages' K and V are gathered and
decoded together by `dense._fp8_rows_host`, numpy integer ops and two torch ops, into buffers
made by the step's first layer and reused by the others) and calls SDPA once. Where
`KVConfig.cpu_fp8` allows C (kernels/cpu_fp8.py), fp8 pages' write and gather are one C call
a layer, and so are bf16 pages' (of an fp32 model): the same bytes and values as the numpy /
torch route, into one fp32 buffer of the step.

It is taken where `runtime/dispatch.py` would run the reference itself and nothing else acts on
the step: a forward of one row and one new token after a prompt, on a CPU pool; no eviction,
no hooks, no check_finite, no Triton kernels (KVConfig.kernels); and per layer no mask, sliding
window within reach, soft-capping or sinks, unquantized or fp8 page-scaled K and V. Otherwise
`for_forward` / `attend` return None, having written nothing, and the general path runs.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcompile.kernels import cpu_fp8
from kvcompile.kernels.dense import (
    _fp8_kind,
    _fp8_rows_host,
    _gather,
    _page_rows,
    _pages,
    _sdpa,
    _widen_rows_applies,
    compute_dtype,
)

KEY = "cpu_decode"   # the forward's CpuDecodeStep (or False) in its plan's cache


class CpuDecodeStep:
    """What the layers of one decode step share (see the module docstring)."""

    def __init__(self, pool, plan, cpu_fp8_route: str = "auto"):
        self.pool = pool
        self.cpu_fp8_route = cpu_fp8_route   # KVConfig.cpu_fp8: the fp8 pages' C or numpy route
        self.page, self.offset = divmod(plan.slots_host[0], pool.page_size)
        self.total = plan.seq_lens_list[0]
        self.pages = _pages(plan.block_tables, [0], True, self.total, pool.page_size)
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the sequence's pages as one run start, start + 1, ... (a pool that handed them out
        # in order): fp8 codes are then widened in place (`_fp8_rows_host`); else None
        ids = self.pages.tolist()
        self.start = ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None
        # fp8: the gather's codes / int16 / fp32 buffers, made by the first layer and reused
        # by the others (per step: no dequantized copy of the cache outlives the forward)
        self._scratch: dict = {}
        self._lib = None   # cpu_fp8.library(cpu_fp8_route), looked up by the first layer

    def rows(self, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sequence's page-head rows [H * n], the new token's rows [H]) of layers with
        `heads` KV heads."""
        r = self._rows.get(heads)
        if r is None:
            P = self.pool.page_size
            token = (self.page * heads + torch.arange(heads)) * P + self.offset
            r = self._rows[heads] = (_page_rows(self.pages, 1, heads), token)
        return r

    def attend(self, layer: int, q, k, v, scale: float, window: int):
        """Write layer `layer`'s new k / v [1, Hkv, 1, D] and attend q [1, Hq, 1, D] over the
        sequence: [1, Hq, 1, Dv] in compute_dtype(q.dtype), or None (nothing written) where
        this path does not apply to the layer."""
        if window and self.total > window:
            return None
        kt, vt = self.pool.k[layer], self.pool.v[layer]
        kind = _kind(kt, vt)
        H = kt.num_heads
        if not kind or k.shape != (1, H, 1, kt.head_dim) or v.shape != (1, H, 1, vt.head_dim):
            return None   # (the general path writes these formats, or names the bad shape)
        dt = compute_dtype(q.dtype)
        if kind == "bf16" and dt == torch.float32 and _c_token(k, v):
            lib = self._lib
            if lib is None:
                lib = self._lib = cpu_fp8.library(self.cpu_fp8_route) or False
            if lib:   # the write and the gather by one C call
                out, pages, keys, values, gather = self._c_buffer(kt)
                cpu_fp8.bf16_step(lib, kt, vt, self.page, self.offset, k, v, gather)
                return _sdpa(q, keys, values, None, scale, False)
        together = kind == "fp8"
        lib = None
        if together:
            lib = self._lib
            if lib is None:
                lib = self._lib = cpu_fp8.library(self.cpu_fp8_route) or False
            lib = lib or None
        if lib is not None and _c_token(k, v):
            # the write and (where it wrote) the gather by one C call
            out, pages, keys, values, gather = self._c_buffer(kt)
            if cpu_fp8.write_tokens(lib, (kt, vt), self.page, self.offset, (k, v),
                                    self._scratch, gather):
                if dt != torch.float32:
                    keys, values = self._kv_views(kt, out.to(dt))
                return _sdpa(q if q.dtype == dt else q.to(dt), keys, values, None, scale,
                              False)
            together_write = False   # (refused, nothing written: each tensor's own write)
        else:
            together_write = together
        rows, token = self.rows(H)
        if not (together_write and self._write_fp8(kt, vt, k, v, lib)):
            kt.write_token(self.page, self.offset, token, k)
            vt.write_token(self.page, self.offset, token, v)
        if together:
            keys, values = self._gather_fp8(kt, vt, rows, dt, lib)
        else:
            keys = _gather(kt, self.pages, 1, self.total, dt, rows)
            values = _gather(vt, self.pages, 1, self.total, dt, rows)
        return _sdpa(q if q.dtype == dt else q.to(dt), keys, values, None, scale, False)

    @staticmethod
    def _fp8_together(kt, vt) -> bool:
        """Whether K and V are fp8 pages of one format and shape that `_fp8_rows_host` decodes
        in one go (kept with K's views, for this V: a growth forgets it)."""
        views = kt.__dict__.setdefault("_views", {})
        pair = views.get("fp8_pair")
        if pair is None or pair[0] is not vt:
            pair = views["fp8_pair"] = (vt, (
                kt.one_token_path() == "fp8" and vt.one_token_path() == "fp8"
                and kt.data.shape == vt.data.shape and _fp8_kind(kt) == _fp8_kind(vt)
                and _widen_rows_applies(kt) and _widen_rows_applies(vt)))
        return pair[1]

    def _write_fp8(self, kt, vt, k, v, lib) -> bool:
        """K and V's tokens written together (`PagedTensor.write_tokens_fp8`: by their kept
        facts, else the scale decisions for both at once; one fp8 cast; with `lib`, the
        cpu_fp8 C library, one C call); False (nothing written) where that does not apply."""
        if (k.dtype != torch.float32 or v.dtype != torch.float32 or k.requires_grad
                or v.requires_grad or k.device.type != "cpu" or v.device.type != "cpu"):
            return False
        if lib is not None and k.is_contiguous() and v.is_contiguous():
            return cpu_fp8.write_tokens(lib, (kt, vt), self.page, self.offset, (k, v),
                                        self._scratch)
        H, D = kt.num_heads, kt.head_dim
        return kt.write_tokens_fp8((kt, vt), self.page, self.offset,
                                   (k.numpy().reshape(H, D), v.numpy().reshape(H, D)),
                                   self._scratch)

    def _gather_fp8(self, kt, vt, rows, dt, lib):
        """`_gather` of K and V together: one widening, one scale product (the same values);
        with `lib` (the cpu_fp8 C library) both by one C call into the step's buffer."""
        if lib is not None:
            return self._gather_fp8_c(kt, vt, dt, lib)
        r = self._scratch.get(id(rows))
        if r is None:   # (the rows as numpy, once per step)
            r = self._scratch[id(rows)] = rows.numpy()
        x, sc = _fp8_rows_host((kt, vt), r, 1, len(self.pages), self.total, self._scratch,
                               self.start)
        if dt == torch.float32:   # x: the step's scratch buffer, its K and V views made once
            views = self._scratch.get(("kv", id(x)))
            if views is None:
                views = self._scratch[("kv", id(x))] = self._kv_views(kt, x)
            x.mul_(sc)
            return views
        return self._kv_views(kt, torch.mul(x, sc).to(dt))

    def _gather_fp8_c(self, kt, vt, dt, lib):
        """`_gather_fp8` by the C library: [2, 1, H, n, P, D] fp32 in the step's buffer."""
        out, pages, keys, values, _ = self._c_buffer(kt)
        cpu_fp8.gather(lib, (kt, vt), pages, out)
        return (keys, values) if dt == torch.float32 else self._kv_views(kt, out.to(dt))

    def _c_buffer(self, kt):
        """(out [2, 1, H, n, P, D] fp32, the pages [n] as int64 numpy, out's K and V views
        [1, H, total, D], (the pages' address, n, out's address) for `cpu_fp8.write_tokens`):
        the step's buffer of the C routes, made by its first layer."""
        key = ("c_gather", kt.num_heads, kt.page_size, kt.head_dim)
        bufs = self._scratch.get(key)
        if bufs is None:
            n = len(self.pages)
            out = torch.empty((2, 1, kt.num_heads, n, kt.page_size, kt.head_dim),
                              dtype=torch.float32)
            pages = self.pages.numpy().astype(np.int64)
            bufs = self._scratch[key] = (out, pages, *self._kv_views(kt, out),
                                         (pages.ctypes.data, n, out.data_ptr()))
        return bufs

    def _kv_views(self, kt, out):
        """(keys, values) [1, H, total, D] of the decoded K and V out [2, 1, H, n, P, D]."""
        H, P, D = kt.num_heads, kt.page_size, kt.head_dim
        size, n = H * len(self.pages) * P * D, len(self.pages) * P * D
        shape, stride = (1, H, self.total, D), (size, n, D, 1)
        return out.as_strided(shape, stride), out.as_strided(shape, stride, size)


def _kind(kt, vt) -> str:
    """What a decode step does with a layer's K and V PagedTensors (kept with K's views, for
    this V: a growth forgets it): "fp8" (fp8 page-scaled pages of one format and shape:
    written and decoded together, `CpuDecodeStep._fp8_together`), "bf16" (bf16 pages of one
    shape, contiguous: the C route may write and gather them in one call), "plain" (other
    pages with a one-token path: `write_token` and `_gather` each), "" (the general path)."""
    views = kt.__dict__.setdefault("_views", {})
    kind = views.get("cpu_step_kind")
    if kind is None or kind[0] is not vt:
        paths = (kt.one_token_path(), vt.one_token_path())
        k = ""
        if "" not in paths:
            k = "fp8" if CpuDecodeStep._fp8_together(kt, vt) else "plain"
            if paths == ("plain", "plain"):
                if (kt.data.dtype == vt.data.dtype == torch.bfloat16
                        and kt.data.shape == vt.data.shape and kt.data.device.type == "cpu"
                        and kt.data.is_contiguous() and vt.data.is_contiguous()):
                    k = "bf16"
        kind = views["cpu_step_kind"] = (vt, k)
    return kind[1]


def _c_token(k, v) -> bool:
    """Whether the C routes may read the new token k / v [1, H, 1, D] as it is."""
    return (k.dtype == torch.float32 and v.dtype == torch.float32 and k.is_cpu and v.is_cpu
            and k.is_contiguous() and v.is_contiguous() and not k.requires_grad
            and not v.requires_grad)


def for_forward(ctx, q, positions) -> CpuDecodeStep | None:
    """The forward's CpuDecodeStep, built by its first attention op; None where the forward is
    not such a step (see the module docstring)."""
    plan = ctx.prepare(q.shape[0], q.shape[2], positions, q.device)
    step = plan.cache.get(KEY)
    if step is None:
        step = plan.cache[KEY] = _build(ctx.state, plan, q.device) or False
    return step or None


def _build(state, plan, device) -> CpuDecodeStep | None:
    if (device.type != "cpu" or plan.packed or plan.batch != 1 or plan.new_tokens != 1
            or not plan.is_decode or plan.slots_host is None or plan.kv_start[0]
            or state.hooks or state.eviction is not None or state.config.check_finite
            or state.kernels.use_triton(device)):
        return None
    return CpuDecodeStep(state.pool, plan, state.config.cpu_fp8)
