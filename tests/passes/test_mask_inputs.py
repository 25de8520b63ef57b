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
                km = n.args[11] if len(n.args) > 11 else None
                if isinstance(m, fx.Node):
                    v = m.meta.get("example_value", m.meta.get("val"))
                    kv = None if km is None else km.meta.get("example_value")
                    seen.append((m.target, tuple(v.shape) if v is not None else None,
                                 None if kv is None else tuple(kv.shape)))
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
    masked = [x for x in seen if x[1] is not None and len(x[1]) == 4 and x[1][2] > 1]
    assert masked, seen   # chunks after the first attend over a prefix: HF passes a mask
    for target, shape, key_shape in masked:
        assert target not in ("expand", torch.Tensor.expand), (target, shape)
        # no [B, 1, S, L] materialized: the shared part [1, 1, S, L], padding (when HF builds
        # it into the mask) as a [B, 1, 1, L] key mask
        assert shape[0] == 1, shape
        if padded:
            assert key_shape is not None and key_shape[0] == B and key_shape[2] == 1, key_shape


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


# --- the split of an AND of a shared and a per-row part ------------------------------------------

def _and_graph(shapes, B=2):
    """attention(q, k, v, m0 & m1 & ...) over bool placeholders of the given shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = fx.Graph()
    mode = FakeTensorMode()
    q, k, v = (g.placeholder(n) for n in "qkv")
    leaves = [g.placeholder(f"m{i}") for i in range(len(shapes))]
    with mode:
        for node in (q, k, v):
            node.meta["example_value"] = torch.empty(B, 2, 4, 8)
        for node, shape in zip(leaves, shapes):
            node.meta["example_value"] = torch.empty(shape, dtype=torch.bool)
        mask = leaves[0]
        for leaf in leaves[1:]:
            n = g.call_function(operator.and_, (mask, leaf))
            n.meta["example_value"] = mask.meta["example_value"] & leaf.meta["example_value"]
            mask = n
    ops = [g.call_function(torch.ops.kvcompile.attention.default,
                           (q, k, v, mask, None, f"l{i}", 0.5, False, 0, 0.0, "t"))
           for i in range(2)]
    g.output(tuple(ops))
    return g, ops, leaves


def _shape(n):
    return tuple(n.meta["example_value"].shape)


def test_split_hands_the_op_a_shared_and_a_key_part():
    """causal [1, 1, 4, 6] & scalar & padding [2, 1, 1, 6]: two parts, one node each for both
    ops, the [2, 1, 4, 6] AND gone from the graph; the parts AND to the same values."""
    g, ops, (causal, one, pad) = _and_graph([(1, 1, 4, 6), (), (2, 1, 1, 6)])
    assert unexpand_masks(g) == 2
    shared, key = ops[0].args[3], ops[0].args[11]
    assert ops[1].args[3] is shared and ops[1].args[11] is key
    assert _shape(shared) == (1, 1, 4, 6) and key is pad
    assert not any(n.op == "call_function" and n.target is operator.and_
                   and _shape(n)[0] == 2 for n in g.nodes)
    g.lint()
    c, p = torch.rand(1, 1, 4, 6) > 0.3, torch.rand(2, 1, 1, 6) > 0.3
    env = {"m0": c, "m1": torch.tensor(True), "m2": p}

    def ev(n):
        if n.op == "placeholder":
            return env[n.name]
        return n.target(*fx.node.map_arg(n.args, ev))

    assert torch.equal(ev(shared) & ev(key), c & True & p)


@pytest.mark.parametrize("shapes", [
    [(1, 1, 4, 6), (2, 1, 4, 6)],      # a per-row, per-query leaf: kept whole
    [(1, 1, 1, 6), (2, 1, 1, 6)],      # the AND is [2, 1, 1, 6] already: nothing to gain
    [(1, 1, 4, 6), (1, 1, 4, 6)],      # no per-row part (and no batch in the AND)
], ids=["per-row-query", "key-only", "shared-only"])
def test_split_does_not_fire(shapes):
    g, ops, _ = _and_graph(shapes)
    before = ops[0].args[3]
    unexpand_masks(g)
    assert len(ops[0].args) == 11 and ops[0].args[3] is before


def test_split_needs_bool_leaves():
    """An additive (float) mask is not an AND of bools: left alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = fx.Graph()
    q, k, v, a, b = (g.placeholder(n) for n in ("q", "k", "v", "a", "b"))
    with FakeTensorMode():
        for node in (q, k, v):
            node.meta["example_value"] = torch.empty(2, 2, 4, 8)
        a.meta["example_value"] = torch.empty(1, 1, 4, 6, dtype=torch.int64)
        b.meta["example_value"] = torch.empty(2, 1, 1, 6, dtype=torch.int64)
        m = g.call_function(operator.and_, (a, b))
        m.meta["example_value"] = a.meta["example_value"] & b.meta["example_value"]
    op = g.call_function(torch.ops.kvcompile.attention.default,
                         (q, k, v, m, None, "l0", 0.5, False, 0, 0.0, "t"))
    g.output(op)
    unexpand_masks(g)
    assert len(op.args) == 11 and op.args[3] is m


def _graphs_seen(monkeypatch):
    """Per graph the inner compiler gets: (attention ops' (tag, mask, key mask), 4-d bool
    nodes' shapes)."""
    seen = []
    real = backend.compile_inner

    def spy(gm, example_inputs, inner):
        ops, bools = [], []
        for n in gm.graph.nodes:
            if n.op == "call_function" and "kvcompile.attention" in str(n.target):
                ops.append((n.args[10], n.args[3], n.args[11] if len(n.args) > 11 else None))
            v = n.meta.get("example_value", n.meta.get("val"))
            if isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.dim() == 4:
                bools.append(tuple(v.shape))
        seen.append((ops, bools))
        return real(gm, example_inputs, inner)

    monkeypatch.setattr(backend, "compile_inner", spy)
    return seen


def test_engine_graphs_build_no_mask(monkeypatch):
    """A graph traced in an engine step gives its ops no mask, and the model's [1, 1, T, T]
    mask over the packed row (4 GiB at 16 x 4,096 tokens) is not computed; the tokens are
    HF's. The same model's generate graph keeps its mask (the drop must not fire there)."""
    from kvcompile import Engine, SamplingParams
    from kvcompile.runtime.context import PACKED_TAG
    from tests.engine.tiny import hf_greedy

    seen = _graphs_seen(monkeypatch)
    ref = make_hf("llama", "sdpa")
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config(kv_dtype="bf16", page_size=8))
    eng = Engine(model, max_num_batched_tokens=512, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (23, 9, 17)]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == hf_greedy(ref, p, 4)
    assert seen
    for ops, bools in seen:
        assert ops and all(tag.endswith(PACKED_TAG) and m is None and km is None
                           for tag, m, km in ops), ops
        assert not bools, bools   # nothing of the model's mask is left in the graph
    n_engine = len(seen)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    assert got[0, len(prompts[0]):].tolist() == hf_greedy(ref, prompts[0], 3)
    later = seen[n_engine:]
    assert later
    for ops, _ in later:
        assert all(not tag.endswith(PACKED_TAG) for tag, _, _ in ops), ops


def test_other_model_inside_an_engine_warm_up_keeps_its_mask(monkeypatch):
    """A second kvcompile model called inside an engine's warm-up context (a model used by
    the first one's code, a callback) traces its own graph with its mask, not as an engine
    graph: its ops get no packed tag, and it runs (and matches HF) outside the engine after."""
    from kvcompile.api import state_of
    from kvcompile.runtime.context import PACKED_TAG, ForwardContext, forward_context
    from tests.engine.tiny import hf_greedy

    seen = _graphs_seen(monkeypatch)
    engine_model = make_hf("llama", "sdpa")
    kvcompile.compile(engine_model, config(kv_dtype="bf16", page_size=8))
    ref = make_hf("llama", "sdpa")
    other = make_hf("llama", "sdpa")
    kvcompile.compile(other, config(kv_dtype="bf16", page_size=8))
    ids = torch.tensor([[5, 9, 17, 33, 2, 71]])
    kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        with forward_context(ForwardContext(state_of(engine_model), None,
                                            engine_warm_up=True)):
            inside = other.generate(ids, **kw)
        after = other.generate(ids, **kw)
    want = hf_greedy(ref, ids[0].tolist(), 3)
    assert inside[0, 6:].tolist() == want and after[0, 6:].tolist() == want
    assert seen
    for ops, _ in seen:
        assert all(not tag.endswith(PACKED_TAG) for tag, _, _ in ops), ops


def test_engine_graph_refuses_to_run_outside_a_step():
    """An op of a graph traced in an engine step (no mask given) called without an engine
    step's plan fails with the reason; the same op with a plain tag attends densely."""
    from kvcompile.errors import CacheStateError
    from kvcompile.runtime.context import PACKED_TAG

    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    args = (q, k, v, None, None, "model.layers.0.self_attn", 8 ** -0.5, True, 0, 0.0)
    with pytest.raises(CacheStateError, match="compiled inside a kvcompile.Engine step"):
        torch.ops.kvcompile.attention(*args, "kvcompile-abc" + PACKED_TAG)
    out = torch.ops.kvcompile.attention(*args, "kvcompile-abc")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want)
    # with no context (the engine's warm-up, a cache-less call) the op returns the layout its
    # fake promises (inductor asserts the strides: [B, H, S, D] laid out as [B, S, H, D]),
    # whatever q's layout and SDPA's output
    for lay in (lambda x: x, lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)):
        out = torch.ops.kvcompile.attention(*(lay(x) for x in (q, k, v)), *args[3:],
                                            "kvcompile-abc")
        torch.library.opcheck(torch.ops.kvcompile.attention.default,
                              (*(lay(x) for x in (q, k, v)), *args[3:], "kvcompile-abc"),
                              test_utils=("test_faketensor",))
        assert out.transpose(1, 2).is_contiguous(), out.stride()
        torch.testing.assert_close(out, want)


def test_drop_masks_erases_the_mask_and_keeps_writes():
    """drop_masks: the op gets no mask, the mask's own nodes go, a placeholder and an in-place
    write under them stay."""
    from kvcompile.passes.mask_inputs import drop_masks

    def built(g, m0):
        w = g.call_method("fill_", (m0, True))      # a write under the mask: kept
        w.meta["example_value"] = torch.empty((1, 1, 4, 6), dtype=torch.bool)
        a = g.call_function(torch.ops.aten.logical_not.default, (w,))
        a.meta["example_value"] = torch.empty((1, 1, 4, 6), dtype=torch.bool)
        b = g.call_function(torch.ops.aten.logical_not.default, (a,))
        b.meta["example_value"] = torch.empty((1, 1, 4, 6), dtype=torch.bool)
        c = g.call_function(operator.and_, (a, b))   # not a write, though named x_
        c.meta["example_value"] = torch.empty((1, 1, 4, 6), dtype=torch.bool)
        return c

    g, op, m0 = _graph_with(built)
    assert drop_masks(g) == 1
    assert op.args[3] is None
    kinds = [str(n.target) for n in g.nodes if n.op != "placeholder" and n.op != "output"]
    assert "fill_" in kinds and not any("logical_not" in t or "and_" in t for t in kinds), kinds
    assert drop_masks(g) == 0   # nothing left to drop
    g.lint()
