"""PagePool methods of the engine: pin / unpin (prefix cache), attach (a cached prefix starts a
sequence), swap_out / swap_in (preemption to host memory), num_free, refcount."""

from __future__ import annotations

import pytest
import torch

from kvcompile.cache.formats import resolve_format
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.errors import (
    CacheStateError,
    KVCacheFullError,
    SequenceTooLongError,
    UnsupportedShapeError,
)

H, D, DV, P = 2, 16, 32, 4


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _pool(kv_dtype="fp32", num_pages=16, granularity="page", **kw):
    fmt = resolve_format(kv_dtype, torch.float32, granularity)
    return PagePool([LayerSpec(H, D, DV, fmt, fmt) for _ in range(2)], num_pages, P, **kw)


def _fill(pool, seq, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, H, D, generator=g) for _ in pool.layers]
    vs = [torch.randn(n, H, DV, generator=g) for _ in pool.layers]
    pool.append(seq, ks, vs)
    return ks, vs


def _raw(pool, seq):
    """Every stored byte of a sequence's pages, per layer tensor (NaN-safe comparison)."""
    ids = torch.tensor(pool.pages_of(seq))
    out = []
    for t in pool.k + pool.v:
        for x in (t.data, t.scale, getattr(t, "zero", None), t.micro):
            if x is not None and (x is t.data or x is t.micro
                                  or t.fmt.granularity != "tensor"):
                out.append(x[ids].reshape(len(ids), -1).view(torch.uint8).clone())
    return out


def test_pinned_pages_outlive_their_sequence_and_are_never_written():
    pool = _pool()
    a = pool.allocate()[0]
    _fill(pool, a, 2 * P + 1)
    full = pool.pages_of(a)[:2]
    before = [pool.gather(i, a) for i in range(2)]
    pool.pin(full)
    assert [pool.refcount(p) for p in full] == [2, 2]
    pool.free([a])
    pool.check_invariants()
    assert pool.num_free == 16 - 2 and pool.stats().pages_used == 2
    # a new sequence starts from the pinned prefix, shares it, and appends on a new page
    b = pool.allocate()[0]
    pool.attach(b, full)
    assert pool.seq_len(b) == 2 * P and pool.pages_of(b) == full
    slots = pool.reserve([b], 3)
    assert set((slots // P).tolist()).isdisjoint(full)
    for i in range(2):
        k, v = pool.gather(i, b)
        torch.testing.assert_close(k[:, :2 * P], before[i][0][:, :2 * P], rtol=0, atol=0)
    # truncating into a pinned page and appending copies it first (it is shared)
    pool.truncate(b, P + 1)
    slots = pool.reserve([b], 1)
    assert int(slots[0]) // P not in full
    assert pool.pages_of(b)[0] == full[0]
    pool.check_invariants()
    pool.free([b])
    pool.unpin(full)
    pool.check_invariants()
    assert pool.num_free == 16 and pool.stats().pages_used == 0


def test_pin_and_attach_reject_bad_pages():
    pool = _pool()
    a = pool.allocate()[0]
    _fill(pool, a, P)
    with pytest.raises(CacheStateError, match="not held"):
        pool.pin([5])               # a free page
    with pytest.raises(CacheStateError, match="not pinned"):
        pool.unpin(pool.pages_of(a))
    b = pool.allocate()[0]
    with pytest.raises(CacheStateError, match="holds nothing"):
        pool.attach(b, [7])
    with pytest.raises(CacheStateError, match="already holds"):
        pool.attach(a, pool.pages_of(a))
    short = _pool(max_seq_len=P)
    s = short.allocate()[0]
    _fill(short, s, P)
    t = short.allocate()[0]
    with pytest.raises(SequenceTooLongError):
        short.attach(t, short.pages_of(s) * 2)
    pool.check_invariants()
    short.check_invariants()


@pytest.mark.parametrize("kv_dtype,granularity", [
    ("fp32", "page"), ("bf16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "token"),
    ("fp8_e5m2", "tensor"), ("fp4_e2m1", "page"), ("int4", "page"), ("int2", "token")])
def test_swap_roundtrip_is_bit_exact(kv_dtype, granularity):
    pool = _pool(kv_dtype, granularity=granularity)
    a, other = pool.allocate(2)
    _fill(pool, a, 3 * P + 2, seed=1)
    _fill(pool, other, P + 1, seed=2)
    raw = _raw(pool, a)
    deq = [pool.gather(i, a) for i in range(2)]
    swapped = pool.swap_out(a)
    assert swapped.length == 3 * P + 2 and swapped.num_pages == 4 and swapped.nbytes > 0
    assert pool.stats().sequences == 1 and pool.num_free == 16 - 2
    # the freed pages are reused and overwritten before the swap-in
    c = pool.allocate()[0]
    _fill(pool, c, 4 * P, seed=3)
    pool.free([c])
    b = pool.swap_in(swapped)
    assert pool.seq_len(b) == 3 * P + 2
    for x, y in zip(_raw(pool, b), raw):
        assert torch.equal(x, y)
    for i in range(2):
        k, v = pool.gather(i, b)
        assert torch.equal(k.view(torch.int32), deq[i][0].view(torch.int32))
        assert torch.equal(v.view(torch.int32), deq[i][1].view(torch.int32))
    # appending after a swap-in continues the sequence
    _fill(pool, b, 3, seed=4)
    assert pool.seq_len(b) == 3 * P + 5
    pool.check_invariants()


def test_swap_in_is_atomic_when_full():
    pool = _pool(num_pages=6)
    a = pool.allocate()[0]
    _fill(pool, a, 4 * P)
    swapped = pool.swap_out(a)
    hog = pool.allocate()[0]
    _fill(pool, hog, 3 * P)
    before = (pool.num_free, pool.stats())
    with pytest.raises(KVCacheFullError):
        pool.swap_in(swapped)
    assert (pool.num_free, pool.stats()) == before
    pool.check_invariants()
    pool.free([hog])
    b = pool.swap_in(swapped)
    assert pool.seq_len(b) == 4 * P
    pool.check_invariants()


def test_shared_pages_survive_swap_of_one_holder():
    pool = _pool()
    a = pool.allocate()[0]
    _fill(pool, a, 2 * P)
    b = pool.fork(a)
    swapped = pool.swap_out(a)
    assert pool.seq_len(b) == 2 * P and pool.stats().pages_used == 2
    c = pool.swap_in(swapped)
    assert pool.stats().pages_used == 4  # the swap-in owns fresh copies
    for i in range(2):
        assert torch.equal(pool.gather(i, c)[0], pool.gather(i, b)[0])
    pool.check_invariants()


def test_residual_pages_are_not_swapped():
    fmt = resolve_format("int4", torch.float32, "page", residual=True)
    pool = PagePool([LayerSpec(H, D, DV, fmt, fmt)], 8, P)
    a = pool.allocate()[0]
    _fill(pool, a, P + 1)
    with pytest.raises(UnsupportedShapeError, match="recompute"):
        pool.swap_out(a)
    assert pool.seq_len(a) == P + 1
    pool.check_invariants()


def test_swap_keeps_the_eviction_counts():
    """A sequence that evicted (dropped and hidden tokens) comes back from host memory with
    the same logical length and eviction counts (Engine(swap_aside=True) swaps evicting
    decoders); a sequence that never evicted comes back with none."""
    pool = _pool()
    a, plain = pool.allocate(2)
    _fill(pool, a, 3 * P + 2, seed=1)
    _fill(pool, plain, P, seed=2)
    pool.evict_pages(a, [1])             # one whole page dropped
    pool.hide(a, 3)                      # and 3 stored tokens hidden
    assert (pool.logical_len(a), pool.dropped(a), pool.evicted(a)) == (3 * P + 2, P, P + 3)
    b = pool.swap_in(pool.swap_out(a))
    assert (pool.seq_len(b), pool.logical_len(b)) == (2 * P + 2, 3 * P + 2)
    assert (pool.dropped(b), pool.evicted(b)) == (P, P + 3)
    c = pool.swap_in(pool.swap_out(plain))
    assert (pool.logical_len(c), pool.evicted(c)) == (P, 0)
    pool.check_invariants()
