"""Absorbed MLA decode over latent pages: a Triton kernel for tensor cores, and its launcher.

    out_lat = latent_decode_attention(q_lat, c_pages, r_pages, block_tables, seq_lens, scale)
    # q_lat: [B, H, r + dr] (absorbed query: q_nope W_UK, then q_rope)
    # c_pages: PagedTensor [N, 1, P, r] (the latent), r_pages: PagedTensor [N, 1, P, dr]
    # block_tables: [B, maxP] int32, seq_lens: [B] int32  ->  out_lat: [B, H, r] fp32

All H query heads attend to one latent per token (MQA). One program per (block of BLOCK_H
heads, split of the context, sequence) walks its tokens BLOCK_N at a time (a tile spans
BLOCK_N / P pages, gathered through the block table), one pass with an online softmax:

    s^T = c . q_c^T * c_scale + k_rope . q_r^T * r_scale   # [BLOCK_N, BLOCK_H], tl.dot
    acc = acc * alpha + (p * c_scale) . c                    # [BLOCK_H, r],       tl.dot

The latent tile [BLOCK_N, r] is loaded and widened once and feeds both dots. Tokens are the M
of QK^T (layouts "once" / "once_t", _latent_once_kernel): with BLOCK_N = 16 x num_warps each
warp scores its own 16 tokens against every head of the block, so every score is computed
once. (With heads as M, layout "heads", latent_decode_heads.py, kept for the benchmark's
comparison: Triton spreads all warps of a dot that feeds another along M, and 64 heads fill
only one warpgroup's M, so the second warpgroup recomputes the same scores.) The programs
that read the same tiles (head blocks) are neighbours in the grid, so that all but the first
find them in L2. fp8 pages (E4M3 / E5M2, one scale per page) are widened to the dot dtype in
registers; their page scale multiplies the score rows and the probabilities, never the tile.
The rotary key is its own page tensor, in its own format (FlashMLA keeps it bf16 beside an
fp8 latent). The softmax runs in base 2 (log2(e) is folded into the softmax scale). Long
contexts with few programs are split (split-K); a second small kernel merges the splits.

Tile sizes are constexpr; `pick_launch` is the rule: `pick_tiles` chooses among CANDIDATES
(the accumulator must stay in registers; by heads, page format and query dtype), then
`pick_splits` sizes split-K from the SM count, the batch, the context, the head blocks and how
many programs an SM holds (`programs_per_sm`). `launch_constexprs` is what a launch passes
the kernel (the sm_90 compile test compiles every launch the rule makes).
Work at 128 heads, per token: 128 x (576 + 512) MACs (278 KFLOP) against 1152 B of bf16 pages
(576 B + scales for fp8), 242 FLOP/B; the H200's ridge is 989 TFLOP/s / 4.8 TB/s = 206 FLOP/B,
so even at the dense peak the bf16 kernel is compute-bound (B16 x 8k: 36.5 GFLOP, 37 us at
989 TFLOP/s, against 151 MB, 31 us at 4.8 TB/s); computing QK^T twice made it 1.53x that.
At 16-32 heads a GPU (tensor-parallel shards: DeepSeek-V3 at TP 8 / TP 4) a token is 35-70
KFLOP against the same 1152 B (30-60 FLOP/B): memory-bound, 80% of a 4.25 TB/s copy needs
only 100-200 TFLOP/s; there the rule takes 4-warp tiles (bf16 pages: "once_t" with a
cp.async ring; fp8 pages: "once" widened by integer operations, two programs an SM; see
CANDIDATES) and splits the context until the programs fill the SMs.
A decode step's key mask is taken (key_mask: left padding, holes); other masks, windows and
soft-capping are not (runtime/dispatch.py `attend_latent` sends those steps to the reference,
kernels/dense.py); kernels/latent.py holds the math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels.decode_kernels import attn_mass_kernel
from kvcompile.kernels.latent_decode_heads import _latent_tile_kernel

_UNSCALED = ("bf16", "fp16", "fp32")
_PAGE_SCALED = ("fp8_e4m3", "fp8_e5m2")
_LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256    # a split shorter than this costs more in the merge than it saves
MAX_SPLITS = 64


LAYOUTS = ("once", "once_t", "heads")
WIDENS = ("dot", "tile", "bits")
AHEADS = ("", "bt", "rope")


@dataclass(frozen=True)
class LatentTiles:
    """One launch configuration of the decode kernel (block sizes powers of two, >= 16).

    layout "once" / "once_t" (_latent_once_kernel): tokens are the M of QK^T, spread over the
    warps 16 rows each (block_n == 16 x num_warps), so every score is computed by exactly one
    warp; "once" accumulates [heads, r] from registers, "once_t" [r, heads] from shared memory.
    layout "heads" (_latent_tile_kernel, issue 22's first rebuild, kept for the benchmark's
    comparison): heads are the M of QK^T, which both warpgroups of 8 warps, or both programs
    of a v_split pair, compute in full.
    widen "tile" (layouts once / once_t, fp8 pages only): the fp8 latent tile is widened to
    fp16 once as loaded, by an opaque conversion Triton cannot move into the dots' operand
    loads, so the fp8 tile enters the cp.async ring and its widened copy waits in shared
    memory, not in registers; "dot" leaves the widening to Triton (per dot operand, in
    registers, the fp8 load not pipelined). widen "bits" is "tile" by integer operations
    instead of the fp8 conversion instruction: the e4m3 code's low 7 bits shifted into fp16's
    exponent and mantissa, its sign into fp16's sign (4 codes: 2 byte permutes, 2 shifts,
    masks; e5m2: the byte permute alone), which is the code's value times 2^-8; the 2^8 is
    folded into the page scale of the score rows and into the accumulator at the end, never
    per element."""
    block_h: int      # query heads per program
    block_n: int      # tokens per tile: K of PV
    num_warps: int
    num_stages: int
    v_split: int = 1  # "heads" only: programs sharing a head block, r / v_split columns each
    layout: str = "once"
    widen: str = "dot"
    # layouts once / once_t, a variant for the benchmark (kernel BT_AHEAD / ROPE_AHEAD):
    # "" the block-table entries a pipeline stage of their own; "bt" loaded a tile ahead in
    # registers, so that the latent tile takes the first stage (a prefetch that overlaps the
    # previous tile's dots); "rope" also the rotary key a tile ahead in registers, outside
    # the ring (bf16 pages then fit a 3-deep ring: once_t h16 n64 w4 s3, 223 KB)
    ahead: str = ""

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"LatentTiles.{name}={v}: must be a power of two >= 16 "
                                 f"(tl.dot needs M, N, K >= 16)")
        if self.num_warps not in (4, 8) or self.num_stages < 1 or self.v_split not in (1, 2):
            raise ValueError(f"LatentTiles: num_warps {self.num_warps} (4 or 8), num_stages "
                             f"{self.num_stages} (>= 1), v_split {self.v_split} (1 or 2)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"LatentTiles.layout={self.layout!r}: one of {LAYOUTS}")
        if self.widen not in WIDENS or (self.widen != "dot" and self.layout == "heads"):
            raise ValueError(f"LatentTiles.widen={self.widen!r}: 'dot', or 'tile' / 'bits' "
                             f"with layout once / once_t")
        if self.ahead not in AHEADS or (self.ahead and self.layout == "heads"):
            raise ValueError(f"LatentTiles.ahead={self.ahead!r}: one of {AHEADS}, and '' "
                             f"with layout 'heads'")
        if self.layout != "heads" and (self.block_n != 16 * self.num_warps
                                       or self.v_split != 1):
            raise ValueError(f"LatentTiles: layout {self.layout!r} needs block_n == 16 x "
                             f"num_warps ({16 * self.num_warps}: one warp per 16 score rows, "
                             f"none computed twice) and v_split 1; got block_n "
                             f"{self.block_n}, v_split {self.v_split}")

    def acc_regs(self, r: int) -> int:
        """fp32 registers per thread that the [block_h, r] accumulator takes."""
        return self.block_h * r // (self.v_split * 32 * self.num_warps)

    def __str__(self) -> str:
        v = f"/v{self.v_split}" if self.v_split > 1 else ""
        w = f" widen-{self.widen}" if self.widen != "dot" else ""
        a = f" ahead-{self.ahead}" if self.ahead else ""
        return (f"{self.layout} h{self.block_h} n{self.block_n} w{self.num_warps} "
                f"s{self.num_stages}{v}{w}{a}")


# Candidates, in order of preference for many heads. "once" at 64 heads: 8 warps, each
# scoring 16 of 128 tokens against all 64 heads (wgmma m64n64, the q block and the latent
# tile in shared memory: 216 KB, one program an SM, no cp.async ring), then the [64, r]
# accumulator over both warpgroups (128 registers a thread at r 512, p from registers,
# m64n128 per latent half). "once_t" keeps p in shared memory and accumulates r x heads.
# sm_90 compile (triton 3.9, r 512, 255 registers each), stack for bf16 / fp8 pages: "once"
# 8-32 / 632-656 B (fp8: the widened tile); "once_t" 72-80 / 1000 B at 64 heads (the first
# rebuild's pick: 48-64 / 328-336). benchmarks/bench_latent_decode.py --quick times every
# candidate of 32+ heads at 128 heads (--heads 16 / 32: the candidates of that many heads).
#
# Under 64 heads (a tensor-parallel shard of DeepSeek-V3: 16 heads a GPU at TP 8, 32 at TP 4)
# a token is 2 x heads x 1088 FLOP against 1152 B of bf16 pages (30 FLOP/B at 16 heads): the
# step is memory-bound, and what counts is a load pipeline and enough programs. "once_t" with
# 4 warps (64 tokens a tile) puts both GEMMs on wgmma with the heads as N (m64n16 / m64n32:
# r x heads needs no 64-row head block) and fits a cp.async ring of bf16 tiles (3 stages:
# Triton 3.9 makes it a 2-deep ring of latent tiles behind the block-table entries loaded one
# stage earlier; sm_90: 168 KB shared, 218 registers, no stack at 16 heads; 189 KB, 255, 64 B
# at 32): one 72 KB tile in flight an SM while the other is computed, one program an SM. fp8
# pages are not in the ring (the tile feeds two dots through two register layouts, and
# Triton does not pipeline such a load): 56-75 KB shared and 255 registers x 128 threads, so
# two programs an SM would overlap one's loads with the other's dots (programs_per_sm), with
# 280-656 B of stack (the widened [64, r] tile is r / 2 registers a thread, whatever the
# warps). For fp8 pages under bf16 / fp16 queries (fp16 dots) the rule takes the 4-warp
# "once" tile that widens each fp8 tile once by integer operations (widen "bits") with no
# cp.async ring, two programs an SM (86 KB shared, 227 registers, no stack): one program's
# loads run under the other's dots and widening. The H200 measured it fastest at 16 heads at
# few and at many sequences (B16 x 8k: 0.068 ms x 16 splits against 0.091 for once_t h16 n64
# w4 s3 x 16 and 0.104 for the widen "tile" tile x 8; B64 x 32k: 0.676 ms x 4 against 0.810-
# 0.814 for the widen "tile" tile x 2; RESULTS.md, mla22g's fifth call). 32 heads take two
# 16-head blocks of it (a 32-head block spills or exceeds shared memory), the second reading
# each tile from L2. Under fp32 queries (fp32 dots, no "bits") the rule keeps mla22g's: the
# 8-warp, 128-token widen "tile" tile (the fp8 tile in the ring, its copy in shared memory,
# 228 KB, one program an SM), or with few sequences (batch x 16-head blocks <= SMs /
# FEW_PROGRAMS) the 4-warp widen "dot" tiles at two programs an SM and twice the splits.
CANDIDATES = (
    LatentTiles(64, 128, 8, 1, layout="once"),
    LatentTiles(64, 128, 8, 1, layout="once_t"),
    # the first rebuild's layout (QK^T twice per head block), kept for comparison; the
    # first was the fastest of its kind on the H200 (bench_latent_decode.py --quick,
    # 2026-12-03)
    LatentTiles(64, 32, 8, 2, layout="heads"),
    LatentTiles(64, 16, 4, 2, v_split=2, layout="heads"),
    # fp8 pages under 64 heads (pick_tiles skips them for pages read as stored, and "bits"
    # for fp32 dots)
    LatentTiles(16, 64, 4, 1, layout="once", widen="bits"),
    LatentTiles(16, 128, 8, 2, layout="once", widen="tile"),
    # under 64 heads: the memory-bound "once_t" tiles (see above) before the first rebuild's
    # (mma.sync, operands in registers: 8 warps keep r 512 without spills; 4 spilled 60-416 B)
    LatentTiles(32, 64, 4, 3, layout="once_t"),
    LatentTiles(32, 32, 8, 2, layout="heads"),
    LatentTiles(16, 64, 4, 3, layout="once_t"),
    LatentTiles(16, 32, 8, 2, layout="heads"),
)
# Timed by benchmarks/bench_latent_decode.py --quick and compiled by
# tests/kernels/test_latent_decode_sm90.py, never picked by the rule: the widen "bits" tile's
# twin widened by the conversion instruction ("tile"; the fifth call reported only the
# fastest row of each shape, "bits"). sm_90 (triton 3.9): 86 KB shared, 231 registers, no
# stack, two an SM.
SWEEP_CANDIDATES = (
    LatentTiles(16, 64, 4, 1, layout="once", widen="tile"),
)
# Not launched on CUDA (latent_decode_attention refuses them there): their first H200 run
# (triton 3.6, 2026-12-04) faulted with an illegal memory access on the bf16 "rope" variant,
# which left the process's CUDA context unusable; the CPU interpreter tests and the sm_90
# compile tests keep them.
PREFETCH_VARIANTS = (
    # the prefetch variants (LatentTiles.ahead, RESULTS.md mla22h; sm_90, triton 3.9): bf16
    # once_t with the rotary key a tile ahead, a 3-deep latent ring (223 KB, 237 registers,
    # no stack; the rule's tile: a 2-deep ring whose next tile is issued after the dots and
    # waited for at once); fp8 "bits" with the block-table entries a tile ahead, a 3-deep
    # ring of fp8 tiles (161 KB, 255 registers, 16 B stack, one an SM) and without a ring
    # (86 KB, 225 registers, no stack, two an SM)
    LatentTiles(16, 64, 4, 3, layout="once_t", ahead="rope"),
    LatentTiles(16, 64, 4, 3, layout="once", widen="bits", ahead="bt"),
    LatentTiles(16, 64, 4, 1, layout="once", widen="bits", ahead="bt"),
)
MAX_ACC_REGS = 128
# pick_tiles over fp8 pages under fp32 dots (no widen "bits"): when batch x 16-head blocks
# are at most the SMs / FEW_PROGRAMS,
# the 1-program-an-SM widen "tile" tile would be split 8+ ways (1k tokens a split at 8k) and
# the rule takes the 2-programs-an-SM tiles split twice as many ways instead (H200, 16 heads,
# B16 x 8k: once_t h16 n64 w4 s3 x 16 splits 0.091 ms against the widen "tile" tile x 8
# 0.104; B64 x 32k: the widen "tile" tile was the fastest, 0.810 ms; RESULTS.md, mla22f)
FEW_PROGRAMS = 8


def pick_tiles(heads: int, r: int, widened: bool = False, batch: int | None = None,
               sms: int | None = None, q_fp32: bool = False) -> LatentTiles:
    """The first candidate whose head block the heads fill (the smallest block for fewer
    than 16 heads), whose accumulator fits MAX_ACC_REGS registers a thread and whose value
    split (or, layouts once / once_t, latent half) leaves >= 16 columns; widen "tile" /
    "bits" candidates only for widened (fp8) pages, and widen "tile" not when batch x
    16-head blocks are at most sms / FEW_PROGRAMS (given both: a step with few sequences,
    see FEW_PROGRAMS). q_fp32 (fp32 queries: fp32 dots, the launcher's dots are fp16 over
    fp8 pages and bf16 / fp16 otherwise under 16-bit queries): no widen "bits" (it widens to
    fp16 only), and no 64-head tile for r > 128 (fp32 operands: the sm_90 compile at r 512
    takes 442,624 B of shared memory for once h64 n128 w8 s1 and 297-315 KB for heads h64
    n32 w8 s2, over the 232,448 B an SM gives a program; the 32-head tiles fit; r 256 not
    compiled). The batch, the context and the SM count size the splits
    (pick_splits); at 16 heads the H200 measured the same tiles fastest at B16 x 8k and at
    B64 x 32k (RESULTS.md), so here they only choose among the fp32-query fallbacks."""
    few = (widened and batch is not None and sms is not None
           and batch * triton.cdiv(heads, 16) * FEW_PROGRAMS <= sms)
    for t in CANDIDATES:
        if t.widen != "dot" and not widened:
            continue
        if t.widen == "bits" and q_fp32 or t.widen == "tile" and few:
            continue
        if q_fp32 and t.block_h == 64 and r > 128:
            continue
        if (t.block_h <= max(heads, 16) and t.acc_regs(r) <= MAX_ACC_REGS
                and r // t.v_split >= 16 and (t.layout == "heads" or r >= 32)):
            return t
    return LatentTiles(16, 16, 8, 1, v_split=2 if r >= 32 else 1,
                       layout="heads")   # the smallest accumulator


def programs_per_sm(tiles: LatentTiles, widened: bool = False) -> int:
    """Programs of these tiles that one SM holds at once (sm_90, r 512; the figures are the
    compile's, tests/kernels/test_latent_decode_sm90.py checks them): one for the "once"
    layouts over pages read as stored (165-216 KB of shared memory) and for a [64, r]
    accumulator over 8 warps, and for widen "tile" (228 KB); two for the "heads" layout's
    other tiles, and for 4-warp "once" tiles of widen "dot" over widened (fp8) pages: no
    cp.async ring, 56-75 KB of shared memory, 255 registers x 128 threads, so a second
    program's dots hide the first one's loads."""
    if tiles.layout == "heads":
        return 1 if tiles.num_warps == 8 and tiles.block_h == 64 else 2
    if widened and tiles.num_warps == 4 and (tiles.widen == "dot" or tiles.num_stages == 1):
        return 2   # and for 4-warp widen "tile" / "bits" tiles without a ring (86 KB)
    return 1


def pick_splits(batch: int, heads: int, max_len: int, tiles: LatentTiles, sms: int,
                widened: bool = False) -> int:
    """Splits of the context so that batch x head blocks x splits programs about fill the SMs
    once (programs_per_sm of them each; widened: fp8 pages, which the kernel widens in
    registers), each split >= MIN_SPLIT_TOKENS."""
    programs = batch * triton.cdiv(heads, tiles.block_h) * tiles.v_split
    per_sm = programs_per_sm(tiles, widened)
    want = max(1, round(sms * per_sm / programs))
    return max(1, min(want, triton.cdiv(max_len, MIN_SPLIT_TOKENS),
                      triton.cdiv(max_len, tiles.block_n), MAX_SPLITS))


def pick_launch(heads: int, r: int, batch: int, max_len: int, sms: int,
                widened: bool = False, q_fp32: bool = False) -> tuple[LatentTiles, int]:
    """The launcher's whole rule: (tiles, splits) for a step of `batch` sequences over block
    tables of `max_len` tokens, `heads` query heads, latent width r, on `sms` SMs; widened:
    fp8 latent pages; q_fp32: fp32 queries (pick_tiles, then pick_splits)."""
    tiles = pick_tiles(heads, r, widened, batch, sms, q_fp32)
    return tiles, pick_splits(batch, heads, max_len, tiles, sms, widened)


@triton.jit
def _widen(x, cvt: tl.constexpr):
    # fp8 pairs -> fp16 pairs, the same values as x.to(tl.float16). Not pure on purpose:
    # Triton then cannot move it past the tile's store to shared memory into each dot's
    # operand load (where it would widen the tile twice, in registers, and keep the fp8
    # load out of the cp.async ring)
    return tl.inline_asm_elementwise(cvt + " $0, $1;", "=r,h", [x], dtype=tl.float16,
                                     is_pure=False, pack=2)


@triton.jit
def _widen4(x, asm: tl.constexpr):
    # widen "bits": 4 fp8 codes (one 32-bit register) -> 4 fp16 by integer operations
    # (_BITS), not pure for the same reason as _widen
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=tl.float16, is_pure=False,
                                     pack=4)


@triton.jit
def _widen_bits_tl(x, E5M2: tl.constexpr):
    # widen "bits" where no PTX runs (the interpreter): the same integer operations as _BITS
    # on the same codes, in Triton. e4m3: sign to fp16 bit 15, the low 7 bits to bits 7..13
    # (value x 2^-8, exact, subnormals included); e5m2: the code is fp16's high byte
    u = x.to(tl.uint8, bitcast=True).to(tl.uint16)
    if E5M2:
        b = u << 8
    else:
        b = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
    return b.to(tl.float16, bitcast=True)


@triton.jit
def _latent_once_kernel(QL, CD, CS, RD, RS, BT, SL, OUT, ACC, ML, stride_qb, stride_qh,
                        stride_bt, H, num_splits, tiles_per_split, qk_scale, R: tl.constexpr,
                        DR: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_N: tl.constexpr, OUT_T: tl.constexpr, C_SCALED: tl.constexpr,
                        R_SCALED: tl.constexpr, DT: tl.constexpr, DT_R: tl.constexpr,
                        Q_SHIFT: tl.constexpr, DIRECT: tl.constexpr,
                        WIDEN_ASM: tl.constexpr = "", WIDEN_BITS: tl.constexpr = "",
                        C_MUL: tl.constexpr = 1.0, BT_AHEAD: tl.constexpr = False,
                        ROPE_AHEAD: tl.constexpr = False, KMASK=None, n_kmask=0,
                        HAS_KMASK: tl.constexpr = False, SCORES=None, scores_len=0,
                        WRITE_SCORES: tl.constexpr = False):
    # DT: the latent dots' dtype, DT_R the rotary one's. fp8 pages under bf16 queries take
    # fp16 (e4m3x2 -> f16x2 is one instruction; bf16 would add one cvt per element), and the
    # query is multiplied by Q_SHIFT (2^-8, exact) so that any bf16-range query up to 2^24
    # fits fp16; the scores take 1 / Q_SHIFT back. WIDEN_ASM (widen "tile", CUDA): the PTX
    # conversion that widens each loaded fp8 latent tile once (_widen), else .to(DT).
    # WIDEN_BITS (widen "bits"): "asm" widens by _widen4's integer PTX, "e4m3" / "e5m2" by
    # the same operations in Triton (the interpreter); the tile is then the latent times
    # 1 / C_MUL (2^-8 for e4m3), which the score rows' page scale and the accumulator's
    # store take back.
    # Scores transposed, s^T = [c, k_rope] . q^T: tokens are the M of the dot, and with
    # BLOCK_N == 16 x num_warps Triton's layout for a dot that feeds another (all warps
    # along M) gives each warp its own 16 tokens, so each score is computed once (with heads
    # as M, 64 heads fill only one warpgroup's M and the other recomputes them). The latent
    # is handled in two column halves (two loads, two accumulators): the registers that
    # widen a tile before it is stored for the dots are half as many (sm_90, r 512, 64 heads:
    # stack 104 -> 32 B for bf16 pages, 1128 -> 648 B for fp8)
    RH: tl.constexpr = R // 2
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    rh = tl.arange(0, RH)
    dd = tl.arange(0, DR)
    t = tl.arange(0, BLOCK_N)
    q_col = QL + b * stride_qb + h[None, :] * stride_qh                       # [1, BLOCK_H]
    q0T = tl.load(q_col + rh[:, None], mask=h_ok[None, :], other=0.0)            # [RH, BH]
    q1T = tl.load(q_col + RH + rh[:, None], mask=h_ok[None, :], other=0.0)       # [RH, BH]
    q_rT = tl.load(q_col + R + dd[:, None], mask=h_ok[None, :], other=0.0)       # [DR, BH]
    q0T = (q0T.to(tl.float32) * Q_SHIFT).to(DT)
    q1T = (q1T.to(tl.float32) * Q_SHIFT).to(DT)
    q_rT = (q_rT.to(tl.float32) * Q_SHIFT).to(DT_R)
    qk_scale = qk_scale / Q_SHIFT
    L = tl.load(SL + b)
    n_lo = split * tiles_per_split * BLOCK_N
    n_hi = tl.minimum(n_lo + tiles_per_split * BLOCK_N, L)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if OUT_T:
        acc0 = tl.zeros([RH, BLOCK_H], tl.float32)
        acc1 = tl.zeros([RH, BLOCK_H], tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_H, RH], tl.float32)
        acc1 = tl.zeros([BLOCK_H, RH], tl.float32)
    bt_row = BT + b * stride_bt
    # variants (LatentTiles.ahead, benchmark only until the H200 times them): BT_AHEAD loads
    # each tile's block-table entries one iteration earlier, by a plain load whose result
    # waits in registers (loop-carried), so the tile's address depends on no load of its own
    # iteration and the pipeliner gives the tile load the first stage (else the entries are
    # a stage of their own, and with 3 stages the tile is issued after the previous tile's
    # dots and waited for at the top of the next iteration: no overlap, RESULTS.md mla22h).
    # ROPE_AHEAD (with BT_AHEAD) also loads the rotary key one tile ahead into registers,
    # outside the cp.async ring, which leaves bf16 pages room for a 3-deep latent ring (its
    # address waits on the next tile's block-table entries, loaded just before: with the
    # entries two tiles ahead, a chain of loop-carried values, Triton 3.9 pipelined nothing).
    page_nx = tl.zeros([BLOCK_N], tl.int32)
    kr_nx = tl.zeros([BLOCK_N, DR], RD.dtype.element_ty)
    if BT_AHEAD:
        page_nx = tl.load(bt_row + (n_lo + t) // P, mask=n_lo + t < n_hi, other=0)
        if ROPE_AHEAD:
            tok0 = page_nx.to(tl.int64) * P + ((n_lo + t) % P)
            kr_nx = tl.load(RD + tok0[:, None] * DR + dd[None, :],
                            mask=(n_lo + t < n_hi)[:, None], other=0.0)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        j = n0 + t                                                            # token ids
        ok = j < n_hi
        if HAS_KMASK:   # key_mask[b, j] False hides key j (j >= n_kmask: seen)
            km = tl.load(KMASK + b * n_kmask + j, mask=ok & (j < n_kmask), other=1)
            ok = ok & (km != 0)
        if BT_AHEAD:
            page = page_nx.to(tl.int64)
            page_nx = tl.load(bt_row + (j + BLOCK_N) // P, mask=j + BLOCK_N < n_hi, other=0)
        else:
            page = tl.load(bt_row + j // P, mask=ok, other=0).to(tl.int64)
        tok = page * P + (j % P)                                              # [BLOCK_N]
        # one load and one widening per element; the tile feeds both dots
        row = CD + tok[:, None] * R + rh[None, :]
        if WIDEN_BITS == "asm":
            c0 = _widen4(tl.load(row, mask=ok[:, None], other=0.0), WIDEN_ASM)
            c1 = _widen4(tl.load(row + RH, mask=ok[:, None], other=0.0), WIDEN_ASM)
        elif WIDEN_BITS != "":
            c0 = _widen_bits_tl(tl.load(row, mask=ok[:, None], other=0.0),
                                WIDEN_BITS == "e5m2")
            c1 = _widen_bits_tl(tl.load(row + RH, mask=ok[:, None], other=0.0),
                                WIDEN_BITS == "e5m2")
        elif WIDEN_ASM != "":
            c0 = _widen(tl.load(row, mask=ok[:, None], other=0.0), WIDEN_ASM)
            c1 = _widen(tl.load(row + RH, mask=ok[:, None], other=0.0), WIDEN_ASM)
        else:
            c0 = tl.load(row, mask=ok[:, None], other=0.0).to(DT)            # [BLOCK_N, RH]
            c1 = tl.load(row + RH, mask=ok[:, None], other=0.0).to(DT)       # [BLOCK_N, RH]
        if ROPE_AHEAD:
            # variant: the rotary key of this tile was loaded one iteration earlier into
            # registers (loop-carried, outside the cp.async ring), which frees the ring's
            # rotary slots: bf16 pages then fit a 3-deep latent ring
            kr = kr_nx.to(DT_R)
            jn = j + BLOCK_N
            tok_nx = page_nx.to(tl.int64) * P + (jn % P)   # the next tile's, loaded earlier
            kr_nx = tl.load(RD + tok_nx[:, None] * DR + dd[None, :],
                            mask=(jn < n_hi)[:, None], other=0.0)
        else:
            kr = tl.load(RD + tok[:, None] * DR + dd[None, :], mask=ok[:, None],
                         other=0.0).to(DT_R)                                  # [BLOCK_N, DR]
        if C_SCALED:
            cs = tl.load(CS + page, mask=ok, other=0.0)                       # [BLOCK_N]
            s_r = tl.dot(kr, q_rT)
            if R_SCALED:
                s_r = s_r * tl.load(RS + page, mask=ok, other=0.0)[:, None]
            sT = (tl.dot(c1, q1T, tl.dot(c0, q0T)) * (cs * C_MUL)[:, None] + s_r) * qk_scale
        elif R_SCALED:
            rs = tl.load(RS + page, mask=ok, other=0.0)
            sT = (tl.dot(c1, q1T, tl.dot(c0, q0T)) + tl.dot(kr, q_rT) * rs[:, None]) * qk_scale
        else:
            sT = tl.dot(kr, q_rT, tl.dot(c1, q1T, tl.dot(c0, q0T))) * qk_scale  # [BLOCK_N, BH]
        sT = tl.where(ok[:, None], sT, float("-inf"))
        if WRITE_SCORES:   # H2O: each key's score (log2 units) for attn_mass, keys < scores_len
            s_dst = SCORES + (b * H + h[None, :]).to(tl.int64) * scores_len + j[:, None]
            tl.store(s_dst, sT, mask=(ok & (j < scores_len))[:, None] & h_ok[None, :])
        m_new = tl.maximum(m_i, tl.max(sT, 0))     # finite: every tile has a token below n_hi
        m_use = m_new
        if HAS_KMASK:   # ... unless the key mask hid every key so far: m stays -inf, and the
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)   # exponents take 0 (no NaN)
        alpha = tl.math.exp2(m_i - m_use)
        pT = tl.math.exp2(sT - m_use[None, :])                                # [BLOCK_N, BH]
        l_i = l_i * alpha + tl.sum(pT, 0)
        if C_SCALED:
            pT = pT * cs[:, None]
        if OUT_T:                                                             # [RH, BH] each
            acc0 = tl.dot(tl.trans(c0), pT.to(DT), acc0 * alpha[None, :])
            acc1 = tl.dot(tl.trans(c1), pT.to(DT), acc1 * alpha[None, :])
        else:                                                                 # [BH, RH] each
            p = tl.trans(pT.to(DT))
            acc0 = tl.dot(p, c0, acc0 * alpha[:, None])
            acc1 = tl.dot(p, c1, acc1 * alpha[:, None])
        m_i = m_new
    if OUT_T:
        acc0 = tl.trans(acc0)
        acc1 = tl.trans(acc1)
    if C_MUL != 1.0:   # the widened tile's 2^-8 (widen "bits"), once an output element
        acc0 = acc0 * C_MUL
        acc1 = acc1 * C_MUL
    if DIRECT:
        inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o_row = OUT + (b * H + h)[:, None] * R + rh[None, :]
        tl.store(o_row, acc0 * inv[:, None], mask=h_ok[:, None])
        tl.store(o_row + RH, acc1 * inv[:, None], mask=h_ok[:, None])
        if WRITE_SCORES:   # (max, sum) for the scores' lse (`_scores_mass`)
            tl.store(ML + (b * H + h) * 2, m_i, mask=h_ok)
            tl.store(ML + (b * H + h) * 2 + 1, l_i, mask=h_ok)
    else:
        row = (b * num_splits + split) * H + h
        a_row = ACC + row[:, None] * R + rh[None, :]
        tl.store(a_row, acc0, mask=h_ok[:, None])
        tl.store(a_row + RH, acc1, mask=h_ok[:, None])
        tl.store(ML + row * 2, m_i, mask=h_ok)
        tl.store(ML + row * 2 + 1, l_i, mask=h_ok)


@triton.jit
def _latent_merge_kernel(ACC, ML, OUT, H, num_splits, R: tl.constexpr, BLOCK_H: tl.constexpr):
    # the splits' (acc, max m, sum l) of one block of heads -> their normalized sum
    hb = tl.program_id(0)
    b = tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    rr = tl.arange(0, R)
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        row = (b * num_splits + s) * H + h
        top = tl.maximum(top, tl.load(ML + row * 2, mask=h_ok, other=float("-inf")))
    den = tl.zeros([BLOCK_H], tl.float32)
    out = tl.zeros([BLOCK_H, R], tl.float32)
    for s in range(0, num_splits):
        row = (b * num_splits + s) * H + h
        m = tl.load(ML + row * 2, mask=h_ok, other=float("-inf"))
        w = tl.where(m > float("-inf"), tl.math.exp2(m - top), 0.0)   # empty splits weigh 0
        den += w * tl.load(ML + row * 2 + 1, mask=h_ok, other=0.0)
        a = tl.load(ACC + row[:, None] * R + rr[None, :], mask=h_ok[:, None], other=0.0)
        out += w[:, None] * a
    inv = tl.where(den > 0, 1.0 / den, 0.0)
    tl.store(OUT + (b * H + h)[:, None] * R + rr[None, :], out * inv[:, None],
             mask=h_ok[:, None])


@triton.jit
def _latent_merge_once_kernel(ACC, ML, OUT, H, num_splits, R: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                              BLOCK_R: tl.constexpr):
    # _latent_merge_kernel's sum with every split's (max, sum) and partial output loaded at once
    # ([BLOCK_S, BLOCK_H, BLOCK_R], one round trip to memory instead of one a split) and the
    # latent columns spread over programs (axis 2): at B16 x 8 splits, 128 programs, not 16
    hb = tl.program_id(0)
    b = tl.program_id(1)
    rb = tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.arange(0, BLOCK_S)
    ok = (s[:, None] < num_splits) & (h[None, :] < H)
    row = (b * num_splits + s[:, None]) * H + h[None, :]
    m = tl.load(ML + row * 2, mask=ok, other=float("-inf"))
    lsum = tl.load(ML + row * 2 + 1, mask=ok, other=0.0)
    top = tl.max(m, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)
    w = tl.where(m > float("-inf"), tl.math.exp2(m - top[None, :]), 0.0)   # empty splits: 0
    den = tl.sum(w * lsum, axis=0)
    rr = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    a = tl.load(ACC + row[:, :, None] * R + rr[None, None, :], mask=ok[:, :, None], other=0.0)
    out = tl.sum(w[:, :, None] * a, axis=0)
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(OUT + (b * H + h)[:, None] * R + rr[None, :], out * inv[:, None],
             mask=(h < H)[:, None])


MERGE = "once"   # "once" (_latent_merge_once_kernel) or "loop" (_latent_merge_kernel, before)


def merge_launch(acc, ml, out, num_splits: int) -> None:
    """out [B, H, R] = the splits' normalized sum (acc [B, S, H, R], ml [B, S, H, 2], log2
    units), one launch. "once": every split in one load, R over programs (at most 8,192
    partial values a program: 64 registers a thread at 4 warps)."""
    B, H, R = out.shape
    bh = 16
    if MERGE == "loop":
        _latent_merge_kernel[(triton.cdiv(H, bh), B)](acc, ml, out, H, num_splits, R=R,
                                                       BLOCK_H=bh, num_warps=4)
        return
    bs = triton.next_power_of_2(num_splits)
    br = min(R, max(16, 8192 // (bs * bh)))
    _latent_merge_once_kernel[(triton.cdiv(H, bh), B, triton.cdiv(R, br))](
        acc, ml, out, H, num_splits, R=R, BLOCK_H=bh, BLOCK_S=bs, BLOCK_R=br,
        num_warps=4 if bs * bh * br <= 8192 else 8)


def fast_path_reason(q_lat, c_pages, r_pages) -> str:
    """'' when the kernel takes these pages, else why not."""
    for name, pg in (("latent", c_pages), ("rotary key", r_pages)):
        fmt = pg.fmt
        if fmt.residual or not (fmt.name in _UNSCALED or fmt.name in _PAGE_SCALED
                                and fmt.granularity == "page"):
            return f"{name} pages {fmt.name}/{fmt.granularity} (the kernel reads bf16 / fp16 / " \
                   f"fp32, or fp8 with page scales)"
        if pg.num_heads != 1:
            return f"{name} pages hold {pg.num_heads} heads, not one latent head"
        d = pg.head_dim
        if d < 16 or d & (d - 1):
            return f"{name} width {d} is not a power of two >= 16"
    if c_pages.page_size & (c_pages.page_size - 1):
        return f"page size {c_pages.page_size} is not a power of two"
    return ""


def _check(q_lat, c_pages, r_pages, block_tables, seq_lens):
    """The launcher's contract; each failure names the fix."""
    why = fast_path_reason(q_lat, c_pages, r_pages)
    if why:
        raise UnsupportedShapeError(f"latent_decode_attention: {why}")
    if not isinstance(q_lat, torch.Tensor) or q_lat.dim() != 3 or q_lat.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        raise UnsupportedShapeError("latent_decode_attention: q_lat must be a bf16 / fp16 / "
                                    "fp32 tensor [B, H, r + dr]")
    B, H, W = q_lat.shape
    R, DR = c_pages.head_dim, r_pages.head_dim
    if W != R + DR:
        raise UnsupportedShapeError(f"latent_decode_attention: q_lat width {W} != latent {R} + "
                                    f"rotary {DR}; pass the absorbed query (kernels/latent.py "
                                    f"absorb_query)")
    N, P = c_pages.num_pages, c_pages.page_size
    for name, pg, d in (("latent", c_pages, R), ("rotary key", r_pages, DR)):
        if tuple(pg.data.shape) != (N, 1, P, d) or not pg.data.is_contiguous():
            raise UnsupportedShapeError(f"latent_decode_attention: {name} pages must be "
                                        f"contiguous [{N}, 1, {P}, {d}], got "
                                        f"{tuple(pg.data.shape)}")
        if pg.fmt.is_quantized and (pg.scale.dtype != torch.float32 or pg.scale.numel() != N
                                    or not pg.scale.is_contiguous()):
            raise UnsupportedShapeError(f"latent_decode_attention: {name} page scales must be "
                                        f"contiguous fp32, one per page ({N})")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or \
            block_tables.shape[0] != B or block_tables.stride(1) != 1:
        raise UnsupportedShapeError(f"latent_decode_attention: block_tables must be int32 "
                                    f"[{B}, max_pages] with unit stride; got "
                                    f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (B,):
        raise UnsupportedShapeError(f"latent_decode_attention: seq_lens must be int32 [{B}], "
                                    f"got {seq_lens.dtype} {tuple(seq_lens.shape)}")


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4   # the interpreter: a few splits, so that CPU tests take the merge
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def _dot_dtype(q_dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float16: tl.float16}.get(q_dtype, tl.bfloat16)


_Q_SHIFT = 2.0 ** -8
_CVT = {"fp8_e4m3": "cvt.rn.f16x2.e4m3x2", "fp8_e5m2": "cvt.rn.f16x2.e5m2x2"}
# widen "bits": 4 codes in $2 -> fp16 pairs $0 (codes 0, 1), $1 (codes 2, 3). prmt puts each
# code in the high byte of a 16-bit lane (low byte 0); e5m2 is then fp16 itself. e4m3: a
# shift by one puts the code at bits 7..14 of its lane, and adding the lane's bit 14 (the
# sign) to itself moves it to bit 15 (no carry leaves the lane): value x 2^-8
_BITS = {
    "fp8_e4m3": "{ .reg .b32 a, b, c, d; prmt.b32 a, $2, 0, 0x1404; prmt.b32 b, $2, 0, 0x3424; "
                "shr.b32 a, a, 1; shr.b32 b, b, 1; and.b32 c, a, 0x40004000; "
                "and.b32 d, b, 0x40004000; add.u32 $0, a, c; add.u32 $1, b, d; }",
    "fp8_e5m2": "prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;",
}
_BITS_MUL = {"fp8_e4m3": 256.0, "fp8_e5m2": 1.0}


def _fp8_dots(dt, c_fmt: str, r_fmt: str) -> dict:
    """The once kernel's dot dtypes: fp16 for fp8 pages under bf16 queries (one conversion
    per fp8 pair, see the kernel), with the query shifted by 2^-8; else the query's."""
    fp8_c = c_fmt in _PAGE_SCALED and dt == tl.bfloat16
    fp8_r = r_fmt in _PAGE_SCALED and dt == tl.bfloat16
    return dict(DT=tl.float16 if fp8_c else dt, DT_R=tl.float16 if fp8_r else dt,
                Q_SHIFT=_Q_SHIFT if fp8_c or fp8_r else 1.0)


def launch_constexprs(tiles: LatentTiles, q_dtype: torch.dtype, c_fmt: str, r_fmt: str,
                      R: int, DR: int, P: int, direct: bool, cuda: bool = True):
    """(kernel, its constexprs and launch options) for these tiles over latent pages of
    format c_fmt and rotary pages of r_fmt (format names) under q_dtype queries: what the
    launcher passes, and what tests/kernels/test_latent_decode_sm90.py compiles. cuda=False:
    the interpreter's form (no inline PTX)."""
    dt = _dot_dtype(q_dtype)
    c_scaled, r_scaled = c_fmt in _PAGE_SCALED, r_fmt in _PAGE_SCALED
    consts = dict(R=R, DR=DR, P=P, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
                  C_SCALED=c_scaled, R_SCALED=r_scaled, DT=dt, DIRECT=direct,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if tiles.layout == "heads":
        return _latent_tile_kernel, dict(consts, V_SPLIT=tiles.v_split)
    consts.update(_fp8_dots(dt, c_fmt, r_fmt))
    # the interpreter runs no inline PTX: there widen "tile" is .to(fp16), the same values
    cvt = _CVT.get(c_fmt) if (tiles.widen == "tile" and cuda and
                              consts["DT"] == tl.float16) else None
    if tiles.widen == "bits":
        if consts["DT"] != tl.float16:
            raise UnsupportedShapeError(f"latent_decode_attention: tiles {tiles} widen "
                                        f"fp8 codes to fp16, which {q_dtype} queries do "
                                        f"not take (bf16 queries do); pass tiles=None")
        consts.update(WIDEN_BITS="asm" if cuda else c_fmt[-4:], C_MUL=_BITS_MUL[c_fmt])
        cvt = _BITS[c_fmt] if cuda else None
    consts.update(OUT_T=tiles.layout == "once_t", WIDEN_ASM=cvt or "",
                  BT_AHEAD=tiles.ahead != "", ROPE_AHEAD=tiles.ahead == "rope")
    return _latent_once_kernel, consts


def check_key_mask(key_mask, q_lat, who: str) -> None:
    """Raises UnsupportedShapeError unless key_mask is None or a bool [B, L] tensor on the
    query's device (the latent kernels' key mask)."""
    if key_mask is not None and (not isinstance(key_mask, torch.Tensor)
                                 or key_mask.dtype != torch.bool or key_mask.dim() != 2
                                 or key_mask.shape[0] != q_lat.shape[0]
                                 or key_mask.device != q_lat.device):
        raise UnsupportedShapeError(f"{who}: key_mask must be a bool tensor "
                                    f"[{q_lat.shape[0]}, L] on {q_lat.device}; got "
                                    f"{getattr(key_mask, 'dtype', type(key_mask))} "
                                    f"{tuple(getattr(key_mask, 'shape', ()))}")


def check_mass(attn_mass, q_lat, who: str) -> int:
    """attn_mass' width (0 for None); raises UnsupportedShapeError unless it is None or a
    contiguous fp32 [B, 1, L] tensor on the query's device (H2O's mass, one latent head)."""
    if attn_mass is None:
        return 0
    if (not isinstance(attn_mass, torch.Tensor) or attn_mass.dtype != torch.float32
            or attn_mass.dim() != 3 or tuple(attn_mass.shape[:2]) != (q_lat.shape[0], 1)
            or not attn_mass.is_contiguous() or attn_mass.device != q_lat.device):
        raise UnsupportedShapeError(f"{who}: attn_mass must be contiguous "
                                    f"fp32 [{q_lat.shape[0]}, 1, L] on {q_lat.device} (one "
                                    f"latent head); got {getattr(attn_mass, 'dtype', None)} "
                                    f"{tuple(getattr(attn_mass, 'shape', ()))}")
    return attn_mass.shape[2]


def latent_decode_attention(q_lat, c_pages, r_pages, block_tables, seq_lens, scale: float,
                            num_splits: int | None = None,
                            tiles: LatentTiles | None = None,
                            key_mask: torch.Tensor | None = None,
                            attn_mass: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. q_lat [B, H, r + dr] -> [B, H, r] fp32.
    num_splits / tiles: None picks them (pick_splits / pick_tiles); tests and benchmarks
    pass them to run one configuration. key_mask: bool [B, Lm], key j seen iff
    key_mask[b, j] (j >= Lm: seen), as paged_decode_attention takes it (left padding, an
    HF decode step's mask); a row whose keys are all hidden gets zeros.
    attn_mass: fp32 [B, 1, Lm] (H2O; the one latent head), += each key j < Lm's attention
    probability summed over the H query heads, as paged_decode_attention's: the kernel
    writes its scores (log2 units, [B, H, Lm]) and each split's (max, sum) as it attends,
    then one small kernel (decode_kernels.attn_mass_kernel) turns them into probabilities
    under each head's final lse. No second pass over the pages."""
    _check(q_lat, c_pages, r_pages, block_tables, seq_lens)
    check_mass(attn_mass, q_lat, "latent_decode_attention")
    check_key_mask(key_mask, q_lat, "latent_decode_attention")
    B, H, _ = q_lat.shape
    R, DR, P = c_pages.head_dim, r_pages.head_dim, c_pages.page_size
    widened = c_pages.fmt.name in _PAGE_SCALED
    max_len = block_tables.shape[1] * P
    if tiles is None:   # the rule (pick_launch), its splits unless num_splits is given
        tiles, rule_splits = pick_launch(H, R, B, max_len, sm_count(q_lat.device), widened,
                                         q_fp32=q_lat.dtype == torch.float32)
        num_splits = rule_splits if num_splits is None else num_splits
    if tiles.ahead and q_lat.device.type == "cuda":
        raise UnsupportedShapeError(
            f"latent_decode_attention: tiles {tiles} (a prefetch variant) faulted on the H200 "
            f"(triton 3.6: illegal memory access, 2026-12-04) and run only under the CPU "
            f"interpreter until fixed; pass tiles=None or a tile without ahead=")
    if tiles.widen != "dot" and not widened:
        raise UnsupportedShapeError(f"latent_decode_attention: tiles {tiles} widen fp8 "
                                    f"latent pages; these are {c_pages.fmt.name}: pass "
                                    f"tiles=None or a widen 'dot' tile")
    if num_splits is None:
        num_splits = pick_splits(B, H, max_len, tiles, sm_count(q_lat.device), widened)
    if num_splits < 1:
        raise UnsupportedShapeError(f"latent_decode_attention: num_splits={num_splits}; use "
                                    f">= 1 or None")
    n_tiles = max(1, triton.cdiv(max_len, tiles.block_n))
    tiles_per_split = triton.cdiv(n_tiles, num_splits)
    q = q_lat if q_lat.stride(2) == 1 else q_lat.contiguous()
    out = torch.empty((B, H, R), dtype=torch.float32, device=q.device)
    direct = num_splits == 1
    if direct:
        acc = ml = out   # not read: the kernel normalizes and writes out itself
        if attn_mass is not None:   # ... and its (max, sum) for the mass
            ml = torch.empty((B, 1, H, 2), dtype=torch.float32, device=q.device)
    else:
        acc = torch.empty((B, num_splits, H, R), dtype=torch.float32, device=q.device)
        ml = torch.empty((B, num_splits, H, 2), dtype=torch.float32, device=q.device)
    c_scaled, r_scaled = c_pages.fmt.is_quantized, r_pages.fmt.is_quantized
    dummy = out   # a valid pointer where a scale is not read
    if R // tiles.v_split < 16 or (tiles.layout != "heads" and R < 32):
        raise UnsupportedShapeError(f"latent_decode_attention: latent width {R} in halves "
                                    f"(layouts once / once_t) or split {tiles.v_split} ways "
                                    f"is under 16; use layout 'heads' with v_split 1")
    # the programs that read the same tiles (head blocks, value halves) are neighbours: L2
    scales = (c_pages.scale if c_scaled else dummy, r_pages.data,
              r_pages.scale if r_scaled else dummy)
    common = (block_tables, seq_lens, out, acc, ml, q.stride(0), q.stride(1),
              block_tables.stride(0), H, num_splits, tiles_per_split, float(scale) * _LOG2E)
    fn, consts = launch_constexprs(tiles, q.dtype, c_pages.fmt.name, r_pages.fmt.name, R, DR,
                                   P, direct, q.is_cuda)
    # the programs that read the same tiles (head blocks, value halves) are neighbours: L2
    grid = (triton.cdiv(H, tiles.block_h) * tiles.v_split, num_splits, B)
    if key_mask is not None:
        consts.update(KMASK=key_mask.contiguous().view(torch.uint8),
                      n_kmask=key_mask.shape[1], HAS_KMASK=True)
    scores = None
    if attn_mass is not None and attn_mass.shape[2] > 0:
        scores = torch.full((B, H, attn_mass.shape[2]), float("-inf"), dtype=torch.float32,
                            device=q.device)
        consts.update(SCORES=scores, scores_len=attn_mass.shape[2], WRITE_SCORES=True)
    fn[grid](q, c_pages.data, *scales, *common, **consts)
    if not direct:
        merge_launch(acc, ml, out, num_splits)
    if scores is not None:
        _scores_mass(scores, ml, attn_mass, seq_lens)
    return out


def _scores_mass(scores, ml, attn_mass, seq_lens) -> None:
    """attn_mass [B, 1, Lm] += sum over heads of 2^(score - lse): lse per (row, head) from the
    splits' (max, sum) in ml [B, S, H, 2] (log2 units; a head that saw no key: -inf, mass 0)."""
    B, H, Lm = scores.shape
    m, lsum = ml[..., 0], ml[..., 1]                                    # [B, S, H]
    top = m.amax(1)
    top = torch.where(top > float("-inf"), top, torch.zeros_like(top))
    den = (torch.exp2(m - top[:, None]) * lsum).sum(1)                  # [B, H]
    lse = (top + torch.log2(den)).reshape(-1).contiguous()
    blk = 256
    attn_mass_kernel[(B, triton.cdiv(Lm, blk))](scores, lse, attn_mass, seq_lens, Lm, 1, G=H,
                                                 SQ=1, BLOCK=blk, num_warps=4)


__all__ = ["AHEADS", "CANDIDATES", "FEW_PROGRAMS", "LAYOUTS", "PREFETCH_VARIANTS",
           "SWEEP_CANDIDATES", "WIDENS",
           "LatentTiles", "check_key_mask", "check_mass", "fast_path_reason",
           "latent_decode_attention", "launch_constexprs",
           "merge_launch",
           "pick_launch", "pick_splits", "pick_tiles", "programs_per_sm"]
