"""Binding a model's own cache object to pool sequences, through zero-byte stub tensors.

A Hugging Face cache stores the tensors a compiled graph returns. kvcompile returns *stubs*
instead: `base.expand(B, Hkv, L, D)`, zero-stride views of a one-element `base`. Shapes stay
right (`get_seq_length()` reads `keys.shape[-2]`), memory is one element, and every stub of one
batch shares `base`'s storage, so any stub leads back to its `Binding`: the pool sequences of the
batch rows. When the last stub dies (the cache object is dropped), a finalizer frees the pages.

Real buffer caches (a StaticCache allocated outside the graph, gpt-fast `k_cache` buffers) are
turned into stubs in place after their first compiled call (`Binding.adopt`), which releases
their memory.

A call that owns the caches it makes (Hugging Face `generate`, integrations/hf.py) opens a
`call_scope()`: every binding created in that thread until it closes is recorded there, so the
call frees the pages of its own caches when it returns, and other threads' calls are untouched.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from kvcompile.errors import CacheStateError

_lock = threading.Lock()
_by_ptr: dict[int, Binding] = {}
_local = threading.local()   # .scopes: the open call scopes of this thread (lists of bindings)


@contextlib.contextmanager
def call_scope():
    """Record the bindings this thread creates until the block ends; yields their list. A
    nested scope hands what it created (and did not release) to the enclosing one."""
    scopes = _local.__dict__.setdefault("scopes", [])
    mine: list[Binding] = []
    scopes.append(mine)
    try:
        yield mine
    finally:
        scopes.pop()
        if scopes:
            scopes[-1].extend(b for b in mine if b.seq_ids)

_by_buffer: dict[int, Binding] = {}   # storage of a bound real buffer -> its binding


class Binding:
    """The pool sequences behind one cache object, one per batch row."""

    def __init__(self, state, seq_ids: list[int], device: torch.device):
        self.state = state                    # ModelState (owns the pool)
        self.seq_ids = list(seq_ids)
        self.kv_start = [0] * len(seq_ids)    # left-padding offset per row
        self.alive = True
        self.device = torch.device(device)
        self._bases: dict[torch.dtype, weakref.ref] = {}
        self._live_bases = 0
        self.released = False                 # by kvcompile.release(model): pages gone
        self.decode_marked = False            # hf_graphs.mark_decode_dynamic: done once
        scopes = getattr(_local, "scopes", None)
        if scopes:
            scopes[-1].append(self)

    # -- stubs -------------------------------------------------------------------------------
    def stub(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zero-byte tensor of `shape` that leads back to this binding."""
        ref = self._bases.get(dtype)
        base = ref() if ref is not None else None
        if base is not None and not torch.is_inference_mode_enabled():
            return base.expand(*shape)   # (60 stubs a decode step of a 30-layer model)
        with torch.inference_mode(False), torch.no_grad():
            if base is None:
                base = torch.zeros(1, device=self.device, dtype=dtype)
                ptr = base.untyped_storage().data_ptr()
                with _lock:
                    _by_ptr[ptr] = self
                self._bases[dtype] = weakref.ref(base)
                self._live_bases += 1
                weakref.finalize(base, _base_died, ptr)
            # views keep `base` alive (outside inference mode), so the stubs own the binding
            return base.expand(*shape)

    def owns_stub(self, t: torch.Tensor) -> bool:
        """Whether t is one of this binding's stubs (made by `stub`)."""
        ref = self._bases.get(t.dtype)
        return ref is not None and t._base is not None and t._base is ref()

    @property
    def has_stubs(self) -> bool:
        return self._live_bases > 0

    def bind_buffer(self, t: torch.Tensor) -> None:
        """Bind a real cache buffer that the model writes by slice assignment
        (`buf[:, :, a:b] = k`): Dynamo re-traces that write at every recompile, and a zero-stride
        stub cannot take it, so the buffer keeps its memory (the compiled graphs no longer write
        it) and leads back to this binding by its storage. The binding lives as long as it."""
        ptr = t.untyped_storage().data_ptr()
        with _lock:
            _by_buffer[ptr] = self
        self._live_bases += 1
        weakref.finalize(t, _buffer_died, self, ptr)

    def adopt(self, t: torch.Tensor) -> None:
        """Turn a real cache buffer (StaticCache made outside the graph, gpt-fast `k_cache`)
        into a stub of this binding, in place: its memory is released and any later read sees
        zeros instead of freed memory. The binding lives as long as the buffer."""
        view = self.stub(t.shape, t.dtype)
        base = self._bases[t.dtype]()
        self._pinned = getattr(self, "_pinned", [])
        self._pinned.append(base)          # set_() shares storage only: keep the base alive
        self._live_bases += 1
        with torch.inference_mode(False), torch.no_grad():
            t.set_(view.untyped_storage(), 0, t.shape, [0] * t.dim())
        weakref.finalize(t, _adopted_died, self, base)

    @property
    def pool(self):
        return self.state.pool

    @property
    def batch(self) -> int:
        return len(self.seq_ids)

    def seq_len(self) -> int:
        # logical length (stored + evicted): what the model's cache object reports
        return self.pool.logical_len(self.seq_ids[0]) if self.seq_ids else 0

    # -- cache-object operations (Hugging Face generate) ---------------------------------------
    def select(self, rows: list[int]) -> None:
        """New batch = old rows `rows` (may repeat: beam search / num_return_sequences).
        Repeated rows fork (pages shared, copy-on-write); rows no longer used are freed."""
        pool = self.pool
        new_ids, new_start, used = [], [], set()
        for r in rows:
            sid = self.seq_ids[r]
            if sid in used:
                sid = pool.fork(sid)
            used.add(self.seq_ids[r])
            new_ids.append(sid)
            new_start.append(self.kv_start[r])
        dropped = [s for s in self.seq_ids if s not in used]
        if dropped:
            pool.free(dropped)
        self.seq_ids, self.kv_start = new_ids, new_start

    def restart(self, batch: int) -> None:
        """Free every sequence and start `batch` empty ones (a write at position 0)."""
        pool = self.pool
        if self.seq_ids:
            pool.free(self.seq_ids)
        self.seq_ids = pool.allocate(batch)
        self.kv_start = [0] * batch

    def crop(self, new_len: int) -> None:
        """Drop tokens past `new_len` (assisted decoding rolls back rejected drafts)."""
        if any(self.pool.evicted(sid) for sid in self.seq_ids):
            raise CacheStateError(
                "cannot crop a cache after eviction removed tokens: its slots no longer map "
                "to positions one to one. Use assisted decoding without an eviction policy.")
        for sid in self.seq_ids:
            self.pool.truncate(sid, new_len)

    def release(self) -> None:
        """Free the pages; the binding stays usable (a new prefill restarts it)."""
        pool = self.state.pool
        if pool is None:
            self.seq_ids, self.kv_start = [], []
            return
        with pool._lock:   # (a finalizer of this binding may run meanwhile: free once)
            ids, self.seq_ids, self.kv_start = self.seq_ids, [], []
            if ids:
                pool.free([i for i in ids if pool.has(i)])

    def detach(self) -> None:
        """The pool went away (kvcompile.release): forget the sequences, free nothing."""
        self.seq_ids, self.kv_start = [], []
        self.released = True

    def _died(self) -> None:
        # the last stub is gone: called from a garbage-collector finalizer, maybe in the middle
        # of a pool method of this thread (PagePool.discard defers the free then)
        self.alive = False
        ids, self.seq_ids, self.kv_start = self.seq_ids, [], []
        pool = self.state.pool
        if ids and pool is not None:
            pool.discard(ids)


def _base_died(ptr: int) -> None:
    with _lock:
        binding = _by_ptr.pop(ptr, None)
    if binding is None:
        return
    binding._live_bases -= 1
    if binding._live_bases <= 0:
        try:
            binding._died()
        except Exception:  # the pool may already be gone at interpreter exit
            pass


def _adopted_died(binding: Binding, base) -> None:
    try:
        binding._pinned.remove(base)
    except ValueError:
        pass
    binding._live_bases -= 1
    if binding._live_bases <= 0:
        binding._died()


def _buffer_died(binding: Binding, ptr: int) -> None:
    with _lock:
        _by_buffer.pop(ptr, None)
    binding._live_bases -= 1
    if binding._live_bases <= 0:
        binding.alive = False
        try:
            binding.release()
        except Exception:  # the pool may already be gone at interpreter exit
            pass


def binding_of(t: torch.Tensor) -> Binding | None:
    """The binding a stub tensor (or a bound buffer) belongs to, or None."""
    if not isinstance(t, torch.Tensor):
        return None
    with _lock:
        if is_stub(t):
            return _by_ptr.get(t.untyped_storage().data_ptr())
        return _by_buffer.get(t.untyped_storage().data_ptr()) if _by_buffer else None


def is_stub(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.dim() > 0 and t.numel() > 1
            and all(s == 0 for s in t.stride()) and t.untyped_storage().nbytes() <= 16)


def live_bindings() -> list[Binding]:
    with _lock:
        return [b for b in _by_ptr.values() if b.alive]
