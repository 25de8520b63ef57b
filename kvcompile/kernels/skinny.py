"""A decode step's weight GEMMs at small M: y[M, N] = x[M, K] @ w[N, K]^T (+ bias).

A decode step of B <= 16 sequences multiplies a few rows by every weight of the model: the
step's largest part, bound by the weights' bytes (issue 16 item 5: on the H200 cuBLAS's M = 16
kernels measured about 65% of copy bandwidth; on the H100 about 84%). This kernel streams the
weights at the width of the GPU: one program a block of BN output columns, which reads its
[BN, K] slab of `w` once in [BN, BK] tiles (rows contiguous in K: every load coalesced, the
loop software-pipelined by Triton over `stages` tiles in flight) against x's [M, BK] tile
(M padded to 16, the MMA's smallest M; x is re-read from L2 by every program). BN is chosen so
that the grid covers the SMs several times over; when N is too small for that (a narrow
output, a K of many tiles) the K range is split over `split` programs that add their fp32
partials in a second pass.

Numerics: fp32 accumulation of bf16 / fp16 products, as cuBLAS; the sum's order differs (a
tile of BK at a time), so results match torch's to the dtype's rounding, not bit for bit.

Routed only with KVConfig.decode_gemms="triton" (passes/skinny_linears.py): on the H100 it
matched cuBLAS (0.97-0.99x over a step's shapes, RESULTS.md, thirty-seventh session);
benchmarks/bench_skinny_gemm.py times it beside cuBLAS (`F.linear`) on the step's shapes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, k_per,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = pid_k * k_per
    k1 = tl.minimum(k0 + k_per, K)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    x_ptr = X + rm[:, None] * stride_xm + (k0 + rk)[None, :]
    w_ptr = W + rn[:, None] * stride_wn + (k0 + rk)[None, :]
    m_ok = rm[:, None] < M
    n_ok = rn[:, None] < N
    for k in range(k0, k1, BK):
        k_ok = (k + rk)[None, :] < k1
        x = tl.load(x_ptr, mask=m_ok & k_ok, other=0.0)
        w = tl.load(w_ptr, mask=n_ok & k_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptr += BK
        w_ptr += BK
    out_ok = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=out_ok)
    else:   # fp32 partials [SPLIT, M, N]
        tl.store(Y + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=out_ok)


@triton.jit
def _split_sum_kernel(P, B, Y, M, N, stride_ym, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(P + s * M * N + i, mask=ok, other=0.0)
    n = i % N
    if HAS_BIAS:
        acc += tl.load(B + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + (i // N) * stride_ym + n, acc.to(Y.dtype.element_ty), mask=ok)


MAX_M = 16


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None
                         else torch.cuda.current_device())
    return 132   # (the interpreter: an H100's count, so the CPU tests take the GPU's tiles)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick(M: int, N: int, K: int, sms: int) -> dict:
    """The rule's tiles for an [M, K] x [N, K]^T product: BN the widest of 128 / 64 / 32 that
    gives at least two programs an SM, else 32 with K split until it does (at least 8 K tiles
    a program); BK 128; 4 stages; 4 warps."""
    bk = 128
    for bn in (128, 64, 32):
        if triton.cdiv(N, bn) >= 2 * sms:
            return dict(BN=bn, BK=bk, split=1, stages=4, warps=4)
    bn = 32
    tiles = triton.cdiv(N, bn)
    split = 1
    while tiles * split < 2 * sms and triton.cdiv(K, bk * split * 2) >= 8:
        split *= 2
    return dict(BN=bn, BK=bk, split=split, stages=4, warps=4)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for x of at most 16 rows (any leading dims, flattened): w
    [N, K] with contiguous rows, x's last dim contiguous, one float dtype for all.
    config: tiles as `pick` returns them (BN, BK, split, stages, warps); None: `pick`'s."""
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    N = w.shape[0]
    if M > MAX_M:
        raise ValueError(f"skinny_linear: {M} rows, more than its {MAX_M}: use F.linear")
    if w.shape[1] != K or w.stride(1) != 1 or x2.stride(1) != 1:
        raise ValueError(f"skinny_linear: w {tuple(w.shape)} (stride {w.stride()}) does not "
                         f"take x's last dim {K} with contiguous rows")
    if w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"skinny_linear: one dtype for x, w and bias, got {x.dtype}, "
                         f"{w.dtype}, {None if bias is None else bias.dtype}")
    cfg = config or pick(M, N, K, _sms(x.device))
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y.reshape(*lead, N)
    split = cfg["split"]
    k_per = triton.cdiv(triton.cdiv(K, split), cfg["BK"]) * cfg["BK"]
    split = triton.cdiv(K, k_per)
    grid = (triton.cdiv(N, cfg["BN"]), split)
    has_bias = bias is not None
    b = bias if has_bias else y
    if split == 1:
        _skinny_kernel[grid](x2, w, b, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0),
                             k_per, BM=16, BN=cfg["BN"], BK=cfg["BK"], HAS_BIAS=has_bias,
                             SPLIT=1, num_warps=cfg["warps"], num_stages=cfg["stages"])
    else:
        part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        _skinny_kernel[grid](x2, w, b, part, M, N, K, x2.stride(0), w.stride(0), N, k_per,
                             BM=16, BN=cfg["BN"], BK=cfg["BK"], HAS_BIAS=False, SPLIT=split,
                             num_warps=cfg["warps"], num_stages=cfg["stages"])
        blk = 1024
        _split_sum_kernel[(triton.cdiv(M * N, blk),)](part, b, y, M, N, y.stride(0),
                                                        SPLIT=split, HAS_BIAS=has_bias,
                                                        BLOCK=blk)
    return y.reshape(*lead, N)
