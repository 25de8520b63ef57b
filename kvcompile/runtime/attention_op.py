"""`torch.ops.kvcompile.attention`: the one op the rewrite pass inserts for attention.

    out = torch.ops.kvcompile.attention(q, k, v, attn_mask, positions, layer, scale, is_causal,
                                        sliding_window, softcap, tag, key_mask=None,
                                        sink_logits=None)
    # q: [B, Hq, S, D]  k: [B, Hkv, S, D]  v: [B, Hkv, S, Dv]  ->  out: [B, Hq, S, Dv]
    # sink_logits: [Hq] or None

Attention sinks (gpt-oss, Flint, MiMo, Granite-SWA): `sink_logits[h]` is a learned logit of
query head h that joins the softmax's denominator as a column whose probability is dropped,
out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h)). Every path that attends takes it
(the references, the Triton decode and chunked-prefill kernels) or refuses with the reason:
the CUDA decode kernel (the Triton one runs), eviction (the pass leaves the site alone), a
hook's `attend` (an error).

The mask is `attn_mask & key_mask` when the rewrite found the model's mask to be an AND of a
part shared by the batch ([1, 1, S, L]: causality, a window) and a per-row key part ([B, 1, 1,
L]: padding), passes/mask_inputs.py: the [B, 1, S, L] product is never built (kernels/masks.py
reads the two block by block; only a dense fallback materializes it, once per forward).

Layout: the op is tagged `flexible_layout`: inductor hands it its inputs as they are realized,
without a copy to the strides the FX graph recorded. With the default constraint inductor
copies an unrealized input (the model's mask is one: a pointwise of aranges and the 2-d mask)
once per op that reads it, one [B, 1, S, L] buffer per layer alive together (six 8 GiB masks
in the B16 x 32k prefill on the H200). The op accepts any strides. Its output [B, H, S, Dv]
is laid out in memory as [B, S, H, Dv] (a transposed contiguous tensor, `_as_promised`), the
layout every model's next step wants (`out.transpose(1, 2).reshape(B, S, H * Dv)` for the
output projection: a view then) and the one SDPA already returns for a q that is a transposed
view of the projection, as the models' q is; a BHSD-contiguous output cost two full copies of
it a layer in a prefill (SDPA's to BHSD, inductor's back: 17 ms of a 440 ms first token at 16
prompts of 4,096 tokens on an H100, `profile_engine.py --prefill`). At S = 1 the two layouts
are the same memory.

With a forward context (runtime/context.py) the new k/v are written into the pool in the
layer's format, then q attends over the sequence's tokens as stored; who attends is decided by
runtime/dispatch.py `attend`. Without one (a graph run outside kvcompile's wrapper) it is plain
attention over the given k/v. `tag` carries the config's hash so that inductor's cache key
changes with the config.

What it mutates. The op writes the pool (the new K/V, and the pool's bookkeeping: slots,
lengths), but the pool is not an argument: it lives outside the graph and is found through the
forward context, so that graph inputs, shapes and guards never change as the cache grows, pages
move or the pool is rebuilt. `mutates_args` can only name arguments, so it is empty, and the op
is registered with `torch.fx.node.has_side_effect` instead: FX dead-code elimination (Dynamo,
AOTAutograd) and inductor's scheduler (`is_impure`) keep a call whose output nobody reads,
which aot_eager and inductor drop for an op not so registered (tests/runtime/
test_attention_op.py). Order needs no more than the
data: layer l + 1's q is computed from layer l's output, each call writes before it reads
within itself, layers own disjoint storage, and nothing else in a graph reads the pool.
(`register_effect(ORDERED)` would also order the calls, by threading effect tokens through
every compiled graph's inputs and outputs: a change of every graph, not made here.)
"""

from __future__ import annotations

import math

import torch

from kvcompile.errors import NonFiniteKVError
from kvcompile.kernels import latent as latent_ref
from kvcompile.kernels import masks
from kvcompile.kernels.dense import dense_attention
from kvcompile.runtime import context as _context
from kvcompile.runtime import cpu_decode, dispatch


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None, positions: torch.Tensor | None, layer: str,
               scale: float, is_causal: bool, sliding_window: int, softcap: float,
               tag: str, key_mask: torch.Tensor | None = None,
               sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    ctx = _context.current()
    _context.require_packed(tag, layer)
    if sink_logits is not None:
        _check_sinks(sink_logits, q)
    if ctx is None or ctx.binding is None and ctx.plan is None:
        # (the layout the fake promises: SDPA's output follows q's, which may be a transpose)
        return _as_promised(dense_attention(q, k, v, masks.combine(attn_mask, key_mask), scale,
                                            is_causal, sliding_window, softcap, sink_logits), q)
    if key_mask is not None:
        attn_mask = key_mask if attn_mask is None else masks.AndMask(attn_mask, key_mask)
    return _cached_attention(ctx, q, k, v, attn_mask, positions, layer, scale, is_causal,
                             sliding_window, softcap, sink_logits)


attention = torch.library.custom_op("kvcompile::attention", mutates_args=(),
                                    tags=(torch.Tag.flexible_layout,))(_attention)


@attention.register_fake
def _(q, k, v, attn_mask, positions, layer, scale, is_causal, sliding_window, softcap, tag,
      key_mask=None, sink_logits=None):
    B, H, S, _ = q.shape
    return q.new_empty((B, S, H, v.shape[-1])).transpose(1, 2)   # see _as_promised


# the pool is written outside the op's arguments: no pass may drop a call (see the docstring)
torch.fx.node.has_side_effect(torch.ops.kvcompile.attention.default)


def _latent_attention(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                      attn_mask: torch.Tensor | None, positions: torch.Tensor | None, layer: str,
                      scale: float, is_causal: bool, sliding_window: int, softcap: float,
                      tag: str, key_mask: torch.Tensor | None = None,
                      kv_b_weight: torch.Tensor | None = None, nope_dim: int = 0
                      ) -> torch.Tensor:
    """MLA (passes/find_latent.py): q [B, H, S, dn + dr] (no-rope part, then rotary part),
    latent [B, 1, S, r] and rope [B, 1, S, dr] of this forward's tokens, kv_b_weight
    [H * (dn + dv), r] -> [B, H, S, dv]: attention over the keys k = [W_UK c, k_rope] and values
    v = W_UV c of the cached latents c. With a forward context the latent and rotary key are
    stored as the layer's keys and values, and attention runs in the latent space
    (runtime/dispatch.py `attend_latent`); without one, over the expanded given tokens.
    (kv_b_weight and nope_dim follow key_mask, which the mask pass may set, so they have
    defaults; the rewrite always passes them.)"""
    if kv_b_weight is None or nope_dim <= 0:
        raise ValueError(f"kvcompile.latent_attention({layer!r}) needs kv_b_weight and "
                         f"nope_dim > 0 (got nope_dim={nope_dim}); the MLA rewrite passes both")
    ctx = _context.current()
    _context.require_packed(tag, layer)
    if ctx is None or ctx.binding is None and ctx.plan is None:
        k, v = latent_ref.expand_latent(latent, rope, kv_b_weight, nope_dim, q.shape[1])
        return _contiguous(dense_attention(q, k, v, masks.combine(attn_mask, key_mask), scale,
                                           is_causal, sliding_window, softcap), q)
    if key_mask is not None:
        attn_mask = key_mask if attn_mask is None else masks.AndMask(attn_mask, key_mask)
    li, plan, mask_info = _store(ctx, q, latent, rope, attn_mask, positions, layer, is_causal,
                                 sliding_window)
    if scale is None or scale <= 0:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out = dispatch.attend_latent(ctx, li, q, plan, mask_info, attn_mask, is_causal,
                                 sliding_window, softcap, scale, kv_b_weight, nope_dim,
                                 fresh=(latent, rope))
    return _contiguous(out, q)


latent_attention = torch.library.custom_op("kvcompile::latent_attention", mutates_args=(),
                                           tags=(torch.Tag.flexible_layout,))(_latent_attention)


@latent_attention.register_fake
def _(q, latent, rope, attn_mask, positions, layer, scale, is_causal, sliding_window, softcap,
      tag, key_mask=None, kv_b_weight=None, nope_dim=0):
    heads = q.shape[1]
    v_dim = kv_b_weight.shape[0] // heads - nope_dim
    return q.new_empty((*q.shape[:-1], v_dim))


torch.fx.node.has_side_effect(torch.ops.kvcompile.latent_attention.default)


def _direct(op, impl):
    def call(*args, **kwargs):
        # with grad enabled the op keeps its autograd contract (it has no backward)
        if torch.is_grad_enabled():
            return op(*args, **kwargs)
        return impl(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"kvcompile_{impl.__name__.lstrip('_')}"
    return call


# A graph that the eager inner compiler runs calls these instead of the ops (backend.py
# `compile_inner`): the same implementation, without the custom op's Python dispatch
# (autograd wrapper, redispatch, output aliasing check: about 20 us a call on the CPU, once
# per layer and step). Tracing compilers (inductor, aot_eager) keep the ops.
DIRECT_CALLS = {
    torch.ops.kvcompile.attention.default: _direct(torch.ops.kvcompile.attention.default,
                                                   _attention),
    torch.ops.kvcompile.latent_attention.default: _direct(
        torch.ops.kvcompile.latent_attention.default, _latent_attention),
}


def _check_sinks(sink_logits: torch.Tensor, q: torch.Tensor) -> None:
    # sink_logits: [Hq], one logit per query head
    if sink_logits.dim() != 1 or sink_logits.shape[0] != q.shape[1] or not (
            sink_logits.dtype.is_floating_point):
        raise ValueError(f"kvcompile.attention: sink_logits must be a float tensor [Hq] = "
                         f"[{q.shape[1]}] (one sink logit per query head); got "
                         f"{sink_logits.dtype} {tuple(sink_logits.shape)}")


def _cached_attention(ctx, q, k, v, attn_mask, positions, layer, scale, is_causal,
                      sliding_window, softcap, sink_logits=None):
    state = ctx.state
    if scale is None or scale <= 0:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if attn_mask is None and sink_logits is None and not softcap:
        # a CPU decode step: fewer ops (built by the forward's first layer, kept in its plan)
        plan = ctx.plan
        step = None if plan is None else plan.cache.get(cpu_decode.KEY)
        if not step or q.shape[0] != 1 or q.shape[2] != 1:
            step = cpu_decode.for_forward(ctx, q, positions)
        if step is not None:
            out = step.attend(state.layer_index(layer), q, k, v, scale, sliding_window)
            if out is not None:
                return _as_promised(out, q)
    li, plan, mask_info = _store(ctx, q, k, v, attn_mask, positions, layer, is_causal,
                                 sliding_window)
    extras = {}
    for hook in state.hooks:
        extras.update(hook.attention_extras(ctx, li))
    if sink_logits is not None:
        extras["sink_logits"] = sink_logits.float().contiguous()
    out = dispatch.attend(ctx, li, q, plan, mask_info, attn_mask, is_causal, sliding_window,
                          softcap, scale, extras, fresh=(k, v))
    for hook in state.hooks:
        hook.after_attention(ctx, li, q, out, extras)
    return _as_promised(out, q)


def _as_promised(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """out [B, Hq, S, Dv] as the attention op's fake promises it (inductor asserts the strides
    it was told): in q's dtype, laid out as a contiguous [B, S, Hq, Dv] (module docstring)."""
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
    t = out.transpose(1, 2)
    return out if t.is_contiguous() else t.contiguous().transpose(1, 2)


def _contiguous(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """out as the latent op's fake promises it: a contiguous [B, H, S, Dv] in q's dtype."""
    out = out.to(q.dtype)
    return out if out.is_contiguous() else out.contiguous()


def _store(ctx, q, k, v, attn_mask, positions, layer, is_causal, sliding_window):
    """Prepare the forward's plan (once per forward), read the mask's structure, and write
    this forward's k [B, Hkv, S, D] / v [B, Hkv, S, Dv] into the layer's pages.
    -> (layer index, plan, mask_info)."""
    state = ctx.state
    li = state.layer_index(layer)
    plan = ctx.prepare(q.shape[0], q.shape[2], positions, q.device)
    pool = state.pool
    B, Hkv, S, D = k.shape
    if plan.packed:  # engine: [1, H, T, D] packed over sequences
        k_flat = k[0].transpose(0, 1).reshape(-1, Hkv, D)
        v_flat = v[0].transpose(0, 1).reshape(-1, Hkv, v.shape[-1])
    elif S == 1:     # a decode step: [B, Hkv, 1, D] is [B, Hkv, D] as it is (one op, not two)
        k_flat = k.reshape(B, Hkv, D)
        v_flat = v.reshape(B, Hkv, v.shape[-1])
    else:
        k_flat = k.transpose(1, 2).reshape(B * S, Hkv, D)
        v_flat = v.transpose(1, 2).reshape(B * S, Hkv, v.shape[-1])
    mask_info = None
    if attn_mask is not None and not plan.packed:
        mask_info = masks.analyze(plan, attn_mask, is_causal, sliding_window)
        _update_kv_start(ctx, plan, mask_info)
    if not plan.packed and _pads_new_tokens(plan):
        # left padding among the new tokens: their K/V are stored as zeros, never attended
        # (where, not a product: a pad token's K/V may be NaN, its row of the mask being empty)
        keep = masks.token_keep(plan, k.device)[:, None, None]  # [B*S, 1, 1] bool
        k_flat = torch.where(keep, k_flat, k_flat.new_zeros(()))
        v_flat = torch.where(keep, v_flat, v_flat.new_zeros(()))
    for hook in state.hooks:
        k_flat, v_flat = hook.before_write(ctx, li, k_flat, v_flat)
    if state.config.check_finite:
        _check_finite(li, "key", k_flat, plan)
        _check_finite(li, "value", v_flat, plan)
    pool.write(li, plan.slots, k_flat, v_flat, plan.slots_host, grouped=plan.slots_grouped)
    return li, plan, mask_info


def _pads_new_tokens(plan) -> bool:
    """Whether some row's left padding reaches into this forward's new tokens (once per
    forward: kv_start only changes in `_update_kv_start`, which drops the memo)."""
    pads = plan.cache.get("pads_new_tokens")
    if pads is None:
        pads = plan.cache["pads_new_tokens"] = any(
            s > p for s, p in zip(plan.kv_start, plan.past_lens))
    return pads


def _update_kv_start(ctx, plan, mask_info) -> None:
    """Left padding from the mask of a prefill (or of a prefill chunk): a row whose cached
    tokens are all padding (kv_start >= past) takes the mask's kv_start, so that a row's
    padding may span several chunks of a chunked prefill (HF prefill_chunk_size)."""
    new = [max(s, m) if s >= p else s
           for s, m, p in zip(plan.kv_start, mask_info.kv_start, plan.past_lens)]
    if new != plan.kv_start:
        plan.kv_start = new
        plan.cache.pop("pads_new_tokens", None)
        if ctx.binding is not None:
            ctx.binding.kv_start = list(new)


def _check_finite(layer: int, which: str, x: torch.Tensor, plan) -> None:
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        t, h, _ = (int(i) for i in bad.nonzero()[0])
        if plan.packed:
            row, pos = 0, t
        else:
            row, pos = divmod(t, plan.new_tokens)
            pos += plan.past_lens[row]
        raise NonFiniteKVError(layer, which, row, pos, h)
