"""Who attends: the one ordered dispatch of every attention op's layer, and the kernels' choice.

    out = attend(ctx, layer, q, plan, mask_info, attn_mask, is_causal, window, softcap, scale,
                 extras)           # q: [B, Hq, S, D] -> out: [B, Hq, S, Dv]

`attend` asks, in this order, and the first that answers attends:

1. eviction: a layer with an eviction policy attends over its kept slots (eviction/runtime.py;
   through the decode kernel where the kept slots allow it);
2. an extension hook's `attend` (runtime/hooks.py), in the order of `state.hooks`;
3. packed engine decode: an engine step in which every sequence adds one token runs the
   split-K decode kernel (q [1, Hq, B, D] seen as [B, Hq, 1, D]), not the varlen prefill
   kernel, which has one program per query block and no split over the keys;
4. the kernels (`KernelDispatch.attend`): the CUDA decode kernel on sm_90 where it applies,
   else the Triton decode or chunked-prefill kernel, for pages they read (kernel_formats.py);
5. the reference over the stored pages (kernels/dense.py), exact for every format.

Kernels get tensors, block tables and constants: never the pool or the forward context.

Attention sinks arrive as `extras["sink_logits"]` ([Hq] fp32, runtime/attention_op.py), so
every kernel call below passes them on. Who cannot take them says so: an eviction policy or a
hook's `attend` on a layer with sinks raises (the eviction pass already leaves such a site
alone), the CUDA decode kernel gives way to the Triton one (`_decode_backend`), and the fresh
prefill's SDPA is skipped (it has no sink input).
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch

from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels import masks
from kvcompile.kernels.dense import (
    compute_dtype,
    paged_reference_attention,
    sdpa_attention,
    sdpa_packed,
    sdpa_rows,
)
from kvcompile.kernels.latent import (
    absorb_query,
    expand_latent,
    expand_rows,
    latent_output,
    paged_latent_expanded,
)
from kvcompile.runtime.context import StepPlan
from kvcompile.runtime.hooks import RuntimeHook
from kvcompile.runtime.kernel_formats import kernel_readable

log = logging.getLogger("kvcompile")


def attend(ctx, layer: int, q, plan, mask_info, attn_mask, is_causal, window, softcap, scale,
           extras: dict, fresh=None):
    """Attention of layer `layer` over the pages of the plan's sequences (the new K/V are
    already written): out [B, Hq, S, Dv] (fp32 or q's dtype). See the module docstring.
    fresh: (k, v) [B, Hkv, S, D] as the model computed them, for a fresh prompt's prefill
    (`_fresh_prefill`)."""
    state = ctx.state
    ev = state.eviction
    sinks = extras.get("sink_logits")
    if sinks is not None:
        _refuse_sinks(state, layer)
    # attn_mask may be a masks.AndMask (two parts never multiplied out): the kernels take the
    # structure in mask_info; the paths that apply a mask as given get it built (once per
    # forward, masks.dense)
    if ev is not None:
        if (mask_info is not None and not mask_info.exact and not plan.is_decode
                and not plan.packed and layer in ev.policies):
            ev.mark_holes(plan)   # a prompt mask with holes: no decode step steps aside
        if layer in ev.policies and ev.takes_plain_prefill(plan, layer):
            # nothing evicted yet: the prompt attends as without eviction; SnapKV's
            # observation rows and H2O's mass are scored apart
            out = _attend_plain(ctx, layer, q, plan, mask_info, attn_mask, is_causal, window,
                                softcap, scale, extras, fresh)
            ev.observe_prefill(ctx, layer, q, plan, attn_mask, is_causal, window, softcap,
                               scale)   # (an AndMask: only the observed rows are built)
            ev.prompt_mass(ctx, layer, q, plan, attn_mask, mask_info, is_causal, window,
                           softcap, scale)   # H2O: one extra pass over Q K^T
            return out
        if layer in ev.policies and plan.packed and not plan.eviction_aside:
            # an engine step of prompt chunks and of sequences already evicted (or decode
            # rows that add up H2O mass): the plain kernels attend the whole step (H2O's
            # prompt rows add up their mass apart), then the eviction runtime attends its
            # rows over their kept slots, in place (decode rows through the paged decode
            # kernel where their slots allow)
            plain = ev.plain_rows(plan, layer)
            if any(plain):
                out = _attend_plain(ctx, layer, q, plan, mask_info, attn_mask, is_causal,
                                    window, softcap, scale, extras, fresh)
                only = {i for i, p in enumerate(plain) if p}
                ev.observe_prefill(ctx, layer, q, plan, None, is_causal, window, softcap,
                                   scale, only=only)
                ev.prompt_mass(ctx, layer, q, plan, None, None, is_causal, window, softcap,
                               scale, only=only)
            else:
                out = torch.empty((*q.shape[:-1], state.pool.v[layer].head_dim),
                                  dtype=torch.float32, device=q.device)
            return ev.attend_kept(ctx, layer, q, plan, None, is_causal, window, softcap,
                                  scale, extras,
                                  rows={i for i, p in enumerate(plain) if not p}, into=out)
        if plan.eviction_aside and not plan.packed:
            # a `generate` decode step stepped aside for (integrations/hf_graphs.py): the
            # stored slots are the keys (decode_aside: no left padding, no prompt mask with
            # holes, and generate's decode mask is all ones); the HF mask, whose columns are
            # logical indices, is not applied to them
            attn_mask = mask_info = None
        out = ev.attend_kept(ctx, layer, q, plan,
                             _kept_mask(plan, attn_mask),
                             is_causal, window, softcap, scale, extras)
        if out is not None:
            return out
    return _attend_plain(ctx, layer, q, plan, mask_info, attn_mask, is_causal, window, softcap,
                         scale, extras, fresh)


def _attend_plain(ctx, layer, q, plan, mask_info, attn_mask, is_causal, window, softcap, scale,
                  extras, fresh):
    """`attend` past the eviction runtime: hooks, a fresh prompt on SDPA, packed decode, the
    kernels, the reference."""
    state = ctx.state
    sinks = extras.get("sink_logits")
    for hook in state.hooks:
        if type(hook).attend is RuntimeHook.attend:
            continue
        out = hook.attend(ctx, layer, q, plan, masks.dense(plan, attn_mask), is_causal, window,
                          softcap, scale, extras)
        if out is not None:
            return out
    out = _fresh_prefill(state, layer, q, fresh, plan, mask_info, attn_mask, is_causal, window,
                         softcap, scale, extras)
    if out is None:
        out = _packed_decode(state, layer, q, plan, window, softcap, scale, extras)
    if out is None:
        out = state.kernels.attend(layer, q, plan, mask_info, attn_mask, is_causal, window,
                                   softcap, scale, extras)
    if out is None:
        pool = state.pool
        out = paged_reference_attention(pool.k[layer], pool.v[layer], q, plan,
                                        masks.dense(plan, attn_mask), is_causal, window,
                                        softcap, scale, sinks)
    return out


def _refuse_sinks(state, layer: int) -> None:
    """Attention sinks on a layer whose attention an eviction policy or a hook replaces: those
    paths have no sink input, and a result without the sinks would be silently wrong."""
    ev = state.eviction
    if ev is not None and layer in ev.policies:
        raise UnsupportedShapeError(
            f"layer {layer} has attention sinks (a per-head sink logit) and an eviction policy, "
            f"whose attention over kept slots has no sink input; remove the policy for this "
            f"module (kvcompile.configure(module, eviction=None))")
    for hook in state.hooks:
        if type(hook).attend is not RuntimeHook.attend and hook is not ev:
            raise UnsupportedShapeError(
                f"layer {layer} has attention sinks (a per-head sink logit), and the hook "
                f"{type(hook).__name__} replaces attention (RuntimeHook.attend), which has no "
                f"sink input; remove the hook from state.hooks for this model")


def _fresh_prefill(state, layer, q, fresh, plan, mask_info, attn_mask, is_causal, window,
                   softcap, scale, extras):
    """A fresh prompt's prefill (no token of any row cached before this forward) attends to its
    K/V as the model computed them, with torch SDPA (flash / cuDNN on CUDA: faster than the
    paged kernels, and no gather of the pages just written), as the model's own path and
    vLLM's do; the pages are written all the same, for the decode steps.
    KVConfig(prefill_attends="stored") attends to the stored (quantized) pages instead.

    Taken for causal (or unmasked) attention without window or softcap, where SDPA needs no
    [B, S, L] mask, and for left padding a row at a time (`_fresh_mode`); anything else (a
    window shorter than the prompt, a custom mask) goes to the paged paths. SnapKV's
    observation rows and H2O's prompt mass are scored apart (`EvictionRuntime.observe_prefill`,
    `prompt_mass`).
    -> [B, Hq, S, Dv] in compute_dtype(q.dtype), or None. A layer that took it is marked in
    the forward's plan (`attended_fresh(plan, layer)`: what `kvcompile inspect --verify` holds
    the output against)."""
    if plan.packed:
        return _fresh_packed(state, layer, q, fresh, plan, window, softcap, scale, extras)
    causal, starts = _fresh_mode(state, layer, q, fresh, plan, mask_info, attn_mask,
                                 is_causal, window, softcap, extras)
    if causal is None and starts is None:
        return None
    k, v = fresh
    state.count("prefill_fresh_sdpa")
    plan.cache[("attended_fresh", layer)] = True
    if starts is not None:
        return _padded_rows(state, q, k, v, starts, scale)
    if causal and state.config.prefill_attends == "fresh_fp8" and _fp8_fresh_ok(state, q, v):
        B, Hq, S, _ = q.shape
        cu = torch.arange(0, B + 1, dtype=torch.int32, device=q.device) * S
        out = _packed_fp8(state, _tokens(q), _tokens(k), _tokens(v), cu, S, scale)
        return out.view(B, S, Hq, -1).transpose(1, 2)
    return sdpa_attention(q, k, v, None, None, scale, causal)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [B * S, H, D]: the rows' tokens, packed."""
    return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], x.shape[3])


def _fp8_fresh_ok(state, q, v) -> bool:
    """Whether prefill_attends="fresh_fp8" can take this layer's fresh prompt (the FP8 prefill
    kernels' head dims); where not, it attends as "fresh" does, said once."""
    from kvcompile.kernels.prefill_launch import HEAD_DIMS

    if q.shape[3] in HEAD_DIMS and v.shape[3] in HEAD_DIMS:
        return True
    state.kernels.note(f"prefill_attends='fresh_fp8': head dims {q.shape[3]} / {v.shape[3]} "
                       f"(the FP8 prefill kernels take {HEAD_DIMS}); attended through SDPA in "
                       f"{q.dtype}", warn=True)
    return False


def _packed_fp8(state, qt, kt, vt, cu, max_len: int, scale: float) -> torch.Tensor:
    """prefill_attends="fresh_fp8": the prompts' tokens packed (qt / kt / vt [T, H, D])
    attended causally on FP8 tensor cores; which kernel takes them is said once.
    -> [T, Hq, Dv] in compute_dtype(qt.dtype)."""
    from kvcompile.kernels import prefill_sm90
    from kvcompile.kernels.prefill import prefill_attention

    dt = compute_dtype(qt.dtype)
    if qt.is_cuda:
        why = prefill_sm90.takes_bf16_q(qt, kt, vt, dt, True, 0, 0, 0.0, None)
        state.kernels.note("prefill_attends='fresh_fp8': " + (
            "the Hopper FP8 prefill kernel, each query row quantized by it" if why is None
            else f"q, k, v block-quantized first, then the FP8 prefill kernels ({why})"))
    else:
        state.kernels.note("prefill_attends='fresh_fp8': no GPU, the reference over the same "
                           "E4M3 values, P rounded to E4M3 as the kernels round it")
    state.count("prefill_fresh_fp8")
    return prefill_attention(qt, kt, vt, cu, scale, causal=True, max_seqlen=max_len, fp8=True,
                             out_dtype=dt)


# the prefill_attends choices under which a fresh prompt attends to its K/V as computed
FRESH_ATTENDS = ("fresh", "fresh_fp8")

# up to this many prompts in one packed step attend one SDPA call each (cuDNN / flash: the
# fastest for long prompts; a call's host cost is tens of microseconds); more go through the
# varlen kernel in one launch where it runs
FRESH_PACKED_SDPA_MAX = 32


def _fresh_packed(state, layer, q, fresh, plan, window, softcap, scale, extras):
    """The Engine's step of fresh prompts only (packed [1, Hq, T, D], nothing of any row cached
    before it): each prompt attends causally to its own K/V as computed, as `_fresh_prefill`
    does for a batch, instead of reading back the pages just written. Steps with decode rows
    or chunks over a cached prefix, softcap, sinks or eviction extras, and windows shorter
    than a prompt keep the paged kernels. -> [1, Hq, T, Dv] or None."""
    if (fresh is None or state.config.prefill_attends not in FRESH_ATTENDS or plan.is_decode
            or not plan.q_lens or max(plan.past_lens) != 0 or softcap or extras):
        return None
    if state.eviction is not None and not state.eviction.takes_plain_prefill(plan, layer):
        return None
    q_lens = list(plan.q_lens)
    if window and window < max(q_lens):
        return None
    k, v = fresh
    if k.shape[2] != q.shape[2] or sum(q_lens) != q.shape[2]:
        return None
    t = lambda x: x[0].transpose(0, 1).contiguous()   # noqa: E731  [T, H, D]
    if state.config.prefill_attends == "fresh_fp8" and _fp8_fresh_ok(state, q, v):
        out = _packed_fp8(state, t(q), t(k), t(v), plan.cu_seqlens_q, max(q_lens), scale)
        out = out.transpose(0, 1).unsqueeze(0)
    elif len(q_lens) > FRESH_PACKED_SDPA_MAX and state.kernels.use_triton(q.device):
        from kvcompile.kernels.prefill import prefill_attention

        state.count("prefill_fresh_varlen")   # which kernel (prefill_fresh_sdpa: attended fresh)
        out = prefill_attention(t(q), t(k), t(v), plan.cu_seqlens_q, scale, causal=True,
                                max_seqlen=max(q_lens))
        out = out.transpose(0, 1).unsqueeze(0)
    else:
        out = sdpa_packed(q, k, v, q_lens, scale)
    state.count("prefill_fresh_sdpa")
    plan.cache[("attended_fresh", layer)] = True
    return out


def _fresh_ok(state, layer, q, fresh, plan, window, softcap, extras) -> bool:
    """What a forward needs, its mask apart, to attend to its fresh K/V (`_fresh_mode`,
    `_fresh_latent_mask`): a prompt of 2+ tokens of which nothing is cached before it (no
    packed step), no softcap or extras, no window shorter than it, prefill_attends "fresh",
    and an eviction policy that lets it attend as without one."""
    S = q.shape[2]
    if (fresh is None or state.config.prefill_attends not in FRESH_ATTENDS or plan.packed
            or plan.is_decode or S < 2 or max(plan.past_lens) != 0 or softcap or extras
            or (window and window < S)):
        return False
    return state.eviction is None or state.eviction.takes_plain_prefill(plan, layer)


def _fresh_mode(state, layer, q, fresh, plan, mask_info, attn_mask, is_causal, window,
                softcap, extras) -> tuple[bool | None, list[int] | None]:
    """How this forward may attend to its fresh K/V (`_fresh_prefill`): (causal, None) where
    SDPA needs no mask (causal: whether the attention is causal), (None, starts) for left
    padding alone (each row's first token, host ints: `_padded_rows` attends over each row's
    own tokens, no [B, 1, S, L] mask), (None, None) where it may not. A mask must be exactly
    causal past each row's padding within any window (MaskInfo.exact, from the analysis every
    forward makes: nothing more is read). Left-padded batches are how HF `generate` runs
    prompts of different lengths; on the paged path their prefill read back the pages just
    written, quantized, through the chunked-prefill kernel."""
    if not _fresh_ok(state, layer, q, fresh, plan, window, softcap, extras):
        return None, None
    if attn_mask is None:
        return bool(is_causal), None
    if (mask_info is None or not mask_info.exact
            or (mask_info.window and mask_info.window < q.shape[2])):
        return None, None
    if not any(mask_info.kv_start):
        return True, None
    if len(mask_info.kv_start) != q.shape[0]:
        return None, None
    return None, [int(s) for s in mask_info.kv_start]


# a left-padded fresh prompt attends one SDPA call per batch row (`_padded_rows`) up to this
# many rows; a larger batch, where the Triton kernels run, packs its tokens for one launch of
# the varlen prefill kernel
FRESH_PADDED_ROWS_MAX = 32


def _padded_rows(state, q, k, v, starts: list[int], scale: float) -> torch.Tensor:
    """Causal attention of a left-padded fresh prompt over each row's own tokens (`_fresh_mode`
    chose it): one SDPA call a row (`dense.sdpa_rows`), or past FRESH_PADDED_ROWS_MAX rows
    where the Triton kernels run, the rows' tokens packed ([T, H, D], padding dropped) for
    one launch of the varlen prefill kernel (head dims it takes: MLA's 192 stays on SDPA), its
    output scattered back (a padding query: 0).
    q [B, Hq, S, D], k / v [B, Hkv, S, D|Dv] -> [B, Hq, S, Dv]."""
    from kvcompile.kernels.prefill_launch import HEAD_DIMS

    B, Hq, S, _ = q.shape
    fp8 = state.config.prefill_attends == "fresh_fp8" and _fp8_fresh_ok(state, q, v)
    if not fp8 and (B <= FRESH_PADDED_ROWS_MAX or not state.kernels.use_triton(q.device)
                    or q.shape[3] not in HEAD_DIMS or v.shape[3] not in HEAD_DIMS):
        return sdpa_rows(q, k, v, starts, scale)
    from kvcompile.kernels.prefill import prefill_attention

    lens = [S - s for s in starts if s < S]
    idx = torch.cat([torch.arange(b * S + s, (b + 1) * S) for b, s in enumerate(starts)
                     if s < S]).to(q.device)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=q.device)

    def packed(x):   # [B, H, S, D] -> [T, H, D], the rows' tokens, padding dropped
        return _tokens(x).index_select(0, idx)

    dt = compute_dtype(q.dtype)
    if fp8:
        o = _packed_fp8(state, packed(q), packed(k), packed(v), cu, max(lens), scale)
    else:
        state.count("prefill_fresh_varlen")   # which kernel (prefill_fresh_sdpa: attended fresh)
        o = prefill_attention(packed(q), packed(k), packed(v), cu, scale, causal=True,
                              max_seqlen=max(lens), out_dtype=dt)
    out = torch.zeros(B * S, Hq, v.shape[3], dtype=dt, device=q.device)
    out.index_copy_(0, idx, o)
    return out.view(B, S, Hq, -1).transpose(1, 2)


def attend_latent(ctx, layer: int, q, plan, mask_info, attn_mask, is_causal, window, softcap,
                  scale, kv_b_weight, nope_dim: int, fresh=None):
    """Attention of an MLA layer (`_attend_latent`), through its eviction policy where it has
    one (`_latent_evicting`)."""
    ev = ctx.state.eviction
    if ev is not None and layer in ev.policies:
        return _latent_evicting(ctx, layer, q, plan, mask_info, attn_mask, is_causal, window,
                                softcap, scale, kv_b_weight, nope_dim, fresh)
    return _attend_latent(ctx, layer, q, plan, mask_info, attn_mask, is_causal, window,
                          softcap, scale, kv_b_weight, nope_dim, fresh)


def _kept_mask(plan, attn_mask):
    """The mask the eviction runtime's host path takes (`attend_kept`): a decode step's built
    once per forward (masks.dense: [B, 1, 1, L], read by every layer and row); a prompt's
    split mask (masks.AndMask) as it is, built a batch row at a time (`_row_mask`), never
    whole ([B, 1, S, L]: 16 GiB of bool at B16 x 32k)."""
    if attn_mask is None or (not plan.is_decode and isinstance(attn_mask, masks.AndMask)):
        return attn_mask
    return masks.dense(plan, attn_mask)


def _latent_evicting(ctx, layer: int, q, plan, mask_info, attn_mask, is_causal, window,
                     softcap, scale, kv_b_weight, nope_dim: int, fresh):
    """An MLA layer with an eviction policy, row by row (EvictionRuntime.latent_rows): rows
    whose sequence evicted nothing attend as without eviction (then SnapKV's observation and
    H2O's prompt mass are scored in the absorbed form: keys [c, k_rope], query [q_nope W_UK,
    q_rope], the same scores); one-token rows over compacted kept slots attend over their
    stored slots through the latent kernels; the others over their kept slots in fp32 on the
    host (the runtime's `attend_kept` through `_kv`), in the latent space, W_UV after. A
    non-packed step with any host row attends every row on the host, as dispatch.attend
    does."""
    state = ctx.state
    ev = state.eviction
    if plan.eviction_aside:
        # a decode step stepped aside for (`generate`'s graphs, integrations/hf_graphs.py, or
        # an engine step; decode_aside: no holes, padding or hidden slots, the decode mask
        # all ones): the stored slots are exactly the kept tokens, read by the latent
        # kernels, which add H2O's mass where the step keeps it
        if plan.aside is not None and plan.aside.spec.mass_len:
            return _latent_aside_mass(ctx, layer, q, plan, scale, kv_b_weight, nope_dim)
        return _attend_latent(ctx, layer, q, plan, None, None, is_causal, window, softcap,
                              scale, kv_b_weight, nope_dim, fresh)
    if (mask_info is not None and not mask_info.exact and not plan.is_decode
            and not plan.packed):
        ev.mark_holes(plan)   # a prompt mask with holes: its decode steps keep the rules
    free = plan.packed or attn_mask is None or mask_hides_no_key(plan, mask_info)
    pool = state.pool
    # rows that add H2O mass may read their stored slots when the latent kernel attends the
    # step (its attn_mass output); elsewhere they stay on the host path
    mass_ok = (free and any(ev.adds_mass(sid, layer) for sid in plan.seq_ids)
               and _latent_kernel_why(state, q, pool.k[layer], pool.v[layer], plan, None,
                                      None, window, softcap, mass=True,
                                      is_causal=is_causal)[0] == "")
    kinds = ev.latent_rows(plan, layer, free, mass_ok)
    host = {i for i, k in enumerate(kinds) if k == "host"}
    plain = {i for i, k in enumerate(kinds) if k == "plain"}
    out = None

    def absorb(x):   # the absorbed query of the rows a score or a host row reads, as it goes
        return absorb_query(x, kv_b_weight, nope_dim)

    if plan.packed or not host:
        if any(k == "stored" for k in kinds) and not plan.packed:
            attn_mask = mask_info = None   # (free: it hides no key; its columns are logical)
        mass_rows = [i for i, k in enumerate(kinds) if k == "stored"
                     and ev.adds_mass(plan.seq_ids[i], layer)]
        mass = None
        if mass_rows:
            mass = torch.zeros((len(kinds), 1, max(plan.seq_lens_list)), dtype=torch.float32,
                               device=q.device)
        out = _attend_latent(ctx, layer, q, plan, mask_info, attn_mask, is_causal, window,
                             softcap, scale, kv_b_weight, nope_dim, fresh, attn_mass=mass)
        if mass_rows:
            ev.add_row_mass(plan, layer, mass[mass_rows], mass_rows)
        if plain:
            # the absorbed query of the rows each score reads, a block at a time (not the
            # whole prompt's [B, H, S, r + dr]: 19 GB at B16 x 8k and 128 heads in bf16)
            only = None if len(plain) == len(kinds) else plain
            ev.observe_prefill(ctx, layer, q, plan, None if plan.packed else attn_mask,
                               is_causal, window, softcap, scale, only=only, absorb=absorb)
            ev.prompt_mass(ctx, layer, q, plan, None if plan.packed else attn_mask,
                           None if plan.packed else mask_info, is_causal, window, softcap,
                           scale, only=only, absorb=absorb)
        if not host:
            return out
    state.count("latent_eviction_host_rows", len(host))
    if not plan.packed:   # every row on the host path, each absorbed as it is attended
        o_lat = ev.attend_kept(ctx, layer, q, plan, _kept_mask(plan, attn_mask), is_causal,
                               window, softcap, scale, {}, absorb=absorb)
        return latent_output(o_lat.to(compute_dtype(q.dtype)), kv_b_weight, nope_dim)
    q_lat = absorb_query(q, kv_b_weight, nope_dim)
    into = torch.zeros((*q_lat.shape[:-1], state.pool.k[layer].head_dim),
                       dtype=torch.float32, device=q.device)
    o_lat = ev.attend_kept(ctx, layer, q_lat, plan, None, is_causal, window, softcap, scale,
                           {}, rows=host, into=into)
    o = latent_output(o_lat.to(q_lat.dtype), kv_b_weight, nope_dim)   # [1, H, T, dv]
    cu = plan.cu_seqlens_q.tolist()
    cols = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in sorted(host)]).to(q.device)
    out = out.clone() if out is not None else torch.zeros_like(o)
    out[:, :, cols] = o[:, :, cols].to(out.dtype)
    return out


def _latent_aside_mass(ctx, layer: int, q, plan, scale, kv_b_weight, nope_dim: int):
    """An H2O decode step of an MLA layer stepped aside for: the eviction runtime's
    `attend_aside_latent` (eviction/aside.py) over the absorbed query, with this module's
    latent kernel choice, W_UV after."""
    q_lat = absorb_query(q, kv_b_weight, nope_dim)
    o_lat = ctx.state.eviction.attend_aside_latent(layer, q_lat, plan, scale, _latent_kernel)
    return latent_output(o_lat.to(q_lat.dtype), kv_b_weight, nope_dim)


def _attend_latent(ctx, layer: int, q, plan, mask_info, attn_mask, is_causal, window, softcap,
                   scale, kv_b_weight, nope_dim: int, fresh=None, attn_mass=None):
    """Attention of an MLA layer (kernels/latent.py), whose pages hold the latent (keys,
    width r) and the rotary key (values, width dr); the new tokens' are already written.
    q [B, H, S, dn + dr] -> [B, H, S, dv].

    A fresh prompt's prefill (the conditions of `_fresh_prefill`, a left-padded one over each
    row's tokens, a custom mask under the model's own: `_fresh_latent_mask`) expands its own
    latents through kv_b_proj and runs dense SDPA, as the model does, a row group at a time
    (`_fresh_latent_rows`): compute-bound, the expansion is cheap there. A prompt chunk over
    a cached prefix of `latent_expand_min_queries` or more queries a row expands its rows'
    stored latents the same way (latent.paged_latent_expanded), and so does such a chunk in
    an engine step beside other rows where LATENT_SPLIT_PACKED is on (`_packed_latent_split`;
    off by default). Everything else (decode
    steps, shorter chunks) attends in the latent space over the stored pages: q_nope
    absorbed by W_UK once per step, one latent head per token read for every query head, W_UV
    applied to the weighted latents; nothing of the past is expanded. Rotation is refused for
    these layers at compile time (passes/site_formats.py); eviction goes through
    `_latent_evicting`. attn_mass [B, 1, Lm] (H2O rows chosen for the latent kernel,
    `EvictionRuntime.latent_rows`): the kernel adds the step's probabilities to it; a step it
    does not take is an error here."""
    state = ctx.state
    causal, starts = _fresh_mode(state, layer, q, fresh, plan, mask_info, attn_mask,
                                 is_causal, window, softcap, None)
    masked = None if causal is not None or starts is not None else _fresh_latent_mask(
        state, layer, q, fresh, plan, attn_mask, window, softcap)
    if causal is not None or starts is not None or masked is not None:
        state.count("prefill_fresh_sdpa")
        plan.cache[("attended_fresh", layer)] = True
        return _fresh_latent_rows(state, q, fresh, kv_b_weight, nope_dim, scale, causal,
                                  starts, masked)
    pool = state.pool
    if _latent_chunk_expands(q, pool.k[layer], plan, mask_info, attn_mask, is_causal, window,
                             softcap, attn_mass):
        state.count("latent_chunk_expanded")
        return paged_latent_expanded(pool.k[layer], pool.v[layer], q, plan, kv_b_weight,
                                     nope_dim, scale,
                                     window or (mask_info.window if mask_info else 0),
                                     LATENT_EXPAND_BYTES)
    split = _packed_latent_split(q, pool.k[layer], plan, attn_mask, window, softcap, attn_mass)
    if split is not None:
        return _attend_latent_split(ctx, layer, q, plan, split, scale, kv_b_weight, nope_dim)
    return _absorbed_latent(state, layer, q, plan, mask_info, attn_mask, is_causal, window,
                            softcap, scale, kv_b_weight, nope_dim, attn_mass)


def _absorbed_latent(state, layer: int, q, plan, mask_info, attn_mask, is_causal, window,
                     softcap, scale, kv_b_weight, nope_dim: int, attn_mass=None):
    """`_attend_latent` in the latent space: the absorbed query over the latent pages, on the
    latent kernels (`_latent_kernel`) or the paged reference; W_UV after."""
    pool = state.pool
    q_lat = absorb_query(q, kv_b_weight, nope_dim)                  # [B, H, S, r + dr]
    o_lat = _latent_kernel(state, q_lat, pool.k[layer], pool.v[layer], plan, mask_info,
                           attn_mask, window, softcap, scale, attn_mass=attn_mass,
                           is_causal=is_causal)
    if o_lat is not None:
        o_lat, route = o_lat
        state.count(f"latent_decode_{route}")
        return latent_output(o_lat.to(q_lat.dtype), kv_b_weight, nope_dim)
    if attn_mass is not None:   # (latent_rows chose these rows for the kernel)
        raise UnsupportedShapeError("eviction: the latent kernel refused a step it was chosen "
                                    "for (H2O mass rows); report this")
    o_lat = paged_reference_attention(pool.k[layer], pool.v[layer], q_lat, plan,
                                      masks.dense(plan, attn_mask), is_causal, window, softcap,
                                      scale, latent=True)           # [B, H, S, r]
    state.count("latent_absorbed")
    return latent_output(o_lat, kv_b_weight, nope_dim)


# expanded K/V (an MLA layer's keys and values through kv_b_proj) of one row group at most:
# a prompt's rows are expanded and attended a group at a time (`_fresh_latent_rows`,
# latent.paged_latent_expanded); B64 x 8k at DeepSeek-V3's 128 heads expands to 43 GB at once
LATENT_EXPAND_BYTES = 2 << 30
# a prompt chunk over latent pages (a cached prefix) of at least this many queries a row
# attends by expansion (the model's form) instead of the absorbed one (the latent kernels with
# each query a row: `_fold_rows`), by the pages' element size: 16-bit or wider, one byte (fp8).
# H100, benchmarks/bench_latent_chunk.py (B16 x 8k and B4 x 32k, 16 and 128 heads), the
# folded rows' time over the expansion's: 16-bit pages 0.56-0.64 at 64 queries, 1.10-1.23 at
# 128; fp8 pages 0.64-0.82 at 128, 1.18-1.42 at 255 (benchmarks/RESULTS.md, 36th session)
LATENT_EXPAND_MIN_QUERIES = 112
LATENT_EXPAND_MIN_QUERIES_FP8 = 192
# an engine step (packed) splits its chunks of latent_expand_min_queries or more off to be
# expanded (`_packed_latent_split`) only with this on. Off: measured end to end on the H100
# (38th session, bench_latent_generate.py, DeepSeek-V3-shaped, B16 x P4096, fp8 latent pages,
# 2,048-token chunks), the split step took the first token at 3.295 s against 1.653 s with
# every chunk folded onto the latent kernel's rows, and decoded at 4,895 against 5,173 tok/s
# (the step's other rows then ran the Triton latent kernel, not the CUDA rows kernel, and each
# long row was expanded and attended alone under an explicit causal mask)
LATENT_SPLIT_PACKED = False


def latent_expand_min_queries(pages) -> int:
    """The queries a row from which a prompt chunk over these latent pages (a PagedTensor)
    expands: 8 bits a value or fewer take the fp8 threshold."""
    return (LATENT_EXPAND_MIN_QUERIES_FP8 if pages.fmt.bits_per_value <= 8
            else LATENT_EXPAND_MIN_QUERIES)


def _packed_latent_split(q, pages, plan, attn_mask, window, softcap, attn_mass):
    """With LATENT_SPLIT_PACKED (off by default: measured slower end to end), an engine step
    (packed) of an MLA layer in which some sequences add a prompt chunk of
    `latent_expand_min_queries` tokens or more: (the long rows' one-row plans, the step
    without them as a StepPlan of its own and the packed columns of its tokens:
    `_split_plan`), made once a forward; None where no row is that long, or where the step
    has a window, softcap, H2O mass or a mask (their rows stay together on the usual route). The long rows attend by expansion, as a
    generate chunk of their length does, the rest as before (`_attend_latent_split`)."""
    if (not LATENT_SPLIT_PACKED or not plan.packed or not plan.q_lens or window or softcap
            or attn_mass is not None or attn_mask is not None):
        return None
    n_min = latent_expand_min_queries(pages)
    if max(plan.q_lens) < n_min:
        return None
    key = ("latent_split", n_min)
    if key not in plan.cache:
        plan.cache[key] = _split_plan(plan, [i for i, n in enumerate(plan.q_lens) if n >= n_min],
                                      q.device)
    return plan.cache[key]


def _split_plan(plan, long: list[int], device: torch.device):
    """`_packed_latent_split`'s ([(packed columns, one-row StepPlan)] of the long rows, the
    rest's StepPlan or None, the rest's packed columns [T'] int64 or None)."""
    cu = list(itertools.accumulate(plan.q_lens, initial=0))
    ones = [(slice(cu[i], cu[i + 1]),
             StepPlan(seq_ids=[plan.seq_ids[i]], batch=1, new_tokens=plan.q_lens[i],
                      past_lens=[plan.past_lens[i]], slots=plan.slots.new_empty(0),
                      block_tables=plan.block_tables[i:i + 1], seq_lens=plan.seq_lens[i:i + 1],
                      seq_lens_list=[plan.seq_lens_list[i]], kv_start=[plan.kv_start[i]]))
            for i in long]
    taken = set(long)
    short = [i for i in range(len(plan.q_lens)) if i not in taken]
    if not short:
        return ones, None, None
    cols = torch.tensor([t for i in short for t in range(cu[i], cu[i + 1])],
                        dtype=torch.int64).to(device, non_blocking=True)
    q_lens = [plan.q_lens[i] for i in short]
    rows = torch.tensor(short, dtype=torch.int64).to(plan.block_tables.device, non_blocking=True)
    rest = StepPlan(
        seq_ids=[plan.seq_ids[i] for i in short], batch=len(short), new_tokens=sum(q_lens),
        past_lens=[plan.past_lens[i] for i in short], slots=plan.slots.new_empty(0),
        block_tables=plan.block_tables.index_select(0, rows),
        seq_lens=plan.seq_lens.index_select(0, rows.to(plan.seq_lens.device)),
        seq_lens_list=[plan.seq_lens_list[i] for i in short],
        kv_start=[plan.kv_start[i] for i in short], packed=True,
        cu_seqlens_q=torch.tensor(list(itertools.accumulate(q_lens, initial=0)),
                                  dtype=torch.int32).to(device, non_blocking=True),
        q_lens=q_lens)
    return ones, rest, cols


def _attend_latent_split(ctx, layer: int, q, plan, split, scale, kv_b_weight, nope_dim: int):
    """`_packed_latent_split`'s step: each long row's chunk by expansion over its stored
    latents (latent.paged_latent_expanded on that row: causal, its chunk the last of its
    positions), the other rows' tokens through `_absorbed_latent` as a step of their own.
    q [1, H, T, dn + dr] -> [1, H, T, dv]."""
    state = ctx.state
    pool = state.pool
    ones, rest, cols = split
    H, T = q.shape[1], q.shape[2]
    dv = kv_b_weight.shape[0] // H - nope_dim
    out = torch.empty((1, H, T, dv), dtype=compute_dtype(q.dtype), device=q.device)
    for part, one in ones:
        out[:, :, part] = paged_latent_expanded(pool.k[layer], pool.v[layer], q[:, :, part],
                                                one, kv_b_weight, nope_dim, scale, 0,
                                                LATENT_EXPAND_BYTES)
    state.count("latent_chunk_expanded")
    if rest is not None:
        o = _absorbed_latent(state, layer, q.index_select(2, cols), rest, None, None, True, 0,
                             0.0, scale, kv_b_weight, nope_dim)
        out.index_copy_(2, cols, o.to(out.dtype))
    return out


def _fresh_latent_rows(state, q, fresh, w, nope_dim: int, scale: float, causal, starts,
                       masked) -> torch.Tensor:
    """A fresh MLA prompt's attention by expansion (one of causal / starts / masked given, as
    `_attend_latent` chose): its rows' fresh latents expanded through kv_b_proj and attended
    a row group at a time (LATENT_EXPAND_BYTES of expanded K/V at most), so that the whole
    batch's K/V never exist at once. -> [B, H, S, dv]."""
    c, rope = fresh
    B, H, S, dqk = q.shape
    dv = w.shape[0] // H - nope_dim
    dt = compute_dtype(q.dtype)
    g = expand_rows(S, H, dqk + dv, torch.finfo(c.dtype).bits // 8, LATENT_EXPAND_BYTES)
    out = None
    for b0 in range(0, B, g):
        rows = slice(b0, min(B, b0 + g))
        k, v = expand_latent(c[rows], rope[rows], w, nope_dim, H)
        if starts is not None:
            o = _padded_rows(state, q[rows], k, v, starts[rows], scale)
        elif masked is not None:
            o = sdpa_attention(q[rows], k, v, *(m if m is None or m.shape[0] == 1
                                                else m[rows] for m in masked), scale, False)
        else:
            o = sdpa_attention(q[rows], k, v, None, None, scale, causal)
        if g >= B:
            return o
        if out is None:
            out = torch.empty((B, H, S, dv), dtype=dt, device=q.device)
        out[rows] = o
    return out


def _latent_chunk_expands(q, pages, plan, mask_info, attn_mask, is_causal, window, softcap,
                          attn_mass) -> bool:
    """Whether an MLA layer's prompt chunk over a cached prefix attends by expansion
    (latent.paged_latent_expanded): a non-packed step of at least `latent_expand_min_queries`
    queries a row, causal, no softcap or mass to add, and a mask that is none or exactly
    causal past each row's padding (its window, if any, taken from the analysis)."""
    if (plan.packed or plan.is_decode or q.shape[2] < latent_expand_min_queries(pages)
            or softcap or attn_mass is not None or not is_causal and attn_mask is None):
        return False
    return attn_mask is None or (mask_info is not None and mask_info.exact)


def _fresh_latent_mask(state, layer, q, fresh, plan, attn_mask, window, softcap):
    """(allowed, additive) for a fresh MLA prompt that `_fresh_mode` refuses for its mask
    alone (left padding, a custom mask): the model's own mask over its own fresh tokens
    ([B|1, 1|H, S, >= S], built once per forward, as the model built it), with which the prompt
    attends by expansion as the model does; else None. Absorbed over the pages instead, a
    padded prompt took q_lat [B, H, S, r + dr] and its fp32 output [B, H, S, r] at once
    (77 + 137 GB at B16 x 32k and DeepSeek-V3's 128 heads) and ~3x the model's FLOPs."""
    if attn_mask is None or not _fresh_ok(state, layer, q, fresh, plan, window, softcap, None):
        return None
    mask = masks.dense(plan, attn_mask)
    n = fresh[0].shape[-2]
    if mask.dim() != 4 or mask.shape[-2] != q.shape[2] or mask.shape[-1] < n:
        return None
    # (a static cache's mask has a column for every slot: the fresh tokens are its first n,
    # the rest are slots the model has not filled, which the pages do not hold either)
    mask = mask[..., :n]
    return (mask, None) if mask.dtype == torch.bool else (None, mask)


def attended_fresh(plan, layer: int) -> bool:
    """Whether layer `layer` of this forward attended to its fresh K/V (`_fresh_prefill`)."""
    return bool(plan.cache.get(("attended_fresh", layer)))


def prefill_mode(config, q: torch.Tensor) -> str:
    """"triton" (the chunked-prefill kernel over the pages) or "sdpa" (gather the pages, torch
    SDPA: kernels/dense.py, exact for any stored format): KVConfig.prefill.

    CUDA prefill runs the Triton chunked-prefill kernel over the pages (checked on the H200,
    benchmarks/prefill_diag.py and tests/gpu/test_prefill_matrix_gpu.py, 2026-11-30). Escape
    hatch: prefill="sdpa"; "sdpa" stays the default off CUDA (KVConfig(kernels="triton") on the
    CPU), where prefill="triton" opts in."""
    if config.prefill != "auto":
        return config.prefill
    return "triton" if q.is_cuda else "sdpa"


def mask_hides_no_key(plan, mask_info) -> bool:
    """Whether an attention mask hides no cached key from a decode step (then the latent
    kernels run without reading a key mask): an exact causal mask without padding or window,
    or a decode step's key
    row that is all True (transformers 5.17 passes such a mask to every MLA decode step; 5.25
    passes None). The key row is read on the host once per forward (one sync, cached in the
    plan); under CUDA graph capture it cannot be, so the answer is no there."""
    if mask_info is None:
        return False
    if mask_info.exact:
        return not any(mask_info.kv_start) and not mask_info.window
    km = mask_info.key_mask
    if mask_info.reason != "decode" or km is None or any(mask_info.kv_start):
        return False
    key = ("key_row_full", id(km))
    if key not in plan.cache:
        capturing = km.is_cuda and torch.cuda.is_current_stream_capturing()
        plan.cache[key] = (km, not capturing and bool(km.all()))
    return plan.cache[key][1]


def _latent_kernel_why(state, q_lat, c_pages, r_pages, plan, mask_info, attn_mask, window,
                       softcap, mass: bool = False, is_causal: bool = True):
    """(why, key_mask, layout) of `_latent_kernel`'s choice: why None where the step is not
    one for it (no Triton kernels, or nothing cached before a non-packed step: the fresh
    routes attend), "" where the kernel takes it, else the reason it does not; key_mask the
    step's key row (or None); layout "decode" (one query a row), "packed" (an engine step of
    one token a sequence: q_lat [1, H, B, W]) or "fold" (several queries a row, or an engine
    step with prompt chunks: each query a kernel row, `_fold_rows`). mass: the step adds H2O
    mass (one query a row only); is_causal: a maskless call's (several queries a row are
    folded only under causality)."""
    packed = plan.packed and bool(plan.q_lens)
    if not state.kernels.use_triton(q_lat.device) or not (packed or plan.past_lens
                                                          and min(plan.past_lens) > 0):
        return None, None, ""
    if packed:
        layout = "packed" if max(plan.q_lens) == 1 and min(plan.past_lens) > 0 else "fold"
    else:
        layout = "decode" if q_lat.shape[2] == 1 else "fold"
    why = ""
    key_mask = None
    if window or softcap:
        why = "a sliding window or soft-capping"
    elif layout == "fold":
        # (a packed step's structure is the engine's plan: causal per sequence)
        if mass:
            why = "H2O mass over several queries a row"
        elif not packed and (attn_mask is None and not is_causal
                             or attn_mask is not None and not (mask_info is not None
                                                               and mask_info.exact
                                                               and not mask_info.window)):
            why = "several queries a row under a mask that is not causal"
    elif attn_mask is not None and layout == "decode" and not mask_hides_no_key(plan,
                                                                                mask_info):
        key_mask = getattr(mask_info, "key_mask", None)
        if key_mask is None or mask_info.reason != "decode":
            why = "a mask that is not one key row per sequence"
    if not why:
        try:
            from kvcompile.kernels.latent_decode import fast_path_reason
        except ImportError as e:
            why = f"ImportError: {e}"
        else:
            why = fast_path_reason(q_lat, c_pages, r_pages)
    return why, key_mask, layout


def _fold_rows(plan, mask_info, n_queries: int, device: torch.device):
    """A step of several queries a row as rows of the latent decode kernels: each query its
    own row, with its sequence's block-table row and the causal length it sees (the keys up
    to its own position; the step's tokens are already stored). -> (index [N] int64 of each
    kernel row's sequence, seq_lens [N] int32, key_mask [N, Lm] bool or None: a row's left
    padding, keys j < kv_start hidden). Non-packed: N = B x S in (row, query) order; packed:
    N = T, the packed tokens' order. Device arithmetic (no host read) for a non-packed step."""
    if plan.packed:
        seqs, lens = [], []
        for s, (past, n) in enumerate(zip(plan.past_lens, plan.q_lens)):
            seqs += [s] * n
            lens += range(past + 1, past + n + 1)
        index = torch.tensor(seqs, dtype=torch.int64).to(device, non_blocking=True)
        seq_lens = torch.tensor(lens, dtype=torch.int32).to(device, non_blocking=True)
        return index, seq_lens, None
    B, S = plan.batch, n_queries
    index = torch.arange(B, device=device).repeat_interleave(S)
    offs = torch.arange(1 - S, 1, device=device, dtype=torch.int32)
    seq_lens = (plan.seq_lens.to(torch.int32)[:, None] + offs[None]).reshape(-1)
    starts = list(mask_info.kv_start) if mask_info is not None else list(plan.kv_start)
    key_mask = None
    if any(starts):
        width = max(starts)
        key_mask = (torch.arange(width, device=device)[None]
                    >= torch.tensor(starts, device=device)[:, None]).index_select(0, index)
    return index, seq_lens, key_mask


def _latent_kernel(state, q_lat, c_pages, r_pages, plan, mask_info, attn_mask, window,
                   softcap, scale, attn_mass=None, is_causal: bool = True):
    """The absorbed decode kernel over the latent pages (no window or softcap), on CUDA or
    with KVConfig(kernels="triton"): ([B, H, S, r] fp32 in q_lat's layout, route), or None
    (the reference attends). route "cuda": the CUDA kernel (kernels/latent_sm90.py) on sm_90
    where latent_sm90.use_cuda says the H200 measured it faster; "triton":
    kernels/latent_decode.py. Both take the step's key mask (left padding, or any mask under
    CUDA graph capture, where the key row cannot be read on the host: mask_hides_no_key).
    A step of several queries a row (a prompt chunk over a cached prefix, speculative
    tokens) or an engine step with prompt chunks runs the same kernels with each query as a
    row of its own (`_fold_rows`, route "triton_rows" / "cuda_rows"): causal, each query
    reads its sequence's pages up to its own position.
    attn_mass [B, 1, Lm] fp32 (H2O, `_latent_aside_mass`): either kernel adds the step's
    probabilities to it (one query a row)."""
    kernels = state.kernels
    why, key_mask, layout = _latent_kernel_why(state, q_lat, c_pages, r_pages, plan,
                                               mask_info, attn_mask, window, softcap,
                                               mass=attn_mass is not None,
                                               is_causal=is_causal)
    if why is None:
        return None
    if why:
        kernels._fallback(f"latent decode: {why}")
        return None
    from kvcompile.kernels import latent_sm90
    from kvcompile.kernels.latent_decode import latent_decode_attention

    tables, seq_lens, suffix = plan.block_tables, plan.seq_lens, ""
    if layout == "decode":
        q_rows = q_lat[:, :, 0]                                                  # [B, H, W]
    else:
        q_rows = q_lat[0].transpose(0, 1)                      # packed: [T, H, W]
        if layout == "fold":
            suffix = "_rows"
            if not plan.packed:
                B, H, S, W = q_lat.shape
                q_rows = q_lat.transpose(1, 2).reshape(B * S, H, W)
            key = ("latent_fold", q_lat.shape[2], id(mask_info))   # once a forward, not a layer
            if key not in plan.cache:
                index, lens, km = _fold_rows(plan, mask_info, q_lat.shape[2], q_lat.device)
                plan.cache[key] = (plan.block_tables.index_select(0, index), lens, km,
                                   mask_info)   # (mask_info held: its id stays its own)
            tables, seq_lens, key_mask, _ = plan.cache[key]
        q_rows = q_rows.contiguous()

    def shaped(out):   # [N, H, r] -> the attention's layout
        if layout == "decode":
            return out[:, :, None]                                               # [B, H, 1, r]
        if plan.packed:
            return out.transpose(0, 1)[None]                                     # [1, H, T, r]
        B, H, S, _ = q_lat.shape
        return out.view(B, S, H, -1).transpose(1, 2)                             # [B, H, S, r]

    launch = latent_sm90.use_cuda(q_rows, c_pages, r_pages, tables.shape[1]
                                  * c_pages.page_size)
    if launch is not None:
        out = latent_sm90.latent_decode_sm90(q_rows, c_pages, r_pages, tables, seq_lens,
                                             scale, key_mask=key_mask, attn_mass=attn_mass,
                                             **launch)
        return shaped(out), "cuda" + suffix
    out = latent_decode_attention(q_rows, c_pages, r_pages, tables, seq_lens, scale,
                                  key_mask=key_mask, attn_mass=attn_mass)
    return shaped(out), "triton" + suffix


def _packed_decode(state, layer, q, plan, window, softcap, scale, extras, key_mask=None):
    """An engine step in which every sequence adds one token, on the split-K decode kernel.
    q: [1, Hq, B, D] -> out [1, Hq, B, Dv], or None (the usual kernels / the reference).
    key_mask [B, Lm] bool or None: slots hidden from each row (the eviction runtime's
    SinkWindow steps, eviction/aside.py `attend_aside`); the same launch otherwise."""
    if not plan.packed or not plan.q_lens or max(plan.q_lens) != 1:
        return None
    if min(plan.past_lens) == 0 or not state.kernels.use_triton(q.device):
        return None
    pool = state.pool
    kc, vc = pool.k[layer], pool.v[layer]
    if not (kernel_readable(kc) and kernel_readable(vc)):
        return None
    try:
        from kvcompile.kernels.decode import paged_decode_attention
    except ImportError:
        return None
    qd = q[0].transpose(0, 1).unsqueeze(2).contiguous()        # [B, Hq, 1, D]
    try:
        out = paged_decode_attention(qd, kc, vc, plan.block_tables, plan.seq_lens, scale,
                                     sliding_window=window, softcap=softcap,
                                     key_mask=key_mask, direct=True, **extras)
    except UnsupportedShapeError:
        return None   # e.g. a head_dim the kernel does not take: the usual path
    state.count("engine_decode_kernel_calls")
    return out.squeeze(2).transpose(0, 1).unsqueeze(0)          # [1, Hq, B, Dv]


class KernelDispatch:
    """Chooses the Triton kernels (CUDA, or KVConfig.kernels="triton") or the reference."""

    def __init__(self, state):
        self._state = weakref.ref(state)   # (the state holds this: no cycle, see RuntimeHook)
        self._warned: set[str] = set()

    @property
    def state(self):   # runtime/state.py ModelState
        return self._state()

    def use_triton(self, device: torch.device) -> bool:
        choice = self.state.config.kernels
        if choice == "reference":
            return False
        if choice in ("triton", "cuda"):
            return choice == "triton" or device.type == "cuda"
        return device.type == "cuda"

    def writer(self, device: torch.device):
        if not self.use_triton(device):
            return None
        try:
            from kvcompile.kernels.append import quantize_append
        except ImportError:
            return None

        def write(paged, slots, x, grouped=False):
            # pages the append kernel does not take (fp8 / fp4 channel scales, residual pages,
            # head_dim / page_size off its powers of two) are written by the reference, which
            # defines the same bytes (CUDA graphs say so: kernel_formats.graph_refusal)
            if not kernel_readable(paged, "append"):
                return paged.write(slots, x)
            return quantize_append(paged, slots, x, grouped, direct=True)

        return write

    def _decode_backend(self, q, kc, vc, extras: dict) -> str:
        """Which decode kernel runs ("cuda" on sm_90 where it applies, else "triton"); counted
        for the report, with the reason a requested CUDA kernel did not run said once."""
        from kvcompile.kernels.decode import cuda_decode_by_default, fast_path_reason

        choice = self.state.config.kernels
        if choice == "triton" or choice == "auto" and not cuda_decode_by_default(
                kc.fmt.name, vc.fmt.name, kc.fmt.granularity, vc.fmt.granularity):
            self.state.count("decode_triton")
            return "triton"
        why = fast_path_reason(
            q, kc.fmt.name, kc.fmt.granularity, vc.fmt.name, vc.fmt.granularity, kc.head_dim,
            vc.head_dim, kc.page_size, q.shape[1] // kc.num_heads * q.shape[2],
            extras.get("attn_mass"), bool(kc.fmt.residual or vc.fmt.residual),
            sinks=extras.get("sink_logits") is not None)
        if not why:
            self.state.count("decode_cuda")
            return "cuda"
        self.state.count("decode_triton")
        self.note(f"decode: Triton kernel, not the CUDA one ({why})", warn=True)
        return "triton"

    def _chunk_route(self, q, kc, vc, plan, starts, window, sink_logits: bool,
                     paged_ok: bool = True):
        """(Route, HostLens) for a prefill over pages (KVConfig prefill_chunk_route,
        kernels/prefill_gather.py choose_route), chosen once per forward and per kind of layer
        (window, sink logits, key bytes) through the plan's memo; the kernel takes the Route as
        decided. Why the rule chose is said once per reason in the report's kernel notes."""
        from kvcompile.kernels import prefill_gather as G

        cfg = self.state.config
        B, S = q.shape[0], q.shape[2]
        per_key = kc.num_heads * (kc.head_dim + vc.head_dim) * q.element_size()
        group = q.shape[1] // kc.num_heads
        memo = ("chunk_route", tuple(starts or ()), window, sink_logits, per_key, group,
                paged_ok)
        hit = plan.cache.get(memo)
        if hit is not None:
            return hit
        q_lens = list(plan.q_lens) if plan.packed else [S] * B
        host = G.HostLens(q_lens, list(plan.seq_lens_list), starts or [0] * len(q_lens))
        pick = G.choose_route(cfg.prefill_chunk_route, host, group, per_key,
                              cfg.prefill_gather_bytes, window=window, sink_logits=sink_logits,
                              paged_ok=paged_ok)
        reason = pick.reason.split(" (")[0]   # once per kind of reason, not per length
        key = f"chunked prefill: {pick.route} route ({reason})"
        if key not in self._warned:
            self._warned.add(key)
            self.state.kernel_notes.append(f"chunked prefill: {pick.route} route "
                                           f"({pick.reason})")
            if cfg.prefill_chunk_route == "gather" and pick.route == "paged":
                log.warning("kvcompile: prefill_chunk_route='gather' refused: %s; the paged "
                            "kernel runs", pick.reason)
        plan.cache[memo] = (pick, host)
        return pick, host

    def note(self, text: str, warn: bool = False) -> None:
        """A kernel choice said once: in kvcompile.report's kernel notes and the log."""
        if text not in self._warned:
            self._warned.add(text)
            self.state.kernel_notes.append(text)
            (log.warning if warn else log.info)("kvcompile: %s", text)

    def _fallback(self, why: str) -> None:
        """The reference attention runs where a kernel was asked for: counted, and said once
        per reason in kvcompile.report's kernel notes and the log (never silently)."""
        self.note(f"reference attention used ({why})")
        self.state.count("reference_fallback")

    def attend(self, layer: int, q, plan, mask_info, attn_mask, is_causal, window, softcap,
               scale, extras: dict | None = None):
        """Output [B, Hq, S, Dv] from a kernel (fast CUDA or portable Triton), or None to use
        the reference. q: [B, Hq, S, D] ([1, Hq, T, D] packed)."""
        if not self.use_triton(q.device):
            return None
        extras = extras or {}
        if plan.packed:
            attn_mask = None  # the engine's plan defines the structure (causal per sequence)
        pool = self.state.pool
        kc, vc = pool.k[layer], pool.v[layer]
        op = "decode" if plan.is_decode else "prefill"
        gather_only = False   # pages only the chunked prefill's gather route reads (int)
        if not (kernel_readable(kc, op) and kernel_readable(vc, op)):
            gather_only = (op == "prefill" and kernel_readable(kc, "gather")
                           and kernel_readable(vc, "gather"))
            if not gather_only:
                return self._fallback(f"{kc.fmt.name}/{vc.fmt.name} pages "
                                      f"({kc.fmt.granularity} scales, residual "
                                      f"{kc.fmt.residual or vc.fmt.residual}) have no Triton "
                                      f"{op} kernel")
        key_mask, kv_start = None, None
        if attn_mask is not None:
            if mask_info is None or mask_info.key_mask is None:
                return self._fallback(getattr(mask_info, "reason", "")
                                      or "mask with per-head or per-row structure")
            if plan.new_tokens == 1 and plan.is_decode:
                key_mask = mask_info.key_mask
            elif mask_info.exact:
                kv_start = mask_info.kv_start
                window = window or mask_info.window
            else:
                return self._fallback("mask that is not causal + padding + window")
        elif not is_causal and plan.new_tokens > 1 and not plan.packed:
            # (a packed plan is causal within each sequence whatever mask the model built: the
            # engine calls the model with use_cache=False, so HF passes a mask, not is_causal)
            return self._fallback("non-causal attention over several new tokens")
        try:
            if plan.is_decode:
                from kvcompile.kernels.decode import paged_decode_attention

                if kv_start is not None and any(kv_start):
                    return self._fallback("padded speculative decode")
                backend = self._decode_backend(q, kc, vc, extras)
                return paged_decode_attention(
                    q, kc, vc, plan.block_tables, plan.seq_lens, scale, key_mask=key_mask,
                    sliding_window=window, softcap=softcap, direct=True, backend=backend,
                    **extras)
            if prefill_mode(self.state.config, q) != "triton":
                self.state.count("prefill_gathered_sdpa")
                return None
            from kvcompile.kernels.prefill_gather import chunk_prefill_attention

            B, Hq, S, D = q.shape
            if plan.packed:
                qp = q[0].transpose(0, 1)
                cu = plan.cu_seqlens_q
            else:
                qp = q.transpose(1, 2).reshape(B * S, Hq, D)
                cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)
            start = None
            starts = list(kv_start or plan.kv_start)
            if kv_start is not None or any(plan.kv_start):
                start = torch.tensor(starts, dtype=torch.int32, device=q.device)
            route, host = self._chunk_route(q, kc, vc, plan, starts, window or 0,
                                            extras.get("sink_logits") is not None,
                                            paged_ok=not gather_only)
            if gather_only and route.route != "gather":
                return self._fallback(f"{kc.fmt.name}/{vc.fmt.name} pages: no paged prefill "
                                      f"kernel, and the gather route cannot run here "
                                      f"({route.reason})")
            out, _ = chunk_prefill_attention(
                qp.contiguous(), kc, vc, plan.block_tables, cu, plan.seq_lens, scale,
                route=route, sliding_window=window, softcap=softcap, kv_start=start,
                sink_logits=extras.get("sink_logits"), host=host,
                workspace_bytes=self.state.config.prefill_gather_bytes)
            self.state.count("prefill_gather" if route.route == "gather" else "prefill_triton")
            if plan.packed:
                return out.transpose(0, 1).unsqueeze(0)
            return out.reshape(B, S, Hq, -1).transpose(1, 2)
        except (ImportError, UnsupportedShapeError) as e:
            self._fallback(f"{type(e).__name__}: {e}")
            return None
