"""Re-rotated SinkWindow sinks (the default) with fp8 pages: the CUDA-graph decode path's logic
(engine/cudagraph.py: static buffers, padding rows, the replayed step) run on the CPU without
a capture, against the eager steps and the host path, under the parting criterion the H200
check uses (kvcompile.testing.greedy_parting: logits within the format's tolerance up to the
first step whose greedy token parts, and that step a near tie).

On the CPU both paths run the same reference kernels, so they agree to fp32 rounding (the
padded batch's GEMMs); on the H200 the graph replays a fixed block-table width and padded
batch (other split-K counts, other GEMM shapes), whose rounding the fp8 cache can turn into
a flipped element and then a parted near tie (benchmarks/RESULTS.md, issue 19). The criterion
must still catch a real difference: DecodeGraphs._pad's old bug (padding zeroed the real rows'
re-rotated sink counts: the sinks attended unrotated) fails it at the tolerance of two runs of
the same kernels (kernel_rel_err fp32). Measured here: that bug moves this tiny model's logits
by 0.6-1.5% of the row's largest, below the fp8 storage tolerance (2.8%), so the fp8 criterion
alone would not see it; on the H200 the bf16 cases (tokens equal) and the host-path comparison
are what caught it (0 of 5 requests agreed), and they keep that job.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

import kvcompile
import kvcompile.engine.cudagraph as CG
from kvcompile import Engine, SamplingParams, SinkWindow
from kvcompile.api import state_of
from kvcompile.testing import greedy_parting, kernel_rel_err, storage_rel_tol
from tests.engine.tiny import config, make_hf, random_prompts

POLICY = SinkWindow(2, 12)


class _CpuTorch:
    """`torch` for engine/cudagraph.py on the CPU: no pinned memory, no graph pool."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*a, pin_memory=False, **k):
        return torch.zeros(*a, **k)

    @staticmethod
    def ones(*a, pin_memory=False, **k):
        return torch.ones(*a, **k)

    cuda = types.SimpleNamespace(graph_pool_handle=lambda: None)


class _Replay:
    """A 'captured' step: replay() runs the step on the graph's static buffers again and
    writes its logits into the static output, as a CUDA graph replay does."""

    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        self.out.copy_(self.step())


def _capture(step, device, mempool):
    step()   # (the warm-up runs of the real capture)
    out = step().clone()
    return _Replay(step, out), out


def _old_pad(self, g, n):
    """DecodeGraphs._pad before the 2026-12-03 fix: it cleared the shifts' padding and
    everything after it, the real rows' re-rotated sink counts included."""
    sid, slots, row = self._scratch(g.bp)
    bp, pad = g.bp, g.bp - n
    g.h64[n:bp] = 0
    g.h64[bp + n:2 * bp] = 0
    g.h64[2 * bp + n:3 * bp] = slots[:pad]
    g.h64[3 * bp + n:4 * bp] = row
    store = self.state.eviction.store if self.state.eviction is not None else None
    g.h64[4 * bp + n:5 * bp] = store.scratch if store is not None else 0
    g.h64[5 * bp + n:] = 0
    g.h32[n:bp] = 1


@pytest.fixture(scope="module")
def model():
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=8, kv_dtype="fp8_e4m3", scale_granularity="token",
                                eviction=POLICY))
    return m


def _run(m, mode: str, prompts, new: int) -> tuple[dict, dict]:
    """Per request its logits per decode step [steps, V]; and the step's counters.
    mode: "eager" (the aside step without graphs), "graphs" (emulated replays), "old_pad"
    (emulated replays with the old padding bug), "host" (attend_kept on every step)."""
    mp = pytest.MonkeyPatch()
    graphs = mode in ("graphs", "old_pad")
    if graphs:
        mp.setattr(CG, "torch", _CpuTorch())
        mp.setattr(CG, "capture", _capture)
        mp.setattr(CG.DecodeGraphs, "why_not", lambda self: None)
        mp.setattr(CG.DecodeGraphs, "capture_all", lambda self: 0)
        if mode == "old_pad":
            mp.setattr(CG.DecodeGraphs, "_pad", _old_pad)
    st = state_of(m)
    before = dict(st.counters)
    try:
        eng = Engine(m, max_num_batched_tokens=128, enable_prefix_caching=False,
                     cuda_graphs=graphs)
        if mode == "host":
            mp.setattr(st.eviction, "decode_aside", lambda seq_ids: False)
        logits: dict[int, list] = {}
        fwd = eng.runner.forward

        def forward(out):
            lg = fwd(out)
            if all(s.n == 1 and s.start > 0 for s in out.seqs):   # decode steps only
                for s, row in zip(out.seqs, lg):
                    logits.setdefault(s.req.id, []).append(row.double().clone())
            return lg

        eng.runner.forward = forward
        eng.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        replays = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
        eng.close()
    finally:
        mp.undo()
    counts = {k: st.counters.get(k, 0) - before.get(k, 0) for k in st.counters}
    counts["replays"] = replays
    return {r: torch.stack(v) for r, v in logits.items()}, counts


def _diagnose(ref: dict, other: dict, tol: float | None = None) -> list[dict]:
    tol = storage_rel_tol("fp8_e4m3") if tol is None else tol
    return [greedy_parting(ref[r], other[r], tol) for r in sorted(ref)]


@pytest.fixture(scope="module")
def runs(model):
    prompts = random_prompts(random.Random(3), 5, 20, 40)   # 5 rows: 3 padding rows of 8
    return {mode: _run(model, mode, prompts, 16) for mode in ("eager", "graphs", "old_pad")}


def test_emulated_graph_steps_equal_eager_steps(runs):
    (eager, ce), (graphs, cg) = runs["eager"], runs["graphs"]
    assert ce["replays"] == 0 and cg["replays"] >= 15
    assert ce["eviction_aside_steps"] >= 15 and cg["eviction_aside_steps"] >= 15
    assert cg["evicted_tokens"] > 0
    diag = _diagnose(eager, graphs)
    print(diag)
    assert all(d["ok"] for d in diag), diag
    # the CPU runs the same reference kernels: no parting, fp32 rounding only (the padded
    # batch's GEMMs), within the bound of two runs of one kernel
    same = _diagnose(eager, graphs, kernel_rel_err(torch.float32, "cpu"))
    assert all(d["parted"] is None and d["ok"] for d in same), same


def test_parting_criterion_fails_on_the_old_padding_bug(runs):
    """The criterion is not vacuous: the sinks attended unrotated (the old _pad) fail it."""
    eager, _ = runs["eager"]
    bad, cb = runs["old_pad"]
    assert cb["replays"] >= 15
    diag = _diagnose(eager, bad, kernel_rel_err(torch.float32, "cpu"))
    print(diag)
    assert not any(d["ok"] for d in diag), diag
    # (the fp8 storage tolerance is blind to it in this model: the module docstring)
    print("fp8 criterion on the old bug:", [d["ok"] for d in _diagnose(eager, bad)])


def test_greedy_parting_on_constructed_logits():
    """A near tie may part within the tolerance; a wide margin may not; logits past the
    parting step are not compared."""
    tol = 0.01
    ref = torch.tensor([[5.0, 1.0, 0.0], [3.0, 2.99, 0.0], [9.0, 0.0, 0.0]])
    near = ref.clone()
    near[1, 1] += 0.02       # flips a 0.01 margin; 0.02 / 3.0 (the row's max) < tol
    d = greedy_parting(ref, near, tol)
    assert d["parted"] == 1 and d["steps"] == 2 and d["ok"], d
    wide = ref.clone()
    wide[0, 1] += 4.5        # parts a 4.0 margin
    d = greedy_parting(ref, wide, tol)
    assert d["parted"] == 0 and not d["tie_ok"] and not d["tol_ok"] and not d["ok"], d
    same = ref + 1e-4
    d = greedy_parting(ref, same, tol)
    assert d["parted"] is None and d["steps"] == 3 and d["ok"], d
    off = ref.clone()
    off[2, 2] += 1.0         # no parting, but a difference beyond the tolerance
    assert not greedy_parting(ref, off, tol)["ok"]
    assert np.isclose(storage_rel_tol("fp8_e4m3"), 10 ** (-31 / 20))
    with pytest.raises(ValueError, match="no tolerance"):
        storage_rel_tol("int9")


def _kernel_model():
    """A tiny Llama of head_dim 64 (a size the decode kernel takes), compiled with re-rotated
    SinkWindow sinks, fp32 pages, kernels="triton" (the interpreter on the CPU)."""
    import transformers as t

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="sdpa")).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    kvcompile.compile(m, config(page_size=8, kv_dtype="fp32", eviction=POLICY,
                                kernels="triton"))
    return m


def _host_path_routes(m, prompts, params) -> list[tuple[dict, dict, int]]:
    """The engine's decode steps on the host path (decode_aside refused), through the decode
    kernel and through attend_kept: per route (logits of each request's decode steps, counter
    increments, all-decode forwards)."""
    st = state_of(m)
    runs = []
    for route in ("kernel", "attend_kept"):
        mp = pytest.MonkeyPatch()
        before = dict(st.counters)
        eng = Engine(m, max_num_batched_tokens=128, enable_prefix_caching=False,
                     eviction_interval=4)
        mp.setattr(st.eviction, "decode_aside", lambda seq_ids: False)
        if route == "attend_kept":
            mp.setattr(st.eviction, "_attend_kernel", lambda *a, **k: None)
        logits: dict[str, list] = {}
        decodes = [0]
        fwd = eng.runner.forward

        def forward(out, fwd=fwd, logits=logits, decodes=decodes):
            lg = fwd(out)
            if all(s.n == 1 and s.start > 0 for s in out.seqs):
                decodes[0] += 1
                for s, row in zip(out.seqs, lg):
                    logits.setdefault(s.req.id, []).append(row.double().clone())
            return lg

        eng.runner.forward = forward
        try:
            eng.generate(prompts, params)
        finally:
            mp.undo()
            eng.close()
        counts = {k: st.counters.get(k, 0) - before.get(k, 0) for k in st.counters}
        runs.append(({r: torch.stack(v) for r, v in logits.items()}, counts, decodes[0]))
    return runs


def test_host_path_decodes_rerotated_sinks_through_the_kernel():
    """The host path (decode_aside refused) of the engine's decode steps attends through the
    decode kernel with the sinks scored by the rotated query (kernel_aside), not per sequence
    through attend_kept: same logits as attend_kept (Triton interpreter, fp32 pages), and it
    evicts every eviction_interval steps as the aside steps do."""
    m = _kernel_model()
    prompts = random_prompts(random.Random(4), 3, 20, 30)
    (kern, ck, _), (ref, cr, _) = _host_path_routes(
        m, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert ck.get("eviction_kernel_decode", 0) > 0 and cr.get("eviction_kernel_decode", 0) == 0
    assert ck.get("eviction_aside_steps", 0) == 0
    # 3 prompts of 20-30 tokens, budget 14, interval 4: evicted at the prompt's end, then
    # every 4 decode steps (not every step)
    assert 3 < ck["eviction_runs"] <= 3 + 3 * 3, ck["eviction_runs"]
    diag = [greedy_parting(ref[r], kern[r], kernel_rel_err(torch.float32, "cpu"))
            for r in sorted(ref)]
    assert all(d["parted"] is None and d["ok"] for d in diag), diag


def test_host_path_kernel_decodes_h2o_beside_rerotated_sinks():
    """Requests with H2O (its mass from the kernel's attn_mass output) in the same decode
    steps as re-rotated SinkWindow sinks: every decode step of every layer runs the decode
    kernel once (before the sinks were scored inside the kernel, such a batch fell back to
    attend_kept: the kernel's mass lacked the sinks' share), with attend_kept's logits, and
    so H2O's choices (kept tokens follow the mass)."""
    from kvcompile.config import H2O

    m = _kernel_model()
    prompts = random_prompts(random.Random(5), 4, 20, 30)
    h2o = H2O(budget=14, recent=3, sinks=1)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             eviction=h2o if i % 2 else "model") for i in range(4)]
    (kern, ck, n_dec), (ref, cr, _) = _host_path_routes(m, prompts, params)
    layers = len(state_of(m).layer_specs)
    assert n_dec >= 11 and ck.get("eviction_kernel_decode", 0) == layers * n_dec, (ck, n_dec)
    assert cr.get("eviction_kernel_decode", 0) == 0
    diag = [greedy_parting(ref[r], kern[r], kernel_rel_err(torch.float32, "cpu"))
            for r in sorted(ref)]
    assert all(d["parted"] is None and d["ok"] for d in diag), diag
