"""The later tensor-parallel cases, run by each rank (tp_worker.py) and, unsharded, by the parent
(test_tensor_parallel.py) for its references: the same functions on both sides.

- `rotate_snapkv`: fp8 pages, rotate="hadamard" (V folded into v_proj / o_proj, which are
  sharded) and a layer-shared SnapKV: tokens, the tokens each layer keeps, the folded weights
  (`rotate_snapkv_batched`: the prompt's end through the batched eviction pass);
- `engine`: the Engine with requests arriving at set steps, a shared prefix, a pool small
  enough to preempt, greedy and seeded sampling;
- `gptfast`: gpt-fast's own tp.py-style sharding (local heads, functional all_reduce).
"""

from __future__ import annotations

import torch

from kvcompile.runtime.hooks import RuntimeHook

SNAPKV = dict(budget=6, window=2, kernel=3)
ENGINE_PAGE = 8
ENGINE_PAGES = 10          # each request fits alone, the four together do not: preemption
ENGINE_PROMPTS = [[5, 9, 17, 33, 65, 129, 200, 7, 3, 11, 250],
                  [40, 41, 42, 90, 91, 92, 150, 151, 152, 60, 61, 62, 63, 64, 99],
                  [7, 7, 8, 200, 201, 3, 4],
                  [5, 9, 17, 33, 65, 129, 200, 7, 130, 140, 150]]   # request 0's first page
ENGINE_ARRIVALS = [0, 0, 2, 5]   # the step before which each request arrives
ENGINE_NEW = 14


class KeptWatch(RuntimeHook):
    """At the start of every forward (layer 0's write), the logical positions each cached
    sequence keeps, per layer and kv head: [[seq, layer, head, [positions]], ...]."""

    def __init__(self, state):
        self.state, self.seen = state, []

    def before_write(self, ctx, layer, k, v):
        ev = self.state.eviction
        if layer == 0 and ev is not None:
            self.seen.append([[sid, li, h, sorted(int(p) for p in row if p >= 0)]
                              for sid, book in sorted(ev.books.items())
                              for li, pos in sorted(book.pos.items())
                              for h, row in enumerate(pos.tolist())])
        return k, v


def rotate_snapkv(model, prompts, new, per_head=False, batched=False) -> dict:
    """Compile with fp8 pages, rotation and SnapKV; generate greedily. batched: the prompt's
    end evicted through the batched pass (front.py, as on CUDA: runtime.BATCH_ON_CPU), its
    layer-shared scores summed over the ranks per row."""
    from kvcompile.eviction import runtime

    saved = runtime.BATCH_ON_CPU
    runtime.BATCH_ON_CPU = batched
    try:
        return _rotate_snapkv(model, prompts, new, per_head)
    finally:
        runtime.BATCH_ON_CPU = saved


def _rotate_snapkv(model, prompts, new, per_head) -> dict:
    import kvcompile
    from kvcompile.api import state_of
    from tests.engine.tiny import config

    kvcompile.compile(model, config(kv_dtype="fp8_e4m3", rotate="hadamard",
                                    eviction=kvcompile.SnapKV(**SNAPKV, per_head=per_head)))
    st = state_of(model)
    watch = KeptWatch(st)
    st.hooks.append(watch)
    tokens = model.generate(torch.tensor(prompts), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=0, eos_token_id=None).tolist()
    attn = model.model.layers[0].self_attn
    local = [getattr(w, "to_local", lambda w=w: w)() for w in (attn.v_proj.weight,
                                                                attn.o_proj.weight)]
    rep = kvcompile.report(model)
    return dict(tokens=tokens, kept=watch.seen, rotate=[s.rotate for s in rep.sites],
                rewritten=[s.rewritten for s in rep.sites],
                evicted=st.counters.get("evicted_tokens", 0),
                device_runs=st.counters.get("eviction_device_runs", 0),
                v_proj=local[0].tolist(), o_proj=local[1].tolist())


def _engine_requests():
    from kvcompile import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=ENGINE_NEW, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=ENGINE_NEW,
                             ignore_eos=True)
    return [(p, sampled if i == 1 else greedy) for i, p in enumerate(ENGINE_PROMPTS)]


def engine(model, kv_heads: int) -> dict:
    """The Engine under a pool of ENGINE_PAGES pages: fp32 pages of this process's `kv_heads`
    (2 layers, K and V, head_dim 16)."""
    import kvcompile
    from tests.engine.tiny import config

    bytes_per_page = ENGINE_PAGE * 2 * 2 * kv_heads * 16 * 4
    cfg = config(kv_dtype="auto", page_size=ENGINE_PAGE,
                 max_kv_bytes=ENGINE_PAGES * bytes_per_page)
    eng = kvcompile.Engine(model, None, cfg, max_num_batched_tokens=16, max_num_seqs=4)
    reqs = _engine_requests()
    rids, done, step = [], {}, 0
    while len(done) < len(reqs):
        for (p, sp), at in zip(reqs, ENGINE_ARRIVALS):
            if at == step:
                rids.append(eng.add_request(p, sp))
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        step += 1
    pages = eng.pool.num_pages
    preempted = eng.stats.preemptions
    steps = eng.stats.steps
    hits = kvcompile.stats(model).get("prefix_hit_tokens", 0)
    eng.close()
    return dict(tokens=[done[r] for r in rids], pages=pages, preemptions=preempted,
                steps=steps, prefix_hit_tokens=hits, pages_left=eng.pool.stats().pages_used)


def engine_diverging(model, rank: int) -> dict:
    """Ranks fed different requests: the schedule check must stop both before the forward."""
    import kvcompile

    eng = kvcompile.Engine(model, max_num_batched_tokens=16, max_num_seqs=4)
    prompt = ENGINE_PROMPTS[0] if rank == 0 else ENGINE_PROMPTS[2]
    eng.add_request(prompt, kvcompile.SamplingParams(temperature=0, max_tokens=2))
    try:
        eng.step()
        return dict(error_seen="none")
    except Exception as e:  # the test reads the type and message
        return dict(error_seen=f"{type(e).__name__}: {e}")


def gptfast(rank: int, world: int, prompts, new: int) -> dict:
    """The zoo's gpt-fast model sharded as gpt-fast's tp.py does, compiled, greedy tokens."""
    import kvcompile
    from kvcompile.api import state_of
    from tests.distributed.gptfast_tp import shard_gptfast
    from tests.passes.zoo import GptFast, gptfast_generate, seeded

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    model = shard_gptfast(seeded(GptFast), rank, world)
    compiled = kvcompile.compile(model, kvcompile.KVConfig(inner="eager", kernels="reference",
                                                           max_kv_bytes=1 << 22))
    tokens = gptfast_generate(compiled, torch.tensor(prompts), new).tolist()
    rep = kvcompile.report(model)
    st = kvcompile.stats(model)
    return dict(tokens=tokens, tp=repr(state_of(model).tp),
                sites=[dict(name=s.name, rewritten=s.rewritten, reason=s.reason,
                            num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads)
                       for s in rep.sites],
                bytes_per_token=st["bytes_per_token"], tp_rank=st["tp_rank"],
                tp_size=st["tp_size"], report=str(rep).splitlines()[:2])
