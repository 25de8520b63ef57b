"""Pass 1: find attention sites in a Dynamo graph.

Matches, at the torch level (any of the function / method / operator spellings):

    SDPA:   out = scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c, scale=s,
                                               enable_gqa=g)
    eager:  s = matmul(q [* c], k.transpose(-2, -1))      # q-side scale optional
            s = s * scale | s / d                          # optional
            s = tanh(s / cap) * cap                        # optional logit soft-capping
            s = s + mask | where(mask, s, -big)            # optional
            p = softmax(s[.float()], dim=-1[, dtype])[.to(dtype)]
            p = dropout(p, p=0.0 | training=False)         # optional
            out = matmul(p, v)

with keys/values repeated for GQA by `x[:, :, None].expand(..).reshape(..)` (repeat_kv),
`repeat_interleave(x, n, dim=1)`, or SDPA's `enable_gqa=True`. Every intermediate of the eager
chain must feed only the next step: if the scores or probabilities are used elsewhere (e.g.
returned as attention weights), the site is reported and left alone.
"""

from __future__ import annotations

import torch.fx as fx

from kvcompile.passes.graph_utils import (
    arg,
    is_scalar,
    kind,
    module_stack,
    ndim,
    scalar_value,
    shape,
    single_user,
    val,
)
from kvcompile.passes.sites import AttentionSite, NearMiss


def find_attention_sites(gm: fx.GraphModule) -> list[AttentionSite]:
    """Every attention site of the graph (near misses dropped; the pipeline keeps them)."""
    sites = [m for m in (match_attention(n) for n in candidates(gm))
             if isinstance(m, AttentionSite)]
    name_sites(sites)
    return sites


def candidates(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes an attention site is anchored on: SDPA calls, softmaxes, and other
    softmax-like ops (which become near misses: no pattern rewrites them)."""
    return [n for n in gm.graph.nodes if kind(n) in ("sdpa", "softmax") or softmax_like(n)]


def softmax_like(node: fx.Node) -> bool:
    """A softmax or an attention op by any spelling (log_softmax, flex_attention, aten SDPA
    variants): what makes a graph with no site worth a warning."""
    if node.op not in ("call_function", "call_method"):
        return False
    if kind(node) in ("sdpa", "softmax"):
        return True
    name = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", str(node.target))
    return any(w in str(name).lower() for w in ("softmax", "attention", "scaled_dot_product"))


def match_attention(node: fx.Node) -> AttentionSite | NearMiss | None:
    """The attention site anchored on `node` (maybe left alone, with its reason), or a
    near miss saying which pattern step failed where."""
    k = kind(node)
    if k == "sdpa":
        return _match_sdpa(node)
    if k == "softmax":
        return _match_eager(node)
    if softmax_like(node):
        return _miss(node, "pattern", node, f"{_op(node)} is not an attention op kvcompile "
                     f"rewrites (SDPA, or softmax(q @ k^T) @ v)")
    return None


def _op(node) -> str:
    """A node's op, readable: 'matmul', 'torch.einsum', '.baddbmm'."""
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_function":
        mod = getattr(node.target, "__module__", "") or ""
        name = getattr(node.target, "__name__", str(node.target))
        return f"{'torch.' if mod.startswith('torch') and mod != 'torch' else ''}{name}" \
            if not mod.startswith("_operator") else name
    return node.op


def _miss(anchor: fx.Node, step: str, at, reason: str) -> NearMiss:
    name, _, _ = _site_location(anchor)
    where = f"{at.name} ({_op(at)})" if isinstance(at, fx.Node) else repr(at)
    return NearMiss(name=name, node=anchor.name, step=step, at=where, reason=reason)


def name_sites(sites: list[AttentionSite]) -> None:
    seen: dict[str, int] = {}
    for s in sites:
        n = seen.get(s.name, 0)
        seen[s.name] = n + 1
        if n:
            s.name = f"{s.name}#{n}"


def _site_location(node: fx.Node) -> tuple[str, str, list]:
    stack = module_stack(node)
    if not stack:
        return "<root>", "", stack
    path, cls = stack[-1]
    return path, getattr(cls, "__name__", str(cls)), stack


# --- SDPA ------------------------------------------------------------------------------------

def _match_sdpa(node: fx.Node) -> AttentionSite:
    q, k, v = arg(node, 0, "query"), arg(node, 1, "key"), arg(node, 2, "value")
    mask = arg(node, 3, "attn_mask")
    dropout_p = arg(node, 4, "dropout_p", 0.0)
    is_causal = arg(node, 5, "is_causal", False)
    scale = arg(node, 6, "scale")
    enable_gqa = arg(node, 7, "enable_gqa", False)
    name, cls, stack = _site_location(node)
    k_src, gqa_k, rep_k = unwrap_gqa(k)
    v_src, gqa_v, rep_v = unwrap_gqa(v)
    gqa = "enable_gqa" if enable_gqa else gqa_k
    site = AttentionSite(
        name=name, module_class=cls, module_stack=stack, pattern="sdpa", gqa=gqa,
        q=q, k=k_src, v=v_src, output=node, chain=[node], mask=mask,
        mask_kind=_mask_kind(mask), scale=scalar_value(scale) if scale is not None else None,
        is_causal=bool(is_causal) if isinstance(is_causal, bool) else False, n_rep=rep_k,
    )
    if not isinstance(is_causal, bool):
        return site.skip("is_causal is not a Python bool (data-dependent causality)")
    if scale is not None and site.scale is None:
        return site.skip("scale is not a Python number")
    if not (isinstance(dropout_p, (int, float)) and float(dropout_p) == 0.0):
        return site.skip(f"dropout_p={dropout_p} is not 0 (training-mode attention)")
    if gqa_k != gqa_v or rep_k != rep_v:
        return site.skip("keys and values are repeated differently for GQA")
    return _check_shapes(site)


def _mask_kind(mask) -> str | None:
    if mask is None:
        return None
    v = val(mask)
    if v is None:
        return "unknown"
    return "bool" if v.dtype.is_floating_point is False and str(v.dtype) == "torch.bool" else (
        "additive" if v.dtype.is_floating_point else "unknown")


def unwrap_gqa(node) -> tuple[fx.Node, str, int]:
    """Strip a GQA repeat from keys/values: returns (source, form, n_rep)."""
    if not isinstance(node, fx.Node):
        return node, "mha", 1
    k = kind(node)
    if k == "repeat_interleave":
        reps = arg(node, 1, "repeats")
        dim = arg(node, 2, "dim")
        if isinstance(reps, int) and dim in (1, -3):
            return arg(node, 0), "repeat_interleave", reps
    if k == "reshape" or k == "view":
        src = arg(node, 0)
        if kind(src) == "expand":
            inner = arg(src, 0)
            s_out, s_exp = shape(node), shape(src)
            if kind(inner) == "getitem" and s_exp is not None and len(s_exp) == 5 and (
                    s_out is not None and len(s_out) == 4):
                idx = arg(inner, 1)
                if isinstance(idx, tuple) and len(idx) >= 3 and idx[2] is None:
                    n_rep = s_exp[2]
                    if isinstance(n_rep, int):
                        return arg(inner, 0), "repeat_kv", n_rep
    return node, "mha", 1


# --- eager -----------------------------------------------------------------------------------

def _strip_to(node):
    """Follow dtype casts backwards: x.to(dtype) / x.float() -> x."""
    while isinstance(node, fx.Node) and kind(node) == "to" and single_user(node) is not None:
        node = arg(node, 0)
    return node


def _is_last_dim(node, dim) -> bool:
    n = ndim(node)
    return dim == -1 or (n is not None and dim == n - 1)


def _match_eager(softmax: fx.Node) -> AttentionSite | NearMiss:
    dim = arg(softmax, 1, "dim")
    if not _is_last_dim(softmax, dim):
        return _miss(softmax, "softmax", softmax, f"softmax over dim {dim}, not the last "
                     f"(key) dim")
    # forwards: softmax -> [to] -> [dropout] -> matmul(p, v); a step may have other users
    # (probabilities returned too): follow the chain, the user check below reports them
    chain_fwd = []
    cur = softmax
    nxt = _next_in_chain(cur)
    while nxt is not None and kind(nxt) in ("to", "dropout"):
        chain_fwd.append(nxt)
        cur, nxt = nxt, _next_in_chain(nxt)
    out = nxt
    # backwards: softmax <- [to] <- [add mask | where] <- [softcap] <- [scale] <- matmul(q, kT)
    chain_bwd = []
    x = arg(softmax, 0, "input")
    mask, mask_kind, scale, softcap = None, None, None, 0.0
    while kind(x) == "to":
        chain_bwd.append(x)
        x = arg(x, 0)
    if kind(x) == "add":
        a, b = arg(x, 0), arg(x, 1, "other")
        if _is_scores(a, b):
            chain_bwd.append(x)
            x, mask = a, b
        elif _is_scores(b, a):
            chain_bwd.append(x)
            x, mask = b, a
        mask_kind = "additive" if mask is not None else None
    elif kind(x) == "where":
        cond, a, b = arg(x, 0), arg(x, 1), arg(x, 2)
        if isinstance(a, fx.Node) and is_scalar(b) and _is_scores(a, cond):
            chain_bwd.append(x)
            x, mask, mask_kind = a, cond, "bool"
    elif kind(x) == "masked_fill":
        # nanoGPT: s.masked_fill(bias[..., :T, :T] == 0, float("-inf")): True = masked out
        a, cond, fill = arg(x, 0), arg(x, 1, "mask"), arg(x, 2, "value")
        if isinstance(fill, (int, float)) and fill <= -1e4 and _is_scores(a, cond):
            chain_bwd.append(x)
            x, mask, mask_kind = a, cond, "bool_inverted"
    # logit soft-capping: tanh(s / cap) * cap
    if kind(x) == "mul" and kind(arg(x, 0)) == "tanh":
        cap = scalar_value(arg(x, 1))
        inner = arg(arg(x, 0), 0)
        if cap is not None and kind(inner) == "div" and scalar_value(arg(inner, 1)) == cap:
            chain_bwd += [x, arg(x, 0), inner]
            softcap, x = cap, arg(inner, 0)
    if kind(x) in ("mul", "div") and is_scalar(arg(x, 1)) and scalar_value(arg(x, 1)) is not None:
        c = scalar_value(arg(x, 1))
        scale = c if kind(x) == "mul" else 1.0 / c
        chain_bwd.append(x)
        x = arg(x, 0)
    if kind(x) != "matmul":
        return _miss(softmax, "scores", x, "the scores are not matmul(q, k.transpose(-2, -1)) "
                     "(matmul, @, bmm), optionally scaled, soft-capped and masked")
    qk = x
    q, kt = arg(qk, 0), arg(qk, 1, "other")
    k = _untranspose(kt)
    if k is None:
        return _miss(softmax, "keys", kt, "the scores' second operand is not the keys "
                     "transposed (k.transpose(-2, -1), k.mT, permute(0, 1, 3, 2))")
    if out is None or kind(out) != "matmul" or arg(out, 0) is not cur:
        users = ", ".join(f"{u.name} ({_op(u)})" for u in cur.users) or "nothing"
        return _miss(softmax, "output", cur, f"the probabilities do not feed matmul(p, v) "
                     f"(used by {users})")
    v = arg(out, 1, "other")
    # q-side scale: matmul(q * c, kT)
    if kind(q) in ("mul", "div") and scalar_value(arg(q, 1)) is not None and (
            single_user(q) is qk):
        c = scalar_value(arg(q, 1))
        c = c if kind(q) == "mul" else 1.0 / c
        scale = c * (scale if scale is not None else 1.0)
        chain_bwd.append(q)
        q = arg(q, 0)
    name, cls, stack = _site_location(softmax)
    k_src, gqa_k, rep_k = unwrap_gqa(k)
    v_src, gqa_v, rep_v = unwrap_gqa(v)
    chain = [qk] + list(reversed(chain_bwd)) + [kt, softmax] + chain_fwd + [out]
    site = AttentionSite(
        name=name, module_class=cls, module_stack=stack, pattern="eager", gqa=gqa_k,
        q=q, k=k_src, v=v_src, output=out, chain=chain, mask=mask, mask_kind=mask_kind,
        scale=scale if scale is not None else 1.0, softcap=softcap, n_rep=rep_k,
    )
    for n in [qk] + chain_bwd + [softmax] + chain_fwd:
        if n is q:
            continue
        if len(n.users) != 1:
            return site.skip(f"attention scores/probabilities ({n.name}) are used elsewhere")
    if len(kt.users) != 1:
        return site.skip("transposed keys are used elsewhere")
    for d in chain_fwd:
        if kind(d) == "dropout":
            p = arg(d, 1, "p", 0.5)
            training = arg(d, 2, "training", True)
            if not (p == 0.0 or training is False):
                return site.skip(f"dropout p={p} in training mode")
    if gqa_k != gqa_v or rep_k != rep_v:
        return site.skip("keys and values are repeated differently for GQA")
    return _check_shapes(site)


def _next_in_chain(node: fx.Node) -> fx.Node | None:
    """The user of `node` that continues an attention chain (cast, dropout, matmul by v)."""
    for u in node.users:
        k = kind(u)
        if k in ("to", "dropout") and arg(u, 0) is node:
            return u
        if k == "matmul" and arg(u, 0) is node:
            return u
    return None


def _is_scores(scores, mask) -> bool:
    """`scores` looks like the [B, H, S, L] score tensor and `mask` broadcasts onto it."""
    s = shape(scores)
    return s is not None and len(s) == 4 and isinstance(scores, fx.Node) and (
        kind(scores) in ("matmul", "mul", "div") or kind(scores) == "to")


def _untranspose(kt):
    """k from k.transpose(-2, -1) / transpose(2, 3) / permute(0, 1, 3, 2) / k.mT."""
    if not isinstance(kt, fx.Node):
        return None
    kk = kind(kt)
    n = ndim(kt)
    if kk == "transpose":
        if kt.op == "call_method" and kt.target == "mT":
            return arg(kt, 0)
        d0, d1 = arg(kt, 1, "dim0"), arg(kt, 2, "dim1")
        if n is not None and {d % n for d in (d0, d1) if isinstance(d, int)} == {n - 2, n - 1}:
            return arg(kt, 0)
    if kk == "permute":
        dims = kt.args[1:] if len(kt.args) > 2 else arg(kt, 1, "dims")
        dims = tuple(dims) if isinstance(dims, (tuple, list)) else None
        if dims == (0, 1, 3, 2):
            return arg(kt, 0)
    return None


def _check_shapes(site: AttentionSite) -> AttentionSite:
    sq, sk, sv = shape(site.q), shape(site.k), shape(site.v)
    if sq is None or sk is None or sv is None:
        return site.skip("q/k/v shapes unknown")
    if len(sq) != 4 or len(sk) != 4 or len(sv) != 4:
        return site.skip(f"q/k/v are not 4-D [B, H, S, D] (q {len(sq)}-D, k {len(sk)}-D)")
    hq, hkv, d, dv = sq[1], sk[1], sq[3], sv[3]
    if not all(isinstance(x, int) for x in (hq, hkv, d, dv)):
        return site.skip("head counts / head_dim are not static")
    if hq % hkv != 0:
        return site.skip(f"{hq} query heads are not a multiple of {hkv} kv heads")
    site.num_q_heads, site.num_kv_heads, site.head_dim, site.v_head_dim = hq, hkv, d, dv
    site.dtype = val(site.q).dtype
    return site
