"""Pass 1's reading of what happens to the scores between q·kᵀ and the softmax (used by
find_attention.py): masks and position biases in any number and order, and what is not a
mask.

    s = s + m                                   additive mask or bias (ALiBi, relative bias)
    s = where(m, s, -big) | where(m, -big, s)   bool mask (either way round)
    s = s.masked_fill(m, -big)  (also in place, before the softmax reads s)
    s = s * b + -big * (1 - b)                  b a 0/1 buffer (OpenAI GPT)
    p = softmax(s).masked_fill(m, 0)            the same mask again after the softmax (CPM-Ant)

-big is a constant <= -1e4 (-inf, finfo.min). Not a mask: a fill of 0, a product with soft
weights, scores + scores.

Also read here, as steps of the chain that change nothing or become the op's sink input:

    s = s - s.max(-1, keepdim=True).values         softmax's own stabilization (gpt-oss, MiMo)
    p = softmax(cat([s, sink.reshape(1, H, 1, 1).expand(B, H, S, 1)], -1))[..., :-1]
                                                   attention sinks (gpt-oss, Flint, HY-V4)
    out = (p @ v) * sigmoid(logsumexp(s, -1) - sink.view(1, H, 1)).unsqueeze(-1)
                                                   the same sinks as a scale (Granite-SWA)

A sink is one learned logit per query head: a sink that varies with the batch row or the
query, or a column that is not the one dropped, is a near miss with its reason.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from kvcompile.passes.graph_utils import arg, kind, ndim, shape

SINK_NOT_PER_HEAD = ("the attention sink column is not one learned logit per query head (a "
                     "[1, H, 1, 1] tensor expanded): kvcompile.attention takes sink logits [H]")
SINK_NOT_DROPPED = ("the softmax's sink column is not the one dropped after it (probs[..., :-1] "
                    "with the sink last): not attention sinks as kvcompile.attention takes "
                    "them")


def reads_shape_only(u, n) -> bool:
    """u reads only n's shape or dtype (XLM: mask.expand_as(scores), p.type_as(scores)); it
    keeps n in the graph after the rewrite, as a value nobody reads (or it is dead code)."""
    if kind(u) in ("view", "reshape") and all(kind(w) == "size" for w in u.users):
        return True    # ProphetNet: scores.view(*scores.shape), then only .shape is read
    return u.op == "call_method" and u.target in ("expand_as", "type_as", "view_as",
                                                  "reshape_as") and arg(u, 0) is not n


def in_place_fill(u, chain) -> bool:
    return u in chain and u.op == "call_method" and u.target == "masked_fill_"


def stabilized(x):
    """(a, [x, values, max]) when x = a - a.max(-1, keepdim=True).values (or a.amax(-1,
    keepdim=True)): softmax's input shifted by its row maximum, which the softmax does itself,
    so the step changes nothing. None otherwise."""
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is operator.sub):
        return None
    a, m = arg(x, 0), arg(x, 1)
    nodes = [x]
    if isinstance(m, fx.Node) and kind(m) == "getitem" and arg(m, 1) == 0:
        nodes.append(m)
        m = arg(m, 0)
    if not isinstance(m, fx.Node) or arg(m, 0) is not a or len(nodes) == 1 and kind(m) == "max":
        return None
    name = m.target if m.op == "call_method" else getattr(m.target, "__name__", "")
    dim = arg(m, 1, "dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if name not in ("max", "amax") or not is_last_dim(a, dim) or not arg(
            m, 2, "keepdim", False) or len(m.users) != 1:
        return None
    return a, nodes + [m]


def sink_column(x):
    """(scores, sink) when x = cat([scores, col], -1) and col is one logit per query head,
    col = sink.expand(B, H, S, 1) with sink [1, H, 1, 1] (through casts); the reason as a str
    when x is such a cat but col is not that; None when x is no cat of the scores."""
    if kind(x) != "cat":
        return None
    parts, dim = arg(x, 0, "tensors"), arg(x, 1, "dim", 0)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and is_last_dim(x, dim)):
        return None
    scores, col = parts
    if not is_scores(scores):
        return SINK_NOT_DROPPED if is_scores(col) else None
    sink = col
    while isinstance(sink, fx.Node) and kind(sink) in ("expand", "to", "contiguous"):
        sink = arg(sink, 0)
    s_col, s_sink = shape(col), shape(sink)
    if s_col is None or s_sink is None or len(s_col) != 4 or s_col[3] != 1:
        return SINK_NOT_PER_HEAD
    if tuple(s_sink) != (1, s_col[1], 1, 1):
        return SINK_NOT_PER_HEAD
    return scores, sink


def drops_sink_column(u, probs) -> bool:
    """u = probs[..., :-1]: the softmax's last column (the sink's) dropped."""
    if kind(u) != "getitem" or arg(u, 0) is not probs:
        return False
    idx = arg(u, 1)
    idx = idx if isinstance(idx, tuple) else (idx,)
    last = idx[-1] if idx else None
    lead_ok = all(i is Ellipsis or i == slice(None) for i in idx[:-1]) and (
        Ellipsis in idx[:-1] or len(idx) == ndim(probs))
    return lead_ok and isinstance(last, slice) and last.start in (None, 0) and (
        last.stop == -1) and last.step in (None, 1)


def logsumexp_sink(scores, out):
    """(sink [1, H, 1], nodes, final) when the p·v output `out` is scaled by
    sigmoid(logsumexp(scores, -1) - sink).unsqueeze(-1) (casts allowed): attention sinks
    written as a scale of the output (Granite-SWA), `final` the scaled output; None when
    scores feed no logsumexp; the reason as a str when they do, in another way."""
    lses = [u for u in scores.users if "logsumexp" in str(u.target)]
    if not lses:
        return None
    why = ("the scores' logsumexp is used other than as sigmoid(logsumexp(s) - sink) "
           "scaling the attention output (attention sinks as Granite-SWA writes them)")
    lse = lses[0]
    if len(lses) != 1 or not is_last_dim(scores, arg(lse, 1, "dim")) or arg(
            lse, 2, "keepdim", False) or len(lse.users) != 1:
        return why
    sub = next(iter(lse.users))
    if not (sub.op == "call_function" and sub.target is operator.sub and arg(sub, 0) is lse):
        return why
    sink, s_lse = arg(sub, 1), shape(lse)
    if shape(sink) is None or s_lse is None or tuple(shape(sink)) != (1, s_lse[1], 1):
        return SINK_NOT_PER_HEAD
    nodes, n = [lse, sub], sub
    while True:
        if len(n.users) != 1:
            return why
        u = next(iter(n.users))
        name = u.target if u.op == "call_method" else getattr(u.target, "__name__", "")
        if kind(u) == "to" or name == "sigmoid" or (kind(u) == "unsqueeze" and arg(u, 1) in (
                -1, 3)):
            nodes.append(u)
            n = u
            continue
        break
    names = [m.target if m.op == "call_method" else getattr(m.target, "__name__", "")
             for m in nodes]
    if names.count("sigmoid") != 1 or not any(kind(m) == "unsqueeze" for m in nodes) or (
            kind(u) != "mul" or out not in (arg(u, 0), arg(u, 1)) or len(out.users) != 1):
        return why
    return sink, nodes, u


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
