"""Attention sinks through a compiled model: the Triton decode and chunked-prefill kernels take
them (token-identical to eager with fp32 pages), and the paths that cannot take them refuse
visibly: an eviction policy leaves the site alone with the reason, a hook that replaces
attention raises.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvcompile  # noqa: E402
from kvcompile.api import state_of  # noqa: E402
from kvcompile.errors import UnsupportedShapeError  # noqa: E402
from kvcompile.runtime.hooks import RuntimeHook  # noqa: E402
from kvcompile.testing import assert_rel_close  # noqa: E402
from tests.passes import research, research_masks  # noqa: E402
from tests.passes.caught import kv_warnings  # noqa: E402


def _model():
    # head_dim 64: a size the decode kernel takes
    return research.make(research_masks.SinkLogits, dim=128, n_head=2)


def test_sinks_through_the_triton_kernels_are_token_identical():
    torch._dynamo.reset()
    model = _model()
    want, want_logits = research.greedy(copy.deepcopy(model), research.prompt(), 6)
    cfg = kvcompile.KVConfig(inner="eager", max_kv_bytes=1 << 22, kernels="triton",
                             prefill="triton", kv_dtype="fp32")
    with kv_warnings() as warned:
        got, logits = research.greedy(kvcompile.compile(model, cfg), research.prompt(), 6)
    assert torch.equal(got, want)
    for a, b in zip(logits, want_logits):
        assert_rel_close(a, b, torch.float32, factor=4, what="logits")
    counters = state_of(model).counters
    assert counters.get("prefill_triton", 0) == 2 and counters.get("decode_triton", 0) == 10, \
        counters
    assert not counters.get("reference_fallback"), counters
    assert not warned, warned


def test_sinks_with_an_eviction_policy_are_left_alone_with_the_reason():
    torch._dynamo.reset()
    model = _model()
    want, _ = research.greedy(copy.deepcopy(model), research.prompt(), 4)
    cfg = kvcompile.KVConfig(inner="eager", max_kv_bytes=1 << 22,
                             eviction=kvcompile.SinkWindow(sinks=2, window=8))
    with kv_warnings() as warned:
        got, _ = research.greedy(kvcompile.compile(model, cfg), research.prompt(), 4)
    assert torch.equal(got, want)   # left exactly as it was: eager's tokens
    rep = kvcompile.report(model)
    assert not rep.rewritten, str(rep)
    assert all("attention sinks" in s.reason and "eviction" in s.reason for s in rep.sites), \
        [s.reason for s in rep.sites]
    assert warned


def test_a_hook_that_replaces_attention_refuses_sinks():
    class Replaces(RuntimeHook):
        def attend(self, ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale,
                   extras):
            return None

    torch._dynamo.reset()
    model = research.make(research_masks.SinkLogits)
    compiled = research.compile_eager(model)
    research.greedy(compiled, research.prompt(), 2)
    state_of(model).hooks.append(Replaces())
    with pytest.raises(UnsupportedShapeError, match="attention sinks .* Replaces"):
        research.greedy(compiled, research.prompt(), 2)
