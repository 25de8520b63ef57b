"""Resolve the config of each attention site from `configure` overrides.

Class overrides (`@kvcompile.configure(...)` on a module class) apply through the classes in the
site's `nn_module_stack`, outer to inner. Instance overrides (`kvcompile.configure(module, ...)`)
apply when the site sits inside that instance: the graph's placeholders are the model's real
parameters, so a module scope belongs to an instance when all the parameters it uses are the
instance's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from kvcompile.config import KVConfig, class_overrides, instance_overrides
from kvcompile.passes.graph_utils import module_stack
from kvcompile.passes.sites import AttentionSite


def resolve_site_configs(gm: fx.GraphModule, example_inputs, sites: list[AttentionSite],
                         base: KVConfig, configured: Sequence = ()) -> None:
    scope = config_scope(gm, example_inputs, configured)
    for site in sites:
        resolve_site_config(site, base, scope)


@dataclass
class ConfigScope:
    """What the overrides of one graph depend on: the configured instances' parameter ids,
    and the parameters each module scope of the graph uses."""

    scope_params: dict
    inst_ids: list


def config_scope(gm: fx.GraphModule, example_inputs, configured: Sequence = ()) -> ConfigScope:
    """`configured`: the module instances with `@configure` overrides, given by the caller."""
    instances = list(configured)
    scope_params = _scope_params(gm, example_inputs) if instances else {}
    return ConfigScope(scope_params, [({id(t) for t in m.parameters()}, m) for m in instances])


def resolve_site_config(site: AttentionSite, base: KVConfig, scope: ConfigScope) -> None:
    """site.config = `base` with the class and instance overrides of the modules around it.
    A combination no format can honour raises KVConfigError (the user's config, not a bug)."""
    cfg = base
    for path, cls in site.module_stack:
        if isinstance(cls, type):
            over = class_overrides(cls)
            if over:
                cfg = cfg.replace(**over)
        used = scope.scope_params.get(path)
        if used:
            for ids, module in scope.inst_ids:
                if used <= ids:
                    cfg = cfg.replace(**instance_overrides(module))
    site.config = cfg


def _scope_params(gm: fx.GraphModule, example_inputs) -> dict[str, set[int]]:
    """module path -> ids of the parameters used by nodes inside it (activations and cache
    tensors are graph inputs too, but never belong to a module)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = {}
    for n, x in zip(placeholders, example_inputs):
        if isinstance(x, torch.nn.Parameter):
            real[n] = id(x)
    out: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        ids = {real[a] for a in node.all_input_nodes if a in real}
        if not ids:
            continue
        for path, _ in module_stack(node):
            out.setdefault(path, set()).update(ids)
    return out
