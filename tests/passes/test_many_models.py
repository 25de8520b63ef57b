"""Many models in one process (issue 15, section 2): Dynamo's recompile limit is per code object,
and every Hugging Face model's forward is the same transformers wrapper, so models compiled one
after another used to share 8 cache entries and the 7th or so ran uncompiled, silently.

- 12 different tiny families compiled one after another: every site rewritten, eager's tokens;
- when Dynamo does fall back (a tiny recompile budget forced here), the model warns once, with
  the reason and the fix, on both routes; a forward that fell back while its cache lives in
  the pool (the model's attention would read zero-byte stubs) raises instead, every time;
- on the backend route, two models of one class share Dynamo's graphs but not a pool, and the
  first one's death leaves the second working.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import transformers

import kvcompile
from kvcompile import recompiles
from kvcompile.api import state_of
from tests.passes.zoo import BASE, HF_FAMILIES, make_hf, num_attention_layers

GEN = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _model(family: str):
    if family == "olmo2":   # a 12th family, beside the zoo's 11
        cfg = transformers.Olmo2Config(**BASE)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return make_hf(family, "eager" if family == "gemma2" else "sdpa")


def _cfg(**kw):
    return kvcompile.KVConfig(inner="eager", kernels="reference", max_kv_bytes=1 << 22, **kw)


def _kvcompile_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("kvcompile:")]


def test_twelve_families_in_one_process_are_all_compiled():
    families = list(HF_FAMILIES) + ["olmo2"]
    assert len(families) == 12
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    missed = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for family in families:
            model = _model(family)
            want = model.generate(ids, **GEN)
            kvcompile.compile(model, _cfg())
            got = model.generate(ids, **GEN)
            rep = kvcompile.report(model)
            layers = num_attention_layers(model)
            if len(rep.rewritten) != layers or not torch.equal(got, want):
                missed.append(f"{family}: {len(rep.rewritten)} of {layers} rewritten")
            assert state_of(model).graph_calls >= 2   # prefill and decode ran kvcompile graphs
    assert not missed, missed
    assert not _kvcompile_warnings(record)


def _only_this_model(monkeypatch, model) -> None:
    import kvcompile.runtime.state as rt

    real = rt.all_states
    if model is None:   # backend route: the state appears at the first compile
        created = set(id(s) for s in real())
        monkeypatch.setattr(rt, "all_states", lambda: [s for s in real()
                                                       if id(s) not in created])
    else:
        st = kvcompile.api.state_of(model)
        monkeypatch.setattr(rt, "all_states", lambda: [st])


def test_a_forward_dynamo_runs_eagerly_warns_once_or_refuses_a_pooled_cache(monkeypatch):
    from kvcompile.errors import CacheStateError

    monkeypatch.setattr(recompiles, "DEFAULT_LIMIT", 1)     # a budget of one graph per model
    model = make_hf("llama")
    kvcompile.compile(model, _cfg())
    # the budget scales with live kvcompile models: count only this one (models of earlier
    # tests may still be alive, which would raise the limit past this test's one graph)
    _only_this_model(monkeypatch, model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, 6), generator=gen)
    with torch._dynamo.config.patch(recompile_limit=1):
        # prefill compiled; the decode step, over a cache held in the pool, falls back
        with pytest.raises(CacheStateError, match="LlamaForCausalLM ran a forward without "
                           "kvcompile .*recompile limit.* while its cache lives in kvcompile's "
                           "pool: .* output is wrong and was not returned"):
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
        # no cache: the eager forward is right, and says once that kvcompile did not run
        with pytest.warns(RuntimeWarning, match="LlamaForCausalLM ran a forward without "
                          "kvcompile .*recompile limit.* Fix: raise torch._dynamo.config."
                          "recompile_limit") as record:
            for n in (9, 11):
                model(torch.randint(3, 256, (1, n), generator=gen), use_cache=False)
    assert len(_kvcompile_warnings(record)) == 1            # once per model
    assert kvcompile.stats(model)["uncompiled_forwards"] == 3


def test_backend_route_warns_when_dynamo_stops_compiling(monkeypatch):
    monkeypatch.setattr(recompiles, "DEFAULT_LIMIT", 1)
    monkeypatch.setattr(recompiles._watch, "seen", set())
    model = make_hf("llama")
    model.forward = torch.compile(model.forward, backend="kvcompile",
                                  options=dict(inner="eager", max_kv_bytes=1 << 22))
    _only_this_model(monkeypatch, None)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    limits = dict(recompile_limit=1, accumulated_recompile_limit=1)
    with torch._dynamo.config.patch(**limits), pytest.warns(RuntimeWarning, match="Dynamo stopped compiling .* a model compiled "
                      "with kvcompile that runs it now runs without kvcompile's pool"):
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                       eos_token_id=None)


def test_backend_route_two_models_of_one_class_have_their_own_pools():
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    models, want = [], []
    for seed in (0, 1):
        m = make_hf("llama", seed=seed)
        want.append(m.generate(ids, **GEN))
        m.forward = torch.compile(m.forward, backend="kvcompile",
                                  options=dict(inner="eager", max_kv_bytes=1 << 22))
        models.append(m)
    for m, w in zip(models, want):
        assert torch.equal(m.generate(ids, **GEN), w)
    first, second = (state_of(m) for m in models)
    assert first is not second and first.pool is not second.pool
    assert kvcompile.stats(models[1])["layers"] == 2
    assert len(kvcompile.report(models[1]).rewritten) == 2
    dead = weakref.ref(first)
    del models[0], first
    gc.collect()
    assert dead() is None                                   # Dynamo's entries did not keep it
    assert torch.equal(models[0].generate(ids, **GEN), want[1])
    assert kvcompile.stats(models[0])["pages_used"] == 0
