"""Overlapped engine steps on CUDA (engine/overlap.py): decode steps replayed from CUDA graphs,
the next step queued while the previous one still runs, outputs those of the synchronous loop.

    pytest -s -q -m gpu tests/gpu/test_engine_overlap_gpu.py   # or: gpu_jobs.sh engine_overlap

A tiny Llama (fp32 weights, fp8 pages) runs mixed requests (greedy, seeded top-k/top-p with
logprobs, stop token ids found mid-output, max_tokens) through two engines over one model,
async_steps on and off, arriving at the same step() calls: tokens and finish reasons must be
equal, logprobs to fp32 rounding. Then the overlap itself: with each forward followed by a
~20 ms device sleep, the host must queue step n+1 while step n is still running (its event not
complete) at almost every decode step, and the synchronous loop never (it reads each step).
Prints the step time of both loops on this small model.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

import kvcompile
from kvcompile import Engine, KVConfig, SamplingParams
from kvcompile.engine import overlap
from kvcompile.testing import ASSERT_CLOSE
from tests.gpu.tiny import tiny_llama

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model():
    m = tiny_llama(0)
    kvcompile.compile(m, KVConfig(kv_dtype="fp8_e4m3", max_kv_bytes=256 << 20, page_size=16))
    return m


def _requests(free_run, rng, n=12):
    reqs = []
    for i in range(n):
        p = [rng.randrange(3, 512) for _ in range(rng.randrange(5, 200))]
        kind = i % 3
        if kind == 0:
            sp = SamplingParams(temperature=0, max_tokens=rng.randrange(4, 40), ignore_eos=True)
        elif kind == 1:
            sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, max_tokens=32,
                                logprobs=True, ignore_eos=True)
        else:
            toks = free_run(p)
            sp = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=(toks[7],))
        reqs.append((p, sp))
    return reqs


def _run(eng, reqs, arrivals):
    final, step = {}, 0

    def done(i):
        def on_output(o):
            assert overlap.PLACEHOLDER not in o.token_ids
            if o.finished:
                final[i] = (o.token_ids, o.finish_reason, o.logprobs)
        return on_output

    while len(final) < len(reqs):
        for i, (p, sp) in enumerate(reqs):
            if arrivals[i] == step:
                eng.add_request(p, sp, on_output=done(i))
        eng.step()
        step += 1
        assert step < 2000
    return [final[i] for i in range(len(reqs))]


def test_overlapped_steps_match_the_synchronous_loop(model):
    fast = Engine(model, None, max_num_batched_tokens=512, max_num_seqs=16,
                  enable_prefix_caching=False, async_steps=True)
    slow = Engine(model, None, max_num_batched_tokens=512, max_num_seqs=16,
                  enable_prefix_caching=False, async_steps=False)

    def free_run(p):
        return slow.generate([p], SamplingParams(temperature=0, max_tokens=32,
                                                 ignore_eos=True))[0].token_ids

    rng = random.Random(0)
    reqs = _requests(free_run, rng)
    arrivals = sorted(rng.randrange(0, 20) for _ in reqs)
    want = _run(slow, reqs, arrivals)
    replays = fast.runner.graphs.replays
    got = _run(fast, reqs, arrivals)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert {w[1] for w in want} == {"stop", "length"}
    atol, rtol = ASSERT_CLOSE[torch.float32]
    for g, w in zip(got, want):
        if w[2] is not None:
            torch.testing.assert_close(torch.tensor(g[2]), torch.tensor(w[2]), atol=atol,
                                       rtol=rtol)
    assert fast.runner.graphs.replays - replays > 10
    print(f"\nasync: {fast.stats.launched_steps} launched, {fast.stats.overlapped_steps} "
          f"overlapped of {fast.stats.steps} steps; sync reasons {fast.stats.sync_reasons}")
    assert fast.stats.overlapped_steps > 10 and fast.stats.sync_reasons == {}
    fast.close()
    slow.close()


@pytest.mark.parametrize("async_steps", [True, False])
def test_the_host_queues_the_next_step_while_the_device_runs(model, monkeypatch, async_steps):
    eng = Engine(model, None, max_num_batched_tokens=1024, max_num_seqs=16,
                 enable_prefix_caching=False, async_steps=async_steps)
    prompts = [[random.Random(i).randrange(3, 512) for _ in range(100)] for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng.generate(prompts, sp)   # warm-up
    forward = eng.runner.forward
    cycles = 40_000_000   # ~20 ms at the H200's ~2 GHz

    def slow_forward(out):
        logits = forward(out)
        torch.cuda._sleep(cycles)
        return logits

    busy = []
    real_feed = overlap.feed_for

    def watch(out, pending):
        if pending is not None and pending.ready is not None:
            busy.append(not pending.ready.query())   # the step before still running
        return real_feed(out, pending)

    monkeypatch.setattr(eng.runner, "forward", slow_forward)
    monkeypatch.setattr(overlap, "feed_for", watch)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == 24 for o in outs)
    print(f"\nasync_steps={async_steps}: {len(busy)} steps queued behind a running one, "
          f"{sum(busy)} while it still ran; {1e3 * dt / 24:.1f} ms a step with ~20 ms device "
          f"sleep in each")
    if async_steps:
        assert len(busy) >= 20 and sum(busy) >= len(busy) - 1
    else:
        assert not busy
    eng.close()


def test_step_time_sync_vs_async(model):
    """Printed only: the decode step time of both loops on the tiny model (host-bound)."""
    for async_steps in (False, True):
        eng = Engine(model, None, max_num_batched_tokens=4096, max_num_seqs=16,
                     enable_prefix_caching=False, async_steps=async_steps)
        prompts = [[random.Random(i).randrange(3, 512) for _ in range(64)] for i in range(16)]
        sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        eng.generate(prompts, sp)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.generate(prompts, sp)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"\ntiny model B16, 128 new: async_steps={async_steps}: "
              f"{1e3 * dt / 128:.3f} ms a step")
        eng.close()
