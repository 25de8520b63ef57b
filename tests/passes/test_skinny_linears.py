"""Decode GEMMs on kernels/skinny.py (passes/skinny_linears.py, KVConfig.decode_gemms="triton"):
a rewritten graph's linears with at most 16 input rows run as torch.ops.kvcompile.skinny_linear.
On the CPU the pass is let fire on "cpu" tensors (the kernel under the Triton interpreter, fp32
models); tokens equal the uncompiled model's, merged projections included, and where it must
not fire: the default, a prefill of more rows, grad mode."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvcompile  # noqa: E402
from kvcompile.passes import skinny_linears  # noqa: E402
from tests.passes.zoo import make_hf  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(skinny_linears, "DEVICES", ("cuda", "cpu"))


def _cfg(**kw):
    return kvcompile.KVConfig(**{"inner": "aot_eager", "kernels": "reference",
                                 "max_kv_bytes": 1 << 24, "decode_gemms": "triton", **kw})


def _generate(model, ids, new=5):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              do_sample=False, pad_token_id=0)


def _linears(m) -> int:
    return sum(isinstance(x, torch.nn.Linear) for x in m.modules())


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen2"])   # qwen2: q / k / v with biases
def test_decode_linears_run_on_the_kernel_with_the_model_tokens(on_cpu, family, merge,
                                                                monkeypatch):
    from kvcompile.kernels import skinny

    real, calls = skinny.skinny_linear, []
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    m, ref = make_hf(family), make_hf(family)
    # 3 x 7 prompt rows: 21 > 16, so the prefill graph keeps F.linear; decode rows: 3
    ids = torch.randint(3, 250, (3, 7), generator=torch.Generator().manual_seed(2))
    kvcompile.compile(m, _cfg(merge_projections=merge))
    assert torch.equal(_generate(m, ids), _generate(ref, ids))
    c = kvcompile.report(m).counters
    # the decode graph: every linear (merged: q/k/v and gate/up as one each); the prefill's
    # LM head too (generate keeps the last position's 3 rows), none of its other linears
    n = _linears(m) - (2 + 1) * m.config.num_hidden_layers if merge else _linears(m)
    n += 1
    assert c.get("decode_gemms_triton") == n, (c.get("decode_gemms_triton"), n)
    assert len(calls) >= 4 * (n - 1), len(calls)   # the kernel ran: 4 decode steps at least
    assert "small-M linears over the graphs on kvcompile's Triton kernel" in str(
        kvcompile.report(m))


def test_the_default_and_a_long_prompt_leave_f_linear(on_cpu):
    ids = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(3))
    m = make_hf("llama")
    kvcompile.compile(m, _cfg(decode_gemms="torch"))
    _generate(m, ids, new=3)
    assert not kvcompile.report(m).counters.get("decode_gemms_triton")
    m = make_hf("llama")
    kvcompile.compile(m, _cfg())
    with torch.no_grad():   # a 20-row prefill alone: nothing to replace
        m(ids, attention_mask=torch.ones_like(ids))
    assert not kvcompile.report(m).counters.get("decode_gemms_triton")


def test_not_on_the_cpu_unless_asked_nor_where_gradients_flow(on_cpu, monkeypatch):
    import torch.fx as fx

    def graph(x, w):
        return torch.nn.functional.linear(x, w)

    x, w = torch.randn(2, 8), torch.nn.Parameter(torch.randn(4, 8))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx_, fw = mode.from_tensor(x), mode.from_tensor(w)
    gm = fx.symbolic_trace(graph)
    for n, v in zip(gm.graph.find_nodes(op="placeholder"), (fx_, fw)):
        n.meta["example_value"] = v
    refused = {}
    with torch.enable_grad():   # w requires grad, grad mode on: refused, the reason given
        assert skinny_linears.rewrite(gm, refusals=refused) == (0, 0)
    assert list(refused) == ["gradients can flow through it (grad mode on, a parameter "
                             "requiring grad)"]
    with torch.no_grad():
        assert skinny_linears.rewrite(gm) == (1, 0)
    gm = fx.symbolic_trace(graph)
    for n, v in zip(gm.graph.find_nodes(op="placeholder"), (fx_, fw)):
        n.meta["example_value"] = v
    monkeypatch.setattr(skinny_linears, "DEVICES", ("cuda",))
    refused = {}
    with torch.no_grad():   # CPU tensors: CUDA only by default
        assert skinny_linears.rewrite(gm, refusals=refused) == (0, 0)
    assert refused == {"its operands are on cpu, the kernel runs on CUDA": 1}


def test_refused_linears_are_said_once_a_model():
    """decode_gemms="triton" on a model whose linears the kernel cannot take (here: CPU
    tensors, the kernel being CUDA's): the tokens are the model's, one warning names the
    reason and the graph, the report counts the refused linears; "torch" says nothing."""
    from tests.passes.caught import kv_warnings

    m, ref = make_hf("llama"), make_hf("llama")
    ids = torch.randint(3, 250, (2, 5), generator=torch.Generator().manual_seed(6))
    kvcompile.compile(m, _cfg())
    with kv_warnings() as said:
        assert torch.equal(_generate(m, ids), _generate(ref, ids))
    mine = [w for w in said if "decode_gemms='triton'" in w]
    assert len(mine) == 1, said
    assert "on cpu, the kernel runs on CUDA" in mine[0] and "graph " in mine[0], mine
    c = kvcompile.report(m).counters
    assert c.get("decode_gemms_refused", 0) >= _linears(m), c   # prefill's and decode's
    assert not c.get("decode_gemms_triton")
    assert "linears refused for their operands" in str(kvcompile.report(m))
    m = make_hf("llama")
    kvcompile.compile(m, _cfg(decode_gemms="torch"))
    with kv_warnings() as said:
        _generate(m, ids)
    assert not [w for w in said if "decode_gemms" in w], said
    assert not kvcompile.report(m).counters.get("decode_gemms_refused")


def test_an_unknown_choice_is_refused():
    with pytest.raises(kvcompile.KVConfigError, match="decode_gemms"):
        kvcompile.KVConfig(decode_gemms="cublas")


def test_the_op_is_f_linear_for_what_the_kernel_does_not_take(monkeypatch):
    import torch.nn.functional as F

    import kvcompile.runtime.skinny_op  # noqa: F401
    from kvcompile.kernels import skinny

    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **k: pytest.fail("kernel ran"))
    op = torch.ops.kvcompile.skinny_linear
    x, w = torch.randn(20, 8), torch.randn(6, 8)
    assert torch.equal(op(x, w, None), F.linear(x, w))             # more than 16 rows
    assert torch.equal(op(x[:4], w.t().contiguous().t()[:, :8], None),
                       F.linear(x[:4], w.t().contiguous().t()[:, :8]))   # columns strided
    assert torch.equal(op(x[:4, :0], w[:, :0], None), F.linear(x[:4, :0], w[:, :0]))   # K 0
    monkeypatch.setenv("TRITON_INTERPRET", "0")                     # CPU, no interpreter
    assert torch.equal(op(x[:4], w, None), F.linear(x[:4], w))


def test_a_dynamic_row_count_goes_to_the_op_which_checks_the_rows(on_cpu, monkeypatch):
    """A second batch size makes Dynamo trace the decode graph with the batch dynamic: its
    linears still go to the op (counted as dynamic), which runs the kernel for the decode
    steps' rows (at most 16) and F.linear for more; the tokens are the model's."""
    from kvcompile.kernels import skinny

    real, rows = skinny.skinny_linear, []
    monkeypatch.setattr(skinny, "skinny_linear",
                        lambda x, *a, **k: rows.append(x.numel() // x.shape[-1])
                        or real(x, *a, **k))
    m, ref = make_hf("llama"), make_hf("llama")
    kvcompile.compile(m, _cfg())
    g = torch.Generator().manual_seed(4)
    for b in (3, 2, 6):
        ids = torch.randint(3, 250, (b, 7), generator=g)
        assert torch.equal(_generate(m, ids), _generate(ref, ids))
    c = kvcompile.report(m).counters
    assert c.get("decode_gemms_triton_dynamic", 0) > 0, c
    assert 2 in rows and 6 in rows and max(rows) <= 16   # the dynamic graph's decode steps
    # the 6 x 7 = 42-row prefill through a dynamic graph (if any) ran F.linear
    assert "small-M linears" in str(kvcompile.report(m))


@pytest.fixture
def fake_timing(monkeypatch):
    """decode_gemms="auto" with the op's timer replaced: the Triton kernel "measures" `fast`
    of cuBLAS's time for shapes whose N is in `faster`, 1.5x it elsewhere; every timing is
    recorded (the op's choices start empty)."""
    from kvcompile.runtime import skinny_op

    monkeypatch.setattr(skinny_op, "CHOICES", {})
    monkeypatch.setattr(skinny_op, "_UNMEASURED", set())
    timed, faster, fast = [], set(), [0.5]

    def fake(fns, device):
        n = fake.shape[-1]
        timed.append(n)
        return [1.0, fast[0] if n in faster else 1.5]

    real_choose = skinny_op.choose

    def choose(x, w, b):   # the shape the timer is asked about
        fake.shape = (w.shape[0],)
        return real_choose(x, w, b)

    monkeypatch.setattr(skinny_op, "time_candidates", fake)
    monkeypatch.setattr(skinny_op, "choose", choose)
    return timed, faster, fast


@pytest.mark.parametrize("merge", [False, True])
def test_auto_runs_each_shape_on_the_faster_of_the_two(on_cpu, fake_timing, merge,
                                                       monkeypatch):
    """"auto": each shape timed once (not once a step or a layer), the kernel run for the
    shapes it won, cuBLAS for the others; tokens the model's; the report counts the choices
    and the kernel notes give each shape's times."""
    from kvcompile.kernels import skinny

    timed, faster, _ = fake_timing
    real, ran = skinny.skinny_linear, []
    monkeypatch.setattr(skinny, "skinny_linear",
                        lambda x, w, *a, **k: ran.append(w.shape[0]) or real(x, w, *a, **k))
    m, ref = make_hf("llama"), make_hf("llama")
    faster.add(m.config.vocab_size)                       # the LM head: the kernel's
    faster.add(m.config.hidden_size)                      # o_proj / down_proj: the kernel's
    ids = torch.randint(3, 250, (3, 7), generator=torch.Generator().manual_seed(5))
    kvcompile.compile(m, _cfg(decode_gemms="auto", merge_projections=merge))
    assert torch.equal(_generate(m, ids, new=6), _generate(ref, ids, new=6))
    from kvcompile.runtime import skinny_op

    c = kvcompile.report(m).counters
    shapes = len(timed)
    assert shapes == len(skinny_op.CHOICES)                 # a timing a distinct shape
    assert c.get("decode_gemms_auto_triton", 0) + c.get("decode_gemms_auto_torch", 0) == shapes
    assert c.get("decode_gemms_auto_triton") and c.get("decode_gemms_auto_torch")
    assert not c.get("decode_gemms_triton")
    assert c.get("decode_gemms_auto", 0) > 0
    assert set(ran) <= faster and ran, (set(ran), faster)   # never a shape cuBLAS won
    assert ran.count(m.config.vocab_size) >= 5             # every decode step's LM head
    # timed once a shape: 6 steps x layers of linears, yet one timing each
    steps_linears = 5 * m.config.num_hidden_layers
    assert shapes < steps_linears, (shapes, steps_linears)
    rep = kvcompile.report(m)
    assert "chosen by shape (KVConfig.decode_gemms='auto')" in str(rep)
    assert any("decode GEMMs (auto)" in n and "Triton 0.5000 ms" in n for n in rep.kernel_notes)


def test_auto_keeps_cublas_within_the_margin_and_inside_a_capture(fake_timing, monkeypatch):
    """The kernel must beat cuBLAS by more than the margin (a tie keeps the library); a shape
    first met inside a CUDA graph capture is not timed: cuBLAS, counted as unmeasured."""
    import torch.nn.functional as F

    from kvcompile.kernels import skinny
    from kvcompile.runtime import skinny_op

    timed, faster, fast = fake_timing
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **k: pytest.fail("kernel ran"))
    op = torch.ops.kvcompile.skinny_linear
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    faster.add(6)
    fast[0] = 0.98                     # 2% faster: inside the 3% margin
    assert torch.equal(op(x, w, None, True), F.linear(x, w))
    assert skinny_op.CHOICES[skinny_op.shape_key(x, w, None)][0] == "torch"
    assert timed == [6]
    assert torch.equal(op(x, w, None, True), F.linear(x, w))   # cached: not timed again
    assert timed == [6]
    monkeypatch.setattr(skinny_op, "capturing", lambda x: True)
    w2 = torch.randn(10, 8)
    faster.add(10)
    fast[0] = 0.5
    assert torch.equal(op(x, w2, None, True), F.linear(x, w2))
    assert timed == [6]                                        # no timing in a capture
    assert skinny_op.shape_key(x, w2, None) not in skinny_op.CHOICES
    monkeypatch.setattr(skinny_op, "capturing", lambda x: False)
    monkeypatch.setattr(skinny, "skinny_linear", lambda x, w, b=None: F.linear(x, w, b))
    assert torch.equal(op(x, w2, None, True), F.linear(x, w2))   # measured at its next call
    assert timed == [6, 10] and skinny_op.CHOICES[skinny_op.shape_key(x, w2, None)][0] == "triton"


def test_not_on_dtensors(on_cpu):
    """Under tensor parallelism a linear's weight may be a DTensor: the kernel takes local
    tensors only, so the pass leaves such a linear to F.linear (the same graph over a plain
    weight is taken). A one-rank gloo group and mesh, made and destroyed here."""
    import torch.distributed as dist
    import torch.fx as fx

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without a process group already set up")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def graph(x, w):
        return torch.nn.functional.linear(x, w)

    def traced(w):
        gm = fx.symbolic_trace(graph)
        for n, v in zip(gm.graph.find_nodes(op="placeholder"), (torch.randn(2, 8), w)):
            n.meta["example_value"] = v
        return gm

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = distribute_tensor(torch.randn(4, 8), init_device_mesh("cpu", (1,)), [Shard(0)])
        with torch.no_grad():
            refused = {}
            assert skinny_linears.rewrite(traced(w), refusals=refused) == (0, 0)
            assert list(refused) == ["its operands are DTensors (tensor parallelism; the "
                                     "kernel takes local tensors)"]
            assert skinny_linears.rewrite(traced(torch.randn(4, 8))) == (1, 0)
    finally:
        dist.destroy_process_group()
