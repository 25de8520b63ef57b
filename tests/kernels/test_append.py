"""quantize_append kernel vs PagedTensor.write (the reference append): bit-exact storage.

On the CPU the kernel runs under TRITON_INTERPRET=1 (conftest.py) with explicit fp8 / bf16
rounding; on CUDA with the hardware casts (tests/gpu/test_append_gpu.py runs it there).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.errors import UnsupportedShapeError  # noqa: E402
from kvcompile.kernels.append import quantize_append  # noqa: E402
from tests.kernels.kernel_cases import (  # noqa: E402
    DEV,
    append_slot_steps,
    assert_same_storage,
    case_seed,
    make_format,
    storage_pair,
)


def _fmt(name, gran="page"):
    return make_format(name, gran)


CASES = [  # format, granularity, head_dim, page size
    ("bf16", "page", 64, 16), ("fp16", "page", 128, 8), ("fp32", "page", 64, 32),
    ("fp8_e4m3", "page", 64, 16), ("fp8_e4m3", "token", 128, 32), ("fp8_e4m3", "tensor", 64, 16),
    ("fp8_e5m2", "page", 128, 16), ("fp8_e5m2", "token", 64, 64),
    ("fp4_e2m1", "page", 64, 16), ("fp4_e2m1", "token", 64, 32), ("fp4_e2m1", "tensor", 128, 16),
    ("fp4_e2m1", "page", 256, 8),
]


@pytest.mark.parametrize("name,gran,D,P", CASES)
def test_append_is_bit_exact_with_reference(name, gran, D, P):
    # a bulk prefill, then decode-style single-token appends whose magnitudes grow (page scales
    # grow and re-encode the page's earlier tokens), then a multi-token chunk
    gen = torch.Generator().manual_seed(case_seed(name, gran, D, P))
    H, N = 2, 12
    ref, got = storage_pair(_fmt(name, gran), N, H, P, D)
    perm = torch.randperm(N, generator=gen).tolist()
    pages = [perm[0:4], perm[4:8]]
    steps = [P + 3, 1, 1, 2, 1, P // 2 + 1]
    for i, slots in enumerate(append_slot_steps(steps, P, pages, gen)):
        x = torch.randn(slots.numel(), H, D, generator=gen) * (1.0 + 3.0 * i)
        x[:, :, 1] *= 8.0
        order = torch.randperm(slots.numel(), generator=gen)  # any slot order
        ref.write(slots[order].to(DEV), x[order].to(DEV))
        quantize_append(got, slots[order].to(DEV), x[order].to(DEV))
        assert_same_storage(ref, got, f"write {i}")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1"])
def test_append_grouped_slots_skip_the_sort_bit_exact(name):
    # slots in PagePool.reserve's order (sequences in any order, each page's run adjacent and
    # increasing, pages not sorted): grouped=True must store what the sorted path stores
    from kvcompile.cache.pool import LayerSpec, PagePool

    gen = torch.Generator().manual_seed(11)
    H, D, P = 2, 64, 8
    pool = PagePool([LayerSpec(H, D, D, _fmt(name), _fmt(name))], 16, P, device=DEV)
    seqs = pool.allocate(3)
    ref = copy.deepcopy(pool.k[0])
    for i, n in enumerate([P + 3, 1, 5, 1]):
        slots = pool.reserve(seqs[::-1] if i % 2 else seqs, n)
        x = (torch.randn(slots.numel(), H, D, generator=gen) * (1 + 4 * i)).to(DEV)
        ref.write(slots, x)
        quantize_append(pool.k[0], slots, x, grouped=True, direct=True)
        assert_same_storage(ref, pool.k[0], f"write {i}")


@pytest.mark.parametrize("name", ["fp8_e5m2", "fp4_e2m1"])
def test_append_bulk_window_path_is_bit_exact(name, monkeypatch):
    # the windowed scan used for bulk prefill writes (forced on with a small write)
    import kvcompile.kernels.append as app

    monkeypatch.setattr(app, "BULK_TOKENS", 0)
    gen = torch.Generator().manual_seed(9)
    ref, got = storage_pair(_fmt(name, "page"), 10, 2, 8, 64)
    perm = torch.randperm(10, generator=gen).tolist()
    for i, slots in enumerate(append_slot_steps([11, 1, 9], 8, [perm[:5], perm[5:]], gen)):
        x = (torch.randn(slots.numel(), 2, 64, generator=gen) * (1 + 5 * i)).to(DEV)
        ref.write(slots.to(DEV), x)
        quantize_append(got, slots.to(DEV), x)
        assert_same_storage(ref, got, f"write {i}")


def test_append_growing_page_scale_reencodes_earlier_tokens():
    gen = torch.Generator().manual_seed(1)
    ref, got = storage_pair(_fmt("fp8_e4m3", "page"), 2, 1, 16, 64)
    x0 = torch.randn(5, 1, 64, generator=gen)
    ref.write(torch.arange(5, device=DEV), x0.to(DEV))
    quantize_append(got, torch.arange(5, device=DEV), x0.to(DEV))
    codes_before = got.data[0, 0, :5].view(torch.uint8).clone()
    scale_before = got.scale[0, 0].item()
    x1 = torch.randn(1, 1, 64, generator=gen) * 100.0  # raises the page's amax
    ref.write(torch.tensor([5], device=DEV), x1.to(DEV))
    quantize_append(got, torch.tensor([5], device=DEV), x1.to(DEV))
    assert got.scale[0, 0].item() > scale_before
    assert not torch.equal(got.data[0, 0, :5].view(torch.uint8), codes_before)  # re-encoded
    assert_same_storage(ref, got, "after growth")


def test_append_nonfinite_values_match_reference():
    gen = torch.Generator().manual_seed(2)
    for name, gran in (("fp8_e4m3", "page"), ("fp8_e5m2", "token"), ("fp4_e2m1", "page")):
        ref, got = storage_pair(_fmt(name, gran), 2, 2, 16, 64)
        x = torch.randn(7, 2, 64, generator=gen)
        x[1, 0, 3] = float("nan")
        x[2, 1, 5] = float("inf")
        x[3, 0, 9] = -float("inf")
        slots = torch.arange(7, device=DEV) + 16
        ref.write(slots, x.to(DEV))
        quantize_append(got, slots, x.to(DEV))
        assert_same_storage(ref, got, name)


def test_append_op_has_fake_and_compiles():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = _fmt("fp8_e4m3", "token").allocate(4, 2, 16, 64, DEV)
    ref = _fmt("fp8_e4m3", "token").allocate(4, 2, 16, 64, DEV)
    with FakeTensorMode(allow_non_fake_inputs=True):
        quantize_append(cache, torch.arange(3, device=DEV), torch.empty(3, 2, 64, device=DEV))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(slots, x):
        quantize_append(cache, slots, x * 2.0)

    x = torch.randn(3, 2, 64, device=DEV)
    f(torch.arange(3, device=DEV), x)
    ref.write(torch.arange(3, device=DEV), x * 2.0)
    assert torch.equal(cache.data[0, :, :3].view(torch.uint8), ref.data[0, :, :3].view(torch.uint8))


@pytest.mark.parametrize("x,slots,msg", [
    (torch.randn(3, 2, 32), torch.arange(3), "x must be"),
    (torch.randn(3, 2, 64), torch.arange(2), "slots must be"),
    (torch.randn(3, 2, 64).to(torch.int32), torch.arange(3), "x must be"),
])
def test_append_rejects_bad_inputs(x, slots, msg):
    cache = _fmt("fp8_e4m3").allocate(4, 2, 16, 64, DEV)
    before = cache.data.view(torch.uint8).clone()
    with pytest.raises(UnsupportedShapeError, match=msg):
        quantize_append(cache, slots.to(DEV), x.to(DEV))
    assert torch.equal(cache.data.view(torch.uint8), before)  # state untouched


def test_iota_buffers_outlive_their_growth():
    """The grouped page-scaled append reads its identity order from a per-device arange
    buffer. A CUDA graph captured with a slice of it reads that memory at every replay, so a
    longer call that grows the buffer must not free the old one (it did: the engine's decode
    graphs of fp8 page-scaled pages then replayed over memory given to other tensors, an
    illegal memory access on the H200 after a prompt chunk of 4,224 tokens)."""
    from kvcompile.kernels import append as A

    dev = torch.device("cpu")
    A._IOTA.pop(dev, None)
    small = A._iota(16, dev)
    ptr = small.untyped_storage().data_ptr()
    del small
    big = A._iota(5000, dev)
    assert torch.equal(big, torch.arange(5000))
    assert big.untyped_storage().data_ptr() != ptr
    kept = [b for b in A._IOTA_RETIRED if b.untyped_storage().data_ptr() == ptr]
    assert kept and torch.equal(kept[0][:16], torch.arange(16))   # alive and unchanged
    assert A._iota(3000, dev).untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
