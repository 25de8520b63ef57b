"""Absorbed MLA decode on Hopper by a CUDA C++ kernel (kernels/cuda/latent_decode.cuh).

    out_lat = latent_decode_sm90(q_lat, c_pages, r_pages, block_tables, seq_lens, scale)
    # the same contract as latent_decode.latent_decode_attention: q_lat [B, H, R + DR],
    # c_pages [N, 1, P, R], r_pages [N, 1, P, DR] (PagedTensor) -> [B, H, R] fp32

It takes the DeepSeek shape (R 512, DR 64), bf16 / fp16 / fp8 (e4m3, e5m2, page scales) latent
and rotary pages (each its own format), pages of 8-128 tokens, any head count (blocks of 16 heads,
one CTA each), bf16 / fp16 / fp32 queries (converted to the pages' MMA dtype: bf16 for bf16 pages,
fp16 otherwise). Options, all compile-time (one cached cubin each): `stages` (the cp.async ring,
half tiles), `variant` (VARIANTS: fp8 widened by integer ops), `warps` (4 or 8 a CTA).
`unsupported(...)` names what it does not take. The Triton kernel stays the
default except where `use_cuda` says the H200 measured this kernel faster (the run time asks it
for every decode step); benchmarks/bench_latent_decode.py --quick times it beside the rule
(`--cuda`), and benchmarks/RESULTS.md ("a CUDA latent kernel") has the arithmetic.
`plan_latent_sm90` builds the launch without a GPU: the CPU emulation (kernels/cuda/emu) runs it.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import torch

from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels.cuda import build

_KIND = {"fp8_e4m3": 0, "fp8_e5m2": 1, "fp16": 2, "bf16": 3}
_QT = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
R_DIMS = (512,)
DR_DIMS = (64,)
PAGES = (8, 16, 32, 64, 128)
TILE = 64            # tokens an iteration (latent_decode.cuh LAT_TILE)
HALF = 32            # tokens a ring stage (LAT_HALF)
WARPS = 4
SMEM_LIMIT = 232448  # sm_90: the most dynamic shared memory a CTA may have
MAX_STAGES = 10     # half-tile stages
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
_LOG2E = 1.4426950408889634
KERNEL_CALL = ("kvc::latent_decode<KVC_CK, KVC_RK, KVC_R, KVC_DR, KVC_LOG2P, KVC_NS, KVC_QT, "
               "KVC_LVAR, KVC_LW>")
WARP_COUNTS = (4, 8)   # warps a CTA: 4 (16 tokens a warp in the scores) or 8 (8 tokens)
# compile-time variants (latent_decode.cuh VAR bits): "aluk" widens fp8 latent keys by integer
# ops for the scores (values still by F2FP), "aluv" the values, "alu" both; e4m3 NaN codes then
# read as +-480 * scale where integer ops widen them
# "wide" (mla22j): fp8 latent codes widened once a tile (the scores' F2FP results kept in a
# 16-bit shared copy of the tile, which P V reads): 144 F2FP a tile a thread instead of 256, for
# 64 KB of shared memory (fewer ring stages)
# "ksplit" (mla22k, any pages): the scores split over the warps by k, q in registers (no q
# reads from shared memory in the loop), partial scores added through shared memory.
# Names join with "+" ("aluv+ksplit").
# "ostage" (mla22k, any pages): O stored through shared memory as whole rows (16-byte stores).
VARIANTS = {"base": 0, "aluk": 1, "aluv": 2, "alu": 3, "wide": 4, "ksplit": 64, "ostage": 128}
WIDE = 4
KSPLIT = 64
FP8_BITS = 7          # the bits above that mean something for fp8 latent pages only
PROF = 8              # profile=: per-CTA timers (latent_decode.cuh LAT_VAR_PROF)
FMERGE = 16           # fused_merge=True: the last CTA of each head block merges the splits
RESCALE = 32          # always_rescale=True: O rescaled every tile (before mla22k), an A/B
MASKED = 256          # a key mask or H2O's scores given: the build that reads them
PROF_SLOTS = 12       # latent_decode.cuh LAT_PROF_SLOTS
PROF_NAMES = ("t_entry", "t_q", "t_tile0", "t_loop", "t_stored", "t_merged", "smid", "tiles",
              "cyc_wait", "cyc_scores", "cyc_softmax", "cyc_pv")


class LatentParams(ctypes.Structure):  # latent_decode.cuh LatentParams, field for field
    _fields_ = [(n, ctypes.c_void_p) for n in (
        "q", "c", "r", "cs", "rs", "bt", "seq_lens", "out", "acc", "ml")] + [
        (n, ctypes.c_longlong) for n in ("stride_qb", "stride_qh", "stride_bt")] + [
        (n, ctypes.c_int) for n in ("H", "num_splits", "tiles_per_split", "direct")] + [
        ("qk_scale", ctypes.c_float), ("prof", ctypes.c_void_p), ("cnt", ctypes.c_void_p),
        ("km", ctypes.c_void_p), ("n_km", ctypes.c_int),
        ("scores", ctypes.c_void_p), ("scores_len", ctypes.c_int)]


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def variant_bits(variant: str, ck: int) -> int:
    """The VAR bits of a variant name ("+" joins names), those for fp8 latent pages only
    dropped for 16-bit ones (ck: the latent kind)."""
    bits = 0
    for name in variant.split("+"):
        if name not in VARIANTS:
            raise UnsupportedShapeError(f"latent_decode_sm90: unknown variant {variant!r}; take "
                                        f"one of {sorted(VARIANTS)} or several joined by '+'")
        bits |= VARIANTS[name]
    return bits if ck < 2 else bits & ~FP8_BITS


def geometry(ck: int, rk: int, r: int, dr: int, page: int,
             stages: int | None = None, warps: int = WARPS,
             wide: bool = False) -> tuple[int, int, int]:
    """(stages, shared bytes a CTA, CTAs an SM by shared memory), as latent_decode.cuh's
    LatGeo lays them out; a stage is half a tile (32 tokens), at least 4. stages None: as many
    as fit one CTA an SM (at most MAX_STAGES)."""
    ceb, reb = (2 if ck >= 2 else 1), (2 if rk >= 2 else 1)
    nch = r * ceb // 16 + dr * reb // 16
    rowb = _round(nch * 16, 128) + 16
    ppt = HALF // min(page, HALF)
    stage = _round(HALF * rowb + (8 * ppt if ck < 2 or rk < 2 else 0), 128)
    qrowb = (r + dr) * 2 + 8
    fixed = _round(_round(16 * qrowb, 128) + warps * 16 * 4 + 16 * (TILE * 2 + 16), 128)
    if wide and ck < 2:   # the tile's latent rows widened to 16 bits (latent_decode.cuh WROWB)
        fixed += _round(TILE * (r * 2 + 16), 128)
    if stages is None:
        stages = max(4, min(MAX_STAGES, (SMEM_LIMIT - fixed) // stage))
    smem = fixed + stages * stage
    if stages < 4 or smem > SMEM_LIMIT:
        raise UnsupportedShapeError(f"latent_decode_sm90: {stages} stages of {stage} B take "
                                    f"{smem} B of shared memory (limit {SMEM_LIMIT}); use "
                                    f"stages=None or fewer (>= 4)")
    return stages, smem, max(1, min(3, (SMEM_LIMIT + 1024) // (smem + 1024)))


def kernel_constants(ck: int, rk: int, r: int, dr: int, page: int, qt: int,
                     stages: int | None = None, var: int = 0,
                     warps: int = WARPS) -> tuple[dict[str, int], int, int]:
    """(compile-time constants, CTAs an SM, shared bytes a CTA) of a variant; the emulation
    builds the same constants. The CTA has `warps` x 32 threads."""
    if warps not in WARP_COUNTS:
        raise UnsupportedShapeError(f"latent_decode_sm90: warps={warps}; take one of "
                                    f"{WARP_COUNTS}")
    ns, smem, ctas = geometry(ck, rk, r, dr, page, stages, warps, bool(var & WIDE))
    defines = {"KVC_CK": ck, "KVC_RK": rk, "KVC_R": r, "KVC_DR": dr,
               "KVC_LOG2P": page.bit_length() - 1, "KVC_NS": ns, "KVC_QT": qt,
               "KVC_LVAR": var if ck < 2 else var & ~FP8_BITS, "KVC_LW": warps}
    return defines, ctas, smem


def unsupported(q_lat, c_pages, r_pages) -> str:
    """'' when the kernel takes these pages and queries, else why not (a short phrase)."""
    for name, pg in (("latent", c_pages), ("rotary key", r_pages)):
        fmt = pg.fmt
        if fmt.residual or fmt.name not in _KIND or (
                fmt.name.startswith("fp8") and fmt.granularity != "page"):
            return (f"{name} pages {fmt.name}/{fmt.granularity} (the CUDA latent kernel reads "
                    f"bf16 / fp16, or fp8 with page scales)")
        if pg.num_heads != 1:
            return f"{name} pages hold {pg.num_heads} heads, not one latent head"
    if c_pages.head_dim not in R_DIMS or r_pages.head_dim not in DR_DIMS:
        return (f"latent {c_pages.head_dim} + rotary {r_pages.head_dim} (the kernel takes "
                f"{R_DIMS[0]} + {DR_DIMS[0]}, DeepSeek's)")
    if c_pages.page_size not in PAGES:
        return f"page size {c_pages.page_size} (the kernel takes {PAGES})"
    if q_lat.dtype not in _QT:
        return f"q dtype {q_lat.dtype}"
    return ""


# The run time's route (runtime/dispatch.py, decode steps the Triton launcher takes): this
# kernel where the H200 measured it faster than the Triton rule, the Triton rule elsewhere.
# H200, 16 heads, 2026-12-04 (RESULTS.md, "Eleventh session's device calls"), % of copy, rule /
# CUDA: B64 x 32k bf16 66.0 / 88.3 (4 warps), fp8 42.6 / 47.7 (4 stages, alu: 53.3);
# B16 x 8k bf16 46.3 / 44.9, fp8 26.1 / 22.5. After mla22j (RESULTS.md, "per-tile instructions
# cut by a third"; CUDA graphs of 4 calls, ms rule / CUDA): B16 x 8k bf16 0.071 / 0.068, fp8
# 0.058 / 0.064 (4 stages: 0.074); B64 x 8k, B16 x 32k, B64 x 32k: CUDA faster in both formats
# (fp8 at 4 stages, 2 CTAs an SM: 69.5% of copy at B64 x 32k).
ROUTE = "auto"                 # "auto" (use_cuda's rule), "cuda" (wherever it runs), "triton"
# by page kind (False: 16-bit pages, True: fp8), (batch x the block table's context from which
# the CUDA kernel takes a step, its launch options): the last entry whose size the step reaches
# (`cuda_launch`); below the first, the Triton rule
CUDA_LAUNCH = {False: [(1 << 17, {})],
               True: [(1 << 19, {"stages": 4})]}   # widened (fp8) pages: 2 CTAs an SM


def cuda_launch(fp8: bool, tokens: int) -> dict | None:
    """The launch options CUDA_LAUNCH gives a step of `tokens` (batch x context) over fp8 or
    16-bit latent pages, None below its first size (the Triton rule takes it)."""
    pick = None
    for min_tokens, opts in CUDA_LAUNCH[fp8]:
        if tokens >= min_tokens:
            pick = opts
    return None if pick is None else dict(pick)


def use_cuda(q_lat, c_pages, r_pages, max_len: int) -> dict | None:
    """The launch options (latent_decode_sm90's keywords) when the run time should take this
    kernel for a decode step, else None: on an sm_90 GPU, for pages it takes (`unsupported`),
    with ROUTE "cuda", or "auto", where `cuda_launch` gives options for batch x max_len, and
    16-bit queries (this kernel rounds fp32 queries to the pages' MMA dtype; the Triton
    kernel's dots stay fp32)."""
    if ROUTE == "triton" or q_lat.device.type != "cuda":
        return None
    from kvcompile.kernels import decode_sm90

    if not decode_sm90.device_ok(q_lat.device)[0] or unsupported(q_lat, c_pages, r_pages):
        return None
    fp8 = c_pages.fmt.name.startswith("fp8")
    opts = cuda_launch(fp8, q_lat.shape[0] * max_len)
    if ROUTE == "auto" and (opts is None or q_lat.dtype == torch.float32):  # fp32 q: Triton's dots
        return None
    return opts if opts is not None else dict(CUDA_LAUNCH[fp8][0][1])


def choose_splits(batch: int, head_blocks: int, max_len: int, sms: int, ctas_per_sm: int) -> int:
    """Splits a sequence: batch x head blocks x splits CTAs fill the SMs' slots once (never a
    second partial wave), at least MIN_SPLIT_TOKENS tokens a split."""
    cap = max(1, min(max_len // MIN_SPLIT_TOKENS, MAX_SPLITS))
    return max(1, min(cap, sms * ctas_per_sm // max(1, batch * head_blocks)))


@dataclass
class Launch:
    """One launch as latent_decode_sm90 sets it up (the emulation runs it too)."""
    key: tuple           # kernel_constants(*key)
    grid: tuple          # (B * head blocks, splits, 1)
    prm: LatentParams
    tensors: dict        # name -> the tensor prm points into (None: null), kept alive
    out: torch.Tensor    # [B, H, R] fp32
    acc: torch.Tensor    # [B, S, H, R] (out when direct)
    ml: torch.Tensor     # [B, S, H, 2] (out when direct)
    num_splits: int
    fused: bool = False  # the kernel merges its splits (LAT_VAR_FMERGE)
    scores: torch.Tensor | None = None   # [B, H, Lm] (attn_mass: H2O), log2 units

    @property
    def direct(self) -> bool:
        return self.num_splits == 1

    @property
    def merged(self) -> bool:
        """out holds the result once the kernel ran (one split, or the fused merge)."""
        return self.direct or self.fused


_arrivals: dict = {}
_warned: set = set()


def arrivals(device: torch.device, n: int) -> torch.Tensor:
    """The fused merge's arrival counters (int32 [>= n], zero between launches: the merging
    CTA sets its counter back to 0), one buffer a device, grown (to a new zeroed buffer) when a
    launch needs more. Launches on one stream only (two streams would share counters); a
    buffer first made during a CUDA graph capture would belong to that graph's pool, so
    callers make it before capturing (a call outside the capture does; latent_decode_sm90
    refuses the fused merge, once with a warning, where it would be first made in a capture)."""
    key = (device.type, device.index)
    buf = _arrivals.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:   # a captured graph may still count in it: kept, never freed
            _retired.append(buf)
        buf = torch.zeros(max(n, ARRIVALS), dtype=torch.int32, device=device)
        _arrivals[key] = buf
    return buf


_retired: list = []   # grown-out buffers that CUDA graphs captured may still use


ARRIVALS = 1 << 14   # the first buffer's counters (64 KB): sequences x head blocks a launch


def _arrivals_ready(device: torch.device, n: int) -> bool:
    buf = _arrivals.get((device.type, device.index))
    return buf is not None and buf.numel() >= n


def plan_latent_sm90(q_lat, c_pages, r_pages, block_tables, seq_lens, scale: float,
                     num_splits: int | None = None, stages: int | None = None,
                     sms: int = 132, variant: str = "base", warps: int = WARPS,
                     poison: bool = False, profile: torch.Tensor | None = None,
                     fused_merge: bool = False, always_rescale: bool = False,
                     key_mask: torch.Tensor | None = None,
                     mass_len: int = 0) -> Launch:
    """The launch for these inputs (any device: the emulation plans CPU tensors).
    stages: ring stages of half a tile (None: as many as fit one CTA an SM; 4 lets fp8 pages
    run two CTAs an SM); variant: VARIANTS (a bit that changes nothing for these pages is
    dropped); warps: WARP_COUNTS (8: two warps a scheduler at one CTA an SM); poison (tests):
    the output and the splits' partials filled with NaN first; profile: an int64 tensor of at
    least grid CTAs x PROF_SLOTS elements, the per-CTA timers' destination (LAT_VAR_PROF; one
    cubin more); fused_merge: the splits merged by the kernel's last CTA a head block (an
    arrival counter, `arrivals`, instead of merge_launch's second launch); always_rescale
    (benchmarks): O rescaled in every tile, as before mla22k (now only tiles that raise a row's
    max do; bit-identical); key_mask: bool [B, Lm], key j seen iff key_mask[b, j] (j >= Lm:
    seen), as latent_decode.latent_decode_attention takes it (left padding, a decode step's
    mask under CUDA graph capture); a row whose keys are all hidden gets zeros; mass_len > 0
    (H2O): the kernel also writes each key j < mass_len's score to Launch.scores [B, H,
    mass_len] (log2 units, -inf where not written) and, with one split too, each head's
    (max, sum) to Launch.ml, which `add_mass` turns into attention mass."""
    from kvcompile.kernels.latent_decode import _check, check_key_mask

    _check(q_lat, c_pages, r_pages, block_tables, seq_lens)
    check_key_mask(key_mask, q_lat, "latent_decode_sm90")
    why = unsupported(q_lat, c_pages, r_pages)
    if why:
        raise UnsupportedShapeError(f"latent_decode_sm90: {why}; use "
                                    f"latent_decode.latent_decode_attention (Triton)")
    B, H, _ = q_lat.shape
    R, DR, P = c_pages.head_dim, r_pages.head_dim, c_pages.page_size
    ck, rk = _KIND[c_pages.fmt.name], _KIND[r_pages.fmt.name]
    vb = variant_bits(variant, ck)
    if vb & KSPLIT and vb & WIDE:
        raise UnsupportedShapeError(f"latent_decode_sm90: variant {variant!r}: ksplit and wide "
                                    f"do not combine; take one")
    var = (vb | (PROF if profile is not None else 0)
           | (FMERGE if fused_merge else 0) | (RESCALE if always_rescale else 0)
           | (MASKED if key_mask is not None or mass_len else 0))
    key = (ck, rk, R, DR, P, _QT[q_lat.dtype], stages, var, warps)
    _, ctas, _ = kernel_constants(*key)
    hbs = (H + 15) // 16
    max_len = block_tables.shape[1] * P
    if num_splits is None:
        num_splits = choose_splits(B, hbs, max_len, sms, ctas)
    if num_splits < 1:
        raise UnsupportedShapeError(f"latent_decode_sm90: num_splits={num_splits}; use >= 1 "
                                    f"or None")
    n_tiles = max(1, -(-max_len // TILE))
    tps = -(-n_tiles // num_splits)
    q = q_lat if q_lat.stride(2) == 1 else q_lat.contiguous()
    dev = q.device
    out = torch.empty((B, H, R), dtype=torch.float32, device=dev)
    if num_splits == 1:
        acc = ml = out
        if mass_len:   # the (max, sum) the mass' lse needs
            ml = torch.empty((B, 1, H, 2), dtype=torch.float32, device=dev)
    else:
        acc = torch.empty((B, num_splits, H, R), dtype=torch.float32, device=dev)
        ml = torch.empty((B, num_splits, H, 2), dtype=torch.float32, device=dev)
    if poison:   # tests: an element the kernel does not write stays NaN
        for t in (out, acc, ml):
            t.fill_(float("nan"))
    scores = None
    if mass_len:
        scores = torch.full((B, H, mass_len), float("-inf"), dtype=torch.float32, device=dev)
    grid = (B * hbs, num_splits, 1)
    if profile is not None and (profile.dtype != torch.int64 or not profile.is_contiguous()
                                or profile.numel() < grid[0] * grid[1] * PROF_SLOTS):
        raise UnsupportedShapeError(f"latent_decode_sm90: profile needs a contiguous int64 "
                                    f"tensor of >= {grid[0] * grid[1] * PROF_SLOTS} elements")
    cnt = arrivals(dev, B * hbs) if fused_merge and num_splits > 1 else None
    tensors = {"q": q, "c": c_pages.data, "r": r_pages.data,
               "cs": c_pages.scale if ck < 2 else None, "rs": r_pages.scale if rk < 2 else None,
               "bt": block_tables, "seq_lens": seq_lens, "out": out,
               "acc": None if num_splits == 1 else acc,
               "ml": None if num_splits == 1 and not mass_len else ml,
               "prof": profile, "cnt": cnt,
               "km": None if key_mask is None else key_mask.contiguous().view(torch.uint8),
               "scores": scores}

    def ptr(name):
        t = tensors[name]
        return None if t is None else t.data_ptr()

    prm = LatentParams(ptr("q"), ptr("c"), ptr("r"), ptr("cs"), ptr("rs"), ptr("bt"),
                       ptr("seq_lens"), ptr("out"), ptr("acc"), ptr("ml"),
                       q.stride(0), q.stride(1), block_tables.stride(0), H, num_splits, tps,
                       int(num_splits == 1), float(scale) * _LOG2E, ptr("prof"), ptr("cnt"),
                       ptr("km"), 0 if key_mask is None else key_mask.shape[1],
                       ptr("scores"), mass_len)
    return Launch(key, grid, prm, tensors, out, acc, ml, num_splits, bool(fused_merge),
                  scores)


_kernels: dict = {}


def _kernel(key):
    from kvcompile.kernels.cuda.driver import Kernel

    k = _kernels.get(key)
    if k is None:
        k = Kernel(build_key(key), "kvc_latent_decode", kernel_constants(*key)[2])
        _kernels[key] = k
    return k


def build_key(key) -> bytes:
    """The sm_90 cubin of launch key `key` (Launch.key), built or from the cache (no GPU needed:
    benchmarks build their variants in parallel processes first)."""
    defines, ctas, _ = kernel_constants(*key)
    return build.build_cubin("latent_decode.cuh", "kvc_latent_decode", KERNEL_CALL, defines,
                             arch="sm_90", threads=defines["KVC_LW"] * 32, min_blocks=ctas,
                             params="LatentParams")


def merge_splits(acc: torch.Tensor, ml: torch.Tensor) -> torch.Tensor:
    """acc [B, S, H, R] unnormalized, ml [B, S, H, 2] (max, sum; log2 units) -> [B, H, R], as
    latent_decode.py's merge kernel (empty splits: max -inf, weight 0). PyTorch (CPU, tests)."""
    m, lsum = ml[..., 0], ml[..., 1]
    top = m.max(1, keepdim=True).values
    w = torch.where(m > float("-inf"), torch.exp2(m - torch.where(
        top > float("-inf"), top, torch.zeros_like(top))), torch.zeros_like(m))
    den = (w * lsum).sum(1)
    out = (w[..., None] * acc).sum(1)
    return torch.where(den[..., None] > 0, out / den.clamp_min(1e-38)[..., None],
                       torch.zeros_like(out))


def latent_decode_sm90(q_lat, c_pages, r_pages, block_tables, seq_lens, scale: float,
                       num_splits: int | None = None, stages: int | None = None,
                       variant: str = "base", warps: int = WARPS,
                       merge: bool = True, poison: bool = False,
                       profile: torch.Tensor | None = None,
                       fused_merge: bool = False, always_rescale: bool = False,
                       key_mask: torch.Tensor | None = None,
                       attn_mass: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. q_lat [B, H, R + DR] -> [B, H, R] fp32, on an sm_90 GPU.
    merge False (benchmarks only: the kernel timed without the merge launch): the splits'
    partials are left unmerged and the returned tensor is not the output when splits > 1.
    poison (tests): the output and the partials are filled with NaN before the launch.
    profile, fused_merge, always_rescale, key_mask: as plan_latent_sm90. attn_mass: fp32
    [B, 1, Lm] (H2O), += each key j < Lm's attention probability summed over the heads, as
    latent_decode.latent_decode_attention's (the kernel writes the scores, `add_mass`)."""
    from kvcompile.kernels import decode_sm90
    from kvcompile.kernels.latent_decode import check_mass, merge_launch, sm_count

    ok, why = decode_sm90.device_ok(q_lat.device)
    if not ok:
        raise UnsupportedShapeError(f"latent_decode_sm90: {why}; use "
                                    f"latent_decode.latent_decode_attention (Triton)")
    if fused_merge and torch.cuda.is_current_stream_capturing() and not _arrivals_ready(
            q_lat.device, q_lat.shape[0] * ((q_lat.shape[1] + 15) // 16)):
        if "capture" not in _warned:
            _warned.add("capture")
            warnings.warn("latent_decode_sm90: fused_merge refused in this CUDA graph capture "
                          "(its arrival counters would be made inside the capture); the splits "
                          "merge in a second launch. One eager call first makes them.",
                          stacklevel=2)
        fused_merge = False
    lp = plan_latent_sm90(q_lat, c_pages, r_pages, block_tables, seq_lens, scale, num_splits,
                          stages, sm_count(q_lat.device), variant, warps, poison, profile,
                          fused_merge, always_rescale, key_mask,
                          check_mass(attn_mass, q_lat, "latent_decode_sm90"))
    _kernel(lp.key).launch(lp.grid, warps * 32, lp.prm, q_lat.device)
    if merge and not lp.merged:
        merge_launch(lp.acc, lp.ml, lp.out, lp.num_splits)
    add_mass(lp, attn_mass, seq_lens)
    return lp.out


def add_mass(lp: Launch, attn_mass, seq_lens) -> None:
    """attn_mass [B, 1, Lm] += each key's probability summed over the heads, from the scores
    and (max, sum) launch `lp` (planned with mass_len = Lm) wrote; nothing without a mass."""
    if lp.scores is not None:
        from kvcompile.kernels.latent_decode import _scores_mass

        _scores_mass(lp.scores, lp.ml, attn_mass, seq_lens)


__all__ = ["KERNEL_CALL", "PROF_NAMES", "VARIANTS", "WARP_COUNTS", "Launch", "LatentParams",
           "add_mass", "arrivals", "choose_splits", "cuda_launch", "geometry",
           "kernel_constants", "latent_decode_sm90", "merge_splits", "plan_latent_sm90",
           "unsupported", "use_cuda", "variant_bits"]
