"""`generate`'s greedy decode loop on the device (integrations/hf_loop.py, KVConfig.device_loop).

CUDA graphs need CUDA (tests/gpu/test_hf_graphs_gpu.py replays them); here their capture and
replay are emulated: a captured forward re-runs over the same static buffers and plan and
refills its static logits, a captured tail re-runs its ops over the same buffers. So the CPU
checks what the loop feeds each replay and reads back: the next step's inputs written by the
tail (ids, positions, cache position), the stop flag read a step late, the tokens stored at the
step's column, a step run past an EOS stop cropped, a graph recaptured mid-call. Tokens are
compared with eager transformers and with the same compiled model with the loop off; the calls
that keep transformers' loop say why in the report."""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile.api import state_of
from kvcompile.config import KVConfig
from kvcompile.integrations import hf_graphs, hf_loop
from tests.engine.tiny import make_llama64
from tests.integrations.graphs_emulated import capture


class _TailReplay:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(hf_graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(hf_loop, "LOOP_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(hf_loop, "capture_tail", lambda fn, device, mempool: _TailReplay(fn))


def _refusal(m):
    """hf_graphs' per-layer refusal (the formats the kernels take), as on CUDA."""
    st = state_of(m)
    if st.pool is None:
        return None
    return next((w for w in (hf_graphs.graph_refusal(k, v) for k, v in zip(st.pool.k, st.pool.v))
                 if w), None)


def _model(**kw):
    torch._dynamo.reset()
    m = make_llama64()
    # kernels="triton" (the interpreter): the graph path's kernels, which read lengths and
    # block tables from the plan's tensors
    kvcompile.compile(m, KVConfig(inner="eager", kernels="triton", max_kv_bytes=1 << 22,
                                  page_size=8, **kw))
    m.forward.why_not = lambda: _refusal(m)
    return m


def _prompts(pad: int = 3):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 200, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


def _generate(m, ids, mask, new=9, **kw):
    args = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    args.update(kw)
    with torch.no_grad():
        return m.generate(ids, attention_mask=mask, **args)


def _delta(m, before):
    return {k: v - before.get(k, 0) for k, v in state_of(m).counters.items()
            if v != before.get(k, 0)}


def _generate_counted(m, ids, mask, **kw):
    """`_generate`'s sequences and the counters the call moved."""
    before = dict(state_of(m).counters)
    got = _generate(m, ids, mask, **kw)
    return got, _delta(m, before)


def test_greedy_tokens_equal_transformers_and_the_loop_off(emulated):
    """A left-padded batch: the prefill's token and the first decode step's as transformers
    runs them, the other 7 steps a forward replay and a tail replay each, no host read."""
    ids, mask = _prompts()
    eager = _generate(make_llama64(), ids, mask)
    m = _model()
    got, c = _generate_counted(m, ids, mask)
    assert torch.equal(got, eager)
    assert c.get("generate_device_loop") == 1 and c.get("generate_device_loop_steps") == 7, c
    assert c.get("generate_cuda_graph_replays") == 8, c
    assert c.get("generate_cuda_graph_captures") == 1, c    # the loop's steps find the graph
    assert not c.get("generate_device_loop_undone"), c
    # the tail's writes for the step after the last: its input id, each row's position (left
    # padding: 3 in row 1), the cache position
    g, _ = m.forward.last
    total = got.shape[1]
    assert torch.equal(g.ids[:, 0], got[:, -1])
    assert g.pos[:, 0].tolist() == [total - 1, total - 1 - 3]
    assert g.cp is None or g.cp.tolist() == [total - 1]
    off = _model(device_loop=False)
    assert torch.equal(_generate(off, ids, mask), eager)
    assert "device_loop is False" in str(kvcompile.report(off))
    assert state_of(m).pool.stats().pages_used == 0


def test_rows_stopping_at_eos_run_one_step_more_cropped(emulated, monkeypatch):
    """Each row ends at one of two EOS ids, at different steps: the first is padded after its
    EOS (transformers' rule), the call ends when both have; the step queued before the flag was read runs, its
    token dropped and its cache entry cropped."""
    ids, mask = _prompts(pad=0)
    free = _generate(make_llama64(), ids, mask, new=12)[:, ids.shape[1]:]
    eos = [int(free[0, 3]), int(free[1, 5])]   # two EOS ids, each row ends at its own
    eager = _generate(make_llama64(), ids, mask, new=12, eos_token_id=eos)
    stop = eager.shape[1] - ids.shape[1]
    assert stop < 12, "the rows were to stop early"
    assert (eager[:, -1] == 0).any(), "one row was to end before the other (then padded)"
    m = _model()
    finish, lengths = hf_loop._finish, []

    def finished(st, cache, *a):
        out = finish(st, cache, *a)
        b = hf_graphs.binding_of(cache.layers[0].keys)
        lengths.append((cache.get_seq_length(), b.seq_len()))
        return out

    monkeypatch.setattr(hf_loop, "_finish", finished)
    got, c = _generate_counted(m, ids, mask, new=12, eos_token_id=eos)
    assert torch.equal(got, eager)
    assert c.get("generate_device_loop_undone") == 1, c
    # the cache, after the crop, holds every token but the last (whose forward never runs)
    assert lengths == [(got.shape[1] - 1,) * 2], lengths
    assert c.get("generate_cuda_graph_replays") == stop, c   # stop - 1 decode steps, 1 more
    assert state_of(m).pool.stats().pages_used == 0


def _growing_at_the_fifth_reserve(monkeypatch, ids, mask):
    """A compiled model whose pool exists, its storage changing (as a growth does) at the
    fifth `reserve` from here on: the graphs then in use are dropped mid-call."""
    m = _model()
    _generate(m, ids[:, :4], mask[:, :4], new=2)   # the pool exists
    pool = state_of(m).pool
    reserve, calls = pool.reserve, []

    def growing(*a, **kw):
        calls.append(1)
        if len(calls) == 5:
            pool.generation += 1
        return reserve(*a, **kw)

    monkeypatch.setattr(pool, "reserve", growing)
    return m


def test_a_graph_recaptured_mid_call_takes_the_tail_along(emulated, monkeypatch):
    """A pool whose storage changes mid-call (as a growth does) drops the graphs: the next
    step captures a new one from the old graph's buffers (ids, positions, mask), and the loop
    captures a tail over the new graph's."""
    ids, mask = _prompts()
    eager = _generate(make_llama64(), ids, mask)
    m = _growing_at_the_fifth_reserve(monkeypatch, ids, mask)
    got, c = _generate_counted(m, ids, mask)
    assert torch.equal(got, eager)
    assert c.get("generate_device_loop_recaptures") == 1, c
    assert c.get("generate_cuda_graph_captures") == 2, c


@pytest.mark.parametrize("eos", [False, True], ids=["to max_new_tokens", "rows end at EOS"])
def test_a_streamer_gets_every_token_a_step_late_and_none_past_the_stop(emulated, eos):
    """The streamer gets the prompt, then each step's tokens, the same as with transformers'
    loop (the loop off), none of the step run past an EOS stop; then end()."""
    ids, mask = _prompts(pad=0)
    kw = {}
    if eos:
        free = _generate(make_llama64(), ids, mask)[:, ids.shape[1]:]
        kw["eos_token_id"] = [int(free[0, 2]), int(free[1, 4])]
    seen = []
    for loop in (True, False):
        m = _model(device_loop=loop)
        streamer = _Streamer()
        before = dict(state_of(m).counters)
        out = _generate(m, ids, mask, streamer=streamer, **kw)
        assert bool(_delta(m, before).get("generate_device_loop")) == loop
        assert streamer.seen[-1] == "end" and len(streamer.seen) == out.shape[1] - ids.shape[1] + 2
        seen.append(streamer.seen)
    assert seen[0] == seen[1]


def test_sampling_runs_the_warpers_in_the_tail(emulated):
    """do_sample=True through transformers' warpers on the device loop: top_k=1 leaves one
    token, so the draw must be greedy's (the warpers ran, the draw took the only token left);
    with top_k=5 and a temperature every token is among the 5 best of its step (checked
    against the logits of the same prefix, teacher-forced), and a seed repeats the samples."""
    ids, mask = _prompts(pad=0)
    greedy = _generate(make_llama64(), ids, mask, new=6)
    m = _model()
    one, c = _generate_counted(m, ids, mask, new=6, do_sample=True, top_k=1)
    assert torch.equal(one, greedy)
    assert c.get("generate_device_loop") == 1 and c.get("generate_device_loop_steps") == 4, c
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(_generate(m, ids, mask, new=6, do_sample=True, top_k=5, temperature=2.0))
    assert torch.equal(runs[0], runs[1])
    ref = make_llama64()
    with torch.no_grad():
        logits = ref(runs[0][:, :-1]).logits[:, ids.shape[1] - 1:]       # [B, 6, V]
    top5 = logits.topk(5, dim=-1).indices
    new = runs[0][:, ids.shape[1]:]
    assert (top5 == new[..., None]).any(-1).all(), (new, top5)
    assert not torch.equal(new, greedy[:, ids.shape[1]:]), "temperature 2 drew greedy's tokens"


def test_the_race_draws_each_token_with_its_probability():
    """argmax(p / E), E ~ Exp(1): token frequencies over 40,000 draws within 5 standard
    deviations of p, zero-probability tokens never drawn (a plain PyTorch reference: p)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1000, (1,))))
    p = torch.rand(7, generator=g) ** 2
    p[3] = 0.0
    p /= p.sum()
    torch.manual_seed(1)
    draws = hf_loop.race(p.expand(40_000, 7).contiguous())
    freq = torch.bincount(draws, minlength=7).double() / 40_000
    sd = (p.double() * (1 - p.double()) / 40_000).sqrt()
    assert freq[3] == 0
    assert ((freq - p.double()).abs() <= 5 * sd + 1e-12).all(), (freq, p)


@pytest.mark.parametrize("case,why", [
    ("penalty", "logits processors (RepetitionPenaltyLogitsProcessor)"),
    ("sample_penalty", "logits processors (RepetitionPenaltyLogitsProcessor)"),
    ("dict", "return_dict_in_generate=True"),
    ("time", "stopping criteria (MaxTimeCriteria)"),   # (stop strings: StopStringCriteria)
])
def test_calls_the_loop_does_not_take_keep_transformers_loop_and_say_why(emulated, case, why):
    ids, mask = _prompts()
    kw = {"sample_penalty": dict(do_sample=True, top_k=5, repetition_penalty=1.3),
          "penalty": dict(repetition_penalty=1.3),
          "dict": dict(return_dict_in_generate=True),
          "time": dict(max_time=600.0)}[case]
    m = _model()
    before = dict(state_of(m).counters)
    torch.manual_seed(0)
    got = _generate(m, ids, mask, new=4, **kw)
    c = _delta(m, before)
    assert "generate_device_loop" not in c and c.get("generate_device_loop_refused") == 1, c
    assert c.get("generate_cuda_graph_replays") == 3, c     # the graphs still replay
    assert f"not the device loop ({why}" in str(kvcompile.report(m))
    if case != "sample_penalty":
        torch.manual_seed(0)
        want = _generate(make_llama64(), ids, mask, new=4, **kw)
        seq = got.sequences if case == "dict" else got
        assert torch.equal(seq, want.sequences if case == "dict" else want)


class _Streamer:
    def __init__(self):
        self.seen = []

    def put(self, value):
        self.seen.append(value.tolist())

    def end(self):
        self.seen.append("end")


@pytest.mark.parametrize("eos", [False, True], ids=["to max_new_tokens", "rows end at EOS"])
def test_steps_that_replay_no_graph_run_as_transformers_runs_them(emulated, eos):
    """A StaticCache's steps replay no graph (hf_graphs takes DynamicCache steps): the loop
    runs each step as `_sample` does, the stop flag still read a step late; tokens equal
    transformers' (eager), a step past an EOS stop undone, no page left."""
    ids, mask = _prompts()
    kw = dict(cache_implementation="static")
    if eos:
        free = _generate(make_llama64(), ids, mask, **kw)[:, ids.shape[1]:]
        kw["eos_token_id"] = [int(free[0, 2]), int(free[1, 3])]
    eager = _generate(make_llama64(), ids, mask, **kw)
    m = _model()
    got, c = _generate_counted(m, ids, mask, **kw)
    assert torch.equal(got, eager)
    assert c.get("generate_device_loop") == 1 and not c.get("generate_cuda_graph_replays"), c
    assert not c.get("generate_device_loop_steps"), c
    assert bool(c.get("generate_device_loop_undone")) == (eager.shape[1] < ids.shape[1] + 9), c
    assert state_of(m).pool.stats().pages_used == 0


def test_generate_from_threads_decodes_in_turn_with_sequential_tokens(emulated):
    """Four threads, each a batch of 2 (one graph, whose input buffers carry each call's state
    between steps): the loop holds the model's lock for its decode, so the calls' steps never
    interleave on the graph; tokens equal sequential calls', no page left."""
    import threading

    m = _model()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 200, (2, 6 + i), generator=g) for i in range(4)]
    want = [_generate(m, p, torch.ones_like(p), new=6) for p in prompts]
    got, errors = [None] * 4, []
    start = threading.Barrier(4)

    def run(i):
        try:
            start.wait()
            got[i] = _generate(m, prompts[i], torch.ones_like(prompts[i]), new=6)
        except BaseException as e:   # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, repr(errors[0])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert state_of(m).counters.get("generate_device_loop") == 8
    assert state_of(m).pool.stats().pages_used == 0


def test_a_tail_whose_recapture_fails_runs_eagerly_for_the_rest_of_the_call(emulated,
                                                                            monkeypatch):
    """A graph recaptured mid-call whose tail then fails to capture: the call's tokens are
    still eager's (the rest of its tails run their ops eagerly over the same buffers), the
    report says so, and the model's later calls keep transformers' loop."""
    ids, mask = _prompts()
    eager = _generate(make_llama64(), ids, mask)
    m = _growing_at_the_fifth_reserve(monkeypatch, ids, mask)
    tails = []

    def second_fails(fn, device, mempool):
        tails.append(1)
        if len(tails) > 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return _TailReplay(fn)

    monkeypatch.setattr(hf_loop, "capture_tail", second_fails)
    got, c = _generate_counted(m, ids, mask)
    assert torch.equal(got, eager)
    assert c.get("generate_device_loop_recaptures") == 1, c
    assert c.get("generate_device_loop_eager_tail") == 1, c
    rep = str(kvcompile.report(m))
    assert "its tail's CUDA graph recapture failed" in rep
    assert "later steps ran its tail eagerly" in rep
    got, c = _generate_counted(m, ids, mask)
    assert torch.equal(got, eager)
    assert c.get("generate_device_loop_refused") == 1 and not c.get("generate_device_loop"), c


def test_a_tail_that_fails_to_capture_leaves_the_call_to_transformers_steps(emulated,
                                                                           monkeypatch):
    """The tail's capture raising (a CUDA capture error): the call goes on as transformers
    runs it (tokens equal eager), the report says why, and the model's later calls keep
    transformers' loop with that reason; kvcompile.release clears it."""
    def broken(fn, device, mempool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(hf_loop, "capture_tail", broken)
    ids, mask = _prompts()
    eager = _generate(make_llama64(), ids, mask)
    m = _model()
    assert torch.equal(_generate(m, ids, mask), eager)
    rep = str(kvcompile.report(m))
    assert "device loop is off for this model: its tail's CUDA graph capture failed" in rep
    got, c = _generate_counted(m, ids, mask)
    assert torch.equal(got, eager)
    assert c.get("generate_device_loop_refused") == 1 and not c.get("generate_device_loop"), c
    assert c.get("generate_cuda_graph_replays") == 8, c      # the graphs still replay
    kvcompile.release(m)
    assert m.forward.loop_off is None


@pytest.mark.parametrize("name", ["SinkWindow", "H2O", "SnapKV hold, interval 3",
                                  "H2O, left-padded"])
def test_evicting_models_run_their_steps_through_the_forward(emulated, name):
    """With an eviction policy the loop's steps go through the model's forward (a graph that
    steps aside, eviction's work after it), inputs from the tail's own buffers and the mask a
    growing view: tokens equal transformers' loop over the same graphs (device_loop off) and
    the steps replay graphs as often (a left-padded batch: its steps read the mask view)."""
    import dataclasses

    from kvcompile.config import H2O, SinkWindow, SnapKV
    from tests.integrations.test_hf_graphs_eviction import _model as evicting_model
    from tests.integrations.test_hf_graphs_eviction import _refusal as refusal

    policy, interval = {"SinkWindow": (SinkWindow(2, 10), 1),
                        "H2O": (H2O(budget=12, recent=4, sinks=2), 1),
                        "SnapKV hold, interval 3": (SnapKV(budget=12, window=4, hold=True),
                                                    3),
                        "H2O, left-padded": (H2O(budget=12, recent=4, sinks=2), 1)}[name]
    m = evicting_model(policy, interval)
    m.forward.why_not = lambda: refusal(m)
    st = state_of(m)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    padded = name.endswith("left-padded")
    if padded:
        ids[1, :5], mask[1, :5] = 0, 0
    outs, counts = [], []
    for loop in (True, False):
        st.config = dataclasses.replace(st.config, device_loop=loop)
        before = dict(st.counters)
        outs.append(_generate(m, ids, mask, new=10))
        counts.append(_delta(m, before))
    assert torch.equal(outs[0], outs[1])
    c = counts[0]
    replays = c.get("generate_cuda_graph_replays", 0)
    assert replays == counts[1].get("generate_cuda_graph_replays", 0), (c, counts[1])
    assert replays > 0 and c.get("generate_device_loop_steps") == 8, c
