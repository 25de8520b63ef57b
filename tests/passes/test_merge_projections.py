"""Merged projections (passes/merge_projections.py): the linears that read one activation run as
one GEMM on their parameters laid out as one tensor. Logits against the uncompiled model in
fp32 (tolerance from kvcompile.testing), the layout (no copy of any weight survives), a replaced
parameter laid out again, and where the pass must not fire."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvcompile
from kvcompile.passes import merge_projections as mp
from kvcompile.testing import assert_rel_close
from tests.passes.zoo import make_hf


def _cfg(**kw):
    # merge_projections=True: "auto" (the default) merges in graphs on CUDA only
    return kvcompile.KVConfig(**{"inner": "aot_eager", "kernels": "reference",
                                 "max_kv_bytes": 1 << 24, "merge_projections": True, **kw})


def _storages(model) -> dict:
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
            for p in model.parameters()}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


def _generate(model, ids, new=6):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])   # qwen2: q / k / v with biases
def test_merged_projections_equal_the_model_and_copy_no_weight(family):
    m = make_hf(family)
    ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(1))
    ref_tokens = _generate(m, ids)
    weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    bytes_before = sum(_storages(m).values())
    kvcompile.compile(m, _cfg())
    assert torch.equal(_generate(m, ids), ref_tokens)
    c = kvcompile.report(m).counters
    layers = m.config.num_hidden_layers
    assert c["projections_laid_out"] == 2 * layers        # q/k/v and gate/up, once
    assert c["projections_merged"] >= 2 * layers and c["projections_linears"] >= 5 * layers
    assert "projections_copied" not in c                  # HF's views only split the last dim
    assert "linears run as" in str(kvcompile.report(m))
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    ws = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    assert mp._adjacent(ws) and mp._adjacent([mlp.gate_proj.weight, mlp.up_proj.weight])
    if family == "qwen2":
        assert mp._adjacent([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    for n, p in m.named_parameters():   # values unchanged, no extra storage
        assert torch.equal(p, weights[n]), n
    assert sum(_storages(m).values()) == bytes_before


def test_a_replaced_parameter_is_laid_out_again_and_read():
    m = make_hf("llama")
    ids = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(2))
    kvcompile.compile(m, _cfg())
    _generate(m, ids, new=2)
    up = m.model.layers[1].mlp.up_proj
    with torch.no_grad():
        up.weight = nn.Parameter(torch.randn_like(up.weight) * 0.05)
    new_weight = up.weight.detach().clone()
    got = _generate(m, ids)
    assert mp._adjacent([m.model.layers[1].mlp.gate_proj.weight, up.weight])
    assert torch.equal(up.weight, new_weight)
    ref = make_hf("llama")
    ref.load_state_dict(m.state_dict())
    assert torch.equal(got, _generate(ref, ids))


def test_the_logits_match_in_fp32():
    m = make_hf("qwen2")
    ref = make_hf("qwen2")
    ids = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(3))
    want = _logits(ref, ids)
    kvcompile.compile(m, _cfg())
    assert_rel_close(_logits(m, ids), want, torch.float32, what="logits")
    assert kvcompile.report(m).counters.get("projections_merged", 0) > 0


def test_off_by_config_leaves_the_parameters_alone():
    m = make_hf("llama")
    ids = torch.randint(3, 250, (1, 5), generator=torch.Generator().manual_seed(4))
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    kvcompile.compile(m, _cfg(merge_projections=False))
    _generate(m, ids, new=2)
    assert not any(k.startswith("projections") for k in kvcompile.report(m).counters)
    assert "linears run as" not in str(kvcompile.report(m))
    assert ptrs == {n: p.data_ptr() for n, p in m.named_parameters()}


def test_env_switch_and_auto(monkeypatch):
    for env, want in (("0", False), ("1", True), ("auto", "auto")):
        monkeypatch.setenv("KVCOMPILE_MERGE_PROJECTIONS", env)
        assert kvcompile.KVConfig().merge_projections == want
        assert type(kvcompile.KVConfig().merge_projections) is type(want)
    monkeypatch.delenv("KVCOMPILE_MERGE_PROJECTIONS")
    assert kvcompile.KVConfig().merge_projections == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(kvcompile.KVConfigError, match="merge_projections"):
            kvcompile.KVConfig(merge_projections=bad)


def test_auto_leaves_a_cpu_model_unmerged():
    m = make_hf("llama")
    ids = torch.randint(3, 250, (1, 5), generator=torch.Generator().manual_seed(6))
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    kvcompile.compile(m, _cfg(merge_projections="auto"))
    _generate(m, ids, new=2)
    assert not any(k.startswith("projections") for k in kvcompile.report(m).counters)
    assert ptrs == {n: p.data_ptr() for n, p in m.named_parameters()}


# --- the pass on graphs of its own (merge / find_groups without the attention passes) ------

class _Block(nn.Module):
    """Three linears on one input: one consumer splits the last dim (a view the merged rows
    take), one flattens across it (a view that needs a copy), one computes."""

    def __init__(self, flatten: bool, bias: bool = False, other_input: bool = False):
        super().__init__()
        self.a = nn.Linear(16, 12, bias=bias)
        self.b = nn.Linear(16, 8, bias=bias)
        self.c = nn.Linear(16, 4, bias=bias)
        self.flatten, self.other_input = flatten, other_input

    def forward(self, x, y):
        a = self.a(x).view(*x.shape[:-1], 3, 4).transpose(-2, -3)
        b = self.b(y if self.other_input else x)
        b = b.view(-1) if self.flatten else b.view(*x.shape[:-1], 2, 4)
        # every element, not their sums: a sum near zero made the relative error of a
        # correct merge exceed fp32's bound now and then (fresh random inputs)
        return torch.cat([a.flatten(), b.flatten() * 2, torch.tanh(self.c(x)).flatten()])


def _run_pass(mod, x, y, laid_out: bool = True):
    """Dynamo's graph of mod with find_groups + merge applied (layout done before tracing, as
    the backend's retrace does); -> (output, groups, copied)."""
    if laid_out:
        params = [mod.a.weight, mod.b.weight, mod.c.weight]
        mp.lay_out(mp.Group([], (0, 1, 2), None, ()), params)
        if mod.a.bias is not None:
            mp.lay_out(mp.Group([], (0, 1, 2), None, ()), [mod.a.bias, mod.b.bias, mod.c.bias])
    seen = {}

    def backend(gm, example_inputs):
        groups = mp.find_groups(gm, example_inputs)
        seen["groups"] = groups
        seen["ready"] = [mp.in_place(g, example_inputs) for g in groups]
        ready = [g for g, ok in zip(groups, seen["ready"]) if ok]
        seen["copied"] = mp.merge(gm, ready) if ready else 0
        seen["code"] = gm.code
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(mod, backend=backend, fullgraph=True)(x, y)
    return out, seen


def _groups_of(fn, *args, grad: bool = False):
    """(fn's output through Dynamo, the groups find_groups saw in its graph)."""
    seen = {}

    def backend(gm, example_inputs):
        seen["groups"] = mp.find_groups(gm, example_inputs)
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        out = torch.compile(fn, backend=backend)(*args)
    return out, seen["groups"]


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_merge_on_a_graph_of_its_own(flatten, bias):
    mod = _Block(flatten, bias)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = mod(x, x)
    out, seen = _run_pass(mod, x, x)
    assert len(seen["groups"]) == 1 and seen["ready"] == [True]
    assert seen["copied"] == int(flatten)                 # only the flattened member copies
    assert seen["code"].count("linear(") == 1
    assert_rel_close(out, want, torch.float32)


def test_no_group_across_inputs_or_before_the_layout():
    mod = _Block(False, other_input=True)
    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    with torch.no_grad():
        want = mod(x, y)
    out, seen = _run_pass(mod, x, y, laid_out=False)
    (g,) = seen["groups"]                 # a and c read x; b reads y
    assert len(g.rows) == 2 and seen["ready"] == [False]   # not laid out: left unmerged
    assert seen["code"].count("linear(") == 3
    assert_rel_close(out, want, torch.float32)


def test_not_where_a_gradient_can_flow():
    x = torch.randn(2, 5, 16)
    _, groups = _groups_of(_Block(False), x, x, grad=True)   # weights require grad
    assert groups == []


def test_a_weight_in_two_groups_is_left_alone():
    lin = nn.Linear(8, 8, bias=False)
    other = nn.Linear(8, 4, bias=False)

    def f(x, y):
        return F.linear(x, lin.weight) + F.linear(y, lin.weight) + F.linear(x, other.weight)[
            ..., :1] + F.linear(y, other.weight)[..., :1]

    _, groups = _groups_of(f, torch.randn(3, 8), torch.randn(3, 8))
    assert groups == []


class _WritesBetween(nn.Module):
    """x written in place between the two linears that read it (merged, the second would
    read x before the write)."""

    def __init__(self, through_view: bool):
        super().__init__()
        self.a = nn.Linear(16, 8, bias=False)
        self.b = nn.Linear(16, 8, bias=False)
        self.through_view = through_view

    def forward(self, x, y):
        x = x * 1.0
        a = self.a(x)
        (x.view(-1) if self.through_view else x).mul_(2.0)
        return a.sum() + self.b(x).sum() * 3 + y.sum()


@pytest.mark.parametrize("through_view", [False, True])
def test_not_across_an_in_place_write_of_the_input(through_view):
    mod = _WritesBetween(through_view)
    mp.lay_out(mp.Group([], (0, 1), None, ()), [mod.a.weight, mod.b.weight])
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = mod(x, x)
    out, groups = _groups_of(mod, x, x)
    assert groups == []
    assert_rel_close(out, want, torch.float32)


def test_v_alone_is_copied_so_the_merged_output_is_freed_before_attention():
    """v reaches the attention op through views only: a contiguous copy of its rows (inductor
    fuses it into k's rope kernel) lets the merged q / k / v output go before the op runs; q,
    k (roped) and the gated product (gate's rows) read their narrowed views."""
    import re

    from kvcompile.cli import trace as _trace

    m = make_hf("llama")
    ids = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(7))
    with _trace.recording(keep_code=False) as traces:
        kvcompile.compile(m, _cfg())
        _generate(m, ids, new=2)
    layers = m.config.num_hidden_layers
    for t in traces:
        code = t.after.code
        narrows = re.findall(r"(narrow\w*) = torch\.narrow\(", code)
        copied = [n for n in narrows if re.search(rf"= {n}\.contiguous\(\)", code)]
        # q, k, v, and gate's rows after the in-place gated product (fuse_gated)
        assert len(narrows) == 4 * layers and len(copied) == layers, code
        assert "projections_copied" not in kvcompile.report(m).counters


def test_an_inner_compiler_failing_on_the_merge_drops_the_merge_only(monkeypatch):
    """The inner compiler refuses the merged graph: the graph compiles unmerged, its
    attention still rewritten, and a warning says so once."""
    import kvcompile.backend as backend
    from tests.passes.caught import has, kv_warnings

    real = backend.compile_inner

    def picky(gm, example_inputs, inner):
        if "as_strided" in gm.code:
            raise RuntimeError("no merged GEMMs here")
        return real(gm, example_inputs, inner)

    monkeypatch.setattr(backend, "compile_inner", picky)
    m, ref = make_hf("llama"), make_hf("llama")
    ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(5))
    kvcompile.compile(m, _cfg())
    with kv_warnings() as caught:
        assert torch.equal(_generate(m, ids), _generate(ref, ids))
    r = kvcompile.report(m)
    assert r.rewritten and len(r.rewritten) == len(r.sites)
    assert not r.counters.get("projections_merged")
    # every counter the merge added is undone (the gated products' were left before)
    assert not any(v for k, v in r.counters.items()
                   if k.startswith("projections_") and k != "projections_laid_out"), r.counters
    assert has(caught, "projections unmerged.*no merged GEMMs here")


def test_several_models_in_one_process_each_rewritten_and_merged():
    ids = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(8))
    models = {f: make_hf(f) for f in ("llama", "qwen2", "mistral")}
    refs = {f: _generate(make_hf(f), ids) for f in models}
    for m in models.values():
        kvcompile.compile(m, _cfg())
    for f, m in models.items():
        assert torch.equal(_generate(m, ids), refs[f]), f
        r = kvcompile.report(m)
        assert r.sites and len(r.rewritten) == len(r.sites), f
        assert r.counters.get("projections_merged", 0) >= 2 * m.config.num_hidden_layers, f


def test_parameters_moved_after_the_layout_are_laid_out_again_at_the_next_trace():
    m, ref = make_hf("llama"), make_hf("llama")
    ids = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(9))
    kvcompile.compile(m, _cfg())
    _generate(m, ids, new=2)
    laid = kvcompile.report(m).counters["projections_laid_out"]
    for p in m.parameters():   # every parameter moved out of the laid-out tensors
        p.data = p.data.clone()
    torch._dynamo.reset()      # the next forward is traced and compiled again
    assert torch.equal(_generate(m, ids), _generate(ref, ids))
    assert kvcompile.report(m).counters["projections_laid_out"] == 2 * laid
    attn = m.model.layers[0].self_attn
    assert mp._adjacent([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])


def test_groups_not_in_place_after_their_layout_are_left_unmerged_and_said(monkeypatch):
    """A layout that did not take (here: made a no-op): the retrace does not lay out again
    (no loop); the groups run unmerged and a warning says so."""
    from tests.passes.caught import has, kv_warnings

    monkeypatch.setattr(mp, "lay_out", lambda g, tensors: None)
    m, ref = make_hf("llama"), make_hf("llama")
    ids = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(10))
    kvcompile.compile(m, _cfg())
    with kv_warnings() as caught:
        assert torch.equal(_generate(m, ids), _generate(ref, ids))
    assert has(caught, r"left \d+ projection group\(s\) of graph \d+ .* unmerged")
    r = kvcompile.report(m)
    assert not r.counters.get("projections_merged") and len(r.rewritten) == len(r.sites)


# --- gated products written into the merged gate / up output (fuse_gated) ------------------

@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("gemma2", "eager")])
def test_gated_product_written_into_the_gate_rows(family, attn):
    """HF's act(gate) * up (silu: Llama; gelu tanh: Gemma 2) on the merged output becomes
    `kvcompile.act_mul_` into gate's rows, which the down projection reads as a view (no
    product buffer beside the merged one: the B16 x 4096 prefill's peak rose 1 GiB on an H100
    without it); logits equal the model's in fp32, tokens equal."""
    from kvcompile.cli import trace as _trace

    m = make_hf(family, attn)
    ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(2))
    want, ref_tokens = _logits(m, ids), _generate(m, ids)
    with _trace.recording(keep_code=False) as traces:
        kvcompile.compile(m, _cfg())
        assert torch.equal(_generate(m, ids), ref_tokens)
    assert_rel_close(_logits(m, ids), want, torch.float32)
    layers = m.config.num_hidden_layers
    for t in traces:
        assert t.after.code.count("kvcompile.act_mul_") == layers, t.after.code
    c = kvcompile.report(m).counters
    assert c["projections_gated_in_place"] >= layers
    assert "gated products written" in str(kvcompile.report(m))


class _Gated(nn.Module):
    """gate / up on one input and act(gate) * up, or (negatives) a gate read elsewhere too,
    an activation the op does not take, an in-place one, a third factor."""

    def __init__(self, kind: str):
        super().__init__()
        self.a = nn.Linear(16, 12, bias=False)
        self.b = nn.Linear(16, 12, bias=False)
        self.c = nn.Linear(12, 16, bias=False)
        self.kind = kind

    def forward(self, x, y):
        g, u = self.a(x), self.b(x)
        if self.kind == "relu":
            return self.c(F.relu(g) * u)
        if self.kind == "inplace":
            return self.c(F.silu(g, inplace=True) * u)
        h = F.silu(g) * u if self.kind != "up_first" else u * F.silu(g)
        if self.kind == "gate_read_twice":
            return self.c(h) + g.sum()
        if self.kind == "third_factor":
            return self.c(h * y)
        return self.c(h)


def _gated_backend(seen: dict, fuse: bool = True, inner=None):
    """A Dynamo backend applying merge (and fuse_gated) to the laid-out groups, then `inner`
    (None: the graph as it is); seen: what fuse_gated did and the rewritten code."""
    def backend(gm, example_inputs):
        groups = [g for g in mp.find_groups(gm, example_inputs) if mp.in_place(g, example_inputs)]
        mp.merge(gm, groups)
        seen["fused"] = mp.fuse_gated(gm, groups) if fuse else 0
        seen["code"] = gm.code
        return gm.forward if inner is None else inner(gm, example_inputs)

    return backend


@pytest.mark.parametrize("kind,fused", [("plain", 1), ("up_first", 1), ("gate_read_twice", 0),
                                        ("relu", 0), ("inplace", 0), ("third_factor", 1)])
def test_fuse_gated_fires_only_on_the_pattern(kind, fused):
    """fuse_gated on a graph of its own: act(gate) * up in either order fires; a gate also
    read elsewhere, relu (not an op activation) and an in-place silu do not; a product used
    further (times another tensor) fires, its consumer reading the view. Output equal."""
    mod = _Gated(kind)
    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 12)
    with torch.no_grad():
        want = mod(x.clone(), y)
    mp.lay_out(mp.Group([], (0, 1), None, ()), [mod.a.weight, mod.b.weight])
    seen = {}
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(mod, backend=_gated_backend(seen), fullgraph=True)(x.clone(), y)
    assert seen["fused"] == fused, seen["code"]
    assert seen["code"].count("kvcompile.act_mul_") == fused
    assert_rel_close(out, want, torch.float32)


def test_inductor_runs_the_gated_product_in_place():
    """What the rewrite is for: inductor re-inplaces `act_mul_` on the merged linear's own
    buffer (no copy of it, no [T, I] product buffer), and the down projection's mm reads gate's
    rows with the merged row stride. Negative: without the rewrite the same graph allocates
    the product. (CPU inductor; the output code is device-independent in this respect.)"""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code

    T, width = 64, 12
    product = f"empty_strided_cpu(({T}, {width}), ({width}, 1)"

    def code_of(fuse: bool) -> str:
        mod = _Gated("plain")
        mp.lay_out(mp.Group([], (0, 1), None, ()), [mod.a.weight, mod.b.weight])
        x, y = torch.randn(T, 16), torch.randn(T, 12)
        with torch.no_grad():
            want = mod(x, y)

        seen = {}
        torch._dynamo.reset()
        with torch.no_grad():
            out, (code, *_) = run_and_get_code(
                torch.compile(mod, backend=_gated_backend(seen, fuse, compile_fx)), x, y)
        assert seen["fused"] == int(fuse)
        assert_rel_close(out, want, torch.float32)
        return code

    fused, plain = code_of(True), code_of(False)
    assert "kvcompile.act_mul_" in fused and product not in fused, fused
    assert f"({T}, {width}), ({2 * width}, 1)" in fused       # the down mm reads gate's rows in place
    assert product in plain, plain
