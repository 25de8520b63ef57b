"""Tolerances and error measures shared by every kvcompile test, in one place.

Kernels and passes are compared with a plain-PyTorch reference computed in fp32 (or fp64).
Full-precision paths are judged by a relative norm error bounded per compute dtype; quantized
storage is judged by SQNR in dB and by bit-exact encode/decode, never by a looser atol.
"""

from __future__ import annotations

import math

import torch

# Relative Frobenius error ||out - ref|| / ||ref|| allowed for an attention output computed with
# operands of this dtype, against an fp32/fp64 reference of the same math on the same stored
# values. fp32 leaves room for tf32-like accumulation order; bf16 follows FlashInfer's 1e-2.
REL_ERR = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}

# The CUDA decode kernel's opt-in qk_fp8 variant (q quantized to e4m3 per row, q.k on FP8 tensor
# cores) against the reference on the unquantized q; against the reference on q quantized the
# same way (decode_sm90.quantize_q_e4m3) it meets REL_ERR above. e4m3 keeps 3 mantissa bits:
# rounding moves each q element by at most 2^-4 of its size (~2.2% RMS), the scaled logits by
# ~0.06 log2-units RMS (0.29 at most) on the tests' keys, and the output by 1.2-1.8% relative
# on random inputs, 0.3-0.35% on needle rows (benchmarks/qk_fp8_quality.py, CPU emulation;
# benchmarks/RESULTS.md "qk_fp8"); up to 2.9% in tests/gpu's qk8 cases (two queries a row over
# short sequences of 15-17 keys, where one row's few logits decide; reference on quantized q
# against reference on q, computed on the CPU). 4e-2 leaves 1.4x over that worst case; the
# kernel's own error (2e-4 .. 4e-3) adds in quadrature.
REL_ERR_QK_FP8 = 4e-2



def kernel_rel_err(dtype: torch.dtype, device) -> float:
    """REL_ERR for a Triton kernel's output with operands of `dtype` on `device`: on CUDA,
    tl.dot takes fp32 operands as tf32 (a 10-bit mantissa, as fp16's), so fp32 gets fp16's
    bound there; the CPU interpreter computes fp32 dots in fp32."""
    if dtype == torch.float32 and torch.device(device).type == "cuda":
        return REL_ERR[torch.float16]
    return REL_ERR[dtype]


# Elementwise (atol, rtol) for torch.testing.assert_close, by dtype.
ASSERT_CLOSE = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# SQNR floors (dB) of each storage format on standard Gaussian data, measured (see
# tests/cache/test_formats.py for the measurement, and the foundation issue's note).
SQNR_FLOOR_DB = {
    "fp8_e4m3": 31.0,
    "fp8_e5m2": 25.0,
    "fp4_e2m1": 20.0,
    # int formats at their coarsest scales (page; token and channel scales do better: int4
    # 17.5 / 20.0 / 23.7 dB with page / token / channel scales, int3 10.9 / 13.4 / 17.1,
    # int2 3.4 / 6.0 / 9.7; measured 2026-12-03 on the data of test_sqnr_floor_gaussian_int)
    "int4": 17.0,
    "int3": 10.5,
    "int2": 3.0,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf if either holds NaN."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all() or not torch.isfinite(ref64).all():
        return math.inf
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom > 0 else num


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, factor: float = 1.0,
                     what: str = "output") -> None:
    err = rel_err(out, ref)
    bound = REL_ERR[dtype] * factor
    assert err <= bound, f"{what}: relative error {err:.3e} > {bound:.1e} allowed for {dtype}"


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, 10*log10(sum ref^2 / sum (ref - approx)^2)."""
    ref64, approx64 = ref.detach().double(), approx.detach().double()
    noise = (ref64 - approx64).pow(2).sum().item()
    signal = ref64.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(signal / noise)


def kl_divergence(logits_ref: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(p_ref || p) over all positions of next-token distributions given as logits."""
    lp_ref = torch.log_softmax(logits_ref.double(), dim=-1)
    lp = torch.log_softmax(logits.double(), dim=-1)
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or the max integer) so unwritten elements show up."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def storage_rel_tol(kv_dtype: str) -> float:
    """Relative difference allowed between the logits of two correct orders of the same
    operations over a KV cache stored as `kv_dtype` (e.g. a CUDA-graph replay and an eager
    step: other split-K counts and padded GEMMs round differently upstream of the cache, and
    the stored format rounds a key or value element to its neighbour where the two land on
    either side of a rounding boundary). Quantized formats: the noise amplitude at the
    format's SQNR floor (SQNR_FLOOR_DB), 10^(-dB/20) (fp8_e4m3: 0.028); 16-bit formats: their
    compute bound (REL_ERR); fp32: REL_ERR[fp32]."""
    if kv_dtype in SQNR_FLOOR_DB:
        return 10.0 ** (-SQNR_FLOOR_DB[kv_dtype] / 20.0)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(kv_dtype)
    if dt is None:
        raise ValueError(f"storage_rel_tol: no tolerance for kv_dtype={kv_dtype!r}; one of "
                         f"{sorted(SQNR_FLOOR_DB) + ['bf16', 'fp16', 'fp32']}")
    return REL_ERR[dt]


def greedy_parting(ref: torch.Tensor, other: torch.Tensor, rel_tol: float) -> dict:
    """Compare the per-step logits [steps, V] of one greedy request decoded two ways (`ref`:
    the reference, e.g. eager steps; `other`: e.g. CUDA-graph replays). Both decoded the same
    tokens up to and including the first step where their argmax parts (after it their
    inputs differ, so later steps are not compared). Returns the diagnostic:

        steps     steps compared (up to and including the parting step)
        parted    the first step whose greedy token differs, or None
        margin    ref's top-2 logit margin at that step (None if none parted)
        max_diff  max |other - ref| over the compared steps
        worst     max over those steps of max|other - ref| / max|ref| (the relative measure)
        tol_ok    worst <= rel_tol
        tie_ok    the tokens part only where ref's margin < 2 * rel_tol * max|ref| (a near
                  tie the allowed difference can flip; a wider margin parting means a real
                  difference, and tol_ok is False too)
        ok        tol_ok and tie_ok
    """
    n = min(len(ref), len(other))
    r, o = ref[:n].double(), other[:n].double()
    top = r.topk(2, -1)
    tok_r, tok_o = top.indices[:, 0], o.argmax(-1)
    diff = (tok_r != tok_o).nonzero()
    parted = int(diff[0, 0]) if len(diff) else None
    upto = n if parted is None else parted + 1
    d = (o[:upto] - r[:upto]).abs().amax(-1)
    scale = r[:upto].abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
    rel = d / scale
    margin = None
    tie_ok = True
    if parted is not None:
        margin = float(top.values[parted, 0] - top.values[parted, 1])
        tie_ok = margin < 2 * rel_tol * float(scale[parted])
    worst = float(rel.max()) if upto else 0.0
    return dict(steps=upto, parted=parted, margin=margin,
                max_diff=float(d.max()) if upto else 0.0, worst=worst,
                tol_ok=worst <= rel_tol, tie_ok=tie_ok, ok=worst <= rel_tol and tie_ok)


def install_sm90_stand_in() -> None:
    """Make Triton believe an sm_90 (Hopper) device is present on a machine without a GPU, so
    that kernels compile (`warmup`, `triton.compile`) for it: the tests that check what the
    interpreter cannot, and benchmarks/kernel_report.py. Nothing can run afterwards."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StandIn:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(StandIn())
