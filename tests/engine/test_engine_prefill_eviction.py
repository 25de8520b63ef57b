"""Issue 19's capacity at long prompts: eviction during a chunked prompt
(`Engine(prefill_eviction_chunk=N)`) and the admission of evicting prompts by their peak
(`Scheduler.reserve_prefill`).

The reference of `prefill_eviction_chunk=N` is the compiled model fed the prompt N tokens per
forward through Hugging Face's cache (the path tests/eviction checks against masked attention),
which evicts after every forward; then one token per forward. The engine must give the same
tokens whatever its step budget, neighbours and preemptions, and its prompts must never store
more than budget + N (+ a page)."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from transformers import DynamicCache

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.api import state_of
from kvcompile.config import SinkWindow, SnapKV
from kvcompile.engine.params import RequestError
from tests.engine.test_engine_eviction import MODEL_POLICY, PAGE, _budget, _generate, _greedy
from tests.engine.tiny import config, make_hf, random_prompts


@pytest.fixture(scope="module")
def model():
    """test_engine_eviction's model: fp32 tiny Llama compiled with H2O, fp32 pages of 8."""
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=PAGE, kv_dtype="fp32", eviction=MODEL_POLICY))
    _generate(m, [[5, 6, 7]], 2)
    return m


def _streamed(m, prompt: list[int], n: int, policy, chunk: int, logprobs: bool = False):
    """Greedy tokens of the compiled model fed `prompt` `chunk` tokens per forward (each
    forward evicts after it), then one token per forward; its sequence under `policy`.
    logprobs: (tokens, each token's log-probability) instead."""
    st = state_of(m)
    pool = st.pool
    allocate = pool.allocate

    def allocate_with_policy(k=1):
        ids = allocate(k)
        if policy != "model":
            for sid in ids:
                st.eviction.set_sequence_policy(sid, policy)
        return ids

    pool.allocate = allocate_with_policy
    try:
        cache, out, lps = DynamicCache(), [], []
        with torch.no_grad():
            for t in range(0, len(prompt), chunk):
                logits = m(input_ids=torch.tensor([prompt[t:t + chunk]]),
                           past_key_values=cache, use_cache=True).logits[0, -1]
            for _ in range(n):
                out.append(int(logits.argmax()))
                lps.append(float(torch.log_softmax(logits.float(), -1)[out[-1]]))
                logits = m(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache,
                           use_cache=True).logits[0, -1]
        # the first forward of a new shape compiles, and Dynamo's compile leaves the frame's
        # locals (this cache among them) in reference cycles: its pages come back at the next
        # collection, not at `del` (the order of tests in a worker decides when that is)
        del cache
        gc.collect()
    finally:
        pool.allocate = allocate
    return (out, lps) if logprobs else out


POLICIES = [SinkWindow(2, 12), SnapKV(budget=16, window=4), "model"]


def test_prefill_eviction_chunk_equals_streamed_prompt(model):
    """Prompts of 30-50 tokens evicted every 8 prompt tokens: the engine equals the prompt fed
    8 tokens per forward, at a step budget of 12 (chunks cut at the eviction points and at
    pages) and of 64 (several chunks of one prompt could share a step: cut at each point);
    during its prompt a sequence stores at most budget + 8 + a page. Negative: the engine
    without the option (a prompt attends in full) gives other tokens for some request, so the
    comparison sees the option."""
    C = 8
    prompts = random_prompts(random.Random(7), len(POLICIES), 30, 50)
    want = [_streamed(model, p, 12, pol, C) for p, pol in zip(prompts, POLICIES)]
    full = [_generate(model, [p], 12, pol)[0] for p, pol in zip(prompts, POLICIES)]
    assert want != full, "evicting during the prompt changed no request"
    budgets = [_budget(MODEL_POLICY if pol == "model" else pol) for pol in POLICIES]
    for step_tokens in (12, 64):
        eng = Engine(model, max_num_batched_tokens=step_tokens, prefill_eviction_chunk=C)
        peak = {}

        def watch(_st, eng=eng, peak=peak):
            for r in eng.scheduler.running:
                if r.seq_id is not None and r.num_computed <= len(r.prompt_ids):
                    i = int(r.id)
                    peak[i] = max(peak.get(i, 0), eng.pool.seq_len(r.seq_id))

        eng.on_step.append(watch)
        outs = eng.generate(prompts, [_greedy(12, pol) for pol in POLICIES])
        for i, pol in enumerate(POLICIES):
            assert outs[i].token_ids == want[i], f"{pol} at step budget {step_tokens}"
            assert peak[i] <= budgets[i] + C + PAGE, (pol, peak[i])
        eng.close()
        assert eng.pool.stats().pages_used == 0
    # the option off: the engine attends in full and evicts at the prompt's end (as generate)
    eng = Engine(model, max_num_batched_tokens=12)
    assert [o.token_ids for o in eng.generate(prompts, [_greedy(12, p) for p in POLICIES])] \
        == full
    eng.close()


def test_prefill_eviction_chunk_refused_clearly(model):
    for bad in (-1, True, 2.0):
        with pytest.raises(RequestError, match=r"prefill_eviction_chunk=.*int >= 0"):
            Engine(model, prefill_eviction_chunk=bad)


def _small_model(pages: int):
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    small = pages * m.config.num_hidden_layers * 2 * 2 * PAGE * 16 * 4
    kvcompile.compile(m, config(page_size=PAGE, kv_dtype="fp32", max_kv_bytes=small,
                                eviction=SinkWindow(2, 14)))
    return m


def test_evicting_prompts_admitted_by_their_peak():
    """A pool of 14 pages of 8 tokens; four 64-token prompts (8 pages each) with
    SinkWindow(2, 14) (2-3 pages once evicted), chunks of 16. Admitted on their first chunk,
    prompts in prefill overcommit the pool and preempt each other (the negative case: the
    rule is what removes them); admitted by their peak (`reserve_prefill`, the default),
    none is preempted and the tokens are the same; the lifetime credit (the default) runs
    more at once than without. With prefill_eviction_chunk=16 a prompt's peak is 40 tokens
    (5 pages), so the requests finish in fewer steps than with whole prompts, again without
    preemption, and each request equals its prompt streamed 16 tokens per forward."""
    m = _small_model(14)
    prompts = random_prompts(random.Random(9), 4, 64, 64)
    want = _generate(m, prompts, 16)
    runs = {}
    for reserve, chunk, credit in ((False, 0, True), (True, 0, False), (True, 0, True),
                                   (True, 16, True)):
        # (the admission rule alone: swap-aside, on by default, has its own tests below)
        eng = Engine(m, max_num_batched_tokens=16, prefill_eviction_chunk=chunk,
                     swap_aside=False)
        assert eng.pool.num_pages == 14
        eng.scheduler.reserve_prefill = reserve
        eng.scheduler.lifetime_credit = credit
        outs = eng.generate(prompts, _greedy(16))
        eng.pool.check_invariants()
        runs[reserve, chunk, credit] = (eng.stats.preemptions,
                                        max(s.num_running for s in eng.history),
                                        [o.token_ids for o in outs], eng.stats.steps)
        eng.close()
        assert eng.pool.stats().pages_used == 0
    assert runs[False, 0, True][0] > 0, "the pool never ran short: the test shows nothing"
    assert runs[False, 0, True][2] == want
    for key in ((True, 0, False), (True, 0, True)):
        assert runs[key][0] == 0 and runs[key][2] == want, key
    # the lifetime credit starts a prompt before a decoder's end frees its pages
    assert runs[True, 0, True][1] > runs[True, 0, False][1]
    assert runs[True, 16, True][0] == 0
    assert runs[True, 16, True][3] < runs[True, 0, True][3]   # fewer steps for the same work
    assert runs[True, 16, True][2] == [_streamed(m, p, 16, "model", 16) for p in prompts]


class _Pool:
    """What `Scheduler._peaks_fit` reads of a pool: free pages and each sequence's pages."""

    page_size, max_pages, k, v = 8, 100, [], []

    def __init__(self, free: int, pages: dict[int, int]):
        self.num_available, self.pages = free, pages

    def seq_len(self, sid: int) -> int:
        return 0 if sid == 99 else self.pages[sid] * self.page_size

    def pages_of(self, sid: int) -> list[int]:
        return list(range(self.pages[sid]))


def _req(sid, prompt, computed, out, max_tokens, evicts=True, peak=None, keep=None,
         every=0):
    from kvcompile.engine.request import Request

    r = Request(str(sid), list(range(prompt)), SamplingParams(max_tokens=max_tokens), None)
    r.seq_id, r.num_computed, r.output_ids = sid, computed, [1] * out
    r.evicts, r.peak_tokens, r.evict_every = evicts, peak, every
    # an evicting decoder at its budget unless told (it stores what its policy keeps)
    r.keep_tokens = keep if keep is not None or not evicts else prompt
    return r


@pytest.mark.parametrize("left, credit, fits", [
    (3, True, True),     # both decoders end within 3 steps: their 20 pages come in time
    (3, False, False),   # the same without the credit: 17 free pages < the 23 owed
    (10, True, False),   # they end after the prompt needs the pages: no credit
])
def test_lifetime_credit_of_ending_decodes(left, credit, fits):
    """A prompt of 200 tokens (peak 25 pages of 8) starting with 2 pages, 32-token steps (up
    to 5 pages a step), 20 free pages (1 watermark) and two evicting decoders of 10 pages
    each with `left` tokens to go: with the credit it fits only when they end in time."""
    from kvcompile.engine.scheduler import Scheduler

    pool = _Pool(20, {1: 10, 2: 10})
    s = Scheduler(pool, None, max_num_batched_tokens=32, max_num_seqs=8)
    s.lifetime_credit = credit
    s.running = [_req(1, 40, 40 + 9 - left, 10 - left, 10),
                 _req(2, 40, 40 + 9 - left, 10 - left, 10)]
    new = _req(99, 200, 0, 0, 10, peak=200)
    assert s._peaks_fit(new, 16) is fits
    # decoders that keep every token are never counted as ending (they only grow)
    s.running = [_req(i, 40, 40 + 9 - left, 10 - left, 10, evicts=False) for i in (1, 2)]
    assert s._peaks_fit(new, 16) is False


@pytest.mark.parametrize("case, fits", [
    ("exact", True),          # 2 decoders at their budgets: a margin of 2 pages, not 20
    ("watermark", False),     # Scheduler.exact_margin off: the 20-page watermark blocks it
    ("below_budget", False),  # a decoder below its policy's budget still grows: watermark
    ("plain", False),         # a decoder that keeps every token: watermark
])
def test_margin_beside_evicting_requests(case, fits):
    """Pages of 8, a 20-page watermark (20% of 100), 30 free pages, two evicting decoders of
    5 pages (40 tokens, their budget) ending in 10 steps (no credit in time), a 200-token
    prompt of peak 25 pages starting with 2: 30 - 2 (its chunk) - 2 (margin) = 26 >= 23
    owed. `_margin` replaces the watermark only when every running request evicts and
    stores its policy's budget (`Scheduler._grows`); otherwise 30 - 2 - 20 = 8 < 23."""
    from kvcompile.engine.scheduler import Scheduler

    pool = _Pool(30, {1: 5, 2: 5})
    s = Scheduler(pool, None, max_num_batched_tokens=32, max_num_seqs=8, watermark=0.2)
    assert s.watermark == 20
    s.exact_margin = case != "watermark"
    keep = 80 if case == "below_budget" else None
    s.running = [_req(1, 40, 40, 1, 11, keep=keep),
                 _req(2, 40, 40, 1, 11, evicts=case != "plain")]
    new = _req(99, 200, 0, 0, 10, peak=200)
    assert s._margin(new) == (2 if fits else 20)
    assert s._peaks_fit(new, 16) is fits


@pytest.mark.parametrize("every, fits", [
    (8, True),    # evicted every 8 tokens: it adds at most 2 pages a step, 10 by step 5
    (0, False),   # evicted at its end: up to 5 pages a step, 15 owed by step 3 > 10 free
])
def test_prompt_growth_by_eviction_chunk(every, fits):
    """Pages of 8, 32-token steps; a prompt of peak 25 pages starting with 2 (23 owed), 10
    pages free past its chunk and the margin, two evicting decoders of 10 pages ending in 6
    steps. A prompt evicted every 8 tokens computes at most 8 a step, so it needs 2j pages
    by step j and the decoders' 20 pages come in time; one that may grow a step's budget a
    step (5 pages) would need 15 by step 3."""
    from kvcompile.engine.scheduler import Scheduler

    pool = _Pool(10 + 2 + 2, {1: 10, 2: 10})
    s = Scheduler(pool, None, max_num_batched_tokens=32, max_num_seqs=8, watermark=0.05)
    s.running = [_req(i, 80, 80 + 4, 5, 10) for i in (1, 2)]
    new = _req(99, 200, 0, 0, 10, peak=200, every=every)
    assert s._margin(new) == 2
    assert s._peaks_fit(new, 16) is fits
    s.exact_margin = False   # the rule before: a step's budget a step, and the watermark
    assert s._margin(new) == 5 and s._peaks_fit(new, 16) is False


@pytest.mark.parametrize("free, fits", [(15, True), (14, False)])
def test_plain_requests_admitted_by_their_lifetime(free, fits):
    """`reserve_plain` (opt-in): pages of 8; a running request that keeps every token, 40 +
    24 tokens (8 pages in its life) holding 5; a new 80 + 16-token request (12 pages)
    starting with a 16-token chunk (2 pages): it owes 10 more and the running one 3, so it
    starts only with 2 + 13 = 15 free pages. Beside an evicting request it is not planned."""
    from kvcompile.engine.scheduler import Scheduler

    pool = _Pool(free, {1: 5})
    s = Scheduler(pool, None, max_num_batched_tokens=32, max_num_seqs=8)
    s.running = [_req(1, 40, 40, 1, 24, evicts=False)]
    new = _req(99, 80, 0, 0, 16, evicts=False)
    assert s._lifetimes_fit(new, 16) is fits
    s.running.append(_req(2, 40, 40, 1, 24))   # an evicting one: the rule steps aside
    pool.pages[2] = 1
    assert s._lifetimes_fit(new, 16) is True


@pytest.mark.parametrize("step_tokens, exact, fits", [
    (40, True, True),     # the running prompt's last chunk is known: it gives a page back
    (40, False, False),   # the rule before: growth a step budget a step, no give-back
    (32, True, False),    # the chunks do not all fit a step: its end is not known
])
def test_running_prompt_gives_back_its_transient(step_tokens, exact, fits):
    """Pages of 8, chunks of 16 (eviction every 16 tokens), budgets of 40 tokens (5 pages).
    A running prompt of 160 tokens has computed 128 and holds its peak (8 pages): 2 chunks to
    go, then it decodes at 5 + 2 pages (one page back). A new prompt of peak 12 pages starts
    with 2 and owes 10 at 3 pages a step; 9 pages are free past its chunk and the margin of
    the one decoder. It fits only with the give-back (10 - 1 = 9 by step 4), which needs every
    prompt's chunk and the decode in one step (16 + 16 + 1 <= 40, not <= 32)."""
    from kvcompile.engine.scheduler import Scheduler

    pool = _Pool(9 + 1 + 2, {1: 5, 2: 8})
    s = Scheduler(pool, None, max_num_batched_tokens=step_tokens, max_num_seqs=8)
    s.exact_margin = exact
    s.running = [_req(1, 40, 40, 1, 100),
                 _req(2, 160, 128, 0, 10, peak=64, keep=40, every=16)]
    new = _req(99, 200, 0, 0, 10, peak=96, keep=40, every=16)
    assert s._margin(new) == 1
    assert s._prefill_end(s.running[1], 8) == ((3, -1) if exact else (None, 0))
    assert s._peaks_fit(new, 16) is fits


def test_swap_aside_runs_a_prompt_beside_decoders():
    """Engine(swap_aside=True): a pool of 14 pages of 8 tokens, six 64-token prompts (8 pages
    each before their eviction) with SnapKV(16, hold=True) (2 pages once evicted): beside
    three decoders a prompt's transient does not fit although its evicted size does, so a
    decoder is copied to host memory for the prompt's prefill and comes back after it, with
    its eviction bookkeeping. The tokens are generate's (each request alone), nothing is
    preempted, the work takes fewer steps with more requests running; without the option
    (and for pages with a bf16 residual, which are not swapped) nothing is swapped."""
    hold = SnapKV(budget=16, window=4, hold=True)
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    small = 14 * m.config.num_hidden_layers * 2 * 2 * PAGE * 16 * 4
    kvcompile.compile(m, config(page_size=PAGE, kv_dtype="fp32", max_kv_bytes=small,
                                eviction=hold))
    prompts = random_prompts(random.Random(11), 6, 64, 64)
    want = _generate(m, prompts, 24)
    runs = {}
    for aside in (False, True):
        eng = Engine(m, max_num_batched_tokens=16, swap_aside=aside)
        assert eng.pool.num_pages == 14
        before = state_of(m).counters.get("swapped_aside", 0)
        outs = eng.generate(prompts, _greedy(24))
        eng.pool.check_invariants()
        running = [s.num_running for s in eng.history if s.decode_tokens]
        runs[aside] = (state_of(m).counters.get("swapped_aside", 0) - before,
                       [o.token_ids for o in outs], eng.stats.preemptions, eng.stats.steps,
                       sum(running) / len(running))
        eng.close()
        assert eng.pool.stats().pages_used == 0 and eng.scheduler.swap_used == 0
        assert not state_of(m).eviction.books, "bookkeeping left behind"
    assert runs[False][0] == 0 and runs[True][0] > 0
    for aside in (False, True):
        assert runs[aside][1] == want and runs[aside][2] == 0, aside
    assert runs[True][3] < runs[False][3] and runs[True][4] > runs[False][4]


def test_swap_aside_not_for_residual_pages(caplog):
    """Pages with a bf16 residual tail are not swapped: swap_aside leaves the prompt waiting
    (the scheduler's `pool_swappable`) and says so when the engine is made."""
    hold = SnapKV(budget=16, window=4, hold=True)
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=16, kv_dtype="int4", scale_granularity="channel",
                                residual=True, eviction=hold))
    prompts = random_prompts(random.Random(12), 3, 64, 64)
    with caplog.at_level("WARNING", logger="kvcompile"):
        eng = Engine(m, max_num_batched_tokens=32, swap_aside=True)
    assert not eng.scheduler.pool_swappable
    assert "swap_aside=True does nothing here" in caplog.text and "residual" in caplog.text
    before = state_of(m).counters.get("swapped_aside", 0)
    eng.generate(prompts, _greedy(8))
    assert state_of(m).counters.get("swapped_aside", 0) == before
    eng.close()


@pytest.mark.parametrize("case, swaps", [
    ("swaps", True),           # one decoder's 16 pages make room for the prompt's peak
    ("peak_fits", False),      # 40 free pages: the prompt is admitted as it is
    ("steady_too_big", False),  # its evicted size (27 pages) does not fit either: no slot
    ("no_swap_space", False),  # the host memory allowed is smaller than a decoder
    ("plain_decoders", False),  # decoders that keep every token are never swapped aside
    ("off", False),            # Scheduler.swap_aside False (the default)
])
def test_swap_aside_rule(case, swaps):
    """Pages of 8, 32-token steps; three evicting decoders of 16 pages (at their 128-token
    budget, 50 tokens to go: none ends during the prompt's prefill); a 200-token prompt of
    peak 25 pages that keeps 40 tokens once evicted (7 pages with the decode margin). With 12
    free pages its peak does not fit (12 - 3 margin - 2 chunk < 23 owed) but its evicted size
    does; one decoder swapped aside (its 16 pages) makes room. The decoder comes back only
    when the prompt no longer owes pages to its peak (`_room_beside_prompts`)."""
    from types import SimpleNamespace

    from kvcompile.engine.request import Status
    from kvcompile.engine.scheduler import Scheduler

    pages = {1: 16, 2: 16, 3: 16}
    pool = _Pool(40 if case == "peak_fits" else 12, pages)
    pool.bytes_per_page = 1
    swapped_out = []

    def swap_out(sid):
        swapped_out.append(sid)
        pool.num_available += pages[sid]
        return SimpleNamespace(nbytes=pages[sid], num_pages=pages[sid])

    pool.swap_out = swap_out
    s = Scheduler(pool, None, max_num_batched_tokens=32, max_num_seqs=8,
                  swap_space_bytes=8 if case == "no_swap_space" else 1 << 20)
    s.swap_aside = case != "off"
    s.running = [_req(i, 40, 40 + 49, 50, 100, keep=128, evicts=case != "plain_decoders")
                 for i in (1, 2, 3)]
    new = _req(None, 200, 0, 0, 10, peak=200, keep=200 if case == "steady_too_big" else 40)
    s.waiting.append(new)
    assert (s.swap_aside and s._swap_aside(new)) is swaps
    assert bool(swapped_out) is swaps
    if not swaps:
        return
    assert len(swapped_out) == 1 and len(s.running) == 2 and s.swapped[0].status is \
        Status.SWAPPED and s.swapped[0].aside is not None
    assert s._peaks_fit(new, 32 - 2, have=0)   # the prompt now fits (step 4 admits it)
    # the prompt in prefill still owes pages to its peak: the decoder waits
    new.seq_id, new.num_computed = 4, 64
    pages[4] = 8
    s.running.append(new)
    pool.num_available -= 8
    assert not s._room_beside_prompts(s.swapped[0])
    new.num_computed = 200                      # its last chunk ran; evicted to 7 pages
    pages[4] = 7
    pool.num_available += 1
    assert s._room_beside_prompts(s.swapped[0])
