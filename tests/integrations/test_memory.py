"""Memory that kvcompile takes and gives back (issue 15, sections 1 and 5; issue 23, item 8).

- the Hugging Face path grows its pool on demand (KVConfig.reserve="auto"), the Engine reserves
  up front; a pool growing in the middle of `generate` gives eager's tokens;
- `kvcompile.release(model)` and the model's death give back the pool (its byte counter, the
  storage tensors) and the state; a second compile in the process works;
- every `generate` call returns its pages when it returns, with the garbage collector off, on
  the `kvcompile.compile` route and on the `torch.compile(..., backend="kvcompile")` route,
  and `stats()` says the same on both; in a fresh process too, where kvcompile was imported
  before transformers (the first call then used to keep its pages until the gc ran);
- generate calls from 6 threads on one compiled model give the tokens of sequential calls.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch

import kvcompile
from kvcompile.api import state_of
from kvcompile.cache import sizing
from kvcompile.errors import CacheStateError
from tests.engine.tiny import config, make_hf

GEN = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
MiB = 1 << 20


def _ids(B=2, S=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (B, S), generator=g)


def test_generate_grows_the_pool_instead_of_reserving_the_budget():
    ref, model = make_hf("llama"), make_hf("llama")
    kvcompile.compile(model, config(max_kv_bytes=None))   # budget: 0.9 of RAM, 4 GiB at most
    ids = _ids()
    out = model.generate(ids, max_new_tokens=12, **GEN)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=12, **GEN))
    st = kvcompile.stats(model)
    pool = state_of(model).pool
    assert pool.growable and st["bytes_total"] <= sizing.CHUNK_BYTES + pool.bytes_per_page
    assert st["pages_max"] >= 100 * st["pages_total"]      # the budget is there if needed


def test_pool_growing_inside_generate_gives_eager_tokens(monkeypatch):
    monkeypatch.setattr(sizing, "CHUNK_BYTES", 1)             # one page: grow again and again
    ref, model = make_hf("qwen2"), make_hf("qwen2")
    kvcompile.compile(model, config(page_size=8))
    ids = _ids(B=3, S=11)
    out = model.generate(ids, max_new_tokens=40, **GEN)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=40, **GEN))
    pool = state_of(model).pool
    assert pool.generation >= 4 and pool.stats().pages_used == 0
    pool.check_invariants()


def test_engine_reserves_up_front_even_after_generate_grew_the_pool():
    model = make_hf("llama")
    kvcompile.compile(model, config(page_size=8, max_kv_bytes=4096 * 4096))   # 4096 pages
    model.generate(_ids(), max_new_tokens=3, **GEN)
    pool = state_of(model).pool
    assert pool.growable and pool.num_pages < 4096
    engine = kvcompile.Engine(model, max_num_batched_tokens=32, cuda_graphs=False)
    assert engine.pool is pool and not pool.growable and pool.num_pages == 4096
    out = engine.generate([[5, 6, 7]], kvcompile.SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4 and pool.stats().sequences == 0


def test_release_and_deletion_give_the_memory_back():
    budget = 192 * MiB
    ref = make_hf("llama")
    ids = _ids()
    want = ref.generate(ids, max_new_tokens=6, **GEN)
    model = make_hf("llama")
    kvcompile.compile(model, config(reserve="upfront", max_kv_bytes=budget))
    assert torch.equal(model.generate(ids, max_new_tokens=6, **GEN), want)
    st = state_of(model)
    # The pool's storages, held weakly: each must die at release. (The process' RSS is no
    # measure on the CPU: glibc may keep freed memory of earlier tests resident and hand it
    # out again, so a filled 192 MiB pool grew RSS by 0.7 MiB after other tests in CI.)
    storage = [weakref.ref(t.data) for t in st.pool.k + st.pool.v]
    assert kvcompile.stats(model)["bytes_total"] > 0.95 * budget
    kept = model.generate(ids, max_new_tokens=3, return_dict_in_generate=True, **GEN)

    kvcompile.release(model)
    assert st.pool is None and kvcompile.stats(model)["bytes_total"] == 0
    assert all(r() is None for r in storage)
    with torch.no_grad(), pytest.raises(CacheStateError, match="kvcompile.release"):
        model(input_ids=ids[:, -1:], past_key_values=kept.past_key_values)   # its pages: gone
    # still compiled: the next call builds a new pool
    assert torch.equal(model.generate(ids, max_new_tokens=6, **GEN), want)
    assert kvcompile.stats(model)["bytes_total"] > 0.95 * budget

    state = weakref.ref(st)
    del model, st, kept
    gc.collect()
    assert state() is None                                  # nothing else held it
    second = make_hf("llama")                               # a second compile in the process
    kvcompile.compile(second, config(reserve="upfront", max_kv_bytes=budget))
    assert torch.equal(second.generate(ids, max_new_tokens=6, **GEN), want)
    kvcompile.release(second)


def _compiled(route: str, budget: int):
    model = make_hf("llama")
    opts = dict(inner="eager", kernels="reference", max_kv_bytes=budget, page_size=8)
    if route == "kvcompile.compile":
        kvcompile.compile(model, kvcompile.KVConfig(**opts))
    else:
        model.forward = torch.compile(model.forward, backend="kvcompile", options=opts)
    return model


POOL_FIELDS = ("pages_used", "sequences", "tokens", "pages_shared", "bytes_used")


@pytest.mark.parametrize("route", ["kvcompile.compile", "torch.compile"])
def test_every_call_returns_its_pages_without_the_garbage_collector(route):
    """A call's 2 x (9 + 8) tokens take 6 pages of 8; the budget holds 9 pages: 4 calls in a
    row fit only if each returns its pages when it ends (the gc is off)."""
    per_page = 2 * 2 * 2 * 16 * 4 * 8                         # layers, K+V, heads, dim, fp32, P
    model = _compiled(route, 9 * per_page)
    ids = _ids()
    gc.disable()
    try:
        outs, stats = [], []
        for _ in range(4):
            outs.append(model.generate(ids, max_new_tokens=8, **GEN))
            stats.append({k: kvcompile.stats(model)[k] for k in POOL_FIELDS})
    finally:
        gc.enable()
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert stats == [dict.fromkeys(POOL_FIELDS, 0)] * 4
    assert state_of(model).graphs >= 1 and len(kvcompile.report(model).rewritten) == 2


def test_stats_agree_between_routes():
    """Issue 23, item 8: the same calls on both routes leave the same pool state."""
    budget = 64 * 4096
    got = []
    for route in ("kvcompile.compile", "torch.compile"):
        model = _compiled(route, budget)
        gc.disable()
        try:
            model.generate(_ids(), max_new_tokens=5, **GEN)
            st = kvcompile.stats(model)
        finally:
            gc.enable()
        got.append({k: st[k] for k in POOL_FIELDS + ("pages_max", "bytes_per_token")})
    assert got[0] == got[1] and got[0]["pages_used"] == 0


# A fresh process: in this one, earlier tests have patched transformers' generate already.
# `from kvcompile import stats` before `from transformers import ...` (isort's order) imports
# kvcompile.backend before transformers; the torch.compile route then compiles inside the first
# generate call, and that call kept its pages (pages_used 4, sequences 2) until the gc ran.
_FRESH = textwrap.dedent("""
    import gc, json, sys
    import torch
    from kvcompile import stats            # kvcompile.backend before transformers
    import kvcompile
    from tests.engine.tiny import make_hf  # transformers comes in here
    torch.set_num_threads(1)
    opts = dict(inner="eager", kernels="reference", max_kv_bytes=64 * 4096, page_size=8)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    out = {}
    for route in ("torch.compile", "kvcompile.compile"):   # torch.compile first: nothing
        model = make_hf("llama")                           # has patched generate yet
        if route == "torch.compile":
            model.forward = torch.compile(model.forward, backend="kvcompile", options=opts)
        else:
            kvcompile.compile(model, kvcompile.KVConfig(**opts))
        calls = []
        for _ in range(2):
            gc.disable()
            try:
                model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
                st = stats(model)
            finally:
                gc.enable()
            calls.append({k: st[k] for k in sys.argv[1:]})
        out[route] = {"calls": calls, "rewritten": len(kvcompile.report(model).rewritten)}
    print(json.dumps(out))
""")


def test_first_generate_returns_its_pages_in_a_fresh_process_on_both_routes():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"),
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _FRESH, *POOL_FIELDS], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    empty = dict.fromkeys(POOL_FIELDS, 0)
    for route in ("torch.compile", "kvcompile.compile"):
        assert got[route]["rewritten"] == 2, route          # compiled, not an eager fallback
        assert got[route]["calls"] == [empty, empty], route


def test_generate_from_threads_equals_sequential_calls():
    model = make_hf("llama")
    kvcompile.compile(model, config(max_kv_bytes=1 << 23))
    prompts = [_ids(B=1 + i % 2, S=5 + i, seed=i) for i in range(6)]
    want = [model.generate(p, max_new_tokens=10, **GEN) for p in prompts]
    got, errors = [None] * 6, []
    start = threading.Barrier(6)

    def run(i):
        try:
            start.wait()
            got[i] = model.generate(prompts[i], max_new_tokens=10, **GEN)
        except BaseException as e:   # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, repr(errors[0])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    pool = state_of(model).pool
    assert pool.stats().pages_used == 0 and pool.stats().sequences == 0
    pool.check_invariants()
