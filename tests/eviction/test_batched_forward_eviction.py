"""after_forward's evictions through the batched pass (EvictionRuntime._batched -> front.py):
the end of a prompt and host-path decode steps of every sequence at once, with no
per-sequence host loop. It runs where host syncs cost (CUDA); here it is forced on the CPU
(runtime.BATCH_ON_CPU) and compared with the per-sequence path (`evict`): the same tokens
kept in every layer and head, the same logits, the same generated tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcompile.api import state_of
from kvcompile.config import H2O, SinkWindow, SnapKV
from kvcompile.eviction import runtime as R
from tests.eviction.test_end_to_end import V, _compiled, _sid

POLICIES = [SnapKV(budget=12, window=4, kernel=3),                  # shared by heads
            SnapKV(budget=12, window=4, kernel=3, per_head=True),
            SnapKV(budget=12, window=4, kernel=3, hold=True),
            H2O(budget=12, recent=4, sinks=2),
            SinkWindow(2, 10)]                                      # re-rotated: compacts


def _run(policy, batched: bool, monkeypatch, **kw):
    monkeypatch.setattr(R, "BATCH_ON_CPU", batched)
    m = _compiled(policy, **kw)
    ids = torch.randint(1, V, (1, 36), generator=torch.Generator().manual_seed(11))
    cache, outs = DynamicCache(), []
    with torch.no_grad():
        outs.append(m(input_ids=ids[:, :24], past_key_values=cache).logits[0])
        for t in range(24, 36):
            outs.append(m(input_ids=ids[:, t:t + 1], past_key_values=cache).logits[0])
    st = state_of(m)
    book = st.eviction.books[_sid(cache)]
    kept = {li: [sorted(int(x) for x in row if x >= 0) for row in p]
            for li, p in book.pos.items()}
    return torch.cat(outs), kept, dict(st.counters)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: repr(p)[:40])
def test_batched_forward_eviction_equals_per_sequence(policy, monkeypatch):
    out_b, kept_b, c_b = _run(policy, True, monkeypatch, kv_dtype="fp8_e4m3")
    out_h, kept_h, c_h = _run(policy, False, monkeypatch, kv_dtype="fp8_e4m3")
    assert kept_b == kept_h, "a different choice of tokens"
    assert c_b.get("eviction_device_runs", 0) > 0 and not c_h.get("eviction_device_runs")
    assert c_b["evicted_tokens"] == c_h["evicted_tokens"]
    torch.testing.assert_close(out_b, out_h, rtol=0, atol=0)


@pytest.mark.parametrize("cells", [None, 1], ids=["one pass", "a pass per sequence"])
def test_batched_generate_equals_per_sequence(monkeypatch, cells):
    """Three prompts of one batch (SnapKV shared by heads, int4 channel keys: moved tokens
    re-encoded on the device) evicted together at the prompt's end, in one pass or split in
    passes (front.MAX_CELLS): generate's tokens equal the per-sequence path's."""
    from kvcompile.eviction import front

    if cells is not None:
        monkeypatch.setattr(front, "MAX_CELLS", cells)
    ids = torch.randint(1, V, (3, 30), generator=torch.Generator().manual_seed(12))
    toks = {}
    for batched in (True, False):
        monkeypatch.setattr(R, "BATCH_ON_CPU", batched)
        m = _compiled(SnapKV(budget=14, window=4, kernel=3), kv_dtype="int4",
                      scale_granularity="channel", page_size=32)
        with torch.no_grad():
            toks[batched] = m.generate(ids, max_new_tokens=10, do_sample=False,
                                       pad_token_id=0)
        runs = state_of(m).counters.get("eviction_device_runs", 0)
        assert (runs == 3) if batched else runs == 0
    assert torch.equal(toks[True], toks[False])
