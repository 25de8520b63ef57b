"""PagePool: allocation, slots, block tables, refcounts, fork / copy-on-write, atomic exhaustion,
stats, and a random-operation stress test against a plain-Python model of the pool."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvcompile.cache.formats import resolve_format
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.config import KVConfig
from kvcompile.errors import (
    CacheStateError,
    KVCacheFullError,
    SequenceTooLongError,
    UnsupportedShapeError,
)
from kvcompile.testing import SQNR_FLOOR_DB, sqnr_db

H, D, DV = 2, 16, 32  # kv heads, key head dim, value head dim (different, to catch swaps)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _specs(kv_dtype="fp32", n_layers=2, heads=H, d=D, dv=DV, granularity="page"):
    fmt = resolve_format(kv_dtype, torch.float32, granularity)
    return [LayerSpec(heads, d, dv, fmt, fmt) for _ in range(n_layers)]


def _pool(kv_dtype="fp32", num_pages=32, page_size=4, **kw):
    return PagePool(_specs(kv_dtype), num_pages, page_size, **kw)


def _kv(pool, T, dtype=torch.float32):
    """Random new k/v for every layer, rounded to `dtype` so 16-bit formats store them exactly."""
    ks = [torch.randn(T, s.num_kv_heads, s.head_dim).to(dtype).float() for s in pool.layers]
    vs = [torch.randn(T, s.num_kv_heads, s.v_head_dim).to(dtype).float() for s in pool.layers]
    return ks, vs


def _expected_slots(pool, seq, start, n):
    pages, P = pool.pages_of(seq), pool.page_size
    return [pages[i // P] * P + i % P for i in range(start, start + n)]


def _storage_bytes(pool):
    out = []
    for t in pool.k + pool.v:
        for x in (t.data, t.scale, t.micro):
            if x is not None:
                out.append(x.reshape(-1).view(torch.uint8).clone())  # bytes: NaN-safe compare
    return out


def _snapshot(pool):
    seqs = {i: (list(s.pages), s.length, s.row) for i, s in pool._seqs.items()}
    return (list(pool._free), list(pool._ref), seqs, pool._table.clone(), pool.stats(),
            (pool._next_id, pool._pending.as_dict()), _storage_bytes(pool))


def _assert_same(a, b):
    assert a[:3] == b[:3] and a[4:6] == b[4:6]
    assert torch.equal(a[3], b[3])
    assert all(torch.equal(x, y) for x, y in zip(a[6], b[6]))


# --- sizing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_bytes_per_page_matches_storage(kv_dtype):
    pool = _pool(kv_dtype, num_pages=8, page_size=16)
    assert pool.stats().bytes_total == pool.bytes_per_page * pool.num_pages
    assert pool.bytes_per_token == pool.bytes_per_page / 16


@pytest.mark.parametrize("kv_dtype,expected", [
    ("bf16", 2 * 32 * 8 * 128 * 2),                      # 131072
    ("fp8_e4m3", 2 * 32 * 8 * (128 + 4 / 16)),           # codes + one fp32 scale per page-head
    ("fp4_e2m1", 2 * 32 * 8 * (64 + 128 / 16 + 4 / 16)),  # nibbles + e4m3 micro + fp32 scale
])
def test_bytes_per_token_llama3_8b(kv_dtype, expected):
    fmt = resolve_format(kv_dtype, torch.bfloat16)
    pool = PagePool([LayerSpec(8, 128, 128, fmt, fmt)] * 32, num_pages=1, page_size=16)
    assert pool.bytes_per_token == pytest.approx(expected)


def test_from_budget_and_budget_bytes():
    specs = _specs("fp8_e4m3")
    per_page = PagePool(specs, 1, 16).bytes_per_page
    pool = PagePool.from_budget(specs, 16, 10 * per_page + per_page - 1, max_seq_len=64)
    assert pool.num_pages == 10 and pool.max_seq_len == 64
    assert pool.stats().bytes_total <= 11 * per_page - 1
    with pytest.raises(KVCacheFullError, match="holds no page"):
        PagePool.from_budget(specs, 16, per_page - 1)
    assert PagePool.budget_bytes(KVConfig(max_kv_bytes=12345), "cpu") == 12345
    cpu = PagePool.budget_bytes(KVConfig(memory_fraction=0.5), "cpu")
    assert 0 < cpu <= (2 << 30)


# --- sequences, slots, data --------------------------------------------------------------------

def test_reserve_slots_mixed_batch():
    pool = _pool(num_pages=64, page_size=4)
    a, b, c, d = pool.allocate(4)
    pool.reserve([a, c], [3, 5])
    starts = {s: pool.seq_len(s) for s in (a, b, c, d)}
    counts = {a: 1, b: 0, c: 37, d: 4}
    slots = pool.reserve([a, b, c, d], [counts[s] for s in (a, b, c, d)])
    assert slots.dtype == torch.int64 and slots.shape == (42,)
    want = sum((_expected_slots(pool, s, starts[s], counts[s]) for s in (a, b, c, d)), [])
    assert slots.tolist() == want
    assert [pool.seq_len(s) for s in (a, b, c, d)] == [4, 0, 42, 4]
    assert len(set(pool.pages_of(a) + pool.pages_of(c) + pool.pages_of(d))) == 1 + 11 + 1
    one = pool.reserve([a, c, d], 1)  # decode step: one token each
    assert one.tolist() == [_expected_slots(pool, s, pool.seq_len(s) - 1, 1)[0] for s in (a, c, d)]
    assert pool.reserve([], 1).shape == (0,)
    pool.check_invariants()


def test_pending_table_last_write_once():
    # block-table changes queued between flushes: each (row, column) leaves once, with its
    # last value (a scatter of repeated indices keeps an arbitrary one on CUDA)
    from kvcompile.cache.pool import _PendingTable
    t = _PendingTable()
    assert not t
    t.set(2, 0, [5, 6, 7])
    t.set(1, 4, [])
    t.set(2, 1, [0, 0])        # a truncation's zeros
    t.set(3, 0, [8])
    t.set(2, 2, [9])           # regrown
    assert t and t.touches(2, 1) and t.touches(3, 1) and not t.touches(1, 9)
    want = {(2, 0): 5, (2, 1): 0, (2, 2): 9, (3, 0): 8}
    assert t.as_dict() == want
    rows, cols, pages = t.take().tolist()
    assert len(rows) == len(want) and not t
    assert dict(zip(zip(rows, cols), pages)) == want
    # past _FEW_ENTRIES: the numpy path, the same rules (a prefill's pages, then changes)
    t.set(0, 0, list(range(100, 200)))
    t.set(0, 50, [7] * 10)
    t.set(1, 0, list(range(80)))
    t.set(0, 55, [9])
    want = t.as_dict()
    assert want[0, 50] == 7 and want[0, 55] == 9 and want[0, 60] == 160 and len(want) == 180
    rows, cols, pages = t.take().tolist()
    assert len(rows) == len(want) and dict(zip(zip(rows, cols), pages)) == want


def test_table_after_truncate_and_regrow_unflushed():
    pool = _pool(num_pages=64, page_size=4)
    a, b = pool.allocate(2)
    pool.reserve([a, b], [9, 30])
    pool.block_table([a, b])
    pool.truncate(b, 3)              # zeros queued for b's columns 1..7
    pool.reserve([b, a], [17, 1])    # b regrows columns 1..4 before any flush
    t = pool.block_table([a, b])
    assert t[0, :3].tolist() == pool.pages_of(a)
    assert t[1, :5].tolist() == pool.pages_of(b) and t[1, 5:].tolist() == [0] * (t.shape[1] - 5)
    pool.check_invariants()


@pytest.mark.parametrize("kv_dtype,round_to", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_append_gather_exact(kv_dtype, round_to):
    torch.manual_seed(0)
    pool = _pool(kv_dtype, num_pages=300, page_size=16)
    s = pool.allocate()[0]
    chunks = [1, 1, 15, 1, 2000, 1, 31, 1, 3, 0, 16]  # one at a time and thousands at a time
    ks, vs = [[] for _ in pool.layers], [[] for _ in pool.layers]
    for T in chunks:
        k, v = _kv(pool, T, round_to)
        slots = pool.append(s, k, v)
        assert slots.shape == (T,)
        for i in range(len(pool.layers)):
            ks[i].append(k[i])
            vs[i].append(v[i])
    for i in range(len(pool.layers)):
        gk, gv = pool.gather(i, s)
        assert gk.dtype == torch.float32 and gk.shape == (H, sum(chunks), D)
        assert torch.equal(gk, torch.cat(ks[i]).transpose(0, 1))
        assert torch.equal(gv, torch.cat(vs[i]).transpose(0, 1))
    empty = pool.allocate()[0]
    gk, gv = pool.gather(1, empty)
    assert gk.shape == (H, 0, D) and gv.shape == (H, 0, DV)
    pool.check_invariants()


def test_block_table_and_seq_lens():
    pool = _pool(num_pages=64, page_size=4)
    a, b, c = pool.allocate(3)
    pool.reserve([a, b], [9, 2])
    t = pool.block_table([a, b, c])
    assert t.dtype == torch.int32 and t.shape == (3, 3)
    assert t[0].tolist() == pool.pages_of(a)
    assert t[1].tolist() == pool.pages_of(b) + [0, 0] and t[2].tolist() == [0, 0, 0]
    assert pool.block_table([c]).shape == (1, 1)
    assert pool.seq_lens([a, b, c]).tolist() == [9, 2, 0]
    assert pool.seq_lens([a]).dtype == torch.int32
    t[0, 0] = 99  # callers get a copy
    assert pool.block_table([a])[0, 0].item() == pool.pages_of(a)[0]
    pool.free([a])
    d = pool.allocate()[0]  # reuses a's row, which must read as empty
    assert pool.block_table([d, b]).tolist() == [[0], [pool.pages_of(b)[0]]]
    # Decode steps move single entries to the table, never whole rows.
    pool.block_table([d, b])
    pool.reserve([b], 1)  # stays in its page
    assert pool._pending.as_dict() == {}
    pool.reserve([b, d], 1)  # b: 4th token, same page; d: a first page
    assert list(pool._pending.as_dict().values()) == pool.pages_of(d)
    # Growth past the initial table width and row count.
    many = pool.allocate(40)
    pool.reserve(many[:1], 4 * 30)
    assert pool.block_table(many[:2]).shape == (2, 30)
    assert pool.block_table(many[:1])[0].tolist() == pool.pages_of(many[0])
    pool.check_invariants()


def test_writer_override():
    calls = []

    def writer(paged, slots, x):
        calls.append((paged, slots.clone(), x.shape))
        paged.write(slots, x)

    pool = _pool(writer=writer)
    s = pool.allocate()[0]
    k, v = _kv(pool, 5)
    slots = pool.append(s, k, v)
    assert [c[0] for c in calls] == [pool.k[0], pool.v[0], pool.k[1], pool.v[1]]
    assert all(torch.equal(c[1], slots) for c in calls)
    assert torch.equal(pool.gather(1, s)[1], v[1].transpose(0, 1))


def test_free_and_refcount():
    pool = _pool(num_pages=8, page_size=4)
    a, b = pool.allocate(2)
    pool.reserve([a, b], [8, 5])
    assert pool.stats().pages_free == 4
    c = pool.fork(a)
    assert pool.pages_of(c) == pool.pages_of(a) and pool.stats().pages_shared == 2
    pool.free([a])
    assert pool.stats().pages_free == 4 and pool.pages_of(c) == [0, 1]
    pool.free([b, c])
    st = pool.stats()
    assert (st.pages_free, st.pages_used, st.sequences, st.tokens) == (8, 0, 0, 0)
    pool.check_invariants()


# --- fork and copy-on-write --------------------------------------------------------------------

def test_fork_copies_only_shared_partial_page():
    torch.manual_seed(1)
    pool = _pool(num_pages=16, page_size=16)
    parent = pool.allocate()[0]
    pool.append(parent, *_kv(pool, 20))  # page 0 full, page 1 holds 4 tokens
    ref = [pool.gather(i, parent) for i in range(2)]
    child = pool.fork(parent)
    full, partial = pool.pages_of(parent)
    full_bytes = [t.data[full].clone() for t in pool.k + pool.v]
    new_k, new_v = _kv(pool, 1)
    pool.append(child, new_k, new_v)
    cp = pool.pages_of(child)
    assert cp[0] == full and cp[1] != partial  # full page shared, partial one copied
    assert pool.pages_of(parent) == [full, partial]
    assert all(torch.equal(t.data[full], b) for t, b in zip(pool.k + pool.v, full_bytes))
    for i in range(2):
        assert torch.equal(pool.gather(i, parent)[0], ref[i][0])
        gk, gv = pool.gather(i, child)
        assert torch.equal(gk, torch.cat([ref[i][0], new_k[i].transpose(0, 1)], 1))
        assert torch.equal(gv, torch.cat([ref[i][1], new_v[i].transpose(0, 1)], 1))
    # The parent now holds the partial page alone: it appends in place, no second copy.
    used = pool.stats().pages_used
    pool.append(parent, *_kv(pool, 1))
    assert pool.pages_of(parent) == [full, partial] and pool.stats().pages_used == used
    pool.check_invariants()


def test_fork_full_last_page_is_not_copied():
    pool = _pool(num_pages=16, page_size=4)
    parent = pool.allocate()[0]
    pool.reserve([parent], 8)
    child = pool.fork(parent)
    pool.reserve([child], 1)
    assert pool.pages_of(child)[:2] == pool.pages_of(parent)
    assert pool.stats().pages_used == 3 and pool.stats().pages_shared == 2


def test_cow_keeps_parent_scales_fp8():
    """The child's write raises the page's amax (re-encoding its old tokens): the parent's copy
    of the page and its scale must stay untouched."""
    torch.manual_seed(2)
    pool = _pool("fp8_e4m3", num_pages=8, page_size=16)
    parent = pool.allocate()[0]
    pool.append(parent, *_kv(pool, 5))
    before = [pool.gather(i, parent) for i in range(2)]
    child = pool.fork(parent)
    k, v = _kv(pool, 3)
    pool.append(child, [x * 100 for x in k], [x * 100 for x in v])
    for i in range(2):
        after = pool.gather(i, parent)
        assert torch.equal(after[0], before[i][0]) and torch.equal(after[1], before[i][1])
    assert pool.gather(0, child)[0][:, 5:].abs().max() > 50


def test_last_fork_keeps_the_partial_page():
    """Three forks share a partial page and the parent is freed: one reserve over all three
    needs only two copies (the last one finds the page unshared), so two free pages suffice."""
    pool = _pool(num_pages=3, page_size=4)
    parent = pool.allocate()[0]
    pool.reserve([parent], 2)
    kids = [pool.fork(parent) for _ in range(3)]
    pool.free([parent])
    pool.reserve(kids, 1)
    assert len({pool.pages_of(k)[0] for k in kids}) == 3 and pool.stats().pages_free == 0
    pool.check_invariants()


# --- errors: atomic, and clear -----------------------------------------------------------------

def test_exhaustion_is_atomic():
    torch.manual_seed(3)
    pool = _pool("fp8_e4m3", num_pages=6, page_size=4)
    a, b = pool.allocate(2)
    pool.append(a, *_kv(pool, 6))
    c = pool.fork(a)  # shares a partial page: reserving c needs a copy
    pool.append(b, *_kv(pool, 4))
    snap = _snapshot(pool)
    with pytest.raises(KVCacheFullError) as err:
        pool.reserve([c, a, b], [1, 2, 9])  # c: copy; a: in place; b: 3 new pages
    assert (err.value.pages_requested, err.value.pages_free, err.value.pages_total) == (4, 3, 6)
    assert "4 page(s) requested, 3 free of 6" in str(err.value)
    _assert_same(snap, _snapshot(pool))
    with pytest.raises(KVCacheFullError):
        pool.append(b, *_kv(pool, 13))
    _assert_same(snap, _snapshot(pool))
    pool.reserve([c, a, b], [1, 2, 5])  # exactly fits
    assert pool.stats().pages_free == 0
    pool.check_invariants()


def test_max_seq_len():
    pool = _pool(num_pages=16, page_size=4, max_seq_len=10)
    a, b = pool.allocate(2)
    pool.reserve([a], 9)
    snap = _snapshot(pool)
    with pytest.raises(SequenceTooLongError, match="11 exceeds KVConfig.max_seq_len=10"):
        pool.reserve([b, a], [3, 2])
    _assert_same(snap, _snapshot(pool))
    pool.reserve([a], 1)
    assert pool.block_table([a]).shape == (1, 3)


def test_bad_inputs_leave_state_untouched():
    pool = _pool()
    a, b = pool.allocate(2)
    pool.append(a, *_kv(pool, 3))
    snap = _snapshot(pool)
    k, v = _kv(pool, 2)
    bad_calls = [
        (CacheStateError, "not in the pool", lambda: pool.reserve([a, 99], 1)),
        (CacheStateError, "repeat", lambda: pool.reserve([a, a], 1)),
        (CacheStateError, "not in the pool", lambda: pool.free([b, 99])),
        (CacheStateError, "not in the pool", lambda: pool.fork(99)),
        (ValueError, "num_tokens", lambda: pool.reserve([a, b], [1])),
        (ValueError, "num_tokens", lambda: pool.reserve([a], -1)),
        (ValueError, "truncate", lambda: pool.truncate(a, -1)),
        (UnsupportedShapeError, "expected", lambda: pool.append(a, k, [v[0], k[1]])),
        (UnsupportedShapeError, "one k and one v", lambda: pool.append(a, k[:1], v[:1])),
        (UnsupportedShapeError, "layer 5", lambda: pool.write(5, torch.zeros(2).long(), k[0], v[0])),
        (UnsupportedShapeError, "int64", lambda: pool.write(0, torch.zeros(2), k[0], v[0])),
        (UnsupportedShapeError, "shape", lambda: pool.write(0, torch.zeros(3).long(), k[0], v[0])),
    ]
    for exc, msg, call in bad_calls:
        with pytest.raises(exc, match=msg):
            call()
        _assert_same(snap, _snapshot(pool))
    pool.free([a])
    with pytest.raises(CacheStateError, match="freed"):
        pool.seq_len(a)


def test_truncate():
    pool = _pool(num_pages=8, page_size=4)
    a = pool.allocate()[0]
    k, v = _kv(pool, 10)
    pool.append(a, k, v)
    b = pool.fork(a)
    pool.truncate(a, 11)  # past the end: a no-op, like HF crop
    assert pool.seq_len(a) == 10
    pool.truncate(a, 5)
    assert pool.seq_len(a) == 5 and len(pool.pages_of(a)) == 2
    assert pool.block_table([a]).tolist() == [pool.pages_of(a)]
    pool.append(a, *_kv(pool, 1))  # page 1 is still shared with b: a copies it
    assert pool.pages_of(a)[1] != pool.pages_of(b)[1]
    assert torch.equal(pool.gather(0, b)[0], k[0].transpose(0, 1))
    pool.truncate(b, 0)
    assert pool.pages_of(b) == [] and pool.stats().pages_used == 2
    pool.check_invariants()


# --- stats -------------------------------------------------------------------------------------

def test_stats_waste_exact():
    pool = _pool(num_pages=16, page_size=16)
    a = pool.allocate()[0]
    pool.reserve([a], 17)
    st = pool.stats()
    assert (st.pages_used, st.tokens, st.sequences) == (2, 17, 1)
    assert st.internal_waste == pytest.approx(15 / 32)
    assert st.bytes_used == 2 * pool.bytes_per_page
    b = pool.fork(a)  # shared slots count once
    assert pool.stats().internal_waste == pytest.approx(15 / 32)
    pool.reserve([b], 1)
    assert pool.stats().internal_waste == pytest.approx((15 + 14) / 48)
    pool.free([a, b])
    assert pool.stats().internal_waste == 0.0


def test_waste_at_32k_context_page_16():
    rng = random.Random(0)
    lens = [32768 - rng.randrange(16) for _ in range(8)]  # partial last pages
    fmt = resolve_format("bf16", torch.bfloat16)
    pool = PagePool([LayerSpec(1, 16, 16, fmt, fmt)], num_pages=8 * 2048, page_size=16)
    seqs = pool.allocate(8)
    pool.reserve(seqs, lens)
    st = pool.stats()
    bound = 8 * 15 / (st.pages_used * 16)  # at most one partial page per sequence
    assert st.internal_waste <= bound < 0.04
    assert st.internal_waste == pytest.approx(1 - sum(lens) / (st.pages_used * 16))
    pool.check_invariants()


# --- random-operation stress test against a model ----------------------------------------------

class _ModelPool:
    """The pool's semantics in plain Python: abstract page ids with refcounts, and the content
    of every token. Reserve applies tokens one at a time and rolls back when pages run out."""

    def __init__(self, num_pages, page_size):
        self.free, self.P, self.next_page = num_pages, page_size, 0
        self.ref, self.seqs = {}, {}  # seq -> [pages, tokens]; a token is (k rows, v rows)

    def _new_page(self):
        self.free -= 1
        self.next_page += 1
        self.ref[self.next_page] = 1
        return self.next_page

    def _drop(self, page):
        self.ref[page] -= 1
        if self.ref[page] == 0:
            del self.ref[page]
            self.free += 1

    def reserve(self, sid, tokens):  # returns False (and changes nothing) when pages run out
        pages, toks = self.seqs[sid]
        undo = (list(pages), len(toks), self.free, dict(self.ref), self.next_page)
        for t in tokens:
            if len(toks) % self.P == 0:
                pages.append(self._new_page())
            elif self.ref[pages[-1]] > 1:
                self._drop(pages[-1])
                pages[-1] = self._new_page()
            toks.append(t)
        if self.free < 0:
            pages[:], self.free, self.ref, self.next_page = undo[0], *undo[2:]
            del toks[undo[1]:]
            return False
        return True

    def fork(self, src, dst):
        pages, toks = self.seqs[src]
        for p in pages:
            self.ref[p] += 1
        self.seqs[dst] = [list(pages), list(toks)]

    def free_seq(self, sid):
        for p in self.seqs.pop(sid)[0]:
            self._drop(p)


def _check_against_model(pool, model, check_content, tol_db):
    pool.check_invariants()
    st = pool.stats()
    assert st.pages_free == model.free and st.sequences == len(model.seqs)
    fwd, back, fill = {}, {}, {}  # sharing must be the same, up to renaming pages
    for sid, (pages, toks) in model.seqs.items():
        real = pool.pages_of(sid)
        assert pool.seq_len(sid) == len(toks) and len(real) == len(pages)
        for i, (m, r) in enumerate(zip(pages, real)):
            assert fwd.setdefault(m, r) == r and back.setdefault(r, m) == m
            fill[m] = max(fill.get(m, 0), min(model.P, len(toks) - i * model.P))
    if fill:
        assert st.internal_waste == pytest.approx(1 - sum(fill.values()) / (len(fill) * model.P))
    if check_content is None:
        return
    sid = check_content
    toks = model.seqs[sid][1]
    for i in range(len(pool.layers)):
        gk, gv = pool.gather(i, sid)
        known = [j for j, t in enumerate(toks) if t is not None]
        if not known:
            continue
        want_k = torch.stack([toks[j][0][i] for j in known], 1)
        want_v = torch.stack([toks[j][1][i] for j in known], 1)
        if tol_db is None:
            assert torch.equal(gk[:, known], want_k) and torch.equal(gv[:, known], want_v)
        else:
            assert sqnr_db(want_k, gk[:, known]) > tol_db
            assert sqnr_db(want_v, gv[:, known]) > tol_db


def _stress(kv_dtype, n_ops, seed, tol_db=None):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    P, N = 4, 48
    pool = _pool(kv_dtype, num_pages=N, page_size=P)
    model = _ModelPool(N, P)
    counts = dict.fromkeys(["allocate", "reserve", "full", "fork", "free", "truncate"], 0)
    for step in range(n_ops):
        live = list(model.seqs)
        op = rng.choices(["allocate", "reserve", "fork", "free", "truncate"],
                         [0.12, 0.5, 0.12, 0.2, 0.06])[0]
        if op == "allocate" or not live:
            for sid in pool.allocate(rng.randint(1, 3)):
                model.seqs[sid] = [[], []]
            op = "allocate"
        elif op == "reserve":
            batch = rng.sample(live, rng.randint(1, min(4, len(live))))
            ns = [rng.choice([0, 1, 1, 1, 2, 3, 5, 9, 17, 40]) for _ in batch]
            total = sum(ns)
            write = kv_dtype != "fp32" or rng.random() < 0.9  # else: reserved, left unwritten
            ks = [torch.randn(total, H, D) for _ in pool.layers]
            vs = [torch.randn(total, H, DV) for _ in pool.layers]
            # Atomic over the batch: the model applies the whole batch or nothing.
            saved = ({s: [list(p), list(t)] for s, (p, t) in model.seqs.items()},
                     model.free, dict(model.ref), model.next_page)
            ok, at = True, 0
            for s, n in zip(batch, ns):
                toks = [([k[j] for k in ks], [v[j] for v in vs]) if write else None
                        for j in range(at, at + n)]
                at += n
                ok = ok and model.reserve(s, toks)
            if not ok:
                model.seqs, model.free, model.ref, model.next_page = saved
            try:
                slots = pool.reserve(batch, ns)
            except KVCacheFullError:
                assert not ok
                counts["full"] += 1
                continue
            assert ok and slots.shape == (total,)
            if write:
                for i in range(len(pool.layers)):
                    pool.write(i, slots, ks[i], vs[i])
        elif op == "fork":
            src = rng.choice(live)
            model.fork(src, pool.fork(src))
        elif op == "free":
            batch = rng.sample(live, rng.randint(1, min(3, len(live))))
            pool.free(batch)
            for s in batch:
                model.free_seq(s)
        else:
            s = rng.choice(live)
            n = rng.randint(0, pool.seq_len(s))
            pool.truncate(s, n)
            pages, toks = model.seqs[s]
            for p in pages[math.ceil(n / P):]:
                model._drop(p)
            del pages[math.ceil(n / P):], toks[n:]
        counts[op] += 1
        live = list(model.seqs)
        check = rng.choice(live) if live and step % 10 == 0 else None
        _check_against_model(pool, model, check, tol_db)
        if step % 50 == 0 and live:
            batch = rng.sample(live, min(3, len(live)))
            t = pool.block_table(batch)
            for row, s in zip(t.tolist(), batch):
                pages = pool.pages_of(s)
                assert row == pages + [0] * (t.shape[1] - len(pages))
    assert all(c > n_ops // 50 for c in counts.values()), counts
    for s in list(model.seqs):
        _check_against_model(pool, model, s, tol_db)
    pool.free(list(model.seqs))
    assert pool.stats().pages_free == N
    pool.check_invariants()


def test_stress_random_ops_exact():
    _stress("fp32", 10_000, seed=0)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_stress_random_ops_quantized_sqnr(kv_dtype):
    # Appends re-encode a page's older tokens when its amax grows. The floors are set on large
    # Gaussian samples; a sequence of a few tokens scatters below them (seed 1 measured e4m3
    # 30.77 dB, e5m2 24.21, fp4 19.36 against floors 31 / 25 / 20), so allow 2 dB of sampling
    # spread per sequence.
    _stress(kv_dtype, 1_000, seed=1, tol_db=SQNR_FLOOR_DB[kv_dtype] - 2.0)


# --- CUDA --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_on_cuda():
    pool = _pool("fp8_e4m3", num_pages=16, page_size=16, device="cuda")
    a = pool.allocate()[0]
    k, v = _kv(pool, 20)
    slots = pool.append(a, [x.cuda() for x in k], [x.cuda() for x in v])
    assert slots.is_cuda and pool.block_table([a]).is_cuda and pool.seq_lens([a]).is_cuda
    assert pool.block_table([a]).tolist() == [pool.pages_of(a)]
    assert sqnr_db(k[0].transpose(0, 1), pool.gather(0, a)[0].cpu()) > SQNR_FLOOR_DB["fp8_e4m3"]


def test_hidden_tokens_count_as_evicted_but_stay_stored():
    """A window evicted without moving tokens (eviction/runtime.py `_evict_window`): whole
    pages leave (`evict_pages`: dropped, the logical length kept), the tokens left between the
    sinks and the window are hidden (`hide`): evicted() counts both, dropped() the pages only,
    fork copies both, free forgets them."""
    pool = _pool(page_size=4)
    sid = pool.allocate()[0]
    pool.append(sid, *_kv(pool, 22))
    pool.evict_pages(sid, [1, 2])        # tokens 4..11
    pool.hide(sid, 3)                    # e.g. tokens 1..3 of page 0
    assert (pool.seq_len(sid), pool.logical_len(sid)) == (14, 22)
    assert (pool.evicted(sid), pool.dropped(sid)) == (11, 8)
    child = pool.fork(sid)
    assert (pool.evicted(child), pool.dropped(child)) == (11, 8)
    with pytest.raises(ValueError):
        pool.hide(sid, -1)
    pool.free([sid, child])
    assert pool.stats().pages_used == 0
    sid = pool.allocate()[0]
    assert pool.evicted(sid) == pool.dropped(sid) == 0
    pool.check_invariants()
