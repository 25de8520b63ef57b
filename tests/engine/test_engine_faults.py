"""The engine's fault paths: a failing forward fails only its request, a request that can never
be scheduled fails instead of hanging, request ids never collide, token ids are integers, and
bad lengths are refused up front. Every other request produces what it produces alone."""

from __future__ import annotations

import gc
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.engine import RequestError
from kvcompile.engine.inputs import max_model_len
from kvcompile.errors import CacheStateError
from tests.engine.tiny import config, make_hf, random_prompts

PAGE = 8
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
POISON = 7   # the first token of the request whose forward fails


@pytest.fixture(scope="module")
def model():
    """A tiny Llama (512 positions) over a pool of 24 pages of 8 tokens (192 tokens)."""
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=PAGE, max_kv_bytes=24 * 4096))
    return m


@pytest.fixture(scope="module")
def alone(model):
    eng = Engine(model, max_num_batched_tokens=128, enable_prefix_caching=False)
    memo = {}

    def run(prompt, params=GREEDY):
        key = (tuple(prompt), params)
        if key not in memo:
            memo[key] = eng.generate([prompt], params)[0].token_ids
        return memo[key]

    yield run
    eng.close()


def _clean(rng, n, lo=3, hi=20):
    return [[POISON + 1] + p for p in random_prompts(rng, n, lo, hi)]


def _inject(eng, fails):
    """Make the engine's forward raise whenever `fails(step_output)` says so."""
    real = eng.runner.forward
    calls = []

    def forward(out):
        calls.append(len(out.seqs))
        if fails(out):
            raise RuntimeError("injected fault")
        return real(out)

    eng.runner.forward = forward
    return calls


def test_failing_forward_fails_only_its_request(model, alone):
    rng = random.Random(0)
    clean = _clean(rng, 4)
    eng = Engine(model, max_num_batched_tokens=64)
    calls = _inject(eng, lambda out: any(s.req.prompt_ids[0] == POISON for s in out.seqs))
    bad = [POISON] + clean[0][1:]
    outs = eng.generate(clean[:2] + [bad] + clean[2:], GREEDY)
    assert outs[2].finish_reason == "error" and outs[2].token_ids == []
    assert "RuntimeError: injected fault" in outs[2].error
    assert [o.token_ids for o in outs[:2] + outs[3:]] == [alone(p) for p in clean]
    assert all(o.finish_reason == "length" for o in outs[:2] + outs[3:])
    assert max(calls) > 1 and 1 in calls          # the packed step failed, then ran alone
    assert eng.stats.requests_failed == 1
    eng.close()
    assert eng.pool.stats().pages_used == 0


def test_transient_fault_fails_nobody(model, alone):
    """A step that fails once (not because of any request): each request runs alone and
    advances, nobody fails, tokens are unchanged."""
    clean = _clean(random.Random(1), 3)
    eng = Engine(model, max_num_batched_tokens=64)
    left = [2]

    def once(out):
        if len(out.seqs) > 1 and left[0]:
            left[0] -= 1
            return True
        return False

    _inject(eng, once)
    outs = eng.generate(clean, GREEDY)
    assert left[0] == 0 and eng.stats.requests_failed == 0
    assert [o.token_ids for o in outs] == [alone(p) for p in clean]
    eng.close()


def test_max_model_len_against_the_models_positions(model):
    with pytest.raises(RequestError, match="exceeds the model's position limit 512"):
        Engine(model, max_model_len=4096)
    for bad in (1, 2.5, True):
        with pytest.raises(RequestError, match="max_model_len"):
            Engine(model, max_model_len=bad)
    state = SimpleNamespace(pool=SimpleNamespace(max_pages=1000, page_size=16),
                            config=SimpleNamespace(max_seq_len=None))
    gpt2 = SimpleNamespace(config=SimpleNamespace(n_positions=1024))   # GPT-2's name
    assert max_model_len(gpt2, state, None) == 1024
    with pytest.raises(RequestError, match="position limit 1024"):
        max_model_len(gpt2, state, 2048)
    state.config.max_seq_len = 300                 # KVConfig.max_seq_len: the pool's limit
    assert max_model_len(gpt2, state, None) == 300
    with pytest.raises(RequestError, match="exceeds KVConfig.max_seq_len=300"):
        max_model_len(gpt2, state, 512)
    eng = Engine(model, max_model_len=512)       # above the pool (192 tokens): per request
    with pytest.raises(RequestError, match="can never fit, even alone"):
        eng.add_request([5] * 100, SamplingParams(max_tokens=300))
    eng.close()


def test_pages_held_outside_fail_the_request_instead_of_hanging(model):
    """Another engine's prefix cache pins most of the pool: a request that cannot get its
    pages fails with the figures (it returned nothing for 300 steps before); the pool is fine
    once the other engine closes."""
    first = Engine(model, max_num_batched_tokens=256)
    eng = Engine(model, max_num_batched_tokens=64)
    try:
        pinned = first.generate([[9] * 160], SamplingParams(temperature=0, max_tokens=1,
                                                            ignore_eos=True))[0]
        assert pinned.finish_reason == "length" and len(first.prefix_cache) == 20
        rid = eng.add_request([5] * 60, GREEDY)
        outs = []
        for _ in range(5):
            outs += eng.step()
            if outs:
                break
        assert [o.request_id for o in outs] == [rid] and outs[0].finish_reason == "error"
        assert "can never be scheduled" in outs[0].error
        assert "20 page(s) are held outside this engine" in outs[0].error
        assert not eng.has_unfinished()
    finally:
        first.close()
    assert eng.generate([[5] * 60], GREEDY)[0].finish_reason == "length"
    eng.close()
    assert eng.pool.stats().pages_used == 0


def test_a_live_hugging_face_cache_blocks_no_engine_forever(model):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.full((1, 170), 5), past_key_values=cache)    # 22 of 24 pages
    eng = Engine(model, max_num_batched_tokens=64)
    try:
        out = eng.generate([[5] * 40], GREEDY)[0]
        assert out.finish_reason == "error" and "22 page(s) are held outside" in out.error
    finally:
        del cache
        gc.collect()
    assert eng.generate([[5] * 40], GREEDY)[0].finish_reason == "length"
    eng.close()


def test_automatic_ids_skip_explicit_ones_and_generate_leaves_nothing_queued(model):
    eng = Engine(model, max_num_batched_tokens=64)
    assert eng.add_request([5, 6], GREEDY) == "0"
    assert eng.add_request([5, 6], GREEDY, request_id="1") == "1"
    assert eng.add_request([5, 6], GREEDY) == "2"            # not "1" again
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request([5, 6], GREEDY, request_id="2")
    while eng.has_unfinished():
        eng.step()
    before = eng.stats.requests_added
    with pytest.raises(RequestError, match="prompt is empty"):
        eng.generate([[5, 6], [7, 8], []], GREEDY)           # the third is bad
    assert not eng.has_unfinished() and not eng._requests
    assert eng.pool.stats().sequences == 0 and eng.stats.requests_added == before + 2
    eng.close()


@pytest.mark.parametrize("prompt", [[1.0, 2.0], [5, 2.7], [True, 5], torch.tensor([1.5, 2.0]),
                                    torch.tensor([True, False]), np.array([3.0, 4.0])])
def test_float_and_bool_token_ids_are_refused(model, prompt):
    eng = Engine(model)
    with pytest.raises(RequestError, match="token ids must be ints"):
        eng.add_request(prompt, GREEDY)
    with pytest.raises(RequestError, match="token ids must be ints"):
        eng.generate(prompt, GREEDY)
    with pytest.raises(RequestError, match="token ids must be ints"):
        eng.add_request([[5, 6]], GREEDY)                      # a batch is not a prompt
    assert not eng.has_unfinished()
    # integer tensors and numpy integers are token ids
    for ok in (torch.tensor([5, 6]), np.array([5, 6]), [np.int64(5), 6]):
        assert eng.generate(ok, GREEDY)[0].finish_reason == "length"
    eng.close()


def test_attach_refuses_a_page_twice(model):
    pool = kvcompile.api.state_of(model).pool
    a, b = pool.allocate(2)
    pool.reserve([a], 2 * PAGE)
    pages = pool.pages_of(a)
    with pytest.raises(CacheStateError, match="listed twice"):
        pool.attach(b, [pages[0], pages[0]])
    assert pool.refcount(pages[0]) == 1 and pool.seq_len(b) == 0
    pool.free([a, b])
    pool.check_invariants()
