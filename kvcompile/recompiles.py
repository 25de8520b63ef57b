"""Dynamo's caches and kvcompile: each model's own cache entries, a recompile budget per model,
and a warning whenever a forward ran uncompiled.

Dynamo keeps compiled code on the *code object* it traced, and stops compiling a code object
after `torch._dynamo.config.recompile_limit` (8) entries, running it eagerly from then on, with
one log line. Every Hugging Face model's `forward` is the same transformers wrapper function
(`deprecate_kwarg`'s `wrapped_func`, `can_return_tuple`'s `wrapper`), so models compiled one
after another shared those entries: the 7th model or so ran uncompiled.

- `own_frame(fn)`: a function calling `fn` with a code object of its own. `kvcompile.compile`
  compiles that, so each model's entries live on its own code object (and die with it); Dynamo
  inlines the shared wrappers into it.
- `recompile_budget()`: while a kvcompile forward runs, each live kvcompile model counts for the
  default budget on code objects that models still share (frames Dynamo compiles separately
  after a graph break). On the backend route (`torch.compile(model.forward, backend=...)`, the
  shared code object itself) the backend raises the global limit the same way
  (`raise_limit_for_models`).
- `check_forward(state, ...)`: a forward of a compiled model that ran no kvcompile graph warns,
  once per model, with the reason and the fix; when its cache object held the pool's stubs,
  the model's own attention read no real K/V, so the forward's output is wrong: it raises
  `CacheStateError` instead (every time), and the output is never returned. On the backend route kvcompile does not see the
  forwards Dynamo runs eagerly: `watch_dynamo_log` turns Dynamo's own "hit config.recompile_limit"
  record into a kvcompile warning (once per function) while kvcompile models are alive.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import types
import warnings

import torch

log = logging.getLogger("kvcompile")

DEFAULT_LIMIT = 8      # Dynamo's default recompile_limit: the budget of each model
_lock = threading.Lock()
_depth = 0
_saved: tuple[int, int] | None = None
_frames = itertools.count()


def own_frame(fn):
    """`fn` behind a function with a fresh code object (Dynamo's cache is per code object).
    A bound method stays a method of the same object, so that Dynamo still sees the module as
    the frame's `self` (site names are module paths from there: `model.layers.0.self_attn`)."""
    func, obj = (fn.__func__, fn.__self__) if isinstance(fn, types.MethodType) else (fn, None)

    def forward(*args, **kwargs):
        return func(*args, **kwargs)

    # A new code object, and a name of its own: Dynamo's automatic-dynamic state is keyed by
    # (file, line, name), and one model's floats (an attention scale) seen by another would
    # turn symbolic there.
    name = f"kvcompile_forward_{next(_frames)}"
    names = {"co_name": name}
    if hasattr(forward.__code__, "co_qualname"):   # Python >= 3.11
        names["co_qualname"] = name
    forward.__code__ = forward.__code__.replace(**names)
    functools.update_wrapper(forward, func)   # name, doc, __wrapped__: the model's signature
    return forward if obj is None else types.MethodType(forward, obj)


def _limits_for(models: int, user: tuple[int, int]) -> tuple[int, int]:
    per_model = max(DEFAULT_LIMIT, user[0])
    limit = max(user[0], per_model * max(1, models))
    return limit, max(user[1], limit)


@contextlib.contextmanager
def recompile_budget():
    """Raise Dynamo's recompile limits to the default per live kvcompile model while the block
    runs (nested and concurrent blocks share one raise; the user's values come back after)."""
    global _depth, _saved
    from kvcompile.runtime.state import all_states

    cfg = torch._dynamo.config
    with _lock:
        if _depth == 0:
            _saved = (cfg.recompile_limit, cfg.accumulated_recompile_limit)
            cfg.recompile_limit, cfg.accumulated_recompile_limit = _limits_for(
                len(all_states()), _saved)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                cfg.recompile_limit, cfg.accumulated_recompile_limit = _saved
                _saved = None


def raise_limit_for_models() -> None:
    """Backend route: the forward Dynamo compiles is the transformers function every model
    shares, so its limit must cover every live kvcompile model (a lasting, global raise; it
    only grows, and never lowers a limit the user set)."""
    global _saved
    from kvcompile.runtime.state import all_states

    watch_dynamo_log()
    cfg = torch._dynamo.config
    with _lock:
        user = _saved if _saved is not None else (cfg.recompile_limit,
                                                  cfg.accumulated_recompile_limit)
        limit, acc = _limits_for(len(all_states()), user)
        if _saved is not None:   # inside recompile_budget: raise what it restores, too
            _saved = (max(_saved[0], limit), max(_saved[1], acc))
        if cfg.recompile_limit < limit:
            log.info("kvcompile: torch._dynamo.config.recompile_limit %d -> %d (%d live "
                     "kvcompile models share the transformers forward)", cfg.recompile_limit,
                     limit, len(all_states()))
            cfg.recompile_limit = limit
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, acc)


# --- a forward that ran uncompiled ---------------------------------------------------------

class _LimitWatch(logging.Filter):
    """Sees Dynamo's "hit config.recompile_limit" record (convert_frame.py) and warns for
    kvcompile; lets every record through."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record) -> bool:
        from kvcompile.runtime.state import all_states

        msg, args = record.msg, record.args
        if (isinstance(msg, str) and msg.startswith("torch._dynamo hit config.")
                and isinstance(args, tuple) and len(args) >= 3 and all_states()):
            func = str(args[2])
            # kvcompile.compile's own frames are checked per model by check_forward, which
            # names the model: one warning for one event
            if func not in self.seen and "kvcompile_forward_" not in func:
                self.seen.add(func)
                _warn(f"kvcompile: Dynamo stopped compiling {func} ({args[0]} = {args[1]}): "
                      f"a model compiled with kvcompile that runs it now runs without kvcompile's "
                      f"pool. Fix: compile each model with kvcompile.compile(model) (its own "
                      f"cache entries), raise torch._dynamo.config.{args[0]}, or call "
                      f"torch._dynamo.reset() before compiling another model.", stacklevel=2)
        return True


_watch = _LimitWatch()


def watch_dynamo_log() -> None:
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if _watch not in logger.filters:
        logger.addFilter(_watch)


def _warn(msg: str, stacklevel: int = 3) -> None:
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)


def check_forward(state, calls_before: int, fn, model_name: str,
                  cache_in_pool: bool = False) -> None:
    """After a forward through Dynamo: warn (once per model) if it ran no kvcompile graph
    although the model has rewritten layers, or Dynamo never handed kvcompile a graph; raise
    if that forward's cache lives in the pool (`cache_in_pool`: its output is wrong)."""
    if state.graph_calls != calls_before:
        return
    if state.graphs and not state.layer_specs:
        return   # compiled, but no site was rewritten: the report (and its warning) say why
    state.count("uncompiled_forwards")
    if cache_in_pool:
        from kvcompile.errors import CacheStateError

        raise CacheStateError(
            f"kvcompile: {model_name} ran a forward without kvcompile ({_why(fn)}) while its "
            f"cache lives in kvcompile's pool: the model's own attention read the cache "
            f"object's zero-byte stubs, not its keys and values, so the output is wrong and "
            f"was not returned. A forward recompiled at every new length (TORCH_LOGS="
            f"recompiles shows a size guard on input_ids failing each step: the model turns "
            f"the length into a Python int) cannot stay compiled; run such a model without "
            f"kvcompile, or raise torch._dynamo.config.recompile_limit (now "
            f"{torch._dynamo.config.recompile_limit}) above its number of steps.")
    if getattr(state, "_warned_uncompiled", False):
        return
    state._warned_uncompiled = True
    msg = (f"kvcompile: {model_name} ran a forward without kvcompile ({_why(fn)}): its "
           f"attention used the model's own cache, not kvcompile's pool. Fix: raise "
           f"torch._dynamo.config.recompile_limit (now {torch._dynamo.config.recompile_limit}) "
           f"or call torch._dynamo.reset() before compiling another model; "
           f"TORCH_LOGS=recompiles,graph_breaks shows what Dynamo did.")
    _warn(msg)


def _why(fn) -> str:
    cfg = torch._dynamo.config
    if getattr(cfg, "disable", False):
        return "Dynamo is disabled (torch._dynamo.config.disable)"
    code = getattr(fn, "__code__", None)
    entries = _cache_entries(code) if code is not None else None
    if entries is not None and entries >= cfg.recompile_limit:
        return (f"Dynamo hit its recompile limit: {entries} compiled versions of this "
                f"forward, limit {cfg.recompile_limit}")
    return ("Dynamo ran it eagerly: it hit a recompile limit on a function that models share, "
            "or a graph break left the attention outside the compiled graphs")


def _cache_entries(code) -> int | None:
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    try:
        return len(_debug_get_cache_entry_list(code))
    except Exception:
        return None
