"""The attention op's mask input at its own size, not broadcast to the batch.

Hugging Face builds the 4-d mask of a forward as `mask.expand(B, -1, S, L)` of a smaller tensor:
[1, 1, S, L] when no row is padded (causality only), [B, 1, S, L] with padding. Every attention
op of the graph takes that mask. An op in inductor's graph gets its inputs as buffers, so an
expanded view is materialized, at B x S x L bytes, once per op that reads it: on the H200, at
B16 and a 16,384-token prefill chunk over 32,768 keys, six 8 GiB copies were alive at once (48
of the chunk's 77 GiB; `bench_prefill_memory.py --trace`, 2026-12-03).

The op reads masks by broadcasting (`kernels/masks.py` views any [B|1, H|1, S|1, L] mask as
[B, H, S, L] without copying; the dense paths let SDPA broadcast), so the rewrite hands it the
tensor before the expand. Before:

    mask = causal.expand(16, -1, 16384, 32768)           # [16, 1, 16384, 32768] (a view)
    out = torch.ops.kvcompile.attention(q, k, v, mask, ...)
After:
    out = torch.ops.kvcompile.attention(q, k, v, causal[None...], ...)   # [1, 1, 16384, 32768]

Looked through: expands, slices that keep the shape (older transformers cut the mask to the
keys' length, `mask[:, :, :, :L]`, also when it has that length: inductor copies such a view
for each op too), and basic slicing of an expand: the slice moves onto the smaller tensor, a
broadcast dim left whole. A mask whose values a later op changes is taken as it is.

Split: transformers (5.17 always, later versions with padding) computes the mask as an AND of
index comparisons: `(kv_idx <= q_idx)` [1, 1, S, L] & `attention_mask[b, kv_idx]` [B, 1, 1, L].
The AND is [B, 1, S, L] however it is spelled (8 GiB at B16 x 16k x 32k). When every leaf of
the mask's AND tree is either shared by the batch ([1, H|1, S|1, L]) or a per-row key mask
([B, 1, 1, L]), the op gets the two ANDs of each kind (`attn_mask` and `key_mask`), and nothing
[B, S, L] is built: kernels/masks.py reads the pair block by block. A leaf of any other shape
(per-row and per-query, as packed documents are) keeps the mask whole.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from kvcompile.passes.graph_utils import ndim, set_meta, val

# the ops whose args 3 and 11 are the mask and the key mask (runtime/attention_op.py)
_ATTENTIONS = ("kvcompile.attention.", "kvcompile.latent_attention.")
_MASK_ARG = 3   # attention(q, k, v, attn_mask, positions, ...)
_KEY_MASK_ARG = 11   # ..., tag, key_mask)

_AND_FUNCTIONS = (operator.and_, operator.iand, torch.bitwise_and, torch.logical_and,
                  torch.ops.aten.bitwise_and.Tensor, torch.ops.aten.logical_and.default)
_AND_METHODS = ("__and__", "__iand__", "bitwise_and", "logical_and", "bitwise_and_",
                "logical_and_")


def _is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and any(a in str(node.target) for a in _ATTENTIONS)


def _is_expand(node) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method" and node.target == "expand":
        return True
    return node.op == "call_function" and node.target in (
        torch.Tensor.expand, torch.ops.aten.expand.default)


def _source(mask: fx.Node) -> fx.Node | None:
    """The tensor `mask` is an expand of (through expands only), if it broadcasts to the
    mask's shape from the right; else None."""
    src = mask
    while _is_expand(src) and isinstance(src.args[0], fx.Node):
        src = src.args[0]
    if src is mask:
        return None
    small, big = val(src), val(mask)
    if small is None or big is None or small.dim() > big.dim():
        return None
    try:
        torch.broadcast_shapes(tuple(small.shape), tuple(big.shape))
    except RuntimeError:
        return None
    return src


def _sliced_expand(mask: fx.Node):
    """(source, index) when `mask` is `expand(...)[slices]` with basic slices only: the same
    view is `source[index]` broadcast, index keeping the source's size-1 dims whole."""
    if not (mask.op == "call_function" and mask.target is operator.getitem
            and isinstance(mask.args[0], fx.Node)):
        return None
    idx = mask.args[1] if isinstance(mask.args[1], tuple) else (mask.args[1],)
    if not all(isinstance(i, slice) or i is Ellipsis for i in idx) or idx.count(Ellipsis) > 1:
        return None
    big = val(mask.args[0])
    src = _source(mask.args[0])
    if src is None or big is None or val(src) is None:
        return None
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        idx = idx[:at] + (slice(None),) * (big.dim() - len(idx) + 1) + idx[at + 1:]
    idx = idx + (slice(None),) * (big.dim() - len(idx))
    small = val(src)
    lead = big.dim() - small.dim()
    if any(i != slice(None) for i in idx[:lead]):
        return None
    out = []
    for d, sl in enumerate(idx[lead:]):
        broadcast = small.shape[d] == 1 and big.shape[lead + d] != 1
        out.append(slice(None) if broadcast else sl)
    return src, tuple(out)


def _noop_slice(node: fx.Node) -> fx.Node | None:
    """x when node is x[slices] with basic slices that keep x's shape (transformers' cut of
    the mask to the keys' length when it already has that length), else None."""
    if not (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)):
        return None
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not all(isinstance(i, slice) or i is Ellipsis for i in idx):
        return None
    a, b = val(node.args[0]), val(node)
    if a is None or b is None or tuple(a.shape) != tuple(b.shape):
        return None
    return node.args[0]


def _is_and(node) -> bool:
    if not isinstance(node, fx.Node) or len(node.args) != 2 or node.kwargs:
        return False
    if node.op == "call_method":
        return node.target in _AND_METHODS
    return node.op == "call_function" and node.target in _AND_FUNCTIONS


def _and_leaves(node: fx.Node, out: list) -> bool:
    """Collect the leaves of `node`'s AND tree into out; False when a leaf is not a bool
    tensor node (a Python bool, an int mask)."""
    if _is_and(node):
        return all(_and_leaves(a, out) for a in node.args)
    v = val(node)
    if v is None or v.dtype != torch.bool:
        return False
    out.append(node)
    return True


def _is_one(n) -> bool:
    return isinstance(n, int) and n == 1


def _split(mask: fx.Node):
    """(shared leaves, key leaves) when mask is an AND of batch-shared and per-row key masks
    (see the module docstring), else None."""
    big = val(mask)
    if big is None or big.dim() != 4 or big.dtype != torch.bool or _is_one(big.shape[0]):
        return None
    leaves: list = []
    if not _is_and(mask) or not _and_leaves(mask, leaves):
        return None
    shared, keys = [], []
    for leaf in leaves:
        shp = (1,) * (4 - val(leaf).dim()) + tuple(val(leaf).shape)
        if len(shp) != 4:
            return None
        if _is_one(shp[0]):
            shared.append((leaf, shp))
        elif _is_one(shp[1]) and _is_one(shp[2]):
            keys.append((leaf, shp))
        else:
            return None    # per-row and per-query: keep the mask whole
    if not keys or not any(not _is_one(shp[2]) for _, shp in shared):
        return None        # the AND is already O(B x L) or O(S x L): nothing to gain
    return [n for n, _ in shared], [n for n, _ in keys]


def _and_chain(graph: fx.Graph, leaves: list, before: fx.Node, built: dict) -> fx.Node:
    """The AND of leaves, 4-d; one node per set of leaves for the whole graph (every layer
    reads the same mask: one buffer, not one per op)."""
    key = tuple(leaves)
    if key in built:
        return built[key]
    out = leaves[0]
    for leaf in leaves[1:]:
        with graph.inserting_before(before):
            node = graph.call_function(operator.and_, (out, leaf))
        set_meta(node, leaf)
        out = node
    n = ndim(out)
    if n is not None and n < 4:   # the op takes masks 4-d, dim 0 the batch
        with graph.inserting_before(before):
            node = graph.call_function(operator.getitem, (out, (None,) * (4 - n)))
        set_meta(node, out)
        out = node
    built[key] = out
    return out


def split_masks(graph: fx.Graph) -> int:
    """Give every attention op whose mask is such an AND its two parts; how many were split.
    (The expand and AND nodes left without users are dropped.)"""
    changed, built = 0, {}
    for node in list(graph.nodes):
        if not _is_attention(node) or len(node.args) <= _MASK_ARG or len(node.args) > 11:
            continue
        mask = node.args[_MASK_ARG]
        if not isinstance(mask, fx.Node):
            continue
        inner = mask
        while _is_expand(inner) and isinstance(inner.args[0], fx.Node):
            inner = inner.args[0]
        found = _split(inner)
        if found is None:
            continue
        shared, keys = found
        args = list(node.args) + [None] * (_KEY_MASK_ARG + 1 - len(node.args))
        args[_MASK_ARG] = _and_chain(graph, shared, node, built)
        args[_KEY_MASK_ARG] = _and_chain(graph, keys, node, built)
        node.args = tuple(args)
        changed += 1
        _drop_pure(graph, mask)
    return changed


def drop_masks(graph: fx.Graph) -> int:
    """Give every attention op no mask (nor key mask), and erase what computed them and is
    left without users; how many ops had one. For a graph traced inside an engine step:
    the engine packs its sequences as one row and its plan says where each begins, so the
    kernels attend causally within each sequence and read no mask (runtime/dispatch.py), but
    the model still builds one for the row, [1, 1, T, T] over all the step's tokens: 4 GiB at
    16 prompts of 4,096 tokens, and 11 ms on an H100 (profile_engine.py --prefill, the
    twenty-seventh session)."""
    changed = 0
    for node in list(graph.nodes):
        if not _is_attention(node):
            continue
        args = list(node.args)
        gone = [args[i] for i in (_MASK_ARG, _KEY_MASK_ARG)
                if len(args) > i and isinstance(args[i], fx.Node)]
        if not gone:
            continue
        for i in (_MASK_ARG, _KEY_MASK_ARG):
            if len(args) > i:
                args[i] = None
        node.args = tuple(args)
        changed += 1
        for g in gone:
            _drop_pure(graph, g)
    return changed


def _drop_pure(graph: fx.Graph, node: fx.Node) -> None:
    """Erase node and its inputs, recursively, where they are left without users and pure
    (no placeholder, nothing that writes)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if (not isinstance(n, fx.Node) or n.users or n.op not in ("call_function", "call_method")
                or n.is_impure() or _writes(n)):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        todo.extend(inputs)


_OPERATOR_WRITES = {getattr(operator, n) for n in (
    "iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imod", "imul", "imatmul", "ior", "ipow",
    "irshift", "isub", "itruediv", "ixor", "setitem", "delitem")}


def _writes(node: fx.Node) -> bool:
    """An op that writes its input (fx's is_impure misses an in-place method's): an aten op
    whose schema mutates, a torch function or method named `x_`, operator's in-place
    functions (operator.and_ is not one)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable
    if t in _OPERATOR_WRITES:
        return True
    if getattr(t, "__module__", None) in ("_operator", "operator"):
        return False
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    return name.endswith("_") and not name.endswith("__") or name in ("__setitem__",
                                                                     "__iand__", "__ior__")


def unexpand_masks(graph: fx.Graph) -> int:
    """Give every attention op its mask before the batch broadcast, split in two parts where
    it is an AND of shared and per-row parts; how many were changed. (The expand nodes left
    without users are dropped by the rewrite's dead-code pass.)"""
    changed = split_masks(graph)
    for node in list(graph.nodes):
        if not _is_attention(node) or len(node.args) <= _MASK_ARG:
            continue
        mask = orig = node.args[_MASK_ARG]
        if not isinstance(mask, fx.Node):
            continue
        while (inner := _noop_slice(mask)) is not None:
            mask = inner
        src, new = _source(mask), None
        if src is None:
            found = _sliced_expand(mask)
            if found is None and mask is orig:
                continue
            if found is None:
                found = (mask, ())
            src, index = found
            if any(sl != slice(None) for sl in index):
                with graph.inserting_before(node):
                    new = graph.call_function(operator.getitem, (src, index))
                set_meta(new, src)
        new = src if new is None else new
        n = ndim(new)
        src = new
        if n is not None and n < 4:   # the op takes masks 4-d, dim 0 the batch
            with graph.inserting_before(node):
                new = graph.call_function(operator.getitem, (src, (None,) * (4 - n)))
            set_meta(new, src)
        args = list(node.args)
        args[_MASK_ARG] = new
        node.args = tuple(args)
        changed += 1
    return changed
