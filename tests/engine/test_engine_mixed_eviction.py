"""Engine steps that pack prompt chunks with the decode rows of sequences already evicted.

A long prompt is prefilled in chunks (the step's token budget) while shorter requests, whose
prompts ended and were evicted, decode in the same steps. Those prompt chunks must attend
through the plain paged path (the kernels of a step without eviction), not through the eviction
runtime's fp32 attention over every query of every row (`attend.attend_kept`): at 32k-token
prompts that fallback took a step from seconds to minutes (benchmarks/RESULTS.md, "Eighth
session": TTFT 102 s against 9.8 s). Only the evicted rows attend over their kept slots.
"""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.api import state_of
from kvcompile.config import H2O, SinkWindow, SnapKV
from kvcompile.engine import faults
from kvcompile.eviction import runtime as rt_mod
from kvcompile.eviction.runtime import EvictionRuntime
from tests.engine.test_engine_eviction import _generate
from tests.engine.tiny import config, make_hf, make_llama64

PAGE = 8
# one long prompt (chunked by the 16-token budget) after short ones that evict and decode
PROMPTS = [[3 + (7 * i) % 90 for i in range(18)], [5 + (11 * i) % 90 for i in range(20)],
           [4 + (13 * i) % 90 for i in range(70)]]


def _model(policy, kernels="reference", head64=False):
    torch._dynamo.reset()
    m = make_llama64() if head64 else make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=PAGE, kv_dtype="fp32", eviction=policy,
                                kernels=kernels))
    _generate(m, [[5, 6, 7]], 2)
    state_of(m).eviction.sink_positions = "original"
    return m


def _run(m, n=10, policy="model"):
    """Tokens, the (queries, observation rows) of every fp32 attention over kept slots, and
    whether a step packed a prompt chunk with a decode row."""
    calls = []
    real = rt_mod.attend_kept

    def spy(q, *a, **kw):
        calls.append((q.shape[1], kw.get("obs_rows", 0)))
        return real(q, *a, **kw)

    def no_retry(_eng, _out, e, _changed):   # a failing step must fail the test, not retry
        raise e

    eng = Engine(m, max_num_batched_tokens=16, enable_prefix_caching=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rt_mod, "attend_kept", spy)
        mp.setattr(faults, "forward_failed", no_retry)
        outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n,
                                                    ignore_eos=True, eviction=policy))
    mixed = any(s.prefill_tokens and s.decode_tokens for s in eng.history)
    eng.close()
    return [o.token_ids for o in outs], calls, mixed


def _full_chunks(calls) -> list:
    """Calls that attend several queries beyond an observation window: prompt chunks."""
    return [(s, r) for s, r in calls if s > 1 and s != r]


@pytest.mark.parametrize("policy", [SinkWindow(2, 10), SnapKV(budget=12, window=3)],
                         ids=["sinkwindow", "snapkv"])
def test_prompt_chunks_beside_evicted_rows_attend_plain(policy, monkeypatch):
    m = _model(policy)
    want = [_generate(m, [p], 10)[0] for p in PROMPTS]
    got, calls, mixed = _run(m)
    assert mixed, "the workload must pack a prompt chunk with a decode row"
    assert got == want
    assert not _full_chunks(calls), f"prompt chunks went to the fp32 reference: {calls}"
    assert calls, "the evicted rows attend over their kept slots"
    # negative: the all-rows fallback (what every mixed step did before) is seen by the spy
    monkeypatch.setattr(EvictionRuntime, "plain_rows",
                        lambda self, plan, layer: [False] * plan.batch)
    forced, calls_f, _ = _run(m)
    assert forced == want
    assert _full_chunks(calls_f)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_h2o_prompt_chunks_attend_plain_and_add_up_their_mass(kernels, monkeypatch):
    """H2O prompt chunks attend through the plain path too, their mass added up apart
    (`EvictionRuntime.prompt_mass`: attend.prompt_mass on the CPU, kernels/prompt_mass.py with
    the Triton kernels); the decode rows' mass still comes from the decode path. Same tokens
    as the old path (every row of a mixed step over its kept slots in fp32), which the
    negative run forces and the spy sees."""
    m = _model(H2O(budget=12, recent=4, sinks=2), kernels=kernels, head64=kernels == "triton")
    st = state_of(m)
    which = "kernel" if kernels == "triton" else "torch"
    with monkeypatch.context() as mp:
        mp.setattr(EvictionRuntime, "plain_rows",
                   lambda self, plan, layer: [False] * plan.batch)
        want, calls_f, _ = _run(m, 8)
    assert _full_chunks(calls_f)   # negative: the old path attends chunks in fp32
    before = st.counters.get(f"eviction_prompt_mass_{which}", 0)
    got, calls, mixed = _run(m, 8)
    assert mixed and got == want
    assert not _full_chunks(calls), f"prompt chunks went to the fp32 reference: {calls}"
    assert st.counters.get(f"eviction_prompt_mass_{which}", 0) > before


def test_decode_rows_of_a_mixed_step_use_the_decode_kernel():
    """With the Triton kernels (the interpreter here), an evicted sequence's decode row in a
    step with prompt chunks runs the paged decode kernel over its kept slots (the window's
    hidden slots masked), a batch of its own, not the fp32 gather; same tokens."""
    pol = SinkWindow(2, 10)
    want, _, _ = _run(_model(pol, head64=True))
    m = _model(pol, kernels="triton", head64=True)   # (head_dim 64: the kernels' smallest)
    st = state_of(m)
    before = st.counters.get("eviction_kernel_decode_rows", 0)
    got, calls, mixed = _run(m)
    assert mixed and got == want
    assert st.counters.get("eviction_kernel_decode_rows", 0) > before
    assert not calls, f"rows went to the fp32 reference: {calls}"


@pytest.mark.parametrize("policy", [SinkWindow(2, 10), SnapKV(budget=12, window=3)],
                         ids=["sinkwindow", "snapkv"])
def test_decode_kernel_reads_the_kept_length(policy, monkeypatch):
    """After eviction the decode kernel is called with the kept lengths (`seq_lens`, which
    both decode kernels split; the table's width only sets the split count), never the
    prompt's: SinkWindow at most budget + interval - 1 tokens plus its hidden slots (the rest
    of the sinks' page and at most one page past it), SnapKV its budget + the new tokens."""
    from kvcompile.kernels import decode

    m = _model(policy, kernels="triton", head64=True)
    lens = []
    real = decode.paged_decode_attention

    def spy(q, kc, vc, tables, seq_lens, *a, **kw):
        lens.append(max(seq_lens.tolist()))
        return real(q, kc, vc, tables, seq_lens, *a, **kw)

    monkeypatch.setattr(decode, "paged_decode_attention", spy)
    eng = Engine(m, max_num_batched_tokens=256, enable_prefix_caching=False,
                 eviction_interval=4)
    eng.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    eng.close()
    assert len(lens) == 9 * len(m.model.layers)
    if isinstance(policy, SinkWindow):
        bound = 12 + 4 - 1 + 2 * PAGE - 1 - policy.sinks
    else:   # SnapKV chooses once, at the prompt's end: its budget, then the new tokens
        bound = 12 + 10 - 1
    assert max(lens) <= bound < len(PROMPTS[2]), lens
