"""Under dynamic shapes (torch._dynamo.config.assume_static_by_default = False, as benchmarks and
servers set to avoid a recompile per length) Dynamo turns float attributes such as HF's
`self.scaling` into SymFloat graph inputs. The SDPA site's scale is then a graph value, not a
number; the pass specializes it with a guard (graphs_utils.scalar_value) instead of leaving every
site alone, and a model whose scale changes recompiles rather than reusing the old value."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvcompile
from kvcompile.passes.graph_utils import scalar_value


@pytest.fixture
def dynamic_shapes():
    old = torch._dynamo.config.assume_static_by_default
    torch._dynamo.config.assume_static_by_default = False
    torch._dynamo.reset()
    yield
    torch._dynamo.config.assume_static_by_default = old
    torch._dynamo.reset()


def _tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    return LlamaForCausalLM(cfg).eval()


def test_symbolic_scale_is_specialized_and_sites_are_rewritten(dynamic_shapes):
    eager = _tiny()
    model = _tiny()
    kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="fp32", inner="eager"))
    ids = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    with torch.no_grad():
        want = eager.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False)
        got = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    rep = kvcompile.report(model)
    assert len(rep.sites) >= 2 and len(rep.rewritten) == len(rep.sites), str(rep)
    assert "scale is not a Python number" not in str(rep)
    st = kvcompile.stats(model)
    assert st["attention_rewritten"] == 2 * st["graphs"] and st["attention_skipped"] == 0, st

    # the guard: another scale must not run with the specialized one
    for layer in list(model.model.layers) + list(eager.model.layers):
        layer.self_attn.scaling = 0.5
    with torch.no_grad():
        want2 = eager(ids, attention_mask=am).logits
        got2 = model(ids, attention_mask=am).logits
    torch.testing.assert_close(got2, want2, rtol=1e-4, atol=1e-4)


def test_a_restart_request_from_the_inner_compiler_is_not_taken_for_a_failure(monkeypatch):
    """Inductor raises TensorifyScalarRestartAnalysis to have Dynamo retrace with a float input
    specialized (HF's self.scaling under dynamic shapes). The backend used to catch it as an
    inner-compiler failure and leave the graph unrewritten for good ("left graph 1 ... as it
    was"); it must reach Dynamo, which retraces. Simulated on the eager inner compiler (inductor
    on the CPU takes 90 s here)."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    import kvcompile.backend as backend

    real, calls = backend.compile_inner, []

    def once_restart(gm, example_inputs, inner):
        calls.append(inner)
        if len(calls) == 1:
            raise TensorifyScalarRestartAnalysis
        return real(gm, example_inputs, inner)

    monkeypatch.setattr(backend, "compile_inner", once_restart)
    torch._dynamo.reset()
    model, eager = _tiny(), _tiny()
    kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="fp32", inner="eager"))
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                             do_sample=False)
        want = eager.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                              do_sample=False)
    assert torch.equal(got, want)
    rep = kvcompile.report(model)
    assert "left graph" not in str(rep) and len(rep.rewritten) == len(rep.sites) >= 2, str(rep)
    assert len(calls) >= 2   # the restart traced the frame again


def test_scalar_value_reads_numbers_and_symbolic_hints_but_not_tensors():
    assert scalar_value(0.125) == 0.125
    assert scalar_value(3) == 3.0
    assert scalar_value(True) is None
    g = torch.fx.Graph()
    t = g.placeholder("t")
    t.meta["example_value"] = torch.ones(2)
    assert scalar_value(t) is None        # a tensor is never a scale constant
    assert scalar_value("0.5") is None


def test_an_abandoned_graph_keeps_what_dynamo_set_on_its_placeholders(monkeypatch):
    """When the inner compiler fails on the rewritten graph, the backend restores Dynamo's graph
    and compiles that. The restored placeholders must keep `_dynamo_source` (set on the node
    objects, not in meta; a deep copy drops it), or AOTAutograd, inductor's front end, fails on
    them."""
    import kvcompile.backend as backend
    from tests.passes.caught import kv_warnings

    real, seen = backend.compile_inner, []

    def fail_once(gm, example_inputs, inner):
        seen.append([hasattr(n, "_dynamo_source") for n in gm.graph.find_nodes(op="placeholder")])
        if len(seen) == 1:
            raise RuntimeError("inner compiler failed (simulated)")
        return real(gm, example_inputs, inner)

    monkeypatch.setattr(backend, "compile_inner", fail_once)
    torch._dynamo.reset()
    model, eager = _tiny(), _tiny()
    # (merged projections off: a failing inner compiler would first drop the merge)
    kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="fp32", inner="eager",
                                                merge_projections=False))
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    with kv_warnings() as warned, torch.no_grad():
        got = model(ids).logits
    assert any("as it was" in w for w in warned), warned     # said once, with the reason
    assert len(seen) == 2 and seen[0] and all(seen[1]), seen  # restored placeholders keep it
    torch.testing.assert_close(got, eager(ids).logits)
