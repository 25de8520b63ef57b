"""Who keeps a `ModelState` alive, and how a compiled graph finds the state of its caller.

`kvcompile.compile(model)`: the model's `__dict__` holds its state. The backend route
(`torch.compile(model.forward, backend="kvcompile")`): the model's parameters own it (`_owners`,
weak keys), so it lives exactly as long as the model's weights.

Dynamo keeps each compiled graph (a `GraphRunner`, backend.py) in a cache entry on the code
object it compiled. On the backend route that code object is the transformers forward wrapper
that every model shares: the entries outlive the model, and a second model of the same class
reuses them (their guards check types and shapes, not identities). So a GraphRunner holds its
state weakly, together with a `Layout` (the compile-time facts: layers and formats, site
records, eviction policies) from which it sets up the state of whichever model calls it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kvcompile.runtime.state import ModelState, all_states

_owners = WeakIdKeyDictionary()   # parameter -> the state its model runs on (backend route)


def find_state(example_inputs, config) -> ModelState:
    """The state of the model whose parameters these graph inputs are (or a new one, owned by
    those parameters)."""
    params = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]
    ids = {id(p) for p in params}
    st = next((s for s in (_owners.get(p) for p in params)
               if s is not None and s.config == config), None)
    if st is None:
        st = next((s for s in all_states() if s.config == config and ids and s.param_ids & ids),
                  None)
    if st is None:
        from kvcompile.passes.notices import warn_quality

        st = ModelState(config)
        st.created_at = time.monotonic()
        warn_quality(st)
    st.param_ids |= ids
    for p in params:
        if p not in _owners:
            _owners[p] = st
    return st


def state_for_param(param, layout: Layout) -> ModelState:
    """The state of the model `param` belongs to, set up with `layout` (a graph compiled for
    another model of the same class runs for it)."""
    st = _owners.get(param)
    if st is None or st.config != layout.config:
        st = next((s for s in all_states() if s.config == layout.config
                   and id(param) in s.param_ids), None)
    if st is None:
        st = ModelState(layout.config)
        st.created_at = time.monotonic()
        _owners[param] = st
    st.param_ids.add(id(param))
    layout.apply(st)
    return st


@dataclass
class Layout:
    """What the passes registered in a state when a graph was compiled (no pool, no tensors
    but the RoPE frequencies), enough to run that graph on another model's state."""

    config: object
    layers: list = field(default_factory=list)     # (name, LayerSpec, meta), in index order
    records: list = field(default_factory=list)    # SiteRecord
    graphs: int = 0
    policies: dict = field(default_factory=dict)   # layer name -> eviction policy
    inv_freq: torch.Tensor | None = None
    sink_positions: str = "cache"
    rotations: dict = field(default_factory=dict)

    @classmethod
    def of(cls, state: ModelState) -> Layout:
        names = sorted(state.layer_names, key=state.layer_names.get)
        out = cls(state.config, [(n, state.layer_specs[state.layer_names[n]],
                                  dict(state.layer_meta[state.layer_names[n]])) for n in names],
                  list(state.records), state.graphs,
                  rotations=dict(state.__dict__.get("rotations", {})))
        rt = state.eviction
        if rt is not None:
            out.policies = {n: rt.policies[state.layer_names[n]] for n in names
                            if state.layer_names[n] in rt.policies}
            out.inv_freq, out.sink_positions = rt.inv_freq, rt.sink_positions
        return out

    def apply(self, state: ModelState) -> None:
        """Register in `state` the layers (and their eviction policies) it lacks."""
        state.graphs = max(state.graphs, self.graphs)
        if all(n in state.layer_names for n, _, _ in self.layers):
            return
        for name, spec, meta in self.layers:
            state.add_layer(name, spec, dict(meta))
        known = {r.name for r in state.records}
        state.records.extend(r for r in self.records if r.name not in known)
        state.__dict__.setdefault("rotations", {}).update(self.rotations)
        if self.policies:
            from kvcompile.eviction.runtime import EvictionRuntime

            rt = state.eviction
            if rt is None:
                rt = state.eviction = EvictionRuntime(state)
                state.hooks.append(rt)
            for name, policy in self.policies.items():
                rt.policies[state.layer_names[name]] = policy
            if rt.inv_freq is None:
                rt.inv_freq = self.inv_freq
            rt.sink_positions = self.sink_positions
