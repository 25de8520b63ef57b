"""What the engine does when a step cannot go on as planned. A fault stays with the request
that caused it; every other request goes on.

- A forward that raises: the step is rolled back (no token of it stays in the pool). With one
  request in the step, that request fails (`finish_reason="error"`, the exception in `error`).
  With several, each runs again alone in the same step: the ones that fail alone fail, the
  others advance as they would have. A transient fault thus costs one slower step, and a
  request whose forward always fails (a position past the model's table, a custom layer that
  raises) can no longer stop every step. NonFiniteKVError (KVConfig.check_finite) names its own
  token and takes the engine's usual path.
- A request that can never be scheduled: nothing of the engine runs, nothing is swapped out,
  and the oldest waiting (or swapped) request still finds no pages, even after the prefix cache
  gave back what it alone holds. Only pages held outside the engine (another Engine's prefix
  cache, a live Hugging Face cache of the same model) can be in the way, and the engine cannot
  free those: the request fails with the figures, instead of `step()` returning nothing forever.
"""

from __future__ import annotations

import logging

from kvcompile.engine.scheduler import ScheduledSeq, SchedulerOutput
from kvcompile.errors import KVCacheFullError, NonFiniteKVError

log = logging.getLogger("kvcompile.engine")


def forward_failed(engine, out: SchedulerOutput, exc: Exception, changed: list) -> int:
    """The step's forward raised `exc` (its reservations already rolled back): fail the request
    that causes it, run the others. Returns the tokens generated."""
    if len(out.seqs) == 1:
        changed.append(fail(engine, out.seqs[0].req, exc))
        return 0
    log.warning("a step of %d requests failed (%s: %s); running each alone", len(out.seqs),
                type(exc).__name__, exc)
    engine.state.count("engine_step_retries")
    generated = 0
    for s in out.seqs:
        req = s.req
        if req.finished or req.seq_id is None:
            continue
        try:
            slots = engine.pool.reserve([req.seq_id], s.n)
        except KVCacheFullError:
            continue  # cannot happen (the step's own pages came back); left for the next step
        one = SchedulerOutput([ScheduledSeq(req, s.start, s.n, slots)])
        try:
            logits = engine.runner.forward(one)
        except NonFiniteKVError as e:
            engine.scheduler.rollback(one)
            changed.append(engine._fail_at(one, e))
            continue
        except Exception as e:  # noqa: BLE001  (any failure of this request's forward)
            engine.scheduler.rollback(one)
            changed.append(fail(engine, req, e))
            continue
        generated += engine._advance(one, logits, changed)
    return generated


def fail(engine, req, exc: Exception):
    """Finish `req` with finish_reason="error" for `exc`; its pages go back to the pool."""
    engine.scheduler.release(req)
    msg = (f"the forward of request {req.id} failed ({type(exc).__name__}: {exc}); this "
           f"request was stopped, the others go on")
    log.warning("%s", msg)
    req.finish("error", msg)
    engine.stats.requests_failed += 1
    return req


def stalled(engine, out: SchedulerOutput) -> bool:
    """Nothing ran, nothing of the engine holds pages it could give up, and requests wait."""
    s = engine.scheduler
    return (not out.seqs and not out.preempted and not s.running
            and bool(s.waiting or s.swapped))


def fail_unschedulable(engine):
    """Fail the oldest request the engine cannot schedule (see `stalled`), with the figures."""
    s, pool = engine.scheduler, engine.pool
    req = s.swapped[0] if s.swapped else s.waiting[0]
    P = pool.page_size
    if req.swapped is not None:
        need = req.swapped.num_pages
    else:  # its first chunk, from scratch (a prefix-cache hit was not enough either)
        need = -(-min(req.num_tokens, s.max_tokens) // P)
    own = set(engine.prefix_cache.pages()) if engine.prefix_cache is not None else set()
    for r in engine._requests.values():
        if r.seq_id is not None and pool.has(r.seq_id):
            own.update(pool.pages_of(r.seq_id))
    used = pool.num_pages - pool.num_free
    outside = max(0, used - len(own))
    msg = (f"request {req.id} can never be scheduled: it needs {need} free page(s), the pool has "
           f"{pool.num_free} free of {pool.num_pages}, and {outside} page(s) are held outside "
           f"this engine (another Engine's prefix cache, or a live Hugging Face cache of the "
           f"same model). Release them (Engine.close(), drop the cache) or give the pool more "
           f"memory (KVConfig.max_kv_bytes)")
    log.warning("%s", msg)
    s.release(req)
    req.finish("error", msg)
    engine.stats.requests_failed += 1
    return req
