"""How a hand-written attention lays out its heads, and how to read its q·kᵀ and p·v ops.

kvcompile's attention op takes q, k, v as [B, H, S, D]. Models hold them other ways:

    [B, H, S, D]     Layout()                   HF, gpt-fast, nanoGPT
    [B, S, H, D]     Layout(perm=(0, 2, 1, 3))  einsum "bthd,bshd->bhts", flash-attn style caches
    [B*H, S, D]      Layout(heads=H)            bmm / baddbmm over batch x heads (BLOOM, fairseq)

and compute the scores as

    matmul(q, k.transpose(-2, -1))  |  bmm(q, k.transpose(1, 2))
    baddbmm(bias, q, k.transpose(1, 2), beta=1, alpha=scale)      # bias: additive mask
    einsum("bhtd,bhsd->bhts", q, k)  (any subscripts meaning q·kᵀ over [B, H, T, S] scores)

and the output as matmul(p, v) / bmm(p, v) / einsum("bhts,bhsd->bhtd", p, v) (any output
order). `qk_operands` / `pv_operands` read those ops; the rewrite moves each tensor to
[B, H, S, D] with `Layout.to_bhsd` and the op's output back with `Layout.from_bhsd`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from kvcompile.passes.graph_utils import arg, kind, ndim, scalar_value, shape

_IDENTITY = (0, 1, 2, 3)


@dataclass(frozen=True)
class Layout:
    perm: tuple = _IDENTITY      # x.permute(perm) is [B, H, S, D] (4-D tensors)
    heads: int = 0               # > 0: a flattened [B*H, S, D] tensor with `heads` heads

    @property
    def flat(self) -> bool:
        return self.heads > 0

    @property
    def seq_dim(self) -> int:
        return 1 if self.flat else self.perm[2]

    @property
    def head_dim_index(self) -> int:
        return -1 if self.flat else self.perm[1]

    def canon(self, s: tuple | None) -> tuple | None:
        """A shape in this layout, as [B, H, S, D]."""
        if s is None:
            return None
        if self.flat:
            b = s[0] // self.heads if isinstance(s[0], int) else -1
            return (b, self.heads, s[1], s[2])
        return tuple(s[i] for i in self.perm) if len(s) == 4 else s

    def then(self, perm: tuple) -> Layout:
        """The layout of y where x = y.permute(perm) and x has this layout."""
        return Layout(perm=tuple(perm[i] for i in self.perm))

    def to_bhsd(self, graph: fx.Graph, node):
        if self.flat:
            return graph.call_method("unflatten", (node, 0, (-1, self.heads)))
        if self.perm == _IDENTITY:
            return node
        return graph.call_method("permute", (node, *self.perm))

    def from_bhsd(self, graph: fx.Graph, node):
        if self.flat:
            return graph.call_method("flatten", (node, 0, 1))
        if self.perm == _IDENTITY:
            return node
        inverse = tuple(self.perm.index(i) for i in range(4))
        return graph.call_method("permute", (node, *inverse))


BHSD = Layout()


@dataclass
class QK:
    """The operands of a scores op: q @ kᵀ (`kt` the transpose node, None for einsum)."""
    q: fx.Node
    k: fx.Node
    kt: fx.Node | None
    q_layout: Layout
    k_layout: Layout
    scale: float = 1.0           # baddbmm's alpha
    bias: fx.Node | None = None  # baddbmm's input (beta=1): an additive mask


@dataclass
class PV:
    v: fx.Node
    v_layout: Layout
    out_layout: Layout


def untranspose(kt):
    """k from k.transpose(-2, -1) / transpose(2, 3) / transpose(1, 2) (3-D) /
    permute(0, 1, 3, 2) / k.mT."""
    if not isinstance(kt, fx.Node):
        return None
    kk, n = kind(kt), ndim(kt)
    if kk == "transpose":
        if kt.op == "call_method" and kt.target == "mT":
            return arg(kt, 0)
        d0, d1 = arg(kt, 1, "dim0"), arg(kt, 2, "dim1")
        if n is not None and {d % n for d in (d0, d1) if isinstance(d, int)} == {n - 2, n - 1}:
            return arg(kt, 0)
    if kk == "permute":
        dims = kt.args[1:] if len(kt.args) > 2 else arg(kt, 1, "dims")
        dims = tuple(dims) if isinstance(dims, (tuple, list)) else None
        if dims in ((0, 1, 3, 2), (0, 2, 1)):
            return arg(kt, 0)
    return None


def _permuted_keys(kt):
    """(k, k's layout) when kt = k.permute(p) is [B, H, D, S] straight from another layout
    (OpenAI GPT: [B, T, H, D] keys permuted (0, 2, 3, 1)); (None, None) otherwise."""
    if kind(kt) != "permute" or ndim(kt) != 4:
        return None, None
    dims = kt.args[1:] if len(kt.args) > 2 else arg(kt, 1, "dims")
    if not (isinstance(dims, (tuple, list)) and sorted(d % 4 for d in dims) == [0, 1, 2, 3]):
        return None, None
    d = [x % 4 for x in dims]
    return arg(kt, 0), Layout(perm=(d[0], d[1], d[3], d[2]))


def flat_heads(node) -> int:
    """Heads of a [B*H, S, D] tensor, read from the [B, H, S, D] it was flattened from."""
    seen = 0
    while isinstance(node, fx.Node) and seen < 8:
        seen += 1
        if kind(node) in ("reshape", "view", "flatten"):
            src = arg(node, 0)
            s_in, s_out = shape(src), shape(node)
            if s_in is not None and len(s_in) == 4 and s_out is not None and len(s_out) == 3 \
                    and isinstance(s_in[1], int) and s_in[2:] == s_out[1:]:
                return s_in[1]
            return 0
        if kind(node) in ("contiguous", "to") or (
                kind(node) in ("mul", "div") and scalar_value(arg(node, 1)) is not None):
            node = arg(node, 0)   # casts and scales (q * D ** -0.5) keep the layout
            continue
        return 0
    return 0


def _layout_of(node) -> Layout | str:
    n = ndim(node)
    if n == 4:
        return BHSD
    if n == 3:
        h = flat_heads(node)
        return Layout(heads=h) if h else "a [B*H, S, D] operand whose heads could not be " \
            "traced to the [B, H, S, D] tensor it was flattened from"
    return f"{n}-D operands (attention needs [B, H, S, D] or [B*H, S, D])"


def qk_operands(node: fx.Node) -> QK | str:
    """The q·kᵀ of a scores node (matmul / bmm / baddbmm / einsum), or why it is not one."""
    k = kind(node)
    if k == "einsum":
        return _einsum_qk(node)
    scale, bias = 1.0, None
    if k == "baddbmm":
        bias, q, kt = arg(node, 0), arg(node, 1, "batch1"), arg(node, 2, "batch2")
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if scalar_value(alpha) is None or scalar_value(beta) not in (0.0, 1.0):
            return "baddbmm with beta other than 0 / 1 or a non-constant alpha"
        scale = scalar_value(alpha)
        bias = bias if scalar_value(beta) == 1.0 else None
    else:
        q, kt = arg(node, 0), arg(node, 1, "other")
    key, lk = untranspose(kt), None
    if key is None:
        key, lk = _permuted_keys(kt)
    if key is None:
        return "the scores' second operand is not the keys transposed (k.transpose(-2, -1), " \
               "k.mT, a permute to [B, H, D, S])"
    lq = _layout_of(q)
    if isinstance(lq, str):
        return lq
    lk = lk or (BHSD if ndim(key) == 4 else Layout(heads=lq.heads))
    return QK(q=q, k=key, kt=kt, q_layout=lq, k_layout=lk, scale=scale, bias=bias)


def pv_operands(out: fx.Node, p: fx.Node) -> PV | None:
    """v and the layouts of v and the output, when `out` is p·v; None otherwise."""
    k = kind(out)
    if k == "matmul" and arg(out, 0) is p:
        v = arg(out, 1, "other")
        n = ndim(p)
        if n == 4:
            return PV(v=v, v_layout=BHSD, out_layout=BHSD)
        if n == 3:
            # flat: the heads are the query's (set by the caller)
            return PV(v=v, v_layout=Layout(heads=-1), out_layout=Layout(heads=-1))
        return None
    if k == "einsum":
        return _einsum_pv(out, p)
    return None


# --- einsum ------------------------------------------------------------------------------------

def _einsum(node: fx.Node):
    eq, ops = arg(node, 0), list(node.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or "->" not in eq or "..." in eq or len(ops) != 2:
        return None
    ins, out = eq.replace(" ", "").split("->")
    ins = ins.split(",")
    if len(ins) != 2:
        return None
    return ins, out, ops


def _einsum_qk(node: fx.Node) -> QK | str:
    parsed = _einsum(node)
    why = "an einsum that is not q·kᵀ: two operands, [B, H, T, S] or [B*H, T, S] scores, " \
          "one contracted head_dim letter, no ellipsis"
    if parsed is None:
        return why
    (a, b), c, (q, key) = parsed
    contracted = (set(a) & set(b)) - set(c)
    if len(contracted) != 1 or len(set(a)) != len(a) or len(set(b)) != len(b):
        return why
    d = contracted.pop()
    if len(c) == 4:
        bb, hh, t, s = c
        if not (set(a) == {bb, hh, t, d} and set(b) == {bb, hh, s, d} and t not in b
                and s not in a):
            return why
        return QK(q=q, k=key, kt=None, q_layout=Layout(tuple(a.index(x) for x in (bb, hh, t, d))),
                  k_layout=Layout(tuple(b.index(x) for x in (bb, hh, s, d))))
    if len(c) == 3:
        bb, t, s = c
        if a != bb + t + d or b != bb + s + d:
            return why
        h = flat_heads(q)
        if not h:
            return "an einsum over [B*H, T, D] whose heads could not be traced"
        return QK(q=q, k=key, kt=None, q_layout=Layout(heads=h), k_layout=Layout(heads=h))
    return why


def _einsum_pv(out: fx.Node, p: fx.Node) -> PV | None:
    parsed = _einsum(out)
    if parsed is None:
        return None
    ins, o, ops = parsed
    if ops[0] is p:
        sp, sv, v = ins[0], ins[1], ops[1]
    elif ops[1] is p:
        sp, sv, v = ins[1], ins[0], ops[0]
    else:
        return None
    extra = set(sv) - set(sp)
    if len(extra) != 1 or len(set(sv)) != len(sv):
        return None
    e = extra.pop()
    if len(sp) == 4:
        bb, hh, t, s = sp
        if set(sv) != {bb, hh, s, e} or set(o) != {bb, hh, t, e} or len(o) != 4:
            return None
        return PV(v=v, v_layout=Layout(tuple(sv.index(x) for x in (bb, hh, s, e))),
                  out_layout=Layout(tuple(o.index(x) for x in (bb, hh, t, e))))
    if len(sp) == 3:
        bb, t, s = sp
        if sv != bb + s + e or o != bb + t + e:
            return None
        return PV(v=v, v_layout=Layout(heads=-1), out_layout=Layout(heads=-1))
    return None

