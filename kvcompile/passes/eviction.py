"""Pass 5: eviction bookkeeping for each rewritten attention site (per-layer policy).

Runs after the rewrite (passes/pipeline.py `evict_site`). For every rewritten
site whose config has a policy:

    out = torch.ops.kvcompile.attention(q, k, v, m, None, "model.layers.3.self_attn", ...)

gets `node.meta["kvcompile_eviction"] = "SinkWindow(sinks=4, window=1020, ...)"` and layer 3 is
bound to that policy in the model's `EvictionRuntime` (eviction/runtime.py), which runs
inside the op (runtime/dispatch.py, hooks). The bookkeeping is not a separate graph node: H2O's mass and SnapKV's scores are
the attention probabilities themselves, which exist only inside the op (or the decode kernel's
`attn_mass` output), and eviction happens between forwards, on block tables, never on graph
shapes. The pass also finds the model's RoPE `inv_freq` (for sink positions).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kvcompile.errors import CacheStateError
from kvcompile.eviction.policies import rules_of
from kvcompile.eviction.runtime import EvictionRuntime
from kvcompile.passes.sites import _policy_str

META_KEY = "kvcompile_eviction"


def eviction_pass(gm: fx.GraphModule, plan, state) -> str:
    sites = [s for s in plan.rewritten if s.config is not None and s.config.eviction]
    if not sites:
        return "no eviction policy"
    for site in sites:
        rules_of(site.config.eviction)   # KVConfigError naming register_policy if unknown
        if site.sinks is not None:   # the pipeline leaves the site alone with this reason
            raise NotImplementedError(
                f"{site.name} has attention sinks (a per-head sink logit), and attention over "
                f"the slots an eviction policy keeps has no sink input; remove the policy for "
                f"this module (kvcompile.configure(module, eviction=None))")
    rt = state.eviction
    if rt is None:
        rt = state.eviction = EvictionRuntime(state)
        state.hooks.append(rt)
    by_name = {s.name: s for s in sites}
    ops = (torch.ops.kvcompile.attention.default, torch.ops.kvcompile.latent_attention.default)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ops:
            site = by_name.get(node.args[5])
            if site is not None:
                node.meta[META_KEY] = _policy_str(site.config.eviction)
    for site in sites:
        policy, li = site.config.eviction, site.layer_index
        if rt.policies.get(li, policy) != policy:
            raise CacheStateError(f"layer {site.name} was compiled with two eviction policies")
        rt.policies[li] = policy
    if rt.inv_freq is None:
        rt.inv_freq = find_inv_freq(gm)
    kinds: dict[str, int] = {}
    for s in sites:
        kinds[_policy_str(s.config.eviction)] = kinds.get(_policy_str(s.config.eviction), 0) + 1
    rope = "RoPE found" if rt.inv_freq is not None else "no RoPE inv_freq found"
    return (f"{len(sites)} layer(s) evict: " + "; ".join(f"{k} x{v}" for k, v in kinds.items())
            + f" ({'page' if rt.page_mode else 'token'} granularity, {rope})")


def find_inv_freq(gm: fx.GraphModule) -> torch.Tensor | None:
    """The rotary `inv_freq` buffer [D/2] the graph reads, as a real tensor, or None."""
    for node in gm.graph.nodes:
        name = str(node.target) if node.op == "get_attr" else node.name
        if "inv_freq" not in name:
            continue
        if node.op == "get_attr":
            t = getattr(gm, node.target, None)
        else:
            ga = node.meta.get("grapharg")
            t = getattr(ga, "example", None) if ga is not None else None
        if isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_meta:
            return t.detach().float().clone()
    return None
