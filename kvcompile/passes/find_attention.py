"""Pass 1: find attention sites in a Dynamo graph.

Matches, at the torch level (any of the function / method / operator spellings):

    SDPA:   out = scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c, scale=s,
                                               enable_gqa=g)
    eager:  s = matmul(q [* c], k.transpose(-2, -1))      # q-side scale optional
            s = s * scale | s / d                          # optional
            s = tanh(s / cap) * cap                        # optional logit soft-capping
            s = s + mask | where(mask, s, -big)            # optional
            s = cat([s, sink.expand(B, H, S, 1)], -1)      # optional attention sinks
            s = s - s.max(-1, keepdim=True).values         # optional, changes nothing
            p = softmax(s[.float()], dim=-1[, dtype])[.to(dtype)]
            p = p[..., :-1]                                # with sinks: drop their column
            p = dropout(p, p=0.0 | training=False)         # optional
            out = matmul(p, v)
            out = out * sigmoid(logsumexp(s) - sink)[..., None]   # sinks, Granite's way

with keys/values repeated for GQA by `x[:, :, None].expand(..).reshape(..)` (repeat_kv),
`repeat_interleave(x, n, dim=1)`, or SDPA's `enable_gqa=True`. Every intermediate of the eager
chain must feed only the next step: if the scores or probabilities are used elsewhere (e.g.
returned as attention weights), the site is reported and left alone.
"""

from __future__ import annotations

import torch
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
from kvcompile.passes.layouts import BHSD, Layout, pv_operands, qk_operands
from kvcompile.passes.score_masks import (
    SINK_NOT_DROPPED,
    drops_sink_column,
    in_place_fill,
    is_last_dim,
    is_very_negative_const,
    logsumexp_sink,
    mask_step,
    masked_in_place,
    reads_shape_only,
    same_value,
    sink_column,
    stabilized,
    views_scores,
    zeroes_probs,
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
    k_src, gqa_k, rep_k, k_layout = unwrap_gqa(k)
    v_src, gqa_v, rep_v, v_layout = unwrap_gqa(v)
    gqa = "enable_gqa" if enable_gqa else gqa_k
    site = AttentionSite(
        name=name, module_class=cls, module_stack=stack, pattern="sdpa", gqa=gqa,
        q=q, k=k_src, v=v_src, output=node, chain=[node], mask=mask,
        mask_kind=_mask_kind(mask), scale=scalar_value(scale) if scale is not None else None,
        is_causal=bool(is_causal) if isinstance(is_causal, bool) else False, n_rep=rep_k,
        k_layout=k_layout, v_layout=v_layout,
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


def unwrap_gqa(node, layout: Layout = BHSD) -> tuple[fx.Node, str, int, Layout]:
    """Strip a GQA repeat from keys/values held in `layout`: (source, form, n_rep, the
    source's layout). Forms: repeat_kv (x[:, :, None].expand(..).reshape(..)), MQA / GQA
    flattened into the batch (the same expand reshaped to [B*H, S, D], or x.expand(B, H, S, D)
    of a single kv head), repeat_interleave along the heads dim."""
    if not isinstance(node, fx.Node):
        return node, "mha", 1, layout
    k = kind(node)
    if k == "to" and _widens_to_fp32(node):
        # Flint: repeat_kv(keys).float(); exact, so the op may read the keys as stored
        found = unwrap_gqa(arg(node, 0), layout)
        if found[1] != "mha":
            return found
    if k == "repeat_interleave":
        reps, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        if isinstance(reps, int) and isinstance(dim, int) and not layout.flat and (
                dim % 4 == layout.head_dim_index):
            return arg(node, 0), "repeat_interleave", reps, layout
    if k in ("reshape", "view") and kind(arg(node, 0)) == "expand":
        src = arg(node, 0)
        inner, s_out, s_exp = arg(src, 0), shape(node), shape(src)
        if s_exp is None or s_out is None or layout.perm != BHSD.perm:
            return node, "mha", 1, layout
        if kind(inner) == "getitem" and len(s_exp) == 5 and len(s_out) in (3, 4):
            idx = arg(inner, 1)
            if isinstance(idx, tuple) and len(idx) >= 3 and idx[2] is None and isinstance(
                    s_exp[2], int):
                return arg(inner, 0), "repeat_kv", s_exp[2], BHSD
        if len(s_exp) == 4 and len(s_out) == 3 and shape(inner) is not None and (
                shape(inner)[1] == 1 and isinstance(s_exp[1], int)):
            return inner, "expand", s_exp[1], BHSD
    if k == "expand" and not layout.flat:
        s_in, s_exp = shape(arg(node, 0)), shape(node)
        h = layout.head_dim_index
        if s_in is not None and len(s_in) == 4 and s_in[h] == 1 and isinstance(s_exp[h], int):
            return arg(node, 0), "expand", s_exp[h], layout
    if layout.flat and k in ("reshape", "view") and ndim(arg(node, 0)) == 4:
        return arg(node, 0), "mha", 1, BHSD   # [B, H, S, D] flattened: its cache is 4-D
    return node, "mha", 1, layout


def _widens_to_fp32(node) -> bool:
    """node casts a float tensor of at most 32 bits to fp32 (no rounding)."""
    out, src = val(node), val(arg(node, 0))
    return out is not None and src is not None and out.dtype == torch.float32 and (
        src.dtype.is_floating_point and src.dtype.itemsize <= 4)


# --- eager -----------------------------------------------------------------------------------

def _strip_to(node):
    """Follow dtype casts backwards: x.to(dtype) / x.float() -> x."""
    while isinstance(node, fx.Node) and kind(node) == "to" and single_user(node) is not None:
        node = arg(node, 0)
    return node


def _match_eager(softmax: fx.Node) -> AttentionSite | NearMiss:
    dim = arg(softmax, 1, "dim")
    if not is_last_dim(softmax, dim):
        return _miss(softmax, "softmax", softmax, f"softmax over dim {dim}, not the last "
                     f"(key) dim")
    # forwards: softmax -> [to] -> [dropout] -> matmul(p, v); a step may have other users
    # (probabilities returned too): follow the chain, the user check below reports them
    chain_fwd = []
    cur = softmax
    nxt = _next_in_chain(cur)
    dropped = None   # p[..., :-1]: the sink column dropped
    while nxt is not None and (kind(nxt) in ("to", "dropout") or _unviews_scores(nxt)
                               or _reviews_probs(nxt) or zeroes_probs(nxt, cur)
                               or drops_sink_column(nxt, cur) and dropped is None):
        if drops_sink_column(nxt, cur):
            dropped = nxt
        chain_fwd.append(nxt)
        cur, nxt = nxt, _next_in_chain(nxt)
    out = nxt
    # backwards: softmax <- [to] <- [add mask | where] <- [softcap] <- [scale] <- matmul(q, kT)
    chain_bwd = []
    x = arg(softmax, 0, "input")
    scale, softcap = None, 0.0
    while kind(x) == "to":
        chain_bwd.append(x)
        x = arg(x, 0)
    # fairseq / XGLM: softmax over 3-D scores that were viewed to 4-D for the mask and
    # clamped: bmm -> view(B, H, T, L) + mask -> max(s, finfo.min) -> view(B*H, T, L)
    if kind(x) in ("view", "reshape") and ndim(x) == 3 and ndim(arg(x, 0)) == 4:
        chain_bwd.append(x)
        x = arg(x, 0)
        if kind(x) == "max" and len(x.args) == 2 and is_very_negative_const(arg(x, 1)):
            chain_bwd.append(x)
            x = arg(x, 0)
    # softmax's own stabilization, s - s.max(-1).values; then attention sinks
    side = set()   # nodes that read a chain node besides its next step (max, logsumexp)
    stab = stabilized(x)
    if stab is not None:
        x, nodes = stab
        chain_bwd += nodes
        side.update(nodes[1:])
    sink = sink_column(x)
    if isinstance(sink, str):
        return _miss(softmax, "sinks", x, sink)
    if sink is not None:
        if dropped is None:
            return _miss(softmax, "sinks", x, SINK_NOT_DROPPED)
        chain_bwd.append(x)
        x, sink = sink
    elif dropped is not None:
        return _miss(softmax, "sinks", dropped, "the probabilities lose their last column, "
                     "but the softmax has no sink column")
    scores_in = x   # what the masks and scale below read back from
    # masks and position biases, any number in any order (GPT-Neo: where(causal, s, min) +
    # mask; MPT: (s + alibi).masked_fill(m, min); CPM-Ant: masked_fill(s + rel_bias, m, -inf))
    masks: list[tuple] = []
    reader = chain_bwd[-1] if chain_bwd else softmax
    while len(masks) < 4:
        step = mask_step(x) or masked_in_place(x, reader)
        if step is None:
            break
        x, m, k, nodes = step
        chain_bwd += nodes
        reader = nodes[0]
        masks.append((m, k))
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
    if views_scores(x):   # BLOOM: baddbmm's [B*H, T, L] scores viewed as [B, H, T, L]
        chain_bwd.append(x)
        x = arg(x, 0)
    if kind(x) not in ("matmul", "einsum", "baddbmm"):
        return _miss(softmax, "scores", x, "the scores are not q·kᵀ (matmul, @, bmm, baddbmm, "
                     "einsum), optionally scaled, soft-capped and masked")
    qk = x
    ops = qk_operands(qk)
    if isinstance(ops, str):
        return _miss(softmax, "keys", qk, ops)
    q, k, kt = ops.q, ops.k, ops.kt
    if ops.scale != 1.0:
        scale = ops.scale * (scale if scale is not None else 1.0)
    if ops.bias is not None:   # baddbmm's input: an additive mask or bias (BLOOM's ALiBi)
        masks.append((ops.bias, "additive"))
    mask, mask_kind = masks[0] if masks else (None, None)
    for z in chain_fwd:
        # p.masked_fill(m, 0) after the softmax (CPM-Ant) only zeroes keys the softmax
        # already gave 0: the same mask m, applied before it
        if zeroes_probs(z, arg(z, 0)) and not any(
                k == "bool_inverted" and same_value(m, arg(z, 1, "mask")) for m, k in masks):
            return _miss(softmax, "output", z, "the probabilities are masked after the "
                         "softmax by a mask not applied before it")
    pv = pv_operands(out, cur) if out is not None else None
    if pv is None:
        users = ", ".join(f"{u.name} ({_op(u)})" for u in cur.users) or "nothing"
        return _miss(softmax, "output", cur, f"the probabilities do not feed p·v (matmul, bmm, "
                     f"einsum) (used by {users})")
    output, scaled = out, []
    lse = logsumexp_sink(scores_in, out) if sink is None else None
    if isinstance(lse, str):
        return _miss(softmax, "sinks", scores_in, lse)
    if lse is not None:   # Granite-SWA: the sinks as a scale of the output
        sink, scaled, output = lse
        side.add(scaled[0])
    v, v_layout, out_layout = pv.v, pv.v_layout, pv.out_layout
    if ops.q_layout.flat:   # flattened values / output share the query's flattening
        out_layout = ops.q_layout if out_layout.heads else out_layout
        v_layout = ops.q_layout if v_layout.heads else v_layout
    # q-side scale: matmul(q * c, kT)
    if kind(q) in ("mul", "div") and scalar_value(arg(q, 1)) is not None and (
            single_user(q) is qk):
        c = scalar_value(arg(q, 1))
        c = c if kind(q) == "mul" else 1.0 / c
        scale = c * (scale if scale is not None else 1.0)
        chain_bwd.append(q)
        q = arg(q, 0)
    name, cls, stack = _site_location(softmax)
    k_src, gqa_k, rep_k, k_layout = unwrap_gqa(k, ops.k_layout)
    v_src, gqa_v, rep_v, v_layout = unwrap_gqa(v, v_layout)
    chain = [qk] + list(reversed(chain_bwd)) + ([kt] if kt is not None else []) + [
        softmax] + chain_fwd + [out] + scaled[1:] + ([output] if scaled else [])
    site = AttentionSite(
        name=name, module_class=cls, module_stack=stack, pattern="eager", gqa=gqa_k,
        q=q, k=k_src, v=v_src, output=output, chain=chain, mask=mask, mask_kind=mask_kind,
        scale=scale if scale is not None else 1.0, softcap=softcap, n_rep=rep_k,
        q_layout=ops.q_layout, k_layout=k_layout, v_layout=v_layout, out_layout=out_layout,
        more_masks=masks[1:], sinks=sink,
    )
    for n in [qk] + chain_bwd + [softmax] + chain_fwd:
        if n is q or n in side or (in_place_fill(n, chain_bwd) and not n.users):
            continue
        if len([u for u in n.users if not (in_place_fill(u, chain_bwd) or u in side
                                           or reads_shape_only(u, n))]) != 1:
            return site.skip(f"attention scores/probabilities ({n.name}) are used elsewhere")
    if kt is not None and len(kt.users) != 1:
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
        if k == "einsum" and node in u.all_input_nodes:
            return u
        if _unviews_scores(u) or _reviews_probs(u) or zeroes_probs(u, node) or (
                drops_sink_column(u, node)):
            return u
    return None


def _reviews_probs(u) -> bool:
    """u views 3-D probabilities to 4-D only to view them back (XGLM's attn_weights_reshaped)."""
    return kind(u) in ("view", "reshape") and ndim(u) == 4 and ndim(arg(u, 0)) == 3 and any(
        _unviews_scores(w) for w in u.users)


def _unviews_scores(u) -> bool:
    """u views [B, H, T, L] probabilities as [B*H, T, L] for a bmm by the values."""
    def feeds_bmm(n, depth=2):
        return any((kind(w) == "matmul" and arg(w, 0) is n) or (
            depth and kind(w) in ("dropout", "to") and feeds_bmm(w, depth - 1))
            for w in n.users)
    return kind(u) in ("view", "reshape") and ndim(u) == 3 and ndim(arg(u, 0)) == 4 and (
        feeds_bmm(u))


def _check_shapes(site: AttentionSite) -> AttentionSite:
    lq, lk, lv = (site.q_layout or BHSD, site.k_layout or BHSD, site.v_layout or BHSD)
    if lq.heads < 0 or lv.heads < 0:
        return site.skip("flattened [B*H, S, D] values whose heads could not be traced")
    sq, sk, sv = shape(site.q), shape(site.k), shape(site.v)
    if sq is None or sk is None or sv is None:
        return site.skip("q/k/v shapes unknown")
    want = {False: 4, True: 3}
    if len(sq) != want[lq.flat] or len(sk) != want[lk.flat] or len(sv) != want[lv.flat]:
        return site.skip(f"q/k/v are not [B, H, S, D], [B, S, H, D] or [B*H, S, D] "
                         f"(q {len(sq)}-D, k {len(sk)}-D)")
    sq, sk, sv = lq.canon(sq), lk.canon(sk), lv.canon(sv)
    hq, hkv, d, dv = sq[1], sk[1], sq[3], sv[3]
    if not all(isinstance(x, int) for x in (hq, hkv, d, dv)):
        return site.skip("head counts / head_dim are not static")
    if hq % hkv != 0:
        return site.skip(f"{hq} query heads are not a multiple of {hkv} kv heads")
    site.num_q_heads, site.num_kv_heads, site.head_dim, site.v_head_dim = hq, hkv, d, dv
    site.dtype = val(site.q).dtype
    return site
