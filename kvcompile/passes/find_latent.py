"""Part of pass 2: multi-head latent attention (MLA, DeepSeek-V2/V3 and their kin).

The model caches a latent per token, one "head" shared by every query head: the compressed
KV `c` [B, 1, L, r] and the rotary key `k_rope` [B, 1, L, dr]. After the cache update it
expands the whole cached latent through `kv_b_proj` and attends over the expansion
(transformers 5.x `expand_kv`):

    c = cat([past_c, c_new], -2)                 # cache.update(c_new, k_rope_new): keys
    k_rope = cat([past_rope, k_rope_new], -2)    #                                 : values
    kv = linear(c, W).view(B, L, H, dn + dv).transpose(1, 2)      # W: [H * (dn + dv), r]
    k_nope, v = split(kv, [dn, dv], -1)
    k = new_empty(B, H, L, dn + dr); k[..., :dn].copy_(k_nope); k[..., dn:].copy_(
        k_rope.expand(-1, H, -1, -1))            # or cat((k_nope, k_rope.expand(..)), -1)
    out = attention(q, k, v)                     # q = cat((q_nope, q_rope), -1)

`match_latent` finds that expansion behind a site's keys and values; the cache ops are then
the ones on `c` and `k_rope` (find_cache.py), and the pool stores exactly them: a layer of
one kv head whose "keys" are the latent (width r) and whose "values" are the rotary key
(width dr), so a token costs (r + dr) elements per layer. The rewrite
(passes/rewrite_latent.py) inserts `kvcompile.latent_attention`, which attends in the latent
space (runtime/attention_op.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from kvcompile.passes.graph_utils import arg, kind, shape, single_user
from kvcompile.passes.sites import AttentionSite


@dataclass
class LatentExpansion:
    """What an MLA site reads and how it expands it. Shapes: latent [B, 1, L, r], rope
    [B, 1, L, dr], weight [H * (nope_dim + v_dim), r] (kv_b_proj's)."""

    latent: fx.Node          # the cached latent as kv_b_proj reads it
    rope: fx.Node            # the cached rotary key as the keys' expand reads it
    weight: fx.Node
    heads: int
    rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    nodes: list[fx.Node] = field(default_factory=list)    # the expansion, removed by the rewrite
    copies: list[fx.Node] = field(default_factory=list)   # in-place copies that build the keys


def match_latent(site: AttentionSite) -> LatentExpansion | str | None:
    """The site's latent expansion; a reason (str) when the keys are built like MLA's but
    something kvcompile cannot rewrite was found; None when they are not MLA's."""
    parts = _key_parts(site.k)
    if parts is None:
        return None
    k_nope, k_rope_b, assembly, copies = parts
    split = arg(k_nope, 0) if kind(k_nope) == "getitem" and arg(k_nope, 1) == 0 else None
    if split is None or kind(split) != "split":
        return None
    expanded = arg(split, 0)
    proj = _projection(expanded)
    if proj is None:
        return None
    lin, views = proj
    # MLA's shape: the values are the other part of the keys' projection, and the keys' second
    # part one head broadcast to all (any other model that splits a projection is not MLA)
    if not (kind(site.v) == "getitem" and arg(site.v, 0) is split and arg(site.v, 1) == 1):
        return None
    if kind(k_rope_b) != "expand":
        return None
    if site.n_rep != 1:
        return (f"MLA: the expanded keys and values are repeated {site.n_rep}x for GQA "
                f"(num_key_value_heads != num_attention_heads); kvcompile rewrites MLA with "
                f"one expanded head per query head")
    if arg(lin, 2, "bias") is not None:
        return "MLA: kv_b_proj has a bias (kvcompile absorbs only a bias-free projection)"
    sizes = arg(split, 1, "split_size_or_sections")
    dim = arg(split, 2, "dim", 0)
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2
            and all(isinstance(s, int) for s in sizes) and dim in (-1, 3)):
        return f"MLA: the expansion is split by {sizes!r} along dim {dim}, not [nope, v] on -1"
    dn, dv = sizes
    rope = arg(k_rope_b, 0)
    latent, weight = arg(lin, 0), arg(lin, 1, "weight")
    s_lat, s_rope, s_w, s_q = shape(latent), shape(rope), shape(weight), shape(site.q)
    if None in (s_lat, s_rope, s_w, s_q) or len(s_lat) != 4 or len(s_rope) != 4:
        return "MLA: the latent's or the rotary key's shape is unknown or not 4-D"
    if s_lat[1] != 1 or s_rope[1] != 1:
        return (f"MLA: the latent {s_lat} / rotary key {s_rope} are not one head "
                f"[B, 1, L, D]")
    r, dr = s_lat[3], s_rope[3]
    heads = site.num_q_heads
    if not all(isinstance(x, int) for x in (r, dr, heads, s_w[0], s_w[1], s_q[-1])):
        return "MLA: head count or widths are not static"
    if s_w != (heads * (dn + dv), r):
        return (f"MLA: kv_b_proj's weight is {tuple(s_w)}, not [{heads} heads x ({dn} + "
                f"{dv}), {r}]")
    if s_q[-1] != dn + dr:
        return f"MLA: the query's width {s_q[-1]} is not nope {dn} + rope {dr}"
    nodes = [lin, *views, expanded, split, k_nope, site.v, k_rope_b, site.k, *assembly, *copies]
    return LatentExpansion(latent=latent, rope=rope, weight=weight, heads=heads, rank=r,
                           nope_dim=dn, rope_dim=dr, v_dim=dv, nodes=nodes, copies=copies)


def _key_parts(k: fx.Node):
    """(nope part, rope part, assembly nodes, copies) of keys built from two pieces along the
    last dim, or None: cat((a, b), -1), or new_empty then [..., :n].copy_(a),
    [..., n:].copy_(b)."""
    if not isinstance(k, fx.Node):
        return None
    if kind(k) == "cat":
        tensors, dim = arg(k, 0, "tensors"), arg(k, 1, "dim", 0)
        if isinstance(tensors, (list, tuple)) and len(tensors) == 2 and dim in (-1, 3):
            return tensors[0], tensors[1], [], []
        return None
    if kind(k) != "new_empty":
        return None
    pieces: dict[str, tuple[fx.Node, fx.Node]] = {}
    for u in k.users:
        if kind(u) != "getitem" or arg(u, 0) is not k:
            continue
        side = _last_dim_half(arg(u, 1))
        c = single_user(u)
        if side is None or c is None or kind(c) != "copy_" or arg(c, 0) is not u:
            return None
        if side in pieces:
            return None
        pieces[side] = (u, c)
    if set(pieces) != {"head", "tail"}:
        return None
    (hs, hc), (ts, tc) = pieces["head"], pieces["tail"]
    return arg(hc, 1), arg(tc, 1), [hs, ts], [hc, tc]


def _last_dim_half(idx) -> str | None:
    """'head' for [..., :n], 'tail' for [..., n:], else None."""
    if not (isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis
            and isinstance(idx[1], slice) and idx[1].step in (None, 1)):
        return None
    sl = idx[1]
    if sl.start in (None, 0) and isinstance(sl.stop, int):
        return "head"
    if isinstance(sl.start, int) and sl.start > 0 and sl.stop is None:
        return "tail"
    return None


def _projection(x: fx.Node):
    """(linear node, the views between it and x) when x is linear(..).view(B, L, H, D)
    .transpose(1, 2), else None."""
    views = []
    if kind(x) != "transpose" or {arg(x, 1), arg(x, 2)} not in ({1, 2}, {-3, -2}):
        return None
    y = arg(x, 0)
    if kind(y) not in ("view", "reshape"):
        return None
    views.append(y)
    lin = arg(y, 0)
    if kind(lin) != "linear":
        return None
    return lin, views
