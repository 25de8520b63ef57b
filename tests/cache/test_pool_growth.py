"""A pool that grows on demand (cache/sizing.py, PagePool.growing): the same page ids, bytes and
block tables as a pool allocated up front, for every storage format; growth that is geometric,
never above the budget, and atomic when the budget is exhausted; and a pool that stays
consistent under threads and under frees requested by finalizers in the middle of a method."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvcompile.cache import sizing
from kvcompile.cache.formats import KVFormat
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.errors import KVCacheFullError

H, D, P = 2, 32, 16

FORMATS = [("fp32", "page", False), ("bf16", "page", False), ("fp8_e4m3", "page", False),
           ("fp8_e4m3", "token", False), ("fp8_e5m2", "tensor", False),
           ("fp4_e2m1", "page", False), ("fp4_e2m1", "channel", False),
           ("int4", "channel", False), ("int4", "token", False), ("int2", "page", False),
           ("int4", "channel", True), ("fp8_e4m3", "page", True)]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture
def one_page_chunks(monkeypatch):
    """Growth chunks of one page, so that a few tokens grow the pool many times."""
    monkeypatch.setattr(sizing, "CHUNK_BYTES", 1)


def _specs(name="fp32", gran="page", residual=False, layers=2):
    kf = KVFormat(name, gran, residual=residual)
    vf = KVFormat(name, "page" if gran == "channel" else gran, residual=residual)
    return [LayerSpec(H, D, D, kf, vf) for _ in range(layers)]


def _budget(specs, pages):
    return pages * PagePool(specs, 1, P).bytes_per_page


def _raw(pool, pages):
    """Every stored byte of these pages, per layer tensor (NaN-safe comparison)."""
    ids = torch.tensor(pages, dtype=torch.long)
    out = []
    for t in pool.k + pool.v:
        for name in ("data", "scale", "zero", "micro"):
            x = getattr(t, name, None)
            if x is None or (name in ("scale", "zero") and t.fmt.granularity == "tensor"):
                continue
            out.append(x[ids].reshape(len(pages), -1).view(torch.uint8).clone())
    return out


def _ops(pool, seed):
    """A fixed random history: appends (prefill and decode sized), forks with copy-on-write,
    truncations, frees. Returns the live sequences."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    live = pool.allocate(3)
    for _ in range(40):
        op = rng.random()
        if op < 0.6 or len(live) < 2:
            sid = rng.choice(live)
            n = rng.choice([1, 1, 3, 17, 40])
            pool.append(sid, [torch.randn(n, H, D, generator=g) for _ in pool.layers],
                        [torch.randn(n, H, D, generator=g) for _ in pool.layers])
        elif op < 0.75:
            live.append(pool.fork(rng.choice(live)))
        elif op < 0.88:
            sid = rng.choice(live)
            pool.truncate(sid, rng.randrange(pool.seq_len(sid) + 1))
        else:
            sid = live.pop(rng.randrange(len(live)))
            pool.free([sid])
    return live


@pytest.mark.parametrize("name,gran,residual", FORMATS)
def test_growing_pool_stores_what_a_fixed_pool_stores(name, gran, residual, one_page_chunks):
    specs = _specs(name, gran, residual)
    fixed = PagePool(specs, 256, P)
    grown = PagePool.growing(specs, P, _budget(specs, 256))
    assert grown.num_pages == 1
    live_f, live_g = _ops(fixed, seed=3), _ops(grown, seed=3)
    assert live_f == live_g
    assert grown.generation > 5 and grown.num_pages < fixed.num_pages
    grown.check_invariants()
    for sid in live_f:
        pages = fixed.pages_of(sid)
        assert grown.pages_of(sid) == pages           # page ids are the same
        assert fixed.seq_len(sid) == grown.seq_len(sid)
        full = pages[:fixed.seq_len(sid) // P]       # (a partial page's free slots: garbage)
        if full:
            for a, b in zip(_raw(fixed, full), _raw(grown, full)):
                assert torch.equal(a, b)              # bit for bit, scales included
        if pages:
            for layer in range(len(specs)):
                for x, y in zip(fixed.gather(layer, sid), grown.gather(layer, sid)):
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(fixed.block_table(live_f), grown.block_table(live_f))


def test_growth_is_geometric_and_stops_at_the_budget(one_page_chunks):
    specs = _specs()
    pool = PagePool.growing(specs, P, _budget(specs, 100))
    sid = pool.allocate()[0]
    counts = []
    for _ in range(100):
        pool.reserve([sid], P)                        # one page at a time
        counts.append(pool.num_pages)
        used = pool.stats().pages_used
        assert used <= pool.num_pages <= min(100, max(used + 1, int(1.5 * used) + 1))
    assert pool.num_pages == 100 and pool.stats().pages_max == 100
    assert pool.generation == len(set(counts)) - (counts[0] == 1) <= 13   # about log1.5(100)
    before = (pool.num_pages, pool.generation, pool.seq_len(sid), pool.stats())
    with pytest.raises(KVCacheFullError) as err:
        pool.reserve([sid], 1)                        # the budget is exhausted: now it raises
    assert (err.value.pages_free, err.value.pages_total) == (0, 100)
    assert (pool.num_pages, pool.generation, pool.seq_len(sid), pool.stats()) == before


def test_no_growth_unless_it_is_enough():
    specs = _specs()
    pool = PagePool.growing(specs, P, _budget(specs, 20))
    assert pool.num_pages == 20                      # 2 MiB chunk: the budget is smaller
    pool = PagePool.growing(specs, P, _budget(specs, 5000))
    chunk = sizing.chunk_pages(pool.bytes_per_page)
    assert pool.num_pages == chunk < 5000
    a, b = pool.allocate(2)
    pool.reserve([a], P * (chunk + 1))              # grows by one more chunk (> x1.5 here)
    assert pool.num_pages == 2 * chunk
    pool.reserve([a], P * (chunk + 1))
    assert pool.num_pages == 3 * chunk             # x1.5 and +1 chunk agree
    pool.reserve([a], P * (2 * chunk))
    assert pool.num_pages == 3 * chunk * 3 // 2    # x1.5 now more than one chunk
    n, gen = pool.num_pages, pool.generation
    with pytest.raises(KVCacheFullError):            # more than the budget: no growth at all
        pool.reserve([b], P * 5000)
    assert (pool.num_pages, pool.generation, pool.seq_len(b)) == (n, gen, 0)


def test_budget_is_evaluated_when_the_pool_grows():
    specs = _specs()
    per_page = PagePool(specs, 1, P).bytes_per_page
    allowed = {"pages": 600}
    seen = []

    def budget(held):
        seen.append(held)
        return allowed["pages"] * per_page

    pool = PagePool.growing(specs, P, budget)
    sid = pool.allocate()[0]
    first = pool.num_pages
    pool.reserve([sid], P * (first + 1))
    assert pool.num_pages > first and seen[-1] == first * per_page   # asked with what it held
    allowed["pages"] = pool.num_pages                 # memory got scarce meanwhile
    with pytest.raises(KVCacheFullError, match="full"):
        pool.reserve([sid], P * (pool.num_available + 1))
    pool.check_invariants()


def test_out_of_memory_while_growing_retries_just_what_is_needed(monkeypatch, one_page_chunks):
    specs = _specs()
    pool = PagePool.growing(specs, P, _budget(specs, 100))
    sid = pool.allocate()[0]
    pool.reserve([sid], 10 * P)
    grow, asked = pool._grow, []

    def tight(n):   # the device holds one more page than needed, not x1.5
        asked.append(n)
        if n > pool.num_pages + 1:
            raise torch.OutOfMemoryError("simulated")
        grow(n)

    monkeypatch.setattr(pool, "_grow", tight)
    pool.reserve([sid], P)
    assert asked == [15, 11] and pool.num_pages == 11
    monkeypatch.setattr(pool, "_grow", lambda n: (_ for _ in ()).throw(torch.OutOfMemoryError()))
    with pytest.raises(KVCacheFullError, match="ran out of memory"):
        pool.reserve([sid], P)
    assert pool.num_pages == 11 and pool.seq_len(sid) == 11 * P
    pool.check_invariants()


def test_swap_in_and_copy_on_write_grow_the_pool(one_page_chunks):
    specs = _specs("fp8_e4m3")
    pool = PagePool.growing(specs, P, _budget(specs, 64))
    a = pool.allocate()[0]
    g = torch.Generator().manual_seed(0)
    pool.append(a, [torch.randn(2 * P + 3, H, D, generator=g) for _ in specs],
                [torch.randn(2 * P + 3, H, D, generator=g) for _ in specs])
    want = [pool.gather(i, a) for i in range(len(specs))]
    swapped = pool.swap_out(a)
    b = pool.allocate()[0]
    pool.reserve([b], pool.num_pages * P)             # every allocated page taken
    n = pool.num_pages
    c = pool.swap_in(swapped)                         # grows instead of failing
    assert pool.num_pages > n
    for i, (k, v) in enumerate(want):
        assert torch.equal(pool.gather(i, c)[0], k) and torch.equal(pool.gather(i, c)[1], v)
    n = pool.num_pages
    pool.reserve([b], pool.num_available - 3)         # leave no free page; b's last is partial
    d = pool.fork(c)
    pool.reserve([d], 1)                              # copy-on-write of the shared partial page
    assert pool.num_pages > n
    pool.check_invariants()


def test_reserve_all_allocates_the_budget_and_stops_growing():
    specs = _specs()
    pool = PagePool.growing(specs, P, _budget(specs, 3000))
    sid = pool.allocate()[0]
    pool.reserve([sid], 5 * P)
    pool.reserve_all()
    assert pool.num_pages == pool.max_pages == 3000 and not pool.growable
    assert pool.seq_len(sid) == 5 * P and pool.num_available == 3000 - 5
    pool.check_invariants()


def test_discard_inside_a_pool_method_runs_when_it_returns():
    """A garbage-collector finalizer (runtime/binding.py) may free a sequence while this thread
    is inside a pool method: the free waits until the method returns."""
    specs = _specs()
    state = {}

    def writer(paged, slots, x, grouped=False):
        if "victim" in state:                          # as if gc ran a finalizer here
            pool.discard([state.pop("victim")])
            state["freed_during_write"] = pool.has(victim)
        paged.write(slots, x)

    pool = PagePool(specs, 32, P, writer=writer)
    victim, live = pool.allocate(2)
    pool.reserve([victim], 3 * P)
    state["victim"] = victim
    pool.append(live, [torch.randn(5, H, D) for _ in specs], [torch.randn(5, H, D) for _ in specs])
    assert state["freed_during_write"] is True         # not freed in the middle of append
    assert not pool.has(victim) and pool.stats().pages_used == 1
    pool.check_invariants()
    pool.discard([victim])                             # already gone: nothing happens
    pool.check_invariants()


def test_threads_share_one_growing_pool(one_page_chunks):
    specs = _specs("fp8_e4m3")
    pool = PagePool.growing(specs, P, _budget(specs, 4000))
    errors, done = [], []

    def work(seed):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        mine = {}
        try:
            for _ in range(25):
                sid = pool.allocate()[0]
                n = rng.choice([1, 5, 17, 33])
                ks = [torch.randn(n, H, D, generator=g) for _ in specs]
                pool.append(sid, ks, [k * 2 for k in ks])
                mine[sid] = ks
                if rng.random() < 0.4:
                    pool.free([mine and mine.popitem()[0]])
            for sid, ks in mine.items():
                for layer in range(len(ks)):
                    got_k, got_v = pool.gather(layer, sid)
                    ref = PagePool(specs, 8, P)
                    r = ref.allocate()[0]
                    ref.append(r, ks, [x * 2 for x in ks])
                    assert torch.equal(got_k, ref.gather(layer, r)[0])
            done.append(list(mine))
        except BaseException as e:   # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert pool.generation > 3
    pool.check_invariants()
    assert pool.stats().sequences == sum(len(d) for d in done)
