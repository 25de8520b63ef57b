"""Plain-PyTorch attention used at run time where no kernel applies.

`paged_reference_attention` is what the CPU runs (KVConfig.kernels="reference", the default off
CUDA) and the fallback for masks or formats no kernel takes. It gathers a layer's pages for the
rows of a forward (one page-index tensor per forward, shared by every layer), dequantizes them
with the formats' reference decoders (PagedTensor.read) and calls torch SDPA in the model's
dtype with GQA: the kernel and dtype of Hugging Face's own SDPA attention, so that bf16 pages
give eager's numbers. `dense_attention` is the same over given k/v (a graph run without a cache
binding).

Non-finite values. A query's output is attention over the keys it may see:
- a NaN / Inf in a seen key's K or V reaches that query's output as it does in eager attention
  (softmax(q k^T) v: NaN, or +-Inf through V);
- masked keys are inert whatever they hold: stored slots never written may hold anything
  (storage is torch.empty). Eager instead multiplies their probability 0 by their value, so
  that a NaN under the mask (or a causally later one) turns rows that never see it into NaN;
- a query that sees no key outputs 0 (as torch SDPA does on the CPU).
SDPA runs first; only where its output is not finite is the attention recomputed in fp32 by
`exact_attention`, which applies these rules.

Attention sinks (`sink_logits [Hq]`, gpt-oss): a learned logit per query head joins each row's
softmax denominator and its probability is dropped, p = exp(s) / (sum exp(s) + exp(sink)).
SDPA has no such input, so attention with sinks runs `exact_attention` (fp32).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F

from kvcompile.cache.fp8 import (
    _FP16_NAN,
    _SIGN_EXP_MANT,
    E4M3_SHIFT,
    fp8_widen,
)
from kvcompile.kernels.masks import align
from kvcompile.kernels.reference import masked_softmax

_MASKED = -1e4  # additive mask values at or below this mask their key (as masks.py reads them)
_Q_BLOCK = 1024  # queries per block of exact_attention: bounds its [B, Hq, S, L] scores


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype SDPA runs in: the model's if half precision, else fp32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def sdpa_attention(q, k, v, allowed, additive, scale: float, causal: bool = False,
                   softcap: float = 0.0, sink_logits=None) -> torch.Tensor:
    """q [B, Hq, S, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv] (any float dtypes); allowed
    [B|1, Hq|1, S, L] bool or None; additive [B|1, Hq|1, S, L] float or None (values <= -1e4
    mask their key); causal: the S queries are the last S of the L positions and see only keys
    at or before their own; sink_logits [Hq] or None (attention sinks, the module docstring).
    -> [B, Hq, S, Dv] in compute_dtype(q.dtype)."""
    S, L = q.shape[2], k.shape[2]
    if causal and (allowed is not None or additive is not None or S > L
                   or S != L and not _lower_right_ok(q, k)):
        c = _causal(S, L, q.device)[None, None]
        allowed = c if allowed is None else allowed & c
        causal = False
    dt = compute_dtype(q.dtype)
    if softcap or sink_logits is not None:
        return exact_attention(q, k, v, _causal_if(allowed, causal, S, L, q.device), additive,
                               scale, softcap, sink_logits).to(dt)
    mask = allowed
    if additive is not None:
        mask = additive.to(dt)
        if allowed is not None:
            mask = mask.masked_fill(~allowed, float("-inf"))
    out = _sdpa(_as(q, dt), _as(k, dt), _as(v, dt), mask, scale, causal)
    if mask is None and not causal:
        return out  # (every query sees every key: SDPA propagates NaN / Inf as eager does)
    if _sdpa_trusted(out, k, dt):
        # a query that sees no key: 0. CUDA's half-precision SDPA kernels return a finite
        # non-zero row there (an H200 gave a relative error of 0.25 against 0)
        return _zero_empty_rows(out, allowed, additive) if out.is_cuda else out
    # a NaN / Inf in K or V (or in a masked slot): the exact rules of the module docstring
    return exact_attention(q, k, v, _causal_if(allowed, causal, S, L, q.device), additive,
                           scale, 0.0).to(dt)


def sdpa_rows(q, k, v, starts, scale: float) -> torch.Tensor:
    """Causal attention of a left-padded batch without its [B, 1, S, L] mask: row b's queries
    and keys from position starts[b] on (its tokens; the positions before are padding) in one
    SDPA call of their own, causal (flash / cuDNN where SDPA has them: no mask to read), and
    a padding query, which sees no key, 0, as `sdpa_attention` gives under the padded mask.
    q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], starts: B host ints.
    -> [B, Hq, S, Dv] in compute_dtype(q.dtype). One finiteness check for the batch (a NaN /
    Inf takes the row's `sdpa_attention`, with the module docstring's rules)."""
    B, Hq, S, _ = q.shape
    dt = compute_dtype(q.dtype)
    out = op_output(B, Hq, S, v.shape[-1], dt, q.device, zero=True)
    rows = [(b, s0) for b, s0 in enumerate(starts) if s0 < S]
    for b, s0 in rows:
        out[b:b + 1, :, s0:] = _sdpa(_as(q[b:b + 1, :, s0:], dt), _as(k[b:b + 1, :, s0:], dt),
                                     _as(v[b:b + 1, :, s0:], dt), None, scale, True)
    if _sdpa_trusted(out, k, dt):
        return out
    for b, s0 in rows:
        out[b:b + 1, :, s0:] = sdpa_attention(q[b:b + 1, :, s0:], k[b:b + 1, :, s0:],
                                              v[b:b + 1, :, s0:], None, None, scale, True)
    return out


def sdpa_packed(q, k, v, q_lens, scale: float) -> torch.Tensor:
    """Causal attention of prompts packed along the sequence (the Engine's step of fresh
    prompts): q [1, Hq, T, D], k [1, Hkv, T, D], v [1, Hkv, T, Dv]; prompt i is its q_lens[i]
    tokens after the earlier prompts' and attends to its own keys only. One SDPA call (flash /
    cuDNN) for each run of adjacent prompts of one length, as a batch of them (`_runs`: strided
    views, no copy; a call a prompt cost the Engine's B16 x P4096 prefill 41.5 ms of cuDNN
    against 35.2 for generate's one [16, 4096] call, H100), written into one output, and one
    finiteness check for them all (a check a prompt was a host sync a prompt and layer); a
    non-finite output takes each prompt's `sdpa_attention`, with the module docstring's rules.
    -> [1, Hq, T, Dv] in compute_dtype(q.dtype)."""
    dt = compute_dtype(q.dtype)
    out = op_output(1, q.shape[1], q.shape[2], v.shape[-1], dt, q.device)
    for t0, n, S in _runs(q_lens):
        views = [_as(_batch(x, t0, n, S), dt) for x in (q, k, v)]
        if n > 1 and not _fused_takes(*views):   # one call a prompt, as before
            for i in range(n):
                o = _sdpa(*(x[i:i + 1] for x in views), None, scale, True)
                _batch(out, t0 + i * S, 1, S).copy_(o)
            continue
        _batch(out, t0, n, S).copy_(_sdpa(*views, None, scale, True))
    if _sdpa_trusted(out, k, dt):
        return out
    ends = list(itertools.accumulate(q_lens))
    for n, e in zip(q_lens, ends, strict=True):
        rows = slice(e - n, e)
        out[:, :, rows] = sdpa_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], None,
                                         None, scale, True)
    return out


def _fused_takes(q, k, v) -> bool:
    """Whether a fused CUDA SDPA kernel (flash, cuDNN, memory-efficient) takes these strided
    batch views, causal and unmasked. Not one of them would leave the math kernel, whose
    [n, Hq, S, S] scores (16 GiB at 16 prompts of 4,096 tokens, 32 heads) a call a prompt
    never builds; on the CPU the views are what the per-prompt slices are (one flash kernel)."""
    if not q.is_cuda:
        return True
    try:
        from torch.backends import cuda
        p = cuda.SDPAParams(q, k, v, None, 0.0, True, q.shape[1] != k.shape[1])
        return bool(cuda.can_use_flash_attention(p, False) or cuda.can_use_cudnn_attention(p, False)
                    or cuda.can_use_efficient_attention(p, False))
    except (AttributeError, TypeError, RuntimeError):   # another torch's API: as before
        return False


def _runs(q_lens) -> list[tuple[int, int, int]]:
    """Adjacent prompts of equal length: [(first token, prompts, length)]."""
    runs, t = [], 0
    for S in q_lens:
        if runs and runs[-1][2] == S:
            runs[-1][1] += 1
        else:
            runs.append([t, 1, S])
        t += S
    return [tuple(r) for r in runs]


def _batch(x: torch.Tensor, t0: int, n: int, S: int) -> torch.Tensor:
    """x [1, H, T, D] -> tokens t0 .. t0 + n S as n prompts of S: [n, H, S, D], a view."""
    s = x.stride()
    return x.as_strided((n, x.shape[1], S, x.shape[3]), (S * s[2], s[1], s[2], s[3]),
                        x.storage_offset() + t0 * s[2])


def op_output(B: int, H: int, S: int, dv: int, dtype: torch.dtype, device,
              zero: bool = False) -> torch.Tensor:
    """An output [B, H, S, dv] laid out as the attention op returns it (a contiguous
    [B, S, H, dv], transposed: runtime/attention_op.py `_as_promised`), so that filling it
    part by part needs no copy at the end."""
    make = torch.zeros if zero else torch.empty
    return make(B, S, H, dv, dtype=dtype, device=device).transpose(1, 2)


def _sdpa_trusted(out: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether SDPA's output stands as it is: every element finite, and (on the CPU in half
    precision) the keys too. On some CPUs (an AMD EPYC, torch 2.13) the half-precision SDPA
    kernel returns 0, not NaN, for a query that sees a +Inf score: a finite output does not
    prove finite keys there. Otherwise the exact rules of the module docstring apply."""
    return _all_finite(out) and (out.is_cuda or dtype == torch.float32 or _all_finite(k))


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # x in dtype, without an op call where it already is (a CPU decode step runs this 90 times)
    return x if x.dtype == dtype else x.to(dtype)


# devices on which causal attention of S queries over L > S keys (a prompt chunk after its
# cached prefix) runs SDPA under torch's lower-right causal bias (its flash / memory-efficient
# kernels skip the masked blocks and read no mask) instead of an explicit [S, L] mask. None
# by default until the route has run on a GPU: tests/gpu/test_dense_gpu.py
# (test_chunk_causal_lower_right_on_cuda) checks it there and benchmarks/bench_latent_chunk.py
# times it (expand_lr against expand_mask); set ("cuda",) to take it
LOWER_RIGHT_DEVICES: tuple[str, ...] = ()


def _lower_right_ok(q, k) -> bool:
    """Whether `_sdpa` takes causal S < L through torch's lower-right causal bias: on
    LOWER_RIGHT_DEVICES, one K/V head a query head (the bias's fused kernels take no GQA),
    head dims within the fused kernels' 256."""
    return (q.device.type in LOWER_RIGHT_DEVICES and q.shape[1] == k.shape[1]
            and q.shape[-1] <= 256)


def _sdpa(q, k, v, mask, scale: float, causal: bool) -> torch.Tensor:
    B, Hq, S, _ = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if causal and S != L:   # (sdpa_attention: S < L, _lower_right_ok, no mask)
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(S, L),
                                              scale=scale)
    if S == 1 and Hq != Hkv and (mask is None or mask.shape[1] == 1):
        # one query per row: the query heads of a group become the group's query rows (as HF
        # does for a masked decode step), so that each K/V head is read once
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, -1), k, v,
                                             attn_mask=mask, scale=scale)
        return out.reshape(B, Hq, 1, -1)
    if _math_expands(q, k, mask) and _math_bytes(q, k) > MATH_BLOCK_BYTES:
        return _sdpa_blocks(q, k, v, mask, scale, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          is_causal=causal, enable_gqa=Hq != Hkv)


# scores of one call of torch's math SDPA at most (fp32 bytes of [B, H, S, L]): past this, a
# call that only the math path takes runs in blocks (`_sdpa_blocks`)
MATH_BLOCK_BYTES = 1 << 30


def _math_expands(q, k, mask) -> bool:
    """Whether only torch's math SDPA takes this call (head dims past the fused kernels' 256,
    or query heads sharing K/V heads under a mask), which materializes the [B, Hq, S, L]
    scores and repeats K / V to every query head (a 32-query MLA chunk absorbed over 32k
    latents at 128 heads asked for 144 GiB)."""
    return q.shape[-1] > 256 or (q.shape[1] != k.shape[1] and mask is not None)


def _math_bytes(q, k) -> int:
    return 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]


def _sdpa_blocks(q, k, v, mask, scale: float, causal: bool) -> torch.Tensor:
    """`_sdpa` for a call only the math path takes, MATH_BLOCK_BYTES of scores a block: a
    K/V head at a time, the query heads of its group folded into the query rows (as the
    one-query case does: K / V read once, never repeated), query rows in blocks, a causal
    mask built per block. Rows are independent, so the result is the unblocked call's."""
    B, Hq, S, _ = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    rows = max(1, min(S, MATH_BLOCK_BYTES // max(4 * B * G * L, 1)))
    out = q.new_empty((B, Hq, S, v.shape[-1]))
    k_pos = torch.arange(L, device=q.device)
    for j in range(Hkv):
        heads = slice(j * G, (j + 1) * G)
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            n = s1 - s0
            qb = q[:, heads, s0:s1].reshape(B, 1, G * n, -1)
            if causal:
                q_pos = torch.arange(L - S + s0, L - S + s1, device=q.device)
                m = (k_pos[None] <= q_pos[:, None])[None, None]          # [1, 1, n, L]
            else:
                m = mask
            if m is not None:
                m = m[:, heads if m.shape[1] > 1 else slice(None)]
                if not causal and m.shape[2] > 1:
                    m = m[:, :, s0:s1]
                m = m.expand(m.shape[0], G, n, L).reshape(m.shape[0], 1, G * n, L)
            o = F.scaled_dot_product_attention(qb, k[:, j:j + 1], v[:, j:j + 1],
                                               attn_mask=m, scale=scale)
            out[:, heads, s0:s1] = o.reshape(B, G, n, -1)
    return out


def exact_attention(q, k, v, allowed, additive, scale: float, softcap: float,
                    sink_logits=None) -> torch.Tensor:
    """The contract of `sdpa_attention` (causality given in `allowed`), in fp32 math, with the
    non-finite rules of the module docstring. -> [B, Hq, S, Dv] fp32."""
    S = q.shape[2]
    sink = None if sink_logits is None else sink_logits.float().view(1, -1, 1, 1)
    if S <= _Q_BLOCK:
        return _exact(q, k, v, allowed, additive, scale, softcap, sink)
    outs = []
    for s0 in range(0, S, _Q_BLOCK):
        rows = slice(s0, min(S, s0 + _Q_BLOCK))
        outs.append(_exact(q[:, :, rows], k, v, _rows(allowed, rows), _rows(additive, rows),
                           scale, softcap, sink))
    return torch.cat(outs, dim=2)


def _exact(q, k, v, allowed, additive, scale, softcap, sink=None):
    # sink: [1, Hq, 1, 1] fp32 sink logits (masked_softmax's `sink`) or None
    B, Hq, S, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    # GQA without repeating K/V: the query heads of a group share one matmul
    qg = q.float().reshape(B, Hkv, rep * S, D)
    s = torch.matmul(qg, k.float().transpose(-1, -2)).reshape(B, Hq, S, L) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = allowed
    if additive is not None:
        s = s + additive.float()
        kept = additive > _MASKED
        seen = kept if seen is None else seen & kept
    p = masked_softmax(s, seen, sink)   # a masked key's NaN score is gone; empty rows -> 0
    pg = p.reshape(B, Hkv, rep * S, L)
    vf = v.float()
    bad = ~torch.isfinite(vf)
    if seen is None or not bool(bad.any()):
        return torch.matmul(pg, vf).reshape(B, Hq, S, -1)
    # Finite values by one matmul; a seen key's non-finite value then reaches the output as
    # p * v does in eager: NaN always, +-Inf where p > 0 (NaN where p == 0, or where +Inf and
    # -Inf meet). Masked keys add nothing. Hits are counted with 0/1 matmuls (exact in fp32).
    out = torch.matmul(pg, torch.where(bad, 0.0, vf))                       # [B, Hkv, rep*S, Dv]
    sg = seen.expand(B, Hq, S, L).reshape(B, Hkv, rep * S, L)

    def hit(rows, cols):
        return torch.matmul(rows.float(), cols.float()) > 0

    pos, neg = hit(sg & (pg > 0), vf == math.inf), hit(sg & (pg > 0), vf == -math.inf)
    nan = hit(sg, torch.isnan(vf)) | hit(sg & (pg == 0), torch.isinf(vf)) | (pos & neg)
    out = torch.where(pos, math.inf, torch.where(neg, -math.inf, out))
    out = torch.where(nan, math.nan, out)
    return out.reshape(B, Hq, S, -1)


def _zero_empty_rows(out, allowed, additive) -> torch.Tensor:
    # out [B, Hq, S, Dv]; allowed / additive [B|1, Hq|1, S, L] or None
    seen = None if allowed is None else allowed
    if additive is not None:
        open_ = additive > _MASKED
        seen = open_ if seen is None else seen & open_
    if seen is None:
        return out
    return out.masked_fill(~seen.any(-1, keepdim=True), 0)


def _all_finite(out: torch.Tensor) -> bool:
    """Whether every element of `out` is finite, or (rarely) a finite `out` whose fp32 sum
    overflows: then the caller takes its exact path, which gives the same finite values. One
    reduction read of `out`; `torch.isfinite(out).all()` ran four elementwise kernels over it
    and wrote two temporaries of its size (abs and a logical and: 2.8 + 2.1 ms of the Engine's
    B16 x P4096 first token on an H100, twenty-ninth session's profile). A NaN or an infinity
    anywhere makes the sum NaN or infinite."""
    if out.is_cuda and torch.cuda.is_current_stream_capturing():
        return True  # no host sync inside a CUDA graph capture
    return bool(torch.isfinite(out.sum(dtype=torch.float32)))


def _rows(mask, rows: slice):
    return None if mask is None or mask.shape[2] == 1 else mask[:, :, rows]


def _causal(s: int, total: int, device) -> torch.Tensor:
    """[S, L] bool: query i (position total - S + i) sees keys <= its position."""
    return torch.ones(s, total, dtype=torch.bool, device=device).tril(total - s)


def _causal_if(allowed, causal: bool, s: int, total: int, device):
    return _causal(s, total, device)[None, None] if causal else allowed


# --- unbatched forms (the CLI's verify, tests) --------------------------------------------------

def _batched(mask):
    return None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def attend_fp32(q, k, v, allowed, additive, scale: float, softcap: float,
                sink_logits=None) -> torch.Tensor:
    """q [Hq, S, D], k [Hkv, L, D], v [Hkv, L, Dv], allowed / additive [.., S, L] or None,
    sink_logits [Hq] or None -> [Hq, S, Dv] fp32, by `exact_attention`."""
    return exact_attention(q[None], k[None], v[None], _batched(allowed), _batched(additive),
                           scale, softcap, sink_logits)[0]


def attend_sdpa(q, k, v, allowed, additive, scale: float, causal: bool = False) -> torch.Tensor:
    """The contract of `attend_fp32` through `sdpa_attention` (torch SDPA in the model's
    dtype): [Hq, S, Dv] fp32."""
    return sdpa_attention(q[None], k[None], v[None], _batched(allowed), _batched(additive),
                          scale, causal)[0].float()


# --- masks ---------------------------------------------------------------------------------------

def _structure(s: int, total: int, is_causal: bool, window: int, device) -> torch.Tensor | None:
    """[S, L] bool from causality (queries are the last S positions) and a sliding window, or
    None where it masks nothing."""
    causal = is_causal and s > 1
    window = window if window and total > window else 0
    if not causal and not window:
        return None
    q_pos = torch.arange(total - s, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    ok = k_pos <= q_pos if causal else torch.ones(s, total, dtype=torch.bool, device=device)
    if window:
        ok = ok & ((q_pos - k_pos) < window)
    return ok


def _model_mask(attn_mask: torch.Tensor | None, total: int):
    """The model's mask [B|1, H|1, S, Lm] (or fewer dims) -> (allowed, additive), 4-d, aligned
    to `total` keys (masks.py's column convention)."""
    if attn_mask is None:
        return None, None
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if m.dtype == torch.bool:
        return align(m, total), None
    lm = m.shape[-1]
    if lm >= total:
        return None, m[..., :total]
    pad = m.new_full((*m.shape[:-1], total - lm), float("-inf"))
    return None, torch.cat([pad, m], dim=-1)


def _masks(attn_mask, s: int, total: int, is_causal: bool, window: int, starts, device):
    """(allowed, additive, causal) for sdpa_attention: the model's mask, causality, the window
    and per-row kv_start (starts: list or None), combined. causal=True (and no mask) where
    plain causal attention of the last S of L positions (S == L, or on LOWER_RIGHT_DEVICES
    1 < S < L: a chunk after its prefix, for sdpa_attention's lower-right causal bias) is all
    there is. (Elsewhere a chunk's mask is built here, once a forward for a plan's rows.)"""
    lower_right = 1 < s < total and torch.device(device).type in LOWER_RIGHT_DEVICES
    if (attn_mask is None and is_causal and (s == total or lower_right)
            and not (window and total > window) and not any(starts or ())):
        return None, None, True
    allowed, additive = _model_mask(attn_mask, total)
    struct = _structure(s, total, is_causal, window, device)
    if struct is not None:
        allowed = struct[None, None] if allowed is None else allowed & struct
    if any(starts or ()):
        st = torch.tensor(starts, device=device)[:, None, None, None]          # [b, 1, 1, 1]
        ok = torch.arange(total, device=device) >= st                          # [b, 1, 1, L]
        allowed = ok if allowed is None else allowed & ok
    return allowed, additive, False


def dense_attention(q, k, v, attn_mask, scale, is_causal, sliding_window, softcap,
                    sink_logits=None):
    # q [B, Hq, S, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv], sink_logits [Hq] | None
    # -> [B, Hq, S, Dv] in q's dtype
    if scale is None or scale <= 0:
        scale = 1.0 / math.sqrt(q.shape[-1])
    allowed, additive, causal = _masks(attn_mask, q.shape[2], k.shape[2], is_causal,
                                       sliding_window, None, q.device)
    return sdpa_attention(q, k, v, allowed, additive, scale, causal, softcap,
                          sink_logits).to(q.dtype)


# --- paged ---------------------------------------------------------------------------------------

def paged_reference_attention(kt, vt, q, plan, attn_mask, is_causal, sliding_window,
                              softcap, scale, sink_logits=None, latent: bool = False):
    """Attention of q over one layer's pages (kt, vt: PagedTensor, [N, P, Hkv, D] pages) for
    each sequence of the plan (its block tables, lengths and padding offsets).
    q [B, Hq, S, D] (packed: [1, Hq, T, D]) -> [B, Hq, S, Dv] in compute_dtype(q.dtype).
    Rows of one length share one gather and one SDPA call (every row, in a generate call);
    what the layers of a forward share (page indices, masks) is built by the first.
    sink_logits [Hq] or None: attention sinks (the module docstring).
    latent: MLA pages (kernels/latent.py): kt holds the latent c [.., r], vt the rotary key
    [.., dr]; the keys are [c, k_rope], the values c, q is the absorbed [B, Hq, S, r + dr] and
    the output the weighted latents [B, Hq, S, r]."""
    if plan.packed:
        return _packed_attention(kt, vt, q, plan, sliding_window, softcap, scale, sink_logits,
                                 latent)
    key = ("reference", None if attn_mask is None else (attn_mask.data_ptr(),
                                                       tuple(attn_mask.shape)),
           is_causal, sliding_window, q.shape[2])
    entry = plan.cache.get(key)
    if entry is None:   # the entry holds the mask, so that its address is not reused (masks.py)
        entry = plan.cache[key] = (attn_mask, _groups(plan, attn_mask, is_causal, sliding_window,
                                                      q.shape[2], kt.page_size, q.device))
    groups = entry[1]
    dt = compute_dtype(q.dtype)
    if len(groups) == 1 and groups[0][0] is None:  # every row one length
        _, idx, b, total, allowed, additive, causal, rows = groups[0]
        return sdpa_attention(q, *_kv(kt, vt, idx, b, total, dt, latent, rows), allowed,
                              additive, scale, causal, softcap, sink_logits)
    B, Hq, S, _ = q.shape
    out = torch.empty((B, Hq, S, (kt if latent else vt).head_dim), dtype=dt, device=q.device)
    for sel, idx, b, total, allowed, additive, causal, rows in groups:
        out[sel] = sdpa_attention(q[sel], *_kv(kt, vt, idx, b, total, dt, latent, rows),
                                  allowed, additive, scale, causal, softcap, sink_logits)
    return out


def _kv(kt, vt, idx, b, total: int, dt, latent: bool, rows: dict | None = None):
    """The keys and values of b rows: [b, Hkv, total, D], [b, Hkv, total, Dv]. rows: a
    forward's memo of `_page_rows` by head count (shared by its layers)."""
    k = _gather(kt, idx, b, total, dt, _rows_of(rows, idx, b, kt.num_heads))
    v = _gather(vt, idx, b, total, dt, _rows_of(rows, idx, b, vt.num_heads))
    if latent:   # MLA: keys [c, k_rope] (one head), values the latent c itself
        return torch.cat([k, v], dim=-1), k
    return k, v


def _rows_of(memo: dict | None, idx, b: int, heads: int) -> torch.Tensor:
    if memo is None:
        return _page_rows(idx, b, heads)
    rows = memo.get(heads)
    if rows is None:
        rows = memo[heads] = _page_rows(idx, b, heads)
    return rows


def _groups(plan, attn_mask, is_causal: bool, window: int, s: int, page_size: int, device):
    """Rows of the plan by length: (rows [b] index or None for all, page index [b * n], b,
    total, allowed, additive, causal, memo of `_page_rows` by head count) each."""
    by_len: dict[int, list[int]] = {}
    for b, total in enumerate(plan.seq_lens_list):
        by_len.setdefault(total, []).append(b)
    out = []
    for total, rows in by_len.items():
        whole = len(rows) == plan.batch
        m = attn_mask
        if m is not None and not whole and m.dim() == 4 and m.shape[0] > 1:
            m = m[rows]
        masks = _masks(m, s, total, is_causal, window, [plan.kv_start[b] for b in rows], device)
        idx = _pages(plan.block_tables, rows, whole, total, page_size)
        sel = None if whole else torch.tensor(rows, device=device)
        out.append((sel, idx, len(rows), total, *masks, {}))
    return out


def _packed_attention(kt, vt, q, plan, sliding_window, softcap, scale, sink_logits=None,
                      latent=False):
    # q [1, Hq, T, D] packed: sequence i owns q columns cu[i]:cu[i+1]; causal within each
    if "reference_cu" not in plan.cache:
        plan.cache["reference_cu"] = plan.cu_seqlens_q.tolist()
    cu = plan.cache["reference_cu"]
    out = None
    for i, total in enumerate(plan.seq_lens_list):
        s = cu[i + 1] - cu[i]
        if s == 0:
            continue
        key = ("reference", total, (i,))
        if key not in plan.cache:
            plan.cache[key] = (_pages(plan.block_tables, [i], False, total, kt.page_size), {})
        idx, rows = plan.cache[key]
        allowed, additive, causal = _masks(None, s, total, True, sliding_window, None, q.device)
        dt = compute_dtype(q.dtype)
        o = sdpa_attention(q[:, :, cu[i]:cu[i + 1]],
                           *_kv(kt, vt, idx, 1, total, dt, latent, rows), allowed, additive,
                           scale, causal, softcap, sink_logits)
        if out is None:
            out = o.new_zeros((*q.shape[:-1], o.shape[-1]))
        out[:, :, cu[i]:cu[i + 1]] = o
    width = (kt if latent else vt).head_dim
    return out if out is not None else q.new_zeros((*q.shape[:-1], width))


def _pages(block_tables, rows, whole: bool, total: int, page_size: int) -> torch.Tensor:
    """[b * n] int64: the first n = ceil(total / P) pages of each of the rows, row-major."""
    n = (total + page_size - 1) // page_size
    bt = block_tables if whole else block_tables[torch.tensor(rows, device=block_tables.device)]
    return bt[:, :n].long().reshape(-1)


def _page_rows(idx: torch.Tensor, b: int, heads: int) -> torch.Tensor:
    """[b * H * n] int64: the rows of a layer's pages seen as [N * H, ...] (one page-head each)
    that lay out b rows' pages idx [b * n] heads first: row (r, h, j) = idx[r, j] * H + h."""
    n = idx.numel() // b
    ids = idx.view(b, 1, n) * heads + torch.arange(heads, device=idx.device).view(1, heads, 1)
    return ids.reshape(-1)


def _gather(paged, idx: torch.Tensor, b: int, total: int, dtype: torch.dtype,
            rows: torch.Tensor | None = None) -> torch.Tensor:
    """The first `total` tokens of b rows whose pages are idx [b * n] -> [b, H, total, D] in
    `dtype` (dequantized by PagedTensor.read; unquantized pages read as stored). rows: their
    `_page_rows`, by which one index_select gathers the page-heads heads first (no second
    pass to transpose them)."""
    n, H, P, D = idx.numel() // b, paged.num_heads, paged.page_size, paged.head_dim
    fmt = paged.fmt
    fp8 = fmt.name.startswith("fp8")
    if fmt.residual or (fmt.is_quantized and not fp8) or not paged.data.is_contiguous():
        return _gather_read(paged, idx, b, n, total, dtype)
    if rows is None:
        rows = _page_rows(idx, b, H)
    if fp8:
        # PagedTensor.read's fp8_decode in two passes: the widening (fp8_widen: integer ops to
        # fp16, then fp32) and the scale product, on the page-heads gathered heads first
        if not _widen_rows_applies(paged):
            return _gather_fp8_widened(paged, idx, b, n, total, dtype)
        x, sc = _fp8_rows_host((paged,), rows, b, n, total)
        # (the product is taken in fp32 whatever the output's dtype, as PagedTensor.read does)
        out = x.mul_(sc) if dtype == torch.float32 else torch.mul(x, sc).to(dtype)
    else:
        out = paged.rows_view("data").index_select(0, rows)                 # [b*H*n, P, D]
        if out.dtype != dtype:
            out = out.to(dtype)
    return out.as_strided((b, H, total, D), (H * n * P * D, n * P * D, D, 1))


def _fp8_rows_host(parts, rows: torch.Tensor | np.ndarray, b: int, n: int, total: int,
                   scratch: dict | None = None, start: int | None = None):
    """(x [len(parts), b, H, n, P, D] fp32, sc broadcastable to x) with x * sc ==
    PagedTensor.read's values of the page-heads `rows` (`_page_rows`) of each of `parts`
    (fp8 PagedTensors of one format and shape: a layer's K and V are decoded together), in the
    heads-first layout.

    fp8_widen's integer ops, run by numpy on views of the pool's memory (`host_rows`): on the
    CPU a torch op costs a few microseconds of dispatch whatever its size, a numpy op on these
    sizes about one; only the fp16 -> fp32 widening (vectorized in torch, exact, no denormal
    read or made) is a torch op, and the caller's scale product. E4M3's 2^8 folds into the
    scales (unless a product would leave fp32: then into x). The NaN repair looks only at each
    head's first `total` tokens: the rest of the last page is whatever the pool held.

    scratch: a dict kept by the caller for one decode step (`CpuDecodeStep`): the codes, int16
    and fp32 buffers are made once per shape and reused by every layer (then x is the scratch
    fp32 buffer, rewritten by the next call: the caller is done with it by then). A fresh
    allocation of these sizes costs its page faults on every call. start: where b == 1 and
    the row's pages are start, start + 1, ... (the caller knows), their codes are widened in
    place, without the gathered copy."""
    first = parts[0]
    H, P, D = first.num_heads, first.page_size, first.head_dim
    e5m2, gran = _fp8_kind(first)
    r = rows if isinstance(rows, np.ndarray) else rows.numpy()
    k = len(parts)
    shape = (k, r.shape[0], P * first.data.shape[-1])
    w = 0 if gran == "tensor" else first.host_rows("scale").shape[1]
    key = (shape, gran, w, b, n)
    bufs = None if scratch is None else scratch.get(key)
    if bufs is None:
        bufs = _fp8_rows_buffers(shape, gran, w, b, H, n, P, D)
        if scratch is not None:
            scratch[key] = bufs
    codes, i16, x, h16, s, sc = bufs
    # int8 codes times 2^7 (E4M3) / 2^8 (E5M2) into int16 in one pass: sign-extended, the sign
    # lands in bit 15 (no product leaves int16)
    mult = np.int16(256 if e5m2 else 128)
    nan_seen = False
    run = start is not None and b == 1
    if run:
        # the row's pages are start .. start + n - 1: their page-heads are one block of the
        # pool, read in place (no gathered copy of the codes); heads-first by the strides
        scales = []
        for i, t in enumerate(parts):
            blk, codes_hf, scale_hf = _run_views(t, start, n, H)
            scales.append(scale_hf)
            # a NaN code (s 1111 111) anywhere in the block, the rest of the last page
            # included: looked at exactly below (`|` and not `or`: every part's screen is
            # taken and kept, whatever an earlier part's)
            if not e5m2:
                nan_seen = _nan_codes_in(t, blk, start, n, H) | nan_seen
            np.multiply(codes_hf, mult, out=i16[i].reshape(H, n, -1))
    else:
        for i, t in enumerate(parts):
            # (mode "clip": np.take with `out` and the default "raise" copies through a
            # buffer, 8x slower here; the rows are the pool's by construction)
            np.take(t.host_rows("codes"), r, axis=0, out=codes[i], mode="clip")   # [b*H*n, P*Ds]
        np.multiply(codes.view(np.int8), mult, out=i16)   # E5M2: code << 8, the fp16 itself
        if not e5m2:
            low = np.bitwise_and(codes.reshape(k * b * H, -1)[:, :total * D], 0x7F)
            nan_seen = np.maximum.reduce(low, None) == 0x7F
    if e5m2:
        factor = 1.0
    else:
        np.bitwise_and(i16, _SIGN_EXP_MANT, out=i16)   # code << 7 less the sign's copy in bit 14
        if nan_seen:   # the NaN codes' placed bits s 0111 1111 0000000: exactly, among the
            # tokens written (then all of them set to NaN: the rest is not read)
            low = np.bitwise_and(i16.reshape(k * b * H, -1)[:, :total * D], _NAN_PLACED)
            if np.maximum.reduce(low, None) == _NAN_PLACED:
                i16[np.bitwise_and(i16, _NAN_PLACED) == _NAN_PLACED] = _FP16_NAN
        factor = E4M3_SHIFT
    x.copy_(h16)                                       # fp16 -> fp32, exact
    if gran == "tensor":
        s[:] = [float(t.scale.reshape(())) for t in parts]
    elif run:   # the block's scales heads-first, times the factor in the same pass, unless
        # a product would leave fp32: then the factor goes into x (exact there)
        into_x = factor != 1.0 and not all(   # (a NaN scale: into x, as below)
            float(np.maximum.reduce(v, None)) * factor <= _FP32_MAX for v in scales)
        f32 = np.float32(1.0 if into_x else factor)
        for i, scale_hf in enumerate(scales):
            np.multiply(scale_hf, f32, out=s[i].reshape(H, n, -1))
        if into_x:
            x.mul_(factor)
        return x, sc
    else:
        for i, t in enumerate(parts):
            np.take(t.host_rows("scale"), r, axis=0, out=s[i], mode="clip")   # [b*H*n, w]
    if factor != 1.0:
        if float(np.maximum.reduce(s, None)) * factor <= _FP32_MAX:
            np.multiply(s, np.float32(factor), out=s)
        else:   # a scale so large that factor * scale leaves fp32: into x (exact there)
            x.mul_(factor)
    return x, sc


def _run_views(t, start: int, n: int, H: int):
    """(codes [n*H, P*Ds] uint8, the same as int8 heads-first [H, n, P*Ds], scales heads-first
    [H, n, w]) of t's pages start .. start + n - 1: numpy views of the pool's memory, kept with
    t's views for the last run asked (a run grows by a page every P steps)."""
    views = t.__dict__.setdefault("_views", {})
    kept = views.get("fp8_run")
    if kept is None or kept[0] != start or kept[1] != n:
        blk = t.host_rows("codes")[start * H:(start + n) * H]
        scale = t.host_rows("scale")[start * H:(start + n) * H]
        kept = views["fp8_run"] = (start, n, blk,
                                   blk.view(np.int8).reshape(n, H, -1).transpose(1, 0, 2),
                                   scale.reshape(n, H, -1).transpose(1, 0, 2))
    return kept[2:]


def _nan_codes_in(t, blk: np.ndarray, start: int, n: int, H: int) -> bool:
    """Whether blk (E4M3 codes of t's pages start .. start + n - 1, [n * H, P * Ds] uint8)
    may hold a NaN code: uint8 max 255 or int8 max 127 (the reductions), screened once. A
    clean screen is kept with t's views as (start, n, data, data._version): the next call on
    the same run screens only its pages past those n. What the one-token writes place by
    numpy without a version bump (`PagedTensor.write_tokens_fp8`, `_reencode_heads`) are
    codes of finite values, never NaN; every other writer is torch and bumps the version
    (an inference tensor has none: screened every time)."""
    views, d = t.__dict__["_views"], t.data
    kept = views.get("nan_free")
    done = 0
    if kept is not None and kept[0] == start and kept[2] is d and kept[3] == d._version:
        done = min(kept[1], n)
    if done < n:
        part = blk[done * H:]
        if (np.maximum.reduce(part, None) == 0xFF
                or np.maximum.reduce(part.view(np.int8), None) == 0x7F):
            return True
        if not d.is_inference():
            views["nan_free"] = (start, n, d, d._version)
    return False


def _fp8_rows_buffers(shape, gran: str, w: int, b: int, H: int, n: int, P: int, D: int):
    """`_fp8_rows_host`'s buffers: codes (uint8) and int16 [k, b*H*n, P*Ds] numpy, x [k, b, H,
    n, P, D] fp32 torch, the int16's memory as fp16 torch, the scales numpy and the same
    memory as a torch tensor broadcastable to x."""
    k = shape[0]
    i16 = np.empty(shape, np.int16)
    if gran == "tensor":
        s = np.empty(k, np.float32)
        view = (k, 1, 1, 1, 1, 1)
    else:
        s = np.empty((k, shape[1], w), np.float32)
        tail = (w, 1) if gran == "token" else (1, w) if gran == "channel" else (1, 1)
        view = (k, b, H, n, *tail)
    return (np.empty(shape, np.uint8), i16, torch.empty((k, b, H, n, P, D), dtype=torch.float32),
            torch.from_numpy(i16).view(torch.float16).view(k, b, H, n, P, D),
            s, torch.from_numpy(s).view(view))


def _fp8_kind(paged) -> tuple[bool, str]:
    """(E5M2?, scale granularity) of fp8 pages, looked up once per tensor."""
    kind = paged.__dict__.get("_fp8_kind")
    if kind is None:
        fmt = paged.fmt
        kind = paged._fp8_kind = (fmt.storage_dtype == torch.float8_e5m2, fmt.granularity)
    return kind


_FP32_MAX = float(torch.finfo(torch.float32).max)
_NAN_PLACED = 0x3F80   # E4M3's NaN codes' low 7 bits, placed (code << 7): no finite code has them


def _widen_rows_applies(paged) -> bool:
    """Whether `_gather` decodes fp8 page-heads by `_fp8_rows_host`: a CPU pool of E4M3 or
    E5M2 codes with contiguous scales (kept with the tensor's views: a growth forgets it)."""
    views = paged.__dict__.setdefault("_views", {})
    ok = views.get("widen_rows")
    if ok is None:
        ok = views["widen_rows"] = (
            paged.data.device.type == "cpu" and paged.scale.is_contiguous()
            and paged.data.is_contiguous() and not paged.data.requires_grad
            and paged.fmt.storage_dtype in (torch.float8_e4m3fn, torch.float8_e5m2))
    return ok


def _gather_read(paged, idx, b: int, n: int, total: int, dtype) -> torch.Tensor:
    """`_gather` by PagedTensor.read (the formats' reference decoders) and one pass that lays
    each head's tokens out contiguously, in the compute dtype."""
    H, P, D = paged.num_heads, paged.page_size, paged.head_dim
    x = paged.read(idx)                                                      # [b*n, H, P, D]
    out = torch.empty((b, H, n, P, D), dtype=dtype, device=paged.data.device)
    out.copy_(x.view(b, n, H, P, D).transpose(1, 2))
    return out.view(b, H, n * P, D)[:, :, :total]


def _fp8_row_scales(paged, rows: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """The fp8 scales (page, token or channel granularity) of the page-heads `rows`
    (`_page_rows`), broadcastable to [b, H, n, P, D] fp32."""
    g, s = paged.fmt.granularity, paged.scale
    tail = (s.shape[2], 1) if g == "token" else (1, s.shape[2]) if g == "channel" else (1, 1)
    return paged.rows_view("scale").index_select(0, rows).view(b, paged.num_heads, n, *tail)


def _gather_fp8_widened(paged, idx, b: int, n: int, total: int, dtype) -> torch.Tensor:
    """`_gather` of fp8 pages where the host path (`_fp8_rows_host`) does not apply: integer widening
    (fp8_widen) and one scale product into the heads-first layout."""
    H, P, D = paged.num_heads, paged.page_size, paged.head_dim
    out = torch.empty((b, H, n, P, D), dtype=dtype, device=paged.data.device)
    x, factor = fp8_widen(paged.data.index_select(0, idx))                  # [b*n, H, P, D]
    sc = _fp8_scales(paged, idx, b, n, factor)                               # bcast to out
    if sc is None:   # a scale so large that factor * scale leaves fp32: unfolded
        x = x.float().mul_(factor)
        sc = _fp8_scales(paged, idx, b, n, 1.0)
    torch.mul(x.view(b, n, H, P, D).transpose(1, 2), sc, out=out)
    return out.view(b, H, n * P, D)[:, :, :total]


def _fp8_scales(paged, idx: torch.Tensor, b: int, n: int, factor: float):
    """The fp8 scales of pages idx [b * n] times `factor`, broadcastable to [b, H, n, P, D]
    fp32, or None where a product leaves fp32's range (scales near 2^120; factor: 2^8 or 1)."""
    g, s = paged.fmt.granularity, paged.scale
    if g == "tensor":
        sc = s.view(1, 1, 1, 1, 1) * factor
    else:
        sc = s.index_select(0, idx)
        tail = (s.shape[2], 1) if g == "token" else (1, s.shape[2]) if g == "channel" else (1, 1)
        sc = sc.view(b, n, paged.num_heads, *tail).transpose(1, 2)
        if factor != 1.0:
            sc = sc * factor
    if factor != 1.0 and float(sc.amax()) == math.inf:
        return None
    return sc
