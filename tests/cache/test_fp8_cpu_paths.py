"""The CPU's fast fp8 paths give the bytes and values of the general ones: the integer-op decode
(fp8.fp8_to_float / fp8_widen, against torch's own cast), the reference attention's page
gather (dense._gather), and the one-token page-scale append (PagedTensor._append_fp8)."""

import math

import pytest
import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.cache.fp8 import (
    fp8_decode,
    fp8_to_float,
    fp8_widen,
    grow_page_scale,
)
from kvcompile.cache.paged import PagedTensor, _as_fp32, _grown_scale
from kvcompile.kernels.dense import _gather
from kvcompile.kernels.reference import gather_pages


def _same_bits(a, b):
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_to_float_every_code(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(4, 8, 8)
    ref = codes.float()
    got = fp8_to_float(codes)
    same = (ref.view(torch.int32) == got.view(torch.int32)) | (ref.isnan() & got.isnan())
    assert got.shape == codes.shape and bool(same.all())
    scale = torch.rand(4, 1, 1) * 3
    assert torch.equal(fp8_decode(codes, scale).nan_to_num(7.0), (ref * scale).nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_widen_with_denormals_flushed(dtype):
    """With torch.set_flush_denormal(True) the E4M3 subnormal codes would read as 0 through
    the placed-bits route: the cast is used there, the values stay torch's."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        w, factor = fp8_widen(codes)
        got = w.float() * factor
        ref = codes.float()
    finally:
        torch.set_flush_denormal(False)
    # (a flushed fp32 subnormal compares as 0 either way: E5M2's smallest codes are fp16
    # subnormals, widened exactly; compare what the flush leaves)
    assert _same_bits(got, ref) or dtype == torch.float8_e5m2
    assert bool(((got == ref) | (got.isnan() & ref.isnan())).all())


@pytest.mark.parametrize("gran", ["page", "token", "tensor"])
@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_reference_gather_equals_read(name, gran, big):
    """dense._gather (the CPU decode's page gather: scale folded, heads-first layout) gives
    PagedTensor.read's values bit for bit: NaN codes, scales >= 2^8 (where 2^120 is not folded
    into an fp32 scale) and rows of one length gathered together."""
    fmt = KVFormat(name, gran)
    H, D, P, N = 3, 16, 8, 9
    t = fmt.allocate(N, H, P, D)
    g = torch.Generator().manual_seed(int(big) + len(gran))
    x = torch.randn(N * P, H, D, generator=g) * (1e7 if big else 1.0)
    x[5, 1, 2] = float("nan")
    t.write(torch.arange(N * P), x)
    if big and gran != "tensor":
        assert bool(t.scale.amax() >= 2.0 ** 8)
    tables = torch.cat([torch.zeros(1, dtype=torch.long),   # page 0 (its token 5: NaN) first
                        1 + torch.randperm(N - 1, generator=g)[:7]]).view(2, 4)
    total = 4 * P - 3
    got = _gather(t, tables.reshape(-1), 2, total, torch.float32)
    for b in range(2):
        want = gather_pages(t, tables[b], total)
        assert _same_bits(got[b].contiguous(), want.contiguous()), (name, gran, big, b)
    assert bool(got[0, 1, 5].isnan().any()) and int(got.isnan().sum()) == 1


def _appends(g, H, D, steps):
    """Tokens of a decode: mostly Gaussian, some a page's first, some larger (the page scale
    grows), some zero (left padding) or holding NaN."""
    out = []
    for i in range(steps):
        x = torch.randn(1, H, D, generator=g)
        r = i % 9
        if r == 3:
            x *= 8.0
        elif r == 5:
            x.zero_()
        elif r == 6:
            x[0, 1, 2] = float("nan")
        elif r == 7:   # codes that round to 0 under the page's scale: not "earlier values"
            x *= 1e-6
        elif r == 8:
            x[0, 0, 5] = float("inf")
            x[0, 2, 1] = float("-inf")
        out.append(x)
    return out


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_one_token_append_equals_general_path(name, rows, monkeypatch):
    fmt = KVFormat(name, "page")
    H, D, P, N = 3, 16, 8, 6
    fast, slow = fmt.allocate(N, H, P, D), fmt.allocate(N, H, P, D)
    for t in (fast, slow):
        t.data.view(torch.uint8).fill_(0x7F)   # unwritten slots: NaN codes
    g = torch.Generator().manual_seed(len(name))
    taken = {"fast": 0, "general": 0}
    # rows=1: one token per write (PagedTensor._write_one); rows=2: a token per page of two
    # (PagedTensor._append_fp8); `slow` always takes the general path
    real = PagedTensor._write_one if rows == 1 else PagedTensor._append_fp8

    def counted(self, *args):
        ok = self is fast and real(self, *args)
        taken["fast" if ok else "general"] += self is fast
        return ok

    monkeypatch.setattr(PagedTensor, "_write_one" if rows == 1 else "_append_fp8", counted)
    if rows == 1:
        monkeypatch.setattr(PagedTensor, "_append_fp8", lambda self, *a: False)
    # a zero prefix (padding) then tokens one at a time; two sequences: rows of one step
    pad = torch.zeros(3, H, D)
    for t in (fast, slow):
        t.write(torch.arange(3), pad)
        t.write(torch.arange(3) + 3 * P, pad)
    xs = _appends(g, H, D, 2 * (P * 3 - 3))
    taken.update(fast=0, general=0)   # (the prefix: three tokens of a page, the general path)
    grown = 0
    for i in range(0, len(xs), 2):
        n = 3 + i // 2
        slots = torch.tensor([n, 3 * P + n])[:rows]
        x = torch.cat(xs[i:i + 2])[:rows]
        before = slow.scale[slots // P].clone()
        fast.write(slots, x)
        slow.write(slots, x)
        # a page scale that grows over earlier tokens' values: they are re-encoded
        grown += int(bool(((slow.scale[slots // P] > before) & (n % P > 0)).any()))
        valid = torch.cat([torch.arange(n + 1), 3 * P + torch.arange(n + 1)][:rows])
        pg, off = valid // P, valid % P
        assert torch.equal(fast.data[pg, :, off].view(torch.uint8),
                           slow.data[pg, :, off].view(torch.uint8)), f"codes after token {n}"
        assert torch.equal(fast.scale[pg], slow.scale[pg]), f"scales after token {n}"
    # every one-token write took the short path, scale growths included
    assert taken["fast"] == len(xs) // 2 and taken["general"] == 0 and grown > 3, (taken, grown)
    if rows == 2:  # two tokens of one page in one write: the general path
        before = taken["general"]
        fast.write(torch.tensor([P * 5, P * 5 + 1]), torch.randn(2, H, D, generator=g))
        assert taken["general"] == before + 1


def test_python_scale_arithmetic_equals_torch():
    """The one-token append decides page scales on Python floats: amax / divisor rounded to
    fp32 and the power-of-two growth give torch's fp32 results bit for bit, extremes included."""
    g = torch.Generator().manual_seed(3)
    mant = torch.rand(4000, generator=g) + 0.5
    expo = torch.randint(-140, 128, (4000,), generator=g)
    amax = torch.ldexp(mant, expo).float()
    amax = amax[torch.isfinite(amax)]
    for div in (448.0, 57344.0, 6.0 * 448.0):
        want = amax / div
        got = torch.tensor(_as_fp32([v / div for v in amax.tolist()]), dtype=torch.float32)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), div
    s = torch.ldexp(torch.rand(3000, generator=g) + 0.5,
                    torch.randint(-126, 120, (3000,), generator=g)).float()
    c = s * torch.ldexp(torch.rand(3000, generator=g) + 0.5,
                        torch.randint(0, 12, (3000,), generator=g)).float()
    c = torch.where(c > s, c, s * 2)       # _grown_scale is only asked where cover > scale
    c = torch.cat([c, torch.tensor([3.0e38])])
    s = torch.cat([s, torch.tensor([2.0 ** 119])])   # grows past fp32's range: inf, as torch
    want = grow_page_scale(s, c)
    got = torch.tensor([_grown_scale(a, b) for a, b in zip(s.tolist(), c.tolist())],
                       dtype=torch.float32)
    assert torch.equal(got, want) and got[-1] == math.inf


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_one_token_append_with_nan_codes_among_earlier(name):
    """A page whose earlier tokens hold NaN codes (and otherwise only zeros): whether they had
    finite values is looked at exactly, not read from the largest code; the scale and bytes
    are the general path's."""
    fmt = KVFormat(name, "page")
    H, D, P = 2, 8, 8
    fast, slow = fmt.allocate(2, H, P, D), fmt.allocate(2, H, P, D)
    first = torch.zeros(2, H, D)
    first[0, 0, 3] = float("nan")           # head 0: NaN and zeros only; head 1: zeros
    first[1, 1, 2] = 0.5                    # head 1 also has a finite value
    for t in (fast, slow):
        t.write(torch.arange(2), first)
    x = torch.randn(1, H, D) * 3
    fast.write(torch.tensor([2]), x)                         # the one-token path
    slow._write_grouped(torch.tensor([0]), torch.tensor([2]), x.float())
    assert torch.equal(fast.scale[0], slow.scale[0])
    assert torch.equal(fast.data[0, :, :3].view(torch.uint8), slow.data[0, :, :3].view(torch.uint8))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_gather_unwritten_tail_and_huge_scales(name, monkeypatch):
    """dense._gather's numpy widening (`_fp8_rows_host`): NaN codes in the unwritten rest of the
    last page neither reach the result nor trigger the NaN repair (only the written tokens
    are looked at); a scale whose product with E4M3's 2^8 leaves fp32 is not folded; a NaN
    code among the written tokens is still NaN (the negative case)."""
    from kvcompile.kernels import dense

    fmt = KVFormat(name, "page")
    H, D, P, N = 2, 16, 8, 4
    t = fmt.allocate(N, H, P, D)
    t.data.view(torch.uint8).fill_(0x7F)   # unwritten slots: NaN codes
    g = torch.Generator().manual_seed(3)
    total = 3 * P - 2
    t.write(torch.arange(total), torch.randn(total, H, D, generator=g))
    t.scale[1, 0] = 2.0e36   # x 2^8 overflows fp32: unfolded (codes * 2^8 first)
    pages = torch.tensor([0, 1, 2])
    repairs = {"n": 0}
    real_and = dense.np.bitwise_and

    def counting_and(a, b, *args, **kw):
        out = real_and(a, b, *args, **kw)
        repairs["n"] += b == 0x7F and bool((out == 0x7F).any())
        return out

    monkeypatch.setattr(dense.np, "bitwise_and", counting_and)
    got = _gather(t, pages, 1, total, torch.float32)
    want = gather_pages(t, pages, total)
    assert _same_bits(got[0].contiguous(), want.contiguous())
    assert not bool(got.isnan().any()) and bool(got[0, 0, P:2 * P].abs().max() > 1e30)
    assert repairs["n"] == 0
    t.data[2, 1, 3].view(torch.uint8)[4] = 0x7F   # a written token's NaN code
    got = _gather(t, pages, 1, total, torch.float32)
    assert bool(got[0, 1, 2 * P + 3, 4].isnan()) and int(got.isnan().sum()) == 1
    assert repairs["n"] == (name == "fp8_e4m3")   # (E5M2's NaN codes widen as NaN)
    assert _same_bits(got[0].contiguous(), gather_pages(t, pages, total).contiguous())


def _write_counting_kept(monkeypatch):
    """{"kept": one-token writes stored by the kept fact, "asked": those that looked at it}."""
    seen = {"kept": 0, "asked": 0}
    real = PagedTensor._fp8_token_kept

    def counted(self, *args):
        ok = real(self, *args)
        seen["asked"] += 1
        seen["kept"] += ok
        return ok

    monkeypatch.setattr(PagedTensor, "_fp8_token_kept", counted)
    return seen


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_one_token_write_by_kept_fact(name, monkeypatch):
    """Tokens written one at a time into a page take the kept fact (no scale or earlier-code
    read) where no scale grows, and store the general path's bytes; a token that grows a
    scale, one holding NaN / Inf and a zero token (no kept fact after it) take the full
    decision."""
    fmt = KVFormat(name, "page")
    H, D, P = 3, 16, 16
    fast, slow = fmt.allocate(3, H, P, D), fmt.allocate(3, H, P, D)
    seen = _write_counting_kept(monkeypatch)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(1, H, D, generator=g) * (4.0 if i % P == 0 else 1.0) for i in range(2 * P)]
    xs[5] = xs[5] * 64.0                  # grows every head's scale: the fact's screen refuses
    xs[9] = xs[9].clone()
    xs[9][0, 1, 3] = float("nan")         # not kept: the full path (and no fact after it)
    xs[P + 4] = torch.zeros(1, H, D)     # second page: zeros keep the fact (had stays true)
    for i, x in enumerate(xs):
        fast.write(torch.tensor([i]), x)
        slow._write_grouped(torch.tensor([i // P]), torch.tensor([i % P]), x.float())
        assert torch.equal(fast.scale[:2], slow.scale[:2]), i
        valid = torch.arange(i + 1)
        assert torch.equal(fast.data[valid // P, :, valid % P].view(torch.uint8),
                           slow.data[valid // P, :, valid % P].view(torch.uint8)), i
    # kept: offsets 1..15 of both pages but token 5 (screen), 9 (NaN) and 10 (no fact)
    assert seen == {"kept": 2 * (P - 1) - 3, "asked": 2 * (P - 1)}, seen


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("writer", ["scale", "codes", "general", "grow"])
def test_kept_fact_not_used_after_another_writer(name, writer, monkeypatch):
    """The negative case: after another writer changes the page (its scale set by torch, its
    earlier codes zeroed, its tokens 1 and 2 written again by the general path, the pool's
    growth that replaces the parts), the next one-token write at the kept offset does not use
    the kept fact: it stores what the general path stores under the changed page. (With a
    stale fact the scale would be the old one: the bytes would differ.)"""
    from kvcompile.cache.sizing import grow_paged

    fmt = KVFormat(name, "page")
    H, D, P = 2, 16, 16
    fast, slow = fmt.allocate(2, H, P, D), fmt.allocate(2, H, P, D)
    seen = _write_counting_kept(monkeypatch)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(1, H, D, generator=g) * (4.0 if i == 0 else 1.0) for i in range(6)]
    for i in range(3):
        fast.write(torch.tensor([i]), xs[i])
        slow._write_grouped(torch.tensor([0]), torch.tensor([i]), xs[i].float())
    assert seen["kept"] == 2 and fast.__dict__["_views"]["fp8_fact"][:2] == (0, 3)
    n = 3
    for t in (fast, slow):
        if writer == "scale":      # a smaller scale: the next token grows it
            t.scale[0] = t.scale[0] / 16.0
        elif writer == "codes":    # no earlier value: the next token sets a fresh scale
            t.data[0, :, :3] = 0.0
        elif writer == "general":  # tokens 1, 2 again, larger: the page's scale grows
            t._write_grouped(torch.tensor([0, 0]), torch.tensor([1, 2]),
                             torch.cat(xs[3:5]) * 32.0)
        else:                      # a fresh, larger allocation with the pages copied
            grow_paged(t, 4)
    if writer == "grow":
        assert fast.__dict__.get("_views", {}).get("fp8_fact") is None
    else:   # (the fact is still there: only the versions tell it is stale)
        assert fast.__dict__["_views"]["fp8_fact"][:2] == (0, 3)
    before = seen["kept"]
    fast.write(torch.tensor([n]), xs[5])
    slow._write_grouped(torch.tensor([0]), torch.tensor([n]), xs[5].float())
    assert seen["kept"] == before, "a stale fact was used"
    assert torch.equal(fast.scale[0], slow.scale[0])
    assert torch.equal(fast.data[0, :, :n + 1].view(torch.uint8),
                       slow.data[0, :, :n + 1].view(torch.uint8))
    # and the fact is kept again from there (the next token takes it)
    fast.write(torch.tensor([n + 1]), xs[5] * 0.5)
    assert seen["kept"] == before + 1


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_rows_widened_in_place_equal_gathered(name):
    """`_fp8_rows_host` with `start` (a row whose pages are one run: the codes widened in place,
    the NaN screen over the whole block) gives the gathered route's values bit for bit: no NaN,
    NaN codes (both signs) only in the unwritten rest of the last page (not in the result),
    a page scale whose product with E4M3's 2^8 leaves fp32, and a written NaN code (the
    negative case: NaN in the result, exactly there)."""
    from kvcompile.kernels.dense import _fp8_rows_host, _page_rows

    fmt = KVFormat(name, "page")
    H, D, P, N = 3, 16, 8, 7
    kt, vt = fmt.allocate(N, H, P, D), fmt.allocate(N, H, P, D)
    g = torch.Generator().manual_seed(11)
    start, n, total = 2, 4, 4 * P - 3
    for t in (kt, vt):
        t.data.view(torch.uint8).fill_(0x11)
        t.write(torch.arange(start * P, start * P + total), torch.randn(total, H, D, generator=g))
    rows = _page_rows(torch.arange(start, start + n), 1, H)

    def both():
        x, sc = _fp8_rows_host((kt, vt), rows, 1, n, total, {}, start)
        got = (x * sc).view(2, H, n * P, D)[:, :, :total]
        x, sc = _fp8_rows_host((kt, vt), rows, 1, n, total)
        want = (x * sc).view(2, H, n * P, D)[:, :, :total]
        assert _same_bits(got.contiguous(), want.contiguous())
        return got

    assert not bool(both().isnan().any())
    kept = kt.scale[start + 1, 0].clone()
    kt.scale[start + 1, 0] = 2.0 ** 120   # E4M3: scale * 2^8 leaves fp32 (the factor into x)
    assert bool(both().isfinite().any())
    kt.scale[start + 1, 0] = kept
    last = start + n - 1
    kt.data[last, 0, P - 1].view(torch.uint8)[3] = 0xFF    # the unwritten rest: not read
    vt.data[last, 2, P - 2].view(torch.uint8)[0] = 0x7F
    assert not bool(both().isnan().any())
    vt.data[start + 1, 1, 2].view(torch.uint8)[5] = 0xFF   # a written token's NaN code
    got = both()
    assert int(got.isnan().sum()) == 1 and bool(got[1, 1, P + 2, 5].isnan())


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_kv_tokens_cast_together_by_kept_facts(name):
    """PagedTensor.write_tokens_kept (a layer's K and V by their kept facts, one fp8 cast)
    stores the general path's bytes; where V's fact is stale (V's scale set by torch), a
    value passes the screen, or no fact is kept it writes nothing and says so (False)."""
    fmt = KVFormat(name, "page")
    H, D, P = 3, 16, 8
    kt, vt = fmt.allocate(2, H, P, D), fmt.allocate(2, H, P, D)
    ks, vs = fmt.allocate(2, H, P, D), fmt.allocate(2, H, P, D)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(2, H, D, generator=g) * (4.0 if i == 0 else 1.0) for i in range(P)]
    scratch, kept = {}, 0

    def general(i, x):
        for t, slow in ((kt, ks), (vt, vs)):
            slow._write_grouped(torch.tensor([0]), torch.tensor([i]), x[None, 0 if t is kt else 1])

    for i, x in enumerate(xs):
        ok = i > 0 and PagedTensor.write_tokens_kept(
            (kt, vt), 0, i, (x[0].numpy(), x[1].numpy()), scratch)
        kept += ok
        if not ok:
            kt.write(torch.tensor([i]), x[None, 0])
            vt.write(torch.tensor([i]), x[None, 1])
        general(i, x)
        for t, slow in ((kt, ks), (vt, vs)):
            assert torch.equal(t.scale[0], slow.scale[0]), i
            assert torch.equal(t.data[0, :, :i + 1].view(torch.uint8),
                               slow.data[0, :, :i + 1].view(torch.uint8)), i
        if i == 3:   # another writer: V's scale, set by torch (what the fact keeps is stale)
            for t in (vt, vs):
                t.scale[0] = t.scale[0] * 4.0
    assert kept == P - 2, kept   # tokens 1 .. P-1 but 4 (V's fact stale)
    # a value past the screen: nothing written
    before = (kt.data.clone(), vt.data.clone())
    kt.write(torch.tensor([P]), xs[1][None, 0])
    vt.write(torch.tensor([P]), xs[1][None, 1])
    big = (xs[2][0].numpy() * 1e4, xs[2][1].numpy())
    assert not PagedTensor.write_tokens_kept((kt, vt), 1, 1, big, scratch)
    assert torch.equal(kt.data[0].view(torch.uint8), before[0][0].view(torch.uint8))
    assert torch.equal(kt.data[1, :, 1].view(torch.uint8), before[0][1, :, 1].view(torch.uint8))


def _c_route_write(tensors, p, o, xs, scratch):
    """PagedTensor.write_tokens_fp8 by the C route (kernels/cpu_fp8.py)."""
    from kvcompile.kernels import cpu_fp8

    return cpu_fp8.write_tokens(cpu_fp8.library("c"), tensors, p, o,
                                tuple(torch.from_numpy(x) for x in xs), scratch)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("route", ["numpy", "c"])
def test_kv_tokens_written_together_with_scale_decisions(name, route):
    """PagedTensor.write_tokens_fp8 (a layer's K and V together: the kept facts, else the
    scale decisions of both at once, the grown heads' earlier codes re-encoded, one fp8 cast)
    stores `_write_grouped`'s scales and bytes token by token: fresh pages (offset 0, a zero
    head among them), tokens that grow some heads' scales (K's only, V's only, both), a
    token past fp8's range. The negative cases write nothing and say so (False): a NaN or an
    Inf token, and a stale fact (V's scale set by torch) at offset > 0."""
    write = PagedTensor.write_tokens_fp8 if route == "numpy" else _c_route_write
    fmt = KVFormat(name, "page")
    H, D, P = 3, 16, 8
    kt, vt = fmt.allocate(3, H, P, D), fmt.allocate(3, H, P, D)
    ks, vs = fmt.allocate(3, H, P, D), fmt.allocate(3, H, P, D)
    for t in (kt, vt, ks, vs):
        t.data.view(torch.uint8).fill_(0x33)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, H, D, generator=g) for _ in range(2 * P + 2)]
    xs[0][1, 2] = 0.0                  # a zero V head on a fresh page: no fact after it
    xs[2][0, 1] *= 40.0                # K's head 1 grows
    xs[3][1] *= 300.0                  # every V head grows
    xs[5][:, 0] *= 1e3                 # both grow by much
    xs[P] = xs[P] * 1e-40              # fresh page, denormal-sized values (MIN_SCALE)
    xs[P + 3] = xs[P + 3] * 1e5        # past fp8's range under the old scale: grows
    scratch, decided = {}, 0

    for i, x in enumerate(xs):
        p, o = divmod(i, P)
        ok = write((kt, vt), p, o, (x[0].numpy(), x[1].numpy()),
                                          scratch)
        if not ok:   # (after a fresh zero head or a MIN_SCALE one: no fact)
            assert i in (1, P + 1), i
            kt.write(torch.tensor([i]), x[None, 0])
            vt.write(torch.tensor([i]), x[None, 1])
        decided += ok
        for t, slow in ((kt, ks), (vt, vs)):
            slow._write_grouped(torch.tensor([p]), torch.tensor([o]),
                                x[None, 0 if t is kt else 1].float())
            assert torch.equal(t.scale[:p + 1], slow.scale[:p + 1]), i
            assert torch.equal(t.data[p, :, :o + 1].view(torch.uint8),
                               slow.data[p, :, :o + 1].view(torch.uint8)), i
    assert decided == len(xs) - 2
    # the negative cases: nothing written
    i = len(xs)
    p, o = divmod(i, P)
    before = (kt.data.clone(), vt.data.clone(), kt.scale.clone(), vt.scale.clone())

    def unchanged():
        return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip((kt.data, vt.data, kt.scale, vt.scale), before))

    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, H, D, generator=g)
        x[1, 0, 3] = bad
        assert not write((kt, vt), p, o, (x[0].numpy(), x[1].numpy()),
                                                scratch)
        assert unchanged()
    vt.scale[p] = vt.scale[p] * 4.0    # another writer (torch): V's fact is stale
    before = (kt.data.clone(), vt.data.clone(), kt.scale.clone(), vt.scale.clone())
    x = torch.randn(2, H, D, generator=g) * 100.0
    assert not write((kt, vt), p, o, (x[0].numpy(), x[1].numpy()),
                                            scratch)
    assert unchanged()


def test_nan_screen_kept_per_run():
    """The in-place gather's NaN screen (`dense._nan_codes_in`) is kept per run of pages as of
    `data`'s version: a second gather of the same pages screens nothing, one with a page more
    screens that page only, and the kept screen never hides a NaN code: one placed by torch
    after it (a version bump) or in the added page is NaN in the result, exactly there (the
    negative cases: without the version check or with the added page unscreened, these
    NaNs would read as finite values). The pages are zero-filled first: the screen looks at
    whole pages, and the pool's storage is torch.empty, whose unwritten slots may hold NaN
    codes (0x7F / 0xFF) left by earlier allocations; such a tail keeps the screen from being
    kept (`test_nan_screen_not_kept_over_a_nan_like_tail`): the kept length varied between
    fresh processes before this fill."""
    from kvcompile.kernels.dense import _fp8_rows_host, _page_rows

    fmt = KVFormat("fp8_e4m3", "page")
    H, D, P, N = 3, 16, 8, 8
    kt, vt = fmt.allocate(N, H, P, D), fmt.allocate(N, H, P, D)
    g = torch.Generator().manual_seed(12)
    start, n, total = 1, 3, 3 * P - 2
    for t in (kt, vt):
        t.data.view(torch.uint8).zero_()
        t.write(torch.arange(start * P, start * P + total + P),
                torch.randn(total + P, H, D, generator=g))
    vt.data[start + n, 2, 3].view(torch.uint8)[1] = 0x7F   # in the page added later

    def result(n, total):
        x, sc = _fp8_rows_host((kt, vt), _page_rows(torch.arange(start, start + n), 1, H),
                               1, n, total, {}, start)
        return (x * sc).view(2, H, n * P, D)[:, :, :total]

    assert not bool(result(n, total).isnan().any())
    assert kt.__dict__["_views"]["nan_free"][:2] == (start, n)
    assert not bool(result(n, total).isnan().any())                # kept: nothing screened
    got = result(n + 1, total + P)                                 # the added page's NaN
    assert int(got.isnan().sum()) == 1 and bool(got[1, 2, n * P + 3, 1].isnan())
    assert kt.__dict__["_views"]["nan_free"][:2] == (start, n + 1)     # the added page's
    assert vt.__dict__["_views"]["nan_free"][:2] == (start, n)         # screen, kept or not
    kt.data[start + 1, 0, 4].view(torch.uint8)[7] = 0xFF           # by torch: a new version
    got = result(n, total)
    assert int(got.isnan().sum()) == 1 and bool(got[0, 0, P + 4, 7].isnan())


def test_nan_screen_not_kept_over_a_nan_like_tail():
    """The cause of the kept screen's varying length (`test_nan_screen_kept_per_run`): the
    screen reads whole pages, so NaN codes in the unwritten slots of the last page (torch.empty
    storage) make it look exactly (nothing NaN among the written tokens) and keep nothing; a
    zero tail is kept. The result is the same either way."""
    from kvcompile.kernels.dense import _fp8_rows_host, _page_rows

    fmt = KVFormat("fp8_e4m3", "page")
    H, D, P, N = 2, 16, 8, 6
    start, n, total = 1, 2, 2 * P - 3
    got = {}
    for tail in (0x00, 0xFF, 0x7F):
        kt, vt = fmt.allocate(N, H, P, D), fmt.allocate(N, H, P, D)
        for t in (kt, vt):
            t.data.view(torch.uint8).zero_()
            t.write(torch.arange(start * P, start * P + total),
                    torch.randn(total, H, D, generator=torch.Generator().manual_seed(3)))
        kt.data[start + n - 1, 1, P - 1].view(torch.uint8)[5] = tail   # an unwritten slot
        x, sc = _fp8_rows_host((kt, vt), _page_rows(torch.arange(start, start + n), 1, H),
                               1, n, total, {}, start)
        got[tail] = (x * sc).view(2, H, n * P, D)[:, :, :total].clone()
        assert not bool(got[tail].isnan().any())
        kept = kt.__dict__["_views"].get("nan_free")
        assert (kept is not None) == (tail == 0x00)
        assert vt.__dict__["_views"]["nan_free"][:2] == (start, n)
    assert torch.equal(got[0x00], got[0xFF]) and torch.equal(got[0x00], got[0x7F])
