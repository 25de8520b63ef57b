"""The full-precision residual page: a partly filled page stays in bf16 until the write that
fills it quantizes it whole (bit-identical to writing the page at once); rows are per page,
copied on copy-on-write and freed with the page (PagePool)."""

from __future__ import annotations

import pytest
import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.cache.pool import LayerSpec, PagePool

CASES = [("int4", "channel"), ("int2", "token"), ("int4", "page"), ("fp8_e4m3", "page"),
         ("fp8_e4m3", "channel"), ("fp4_e2m1", "channel"), ("fp4_e2m1", "page")]


def _x(n, h=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g)
    x[..., 5] += 9.0
    return x


def _state(t):
    return [getattr(t, k).view(torch.uint8).clone() for k in ("data", "scale", "zero", "micro")
            if getattr(t, k) is not None]


@pytest.mark.parametrize("name, gran", CASES)
def test_token_by_token_equals_whole_page(name, gran):
    N, H, P, D = 3, 2, 16, 32
    x = _x(N * P)
    xb = x.bfloat16().float()                      # tokens pass through bf16 first
    res = KVFormat(name, gran, residual=True).allocate(N, H, P, D)
    whole = KVFormat(name, gran).allocate(N, H, P, D)
    whole.write(torch.arange(N * P), xb)
    n = N * P - 5                                  # the last page stays partly filled
    for o in range(P):                             # a decode batch: one token per page per step
        slots = torch.arange(N) * P + o
        slots = slots[slots < n]
        res.write(slots, x[slots])
        assert res.residual_pages() == (list(range(N)) if o < P - 1 else [N - 1])
    # full pages: exactly the bytes of a whole-page write
    for a, b in zip(_state(res), _state(whole)):
        assert torch.equal(a[:N - 1], b[:N - 1])
    # the partial page reads back its tokens in bf16
    last = res.read(torch.tensor([N - 1]))[0]                          # [H, P, D]
    k = n - (N - 1) * P
    assert torch.equal(last[:, :k], xb[(N - 1) * P:n].transpose(0, 1))


@pytest.mark.parametrize("name, gran", CASES[:3])
def test_chunked_writes_and_rows(name, gran):
    N, H, P, D = 4, 2, 16, 32
    x = _x(N * P, seed=1)
    t = KVFormat(name, gran, residual=True).allocate(N, H, P, D)
    t.write(torch.arange(0, 20), x[:20])           # page 0 full, page 1 partial
    assert t.residual_pages() == [1]
    t.write(torch.arange(20, 40), x[20:40])        # page 1 fills, page 2 partial
    assert t.residual_pages() == [2]
    t.write(torch.arange(40, 64), x[40:64])        # everything full
    assert t.residual_pages() == []
    whole = KVFormat(name, gran).allocate(N, H, P, D)
    whole.write(torch.arange(N * P), x.bfloat16().float())
    assert torch.equal(t.read(torch.arange(N)), whole.read(torch.arange(N)))
    assert t.res_data.shape[0] >= 1 and (t.res_slot == -1).all()


def test_rows_reused_and_dropped():
    t = KVFormat("int4", "channel", residual=True).allocate(8, 1, 16, 32)
    x = _x(16, h=1)
    for p in range(6):
        t.write(torch.tensor([p * 16]), x[:1])
    assert t.residual_pages() == list(range(6))
    cap = t.res_data.shape[0]
    t.drop_residual([0, 2, 4])
    assert t.residual_pages() == [1, 3, 5]
    for p in (6, 7, 0):
        t.write(torch.tensor([p * 16 + 0]), x[:1])
    assert t.res_data.shape[0] == cap               # freed rows were reused
    assert int((t.res_slot >= 0).sum()) == 6


def test_truncated_page_continues_in_bf16():
    # A page quantized earlier and then cut (HF crop) keeps its surviving tokens: they move to
    # a residual row (decoded), and the page is quantized again when it fills.
    P = 16
    t = KVFormat("int4", "channel", residual=True).allocate(2, 2, P, 32)
    x = _x(P)
    t.write(torch.arange(P), x)                    # quantized whole
    decoded = t.read(torch.tensor([0]))[0, :, :8].clone()
    t.write(torch.arange(8, 12), x[8:12] * 2)      # continue after a crop to 8 tokens
    assert t.residual_pages() == [0]
    now = t.read(torch.tensor([0]))[0]
    assert torch.equal(now[:, :8], decoded.bfloat16().float())
    assert torch.equal(now[:, 8:12], (x[8:12] * 2).transpose(0, 1).bfloat16().float())


def test_copy_pages_copies_rows():
    t = KVFormat("fp8_e4m3", "page", residual=True).allocate(4, 2, 16, 32)
    x = _x(8)
    t.write(torch.arange(5), x[:5])                # page 0 partial
    t.copy_pages([0], [3])                         # copy-on-write of a shared partial page
    assert t.residual_pages() == [0, 3]
    t.write(torch.arange(48 + 5, 48 + 8), x[5:8] * 3)
    t.write(torch.arange(5, 8), x[5:8])
    a, b = t.read(torch.tensor([0, 3]))
    assert torch.equal(a[:, :5], b[:, :5]) and not torch.equal(a[:, 5:8], b[:, 5:8])


def test_pool_frees_rows_with_pages():
    spec = LayerSpec(2, 32, 32, KVFormat("int4", "channel", residual=True),
                     KVFormat("int2", "token", residual=True))
    pool = PagePool([spec], num_pages=8, page_size=16)
    a = pool.allocate()[0]
    slots = pool.reserve([a], 20)
    pool.write(0, slots, _x(20), _x(20, seed=3))
    b = pool.fork(a)
    slots = pool.reserve([b], 1)                   # copy-on-write of the partial page
    pool.write(0, slots, _x(1, seed=4), _x(1, seed=5))
    assert len(pool.k[0].residual_pages()) == 2
    ka, _ = pool.gather(0, a)
    kb, _ = pool.gather(0, b)
    assert torch.equal(ka[:, :20], kb[:, :20])
    pool.free([b])
    assert len(pool.k[0].residual_pages()) == 1 and len(pool.v[0].residual_pages()) == 1
    pool.truncate(a, 16)                           # the partial page is released
    assert pool.k[0].residual_pages() == [] and pool.v[0].residual_pages() == []
    pool.check_invariants()
    assert pool.stats().bytes_total == sum(t.nbytes() for t in pool.k + pool.v)
