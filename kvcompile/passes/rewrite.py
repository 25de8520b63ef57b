"""Pass 3: rewrite each (cache op + attention) onto the paged pool.

Before (DynamicCache, GQA by repeat_kv):

    keys = torch.cat([past_k, k_new], dim=-2)            # stored back into the HF cache
    values = torch.cat([past_v, v_new], dim=-2)
    out = sdpa(q, repeat_kv(keys), repeat_kv(values), attn_mask=m, scale=s)

After:

    out = torch.ops.kvcompile.attention(q, k_new, v_new, m, None, "model.layers.0.self_attn",
                                        s, False, 0, 0.0, tag)
    # (with attention sinks: ..., tag, sink_logits=sinks.reshape(-1))
    keys = _virtual_cat(past_k, k_new)                    # zero-byte stub of cat's shape
    values = _virtual_cat(past_v, v_new)

Index-written buffers lose their write (`buf.index_copy_(2, pos, k_new)` goes; `pos` becomes
the op's `positions`), and a buffer made in the graph (`torch.zeros(...)`) becomes a stub. The
rewrite of a site happens only after all its checks passed, so a site is either fully rewritten
or left exactly as it was.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kvcompile.passes.graph_utils import VIEW_KINDS, arg, graph_outputs, kind, ndim, set_meta, val
from kvcompile.passes.layouts import BHSD
from kvcompile.passes.mask_inputs import drop_masks, unexpand_masks
from kvcompile.passes.sites import AttentionSite

STUB_META = "kvcompile_stub"


def _virtual_cat(past: torch.Tensor, new: torch.Tensor, dim: int | None = -2) -> torch.Tensor:
    """A zero-stride tensor shaped like torch.cat([past, new], dim)."""
    size = list(new.shape)
    if dim is not None:   # None: no past (a cache that starts with `new`)
        size[dim] += past.shape[dim] if past.dim() == new.dim() else 0
    return new.new_zeros(()).expand(*size)


def _zero_stub(*size, dtype=None, device=None, **_ignored) -> torch.Tensor:
    """A zero-stride tensor shaped like torch.zeros(size): an in-graph cache buffer."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return torch.zeros((), dtype=dtype, device=device).expand(*size)


def _slice_positions(start, stop, ref: torch.Tensor) -> torch.Tensor:
    return torch.arange(0 if start is None else start, stop, device=ref.device)


@dataclass
class RewritePlan:
    """What the backend wrapper needs at run time."""

    sites: list[AttentionSite] = field(default_factory=list)
    handle_inputs: list[int] = field(default_factory=list)   # placeholder index of past/buffer
    handle_kinds: list[str] = field(default_factory=list)    # "cat" | "index_copy" | "index_put"
    handle_seq_dims: list[int] = field(default_factory=list)  # each handle's sequence dim
    buffer_inputs: list[int] = field(default_factory=list)   # real buffers to release
    stub_outputs: list[int] = field(default_factory=list)    # output index of stubs

    @property
    def rewritten(self) -> list[AttentionSite]:
        return [s for s in self.sites if s.rewritten]


def rewrite_sites(gm: fx.GraphModule, sites: list[AttentionSite], tag: str) -> RewritePlan:
    handles: list[tuple[fx.Node, str]] = []
    for site in sites:
        if site.reason or not site.config.enabled:
            if not site.reason:
                site.skip("disabled by configure(enabled=False)")
            continue
        rewrite_site(gm, site, tag, handles)
    return finish_rewrite(gm, sites, handles)


def rewrite_site(gm: fx.GraphModule, site: AttentionSite, tag: str,
                 handles: list[tuple[fx.Node, str]]) -> None:
    """Replace one site's attention and cache ops by `kvcompile.attention`; appends the cache
    inputs it binds to `handles`. Sets site.rewritten."""
    graph = gm.graph
    q_layout = site.q_layout or BHSD
    mask = _mask_operand(graph, site, site.mask, site.mask_kind, q_layout)
    for m, k in site.more_masks:
        mask = _combine_masks(graph, site, mask, _mask_operand(graph, site, m, k, q_layout))
    positions = _positions(graph, site)
    scale = site.scale if site.scale is not None else 1.0 / math.sqrt(site.head_dim)
    is_causal = site.is_causal
    with graph.inserting_before(site.output):
        if positions is _NEEDS_SLICE:
            sl = site.k_cache.positions
            positions = graph.call_function(_slice_positions,
                                            (sl.start, sl.stop, site.k_cache.new))
            _set_meta(positions, site.output)
    q = _adapt(graph, q_layout.to_bhsd, site.q, site.output)
    k_new = _adapt(graph, (site.k_cache.layout or BHSD).to_bhsd, site.k_cache.new, site.output)
    v_new = _adapt(graph, (site.v_cache.layout or BHSD).to_bhsd, site.v_cache.new, site.output)
    kwargs = {}
    if site.sinks is not None:   # one logit per query head, [1, H, 1, 1] -> [H]
        with graph.inserting_before(site.output):
            kwargs["sink_logits"] = graph.call_method("reshape", (site.sinks, -1))
        _set_meta(kwargs["sink_logits"], site.sinks)
    with graph.inserting_before(site.output):
        node = graph.call_function(
            torch.ops.kvcompile.attention.default,
            (q, k_new, v_new, mask, positions, site.name,
             float(scale), bool(is_causal), 0, float(site.softcap), tag), kwargs)
        _set_meta(node, site.output)
    node = _adapt(graph, (site.out_layout or BHSD).from_bhsd, node, site.output)
    with graph.inserting_before(site.output):
        out_val = val(site.output)
        result = node
        if out_val is not None and out_val.dtype != site.dtype:
            result = graph.call_method("to", (node, out_val.dtype))
            _set_meta(result, site.output)
    site.output.replace_all_uses_with(result)
    _erase_dead(graph, list(reversed(site.chain)))
    for cache in (site.k_cache, site.v_cache):
        _rewrite_cache(graph, cache, handles)
    site.rewritten = True


def _mask_operand(graph: fx.Graph, site: AttentionSite, mask, mask_kind, q_layout):
    """One of the site's masks as the op takes it: bool (True = attend) or additive, 4-D."""
    if mask is None:
        return None
    src = _bool_mask_source(mask)
    if mask_kind == "binary":   # a 0/1 float mask (find_attention checked its values)
        with graph.inserting_before(site.output):
            src = graph.call_method("to", (mask, torch.bool))
        _set_meta(src, site.output)
    if mask_kind == "bool_inverted":
        with graph.inserting_before(site.output):
            src = graph.call_function(torch.logical_not, (mask,))
        _set_meta(src, site.output)
    if q_layout.flat and ndim(src) == 3 and val(src).shape[0] != 1:
        src = _adapt(graph, q_layout.to_bhsd, src, site.output)   # [B*H, S, L] bias
    return _to_4d(graph, src, site.output)


def _combine_masks(graph: fx.Graph, site: AttentionSite, a, b):
    """Two masks applied one after the other as one: bool & bool, where(bool, additive, -inf),
    additive + additive (a position bias under a mask: MPT's ALiBi, BLOOM's baddbmm bias)."""
    if a is None or b is None:
        return a if b is None else b
    if val(a) is None or val(b) is None:   # never guess: a bool mask added as 0 / 1 is wrong
        raise ValueError("a mask's dtype is unknown, so the site's masks cannot be combined")
    a_bool, b_bool = val(a).dtype == torch.bool, val(b).dtype == torch.bool
    with graph.inserting_before(site.output):
        if a_bool and b_bool:
            out = graph.call_function(torch.logical_and, (a, b))
        elif a_bool or b_bool:
            keep, add = (a, b) if a_bool else (b, a)
            out = graph.call_function(torch.where, (keep, add, float("-inf")))
        else:
            out = graph.call_function(operator.add, (a, b))
    _set_meta(out, site.output)
    if not (a_bool and b_bool):
        site.mask_kind = "additive"
    return out


def _adapt(graph: fx.Graph, how, node, before: fx.Node):
    """`how(graph, node)` (a Layout's to_bhsd / from_bhsd) inserted before `before`."""
    with graph.inserting_before(before):
        out = how(graph, node)
    if out is not node:
        _set_meta(out, before)
    return out


def finish_rewrite(gm: fx.GraphModule, sites: list[AttentionSite],
                   handles: list[tuple[fx.Node, str]], packed_steps: bool = False) -> RewritePlan:
    """Drop what the rewrites left dead, check and recompile the graph, and say which graph
    inputs and outputs are cache handles and stubs. packed_steps: a graph traced in an engine
    step, whose ops get no mask (mask_inputs.drop_masks)."""
    plan = RewritePlan(sites=sites)
    graph = gm.graph
    if packed_steps:
        drop_masks(graph)
    else:
        unexpand_masks(graph)
    _erase_dead(graph, [n for n in graph.nodes if kind(n) in VIEW_KINDS | {
        "repeat_interleave", "cat", "where"}])
    graph.lint()
    gm.recompile()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for h, k, seq in handles:
        if h in placeholders:
            plan.handle_inputs.append(placeholders.index(h))
            plan.handle_kinds.append(k)
            plan.handle_seq_dims.append(seq)
    plan.stub_outputs = _stub_output_indices(gm)
    return plan


_NEEDS_SLICE = object()


def _set_meta(node: fx.Node, like: fx.Node) -> None:
    """graph_utils.set_meta, and where it left no value, the value computed in the fake mode of
    the node's inputs: the tracing context's mode, which set_meta takes, need not be the one
    Dynamo recorded the graph in (seen under torch 2.13: MPT's logical_not(mask) got no value,
    so its ALiBi bias was added to the bool mask as 0/1 instead of under it)."""
    set_meta(node, like)
    if val(node) is not None or node.op not in ("call_function", "call_method"):
        return
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: val(n))
    leaves = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
              if isinstance(a, torch.Tensor)]
    modes = {id(m): m for m in (getattr(a, "fake_mode", None) for a in leaves) if m is not None}
    if len(modes) != 1:
        return
    fn = node.target if node.op == "call_function" else getattr(torch.Tensor, node.target)
    try:
        with next(iter(modes.values())):
            node.meta["example_value"] = fn(*args, **kwargs)
    except Exception:  # noqa: BLE001  (meta is advisory, as in set_meta)
        pass


def _to_4d(graph: fx.Graph, mask, before: fx.Node):
    """A mask broadcasts like SDPA's (trailing dims: [S, L] is [1, 1, S, L], [H, S, L] is
    [1, H, S, L]); the op takes it 4-D, dim 0 the batch: mask[None, ...] as needed."""
    n = ndim(mask)
    if not isinstance(mask, fx.Node) or n is None or n >= 4:
        return mask
    with graph.inserting_before(before):
        out = graph.call_function(operator.getitem, (mask, (None,) * (4 - n)))
    _set_meta(out, mask)
    return out


def _positions(graph: fx.Graph, site: AttentionSite):
    cache = site.k_cache
    if cache.kind in ("cat", "none"):
        return None
    if isinstance(cache.positions, slice):
        return _NEEDS_SLICE
    return cache.positions


def _rewrite_cache(graph: fx.Graph, cache, handles: list) -> None:
    if cache.kind == "cat" and cache.past is None:   # a cache that starts in this graph
        with graph.inserting_after(cache.new):
            stub = graph.call_function(_virtual_cat, (cache.new, cache.new, None))
        _set_meta(stub, cache.new)
        stub.meta[STUB_META] = True
        for u in cache.write_nodes:
            u.replace_input_with(cache.new, stub)
        return
    if cache.kind == "cat":
        cat = _find_cat_of(cache)
        if cat is not None:
            with graph.inserting_before(cat):
                stub = graph.call_function(_virtual_cat, (cache.past, cache.new, cache.seq_dim))
            _set_meta(stub, cat)
            stub.meta[STUB_META] = True
            cat.replace_all_uses_with(stub)
            graph.erase_node(cat)
        if isinstance(cache.past, fx.Node) and cache.past.op == "placeholder":
            handles.append((cache.past, "cat", cache.seq_dim))
    elif cache.kind in ("index_copy", "index_put"):
        for w in cache.write_nodes:
            if w in graph.nodes and not w.users:
                graph.erase_node(w)
        buf = cache.buffer
        if buf.op == "placeholder":
            # "slice": written by slice assignment, the buffer stays real (backend.py)
            handles.append((buf, "slice" if isinstance(cache.positions, slice) else cache.kind,
                            cache.seq_dim))
        elif kind(buf) in ("zeros", "empty"):
            buf.target = _zero_stub
            buf.meta[STUB_META] = True


def _find_cat_of(cache) -> fx.Node | None:
    for u in cache.new.users:
        if kind(u) == "cat" and cache.past in arg(u, 0, "tensors", ()):
            return u
    return None


def _bool_mask_source(mask):
    """HF eager masks are `where(bool_mask, 0, finfo.min)`: pass the bool mask instead."""
    if isinstance(mask, fx.Node) and kind(mask) == "where":
        cond, a, b = arg(mask, 0), arg(mask, 1), arg(mask, 2)
        v = val(cond)
        if v is not None and v.dtype == torch.bool and _is_zero(a) and _is_very_negative(b):
            return cond
    return mask


def _is_zero(x) -> bool:
    if isinstance(x, (int, float)):
        return x == 0
    if isinstance(x, fx.Node) and kind(x) in ("zeros", "tensor"):
        a0 = arg(x, 0)
        return kind(x) == "zeros" or (isinstance(a0, (int, float)) and a0 == 0)
    return False


def _is_very_negative(x) -> bool:
    return isinstance(x, (int, float)) and x <= -1e4


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    alive = set(graph.nodes)
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if n in alive and not n.users and n.op in ("call_function", "call_method") and (
                    "kvcompile" not in str(n.target)):
                if kind(n) in ("index_copy_", "index_put_", "setitem", "copy_"):
                    continue
                graph.erase_node(n)
                alive.discard(n)
                changed = True


def _stub_output_indices(gm: fx.GraphModule) -> list[int]:
    out = []
    for i, o in enumerate(graph_outputs(gm)):
        n = o
        while isinstance(n, fx.Node) and not n.meta.get(STUB_META) and kind(n) in VIEW_KINDS:
            n = arg(n, 0)
        if isinstance(n, fx.Node) and n.meta.get(STUB_META):
            out.append(i)
    return out


