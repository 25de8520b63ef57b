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


def _graph_with(mask_ops, mask_shape=(1, 1, 4, 6)):
    """attention(q, k, v, mask) where mask = mask_ops(placeholder `mask_shape`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = fx.Graph()
    mode = FakeTensorMode()
    q, k, v, m0 = (g.placeholder(n) for n in "qkvm")
    with mode:
        for node, shape in ((q, (2, 2, 4, 8)), (k, (2, 2, 4, 8)), (v, (2, 2, 4, 8)),
                            (m0, mask_shape)):
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


def test_unexpand_moves_a_key_slice_onto_the_small_mask():
    """Older transformers cut the mask to the keys' length after the expand:
    expand(m)[:, :, :, :6] becomes m[:, :, :, :6] (the batch dim stays broadcast)."""
    def sliced(g, m0):
        e = g.call_method("expand", (m0, 2, -1, 4, 8))
        e.meta["example_value"] = m0.meta["example_value"].expand(2, -1, 4, 8)
        s = g.call_function(operator.getitem, (e, (slice(None), slice(None), slice(None),
                                                   slice(None, 6))))
        s.meta["example_value"] = e.meta["example_value"][:, :, :, :6]
        return s

    g, op, m0 = _graph_with(sliced, (1, 1, 4, 8))
    assert unexpand_masks(g) == 1
    new = op.args[3]
    assert new.target is operator.getitem and new.args[0] is m0
    assert tuple(new.meta["example_value"].shape) == (1, 1, 4, 6)
    m = torch.rand(1, 1, 4, 8) > 0.5   # the same values, broadcast
    assert torch.equal(m[new.args[1]].expand(2, -1, -1, -1), m.expand(2, -1, 4, 8)[:, :, :, :6])


def test_unexpand_drops_a_slice_that_keeps_the_shape():
    """mask[:, :, :, :L] of a [B, 1, S, L] mask is the mask: the op takes the mask itself (an
    op's view input is copied per op by inductor)."""
    def sliced(g, m0):
        s = g.call_function(operator.getitem, (m0, (slice(None), slice(None), slice(None),
                                                    slice(None, 6))))
        s.meta["example_value"] = m0.meta["example_value"][:, :, :, :6]
        return s

    g, op, m0 = _graph_with(sliced, (2, 1, 4, 6))
    assert unexpand_masks(g) == 1 and op.args[3] is m0

    def shorter(g, m0):   # a slice that cuts keys: a real change, kept
        s = g.call_function(operator.getitem, (m0, (slice(None), slice(None), slice(None),
                                                    slice(None, 5))))
        s.meta["example_value"] = m0.meta["example_value"][:, :, :, :5]
        return s

    g, op, m0 = _graph_with(shorter, (2, 1, 4, 6))
    kept = op.args[3]
    assert unexpand_masks(g) == 0 and op.args[3] is kept
