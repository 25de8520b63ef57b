"""Run a decode graph's small-M linears on kernels/skinny.py's Triton kernel.

A decode step multiplies at most a few rows by every weight of the model; cuBLAS's kernels for
such products did not use the H200's bandwidth as fully as the H100's (issue 16 item 5). With
`KVConfig.decode_gemms="triton"` (or "auto") this pass replaces each linear (F.linear, merged
or not) of a rewritten graph on CUDA whose input has at most 16 rows (a static count, or a
dynamic one the op checks at each call) by `torch.ops.kvcompile.skinny_linear`
(runtime/skinny_op.py), which is F.linear computed by that kernel ("auto": the op's own
measured choice between that kernel and cuBLAS, per shape on this GPU: `skinny_op.choose`).
Fires only where no gradient can flow (grad mode off when traced, or no parameter requiring
it), on float16 / bfloat16 / float32 operands of one dtype, never on DTensors (tensor
parallelism); a linear whose weight is not a 2-D tensor with contiguous rows keeps F.linear.
The default ("torch") leaves every linear to the inner compiler (cuBLAS through inductor).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kvcompile.kernels.skinny import MAX_M
from kvcompile.passes.graph_utils import val
from kvcompile.passes.merge_projections import _linear_parts

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEVICES = ("cuda",)   # (the CPU tests add "cpu": the kernel under the Triton interpreter)


def _static_rows(x: torch.Tensor) -> int | None:
    """x's rows (all but its last dim) where its shape is static, else None."""
    if any(not isinstance(s, int) for s in x.shape):
        return None
    return x.numel() // x.shape[-1]


class _Meta:
    """What the pass reads of an operand: dims, last stride, dtype, device, requires_grad."""

    def __init__(self, dim, stride1, dtype, device, requires_grad):
        self.dim, self.stride1, self.dtype = dim, stride1, dtype
        self.device, self.requires_grad = device, requires_grad


def _meta(p) -> _Meta | None:
    """An operand's meta from its fake tensor; for merge_projections' merged weight (an
    `as_strided` view of the group's first parameter, recorded without a fake tensor) from
    that view's arguments."""
    v = val(p)
    if v is not None:
        return _Meta(v.dim(), v.stride(-1) if v.dim() else 1, v.dtype, v.device,
                     v.requires_grad)
    if isinstance(p, fx.Node) and p.op == "call_function" and p.target is torch.as_strided:
        base = val(p.args[0])
        size, stride = p.args[1], p.args[2]
        if base is not None and isinstance(size, (tuple, list)):
            return _Meta(len(size), stride[-1], base.dtype, base.device, base.requires_grad)
    return None


def _is_dtensor(v) -> bool:
    """A DTensor (tensor parallelism): the kernel takes local tensors only."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # pragma: no cover - a torch without torch.distributed
        return False
    return isinstance(v, DTensor)


def _eligible(n: fx.Node, grad: bool) -> bool | str | None:
    """Whether the pass takes linear `n`: True; None: it would, but its row count is dynamic;
    False: not a linear it could take (not a linear, a product of no columns, more than 16
    static rows); a string: a linear refused for its operands, the reason (said once a model
    by the backend, `refusals`)."""
    parts = _linear_parts(n)
    if parts is None:
        return False
    xn, wn, bn = parts
    x = val(xn)
    w = _meta(wn)
    b = None if bn is None else _meta(bn)
    if x is None or w is None or (bn is not None and b is None):
        return "its operands carry no traced shape"
    if bn is not None and b.dim != 1:
        return "its bias is not 1-D"
    if _is_dtensor(x) or _is_dtensor(val(wn)):
        return "its operands are DTensors (tensor parallelism; the kernel takes local tensors)"
    if x.dim() == 0 or (isinstance(x.shape[-1], int) and x.shape[-1] == 0):
        return False   # (no product: F.linear's zeros or bias)
    if x.device.type not in DEVICES or w.device != x.device:
        return f"its operands are on {x.device.type}, the kernel runs on CUDA"
    if w.dim != 2 or w.stride1 != 1:
        return "its weight is not a 2-D tensor with contiguous rows"
    if x.dtype not in _DTYPES or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return (f"its operands' dtypes ({x.dtype}, {w.dtype}) are not one of float16 / "
                f"bfloat16 / float32")
    if grad and any(t is not None and t.requires_grad for t in (x, w, b)):
        return "gradients can flow through it (grad mode on, a parameter requiring grad)"
    rows = _static_rows(x)
    if rows is None:
        return None
    return rows <= MAX_M


def rewrite(gm: fx.GraphModule, auto: bool = False,
            refusals: dict | None = None) -> tuple[int, int]:
    """Replace the eligible linears of `gm` in place (auto: by the op's measured choice);
    -> (how many, how many of them have a dynamic row count). `refusals`, if given, gets
    {reason: count} for the linears refused for their operands. A graph Dynamo traced with its
    token dim dynamic (the decode step after a prefill of another length, in `generate`) has
    no static row count, yet runs decode steps of at most 16 rows: its linears go to the op
    too, which checks the rows at each call (runtime/skinny_op.py `takes`: more than 16 run
    F.linear; a CUDA graph bakes the call's choice in)."""
    import kvcompile.runtime.skinny_op  # noqa: F401  (registers the op)

    grad = torch.is_grad_enabled() and not any(
        n.op == "call_function" and n.target is torch._C._set_grad_enabled
        for n in gm.graph.nodes)
    count = dynamic = 0
    for n in list(gm.graph.nodes):
        ok = _eligible(n, grad)
        dynamic += ok is None
        if isinstance(ok, str):
            if refusals is not None:
                refusals[ok] = refusals.get(ok, 0) + 1
            continue
        if ok is False:
            continue
        x, w, b = _linear_parts(n)
        n.target = torch.ops.kvcompile.skinny_linear.default
        n.args, n.kwargs = ((x, w, b, True) if auto else (x, w, b)), {}
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count, dynamic


def say_refusals(state, refused: dict, mode: str) -> None:
    """Count the linears `rewrite` refused for their operands (`decode_gemms_refused`) and say
    each reason once a model: they stay on the inner compiler's GEMMs although the config asked
    for the kernel."""
    from kvcompile.passes import notices

    for reason, k in refused.items():
        state.count("decode_gemms_refused", k)
        notices.warn_once(state, ("decode_gemms", reason),
                          f"kvcompile left {k} linear(s) of graph {state.graphs} of "
                          f"{notices.model_name(state)} on the inner compiler's GEMMs although "
                          f"KVConfig.decode_gemms={mode!r} asked for kvcompile's kernel: "
                          f"{reason}. Nothing to fix if that is expected; "
                          f"decode_gemms='torch' (the default) does not try.")


def summary(counters: dict) -> str | None:
    """The report's line on what the pass did (None: nothing)."""
    n = counters.get("decode_gemms_triton")
    a = counters.get("decode_gemms_auto")
    r = counters.get("decode_gemms_refused")
    refused = (f"; {r} linears refused for their operands (the warnings give the reasons)"
               if r else "")
    if not n and not a:
        return (f"decode GEMMs: no linear on kvcompile's kernel{refused}" if r else None)
    mode = "triton" if n else "auto"
    d = counters.get(f"decode_gemms_{mode}_dynamic")
    dyn = (f" ({d} of them in graphs with a dynamic row count: the op checks the rows at "
           f"each call, more than 16 run F.linear)") if d else ""
    if n:
        return (f"decode GEMMs: {n} small-M linears over the graphs on kvcompile's Triton "
                f"kernel (KVConfig.decode_gemms='triton'){dyn}{refused}")
    chosen = ", ".join(f"{counters.get(f'decode_gemms_auto_{c}', 0)} {what}" for c, what in
                       (("triton", "on the Triton kernel"), ("torch", "on cuBLAS"),
                        ("unmeasured", "first met in a capture (cuBLAS there)")))
    return (f"decode GEMMs: {a} small-M linears over the graphs chosen by shape "
            f"(KVConfig.decode_gemms='auto'){dyn}; shapes this model measured: {chosen} "
            f"(the kernel notes give each shape's times){refused}")
