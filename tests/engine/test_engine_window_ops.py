"""A SinkWindow decode step whose sinks sit at their text positions (the zero-copy window path:
only a short key mask) runs the ops of a decode step without eviction: the packed decode path
(runtime/dispatch.py `_packed_decode`), the same kernel launch with the key mask, the output in
q's dtype; the mask built once per step and read by the sm_90 kernel without a copy. Steps that
need more (H2O's mass rows, re-rotated sinks) still take eviction's aside path (aside.py).

Ops counted on the CPU (benchmarks/decode_step_ops.py: TorchDispatchMode over each layer's
attention of the last decode step, kernels="triton" under the interpreter, a bf16 model)."""

from __future__ import annotations

import collections

import pytest
import torch

from kvcompile.config import H2O, SinkWindow
from kvcompile.testing import ASSERT_CLOSE

pytest.importorskip("triton")

from benchmarks.decode_step_ops import step_ops  # noqa: E402

LAYERS = 2
MASK_OPS = {"arange", "lt", "ge", "bitwise_or"}   # AsideInputs.key_mask, once per step


def _kernel_launches(ops: collections.Counter) -> tuple[collections.Counter, collections.Counter]:
    launches = collections.Counter({k: v for k, v in ops.items() if k.startswith("decode_kernel")})
    return launches, ops - launches


@pytest.fixture(scope="module")
def plain():
    ops, delta = step_ops(None, layers=LAYERS, new=8)
    assert delta.get("engine_decode_kernel_calls") == LAYERS
    return ops


def test_window_step_takes_no_extra_ops(plain):
    logits = []
    ops, delta = step_ops(SinkWindow(4, 20), "original", layers=LAYERS, new=8, logits=logits)
    assert delta.get("eviction_aside_steps") == 1, delta   # a step eviction steps aside for
    assert not delta.get("eviction_aside_kernel"), "the window step took the aside path"
    assert delta.get("engine_decode_kernel_calls") == LAYERS
    launches, rest = _kernel_launches(ops)
    assert launches == {"decode_kernel+key_mask": LAYERS}, launches
    base_launches, base_rest = _kernel_launches(plain)
    assert base_launches == {"decode_kernel": LAYERS}
    extra, missing = rest - base_rest, base_rest - rest
    assert not missing, missing
    # only the key mask, once for all layers (no cast, copy, or mask widening per layer)
    assert set(extra) <= MASK_OPS and all(n == 1 for n in extra.values()), extra
    # the same logits as the reference kernels' step over the same hidden slots
    want = []
    step_ops(SinkWindow(4, 20), "original", layers=LAYERS, new=8, kernels="reference",
             logits=want)
    assert len(logits) == len(want)
    atol, rtol = ASSERT_CLOSE[torch.bfloat16]
    for g, w in zip(logits, want):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


@pytest.mark.parametrize("policy, where, needs, casts", [
    (H2O(budget=24, recent=8, sinks=2), "original", {"index_select", "index_copy_"}, 0),
    # sink_rotation's fp64 products and fp32 results, once per step
    (SinkWindow(4, 20), "cache", {"cos", "sin"}, 4),
])
def test_steps_that_need_more_still_step_aside(plain, policy, where, needs, casts):
    """The negative case: H2O's mass rows and re-rotated sinks are aside work."""
    ops, delta = step_ops(policy, where, layers=LAYERS, new=8)
    assert delta.get("eviction_aside_kernel") == LAYERS, delta
    launches, rest = _kernel_launches(ops)
    assert not launches.get("decode_kernel") and not launches.get("decode_kernel+key_mask")
    assert needs <= set(rest - _kernel_launches(plain)[1]), rest
    # the kernel's output in q's dtype: no float round trip beside it
    assert rest.get("_to_copy", 0) <= _kernel_launches(plain)[1].get("_to_copy", 0) + casts


def test_sm90_mask_read_without_copy():
    """decode_sm90 `_padded_mask`: a bool mask 16 wide or a multiple is read as a uint8 view;
    other widths are still widened (keys past the mask seen)."""
    from kvcompile.kernels.decode_sm90 import _padded_mask

    m = torch.rand(3, 32) > 0.3
    v = _padded_mask(m, 64)
    assert v.dtype == torch.uint8 and v.data_ptr() == m.data_ptr()
    assert torch.equal(v, m.to(torch.uint8))
    for w, cap in ((20, 64), (32, 16)):   # not a multiple of 16; wider than the table
        m = torch.rand(3, w) > 0.3
        v = _padded_mask(m, cap)
        assert v.data_ptr() != m.data_ptr() and v.shape[1] % 16 == 0
        n = min(w, v.shape[1])
        assert torch.equal(v[:, :n], m[:, :n].to(torch.uint8)) and bool((v[:, n:] == 1).all())


def test_triton_kernel_reads_a_non_contiguous_key_mask():
    """A key mask sliced out of a wider one (rows strided past its width) hides the same keys
    as its contiguous copy (the kernel steps rows by the width: it was read shifted)."""
    from kvcompile.cache.formats import KVFormat
    from kvcompile.kernels.decode import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, P, W = 2, 4, 2, 64, 16, 6
    fmt = KVFormat("fp8_e4m3", "token")
    kc, vc = (fmt.allocate(B * W, Hkv, P, D, "cpu") for _ in range(2))
    for c in (kc, vc):
        c.data.copy_((torch.randn(c.data.shape, generator=gen) * 60).to(c.data.dtype))
        c.scale.copy_(torch.rand(c.scale.shape, generator=gen) * 0.01 + 1e-3)
    bt = torch.randperm(B * W, generator=gen).view(B, W).int()
    lens = torch.tensor([90, 70], dtype=torch.int32)
    q = torch.randn(B, Hq, 1, D, generator=gen)
    wide = torch.rand(B, 48, generator=gen) > 0.4
    sliced = wide[:, :32]
    assert not sliced.is_contiguous()
    got = paged_decode_attention(q, kc, vc, bt, lens, D ** -0.5, key_mask=sliced, direct=True)
    want = paged_decode_attention(q, kc, vc, bt, lens, D ** -0.5,
                                  key_mask=sliced.contiguous(), direct=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    other = paged_decode_attention(q, kc, vc, bt, lens, D ** -0.5, direct=True)
    assert not torch.equal(got, other)   # (the mask hides keys)
