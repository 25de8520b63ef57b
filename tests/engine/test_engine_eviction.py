"""Eviction in the engine: per model (KVConfig.eviction) and per request
(SamplingParams.eviction).

The reference is Hugging Face `generate` on the same model compiled with the same policy (the
eviction path tests/eviction checks against masked attention): prefill attends in full, then
each decode step evicts. The engine must produce the same tokens whatever its chunking, batch
neighbours, preemptions and prefix cache, and give evicted pages back to the pool.
"""

from __future__ import annotations

import random

import pytest
import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.api import state_of
from kvcompile.config import H2O, EvictionPolicy, SinkWindow, SnapKV
from kvcompile.engine.params import RequestError
from kvcompile.testing import ASSERT_CLOSE
from tests.engine.test_engine import _run_arrivals
from tests.engine.tiny import config, make_hf, random_prompts

PAGE = 8
MODEL_POLICY = H2O(budget=16, recent=4, sinks=2)
POLICIES = [SinkWindow(2, 12), SnapKV(budget=16, window=4), None, "model",
            SnapKV(budget=16, window=4, hold=True)]


def _budget(policy) -> int:
    return policy.sinks + policy.window if isinstance(policy, SinkWindow) else policy.budget


@pytest.fixture(scope="module")
def model():
    """fp32 tiny Llama compiled with H2O, fp32 pages of 8 tokens: the engine's model and the
    reference's (generate)."""
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=PAGE, kv_dtype="fp32", eviction=MODEL_POLICY))
    _generate(m, [[5, 6, 7]], 2)   # compiled, the pool built, at the first call
    return m


def _generate(m, prompts, n: int, policy="model") -> list[list[int]]:
    """Greedy tokens of HF generate on `m`, one prompt at a time, its sequences under `policy`
    ("model": the compiled one) through the run time's per-sequence policies."""
    st = state_of(m)
    pool = st.pool if policy != "model" else None
    if pool is not None:
        allocate = pool.allocate

        def allocate_with_policy(k=1):
            ids = allocate(k)
            for sid in ids:
                st.eviction.set_sequence_policy(sid, policy)
            return ids

        pool.allocate = allocate_with_policy
    try:
        out = []
        for p in prompts:
            ids = m.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(p):].tolist())
    finally:
        if pool is not None:
            pool.allocate = allocate
    return out


def _greedy(n: int, eviction="model") -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, eviction=eviction)


def test_engine_equals_generate_per_request_policy(model):
    """Prompts of 20-40 tokens under a 16-token step budget, one batch with a request of each
    policy (SinkWindow, SnapKV, none, the model's H2O, SnapKV holding its budget): every prompt is chunked, yet it evicts
    as generate's one-forward prefill does, and decodes evict after every step."""
    rng = random.Random(0)
    prompts = random_prompts(rng, len(POLICIES), 20, 40)
    want = [_generate(model, [p], 20, pol)[0] for p, pol in zip(prompts, POLICIES)]
    before = state_of(model).counters.get("evicted_tokens", 0)
    eng = Engine(model, max_num_batched_tokens=16)
    stored = {i: [] for i in range(len(POLICIES))}
    rids = [eng.add_request(p, _greedy(20, pol)) for p, pol in zip(prompts, POLICIES)]

    def watch(_st):
        for r in eng.scheduler.running:
            if r.seq_id is not None and r.num_computed > len(r.prompt_ids):
                stored[rids.index(r.id)].append((eng.pool.seq_len(r.seq_id), r.num_computed))

    eng.on_step.append(watch)
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    for i, pol in enumerate(POLICIES):
        assert outs[rids[i]].token_ids == want[i], f"request {i} ({pol}) differs from generate"
    assert state_of(model).counters["evicted_tokens"] > before
    # (stored, computed) tokens of each request after each of its decode steps: SinkWindow
    # and H2O hold their budget, SnapKV its budget + the tokens since its prompt, no policy all
    assert {s for s, _ in stored[0]} == {_budget(POLICIES[0])}
    assert {s for s, _ in stored[3]} == {_budget(MODEL_POLICY)}
    assert stored[1] and all(s == _budget(POLICIES[1]) + c - len(prompts[1])
                             for s, c in stored[1])
    assert stored[2] and all(s == c for s, c in stored[2])
    # SnapKV(hold=True) holds its budget while decoding, as SinkWindow and H2O do
    assert {s for s, _ in stored[4]} == {_budget(POLICIES[4])}
    eng.close()
    assert eng.pool.stats().sequences == 0 and eng.pool.stats().pages_used == 0
    assert not state_of(model).eviction.seq_policy, "per-sequence policies leaked"


def arrivals_in_few_pages(model, reqs, expect, free_pages, page, mode, rng,
                          reserve_prefill=True) -> None:
    """Random arrivals on an engine whose pool has `free_pages` pages free (the rest held by
    another sequence), checked by `check_arrivals`; the pool is empty afterwards.
    reserve_prefill=False: evicting prompts admitted on their first chunk, so that they
    overcommit the pool and are preempted."""
    pool = state_of(model).pool
    hog = pool.allocate(1)[0]
    pool.reserve([hog], (pool.num_pages - free_pages) * page)
    try:
        eng = Engine(model, max_num_batched_tokens=32, preemption_mode=mode)
        eng.scheduler.watermark = 1   # as a small pool's (1% of the pages, at least 1)
        eng.scheduler.reserve_prefill = reserve_prefill
        final = _run_arrivals(eng, reqs, rng, lambda e, _: e.pool.check_invariants())
        check_arrivals(eng, reqs, final, expect)
        eng.close()
    finally:
        pool.free([hog])
    assert pool.stats().pages_used == 0


def check_arrivals(eng, reqs, final, expect) -> None:
    """Random arrivals: every request equals itself alone, some were preempted, evicting
    requests took no page from the prefix cache, and the prefix cache hit for the others."""
    for i in range(len(reqs)):
        assert final[i].token_ids == expect[i], f"request {i} changed by its neighbours"
    assert eng.stats.preemptions > 0
    evicting = [i for i, (_p, sp) in enumerate(reqs) if sp.eviction is not None]
    assert all(final[i].num_cached_tokens == 0 for i in evicting)
    assert any(final[i].num_cached_tokens for i in final if i not in evicting), \
        "the prefix cache never hit"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_arrivals_with_preemption_and_prefix_caching(model, mode):
    """A tiny pool forces preemption; prompts share a prefix; some requests evict and some do
    not. Every request equals itself alone: a recompute replays each eviction (one token per
    step past the prompt), and evicting requests never share pages through the prefix cache."""
    rng = random.Random(3)
    shared = random_prompts(rng, 1, 17, 17)[0]
    choices = [None, "model", None, SinkWindow(2, 10)]
    reqs = [(shared + p, SamplingParams(temperature=0, max_tokens=rng.randrange(15, 30),
                                        ignore_eos=True, eviction=choices[i % 4]))
            for i, p in enumerate(random_prompts(rng, 8, 4, 30))]
    alone = Engine(model, max_num_batched_tokens=128, enable_prefix_caching=False)
    expect = [alone.generate([p], sp)[0].token_ids for p, sp in reqs]
    alone.close()
    # leave 12 pages of 8 tokens: each request fits alone
    arrivals_in_few_pages(model, reqs, expect, 12, PAGE, mode, rng)


def test_evicted_pages_go_back_and_admit_more():
    """A pool of 12 pages of 8 tokens: three 30-token requests decoding to 60 tokens each do
    not fit together without eviction (preemptions); with SinkWindow(2, 14) each holds at most
    3 pages once its prompt is done, so all three run at once and none is preempted."""
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    small = 12 * m.config.num_hidden_layers * 2 * 2 * PAGE * 16 * 4
    kvcompile.compile(m, config(page_size=PAGE, kv_dtype="fp32", max_kv_bytes=small,
                                eviction=SinkWindow(2, 14)))
    prompts = random_prompts(random.Random(5), 3, 30, 30)
    runs = {}
    for eviction in (None, "model"):
        eng = Engine(m, max_num_batched_tokens=96)
        assert eng.pool.num_pages == 12
        eng.generate(prompts, _greedy(30, eviction))
        runs[eviction] = (eng.stats.preemptions, max(s.num_running for s in eng.history),
                          [s.pages_free for s in eng.history])
        eng.pool.check_invariants()
        eng.close()
        assert eng.pool.stats().pages_used == 0
    assert runs[None][0] > 0
    assert runs["model"][0] == 0 and runs["model"][1] == 3
    assert min(runs["model"][2][3:]) >= 12 - 3 * 3, "evicted pages did not come back"
    assert state_of(m).counters["evicted_tokens"] > 0


@pytest.mark.parametrize("cfg", [
    dict(kv_dtype="bf16"),
    dict(kv_dtype="fp8_e4m3"),
    # generate's fresh prompt attends to its own K/V (SDPA), the engine's prompt chunks to
    # their stored pages: int4 keys part the tokens, so both attend to the stored pages here
    # (an H2O prompt took the fp32 path over its stored pages in both before its prompt mass
    # moved beside the plain kernels)
    dict(kv_dtype="int4", scale_granularity="channel", residual=True, page_size=16,
         prefill_attends="stored"),
], ids=["bf16", "fp8", "int4-channel-residual"])
def test_storage_formats_compose_with_eviction(cfg):
    """The engine evicts (moves tokens in) quantized pages, channel-scaled keys and residual
    pages as generate does: same tokens, same stored lengths."""
    cfg = dict(cfg)
    page = cfg.pop("page_size", PAGE)
    prompts = random_prompts(random.Random(4), 2, 24, 36)
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(page_size=page, eviction=H2O(budget=20, recent=4, sinks=2),
                                **cfg))
    def moved():   # tokens moved one sequence at a time, or slots by the batched pass
        c = state_of(m).counters
        return c.get("eviction_moves", 0) + c.get("eviction_moved_slots", 0)

    want = _generate(m, prompts, 16)
    moves = moved()
    assert moves > 0
    eng = Engine(m, max_num_batched_tokens=64)
    outs = eng.generate(prompts, _greedy(16))
    assert [o.token_ids for o in outs] == want
    assert moved() > moves
    eng.close()
    assert eng.pool.stats().pages_used == 0


def test_eviction_requests_refused_clearly(model):
    with pytest.raises(RequestError, match=r"SamplingParams.eviction='sometimes'.*allowed"):
        SamplingParams(eviction="sometimes")
    with pytest.raises(RequestError, match="SamplingParams.eviction"):
        SamplingParams(eviction={"policy": "sink_window", "size": 3})
    torch._dynamo.reset()
    plain = make_hf("llama", "sdpa")
    eng = Engine(plain, config=config(page_size=PAGE), max_num_batched_tokens=32)
    with pytest.raises(RequestError, match=r"needs a model compiled with an eviction policy"):
        eng.add_request([5, 6, 7], SamplingParams(eviction=SinkWindow(2, 8)))
    eng.add_request([5, 6, 7], SamplingParams(eviction=None, max_tokens=2))  # keep all: fine
    eng.close()

    class Unregistered(EvictionPolicy):
        pass

    eng = Engine(model, max_num_batched_tokens=32)
    with pytest.raises(RequestError, match="register_policy"):
        eng.add_request([5, 6, 7], SamplingParams(eviction=Unregistered()))
    assert not eng.has_unfinished()
    eng.close()


# --- decode steps that eviction steps aside for (CUDA graphs on the GPU) -----------------------

_SYNCS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


class _NoHostSync:
    """Makes every tensor -> host read raise (Tensor.item, .tolist(), .nonzero(), bool(t),
    int(t), ...): what a step between CUDA-graph replays must not do."""

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in _SYNCS}

        def refuse(name):
            def f(*_a, **_k):
                raise AssertionError(f"host sync: Tensor.{name} between decode steps")
            return f

        for n in _SYNCS:
            setattr(torch.Tensor, n, refuse(n))

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


@pytest.fixture
def original_sinks(model):
    """SinkWindow's sinks at their text positions: no per-slot rotation, so decode steps can
    step aside (re-rotated sinks need attend_kept)."""
    rt = state_of(model).eviction
    rt.sink_positions = "original"
    yield
    rt.sink_positions = "cache"


def test_decode_steps_step_aside_and_equal_generate(model, original_sinks):
    """SinkWindow (original sink positions), SnapKV and no policy decode through the plain
    decode path over the stored slots, evicting on the device after each step without a host
    sync: the tokens are generate's, whose every step attends over kept slots on the host."""
    rng = random.Random(6)
    pols = [SinkWindow(2, 12), SnapKV(budget=16, window=4), None]
    prompts = random_prompts(rng, len(pols), 20, 40)
    want = [_generate(model, [p], 20, pol)[0] for p, pol in zip(prompts, pols)]
    st = state_of(model)
    before = {k: st.counters.get(k, 0) for k in ("eviction_aside_steps", "eviction_device_runs",
                                                 "eviction_window_runs")}
    eng = Engine(model, max_num_batched_tokens=64)
    rt = st.eviction
    step = rt.after_decode_step

    def checked(seq_ids):
        with _NoHostSync():
            step(seq_ids)

    rt.after_decode_step = checked
    try:
        outs = eng.generate(prompts, [_greedy(20, p) for p in pols])
    finally:
        del rt.after_decode_step
    assert [o.token_ids for o in outs] == want
    assert st.counters["eviction_aside_steps"] - before["eviction_aside_steps"] >= 18
    # SinkWindow evicts without moving tokens (_evict_window), once per step here
    assert st.counters["eviction_window_runs"] - before["eviction_window_runs"] >= 18
    eng.close()
    assert eng.pool.stats().pages_used == 0


def _record(eng, rt):
    """Per request: the logits of each step, and after each step the kept positions and H2O
    mass of every layer of each request that keeps mass (the bookkeeping is current after a
    step that evicted: every step here, interval 1)."""
    logits, books = {}, {}
    fwd = eng.runner.forward

    def forward(out):
        lg = fwd(out)
        for s, row in zip(out.seqs, lg):
            logits.setdefault(s.req.id, []).append(row.clone())
            book = rt.books.get(s.req.seq_id)
            if book is not None and book.mass and not book.pending:
                books.setdefault(s.req.id, []).append(
                    {li: (book.pos[li].clone(), book.mass[li].clone()) for li in book.mass})
        return lg

    eng.runner.forward = forward
    return logits, books


def test_h2o_and_rerotated_sinks_step_aside_and_equal_host_path(model):
    """H2O (the model's and a request's) and SinkWindow with its sinks re-rotated (the default
    sink positions) decode aside: the mass comes from the decode attention's output into the
    device store, the sinks' rotation is applied inside the step, and neither the step's
    attention nor the eviction after it syncs with the host. Logits, kept positions and mass
    after every step equal the host path's (decode_aside refused: attend_kept)."""
    import kvcompile.eviction.runtime as R

    rng = random.Random(6)
    pols = ["model", SinkWindow(2, 12), H2O(budget=14, recent=3, sinks=1)]
    prompts = random_prompts(rng, len(pols), 20, 40)
    st = state_of(model)
    runs = []
    for aside in (True, False):
        eng = Engine(model, max_num_batched_tokens=64)
        rt = st.eviction
        logits, books = _record(eng, rt)
        before = {k: st.counters.get(k, 0) for k in ("eviction_aside_steps",
                                                     "eviction_aside_reference")}
        attend, step = R.attend_aside, rt.after_decode_step

        def attend_checked(*a, attend=attend, **k):
            with _NoHostSync():
                return attend(*a, **k)

        def step_checked(seq_ids, step=step):
            with _NoHostSync():
                step(seq_ids)

        R.attend_aside, rt.after_decode_step = attend_checked, step_checked
        if not aside:
            rt.decode_aside = lambda seq_ids: False
        try:
            outs = eng.generate(prompts, [_greedy(12, p) for p in pols])
        finally:
            R.attend_aside = attend
            for name in ("after_decode_step", "decode_aside"):
                rt.__dict__.pop(name, None)
        steps = st.counters.get("eviction_aside_steps", 0) - before["eviction_aside_steps"]
        assert (steps >= 11) == aside
        if aside:
            assert st.counters["eviction_aside_reference"] > before["eviction_aside_reference"]
            assert rt.store is not None and not rt.store.row_of, "mass rows leaked"
        runs.append(([o.token_ids for o in outs], logits, books))
        eng.close()
    (tok_a, log_a, books_a), (tok_h, log_h, books_h) = runs
    assert tok_a == tok_h
    atol, rtol = ASSERT_CLOSE[torch.float32]
    for rid in log_h:
        torch.testing.assert_close(torch.stack(log_a[rid]), torch.stack(log_h[rid]), atol=atol,
                                   rtol=rtol, msg=lambda m, rid=rid: f"request {rid}: {m}")
    assert sorted(books_h) == sorted(books_a) and len(books_h) == 2   # the two H2O requests
    for rid in books_h:
        assert len(books_a[rid]) == len(books_h[rid]) >= 10
        for got, want in zip(books_a[rid], books_h[rid]):
            for li in want:   # slot order differs (compact_front vs move_tokens): by position
                (pg, mg), (pw, mw) = got[li], want[li]
                og, ow = pg.argsort(-1), pw.argsort(-1)
                assert torch.equal(pg.gather(1, og), pw.gather(1, ow)), "kept positions differ"
                torch.testing.assert_close(mg.gather(1, og), mw.gather(1, ow), atol=atol,
                                           rtol=rtol)


def _kept(pool, sid) -> int:
    """Tokens a sequence keeps: stored, less those a window hides (pool.hide)."""
    return pool.seq_len(sid) - (pool.evicted(sid) - pool.dropped(sid))


def _host_path(rt) -> None:
    """Every eviction on the host (evict: move_tokens, which reads counts), SinkWindow too."""
    rt._evict_fronts = lambda items: list(items)
    rt._window_policy = lambda *a: None


def _device_path(rt) -> None:
    for name in ("_evict_fronts", "_window_policy"):
        rt.__dict__.pop(name, None)


def test_eviction_interval_device_path_equals_host_path(model, original_sinks):
    """Every 4 steps (a sequence holds at most budget + 3 tokens): eviction without moving
    tokens (SinkWindow: _evict_window) and on the host (move_tokens, which reads counts) keep
    the same tokens at the same cadence, and give the same outputs."""
    rng = random.Random(8)
    prompts = random_prompts(rng, 3, 20, 30)
    pols = [SinkWindow(2, 10), SinkWindow(3, 9), SnapKV(budget=14, window=4)]
    rt = state_of(model).eviction
    runs = []
    for device in (True, False):
        eng = Engine(model, max_num_batched_tokens=64, eviction_interval=4)
        lens = []   # (budget, kept) of each decoding SinkWindow request after each step
        eng.on_step.append(lambda _st, eng=eng, lens=lens: lens.extend(
            (_budget(r.params.eviction), _kept(eng.pool, r.seq_id))
            for r in eng.scheduler.running if isinstance(r.params.eviction, SinkWindow)
            and r.num_computed > len(r.prompt_ids)))
        if not device:
            _host_path(rt)
        try:
            outs = eng.generate(prompts, [_greedy(24, p) for p in pols])
        finally:
            _device_path(rt)
        runs.append(([o.token_ids for o in outs], lens))
        eng.close()
    assert runs[0] == runs[1]
    held = runs[0][1]
    assert held and all(b <= n <= b + 3 for b, n in held)
    assert {n - b for b, n in held} == {0, 1, 2, 3}, "not every 4 steps"


def test_eviction_interval_h2o_and_rerotated_sinks(model):
    """Every 4 steps, H2O's mass accumulates in the device store between evictions and the
    sinks' shift changes only at them: eviction on the device (front.py, batched) and on the
    host (evict, which reads counts) give the same logits, kept positions and mass."""
    rng = random.Random(9)
    prompts = random_prompts(rng, 3, 20, 30)
    pols = [SinkWindow(2, 10), H2O(budget=14, recent=3, sinks=1), "model"]
    rt = state_of(model).eviction
    runs = []
    for device in (True, False):
        eng = Engine(model, max_num_batched_tokens=64, eviction_interval=4)
        logits, books = _record(eng, rt)
        if not device:
            _host_path(rt)
        try:
            outs = eng.generate(prompts, [_greedy(16, p) for p in pols])
        finally:
            _device_path(rt)
        runs.append(([o.token_ids for o in outs], logits, books))
        eng.close()
    assert runs[0][0] == runs[1][0]
    atol, rtol = ASSERT_CLOSE[torch.float32]
    for rid in runs[1][1]:
        torch.testing.assert_close(torch.stack(runs[0][1][rid]), torch.stack(runs[1][1][rid]),
                                   atol=atol, rtol=rtol)
    (_, _, got), (_, _, want) = runs
    assert sorted(got) == sorted(want) and len(want) == 2
    for rid in want:
        assert len(got[rid]) == len(want[rid]) >= 3
        for g, w in zip(got[rid], want[rid]):
            for li in w:
                og, ow = g[li][0].argsort(-1), w[li][0].argsort(-1)
                assert torch.equal(g[li][0].gather(1, og), w[li][0].gather(1, ow))
                torch.testing.assert_close(g[li][1].gather(1, og), w[li][1].gather(1, ow),
                                           atol=atol, rtol=rtol)


def test_full_mass_store_decodes_on_host_path_and_says_why(model, caplog):
    """More H2O sequences decoding at once than the mass store has rows: their steps take the
    host path (same tokens), and the reason is logged once."""
    prompts = random_prompts(random.Random(10), 2, 20, 24)
    alone = Engine(model, max_num_batched_tokens=64)
    want = alone.generate(prompts, _greedy(4))
    alone.close()
    eng = Engine(model, max_num_batched_tokens=64)
    rt = state_of(model).eviction
    rt.set_aside_rows(1)
    rt.store = None
    st = state_of(model)
    before = st.counters.get("eviction_aside_steps", 0)
    try:
        with caplog.at_level("WARNING", logger="kvcompile"):
            outs = eng.generate(prompts, _greedy(4))
    finally:
        rt.set_aside_rows(128)   # (the engine's default max_num_seqs)
        rt._said.clear()
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert st.counters.get("eviction_aside_steps", 0) == before
    said = [r for r in caplog.records if "mass store's 1 rows" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    eng.close()


def test_chunked_prompts_attend_as_without_eviction(model, monkeypatch):
    """SinkWindow and SnapKV prompts, chunked by a 16-token step budget, attend through the
    paged prefill path (nothing is evicted before a prompt's end) with SnapKV's observation
    rows scored apart: the same tokens as the eviction runtime's own attention over every
    query, which the first run forces."""
    from kvcompile.eviction.runtime import EvictionRuntime

    rng = random.Random(3)
    pols = [SinkWindow(2, 12), SnapKV(budget=16, window=4), SnapKV(budget=12, window=3)]
    prompts = random_prompts(rng, len(pols), 20, 40)

    def run():
        eng = Engine(model, max_num_batched_tokens=16)
        outs = eng.generate(prompts, [_greedy(12, p) for p in pols])
        eng.close()
        return [o.token_ids for o in outs]

    st = state_of(model)
    with monkeypatch.context() as mp:
        mp.setattr(EvictionRuntime, "takes_plain_prefill", lambda self, plan, layer: False)
        mp.setattr(EvictionRuntime, "plain_rows",
                   lambda self, plan, layer: [False] * plan.batch)
        before = st.counters.get("eviction_plain_prefill", 0)
        want = run()
        assert st.counters.get("eviction_plain_prefill", 0) == before
    got = run()
    assert st.counters.get("eviction_plain_prefill", 0) > before
    assert got == want


@pytest.mark.parametrize("cfg", [
    dict(kv_dtype="fp8_e4m3", page_size=8, free_pages=12),
    # the 4-bit Pareto layout's kind (int4 keys with channel scales, token-scaled values, bf16
    # residual page); pages of 16 keep the test small (the capacity benchmark uses 64)
    # (this case parted at the SnapKV request's 3rd token while the scheduler cut its prompt
    # at 14 tokens, inside a page, when the budget left was under a page: now the chunk waits,
    # test_engine.py::test_quantized_prompt_chunks_end_on_pages)
    dict(kv_dtype="int4", scale_granularity="channel", residual=True, page_size=16,
         free_pages=6),
    # the same without the residual page (the capacity rows' 4-bit format): its evictions
    # re-encode the moved tokens' (page, head)s on the device (compaction.move_slots_device)
    dict(kv_dtype="int4", scale_granularity="channel", page_size=16, free_pages=6),
], ids=["fp8", "int4-channel-residual", "int4-channel"])
def test_random_arrivals_quantized_eviction_preemption_prefix(cfg):
    """Issue 19's settings under random arrivals: quantized pages, SinkWindow and SnapKV (growing
    and holding its budget) requests beside requests that keep every token, prompts that share a prefix, a pool so
    small that evicting requests are preempted (recomputed: each eviction replayed). Every
    request equals itself alone on a roomy engine (one prefill chunk), and the evicting ones
    differ from the same request without eviction (the comparison sees eviction)."""
    cfg = dict(cfg)
    free_pages = cfg.pop("free_pages")
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    # prompts attend to their stored pages whether chunked or not (as the int4 case above)
    kvcompile.compile(m, config(eviction=SinkWindow(2, 10), prefill_attends="stored", **cfg))
    rng = random.Random(5)
    shared = random_prompts(rng, 1, 17, 17)[0]
    choices = [None, SinkWindow(2, 10), None, SnapKV(budget=12, window=4)]
    hold = SnapKV(budget=12, window=4, hold=True)   # the last SnapKV request holds its budget
    reqs = [(shared + p, SamplingParams(temperature=0, max_tokens=rng.randrange(15, 30),
                                        ignore_eos=True,
                                        eviction=choices[i % 4] if i != 7 else hold))
            for i, p in enumerate(random_prompts(rng, 8, 4, 30))]
    alone = Engine(m, max_num_batched_tokens=128, enable_prefix_caching=False)
    expect = [alone.generate([p], sp)[0].token_ids for p, sp in reqs]
    keep_all = [alone.generate([p], SamplingParams(temperature=0, max_tokens=sp.max_tokens,
                                                   ignore_eos=True, eviction=None))[0].token_ids
                for p, sp in reqs]
    alone.close()
    evicting = [i for i, (_p, sp) in enumerate(reqs) if sp.eviction is not None]
    assert any(expect[i] != keep_all[i] for i in evicting), "eviction changed no request"
    pool = state_of(m).pool
    hog = pool.allocate(1)[0]
    pool.reserve([hog], (pool.num_pages - free_pages) * pool.page_size)
    try:
        eng = Engine(m, max_num_batched_tokens=32, preemption_mode="recompute")
        eng.scheduler.watermark = 1
        # evicting prompts admitted on their first chunk, so that they overcommit the pool and
        # are preempted (recomputed): the replay this test checks (by default they wait for
        # their peak: test_engine_prefill_eviction.py)
        eng.scheduler.reserve_prefill = False
        final = _run_arrivals(eng, reqs, rng, lambda e, _: e.pool.check_invariants())
        for i in range(len(reqs)):
            assert final[i].token_ids == expect[i], \
                f"request {i} ({reqs[i][1].eviction}) changed by its neighbours"
        assert any(final[i].num_preemptions for i in evicting), "no evicting request preempted"
        assert all(final[i].num_cached_tokens == 0 for i in evicting)
        assert any(final[i].num_cached_tokens for i in final if i not in evicting), \
            "the prefix cache never hit"
        if not cfg.get("residual"):   # decode-step evictions moved tokens on the device
            assert state_of(m).counters.get("eviction_device_runs", 0) > 0
        eng.close()
    finally:
        pool.free([hog])
    assert pool.stats().pages_used == 0


@pytest.mark.parametrize("kv", ["int4-channel-residual", "bf16"])
def test_prompt_chunk_cut_inside_a_page_waits(kv):
    """The int4 case of the random-arrivals test above parted from its run alone because the
    step budget left after a neighbour's prompt (14 tokens) cut a prompt inside its first page:
    pages whose tokens share scales and a bf16 residual store and attend other values for a
    prompt written in two pieces of a page than in one (not eviction state: the same request
    alone in chunks of 14 parted the same way). Such a chunk now waits for a later step, so
    the prompt's chunks end on page boundaries and its tokens are its own in one piece. bf16
    pages (negative case: every token stored on its own) take the 14-token chunk at once."""
    cfg = (dict(kv_dtype="int4", scale_granularity="channel", residual=True)
           if kv != "bf16" else dict(kv_dtype="bf16"))
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(eviction=SinkWindow(2, 10), prefill_attends="stored",
                                page_size=16, **cfg))
    rng = random.Random(5)   # the random-arrivals test's request 7 (SnapKV, 33 tokens)
    shared = random_prompts(rng, 1, 17, 17)[0]
    prompt = shared + random_prompts(rng, 8, 4, 30)[7]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,   # (parted at 2)
                            eviction=SnapKV(budget=12, window=4))
    first = random_prompts(random.Random(9), 1, 18, 18)[0]
    alone = Engine(m, max_num_batched_tokens=128, enable_prefix_caching=False)
    want = alone.generate([prompt], params)[0].token_ids
    alone.close()

    eng = Engine(m, max_num_batched_tokens=32, enable_prefix_caching=False)
    chunks = []
    schedule = eng.scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend((s.req.id, s.start, s.n) for s in out.seqs if s.n > 1)
        return out

    eng.scheduler.schedule = recording
    eng.add_request(first, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    rid = eng.add_request(prompt, params)
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    eng.close()
    ends = [s + n for r, s, n in chunks if r == rid]
    assert ends[-1] == len(prompt)
    if kv == "bf16":
        assert ends[0] == 14, chunks   # 32 - 18: cut inside the page
    else:
        assert all(e % 16 == 0 for e in ends[:-1]) and ends[0] != 14, chunks
    assert outs[rid].token_ids == want


def test_random_arrivals_with_swap_aside():
    """Engine(swap_aside=True) under random arrivals in a pool so small that requests are also
    preempted (recomputed): fp8 pages, SnapKV(hold=True) requests (the model's policy) beside
    SinkWindow requests and requests that keep every token. Decoders swapped aside for a
    prompt's transient come back with their eviction bookkeeping: every request equals
    itself alone, the pool's invariants hold at every step, and nothing is left behind."""
    torch._dynamo.reset()
    m = make_hf("llama", "sdpa")
    hold = SnapKV(budget=16, window=4, hold=True)
    kvcompile.compile(m, config(eviction=hold, kv_dtype="fp8_e4m3", page_size=8,
                                prefill_attends="stored"))
    rng = random.Random(7)
    choices = ["model", "model", None, SinkWindow(2, 14), "model"]
    reqs = [(p, SamplingParams(temperature=0, max_tokens=rng.randrange(15, 30),
                               ignore_eos=True, eviction=choices[i % 5]))
            for i, p in enumerate(random_prompts(rng, 10, 40, 64))]
    alone = Engine(m, max_num_batched_tokens=128, enable_prefix_caching=False)
    expect = [alone.generate([p], sp)[0].token_ids for p, sp in reqs]
    alone.close()
    st = state_of(m)
    pool = st.pool
    hog = pool.allocate(1)[0]
    pool.reserve([hog], (pool.num_pages - 12) * pool.page_size)
    try:
        eng = Engine(m, max_num_batched_tokens=32, swap_aside=True)
        eng.scheduler.watermark = 1
        before = st.counters.get("swapped_aside", 0)
        final = _run_arrivals(eng, reqs, rng, lambda e, _: e.pool.check_invariants())
        for i in range(len(reqs)):
            assert final[i].token_ids == expect[i], f"request {i} changed by its neighbours"
        assert st.counters.get("swapped_aside", 0) > before, "nothing was swapped aside"
        assert eng.stats.preemptions > 0
        eng.close()
        assert eng.scheduler.swap_used == 0 and not eng.scheduler.swapped
    finally:
        pool.free([hog])
    assert pool.stats().pages_used == 0 and not st.eviction.books
