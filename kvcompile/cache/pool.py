"""PagePool: the paged KV store of every layer of a model.

    seq = pool.allocate()[0]
    slots = pool.reserve([seq], 128)      # [128] int64, page * P + offset
    pool.write(layer, slots, k, v)        # k: [128, Hkv, D], for each layer
    pool.block_table([seq])               # [1, max_pages] int32, for the paged kernels

Page ids are shared across layers (page p of a block table is page p of every layer's storage),
so one block table per sequence serves all layers. Pages are reference-counted: `fork` shares
every page, and only a shared, partially filled last page is copied (all layers) when a sequence
appends to it. Full pages are never written again. The allocator is a stack of free page ids.

A pool built with a `limit` grows on demand (cache/sizing.py): when `reserve` (or a copy-on-write,
or `swap_in`) runs out of free pages, every layer's storage is reallocated to a larger page count
and copied, page ids unchanged. `generation` counts the growths: whatever holds pointers into the
storage tensors (CUDA graphs) must compare it and rebuild. KVCacheFullError means the budget is
exhausted, not the pages allocated so far.

Thread safety: one re-entrant lock guards the bookkeeping and the storage (every public method
that reads or changes them takes it). A free requested by a garbage-collector finalizer while
the same thread is inside a pool method (`discard`) waits until that method returns.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcompile.cache import sizing
from kvcompile.cache.formats import KVFormat, PagedTensor
from kvcompile.errors import (
    CacheStateError,
    KVCacheFullError,
    SequenceTooLongError,
    UnsupportedShapeError,
)

_CPU_BUDGET_CAP = sizing.CPU_BUDGET_CAP  # bytes: a CPU pool never takes more by default


def _locked(method):
    """Run a PagePool method under the pool's lock; the outermost call first runs the frees
    that finalizers queued meanwhile (`discard`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            self._depth += 1
            outer = self._depth == 1
            if outer:
                self._owner = threading.get_ident()
            try:
                if outer and self._deferred:
                    self._run_deferred()
                return method(self, *args, **kwargs)
            finally:
                if outer and self._deferred:
                    self._run_deferred()
                self._depth -= 1
                if outer:
                    self._owner = None

    return run


@dataclass(frozen=True)
class LayerSpec:
    """Shape and storage format of one attention layer's cache."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    k_format: KVFormat
    v_format: KVFormat

    def __post_init__(self):
        for name in ("num_kv_heads", "head_dim", "v_head_dim"):
            _check_int(f"LayerSpec.{name}", getattr(self, name), 1)

    def bytes_per_page(self, page_size: int) -> float:
        h, p = self.num_kv_heads, page_size
        return p * (self.k_format.bytes_per_token(h, self.head_dim, p)
                    + self.v_format.bytes_per_token(h, self.v_head_dim, p))


@dataclass
class PoolStats:
    pages_total: int        # pages allocated now (a growing pool: so far)
    pages_used: int
    pages_free: int
    pages_shared: int       # pages held by more than one sequence
    sequences: int
    tokens: int             # sum of sequence lengths (a shared token counts once per sequence)
    bytes_total: int
    bytes_used: int
    bytes_per_token: float  # all layers, K + V, scales included
    internal_waste: float   # fraction of the slots of used pages that hold no token
    pages_max: int = 0      # the most pages the pool may hold (its budget, as last evaluated)


@dataclass
class SwappedSequence:
    """A sequence's pages in host memory (PagePool.swap_out): per PagedTensor of `k + v`, its
    `data` / `scale` / `micro` rows of the sequence's pages, in page order."""

    length: int
    num_pages: int
    tensors: list
    evicted: int = 0   # the sequence's eviction counts (`dropped`, `hide`), restored with it
    hidden: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.tensors for t in parts.values())


class _Sequence:
    """One sequence: its pages in order, its length and its block-table row. Invariant:
    len(pages) == ceil(length / page_size); eviction may drop or compact pages if it keeps that
    (and updates the table row: PagePool._drop_pages / _sync_row)."""

    __slots__ = ("pages", "length", "row")

    def __init__(self, pages: list[int], length: int, row: int):
        self.pages, self.length, self.row = pages, length, row


class PagePool:
    def __init__(self, layers: Sequence[LayerSpec], num_pages: int, page_size: int, device="cpu",
                 *, max_seq_len: int | None = None, writer=None,
                 limit: Callable[[int], int] | None = None):
        """`limit`: None for a fixed pool of `num_pages`; else a growing pool starting with
        `num_pages`, where limit(bytes held now) -> the most bytes it may hold (its budget)."""
        if not layers:
            raise ValueError("PagePool needs at least one LayerSpec")
        _check_int("PagePool num_pages", num_pages, 1)
        _check_int("PagePool page_size", page_size, 1)
        if max_seq_len is not None:
            _check_int("PagePool max_seq_len", max_seq_len, 1)
        self.layers = list(layers)
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_seq_len = max_seq_len
        # writer(paged, slots, x[, grouped]): grouped = the slots come from reserve(), so each
        # page's slots are adjacent and increasing (a writer may skip sorting them)
        self.writer = writer or _write_reference
        self._writer_grouped = _takes_grouped(self.writer)
        self._reserved: torch.Tensor | None = None  # the last slots reserve() returned
        # counts the block table's changes (entries flushed, the tensor replaced by a growth):
        # a copy of some rows taken at one version is current while it stands (upload_plan)
        self.table_version = 0
        self.k: list[PagedTensor] = []
        self.v: list[PagedTensor] = []
        for spec in self.layers:  # torch.empty inside allocate: the pool is never zero-filled
            self.k.append(spec.k_format.allocate(num_pages, spec.num_kv_heads, page_size,
                                                 spec.head_dim, self.device))
            self.v.append(spec.v_format.allocate(num_pages, spec.num_kv_heads, page_size,
                                                 spec.v_head_dim, self.device))
        self.bytes_per_page = _page_bytes(self.layers, page_size)
        self.bytes_per_token = self.bytes_per_page / page_size
        self._limit = limit
        self.max_pages = num_pages   # a growing pool: its budget in pages, as last evaluated
        if limit is not None:
            self.max_pages = max(num_pages, int(limit(num_pages * self.bytes_per_page))
                                 // self.bytes_per_page)
        self.generation = 0          # storage growths so far (CUDA graphs compare it)
        self._lock = threading.RLock()
        self._depth = 0              # nesting of locked calls in the thread holding the lock
        self._owner: int | None = None
        self._deferred: list[list[int]] = []   # frees queued by `discard`
        # Allocator: a stack of free ids (popped from the end, so page 0 goes out first).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._ref: list[int] = [0] * num_pages
        self._pins: dict[int, int] = {}  # page -> pins (prefix cache), counted in _ref
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        # Block tables: one persistent int32 table on the pool device, a row per sequence. Changes
        # wait in `_pending` (runs of a row's columns, the last write wins) and reach the table
        # in one scatter when a table is asked for: a decode step moves a few entries, not the
        # table; a prefill of 4,096 pages one copy built by numpy, not a Python loop a page.
        width = math.ceil(max_seq_len / page_size) if max_seq_len else 16
        self._table = torch.zeros(16, min(width, self.max_pages), dtype=torch.int32,
                                  device=self.device)
        self._pending = _PendingTable()
        self._free_rows: list[int] = list(range(15, -1, -1))
        self._rows: tuple = (None, None)  # the last batch's rows, and as an index tensor
        # Eviction (kvcompile/eviction): tokens dropped from each sequence, so that its logical
        # length (what the model's cache object reports) is length + evicted; and callbacks
        # (parent, child) run by fork, for per-sequence eviction bookkeeping.
        self._evicted: dict[int, int] = {}
        # tokens still stored but no longer attended (a window evicted without moving tokens:
        # eviction/runtime.py `_evict_window`); evicted() counts them, logical_len does not
        self._hidden: dict[int, int] = {}
        self.fork_listeners: list = []
        self.free_listeners: list = []   # callables(seq_id) run when a sequence is freed

    # --- sizing ------------------------------------------------------------------------------

    @classmethod
    def from_budget(cls, layers: Sequence[LayerSpec], page_size: int, budget_bytes: int,
                    device="cpu", **kw) -> PagePool:
        """As many pages as fit in `budget_bytes` (all layers, K + V, scales included)."""
        per_page = _page_bytes(layers, page_size)
        num_pages = int(budget_bytes) // per_page
        if num_pages < 1:
            raise KVCacheFullError(1, 0, 0, detail=f"a budget of {int(budget_bytes)} bytes holds "
                                   f"no page of {per_page} bytes")
        return cls(layers, num_pages, page_size, device, **kw)

    @classmethod
    def growing(cls, layers: Sequence[LayerSpec], page_size: int, budget, device="cpu",
                **kw) -> PagePool:
        """A pool that starts with one chunk (sizing.CHUNK_BYTES) and grows on demand up to
        `budget`: bytes, or a callable (bytes held now) -> bytes it may hold now."""
        limit = budget if callable(budget) else (lambda held, b=int(budget): b)
        per_page = _page_bytes(layers, page_size)
        most = int(limit(0)) // per_page
        if most < 1:
            raise KVCacheFullError(1, 0, 0, detail=f"a budget of {int(limit(0))} bytes holds "
                                   f"no page of {per_page} bytes")
        first = min(most, sizing.chunk_pages(per_page))
        return cls(layers, first, page_size, device, limit=limit, **kw)

    @staticmethod
    def budget_bytes(config, device) -> int:
        """`config.max_kv_bytes`, else `memory_fraction` of the device's free memory (on the CPU:
        of available RAM, at most 4 GiB)."""
        return sizing.budget_bytes(config, device)

    @property
    def growable(self) -> bool:
        return self._limit is not None

    @property
    def num_available(self) -> int:
        """Pages a reservation may still take: free ones plus the budget's unallocated ones (as
        last evaluated)."""
        return len(self._free) + max(0, self.max_pages - self.num_pages)

    @_locked
    def reserve_all(self) -> None:
        """Allocate the whole budget now and stop growing (a growing pool handed to the Engine,
        whose scheduler plans against a fixed page count)."""
        if self._limit is None:
            return
        self._refresh_limit()
        if self.max_pages > self.num_pages:
            self._grow(self.max_pages)
        self._limit = None
        self.max_pages = self.num_pages

    # --- sequences ---------------------------------------------------------------------------

    @_locked
    def allocate(self, n: int = 1) -> list[int]:
        """`n` new empty sequences; returns their ids (never reused)."""
        _check_int("allocate(n)", n, 0)
        ids = []
        for _ in range(n):
            sid, self._next_id = self._next_id, self._next_id + 1
            self._seqs[sid] = _Sequence([], 0, self._take_row())
            ids.append(sid)
        return ids

    @_locked
    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every page of `seq_id` (copy-on-write of its partial page)."""
        src = self._lookup([seq_id])[0]
        sid, self._next_id = self._next_id, self._next_id + 1
        seq = _Sequence(list(src.pages), src.length, self._take_row())
        for p in seq.pages:
            self._ref[p] += 1
        self._seqs[sid] = seq
        self._sync_row(seq, 0)
        if seq_id in self._evicted:  # eviction bookkeeping follows the pages
            self._evicted[sid] = self._evicted[seq_id]
        if seq_id in self._hidden:
            self._hidden[sid] = self._hidden[seq_id]
        for listener in self.fork_listeners:
            listener(seq_id, sid)
        return sid

    @_locked
    def free(self, seq_ids) -> None:
        """Drop sequences; their pages return to the free list when no sequence holds them."""
        for seq in self._lookup(seq_ids):
            self._drop_pages(seq, 0)
            self._free_rows.append(seq.row)
        for sid in _as_list(seq_ids):
            del self._seqs[sid]
            self._evicted.pop(sid, None)
            self._hidden.pop(sid, None)
            for listener in self.free_listeners:
                listener(sid)

    @_locked
    def truncate(self, seq_id: int, length: int) -> None:
        """Shorten a sequence to `length` tokens, releasing pages past it; like HF `crop`, a
        length >= the sequence's is a no-op."""
        seq = self._lookup([seq_id])[0]
        _check_int("truncate(length)", length, 0)
        if length < seq.length:
            self._drop_pages(seq, math.ceil(length / self.page_size))
            seq.length = length

    @_locked
    def reserve(self, seq_ids, num_tokens, slots: bool = True) -> torch.Tensor | None:
        """Extend each sequence by `num_tokens` (an int, or one per sequence).

        Returns the slots of the new tokens, [sum] int64 (page * P + offset) in sequence order, on
        the pool device; slots=False: None (a caller that takes them from `decode_slots`, as
        generate's graphs do, saves the tensor and its host-to-device copy). Atomic: on
        KVCacheFullError / SequenceTooLongError nothing changes.
        """
        seqs = self._lookup(seq_ids)
        counts = _counts(num_tokens, len(seqs))
        P, ref, free, max_len = self.page_size, self._ref, self._free, self.max_seq_len
        # Plan without touching state: new pages, plus one copy of each shared partial last
        # page. Copies are simulated in order, since one copy may leave the page unshared.
        need, released = 0, {}
        for seq, n in zip(seqs, counts):
            if n:
                new_len = seq.length + n
                if max_len is not None and new_len > max_len:
                    raise SequenceTooLongError(new_len, max_len)
                need += (new_len + P - 1) // P - len(seq.pages)
                if seq.length % P:
                    last = seq.pages[-1]
                    if ref[last] - released.get(last, 0) > 1:
                        need += 1
                        released[last] = released.get(last, 0) + 1
        if need > len(free):
            self._make_room(need)
            ref, free = self._ref, self._free   # (a growth extended them)
        # Commit.
        cow_src, cow_dst, runs = [], [], []
        for seq, n in zip(seqs, counts):
            if not n:
                continue
            start, pages = seq.length, seq.pages
            first_new = grow = (start + n + P - 1) // P - len(pages)
            if start % P and ref[pages[-1]] > 1:
                cow_src.append(pages[-1])
                ref[pages[-1]] -= 1
                pages[-1] = free.pop()
                ref[pages[-1]] = 1
                cow_dst.append(pages[-1])
                first_new += 1
            if grow:   # popped from the end of the free stack, last first
                new = free[-grow:]
                del free[-grow:]
                new.reverse()
                pages.extend(new)
                for p in new:
                    ref[p] = 1
            seq.length = start + n
            if first_new:
                self._sync_row(seq, len(pages) - first_new)
            if start % P + n <= P:  # within the last page (every decode step): one run
                runs.append((pages[-1] * P + start % P, n))
            else:   # the slots of the pages it spans, from its first new position on
                pg = np.asarray(pages[start // P:(start + n - 1) // P + 1], dtype=np.int64)
                o = start % P
                runs.append((pg[:, None] * P + np.arange(P)).reshape(-1)[o:o + n])
        if cow_src:
            self._copy_pages(cow_src, cow_dst)
        # one run per page, runs of distinct pages: write() may tell the writer so
        self._reserved = _to_device(_slots(runs), self.device) if slots else None
        return self._reserved

    # --- data --------------------------------------------------------------------------------

    @_locked
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              host_slots: list[int] | None = None, grouped: bool = False) -> None:
        """Store new keys / values at reserved slots. k: [T, Hkv, D], v: [T, Hkv, Dv].
        host_slots: the slots as host ints too (a CPU decode step's plan has them), so that
        the reference writer reads no slot from the tensor. grouped: the caller knows each
        page's slots are adjacent in `slots` (a decode step's rows are distinct sequences);
        reserve()'s last slots are known to be."""
        if slots.dim() != 1 or slots.dtype != torch.int64:
            raise UnsupportedShapeError(f"slots must be a 1-D int64 tensor (from reserve); got "
                                        f"{tuple(slots.shape)} {slots.dtype}")
        self._check_kv(layer, slots.shape[0], k, v)
        if slots.shape[0] == 0:
            return
        if self.writer is _write_reference:
            self.k[layer].write(slots, k, host_slots)
            self.v[layer].write(slots, v, host_slots)
        elif self._writer_grouped:
            grouped = grouped or slots is self._reserved  # each page's slots adjacent
            self.writer(self.k[layer], slots, k, grouped)
            self.writer(self.v[layer], slots, v, grouped)
        else:
            self.writer(self.k[layer], slots, k)
            self.writer(self.v[layer], slots, v)

    @_locked
    def append(self, seq_id: int, k_layers, v_layers) -> torch.Tensor:
        """Reserve and write every layer at once. k_layers[i]: [T, Hkv, D]; returns the slots."""
        L = len(self.layers)
        if len(k_layers) != L or len(v_layers) != L:
            raise UnsupportedShapeError(f"append needs one k and one v per layer ({L}); got "
                                        f"{len(k_layers)}, {len(v_layers)}")
        T = k_layers[0].shape[0]
        for i in range(len(self.layers)):  # validate everything before any state changes
            self._check_kv(i, T, k_layers[i], v_layers[i])
        seq = self._lookup([seq_id])[0]
        start = seq.length
        slots = self.reserve([seq_id], T)
        try:
            for i in range(len(self.layers)):
                self.write(i, slots, k_layers[i], v_layers[i])
        except BaseException:
            self.truncate(seq_id, start)
            raise
        return slots

    @_locked
    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized cache of one sequence: k [Hkv, L, D], v [Hkv, L, Dv] fp32 (reference)."""
        seq = self._lookup([seq_id])[0]
        ids = torch.tensor(seq.pages, dtype=torch.int64, device=self.device)
        out = []
        for paged in (self.k[layer], self.v[layer]):
            pages = paged.read(ids)  # [n, H, P, D]
            n, h, p, d = pages.shape
            out.append(pages.permute(1, 0, 2, 3).reshape(h, n * p, d)[:, :seq.length])
        return out[0], out[1]

    # --- views for the kernels ---------------------------------------------------------------

    def seq_len(self, seq_id: int) -> int:
        return self._lookup([seq_id])[0].length

    def pages_of(self, seq_id: int) -> list[int]:
        return list(self._lookup([seq_id])[0].pages)

    def seq_lens(self, seq_ids, device=None) -> torch.Tensor:
        lens = [s.length for s in self._lookup(seq_ids)]
        return torch.tensor(lens, dtype=torch.int32, device=device or self.device)

    @_locked
    def block_table(self, seq_ids, device=None) -> torch.Tensor:
        """[B, max_pages] int32 page ids, padded with 0 (at least one column)."""
        seqs = self._lookup(seq_ids)
        self._flush_table()
        key = tuple(s.row for s in seqs)  # rows are fixed for a sequence's life
        if key != self._rows[0]:
            self._rows = (key, torch.tensor(key, dtype=torch.int64, device=self.device))
        width = max([len(s.pages) for s in seqs] + [1])
        out = self._table[:, :width].index_select(0, self._rows[1])
        return out if device is None else out.to(device)

    @_locked
    def table(self) -> torch.Tensor:
        """The whole block table [rows, width] int32, pending changes applied. Row r belongs
        to the sequence whose `row` is r (decode_slots / sequence_slots give them). The tensor
        is replaced when the table grows: do not keep it across reserve / fork calls."""
        self._flush_table()
        return self._table

    @_locked
    def decode_slots(self, seq_ids) -> tuple[list[int], list[int], list[int]]:
        """Host-side view of a decode step after reserve(seq_ids, 1): for each sequence the
        slot of its last token, its block-table row and its length (no device work)."""
        P = self.page_size
        slots, rows, lens = [], [], []
        for s in self._lookup(seq_ids):
            last = s.length - 1
            slots.append(s.pages[last // P] * P + last % P)
            rows.append(s.row)
            lens.append(s.length)
        return slots, rows, lens

    @_locked
    def sequence_slots(self, seq_id: int) -> tuple[list[int], int]:
        """The slots of every token of a sequence, in order, and its block-table row."""
        s = self._lookup([seq_id])[0]
        P = self.page_size
        return [s.pages[i // P] * P + i % P for i in range(s.length)], s.row

    # --- eviction (kvcompile/eviction) ---------------------------------------------------------

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def logical_len(self, seq_id: int) -> int:
        """Tokens the sequence has seen: stored (`seq_len`) + evicted."""
        return self._lookup([seq_id])[0].length + self._evicted.get(seq_id, 0)

    def evicted(self, seq_id: int) -> int:
        """Tokens evicted: dropped from the pages, or stored but hidden (`hide`)."""
        self._lookup([seq_id])
        return self._evicted.get(seq_id, 0) + self._hidden.get(seq_id, 0)

    def dropped(self, seq_id: int) -> int:
        """Tokens evicted and no longer stored (logical_len - seq_len)."""
        self._lookup([seq_id])
        return self._evicted.get(seq_id, 0)

    def hide(self, seq_id: int, n: int) -> None:
        """`n` stored tokens of the sequence are evicted but keep their slots (the attention
        masks them): evicted() counts them."""
        self._lookup([seq_id])
        _check_int("hide(n)", n, 0)
        self._hidden[seq_id] = n

    @_locked
    def evict_tail(self, seq_id: int, length: int) -> None:
        """Shorten a sequence to `length` stored tokens after compaction moved every kept token
        below it; the dropped tokens count as evicted (the logical length is unchanged)."""
        seq = self._lookup([seq_id])[0]
        _check_int("evict_tail(length)", length, 0, seq.length)
        dropped = seq.length - length
        if dropped:
            self._drop_pages(seq, math.ceil(length / self.page_size))
            seq.length = length
            self._evicted[seq_id] = self._evicted.get(seq_id, 0) + dropped

    @_locked
    def evict_pages(self, seq_id: int, page_indices) -> None:
        """Drop whole pages of a sequence (indices into its page list; a partly filled last
        page cannot be dropped). Later pages move up; the pages return to the free list when no
        other sequence holds them; every layer loses those tokens."""
        seq = self._lookup([seq_id])[0]
        idx = sorted(set(int(i) for i in page_indices))
        if not idx:
            return
        n, P = len(seq.pages), self.page_size
        full = n if seq.length % P == 0 else n - 1
        if idx[0] < 0 or idx[-1] >= full:
            raise CacheStateError(f"evict_pages: page indices {idx} outside the {full} full "
                                  f"page(s) of sequence {seq_id}")
        gone = set(idx)
        for p in (seq.pages[i] for i in idx):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)
        seq.pages = [p for i, p in enumerate(seq.pages) if i not in gone]
        seq.length -= P * len(idx)
        self._sync_row(seq, idx[0])
        self._pending.set(seq.row, len(seq.pages), [0] * (n - len(seq.pages)))
        self._evicted[seq_id] = self._evicted.get(seq_id, 0) + P * len(idx)

    @_locked
    def move_tokens(self, layer: int, seq_id: int, src: torch.Tensor, dst: torch.Tensor,
                    heads: torch.Tensor) -> None:
        """Copy tokens of one layer within a sequence, per kv head (compaction). src, dst:
        [M] int64 token indices of the sequence (< seq_len), heads: [M] kv head of each move.
        Destination pages shared with another sequence (fork) are copied first."""
        from kvcompile.cache.compaction import move_slots

        seq = self._lookup([seq_id])[0]
        if src.numel() == 0:
            return
        if src.shape != dst.shape or src.shape != heads.shape or src.dim() != 1:
            raise UnsupportedShapeError("move_tokens: src, dst and heads must be [M] alike")
        lo, hi = torch.stack([torch.cat([src, dst]).min(), torch.cat([src, dst]).max()]).tolist()
        if lo < 0 or hi >= seq.length:
            raise CacheStateError(f"move_tokens: token index out of [0, {seq.length})")
        P = self.page_size
        self._make_private(seq, sorted(set((dst // P).tolist())))
        table = torch.tensor(seq.pages, dtype=torch.int64, device=self.device)
        src, dst, heads = (t.to(self.device, torch.int64) for t in (src, dst, heads))
        gsrc = table[src // P] * P + src % P
        gdst = table[dst // P] * P + dst % P
        move_slots(self.k[layer], gsrc, gdst, heads)
        move_slots(self.v[layer], gsrc, gdst, heads)

    @_locked
    def compact_front(self, layer: int, seq_id: int, src: torch.Tensor) -> None:
        """Move token `src[h, k]` of kv head h to index k of the sequence, in one layer, with no
        host sync (eviction between CUDA-graph decode steps). src: [Hkv, K] int64 token indices
        of the sequence, each row increasing (so no kept token is overwritten before it
        moves). Only for formats that move exactly (compaction.py `moves_exactly`); pages
        shared with another sequence are copied first."""
        from kvcompile.cache.compaction import move_slots_exact, moves_exactly

        seq = self._lookup([seq_id])[0]
        H, K = src.shape
        if K > seq.length or H != self.layers[layer].num_kv_heads:
            raise CacheStateError(f"compact_front: src {tuple(src.shape)} for a sequence of "
                                  f"{seq.length} tokens and {self.layers[layer].num_kv_heads} "
                                  f"kv heads")
        for paged in (self.k[layer], self.v[layer]):
            if not moves_exactly(paged):
                raise UnsupportedShapeError(f"compact_front: {paged.fmt.name} pages re-encode "
                                            f"moved tokens; use move_tokens")
        P = self.page_size
        front = range(-(-K // P))
        self._make_private(seq, list(front))
        # the row's first pages as the device table holds them; flushed (a host-to-device
        # copy) only when one of them changed since the last flush (copy-on-write above)
        stale = self._pending.touches(seq.row, len(front))
        table = (self.table() if stale else self._table)[seq.row].to(torch.int64)
        src = src.to(self.device, torch.int64)
        dst = torch.arange(K, device=self.device).expand(H, K)
        heads = torch.arange(H, device=self.device)[:, None].expand(H, K)
        gsrc = table[src // P] * P + src % P
        gdst = table[dst // P] * P + dst % P
        for paged in (self.k[layer], self.v[layer]):
            move_slots_exact(paged, gsrc.reshape(-1), gdst.reshape(-1), heads.reshape(-1))

    @_locked
    def make_private(self, seq_id: int, page_indices) -> None:
        """Copy-on-write of the listed pages of a sequence (indices into its page list; those
        past its end are ignored) that other sequences also hold: before moving tokens into
        them (eviction/front.py)."""
        seq = self._lookup([seq_id])[0]
        self._make_private(seq, [i for i in page_indices if i < len(seq.pages)])

    def row_of(self, seq_id: int) -> int:
        """The sequence's row of the block table (`table`)."""
        return self._lookup([seq_id])[0].row

    def _make_private(self, seq: _Sequence, page_indices: list[int]) -> None:
        """Copy-on-write of the listed pages of `seq` that other sequences also hold."""
        shared = [i for i in page_indices if self._ref[seq.pages[i]] > 1]
        if not shared:
            return
        self._make_room(len(shared), "copy-on-write before compaction")
        src, dst = [], []
        for i in shared:
            old = seq.pages[i]
            self._ref[old] -= 1
            new = self._free.pop()
            self._ref[new] = 1
            seq.pages[i] = new
            src.append(old)
            dst.append(new)
            self._pending.set(seq.row, i, [new])
        self._copy_pages(src, dst)

    # --- prefix sharing and swapping (kvcompile/engine) ---------------------------------------

    @_locked
    def pin(self, pages) -> None:
        """Hold full pages outside any sequence (the engine's prefix cache). A pinned page is not
        freed when its sequences are, and counts as shared: a sequence that appends to it after
        a truncation copies it first, so pinned pages are never written."""
        pages = [int(p) for p in pages]
        for p in pages:
            if not 0 <= p < self.num_pages or self._ref[p] == 0:
                raise CacheStateError(f"pin: page {p} is not held by any sequence (pin a page "
                                      f"while the sequence that wrote it still holds it)")
        for p in pages:
            self._ref[p] += 1
            self._pins[p] = self._pins.get(p, 0) + 1

    @_locked
    def unpin(self, pages) -> None:
        """Drop pins; a page no sequence holds returns to the free list."""
        pages = [int(p) for p in pages]
        for p in pages:
            if self._pins.get(p, 0) < 1:
                raise CacheStateError(f"unpin: page {p} is not pinned")
        for p in pages:
            self._pins[p] -= 1
            if not self._pins[p]:
                del self._pins[p]
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)

    @property
    def num_free(self) -> int:
        """Pages on the free list (cheap; `stats()` walks every sequence)."""
        return len(self._free)

    def refcount(self, page: int) -> int:
        """Holders of a page: sequences plus pins (0 = free)."""
        return self._ref[int(page)]

    @_locked
    def attach(self, seq_id: int, pages) -> None:
        """Give an empty sequence full pages that hold its first len(pages) * page_size tokens
        (a prefix-cache hit): shared, never copied; its next tokens start a new page."""
        seq = self._lookup([seq_id])[0]
        pages = [int(p) for p in pages]
        if seq.length:
            raise CacheStateError(f"attach: sequence {seq_id} already holds {seq.length} tokens")
        if self.max_seq_len is not None and len(pages) * self.page_size > self.max_seq_len:
            raise SequenceTooLongError(len(pages) * self.page_size, self.max_seq_len)
        for p in pages:
            if not 0 <= p < self.num_pages or self._ref[p] == 0:
                raise CacheStateError(f"attach: page {p} holds nothing (freed, or never used)")
        if len(set(pages)) != len(pages):
            dup = next(p for p in pages if pages.count(p) > 1)
            raise CacheStateError(f"attach: page {dup} is listed twice; a page holds one "
                                  f"stretch of one prefix")
        for p in pages:
            self._ref[p] += 1
        seq.pages, seq.length = pages, len(pages) * self.page_size
        self._sync_row(seq, 0)

    @_locked
    def swap_out(self, seq_id: int, pin_memory: bool = False) -> SwappedSequence:
        """Copy a sequence's pages (every layer, K and V, scales included) to host memory and
        free the sequence. `swap_in` restores it bit for bit, with its eviction counts (its
        logical length); the eviction runtime's bookkeeping moves apart
        (EvictionRuntime.detach / attach)."""
        seq = self._lookup([seq_id])[0]
        if any(getattr(t, "res_slot", None) is not None for t in self.k + self.v):
            raise UnsupportedShapeError("swap_out: pages with a bf16 residual tail are not "
                                        "swapped (recompute instead)")
        ids = torch.tensor(seq.pages, dtype=torch.int64, device=self.device)
        saved = []
        for paged in self.k + self.v:
            parts = {}
            for name in ("data", "scale", "zero", "micro"):   # every per-page tensor
                t = getattr(paged, name, None)
                if t is None or (name in ("scale", "zero")
                                 and paged.fmt.granularity == "tensor"):
                    continue
                host = t[ids].to("cpu")
                parts[name] = host.pin_memory() if pin_memory else host
            saved.append(parts)
        swapped = SwappedSequence(seq.length, len(seq.pages), saved,
                                  self._evicted.get(seq_id, 0), self._hidden.get(seq_id, 0))
        self.free([seq_id])
        return swapped

    @_locked
    def swap_in(self, swapped: SwappedSequence) -> int:
        """A new sequence holding the swapped-out tokens again. Atomic: on KVCacheFullError
        nothing changes."""
        self._make_room(swapped.num_pages, "swap in")
        sid = self.allocate(1)[0]
        try:
            self.reserve([sid], swapped.length)
        except BaseException:
            self.free([sid])
            raise
        ids = torch.tensor(self._seqs[sid].pages, dtype=torch.int64, device=self.device)
        for paged, parts in zip(self.k + self.v, swapped.tensors):
            for name, host in parts.items():
                getattr(paged, name)[ids] = host.to(self.device, non_blocking=True)
        if swapped.evicted:
            self._evicted[sid] = swapped.evicted
        if swapped.hidden:
            self._hidden[sid] = swapped.hidden
        return sid

    # --- accounting --------------------------------------------------------------------------

    @_locked
    def stats(self) -> PoolStats:
        used = self.num_pages - len(self._free)
        fill: dict[int, int] = {}  # page -> tokens held (the most any holder has written)
        for seq in self._seqs.values():
            for i, p in enumerate(seq.pages):
                fill[p] = max(fill.get(p, 0), min(self.page_size, seq.length - i * self.page_size))
        for p in self._pins:  # prefix-cache pages are full
            fill[p] = self.page_size
        slots = used * self.page_size
        return PoolStats(
            pages_total=self.num_pages, pages_used=used, pages_free=len(self._free),
            pages_shared=sum(r > 1 for r in self._ref), sequences=len(self._seqs),
            tokens=sum(s.length for s in self._seqs.values()),
            bytes_total=sum(t.nbytes() for t in self.k + self.v),
            bytes_used=used * self.bytes_per_page, bytes_per_token=self.bytes_per_token,
            internal_waste=(slots - sum(fill.values())) / slots if slots else 0.0,
            pages_max=max(self.max_pages, self.num_pages))

    @_locked
    def check_invariants(self) -> None:
        """Raise CacheStateError unless every page is owned as its refcount says (for tests)."""
        P, held, rows = self.page_size, [0] * self.num_pages, set()
        self._flush_table()
        table = self._table.cpu()
        for sid, seq in self._seqs.items():
            if len(set(seq.pages)) != len(seq.pages):
                raise CacheStateError(f"sequence {sid} holds a page twice: {seq.pages}")
            if len(seq.pages) != math.ceil(seq.length / P):
                raise CacheStateError(f"sequence {sid}: {len(seq.pages)} pages for {seq.length}"
                                      f" tokens of page size {P}")
            for p in seq.pages:
                held[p] += 1
            if seq.row in rows:
                raise CacheStateError(f"sequence {sid} shares block-table row {seq.row}")
            rows.add(seq.row)
            row = table[seq.row].tolist()
            if row[:len(seq.pages)] != seq.pages or any(row[len(seq.pages):]):
                raise CacheStateError(f"block-table row of sequence {sid} is {row}, pages are "
                                      f"{seq.pages}")
        for p, n in self._pins.items():  # pins (prefix cache) hold pages too
            held[p] += n
        if held != self._ref:
            bad = [p for p in range(self.num_pages) if held[p] != self._ref[p]][:8]
            raise CacheStateError(f"refcounts disagree with owners at pages {bad}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise CacheStateError("a page is on the free list twice")
        if free != {p for p in range(self.num_pages) if held[p] == 0}:
            raise CacheStateError("free list != pages no sequence holds (leak or double use)")
        if rows & set(self._free_rows) or len(rows) + len(self._free_rows) != len(table):
            raise CacheStateError("block-table rows leaked or double-assigned")
        if table[self._free_rows].any():
            raise CacheStateError("a free block-table row is not all zeros")

    # --- growth ------------------------------------------------------------------------------

    def _refresh_limit(self) -> None:
        held = self.num_pages * self.bytes_per_page
        self.max_pages = max(self.num_pages, int(self._limit(held)) // self.bytes_per_page)

    def _make_room(self, need: int, detail: str = "") -> None:
        """Make `need` pages free, growing the storage when the budget allows it; else raise
        KVCacheFullError with nothing changed (a growth happens only if it is enough)."""
        if need <= len(self._free):
            return
        if self._limit is not None:
            self._refresh_limit()
            short = need - len(self._free)
            if self.num_pages + short <= self.max_pages:
                target = sizing.grow_target(self.num_pages, short, self.max_pages,
                                            sizing.chunk_pages(self.bytes_per_page))
                exact = self.num_pages + short
                for n in dict.fromkeys((target, exact)):   # then just what is needed
                    try:
                        self._grow(n)
                        return
                    except torch.OutOfMemoryError:
                        pass
                raise KVCacheFullError(need, len(self._free), self.max_pages, detail=(
                    f"the device ran out of memory growing the pool from {self.num_pages} to "
                    f"{exact} pages; lower KVConfig.memory_fraction or max_kv_bytes"))
        raise KVCacheFullError(need, self.num_available, max(self.max_pages, self.num_pages),
                               detail=detail)

    def _grow(self, num_pages: int) -> None:
        """Reallocate every layer's storage to `num_pages` pages (cache/sizing.py)."""
        old = self.num_pages
        for paged in self.k + self.v:
            sizing.grow_paged(paged, num_pages)
        self._ref.extend([0] * (num_pages - old))
        self._free[:0] = range(num_pages - 1, old - 1, -1)   # popped after the old free pages
        self.num_pages = num_pages
        self.generation += 1

    # --- frees from finalizers ----------------------------------------------------------------

    def discard(self, seq_ids) -> None:
        """Free sequences from a garbage-collector finalizer (runtime/binding.py): now, or, when
        this thread is inside a pool method (the collector ran in the middle of it), as that
        method returns. Sequences already gone are skipped."""
        ids = list(seq_ids)
        if not ids:
            return
        self._deferred.append(ids)
        if self._owner != threading.get_ident():
            self._flush_deferred()

    @_locked
    def _flush_deferred(self) -> None:
        pass   # (the lock's outermost call runs the queued frees)

    def _run_deferred(self) -> None:
        while self._deferred:
            ids = [i for i in self._deferred.pop() if i in self._seqs]
            if ids:
                self.free(ids)

    # --- internals ---------------------------------------------------------------------------

    def _lookup(self, seq_ids) -> list[_Sequence]:
        ids = _as_list(seq_ids)
        if len(set(ids)) != len(ids):
            raise CacheStateError(f"sequence ids {ids} repeat; pass each sequence once")
        try:
            return [self._seqs[i] for i in ids]
        except (KeyError, TypeError):
            bad = [i for i in ids if not isinstance(i, int) or i not in self._seqs]
            raise CacheStateError(f"sequence(s) {bad} are not in the pool (never allocated, or "
                                  f"freed); call allocate() or fork() first") from None

    def _check_kv(self, layer: int, T: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not 0 <= layer < len(self.layers):
            raise UnsupportedShapeError(f"layer {layer} out of range [0, {len(self.layers)})")
        spec = self.layers[layer]
        for name, x, d in (("k", k, spec.head_dim), ("v", v, spec.v_head_dim)):
            if tuple(x.shape) != (T, spec.num_kv_heads, d):
                raise UnsupportedShapeError(
                    f"layer {layer}: {name} has shape {tuple(x.shape)}, expected [T={T}, "
                    f"Hkv={spec.num_kv_heads}, {'D' if name == 'k' else 'Dv'}={d}]")
            if x.device != self.device:
                raise UnsupportedShapeError(f"layer {layer}: {name} is on {x.device}, the pool "
                                            f"on {self.device}")

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        for paged in self.k + self.v:
            paged.copy_pages(src, dst)   # host lists: checked without reading the device

    def _drop_pages(self, seq: _Sequence, keep: int) -> None:
        """Release seq.pages[keep:] and clear them from its table row."""
        dropped = seq.pages[keep:]
        for p in dropped:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)
        freed = [p for p in dropped if self._ref[p] == 0]
        if freed and any(t.res_slot is not None for t in self.k + self.v):
            for paged in self.k + self.v:  # a freed page's bf16 residual row goes too
                paged.drop_residual(freed)
        if dropped:
            del seq.pages[keep:]
            self._pending.set(seq.row, keep, [0] * len(dropped))

    def _sync_row(self, seq: _Sequence, start: int) -> None:
        """Queue seq.pages[start:] for its table row (growing the table's width if needed)."""
        n, width = len(seq.pages), self._table.shape[1]
        if n > width:
            new_w = max(n, min(2 * width, self.max_pages))
            self._table = torch.nn.functional.pad(self._table, (0, new_w - width))
            self.table_version += 1
        if start < n:
            self._pending.set(seq.row, start, seq.pages[start:])

    def _take_row(self) -> int:
        if not self._free_rows:
            n = self._table.shape[0]
            self._table = torch.cat([self._table, torch.zeros_like(self._table)])
            self.table_version += 1
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _flush_table(self) -> None:
        if self._pending:
            self.table_version += 1
            upd = _to_device(self._pending.take(), self.device)  # [3, K]: one copy
            self._table[upd[0], upd[1]] = upd[2].to(torch.int32)


_FEW_ENTRIES = 64   # pending entries up to which a flush builds its tensor in Python (numpy's
#                     setup costs more there: 25 us against 5 for three decode pages)


class _PendingTable:
    """Block-table changes not yet on the device: runs (row, first column, page ids) in the
    order made. `take` turns them into one [3, K] int64 host tensor (rows, columns, pages)
    where each (row, column) appears once, its last write (a scatter with repeated indices
    keeps an arbitrary one on CUDA), and empties the list."""

    def __init__(self):
        self._runs: list[tuple[int, int, list[int] | np.ndarray]] = []

    def __bool__(self) -> bool:
        return bool(self._runs)

    def set(self, row: int, col: int, pages) -> None:
        if len(pages):
            self._runs.append((row, col, pages))

    def as_dict(self) -> dict[tuple[int, int], int]:
        """{(row, column): page} as the table will have it (tests, snapshots)."""
        return _last_writes(self._runs)

    def touches(self, row: int, ncols: int) -> bool:
        """Whether a pending change is in row `row`, columns [0, ncols)."""
        return any(r == row and c < ncols for r, c, _ in self._runs)

    def take(self) -> torch.Tensor:
        runs, self._runs = self._runs, []
        if sum(len(p) for _, _, p in runs) <= _FEW_ENTRIES:   # a decode step's few pages
            last = _last_writes(runs)
            return torch.tensor([[r for r, _ in last], [c for _, c in last],
                                 list(last.values())], dtype=torch.int64)
        lens = np.fromiter((len(p) for _, _, p in runs), dtype=np.int64, count=len(runs))
        rows = np.repeat(np.fromiter((r for r, _, _ in runs), np.int64, len(runs)), lens)
        first = np.fromiter((c for _, c, _ in runs), np.int64, len(runs))
        # column of each entry: its run's first column + its index in the run
        cols = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(
            first - (np.cumsum(lens) - lens), lens)
        pages = np.concatenate([np.asarray(p, dtype=np.int64) for _, _, p in runs])
        if len(runs) > 1:   # (one run, a prompt's new pages, repeats no entry)
            key = rows * (int(cols.max()) + 1) + cols
            _, last = np.unique(key[::-1], return_index=True)   # the last write of each entry
            if len(last) != len(key):
                keep = len(key) - 1 - last
                rows, cols, pages = rows[keep], cols[keep], pages[keep]
        return torch.from_numpy(np.stack([rows, cols, pages]))


def _last_writes(runs) -> dict[tuple[int, int], int]:
    """Runs (row, first column, pages), in order -> {(row, column): its last page}."""
    return {(r, c + j): int(p) for r, c, ps in runs for j, p in enumerate(ps)}


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the pool's device. To CUDA through pinned memory, without blocking: a
    pageable copy waits for every kernel queued before it, so a step's reserve() would wait for
    the step before it (the engine's overlapped steps, engine/overlap.py)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _takes_grouped(writer) -> bool:
    try:
        params = inspect.signature(writer).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind == p.VAR_POSITIONAL for p in params) or len(
        [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 4


def _write_reference(paged: PagedTensor, slots: torch.Tensor, x: torch.Tensor,
                     grouped: bool = False) -> None:
    """The pool's writer without a kernel: the format's reference encoder."""
    paged.write(slots, x)


def _check_int(what: str, v, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise ValueError(f"{what}={v!r}: must be an int in [{lo}, {'inf' if hi is None else hi}]")


def _as_list(seq_ids) -> list[int]:
    if isinstance(seq_ids, int):
        return [seq_ids]
    if isinstance(seq_ids, torch.Tensor):
        return seq_ids.tolist()
    return list(seq_ids)


def _counts(num_tokens, n: int) -> list[int]:
    if isinstance(num_tokens, int) and not isinstance(num_tokens, bool) and num_tokens >= 0:
        return [num_tokens] * n  # the decode path: validated once
    if isinstance(num_tokens, torch.Tensor):
        num_tokens = num_tokens.tolist()
    counts = list(num_tokens) if isinstance(num_tokens, (list, tuple)) else [num_tokens]
    if len(counts) != n or any(isinstance(c, bool) or not isinstance(c, int) or c < 0
                               for c in counts):
        raise ValueError(f"num_tokens={num_tokens!r}: give an int >= 0, or one per sequence "
                         f"({n})")
    return counts


def _slots(runs: list) -> torch.Tensor:
    """runs: (first slot, length) pairs and arrays of slots, in order -> their slots [sum]
    int64."""
    if all(isinstance(r, tuple) and r[1] == 1 for r in runs):   # decode: a token a sequence
        return torch.tensor([r[0] for r in runs], dtype=torch.int64)
    return torch.from_numpy(np.concatenate([
        r if isinstance(r, np.ndarray) else np.arange(r[0], r[0] + r[1], dtype=np.int64)
        for r in runs]))


def _page_bytes(layers: Sequence[LayerSpec], page_size: int) -> int:
    return round(sum(s.bytes_per_page(page_size) for s in layers))

