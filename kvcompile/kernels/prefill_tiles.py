"""Pieces shared by the prefill kernels: the key ranges of a query tile, the mask, the online
softmax step, and the version guards (triton 3.6 on the H200, 3.9 here).

A query tile holds BLOCK_M rows. With grouped-query attention the rows of one tile are
`BLOCK_M // GROUP` tokens times the GROUP query heads of one kv head (row r is token r // GROUP,
head r % GROUP), so every key/value tile loaded (and dequantized) serves the whole group.

Key ranges of a tile whose rows sit at positions [pos_lo, pos_hi] over valid keys [kv_lo, kv_hi):

    [sink tiles) ... [lo, a) masked | [a, b) unmasked | [b, hi) masked (diagonal, sequence end)

The unmasked middle carries almost all of the work and runs without any mask arithmetic.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # triton >= 3.4 on both machines; guarded so an older triton still runs the pointer path
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_tma(device: torch.device) -> bool:
    """TMA tensor descriptors: Hopper or newer, and the interpreter (which emulates them)."""
    if TensorDescriptor is None:
        return False
    if interpreting():
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def row_split(block_m: int, group: int) -> int:
    """Tokens per query tile of BLOCK_M rows when each token brings `group` query heads."""
    return max(block_m // group, 1)


@triton.jit
def key_ranges(pos_lo, pos_hi, kv_lo, kv_hi, window, live, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """(lo, a, b, hi): tiles [lo, a) and [b, hi) need the mask, [a, b) do not (all >= 0);
    all 0 when the tile is not `live` (past its sequence's end)."""
    if CAUSAL:
        hi = tl.minimum(kv_hi, pos_hi + 1)
    else:
        hi = kv_hi
    first = kv_lo
    if WINDOW:
        first = tl.maximum(kv_lo, pos_lo - window + 1)
    lo = (first // BLOCK_N) * BLOCK_N
    a = tl.cdiv(kv_lo, BLOCK_N) * BLOCK_N
    if WINDOW:
        a = tl.maximum(a, tl.cdiv(tl.maximum(pos_hi - window + 1, 0), BLOCK_N) * BLOCK_N)
    if CAUSAL:
        b = (tl.minimum(pos_lo + 1, kv_hi) // BLOCK_N) * BLOCK_N
    else:
        b = (kv_hi // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    a = tl.maximum(lo, tl.minimum(a, hi))
    b = tl.maximum(a, tl.minimum(b, hi))
    return (tl.where(live, lo, 0), tl.where(live, a, 0), tl.where(live, b, 0),
            tl.where(live, hi, 0))


@triton.jit
def sink_range(kv_lo, sinks, lo, BLOCK_N: tl.constexpr):
    """Tiles holding the first `sinks` keys that the window loop [lo, ...) does not cover."""
    s_lo = (kv_lo // BLOCK_N) * BLOCK_N
    s_hi = tl.minimum(tl.cdiv(kv_lo + sinks, BLOCK_N) * BLOCK_N, lo)
    return s_lo, tl.maximum(s_hi, s_lo)


@triton.jit
def visible(pos, keys, kv_lo, kv_hi, window, sinks, CAUSAL: tl.constexpr,
            WINDOW: tl.constexpr, SINKS: tl.constexpr):
    """[BM, BN] bool: may the row at `pos` see `keys`? (window: pos - key < window; the first
    `sinks` valid keys stay visible whatever the window)."""
    keys2 = keys[None, :]
    vis = (keys2 >= kv_lo) & (keys2 < kv_hi)
    if CAUSAL:
        vis = vis & (keys2 <= pos[:, None])
    if WINDOW:
        near = (pos[:, None] - keys2) < window
        if SINKS:
            near = near | (keys2 < kv_lo + sinks)
        vis = vis & near
    return vis


@triton.jit
def softcap_log2(s, softcap_log2e, inv_softcap):
    """softcap * tanh(s / softcap), in log2 units: s arrives as raw q.k * scale."""
    x = s * inv_softcap
    t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)
    return t * softcap_log2e


@triton.jit
def softmax_step(s, m_i, l_i, MASKED: tl.constexpr, P_SHIFT: tl.constexpr):
    """One online-softmax step over scores `s` [BM, BN] in log2 units (-inf where masked).

    Returns p (scaled by 2**P_SHIFT, so that fp8 P keeps small weights out of subnormals), the
    factor alpha that rescales the old accumulator, and the new running max and sum.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    else:
        m_use = m_new
    p = tl.exp2(s - (m_use - P_SHIFT)[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def softmax_step_scaled(qk, c, m_i, l_i, P_SHIFT: tl.constexpr):
    """softmax_step for an unmasked tile whose scores are qk * c[:, None] (c > 0): the scale is
    folded into one FMA per score, as in FlashAttention."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
    p = tl.exp2(qk * c[:, None] - (m_new - P_SHIFT)[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new
