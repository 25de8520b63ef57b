"""SinkWindow with its sinks at their text positions evicts without moving a token
(eviction/runtime.py `_evict_window`): the pages between the sinks and the window leave the
sequence and go back to the pool, the tokens left between them are hidden from attention.

Checked against the same requests evicted by compaction (tokens moved into the front, the
previous path) and against attention over the hidden slots marked as holes on the host
(`attend_kept`: the masked reference): same tokens, logits within the fp32 tolerance."""

from __future__ import annotations

import random

import pytest
import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.api import state_of
from kvcompile.config import SinkWindow
from kvcompile.testing import ASSERT_CLOSE
from tests.engine.test_engine_eviction import _NoHostSync
from tests.engine.tiny import config, make_hf, random_prompts

PAGE = 8
POLICY = SinkWindow(3, 13)


def _model(kv_dtype: str):
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    # (fp8 with token scales: compaction moves its tokens exactly, so both paths hold the
    # same values)
    kvcompile.compile(m, config(page_size=PAGE, kv_dtype=kv_dtype, eviction=POLICY,
                                scale_granularity="token"))
    Engine(m, max_num_batched_tokens=64).close()   # compiled, the pool built
    state_of(m).eviction.sink_positions = "original"
    return m


def _run(m, prompts, pols, mode: str, n: int = 24, interval: int = 4):
    """Greedy tokens, the logits of every step per request, the counters' change and the
    fewest free pages, evicting as `mode` says: "window" (no token moves, steps aside),
    "holes" (no token moves, the host's attend_kept over holes: the masked reference; the
    host path evicts after every step, so compare it at interval 1), "compact" (tokens moved
    into the front: the previous path)."""
    st = state_of(m)
    rt = st.eviction
    eng = Engine(m, max_num_batched_tokens=64, eviction_interval=interval)
    logits = {}
    fwd = eng.runner.forward

    def forward(out):
        lg = fwd(out)
        for s, row in zip(out.seqs, lg):
            logits.setdefault(s.req.id, []).append(row.clone())
        return lg

    eng.runner.forward = forward
    step = rt.after_decode_step

    def step_checked(seq_ids):
        with _NoHostSync():
            step(seq_ids)

    if mode == "window":   # (the host path of "holes" reads counts)
        rt.after_decode_step = step_checked
    if mode == "holes":
        rt.decode_aside = lambda seq_ids: False
    if mode == "compact":
        rt._window_policy = lambda *a: None
    before = dict(st.counters)
    try:
        outs = eng.generate(prompts, [SamplingParams(temperature=0, max_tokens=n,
                                                     ignore_eos=True, eviction=p)
                                      for p in pols])
    finally:
        for name in ("after_decode_step", "decode_aside", "_window_policy"):
            rt.__dict__.pop(name, None)
    delta = {k: st.counters.get(k, 0) - before.get(k, 0) for k in st.counters}
    free = min(s.pages_free for s in eng.history)
    eng.pool.check_invariants()
    eng.close()
    assert eng.pool.stats().pages_used == 0
    return [o.token_ids for o in outs], logits, delta, free


def _same(a, b) -> None:
    assert a[0] == b[0]
    atol, rtol = ASSERT_CLOSE[torch.float32]
    for rid, want in b[1].items():
        torch.testing.assert_close(torch.stack(a[1][rid]), torch.stack(want), atol=atol,
                                   rtol=rtol, msg=lambda s, rid=rid: f"request {rid}: {s}")


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3"])
def test_window_eviction_equals_compaction_and_masked_reference(kv_dtype):
    m = _model(kv_dtype)
    prompts = random_prompts(random.Random(11), 3, 20, 45)
    pols = ["model", SinkWindow(2, 9), SinkWindow(9, 12)]   # sinks past a page, too
    # every 4 steps: against compaction
    window, compact = (_run(m, prompts, pols, mode) for mode in ("window", "compact"))
    _same(window, compact)
    d = window[2]
    assert d.get("eviction_window_runs", 0) >= 3 * 4 and d.get("evicted_pages", 0) > 0
    assert d.get("eviction_aside_steps", 0) >= 20   # (steps, each of every request)
    assert not d.get("eviction_moves") and not d.get("eviction_moved_slots"), "tokens moved"
    assert not compact[2].get("eviction_window_runs")
    assert compact[2].get("eviction_device_runs", 0) > 0
    assert d["evicted_tokens"] == compact[2]["evicted_tokens"]
    # hidden slots cost at most two pages a sequence over compaction's layout
    assert window[3] >= compact[3] - 2 * len(prompts)
    # every step: against the host's attention over the hidden slots as holes, and compaction
    window, holes, compact = (_run(m, prompts, pols, mode, interval=1)
                              for mode in ("window", "holes", "compact"))
    _same(window, holes)
    _same(window, compact)
    assert holes[2]["eviction_window_runs"] == window[2]["eviction_window_runs"] > 0
    assert not holes[2].get("eviction_aside_steps")


def test_window_eviction_changes_nothing_it_does_not_evict():
    """Sensitivity: with the hidden slots shown to the kernel (the mask's width 0) the window
    path's logits differ from the masked reference's, so the test above can fail."""
    import kvcompile.eviction.runtime as R

    m = _model("fp32")
    prompts = random_prompts(random.Random(12), 2, 30, 40)
    want = _run(m, prompts, ["model", "model"], "holes", n=12, interval=1)
    inputs = R.EvictionRuntime.aside_inputs

    def unmasked(self, seq_ids, device):
        spec, *rows = inputs(self, seq_ids, device)
        return (type(spec)(spec.mass_len, spec.sinks, 0), *rows)

    R.EvictionRuntime.aside_inputs = unmasked
    try:
        got = _run(m, prompts, ["model", "model"], "window", n=12, interval=1)
    finally:
        R.EvictionRuntime.aside_inputs = inputs
    diff = max((torch.stack(got[1][r]) - torch.stack(want[1][r])).abs().max().item()
               for r in want[1])
    assert diff > 1e-3


def test_window_eviction_in_generate_with_beams():
    """HF generate with beam search forks evicted sequences (pages shared): the window path
    gives the compaction path's tokens, and the pool stays consistent."""
    m = _model("fp32")
    rt = state_of(m).eviction
    ids = torch.randint(3, 200, (2, 30), generator=torch.Generator().manual_seed(13))
    outs = []
    for compact in (False, True):
        if compact:
            rt._window_policy = lambda *a: None
        before = dict(state_of(m).counters)
        try:
            outs.append(m.generate(ids, max_new_tokens=12, num_beams=2, num_return_sequences=2,
                                   do_sample=False, pad_token_id=0, eos_token_id=None))
        finally:
            rt.__dict__.pop("_window_policy", None)
        runs = state_of(m).counters.get("eviction_window_runs", 0) - \
            before.get("eviction_window_runs", 0)
        assert (runs > 0) != compact
        state_of(m).pool.check_invariants()
    assert torch.equal(outs[0], outs[1])
