"""Which calls `GraphedForward` (integrations/hf_graphs.py) would replay from a CUDA graph.

Replay itself needs CUDA (tests/gpu/test_hf_graphs_gpu.py checks it on the H200); here the
graph path is replaced by a recorder that runs the compiled forward, so the CPU checks the
selection: every decode step of `generate` on a bound DynamicCache, and nothing else."""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile.integrations.hf_graphs import GraphedForward, in_generate
from tests.engine.tiny import config, make_hf, make_llama64


@pytest.fixture
def recorded():
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(kv_dtype="bf16"))
    fwd = m.forward
    assert isinstance(fwd, GraphedForward)
    assert fwd.why_not() is not None            # CPU: never replays
    calls = []
    fwd.why_not = lambda: None                  # pretend the device allows graphs

    def record(kw, cache, b, past, aside=False):
        calls.append((tuple(kw["input_ids"].shape), past, b.batch))
        return fwd.compiled(**kw)

    fwd._run = record
    return m, calls


def _inputs(B=2, L=7, pad=True):
    ids = torch.randint(3, 200, (B, L), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    if pad:
        am[0, :2] = 0
    return ids, am


def test_decode_steps_of_generate_are_selected(recorded):
    m, calls = recorded
    ids, am = _inputs()
    out = m.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 11)
    # prefill runs the compiled graph; the 3 decode steps are selected, lengths growing
    assert [c[1] for c in calls] == [7, 8, 9]
    assert all(c[0] == (2, 1) and c[2] == 2 for c in calls)
    assert not in_generate()


def test_selected_steps_give_the_same_tokens(recorded):
    m, calls = recorded
    ids, am = _inputs()
    a = m.generate(ids, attention_mask=am, max_new_tokens=5, do_sample=False)
    m.forward.why_not = lambda: "off"
    b = m.generate(ids, attention_mask=am, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b) and len(calls) == 4


def test_not_selected(recorded):
    """Outside generate, with outputs the graph does not produce, or another cache class."""
    m, calls = recorded
    ids, am = _inputs(pad=False)
    with torch.no_grad():
        m(input_ids=ids, attention_mask=am)                       # not in generate
    m.generate(ids, attention_mask=am, max_new_tokens=3, do_sample=False,
               output_attentions=True, return_dict_in_generate=True)
    m.generate(ids, attention_mask=am, max_new_tokens=3, do_sample=False,
               cache_implementation="static")
    assert calls == []


def test_why_decode_steps_run_eagerly_is_in_the_report():
    """On CUDA, pages that the reference writes (int4 with a bf16 residual) keep generate's
    decode steps off CUDA graphs: kvcompile.report says so, once, with the reason. Negative:
    bf16 pages and the 4-bit format (int4, channel-scaled keys, pages of 64: kernel-written
    since append14i) give no such note; nor does a head_dim the decode kernel does not take
    (16: its steps would run the reference, which reads the capture's host lengths). The
    device is a CUDA one on paper only (the check reads the pool's formats, not the GPU)."""
    notes = {}
    int4 = dict(kv_dtype="int4", scale_granularity="channel", page_size=64, kernels="auto")
    bf16 = dict(kv_dtype="bf16", kernels="auto")
    for name, kw in (("int4_residual", dict(int4, residual=True)), ("int4", int4),
                     ("bf16", bf16), ("bf16_d16", bf16)):
        torch._dynamo.reset()
        m = make_hf("llama", "sdpa") if name == "bf16_d16" else make_llama64()
        kvcompile.compile(m, config(**kw))
        ids, am = _inputs(pad=False)
        with torch.no_grad():
            m(input_ids=ids, attention_mask=am)
        fwd = m.forward
        fwd.state.device = torch.device("cuda")
        fwd._why_not = None
        reason = fwd.why_not()
        fwd._why_not = None
        fwd.why_not()                                   # asked again: noted once
        rep = kvcompile.report(m)
        notes[name] = (reason, [n for n in rep.kernel_notes if n.startswith("generate:")])
        assert all(n in str(rep) for n in notes[name][1])
    reason, found = notes["int4_residual"]
    assert reason is not None and "residual pages are written by the reference" in reason
    assert found == [f"generate: decode steps run eagerly, without CUDA graphs ({reason})"]
    assert notes["int4"] == (None, [])
    assert notes["bf16"] == (None, [])
    reason, found = notes["bf16_d16"]
    assert reason == ("pages of head_dim 16 / page_size 16: the decode kernel takes head_dim "
                      "(64, 128, 256), page_size (8, 16, 32, 64, 128)"), reason
    assert len(found) == 1
