"""PagePool eviction methods: per-head token moves in every format, copy-on-write, dropping a
tail or whole pages, logical lengths, and errors that leave the pool untouched."""

from __future__ import annotations

import pytest
import torch

from kvcompile.cache.formats import resolve_format
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.errors import CacheStateError
from kvcompile.testing import SQNR_FLOOR_DB, sqnr_db

H, D, P = 2, 16, 4
FORMATS = [("fp32", "page"), ("bf16", "page"), ("fp8_e4m3", "token"), ("fp8_e4m3", "page"),
           ("fp8_e5m2", "page"), ("fp4_e2m1", "page"), ("fp4_e2m1", "token")]


def _pool(kv_dtype="fp32", gran="page", pages=32):
    fmt = resolve_format(kv_dtype, torch.float32, gran)
    return PagePool([LayerSpec(H, D, D, fmt, fmt)], pages, P)


def _filled(pool, n=22, seed=0):
    g = torch.Generator().manual_seed(seed)
    sid = pool.allocate()[0]
    k = torch.randn(n, H, D, generator=g)
    v = torch.randn(n, H, D, generator=g)
    pool.append(sid, [k], [v])
    return sid


def _moves(keep):
    """Hole filling as the runtime does it: kept slots >= n move into holes below n."""
    n = int(keep.sum(-1).max())
    src, dst, hs = [], [], []
    for h in range(keep.shape[0]):
        holes = (~keep[h, :n]).nonzero()[:, 0]
        movers = keep[h, n:].nonzero()[:, 0] + n
        src.append(movers)
        dst.append(holes[:movers.numel()])
        hs.append(torch.full((movers.numel(),), h))
    return n, torch.cat(src), torch.cat(dst), torch.cat(hs)


@pytest.mark.parametrize("kv_dtype,gran", FORMATS)
def test_move_tokens_per_head(kv_dtype, gran):
    pool = _pool(kv_dtype, gran)
    sid = _filled(pool)
    k0, v0 = pool.gather(0, sid)                                     # [H, L, D]
    g = torch.Generator().manual_seed(1)
    keep = torch.zeros(H, 22, dtype=torch.bool)
    for h in range(H):
        keep[h, torch.randperm(22, generator=g)[:9]] = True
    n, src, dst, hs = _moves(keep)
    assert src.numel() > 0
    pool.move_tokens(0, sid, src, dst, hs)
    k1, v1 = pool.gather(0, sid)
    moved = torch.zeros(H, 22, dtype=torch.bool)
    moved[hs, dst] = True
    stay = keep.clone()
    stay[:, n:] = False
    exact = kv_dtype in ("fp32", "bf16") or gran == "token"
    for new, old in ((k1, k0), (v1, v0)):
        if exact:
            assert torch.equal(new[hs, dst], old[hs, src])
        else:  # moved tokens are quantized again with the destination page's scale
            floor = SQNR_FLOOR_DB[kv_dtype] - 3
            assert sqnr_db(old[hs, src], new[hs, dst]) > floor
        # tokens that did not move keep their decoded values (scales grow by powers of 2)
        torch.testing.assert_close(new[stay & ~moved], old[stay & ~moved], atol=1e-6, rtol=0)
    pool.check_invariants()


def test_move_tokens_copies_shared_pages_first():
    pool = _pool()
    sid = _filled(pool, 16)
    child = pool.fork(sid)
    k0, _ = pool.gather(0, sid)
    free0 = len(pool._free)
    pool.move_tokens(0, child, torch.tensor([12, 13]), torch.tensor([1, 2]),
                     torch.tensor([0, 1]))
    k_parent, _ = pool.gather(0, sid)
    k_child, _ = pool.gather(0, child)
    assert torch.equal(k_parent, k0)                                  # the sibling is untouched
    assert torch.equal(k_child[0, 1], k0[0, 12]) and torch.equal(k_child[1, 2], k0[1, 13])
    assert len(pool._free) == free0 - 1                               # page 0 copied
    pool.check_invariants()


def test_evict_tail_keeps_logical_length_and_frees_pages():
    pool = _pool()
    sid = _filled(pool, 22)
    used = pool.stats().pages_used
    pool.evict_tail(sid, 9)
    assert pool.seq_len(sid) == 9 and pool.logical_len(sid) == 22 and pool.evicted(sid) == 13
    assert pool.stats().pages_used == used - 3
    child = pool.fork(sid)
    assert pool.logical_len(child) == 22                              # forks inherit it
    slots = pool.reserve([sid], 2)
    assert pool.logical_len(sid) == 24 and slots.numel() == 2
    pool.free([sid, child])
    assert pool.stats().pages_used == 0
    pool.check_invariants()


def test_evict_pages_drops_middle_pages_in_every_layer():
    fmt = resolve_format("fp32", torch.float32)
    pool = PagePool([LayerSpec(H, D, D, fmt, fmt)] * 2, 32, P)
    sid = pool.allocate()[0]
    ks = [torch.randn(18, H, D) for _ in range(2)]
    pool.append(sid, ks, [torch.randn(18, H, D) for _ in range(2)])
    pages = pool.pages_of(sid)
    pool.evict_pages(sid, [1, 2])
    assert pool.pages_of(sid) == [pages[0]] + pages[3:]
    assert pool.seq_len(sid) == 10 and pool.logical_len(sid) == 18
    keep = torch.cat([torch.arange(0, 4), torch.arange(12, 18)])
    for layer in range(2):
        k, _ = pool.gather(layer, sid)
        assert torch.equal(k, ks[layer][keep].transpose(0, 1))
    assert pool.block_table([sid])[0].tolist()[:3] == [pages[0], pages[3], pages[4]]
    pool.check_invariants()


def test_eviction_errors_leave_pool_untouched():
    pool = _pool()
    sid = _filled(pool, 10)
    before = (pool.pages_of(sid), pool.seq_len(sid), pool.logical_len(sid))
    with pytest.raises(CacheStateError):
        pool.evict_pages(sid, [2])                                    # the partial last page
    with pytest.raises(CacheStateError):
        pool.move_tokens(0, sid, torch.tensor([10]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError):
        pool.evict_tail(sid, 11)
    assert (pool.pages_of(sid), pool.seq_len(sid), pool.logical_len(sid)) == before
    pool.check_invariants()
