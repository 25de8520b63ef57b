"""fp8 pages' CPU decode step in C (kernels/cpu_fp8.py) against its numpy route, byte for byte:
the codes' values and the fp8 cast against torch's, the gather + decode of random pages (every
code, NaN / Inf / huge / tiny scales) against dense._fp8_rows_host, the one-token writes (fresh
pages, grown scales, NaN codes among the earlier tokens, refused tokens) against
PagedTensor.write_tokens_fp8; a deliberately broken build fails; without a compiler "auto"
warns once and takes the numpy route, "c" raises."""

import math
import warnings

import numpy as np
import pytest
import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.cache.fp8 import fp8_to_float
from kvcompile.cache.paged import PagedTensor
from kvcompile.errors import KVCompileWarning
from kvcompile.kernels import cpu_fp8, dense
from kvcompile.kernels.cuda import build

DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def lib():
    return cpu_fp8.library("c")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _edge_floats() -> torch.Tensor:
    """Every fp8 value of both formats, the midpoints between neighbours (ties) and one fp32 ulp
    either side of them, fp32 denormals, zeros, random values."""
    vals = [fp8_to_float(torch.arange(256, dtype=torch.uint8).view(dt)).double()
            for dt in DTYPES.values()]
    v = torch.cat(vals)
    v = v[torch.isfinite(v)].unique()
    mid = (v[1:] + v[:-1]) / 2
    pts = torch.cat([v, mid]).float()
    near = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, math.inf)),
                      torch.nextafter(pts, torch.full_like(pts, -math.inf))])
    g = torch.Generator().manual_seed(0)
    rnd = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-30, 20, (20000,),
                                                                     generator=g).float())
    extra = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, 2.0 ** -126, 448.0, 464.0, 57344.0])
    return torch.cat([near, -near, rnd, extra])


@pytest.mark.parametrize("name", list(DTYPES))
def test_values_and_cast_equal_torch(lib, name):
    dt = DTYPES[name]
    e5m2 = dt == torch.float8_e5m2
    codes = torch.arange(256, dtype=torch.uint8)
    got = torch.empty(256)
    lib.kvc_fp8_values(e5m2, codes.data_ptr(), 256, got.data_ptr())
    want = fp8_to_float(codes.view(dt))   # the numpy route's table (its NaN bits included)
    assert torch.equal(_bits(got), _bits(want))
    fmax = torch.finfo(dt).max
    x = _edge_floats().clamp(-fmax, fmax)
    x = torch.cat([x, torch.tensor([math.nan, -math.nan])])
    out = torch.empty(x.numel(), dtype=torch.uint8)
    lib.kvc_fp8_encode(e5m2, x.data_ptr(), x.numel(), out.data_ptr())
    assert torch.equal(out, x.to(dt).view(torch.uint8))


def _pages(name, N, H, P, D, g):
    """K and V fp8 pools of every code, page scales of every kind (NaN, Inf, 0, 2^127, fp32
    denormals, MIN_SCALE, random)."""
    fmt = KVFormat(name, "page")
    parts = []
    for _ in range(2):
        t = fmt.allocate(N, H, P, D)
        t.data.view(torch.uint8).copy_(torch.randint(0, 256, t.data.shape, generator=g,
                                                     dtype=torch.uint8))
        s = torch.exp2(torch.randint(-40, 20, (N, H), generator=g).float())
        s *= torch.rand(N, H, generator=g) + 0.5
        edge = torch.tensor([math.nan, math.inf, 0.0, 2.0 ** 127, 1e-40, 2.0 ** -126, 3e38])
        s.view(-1)[:len(edge)] = edge[torch.randperm(len(edge), generator=g)]
        t.scale.copy_(s[torch.randperm(N, generator=g)])
        parts.append(t)
    return parts


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("run", [True, False], ids=["run", "gathered"])
def test_gather_equals_numpy_route(lib, name, run):
    g = torch.Generator().manual_seed(3 + run)
    N, H, P, D, total = 12, 3, 16, 64, 150
    kt, vt = _pages(name, N, H, P, D, g)
    n = -(-total // P)
    pages = (torch.arange(2, 2 + n) if run else torch.randperm(N, generator=g)[:n]).long()
    x, sc = dense._fp8_rows_host((kt, vt), dense._page_rows(pages, 1, H), 1, n, total, {},
                                 2 if run else None)
    want = (x * sc).view(2, H, n * P, D)[:, :, :total]
    out = torch.full((2, 1, H, n, P, D), math.nan)
    cpu_fp8.gather(lib, (kt, vt), pages.numpy(), out)
    got = out.view(2, H, n * P, D)[:, :, :total]
    assert bool(want.isnan().any()) and bool(want.isinf().any())   # the edges are there
    assert torch.equal(_bits(got), _bits(want))


def _c_writer(lib):
    def write(tensors, p, o, xs, scratch):
        return cpu_fp8.write_tokens(lib, tensors, p, o,
                                    tuple(torch.from_numpy(x) for x in xs), scratch)
    return write


@pytest.mark.parametrize("name", list(DTYPES))
def test_writes_equal_numpy_route(lib, name):
    """Token by token, a C-written pair (K, V) and a numpy-written pair hold the same bytes,
    scales and kept facts: fresh pages (a zero head, denormal-sized values), kept-fact
    tokens, grown scales (one head, all, by much); NaN / Inf tokens and tokens without a
    fact are refused by both (then the tensors' own write)."""
    fmt = KVFormat(name, "page")
    H, D, P, N = 3, 16, 8, 5
    pairs = [(fmt.allocate(N, H, P, D), fmt.allocate(N, H, P, D)) for _ in range(2)]
    for pair in pairs:
        for t in pair:
            t.data.view(torch.uint8).fill_(0x33)
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(2, H, D, generator=g) for _ in range(4 * P)]
    xs[0][1, 2] = 0.0                    # a zero V head on a fresh page
    xs[2][0, 1] *= 40.0                  # K's head 1 grows
    xs[3][1] *= 300.0                    # every V head grows
    xs[5][:, 0] *= 1e3                   # both grow by much
    xs[6][0, 0, 1] = math.nan            # refused (and the next: the general write's
    xs[7][0] *= 1e4                      # version bump leaves no fact)
    xs[P] = xs[P] * 1e-40                # fresh page, MIN_SCALE
    xs[P + 3] = xs[P + 3] * 1e5
    xs[2 * P + 1][1, 0, 0] = math.inf    # refused
    xs[3 * P + 2] = xs[3 * P + 2] * 1e-3
    writers = (_c_writer(lib), PagedTensor.write_tokens_fp8)
    scratches, refused = ({}, {}), 0
    for i, x in enumerate(xs):
        p, o = divmod(i, P)
        oks = []
        for (kt, vt), write, scratch in zip(pairs, writers, scratches):
            ok = write((kt, vt), p, o, (x[0].numpy(), x[1].numpy()), scratch)
            if not ok:
                kt.write(torch.tensor([i]), x[None, 0])
                vt.write(torch.tensor([i]), x[None, 1])
            oks.append(ok)
        assert oks[0] == oks[1], i
        refused += not oks[0]
        for a, b in zip(*pairs):
            assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), i
            assert torch.equal(_bits(a.scale), _bits(b.scale)), i
            fa, fb = a._fp8_fact(p, o + 1), b._fp8_fact(p, o + 1)
            assert (fa is None) == (fb is None), i
            if fa is not None:
                assert np.array_equal(fa[5], fb[5]) and fa[6] == fb[6], i
    assert refused == 6, refused   # 1 (after a zero head), 6, 7, P + 1 (MIN_SCALE), 2P + 1, 2


def test_a_broken_build_differs(lib, tmp_path):
    """The E4M3 subnormal codes decoded with the wrong exponent: the comparison sees it."""
    src = cpu_fp8._SOURCE.read_text()
    broken = src.replace("(float)(int32_t)em * 0x1p-9f", "(float)(int32_t)em * 0x1p-8f")
    assert broken != src
    path = tmp_path / "cpu_fp8.c"
    path.write_text(broken)
    bad = cpu_fp8.load(cpu_fp8.build_library(path))
    codes = torch.arange(256, dtype=torch.uint8)
    got, want = torch.empty(256), torch.empty(256)
    bad.kvc_fp8_values(0, codes.data_ptr(), 256, got.data_ptr())
    lib.kvc_fp8_values(0, codes.data_ptr(), 256, want.data_ptr())
    assert not torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(got)[8:127], _bits(want)[8:127])   # only the subnormals


def test_without_a_compiler(monkeypatch):
    monkeypatch.setattr(cpu_fp8, "c_compiler", lambda: None)
    cpu_fp8.library.cache_clear()
    try:
        with pytest.warns(KVCompileWarning, match="no C compiler found.*Install a C compiler"):
            assert cpu_fp8.library("auto") is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_fp8.library("auto") is None   # once
            assert cpu_fp8.library("numpy") is None
        with pytest.raises(build.BuildError, match="no C compiler"):
            cpu_fp8.library("c")
        monkeypatch.setattr(cpu_fp8, "c_compiler", lambda: "false")   # a compiler that fails
        with pytest.raises(build.BuildError, match="false failed on cpu_fp8.c"):
            cpu_fp8.build_library()
    finally:
        cpu_fp8.library.cache_clear()


def _bf16_pages(g, N=6, H=3, P=16, D=64):
    kp = torch.randn(N, H, P, D, generator=g).to(torch.bfloat16)
    return kp, torch.randn(N, H, P, D, generator=g).to(torch.bfloat16)


def test_bf16_step_equals_torch(lib):
    """kvc_bf16_step: the token written as torch's .to(bfloat16) writes it (every fp8 value, the
    ties and their neighbours, fp32 denormals, +-Inf, random magnitudes), the pages widened as
    .float() widens them (heads first); a token with a NaN writes nothing (-1); through
    cpu_fp8.bf16_step, torch writes it (its NaN bits). Rounding by truncation, or ties away
    from zero, would differ on these values."""
    H, P, D, N = 3, 16, 64, 6
    g = torch.Generator().manual_seed(3)
    kp, vp = _bf16_pages(g, N, H, P, D)
    vals = torch.cat([_edge_floats(), torch.tensor([math.inf, -math.inf, 3.4e38, -3.4e38])])
    u = vals.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    trunc = (u >> 16).to(torch.int16)
    assert not torch.equal(trunc, vals.to(torch.bfloat16).view(torch.int16))   # (can fail)
    pages = np.array([4, 1, 2], np.int64)
    out = torch.empty(2, 1, H, len(pages), P, D)
    gather = (pages.ctypes.data, len(pages), out.data_ptr())
    step = 2 * H * D
    for i, start in enumerate(range(0, len(vals) - step, step)):
        x = vals[start:start + step].view(2, 1, H, 1, D)
        k, v = x[0].contiguous(), x[1].contiguous()
        p, o = int(pages[i % 3]), i % P
        assert lib.kvc_bf16_step(H, D, P, p, o, kp.data_ptr(), vp.data_ptr(), k.data_ptr(),
                                 v.data_ptr(), *gather) == 0
        for pool, t in ((kp, k), (vp, v)):
            want = t.reshape(H, D).to(torch.bfloat16).view(torch.int16)
            assert torch.equal(pool[p, :, o].view(torch.int16), want), (i, start)
        want = torch.stack([kp[pages].transpose(0, 1), vp[pages].transpose(0, 1)]).float()
        assert torch.equal(_bits(out.view(2, H, len(pages), P, D)), _bits(want))
    k = torch.randn(1, H, 1, D, generator=g)
    k[0, 1, 0, 5] = math.nan
    before = kp.clone()
    assert lib.kvc_bf16_step(H, D, P, 1, 3, kp.data_ptr(), vp.data_ptr(), k.data_ptr(),
                             k.data_ptr(), *gather) == -1
    assert torch.equal(kp.view(torch.int16), before.view(torch.int16))
    t = PagedTensor(KVFormat("bf16"), N, H, P, D)
    u = PagedTensor(KVFormat("bf16"), N, H, P, D)
    t.data.copy_(kp)
    u.data.copy_(vp)
    cpu_fp8.bf16_step(lib, t, u, 1, 3, k, k, gather)
    want = k.reshape(H, D).to(torch.bfloat16).view(torch.int16)
    assert torch.equal(t.data[1, :, 3].view(torch.int16), want)
    assert torch.equal(u.data[1, :, 3].view(torch.int16), want)
    assert torch.equal(_bits(out[0, 0, :, 1]), _bits(t.data[1].float()))   # (pages[1] is 1)
