"""Merge the projections that read one activation into one GEMM (q / k / v, gate / up).

A decode step multiplies a few rows by every weight of the model: each projection is a
bandwidth-bound matrix product whose launch, ramp-up and tail cost about as much as its bytes
at small M. Serving stacks store q / k / v (and gate / up) as one matrix for that reason; a
Hugging Face model keeps them apart. This pass finds, in any graph, the linears that read the
same activation with parameters of one dtype, device and input width, and runs them as one
linear whose output each consumer reads through a narrow view.

The weights are not copied for it. A group's parameters are made rows of one tensor (`lay_out`:
a new tensor holding the group, each parameter's `.data` then a view of its rows; the memory is
the same after it), and the merged linear reads `as_strided(first weight, [all rows, in])`.
Dynamo's fake inputs describe the storage it traced, so a graph whose groups were just laid out
is traced again (`retrace`), once per model; a later graph finds them in place.

Before each call the runner checks that every group still sits in one tensor (`Merged.ready`:
a parameter replaced, or another model of the same class running the graph); where not, it lays
the group out again from the parameters it was given, so the graph reads those values.

Fires only where no gradient can flow (grad mode off when traced, or no weight requiring it),
on plain dense floating parameters each in one group only; a member whose consumers would view
its output across the merged width (anything but splitting the last dimension, then transposes)
reads a contiguous copy instead; not across an in-place write of the shared input.
`KVConfig.merge_projections` ("auto": graphs on CUDA; True; False) decides where it runs
(backend.py `_merging`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from kvcompile.passes.graph_utils import val

_LINEARS = (torch._C._nn.linear, F.linear)
# views valid at any strides (they never merge dimensions); their outputs are followed
_ANY_STRIDES = ("transpose", "permute", "getitem", "__getitem__", "narrow", "select", "split",
                "chunk", "unbind", "unsqueeze", "squeeze", "expand", "unflatten", "movedim",
                "swapaxes", "t", "T", "mT", "detach")


@dataclass(eq=False)
class Group:
    """Linears reading one activation: their nodes in graph order, the input indices of their
    weights (and biases, or None), and each one's rows (out_features)."""

    nodes: list
    weights: tuple
    biases: tuple | None
    rows: tuple
    merged: tuple | None = None   # after `merge`: (the merged linear, each member's view)

    @property
    def params(self) -> tuple:
        return self.weights + (self.biases or ())


def _linear_parts(n: fx.Node):
    if n.op != "call_function" or n.target not in _LINEARS:
        return None
    x = n.args[0] if n.args else n.kwargs.get("input")
    w = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
    b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    return x, w, b


def _plain(t) -> bool:
    return (isinstance(t, torch.nn.Parameter) and type(t.data) is torch.Tensor
            and t.is_floating_point() and not t.is_sparse and t.layout == torch.strided)


def find_groups(gm: fx.GraphModule, example_inputs) -> list[Group]:
    """The mergeable groups of `gm` (two or more linears on one activation)."""
    if any(n.op == "call_function" and n.target is torch._C._set_grad_enabled
           for n in gm.graph.nodes):
        return []
    index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    by_input: dict = {}
    for n in gm.graph.nodes:
        parts = _linear_parts(n)
        if parts is None:
            continue
        x, w, b = parts
        if not (isinstance(x, fx.Node) and w in index and (b is None or b in index)):
            continue
        wt = example_inputs[index[w]]
        bt = None if b is None else example_inputs[index[b]]
        if not (_plain(wt) and wt.dim() == 2 and (bt is None or (_plain(bt) and bt.dim() == 1
                                                                   and bt.dtype == wt.dtype))):
            continue
        if torch.is_grad_enabled() and (wt.requires_grad or (bt is not None
                                                               and bt.requires_grad)):
            continue
        key = (x, wt.dtype, wt.device, wt.shape[1], b is None)
        by_input.setdefault(key, []).append((n, index[w], None if b is None else index[b],
                                             wt.shape[0]))
    groups = [Group(nodes=[m[0] for m in ms], weights=tuple(m[1] for m in ms),
                    biases=None if ms[0][2] is None else tuple(m[2] for m in ms),
                    rows=tuple(m[3] for m in ms))
              for ms in by_input.values() if len(ms) > 1 and not _written_between(ms)]
    # a parameter in two groups (or twice in one) cannot be laid out for both
    seen: dict = {}
    for g in groups:
        for i in g.params:
            key = id(example_inputs[i])
            seen[key] = seen.get(key, 0) + 1
    return [g for g in groups if all(seen[id(example_inputs[i])] == 1 for i in g.params)]


_VIEWS = _ANY_STRIDES + ("view", "view_as", "reshape", "flatten", "contiguous", "as_strided",
                         "expand_as", "to")
_INPLACE_OPS = ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                "ixor", "ilshift", "irshift", "setitem")


def _name(n: fx.Node) -> str:
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", "")


def _chain(t, limit: int = 64) -> set:
    """t and the nodes it is a view of (through view-like ops)."""
    out = set()
    while isinstance(t, fx.Node) and len(out) < limit:
        out.add(t)
        if _name(t) not in _VIEWS or not t.args:
            break
        t = t.args[0]
    return out


def _written_between(members) -> bool:
    """An in-place op between the group's first and last linear writes their input (or a
    tensor it views, or a view of it): merged, the later linears would read it before the
    write."""
    xs = _chain(_linear_parts(members[0][0])[0])
    last = members[-1][0]
    node = members[0][0].next
    while node is not last and node.op != "output":
        name = _name(node)
        inplace = (name.endswith("_") and not name.startswith("_")) or name in _INPLACE_OPS
        if inplace and node.args and _chain(node.args[0]) & xs:
            return True
        node = node.next
    return False


def _adjacent(ts) -> bool:
    """The tensors are the rows of one tensor that holds exactly them, in order."""
    first = ts[0]
    if first.storage_offset() != 0:
        return False
    st, off = first.untyped_storage().data_ptr(), 0
    for t in ts:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != st
                or t.storage_offset() != off):
            return False
        off += t.numel()
    return first.untyped_storage().nbytes() == off * first.element_size()


def in_place(g: Group, tensors) -> bool:
    """The group's weights (and biases) each sit in one tensor of theirs, in order."""
    ws = [tensors[i] for i in g.weights]
    return _adjacent(ws) and (g.biases is None or _adjacent([tensors[i] for i in g.biases]))


def lay_out(g: Group, tensors) -> None:
    """Make the group's parameters rows of one new tensor (weights, then biases in another):
    each parameter's .data becomes a view of its rows; its values are unchanged."""
    for idx in (g.weights, g.biases):
        if idx is None or _adjacent([tensors[i] for i in idx]):
            continue
        ps = [tensors[i] for i in idx]
        with torch.inference_mode(False), torch.no_grad():
            base = torch.cat([p.detach().reshape(p.shape[0], -1) for p in ps]).reshape(
                (-1,) + tuple(ps[0].shape[1:]))
            off = 0
            for p in ps:
                p.data = base[off:off + p.shape[0]]
                off += p.shape[0]


def retrace():
    """The exception that has Dynamo trace the frame again (its fake inputs then describe the
    laid-out storage). Dynamo lets this one restart type through a backend (inductor raises it
    to specialize a float)."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    return TensorifyScalarRestartAnalysis()


def _safe_users(node: fx.Node) -> bool:
    """Every consumer of a linear's output can take it as a narrowed view of the merged
    output (its rows a wider stride apart): compute ops take any strides, and so do views
    that never merge dimensions (transposes, slices, unsqueezes, ...); a `view` merges or
    splits, and is known safe only as the first op, splitting the last dimension."""
    lead = None if val(node) is None else tuple(val(node).shape[:-1])

    def ok(n: fx.Node, first: bool) -> bool:
        name = _name(n)
        if name in ("view", "view_as"):
            v = val(n)
            if not (first and v is not None and lead is not None
                    and tuple(v.shape[:len(lead)]) == lead):
                return False
            return all(ok(u, False) for u in n.users)
        if name in ("as_strided", "set_", "resize_", "copy_"):
            return False
        if name in _ANY_STRIDES:
            return all(ok(u, False) for u in n.users)
        return True   # a compute op (or contiguous / reshape, which copy where they must)

    return all(ok(u, True) for u in node.users)


def _held_by_an_op(node: fx.Node) -> bool:
    """The linear's output reaches, through views only, one of this package's ops (the
    attention op takes v so): narrowed, it would keep the whole merged output alive until that
    op runs, after the other members' consumers (at a prefill of T tokens, T x the others'
    rows). A contiguous copy of its own rows lets the merged output go after them."""
    todo, seen = list(node.users), 0
    while todo and seen < 256:
        n, seen = todo.pop(), seen + 1
        if n.op == "call_function" and isinstance(n.target, (torch._ops.OpOverload,
                                                             torch._ops.OpOverloadPacket)) \
                and str(n.target).startswith("kvcompile."):
            return True
        if _name(n) in _VIEWS:
            todo.extend(n.users)
    return False


def merge(gm: fx.GraphModule, groups: list[Group]) -> int:
    """Rewrite each group as one linear on its laid-out weights; -> how many members read a
    contiguous copy of their rows (a consumer would view them across the merged width)."""
    graph = gm.graph
    copied = 0
    for g in groups:
        first = g.nodes[0]
        x, w0, b0 = _linear_parts(first)
        total = sum(g.rows)
        wv = val(w0)
        if wv is None:
            continue
        with graph.inserting_before(first):
            w = graph.call_function(torch.as_strided, (w0, (total, wv.shape[1]),
                                                       (wv.shape[1], 1)))
            b = None if b0 is None else graph.call_function(torch.as_strided,
                                                            (b0, (total,), (1,)))
            y = graph.call_function(torch._C._nn.linear, (x, w, b))
        start, views = 0, []
        for n, rows in zip(g.nodes, g.rows):
            contiguous = not _safe_users(n)
            copied += contiguous
            contiguous = contiguous or _held_by_an_op(n)
            with graph.inserting_after(n):
                part = graph.call_function(torch.narrow, (y, -1, start, rows))
            out = part
            if contiguous:
                with graph.inserting_after(part):
                    out = graph.call_method("contiguous", (part,))
            if "example_value" in n.meta:
                part.meta["example_value"] = n.meta["example_value"]
                out.meta["example_value"] = n.meta["example_value"]
            n.replace_all_uses_with(out)
            graph.erase_node(n)
            views.append(out)
            start += rows
        g.merged = (y, tuple(views))
    graph.lint()
    gm.recompile()
    return copied


def _activation(n: fx.Node) -> str | None:
    """The name (kernels/gated.py ACTS) of the activation node n applies, else None."""
    if n.op == "call_function" and n.target in (F.silu, torch._C._nn.silu):
        return None if n.kwargs.get("inplace") or (len(n.args) > 1 and n.args[1]) else "silu"
    if n.op == "call_method" and n.target == "silu":
        return "silu"
    if n.op == "call_function" and n.target in (F.gelu, torch._C._nn.gelu):
        approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return "gelu_tanh" if approx == "tanh" else None
    return None


def _is_mul(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in (operator.mul, torch.mul)
            or n.op == "call_method" and n.target == "mul") and len(n.args) == 2 \
        and not n.kwargs


def fuse_gated(gm: fx.GraphModule, groups: list[Group]) -> int:
    """Where a merged pair's views meet only in act(first) * second (or second * act(first),
    either member gated), the product is written into the gated half of the merged output
    (`torch.ops.kvcompile.act_mul_`, kernels/gated.py) and its consumers read that half as a
    view: no [..., I] buffer beside the merged [..., 2I] one. Consumers of the product must
    take a narrowed view (`_safe_users`); -> how many products were rewritten."""
    from kvcompile.runtime import gated_op  # noqa: F401  (registers the op)

    graph, fused = gm.graph, 0
    for g in groups:
        if g.merged is None or len(g.rows) != 2 or g.rows[0] != g.rows[1]:
            continue
        y, views = g.merged
        if any(_name(v) != "narrow" or len(v.users) != 1 for v in views):
            continue
        uses = [next(iter(v.users)) for v in views]
        for gi in (0, 1):
            act, mul = uses[gi], uses[1 - gi]
            name = _activation(act)
            if (name is None or len(act.users) != 1 or next(iter(act.users)) is not mul
                    or not _is_mul(mul) or set(mul.args) != {act, views[1 - gi]}
                    or not _safe_users(mul)):
                continue
            width = g.rows[0]
            a, b = views[gi].args[2], views[1 - gi].args[2]
            with graph.inserting_before(mul):
                graph.call_function(torch.ops.kvcompile.act_mul_.default,
                                    (y, a, b, width, name))
                out = graph.call_function(torch.narrow, (y, -1, a, width))
            if "example_value" in mul.meta:
                out.meta["example_value"] = mul.meta["example_value"]
            mul.replace_all_uses_with(out)
            for n in (mul, act, *views):
                graph.erase_node(n)
            fused += 1
            break
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def summary(counters: dict) -> str | None:
    """The report's and `kvcompile inspect`'s line on what the pass did (None: nothing)."""
    if not counters.get("projections_merged"):
        return None
    copied = counters.get("projections_copied")
    gated = counters.get("projections_gated_in_place")
    return (f"merged projections: {counters['projections_linears']} linears run as "
            f"{counters['projections_merged']} GEMMs over the graphs "
            f"(KVConfig.merge_projections)"
            + (f"; {copied} read a contiguous copy of their rows" if copied else "")
            + (f"; {gated} gated products written into their gate's rows" if gated else ""))


class Merged:
    """The runner's side: the merged groups of one compiled graph, checked before each call."""

    def __init__(self, groups: list[Group], counts: dict | None = None):
        self.groups = groups
        self.counts = counts or {}   # the state counters the merge added (undone on a fallback)
        self._members = [i for g in groups for i in g.params]
        self._verified: list | None = None   # the members' addresses when last found in place

    def ready(self, args) -> None:
        """Lay out again any group whose parameters no longer sit in one tensor. The common
        case (the addresses found in place at the last call) is one list comparison."""
        ptrs = [args[i].data_ptr() for i in self._members]
        if ptrs == self._verified:
            return
        for g in self.groups:
            if not in_place(g, args):
                lay_out(g, args)
        self._verified = [args[i].data_ptr() for i in self._members]
