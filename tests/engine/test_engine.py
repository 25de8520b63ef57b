"""The continuous-batching engine against running each request alone.

Requests arrive at random steps with random lengths and sampling settings; prefill is chunked
under a small token budget; a tiny pool forces preemption (recompute and swap); prompts share
prefixes. Every request must produce exactly the tokens it produces alone, shared pages must
never be written, and no page may leak.
"""

from __future__ import annotations

import random

import pytest
import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.api import state_of
from tests.engine.tiny import config, hf_greedy, make_hf, random_prompts

PAGE = 8


@pytest.fixture(scope="module")
def model():
    """fp32 tiny Llama, bf16 pages of 8 tokens, a roomy pool (512 pages)."""
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(kv_dtype="bf16", page_size=PAGE, max_kv_bytes=1 << 20))
    return m


@pytest.fixture(scope="module")
def alone(model):
    """Runs one request at a time through an engine without prefix caching; memoized."""
    eng = Engine(model, max_num_batched_tokens=512, enable_prefix_caching=False)
    memo = {}

    def run(prompt, params):
        key = (tuple(prompt), params)
        if key not in memo:
            out = eng.generate([prompt], params)[0]
            memo[key] = (out.token_ids, out.finish_reason)
        return memo[key]

    return run


def _params(rng, max_tokens=None):
    n = max_tokens or rng.randrange(1, 20)
    if rng.random() < 0.5:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return SamplingParams(temperature=rng.choice([0.7, 1.0, 1.3]), top_k=rng.choice([0, 20]),
                          top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(1 << 30),
                          max_tokens=n, ignore_eos=True)


def _run_arrivals(eng, reqs, rng, check_step=None):
    """Add each (prompt, params) at a random step; returns {index: RequestOutput}."""
    arrival = sorted(rng.randrange(0, 3 * len(reqs)) for _ in reqs)
    final, ids, step = {}, {}, 0
    while len(final) < len(reqs):
        for i, (p, sp) in enumerate(reqs):
            if arrival[i] == step or (arrival[i] < step and i not in ids):
                ids[i] = eng.add_request(p, sp)
        outs = eng.step()
        if check_step is not None:
            check_step(eng, outs)
        for o in outs:
            if o.finished:
                i = next(k for k, v in ids.items() if v == o.request_id)
                final[i] = o
        step += 1
        assert step < 5000
    return final


@pytest.mark.parametrize("arrays", [False, True], ids=["lists", "arrays"])
def test_matches_each_request_alone(model, alone, arrays, monkeypatch):
    # arrays: every step's ids and positions built as arrays (runner.LARGE_STEP_TOKENS, the
    # path of large prompt steps), decode steps and chunks with sampled tokens included
    if arrays:
        from kvcompile.engine import runner

        monkeypatch.setattr(runner, "LARGE_STEP_TOKENS", 1)
    rng = random.Random(0)
    reqs = [(p, _params(rng)) for p in random_prompts(rng, 16, 1, 70)]
    eng = Engine(model, max_num_batched_tokens=40, max_num_seqs=6)
    budget_ok = []
    final = _run_arrivals(eng, reqs, rng,
                          lambda e, _: budget_ok.append(
                              e.history[-1].prefill_tokens + e.history[-1].decode_tokens <= 40))
    for i, (p, sp) in enumerate(reqs):
        toks, reason = alone(p, sp)
        assert final[i].token_ids == toks, f"request {i} differs from its run alone"
        assert final[i].finish_reason == reason == "length"
        assert len(toks) == sp.max_tokens
    assert all(budget_ok)
    assert max(s.num_running for s in eng.history) == 6  # max_num_seqs reached
    chunked = [s for s in eng.history if s.prefill_tokens and s.decode_tokens]
    assert chunked, "no step mixed prefill chunks with decodes"
    eng.close()
    assert state_of(model).pool.stats().sequences == 0


def test_engine_greedy_matches_eager_hugging_face():
    """fp32 pages: the engine's greedy tokens are eager HF's (sdpa and eager attention, GPT-2
    with learned positions), prompts packed together."""
    rng = random.Random(1)
    prompts = random_prompts(rng, 4, 3, 30)
    for family, attn in (("llama", "eager"), ("gpt2", "sdpa")):
        torch._dynamo.reset()
        ref = make_hf(family, attn)
        m = make_hf(family, attn)
        eng = Engine(m, config=config(page_size=PAGE), max_num_batched_tokens=64)
        outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(ref, p, 12), (family, attn)
        assert state_of(m).graphs <= 2, "T and the number of sequences must not recompile"


def test_long_prompt_never_stalls_decodes(model):
    eng = Engine(model, max_num_batched_tokens=24)
    rng = random.Random(2)
    short = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
             for p in random_prompts(rng, 3, 4, 8)]
    for _ in range(3):
        eng.step()
    eng.add_request(random_prompts(rng, 1, 200, 200)[0],
                    SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    prefill_steps = 0
    for _ in range(12):
        outs = {o.request_id: o for o in eng.step()}
        st = eng.history[-1]
        assert all(len(outs[r].new_token_ids) == 1 for r in short), "a decode was stalled"
        if st.prefill_tokens:
            prefill_steps += 1
            assert st.decode_tokens == 3 and st.prefill_tokens <= 24 - 3
    assert prefill_steps >= 8  # the 200-token prompt went through in chunks
    eng.close()


@pytest.mark.parametrize("mode,prefix", [("recompute", True), ("swap", False)])
def test_preemption_under_a_tiny_pool_changes_no_output(mode, prefix):
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    # 24 pages of 8 tokens: each request fits alone, the batch does not
    kvcompile.compile(m, config(kv_dtype="bf16", page_size=PAGE, max_kv_bytes=24 * 2048))
    rng = random.Random(3)
    reqs = [(p, _params(rng, max_tokens=rng.randrange(20, 40)))
            for p in random_prompts(rng, 8, 20, 60)]
    ref = Engine(m, max_num_batched_tokens=128, enable_prefix_caching=False)
    expect = [ref.generate([p], sp)[0].token_ids for p, sp in reqs]
    assert ref.stats.preemptions == 0
    eng = Engine(m, max_num_batched_tokens=48, preemption_mode=mode,
                 enable_prefix_caching=prefix)
    assert eng.pool.num_pages == 24
    final = _run_arrivals(eng, reqs, rng,
                          lambda e, _: e.pool.check_invariants())
    for i in range(len(reqs)):
        assert final[i].token_ids == expect[i], f"request {i} changed by preemption"
    assert eng.stats.preemptions > 0
    assert sum(o.num_preemptions for o in final.values()) == eng.stats.preemptions
    if mode == "swap":
        assert max(s.num_swapped for s in eng.history) > 0
        assert eng.scheduler.swap_used == 0
    assert kvcompile.stats(m)["preemptions"] == eng.stats.preemptions
    eng.close()
    assert eng.pool.stats().pages_used == 0


def test_prefix_cache_hits_and_never_writes_shared_pages(model, alone):
    eng = Engine(model, max_num_batched_tokens=64)
    pool = eng.pool
    written_shared = []
    write = pool.write

    def spy(layer, slots, k, v, *args, **kwargs):
        pages = set((slots // pool.page_size).tolist())
        shared = [p for p in pages if pool.refcount(p) > 1 or p in eng.prefix_cache.pages()]
        written_shared.extend(shared)
        return write(layer, slots, k, v, *args, **kwargs)

    pool.write = spy
    try:
        rng = random.Random(4)
        system = random_prompts(rng, 1, 43, 43)[0]   # 5 full pages + 3 tokens
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        first = eng.generate([system + [7, 8, 9]], sp)[0]
        assert first.num_cached_tokens == 0
        prompts = [system + random_prompts(rng, 1, 1, 20)[0] for _ in range(6)]
        outs = eng.generate(prompts, sp)
        assert [o.num_cached_tokens for o in outs] == [40] * 6
        for p, o in zip(prompts, outs):
            assert o.token_ids == alone(p, sp)[0]
        again = eng.generate([prompts[0] + outs[0].token_ids[:5]], sp)[0]  # a follow-up turn
        assert again.num_cached_tokens >= len(prompts[0]) // PAGE * PAGE
        assert again.token_ids == alone(prompts[0] + outs[0].token_ids[:5], sp)[0]
        assert not written_shared, f"shared pages written: {sorted(set(written_shared))}"
        hit = eng.prefix_cache.hit_rate
        assert 0.5 < hit < 1 and kvcompile.stats(model)["prefix_cache_hit_rate"] > 0
        assert eng.history[-1].prefix_hit_rate == hit
    finally:
        pool.write = write
    eng.close()
    pool.check_invariants()
    assert pool.stats().sequences == 0 and pool.stats().pages_used == 0


def test_no_page_leak_after_thousands_of_requests():
    """2,000 requests through a 24-page pool: shared prefixes, preemptions, LRU eviction of
    cached pages, aborts. At the end the pool holds only the prefix cache, then nothing."""
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=PAGE, max_kv_bytes=24 * 4096))
    eng = Engine(m, max_num_batched_tokens=256, max_num_seqs=48)
    assert eng.pool.num_pages == 24
    rng = random.Random(5)
    stems = random_prompts(rng, 12, 8, 24)
    live, added, aborted = [], 0, 0
    while added < 2000 or eng.has_unfinished():
        for _ in range(min(rng.randrange(0, 40), 2000 - added)):
            p = rng.choice(stems)[:rng.randrange(1, 25)] + random_prompts(rng, 1, 0, 6)[0]
            live.append(eng.add_request(p, SamplingParams(temperature=rng.choice([0, 1.0]),
                                                          max_tokens=rng.randrange(1, 6),
                                                          seed=added)))
            added += 1
        if live and rng.random() < 0.05:
            aborted += eng.abort(live.pop(rng.randrange(len(live))))
        eng.step()
    st = eng.pool.stats()
    assert st.sequences == 0 and st.pages_used == len(eng.prefix_cache)
    assert eng.stats.requests_finished == 2000 and aborted > 0
    assert eng.prefix_cache.evictions > 0 and eng.prefix_cache.hits > 0
    assert eng.stats.preemptions > 0
    eng.pool.check_invariants()
    eng.close()
    assert eng.pool.stats().pages_used == 0
    eng.pool.check_invariants()
