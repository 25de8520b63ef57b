"""Pass 1's reading of what happens to the scores between q·kᵀ and the softmax (used by
find_attention.py): masks and position biases in any number and order, and what is not a
mask.

    s = s + m                                   additive mask or bias (ALiBi, relative bias)
    s = where(m, s, -big) | where(m, -big, s)   bool mask (either way round)
    s = s.masked_fill(m, -big)  (also in place, before the softmax reads s)
    s = s * b + -big * (1 - b)                  b a 0/1 buffer (OpenAI GPT)
    p = softmax(s).masked_fill(m, 0)            the same mask again after the softmax (CPM-Ant)

-big is a constant <= -1e4 (-inf, finfo.min). Not a mask: a fill of 0, a product with soft
weights, scores + scores. Attention sinks (cat([s, sinks], -1)) are recognised only to say why
the site is left alone.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from kvcompile.passes.graph_utils import arg, kind, ndim

SINKS = ("attention sinks (a learned logit per head in the softmax's denominator) are not "
         "supported by kvcompile.attention, which has no sink input")


def reads_shape_only(u, n) -> bool:
    """u reads only n's shape or dtype (XLM: mask.expand_as(scores), p.type_as(scores)); it
    keeps n in the graph after the rewrite, as a value nobody reads (or it is dead code)."""
    if kind(u) in ("view", "reshape") and all(kind(w) == "size" for w in u.users):
        return True    # ProphetNet: scores.view(*scores.shape), then only .shape is read
    return u.op == "call_method" and u.target in ("expand_as", "type_as", "view_as",
                                                  "reshape_as") and arg(u, 0) is not n


def in_place_fill(u, chain) -> bool:
    return u in chain and u.op == "call_method" and u.target == "masked_fill_"


def sink_logits(x):
    """The cat node when x is softmax's input cat([scores, sinks], -1), maybe stabilized as
    cat(..) - cat(..).max(-1) (gpt-oss, Flint): None otherwise."""
    if kind(x) not in ("cat", "add") and not (
            x.op == "call_function" and x.target is operator.sub):
        return None
    if kind(x) != "cat":
        x = arg(x, 0)
    if kind(x) != "cat":
        return None
    parts, dim = arg(x, 0, "tensors"), arg(x, 1, "dim", 0)
    if not (isinstance(parts, (list, tuple)) and is_last_dim(x, dim)):
        return None
    return x if any(is_scores(p) for p in parts) else None


def mask_step(x, depth: int = 4):
    """(scores, mask, kind, nodes) when x applies a mask or a bias to scores: s + m
    ("additive"), where(m, s, -big) ("bool"), where(m, -big, s) / s.masked_fill(m, -big)
    ("bool_inverted"), s * m + -big * (1 - m) with m a 0/1 buffer ("binary", GPT-1); else None.
    -big: a constant <= -1e4 (a number, torch.tensor(finfo.min), -inf); nodes: the chain's
    nodes of this step."""
    k = kind(x)
    if k == "add":
        a, b = arg(x, 0), arg(x, 1, "other")
        for kept, rest in ((a, b), (b, a)):
            found = kept_by_product(kept, rest, depth)
            if found is not None:
                return found[0], found[1], "binary", [x, kept]
        sa, sb = is_scores(a, b, depth), is_scores(b, a, depth)
        if sa != sb:   # scores + scores is not a mask
            return (a, b, "additive", [x]) if sa else (b, a, "additive", [x])
    elif k == "where":
        cond, a, b = arg(x, 0), arg(x, 1), arg(x, 2)
        if is_very_negative_const(b) and is_scores(a, cond, depth):
            return a, cond, "bool", [x]
        if is_very_negative_const(a) and is_scores(b, cond, depth):
            return b, cond, "bool_inverted", [x]
    elif k == "masked_fill":
        # nanoGPT: s.masked_fill(bias[..., :T, :T] == 0, float("-inf")): True = masked out
        a, cond, fill = arg(x, 0), arg(x, 1, "mask"), arg(x, 2, "value")
        if is_very_negative_const(fill) and is_scores(a, cond, depth):
            return a, cond, "bool_inverted", [x]
    return None


def masked_in_place(x, reader):
    """(x, mask, "bool_inverted", [fill]) when x.masked_fill_(mask, -big) runs before `reader`
    reads x (XLM masks its scores in place); None otherwise."""
    fills = [u for u in x.users if u.op == "call_method" and u.target == "masked_fill_"
             and arg(u, 0) is x]
    if len(fills) != 1 or not is_very_negative_const(arg(fills[0], 2, "value")):
        return None
    n = fills[0]
    for _ in range(64):   # program order: the fill, then the read
        n = n.next
        if n is reader:
            return x, arg(fills[0], 1, "mask"), "bool_inverted", [fills[0]]
    return None


def kept_by_product(kept, rest, depth: int):
    """(s, m) when kept = s * m and rest = -big * (1 - m) (either order) for one m: the
    masking of OpenAI GPT, w * b + -1e4 * (1 - b), a where(b, w, -big) when b holds only 0 and
    1, which is checked on the buffer b is sliced from (its value at compile time)."""
    if kind(kept) != "mul" or kind(rest) != "mul":
        return None
    for s, m in ((arg(kept, 0), arg(kept, 1)), (arg(kept, 1), arg(kept, 0))):
        if not (isinstance(m, fx.Node) and is_scores(s, m, depth)):
            continue
        for c, one_minus in ((arg(rest, 0), arg(rest, 1)), (arg(rest, 1), arg(rest, 0))):
            if is_very_negative_const(c) and isinstance(one_minus, fx.Node) and (
                    one_minus.op == "call_function" and one_minus.target is operator.sub
                    and constant(arg(one_minus, 0)) == 1
                    and same_value(arg(one_minus, 1), m) and binary_buffer(m)):
                return s, m
    return None


def binary_buffer(m) -> bool:
    """m is a view of a graph input (a module buffer) whose value holds only 0 and 1."""
    while isinstance(m, fx.Node) and kind(m) in ("getitem", "view", "reshape", "expand", "to"):
        m = arg(m, 0)
    if not (isinstance(m, fx.Node) and m.op == "placeholder"):
        return False
    example = getattr(m.meta.get("grapharg"), "example", None)
    if not isinstance(example, torch.Tensor) or isinstance(
            example, torch._subclasses.FakeTensor) or example.numel() > 1 << 24:
        return False
    return bool(((example == 0) | (example == 1)).all())


def zeroes_probs(u, p) -> bool:
    """u is p.masked_fill(mask, 0) / torch.masked_fill(p, mask, 0)."""
    return kind(u) == "masked_fill" and arg(u, 0) is p and constant(arg(u, 2, "value")) == 0 \
        and isinstance(arg(u, 1, "mask"), fx.Node)


def constant(x):
    """A number, or the number a 0-d torch.tensor(v) / scalar_tensor(v) / full((), v) holds."""
    if isinstance(x, fx.Node) and x.op == "call_function" and (
            kind(x) == "tensor" or x.target is torch.scalar_tensor):
        x = arg(x, 0)
    elif isinstance(x, fx.Node) and kind(x) == "full":
        x = arg(x, 1, "fill_value")
    return x if isinstance(x, (int, float, bool)) else None


def same_value(a, b, depth: int = 6) -> bool:
    """a and b are the same node, or the same ops over the same inputs (a mask computed twice
    from one tensor, as CPM-Ant does before and after its softmax)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and a == b
    if depth <= 0 or a.op != b.op or a.target != b.target or a.op not in (
            "call_function", "call_method") or a.kwargs != b.kwargs or len(a.args) != len(
            b.args):
        return False
    return all(same_value(x, y, depth - 1) for x, y in zip(a.args, b.args))


def is_very_negative_const(x) -> bool:
    """A number <= -1e4 (-inf, finfo.min), or a 0-d tensor made of one in the graph:
    torch.full((), v), torch.tensor(v), torch.scalar_tensor(v)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x <= -1e4
    fill = constant(x) if isinstance(x, fx.Node) else None
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= -1e4


def views_scores(x) -> bool:
    """x is a [B, H, T, L] view of 3-D scores from bmm / baddbmm."""
    return kind(x) in ("view", "reshape") and ndim(x) == 4 and ndim(arg(x, 0)) == 3 and (
        kind(arg(x, 0)) in ("matmul", "baddbmm", "einsum"))


def is_scores(scores, mask=None, depth: int = 4) -> bool:
    """`scores` is the [B, H, S, L] (or [B*H, S, L]) q·kᵀ tensor, maybe scaled, cast, viewed,
    soft-capped or already masked (`depth` such steps at most); `mask` (unused) is what would
    be applied to it."""
    if not isinstance(scores, fx.Node) or ndim(scores) not in (3, 4):
        return False
    k = kind(scores)
    if k in ("matmul", "einsum", "baddbmm") or views_scores(scores):
        return True
    if depth <= 0:
        return False
    if k in ("mul", "div", "to", "tanh"):
        return any(is_scores(a, None, depth - 1) for a in scores.args[:2])
    return mask_step(scores, depth - 1) is not None


def is_last_dim(node, dim) -> bool:
    n = ndim(node)
    return dim == -1 or (n is not None and dim == n - 1)
