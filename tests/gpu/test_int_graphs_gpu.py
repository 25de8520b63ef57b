"""The 4-bit format (K int4 per channel, V int4 per token, pages of 64) now that its pages are
written by the append kernel (kernels/append_int.py): HF `generate`'s decode steps and the
Engine's are graphed (CUDA only).

    pytest -s -q -m gpu tests/gpu/test_int_graphs_gpu.py       # or: gpu_jobs.sh int_graphs

HF generate: graphs on vs off on the tiny Llama (test_hf_graphs_gpu.py's cases, greedy with
left padding and beam search): same tokens, logits within 2e-3, graphs replayed, no refusal
reason. Engine: test_engine_graphs_gpu.py's check (graph replay vs the same step eager, per
step; argmax on decisive rows; whole runs), prefill on the reference (int pages have no prefill
kernel). The engine's per-step comparison writes each token twice: a channel range the first
write grew may re-round the page's earlier tokens on the second, so its tolerance is wider.
"""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile import KVConfig
from tests.gpu.test_engine_graphs_gpu import (
    BATCHES,
    check,
    prompts_for,
    reference_last_logits,
    tiny,
)
from tests.gpu.test_hf_graphs_gpu import CASES, TOL, inputs, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

INT4 = dict(kv_dtype="int4", scale_granularity="channel", page_size=64)
ENGINE_TOL = 2e-2


@pytest.fixture(autouse=True)
def _fresh_dynamo(dynamo_per_module):
    yield


@pytest.fixture(scope="module")
def hf_model():
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 64
    model = tiny()
    kvcompile.compile(model, KVConfig(**INT4, max_kv_bytes=256 << 20))
    yield model
    kvcompile.release(model)
    torch._dynamo.config.recompile_limit = limit


@pytest.mark.parametrize("i", [0, 3], ids=[CASES[0][0], CASES[3][0]])
def test_int4_generate_graphs_equal_no_graphs(hf_model, i):
    model, (name, shape, kw) = hf_model, CASES[i]
    fwd = model.forward
    ids, am = inputs(seed=i, **shape)
    r0 = fwd.replays
    tg, lg = run(model, ids, am, kw, True, seed=i)
    replays = fwd.replays - r0
    reason = fwd.why_not()
    te, le = run(model, ids, am, kw, False, seed=i)
    first = next((j for j in range(tg.shape[1]) if not torch.equal(tg[:, j], te[:, j])),
                 len(lg))
    rel = max([float((a - b).abs().max() / b.abs().max()) for a, b in
               zip(lg[:first], le[:first])] or [0.0])
    st = kvcompile.stats(model)
    print(dict(case=name, replays=replays, why_not=reason, max_rel=rel, steps_compared=first,
               decode={k: st.get(k, 0) for k in ("decode_cuda", "decode_triton")},
               fallbacks=st.get("reference_fallback", 0)))
    assert reason is None
    assert replays > 0
    assert rel <= TOL
    assert torch.equal(tg, te)


@pytest.fixture(scope="module")
def engine_model():
    torch._dynamo.reset()
    model = tiny()
    prompts = {b: prompts_for(b) for b in BATCHES}
    ref = {b: reference_last_logits(model, prompts[b]) for b in BATCHES}
    kvcompile.compile(model, KVConfig(**INT4, max_kv_bytes=256 << 20))
    yield model, prompts, ref
    kvcompile.release(model)


@pytest.mark.parametrize("batch", [3, 16])
def test_int4_engine_graph_steps_equal_eager_steps(engine_model, batch):
    model, prompts, ref = engine_model
    r = check(model, "int4", batch, prompts[batch], ref[batch])
    print(r)
    assert r["off"] is None, r
    assert r["steps"] > 0 and r["replays"] > 0, r
    assert r["max_rel"] <= ENGINE_TOL, r
    assert r["argmax"] == 1.0, r
    assert not r["pages_left"], r
