"""Eviction on latent (MLA) pages: a tiny DeepSeek-V3 through the compiler, each policy against
the uncompiled model under the mask of what was kept (fp32 latent pages), as
test_end_to_end.py does for Llama.

An MLA layer's pages hold the latent c (keys) and the rotary key (values). Its attention over
kept slots runs in the absorbed form (keys [c, k_rope], query [q_nope W_UK, q_rope], values c,
W_UV after: runtime/dispatch.py `_latent_evicting`), so SnapKV's observation, H2O's mass and
the kept-slot attention are the model's own probabilities. Rows whose stored slots are exactly
their kept tokens (compacted, no rule) attend through the latent kernels over them; the others
on the host path. Sinks keep their text positions on latent layers (said once)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

import kvcompile
from kvcompile.api import state_of
from kvcompile.config import H2O, KVConfig, SinkWindow, SnapKV
from kvcompile.testing import assert_rel_close
from tests.eviction.test_end_to_end import _sid
from tests.passes.test_latent_attention import make_mla

T, PREFILL = 40, 20


def _compiled(policy, rope=8, **kw):
    torch._dynamo.reset()
    m = make_mla("deepseek_v3", "sdpa", rope=rope)
    cfg = dict(inner="eager", max_kv_bytes=1 << 24, kv_dtype="fp32", page_size=8,
               eviction=policy) | kw
    kvcompile.compile(m, KVConfig(**cfg))
    return m


def _ids(seed, n=T):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _stream(m, ids, prefill=PREFILL, original=True):
    """Logits [T, V] of the prefill, then one token per forward, and the kept positions of
    each layer after every forward (book.pos)."""
    if original:
        with torch.no_grad():
            m(input_ids=ids[:, :2], past_key_values=DynamicCache())   # creates the runtime
        state_of(m).eviction.sink_positions = "original"
    cache, outs, kept = DynamicCache(), [], []
    with torch.no_grad():
        outs.append(m(input_ids=ids[:, :prefill], past_key_values=cache).logits[0])
        kept.append(_kept(m, cache))
        for t in range(prefill, ids.shape[1]):
            outs.append(m(input_ids=ids[:, t:t + 1], past_key_values=cache).logits[0])
            kept.append(_kept(m, cache))
    return torch.cat(outs), cache, kept


def _kept(m, cache):
    book = state_of(m).eviction.books[_sid(cache)]
    return {li: {int(x) for x in p[0] if x >= 0} for li, p in book.pos.items()}


def _reference(ids, allowed, rope=8):
    """The uncompiled model (eager attention) over the whole sequence under a [T, T] bool mask
    per layer (a list), or one for every layer."""
    torch._dynamo.reset()
    m = make_mla("deepseek_v3", "eager", rope=rope)
    layers = m.model.layers
    masks = allowed if isinstance(allowed, list) else [allowed] * len(layers)
    add = [torch.zeros(a.shape).masked_fill(~a, torch.finfo(torch.float32).min)[None, None]
           for a in masks]
    handles = []
    for layer, a in zip(layers, add):
        def hook(module, args, kwargs, a=a):
            kwargs["attention_mask"] = a
            return args, kwargs
        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=add[0]).logits[0]
    finally:
        for h in handles:
            h.remove()


def _masks_from_kept(kept, n, prefill=PREFILL):
    """Per layer: query t of a decode forward sees what the layer kept after the forward
    before it, and itself; the prompt attends causally (nothing evicted while it ran)."""
    out = []
    for li in sorted(kept[0]):
        allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
        for t, held in zip(range(prefill, n), kept[:-1]):
            allowed[t] = False
            allowed[t, sorted(held[li] | {t})] = True
        out.append(allowed)
    return out


@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_sink_window_equals_masked_attention(kernels):
    """SinkWindow(2, 12) at the sinks' text positions: latent layers compact (not the window
    path, whose hidden slots are a per-slot rule), so each decode step reads its stored slots
    through the latent kernels, never the host path; every logit equals the masked model's."""
    ids = _ids(1)
    rope = 16 if kernels == "triton" else 8   # (the latent kernel: widths >= 16)
    m = _compiled(SinkWindow(2, 12), rope=rope, kernels=kernels)
    out, cache, _kept_sets = _stream(m, ids)
    t = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    start = torch.where(t < PREFILL, torch.zeros_like(t), t)
    allowed = (j <= t) & ((j >= start) | (j < 2) | (j >= start - 12) | (start == 0))
    ref = _reference(ids, allowed, rope)
    assert_rel_close(out, ref, torch.float32, factor=10, what="SinkWindow on latent pages")
    rep = kvcompile.report(m)   # every MLA site rewritten, with its policy (not left alone)
    assert [s.rewritten for s in rep.sites] == [True, True], str(rep)
    assert all(s.eviction.startswith("SinkWindow") for s in rep.sites), str(rep)
    st = state_of(m)
    assert "eviction_window_runs" not in st.counters and st.counters["eviction_moves"] > 0
    assert st.counters["evicted_tokens"] == 26
    assert "latent_eviction_host_rows" not in st.counters
    assert st.pool.seq_len(_sid(cache)) == 14 and cache.get_seq_length() == T
    if kernels == "triton":   # (the interpreter: the latent kernel over the stored slots)
        assert st.counters["latent_decode_triton"] == 2 * (T - PREFILL), st.counters
    st.pool.check_invariants()


@pytest.mark.parametrize("hold", [False, True])
def test_snapkv_equals_masked_attention(hold, monkeypatch):
    """SnapKV over latent pages: the observation window's probabilities in the absorbed form
    choose each layer's prompt tokens at its end (compacted); decode steps then attend over
    the stored slots through the latent kernels (no rule: "stored" rows, never the host),
    holding the budget with hold=True. Each step equals the model under each layer's mask of
    what it kept then, and the choice is not a window."""
    budget = 12
    ids = _ids(2)
    if hold:   # the observation: the model's own probabilities of the last 4 queries
        from kvcompile.eviction.runtime import EvictionRuntime

        m = _compiled(SnapKV(budget=8, window=4, kernel=3, per_head=False, hold=True))
        cache = DynamicCache()
        with monkeypatch.context() as mp, torch.no_grad():   # (no eviction: obs is kept)
            mp.setattr(EvictionRuntime, "after_forward", lambda self, ctx: None)
            m(input_ids=ids[:, :PREFILL], past_key_values=cache)
        book = state_of(m).eviction.books[_sid(cache)]
        torch._dynamo.reset()
        with torch.no_grad():
            att = make_mla("deepseek_v3", "eager")(input_ids=ids[:, :PREFILL],
                                                    output_attentions=True).attentions
        for li in (0, 1):
            assert_rel_close(book.obs[li][0], att[li][0, :, -4:].sum(0), torch.float32,
                             factor=10, what=f"SnapKV observation, layer {li}")
    m = _compiled(SnapKV(budget=budget, window=4, kernel=3, per_head=False, hold=hold))
    out, _cache, kept = _stream(m, ids, original=False)
    st = state_of(m)
    assert all(len(kept[0][li]) == budget for li in (0, 1))
    assert len(kept[-1][0]) == (budget if hold else budget + T - PREFILL)
    gone = set(range(PREFILL)) - kept[0][0]
    assert gone and min(kept[0][0]) < max(gone), "the choice is a window"
    assert st.counters.get("latent_eviction_host_rows", 0) == 0   # decode rows over stored
    ref = _reference(ids, _masks_from_kept(kept, T))
    assert_rel_close(out, ref, torch.float32, factor=10, what="SnapKV on latent pages")
    # and not the model without eviction
    full = _reference(ids, torch.tril(torch.ones(T, T, dtype=torch.bool)))
    assert (out[PREFILL:] - full[PREFILL:]).abs().max() > 1e-3
    st.pool.check_invariants()


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_h2o_mass_is_the_models_attention(kernels):
    """H2O on latent pages: the prompt's mass per key is the model's own attention
    probabilities summed over heads and queries (eager output_attentions), through the
    prompt-mass kernel over the latent and rotary pages (kernels="triton": the interpreter;
    rope 248 makes the absorbed width 264, above WIDE_D: Q K^T in chunks) or the torch path; and each decode step (host rows:
    they add up mass) equals the model under each layer's kept mask."""
    ids = _ids(4, 24)
    rope = 248 if kernels == "triton" else 8
    m = _compiled(H2O(budget=40, recent=4, sinks=2), rope=rope, kernels=kernels)
    cache = DynamicCache()
    with torch.no_grad():
        m(input_ids=ids[:, :16], past_key_values=cache)
    which = "kernel" if kernels == "triton" else "torch"
    assert state_of(m).counters.get(f"eviction_prompt_mass_{which}", 0) == 2   # 2 layers
    book = state_of(m).eviction.books[_sid(cache)]
    torch._dynamo.reset()
    ref_m = make_mla("deepseek_v3", "eager", rope=rope)
    with torch.no_grad():
        att = ref_m(input_ids=ids[:, :16], output_attentions=True).attentions
    for li in (0, 1):
        want = att[li][0].sum((0, 1))                                   # [16]
        assert_rel_close(book.mass[li][0], want, torch.float32, factor=10,
                         what=f"H2O prompt mass, layer {li}")
    budget = 14
    m = _compiled(H2O(budget=budget, recent=4, sinks=2))
    out, _cache, kept = _stream(m, ids, prefill=16, original=False)
    assert max(len(k[0]) for k in kept) == budget
    assert state_of(m).counters["latent_eviction_host_rows"] > 0
    ref = _reference(ids, _masks_from_kept(kept, 24, prefill=16))
    assert_rel_close(out, ref, torch.float32, factor=10, what="H2O on latent pages")


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_h2o_prompt_mass_absorbs_in_blocks(kernels, monkeypatch):
    """The prompt's H2O mass on latent pages absorbs the query a block of rows at a time
    (runtime.ABSORB_ELEMENTS, here 5 of 16 rows: three blocks and a partial one), never the
    whole prompt's (19 GB at B16 x 8k, 128 heads, bf16), and SnapKV's observation only its
    observed rows; the mass still equals the model's own attention summed over heads and
    queries, and the observation its last rows' probabilities. Negative control: with the
    whole prompt in one block, the largest absorbed query is the prompt."""
    from kvcompile.eviction import runtime as R
    from kvcompile.kernels import latent
    from kvcompile.runtime import dispatch
    from tests.passes.test_latent_attention import HEADS, RANK

    rope = 248 if kernels == "triton" else 8
    seen = []

    def spy(q, w, nope_dim):
        seen.append(q.shape[2])
        return latent.absorb_query(q, w, nope_dim)

    monkeypatch.setattr(dispatch, "absorb_query", spy)
    ids = _ids(4, 24)
    torch._dynamo.reset()
    att = make_mla("deepseek_v3", "eager", rope=rope)(input_ids=ids[:, :16],
                                                      output_attentions=True).attentions
    for rows, want_max in ((5, 5), (16, 16)):
        monkeypatch.setattr(R, "ABSORB_ELEMENTS", HEADS * (RANK + rope) * rows)
        seen.clear()
        m = _compiled(H2O(budget=40, recent=4, sinks=2), rope=rope, kernels=kernels)
        cache = DynamicCache()
        with torch.no_grad():
            m(input_ids=ids[:, :16], past_key_values=cache)
        assert max(seen) == want_max, seen
        if rows == 5:
            assert seen == [5, 5, 5, 1] * 2, seen   # each layer's blocks
        book = state_of(m).eviction.books[_sid(cache)]
        for li in (0, 1):
            assert_rel_close(book.mass[li][0], att[li][0].sum((0, 1)).detach(),
                             torch.float32, factor=10, what=f"blocked mass, layer {li}")
    seen.clear()
    monkeypatch.setattr(R, "ABSORB_ELEMENTS", HEADS * (RANK + rope) * 5)
    m = _compiled(SnapKV(budget=40, window=4, kernel=3, per_head=False), rope=rope,
                  kernels=kernels)
    with torch.no_grad():
        m(input_ids=ids[:, :16], past_key_values=DynamicCache())
    assert seen == [4, 4], seen   # each layer's 4 observed rows, nothing else


def test_h2o_eager_decode_rows_take_the_kernel_mass():
    """Eager H2O decode steps on latent pages where the Triton latent kernel runs (the
    interpreter, kernels="triton"): the evicted rows read their stored slots through it and
    add its attn_mass output, not the host path; the kept positions, each kept token's mass
    and the logits equal the host path's (kernels="reference"), and the logits equal the
    model under each layer's kept mask."""
    ids = _ids(6, 26)
    runs = {}
    for kernels in ("triton", "reference"):
        m = _compiled(H2O(budget=12, recent=4, sinks=2), rope=16, kernels=kernels)
        c0 = dict(state_of(m).counters)
        out, cache, kept = _stream(m, ids, prefill=14, original=False)
        book = state_of(m).eviction.books[_sid(cache)]
        order = {li: p.argsort(-1) for li, p in book.pos.items()}
        mass = {li: book.mass[li].gather(-1, order[li]) for li in book.mass}
        c = {k: v - c0.get(k, 0) for k, v in state_of(m).counters.items()}
        runs[kernels] = out, kept, mass, c
    (out, kept, mass, c), (out_r, kept_r, mass_r, c_r) = runs["triton"], runs["reference"]
    assert c.get("latent_decode_triton", 0) > 0 and not c.get("latent_eviction_host_rows"), c
    assert c_r.get("latent_eviction_host_rows", 0) > 0, c_r
    assert kept == kept_r and max(len(k[0]) for k in kept) <= 12 + 1
    for li in mass:
        assert_rel_close(mass[li], mass_r[li], torch.float32, factor=10, what=f"mass {li}")
    assert_rel_close(out, out_r, torch.float32, factor=10, what="logits vs the host path")
    ref = _reference(ids, _masks_from_kept(kept, 26, prefill=14), rope=16)
    assert_rel_close(out, ref, torch.float32, factor=10, what="H2O, kernel mass")


def test_rerotated_sinks_keep_text_positions_and_say_so(caplog):
    """The default sink positions ("cache": re-rotated) are not done for latent layers: said
    once, and the logits are those of sinks at their text positions."""
    ids = _ids(5)
    m = _compiled(SinkWindow(2, 12))
    with caplog.at_level("WARNING", logger="kvcompile"):
        out, _c, _k = _stream(m, ids, original=False)
    said = [r for r in caplog.records if "latent (MLA) layers keep SinkWindow's sinks" in
            r.getMessage()]
    assert len(said) == 1
    m2 = _compiled(SinkWindow(2, 12))
    out2, _c2, _k2 = _stream(m2, ids, original=True)
    assert torch.equal(out, out2)


def test_generate_with_padding_and_fp8_latent_pages(monkeypatch):
    """Batched greedy generate with left padding (host rows: the padding is a per-slot rule)
    over fp8 latent pages with SnapKV: runs, holds the budget, and differs from no eviction;
    with a budget above the whole length it equals the run without eviction. The host rows
    absorb their query one batch row at a time as they are attended, never the batch's
    prompt at once ([B, H, S, r + dr]: 19 GB at B16 x 8k, 128 heads)."""
    from kvcompile.kernels import latent
    from kvcompile.runtime import dispatch

    seen = []

    def spy(q, w, nope_dim):
        seen.append(tuple(q.shape[:3]))
        return latent.absorb_query(q, w, nope_dim)

    monkeypatch.setattr(dispatch, "absorb_query", spy)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 256, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    kw = dict(max_new_tokens=10, do_sample=False, attention_mask=mask, pad_token_id=0,
              eos_token_id=None)
    runs = {}
    for name, policy in (("none", None), ("big", SnapKV(budget=64, window=4)),
                         ("small", SnapKV(budget=12, window=4, hold=True))):
        # prefill_attends="stored": without eviction a padded fresh prompt attends its own
        # fp32 latents (the model's mask), the host rows the fp8 pages; stored, both read the
        # pages, so a budget above the length must give the same tokens
        m = _compiled(policy, kv_dtype="fp8_e4m3", prefill_attends="stored")
        seen.clear()
        with torch.no_grad():
            runs[name] = m.generate(ids, **kw)
        if name != "none":   # the host rows (without eviction the prompt's own path runs)
            prompt = [s for s in seen if s[2] > 1]
            assert prompt and all(s[0] == 1 for s in prompt), seen   # a batch row at a time
        st = state_of(m)
        if name == "small":
            assert st.counters["evicted_tokens"] > 0
        if name != "none":
            assert st.counters["latent_eviction_host_rows"] > 0   # the padded row
    assert torch.equal(runs["big"], runs["none"])
    assert not torch.equal(runs["small"], runs["none"])


def test_engine_equals_generate_per_request():
    """The engine on latent pages with per-request policies (packed steps: prompt chunks beside
    decode rows over stored slots and host rows): every request equals generate's."""
    from kvcompile.engine import Engine, SamplingParams

    m = _compiled(SinkWindow(2, 10))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(18, 30))] for _ in range(3)]
    policies = [SnapKV(budget=12, window=4, hold=True), None, H2O(budget=14, recent=4, sinks=2)]
    want = []
    for p, pol in zip(prompts, policies):
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, eviction=pol)
        alone = Engine(m, max_num_batched_tokens=256)
        want.append(alone.generate([p], sp)[0].token_ids)
        alone.close()
    eng = Engine(m, max_num_batched_tokens=16)
    outs = eng.generate(prompts, [SamplingParams(temperature=0, max_tokens=12,
                                                 ignore_eos=True, eviction=pol)
                                  for pol in policies])
    assert [o.token_ids for o in outs] == want
    assert state_of(m).counters["evicted_tokens"] > 0
    eng.close()
    assert eng.pool.stats().pages_used == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_random_arrivals_on_latent_pages(mode):
    """The engine on latent pages under random arrivals: SnapKV(hold) / SinkWindow requests
    beside requests that keep every token, prompts sharing a prefix, a pool so small that
    requests are preempted (recomputed, or swapped out and back with their eviction
    bookkeeping). Every request equals itself alone; evicting requests never take pages
    from the prefix cache; the others hit it."""
    from kvcompile.engine import Engine, SamplingParams
    from tests.engine.test_engine_eviction import arrivals_in_few_pages

    m = _compiled(SinkWindow(2, 10), page_size=8)
    rng = random.Random(5)
    shared = [rng.randrange(3, 256) for _ in range(17)]
    choices = [None, SinkWindow(2, 10), None, SnapKV(budget=12, window=4, hold=True)]
    reqs = [(shared + [rng.randrange(3, 256) for _ in range(rng.randrange(4, 20))],
             SamplingParams(temperature=0, max_tokens=rng.randrange(12, 24), ignore_eos=True,
                            eviction=choices[i % 4])) for i in range(8)]
    alone = Engine(m, max_num_batched_tokens=128, enable_prefix_caching=False)
    expect = [alone.generate([p], sp)[0].token_ids for p, sp in reqs]
    alone.close()
    # 14 pages of 8 tokens free; prompts admitted on their first chunk (preempted)
    arrivals_in_few_pages(m, reqs, expect, 14, 8, mode, rng, reserve_prefill=False)


def test_engine_prefill_eviction_chunks_on_latent_pages():
    """Prompts on latent pages evicted every 8 tokens (Engine(prefill_eviction_chunk=8)): a
    chunk after an eviction attends over kept slots in fp32 on the host, beside other rows in
    a packed step (dispatch._latent_evicting's packed host branch). The engine equals the
    prompt fed 8 tokens per forward through HF's cache (the same rows, one at a time), at a
    step budget of 12; negative: without the option some request's tokens differ."""
    from kvcompile.engine import Engine, SamplingParams
    from tests.engine.test_engine_prefill_eviction import _streamed
    from tests.engine.tiny import random_prompts

    m = _compiled(SinkWindow(2, 10))
    with torch.no_grad():   # (the pool is made at the first forward)
        m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    C, N = 8, 10
    pols = [SinkWindow(2, 12), SnapKV(budget=16, window=4), "model"]
    prompts = random_prompts(random.Random(3), len(pols), 30, 44)
    want, want_lp = zip(*[_streamed(m, p, N, pol, C, logprobs=True)
                          for p, pol in zip(prompts, pols)])
    want = list(want)

    def params():
        return [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, eviction=pol,
                               logprobs=True) for pol in pols]

    st = state_of(m)
    before = st.counters.get("latent_eviction_host_rows", 0)
    eng = Engine(m, max_num_batched_tokens=12, prefill_eviction_chunk=C)
    outs = eng.generate(prompts, params())
    assert [o.token_ids for o in outs] == want
    for o, lp in zip(outs, want_lp):   # (fp32 pages: the rows' numbers, not only argmax)
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(lp), rtol=0,
                                   atol=1e-4)
    assert st.counters.get("latent_eviction_host_rows", 0) > before
    eng.close()
    assert eng.pool.stats().pages_used == 0
    eng = Engine(m, max_num_batched_tokens=12)
    full = [o.token_ids for o in eng.generate(prompts, params())]
    eng.close()
    assert full != want, "evicting during the prompt changed no request"
