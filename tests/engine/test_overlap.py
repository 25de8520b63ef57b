"""Overlapped engine steps (engine/overlap.py) against the synchronous loop, on the CPU.

The same requests arrive at the same step() calls of two engines over one model, one with
`async_steps=True` (opt-in), one with False. Every request must end with the same
tokens, text, finish reason and logprobs: stop conditions found one step late (EOS, stop
token ids, stop strings, max_tokens, min_tokens), seeded sampling, preemption under a tiny
pool, aborts while a step is in flight. The async engine must really overlap (steps launched
before the previous step was read). A feed that gives a step the tokens of the step before
the previous one (one step stale) must change the outputs.
"""

from __future__ import annotations

import random

import pytest
import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.engine import overlap
from kvcompile.testing import ASSERT_CLOSE
from tests.engine.tiny import byte_tokenizer, config, make_hf, random_prompts

PAGE = 8


@pytest.fixture(scope="module")
def model():
    """24 pages of 8 tokens: a batch of the tests' requests does not fit (preemption)."""
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(kv_dtype="bf16", page_size=PAGE, max_kv_bytes=24 * 2048))
    return m


def _requests(sync_engine, rng, n=8):
    """Prompts with mixed sampling and stop conditions; the stop token / string of some is
    taken from what the synchronous engine generates, so that they fire mid-output."""
    reqs = []
    for i, p in enumerate(random_prompts(rng, n, 1, 30)):
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 14), ignore_eos=True)
        elif kind == 1:
            sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=rng.randrange(99),
                                max_tokens=12, logprobs=True, ignore_eos=True)
        else:
            free = sync_engine.generate([p], SamplingParams(temperature=0, max_tokens=12,
                                                            ignore_eos=True))[0]
            if kind == 2:   # a stop token id at its 5th output token, min_tokens before it
                sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=2,
                                    stop_token_ids=(free.token_ids[4],))
            else:           # a stop string from the middle of its text
                sp = SamplingParams(temperature=0, max_tokens=12, stop=[free.text[3:5]])
        reqs.append((p, sp))
    return reqs


def _run(eng, reqs, arrivals, abort_at=None):
    """Each request added at its step() call; returns [(tokens, text, reason, logprobs)]."""
    final, ids, step = {}, {}, 0

    def done(i):
        def on_output(o):
            assert overlap.PLACEHOLDER not in o.token_ids
            if o.finished:
                final[i] = (o.token_ids, o.text, o.finish_reason, o.logprobs)
        return on_output

    while len(final) < len(reqs):
        for i, (p, sp) in enumerate(reqs):
            if arrivals[i] == step:
                ids[i] = eng.add_request(p, sp, on_output=done(i))
        if abort_at is not None and step == abort_at[1]:
            assert eng.abort(ids[abort_at[0]])
        eng.step()
        step += 1
        assert step < 500
    assert not eng.has_unfinished()
    return [final[i] for i in range(len(reqs))]


def _same(got, want):
    """Tokens, text and finish reasons exactly; logprobs to fp32 rounding (a step after a
    request stopped on a token not read yet carries its row too: a batch of another size,
    whose matmuls may round otherwise, overlap.py)."""
    assert [g[:3] for g in got] == [w[:3] for w in want]
    atol, rtol = ASSERT_CLOSE[torch.float32]
    for g, w in zip(got, want):
        if w[3] is not None:
            torch.testing.assert_close(torch.tensor(g[3]), torch.tensor(w[3]), atol=atol,
                                       rtol=rtol)


def _pair(model, **kw):
    tok = byte_tokenizer()
    return (Engine(model, tok, async_steps=True, **kw),
            Engine(model, tok, async_steps=False, **kw))


def test_outputs_match_the_synchronous_loop(model):
    rng = random.Random(1)
    fast, slow = _pair(model, max_num_batched_tokens=48, max_num_seqs=5)
    free = fast.pool.num_free
    reqs = _requests(slow, rng)
    arrivals = sorted(rng.randrange(0, 12) for _ in reqs)
    base = slow.stats.steps
    want = _run(slow, reqs, arrivals)
    got = _run(fast, reqs, arrivals)
    _same(got, want)
    reasons = {r for _, _, r, _ in want}
    assert reasons == {"stop", "length"}, reasons
    assert fast.stats.launched_steps > 0 and fast.stats.sync_reasons == {}
    # most decode steps were queued before the step before them was read back
    assert fast.stats.overlapped_steps >= (slow.stats.steps - base) // 3
    fast.close()
    slow.close()
    assert fast.pool.num_free == free   # no page leaked (both engines share the model's pool)


def test_a_one_step_stale_feed_changes_outputs(model, monkeypatch):
    """Negative: feeding each decode the tokens of the step before the previous one."""
    rng = random.Random(3)
    fast, slow = _pair(model, max_num_batched_tokens=64)
    reqs = [(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
            for p in random_prompts(rng, 4, 5, 20)]
    want = _run(slow, reqs, [0] * 4)
    real, older = overlap.feed_for, {}

    def stale(out, pending):
        feed = real(out, pending)
        prev = older.get("prev")
        if feed is not None and prev is not None and prev.shape == feed.tokens.shape:
            feed = overlap.TokenFeed(prev, feed.rows, feed.src)
            older["stale"] = older.get("stale", 0) + 1
        older["prev"] = pending.tokens if pending is not None else None
        return feed

    monkeypatch.setattr(overlap, "feed_for", stale)
    got = _run(fast, reqs, [0] * 4)
    assert older["stale"] > 3 and got != want
    fast.close()
    slow.close()


def test_features_that_need_the_host_run_synchronously_and_say_so(model):
    eng = Engine(model, byte_tokenizer(), max_num_batched_tokens=64, async_steps=True)
    sp = SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3)
    ref = Engine(model, byte_tokenizer(), max_num_batched_tokens=64, async_steps=False)
    prompt = [5, 6, 7, 8, 9]
    assert eng.generate([prompt], sp)[0].token_ids == ref.generate([prompt], sp)[0].token_ids
    reason = overlap.request_reason(eng._requests.get("x") or _req(sp))
    assert eng.stats.sync_reasons.get(reason, 0) >= 4 and eng.stats.launched_steps == 0
    notes = [n for n in kvcompile.report(model).kernel_notes if "synchronously" in n]
    assert notes == [f"engine: steps run synchronously, not overlapped ({reason})"]
    eng.close()
    ref.close()


def _req(sp):
    from kvcompile.engine.request import Request

    return Request("x", [1], sp, None)


def test_preemption_and_abort_match(model):
    """Six requests of 5 pages in a pool of 24: preemption by recompute; one request aborted
    while a step of it is in flight."""
    rng = random.Random(2)
    fast, slow = _pair(model, max_num_batched_tokens=32, max_num_seqs=6,
                       enable_prefix_caching=False)
    reqs = [(p, SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True))
            for i, p in enumerate(random_prompts(rng, 6, 24, 28))]
    arrivals = [0, 0, 1, 1, 2, 2]
    want = _run(slow, reqs, arrivals, abort_at=(1, 6))
    got = _run(fast, reqs, arrivals, abort_at=(1, 6))
    assert slow.stats.preemptions > 0 and fast.stats.preemptions == slow.stats.preemptions
    # the aborted request: what it had delivered (its token in flight is dropped)
    assert got[1][2] == want[1][2] == "abort" and len(got[1][0]) >= 1
    assert want[1][0][:len(got[1][0])] == got[1][0] and len(want[1][0]) - len(got[1][0]) <= 1
    _same(got[:1] + got[2:], want[:1] + want[2:])
    fast.close()
    slow.close()
    assert fast.pool.num_free == slow.pool.num_free
