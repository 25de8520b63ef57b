"""Eviction on the device, with no host sync (EvictionRuntime._evict_front: eviction/front.py,
compaction.move_slots_exact), against the host path (EvictionRuntime.evict: move_tokens, which
reads counts): the same tokens kept, bit for bit, in every format that moves tokens exactly.
Both fill the holes below the budget from the tail, each in its own order, so the two are
compared by logical index."""

from __future__ import annotations

import pytest
import torch

from kvcompile.cache.compaction import moves_exactly, moves_on_device
from kvcompile.cache.formats import KVFormat
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.config import H2O, SinkWindow, SnapKV
from kvcompile.errors import UnsupportedShapeError
from kvcompile.eviction.runtime import _Book
from tests.eviction.test_compaction_formats import FORMATS, _formats, _raw, _runtime

H, D, P, L = 2, 16, 16, 45
EXACT = [f for f in FORMATS if moves_exactly(PagePool([LayerSpec(H, D, D, *_formats(*f))], 4,
                                                      P).k[0])]
# fp8 page scales: moved on the device too, re-encoding what a moved token's scale growth
# asks (compaction.move_slots_device), bit for bit as the host path (move_slots)
DEVICE = EXACT + [f for f in FORMATS if f not in EXACT and moves_on_device(
    PagePool([LayerSpec(H, D, D, *_formats(*f))], 4, P).k[0])]
POLICIES = [SinkWindow(2, 12), H2O(budget=14, recent=4, sinks=2),
            SnapKV(budget=14, window=4, kernel=3, per_head=True)]


def _setup(fmt, policy):
    pool = PagePool([LayerSpec(H, D, D, *_formats(*fmt))], 8, P)
    sid = pool.allocate()[0]
    pool.append(sid, [_raw(L, 0, True)], [_raw(L, 1, False)])
    rt = _runtime(pool, policy)
    book = _Book(0)
    g = torch.Generator().manual_seed(3)
    book.pos[0] = torch.arange(L).expand(H, L).clone()
    book.mass[0] = torch.rand(H, L, generator=g)
    book.obs[0] = torch.rand(H, 4, L, generator=g)
    return pool, sid, rt, book


def _by_position(pool, sid, pos):
    """[H, n, D] K and V of the kept tokens ordered by logical index, and those indices."""
    order = pos.argsort(-1)
    k, v = pool.gather(0, sid)
    take = order[..., None].expand(-1, -1, D)
    return torch.gather(k, 1, take), torch.gather(v, 1, take), pos.gather(1, order)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("fmt", DEVICE, ids=str)
def test_device_eviction_equals_host_eviction(fmt, policy):
    budget = policy.sinks + policy.window if isinstance(policy, SinkWindow) else policy.budget
    host = _setup(fmt, policy)
    host[2].evict(host[1], host[3])
    dev = _setup(fmt, policy)
    pool, sid, rt, book = dev
    parent = pool.fork(sid)        # a page shared with another sequence is copied first
    rt.books[parent] = book.copy()
    keep_parent = pool.gather(0, parent)
    with _no_sync():
        assert rt._evict_front(sid, book, budget)
    assert pool.seq_len(sid) == budget == host[0].seq_len(host[1])
    kd, vd, pd = _by_position(pool, sid, book.pos[0])
    kh, vh, ph = _by_position(host[0], host[1], host[3].pos[0])
    assert torch.equal(pd, ph), "a different choice of tokens"
    assert torch.equal(kd, kh) and torch.equal(vd, vh), "moved tokens changed"
    for b in (book, host[3]):      # the mass each kept token had follows it
        b.mass[0] = b.mass[0].gather(1, b.pos[0].argsort(-1))
    assert torch.equal(book.mass[0], host[3].mass[0])
    assert all(torch.equal(a, b) for a, b in zip(pool.gather(0, parent), keep_parent))
    pool.check_invariants()


@pytest.mark.parametrize("name,gran", [("fp4_e2m1", "page"), ("fp8_e4m3", "page"),
                                       ("int4", "channel")])
def test_residual_pages_take_the_host_path(name, gran, caplog):
    """Residual pages (bf16 rows assigned on the host): the host path, said once with the
    format's name, and move_slots_device refuses them by name."""
    from kvcompile.cache.compaction import move_slots_device

    fmt = next(f for f in FORMATS if f == (name, gran, True))
    pool, sid, rt, book = _setup(fmt, SinkWindow(2, 12))
    assert not moves_exactly(pool.k[0]) and not moves_on_device(pool.k[0])
    with caplog.at_level("WARNING", logger="kvcompile"):
        assert rt._evict_front(sid, book, 14) is False      # evict() (host) does it instead
        assert rt._evict_front(sid, book, 14) is False
    said = [r.getMessage() for r in caplog.records if "on the host path" in r.getMessage()]
    assert len(said) == 1 and f"{name}/{gran}" in said[0], said
    assert pool.seq_len(sid) == L
    with pytest.raises(UnsupportedShapeError, match="re-encode moved tokens; use move_tokens"):
        pool.compact_front(0, sid, torch.arange(14).expand(H, 14))
    one = torch.tensor([0])
    with pytest.raises(UnsupportedShapeError, match="residual rows .*use move_slots"):
        move_slots_device(pool.k[0], one, one, one)


class _no_sync:
    """Tensor -> host reads raise (as between CUDA-graph replays)."""

    NAMES = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(name):
            def f(*_a, **_k):
                raise AssertionError(f"host sync: Tensor.{name}")
            return f

        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("per_head", [False, True])
def test_device_eviction_of_kept_scores_equals_host(per_head):
    """SnapKV(hold=True) between decode steps: the slots of the steps stepped aside for rank
    as decoded tokens (above every kept score, newer above older), the rest by the kept
    scores; the device path keeps what the host path keeps, the scores follow their tokens,
    and no host sync happens."""
    from kvcompile.eviction import policies as Pol

    fmt = EXACT[0]
    policy = SnapKV(budget=14, window=4, kernel=3, per_head=per_head, hold=True)
    pend = 6   # the last 6 slots: decode steps stepped aside for (not in the book yet)

    def setup():
        pool, sid, rt, book = _setup(fmt, policy)
        book.mass.clear()
        book.obs.clear()
        g = torch.Generator().manual_seed(5)
        book.pos[0] = book.pos[0][:, :L - pend].clone()
        raw = torch.rand(1 if not per_head else H, L - pend, generator=g).expand(H, -1)
        book.score[0] = Pol.kept_rank(raw, book.pos[0], 0)
        book.pending = pend
        return pool, sid, rt, book

    host = setup()
    host[2].evict(host[1], host[3])
    pool, sid, rt, book = setup()
    with _no_sync():
        assert rt._evict_front(sid, book, 14)
    assert pool.seq_len(sid) == 14 == host[0].seq_len(host[1])
    _kd, _vd, pd = _by_position(pool, sid, book.pos[0])
    _kh, _vh, ph = _by_position(host[0], host[1], host[3].pos[0])
    assert torch.equal(pd, ph), "a different choice of tokens"
    # every pending (decoded) token is kept; the prompt tokens kept are the best-scored ones
    assert set(range(L - pend, L)) <= set(pd[0].tolist())
    raw0 = setup()[3].score[0]
    for h in range(H):
        best = raw0[h].argsort(descending=True)[:14 - pend].sort().values
        assert torch.equal(pd[h][:14 - pend], best), f"head {h}: not the best-scored tokens"
    for b in (book, host[3]):      # the kept score of each token followed it
        s = b.score[0].gather(1, b.pos[0].argsort(-1))
        want = torch.where(pd >= L - pend, Pol.decoded_scores(pd), raw0.gather(1, pd.clamp(
            max=L - pend - 1)))
        assert torch.equal(s, want)
    pool.check_invariants()


GROUPED = [f for f in DEVICE if f not in EXACT]


@pytest.mark.parametrize("max_cells", [4, None], ids=["exact", "spare"])
@pytest.mark.parametrize("fmt", GROUPED, ids=str)
def test_grouped_moves_on_the_device_equal_move_slots(fmt, max_cells):
    """compaction.move_slots_device against move_slots on page- and channel-scaled pages (fp8,
    fp4, int), bit for bit (every part of the whole pool): moves into pages whose parameters
    must change (a token 50x the page's values; its (page, head) is re-encoded whole), two
    moves into one (page, head), moves that need no change, and padding moves (a token onto
    itself, real=False) that must change nothing, also in a page another move changes; under
    a guard that refuses every host read, with max_cells at the distinct count and above it
    (None: one rank per move, the spare ones rewriting rank 0's cell)."""
    from kvcompile.cache.compaction import move_slots, move_slots_device

    def build():
        pool = PagePool([LayerSpec(H, D, D, *_formats(*fmt))], 8, 16)
        sid = pool.allocate()[0]
        g = torch.Generator().manual_seed(9)
        k = torch.randn(96, H, D, generator=g)
        k[80:] *= 50.0                         # the tail: 50x the front pages' values
        v = torch.randn(96, H, D, generator=g)
        v[80:] *= 50.0
        pool.append(sid, [k], [v])
        return pool, sid

    # token index -> slot through the sequence's pages (P 16: 6 pages)
    moves = [(80, 1, 0), (81, 2, 0), (88, 17, 1), (52, 36, 1), (95, 95, 0)]   # (src, dst, head)
    real = torch.tensor([True, True, True, True, False])
    host, hsid = build()
    dev, dsid = build()
    for pool, sid, fn in ((host, hsid, "host"), (dev, dsid, "device")):
        t = torch.tensor(pool._lookup([sid])[0].pages)
        src = torch.tensor([t[s // 16] * 16 + s % 16 for s, _d, _h in moves])
        dst = torch.tensor([t[d // 16] * 16 + d % 16 for _s, d, _h in moves])
        hd = torch.tensor([h for *_x, h in moves])
        for paged in (pool.k[0], pool.v[0]):
            if fn == "host":
                move_slots(paged, src[real], dst[real], hd[real])
            else:
                with _no_sync():
                    move_slots_device(paged, src, dst, hd, real, max_cells=max_cells)
    hp = torch.tensor(host._lookup([hsid])[0].pages)   # (the pages past the sequence's
    dp = torch.tensor(dev._lookup([dsid])[0].pages)    # hold whatever memory held)
    before = build()
    bp = torch.tensor(before[0]._lookup([before[1]])[0].pages)
    grew = ~_same(host.k[0].scale[hp], before[0].k[0].scale[bp])
    assert grew.any(), "no parameter changed: the re-encode branch is not exercised"
    for a, b in ((host.k[0], dev.k[0]), (host.v[0], dev.v[0])):
        for name, t in a.parts().items():
            u = getattr(b, name)
            if name in ("scale", "zero") and t.dim() == 1:     # (a tensor scale)
                assert torch.equal(t, u), name
                continue
            assert torch.equal(t[hp].view(torch.uint8), u[dp].view(torch.uint8)), name


def _same(a, b):
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


@pytest.mark.parametrize("fmt", GROUPED, ids=str)
def test_padding_moves_change_nothing(fmt):
    """Moves with real=False leave every byte of the pool as it was, even from a token 50x
    the destination page's values and from a NaN token: their values count in no group's
    statistics (scale, range, NaN), and a format that moves exactly (the pair's token-scaled
    V of int "channel") copies nothing."""
    from kvcompile.cache.compaction import move_slots_device

    pool = PagePool([LayerSpec(H, D, D, *_formats(*fmt))], 8, 16)
    sid = pool.allocate()[0]
    g = torch.Generator().manual_seed(4)
    k = torch.randn(96, H, D, generator=g)
    v = torch.randn(96, H, D, generator=g)
    for x in (k, v):
        x[80:] *= 50.0
        x[91, 1, 5] = float("nan")
    pool.append(sid, [k], [v])
    t = torch.tensor(pool._lookup([sid])[0].pages)
    moves = [(90, 3, 0), (91, 20, 1), (91, 33, 0)]          # (src, dst, head): 50x, NaN
    src = torch.tensor([t[s // 16] * 16 + s % 16 for s, _d, _h in moves])
    dst = torch.tensor([t[d // 16] * 16 + d % 16 for _s, d, _h in moves])
    hd = torch.tensor([h for *_x, h in moves])
    for paged in (pool.k[0], pool.v[0]):
        before = {n: p.clone() for n, p in paged.parts().items()}
        with _no_sync():
            move_slots_device(paged, src, dst, hd, torch.zeros(3, dtype=torch.bool))
        for n, p in paged.parts().items():
            assert torch.equal(p[t].view(torch.uint8), before[n][t].view(torch.uint8)), n



@pytest.mark.parametrize("policy", [SinkWindow(2, 12), H2O(budget=14, recent=4, sinks=2),
                                    SnapKV(budget=14, window=4, kernel=3, per_head=True)],
                         ids=lambda p: type(p).__name__)
def test_padded_sequence_compacts_in_slot_order(policy):
    """A left-padded sequence's first eviction (host path) drops the padding and compacts in
    slot order: every kept token keeps its value, the sinks (its first real tokens) land in
    slots [0, n) as the decode steps stepped aside for assume, and the book is no longer
    padded; heads may keep different sets (per-head SnapKV, H2O)."""
    start = 5
    pool, sid, rt, book = _setup(("fp32", "-", False), policy)
    book.start, book.padded = start, True
    before_k, before_v = pool.gather(0, sid)
    rt.evict(sid, book)
    assert not book.padded
    pos = book.pos[0]
    k, v = pool.gather(0, sid)
    for h in range(H):
        real = pos[h] >= 0
        assert bool((pos[h][real] >= start).all()), "padding kept"
        n = int(real.sum())
        assert bool(real[:n].all()), "a hole below the kept count"
        assert torch.equal(pos[h][:n], pos[h][:n].sort().values), "not in slot order"
        assert torch.equal(k[h, :n], before_k[h, pos[h][:n]])
        assert torch.equal(v[h, :n], before_v[h, pos[h][:n]])
        if not isinstance(policy, SnapKV):
            assert pos[h][:2].tolist() == [start, start + 1], "sinks not in slots [0, 2)"
    pool.check_invariants()


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("case", ["grow", "nan", "tiny"])
def test_fp8_cell_kernel_equals_the_pytorch_moves(name, case, monkeypatch):
    """`check_cell_kernel` under the interpreter (tests/gpu/test_move_cells_gpu.py on CUDA)."""
    check_cell_kernel(name, case, monkeypatch, "cpu")


def check_cell_kernel(name, case, monkeypatch, device):
    """kernels/move_cells.py (three launches; on by default on CUDA, where it passed) against
    compaction's PyTorch path on the same pools, bit for bit over every part: front.py-style
    compaction (the tail's kept tokens into the holes below the budget, per head its own
    choice, padding moves onto the last slot), with tail tokens up to 300x the front's (page
    scales grow, their pages are encoded again), a NaN source token, or tiny values near the
    subnormal range; several moves into one (page, head)."""
    from kvcompile.cache import compaction as C

    P_, budget, n = 8, 40, 64
    g = torch.Generator().manual_seed({"grow": 1, "nan": 2, "tiny": 3}[case])
    k = torch.randn(n, H, D, generator=g)
    v = torch.randn(n, H, D, generator=g)
    if case == "grow":
        k[budget:] *= 300.0
        v[budget:] *= 40.0
    elif case == "nan":
        k[50, 1, 3] = float("nan")
        v[57, 0, 0] = float("nan")
    else:
        k *= 1e-36
        v[:budget] *= 1e-6

    def build():
        pool = PagePool([LayerSpec(H, D, D, KVFormat(name, "page"), KVFormat(name, "page"))],
                        16, P_, device=device)
        sid = pool.allocate()[0]
        pool.append(sid, [k.to(device)], [v.to(device)])
        return pool, sid

    # per head: 24 holes below the budget (every other slot from 8), filled by 24 kept tail
    # tokens; head 1 takes other tails than head 0; two padding moves (last slot onto itself)
    holes = torch.arange(8, budget, 2)[:16]
    tails = [torch.arange(budget, n)[:16], torch.arange(n - 1, budget - 1, -1)[:16]]
    src = torch.cat([tails[0], tails[1], torch.tensor([n - 1, n - 1])])
    dst = torch.cat([holes, holes, torch.tensor([n - 1, n - 1])])
    hd = torch.cat([torch.zeros(16), torch.ones(16), torch.tensor([0, 1])]).long()
    real = torch.cat([torch.ones(32, dtype=torch.bool), torch.zeros(2, dtype=torch.bool)])
    pools = {}
    for use_kernel in (False, True):
        monkeypatch.setitem(C.CELL_KERNEL, device, use_kernel)
        pool, sid = build()
        t = torch.tensor(pool._lookup([sid])[0].pages)
        gs, gd = t[src // P_] * P_ + src % P_, t[dst // P_] * P_ + dst % P_
        # max_cells: the distinct (page, head) cells, padding's included (front.py's bound
        # counts the padding page too); 8 here (below the 10 there are) made ranks 8 and 9
        # collide with rank 7, which CUDA's scatter resolves differently from run to run
        cells = torch.unique(gd // P_ * H + hd).numel()
        assert cells == 10
        for paged in (pool.k[0], pool.v[0]):
            assert C._cell_kernel(paged) == use_kernel
            with _no_sync():
                C.move_slots_device(paged, gs.to(device), gd.to(device), hd.to(device),
                                    real.to(device), max_cells=cells)
        pools[use_kernel] = (pool, t)
    (ref, tr), (got, tg) = pools[False], pools[True]
    before, _ = build()
    tr, tg = tr.to(device), tg.to(device)
    grew = ~_same(ref.k[0].scale[tr], before.k[0].scale[tr])
    if case == "grow":
        assert grew.any(), "no page scale grew: the re-encode is not exercised"
    for a, b in ((ref.k[0], got.k[0]), (ref.v[0], got.v[0])):
        for part, x in a.parts().items():
            y = getattr(b, part)
            assert torch.equal(x[tr].view(torch.uint8), y[tg].view(torch.uint8)), part


def test_cell_kernel_takes_only_fp8_page_scales(monkeypatch):
    """Negative: kernels/move_cells.py refuses every other format (token or channel scales,
    fp4, int, 16-bit, residual rows) with a reason, and runs nowhere its switch is off."""
    from kvcompile.cache import compaction as C
    from kvcompile.kernels.move_cells import takes

    monkeypatch.setitem(C.CELL_KERNEL, "cpu", True)
    seen = set()
    for f in FORMATS:
        pool = PagePool([LayerSpec(H, D, D, *_formats(*f))], 4, 16)
        for paged in (pool.k[0], pool.v[0]):
            fp8_page = (paged.fmt.name.startswith("fp8") and paged.fmt.granularity == "page"
                        and not paged.fmt.residual)
            why = takes(paged)
            assert (why == "") == fp8_page, (f, paged.fmt, why)
            assert C._cell_kernel(paged) == fp8_page
            seen.add(fp8_page)
    assert seen == {True, False}
    monkeypatch.setitem(C.CELL_KERNEL, "cpu", False)
    pool = PagePool([LayerSpec(H, D, D, KVFormat("fp8_e4m3", "page"),
                               KVFormat("fp8_e4m3", "page"))], 4, 16)
    assert takes(pool.k[0]) == "" and not C._cell_kernel(pool.k[0])


def test_a_max_cells_below_the_distinct_cells_is_refused():
    """More destination (page, head) cells than max_cells would merge cells (moves landing in
    another cell's page): refused, not done wrong. Negative case of the bound front.py
    proves; at the distinct count the same moves go through."""
    from kvcompile.cache.compaction import move_slots_device

    pool = PagePool([LayerSpec(H, D, D, KVFormat("fp8_e4m3", "page"),
                               KVFormat("fp8_e4m3", "page"))], 8, 16)
    sid = pool.allocate()[0]
    pool.append(sid, [torch.randn(64, H, D)], [torch.randn(64, H, D)])
    t = torch.tensor(pool._lookup([sid])[0].pages)
    s, d = torch.tensor([60, 61, 62]), torch.tensor([1, 17, 33])   # into 3 pages
    src, dst = t[s // 16] * 16 + s % 16, t[d // 16] * 16 + d % 16
    hd = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="more destination cells than max_cells"):
        move_slots_device(pool.k[0], src, dst, hd, max_cells=2)
    move_slots_device(pool.k[0], src, dst, hd, max_cells=3)
    pool.check_invariants()


def test_plans_of_several_layers_at_once_equal_one_a_layer():
    """plan_moves over [Ly, M] rows (front.py plans every layer's moves with one sort and
    scan) gives each layer what planning it alone gives, and `torch.unique`'s cells: rows
    with different distinct counts, a row with one cell, max_cells at the largest count."""
    from kvcompile.cache.compaction import plan_at, plan_moves

    g = torch.Generator().manual_seed(11)
    P_, H_, M = 8, 2, 24
    dst = torch.stack([torch.randint(0, 64, (M,), generator=g),
                       torch.randint(0, 16, (M,), generator=g),
                       torch.full((M,), 5)])
    src = torch.randint(0, 200, (3, M), generator=g)
    heads = torch.randint(0, H_, (M,), generator=g)
    real = torch.rand(3, M, generator=g) > 0.2
    cells = dst // P_ * H_ + heads
    S = max(torch.unique(c).numel() for c in cells)
    both = plan_moves(src, dst, heads, real, P_, H_, max_cells=S)
    for i in range(3):
        one = plan_moves(src[i], dst[i], heads, real[i], P_, H_, max_cells=S)
        got = plan_at(both, i)
        assert one.keys() == got.keys()
        for k, v in one.items():
            assert (torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k]), k
        uc, inv = torch.unique(cells[i], return_inverse=True)
        assert torch.equal(got["seg"], inv) and int(got["last"]) == uc.numel() - 1
        n = uc.numel()
        assert torch.equal(got["pg"][:n] * H_ + got["hd"][:n], uc)
