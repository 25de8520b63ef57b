"""Engine requests: bad input (clear errors, nothing else touched), NaN in one sequence,
streaming, stop strings / EOS / stop tokens / min_tokens with a tokenizer, abort, chat, step
statistics, and the packed step itself (the model's own mask does not matter)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.api import state_of
from kvcompile.engine import RequestError
from tests.engine.tiny import byte_tokenizer, config, make_hf, random_prompts

PAGE = 8
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=PAGE, max_kv_bytes=64 * 4096))  # 64 pages
    return m


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, byte_tokenizer(), max_num_batched_tokens=64)


def _snapshot(eng):
    s = eng.scheduler
    return (len(s.waiting), len(s.running), len(s.swapped), eng.pool.stats(),
            len(eng._requests), eng.stats.requests_added)


@pytest.mark.parametrize("prompt,params,match", [
    ([], GREEDY, "prompt is empty"),
    ("", GREEDY, "prompt is empty"),
    ([5, 300], GREEDY, "outside the vocabulary"),
    ([5, -1], GREEDY, "outside the vocabulary"),
    ([5] * 512, GREEDY, "max_model_len is 512"),
    ([5] * 500, SamplingParams(max_tokens=13), r"max_tokens \(13\) = 513 tokens exceeds"),
    (object(), GREEDY, "string or a list of token ids"),
    ([5, True], GREEDY, "item 1 is bool"),     # (checked a container at a time: a bool
    (torch.tensor([5.0, 6.0]), GREEDY, "item 0 is float"),  # among ints, float tensors)
    (torch.tensor([[5, 6]]), GREEDY, "item 0 is list"),
    ([5, 6], "greedy", "must be a SamplingParams"),
])
def test_bad_requests_raise_and_change_nothing(engine, prompt, params, match):
    rid = engine.add_request([3, 4, 5], GREEDY)       # a request in flight meanwhile
    engine.step()
    before = _snapshot(engine)
    with pytest.raises(RequestError, match=match):
        engine.add_request(prompt, params)
    assert _snapshot(engine) == before
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.stats().sequences == 0
    assert rid not in engine._requests


def test_request_ids_in_use_are_refused(model):
    """(A request that can never fit the pool: tests/engine/test_engine_faults.py.)"""
    eng = Engine(model)
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request([5], GREEDY, request_id="a")
        eng.add_request([5], GREEDY, request_id="a")
    eng.close()


def test_engine_options_are_validated(model):
    for kw, match in ((dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                      (dict(preemption_mode="drop"), "preemption_mode"),
                      (dict(config=config()), "already compiled")):
        with pytest.raises(RequestError, match=match):
            Engine(model, **kw)
    with pytest.raises(RequestError, match="eviction_interval"):
        Engine(model, eviction_interval=0)
    eng = Engine(model)
    with pytest.raises(RequestError, match="needs a tokenizer"):
        eng.add_request("hello", GREEDY)
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        eng.add_request([5, 6], SamplingParams(stop=["x"]))


def test_nan_in_one_sequence_fails_only_that_request(model, engine):
    rng = random.Random(0)
    clean = [p for p in random_prompts(rng, 6, 5, 30) if 9 not in p][:4]
    expect = [o.token_ids for o in engine.generate(clean, GREEDY)]
    emb = model.get_input_embeddings().weight
    saved = emb.data[9].clone()
    with torch.no_grad():
        emb.data[9] = float("nan")     # any sequence that holds token 9 goes NaN
    try:
        bad = clean[0][:3] + [9] + clean[0][3:]
        outs = engine.generate(clean[:2] + [bad] + clean[2:], GREEDY)
    finally:
        with torch.no_grad():
            emb.data[9] = saved
    assert outs[2].finish_reason == "error" and "non-finite logits" in outs[2].error
    assert outs[2].token_ids == []
    assert [o.token_ids for o in outs[:2] + outs[3:]] == expect
    assert engine.stats.requests_failed >= 1
    # the failed request left nothing behind, not even in the prefix cache
    assert engine.pool.stats().sequences == 0
    assert engine.generate([clean[0]], GREEDY)[0].token_ids == expect[0]


def test_nonfinite_kv_check_fails_only_that_request():
    """KVConfig(check_finite=True): the op raises NonFiniteKVError for the packed step; the
    engine fails the request that owns the token and runs the step again without it."""
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=PAGE, check_finite=True))
    eng = Engine(m, max_num_batched_tokens=64)
    rng = random.Random(1)
    clean = [p for p in random_prompts(rng, 5, 5, 20) if 9 not in p][:3]
    expect = [o.token_ids for o in eng.generate(clean, GREEDY)]
    emb = m.get_input_embeddings().weight
    saved = emb.data[9].clone()
    with torch.no_grad():
        emb.data[9] = float("inf")
    try:
        outs = eng.generate([clean[0], clean[1] + [9], clean[2]], GREEDY)
    finally:
        with torch.no_grad():
            emb.data[9] = saved
    assert outs[1].finish_reason == "error" and "KV cache" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [expect[0], expect[2]]
    eng.close()
    assert eng.pool.stats().pages_used == 0


def test_streaming_deltas_add_up(engine):
    tok = byte_tokenizer()
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True)
    other = engine.add_request("other request", params)   # runs alongside
    deltas = list(engine.stream("Once upon a time", params))
    final = deltas[-1]
    assert final.finished and all(not d.finished for d in deltas[:-1])
    assert sum((d.new_token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.new_text for d in deltas) == final.text == tok.decode(final.token_ids, skip_special_tokens=True)
    assert len(final.token_ids) == 40 and final.finish_reason == "length"
    assert final.first_token_time >= final.arrival_time
    alone = engine.generate("Once upon a time", params)
    assert alone[0].token_ids == final.token_ids
    engine.abort(other)
    assert not engine.has_unfinished()


def test_stream_abandoned_early_aborts_its_request(engine):
    it = engine.stream([5, 6, 7], SamplingParams(temperature=0, max_tokens=50))
    next(it)
    it.close()
    assert not engine.has_unfinished() and engine.pool.stats().sequences == 0


def test_stop_strings_eos_stop_tokens_min_tokens(engine, model):
    tok = byte_tokenizer()
    prompt = [40, 41, 42, 43]
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True))[0]
    ids = free.token_ids
    text = tok.decode(ids, skip_special_tokens=True)
    i = next(i for i in range(4, len(text) - 1)
             if all(c.isascii() and c.isprintable() for c in text[i:i + 2]))
    stop = text[i:i + 2]
    first = text.find(stop)
    o = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                 ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.text == text[:first]
    assert stop not in tok.decode(o.token_ids[:-1], skip_special_tokens=True)
    assert tok.decode(o.token_ids, skip_special_tokens=True).startswith(text[:first] + stop)
    o = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                 include_stop_str_in_output=True,
                                                 ignore_eos=True))[0]
    assert o.text == text[:first] + stop
    o = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40,
                                                 stop_token_ids=[ids[9]], ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.token_ids == ids[:ids.index(ids[9]) + 1]
    # EOS (the model's eos_token_id; here a token the free run emits) ends a request unless
    # ignore_eos; it is kept in token_ids, not in the text
    assert engine.eos_ids == {2}
    engine.eos_ids = {ids[7]}
    try:
        o = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
        assert o.token_ids == ids[:ids.index(ids[7]) + 1] and o.finish_reason == "stop"
        o = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40,
                                                     ignore_eos=True))[0]
        assert o.token_ids == ids and o.finish_reason == "length"
    finally:
        engine.eos_ids = {2}
    # min_tokens: stop tokens are not produced before it
    o = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40, min_tokens=12,
                                                 stop_token_ids=[ids[3]]))[0]
    assert ids[3] not in o.token_ids[:12] and len(o.token_ids) >= 12


def test_requests_added_from_another_thread(engine):
    results = {}

    def add(i):
        results[i] = engine.add_request([10 + i, 11, 12], GREEDY)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    steps = 0
    while any(t.is_alive() for t in threads) or engine.has_unfinished():
        engine.step()
        steps += 1
    for t in threads:
        t.join()
    assert len(set(results.values())) == 8 and engine.pool.stats().sequences == 0


def test_chat_with_a_template(engine):
    tok = engine.tokenizer
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    out = engine.chat([{"role": "user", "content": "hi"}],
                      SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert out.prompt_token_ids == tok("<user>hi<assistant>").input_ids
    assert len(out.token_ids) == 5


def test_step_stats(engine):
    seen = []
    engine.on_step.append(seen.append)
    try:
        engine.generate(random_prompts(random.Random(2), 5, 10, 90), GREEDY)
    finally:
        engine.on_step.remove(seen.append)
    assert seen and seen[-1] is engine.history[-1]
    for s in seen:
        assert s.pages_used + s.pages_free == engine.pool.num_pages
        assert s.prefill_tokens + s.decode_tokens <= 64
        assert s.tokens_per_s > 0 and s.duration_s > 0
    assert sum(s.generated_tokens for s in seen) == 5 * 12
    assert "gen tok/s" in str(seen[-1]) and seen[-1].as_dict()["step"] == seen[-1].step
    assert engine.stats.as_dict()["generated_per_s"] > 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_step_ignores_the_models_mask(attn):
    """Two sequences packed in one row, continuing at different positions: whatever mask HF
    builds for packed position_ids (block-diagonal, or causal over the whole row), the op
    attends within each sequence, so the logits are each sequence's own."""
    from kvcompile.engine.request import Request
    from kvcompile.engine.scheduler import ScheduledSeq, SchedulerOutput

    torch._dynamo.reset()
    ref = make_hf("llama", attn)
    m = make_hf("llama", attn)
    eng = Engine(m, config=config(page_size=PAGE), max_num_batched_tokens=64)
    masks = []
    import kvcompile.runtime.attention_op as op

    inner = op._cached_attention

    def spy(ctx, q, k, v, attn_mask, *a):
        masks.append(None if attn_mask is None else tuple(attn_mask.shape))
        return inner(ctx, q, k, v, attn_mask, *a)

    rng = random.Random(6)
    a, b = random_prompts(rng, 2, 9, 20)
    reqs = [Request(str(i), p, GREEDY, None) for i, p in enumerate((a, b))]
    out = SchedulerOutput()
    pool = eng.pool
    for r, (start, n) in zip(reqs, ((0, 6), (0, len(b)))):
        r.seq_id = pool.allocate()[0]
        out.seqs.append(ScheduledSeq(r, start, n, pool.reserve([r.seq_id], n)))
    eng.runner.forward(out)
    # step 2: the rest of a (positions 6..) packed with one more token of b
    out2 = SchedulerOutput([ScheduledSeq(reqs[0], 6, len(a) - 6,
                                         pool.reserve([reqs[0].seq_id], len(a) - 6))])
    reqs[1].output_ids = [17]
    out2.seqs.append(ScheduledSeq(reqs[1], len(b), 1, pool.reserve([reqs[1].seq_id], 1)))
    op._cached_attention = spy
    try:
        logits = eng.runner.forward(out2)
    finally:
        op._cached_attention = inner
    with torch.no_grad():
        ra = ref(torch.tensor([a])).logits[0, -1]
        rb = ref(torch.tensor([b + [17]])).logits[0, -1]
    torch.testing.assert_close(logits[0], ra, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], rb, rtol=1e-4, atol=1e-4)
    T = len(a) - 6 + 1
    assert masks and all(s is None or s[-2:] == (T, T) for s in masks)  # a whole-row mask
    pool.free([r.seq_id for r in reqs])
    assert state_of(m).graphs <= 2


def test_decode_steps_take_the_decode_kernel():
    """kernels="triton" (the interpreter on the CPU): a packed step of one token per sequence
    runs the split-K decode kernel, with the same tokens as the reference."""
    from tests.engine.tiny import make_llama64

    prompts = random_prompts(random.Random(7), 3, 3, 20)
    outs = {}
    for kernels in ("reference", "triton"):
        torch._dynamo.reset()
        m = make_llama64()
        eng = Engine(m, config=config(kernels=kernels, kv_dtype="fp32", page_size=PAGE))
        outs[kernels] = [o.token_ids for o in eng.generate(prompts, GREEDY)]
        calls = state_of(m).counters.get("engine_decode_kernel_calls", 0)
        assert calls == (2 * (GREEDY.max_tokens - 1) if kernels == "triton" else 0)
    assert outs["triton"] == outs["reference"]


def test_prompt_ids_of_every_integer_container():
    """A prompt's ids from a list, a tuple, an integer tensor or numpy array, and a list of
    numpy integers are the same ids (the container checks and the item check agree)."""
    import numpy as np

    from kvcompile.engine.inputs import token_ids

    want = [5, 6, 7]
    for prompt in (want, tuple(want), torch.tensor(want), torch.tensor(want, dtype=torch.int32),
                   np.array(want, dtype=np.uint16), [np.int64(5), 6, 7]):
        got = token_ids(prompt, None)
        assert got == want and all(type(t) is int for t in got), type(prompt)


def test_mask_limit_reads_the_configs_mask_structure():
    from types import SimpleNamespace

    from kvcompile.engine.inputs import mask_limit

    plain = SimpleNamespace(layer_types=["full_attention", "sliding_attention"],
                            sliding_window=16)
    assert mask_limit(plain) is None and mask_limit(SimpleNamespace()) is None
    chunked = SimpleNamespace(layer_types=["chunked_attention", "full_attention"],
                              attention_chunk_size=8192)
    assert mask_limit(chunked) == 8192
    # a chunk size without chunked layers (an audio tower's setting, say) limits nothing
    assert mask_limit(SimpleNamespace(layer_types=["full_attention"],
                                      attention_chunk_size=12)) is None
    for cfg, match in ((SimpleNamespace(use_bidirectional_attention=True), "bidirectional"),
                       (SimpleNamespace(layer_types=["full_attention", "window_attention"]),
                        "window_attention layers")):
        with pytest.raises(RequestError, match=match):
            mask_limit(cfg)
    # a multimodal config: its text config's
    outer = SimpleNamespace(get_text_config=lambda: chunked)
    assert mask_limit(outer) == 8192


def test_engine_caps_or_refuses_a_model_whose_mask_it_cannot_follow(model, monkeypatch, caplog):
    # the engine attends causally per sequence: a model with chunked layers runs up to its
    # chunk (where chunked attention is causal), said once; one with a longer request, or
    # with bidirectional attention, is refused at construction, naming why and what to use
    cfg = model.config
    monkeypatch.setattr(cfg, "layer_types", ["full_attention", "chunked_attention"],
                        raising=False)
    monkeypatch.setattr(cfg, "attention_chunk_size", 40, raising=False)
    with caplog.at_level("WARNING", logger="kvcompile.engine"):
        eng = Engine(model)
    assert eng.max_model_len == 40
    assert "attention chunk" in caplog.text
    with pytest.raises(RequestError, match="max_model_len is 40"):
        eng.add_request([5] * 40, SamplingParams(max_tokens=1))
    eng.add_request([5] * 30, SamplingParams(max_tokens=10))   # fits within the chunk
    with pytest.raises(RequestError, match="exceeds the model's attention chunk"):
        Engine(model, max_model_len=41)
    assert Engine(model, max_model_len=40).max_model_len == 40
    with pytest.raises(RequestError, match="must be an int"):   # checked before the chunk
        Engine(model, max_model_len="64")
    monkeypatch.setattr(cfg, "use_bidirectional_attention", True, raising=False)
    with pytest.raises(RequestError, match="bidirectional.*HF `generate`"):
        Engine(model)
