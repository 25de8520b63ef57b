"""Part of pass 3: an MLA site (passes/find_latent.py) onto the pool's latent pages.

Before (DynamicCache; the keys' assembly by new_empty + copy_ or by cat):

    c = torch.cat([past_c, c_new], dim=-2)              # [B, 1, L, r], stored back
    k_rope = torch.cat([past_rope, rope_new], dim=-2)   # [B, 1, L, dr], stored back
    kv = linear(c, W).view(B, L, H, dn + dv).transpose(1, 2)
    k_nope, v = split(kv, [dn, dv], -1)
    k = cat((k_nope, k_rope.expand(-1, H, -1, -1)), -1)
    out = sdpa(q, k, v, attn_mask=m, scale=s)

After:

    out = torch.ops.kvcompile.latent_attention(q, c_new, rope_new, m, None,
                                               "model.layers.0.self_attn", s, False, 0, 0.0,
                                               tag, kv_b_weight=W, nope_dim=dn)
    c = _virtual_cat(past_c, c_new)                     # zero-byte stubs of cat's shape
    k_rope = _virtual_cat(past_rope, rope_new)

The op stores c_new and rope_new (the pool layer's keys and values), and attends in the latent
space: no key or value is expanded for the cached tokens (runtime/attention_op.py).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from kvcompile.passes import rewrite as _rw
from kvcompile.passes.graph_utils import val
from kvcompile.passes.layouts import BHSD
from kvcompile.passes.sites import AttentionSite


def rewrite_latent_site(gm: fx.GraphModule, site: AttentionSite, tag: str,
                        handles: list) -> None:
    """Replace one MLA site's expansion, attention and cache ops by
    `kvcompile.latent_attention`; appends the cache inputs it binds to `handles`."""
    graph, lat = gm.graph, site.latent
    q_layout = site.q_layout or BHSD
    mask = _rw._mask_operand(graph, site, site.mask, site.mask_kind, q_layout)
    for m, k in site.more_masks:
        mask = _rw._combine_masks(graph, site, mask,
                                  _rw._mask_operand(graph, site, m, k, q_layout))
    positions = _rw._positions(graph, site)
    # SDPA's default scale is over the query's width (nope + rope), not the latent's
    scale = site.scale if site.scale is not None else 1.0 / math.sqrt(lat.nope_dim
                                                                      + lat.rope_dim)
    with graph.inserting_before(site.output):
        if positions is _rw._NEEDS_SLICE:
            sl = site.k_cache.positions
            positions = graph.call_function(_rw._slice_positions,
                                            (sl.start, sl.stop, site.k_cache.new))
            _rw._set_meta(positions, site.output)
    q = _rw._adapt(graph, q_layout.to_bhsd, site.q, site.output)
    with graph.inserting_before(site.output):
        node = graph.call_function(
            torch.ops.kvcompile.latent_attention.default,
            (q, site.k_cache.new, site.v_cache.new, mask, positions, site.name, float(scale),
             bool(site.is_causal), 0, float(site.softcap), tag),
            {"kv_b_weight": lat.weight, "nope_dim": lat.nope_dim})
        _rw._set_meta(node, site.output)
    node = _rw._adapt(graph, (site.out_layout or BHSD).from_bhsd, node, site.output)
    with graph.inserting_before(site.output):
        out_val = val(site.output)
        result = node
        if out_val is not None and out_val.dtype != site.dtype:
            result = graph.call_method("to", (node, out_val.dtype))
            _rw._set_meta(result, site.output)
    site.output.replace_all_uses_with(result)
    _rw._erase_dead(graph, list(reversed(site.chain)))
    for c in lat.copies:     # in-place writes into the dead keys buffer (_erase_dead keeps them)
        if c in graph.nodes and not c.users:
            graph.erase_node(c)
    _rw._erase_dead(graph, list(reversed(site.chain)))
    for cache in (site.k_cache, site.v_cache):
        _rw._rewrite_cache(graph, cache, handles)
    site.rewritten = True
