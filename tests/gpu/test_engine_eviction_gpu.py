"""Eviction in the engine on CUDA: decode steps replayed from CUDA graphs with SinkWindow
(sinks at their original positions, and re-rotated: the default), H2O (its mass from the
decode kernel's attn_mass into the device store) and SnapKV, evicting on the device between
replays (CUDA only).

    pytest -s -q -m gpu tests/gpu/test_engine_eviction_gpu.py

A tiny fp32 Llama (head_dim 64, the Triton decode kernel's) in bf16 and fp8 pages. Per format
and policy: the engine's greedy tokens with graphs against the engine's without graphs (the
same kernels, eager), the graphs replayed with eviction on (`eviction_aside_steps`,
`eviction_device_runs`), stored lengths stayed within budget + interval - 1, and the pool is
empty after close. Prints the decode step time with and without graphs (-s).

bf16 pages: the tokens are equal. fp8 pages: a graph replays a padded batch and the block
table's full width (other split-K counts and GEMM shapes than the eager step), and the fp8
cache can turn that rounding into a flipped element, then a parted near tie (issue 19: 2 of 4
re-rotated cases parted after 29 and 62 tokens). So fp8 is judged by
kvcompile.testing.greedy_parting: per request, the logits up to and including the first step
whose greedy token parts are within storage_rel_tol("fp8_e4m3") of the eager logits (relative
to the row's largest), and the parting step is a near tie. Every case prints, per request, the
parted step, the eager margin there, the max logit difference and the relative measure
("parting" in the printed dict).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvcompile import H2O, Engine, KVConfig, SamplingParams, SinkWindow, SnapKV
from kvcompile.api import state_of
from kvcompile.testing import greedy_parting, storage_rel_tol
from tests.gpu.tiny import tiny_llama

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def tiny(seed: int = 0):
    return tiny_llama(seed, max_positions=4096)


def run(fmt, policy, graphs: bool, interval: int, prompts, new: int, sinks: str = "original",
        aside: bool = True, record: bool = False):
    torch._dynamo.reset()
    m = tiny()
    name, gran = fmt
    eng = Engine(m, None, KVConfig(kv_dtype=name, scale_granularity=gran, eviction=policy,
                                   max_kv_bytes=1 << 28),
                 max_num_batched_tokens=8192, max_num_seqs=16, enable_prefix_caching=False,
                 cuda_graphs=graphs, eviction_interval=interval)
    eng.eviction.sink_positions = sinks
    if not aside:   # the host path: attend_kept on every decode step (not its kernel route)
        eng.eviction.decode_aside = lambda seq_ids: False
        eng.eviction._attend_kernel = lambda *a, **k: None
    held = []   # tokens kept: stored, less those a window hides (SinkWindow, original sinks)
    pool = eng.pool
    eng.on_step.append(lambda _s: held.extend(
        pool.seq_len(r.seq_id) - (pool.evicted(r.seq_id) - pool.dropped(r.seq_id))
        for r in eng.scheduler.running if r.num_computed > len(r.prompt_ids)))
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    eng.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    logits: dict = {}   # request -> its decode steps' logits (recorded apart from the timing)
    if record:
        fwd = eng.runner.forward

        def forward(out):
            lg = fwd(out)
            if all(s.n == 1 and s.start > 0 for s in out.seqs):
                for s, row in zip(out.seqs, lg):
                    logits.setdefault(s.req.id, []).append(row.float().cpu())
            return lg

        eng.runner.forward = forward
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    g = eng.runner.graphs
    st = state_of(m).counters
    info = dict(replays=g.replays if g is not None else 0,
                aside=st.get("eviction_aside_steps", 0),
                aside_kernel=st.get("eviction_aside_kernel", 0),
                aside_reference=st.get("eviction_aside_reference", 0),
                device_runs=st.get("eviction_device_runs", 0),
                window_runs=st.get("eviction_window_runs", 0),
                evicted_pages=st.get("evicted_pages", 0),
                evicted=st.get("evicted_tokens", 0), max_held=max(held, default=0), seconds=dt)
    eng.close()
    assert eng.pool.stats().pages_used == 0
    toks = [o.token_ids for o in outs]
    if record:
        info["logits"] = [torch.stack(logits[o.request_id]) for o in outs]
    return toks, info


def parting(eager: dict, graphed: dict, fmt) -> list[dict]:
    """greedy_parting of each request, graphs against eager (logits recorded by `run`)."""
    tol = storage_rel_tol(fmt[0])
    return [greedy_parting(e, g, tol) for e, g in zip(eager.pop("logits"),
                                                       graphed.pop("logits"))]


# bf16 and fp8 token scales move tokens on the device; fp8 page scales re-encode them (the host
# path between replays)
@pytest.mark.parametrize("fmt", [("bf16", "page"), ("fp8_e4m3", "token"), ("fp8_e4m3", "page")],
                         ids=lambda f: "-".join(f))
@pytest.mark.parametrize("policy,sinks", [
    (SinkWindow(4, 124), "original"), (SinkWindow(4, 124), "cache"),
    (H2O(budget=128, recent=32, sinks=4), "cache"), (SnapKV(budget=128), "cache"),
    (SnapKV(budget=128, hold=True), "cache")],
    ids=["SinkWindow-original", "SinkWindow-rerotated", "H2O", "SnapKV", "SnapKV-hold"])
@pytest.mark.parametrize("interval", [1, 16])
def test_graph_decode_with_eviction_equals_eager(fmt, policy, sinks, interval):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(200, 400))]
               for _ in range(5)]
    new = 64
    eager, ie = run(fmt, policy, False, interval, prompts, new, sinks, record=True)
    graphed, ig = run(fmt, policy, True, interval, prompts, new, sinks, record=True)
    diag = parting(ie, ig, fmt)
    print({"fmt": "-".join(fmt), "policy": type(policy).__name__, "sinks": sinks,
           "interval": interval, "eager": ie, "graphs": ig,
           "parting": [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()}
                       for d in diag]})
    # Every format, bf16 included, by the parting rule: a graph replays a bucket's padded batch,
    # so the decode kernel's split count (and its reduction order) can differ from the eager
    # step's; on the H200 bf16 logits differ by up to 8e-3 between the two, and a greedy token
    # may part at a near tie (SnapKV, bf16: once at a top-2 margin of 5.3e-4).
    assert all(d["ok"] for d in diag), diag
    assert ig["replays"] > 0 and ig["aside"] > 0
    if isinstance(policy, H2O) or sinks == "cache" and isinstance(policy, SinkWindow):
        # the mass / the rotated sinks inside the replayed step, through the Triton kernel
        assert ig["aside_kernel"] > 0 and ig["aside_reference"] == 0
    if isinstance(policy, (SinkWindow, H2O)) or getattr(policy, "hold", False):
        budget = policy.sinks + policy.window if isinstance(policy, SinkWindow) else policy.budget
        assert ig["evicted"] > 0 and ig["max_held"] <= budget + interval
        if isinstance(policy, SinkWindow) and sinks == "original":
            # no token moves, in any format: pages leave, the rest is hidden by a key mask
            assert ig["window_runs"] > 0 and ig["evicted_pages"] > 0 and ig["device_runs"] == 0
        else:
            # every format of the matrix moves on the device (fp8 page scales too, since the
            # fifteenth session: compaction.move_slots_device)
            assert ig["device_runs"] > 0


@pytest.mark.parametrize("policy", [H2O(budget=128, recent=32, sinks=4), SinkWindow(4, 124)],
                         ids=["H2O", "SinkWindow-rerotated"])
def test_graph_decode_equals_host_path(policy):
    """Interval 1, bf16 pages: the graphed decode steps (kernel + mass store / rotated sinks)
    give the host path's tokens (attend_kept on every step, no CUDA graph)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(200, 400))]
               for _ in range(5)]
    host, ih = run(("bf16", "page"), policy, False, 1, prompts, 48, "cache", aside=False)
    graphed, ig = run(("bf16", "page"), policy, True, 1, prompts, 48, "cache")
    print({"policy": type(policy).__name__, "host": ih, "graphs": ig})
    assert ih["aside"] == 0 and ig["replays"] > 0 and ig["aside_kernel"] > 0
    same = sum(a == b for a, b in zip(graphed, host))
    # bf16 pages: the kernel and attend_kept (fp32) round differently; greedy tokens of a
    # random model may part after a near tie, so at least 4 of the 5 requests must agree
    assert same >= 4, (graphed, host)


@pytest.mark.parametrize("policy", [SinkWindow(4, 124), SnapKV(budget=128),
                                    H2O(budget=128, recent=32, sinks=4)],
                         ids=["SinkWindow-original", "SnapKV", "H2O"])
def test_prompt_chunks_beside_evicted_rows(policy, monkeypatch):
    """A 256-token step budget: long prompts are chunked while shorter requests, evicted at
    their prompt's end, decode in the same steps. The chunks of every policy's prompts
    attend through the paged prefill kernel (no fp32 attention over a chunk's queries; H2O's
    mass through kernels/prompt_mass.py), the evicted decode rows through the decode kernel;
    tokens against the old path (every row of
    such a step over its kept slots in fp32): at least 4 of the 6 requests agree (fp8 pages,
    the kernel and the fp32 path round differently; a random model's greedy tokens may part
    after a near tie)."""
    from kvcompile.eviction import runtime as rt_mod
    from kvcompile.eviction.runtime import EvictionRuntime

    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (150, 200, 900, 1200, 700, 300)]

    def go(old: bool, torch_mass: bool = False):
        torch._dynamo.reset()
        m = tiny()
        eng = Engine(m, None, KVConfig(kv_dtype="fp8_e4m3", scale_granularity="token",
                                       eviction=policy, max_kv_bytes=1 << 28),
                     max_num_batched_tokens=256, max_num_seqs=8, enable_prefix_caching=False)
        eng.eviction.sink_positions = "original"
        chunks = []
        real = rt_mod.attend_kept

        def spy(q, *a, **kw):
            if q.shape[1] > 1 and q.shape[1] != kw.get("obs_rows", 0):
                chunks.append(q.shape[1])
            return real(q, *a, **kw)

        with monkeypatch.context() as mp:
            mp.setattr(rt_mod, "attend_kept", spy)
            if old:
                mp.setattr(EvictionRuntime, "plain_rows",
                           lambda self, plan, layer: [False] * plan.batch)
            if torch_mass:   # the prompt mass by the fp32 torch path (prompt_mass's fallback)
                mp.setattr(EvictionRuntime, "_kernel_mass", lambda self, *a, **k: False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                        ignore_eos=True))
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        st = state_of(m).counters
        info = dict(seconds=dt, fp32_chunks=len(chunks),
                    decode_rows_kernel=st.get("eviction_kernel_decode_rows", 0),
                    mass_kernel_rows=st.get("eviction_prompt_mass_kernel", 0),
                    mass_torch_rows=st.get("eviction_prompt_mass_torch", 0),
                    mixed=any(s.prefill_tokens and s.decode_tokens for s in eng.history))
        eng.close()
        return [o.token_ids for o in outs], info

    old, io = go(True)
    new, inew = go(False)
    print({"policy": type(policy).__name__, "old": io, "new": inew})
    assert inew["mixed"] and io["fp32_chunks"] > 0
    assert inew["fp32_chunks"] == 0 and inew["decode_rows_kernel"] > 0
    if isinstance(policy, H2O):   # its chunks' mass: the Triton pass, not the torch one
        assert inew["mass_kernel_rows"] > 0 and inew["mass_torch_rows"] == 0
        # H2O picks its heavy hitters by mass: against the old path (fp32 attention and mass)
        # its choices flip at near-equal masses (the H200: 3 of 7 requests agreed), so the
        # kernel's mass is judged against the torch mass under the same attention route
        ref, iref = go(False, torch_mass=True)
        # (the engine's warm-up, outside the patch, adds its few kernel rows in every run)
        assert iref["mass_torch_rows"] > 0 and iref["mass_kernel_rows"] <= io["mass_kernel_rows"]
        assert sum(a == b for a, b in zip(new, ref)) >= 4, (new, ref)
    else:
        assert inew["mass_kernel_rows"] == 0
        assert sum(a == b for a, b in zip(new, old)) >= 4, (new, old)


def test_swap_aside_on_cuda():
    """Engine(swap_aside=True) on CUDA with graphs, bf16 pages, SnapKV(hold=True): a pool that
    holds three evicted requests but not a fourth's whole prompt beside them, so decoders are
    swapped to host memory (pool.swap_out / swap_in of CUDA pages, the eviction bookkeeping
    detached and attached) while prompts are prefilled. The tokens are those of the same
    requests without swap-aside (a request may part at a near tie, as graphs against eager
    do above: at least 5 of 6 equal), something was swapped aside, the pool is empty after."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(384)] for _ in range(6)]
    policy = SnapKV(budget=128, hold=True)
    runs = {}
    for aside in (False, True):
        torch._dynamo.reset()
        m = tiny()
        # bf16 bytes of a token: 4 layers x 2 (K, V) x 2 kv heads x 64 x 2 = 2 KiB; room for
        # three evicted requests (128 + a page) and one whole prompt of 384 tokens
        budget = (3 * (128 + 32) + 384 + 64) * 2048
        eng = Engine(m, None, KVConfig(kv_dtype="bf16", eviction=policy, max_kv_bytes=budget),
                     max_num_batched_tokens=256, max_num_seqs=16, enable_prefix_caching=False,
                     swap_aside=aside)
        before = state_of(m).counters.get("swapped_aside", 0)
        outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=96,
                                                    ignore_eos=True))
        runs[aside] = ([o.token_ids for o in outs], [o.finish_reason for o in outs],
                       state_of(m).counters.get("swapped_aside", 0) - before,
                       eng.stats.steps, eng.runner.graphs.replays if eng.runner.graphs else 0)
        eng.close()
        assert eng.pool.stats().pages_used == 0 and eng.scheduler.swap_used == 0
    print({"steps": (runs[False][3], runs[True][3]), "swaps": runs[True][2],
           "replays": (runs[False][4], runs[True][4])})
    assert all(r == "length" for r in runs[True][1]), runs[True][1]
    assert runs[False][2] == 0 and runs[True][2] > 0 and runs[True][4] > 0
    same = sum(a == b for a, b in zip(runs[True][0], runs[False][0]))
    assert same >= 5, same
