"""H2O's attention mass of a prompt, after the prompt attended through the plain kernels: per
key, the softmax probabilities it received, summed over the queries of the prompt (or chunk)
and over the query heads of its kv head's group. Two passes over Q K^T, none over V:

    _row_lse_kernel   one program per (query tile, row, query head): the log-sum-exp of each
                      query's scores over the keys it may see (online max / sum, base 2)
    _key_mass_kernel  one program per (key tile, row, kv head): sum over the group's query
                      heads and the query tiles that may see the tile of exp2(s - lse)

Rows are packed: row b's queries are q[:, q_off[b] + t] (t < q_len[b], at logical positions
pos0[b] + t), its keys k[:, k_start[b] + j] (j < k_len[b], key j at logical position j: nothing
of the row is evicted), keys j < start[b] are left padding. Causality, the model's sliding
window and soft-capping are applied as eviction/attend.py `attend_kept` applies them; the mass
is that function's `mass` (its reference, `attend.prompt_mass`, is the CPU path).

Operands: q in its own dtype, k cast to it by the launcher (bf16 pages read back exactly; other
formats' dequantized keys rounded to bf16), fp32 q as tf32 on CUDA; scores, lse and mass fp32.

Wide heads (head_dim above WIDE_D: an MLA layer's absorbed query against its latent pages,
576 wide, one "kv head" shared by every query head) take Q K^T in chunks of BLOCK_D columns,
re-read from memory per key tile instead of held in registers across it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.errors import UnsupportedShapeError

LOG2E = tl.constexpr(1.4426950408889634)
BLOCK_M = 64    # queries per tile
BLOCK_N = 64    # keys per tile
WIDE_D = 256    # head_dim above which Q K^T runs in BLOCK_D chunks
BLOCK_D = 64    # columns per chunk there


@triton.jit
def _tile(ptr, idx, lim, stride, offs_d, d_ok, ND: tl.constexpr):
    """Rows idx (< lim) of a [*, D] operand, whole, where Q K^T takes one tile (ND == 1);
    zeros (unused, nothing read) where it runs in chunks."""
    if ND == 1:
        t = tl.load(ptr + idx.to(tl.int64)[:, None] * stride + offs_d[None, :],
                    mask=(idx < lim)[:, None] & d_ok[None, :], other=0.0)
    else:
        t = tl.zeros([idx.shape[0], offs_d.shape[0]], ptr.dtype.element_ty)
    return t


@triton.jit
def _qk(q, q_ptr, k, k_ptr, rows, n_q, kpos, k_len, stride_qt, stride_kt,
        HEAD_DIM: tl.constexpr, BD: tl.constexpr, ND: tl.constexpr):
    """[BM, BN] = Q K^T of a query tile and a key tile. ND == 1: q and k are the tiles already
    loaded (the pointers unused); else chunks of BD columns are loaded from q_ptr / k_ptr
    (the tiles' first column) and q, k unused."""
    if ND == 1:
        s = tl.dot(q, tl.trans(k))
    else:
        q_ok = (rows < n_q)[:, None]
        k_ok = (kpos < k_len)[:, None]
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qt
        k_rows = k_ptr + kpos.to(tl.int64)[:, None] * stride_kt
        offs = tl.arange(0, BD)
        qc = tl.load(q_rows + offs[None, :], mask=q_ok & (offs < HEAD_DIM)[None, :], other=0.0)
        kc = tl.load(k_rows + offs[None, :], mask=k_ok & (offs < HEAD_DIM)[None, :], other=0.0)
        s = tl.dot(qc, tl.trans(kc))
        for c in range(1, ND):   # (a loop, not unrolled: pipelined stages hold one chunk)
            offs = c * BD + tl.arange(0, BD)
            d_ok = (offs < HEAD_DIM)[None, :]
            qc = tl.load(q_rows + offs[None, :], mask=q_ok & d_ok, other=0.0)
            kc = tl.load(k_rows + offs[None, :], mask=k_ok & d_ok, other=0.0)
            s += tl.dot(qc, tl.trans(kc))
    return s


@triton.jit
def _scores(s, qpos, kpos, start, k_len, window, qk_scale, softcap, inv_softcap,
            CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Q K^T [BM, BN] -> scores in base-2 units (-inf where a key is not visible)."""
    if SOFTCAP:   # softcap * tanh(s * scale / softcap), then to base 2
        x = s * (qk_scale * inv_softcap)
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        s = softcap * LOG2E * tl.where(x < 0, -t, t)
    else:
        s = s * (qk_scale * LOG2E)
    vis = (kpos[None, :] >= start) & (kpos[None, :] < k_len)
    if CAUSAL:
        vis = vis & (kpos[None, :] <= qpos[:, None])
    if WINDOW:
        vis = vis & (qpos[:, None] - kpos[None, :] < window)
    return tl.where(vis, s, float("-inf")), vis


@triton.jit
def _row_lse_kernel(Q, K, LSE, q_off, q_len, lse_start, k_start, k_lens, pos0, starts,
                    stride_qh, stride_qt, stride_kh, stride_kt, stride_lh,
                    qk_scale, softcap, inv_softcap, window,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ND: tl.constexpr):
    mt = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    n_q = tl.load(q_len + b)
    if mt * BM >= n_q:
        return
    k0 = tl.load(k_start + b).to(tl.int64)
    k_len = tl.load(k_lens + b)
    start = tl.load(starts + b)
    p0 = tl.load(pos0 + b)
    rows = mt * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q_ptr = Q + tl.load(q_off + b) + h.to(tl.int64) * stride_qh
    q = _tile(q_ptr, rows, n_q, stride_qt, offs_d, d_ok, ND)
    qpos = p0 + rows
    kv = h // GROUP
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, p0 + tl.minimum(mt * BM + BM, n_q))
    lo = start // BN * BN
    if WINDOW:
        lo = tl.maximum(lo, (p0 + mt * BM - window + 1) // BN * BN)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    k_base = K + kv.to(tl.int64) * stride_kh + k0 * stride_kt
    for n in range(lo, hi, BN):
        kpos = n + tl.arange(0, BN)
        k = _tile(k_base, kpos, k_len, stride_kt, offs_d, d_ok, ND)
        qk = _qk(q, q_ptr, k, k_base, rows, n_q, kpos, k_len, stride_qt, stride_kt,
                 HEAD_DIM, BD, ND)
        s, _vis = _scores(qk, qpos, kpos, start, k_len, window, qk_scale, softcap,
                          inv_softcap, CAUSAL, WINDOW, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    t0 = tl.load(lse_start + b).to(tl.int64)
    tl.store(LSE + h.to(tl.int64) * stride_lh + t0 + rows, lse, mask=rows < n_q)


@triton.jit
def _key_mass_kernel(Q, K, LSE, MASS, q_off, q_len, lse_start, k_start, k_lens, pos0, starts,
                     stride_qh, stride_qt, stride_kh, stride_kt, stride_lh, stride_mh,
                     qk_scale, softcap, inv_softcap, window,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                     CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ND: tl.constexpr):
    nt = tl.program_id(0)
    b = tl.program_id(1)
    kv = tl.program_id(2)
    k_len = tl.load(k_lens + b)
    if nt * BN >= k_len:
        return
    n_q = tl.load(q_len + b)
    k0 = tl.load(k_start + b).to(tl.int64)
    start = tl.load(starts + b)
    p0 = tl.load(pos0 + b)
    t0 = tl.load(lse_start + b).to(tl.int64)
    kpos = nt * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    k_base = K + kv.to(tl.int64) * stride_kh + k0 * stride_kt
    k = _tile(k_base, kpos, k_len, stride_kt, offs_d, d_ok, ND)
    # the queries that may see a key of this tile: t with p0 + t >= the tile's first key
    # (causal), and p0 + t - window < its last key (window)
    lo = 0
    if CAUSAL:
        lo = tl.maximum(0, nt * BN - p0) // BM * BM
    hi = n_q
    if WINDOW:
        hi = tl.minimum(n_q, tl.maximum(0, nt * BN + BN - 1 + window - p0))
    acc = tl.zeros([BN], tl.float32)
    for g in range(GROUP):
        h = kv * GROUP + g
        q_ptr = Q + tl.load(q_off + b) + h.to(tl.int64) * stride_qh
        l_ptr = LSE + h.to(tl.int64) * stride_lh + t0
        for m in range(lo, hi, BM):
            rows = m + tl.arange(0, BM)
            q = _tile(q_ptr, rows, n_q, stride_qt, offs_d, d_ok, ND)
            lse = tl.load(l_ptr + rows, mask=rows < n_q, other=float("-inf"))
            qk = _qk(q, q_ptr, k, k_base, rows, n_q, kpos, k_len, stride_qt, stride_kt,
                     HEAD_DIM, BD, ND)
            s, vis = _scores(qk, p0 + rows, kpos, start, k_len, window, qk_scale, softcap,
                             inv_softcap, CAUSAL, WINDOW, SOFTCAP)
            vis = vis & (rows < n_q)[:, None]
            p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
            acc += tl.sum(p, 0)
    tl.store(MASS + kv.to(tl.int64) * stride_mh + k0 + kpos, acc, mask=kpos < k_len)


def d_tiles(D: int) -> dict:
    """The head-dim constants: one tile D_PAD wide up to WIDE_D; above it, ND chunks of BD
    (D_PAD then only sizes the unused whole-tile loads, kept at BD)."""
    if D <= WIDE_D:
        return dict(D_PAD=max(16, triton.next_power_of_2(D)), BD=16, ND=1)
    return dict(D_PAD=BLOCK_D, BD=BLOCK_D, ND=triton.cdiv(D, BLOCK_D))


def _check(q, k, rows: dict, group_ok: bool) -> None:
    """The launcher's contract; each failure names the fix."""
    if q.dim() != 3 or k.dim() != 3:
        raise UnsupportedShapeError(f"prompt_mass: q [Hq, T, D] and k [Hkv, N, D], got "
                                    f"{tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise UnsupportedShapeError(f"prompt_mass: head_dim of q {q.shape[-1]} != k "
                                    f"{k.shape[-1]}")
    if not group_ok:
        raise UnsupportedShapeError(f"prompt_mass: {q.shape[0]} query heads are not a "
                                    f"multiple of {k.shape[0]} kv heads")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise UnsupportedShapeError("prompt_mass: q and k need a contiguous last dim "
                                    "(call .contiguous() first)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UnsupportedShapeError(f"prompt_mass: q of {q.dtype}; fp32, bf16 or fp16")
    for name, t in rows.items():
        want = torch.int64 if name == "q_off" else torch.int32
        if t.dtype != want or t.device != q.device:
            raise UnsupportedShapeError(f"prompt_mass: {name} must be {want} on {q.device}, "
                                        f"got {t.dtype} on {t.device}")


def prompt_mass(q: torch.Tensor, k: torch.Tensor, q_off: torch.Tensor, q_len: torch.Tensor,
                k_start: torch.Tensor, k_len: torch.Tensor, pos0: torch.Tensor,
                start: torch.Tensor, scale: float, *, causal: bool = True, window: int = 0,
                softcap: float = 0.0, max_q: int, max_k: int) -> torch.Tensor:
    """Attention mass of packed rows (see the module docstring).

    q [Hq, T', D] (any strides but the last; row b's query t at q_off[b] + t * q.stride(1)
    elements from q's start, so that a batch [B, Hq, S, D] goes in as a view), k [Hkv, N, D],
    per row [B]: q_off (int64), and int32 q_len, k_start, k_len, pos0 (logical position of
    its first query), start (first real key); max_q / max_k: the largest q_len / k_len (host
    ints, for the grid). -> mass [Hkv, N] fp32 (0 outside the rows' keys and for keys no query sees)."""
    Hq, _, D = q.shape
    Hkv, N, _ = k.shape
    B = q_len.numel()
    _check(q, k, dict(q_off=q_off, q_len=q_len, k_start=k_start, k_len=k_len, pos0=pos0,
                      start=start), Hq % Hkv == 0)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    T = max_q * B
    lse_start = (torch.arange(B, dtype=torch.int32, device=q.device) * max_q)
    lse = torch.empty(Hq, max(T, 1), dtype=torch.float32, device=q.device)
    mass = torch.zeros(Hkv, N, dtype=torch.float32, device=q.device)
    if B == 0 or max_q == 0 or max_k == 0:
        return mass
    consts = dict(GROUP=Hq // Hkv, HEAD_DIM=D, CAUSAL=bool(causal), WINDOW=bool(window),
                  SOFTCAP=bool(softcap), BM=BLOCK_M, BN=BLOCK_N, **d_tiles(D))
    inv_cap = 1.0 / softcap if softcap else 0.0
    stages = 2 if consts["ND"] > 1 else 3
    _row_lse_kernel[(triton.cdiv(max_q, BLOCK_M), B, Hq)](
        q, k, lse, q_off, q_len, lse_start, k_start, k_len, pos0, start,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
        float(scale), float(softcap), inv_cap, int(window), num_warps=4, num_stages=stages,
        **consts)
    _key_mass_kernel[(triton.cdiv(max_k, BLOCK_N), B, Hkv)](
        q, k, lse, mass, q_off, q_len, lse_start, k_start, k_len, pos0, start,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0), mass.stride(0),
        float(scale), float(softcap), inv_cap, int(window), num_warps=4, num_stages=stages,
        **consts)
    return mass
