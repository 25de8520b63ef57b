"""What kvcompile says, once per model, when it leaves part of a model as it was.

Every site left alone is in `kvcompile.report`; these warnings (`KVCompileWarning`) are for what
a user would otherwise not notice: a whole model running uncompiled, a site whose format or
pass failed, a rotation not applied. Each names the model, the reason and the fix, once.
"""

from __future__ import annotations

import warnings

import torch.fx as fx

from kvcompile.errors import KVCompileWarning

_SEEN = "_kvcompile_notices"


def warn_once(state, key, message: str) -> bool:
    """Warn `message` unless this model's state already warned under `key`."""
    seen = state.__dict__.setdefault(_SEEN, set())
    if key in seen:
        return False
    seen.add(key)
    warnings.warn(message, KVCompileWarning, stacklevel=2)
    return True


def warn_quality(state) -> None:
    """Once per model: its config stores keys in a format measured to cost more than a few
    percent of perplexity (config.quality_warning names the cost and the alternative)."""
    from kvcompile.config import quality_warning

    msg = quality_warning(state.config)
    if msg is not None:
        warn_once(state, "quality", msg)


def model_name(state) -> str:
    name = getattr(state, "model_name", None)
    return name or "the model compiled with backend='kvcompile'"


def warn_if_nothing_rewritten(gm: fx.GraphModule, state, res) -> None:
    """A graph with softmax-like ops, and no site of the model rewritten so far: the model
    runs exactly as without kvcompile. Say so once, with what `kvcompile inspect` would show."""
    from kvcompile.passes.find_attention import softmax_like

    if any(r.rewritten for r in state.records):
        return
    ops = [n for n in gm.graph.nodes if softmax_like(n)]
    if not ops:
        return
    sites = res.plan.sites
    if sites:
        why = f"{len(sites)} attention site(s) found, all left alone (first: {sites[0].name}: " \
              f"{sites[0].reason})"
    else:
        why = f"no attention site found among {len(ops)} softmax/attention op(s)"
        if res.near_misses:
            why += f" (first near miss: {res.near_misses[0]})"
    warn_once(state, "nothing rewritten",
              f"kvcompile rewrote no attention site of {model_name(state)}, so it runs with its "
              f"own KV cache, as without kvcompile: {why}. Run `kvcompile inspect MODEL` "
              f"(MODEL: its directory, .gguf file or module:factory) to see every site and "
              f"near miss; kvcompile.report(model) lists them too")


def warn_if_rewritten_only_elsewhere(state, sites) -> None:
    """Sites rewritten in an earlier graph (e.g. the prefill, where a cache-less attention
    matched) but left alone in this one (e.g. the decode): the calls this graph runs use the
    model's own cache. Say so once per model, with the first such site's reason."""
    earlier = {r.name for r in state.records[:len(state.records) - len(sites)] if r.rewritten}
    later = [s for s in sites if not s.rewritten and s.reason and s.name in earlier]
    if later:
        warn_once(state, "rewritten only elsewhere",
                  f"kvcompile rewrote {len(later)} attention site(s) of {model_name(state)} "
                  f"in an earlier graph but leaves them alone in graph {state.graphs}, whose "
                  f"calls run with the model's own KV cache: {later[0].name}: "
                  f"{later[0].reason}. `kvcompile inspect MODEL` or kvcompile.report(model) "
                  f"shows every site")
