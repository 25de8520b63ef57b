"""The engine's decode graphs (engine/cudagraph.py) with their replays emulated on the CPU: a
"replay" re-runs the captured step over the same static buffers and plan and copies its logits
into the captured output. CUDA graphs need CUDA (tests/gpu/ replays them); this checks what
the graphs are fed, every replay, against the pool (`check_inputs`, KVConfig.graph_check), and
that the tokens equal the engine's eager steps: an eviction policy that moves tokens on the
device between replays, and MLA layers, whose packed decode steps take the latent kernel
(their real graphs: tests/gpu/test_hf_graphs_gpu.py test_engine_latent_graphs)."""

from __future__ import annotations

import random

import pytest
import torch

import kvcompile
import kvcompile.engine.cudagraph as CG
from kvcompile.api import state_of
from kvcompile.config import H2O, SnapKV
from tests.engine.tiny import config, make_llama64, random_prompts


class _Replay:
    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        self.out.copy_(self.step())


def _capture(step, device, mempool):
    step()
    out = step()
    return _Replay(step, out), out


@pytest.fixture
def emulated(monkeypatch):
    checked = []
    real = CG.check_inputs

    def check(*a):
        checked.append(1)
        real(*a)

    monkeypatch.setattr(CG, "capture", _capture)
    monkeypatch.setattr(CG, "check_inputs", check)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    return checked


def _formats_refusal(self):
    """DecodeGraphs.why_not as on CUDA, less the device checks: each layer's pages
    (kernel_formats.graph_refusal; MLA layers included)."""
    from kvcompile.runtime.kernel_formats import graph_refusal

    st = self.state
    if st.pool is None:
        return None
    why = [graph_refusal(k, v, latent=bool(meta.get("latent")))
           for k, v, meta in zip(st.pool.k, st.pool.v, st.layer_meta)]
    return next((w for w in why if w), None)


def _run(model, cfg, prompts, graphs: bool, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(CG.DecodeGraphs, "why_not",
                        _formats_refusal if graphs else (lambda self: "off (check)"))
    eng = kvcompile.Engine(model, config=cfg, max_num_batched_tokens=64, max_num_seqs=4,
                           enable_prefix_caching=False)
    outs = eng.generate(prompts, kvcompile.SamplingParams(temperature=0, max_tokens=10,
                                                          ignore_eos=True))
    replays = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
    counters = dict(state_of(model).counters)
    kvcompile.release(model)
    return [o.token_ids for o in outs], replays, counters


def test_eviction_between_replays(emulated, monkeypatch):
    """SnapKV(hold) over fp8 token scales (moves exactly: evicted on the device between
    replays), 3 requests, triton kernels (the interpreter)."""
    prompts = random_prompts(random.Random(2), 3, 20, 30)
    cfg = config(kv_dtype="fp8_e4m3", scale_granularity="token", kernels="triton",
                 page_size=8, eviction=SnapKV(budget=12, window=4, hold=True),
                 eviction_interval=2, graph_check=True)
    got, replays, c = _run(make_llama64(), cfg, prompts, True, monkeypatch)
    ref, none, _ = _run(make_llama64(), cfg, prompts, False, monkeypatch)
    assert none == 0 and replays >= 9 and len(emulated) == replays
    assert c.get("eviction_device_runs", 0) > 0, c
    assert got == ref


@pytest.mark.parametrize("policy", [None, H2O(budget=12, recent=4, sinks=2)],
                         ids=["no eviction", "H2O"])
def test_latent_layers(emulated, monkeypatch, policy):
    """MLA layers: packed decode steps on the latent kernel, replayed; under H2O the replays
    add each step's mass through the latent kernel's attn_mass output and evict on the
    device between them."""
    from tests.passes.test_latent_attention import make_mla

    prompts = random_prompts(random.Random(3), 3, 3 if policy is None else 18, 20 if
                             policy is None else 26)
    cfg = config(page_size=8, kernels="triton", graph_check=True, eviction=policy,
                 eviction_interval=2)
    got, replays, c = _run(make_mla("deepseek_v3", "sdpa", rope=16), cfg, prompts, True,
                           monkeypatch)
    ref, none, _ = _run(make_mla("deepseek_v3", "sdpa", rope=16), cfg, prompts, False,
                        monkeypatch)
    assert none == 0 and replays >= 7 and len(emulated) == replays
    assert c.get("latent_decode_triton", 0) > 0, c
    if policy is not None:
        assert c.get("eviction_device_runs", 0) > 0 and c.get("eviction_aside_steps"), c
    assert got == ref
