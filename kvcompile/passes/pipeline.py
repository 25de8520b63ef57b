"""The pass pipeline: find attention, find the cache, resolve configs, rewrite, rotate, eviction.

Each pass is recorded (what it found or changed, and optionally the graph code after it) so the
report and `kvcompile inspect --passes` can show every step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kvcompile.passes.find_attention import find_attention_sites
from kvcompile.passes.find_cache import find_caches
from kvcompile.passes.rewrite import RewritePlan, rewrite_sites
from kvcompile.passes.rotate import rotate_pass
from kvcompile.passes.site_config import resolve_site_configs
from kvcompile.passes.sites import SiteRecord

PASS_NAMES = ("find_attention", "find_cache", "resolve_config", "rewrite", "rotate",
              "eviction")


@dataclass
class PassLog:
    name: str
    summary: str
    code_after: str | None = None


@dataclass
class PipelineResult:
    plan: RewritePlan
    logs: list[PassLog] = field(default_factory=list)
    code_before: str | None = None


def run_passes(gm: fx.GraphModule, example_inputs, state, *, keep_code: bool = False,
               stop_after: str | None = None) -> PipelineResult:
    from kvcompile.cache.formats import resolve_format
    from kvcompile.cache.pool import LayerSpec

    if stop_after is not None and stop_after not in PASS_NAMES:
        raise ValueError(f"unknown pass {stop_after!r}; passes: {', '.join(PASS_NAMES)}")
    res = PipelineResult(plan=RewritePlan(), code_before=gm.code if keep_code else None)

    def log(name, summary):
        res.logs.append(PassLog(name, summary, gm.code if keep_code else None))
        return stop_after == name

    sites = find_attention_sites(gm)
    res.plan.sites = sites
    if _needs_grad(example_inputs):
        for site in sites:
            site.skip(site.reason or "autograd is recording (parameters require grad): "
                      "kvcompile rewrites inference graphs; run under torch.no_grad() or "
                      "torch.inference_mode()")
    patterns = ", ".join(sorted({f"{s.pattern}/{s.gqa}" for s in sites})) or "-"
    if log("find_attention", f"{len(sites)} attention site(s): {patterns}"):
        return res
    find_caches(gm, sites)
    kinds = ", ".join(sorted({s.cache_kind for s in sites if s.k_cache})) or "-"
    if log("find_cache", f"cache ops: {kinds}; "
           f"{sum(1 for s in sites if s.reason)} site(s) not rewritable"):
        return res
    resolve_site_configs(gm, example_inputs, sites, state.config)
    for site in sites:
        if site.reason or not site.config.enabled:
            continue
        cfg = site.config
        try:
            kf = resolve_format(cfg.key_dtype, site.dtype, cfg.scale_granularity,
                                cfg.static_scale, cfg.residual)
            vf = resolve_format(cfg.value_dtype, site.dtype, cfg.value_granularity,
                                cfg.static_scale, cfg.residual)
            kf.check_shape(site.head_dim, state.config.page_size)
            vf.check_shape(site.v_head_dim, state.config.page_size)
        except (ValueError, NotImplementedError) as e:
            site.skip(f"format not applicable: {e}")
            continue
        site.k_format_name, site.v_format_name = kf.name, vf.name
        spec = LayerSpec(num_kv_heads=site.num_kv_heads, head_dim=site.head_dim,
                         v_head_dim=site.v_head_dim, k_format=kf, v_format=vf)
        site.layer_index = state.register_layer(site, spec, {
            "name": site.name, "k_format": kf.name, "v_format": vf.name,
            "eviction": cfg.eviction, "rotate": cfg.rotate})
    if log("resolve_config", f"{len({s.name for s in sites if s.layer_index >= 0})} layer(s) "
           f"configured"):
        return res
    # the config's hash goes into the graph (the op's `tag`), so inductor's cache key changes
    # with the config; a hash keeps `--passes` diffs readable
    tag = "kvcompile-" + hashlib.sha1(state.config.cache_key().encode()).hexdigest()[:12]
    res.plan = rewrite_sites(gm, sites, tag)
    n = len(res.plan.rewritten)
    state.count("attention_rewritten", n)
    state.count("attention_skipped", len(sites) - n)
    torch._dynamo.utils.counters["kvcompile"]["attention_rewritten"] += n
    torch._dynamo.utils.counters["kvcompile"]["attention_skipped"] += len(sites) - n
    if log("rewrite", f"{n} of {len(sites)} site(s) rewritten onto the pool"):
        return res
    if log("rotate", rotate_pass(gm, res.plan, state, example_inputs)):
        return res
    if state.eviction_pass is not None:
        summary = state.eviction_pass(gm, res.plan, state)
        log("eviction", summary)
    state.graphs += 1
    for s in sites:
        rec = SiteRecord.of(s, state.graphs)
        rec.rotate = getattr(s, "rotation", "") or rec.rotate  # what the rotate pass did
        state.records.append(rec)
    return res


def _needs_grad(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)

