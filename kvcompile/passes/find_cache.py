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

import torch.fx as fx

from kvcompile.passes.graph_utils import (
    VIEW_KINDS,
    ancestors_until,
    arg,
    kind,
    ndim,
    shape,
)
from kvcompile.passes.sites import AttentionSite, CacheOp

_WRITE_KINDS = ("index_copy_", "index_put_", "setitem", "index_copy")


def find_caches(gm: fx.GraphModule, sites: list[AttentionSite]) -> None:
    for site in sites:
        if not site.reason:
            find_cache(gm, site)


def find_cache(gm: fx.GraphModule, site: AttentionSite) -> None:
    """Set site.k_cache / v_cache, or leave the site alone with the reason. Changes no code."""
    try:
        site.k_cache = _find_one(site.k, site, "keys")
        site.v_cache = _find_one(site.v, site, "values")
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
    sq, sk = shape(site.q), shape(site.k_cache.new)
    if sq[2] != sk[2] or sq[0] != sk[0]:
        site.skip(f"new keys {sk} do not align with queries {sq} (batch/length)")


class _NotACache(Exception):
    pass


def _strip_length_slice(x: fx.Node) -> fx.Node:
    """keys[:, :, :kv_len] (HF slices a static buffer to the live length): the buffer."""
    if kind(x) == "getitem" and ndim(x) == 4:
        idx = arg(x, 1)
        full = slice(None, None, None)
        if (isinstance(idx, tuple) and len(idx) >= 3 and idx[0] == full and idx[1] == full
                and isinstance(idx[2], slice) and idx[2].start in (None, 0)
                and idx[2].step in (None, 1) and all(i == full for i in idx[3:])):
            return arg(x, 0)
    return x


def _root(x: fx.Node) -> fx.Node:
    while isinstance(x, fx.Node) and kind(x) in VIEW_KINDS:
        x = arg(x, 0)
    return x


def _find_one(x: fx.Node, site: AttentionSite, what: str) -> CacheOp:
    x = _strip_length_slice(x)
    k = kind(x)
    if k == "cat":
        tensors = arg(x, 0, "tensors")
        dim = arg(x, 1, "dim", 0)
        n = ndim(x)
        if not (isinstance(tensors, (list, tuple)) and len(tensors) == 2 and n == 4
                and isinstance(dim, int) and dim % 4 == 2):
            raise _NotACache(f"{what}: cat is not cat([past, new], dim=-2) over 4-D tensors")
        past, new = tensors
        _views_to_outputs_only(x, site, what, allowed_extra=_attention_readers(site, x))
        return CacheOp(kind="cat", new=new, past=past)
    # index-written buffers: the attention reads the buffer (or the index_copy_ result)
    buf = x
    if k in ("index_copy_", "index_copy"):
        buf = arg(x, 0)
    writes = [u for u in buf.users if kind(u) in _WRITE_KINDS and arg(u, 0) is buf]
    if writes:
        if len(writes) != 1:
            raise _NotACache(f"{what}: the cache buffer is written {len(writes)} times")
        w = writes[0]
        new, positions = _write_args(w, what)
        readers = _attention_readers(site, buf) | {w}
        if k in ("index_copy_", "index_copy"):
            readers |= _attention_readers(site, x)
        _views_to_outputs_only(buf, site, what, allowed_extra=readers)
        if w is not x and len(w.users) and not all(u in readers for u in w.users):
            raise _NotACache(f"{what}: the result of the cache write is used elsewhere")
        return CacheOp(kind="index_put" if kind(w) in ("setitem", "index_put_") else "index_copy",
                       new=new, buffer=buf, positions=positions, write_nodes=[w])
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
    return CacheOp(kind="none", new=x)


def _write_args(w: fx.Node, what: str):
    k = kind(w)
    if k in ("index_copy_", "index_copy"):
        dim, index, src = arg(w, 1, "dim"), arg(w, 2, "index"), arg(w, 3, "source")
        if not (isinstance(dim, int) and dim % 4 == 2):
            raise _NotACache(f"{what}: index_copy_ along dim {dim}, not the sequence dim")
        return src, index
    if k == "setitem":
        idx, src = arg(w, 1), arg(w, 2)
    else:  # index_put_(indices, values)
        idx, src = arg(w, 1, "indices"), arg(w, 2, "values")
    if not isinstance(idx, (tuple, list)) or len(idx) != 3:
        raise _NotACache(f"{what}: buffer write index {idx!r} is not [:, :, positions]")
    a, b, pos = idx
    full = slice(None, None, None)
    if k == "setitem" and not (a == full and b == full):
        raise _NotACache(f"{what}: buffer write does not cover all batch rows and heads")
    if k == "index_put_" and not (a is None and b is None):
        raise _NotACache(f"{what}: index_put_ indices are not (None, None, positions)")
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


def _same_tokens(q: fx.Node, k_new: fx.Node) -> bool:
    qi, ki = _linear_inputs(q), _linear_inputs(k_new)
    if not qi or not ki:
        return True  # no projection in sight (a bare attention function): nothing to compare
    return bool(qi & ki) or _same_source(qi, ki)


def _same_source(qi: set[fx.Node], ki: set[fx.Node]) -> bool:
    # fused-projection models reshape the same activation differently for q and k
    def roots(ns):
        out = set()
        for n in ns:
            while kind(n) in VIEW_KINDS:
                n = arg(n, 0)
            out.add(n)
        return out
    return bool(roots(qi) & roots(ki))
