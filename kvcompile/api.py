"""The public entry points: `kvcompile.compile`, `release`, `report`, `stats`."""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass, field

import torch

from kvcompile import telemetry as _telemetry  # noqa: F401  (the silent `kvcompile` logger)
from kvcompile.backend import kvcompile_backend
from kvcompile.config import KVConfig
from kvcompile.integrations.tp import check_tensor_parallel, tensor_parallel_of
from kvcompile.passes import merge_projections, skinny_linears
from kvcompile.passes.notices import warn_quality
from kvcompile.runtime.state import ModelState, all_states

_STATE_ATTR = "_kvcompile_state"


def _backend_for(state: ModelState):
    """The backend of one `kvcompile.compile` call. Dynamo keeps every backend it was given in a
    global table (`torch._dynamo.eval_frame.cached_backends`) until `torch._dynamo.reset()`, so
    this one reaches the state through a weak reference: the model alone keeps it alive."""
    ref = weakref.ref(state)

    def backend(gm, example_inputs, **kwargs):
        st = ref()
        if st is None:
            raise RuntimeError("kvcompile: the model this graph was compiled for is gone")
        return kvcompile_backend(gm, example_inputs, state=st, **kwargs)

    functools.update_wrapper(backend, kvcompile_backend)
    return backend


def compile(model: torch.nn.Module, config: KVConfig | dict | None = None, **options):
    """Compile `model` so that its attention runs on kvcompile's paged, quantized KV cache.

    A Hugging Face `PreTrainedModel` is compiled in place (`model.forward` is replaced, so
    `model(...)` and `model.generate(...)` go through the backend) and returned. Any other module
    is returned compiled (`torch.compile(module, backend=...)`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kvcompile.compile(model): model must be a torch.nn.Module (a Hugging "
                        f"Face model or any module), got {type(model).__name__}; compile a "
                        f"function with torch.compile(fn, backend='kvcompile')")
    if config is not None and options:
        raise TypeError("pass either a KVConfig/dict or keyword options, not both")
    cfg = KVConfig.from_options(config if config is not None else options)
    check_tensor_parallel(model)  # a head split across ranks: refused here, not mid-forward
    state = ModelState(cfg)
    state.tp = tensor_parallel_of(model)   # DTensor-sharded; else the backend looks at the graph
    state.model_name = type(model).__name__  # for the warnings of the passes
    state.created_at = time.monotonic()  # telemetry rates count from here
    state.param_ids = {id(p) for p in model.parameters()}
    warn_quality(state)
    backend = _backend_for(state)
    if _is_hf_model(model):
        from kvcompile.inputs import CheckedForward
        from kvcompile.integrations.hf_graphs import GraphedForward
        from kvcompile.recompiles import own_frame

        fwd = model.forward
        if isinstance(fwd, GraphedForward):  # compiled before: start again from the original
            fwd.state.release()
            fwd = fwd.original
        # Dynamo caches compiled code per code object, and every HF model's forward is the same
        # transformers wrapper: compile a function of this model's own (kvcompile/recompiles.py)
        frame = own_frame(fwd)
        # generate's decode steps replay CUDA graphs where they can (integrations/hf_graphs.py)
        # inputs checked before Dynamo sees them (kvcompile/inputs.py)
        model.forward = CheckedForward(torch.compile(frame, backend=backend), state, model,
                                       frame=frame, original=fwd)
        model.__dict__[_STATE_ATTR] = state
        # engine issue (#6): a generate call's pages return to the pool when it returns, not at
        # the next gc (HF cache objects sit in reference cycles); see integrations/hf.py
        from kvcompile.integrations.hf import wrap_generate

        wrap_generate(model)
        return model
    compiled = torch.compile(model, backend=backend)
    compiled.__dict__[_STATE_ATTR] = state
    model.__dict__[_STATE_ATTR] = state
    return compiled


def release(model) -> None:
    """Give back what kvcompile holds for `model`: its page pool (every cached sequence's
    pages), its CUDA graphs and their buffers. The model stays compiled: its next forward
    builds a new pool (cache objects from before the release cannot be continued). Also
    happens when the model is garbage-collected."""
    st = state_of(model)
    if st is None:
        raise ValueError("this model was not compiled with kvcompile (nothing to release)")
    st.release()


def _is_hf_model(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def state_of(model) -> ModelState | None:
    st = model.__dict__.get(_STATE_ATTR) if hasattr(model, "__dict__") else None
    if st is not None:
        return st
    ids = {id(p) for p in model.parameters()} if isinstance(model, torch.nn.Module) else set()
    matches = [s for s in all_states() if s.param_ids & ids]
    return matches[-1] if matches else None


@dataclass
class Report:
    """What kvcompile found and did for one model. `str()` is a readable table."""

    sites: list = field(default_factory=list)       # SiteRecord, latest graph per site
    layers: list = field(default_factory=list)      # per pool layer: name, formats, policy
    pool: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    graphs: int = 0
    compile_seconds: float = 0.0
    config: KVConfig | None = None
    kernel_notes: list = field(default_factory=list)  # why a portable kernel ran, once each
    near_misses: list = field(default_factory=list)  # NearMiss: softmaxes that were no site
    tp_rank: int = 0     # tensor parallelism: this process's rank, of tp_size
    tp_size: int = 1

    @property
    def rewritten(self) -> list:
        return [s for s in self.sites if s.rewritten]

    @property
    def skipped(self) -> list:
        return [s for s in self.sites if not s.rewritten]

    def as_dict(self) -> dict:
        return {
            "sites": [s.as_dict() for s in self.sites], "layers": self.layers,
            "pool": self.pool, "counters": self.counters, "graphs": self.graphs,
            "compile_seconds": self.compile_seconds,
            "config": repr(self.config) if self.config else None,
            "near_misses": [m.as_dict() for m in self.near_misses],
            "tp_rank": self.tp_rank, "tp_size": self.tp_size,
        }

    def __str__(self) -> str:
        lines = [f"kvcompile report: {len(self.rewritten)} of {len(self.sites)} attention "
                 f"site(s) rewritten, {self.graphs} graph(s), compile {self.compile_seconds:.1f}s"]
        if self.tp_size > 1:
            lines.append(f"tensor parallel: rank {self.tp_rank} of {self.tp_size}; the sites "
                         f"and pool below are this rank's (its share of the heads)")
        head = f"{'site':40s} {'pattern':14s} {'gqa':17s} {'cache':10s} {'K/V format':20s} status"
        lines += [head, "-" * len(head)]
        for s in self.sites:
            fmt = f"{s.k_format}/{s.v_format}" if s.k_format else "-"
            status = "rewritten" if s.rewritten else f"left alone: {s.reason}"
            if s.rewritten and s.eviction != "none":
                status += f", eviction {s.eviction}"
            lines.append(f"{s.name[:40]:40s} {s.pattern:14s} {s.gqa:17s} {s.cache:10s} "
                         f"{fmt:20s} {status}")
        kc = {k: v for k, v in self.counters.items()
              if k.startswith(("decode_", "prefill_", "reference_fallback"))}
        if kc:
            lines.append("kernels: " + ", ".join(f"{k} {v}" for k, v in sorted(kc.items())))
        lines += [f"  {n}" for n in self.kernel_notes]
        merged = merge_projections.summary(self.counters)
        if merged:
            lines.append(merged)
        gemms = skinny_linears.summary(self.counters)
        if gemms:
            lines.append(gemms)
        if not self.rewritten:
            lines.append("nothing rewritten: the model runs with its own cache; "
                         "`kvcompile inspect MODEL` shows why")
            lines += [f"near miss: {m}" for m in self.near_misses]
        if self.pool:
            p = self.pool
            lines.append(
                f"pool: {p.get('pages_used', 0)}/{p.get('pages_total', 0)} pages used, "
                f"{p.get('sequences', 0)} sequence(s), {p.get('tokens', 0)} token(s), "
                f"{p.get('bytes_per_token', 0):.1f} B/token, waste "
                f"{100 * p.get('internal_waste', 0):.1f}%"
                + (f" (this rank; {self.tp_size * p.get('bytes_per_token', 0):.1f} B/token "
                   f"over all {self.tp_size} ranks)" if self.tp_size > 1 else ""))
        return "\n".join(lines)


def report(model) -> Report:
    st = state_of(model)
    if st is None:
        raise ValueError("this model was not compiled with kvcompile (or has not run yet: "
                         "the passes run at the first forward)")
    latest = {}
    for rec in st.records:
        latest[rec.name] = rec
    pool = {}
    if st.pool is not None:
        pool = dict(st.pool.stats().__dict__)
    misses = {(m.name, m.node): m for m in st.__dict__.get("near_misses", [])}
    return Report(sites=list(latest.values()), layers=list(st.layer_meta), pool=pool,
                  counters=dict(st.counters), graphs=st.graphs,
                  compile_seconds=st.compile_seconds, config=st.config,
                  kernel_notes=list(getattr(st, "kernel_notes", [])),
                  near_misses=list(misses.values()),
                  tp_rank=st.tp.rank if st.tp is not None else 0,
                  tp_size=st.tp.size if st.tp is not None else 1)


def stats(model=None) -> dict:
    """Telemetry of one compiled model (or of all, keyed 0, 1, ...): pages used / free / total,
    fill_ratio, internal_waste, tokens, bytes_per_token, evictions_per_s, evicted_tokens_per_s,
    preemptions_per_s (60 s window), prefix_cache_hit_rate, and the raw counters. Under tensor
    parallelism the pool figures are this rank's, with tp_rank, tp_size and bytes_total /
    bytes_used / bytes_per_token `_all_ranks` (this rank's x tp_size; no collective)."""
    from kvcompile.telemetry import state_stats

    if model is not None:
        st = state_of(model)
        return state_stats(st) if st is not None else {}
    return {i: state_stats(st) for i, st in enumerate(all_states())}
