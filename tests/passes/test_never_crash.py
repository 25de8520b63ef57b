"""A pass that fails for one site leaves that site as it was, says why, and the rest compiles.

Every per-site pass function of kvcompile/passes/pipeline.py is made to raise for one site,
before and after doing its work (a rewrite that raises halfway has changed the graph); the
model's output must still equal eager, and the report must name the pass and the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kvcompile
from kvcompile.passes import pipeline
from kvcompile.passes.find_attention import _site_location
from kvcompile.passes.sites import AttentionSite
from kvcompile.testing import assert_rel_close
from tests.passes.caught import has, kv_warnings
from tests.passes.research import SliceCacheAttention, greedy, make

TARGET = "layers.1"


def _cfg(**kw):
    # fp32 pages (the model's dtype): the compiled model computes what eager does
    base = dict(inner="eager", max_kv_bytes=1 << 22)
    base.update(kw)
    return kvcompile.KVConfig(**base)


def _prompt():
    return torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))


def _check_equal(model, compiled, steps=4):
    ref_tokens, ref_logits = greedy(model, _prompt(), steps)
    tokens, logits = greedy(compiled, _prompt(), steps)
    assert torch.equal(tokens, ref_tokens)
    for got, ref in zip(logits, ref_logits):
        assert_rel_close(got, ref, torch.float32, factor=4, what="logits")


def _name_of(args) -> str | None:
    for a in args:
        if isinstance(a, AttentionSite):
            return a.name
        if isinstance(a, torch.fx.Node):
            return _site_location(a)[0]
    return None


def _failing(orig, when: str):
    def fn(*args):
        if _name_of(args) == TARGET:
            if when == "before":
                raise RuntimeError("injected failure\nsecond line")
            orig(*args)
            raise RuntimeError("injected failure\nsecond line")
        return orig(*args)
    return fn


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("pass_name", list(pipeline.PASS_FUNCTIONS))
def test_a_failing_pass_leaves_one_site_alone(monkeypatch, pass_name, when):
    torch._dynamo.reset()
    model = make(SliceCacheAttention)
    ref = copy.deepcopy(model)
    fn = pipeline.PASS_FUNCTIONS[pass_name]
    monkeypatch.setattr(pipeline, fn, _failing(getattr(pipeline, fn), when))
    # rotate and eviction run only where asked for: ask for both (exact on fp32 pages; H2O's
    # budget holds every token)
    compiled = kvcompile.compile(model, _cfg(rotate="hadamard",
                                             eviction=kvcompile.H2O(budget=64, recent=8)))
    with kv_warnings() as warned:
        _check_equal(ref, compiled)
    assert has(warned, f"site {TARGET} .*{pass_name} pass failed"), warned
    by = {s.name: s for s in kvcompile.report(model).sites}
    assert set(by) == {"layers.0", "layers.1"}
    assert by["layers.0"].rewritten
    bad = by[TARGET]
    assert not bad.rewritten
    assert bad.reason == f"{pass_name} pass failed: RuntimeError: injected failure"


def test_slice_assigned_buffers_with_position_mask_rewritten():
    """Crashed the second call (Dynamo re-traced the slice write into a zero-stride stub) and
    was wrong at prefill (a [T, L] mask read as [B, ...])."""
    torch._dynamo.reset()
    model = make(SliceCacheAttention)
    ref = copy.deepcopy(model)
    compiled = kvcompile.compile(model, _cfg())
    _check_equal(ref, compiled, steps=6)
    rep = kvcompile.report(model)
    assert len(rep.sites) == 2 and len(rep.rewritten) == 2, str(rep)
    assert {s.cache for s in rep.sites} == {"index_put"}
    assert kvcompile.stats(model)["tokens"] > 0  # the pool holds the cache


def test_failure_outside_any_site_compiles_the_graph_as_it_came(monkeypatch):
    torch._dynamo.reset()
    model = make(SliceCacheAttention)
    ref = copy.deepcopy(model)

    def broken(*args):
        raise RuntimeError("lint failed")

    monkeypatch.setattr(pipeline, "finish_rewrite", broken)
    compiled = kvcompile.compile(model, _cfg())
    with kv_warnings() as warned:
        _check_equal(ref, compiled)
    assert has(warned, "as it was: .*lint failed"), warned
    rep = kvcompile.report(model)
    assert rep.sites and not rep.rewritten
    assert all("lint failed" in s.reason for s in rep.sites)


def test_inner_compiler_failure_falls_back_to_the_original_graph(monkeypatch):
    import kvcompile.backend as backend

    torch._dynamo.reset()
    model = make(SliceCacheAttention)
    ref = copy.deepcopy(model)
    original = backend.compile_inner

    def inner(gm, example_inputs, name):
        if any(n.target is torch.ops.kvcompile.attention.default for n in gm.graph.nodes):
            raise RuntimeError("inductor says no")
        return original(gm, example_inputs, name)

    monkeypatch.setattr(backend, "compile_inner", inner)
    compiled = kvcompile.compile(model, _cfg())
    with kv_warnings() as warned:
        _check_equal(ref, compiled)
    assert has(warned, "as it was: the inner compiler .*inductor says no"), warned
    rep = kvcompile.report(model)
    assert not rep.rewritten and all("inductor says no" in s.reason for s in rep.sites)


def test_site_rewritten_earlier_cannot_silently_run_uncompiled_later(monkeypatch):
    # its past keys live in the pool: left alone in the decode graph it would read zeros
    torch._dynamo.reset()
    model = make(SliceCacheAttention)
    orig = pipeline.rewrite_site

    def rewrite_once(gm, site, tag, handles):
        if any(r.name == site.name for r in kvcompile.api.state_of(model).records):
            raise RuntimeError("not this time")
        return orig(gm, site, tag, handles)

    monkeypatch.setattr(pipeline, "rewrite_site", rewrite_once)
    compiled = kvcompile.compile(model, _cfg())
    with pytest.raises(kvcompile.CacheStateError, match="was rewritten in graph 1"):
        greedy(compiled, _prompt(), 3)
