"""Attention sinks (a learned logit per query head in the softmax's denominator, gpt-oss) in
every path that attends: the shared masked softmax, the dense reference, the paged decode
kernel (direct and split, with H2O's mass) and the chunked-prefill kernel, each against the
plain PyTorch form models write: softmax(cat([scores, sink], -1))[..., :-1] @ v.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.errors import UnsupportedShapeError  # noqa: E402
from kvcompile.kernels import prefill_launch as L  # noqa: E402
from kvcompile.kernels.dense import dense_attention  # noqa: E402
from kvcompile.kernels.reference import (  # noqa: E402
    masked_softmax,
    paged_prefill_attention_ref,
)
from kvcompile.testing import REL_ERR, assert_rel_close, poison_, rel_err  # noqa: E402
from tests.kernels.kernel_cases import DEV, make_format, make_paged_kv, run_case  # noqa: E402


def cat_softmax(s, allowed, sinks):
    """What gpt-oss writes: the sink as one more column of the scores, dropped after the
    softmax. s [B, H, S, L], allowed [.., S, L] bool or None, sinks [H]."""
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    col = sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]


def sink_attention(q, k, v, allowed, scale, sinks):
    # q [B, Hq, S, D], k / v [B, Hkv, L, D] -> [B, Hq, S, Dv] fp64
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    return cat_softmax(s, allowed, sinks.double()) @ v


def test_masked_softmax_sink_is_an_extra_dropped_column():
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(2, 4, 5, 9, generator=gen) * 3
    allowed = torch.rand(2, 1, 5, 9, generator=gen) > 0.3
    allowed[1, 0, 2] = False          # a row that sees no key: zeros, as cat-softmax gives
    sinks = torch.randn(4, generator=gen) * 2
    sinks[0] = 30.0                   # a sink that takes almost all the mass
    p = masked_softmax(s, allowed, sinks.view(1, -1, 1, 1))
    torch.testing.assert_close(p, cat_softmax(s, allowed, sinks), atol=1e-6, rtol=1e-5)
    assert torch.equal(p[1, :, 2], torch.zeros_like(p[1, :, 2]))
    # rows sum to 1 - p(sink) < 1; a sink of -inf is no sink at all
    assert bool((p.sum(-1) < 1).all())
    torch.testing.assert_close(masked_softmax(s, allowed, torch.full((1, 4, 1, 1), -math.inf)),
                               masked_softmax(s, allowed))


@pytest.mark.parametrize("S,L,causal", [(1, 23, False), (6, 6, True), (4, 19, True)])
def test_dense_attention_with_sinks(S, L, causal):
    gen = torch.Generator().manual_seed(S * 100 + L)
    B, Hq, Hkv, D = 2, 8, 2, 16
    q = torch.randn(B, Hq, S, D, generator=gen)
    k, v = torch.randn(B, Hkv, L, D, generator=gen), torch.randn(B, Hkv, L, D, generator=gen)
    pad = torch.ones(B, 1, 1, L, dtype=torch.bool)
    pad[0, ..., :3] = False           # left padding of row 0
    sinks = torch.randn(Hq, generator=gen)
    out = dense_attention(q, k, v, pad, 0.25, causal, 0, 0.0, sinks)
    allowed = pad & torch.ones(S, L, dtype=torch.bool).tril(L - S) if causal else pad
    assert_rel_close(out, sink_attention(q, k, v, allowed, 0.25, sinks), torch.float32)
    # the sinks change the answer (a test that passed without them would prove nothing)
    assert rel_err(dense_attention(q, k, v, pad, 0.25, causal, 0, 0.0), out) > 1e-2


@pytest.mark.parametrize("splits,Sq,fmt", [(1, 1, "fp32"), (3, 2, "fp32"), (2, 1, "fp8_e4m3")])
def test_decode_kernel_with_sinks(splits, Sq, fmt):
    gen = torch.Generator().manual_seed(splits * 10 + Sq)
    Hkv, G = 2, 4
    sinks = (torch.randn(Hkv * G, generator=gen) * 2).to(DEV)
    f = make_format(fmt, "page")
    err, bound, out, (mass, mass_ref) = run_case(
        f, f, [37, 70], Hkv, G, 64, 16, Sq=Sq, splits=splits, config={"BLOCK_T": 16},
        with_mass=True, gen=gen, sink_logits=sinks)
    assert err <= bound, f"relative error {err:.2e} > {bound:.1e}"
    # H2O's mass is the probability with the sink in the denominator, as the reference's
    assert rel_err(mass, mass_ref) <= 1e-4


def test_decode_reference_with_sinks_is_cat_softmax():
    """The decode reference the kernel is held to, against the form models write."""
    from kvcompile.kernels.reference import gather_pages, paged_decode_attention_ref

    gen = torch.Generator().manual_seed(5)
    f = make_format("fp32")
    kc, vc, bt, sl = make_paged_kv(f, f, [21], 2, 64, 16, device="cpu", gen=gen)
    q = torch.randn(1, 4, 1, 64, generator=gen)
    sinks = torch.randn(4, generator=gen)
    got = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.125, sink_logits=sinks)
    k, v = gather_pages(kc, bt[0], 21)[None], gather_pages(vc, bt[0], 21)[None]
    assert_rel_close(got, sink_attention(q, k, v, None, 0.125, sinks), torch.float32)


def test_paged_prefill_kernel_with_sinks():
    gen = torch.Generator().manual_seed(9)
    fmt = make_format("fp32")
    Hq, Hkv, D, P = 4, 2, 64, 16
    kc, vc, bt, sl = make_paged_kv(fmt, fmt, [40, 19], Hkv, D, P, gen=gen)
    cu = torch.tensor([0, 8, 27], dtype=torch.int32, device=DEV)   # a chunk, a whole prompt
    q = torch.randn(27, Hq, D, generator=gen).to(DEV)
    sinks = (torch.randn(Hq, generator=gen) * 2).to(DEV)
    out = poison_(torch.empty_like(q))
    L.launch_paged_prefill(q, out, ("fp32", "page", kc.data, kc.scale, kc.micro),
                           ("fp32", "page", vc.data, vc.scale, vc.micro), bt, cu, sl, None,
                           0.125, 0, 0, 0.0, 19, config=L.INTERPRET_CONFIG, sink_logits=sinks)
    ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, 0.125, sink_logits=sinks)
    assert_rel_close(out, ref, torch.float32)
    plain = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, 0.125)
    assert rel_err(plain, ref) > 1e-2


def test_kernels_refuse_sinks_of_the_wrong_shape():
    gen = torch.Generator().manual_seed(1)
    f = make_format("fp32")
    with pytest.raises(UnsupportedShapeError, match="sink_logits must be contiguous fp32 \\[8\\]"):
        run_case(f, f, [20], 2, 4, 64, 16, gen=gen, sink_logits=torch.zeros(2, device=DEV))
    kc, vc, bt, sl = make_paged_kv(f, f, [20], 2, 64, 16, gen=gen)
    q = torch.randn(20, 4, 64, device=DEV)
    with pytest.raises(UnsupportedShapeError, match="sink_logits must be contiguous fp32 \\[4\\]"):
        L.launch_paged_prefill(q, torch.empty_like(q), ("fp32", "page", kc.data, None, None),
                               ("fp32", "page", vc.data, None, None), bt,
                               torch.tensor([0, 20], dtype=torch.int32, device=DEV), sl, None,
                               0.125, 0, 0, 0.0, 20, sink_logits=torch.zeros(4, 1, device=DEV))


def test_attention_op_refuses_sinks_that_are_not_one_per_query_head():
    import kvcompile.runtime.attention_op  # noqa: F401  (registers torch.ops.kvcompile.attention)

    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match=r"sink_logits must be a float tensor \[Hq\] = \[4\]"):
        torch.ops.kvcompile.attention(q, k, v, None, None, "layer", 0.25, True, 0, 0.0, "t",
                                      None, torch.zeros(2))
    # without a forward context the op is plain attention over the given k / v, sinks included
    sinks = torch.randn(4)
    out = torch.ops.kvcompile.attention(q, k, v, None, None, "layer", 0.25, True, 0, 0.0, "t",
                                        None, sinks)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    assert_rel_close(out, sink_attention(q, k, v, causal, 0.25, sinks), torch.float32)
    assert REL_ERR[torch.float32] < rel_err(
        torch.ops.kvcompile.attention(q, k, v, None, None, "layer", 0.25, True, 0, 0.0, "t"),
        out)
