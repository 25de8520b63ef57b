"""The int append kernels (kernels/append_int.py, through quantize_append) against
PagedTensor.write, the reference: codes, scales and zero points bit for bit, for int4 / int3 /
int2 with token, page and channel scales. On the CPU under TRITON_INTERPRET=1 (small shapes);
tests/gpu/test_append_int_gpu.py runs a wider matrix on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.kernels import append_int  # noqa: E402
from kvcompile.kernels.append import launch_append, quantize_append  # noqa: E402
from tests.kernels.kernel_cases import (  # noqa: E402
    DEV,
    append_slot_steps,
    assert_same_storage,
    case_seed,
    make_format,
    storage_pair,
)


def int_step_inputs(n: int, H: int, D: int, step: int, gen) -> torch.Tensor:
    """x [n, H, D] fp32 for append step `step`: magnitudes grow with the step (page and channel
    ranges grow mid-page, so earlier tokens are encoded again), channel 1 an outlier, channel 2
    all zero, channel 3 one negative constant (scale 0), channel 5 a large offset with a small
    spread; step 2 adds NaN, +-Inf and a value beyond fp16 in head 0."""
    x = torch.randn(n, H, D, generator=gen) * (1.0 + 3.0 * step)
    x[:, :, 1] *= 8.0
    x[:, :, 2] = 0.0
    x[:, :, 3] = -1.5
    x[:, :, 5] = 100.0 + 0.01 * torch.randn(n, H, generator=gen)
    if step == 2:
        x[0, 0, 7] = float("nan")
        x[-1, 0, 8] = float("inf")
        x[-1, 0, 9] = -float("inf")
        x[0, 0, 10] = 1.0e6
    return x


def run_int_steps(name, gran, D, P, steps, gen, device=DEV, grouped=False, dtypes=None):
    """Appends of `steps` tokens to two sequences (shuffled pages, any slot order) by both
    writers, storage compared after each -> the PagedTensor the kernel wrote."""
    H = 2
    per_seq = -(-sum(steps) // P)
    N = 2 * per_seq + 2
    ref, got = storage_pair(make_format(name, gran), N, H, P, D, device)
    perm = torch.randperm(N, generator=gen).tolist()
    pages = [perm[:per_seq], perm[per_seq:2 * per_seq]]
    got.reencoded = 0   # writes that changed codes of a page's earlier tokens
    for i, slots in enumerate(append_slot_steps(steps, P, pages, gen)):
        x = int_step_inputs(slots.numel(), H, D, i, gen)
        if dtypes:
            x = x.to(dtypes[i % len(dtypes)])
        if not grouped:
            order = torch.randperm(slots.numel(), generator=gen)
            slots, x = slots[order], x[order]
        slots, x = slots.to(device), x.to(device)
        before = got.data.clone()
        ref.write(slots, x)
        quantize_append(got, slots, x, grouped=grouped, direct=grouped)
        assert_same_storage(ref, got, f"{name}/{gran} write {i}")
        moved = (before != got.data).any(-1)                                   # [N, H, P]
        moved[slots // P, :, slots % P] = False
        got.reencoded += int(moved.any())
    return got


CASES = [  # format, granularity, head_dim, page size
    ("int4", "channel", 32, 16), ("int4", "token", 64, 16), ("int3", "channel", 32, 8),
    ("int2", "page", 16, 8),
]


@pytest.mark.parametrize("name,gran,D,P", CASES)
def test_int_append_is_bit_exact_with_reference(name, gran, D, P):
    # a prefill crossing a page, decode steps (the second with NaN / Inf / 1e6), a chunk
    gen = torch.Generator().manual_seed(case_seed(name, gran, D, P))
    got = run_int_steps(name, gran, D, P, [P + 3, 1, 1, P // 2 + 1], gen,
                        dtypes=[torch.float32, torch.bfloat16])
    if gran != "token":   # growing ranges re-encoded earlier tokens: that path ran
        assert got.reencoded >= 2


@pytest.mark.parametrize("bulk,split,spec", [("tiles", True, True), ("tiles", False, False),
                                             ("runs", False, True)])
def test_int_append_grouped_and_bulk_launches(bulk, split, spec, monkeypatch):
    # slots in reserve order (grouped=True: no sort) and the bulk launches, here made to start
    # at 8 tokens: "runs" (a window of P slots per program, chunks of BULK_ROWS); "tiles" (fresh
    # full pages from one tile of two pages a program, the other runs as "runs" does: the steps
    # below give full pages, a partial first and last page, and pages with earlier tokens)
    monkeypatch.setattr(append_int, "BULK_TOKENS", 8)
    monkeypatch.setattr(append_int, "PAGE_BULK", bulk)
    monkeypatch.setattr(append_int, "TILE_SPLIT", split)   # one launch, or full pages then runs
    monkeypatch.setattr(append_int, "TILE_SPEC", spec)     # x read before the full-page test
    monkeypatch.setattr(append_int, "TILE_PAGES", 2)
    gen = torch.Generator().manual_seed(5)
    run_int_steps("int4", "channel", 32, 16, [37, 1, 20, 50], gen, grouped=True)
    monkeypatch.setattr(append_int, "TILE_PAGES", 4)
    run_int_steps("int4", "page", 16, 8, [11, 9, 30], gen)
    run_int_steps("int3", "channel", 32, 8, [27, 20], gen)


@pytest.mark.parametrize("name,gran,D,P,spec", [("int4", "channel", 32, 16, False),
                                                ("int4", "channel", 32, 16, True),
                                                ("int2", "page", 16, 8, True),
                                                ("int4", "token", 32, 16, False)])
def test_int_append_fresh_pages_with_non_finite_values(name, gran, D, P, spec, monkeypatch):
    """A bulk write of whole fresh pages (the tiles kernel's own pages; token scales: its
    tiles) where some pages hold NaN, +-Inf or a value beyond fp16 (those tiles take the
    masked statistics and clamped codes, the others the cheap path) and one page is all
    zeros, bit for bit with the reference; slots grouped as the runtime's prefill gives them."""
    monkeypatch.setattr(append_int, "BULK_TOKENS", 8)
    monkeypatch.setattr(append_int, "TILE_PAGES", 2)
    monkeypatch.setattr(append_int, "TILE_SPEC", spec)   # x read before the full-page test
    gen = torch.Generator().manual_seed(case_seed(name, gran, D, P, 17))
    H, N = 2, 10
    ref, got = storage_pair(make_format(name, gran), N, H, P, D, DEV)
    pages = torch.randperm(N, generator=gen)[:8]
    slots = (pages[:, None] * P + torch.arange(P)).reshape(-1)
    x = torch.randn(slots.numel(), H, D, generator=gen) * 4
    x[1, 0, 3] = float("nan")                     # page 0
    x[3 * P + 2, 1, 0] = float("inf")             # page 3
    x[3 * P + 5, 1, 4] = -float("inf")
    x[5 * P, 0, 1] = 1.0e6                        # page 5: beyond fp16
    x[6 * P:7 * P] = 0.0                          # page 6: zeros (scale 0)
    x = x.to(torch.bfloat16)
    slots, x = slots.to(DEV), x.to(DEV)
    ref.write(slots, x)
    quantize_append(got, slots, x, grouped=gran != "token", direct=True)
    assert_same_storage(ref, got, f"{name}/{gran}")


def test_int_append_wrong_scale_or_kernel_fails():
    """Negative cases: one scale an fp16 ulp off, and channel pages written by the page-scale
    kernel, must both fail the comparison."""
    gen = torch.Generator().manual_seed(7)
    got = run_int_steps("int4", "channel", 32, 16, [5], gen)
    ref, bad = storage_pair(make_format("int4", "channel"), got.num_pages, 2, 16, 32)
    for t in ("data", "scale", "zero"):
        getattr(ref, t).copy_(getattr(got, t))
        getattr(bad, t).copy_(getattr(got, t))
    s = bad.scale.view(torch.int16).view(-1)
    s[s.view(torch.float16).float().argmax()] += 1
    with pytest.raises(AssertionError, match="scale"):
        assert_same_storage(ref, bad)

    ref, bad = storage_pair(make_format("int4", "channel"), 4, 2, 16, 32)
    slots = torch.arange(16, 23, device=DEV)
    x = int_step_inputs(7, 2, 32, 0, gen).to(DEV)
    ref.write(slots, x)
    launch_append(x, slots, bad.data, bad.scale, None, "int4", "page", zero=bad.zero)
    with pytest.raises(AssertionError):
        assert_same_storage(ref, bad)


def test_append_kernel_declared_for_int_pages_of_kernel_shapes():
    """kernel_readable(.., "append") holds for int pages of the kernel's shapes (so CUDA graphs
    may take them), not for residual pages or a head_dim the launcher refuses; graph_refusal
    says which."""
    from kvcompile.runtime.kernel_formats import graph_refusal, kernel_readable

    ok = make_format("int4", "channel").allocate(2, 1, 64, 128)
    assert kernel_readable(ok, "append") and graph_refusal(ok, ok) == ""
    res = make_format("int4", "channel", residual=True).allocate(2, 1, 64, 128)
    assert not kernel_readable(res, "append")
    assert "residual pages are written by the reference" in graph_refusal(ok, res)
    odd = make_format("int4", "token").allocate(2, 1, 64, 96)
    assert not kernel_readable(odd, "append")
    assert "head_dim 96" in graph_refusal(odd, ok)
    with pytest.raises(Exception, match="head_dim 96"):
        quantize_append(odd, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, 96))


def test_int_append_decode_steps_in_one_chunk(monkeypatch):
    # a decode step's launch with a chunk of P rows (append_int.DECODE_ROWS): a page's earlier
    # tokens read, and re-encoded, in one chunk instead of P / 16
    monkeypatch.setattr(append_int, "DECODE_ROWS", 32)   # (default 16: two chunks at P 32)
    gen = torch.Generator().manual_seed(11)
    got = run_int_steps("int4", "channel", 32, 32, [29, 1, 1, 1, 2], gen)
    assert got.reencoded >= 2


@triton.jit
def _quotient_probe(A, S, Q, N, BLOCK: tl.constexpr, CORRECT: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    a = tl.load(A + i, mask=ok, other=0.0)
    sd, rs = append_int._divisor(tl.load(S + i, mask=ok, other=1.0))
    q = append_int.rn_quotient(a, rs, sd) if CORRECT else a * rs
    tl.store(Q + i, q, mask=ok)


def test_codes_division_is_ieee_division_for_every_fp16_scale():
    """append_int.rn_quotient with _divisor (a reciprocal per group, two fmas a value) equals IEEE fp32
    division a / s bit for bit, for every positive finite fp16 scale, with numerators whose
    quotients sit at and next to fp32 rounding midpoints and half-integers (the codes' ties),
    zeros and wide random values; a scale not > 0 gives 0. Negative case: the reciprocal's
    product alone (no fma correction) differs on some of the same inputs."""
    gen = torch.Generator().manual_seed(3)
    s = torch.arange(1, 0x7C00, dtype=torch.int16).view(torch.float16).float()
    n = s.numel()
    qk = torch.rand(n, generator=gen) * 16
    mid = (qk.double() + torch.nextafter(qk, torch.tensor(99.0)).double()) / 2
    half = torch.randint(0, 16, (n,), generator=gen).double() + 0.5
    a = [(mid * s.double()).float(), (half * s.double()).float(), torch.zeros(n),
         (torch.rand(n, generator=gen) * 131008).float()]
    a += [torch.nextafter(a[0], a[0] + 1), torch.nextafter(a[1], a[1] - 1)]
    a = torch.cat(a + [torch.tensor([3.0, -2.0])])
    s = torch.cat([s.repeat(6), torch.tensor([0.0, float("nan")])])
    want = torch.where(s > 0, a / torch.where(s > 0, s, 1.0), 0.0)
    a, s = a.to(DEV), s.to(DEV)
    got = {}
    for correct in (True, False):
        q = torch.empty_like(a)
        _quotient_probe[(triton.cdiv(a.numel(), 1024),)](a, s, q, a.numel(), BLOCK=1024,
                                                        CORRECT=correct)
        got[correct] = q.cpu() + 0.0   # -0 -> +0 (a scale not > 0: a signed zero)
    assert torch.equal(got[True].view(torch.int32), want.view(torch.int32))
    assert (got[False] != want).sum() > 100
