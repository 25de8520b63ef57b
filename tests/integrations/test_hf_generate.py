"""Hugging Face `generate` on a kvcompile-compiled model, against eager Hugging Face.

fp32 model + fp32 pages ("auto"): token-identical for greedy, sampling, left padding,
num_return_sequences, beam search, prompt-lookup decoding (crop), StaticCache reuse, EOS and
stop strings, TextStreamer. bf16 model + bf16 pages: identical wherever the eager run's top two
logits are apart (a tie in bf16 is broken by rounding either way). Forks share pages (no copy of
a shared prefix), and every page returns to the pool when generate returns.
"""

from __future__ import annotations

import contextlib
import gc
import io

import pytest
import torch

import kvcompile
from kvcompile.api import state_of
from kvcompile.runtime.hooks import RuntimeHook
from tests.engine.tiny import byte_tokenizer, config, make_hf

NEW = 48


@pytest.fixture(scope="module")
def pair():
    """(eager reference, compiled twin): same weights, fp32, sdpa; pages fp32."""
    ref = make_hf("llama", "sdpa")
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config())
    return ref, model


def _batch(seed=0, B=3, S=11, pads=(0, 4, 2)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (B, S), generator=g)
    am = torch.ones_like(ids)
    for b, p in enumerate(pads[:B]):
        am[b, :p] = 0
    ids[am == 0] = 0
    return ids, am


def _both(ref, model, seed=0, S=11, **kw):
    """Eager and compiled generate on the same left-padded batch; checks the compiled run
    went through the pool at every step."""
    ids, am = _batch(S=S)
    kw = dict(attention_mask=am, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None, **kw)
    torch.manual_seed(seed)
    r = ref.generate(ids, **kw)
    torch.manual_seed(seed)
    with watch(model) as w:
        o = model.generate(ids, **kw)
    assert len(w.seen) >= NEW - 1, "the compiled model's forwards did not run on the pool"
    return r, o, w


class _PoolWatch(RuntimeHook):
    """Pool stats after every forward of the compiled model."""

    def __init__(self, state):
        self.state, self.seen = state, []

    def after_forward(self, ctx):
        self.seen.append(self.state.pool.stats())


@contextlib.contextmanager
def watch(model):
    st = state_of(model)
    hook = _PoolWatch(st)
    st.hooks.append(hook)
    try:
        yield hook
    finally:
        st.hooks.remove(hook)


def _pages_used(model) -> int:
    return state_of(model).pool.stats().pages_used


@pytest.mark.parametrize("mode", [
    dict(do_sample=False),
    dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=20),
    dict(do_sample=True, temperature=1.3, top_k=0, top_p=0.7),
], ids=["greedy", "sample-topk-topp", "sample-topp"])
def test_matches_eager_with_left_padding(pair, mode):
    ref, model = pair
    r, o, _ = _both(ref, model, **mode)
    assert r.shape == (3, 11 + NEW)
    torch.testing.assert_close(o, r, rtol=0, atol=0)
    assert _pages_used(model) == 0  # returned when generate returned, no gc needed


def test_num_return_sequences_forks_pages(pair):
    ref, model = pair
    r, o, w = _both(ref, model, S=40, do_sample=True, num_return_sequences=3, temperature=1.0)
    torch.testing.assert_close(o, r, rtol=0, atol=0)
    assert o.shape[0] == 9
    P = state_of(model).pool.page_size
    # the prompt's full pages are computed once per prompt and shared by its 3 sequences
    assert min(s.pages_shared for s in w.seen[1:]) == 3 * (40 // P)  # [0]: the prefill
    # no copy of a shared prefix: the prompt pages once per prompt, plus per sequence its own
    # new pages and one copied partial page
    bound = 3 * -(-40 // P) + 9 * (-(-NEW // P) + 1)
    assert max(s.pages_used for s in w.seen) <= bound
    assert _pages_used(model) == 0


@pytest.mark.parametrize("beams,ret", [(3, 1), (4, 2)])
def test_beam_search(pair, beams, ret):
    ref, model = pair
    r, o, w = _both(ref, model, S=40, num_beams=beams, num_return_sequences=ret,
                    do_sample=False)
    torch.testing.assert_close(o, r, rtol=0, atol=0)
    P = state_of(model).pool.page_size
    assert min(s.pages_shared for s in w.seen[1:]) >= 3 * (40 // P), "beams share the prompt"
    assert _pages_used(model) == 0


def test_prompt_lookup_decoding_crops(pair):
    """Prompt-lookup decoding drafts tokens and crops the cache back when they are rejected."""
    ref, model = pair
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None,
              prompt_lookup_num_tokens=3)
    with watch(model) as w:
        out = model.generate(ids, **kw)
    assert w.seen
    torch.testing.assert_close(out, ref.generate(ids, **kw), rtol=0, atol=0)
    assert _pages_used(model) == 0


def test_static_cache_reused(pair):
    ref, model = pair
    for seed in (0, 1):  # the second call reuses (resets) the model's StaticCache
        r, o, _ = _both(ref, model, seed=seed, do_sample=False, cache_implementation="static")
        torch.testing.assert_close(o, r, rtol=0, atol=0)
        assert _pages_used(model) == 0


def test_eos_and_stop_strings(pair):
    ref, model = pair
    tok = byte_tokenizer()
    ids, am = _batch()
    free_run = ref.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
    eos = int(free_run[0, 11 + 10])  # a token the first row emits at step 10
    kw = dict(attention_mask=am, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    r = ref.generate(ids, eos_token_id=eos, **kw)
    with watch(model) as w:
        o = model.generate(ids, eos_token_id=eos, **kw)
    assert w.seen
    torch.testing.assert_close(o, r, rtol=0, atol=0)
    assert r.shape[1] < 11 + NEW or (r[0, 11:] == eos).any()
    stop = tok.decode(free_run[1, 11 + 20:11 + 23])  # three tokens of row 1's output
    r = ref.generate(ids, eos_token_id=None, stop_strings=[stop], tokenizer=tok, **kw)
    o = model.generate(ids, eos_token_id=None, stop_strings=[stop], tokenizer=tok, **kw)
    torch.testing.assert_close(o, r, rtol=0, atol=0)
    assert stop in tok.decode(r[1, 11:])
    assert _pages_used(model) == 0


def test_text_streamer(pair):
    from transformers import TextStreamer

    ref, model = pair
    tok = byte_tokenizer()
    ids = torch.tensor([[72, 101, 108, 108, 111]])
    texts = []
    for m in (ref, model):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), watch(model) as w:
            out = m.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             eos_token_id=None, streamer=TextStreamer(tok, skip_prompt=True))
        texts.append(buf.getvalue())
        assert bool(w.seen) == (m is model)
        assert buf.getvalue().strip() == tok.decode(out[0, 5:]).strip()
    assert texts[0] == texts[1] and len(texts[0]) > 0


def test_pages_return_and_are_reused(pair):
    _, model = pair
    ids, am = _batch()
    gc.disable()  # pages must come back without the garbage collector
    try:
        peaks = []
        for _ in range(2):
            with watch(model) as w:
                model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
            pool = state_of(model).pool
            peaks.append(max(s.pages_used for s in w.seen))
            assert pool.stats().pages_used == 0
            assert kvcompile.stats(model)["pages_used"] == 0
        assert peaks[0] == peaks[1] > 0
        # a cache handed back to the caller keeps its pages until the caller drops it
        out = model.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False,
                             pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
        assert pool.stats().pages_used > 0
        assert out.past_key_values.get_seq_length() == 11 + 8 - 1
        del out
        gc.collect()
        assert pool.stats().pages_used == 0
        # so does a cache the caller passed in
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        model.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False,
                       pad_token_id=0, eos_token_id=None, past_key_values=cache)
        assert pool.stats().pages_used > 0 and cache.get_seq_length() == 11 + 8 - 1
        del cache
    finally:
        gc.enable()
    gc.collect()
    assert pool.stats().pages_used == 0
    pool.check_invariants()


def test_batch_select_indices_and_reorder_act_on_the_pool(pair):
    _, model = pair
    ids, am = _batch()
    out = model.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False,
                         pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
    cache = out.past_key_values
    pool = state_of(model).pool
    L = cache.get_seq_length()
    before = pool.stats()
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert cache.layers[0].keys.shape[0] == 2 and pool.stats().sequences == before.sequences - 1
    cache.reorder_cache(torch.tensor([1, 1, 0]))       # beam-style: row 1 forked
    assert cache.layers[0].keys.shape[0] == 3
    assert pool.stats().pages_shared > 0 and pool.stats().pages_used <= before.pages_used
    cache.crop(-2)  # remove two tokens
    assert cache.get_seq_length() == L - 2
    assert all(pool.seq_len(s) == L - 2 for s in _binding(cache).seq_ids)
    pool.check_invariants()
    del out, cache
    gc.collect()
    assert pool.stats().pages_used == 0


def _binding(cache):
    from kvcompile.integrations.hf import _binding_of_cache

    return _binding_of_cache(cache)


class _Force:
    """Logits processor that makes generate follow given sequences (teacher forcing)."""

    def __init__(self, sequences: torch.Tensor):
        self.seq = sequences

    def __call__(self, input_ids, scores):
        nxt = self.seq[:, input_ids.shape[1]]
        forced = torch.full_like(scores, float("-inf"))
        forced[torch.arange(scores.shape[0]), nxt] = 0.0
        return forced


def _decisive(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: the top two logits are more than 2 bf16 ulps apart (not a rounding tie)."""
    top2 = logits.float().topk(2, dim=-1).values
    ulp = torch.finfo(torch.bfloat16).eps * top2[:, 0].abs().clamp_min(1e-3)
    return (top2[:, 0] - top2[:, 1]) > 2 * ulp


def test_bf16_pages_match_eager_bf16():
    """bf16 model, bf16 pages, 48 new tokens. Along eager HF's own greedy path (teacher forced),
    the compiled model's logits stay within bf16 rounding of eager's at every step, and pick
    eager's token at every step where eager's choice is not a rounding tie. Free-running, the
    two outputs are identical up to the first such tie."""
    ref = make_hf("llama", "sdpa", dtype=torch.bfloat16, seed=3)
    model = make_hf("llama", "sdpa", dtype=torch.bfloat16, seed=3)
    kvcompile.compile(model, config(kv_dtype="bf16"))
    ids, am = _batch(B=3)
    kw = dict(attention_mask=am, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
              pad_token_id=0, eos_token_id=None, output_logits=True,
              return_dict_in_generate=True)
    r = ref.generate(ids, **kw)
    with watch(model) as w:
        forced = model.generate(ids, logits_processor=[_Force(r.sequences)], **kw)
    assert len(w.seen) == NEW  # every step ran on the pool
    torch.testing.assert_close(forced.sequences, r.sequences, rtol=0, atol=0)
    compared = 0
    for t, (lr, lo) in enumerate(zip(r.logits, forced.logits)):
        scale = lr.float().abs().amax(-1, keepdim=True)
        assert float(((lo.float() - lr.float()).abs() / scale).max()) < 0.02, f"step {t}"
        dec = _decisive(lr)
        assert torch.equal(lo.argmax(-1)[dec], lr.argmax(-1)[dec]), f"step {t}"
        compared += int(dec.sum())
    assert compared >= 0.8 * 3 * NEW, f"only {compared} decisive steps"
    free = model.generate(ids, **kw)
    for b in range(3):  # identical until eager's first rounding tie
        for t, lr in enumerate(r.logits):
            if not bool(_decisive(lr[b:b + 1])):
                break
            assert int(free.sequences[b, 11 + t]) == int(r.sequences[b, 11 + t]), (b, t)
    del free, forced
    gc.collect()
    assert _pages_used(model) == 0


def test_returned_cache_read_by_its_current_field(monkeypatch):
    """A cache given back by `generate(return_dict_in_generate=True)` is found under the
    output's own field (`cache` from transformers 5.25, `past_key_values` before) without
    reading a deprecated alias (which logs a warning in the user's run)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput as Out

    from kvcompile.integrations.hf import _caches

    class _Cache:
        layers = ()

    c = _Cache()
    fields = Out.__dataclass_fields__
    name = "cache" if "cache" in fields else "past_key_values"
    out = Out(sequences=torch.zeros(1, 2, dtype=torch.long), **{name: c})
    if name == "cache" and isinstance(getattr(Out, "past_key_values", None), property):
        def deprecated(self):
            raise AssertionError("read the deprecated past_key_values alias")
        monkeypatch.setattr(Out, "past_key_values", property(deprecated))
    assert _caches({}, out) == [c]
    assert _caches({"past_key_values": c}, None) == [c]     # passed in, nothing returned
