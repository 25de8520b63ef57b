"""The fast paged-decode path on Hopper: a CUDA C++ kernel (kernels/cuda/paged_decode.cuh).

    reason = unsupported(q, k_fmt, k_gran, v_fmt, v_gran, k_data, v_data, page, attn_mass, ...)
    launch_decode_sm90(q, kd, ks, vd, vs, block_tables, seq_lens, key_mask, out, k_fmt, ...)

It takes bf16 / fp16 / fp8 (e4m3, e5m2) pages with page, token or tensor scales, head_dim 64 or
128, up to 16 query rows per kv head (G * Sq), pages of 8-128 tokens, windows with sinks, key
masks and softcapping; and int4 pages (head_dim 64 or 128) with the Pareto table's scales: keys with
a scale and zero point per (page, kv head, channel) in pages of >= 16 tokens, values with one per
token (KVConfig(kv_dtype="int4", scale_granularity="channel")). `unsupported` names what it does not take; the caller (decode.py) then
runs the portable Triton kernel and the run time reports why.

qk_fp8=True (opt-in, default off; e4m3 keys only) selects the variant that runs q.k on FP8 tensor
cores: q quantized to e4m3 once per CTA with a power-of-two scale per query row (folded into the
score scale), mma.sync m16n8k32 e4m3 on the key codes as stored. It adds q's e4m3 rounding to the
scores (quantize_q_e4m3 is the same quantization in PyTorch, for references). Why CUDA C++ and not Triton or
Gluon: docs/architecture.md, "Decode kernels".

variant= (issue 14; default: `default_variant`, "pvt4h" for fp8 pages with page / tensor scales,
"pvt4sp" for int4 K channel / V token pages, "base", the kernel as it was, elsewhere) picks a compile-time variant
of the same kernel (VARIANTS; paged_decode.cuh KVC_VAR): "nocap" decides softcapping at compile
time (the base kernel computes tanh on every score even without a softcap), "aluk" / "aluv" /
"alu" also widen fp8 keys / values / both to f16 by integer ops instead of F2FP conversions
(e4m3 NaN codes then read as +-480 * scale, not NaN). benchmarks/RESULTS.md, "The CUDA decode
kernel's limiter, from its SASS". cuda14g's (the chain, not a pipe, is the limiter): "chain"
splits q.k into two accumulator chains and tests the softmax max by a vote (shuffles only when
it grows), "pvt" also runs P.V with the value columns as M (fp8 values: half the MMAs and O
registers at <= 8 query rows), "pvt4" builds that for 4 CTAs a SM (<= 128 registers, the ring
sized for 4), "pvt4h" / "pvt5h" also hoist the copies' addresses (pvt5h: 5 CTAs at fp8 head_dim
64), "cta4" the plain kernel for 4 CTAs; RESULTS.md, "Two chains, P.V transposed, four
CTAs". cuda14h's (RESULTS.md, "int4 on pvt4h's structure, and q.k with the tokens as M"):
"pvt4n" = pvt4h with int4 codes widened to f16 subnormals by one mask and P.V transposed for
int4 values ("pvt3n": at 3 CTAs), "pvt4nz" also computes the int4 keys' channel terms once a
page (a warp takes a page's steps in a row), "pvt4s" / "pvt4sz" run q.k with the step's tokens
as M and the query rows as N at <= 8 rows (no padded rows: half the q.k MMAs and exponentials;
int4, 16-bit and fp8 pages), "pvt4sp" also widens int4 keys by masks alone (d permuted in q and
the channel terms).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels.cuda import build
from kvcompile.kernels.cuda.driver import Kernel
from kvcompile.kernels.masks import KEY_MASK_ALIGN, key_mask_width

_KIND = {"fp8_e4m3": 0, "fp8_e5m2": 1, "fp16": 2, "bf16": 3, "int4": 4}
_SCALE = {"page": 1, "token": 2, "tensor": 3}
INT4 = _KIND["int4"]
# int4 pages (scale and zero point, fp16): keys per (page, head, channel), values per token,
# the Pareto table's "K int4/V int4" (benchmarks/RESULTS.md); paged_decode.cuh KVC_SC_CHANZP /
# KVC_SC_TOKZP
INT4_KEY_GRAN, INT4_VALUE_GRAN = "channel", "token"
_SC_CHANZP, _SC_TOKZP = 4, 5
INT4_HEAD_DIMS = (64, 128)
INT4_MIN_KEY_PAGE = 16   # a step of 16 keys reads one page's channel scales
_QT = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
HEAD_DIMS = (64, 128)
MAX_ROWS = 16
WARPS = 4
_SMEM_PER_SM = 227 * 1024
LOG2E = 1.4426950408889634
# issue-14 variants: name -> paged_decode.cuh KVC_VAR bits (CAP_STATIC 1, CAP_ON 2 set per call,
# ALU_K 4, ALU_V 8; cuda14g: QK2 16, VOTE 32, PVT 64, CTA4 128, HOIST 256, CTA5 512); all but
# base include nocap
VAR_CAP_STATIC, VAR_CAP_ON, VAR_ALU_K, VAR_ALU_V = 1, 2, 4, 8
VAR_QK2, VAR_VOTE, VAR_PVT, VAR_CTA4, VAR_HOIST, VAR_CTA5 = 16, 32, 64, 128, 256, 512
VAR_I4N = 1024  # cuda14h: int4 codes as f16 subnormals, P.V transposed for int4 values
VAR_PGZ = 2048  # cuda14h: int4 keys' channel terms once a page (a warp takes a page's steps)
VAR_SWQ = 4096  # cuda14h: q.k with the tokens as M, the query rows as N (8 rows)
VAR_KPERM = 8192  # cuda14h: int4 keys widened by masks alone (q, channel terms permuted)
VAR_BTPF = 16384  # page ids loaded a step (a page's run under PGZ) ahead of their issue
_CHAIN = VAR_CAP_STATIC | VAR_QK2 | VAR_VOTE
VARIANTS = {"base": 0, "nocap": VAR_CAP_STATIC, "aluk": VAR_CAP_STATIC | VAR_ALU_K,
            "aluv": VAR_CAP_STATIC | VAR_ALU_V, "alu": VAR_CAP_STATIC | VAR_ALU_K | VAR_ALU_V,
            # cuda14g: shorter per-warp chains (q.k in two accumulator chains, the max test
            # by vote), P.V with value columns as M (fp8 values), 4 CTAs a SM (at <= 8 query
            # rows with P.V transposed), cp.async addresses hoisted
            "chain": _CHAIN, "pvt": _CHAIN | VAR_PVT, "pvt4": _CHAIN | VAR_PVT | VAR_CTA4,
            "pvt4h": _CHAIN | VAR_PVT | VAR_CTA4 | VAR_HOIST,
            # 5 CTAs a SM where rows are short (key + value rows <= 128 bytes: fp8 D 64)
            "pvt5h": _CHAIN | VAR_PVT | VAR_CTA4 | VAR_CTA5 | VAR_HOIST,
            "cta4": VAR_CAP_STATIC | VAR_CTA4,
            # cuda14h, int4 pages: pvt4h's structure with int4 codes widened to f16 subnormals
            # by one mask (no sub.f16x2), two q.k chains, P.V transposed for int4 values too;
            # 4 CTAs a SM (pvt4n) or 3 (pvt3n); for other pages they are pvt4h / pvt(h)
            "pvt4n": _CHAIN | VAR_PVT | VAR_CTA4 | VAR_HOIST | VAR_I4N,
            "pvt3n": _CHAIN | VAR_PVT | VAR_HOIST | VAR_I4N,
            # and the keys' channel terms once a page, a warp taking a page's steps in a row
            "pvt4nz": _CHAIN | VAR_PVT | VAR_CTA4 | VAR_HOIST | VAR_I4N | VAR_PGZ,
            # and q.k with the step's tokens as M, the query rows as N (int4 K and V, <= 8
            # rows; elsewhere pvt4n / pvt4nz)
            "pvt4s": _CHAIN | VAR_PVT | VAR_CTA4 | VAR_HOIST | VAR_I4N | VAR_SWQ,
            "pvt4sz": _CHAIN | VAR_PVT | VAR_CTA4 | VAR_HOIST | VAR_I4N | VAR_PGZ | VAR_SWQ,
            # and int4 keys widened by masks alone (d permuted in q and the channel terms)
            "pvt4sp": (_CHAIN | VAR_PVT | VAR_CTA4 | VAR_HOIST | VAR_I4N | VAR_PGZ | VAR_SWQ
                       | VAR_KPERM)}
# twenty-sixth session: the defaults with the block table's page ids loaded a step (a page's
# run) ahead of their issue (paged_decode.cuh BTPF); and pvt4sp at 5 CTAs a SM ("pvt5sp": int4
# K and V at head_dim 128 fit 96 registers, no spill, with 3 ring stages; Nsight Compute found
# the int4 kernel bound by each warp's dependent chain at 3.6 warps a scheduler: 25% more warps
# for 12% more instructions a step; not timed yet)
VARIANTS.update({f"{k}_pf": VARIANTS[k] | VAR_BTPF for k in ("base", "pvt4h", "pvt4sp")})
VARIANTS["pvt5sp"] = VARIANTS["pvt4sp"] | VAR_CTA5


# The variant a launch without variant= runs: "pvt4h" for fp8 keys and values with page or
# tensor scales, where the H200 measured it faster than "base" at every shape of the bench
# (benchmarks/RESULTS.md, "Eleventh session's device calls": e4m3 page scales, x SDPA over bf16,
# B64 L8k 0.690 -> 0.610, B16 L32k 0.651 -> 0.641, B1 L128k 0.721 -> 0.712, D64 B64 L8k
# 0.780 -> 0.703); "base" elsewhere (token scales: pvt4h spills 8 B at head_dim 128; bf16 /
# int4 pages: its bits mostly drop out, and nothing was timed).
DEFAULT_FP8_VARIANT = "pvt4h"
# int4 K channel / V token pages: "pvt4sp" (cuda14h), faster than "base" at every shape of the
# bench on the H200 (benchmarks/RESULTS.md, cuda14h's section: x SDPA over bf16, P64, B64 L8k
# 0.806 -> 0.464, B16 L32k 0.756 -> 0.471, B1 L128k 0.834 -> 0.554, D64 B64 L8k 1.000 -> 0.632),
# its GPU cases, needle case and negatives passed (tests/gpu/test_decode_sm90_variants_gpu.py
# -k int4); at 16 query rows it is pvt4nz's code (3 CTAs a SM).
DEFAULT_INT4_VARIANT = "pvt4sp"


def default_variant(kk: int, vk: int, ksm: int, vsm: int, qk_fp8: bool = False) -> str:
    """The variant name a launch without variant= runs for these element kinds / scales."""
    page_or_tensor = (_SCALE["page"], _SCALE["tensor"])
    if not qk_fp8 and kk < 2 and vk < 2 and ksm in page_or_tensor and vsm in page_or_tensor:
        return DEFAULT_FP8_VARIANT
    if kk == INT4 and vk == INT4 and ksm == _SC_CHANZP and vsm == _SC_TOKZP:
        return DEFAULT_INT4_VARIANT
    return "base"


def with_default_variants(keys) -> set:
    """`keys` (_kernel argument tuples without a variant) plus the key of the default
    variant of each, softcap off: what a launch without variant= builds (for prebuilding)."""
    out = set(keys)
    for k in keys:
        q8 = k[8] if len(k) > 8 else 0
        if len(k) <= 9 and default_variant(*k[:4], bool(q8)) != "base":
            out.add((*k[:8], q8, variant_bits(default_variant(*k[:4]), k[0], k[1], 0.0,
                                              int(q8), k[6])))
    return out


class DecodeParams(ctypes.Structure):  # paged_decode.cuh DecodeParams, field for field
    _fields_ = [(n, ctypes.c_void_p) for n in (
        "q", "k", "v", "ks", "vs", "bt", "seq_lens", "kmask", "out", "acc", "lse")] + [
        ("stride_bt", ctypes.c_longlong), ("stride_km", ctypes.c_longlong)] + [
        (n, ctypes.c_int) for n in (
            "H", "G", "SQ", "num_splits", "log2p", "window", "sinks", "direct")] + [
        (n, ctypes.c_float) for n in ("qk_scale", "cap_in", "cap_out")] + [
        ("n_km", ctypes.c_int), ("kz", ctypes.c_void_p), ("vz", ctypes.c_void_p)]


def device_ok(device: torch.device) -> tuple[bool, str]:
    """Whether this device runs the kernel: sm_90 (Hopper) with nvcc available. Asked on every
    decode step (kernels/decode.py, kernels/latent_sm90.py): the answer is kept per device."""
    if device.type != "cuda":
        return False, "not a CUDA device"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _device_ok(idx)


@cache
def _device_ok(idx: int) -> tuple[bool, str]:
    cap = torch.cuda.get_device_capability(idx)
    if cap != (9, 0):
        return False, f"compute capability {cap[0]}.{cap[1]} (the CUDA decode kernel is sm_90)"
    return build.available()


def unsupported(q: torch.Tensor, k_fmt: str, k_gran: str, v_fmt: str, v_gran: str,
                d: int, dv: int, page: int, *, attn_mass=None, residual: bool = False) -> str:
    """'' when the kernel takes this call, else why not (one short phrase)."""
    for name, fmt, gran in (("keys", k_fmt, k_gran), ("values", v_fmt, v_gran)):
        if fmt not in _KIND:
            return f"{name} in {fmt}"
        if fmt.startswith("fp8") and gran not in _SCALE:
            return f"{name} with {gran} scales"
        want = INT4_KEY_GRAN if name == "keys" else INT4_VALUE_GRAN
        if fmt == "int4" and gran != want:
            return f"int4 {name} with {gran} scales (the kernel takes {want} scales)"
    if "int4" in (k_fmt, v_fmt) and (d not in INT4_HEAD_DIMS or dv not in INT4_HEAD_DIMS):
        return f"int4 pages of head_dim {d}/{dv} (the kernel takes {INT4_HEAD_DIMS})"
    if k_fmt == "int4" and page < INT4_MIN_KEY_PAGE:
        return f"int4 keys in pages of {page} tokens (channel scales need >= 16)"
    if residual:
        return "residual pages"
    if attn_mass is not None:
        return "attention-mass output (H2O)"
    if d not in HEAD_DIMS or dv not in HEAD_DIMS:
        return f"head_dim {d}/{dv}"
    B, Hq, Sq, _ = q.shape
    if q.dtype not in _QT:
        return f"q dtype {q.dtype}"
    if page not in (8, 16, 32, 64, 128):
        return f"page size {page}"
    return ""


_kernels: dict[tuple, Kernel] = {}


def _stages(kk: int, vk: int, d: int, dv: int, rows: int,
            ctas: int | None = None) -> tuple[int, int, int]:
    """(stages per warp, CTAs per SM, shared bytes per CTA) of a variant; `ctas` forces the
    CTAs a SM (the CTA4 variants), else 3 for rows of <= 256 bytes (key + value), else 2."""
    def row_bytes(kind, n):
        return n // 2 if kind == INT4 else n * (2 if kind >= 2 else 1)

    rbk, rbv = row_bytes(kk, d), row_bytes(vk, dv)
    # codes, fp8 scales, key mask; int4: key channel scales + zero points, value token ones
    stage = 16 * (rbk + rbv) + 128 + 16 + (4 * d if kk == INT4 else 0) + (64 if vk == INT4 else 0)
    stage = (stage + 15) // 16 * 16
    if ctas is None:
        ctas = 3 if rbk + rbv <= 256 else 2
    fixed = rows * d * 2
    ns = (_SMEM_PER_SM // ctas - 1024 - fixed) // (WARPS * stage)
    ns = max(2, min(6, ns))
    return ns, ctas, fixed + WARPS * ns * stage


def _forced_ctas(kk: int, vk: int, d: int, dv: int, var: int) -> int | None:
    """CTAs a SM that the variant bits force (CTA4, CTA5; None: the default rule). CTA5 takes
    5 where key + value rows are at most 128 bytes (fp8 at head_dim 64: <= 102 registers and
    the ring in 45 KB), else 4; CTA4 takes 4 where they are at most 256 bytes, else 3 (16-bit
    pages at head_dim 128, whose two-stage rings do not fit 4 times)."""
    rb = sum(n // 2 if k == INT4 else n * (2 if k >= 2 else 1) for k, n in ((kk, d), (vk, dv)))
    if var & VAR_CTA5:
        return 5 if rb <= 128 else 4
    if var & VAR_CTA4:  # rows of more than 256 bytes (16-bit at D 128): 3, two stages each
        return 4 if rb <= 256 else 3
    return None


def kernel_constants(kk: int, vk: int, ksm: int, vsm: int, d: int, dv: int, rows: int,
                     qt: int, q8: int = 0, var: int = 0) -> tuple[dict[str, int], int, int]:
    """(compile-time constants, CTAs per SM, shared bytes per CTA) of a kernel variant; the
    host emulation (kernels/cuda/emu) builds the same constants. q8 = 1: q.k on e4m3 tensor
    cores (e4m3 keys only, kk == 0); the same stages and shared memory as q8 = 0. var: the
    issue-14 bits (variant_bits); 0 adds no constant (the base kernel's build is unchanged)."""
    if q8 and kk != _KIND["fp8_e4m3"]:
        raise UnsupportedShapeError("sm90 decode: the qk_fp8 variant takes fp8_e4m3 keys only")
    ns, ctas, smem = _stages(kk, vk, d, dv, rows, _forced_ctas(kk, vk, d, dv, var))
    defines = {"KVC_KK": kk, "KVC_VK": vk, "KVC_KSM": ksm, "KVC_VSM": vsm, "KVC_D": d,
               "KVC_DV": dv, "KVC_ROWS": rows, "KVC_NS": ns, "KVC_QT": qt, "KVC_Q8": int(q8)}
    if var:
        defines["KVC_VAR"] = int(var)
    return defines, ctas, smem


def variant_bits(name: str, kk: int, vk: int, softcap: float, q8: int = 0,
                 rows: int = 8) -> int:
    """KVC_VAR of variant `name` for these element kinds: the bits that change nothing for
    them are dropped (so equal kernels share one build), CAP_ON set from the softcap. The pvt
    variants' 4 / 5 CTAs a SM hold only where P.V is transposed at <= 8 query rows and keys are
    not int4 (elsewhere 128 registers spill, 40-216 B: such calls get 3 CTAs a SM)."""
    if name not in VARIANTS:
        raise UnsupportedShapeError(
            f"sm90 decode: unknown variant {name!r}; take one of {sorted(VARIANTS)}")
    bits = VARIANTS[name]
    if kk >= 2 or q8:
        bits &= ~VAR_ALU_K
    if kk != INT4 and vk != INT4:
        bits &= ~VAR_I4N
    if kk != INT4:
        bits &= ~VAR_PGZ
    sixteen = kk in (2, 3) and vk in (2, 3)
    fp8 = kk < 2 and vk < 2 and not bits & (VAR_ALU_K | VAR_ALU_V)
    if not ((kk == INT4 and vk == INT4 and bits & VAR_I4N) or sixteen or fp8) or rows > 8 or q8:
        bits &= ~VAR_SWQ
    if not (kk == INT4 and bits & VAR_SWQ and bits & VAR_PGZ):
        bits &= ~VAR_KPERM
    if vk >= 2 and not (vk == INT4 and bits & VAR_I4N) and not (sixteen and bits & VAR_SWQ):
        bits &= ~(VAR_ALU_V | VAR_PVT)
    if bits & VAR_ALU_V:
        bits &= ~VAR_PVT
    if kk == INT4 or q8:
        bits &= ~VAR_QK2
    if VARIANTS[name] & VAR_PVT and (not bits & VAR_PVT or rows > 8
                                     or (kk == INT4 and not bits & VAR_I4N)
                                     or (INT4 in (kk, vk) and kk != vk)):  # spills 24-32 B
        # the pvt variants' extra CTAs are paid by P.V's smaller O; without it (values not
        # fp8, 16 rows) or with int4 keys' channel terms, 128 registers spill: 3 CTAs a SM
        bits &= ~(VAR_CTA4 | VAR_CTA5)
    if bits & VAR_CAP_STATIC and softcap:
        bits |= VAR_CAP_ON
    return bits


KERNEL_CALL = ("kvc::paged_decode<KVC_KK, KVC_VK, KVC_KSM, KVC_VSM, KVC_D, KVC_DV, KVC_ROWS, "
               "KVC_NS, KVC_QT, KVC_Q8 != 0>")


def _kernel(kk: int, vk: int, ksm: int, vsm: int, d: int, dv: int, rows: int, qt: int,
            q8: int = 0, var: int = 0) -> Kernel:
    key = (kk, vk, ksm, vsm, d, dv, rows, qt, int(q8), int(var))
    k = _kernels.get(key)
    if k is None:
        defines, ctas, smem = kernel_constants(*key)
        cubin = build.build_cubin(
            "paged_decode.cuh", "kvc_paged_decode", KERNEL_CALL, defines, arch="sm_90",
            threads=WARPS * 32, min_blocks=ctas)
        k = Kernel(cubin, "kvc_paged_decode", smem)
        _kernels[key] = k
    return k


@lru_cache(maxsize=4096)  # per layer and step on the launch path: shapes repeat
def choose_splits(batch: int, kv_heads: int, max_len: int, sm_count: int,
                  waves: float | None = None, ctas_per_sm: int = 3,
                  cta_overhead_tokens: int = 256) -> int:
    """Splits per (sequence, kv head) from shapes only (no device sync, graph-safe).

    waves=None (the default) counts rounds: B * Hkv * s CTAs run in ceil(B * Hkv * s / slots)
    rounds of `slots = sm_count * ctas_per_sm`; a CTA costs its share of the keys, max_len / s
    tokens, plus a fixed `cta_overhead_tokens` (loading q, merging the warps, the split merge),
    so the time goes as rounds * (max_len / s + overhead). The smallest s within 2% of the
    best wins, with at least 256 tokens a split. A number for `waves` sets the older rule
    instead: about `waves` x SMs CTAs."""
    cap = int(max(1, min(max_len // 256, 1024)))
    work = max(1, batch * kv_heads)
    if waves is not None:
        want = -(-int(waves * sm_count) // work)
        return int(max(1, min(want, cap)))
    slots = max(1, sm_count * ctas_per_sm)
    cost = {s: -(-work * s // slots) * (max_len / s + cta_overhead_tokens)
            for s in range(1, cap + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= best * 1.02)


def _padded_mask(key_mask: torch.Tensor, max_width: int) -> torch.Tensor:
    """[B, Lm] bool -> [B, width] uint8, width = Lm rounded up to 16 (at most max_width, a
    multiple of 16), 1 past Lm (keys seen). The kernel reads the mask for its first `width`
    slots only (DecodeParams.n_km): the steps after it run unmasked. A contiguous mask whose
    width already is a multiple of 16 (at most max_width) is read as it is, through a uint8
    view of its bools (no copy: the eviction runtime builds its masks so, aside.py)."""
    B, lm = key_mask.shape
    if (lm % KEY_MASK_ALIGN == 0 and 0 < lm <= max_width and key_mask.dtype == torch.bool
            and key_mask.is_contiguous()):
        return key_mask.view(torch.uint8)
    width = max(KEY_MASK_ALIGN, min(max_width, key_mask_width(lm)))
    out = torch.ones(B, width, dtype=torch.uint8, device=key_mask.device)
    n = min(lm, width)
    out[:, :n] = key_mask[:, :n].to(torch.uint8)
    return out


E4M3_MAX_CODE_MAGNITUDE = 256.0  # |q / scale| < 256 with the power-of-two row scales


def quantize_q_e4m3(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The qk_fp8 kernel's quantization of q in PyTorch: q [..., D] -> (codes [..., D]
    float8_e4m3fn, scales [..., 1] fp32), q ~ codes * scales. Per row (the last dim): scale =
    2^(e - 8) with amax = max |q| < 2^e (frexp), 1 for an all-zero row, NaN for a row holding a
    NaN or an infinity; codes = round-to-nearest-even(q / scale), exact division, |codes| < 256."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    bad = ~torch.isfinite(qf).all(-1, keepdim=True)
    _, e = torch.frexp(amax)
    es = torch.where((amax > 0) & ~bad, (e - 8).clamp(-126, 126), torch.zeros_like(e))
    inv = torch.ldexp(torch.ones_like(amax), -es)
    scale = torch.where(bad, torch.full_like(amax, float("nan")),
                        torch.ldexp(torch.ones_like(amax), es))
    codes = (torch.nan_to_num(qf, nan=0.0, posinf=0.0, neginf=0.0) * inv).to(torch.float8_e4m3fn)
    return codes, scale


def _check_int4(name, kind, gran, want, data, scale, zero, shape) -> None:
    """int4 pages: packed codes [N, Hkv, P, D / 2] uint8, contiguous fp16 scales and zero
    points of `shape` (cache/intq.py), `want` granularity; UnsupportedShapeError otherwise."""
    if kind != INT4:
        return
    if gran != want:
        raise UnsupportedShapeError(f"sm90 decode: int4 {name} need {want} scales, not {gran}; "
                                    f"store them with {want} scales or use the Triton kernel")
    for part, t in (("scales", scale), ("zero points", zero)):
        if (t is None or t.dtype != torch.float16 or tuple(t.shape) != shape
                or not t.is_contiguous()):
            got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise UnsupportedShapeError(f"sm90 decode: int4 {name} need contiguous fp16 {part} "
                                        f"of shape {shape}, got {got}")
    if data.dtype != torch.uint8 or not data.is_contiguous():
        raise UnsupportedShapeError(f"sm90 decode: int4 {name} need contiguous uint8 codes")


@dataclass
class Launch:
    """One launch of the kernel as launch_decode_sm90 sets it up (the emulation runs it too)."""
    key: tuple             # the variant: _kernel(*key)
    grid: tuple            # (B * Hkv, num_splits, 1)
    prm: DecodeParams
    tensors: dict          # name -> the tensor prm points into (None: null), kept alive
    out: torch.Tensor      # [B, Hq, Sq, DV]
    acc: torch.Tensor      # [B*Hq*Sq, S, DV] fp32 partial outputs (out when direct)
    plse: torch.Tensor     # [B*Hq*Sq, S] their log2-sum-exp (out when direct)
    num_splits: int
    dv: int

    @property
    def direct(self) -> bool:
        return self.num_splits == 1


def launch_decode_sm90(q, kd, ks, vd, vs, block_tables, seq_lens, key_mask, out,
                       k_fmt: str, k_gran: str, v_fmt: str, v_gran: str, scale: float,
                       sliding_window: int, sinks: int, softcap: float, num_splits: int,
                       sm_count: int, combine, *, qk_fp8: bool = False, kz=None,
                       vz=None, variant: str | None = None) -> torch.Tensor:
    """q [B, Hq, Sq, D]; kd / vd [N, Hkv, P, D(v)] pages; ks / vs their fp32 scales (or None;
    int4: fp16 scales, keys [N, Hkv, D], values [N, Hkv, P], and kz / vz their zero points);
    block_tables [B, W] int32; seq_lens [B] int32; key_mask [B, Lm] bool or None; out
    [B, Hq, Sq, DV] or None. `combine(acc, plse, out, lse, num_splits, dv)` merges splits.
    qk_fp8: the opt-in variant with q.k on e4m3 tensor cores (fp8_e4m3 keys only).
    variant: an issue-14 compile-time variant (VARIANTS; None: default_variant's)."""
    lp = plan_decode_sm90(q, kd, ks, vd, vs, block_tables, seq_lens, key_mask, out, k_fmt,
                          k_gran, v_fmt, v_gran, scale, sliding_window, sinks, softcap,
                          num_splits, sm_count, qk_fp8=qk_fp8, kz=kz, vz=vz,
                          variant=variant)
    _kernel(*lp.key).launch(lp.grid, WARPS * 32, lp.prm, q.device)
    if not lp.direct:
        lse = torch.empty(lp.acc.shape[0], dtype=torch.float32, device=q.device)
        combine(lp.acc, lp.plse, lp.out, lse, lp.num_splits, lp.dv)
    return lp.out


def plan_decode_sm90(q, kd, ks, vd, vs, block_tables, seq_lens, key_mask, out,
                     k_fmt: str, k_gran: str, v_fmt: str, v_gran: str, scale: float,
                     sliding_window: int, sinks: int, softcap: float, num_splits: int,
                     sm_count: int, *, qk_fp8: bool = False, kz=None, vz=None,
                     variant: str | None = None) -> Launch:
    """launch_decode_sm90's arguments -> the launch: variant, grid, DecodeParams, buffers."""
    if qk_fp8 and k_fmt != "fp8_e4m3":
        raise UnsupportedShapeError(
            f"sm90 decode: qk_fp8 (q.k on e4m3 tensor cores) needs fp8_e4m3 keys, not {k_fmt}; "
            "call without qk_fp8 for these pages")
    B, Hq, Sq, D = q.shape
    N, Hkv, P, _ = kd.shape
    kk, vk = _KIND[k_fmt], _KIND[v_fmt]
    dv = vd.shape[3] * (2 if vk == INT4 else 1)   # int4: two codes a byte
    G = Hq // Hkv
    rows = G * Sq
    if rows > MAX_ROWS:
        raise UnsupportedShapeError(f"sm90 decode: {rows} query rows per kv head (> {MAX_ROWS})")
    ksm = _SCALE[k_gran] if kk < 2 else _SC_CHANZP if kk == INT4 else 0
    vsm = _SCALE[v_gran] if vk < 2 else _SC_TOKZP if vk == INT4 else 0
    _check_int4("keys", kk, k_gran, INT4_KEY_GRAN, kd, ks, kz, (N, Hkv, D))
    _check_int4("values", vk, v_gran, INT4_VALUE_GRAN, vd, vs, vz, (N, Hkv, P))
    key = (kk, vk, ksm, vsm, D, dv, 8 if rows <= 8 else 16, _QT[q.dtype], int(qk_fp8))
    if variant is None:
        variant = default_variant(kk, vk, ksm, vsm, qk_fp8)
    var = variant_bits(variant, kk, vk, softcap, int(qk_fp8), key[6])
    if var & VAR_PGZ and N * Hkv * P >= 2 ** 32:  # paged_decode.cuh's iss_row
        raise UnsupportedShapeError(
            f"sm90 decode: {N * Hkv * P} pool rows (pages x kv heads x page size) overflow the "
            f"{variant} variant's 32-bit row index; take variant='base' or a smaller pool")
    if var:
        key = (*key, var)
    q = q.contiguous()
    dev = q.device
    max_len = block_tables.shape[1] * P
    if num_splits <= 0:
        num_splits = choose_splits(B, Hkv, max_len, sm_count,
                                   ctas_per_sm=kernel_constants(*key)[1])
    if out is None:
        out = torch.empty(B, Hq, Sq, dv, dtype=q.dtype, device=dev)
    direct = num_splits == 1
    nrows = B * Hq * Sq
    if direct:
        acc = plse = out
    else:
        acc = torch.empty(nrows, num_splits, dv, dtype=torch.float32, device=dev)
        plse = torch.empty(nrows, num_splits, dtype=torch.float32, device=dev)
    km = None
    if key_mask is not None:
        km = _padded_mask(key_mask, key_mask_width(max_len))
    window = int(sliding_window) if sliding_window and sliding_window > 0 else 0
    prm = DecodeParams()
    prm.q, prm.k, prm.v = q.data_ptr(), kd.data_ptr(), vd.data_ptr()
    prm.ks = ks.data_ptr() if ks is not None else 0
    prm.vs = vs.data_ptr() if vs is not None else 0
    prm.bt, prm.seq_lens = block_tables.data_ptr(), seq_lens.data_ptr()
    prm.kmask = km.data_ptr() if km is not None else 0
    prm.out, prm.acc, prm.lse = out.data_ptr(), acc.data_ptr(), plse.data_ptr()
    prm.stride_bt = block_tables.stride(0)
    prm.stride_km = km.shape[1] if km is not None else 0
    prm.n_km = km.shape[1] if km is not None else 0
    prm.H, prm.G, prm.SQ, prm.num_splits = Hkv, G, Sq, num_splits
    prm.log2p = int(math.log2(P))
    prm.window, prm.sinks = window, int(sinks) if window else 0
    prm.direct = int(direct)
    prm.qk_scale = float(scale) * LOG2E
    prm.cap_in = float(scale) / softcap if softcap else 0.0
    prm.cap_out = softcap * LOG2E if softcap else 0.0
    kz = kz if kk == INT4 else None
    vz = vz if vk == INT4 else None
    prm.kz = kz.data_ptr() if kz is not None else 0
    prm.vz = vz.data_ptr() if vz is not None else 0
    tensors = {"q": q, "k": kd, "v": vd, "ks": ks, "vs": vs, "bt": block_tables,
               "seq_lens": seq_lens, "kmask": km, "out": out, "acc": acc, "lse": plse,
               "kz": kz, "vz": vz}
    return Launch(key, (B * Hkv, num_splits, 1), prm, tensors, out, acc, plse, num_splits, dv)
