"""CUDA-graph decode steps of the engine against the same steps run eagerly (CUDA only).

    pytest -s -q -m gpu tests/gpu/test_engine_graphs_gpu.py   # or: gpu_jobs.sh engine_graphs

A tiny Llama (fp32 weights, so the comparison sees kvcompile's kernels rather than bf16
rounding) runs requests of mixed prompt lengths through `kvcompile.Engine`. At every decode
step the graph replay computes the logits first, then the same step runs eagerly (graphs off)
over the same pool state; the eager logits drive the engine. Both write the same K/V to the
same slots (the second write stores the same bytes), so every step compares the two paths on
identical inputs. Per format (bf16, fp8_e4m3 page scales, fp4_e2m1) and batch sizes that hit
a bucket exactly and that need padding rows (1, 3, 5, 16): the largest relative logit
difference and the argmax agreement (on rows whose top two logits are decisively apart: the
two paths split the keys differently, so a near-tie may flip). The prefill steps (packed:
fresh prompts on the varlen / SDPA kernels) are compared with the plain fp32 model at each prompt's last token.
Then: a whole run with graphs against a whole run
without (greedy tokens), the pool empty after close (scratch pages returned), and the step
time of both paths on this model (printed with -s). (Was benchmarks/gpu_check_engine_graphs.py.)
"""

from __future__ import annotations

import random
import time

import pytest
import torch

import kvcompile
from kvcompile import Engine, KVConfig, SamplingParams
from tests.gpu.tiny import tiny_llama

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {"bf16": 2e-3, "fp8_e4m3": 2e-3, "fp4_e2m1": 2e-3}   # graph vs eager: same kernels
# engine prefill (packed; fresh prompts attend to their own K/V) vs the plain fp32 model
PREFILL_TOL = {"bf16": 3e-2, "fp8_e4m3": 1e-1, "fp4_e2m1": 3e-1}


def tiny(seed: int = 0):
    return tiny_llama(seed)


def prompts_for(batch: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 300))] for _ in range(batch)]


def reference_last_logits(model, prompts) -> list[torch.Tensor]:
    """Plain HF forward (fp32, uncompiled): logits at each prompt's last token."""
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p], device="cuda")).logits[0, -1].float()
                for p in prompts]


def decisive(le: torch.Tensor, margin: float = 1e-3) -> torch.Tensor:
    """Rows whose top two logits are more than `margin` (relative) apart."""
    top = le.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) > margin * top[:, 0].abs().clamp_min(1.0)


def check(model, fmt: str, batch: int, prompts, ref, new: int = 24) -> dict:
    eng = Engine(model, None, None, max_num_batched_tokens=4096, max_num_seqs=64,
                 enable_prefix_caching=False)
    runner = eng.runner
    graphs = runner.graphs
    orig = runner.forward
    diffs, agree, steps = [], [], 0
    prefill = {}

    def both(out):
        nonlocal steps
        if graphs is None or not graphs.usable(out):
            lg = orig(out)
            for i, s in enumerate(out.seqs):   # prefill logits at a prompt's last token
                if s.start + s.n == len(s.req.prompt_ids) and s.req.prompt_ids:
                    prefill[tuple(s.req.prompt_ids)] = lg[i].float()
            return lg
        lg = graphs.run(out).float().clone()
        runner.graphs = None
        try:
            le = orig(out).float()
        finally:
            runner.graphs = graphs
        steps += 1
        diffs.append(float((lg - le).abs().max() / le.abs().max().clamp_min(1e-6)))
        sel = decisive(le)
        if bool(sel.any()):
            agree.append(float((lg.argmax(-1) == le.argmax(-1))[sel].float().mean()))
        return le

    runner.forward = both
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    eng.generate(prompts, params)
    runner.forward = orig
    # whole runs: graphs on vs off, same prompts
    t0 = time.perf_counter()
    a = eng.generate(prompts, params)
    torch.cuda.synchronize()
    t_graph = time.perf_counter() - t0
    runner.graphs = None
    t0 = time.perf_counter()
    b = eng.generate(prompts, params)
    torch.cuda.synchronize()
    t_eager = time.perf_counter() - t0
    runner.graphs = graphs
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / batch
    eng.close()
    eng.pool.check_invariants()
    used = eng.pool.stats().pages_used if hasattr(eng.pool.stats(), "pages_used") else None
    st = kvcompile.stats(model)
    pre = [float((prefill[tuple(p)] - r).abs().max() / r.abs().max()) for p, r in zip(prompts, ref)
           if tuple(p) in prefill]
    pre_top1 = [float(prefill[tuple(p)].argmax() == r.argmax()) for p, r in zip(prompts, ref)
                if tuple(p) in prefill]
    return dict(fmt=fmt, batch=batch, steps=steps, max_rel=max(diffs or [float("nan")]),
                prefill_rel=max(pre or [float("nan")]),
                prefill_top1=sum(pre_top1) / max(len(pre_top1), 1),
                # a fresh packed prompt attends to its own K/V (varlen / SDPA), a prompt over
                # stored pages through the Triton prefill kernel or the gather route
                prefill_kernel=sum(st.get(k, 0) for k in ("prefill_triton", "prefill_gather",
                                                          "prefill_fresh_varlen",
                                                          "prefill_fresh_sdpa")),
                argmax=min(agree or [1.0]), same_run=same,
                captures=graphs.captures if graphs else 0,
                replays=graphs.replays if graphs else 0,
                off=graphs.why_not() if graphs else "none", pages_left=used,
                ms_graph=1e3 * t_graph / new, ms_eager=1e3 * t_eager / new,
                fallbacks=st.get("reference_fallback", 0))


BATCHES = (1, 3, 5, 16)   # buckets hit exactly and ones that need padding rows


@pytest.fixture(scope="module", params=["bf16", "fp8_e4m3", "fp4_e2m1"])
def compiled(request):
    """(format, model compiled once per format, prompts and fp32 references per batch)."""
    fmt = request.param
    torch._dynamo.reset()
    model = tiny()
    prompts = {b: prompts_for(b) for b in BATCHES}
    ref = {b: reference_last_logits(model, prompts[b]) for b in BATCHES}
    kvcompile.compile(model, KVConfig(kv_dtype=fmt, max_kv_bytes=256 << 20, page_size=16))
    yield fmt, model, prompts, ref
    kvcompile.release(model)


@pytest.fixture(autouse=True)
def _fresh_dynamo(dynamo_per_module):  # overrides tests/conftest.py: one compile per format
    yield


@pytest.mark.parametrize("batch", BATCHES)
def test_graph_steps_equal_eager_steps(compiled, batch):
    fmt, model, prompts, ref = compiled
    r = check(model, fmt, batch, prompts[batch], ref[batch])
    print(r)
    assert r["steps"] > 0 and r["replays"] > 0, r
    assert r["max_rel"] <= TOL[fmt], r
    assert r["argmax"] == 1.0, r
    assert not r["pages_left"], r
    assert r["prefill_kernel"] > 0 and r["prefill_rel"] <= PREFILL_TOL[fmt], r
