"""The CPU decode step (runtime/cpu_decode.py) stores and attends as the general path does: a
compiled tiny Llama generates the same logits, token by token, with it and without it (bf16,
fp32, fp8 E4M3 and E5M2 pages; fp8 under a bf16 model too), and it is not taken for a
left-padded batch."""

import pytest
import torch

import kvcompile
from kvcompile.runtime import cpu_decode
from tests.engine.tiny import config, make_hf

pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(model, ids, am):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def _counting(monkeypatch):
    calls = {"attend": 0}
    real = cpu_decode.CpuDecodeStep.attend

    def attend(self, *args):
        out = real(self, *args)
        calls["attend"] += out is not None
        return out

    monkeypatch.setattr(cpu_decode.CpuDecodeStep, "attend", attend)
    return calls


@pytest.mark.parametrize("kv,dtype", [("bf16", torch.float32), ("fp32", torch.float32),
                                      ("fp8_e4m3", torch.float32), ("fp8_e5m2", torch.float32),
                                      ("fp8_e4m3", torch.bfloat16)])
def test_cpu_decode_step_equals_general_path(kv, dtype, monkeypatch):
    """fp8 pages take the route KVCOMPILE_CPU_FP8 picks (unset: the C one, kernels/cpu_fp8.py;
    =numpy: the numpy one; tests/kernels/test_cpu_fp8_c.py compares the two byte for byte)."""
    model = make_hf("llama", "sdpa", dtype=dtype)
    kvcompile.compile(model, config(kv_dtype=kv))
    ids = torch.randint(3, 256, (1, 21), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    calls = _counting(monkeypatch)
    seq, logits = _generate(model, ids, am)
    assert calls["attend"] > 0, "the CPU decode step did not run"
    monkeypatch.setattr(cpu_decode, "for_forward", lambda *a: None)   # the general path
    seq_ref, logits_ref = _generate(model, ids, am)
    assert torch.equal(seq, seq_ref)
    assert torch.equal(logits, logits_ref)


def test_cpu_decode_step_not_taken_for_a_padded_batch(monkeypatch):
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config(kv_dtype="bf16"))
    ids = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[1, :4] = 0
    calls = _counting(monkeypatch)
    _generate(model, ids, am)
    assert calls["attend"] == 0


def test_eager_graph_drops_unread_shape_math_and_makes_binding_stubs():
    """backend._call_directly: a `torch.sym_sum` / `size` nobody reads goes, one that is read
    stays, the attention op (no users, a side effect) stays; a cast to the dtype the tensor
    has goes (not one to another dtype); `_virtual_cat` becomes
    `_binding_stub_cat`: in a forward context the stub is the binding's own (GraphRunner's
    restub keeps it), without a binding the plain zero-stride stub of cat's shape."""
    import torch.fx as fx

    from kvcompile import backend
    from kvcompile.passes.rewrite import _virtual_cat
    from kvcompile.runtime.binding import Binding, is_stub
    from kvcompile.runtime.context import ForwardContext, forward_context

    g = fx.Graph()
    past, new, n = g.placeholder("past"), g.placeholder("new"), g.placeholder("n")
    g.call_function(torch.sym_sum, ([1, n],))                     # unread: dropped
    g.call_method("size", (past, 2))                              # unread: dropped
    kept = g.call_function(torch.sym_sum, ([2, n],))              # read below: kept
    g.call_function(torch.ops.kvcompile.attention.default,        # no users, kept
                    (new, new, new, None, None, "l0", 1.0, False, 0, 0.0, "t"))
    stub = g.call_function(_virtual_cat, (past, new, 2))
    same = g.call_method("to", (new, torch.float32))              # new is fp32: dropped
    other = g.call_method("to", (same,), {"dtype": torch.bfloat16})   # a cast: kept
    new.meta["example_value"] = torch.empty(1, 3, 1, 4)
    g.output((stub, kept, same, other))
    gm = backend._call_directly(fx.GraphModule(torch.nn.Module(), g))
    calls = [(nd.op, nd.target) for nd in gm.graph.nodes if nd.op.startswith("call")]
    assert ("call_method", "size") not in calls
    assert [t for _, t in calls].count("to") == 1
    assert [t for _, t in calls].count(torch.sym_sum) == 1
    assert backend._binding_stub_cat in [t for _, t in calls]
    assert any(getattr(t, "__name__", "") == "kvcompile_attention" for _, t in calls)
    p, x = torch.zeros(1, 3, 5, 4), torch.randn(1, 3, 1, 4)
    with torch.no_grad():
        out, k, y, z = gm(p, x, 7)   # no forward context: the plain stub (plain attention)
        assert k == 9 and out.shape == (1, 3, 6, 4) and is_stub(out)
        assert y is x and z.dtype == torch.bfloat16
        b = Binding(None, [], "cpu")
        with forward_context(ForwardContext(None, b)):
            s = backend._binding_stub_cat(p, x, 2)
        assert s.shape == (1, 3, 6, 4) and b.owns_stub(s)
        assert not b.owns_stub(out) and not Binding(None, [], "cpu").owns_stub(s)
