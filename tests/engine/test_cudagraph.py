"""The engine's CUDA-graph decode steps (engine/cudagraph.py): the host-side pieces on the CPU,
and graph replay against eager steps on CUDA (tests/gpu/test_engine_graphs_gpu.py runs the
fuller check on the H200)."""

from __future__ import annotations

import random

import pytest
import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.config import KVConfig
from kvcompile.engine.cudagraph import DecodeGraphs, Staged, bucket_sizes
from tests.engine.tiny import config, make_hf, random_prompts


@pytest.fixture
def pool():
    from kvcompile.cache.formats import resolve_format

    fmt = resolve_format("bf16", torch.float32)
    return PagePool([LayerSpec(2, 8, 8, fmt, fmt)], 64, 4)


def test_decode_slots_match_reserve(pool):
    rng = random.Random(0)
    seqs = pool.allocate(5)
    for s in seqs:
        pool.reserve([s], rng.randrange(1, 11))
    for _ in range(6):  # decode steps: one token each, some sequences forked
        slots = pool.reserve(seqs, 1)
        got, rows, lens = pool.decode_slots(seqs)
        assert got == slots.tolist()
        assert lens == [pool.seq_len(s) for s in seqs]
        table = pool.table()
        for s, r in zip(seqs, rows):
            n = len(pool.pages_of(s))
            assert table[r, :n].tolist() == pool.pages_of(s)
    child = pool.fork(seqs[0])
    got, _, _ = pool.decode_slots([child])
    before = pool.pages_of(child)
    slot = pool.reserve([child], 1)
    assert pool.decode_slots([child])[0] == slot.tolist()
    assert pool.pages_of(child)[-1] != before[-1] or len(before) < len(pool.pages_of(child))
    all_slots, row = pool.sequence_slots(seqs[1])
    assert len(all_slots) == pool.seq_len(seqs[1]) and len(set(all_slots)) == len(all_slots)
    P = pool.page_size
    assert [s // P for s in all_slots[::P]] == pool.pages_of(seqs[1])


def test_upload_plan_copies_the_table_rows_again_only_when_they_can_differ(pool):
    """upload_plan with rows_key (generate's steps): the rows' gather is skipped while the
    rows and the pool's table stand as at the last copy; a new page (the table changed),
    other rows, or a caller without rows_key copy them again."""
    from types import SimpleNamespace

    from kvcompile.engine.cudagraph import upload_plan

    seqs = pool.allocate(3)
    pool.reserve(seqs, 3)                       # pages of 4: the next token fits
    B = len(seqs)
    g = SimpleNamespace(block_tables=torch.zeros(B, 8, dtype=torch.int32))
    Staged._stage(g, 2 * B, B, "cpu", events=False)   # the plan's buffers, one upload
    g.rows = g.dev64[B:]

    def step(key=True):
        pool.reserve(seqs, 1, slots=False)
        slots, rows, lens = pool.decode_slots(seqs)
        g.h64[:B], g.h64[B:], g.h32[:] = slots, rows, lens
        g.block_tables.fill_(-1)                # poison: a skipped gather leaves it
        upload_plan(g, pool, non_blocking=False, rows_key=tuple(rows) if key else None)
        # slots, rows and lengths (two dtypes) arrive in the one copy
        assert g.dev64.tolist() == slots + rows and g.seq_lens.tolist() == lens
        want = pool.table()[torch.tensor(rows)][:, :8]
        return torch.equal(g.block_tables, want)

    assert step()                 # token 4: the first copy
    assert step()                 # token 5: a new page each, the table changed: copied
    assert not step()             # token 6: same rows, same table: skipped (poison stays)
    assert step(key=False)        # token 7: no rows_key: always copied
    assert step()                 # token 8: (the key was cleared by the call without one)
    assert step()                 # token 9: a new page
    assert not step()             # token 10
    seqs.reverse()                # other rows: copied
    assert step()


def test_bucket_sizes():
    assert bucket_sizes(16) == [1, 2, 4, 8, 12, 16]
    assert bucket_sizes(20)[-1] == 20 and bucket_sizes(1) == [1]
    for m in (3, 17, 64, 300):
        b = bucket_sizes(m)
        assert b == sorted(set(b)) and b[-1] == m and all(x <= m for x in b)


def test_padding_rows_leave_the_real_rows_inputs_alone():
    """_pad fills the padding rows of every segment of a graph's int64 inputs (ids | positions
    | slots | table rows | mass rows | sink shifts | re-rotated sink counts | hidden slots' lo,
    hi) and nothing of the real rows. It once zeroed the real rows' re-rotated sink counts, so a replay with padding
    attended the sinks unrotated (the H200 check of re-rotated SinkWindow, 2026-12-03)."""
    from types import SimpleNamespace

    import numpy as np

    bp, n = 4, 2
    g = SimpleNamespace(bp=bp, h64=np.full(9 * bp, 7, dtype=np.int64),
                        h32=np.full(bp, 9, dtype=np.int32))
    store = SimpleNamespace(scratch=3)
    graphs = SimpleNamespace(_scratch=lambda rows: (0, [100, 101, 102, 103], 5),
                             state=SimpleNamespace(eviction=SimpleNamespace(store=store)))
    DecodeGraphs._pad(graphs, g, n)
    seg = g.h64.reshape(9, bp)
    assert (seg[:, :n] == 7).all(), seg          # real rows untouched, every segment
    assert seg[:, n:].tolist() == [[0, 0], [0, 0], [100, 101], [5, 5], [3, 3], [0, 0], [0, 0],
                                   [0, 0], [0, 0]]
    assert g.h32.tolist() == [9, 9, 1, 1]


def test_graphs_off_on_cpu_and_engine_unchanged():
    """Off the GPU the engine never tries a graph, and says why."""
    m = make_hf("llama", "sdpa")
    kvcompile.compile(m, config(kv_dtype="bf16", page_size=8, max_kv_bytes=1 << 20))
    eng = Engine(m, max_num_batched_tokens=256, enable_prefix_caching=False)
    g = eng.runner.graphs
    assert isinstance(g, DecodeGraphs)
    assert g.why_not() == "not on CUDA"
    outs = eng.generate(random_prompts(random.Random(1), 3),
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outs)
    assert g.replays == 0 and g.captures == 0 and g.scratch is None
    eng.close()
    off = Engine(m, max_num_batched_tokens=256, enable_prefix_caching=False, cuda_graphs=False)
    assert off.runner.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_graph_steps_match_eager_on_cuda(fmt):
    m = make_hf("llama", "sdpa").cuda()
    kvcompile.compile(m, KVConfig(kv_dtype=fmt, page_size=16, max_kv_bytes=64 << 20,
                                  inner="eager"))
    prompts = random_prompts(random.Random(2), 5, 3, 60)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eng = Engine(m, max_num_batched_tokens=512, enable_prefix_caching=False)
    a = eng.generate(prompts, params)
    assert eng.runner.graphs.replays > 0
    eng.runner.graphs = None
    b = eng.generate(prompts, params)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    eng.close()
    assert eng.pool.stats().pages_used == 0


def test_a_new_eviction_spec_captures_every_bucket_at_once():
    """The first decode step with an eviction spec (a window's hidden slots, H2O mass) captures
    that spec's graph for every bucket, largest first, so that the batch shrinking as requests
    finish replays graphs instead of capturing inside the run; later steps capture nothing, and
    the plain step (captured up front by capture_all) is not widened."""
    from types import SimpleNamespace

    from kvcompile.engine.cudagraph import PLAIN
    from kvcompile.eviction.aside import AsideSpec

    state = SimpleNamespace(release_hooks=[])
    graphs = DecodeGraphs(SimpleNamespace(state=state), 16)
    captured = []

    def fake_capture(bp, spec=PLAIN):
        captured.append((bp, spec))
        graphs.graphs[(bp, spec)] = g = SimpleNamespace(bp=bp, spec=spec)
        return g

    graphs._capture = fake_capture
    window = AsideSpec(hidden=32)
    assert graphs._graph_for(4, window).bp == 4
    assert captured == [(b, window) for b in (16, 12, 8, 4, 2, 1)]
    for bp in (16, 12, 8, 1):
        assert graphs._graph_for(bp, window).spec == window
    assert len(captured) == 6
    mass = AsideSpec(mass_len=64)
    graphs._graph_for(16, mass)
    assert [c for c in captured[6:]] == [(b, mass) for b in (16, 12, 8, 4, 2, 1)]
    captured.clear()
    graphs._graph_for(8, AsideSpec())   # the plain step: one bucket, as before
    assert captured == [(8, AsideSpec())]


def test_check_inputs_names_what_would_fault(pool):
    """KVCOMPILE_GRAPH_CHECK's check of a replay's inputs: valid inputs pass; a slot outside
    its row's last page, a length past the table, a table entry outside the pool and a pool
    that grew after the capture are each named."""
    from kvcompile.engine.cudagraph import _Graph, check_inputs, upload_plan
    from kvcompile.errors import CacheStateError

    seqs = pool.allocate(2)
    pool.reserve(seqs, 9)   # 3 pages each (P 4)
    g = _Graph(2, 8, torch.device("cpu"))
    slots, rows, lens = pool.decode_slots(seqs)

    def fill(slots=slots, lens=lens):
        g.h64[2 * 2:3 * 2] = slots
        g.h64[3 * 2:4 * 2] = rows
        g.h32[:] = lens
        upload_plan(g, pool)

    fill()
    check_inputs(g, pool, pool.generation, seqs)
    fill(slots=[slots[0], slots[1] - 4])   # the token a page too early
    with pytest.raises(CacheStateError, match="row 1 .* is not in its last page"):
        check_inputs(g, pool, pool.generation, seqs)
    fill(lens=[lens[0], 8 * 4 + 1])
    with pytest.raises(CacheStateError, match="row 1 .* length 33, table width 8"):
        check_inputs(g, pool, pool.generation, seqs)
    fill()
    g.block_tables[0, 1] = pool.num_pages
    with pytest.raises(CacheStateError, match="row 0 .* outside"):
        check_inputs(g, pool, pool.generation, seqs)
    with pytest.raises(CacheStateError, match="generation"):
        check_inputs(g, pool, pool.generation - 1, seqs)
