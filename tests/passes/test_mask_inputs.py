"""The attention op takes HF's mask before its batch broadcast (passes/mask_inputs.py): inductor
would otherwise materialize the expanded [B, 1, S, L] view once per op (48 GiB at B16 x 16k x
32k on the H200). Checked on the graph the inner compiler gets, and on the tokens."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import kvcompile
import kvcompile.backend as backend
from kvcompile.passes.mask_inputs import unexpand_masks
from tests.engine.tiny import config, make_hf


def _masks_seen(monkeypatch):
    """Record (mask node target, mask shape) of every attention op the inner compiler gets."""
    seen = []
    real = backend.compile_inner

    def spy(gm, example_inputs, inner):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "kvcompile.attention" in str(n.target):
                m = n.args[3]
                if isinstance(m, fx.Node):
                    v = m.meta.get("example_value", m.meta.get("val"))
                    seen.append((m.target, tuple(v.shape) if v is not None else None))
        return real(gm, example_inputs, inner)

    monkeypatch.setattr(backend, "compile_inner", spy)
    return seen


@pytest.mark.parametrize("padded", [False, True])
def test_chunked_prefill_mask_is_not_broadcast_to_the_batch(padded, monkeypatch):
    seen = _masks_seen(monkeypatch)
    ref = make_hf("llama", "sdpa")
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config())
    B, S = 3, 40
    g = torch.Generator().manual_seed(int(padded))
    ids = torch.randint(3, 256, (B, S), generator=g)
    am = torch.ones_like(ids)
    if padded:
        am[1, :7] = 0
        ids[am == 0] = 0
    kw = dict(attention_mask=am, max_new_tokens=2, min_new_tokens=2, do_sample=False,
              pad_token_id=0, prefill_chunk_size=16)
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    masked = [(t, s) for t, s in seen if s is not None and len(s) == 4 and s[2] > 1]
    assert masked, seen   # chunks after the first attend over a prefix: HF passes a mask
    for target, shape in masked:
        assert target not in ("expand", torch.Tensor.expand), (target, shape)
        assert shape[0] == (B if padded else 1), shape   # no batch broadcast materialized


def _graph_with(mask_ops):
    """attention(q, k, v, mask) where mask = mask_ops(placeholder [1, 1, 4, 6])."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = fx.Graph()
    mode = FakeTensorMode()
    q, k, v, m0 = (g.placeholder(n) for n in "qkvm")
    with mode:
        for node, shape in ((q, (2, 2, 4, 8)), (k, (2, 2, 4, 8)), (v, (2, 2, 4, 8)),
                            (m0, (1, 1, 4, 6))):
            node.meta["example_value"] = torch.empty(shape, dtype=torch.bool if node is m0
                                                     else torch.float32)
        mask = mask_ops(g, m0)
    op = g.call_function(torch.ops.kvcompile.attention.default,
                         (q, k, v, mask, None, "l0", 0.5, False, 0, 0.0, "t"))
    g.output(op)
    return g, op, m0


def test_unexpand_looks_through_expand_only():
    def expanded(g, m0):
        e = g.call_method("expand", (m0, 2, -1, 4, 6))
        e.meta["example_value"] = m0.meta["example_value"].expand(2, -1, 4, 6)
        return e

    g, op, m0 = _graph_with(expanded)
    assert unexpand_masks(g) == 1 and op.args[3] is m0

    def changed(g, m0):   # a negative case: the values are changed after the expand
        e = expanded(g, m0)
        n = g.call_function(operator.invert, (e,))
        n.meta["example_value"] = e.meta["example_value"]
        return n

    g, op, m0 = _graph_with(changed)
    before = op.args[3]
    assert unexpand_masks(g) == 0 and op.args[3] is before
