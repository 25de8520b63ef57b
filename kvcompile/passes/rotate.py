"""Pass 4b: randomized Hadamard rotation of q and k (and of V) at each rewritten attention site
whose config has rotate="hadamard". Runs after the rewrite.

Scores are unchanged by an orthogonal R applied to both q and k ((q R)(k R)^T = q k^T), while
R spreads the keys' outlier channels over all channels before they are quantized. R =
diag(random signs) @ H / sqrt(b): H a Sylvester Hadamard matrix of size b (block-diagonal when
head_dim is not a power of two; b is its largest power-of-two divisor), the signs seeded by the
layer's name, so every graph of a model rotates a layer the same way.

Before:

    v = linear(x, W_v).view(B, S, Hkv, Dv).transpose(1, 2)
    out = torch.ops.kvcompile.attention(q, k, v, mask, pos, "layers.0.attn", s, ...)
    y = linear(out.transpose(1, 2).reshape(B, S, Hq * Dv), W_o)

After, V folded (the graph proves that only views lie between v_proj and the op, and between
the op and o_proj; W_v <- R^T W_v and W_o <- W_o R per head, once, in place):

    out = torch.ops.kvcompile.attention(_rotate(q, R), _rotate(k, R), v, ...)  # v already v R
    y = linear(out.transpose(1, 2).reshape(B, S, Hq * Dv), W_o)               # W_o undoes R

After, V explicit (anything else between them):

    out = _rotate(torch.ops.kvcompile.attention(_rotate(q, R), _rotate(k, R), _rotate(v, Rv),
                                                ...), Rv.T)

Keys stored with per-channel scales (scale_granularity="channel") are left unrotated: those
scales exploit the channel structure a rotation mixes away; the values are rotated all the same.

Folding changes the model's v_proj / o_proj weights, not the function the model computes (in
exact arithmetic); the folded parameters are marked so that no later compile folds them again.
The pass does not fire (and says why) on sites that were not rewritten, on SinkWindow layers
whose keys it would rotate (their sink keys are re-rotated with RoPE, which needs unrotated
keys), and where head_dim has no power-of-two block of at least 8.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from kvcompile.cache.registry import is_quantized
from kvcompile.eviction.policies import rerotated_sinks
from kvcompile.passes.graph_utils import arg, kind, val
from kvcompile.passes.rewrite import _set_meta

_FOLD_MARK = "_kvcompile_rotated"   # set on folded nn.Parameters: (role, layer name)
_VIEW_OPS = ("view", "reshape", "contiguous", "to", "transpose", "permute")


@dataclass
class LayerRotation:
    """How one layer is rotated: the signs of R (q, k) and of Rv (V), and V's mode."""

    signs: tuple
    v_signs: tuple
    seed: int
    v_mode: str          # "folded" | "explicit"
    note: str = ""
    keys: bool = True    # False: keys with per-channel scales stay unrotated

    @property
    def r(self) -> torch.Tensor:
        return rotation_matrix(len(self.signs), self.seed)

    @property
    def rv(self) -> torch.Tensor:
        return rotation_matrix(len(self.v_signs), self.seed + 1)

    def describe(self) -> str:
        how = ("V folded into v_proj/o_proj" if self.v_mode == "folded"
               else f"V rotated explicitly ({self.note})" if self.note
               else "V rotated explicitly")
        if not self.keys:
            return f"hadamard V only (keys keep their per-channel scales); {how}"
        return f"hadamard q,k (D={len(self.signs)}); {how}"


def _rotate(x: torch.Tensor, signs: tuple, inverse: bool = False) -> torch.Tensor:
    """x [..., D] @ R (or @ R^T), R = diag(signs) @ blockdiag(H_b / sqrt(b)), computed in fp32
    by a fast Walsh-Hadamard transform (O(D log D), no matrix), returned in x's dtype."""
    b = hadamard_block(x.shape[-1])
    s = torch.tensor(signs, dtype=torch.float32, device=x.device)
    y = x.float()
    if not inverse:
        y = y * s
    y = _fwht(y, b) * (1.0 / math.sqrt(b))
    if inverse:
        y = y * s
    return y.to(x.dtype)


def _fwht(x: torch.Tensor, b: int) -> torch.Tensor:
    """x [..., D] @ blockdiag(H_b) (Sylvester order; H_b symmetric), unnormalized."""
    h = 1
    while h < b:
        y = x.unflatten(-1, (-1, 2, h))                    # pairs (j, j + h) of blocks of 2h
        lo, hi = y.select(-2, 0), y.select(-2, 1)
        x = torch.stack((lo + hi, lo - hi), dim=-2).flatten(-3)
        h *= 2
    return x


# --- rotation matrices -------------------------------------------------------------------------

def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix [n, n] of +-1 (n a power of two), fp64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_block(d: int) -> int:
    """Largest power of two dividing d."""
    return d & -d


def rotation_signs(d: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randint(0, 2, (d,), generator=g) * 2 - 1).tolist())


def rotation_matrix(d: int, seed: int) -> torch.Tensor:
    """The R [d, d] fp32 that `_rotate(x, rotation_signs(d, seed))` multiplies by."""
    b = hadamard_block(d)
    h = torch.block_diag(*([hadamard(b) / math.sqrt(b)] * (d // b)))
    signs = torch.tensor(rotation_signs(d, seed), dtype=torch.float64)
    return (signs[:, None] * h).float()


def rotates_keys(site) -> bool:
    """Keys stored with per-channel scales are not rotated: those scales exploit the channel
    structure (offsets, outlier channels) that a rotation would mix away (measured: int4
    channel keys lose more with it); their values still are."""
    cfg = site.config
    quantized = is_quantized(cfg.key_dtype)
    return not (quantized and cfg.scale_granularity == "channel")


def why_not_rotatable(site) -> str:
    """'' if the site's pattern allows the rotation, else the reason."""
    policy = site.config.eviction if site.config is not None else None
    if rerotated_sinks(policy) > 0 and rotates_keys(site):
        return (f"{type(policy).__name__} re-rotates its sink keys with RoPE, which needs "
                "unrotated keys; "
                "use sinks=0, H2O / SnapKV, or rotate=None for this layer")
    for name, d in (("head_dim", site.head_dim), ("v head_dim", site.v_head_dim)):
        b = hadamard_block(d)
        if b != d and b < 8:
            return (f"{name} {d} has no power-of-two Hadamard block >= 8 (largest {b}); "
                    f"use rotate=None for this layer")
    return ""


# --- the pass ----------------------------------------------------------------------------------

def rotate_pass(gm: fx.GraphModule, plan, state, example_inputs) -> str:
    sites = [s for s in plan.rewritten if wants_rotation(s)]
    if not sites:
        return "no site asks for rotate='hadamard'"
    ctx = rotation_context(gm, state, example_inputs)
    modes = [rotate_site(gm, site, state, ctx) for site in sites]
    return finish_rotation(gm, modes)


def wants_rotation(site) -> bool:
    return site.rewritten and site.config is not None and site.config.rotate == "hadamard"


@dataclass
class RotationContext:
    """What every site's rotation of one graph shares."""

    rotations: dict      # layer name -> LayerRotation, kept on the model's state
    ops: dict            # layer name -> its kvcompile.attention node
    params: dict         # placeholder -> nn.Parameter


def rotation_context(gm: fx.GraphModule, state, example_inputs) -> RotationContext:
    ops = {n.args[5]: n for n in gm.graph.nodes
           if n.op == "call_function" and n.target is torch.ops.kvcompile.attention.default}
    return RotationContext(state.__dict__.setdefault("rotations", {}), ops,
                           _real_params(gm, example_inputs))


def rotate_site(gm: fx.GraphModule, site, state, ctx: RotationContext) -> str:
    """Rotate one rewritten site: returns its V mode ("folded" / "explicit"), or "" when its
    pattern does not allow the rotation (site.rotation says why)."""
    node = ctx.ops.get(site.name)
    reason = why_not_rotatable(site) or ("" if node is not None else
                                         "attention op not found after the rewrite")
    if reason:
        site.rotation = f"not rotated: {reason}"
        return ""
    rot = ctx.rotations.get(site.name)
    if rot is None:
        rot = _new_rotation(site, node, ctx.params)
        ctx.rotations[site.name] = rot
    _insert(gm, node, site, rot)
    site.rotation = rot.describe()
    if site.layer_meta is not None:          # a layer joining the pool with this graph
        site.layer_meta["rotate"] = site.rotation
    if 0 <= site.layer_index < len(state.layer_meta):
        state.layer_meta[site.layer_index]["rotate"] = site.rotation
    return rot.v_mode


def finish_rotation(gm: fx.GraphModule, modes: list[str]) -> str:
    gm.graph.lint()
    gm.recompile()
    done = [m for m in modes if m]
    out = (f"{len(done)} site(s) rotated (V folded: {done.count('folded')}, explicit: "
           f"{done.count('explicit')})")
    if len(done) < len(modes):
        out += f"; {len(modes) - len(done)} left unrotated (see the report)"
    return out


def _new_rotation(site, node: fx.Node, params: dict) -> LayerRotation:
    seed = zlib.crc32(site.name.encode())
    signs = rotation_signs(site.head_dim, seed)
    v_signs = rotation_signs(site.v_head_dim, seed + 1)
    keys = rotates_keys(site)
    fold, why = _fold_plan(node, site, params)
    if fold is None:
        return LayerRotation(signs, v_signs, seed, "explicit", why, keys)
    rot = LayerRotation(signs, v_signs, seed, "folded", "", keys)
    w_v, b_v, w_o = fold
    if {getattr(p, _FOLD_MARK, None) for p in (w_v, w_o)} != {None}:
        return rot  # folded by an earlier compile of this model: V is rotated already
    _fold(w_v, b_v, w_o, rot.rv, site.num_kv_heads, site.num_q_heads)
    for p, role in ((w_v, "v_proj"), (w_o, "o_proj")):
        setattr(p, _FOLD_MARK, (role, site.name))
    return rot


def _insert(gm: fx.GraphModule, node: fx.Node, site, rot: LayerRotation) -> None:
    """q, k (and v) of the op -> _rotate(...); the op's output -> _rotate(out, inverse) if V
    is rotated explicitly. The signs are literals of the graph: no new tensor constants."""
    graph = gm.graph
    args = list(node.args)
    todo = ((0, rot.signs), (1, rot.signs)) if rot.keys else ()
    if rot.v_mode == "explicit":
        todo += ((2, rot.v_signs),)
    with graph.inserting_before(node):
        for i, signs in todo:
            rotated = graph.call_function(_rotate, (args[i], signs))
            _set_meta(rotated, args[i])
            args[i] = rotated
    node.args = tuple(args)
    if rot.v_mode == "explicit":
        with graph.inserting_after(node):
            back = graph.call_function(_rotate, (node, rot.v_signs, True))
        _set_meta(back, node)
        node.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)


# --- proving and applying the V fold -----------------------------------------------------------

def _real_params(gm: fx.GraphModule, example_inputs) -> dict:
    """placeholder node -> the nn.Parameter it is (Dynamo lifts parameters to inputs)."""
    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, x in zip(placeholders, example_inputs):
        if isinstance(x, torch.nn.Parameter):
            out[n] = x
    return out


def _fold_plan(node: fx.Node, site, params: dict):
    """((W_v, b_v or None, W_o), '') if only views lie between v_proj and the op and between
    the op and o_proj, with all tensors private to that path; else (None, why)."""
    v_lin, why = _v_source(node, site)
    if v_lin is None:
        return None, why
    o_lin, why = _o_sink(node, site)
    if o_lin is None:
        return None, why
    w_v, b_v = arg(v_lin, 1, "weight"), arg(v_lin, 2, "bias")
    w_o = arg(o_lin, 1, "weight")
    found = []
    for w in (w_v, b_v, w_o):
        if w is None:
            found.append(None)
            continue
        p = _param_of(w, params)
        if p is None or not p.is_floating_point():
            return None, "v_proj / o_proj weights are not parameters used only there"
        found.append(p)
    hv, dv, hq = site.num_kv_heads, site.v_head_dim, site.num_q_heads
    # a sharded weight: the rank's own rows of v_proj (colwise) and columns of o_proj
    # (rowwise) must be whole local heads, which the local shapes show
    if tuple(_local(found[0]).shape[:1]) != (hv * dv,) or _local(found[2]).shape[-1] != hq * dv:
        return None, "v_proj / o_proj shapes do not match the heads"
    return (found[0], found[1], found[2]), ""


def _param_of(w, params: dict):
    """The nn.Parameter a linear's weight (or bias) node is, used only there: a lifted
    parameter, or, under tensor parallelism (HF tp_plan), `param.to_local()` of a DTensor
    parameter, whose local shard the fold rotates in place."""
    if not isinstance(w, fx.Node) or len(w.users) != 1:
        return None
    if w.op == "call_method" and w.target == "to_local" and isinstance(w.args[0], fx.Node):
        src = w.args[0]
        return params.get(src) if len(src.users) == 1 else None
    return params.get(w)


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local shard (the rank's heads); any other tensor itself."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


def _v_source(op: fx.Node, site):
    """The linear producing v through views only: [.., Hkv*Dv] -> [B, Hkv, S, Dv]."""
    chain = []
    n = op.args[2]
    while isinstance(n, fx.Node) and kind(n) in _VIEW_OPS:
        chain.append(n)
        n = arg(n, 0)
    if not (isinstance(n, fx.Node) and kind(n) == "linear"):
        return None, "v is not a linear projection followed by views"
    for c in [n] + chain:
        if any(u not in chain and u is not op and not _shape_only(u) for u in c.users):
            return None, "v_proj's output has other users"
    hv, dv = site.num_kv_heads, site.v_head_dim
    start = _columns(n, hv, dv, merged=True)
    if start is None or not _is_split(_replay(list(reversed(chain)), start), hv, dv):
        return None, "the views between v_proj and attention are not a head split"
    return n, ""


def _o_sink(node: fx.Node, site):
    """The linear consuming the op output through views only: [B, Hq, S, Dv] -> [.., Hq*Dv]."""
    chain, n = [], node
    while True:
        users = list(n.users)
        if len(users) != 1:
            return None, "the attention output has other users"
        u = users[0]
        if kind(u) == "linear" and arg(u, 0) is n:
            break
        if kind(u) not in _VIEW_OPS or arg(u, 0) is not n:
            return None, f"{getattr(u.target, '__name__', u.target)} lies between attention " \
                         f"and o_proj"
        chain.append(u)
        n = u
    hq, dv = site.num_q_heads, site.v_head_dim
    start = _columns(node, hq, dv, merged=False)
    if start is None or not _is_merge(_replay(chain, start), hq, dv):
        return None, "the views between attention and o_proj are not a head merge"
    return u, ""


def _hint_shape(node: fx.Node) -> tuple | None:
    """The node's recorded shape with symbolic sizes replaced by their example values."""
    v = val(node)
    if v is None:
        return None
    out = []
    for dim in v.shape:
        if isinstance(dim, int):
            out.append(dim)
            continue
        hint = getattr(getattr(dim, "node", None), "hint", None)
        if hint is None:
            return None
        out.append(int(hint))
    return tuple(out)


def _columns(node: fx.Node, heads: int, d: int, merged: bool) -> torch.Tensor | None:
    """A tensor of the node's (example) shape holding, in each element, the column h*d + j of
    the merged [.., heads*d] layout that element belongs to."""
    shape = _hint_shape(node)
    if shape is None and not merged:  # the op's output: q's shape with v's head dim
        q, v = _hint_shape(node.args[0]), _hint_shape(node.args[2])
        shape = None if q is None or v is None else (*q[:-1], v[-1])
    if shape is None:
        return None
    if merged:
        if shape[-1] != heads * d:
            return None
        return torch.arange(heads * d).expand(*shape)
    if len(shape) != 4 or shape[1] != heads or shape[3] != d:
        return None
    col = torch.arange(heads)[:, None, None] * d + torch.arange(d)[None, None, :]
    return col.expand(*shape)


def _replay(chain: list[fx.Node], x: torch.Tensor | None) -> torch.Tensor | None:
    """Apply the chain's views / transposes to x (their shapes from the recorded values)."""
    for n in chain:
        if x is None:
            return None
        k = kind(n)
        if k in ("contiguous", "to"):
            continue
        if k == "transpose":
            d0, d1 = arg(n, 1, "dim0"), arg(n, 2, "dim1")
            if not (isinstance(d0, int) and isinstance(d1, int)):
                return None
            x = x.transpose(d0, d1)
        elif k == "permute":
            dims = n.args[1:] if len(n.args) > 2 else arg(n, 1, "dims")
            if not all(isinstance(i, int) for i in dims):
                return None
            x = x.permute(*dims)
        else:  # view / reshape: the target is the recorded output shape
            shape = _hint_shape(n)
            if shape is None or math.prod(shape) != x.numel():
                return None
            x = x.reshape(shape)
    return x


def _is_split(x: torch.Tensor | None, heads: int, d: int) -> bool:
    """x [B, heads, S, d]: element (b, h, s, j) holds column h*d + j."""
    if x is None or x.dim() != 4 or x.shape[1] != heads or x.shape[3] != d:
        return False
    want = torch.arange(heads)[:, None, None] * d + torch.arange(d)[None, None, :]
    return bool((x == want).all())


def _is_merge(x: torch.Tensor | None, heads: int, d: int) -> bool:
    """x [.., heads*d]: element c of the last dim holds column c."""
    return x is not None and x.shape[-1] == heads * d and bool(
        (x == torch.arange(heads * d)).all())


def _shape_only(u: fx.Node) -> bool:
    """A user that reads only the shape (stubs of the rewrite, size queries)."""
    name = getattr(u.target, "__name__", "")
    return kind(u) == "size" or name in ("_virtual_cat", "_zero_stub", "_slice_positions")


@torch.no_grad()
def _fold(w_v: torch.Tensor, b_v, w_o: torch.Tensor, rv: torch.Tensor, hkv: int,
          hq: int) -> None:
    """W_v[h] <- R^T W_v[h] (rows of kv head h), b_v[h] <- b_v[h] R, W_o[:, h] <- W_o[:, h] R
    (columns of q head h); computed in fp64. Sharded weights (DTensors) are folded in their
    local shards: the same R for every head, so each rank rotates its own heads."""
    w_v, w_o = _local(w_v), _local(w_o)
    b_v = _local(b_v) if b_v is not None else None
    dv = rv.shape[0]
    r = rv.double().to(w_v.device)
    wv = w_v.double().view(hkv, dv, -1)
    w_v.copy_(torch.einsum("ji,hjc->hic", r, wv).reshape(w_v.shape).to(w_v.dtype))
    if b_v is not None:
        b_v.copy_((b_v.double().view(hkv, dv) @ r).reshape(b_v.shape).to(b_v.dtype))
    wo = w_o.double().view(w_o.shape[0], hq, dv)
    w_o.copy_((wo @ r.to(w_o.device)).reshape(w_o.shape).to(w_o.dtype))
