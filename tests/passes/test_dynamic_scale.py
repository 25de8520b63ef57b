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


def test_scalar_value_reads_numbers_and_symbolic_hints_but_not_tensors():
    assert scalar_value(0.125) == 0.125
    assert scalar_value(3) == 3.0
    assert scalar_value(True) is None
    g = torch.fx.Graph()
    t = g.placeholder("t")
    t.meta["example_value"] = torch.ones(2)
    assert scalar_value(t) is None        # a tensor is never a scale constant
    assert scalar_value("0.5") is None
