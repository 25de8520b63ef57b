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

Only an expand is looked through: a mask whose values a later op changes is taken as it is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from kvcompile.passes.graph_utils import ndim, val

_ATTENTION = "kvcompile.attention"
_MASK_ARG = 3   # attention(q, k, v, attn_mask, positions, ...)


def _is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and _ATTENTION in str(node.target)


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


def unexpand_masks(graph: fx.Graph) -> int:
    """Give every attention op its mask before the batch broadcast; how many were changed.
    (The expand nodes left without users are dropped by the rewrite's dead-code pass.)"""
    changed = 0
    for node in list(graph.nodes):
        if not _is_attention(node) or len(node.args) <= _MASK_ARG:
            continue
        mask = node.args[_MASK_ARG]
        src = _source(mask) if isinstance(mask, fx.Node) else None
        if src is None:
            continue
        n = ndim(src)
        new = src
        if n is not None and n < 4:   # the op takes masks 4-d, dim 0 the batch
            with graph.inserting_before(node):
                new = graph.call_function(operator.getitem, (src, (None,) * (4 - n)))
            from kvcompile.passes.rewrite import _set_meta

            _set_meta(new, src)
        args = list(node.args)
        args[_MASK_ARG] = new
        node.args = tuple(args)
        changed += 1
    return changed
