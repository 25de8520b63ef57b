"""Canonical views of Dynamo FX nodes.

Dynamo graphs are torch-level: the same op appears as a function (`torch.matmul`), an operator
(`operator.matmul`, `@`) or a method (`x.matmul(y)`). `kind(node)` maps all of them to one name,
and `arg(node, i, name)` reads an argument wherever it was passed, so patterns are written once.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
import torch.nn.functional as F

_FUNCTION_KINDS = {
    torch._C._nn.scaled_dot_product_attention: "sdpa",
    F.scaled_dot_product_attention: "sdpa",
    torch.matmul: "matmul", operator.matmul: "matmul", torch.bmm: "matmul",
    torch.einsum: "einsum", torch.functional.einsum: "einsum", torch.baddbmm: "baddbmm",
    torch.masked_fill: "masked_fill", torch.flatten: "flatten",
    torch.softmax: "softmax", F.softmax: "softmax", torch.nn.functional.softmax: "softmax",
    F.dropout: "dropout", torch.dropout: "dropout",
    operator.mul: "mul", torch.mul: "mul",
    operator.truediv: "div", torch.div: "div",
    operator.add: "add", torch.add: "add",
    operator.getitem: "getitem",
    operator.setitem: "setitem",
    torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat",
    torch.where: "where",
    torch.repeat_interleave: "repeat_interleave",
    torch.transpose: "transpose", torch.permute: "permute",
    torch.reshape: "reshape",
    torch.index_copy: "index_copy",
    torch.zeros: "zeros", torch.empty: "empty", torch.tensor: "tensor",
    torch._C._nn.linear: "linear", F.linear: "linear", torch.addmm: "addmm",
    torch.split: "split", torch.functional.split: "split",
    torch.tanh: "tanh", torch.max: "max", torch.maximum: "max", torch.full: "full",
    torch.ops.aten.sym_size.int: "size", torch.ops.aten.sym_size: "size", getattr: "size",
}
try:  # a tensor-parallel projection wraps its local input (parallelize_module's input hook)
    from torch.distributed.tensor import DTensor

    _FUNCTION_KINDS[DTensor.from_local] = "from_local"
except ImportError:  # torch built without distributed
    pass

_METHOD_KINDS = {
    "matmul": "matmul", "bmm": "matmul", "__matmul__": "matmul", "baddbmm": "baddbmm",
    "softmax": "softmax",
    "mul": "mul", "__mul__": "mul", "div": "div", "__truediv__": "div",
    "add": "add", "__add__": "add",
    "transpose": "transpose", "permute": "permute", "mT": "transpose",
    "view": "view", "reshape": "reshape", "expand": "expand", "contiguous": "contiguous",
    "to": "to", "float": "to", "half": "to", "bfloat16": "to", "type_as": "to", "type": "to",
    "repeat_interleave": "repeat_interleave",
    "index_copy_": "index_copy_", "index_copy": "index_copy",
    "index_put_": "index_put_", "index_put": "index_put",
    "copy_": "copy_", "unsqueeze": "unsqueeze", "split": "split", "chunk": "chunk",
    "new_empty": "new_empty", "new_zeros": "new_empty",
    "masked_fill": "masked_fill", "masked_fill_": "masked_fill",
    "size": "size", "dim": "size", "numel": "size", "flatten": "flatten",
}

# Ops that only re-view or re-type a tensor: following them keeps "the same data".
VIEW_KINDS = {"view", "reshape", "transpose", "permute", "contiguous", "expand", "unsqueeze",
              "getitem", "to", "flatten"}


def kind(node: fx.Node) -> str | None:
    if node.op == "call_function":
        return _FUNCTION_KINDS.get(node.target)
    if node.op == "call_method":
        return _METHOD_KINDS.get(node.target)
    return None


def arg(node: fx.Node, index: int, name: str | None = None, default=None):
    """Argument `index` (positional, counting `self` for methods) or keyword `name`."""
    if index < len(node.args):
        return node.args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    return default


def val(node) -> torch.Tensor | None:
    """The fake tensor Dynamo recorded for a node (None for non-tensors and literals)."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def shape(node) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if v is not None else None


def ndim(node) -> int | None:
    v = val(node)
    return v.dim() if v is not None else None


def is_scalar(x) -> bool:
    """A Python number, or a 0-d / one-element tensor node."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return True
    v = val(x)
    return v is not None and v.numel() == 1


def scalar_value(x) -> float | None:
    """x as a Python float: a number, or a graph value Dynamo made symbolic (a float attribute
    such as `self.scaling` becomes a SymFloat input under dynamic shapes,
    assume_static_by_default=False). A symbolic one is specialized to its value with a guard
    (float() on a SymFloat guards on it, as inductor does for a value it must know), so a call
    with another value recompiles instead of running with this one."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, fx.Node):
        ev = x.meta.get("example_value", x.meta.get("val"))
        if isinstance(ev, (torch.SymFloat, torch.SymInt)):
            return float(ev)
    return None


def single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def module_stack(node: fx.Node) -> list[tuple[str, type]]:
    """The node's nn_module_stack as [(path, class)], outermost first, paths cleaned of Dynamo's
    `L['self'].` / `L['args'][0].` prefixes."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, value in stack.items():
        path, cls = value if isinstance(value, tuple) else (key, value)
        out.append((clean_path(str(path)), cls if isinstance(cls, type) else type(None)))
    return out


# Dynamo's source of the root module: L['self'], L['args'][0], or the forward's own name for
# `self` (research code writes `def forward(s, x)` or compiles `fn(model, x)`)
_ROOT_SOURCE = re.compile(r"^L\['[A-Za-z_]\w*'\](\[\d+\])?\.?")


def clean_path(path: str) -> str:
    path = _ROOT_SOURCE.sub("", path, count=1)
    # layers[0] -> layers.0 ; _modules['x'] -> x
    out = re.sub(r"(^|\.)_modules\['([^']*)'\]", r"\1\2", path).replace("']", "")
    out = out.replace("[", ".").replace("]", "")
    return out.strip(".") or "<root>"


def ancestors_until(node: fx.Node, stop, limit: int = 64) -> set[fx.Node]:
    """Breadth-first ancestors of `node`, not expanding past nodes for which `stop(n)` is true
    (those are included). Bounded by `limit` nodes."""
    seen: set[fx.Node] = set()
    frontier = [node]
    while frontier and len(seen) < limit:
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                if not stop(a):
                    nxt.append(a)
        frontier = nxt
    return seen


def graph_outputs(gm: fx.GraphModule) -> list:
    out = gm.graph.output_node()
    res = out.args[0]
    return list(res) if isinstance(res, (tuple, list)) else [res]


def set_meta(node: fx.Node, like: fx.Node) -> None:
    """Copy module-stack metadata and compute the fake value of a new node."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    try:
        fake_args = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get(
            "example_value", n.meta.get("val")))
        leaves = [a for a in torch.utils._pytree.tree_leaves(fake_args)
                  if isinstance(a, torch.Tensor)]
        # the inputs' own mode: detect_fake_mode prefers the tracing context's, which is not
        # always the one Dynamo recorded the example values in
        mode = next((a.fake_mode for a in leaves if hasattr(a, "fake_mode")), None)
        if mode is None and leaves:
            mode = torch._guards.detect_fake_mode(leaves)
        fn = node.target if node.op == "call_function" else getattr(torch.Tensor, node.target)
        args, kwargs = fake_args
        if mode is not None:
            with mode:
                node.meta["example_value"] = fn(*args, **kwargs)
        else:
            node.meta["example_value"] = fn(*args, **kwargs)
    except Exception:  # meta is advisory: AOTAutograd re-traces from the inputs
        pass
