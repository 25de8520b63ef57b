"""Pass 2: find the KV cache that feeds each attention site.

    DynamicCache        keys = torch.cat([past_keys, k_new], dim=-2)     # past: placeholder or
                                                                         # torch.tensor([]) (prefill)
    StaticCache         buf.index_copy_(2, cache_position, k_new); attend over buf
    gpt-fast buffers    buf[:, :, input_pos] = k_new  |  buf.index_put_((.., input_pos), k_new)
    no cache            attend over this forward's own k_new

The cache is only accepted when everything else that reads it is a chain of views ending in the
graph's outputs (the tensors a cache object stores back): those become zero-byte stubs. Any
other reader would see the stubs' zeros, so such a site is left alone. New keys must come from
the same tokens as the queries (cross-attention over encoder states is left alone).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kvcompile.passes.find_latent import LatentExpansion, match_latent
from kvcompile.passes.graph_utils import (
    VIEW_KINDS,
    ancestors_until,
    arg,
    kind,
    ndim,
    shape,
    val,
)
from kvcompile.passes.layouts import BHSD, Layout
from kvcompile.passes.sites import AttentionSite, CacheOp

_WRITE_KINDS = ("index_copy_", "index_put_", "setitem", "index_copy")


def find_caches(gm: fx.GraphModule, sites: list[AttentionSite]) -> None:
    for site in sites:
        if not site.reason:
            find_cache(gm, site)


def find_cache(gm: fx.GraphModule, site: AttentionSite) -> None:
    """Set site.k_cache / v_cache, or leave the site alone with the reason. Changes no code."""
    latent = match_latent(site)
    if isinstance(latent, str):
        site.skip(latent)
        return
    if latent is not None:
        _find_latent_cache(site, latent)
        return
    try:
        site.k_cache = _find_one(site.k, site, "keys", site.k_layout or BHSD)
        site.v_cache = _find_one(site.v, site, "values", site.v_layout or BHSD)
    except _NotACache as e:
        site.skip(str(e))
        return
    if site.k_cache.kind != site.v_cache.kind:
        site.skip(f"keys cached by {site.k_cache.kind}, values by {site.v_cache.kind}")
        return
    if not _same_tokens(site.q, site.k_cache.new):
        site.skip("keys do not come from the query's tokens (cross-attention over other "
                  "states)")
        return
    sq = (site.q_layout or BHSD).canon(shape(site.q))
    sk = site.k_cache.layout.canon(shape(site.k_cache.new))
    if site.k_cache.kind == "none" and sq[2] != sk[2]:
        site.skip("the keys attention reads are computed from the cached tensors by ops "
                  "kvcompile does not follow (e.g. a latent cache expanded by a projection "
                  "after the cache update, as in MLA): kvcompile pages only the K/V that "
                  "attention reads")
        return
    if sq[2] != sk[2] or (sq[0] != sk[0] and -1 not in (sq[0], sk[0])):
        site.skip(f"new keys {sk} do not align with queries {sq} (batch/length)")


def _find_latent_cache(site: AttentionSite, latent: LatentExpansion) -> None:
    """MLA (passes/find_latent.py): the cache ops are those of the latent and the rotary key,
    which the pool stores as one kv head's keys (width r) and values (width dr)."""
    site.latent = latent
    site.chain = site.chain + [n for n in latent.nodes if n not in site.chain]
    try:
        site.k_cache = _find_one(latent.latent, site, "latent", BHSD)
        site.v_cache = _find_one(latent.rope, site, "rotary keys", BHSD, joined_ok=True)
    except _NotACache as e:
        site.skip(f"MLA: {e}")
        return
    if site.k_cache.kind != site.v_cache.kind:
        site.skip(f"MLA: latent cached by {site.k_cache.kind}, rotary keys by "
                  f"{site.v_cache.kind}")
        return
    if not _same_tokens(site.q, site.k_cache.new):
        site.skip("keys do not come from the query's tokens (cross-attention over other "
                  "states)")
        return
    sq = (site.q_layout or BHSD).canon(shape(site.q))
    sk, sr = shape(site.k_cache.new), shape(site.v_cache.new)
    if sq[2] != sk[2] or sk[2] != sr[2] or (sq[0] != sk[0] and -1 not in (sq[0], sk[0])):
        site.skip(f"MLA: new latent {sk} / rotary keys {sr} do not align with queries {sq}")
        return
    site.gqa = "mla"
    site.num_kv_heads, site.head_dim, site.v_head_dim = 1, latent.rank, latent.rope_dim


class _NotACache(Exception):
    pass


_FULL = slice(None, None, None)


def _strip_length_slice(x: fx.Node, seq: int) -> fx.Node:
    """keys[:, :, :kv_len] (HF slices a static buffer to the live length; [:, :kv_len] for a
    [B, S, H, D] buffer): the buffer."""
    if kind(x) == "getitem" and ndim(x) == 4:
        idx = arg(x, 1)
        if (isinstance(idx, tuple) and len(idx) > seq and all(i == _FULL for i in idx[:seq])
                and isinstance(idx[seq], slice) and idx[seq].start in (None, 0)
                and idx[seq].step in (None, 1) and all(i == _FULL for i in idx[seq + 1:])):
            return arg(x, 0)
    return x


def _through_permutes(x: fx.Node, layout: Layout) -> tuple[fx.Node, Layout]:
    """k_cat.transpose(1, 2) / .permute(..) / .contiguous(): the cached tensor and its
    layout ([B, S, H, D] caches attended as [B, H, S, D])."""
    while isinstance(x, fx.Node) and not layout.flat and ndim(x) == 4:
        k = kind(x)
        if k == "contiguous" or _float_cast(x):
            x = arg(x, 0)
        elif k == "transpose" and x.target != "mT":
            d0, d1 = arg(x, 1, "dim0"), arg(x, 2, "dim1")
            if not (isinstance(d0, int) and isinstance(d1, int)):
                break
            perm = list(range(4))
            perm[d0 % 4], perm[d1 % 4] = perm[d1 % 4], perm[d0 % 4]
            x, layout = arg(x, 0), layout.then(tuple(perm))
        elif k == "permute":
            dims = x.args[1:] if len(x.args) > 2 else arg(x, 1, "dims")
            if not (isinstance(dims, (tuple, list)) and len(dims) == 4):
                break
            x, layout = arg(x, 0), layout.then(tuple(d % 4 for d in dims))
        else:
            break
    return x, layout


def _float_cast(x: fx.Node) -> bool:
    """x.float() / x.to(torch.float32): attention computed in another float dtype than the
    cache's (GPT-Neo upcasts its cached keys); the op reads the pages in the query's dtype."""
    if kind(x) != "to" or x.kwargs.keys() - {"dtype"}:
        return False
    rest = list(x.args[1:]) + list(x.kwargs.values())
    return all(isinstance(a, torch.dtype) and a.is_floating_point for a in rest)


def _root(x: fx.Node) -> fx.Node:
    while isinstance(x, fx.Node) and kind(x) in VIEW_KINDS:
        x = arg(x, 0)
    return x


def _find_one(x: fx.Node, site: AttentionSite, what: str, layout: Layout,
              joined_ok: bool = False) -> CacheOp:
    """joined_ok: a cat along the last dim is this forward's tensor (MLA's rotary key, its
    rotated halves joined), not a cache."""
    consumed = x
    x, layout = _through_permutes(x, layout)
    unpermuted, unpermuted_layout = x, layout
    if layout.flat:
        raise _NotACache(f"{what}: a cache kept flattened as [B*H, S, D] (kvcompile reads "
                         f"caches held as [B, H, S, D] or [B, S, H, D])")
    seq = layout.seq_dim
    x = _strip_length_slice(x, seq)
    x, layout = _through_permutes(x, layout)
    seq = layout.seq_dim
    k = kind(x)
    if k == "cat" and joined_ok and arg(x, 1, "dim", 0) in (-1, 3):
        k = "joined"
    if k == "cat":
        tensors = arg(x, 0, "tensors")
        dim = arg(x, 1, "dim", 0)
        n = ndim(x)
        if not (isinstance(tensors, (list, tuple)) and len(tensors) == 2 and n == 4
                and isinstance(dim, int) and dim % 4 == seq):
            raise _NotACache(f"{what}: cat is not cat([past, new]) along the sequence dim "
                             f"({seq}) of 4-D tensors")
        past, new = tensors
        pv = val(past)
        if isinstance(past, fx.Node) and past.op != "placeholder" and not (
                pv is not None and (pv.numel() == 0 or pv.shape[seq] == 0)):
            raise _NotACache(f"{what}: cat onto {past.name}, keys computed in this graph, not "
                             f"a cache passed in (a cache extended twice in one forward: a "
                             f"layer run twice, reading its first pass's keys, or keys appended "
                             f"to the cache, as DeepSeek-V4 appends its compressed KV)")
        _views_to_outputs_only(x, site, what, allowed_extra=_attention_readers(site, x))
        return CacheOp(kind="cat", new=new, past=past, layout=layout, seq_dim=seq)
    # index-written buffers: the attention reads the buffer (or the index_copy_ result)
    buf = x
    if k in ("index_copy_", "index_copy"):
        buf = arg(x, 0)
    writes = [u for u in buf.users if kind(u) in _WRITE_KINDS and arg(u, 0) is buf]
    if writes:
        if len(writes) != 1:
            raise _NotACache(f"{what}: the cache buffer is written {len(writes)} times")
        w = writes[0]
        new, positions = _write_args(w, what, seq)
        readers = _attention_readers(site, buf) | {w}
        if k in ("index_copy_", "index_copy"):
            readers |= _attention_readers(site, x)
        _views_to_outputs_only(buf, site, what, allowed_extra=readers)
        if w is not x and len(w.users) and not all(u in readers for u in w.users):
            raise _NotACache(f"{what}: the result of the cache write is used elsewhere")
        return CacheOp(kind="index_put" if kind(w) in ("setitem", "index_put_") else "index_copy",
                       new=new, buffer=buf, positions=positions, write_nodes=[w],
                       layout=layout, seq_dim=seq)
    if x.op == "placeholder":
        raise _NotACache(f"{what} come from a graph input that nothing in the graph writes "
                         f"(a cache read without an update, e.g. cross-attention keys cached "
                         f"from an earlier step)")
    if k in ("zeros", "empty"):
        raise _NotACache(f"{what}: attention over a buffer that is never written")
    root = _root(x)
    if root.op == "placeholder" or kind(root) in ("zeros", "empty", "tensor"):
        raise _NotACache(f"{what} are read from {root.name}, a tensor this graph neither "
                         f"computes nor writes as a cache")
    # no cache: this forward's own keys, in the layout the attention consumed them; unless
    # the model also keeps them (returns them, or stores them on a module) to grow a cache by
    # cat from the next call on: a cache that starts here, its stored copy a stub
    layout = site_layout(site, what)
    while _float_cast(consumed):   # keys kept as they are, attended upcast (GPT-Neo)
        consumed = arg(consumed, 0)
    kept = _kept_readers(consumed, site)
    if not kept and unpermuted is not consumed and _kept_readers(unpermuted, site):
        # kept in another layout than attention reads them (OpenAI GPT: [B, T, H, D])
        consumed, layout = unpermuted, unpermuted_layout
        kept = _kept_readers(consumed, site)
    if kept:
        seq = layout.seq_dim if not layout.flat else -1
        if seq < 0:
            raise _NotACache(f"{what}: kept for a later call in a flattened [B*H, S, D] layout")
        return CacheOp(kind="cat", new=consumed, layout=layout, seq_dim=seq, write_nodes=kept)
    return CacheOp(kind="none", new=consumed, layout=layout, seq_dim=-1)


def _kept_readers(new: fx.Node, site: AttentionSite) -> list[fx.Node]:
    """The readers of `new`, other than the attention, that only carry it (through views)
    to the graph's outputs; [] when there are none, or when something else reads it too."""
    readers = _attention_readers(site, new)
    others = [u for u in new.users if u not in readers]
    try:
        _views_to_outputs_only(new, site, "keys", allowed_extra=readers)
    except _NotACache:
        return []
    return others


def site_layout(site: AttentionSite, what: str) -> Layout:
    return (site.k_layout if what == "keys" else site.v_layout) or BHSD


def _write_args(w: fx.Node, what: str, seq: int):
    k = kind(w)
    if k in ("index_copy_", "index_copy"):
        dim, index, src = arg(w, 1, "dim"), arg(w, 2, "index"), arg(w, 3, "source")
        if not (isinstance(dim, int) and dim % 4 == seq):
            raise _NotACache(f"{what}: index_copy_ along dim {dim}, not the sequence dim")
        return src, index
    if k == "setitem":
        idx, src = arg(w, 1), arg(w, 2)
    else:  # index_put_(indices, values)
        idx, src = arg(w, 1, "indices"), arg(w, 2, "values")
    if not isinstance(idx, (tuple, list)) or not seq < len(idx) <= 4:
        raise _NotACache(f"{what}: buffer write index {idx!r} is not "
                         f"[{':, ' * seq}positions]")
    before, pos, after = idx[:seq], idx[seq], idx[seq + 1:]
    if k == "setitem" and not all(i == _FULL for i in (*before, *after)):
        raise _NotACache(f"{what}: buffer write does not cover all batch rows and heads")
    if k == "index_put_" and not (all(i is None for i in before) and not after):
        raise _NotACache(f"{what}: index_put_ indices are not ({'None, ' * seq}positions)")
    if isinstance(pos, slice):
        if pos.step not in (None, 1):
            raise _NotACache(f"{what}: strided slice assignment into the cache")
    elif not isinstance(pos, fx.Node):
        raise _NotACache(f"{what}: cache write positions {pos!r} are not a tensor or slice")
    return src, pos


def _attention_readers(site: AttentionSite, node: fx.Node) -> set[fx.Node]:
    """Nodes between the cache tensor and the attention op (GQA repeats, transposes, slices of
    the mask length) that the rewrite removes."""
    chain = set(site.chain)
    readers = set()
    frontier = [node]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in chain:
                readers.add(u)
            elif kind(u) in VIEW_KINDS | {"repeat_interleave"} and _reaches(u, chain):
                readers.add(u)
                frontier.append(u)
    return readers


def _reaches(node: fx.Node, targets: set[fx.Node], depth: int = 6) -> bool:
    if node in targets:
        return True
    if depth == 0:
        return False
    return any(_reaches(u, targets, depth - 1) for u in node.users)


def _views_to_outputs_only(node: fx.Node, site: AttentionSite, what: str,
                           allowed_extra: set[fx.Node]) -> None:
    """Every reader of the cache tensor, apart from `allowed_extra`, must be a view chain that
    ends in the graph output (a cache object storing it back)."""
    frontier = [u for u in node.users if u not in allowed_extra]
    while frontier:
        u = frontier.pop()
        if u.op == "output" or kind(u) == "size":
            continue  # stored back by the cache object, or only its shape is read
        if kind(u) in VIEW_KINDS and u not in allowed_extra:
            frontier.extend(u.users)
            continue
        if u in allowed_extra:
            continue
        raise _NotACache(f"{what}: the cache tensor is also read by {u.name} "
                         f"({u.target if u.op != 'call_method' else '.' + u.target}), "
                         f"which would see a quantized/evicted cache")


def _linear_inputs(node: fx.Node) -> set[fx.Node]:
    """Activation inputs of the projections (linear/addmm/matmul-with-weight) behind `node`."""
    def is_proj(n):
        return kind(n) in ("linear", "addmm") or (n.op == "placeholder")

    found = set()
    for a in ancestors_until(node, is_proj, limit=48):
        k = kind(a)
        if k == "linear":
            found.add(arg(a, 0))
        elif k == "addmm":
            found.add(arg(a, 1))
    return found


def _inputs_two_projections_back(node: fx.Node) -> set[fx.Node]:
    """The projections' inputs behind `node`, and those one projection further back: low-rank
    projections (DeepSeek's MLA: x -> kv_a_proj -> norm -> kv_b_proj) reach the hidden states
    only there."""
    first = _linear_inputs(node)
    out = set(first)
    for n in first:
        if isinstance(n, fx.Node):
            out |= _linear_inputs(n)
    return out


def _same_tokens(q: fx.Node, k_new: fx.Node) -> bool:
    qi, ki = _linear_inputs(q), _linear_inputs(k_new)
    if qi and ki and not (qi & ki) and not _same_source(qi, ki):
        qi, ki = _inputs_two_projections_back(q), _inputs_two_projections_back(k_new)
    if not qi or not ki:
        return True  # no projection in sight (a bare attention function): nothing to compare
    return bool(qi & ki) or _same_source(qi, ki)


def _same_source(qi: set[fx.Node], ki: set[fx.Node]) -> bool:
    # fused-projection models reshape the same activation differently for q and k; tensor-
    # parallel ones (parallelize_module) wrap it in a DTensor once per projection
    def roots(ns):
        out = set()
        for n in ns:
            while kind(n) in VIEW_KINDS or kind(n) == "from_local":
                n = arg(n, 0)
            out.add(n)
        return out
    return bool(roots(qi) & roots(ki))
