"""`torch.ops.kvcompile.attention` writes the pool, which is not one of its arguments: it
declares no mutated argument and is registered as having a side effect, so that no compiler
pass drops it. These tests call it with its output unused (the one case where data flow alone
would not keep it) and check that it still runs."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._library.utils import is_impure

import kvcompile.runtime.attention_op as op


@pytest.fixture
def calls(monkeypatch):
    """Counts the op's runs (outside a forward context it attends over the given k/v)."""
    seen = []
    real = op.dense_attention

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(op, "dense_attention", spy)
    return seen


def _unused_attention(q, k, v):
    # q, k, v: [1, 2, 3, 8]; the op's output is dropped, only q * 2 is returned
    torch.ops.kvcompile.attention(q, k, v, None, None, "layers.0", 0.0, True, 0, 0.0, "t")
    return q * 2


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 3, 8, generator=g) for _ in range(3)]


def test_the_op_is_impure_and_declares_no_mutated_argument():
    attention = torch.ops.kvcompile.attention.default
    assert is_impure(attention)   # what FX dead-code elimination and inductor's scheduler ask
    assert not attention._schema.is_mutable   # the pool is reached through the context


def test_no_mutated_argument_of_a_kvcompile_op_has_a_default():
    # torch 2.11's dispatcher drops a trailing argument equal to its default from a boxed
    # call; the version bump of a mutated one then indexed past the arguments (IndexError on
    # every quantize_append through the op, H100, 2026-12-06): mutated arguments take no default
    import kvcompile.kernels.append  # noqa: F401  (registers quantize_append)
    import kvcompile.kernels.decode  # noqa: F401
    seen = []
    for name in ("quantize_append", "paged_decode", "paged_decode_out", "attention"):
        schema = getattr(torch.ops.kvcompile, name).default._schema
        for a in schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                seen.append(name)
                assert not a.has_default_value(), f"{name}({a.name}) has a default"
    assert "quantize_append" in seen and "paged_decode_out" in seen


def test_fx_dead_code_elimination_keeps_an_unused_call():
    gm = fx.symbolic_trace(_unused_attention)
    gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.kvcompile.attention.default in targets or \
        torch.ops.kvcompile.attention in targets


def test_aot_eager_runs_an_unused_call(calls):
    torch._dynamo.reset()
    q, k, v = _inputs()
    out = torch.compile(_unused_attention, backend="aot_eager", fullgraph=True)(q, k, v)
    assert torch.equal(out, q * 2)
    assert len(calls) == 1


@pytest.mark.slow
def test_inductor_runs_an_unused_call(calls):
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    q, k, v = _inputs()
    # a graph cached by a process that did not register the side effect would drop the call.
    # inductor's own patch, not monkeypatch: pytest >= 9 undoes a module attribute it did not
    # find in the module's __dict__ by deleting it, which hides the option from every later
    # inductor compile in the worker ("config.fx_graph_cache does not exist")
    with inductor_config.patch(fx_graph_cache=False):
        out = torch.compile(_unused_attention, backend="inductor", fullgraph=True)(q, k, v)
    assert torch.equal(out, q * 2)
    assert len(calls) == 1
