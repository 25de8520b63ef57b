"""What the passes find: attention sites, the cache op feeding each, and what was done."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


@dataclass
class CacheOp:
    """How the keys (or values) reaching an attention site are cached.

    kind: "cat"        torch.cat([past, new], dim=-2): DynamicCache
          "index_copy" buf.index_copy_(2, positions, new): StaticCache
          "index_put"  buf[:, :, positions] = new / index_put_: gpt-fast-style buffers
          "none"       a plain forward: attention over this forward's own k/v
    """

    kind: str
    new: fx.Node                       # [B, Hkv, S, D] this forward's keys (values)
    past: fx.Node | None = None        # cat: the past tensor (placeholder or in-graph empty)
    buffer: fx.Node | None = None      # index ops: the cache buffer (placeholder or in-graph zeros)
    positions: Any = None              # index ops: node [S] / [B, S], or a slice object
    write_nodes: list[fx.Node] = field(default_factory=list)   # the index_copy_/setitem nodes
    layout: Any = None                 # Layout of `new` (passes/layouts.py); None: [B, H, S, D]
    seq_dim: int = 2                   # the sequence dim of the cached tensor


@dataclass
class AttentionSite:
    """One attention computation found in a graph."""

    name: str                          # module path, e.g. "model.layers.3.self_attn"
    module_class: str
    module_stack: list                 # [(path, class)] outermost first
    pattern: str                       # "sdpa" | "eager"
    gqa: str                           # "mha" | "enable_gqa" | "repeat_kv" | "repeat_interleave"
    q: fx.Node
    k: fx.Node                         # keys as attention consumes them (after unwrapping GQA)
    v: fx.Node
    output: fx.Node                    # the node whose value is the attention output
    chain: list[fx.Node]               # nodes of the attention computation, in order
    mask: Any = None                   # node, or None
    mask_kind: str | None = None       # "bool" | "additive" | None
    scale: float | None = None         # None: 1/sqrt(D) (SDPA default)
    is_causal: bool = False
    softcap: float = 0.0
    n_rep: int = 1
    k_cache: CacheOp | None = None
    v_cache: CacheOp | None = None
    # filled by the rewrite pass
    rewritten: bool = False
    reason: str = ""                   # why it was left alone
    config: Any = None                 # the KVConfig that applies to this site
    layer_index: int = -1
    layer_spec: Any = None             # the pool layer it would get (resolve_config)
    layer_meta: dict | None = None
    num_q_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    dtype: Any = None
    # how q, k, v (as consumed, after unwrapping GQA) and the output hold their heads
    # (passes/layouts.py); None: [B, H, S, D]
    q_layout: Any = None
    k_layout: Any = None
    v_layout: Any = None
    out_layout: Any = None
    # further masks / position biases applied with `mask` ([(node, kind)]): ALiBi, a second
    # causal mask; the rewrite combines them into one
    more_masks: list = field(default_factory=list)
    # MLA: how the keys and values are expanded from a cached latent (passes/find_latent.py
    # LatentExpansion); None for attention over the cached K/V themselves
    latent: Any = None
    # attention sinks: a node holding one logit per query head ([1, H, 1, 1] or [1, H, 1]);
    # the rewrite passes it to kvcompile.attention as sink_logits [H]
    sinks: Any = None

    @property
    def cache_kind(self) -> str:
        return self.k_cache.kind if self.k_cache is not None else "?"

    def skip(self, reason: str) -> AttentionSite:
        self.rewritten = False
        self.reason = reason
        return self


@dataclass
class NearMiss:
    """A softmax (or attention-like op) that did not become an attention site, and why: the
    pattern step that failed and the node it failed on. Shown by `kvcompile inspect` and by
    `kvcompile.report` when no site was rewritten."""

    name: str                          # module path of the candidate, e.g. "blocks.0.attn"
    node: str                          # the candidate node (a softmax, an unknown attention op)
    step: str                          # pattern step that failed: "softmax", "scores", ...
    at: str                            # the node the step failed on, with its op
    reason: str
    graph: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def __str__(self) -> str:
        return f"{self.name}: {self.node}: {self.step} step failed at {self.at}: {self.reason}"


@dataclass
class SiteRecord:
    """A graph-independent summary of a site, kept for `kvcompile.report` and the CLI."""

    name: str
    module_class: str
    pattern: str
    gqa: str
    cache: str
    rewritten: bool
    reason: str
    k_format: str = ""
    v_format: str = ""
    eviction: str = "none"
    rotate: str = "none"
    num_q_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    mask: str = "none"
    graph: int = 0

    @classmethod
    def of(cls, site: AttentionSite, graph_index: int) -> SiteRecord:
        cfg = site.config
        return cls(
            name=site.name, module_class=site.module_class, pattern=site.pattern,
            gqa=site.gqa, cache=site.cache_kind, rewritten=site.rewritten, reason=site.reason,
            k_format=getattr(site, "k_format_name", "") or "",
            v_format=getattr(site, "v_format_name", "") or "",
            eviction=_policy_str(cfg.eviction) if cfg is not None else "none",
            rotate=str(cfg.rotate) if cfg is not None and cfg.rotate else "none",
            num_q_heads=site.num_q_heads, num_kv_heads=site.num_kv_heads,
            head_dim=site.head_dim, mask=site.mask_kind or "none", graph=graph_index,
        )

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _policy_str(policy) -> str:
    if policy is None:
        return "none"
    args = ", ".join(f"{k}={v}" for k, v in policy.__dict__.items())
    return f"{type(policy).__name__}({args})"
