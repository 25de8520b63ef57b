// Paged decode attention for Hopper (sm_90) and Ada (sm_89), below Triton's tile abstraction.
//
//   out[b, hq, i, :] = softmax_j(q[b, hq, i] . k[b, j] * scale) @ v[b, j]    over stored pages
//
// One CTA of 4 warps owns (sequence b, kv head h, split). The split's keys are cut into steps of
// 16 tokens; warp w takes steps w, w + 4, ... and runs its own online softmax over them (no
// barrier in the main loop). Each warp streams its steps through a private ring of NS shared-
// memory stages filled by cp.async (page ids from the block table, 16-byte copies, zero-filled
// past the sequence's end), so several steps' bytes are in flight per warp while it computes.
//
// Tensor cores via mma.sync m16n8k16 (f32 accumulators), query rows as M (the G = Hq / Hkv heads
// of the group times Sq queries, padded to 8 or 16), tokens as N for q.k and as K for p.v:
//   S[16 x 16 tokens] = Q[16 x D] K^T      two n-tiles of 8 tokens, D / 16 k-steps
//   O[16 x DV]       += P[16 x 16] V       P reused from S's accumulators (FA2 register reuse)
// Layouts are chosen so that every fragment comes from contiguous bytes:
//   - q.k sums over d, so d is permuted: thread t of a quad owns 16-byte chunks t, t + 4, ... of
//     each key row, and k-step s reads 4 consecutive elements of them (Q is permuted alike);
//   - p.v's output columns are permuted: thread g (of 8) owns chunks g, g + 8, ... of each value
//     row, n-tile nb's column g is element nb of them; the pairs of tokens a k-register needs are
//     interleaved with one byte_perm (fp8) or half-word perm (16-bit) per 4 or 2 elements.
// FP8 codes widen to f16 with one cvt.rn.f16x2.e4m3x2 / e5m2x2 per two values (sm_89+); block
// scales fold into the scores (keys) and the probabilities (values), one multiply per token.
// Shared-memory rows are XOR-swizzled in 16-byte chunks (see swz) so that fragment loads are
// free of bank conflicts.
//
// Opt-in variant Q8 (e4m3 keys only; the launcher's qk_fp8, default off): q.k on FP8 tensor
// cores, mma.sync m16n8k32 e4m3 x e4m3 -> f32, the key codes straight from shared memory as the
// B operand (no cvt on K). q is quantized once per CTA: each query row r gets a power-of-two
// scale sq_r = 2^(e_r - 8), e_r = frexp exponent of max_d |q[r, d]| (so |q / sq_r| < 256 <= 448,
// and the division is exact: the only rounding is e4m3's round-to-nearest-even), folded into
// the row's score multiplier (qk_scale * sq_r, and cap_in * sq_r under softcapping). A row with
// a NaN or infinite q gets sq_r = NaN (its output is NaN, as the reference's). The k32 layout
// reads 8 bytes per thread per k-step: k-step s = 2 i + h takes bytes 8 h .. 8 h + 7 of the
// thread's chunk t + 4 i (B registers: bytes 0-3 = k 4t..4t+3, bytes 4-7 = k 16+4t..16+4t+3),
// and q's A registers take the same d's. P.V stays on the f16 route.
// Only sm_89 / sm_120 run this MMA natively (SASS QMMA.16832): for sm_90 ptxas lowers it to F2FP
// unpacks of both operands plus two HMMA.16816, so on Hopper Q8 saves no cvt (Hopper's FP8
// tensor cores are reached through wgmma, target sm_90a; benchmarks/RESULTS.md, "qk_fp8").
//
// INT4 pages (KVC_INT4, cache/intq.py: x = code * scale + zero, fp16 scale and zero point,
// element 2i in a byte's low nibble), the Pareto table's "K int4/V int4" (benchmarks/RESULTS.md):
//   - keys, scale and zero point per (page, kv head, channel) (KVC_SC_CHANZP; pages of >= 16
//     tokens, so a step is one page): q.k = sum_d (q_d s_d) c_d + sum_d q_d z_d. Each step scales
//     q's A fragments by the page's channel scales (one f16x2 multiply per register, shared by
//     both n-tiles) and gets sum_d q_d z_d from one more n-tile of MMAs whose every column is the
//     zero points (exact f16 products, f32 sums: a large zero point keeps the codes' resolution,
//     which dequantizing keys to f16 would lose);
//   - values, scale and zero point per token (KVC_SC_TOKZP): the scale folds into p like fp8's
//     token scales, the zero points add sum_j p_j z_j to every column of a row (f32, per lane,
//     summed over the quad at the end);
//   - codes widen exactly: byte_perm puts two codes at bits 0-3 / 16-19, (y & 0x000F000F) |
//     0x64006400 is the f16x2 of 1024 + c, less 1024 (sub.f16x2). Thread t of a quad owns key
//     unit t (32 codes at D 128, 16 at D 64), k-step s reads 4 codes (2 bytes) of it.
// Built with -DKVC_EMU, the same source runs on the CPU (emu/cuda_emu.h, tested by
// tests/kernels/test_decode_sm90_emu.py): each inline-PTX helper below has its host version
// beside it, and nothing else differs.
#pragma once
#ifdef KVC_EMU
#include "emu/cuda_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#include <stdint.h>

struct DecodeParams {
  const void* q;            // [B, Hq, SQ, D]    f16 / bf16 / f32, contiguous
  const uint8_t* k;         // [N, H, P, D]      key codes (fp8) or elements (f16 / bf16)
  const uint8_t* v;         // [N, H, P, DV]
  const float* ks;          // key scales:   page [N, H] | token [N, H, P] | tensor [1]
  const float* vs;          // value scales: alike
  const int* bt;            // [B, stride_bt]    block tables
  const int* seq_lens;      // [B]               tokens stored, new ones included
  const uint8_t* kmask;     // [B, stride_km]    1 = key visible (its first n_km slots), or null
  void* out;                // [B, Hq, SQ, DV]   q's dtype (written when direct)
  float* acc;               // [B*Hq*SQ, S, DV]  normalized partial outputs (splits)
  float* lse;               // [B*Hq*SQ, S]      log2-sum-exp of each split
  long long stride_bt;
  long long stride_km;
  int H, G, SQ, num_splits, log2p, window, sinks, direct;
  float qk_scale;           // scale * log2(e)
  float cap_in;             // softcap: s = cap_out * tanh(cap_in * q.k), 0 = none
  float cap_out;
  int n_km;                 // key-mask columns (a multiple of 16): slots past them are seen
  const uint16_t* kz;       // int4 keys: fp16 zero points [N, H, D] (ks: fp16 scales alike)
  const uint16_t* vz;       // int4 values: fp16 zero points [N, H, P] (vs: fp16 scales alike)
};

// element kinds
#define KVC_E4M3 0
#define KVC_E5M2 1
#define KVC_F16 2
#define KVC_BF16 3
#define KVC_INT4 4  // asymmetric int4 (cache/intq.py): x = code * scale + zero, 2 codes a byte
// scale modes
#define KVC_SC_NONE 0
#define KVC_SC_PAGE 1
#define KVC_SC_TOKEN 2
#define KVC_SC_TENSOR 3
#define KVC_SC_CHANZP 4  // int4 keys: fp16 scale and zero point per (page, kv head, channel)
#define KVC_SC_TOKZP 5   // int4 values: fp16 scale and zero point per token

// ---- issue-14 variants (cuda14e): KVC_VAR, a bit set chosen by the launcher (decode_sm90.py
// VARIANTS); 0 (the default when the macro is absent) is the kernel as it was.
//   CAP_STATIC: softcapping decided at compile time (KVC_VAR_CAP_ON says whether it is on), so
//     the uncapped kernel issues no tanh (the runtime test `p.cap_out != 0` was if-converted by
//     ptxas: 8 MUFU.TANH + 16 FMUL + 8 selects a 16-token step, every step, capped or not);
//   ALU_K / ALU_V: fp8 keys / values widened to f16 by integer ops instead of F2FP (cvt
//     .f16x2.e4m3x2), see fp8x4_to_f16x2x2_alu; e4m3 comes out as x * 2^-8 and the 2^8 is
//     folded into the score multiplier (keys) or the probabilities (values).
#ifndef KVC_VAR
#define KVC_VAR 0
#endif
#define KVC_VAR_CAP_STATIC 1
#define KVC_VAR_CAP_ON 2
#define KVC_VAR_ALU_K 4
#define KVC_VAR_ALU_V 8
// issue-14 variants (cuda14g): the limiter is each warp's dependent chain (RESULTS.md), so
//   QK2: q.k of each n-tile in two accumulator chains (even / odd MMAs, summed after), half as
//     deep, for fp8 (F2FP or ALU widening) and 16-bit keys;
//   VOTE: the online softmax's max test without shuffles: each lane tests its own scores
//     against its rows' running max (+ 8), one vote; only when some score passes it (rare after
//     the first steps) do the quad shuffles run, as before;
//   PVT: P.V with the value columns as M (O^T[DV x rows] += V^T P^T, m16n8k16, the query rows
//     as N), fp8 values: the B operand is P exactly as q.k's accumulators hold it (row g, tokens
//     2t, 2t+1 | 2t+8, 2t+9), the A operand the same unpacked value pairs as before, two value
//     elements a MMA. At <= 8 query rows it takes DV / 16 MMAs a step instead of DV / 8 (no
//     padded M rows) and half the O registers (DV / 4 floats a lane instead of DV / 2); at 16
//     rows the same count. Lane (g, t) then holds O of rows 2t, 2t + 1 (+ 8): the rare max
//     rescale fetches their factors with __shfl_sync;
//   CTA4 / CTA5: no code change; the launcher builds with __launch_bounds__(128, 4) (<= 128
//     registers) or (128, 5) (<= 102, fp8 head_dim 64 only) and sizes the ring for that many
//     CTAs a SM (decode_sm90.kernel_constants);
//   HOIST: the cp.async addresses' lane-constant parts (each copy's shared offset in a stage and
//     byte offset in the page) computed once before the loop and pinned (pin: opaque to ptxas,
//     which otherwise rematerializes them every step: ~30 LOP3 / IMAD a step at pvt's 124
//     registers); a step adds them to two page bases.
#define KVC_VAR_QK2 16
#define KVC_VAR_VOTE 32
#define KVC_VAR_PVT 64
#define KVC_VAR_CTA4 128
#define KVC_VAR_HOIST 256
#define KVC_VAR_CTA5 512
// issue-14 variants for int4 pages (cuda14h):
//   I4N: int4 codes widen to f16 *subnormals* c * 2^-24 by one mask (no sub.f16x2 of 1024):
//     (y & 0x000F000F) is f16x2(c0 * 2^-24, c1 * 2^-24), exact, and f16 x f16 products are exact
//     in the MMA's f32 sums, so the 2^24 goes into the f32 score (keys) or O at the merge
//     (values). Keys: the two k-steps of a word feed two accumulator chains (as QK2). Values:
//     P.V transposed (PVT) for int4 values too: M-tile row g is element 2k of byte k (low
//     nibble, c * 2^-24), row g + 8 element 2k + 1 (high nibble masked in place, 16 c * 2^-24:
//     the 1/16 at the merge), so a token pair's byte k takes one prmt and four masks for one
//     MMA of 16 value columns (base: two prmt, two shifts, four masks, four sub.f16x2 for two
//     MMAs of 8 columns, at 8 query rows);
#define KVC_VAR_I4N 1024
//   PGZ (int4 keys): a warp takes runs of P / 16 consecutive steps (one page: 4 steps at P64)
//     instead of every 4th step, splits start on page boundaries, and the page's channel terms
//     (q times the channel scales, sum_d q_d z_d: 8 LDS.128 + 16 mul.f16x2 + 8 MMAs at D 128, 8
//     rows) are computed when a step's page differs from the warp's previous step's, i.e. once
//     a page instead of once a step.
#define KVC_VAR_PGZ 2048
//   SWQ (int4 keys and values with I4N, P.V transposed, 8 query rows): q.k with the tokens as M (A: the
//     key codes of tokens g and g + 8) and the query rows as N (B: q times the channel scales),
//     so no M row is padding: 8 MMAs a step at D 128 instead of 16, 4 exponentials a lane instead
//     of 8; the softmax runs on S^T (lane (g, t): rows 2t, 2t + 1, the same rows as O^T's, so a
//     rescale needs no shuffle), and movmatrix.trans turns P^T's two 8 x 8 blocks into P.V's B
//     fragments.
#define KVC_VAR_SWQ 4096
//   KPERM (with SWQ and PGZ, int4 keys): q is staged with each 8 elements in the order 0 4 2 6 1 5
//     3 7, the page's channel scales / zero points permuted alike (prmt, once a page), so a key
//     word x gives its k-pairs by masks alone: x & 0x000F000F = (e0, e4), (x >> 8) & .. = (e2,
//     e6) (x 1), x & 0x00F000F0 = (e1, e5), (x >> 8) & .. = (e3, e7) (x 16, the second chain,
//     / 16 in the score): 32 prmt a step fewer at D 128.
#define KVC_VAR_KPERM 8192
// issue-14 variant (twenty-sixth session), measured by Nsight Compute's stall samples: in the
// kernels above, issue() loaded a step's page id from the block table and used it at once to
// build the step's copy addresses, so every warp waited out a global load's latency once a step
// (once a page under PGZ): 29% of the fp8 kernel's stall samples (pvt4h, B16 L32k, H100), 36%
// of bf16's, 8% of int4's (pvt4sp).
//   BTPF: the page ids of the warp's next step (PGZ: of its next run's first step) are loaded
//     when the current step is issued, a step ahead, into registers; issue() takes them from
//     there (the first step of a warp, and a page change inside a run, still load). Measured:
//     the stall leaves the page id and the kernels run no faster (the SM's other warps had
//     hidden it; benchmarks/RESULTS.md, twenty-sixth session), so it stays opt-in.
#define KVC_VAR_BTPF 16384

namespace kvc {

constexpr int WARPS = 4;
constexpr int STEP = 16;  // tokens per step

__device__ __forceinline__ int swz(int row) {  // XOR of a row's 16-byte chunks (rows % 8)
  row &= 7;
  return ((row & 1) << 2) ^ (row & 6);
}

// x, opaque to the compiler (an empty asm): a value computed once stays in its register instead
// of being recomputed where it is used
__device__ __forceinline__ int pin(int x) {
#ifndef KVC_EMU
  asm volatile("" : "+r"(x));
#endif
  return x;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
#ifdef KVC_EMU
  kvc_emu::cp_async(dst, src, 16, src_bytes);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
#endif
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
#ifdef KVC_EMU
  kvc_emu::cp_async(dst, src, 4, src_bytes);
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
#endif
}

__device__ __forceinline__ void cp_commit() {
#ifdef KVC_EMU
  kvc_emu::cp_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_wait() {
#ifdef KVC_EMU
  kvc_emu::cp_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ uint4 lds128(const uint8_t* p) {
  uint4 r;
#ifdef KVC_EMU
  kvc_emu::ld_shared(smem_u32(p), &r, 16);
#else
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(smem_u32(p)));
#endif
  return r;
}

// Whether a step's 16 staged key-mask bytes (0 / 1 each) are all 1: such a step is read as an
// unmasked one. HF generate's decode steps pass an all-True key row (no padding), which would
// otherwise send every step through the per-token masking code.
__device__ __forceinline__ bool mask_step_all_seen(const uint8_t* km) {
  const uint4 w = lds128(km);
  return (w.x & w.y & w.z & w.w) == 0x01010101u;
}

__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
  uint32_t r;
#ifdef KVC_EMU
  kvc_emu::ld_shared(smem_u32(p), &r, 4);
#else
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(r) : "r"(smem_u32(p)));
#endif
  return r;
}

__device__ __forceinline__ uint2 lds64(const uint8_t* p) {
  uint2 r;
#ifdef KVC_EMU
  kvc_emu::ld_shared(smem_u32(p), &r, 8);
#else
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "r"(smem_u32(p)));
#endif
  return r;
}

// mma.sync m16n8k32 e4m3 x e4m3 -> f32 (sm_89+). Fragments (PTX ISA, "Matrix Fragments for
// mma.m16n8k32", 8-bit types; g = lane / 4, t = lane % 4; 4 codes per register, the lowest k in
// the lowest byte):
//   A (16 x 32, row): a[0] = row g, k 4t..4t+3;   a[1] = row g+8, k 4t..4t+3;
//                     a[2] = row g, k 16+4t..;    a[3] = row g+8, k 16+4t..
//   B (32 x 8, col):  b0 = col g, k 4t..4t+3;     b1 = col g, k 16+4t..16+4t+3
//   C, D: as m16n8k16 (c[0], c[1] = row g, cols 2t, 2t+1; c[2], c[3] = row g+8)
__device__ __forceinline__ void mma16832_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                              uint32_t b1) {
#ifdef KVC_EMU
  kvc_emu::mma_m16n8k32_e4m3(d, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// two f32 -> two e4m3 codes, round to nearest even, saturating to +-448 (NaN -> NaN code):
// `lo`'s code in the low byte (cvt.rn.satfinite.e4m3x2.f32 d, a, b puts a in the high byte)
__device__ __forceinline__ uint32_t f32x2_to_e4m3x2(float lo, float hi) {
#ifdef KVC_EMU
  return kvc_emu::f32_to_e4m3(lo) | (static_cast<uint32_t>(kvc_emu::f32_to_e4m3(hi)) << 8);
#else
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

__device__ __forceinline__ float pow2f(int e) {  // 2^e, exact, e in [-126, 127]
  return __int_as_float((e + 127) << 23);
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#ifdef KVC_EMU
  kvc_emu::mma_m16n8k16(d, a, b0, b1, BF16);
#else
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// two fp8 codes (low byte first) -> f16x2 (low half first)
template <int KIND>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t x16) {
  uint32_t r;
  const uint16_t h = static_cast<uint16_t>(x16);
#ifdef KVC_EMU
  // the low byte becomes the low half (cuda_fp8.hpp's __nv_cvt_fp8x2_to_halfraw2 fallback)
  auto one = [](uint8_t c) {
    return KIND == KVC_E5M2 ? kvc_emu::e5m2_to_f16(c) : kvc_emu::e4m3_to_f16(c);
  };
  r = one(h & 0xffu) | (static_cast<uint32_t>(one(h >> 8)) << 16);
#else
  if constexpr (KIND == KVC_E5M2) {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(r) : "h"(h));
  } else {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(h));
  }
#endif
  return r;
}

// prmt in its default mode with the sign flag: byte n of the result is byte s<4n+2:4n> of
// {y, x}, or, when bit 4n+3 is set, that byte's sign bit replicated (PTX ISA, prmt)
__device__ __forceinline__ uint32_t prmt_sx(uint32_t x, uint32_t y, uint32_t s) {
#ifdef KVC_EMU
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t sel = (s >> (4 * n)) & 15u;
    uint32_t b = static_cast<uint32_t>(v >> (8 * (sel & 7u))) & 0xffu;
    if (sel & 8u) b = (b & 0x80u) ? 0xffu : 0u;
    r |= b << (8 * n);
  }
  return r;
#else
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(x), "r"(y), "r"(s));
  return r;
#endif
}

// Two e4m3 codes a, b with their signs, x = [a, sign(a) x 8, b, sign(b) x 8] (prmt_sx) -> f16x2
// of (a, b) * 2^-8: the 7 exponent-mantissa bits to bits 13..7 (f16's exponent bias is 15,
// e4m3's 7: subnormals map to f16 subnormals, exact), a replicated sign bit to bit 15
__device__ __forceinline__ uint32_t e4m3x2_sx_to_f16x2(uint32_t x) {
  return (x << 7) & 0xbf80bf80u;
}

// Four fp8 codes z = [c0, c1, c2, c3] (c0 in the low byte) -> two f16x2 words by integer ops
// (no F2FP): ev = (c0, c2), od = (c1, c3), low half first. e5m2 is f16's top byte (exact,
// NaN / inf included). e4m3 lands as x * 2^-8 (e4m3x2_sx_to_f16x2); the caller multiplies by
// 2^8 elsewhere. e4m3's NaN code (0x7f / 0xff) reads as +-1.875 (* 2^8 = 480): these variants
// do not propagate NaN codes (the default kernel does).
template <int KIND>
__device__ __forceinline__ void fp8x4_to_f16x2x2_alu(uint32_t z, uint32_t& ev, uint32_t& od) {
  if constexpr (KIND == KVC_E5M2) {
    ev = __byte_perm(z, 0u, 0x2404);  // [0, c0, 0, c2]
    od = __byte_perm(z, 0u, 0x3414);  // [0, c1, 0, c3]
  } else {
    ev = e4m3x2_sx_to_f16x2(prmt_sx(z, 0u, 0xa280u));  // [c0, s0, c2, s2]
    od = e4m3x2_sx_to_f16x2(prmt_sx(z, 0u, 0xb391u));  // [c1, s1, c3, s3]
  }
}

// f16x2 a - b and a * b, round to nearest even (int4 pages: exact code widening, q * scale)
__device__ __forceinline__ uint32_t hsub2_u32(uint32_t a, uint32_t b) {
#ifdef KVC_EMU
  auto one = [](uint16_t x, uint16_t y) {  // one f32 subtraction of two f16, rounded once
    return kvc_emu::f32_to_f16(kvc_emu::f16_to_f32(x) - kvc_emu::f16_to_f32(y));
  };
  return one(a & 0xffffu, b & 0xffffu) | (static_cast<uint32_t>(one(a >> 16, b >> 16)) << 16);
#else
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
#endif
}

__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
#ifdef KVC_EMU
  auto one = [](uint16_t x, uint16_t y) {  // the f32 product of two f16 is exact
    return kvc_emu::f32_to_f16(kvc_emu::f16_to_f32(x) * kvc_emu::f16_to_f32(y));
  };
  return one(a & 0xffffu, b & 0xffffu) | (static_cast<uint32_t>(one(a >> 16, b >> 16)) << 16);
#else
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
#endif
}

// Two int4 codes at bits 0-3 and 16-19 of y (other bits ignored) -> f16x2 of the codes, exact:
// 0x6400 | c is the f16 of 1024 + c (f16 has 10 mantissa bits), less 1024 exactly.
__device__ __forceinline__ uint32_t int4x2_to_f16x2(uint32_t y) {
  return hsub2_u32((y & 0x000F000Fu) | 0x64006400u, 0x64006400u);
}

// The two codes of byte k of word x (element 2k in the low nibble) -> f16x2 (low half first):
// one byte_perm puts byte k of x at bits 0-7 and byte k of x >> 4 (its high nibble low) at 16-23.
// SUBN (the I4N variants): the codes as f16 subnormals c * 2^-24 instead (no subtraction).
template <int K, bool SUBN = false>
__device__ __forceinline__ uint32_t int4_byte_f16x2(uint32_t x, uint32_t x4) {
  const uint32_t y = __byte_perm(x, x4, K | (K << 4) | ((4 + K) << 8) | ((4 + K) << 12));
  if constexpr (SUBN) return y & 0x000F000Fu;
  return int4x2_to_f16x2(y);
}

__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) {
#ifdef KVC_EMU
  return kvc_emu::f16_to_f32(h);
#else
  return __half2float(__ushort_as_half(h));
#endif
}

template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// movmatrix.sync.aligned.m8n8.trans.b16: lane (g, t) holds row g, columns 2t, 2t + 1 of an 8 x 8
// b16 matrix (low half first); returns the same of its transpose (row g = the matrix's column g)
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x) {
#ifdef KVC_EMU
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // M^T[g][2t + e] = M[2t + e][g]: lane 4 (2t + e) + g / 2, half g & 1
  const uint32_t a = kvc_emu::f32_bits(__shfl_sync(0xffffffffu, kvc_emu::bits_f32(x), 8 * t + g / 2));
  const uint32_t b = kvc_emu::f32_bits(__shfl_sync(0xffffffffu, kvc_emu::bits_f32(x), 8 * t + 4 + g / 2));
  const int sh = 16 * (g & 1);
  return ((a >> sh) & 0xffffu) | (((b >> sh) & 0xffffu) << 16);
#else
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
#endif
}

template <int QT>
__device__ __forceinline__ float load_q(const void* q, long long i) {
  if constexpr (QT == 0) return __half2float(reinterpret_cast<const __half*>(q)[i]);
  else if constexpr (QT == 1) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(q)[i]);
  else return reinterpret_cast<const float*>(q)[i];
}

template <int QT>
__device__ __forceinline__ void store_o(void* o, long long i, float x) {
  if constexpr (QT == 0) reinterpret_cast<__half*>(o)[i] = __float2half_rn(x);
  else if constexpr (QT == 1) reinterpret_cast<__nv_bfloat16*>(o)[i] = __float2bfloat16_rn(x);
  else reinterpret_cast<float*>(o)[i] = x;
}

__device__ __forceinline__ uint32_t word(const uint4& w, int i) {
  return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}

// Kernel geometry for element kinds KK (keys) / VK (values), head dims D / DV, stages NS.
template <int KK, int VK, int D, int DV, int NS, int KSM, int VSM>
struct Geo {
  static constexpr bool KI4 = KK == KVC_INT4, VI4 = VK == KVC_INT4;
  static constexpr int KEB = KK >= KVC_F16 && !KI4 ? 2 : 1;   // bytes per element (int4: 1/2)
  static constexpr int VEB = VK >= KVC_F16 && !VI4 ? 2 : 1;
  static constexpr int RBK = KI4 ? D / 2 : D * KEB;     // bytes per token row
  static constexpr int RBV = VI4 ? DV / 2 : DV * VEB;
  static constexpr int NCK = RBK / 16, NCV = RBV / 16;  // 16-byte chunks per row
  // key elements per chunk (int4: per unit a thread reads, a chunk at D 128, 8 bytes at D 64)
  static constexpr int KEPC = KI4 ? (D >= 128 ? 32 : 16) : 16 / KEB;
  static constexpr int KPC = KEPC / 4;                  // k-steps per key chunk
  static constexpr int KS = D / 16;                     // k-steps of q.k
  // values: thread g owns units g + 8 i of VU bytes (a chunk, or half of one for 64-byte rows)
  static constexpr int VU = NCV >= 8 ? 16 : RBV / 8;
  static constexpr int VUN = RBV / (8 * VU);            // units per thread per row
  static constexpr int VEPU = VI4 ? 2 * VU : VU / VEB;  // value elements per unit
  static constexpr int NT = DV / 8;                     // n-tiles of p.v
  static constexpr int KBYTES = STEP * RBK, VBYTES = STEP * RBV;
  static constexpr int SC_OFF = KBYTES + VBYTES;        // 16 key scales, then 16 value scales
  static constexpr bool HAS_SC = KSM == KVC_SC_PAGE || KSM == KVC_SC_TOKEN ||
                                 VSM == KVC_SC_PAGE || VSM == KVC_SC_TOKEN;
  static constexpr int MASK_OFF = SC_OFF + (HAS_SC ? 128 : 0);  // 16 key-mask bytes
  // int4: the key page's fp16 channel scales [D] then zero points [D]; the values' fp16 token
  // scales [16] then zero points [16]
  static constexpr int KZP_OFF = MASK_OFF + 16;
  static constexpr int VZP_OFF = KZP_OFF + (KSM == KVC_SC_CHANZP ? 4 * D : 0);
  static constexpr int STAGE = VZP_OFF + (VSM == KVC_SC_TOKZP ? 64 : 0);
  static constexpr int STAGE_ALIGNED = (STAGE + 15) / 16 * 16;
  static_assert(KI4 ? (D == 64 || D % 128 == 0) : NCK >= 4 && NCK % 4 == 0,
                "key rows of at least 64 bytes (int4: head_dim 64 or a multiple of 128)");
  static_assert(RBV % (VI4 ? 32 : 64) == 0, "value rows of at least 64 bytes (int4: 32)");
};

// Byte offset of chunk c (of 16 bytes) of row `row` in a stage region with `nc` chunks a row.
__device__ __forceinline__ int chunk_off(int row, int c, int nc) {
  return row * nc * 16 + ((nc >= 8 ? (c ^ swz(row)) : c) << 4);
}

// int4 keys: page `pg`'s channel scales and zero points (fp16 [D] each) into a stage's KZP
// area, 16 bytes a lane: lanes [0, D / 8) scales, the next D / 8 lanes zero points
template <int D>
__device__ __forceinline__ void copy_channel_terms(uint8_t* kzp, const DecodeParams& p, int pg,
                                                   int H, int h, int lane) {
  constexpr int NCH = D / 8;  // 16-byte copies of one [D] fp16 row
  static_assert(2 * NCH <= 32, "one copy a lane");
  if (lane < 2 * NCH) {
    const int l = lane % NCH;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(lane < NCH ? (const void*)p.ks
                                                                     : (const void*)p.kz);
    cp_async16(smem_u32(kzp + 16 * lane), src + ((long long)pg * H + h) * D * 2 + 16 * l, 16);
  }
}

template <int KK, int VK, int KSM, int VSM, int D, int DV, int ROWS, int NS, int QT,
          bool Q8 = false>
__device__ __forceinline__ void paged_decode(const DecodeParams& p) {
  using Gm = Geo<KK, VK, D, DV, NS, KSM, VSM>;
  static_assert(!Q8 || KK == KVC_E4M3, "Q8 (q.k on e4m3 tensor cores) takes e4m3 keys only");
  static_assert((KK == KVC_INT4) == (KSM == KVC_SC_CHANZP), "int4 keys: channel scale + zero");
  static_assert((VK == KVC_INT4) == (VSM == KVC_SC_TOKZP), "int4 values: token scale + zero");
  constexpr bool KBF = KK == KVC_BF16, VBF = VK == KVC_BF16;
  // issue-14 variants (KVC_VAR): integer fp8 widening applies to fp8 operands only
  constexpr bool ALU_K = (KVC_VAR & KVC_VAR_ALU_K) && Gm::KEB == 1 && !Q8;
  constexpr bool ALU_V = (KVC_VAR & KVC_VAR_ALU_V) && Gm::VEB == 1;
  constexpr float K_ALU = ALU_K && KK == KVC_E4M3 ? 256.f : 1.f;  // 2^8 back into the scores
  constexpr float V_ALU = ALU_V && VK == KVC_E4M3 ? 256.f : 1.f;  // ... into the probabilities
  constexpr bool QK2 = (KVC_VAR & KVC_VAR_QK2) && !Gm::KI4 && !Q8;
  constexpr bool VOTE = (KVC_VAR & KVC_VAR_VOTE) != 0;
  constexpr bool I4NK = (KVC_VAR & KVC_VAR_I4N) && Gm::KI4;  // int4 codes as f16 subnormals
  constexpr bool I4NV = (KVC_VAR & KVC_VAR_I4N) && Gm::VI4;
  // SWQ: int4 keys and values (I4N), or 16-bit keys and values (values' P.V transposed too)
  constexpr bool SWQ_OK = (KVC_VAR & KVC_VAR_SWQ) && ROWS == 8 && !Q8 &&
                          ((I4NK && I4NV) || (Gm::KEB == 2 && Gm::VEB == 2 && !ALU_V) ||
                           (Gm::KEB == 1 && !Gm::KI4 && Gm::VEB == 1 && !Gm::VI4 && !ALU_K &&
                            !ALU_V));  // int4, 16-bit or fp8 keys and values
  constexpr bool PVT = (KVC_VAR & KVC_VAR_PVT) && !ALU_V &&
                       (Gm::VEB == 1 ? (!Gm::VI4 || I4NV) : SWQ_OK);
  constexpr bool SB = QK2 || I4NK;                   // q.k in two accumulator chains
  constexpr bool PGZ = (KVC_VAR & KVC_VAR_PGZ) && Gm::KI4;
  constexpr bool SWQ = SWQ_OK && PVT;
  constexpr bool KPERM = (KVC_VAR & KVC_VAR_KPERM) && SWQ && PGZ && I4NK;
  constexpr int NR = ROWS / 8;                       // PVT: n-tiles of query rows
  constexpr int MT = DV / 16;                        // PVT: m-tiles of value columns
  constexpr int OT = PVT ? MT * NR : Gm::NT;         // accumulator tiles of O
  constexpr bool HOIST = (KVC_VAR & KVC_VAR_HOIST) && Gm::NCK >= 4 && Gm::NCV >= 4;
  const float NEG_INF = -INFINITY;
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int H = p.H, G = p.G, SQ = p.SQ, R = G * SQ;
  const int b = blockIdx.x / H, h = blockIdx.x % H;
  const int split = blockIdx.y;
  const int L = p.seq_lens[b];
  const int P = 1 << p.log2p;
  const long long Hq = (long long)H * G;

  // ---- q -> shared (compute dtype of q.k), rows >= R zero; then A fragments in registers
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem);  // [ROWS][D]
  uint8_t* stages = smem + ROWS * D * 2;
  // Q8: e4m3 codes [ROWS][D] bytes, then 16 row scales (fits in the ROWS * D * 2 bytes)
  uint8_t* qc = smem;
  float* qsc = reinterpret_cast<float*>(smem + ROWS * D);
  constexpr int KS8 = D / 32;  // Q8: k-steps of q.k
  uint32_t qa[Q8 ? 1 : Gm::KS][4];
  uint32_t qa8[Q8 ? KS8 : 1][4];
  if constexpr (Q8) {
    // warp w quantizes rows w, w + 4, ...; lane l holds elements 4 l .. 4 l + 3 (D 64: lanes < 16)
    for (int r = warp; r < ROWS; r += WARPS) {
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      if (r < R && 4 * lane < D) {
        const long long row = (b * Hq + (long long)h * G + r / SQ) * SQ + r % SQ;
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = load_q<QT>(p.q, row * D + 4 * lane + e);
      }
      float amax = 0.f;
      bool bad = false;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        amax = fmaxf(amax, fabsf(x[e]));
        bad = bad || !(fabsf(x[e]) <= 3.402823466e38f);  // NaN or +-inf
      }
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      bad = __any_sync(0xffffffffu, bad);
      int es = 0;
      if (amax > 0.f && !bad) {
        int e;
        frexpf(amax, &e);  // amax < 2^e
        es = min(max(e - 8, -126), 126);
      }
      const float inv = pow2f(-es);
      if (4 * lane < D) {
        const uint32_t w = f32x2_to_e4m3x2(x[0] * inv, x[1] * inv) |
                           (f32x2_to_e4m3x2(x[2] * inv, x[3] * inv) << 16);
        *reinterpret_cast<uint32_t*>(qc + r * D + 4 * lane) = w;
      }
      if (lane == 0) qsc[r] = bad ? __int_as_float(0x7fc00000) : pow2f(es);
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < KS8; ++s) {
      const int d0 = 16 * (t + 4 * (s / 2)) + 8 * (s % 2);
      const uint32_t* r0 = reinterpret_cast<const uint32_t*>(qc + g * D + d0);
      qa8[s][0] = r0[0];
      qa8[s][2] = r0[1];
      if constexpr (ROWS == 16) {
        const uint32_t* r1 = reinterpret_cast<const uint32_t*>(qc + (g + 8) * D + d0);
        qa8[s][1] = r1[0];
        qa8[s][3] = r1[1];
      } else {
        qa8[s][1] = 0u;
        qa8[s][3] = 0u;
      }
    }
  } else {
  for (int e = threadIdx.x; e < ROWS * D; e += WARPS * 32) {
    const int r = e / D, d = e % D;
    float x = 0.f;
    if (r < R) {
      const long long row = (b * Hq + (long long)h * G + r / SQ) * SQ + r % SQ;
      // KPERM: element (d & ~7) | bitrev3(d & 7) at d (0 4 2 6 1 5 3 7 in each 8)
      const int dq = KPERM ? (d & ~7) | ((d & 1) << 2) | (d & 2) | ((d >> 2) & 1) : d;
      x = load_q<QT>(p.q, row * D + dq);
    }
    if constexpr (KBF) {
      __nv_bfloat16 y = __float2bfloat16_rn(x);
      qs[e] = *reinterpret_cast<uint16_t*>(&y);
    } else {
      __half y = __float2half_rn(x);
      qs[e] = *reinterpret_cast<uint16_t*>(&y);
    }
  }
  __syncthreads();
#pragma unroll
  for (int s = 0; s < Gm::KS; ++s) {
    const int c = t + 4 * (s / Gm::KPC);
    const int d0 = Gm::KEPC * c + 4 * (s % Gm::KPC);
    const uint32_t* r0 = reinterpret_cast<const uint32_t*>(qs + g * D + d0);
    qa[s][0] = r0[0];
    qa[s][2] = r0[1];
    if constexpr (ROWS == 16) {
      const uint32_t* r1 = reinterpret_cast<const uint32_t*>(qs + (g + 8) * D + d0);
      qa[s][1] = r1[0];
      qa[s][3] = r1[1];
    } else {
      qa[s][1] = 0u;
      qa[s][3] = 0u;
    }
    if constexpr (ALU_K) {  // keys come as (d0, d0 + 2), (d0 + 1, d0 + 3): q alike
      auto pair = [&](int r, int e) {
        const uint16_t* x = qs + r * D + d0 + e;
        return static_cast<uint32_t>(x[0]) | (static_cast<uint32_t>(x[2]) << 16);
      };
      qa[s][0] = pair(g, 0);
      qa[s][2] = pair(g, 1);
      if constexpr (ROWS == 16) {
        qa[s][1] = pair(g + 8, 0);
        qa[s][3] = pair(g + 8, 1);
      }
    }
  }
  }

  float kt = 1.f, vt = 1.f;  // tensor scales
  if constexpr (KSM == KVC_SC_TENSOR) kt = p.ks[0];
  if constexpr (VSM == KVC_SC_TENSOR) vt = p.vs[0];
  const float qk = p.qk_scale * kt, cap_in = p.cap_in * kt;
  // score multipliers of rows g (c < 2) and g + 8 (c >= 2): Q8 folds in the rows' q scales
  float qk_r[2] = {qk, qk}, cap_r[2] = {cap_in, cap_in};
  if constexpr (Q8) {
    const float s0 = qsc[g], s1 = ROWS == 16 ? qsc[g + 8] : 1.f;
    qk_r[0] = qk * s0;
    qk_r[1] = qk * s1;
    cap_r[0] = cap_in * s0;
    cap_r[1] = cap_in * s1;
  }
  if constexpr (K_ALU != 1.f) {
    qk_r[0] *= K_ALU;
    qk_r[1] *= K_ALU;
    cap_r[0] *= K_ALU;
    cap_r[1] *= K_ALU;
  }
  // softcapping: a compile-time decision in the CAP_STATIC variants
  const bool use_cap = (KVC_VAR & KVC_VAR_CAP_STATIC) ? (KVC_VAR & KVC_VAR_CAP_ON) != 0
                                                      : p.cap_out != 0.f;

  // ---- the split's steps: [lo_s, ceil(L / 16)) plus the sink steps a window cuts off
  int lo_s = 0, n_sink = 0;
  if (p.window > 0) {
    const int lo = max(L - SQ + 1 - p.window, 0);
    lo_s = lo / STEP;
    n_sink = (min(p.sinks, lo) + STEP - 1) / STEP;
    if (n_sink >= lo_s) { n_sink = 0; lo_s = 0; }
  }
  const int n_steps = n_sink + (L + STEP - 1) / STEP - lo_s;
  // PGZ: runs of BLK = P / 16 steps (at most 8) a warp, splits of whole runs
  const int lblk = PGZ ? min(p.log2p - 4, 3) : 0;
  const int per = ((n_steps + p.num_splits - 1) / p.num_splits + (1 << lblk) - 1) >> lblk << lblk;
  const int v0 = split * per, v1 = min(n_steps, v0 + per);
  int my_steps = v1 - v0 > warp ? (v1 - v0 - warp + WARPS - 1) / WARPS : 0;
  if constexpr (PGZ) {
    const int n = max(v1 - v0, 0), round = WARPS << lblk;
    const int full = n / round;
    my_steps = (full << lblk) + min(max(n - full * round - (warp << lblk), 0), 1 << lblk);
  }

  // the merge reuses each warp's ring for its (O, m, l) rows
  static_assert(ROWS * DV * 4 + 3 * ROWS * 4 <= NS * Gm::STAGE_ALIGNED, "ring < merge rows");
  uint8_t* ring = stages + warp * NS * Gm::STAGE_ALIGNED;
  const int* bt = p.bt + (long long)b * p.stride_bt;
  const long long head_k = (long long)h * P;  // (page * H + h) * P = page * H * P + h * P

  auto step_tok0 = [&](int i) {  // first token of the warp's i-th step
    const int v = PGZ ? v0 + ((((i >> lblk) * WARPS) + warp) << lblk) + (i & ((1 << lblk) - 1))
                      : v0 + warp + i * WARPS;
    return (v < n_sink ? v : lo_s + v - n_sink) * STEP;
  };

  // HOIST: copy k of a lane takes row lane / NC + k * (32 / NC) (rows < 8 iff k * (32 / NC) < 8,
  // NC = 4, 8, 16), chunk c = lane % NC; its shared offset in a stage and its byte offset from
  // the step's first row in its page ((tok0 + row) & (P - 1) = (tok0 & (P - 1)) + (row & (P - 1))
  // for tok0 a multiple of 16)
  // (keys and values of one row size share them: 2 registers a copy)
  constexpr bool HSAME = Gm::RBK == Gm::RBV;
  constexpr int HK = HOIST ? Gm::NCK / 2 : 1, HV = HOIST ? Gm::NCV / 2 : 1;
  int hks[HK], hkg[HK], hvs[HSAME ? 1 : HV], hvg[HSAME ? 1 : HV];
  if constexpr (HOIST) {
#pragma unroll
    for (int k = 0; k < HK; ++k) {
      const int q = lane + 32 * k, row = q / Gm::NCK, c = q % Gm::NCK;
      hks[k] = pin(chunk_off(row, c, Gm::NCK));
      hkg[k] = pin((row & (P - 1)) * Gm::RBK + c * 16);
    }
#pragma unroll
    for (int k = 0; k < (HSAME ? 0 : HV); ++k) {
      const int q = lane + 32 * k, row = q / Gm::NCV, c = q % Gm::NCV;
      hvs[k] = pin(chunk_off(row, c, Gm::NCV));
      hvg[k] = pin((row & (P - 1)) * Gm::RBV + c * 16);
    }
  }

  // PGZ (int4 keys: pages of >= 16 tokens, so a step lies in one page): the page index, id
  // and first row (page * H * P + h * P, 32 bits: the launcher checks the pool's rows) of the
  // warp's last issued step, kept while its steps stay in that page: a block-table load, the
  // page's row arithmetic and its channel-scale copy once a page, not once a step
  int iss_lpg = -1, iss_pg = 0;
  uint32_t iss_row = 0;
  // BTPF: page ids loaded a step (PGZ: a run of 1 << lblk steps) ahead of their issue
  constexpr bool BTPF = (KVC_VAR & KVC_VAR_BTPF) != 0;
  int pf0 = 0, pf1 = 0;
  auto issue = [&](int i) {  // cp.async of the warp's i-th step into its ring slot
    uint8_t* st = ring + (i % NS) * Gm::STAGE_ALIGNED;
    const int tok0 = step_tok0(i);
    const int last = L - 1;
    // page ids of the step's two halves (equal unless pages of 8)
    int pg0, pg1;
    long long r0, r1;  // rows (page * H + h) * P + slot of the step's two halves
    if constexpr (PGZ) {
      const int lpg = tok0 >> p.log2p;  // tok0 < L: a step's first token is a key
      // BTPF: a run's first step (but the warp's first) has its page id from the run before
      const bool run0 = (i & ((1 << lblk) - 1)) == 0;
      if (lpg != iss_lpg) {
        iss_lpg = lpg;
        iss_pg = BTPF && run0 && i > 0 ? pf0 : bt[lpg];
        iss_row = (uint32_t)iss_pg * (uint32_t)(H * P) + (uint32_t)head_k;
        // the page's channel terms, for the main loop's first step in this page (the steps
        // that recompute them)
        copy_channel_terms<D>(st + Gm::KZP_OFF, p, iss_pg, H, h, lane);
      }
      pg0 = pg1 = iss_pg;
      r0 = r1 = (long long)(iss_row + (uint32_t)(tok0 & (P - 1)));
      if constexpr (BTPF) {  // the next run's page id, used at its first step
        // (loaded every step, the index clamped to the warp's last step, never skipped: a
        // conditional load merges with the old value, which ptxas did with a copy right after
        // the load, waiting for it)
        const int ni = min(((i >> lblk) + 1) << lblk, my_steps - 1);
        pf0 = bt[step_tok0(ni) >> p.log2p];
      }
    } else {
      if (BTPF && i > 0) {  // loaded by the previous step's issue
        pg0 = pf0;
        pg1 = pf1;
      } else {
        pg0 = bt[min(tok0, last) >> p.log2p];
        pg1 = bt[min(tok0 + 8, last) >> p.log2p];
      }
      if constexpr (BTPF) {  // the next step's, used at its issue (never skipped, as above)
        const int nt = step_tok0(min(i + 1, my_steps - 1));
        pf0 = bt[min(nt, last) >> p.log2p];
        pf1 = bt[min(nt + 8, last) >> p.log2p];
      }
      r0 = (long long)pg0 * H * P + head_k + (tok0 & (P - 1));
      r1 = (long long)pg1 * H * P + head_k + (tok0 & (P - 1));
    }
    if constexpr (HOIST) {
      const uint32_t sb = smem_u32(st);
      const int lim = L - tok0;  // rows below it hold tokens (< L)
      const uint8_t* k0 = p.k + r0 * Gm::RBK;
      const uint8_t* k1 = p.k + r1 * Gm::RBK;
#pragma unroll
      for (int k = 0; k < HK; ++k) {
        const int row = lane / Gm::NCK + k * (32 / Gm::NCK);
        cp_async16(sb + hks[k], (k * (32 / Gm::NCK) < 8 ? k0 : k1) + hkg[k],
                   row < lim ? 16 : 0);
      }
      const uint8_t* v0 = p.v + r0 * Gm::RBV;
      const uint8_t* v1 = p.v + r1 * Gm::RBV;
#pragma unroll
      for (int k = 0; k < HV; ++k) {
        const int row = lane / Gm::NCV + k * (32 / Gm::NCV);
        cp_async16(sb + Gm::KBYTES + (HSAME ? hks[k] : hvs[k]),
                   (k * (32 / Gm::NCV) < 8 ? v0 : v1) + (HSAME ? hkg[k] : hvg[k]),
                   row < lim ? 16 : 0);
      }
    }
#pragma unroll
    for (int k = 0; k < (HOIST ? 0 : Gm::NCK / 2); ++k) {
      const int q = lane + 32 * k, row = q / Gm::NCK, c = q % Gm::NCK;
      const int tok = tok0 + row;  // (tok & (P - 1)) = (tok0 & (P - 1)) + (row & (P - 1))
      const long long off = ((row < 8 ? r0 : r1) + (row & (P - 1))) * Gm::RBK + c * 16;
      cp_async16(smem_u32(st + chunk_off(row, c, Gm::NCK)), p.k + off, tok < L ? 16 : 0);
    }
#pragma unroll
    for (int k = 0; k < (HOIST ? 0 : Gm::NCV / 2); ++k) {
      const int q = lane + 32 * k, row = q / Gm::NCV, c = q % Gm::NCV;
      const int tok = tok0 + row;
      const long long off = ((row < 8 ? r0 : r1) + (row & (P - 1))) * Gm::RBV + c * 16;
      cp_async16(smem_u32(st + Gm::KBYTES + chunk_off(row, c, Gm::NCV)), p.v + off,
                 tok < L ? 16 : 0);
    }
    if constexpr (Gm::HAS_SC) {
      float* sc = reinterpret_cast<float*>(st + Gm::SC_OFF);
      // lanes 0-3: key token scales (4 per lane) or lanes 0-1 page scales; 8-11 / 8-9 values
      const bool is_v = lane >= 8;
      const int l = lane & 7;
      const int mode = is_v ? VSM : KSM;
      const float* src = is_v ? p.vs : p.ks;
      if (mode == KVC_SC_TOKEN && l < 4 && lane < 16) {
        const int tok = tok0 + 4 * l;
        const long long off = (l < 2 ? r0 : r1) + ((4 * l) & (P - 1));
        // the scales of tokens past L (unwritten slots) are zero-filled, never read
        cp_async16(smem_u32(sc + (is_v ? 16 : 0) + 4 * l), src + off,
                   4 * min(max(L - tok, 0), 4));
      } else if (mode == KVC_SC_PAGE && l < 2 && lane < 16) {
        const int pg = l == 0 ? pg0 : pg1;
        cp_async4(smem_u32(sc + (is_v ? 16 : 0) + l), src + (long long)pg * H + h, 4);
      }
    }
    if constexpr (KSM == KVC_SC_CHANZP && !PGZ) {  // (pages of >= 16 tokens: a page a step)
      copy_channel_terms<D>(st + Gm::KZP_OFF, p, pg0, H, h, lane);
    }
    if constexpr (VSM == KVC_SC_TOKZP) {
      // the step's 16 token scales (lanes 0, 1: 8 tokens each) and zero points (lanes 2, 3);
      // those of tokens past L (unwritten slots, NaN there) are zero-filled, never read
      if (lane < 4) {
        const int half = lane & 1, tok = tok0 + 8 * half;
        const uint8_t* src = reinterpret_cast<const uint8_t*>(lane < 2 ? (const void*)p.vs
                                                                       : (const void*)p.vz);
        // (PGZ: pages of >= 16 tokens, r1 = r0)
        const long long off = PGZ ? r0 + 8 * half : (half ? r1 : r0) + ((8 * half) & (P - 1));
        cp_async16(smem_u32(st + Gm::VZP_OFF + 16 * lane), src + off * 2,
                   2 * min(max(L - tok, 0), 8));
      }
    }
    if (p.kmask != nullptr && tok0 < p.n_km && lane == 31) {
      cp_async16(smem_u32(st + Gm::MASK_OFF), p.kmask + (long long)b * p.stride_km + tok0, 16);
    }
  };

  float o[OT][4];  // PVT: tile mt * NR + nr = value columns of m-tile mt x query rows 8 nr..
#pragma unroll
  for (int n = 0; n < OT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  float zacc0 = 0.f, zacc1 = 0.f;  // int4 values: sum_j p_j z_j of rows g, g + 8
  int vexp = -126;       // O is in units of 2^vexp (value scales, see the main loop)
  float vinv = 0x1p126f;  // 2^-vexp
  const int qpos_first = L - SQ;  // position of the first query
  const int i_row0 = g % SQ, i_row1 = (g + 8) % SQ;  // query index of rows g, g + 8

#pragma unroll
  for (int k = 0; k < NS - 1; ++k) {
    if (k < my_steps) issue(k);
    cp_commit();
  }

  // int4 keys: q's columns times the channel scales, and sum_d q_d z_d (PGZ: the page's, kept)
  uint32_t qk4[Gm::KI4 ? Gm::KS : 1][4];
  float sz[4] = {0.f, 0.f, 0.f, 0.f};
  int cur_lpg = -1;  // PGZ: page index (in the sequence) of the warp's previous step
  for (int it = 0; it < my_steps; ++it) {
    if (it + NS - 1 < my_steps) issue(it + NS - 1);
    cp_commit();
    cp_wait<NS - 1>();
    __syncwarp();
    const uint8_t* st = ring + (it % NS) * Gm::STAGE_ALIGNED;
    const int tok0 = step_tok0(it);

    // ---- int4 keys: q's columns times the page's channel scales (f16, once per step for both
    // n-tiles), and sum_d q_d z_d per row from one more MMA whose every column is the page's
    // zero points (so each lane's accumulators hold its rows' sums: sz[0] row g, sz[2] g + 8)
    if constexpr (!PGZ) {
      sz[0] = sz[1] = sz[2] = sz[3] = 0.f;
    }
    bool fresh = true;  // PGZ: the step's page is not the warp's previous step's
    if constexpr (PGZ) {
      const int lpg = tok0 >> p.log2p;
      fresh = lpg != cur_lpg;
      cur_lpg = lpg;
      if (fresh) sz[0] = sz[1] = sz[2] = sz[3] = 0.f;
    }
    if constexpr (Gm::KI4) if (fresh) {
      const uint8_t* kzp = st + Gm::KZP_OFF;  // scales [D] f16, then zero points [D] f16
#pragma unroll
      for (int i = 0; i < Gm::KS / Gm::KPC; ++i) {
        const int d0 = Gm::KEPC * (t + 4 * i);  // first element of the thread's unit
#pragma unroll
        for (int q4 = 0; q4 < Gm::KEPC / 8; ++q4) {  // 8 elements (2 k-steps) a 16-byte load
          uint4 sw = lds128(kzp + 2 * (d0 + 8 * q4));
          uint4 zw = lds128(kzp + 2 * D + 2 * (d0 + 8 * q4));
          if constexpr (KPERM) {  // as q: words (0, 4), (2, 6), (1, 5), (3, 7)
            auto perm = [](const uint4& w) {
              uint4 r;
              r.x = __byte_perm(w.x, w.z, 0x5410);
              r.y = __byte_perm(w.y, w.w, 0x5410);
              r.z = __byte_perm(w.x, w.z, 0x7632);
              r.w = __byte_perm(w.y, w.w, 0x7632);
              return r;
            };
            sw = perm(sw);
            zw = perm(zw);
          }
          // I4N: q's fragments again from shared memory (the same words as qa[s]), so that qa
          // is not live across the loop (the registers that 4 CTAs a SM need)
          uint4 q0w{}, q1w{};
          if constexpr (I4NK) {
            q0w = lds128(reinterpret_cast<const uint8_t*>(qs + g * D + d0 + 8 * q4));
            if constexpr (ROWS == 16)
              q1w = lds128(reinterpret_cast<const uint8_t*>(qs + (g + 8) * D + d0 + 8 * q4));
          }
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int s = Gm::KPC * i + 2 * q4 + h2;
            const uint32_t s01 = word(sw, 2 * h2), s23 = word(sw, 2 * h2 + 1);
            uint32_t qf[4] = {qa[s][0], qa[s][1], qa[s][2], qa[s][3]};
            if constexpr (I4NK) {
              qf[0] = word(q0w, 2 * h2);
              qf[2] = word(q0w, 2 * h2 + 1);
              qf[1] = ROWS == 16 ? word(q1w, 2 * h2) : 0u;
              qf[3] = ROWS == 16 ? word(q1w, 2 * h2 + 1) : 0u;
            }
            qk4[s][0] = hmul2_u32(qf[0], s01);
            qk4[s][2] = hmul2_u32(qf[2], s23);
            qk4[s][1] = ROWS == 16 ? hmul2_u32(qf[1], s01) : 0u;
            qk4[s][3] = ROWS == 16 ? hmul2_u32(qf[3], s23) : 0u;
            if constexpr (SWQ) {  // A: every M row the zero points; B: q (rows as N)
              const uint32_t za[4] = {word(zw, 2 * h2), word(zw, 2 * h2), word(zw, 2 * h2 + 1),
                                      word(zw, 2 * h2 + 1)};
              mma16816<false>(sz, za, qf[0], qf[2]);
            } else {
              mma16816<false>(sz, qf, word(zw, 2 * h2), word(zw, 2 * h2 + 1));
            }
          }
        }
      }
    }

    // (masked / full are set where the base kernel sets them: moved up, they cost pvt4h 20
    // instructions a step and a spill)
    bool masked, full;
    bool tok_ok[2][2] = {{true, true}, {true, true}};
    uint32_t pa[4];
    if constexpr (SWQ) {
      masked = p.kmask != nullptr && tok0 < p.n_km && !mask_step_all_seen(st + Gm::MASK_OFF);
      full = tok0 + STEP <= L - SQ + 1 && !masked &&
             (p.window <= 0 || tok0 >= L - p.window || tok0 + STEP <= p.sinks);
      // ---- SWQ: S^T = K Q^T, the step's 16 tokens as M (A: the key codes of tokens g, g + 8,
      // the registers base feeds its two n-tiles as B), the 8 query rows as N (B: q times the
      // channel scales, no padded rows): lane (g, t) holds c0 / c1 = token g, rows 2t / 2t + 1,
      // c2 / c3 = token g + 8; half base's q.k MMAs and exponentials at 8 rows
      float s4[4] = {0.f, 0.f, 0.f, 0.f}, s4b[4] = {0.f, 0.f, 0.f, 0.f};
      auto kmma = [&](uint32_t x0, uint32_t x1, int s) {  // word of tokens g / g + 8, k-steps s, s + 1
        if constexpr (KPERM) {  // (e0, e4), (e2, e6) x 1; (e1, e5), (e3, e7) x 16
          const uint32_t x08 = x0 >> 8, x18 = x1 >> 8;
          const uint32_t ae[4] = {x0 & 0x000F000Fu, x1 & 0x000F000Fu, x08 & 0x000F000Fu,
                                  x18 & 0x000F000Fu};
          mma16816<false>(s4, ae, qk4[s][0], qk4[s][2]);
          const uint32_t ao[4] = {x0 & 0x00F000F0u, x1 & 0x00F000F0u, x08 & 0x00F000F0u,
                                  x18 & 0x00F000F0u};
          mma16816<false>(s4b, ao, qk4[s + 1][0], qk4[s + 1][2]);
          return;
        }
        const uint32_t x04 = x0 >> 4, x14 = x1 >> 4;
        const uint32_t ae[4] = {int4_byte_f16x2<0, true>(x0, x04), int4_byte_f16x2<0, true>(x1, x14),
                                int4_byte_f16x2<1, true>(x0, x04), int4_byte_f16x2<1, true>(x1, x14)};
        mma16816<false>(s4, ae, qk4[s][0], qk4[s][2]);
        const uint32_t ao[4] = {int4_byte_f16x2<2, true>(x0, x04), int4_byte_f16x2<2, true>(x1, x14),
                                int4_byte_f16x2<3, true>(x0, x04), int4_byte_f16x2<3, true>(x1, x14)};
        mma16816<false>(s4b, ao, qk4[s + 1][0], qk4[s + 1][2]);
      };
#pragma unroll
      for (int i = 0; i < Gm::NCK / 4; ++i) {
        const uint4 w0 = lds128(st + chunk_off(g, t + 4 * i, Gm::NCK));
        const uint4 w1 = lds128(st + chunk_off(8 + g, t + 4 * i, Gm::NCK));
        if constexpr (Gm::KI4) {
#pragma unroll
          for (int ww = 0; ww < 4; ++ww) kmma(word(w0, ww), word(w1, ww), Gm::KPC * i + 2 * ww);
        } else if constexpr (Gm::KEB == 1) {  // fp8 keys: k-step 4i + ww, F2FP widening
#pragma unroll
          for (int ww = 0; ww < 4; ++ww) {
            const uint32_t x0 = word(w0, ww), x1 = word(w1, ww);
            const uint32_t a8[4] = {fp8x2_to_f16x2<KK>(x0 & 0xffffu), fp8x2_to_f16x2<KK>(x1 & 0xffffu),
                                    fp8x2_to_f16x2<KK>(x0 >> 16), fp8x2_to_f16x2<KK>(x1 >> 16)};
            mma16816<false>((ww & 1) ? s4b : s4, a8, qa[4 * i + ww][0], qa[4 * i + ww][2]);
          }
        } else {  // 16-bit keys: k-steps 2i, 2i + 1 (two chains), q as B
#pragma unroll
          for (int ww = 0; ww < 2; ++ww) {
            const uint32_t a16[4] = {word(w0, 2 * ww), word(w1, 2 * ww), word(w0, 2 * ww + 1),
                                     word(w1, 2 * ww + 1)};
            mma16816<KBF>(ww ? s4b : s4, a16, qa[2 * i + ww][0], qa[2 * i + ww][2]);
          }
        }
      }
      if constexpr (Gm::KI4 && Gm::KEPC == 16) {  // int4, head_dim 64: 8 bytes a thread
        const uint2 w0 = lds64(st + g * Gm::RBK + 8 * t);
        const uint2 w1 = lds64(st + (8 + g) * Gm::RBK + 8 * t);
        kmma(w0.x, w1.x, 0);
        kmma(w0.y, w1.y, 2);
      }
      // fp8 scales of tokens g (half 0 of the step) and g + 8 (half 1)
      const float* sc = reinterpret_cast<const float*>(st + Gm::SC_OFF);
      float kfs[2] = {1.f, 1.f}, vfs[2] = {1.f, 1.f}, zts[2] = {0.f, 0.f};
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        if constexpr (KSM == KVC_SC_TOKEN) kfs[h2] = sc[g + 8 * h2];
        if constexpr (KSM == KVC_SC_PAGE) kfs[h2] = sc[h2];
        if constexpr (VSM == KVC_SC_TOKEN) vfs[h2] = sc[16 + g + 8 * h2];
        if constexpr (VSM == KVC_SC_PAGE) vfs[h2] = sc[16 + h2];
      }
      float x4[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // codes came as c * 2^-24; sz[c]: row 2t + (c & 1)
        float raw = KPERM     ? fmaf(s4[c], 0x1p24f, fmaf(s4b[c], 0x1p20f, sz[c]))
                    : Gm::KI4 ? fmaf(s4[c] + s4b[c], 0x1p24f, sz[c]) : s4[c] + s4b[c];
        if constexpr (KSM == KVC_SC_TOKEN || KSM == KVC_SC_PAGE) raw *= kfs[c >> 1];
        x4[c] = use_cap ? p.cap_out * tanhf(raw * cap_r[0]) : raw * qk_r[0];
      }
      // the value token scales / zero points of tokens g, g + 8
      const uint16_t* vzp = reinterpret_cast<const uint16_t*>(st + Gm::VZP_OFF);
      if constexpr (VSM == KVC_SC_TOKZP) {
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        vfs[h2] = f16_bits_to_f32(vzp[g + 8 * h2]);
        zts[h2] = f16_bits_to_f32(vzp[16 + g + 8 * h2]);
      }
      }
      if constexpr (VSM == KVC_SC_TOKZP || VSM == KVC_SC_TOKEN || VSM == KVC_SC_PAGE) {  // O in units of 2^vexp (see below): a lane's own tokens first, the warp's when one grows
        float vmax = fmaxf(vfs[0], vfs[1]);
        if (__any_sync(0xffffffffu, vmax >= pow2f(vexp) && vmax < INFINITY)) {
          vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 4));
          vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 8));
          vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 16));
          int e = vexp;
          if (vmax > 0.f && vmax < INFINITY) frexpf(vmax, &e);
          if (e > vexp) {
            const float a = exp2f(static_cast<float>(vexp - e));
#pragma unroll
            for (int n = 0; n < OT; ++n)
#pragma unroll
              for (int c = 0; c < 4; ++c) o[n][c] *= a;
            vexp = e;
            vinv = exp2f(static_cast<float>(-e));
          }
        }
      }
      if constexpr (VSM == KVC_SC_TOKZP || VSM == KVC_SC_TOKEN || VSM == KVC_SC_PAGE) {
        vfs[0] *= vinv;
        vfs[1] *= vinv;
      }
      if (!full) {
        const uint8_t* km = st + Gm::MASK_OFF;
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {  // tokens g + 8 h2 of the scores
          const int pos = tok0 + g + 8 * h2;
          const bool any = pos < L && (!masked || km[g + 8 * h2] != 0);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int qpos = L - SQ + (2 * t + e) % SQ;
            const bool vis = any && pos <= qpos &&
                             (p.window <= 0 || qpos - pos < p.window || pos < p.sinks);
            if (!vis) x4[2 * h2 + e] = NEG_INF;
          }
          if (!(any && (p.window <= 0 || qpos_first - pos < p.window || pos < p.sinks)))
            vfs[h2] = zts[h2] = 0.f;  // read by nobody: inert (NaN there)
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)  // tokens 8 j + 2 t + e of P.V's A operand
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tau = 8 * j + 2 * t + e, pos = tok0 + tau;
            const bool any = pos < L && (!masked || km[tau] != 0);
            tok_ok[j][e] = any && (p.window <= 0 || qpos_first - pos < p.window || pos < p.sinks);
          }
      }
      // ---- online softmax over rows 2t (c even) and 2t + 1 (c odd), their maxima over the
      // tokens of lanes g = 0..7
      float mx0 = fmaxf(x4[0], x4[2]), mx1 = fmaxf(x4[1], x4[3]);
      auto row_max = [&]() {
#pragma unroll
        for (int o2 = 4; o2 <= 16; o2 <<= 1) {
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
        }
      };
      if constexpr (!VOTE) row_max();
      if (__any_sync(0xffffffffu, mx0 > m0 + 8.f || mx1 > m1 + 8.f)) {
        if constexpr (VOTE) row_max();
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float a0 = n0 == NEG_INF ? 1.f : exp2f(m0 - n0);
        const float a1 = n1 == NEG_INF ? 1.f : exp2f(m1 - n1);
        m0 = n0;
        m1 = n1;
        l0 *= a0;
        l1 *= a1;
        zacc0 *= a0;
        zacc1 *= a1;
#pragma unroll
        for (int n = 0; n < OT; ++n)  // O^T: columns 2t + (c & 1) are this lane's rows
#pragma unroll
          for (int c = 0; c < 4; ++c) o[n][c] *= (c & 1) ? a1 : a0;
      }
      const float mu0 = m0 == NEG_INF ? 0.f : m0, mu1 = m1 == NEG_INF ? 0.f : m1;
      float pr[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) pr[c] = exp2f(x4[c] - ((c & 1) ? mu1 : mu0));
      l0 += pr[0] + pr[2];
      l1 += pr[1] + pr[3];
      if constexpr (VSM == KVC_SC_TOKZP) {
        zacc0 += pr[0] * zts[0] + pr[2] * zts[1];
        zacc1 += pr[1] * zts[0] + pr[3] * zts[1];
      }
      // P^T blocks (token g / g + 8, rows 2t, 2t + 1) transposed by movmatrix into P.V's B
      // fragments (row g, tokens 2t, 2t + 1 / 2t + 8, 2t + 9)
      pa[0] = movmatrix_t(pack2<VBF>(pr[0] * vfs[0], pr[1] * vfs[0]));
      pa[2] = movmatrix_t(pack2<VBF>(pr[2] * vfs[1], pr[3] * vfs[1]));
      pa[1] = pa[3] = 0u;
    } else {
    // ---- S = Q K^T: n-tile j holds tokens 8 j + n
    float sa[2][4];
    float sb[2][4];  // QK2: the odd MMAs' chain
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sa[j][0] = sa[j][1] = sa[j][2] = sa[j][3] = 0.f;
      sb[j][0] = sb[j][1] = sb[j][2] = sb[j][3] = 0.f;
      const int row = 8 * j + g;
#pragma unroll
      for (int i = 0; i < Gm::NCK / 4; ++i) {
        const uint4 w = lds128(st + chunk_off(row, t + 4 * i, Gm::NCK));
        if constexpr (Q8) {
          mma16832_e4m3(sa[j], qa8[2 * i], w.x, w.y);
          mma16832_e4m3(sa[j], qa8[2 * i + 1], w.z, w.w);
        } else if constexpr (ALU_K) {
#pragma unroll
          for (int ww = 0; ww < 4; ++ww) {
            uint32_t ev, od;
            fp8x4_to_f16x2x2_alu<KK>(word(w, ww), ev, od);
            mma16816<false>(QK2 && (ww & 1) ? sb[j] : sa[j], qa[4 * i + ww], ev, od);
          }
        } else if constexpr (Gm::KI4) {
#pragma unroll
          for (int ww = 0; ww < 4; ++ww) {  // 8 codes a word: k-steps 2 ww, 2 ww + 1
            const uint32_t x = word(w, ww), x4 = x >> 4;
            const int s = Gm::KPC * i + 2 * ww;
            mma16816<false>(sa[j], qk4[s], int4_byte_f16x2<0, I4NK>(x, x4),
                            int4_byte_f16x2<1, I4NK>(x, x4));
            mma16816<false>(I4NK ? sb[j] : sa[j], qk4[s + 1], int4_byte_f16x2<2, I4NK>(x, x4),
                            int4_byte_f16x2<3, I4NK>(x, x4));
          }
        } else if constexpr (Gm::KEB == 1) {
#pragma unroll
          for (int ww = 0; ww < 4; ++ww) {
            const uint32_t x = word(w, ww);
            mma16816<false>(QK2 && (ww & 1) ? sb[j] : sa[j], qa[4 * i + ww],
                            fp8x2_to_f16x2<KK>(x & 0xffffu), fp8x2_to_f16x2<KK>(x >> 16));
          }
        } else {
#pragma unroll
          for (int ww = 0; ww < 2; ++ww)
            mma16816<KBF>(QK2 && (ww & 1) ? sb[j] : sa[j], qa[2 * i + ww], word(w, 2 * ww),
                          word(w, 2 * ww + 1));
        }
      }
      if constexpr (Gm::KI4 && Gm::KEPC == 16) {  // int4, head_dim 64: 8 bytes a thread
        const uint2 w = lds64(st + row * Gm::RBK + 8 * t);
#pragma unroll
        for (int ww = 0; ww < 2; ++ww) {
          const uint32_t x = ww == 0 ? w.x : w.y, x4 = x >> 4;
          mma16816<false>(sa[j], qk4[2 * ww], int4_byte_f16x2<0, I4NK>(x, x4),
                          int4_byte_f16x2<1, I4NK>(x, x4));
          mma16816<false>(I4NK ? sb[j] : sa[j], qk4[2 * ww + 1], int4_byte_f16x2<2, I4NK>(x, x4),
                          int4_byte_f16x2<3, I4NK>(x, x4));
        }
      }
    }

    if constexpr (SB) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) sa[j][c] += sb[j][c];
    }
    if constexpr (Gm::KI4) {  // I4N: the codes came as c * 2^-24
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) sa[j][c] = I4NK ? fmaf(sa[j][c], 0x1p24f, sz[c]) : sa[j][c] + sz[c];
    }

    // ---- scores (log2 units), masks; thread's tokens: 8 j + 2 t + e, rows g (c < 2), g + 8
    const float* sc = reinterpret_cast<const float*>(st + Gm::SC_OFF);
    float kf[2][2], vf[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tau = 8 * j + 2 * t + e;
        kf[j][e] = KSM == KVC_SC_TOKEN ? sc[tau] : KSM == KVC_SC_PAGE ? sc[j] : 1.f;
        vf[j][e] = VSM == KVC_SC_TOKEN ? sc[16 + tau] : VSM == KVC_SC_PAGE ? sc[16 + j] : 1.f;
      }
    float zt[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // int4 values: the tokens' zero points
    if constexpr (VSM == KVC_SC_TOKZP) {
      const uint16_t* vzp = reinterpret_cast<const uint16_t*>(st + Gm::VZP_OFF);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          vf[j][e] = f16_bits_to_f32(vzp[8 * j + 2 * t + e]);
          zt[j][e] = f16_bits_to_f32(vzp[16 + 8 * j + 2 * t + e]);
        }
    }
    if constexpr (VSM == KVC_SC_PAGE || VSM == KVC_SC_TOKEN || VSM == KVC_SC_TOKZP) {
      // p * vf goes to the MMA in f16, where a small value scale (values of std 0.01 in e5m2:
      // scales ~6e-7) would fall into subnormals. O accumulates p * vf * 2^-vexp instead, vexp
      // the largest exponent of a value scale seen so far (warp-uniform: every lane reads the
      // same scales), rescaled by a power of two when it grows and put back at the merge.
      float vmax = VSM == KVC_SC_PAGE ? fmaxf(sc[16], sc[17]) : 0.f;
      if constexpr (VSM == KVC_SC_TOKEN) {
#pragma unroll
        for (int tau = 0; tau < 16; ++tau) vmax = fmaxf(vmax, sc[16 + tau]);
      }
      if constexpr (VSM == KVC_SC_TOKZP) {  // the quad holds the step's 16 tokens
        vmax = fmaxf(fmaxf(vf[0][0], vf[0][1]), fmaxf(vf[1][0], vf[1][1]));
        vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));
        vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));
      }
      int e = vexp;
      if (vmax > 0.f && vmax < INFINITY) frexpf(vmax, &e);  // vmax < 2^e
      if (e > vexp) {
        const float a = exp2f(static_cast<float>(vexp - e));
#pragma unroll
        for (int n = 0; n < OT; ++n) {
          o[n][0] *= a;
          o[n][1] *= a;
          o[n][2] *= a;
          o[n][3] *= a;
        }
        vexp = e;
        vinv = exp2f(static_cast<float>(-e));
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        vf[j][0] *= vinv;
        vf[j][1] *= vinv;
      }
    }
    if constexpr (V_ALU != 1.f) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        vf[j][0] *= V_ALU;
        vf[j][1] *= V_ALU;
      }
    }
    float x[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float raw = sa[j][c] * kf[j][c & 1];
        x[j][c] = use_cap ? p.cap_out * tanhf(raw * cap_r[c >> 1]) : raw * qk_r[c >> 1];
      }
    // every row sees every token of the step: the first query (position L - SQ) sees the last
    // token, the last query (L - 1) the first one through its window
    // (a key mask covers the first n_km slots, whole steps of 16: later steps need no mask,
    // so a short mask, as eviction's hidden slots after the sinks, costs only its own steps)
    masked = p.kmask != nullptr && tok0 < p.n_km && !mask_step_all_seen(st + Gm::MASK_OFF);
    full = tok0 + STEP <= L - SQ + 1 && !masked &&
           (p.window <= 0 || tok0 >= L - p.window || tok0 + STEP <= p.sinks);
    if (!full) {
      const uint8_t* km = st + Gm::MASK_OFF;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tau = 8 * j + 2 * t + e, pos = tok0 + tau;
          bool any = pos < L && (!masked || km[tau] != 0);
#pragma unroll
          for (int c = e; c < 4; c += 2) {
            const int qpos = L - SQ + (c < 2 ? i_row0 : i_row1);
            const bool vis = any && pos <= qpos &&
                             (p.window <= 0 || qpos - pos < p.window || pos < p.sinks);
            if (!vis) x[j][c] = NEG_INF;
          }
          // a key no query sees is read by nobody: its values must stay inert (NaN there)
          tok_ok[j][e] = any && (p.window <= 0 || qpos_first - pos < p.window || pos < p.sinks);
        }
      if constexpr (VSM == KVC_SC_TOKZP) {  // an unread token's scale / zero point: inert
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (!tok_ok[j][e]) vf[j][e] = zt[j][e] = 0.f;
      }
    }

    // ---- online softmax, rescaled only when a row's max grows by more than 2^8
    float mx0 = fmaxf(fmaxf(x[0][0], x[0][1]), fmaxf(x[1][0], x[1][1]));
    float mx1 = fmaxf(fmaxf(x[0][2], x[0][3]), fmaxf(x[1][2], x[1][3]));
    auto quad_max = [&]() {  // the rows' maxima over the quad's 16 tokens
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      if constexpr (ROWS == 16) {
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      }
    };
    // VOTE: a lane's own scores decide (a row passes m + 8 iff one of its scores does)
    if constexpr (!VOTE) quad_max();
    const bool need = mx0 > m0 + 8.f || (ROWS == 16 && mx1 > m1 + 8.f);
    if (__any_sync(0xffffffffu, need)) {
      if constexpr (VOTE) quad_max();
      const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
      const float a0 = n0 == NEG_INF ? 1.f : exp2f(m0 - n0);
      const float a1 = n1 == NEG_INF ? 1.f : exp2f(m1 - n1);
      m0 = n0;
      m1 = n1;
      l0 *= a0;
      l1 *= a1;
      zacc0 *= a0;
      zacc1 *= a1;
      if constexpr (PVT) {
        // lane (g, t) holds O of rows 2t (c even), 2t + 1 (c odd) (+ 8 in n-tile 1): their
        // factors are those of lanes 8t (row 2t) and 8t + 4 (row 2t + 1)
        float f[NR][2];
        f[0][0] = __shfl_sync(0xffffffffu, a0, 8 * t);
        f[0][1] = __shfl_sync(0xffffffffu, a0, 8 * t + 4);
        if constexpr (NR == 2) {
          f[NR - 1][0] = __shfl_sync(0xffffffffu, a1, 8 * t);
          f[NR - 1][1] = __shfl_sync(0xffffffffu, a1, 8 * t + 4);
        }
#pragma unroll
        for (int n = 0; n < OT; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c) o[n][c] *= f[n % NR][c & 1];
      } else {
#pragma unroll
        for (int n = 0; n < OT; ++n) {
          o[n][0] *= a0;
          o[n][1] *= a0;
          o[n][2] *= a1;
          o[n][3] *= a1;
        }
      }
    }
    const float mu0 = m0 == NEG_INF ? 0.f : m0, mu1 = m1 == NEG_INF ? 0.f : m1;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float p0 = exp2f(x[j][0] - mu0), p1 = exp2f(x[j][1] - mu0);
      const float p2 = exp2f(x[j][2] - mu1), p3 = exp2f(x[j][3] - mu1);
      l0 += p0 + p1;
      l1 += p2 + p3;
      pa[2 * j] = pack2<VBF>(p0 * vf[j][0], p1 * vf[j][1]);
      pa[2 * j + 1] = ROWS == 16 ? pack2<VBF>(p2 * vf[j][0], p3 * vf[j][1]) : 0u;
      if constexpr (VSM == KVC_SC_TOKZP) {  // the zero points' rank-1 term, in f32
        zacc0 += p0 * zt[j][0] + p1 * zt[j][1];
        zacc1 += p2 * zt[j][0] + p3 * zt[j][1];
      }
    }

    }  // !SWQ

    // ---- O += P V: k = tokens (2t, 2t+1 | 2t+8, 2t+9), n-tile nb's column g = unit element
#pragma unroll
    for (int i = 0; i < Gm::VUN; ++i) {
      const int u = g + 8 * i;
      uint32_t va[Gm::VU / 4], vb[Gm::VU / 4], vc[Gm::VU / 4], vd[Gm::VU / 4];
      const uint8_t* vbase = st + Gm::KBYTES;
      auto load_unit = [&](int row, uint32_t* dst) {
        if constexpr (Gm::VU == 16) {
          const uint4 w = lds128(vbase + chunk_off(row, u, Gm::NCV));
          dst[0] = w.x; dst[1] = w.y; dst[2] = w.z; dst[3] = w.w;
        } else if constexpr (Gm::VU == 4) {  // int4 values, head_dim 64
          dst[0] = lds32(vbase + row * Gm::RBV + u * Gm::VU);
        } else {
          const uint2 w = lds64(vbase + row * Gm::RBV + u * Gm::VU);
          dst[0] = w.x; dst[1] = w.y;
        }
      };
      load_unit(2 * t, va);
      load_unit(2 * t + 1, vb);
      load_unit(2 * t + 8, vc);
      load_unit(2 * t + 9, vd);
      if (!full) {
#pragma unroll
        for (int w = 0; w < Gm::VU / 4; ++w) {
          va[w] = tok_ok[0][0] ? va[w] : 0u;
          vb[w] = tok_ok[0][1] ? vb[w] : 0u;
          vc[w] = tok_ok[1][0] ? vc[w] : 0u;
          vd[w] = tok_ok[1][1] ? vd[w] : 0u;
        }
      }
#pragma unroll
      for (int w = 0; w < Gm::VU / 4; ++w) {
        if constexpr (ALU_V && VK == KVC_E4M3) {
          // element e of tokens 2t / 2t+1 (a, b) straight from the two words: [a_e, sign(a_e),
          // b_e, sign(b_e)], one prmt each, then shift and mask
          const int nb = Gm::VEPU * i + 4 * w;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint32_t sel = 0xc480u + 0x1111u * e;
            mma16816<false>(o[nb + e], pa, e4m3x2_sx_to_f16x2(prmt_sx(va[w], vb[w], sel)),
                            e4m3x2_sx_to_f16x2(prmt_sx(vc[w], vd[w], sel)));
          }
        } else if constexpr (ALU_V) {
          // z = [a_e, a_e+1, b_e, b_e+1] (tokens 2t / 2t+1 of one k-register): its even
          // codes are element e of both tokens, its odd codes element e + 1
          const uint32_t z0 = __byte_perm(va[w], vb[w], 0x5410);
          const uint32_t z1 = __byte_perm(va[w], vb[w], 0x7632);
          const uint32_t y0 = __byte_perm(vc[w], vd[w], 0x5410);
          const uint32_t y1 = __byte_perm(vc[w], vd[w], 0x7632);
          uint32_t xe0, xo0, xe1, xo1, ye0, yo0, ye1, yo1;
          fp8x4_to_f16x2x2_alu<VK>(z0, xe0, xo0);
          fp8x4_to_f16x2x2_alu<VK>(z1, xe1, xo1);
          fp8x4_to_f16x2x2_alu<VK>(y0, ye0, yo0);
          fp8x4_to_f16x2x2_alu<VK>(y1, ye1, yo1);
          const int nb = Gm::VEPU * i + 4 * w;
          mma16816<false>(o[nb + 0], pa, xe0, ye0);
          mma16816<false>(o[nb + 1], pa, xo0, yo0);
          mma16816<false>(o[nb + 2], pa, xe1, ye1);
          mma16816<false>(o[nb + 3], pa, xo1, yo1);
        } else if constexpr (PVT && Gm::VEB == 2) {
          // SWQ, 16-bit values: word w holds elements 2w, 2w + 1 of the unit; the tokens' pairs
          // of each by one prmt: M-tile mt's row g is element 2w, row g + 8 element 2w + 1
          const uint32_t a16[4] = {__byte_perm(va[w], vb[w], 0x5410), __byte_perm(va[w], vb[w], 0x7632),
                                   __byte_perm(vc[w], vd[w], 0x5410), __byte_perm(vc[w], vd[w], 0x7632)};
          const int mt = Gm::VEPU / 2 * i + w;
#pragma unroll
          for (int nr = 0; nr < NR; ++nr) mma16816<VBF>(o[mt * NR + nr], a16, pa[nr], pa[2 + nr]);
        } else if constexpr (PVT && Gm::VI4) {
          // I4N: byte k of tokens 2t, 2t + 1 at bits 0-7 / 16-23 (ab; cd: 2t + 8, 2t + 9); its
          // low nibbles (element 8 w + 2 k of the unit, c * 2^-24) are M-tile mt's row g, its
          // high nibbles masked in place (element 8 w + 2 k + 1, 16 c * 2^-24) row g + 8
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t ab = __byte_perm(va[w], vb[w], k | ((4 + k) << 8));
            const uint32_t cd = __byte_perm(vc[w], vd[w], k | ((4 + k) << 8));
            const uint32_t a4[4] = {ab & 0x000F000Fu, ab & 0x00F000F0u, cd & 0x000F000Fu,
                                    cd & 0x00F000F0u};
            const int mt = Gm::VEPU / 2 * i + 4 * w + k;
#pragma unroll
            for (int nr = 0; nr < NR; ++nr)
              mma16816<false>(o[mt * NR + nr], a4, pa[nr], pa[2 + nr]);
          }
        } else if constexpr (Gm::VI4) {
          // byte k of rows 2t, 2t + 1 at bits 0-7 / 16-23: their low nibbles are n-tile
          // nb + 2k's k-pair, their high nibbles n-tile nb + 2k + 1's (element 2i: low nibble)
          const int nb = Gm::VEPU * i + 8 * w;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t ab = __byte_perm(va[w], vb[w], k | ((4 + k) << 8));
            const uint32_t cd = __byte_perm(vc[w], vd[w], k | ((4 + k) << 8));
            mma16816<false>(o[nb + 2 * k], pa, int4x2_to_f16x2(ab), int4x2_to_f16x2(cd));
            mma16816<false>(o[nb + 2 * k + 1], pa, int4x2_to_f16x2(ab >> 4),
                            int4x2_to_f16x2(cd >> 4));
          }
        } else if constexpr (PVT) {
          // x0 = [a0, b0, a1, b1] (tokens 2t, 2t+1: elements 4w, 4w + 1), x1 elements 4w + 2,
          // 4w + 3; y alike for tokens 2t+8, 2t+9. M-tile mt = VEPU / 2 * i + 2 w + h: its M
          // row g is element 4w + 2h of lane group g's unit, row g + 8 element 4w + 2h + 1
          const uint32_t x0 = __byte_perm(va[w], vb[w], 0x5140);
          const uint32_t x1 = __byte_perm(va[w], vb[w], 0x7362);
          const uint32_t y0 = __byte_perm(vc[w], vd[w], 0x5140);
          const uint32_t y1 = __byte_perm(vc[w], vd[w], 0x7362);
          const uint32_t a0[4] = {fp8x2_to_f16x2<VK>(x0 & 0xffffu), fp8x2_to_f16x2<VK>(x0 >> 16),
                                  fp8x2_to_f16x2<VK>(y0 & 0xffffu), fp8x2_to_f16x2<VK>(y0 >> 16)};
          const uint32_t a1[4] = {fp8x2_to_f16x2<VK>(x1 & 0xffffu), fp8x2_to_f16x2<VK>(x1 >> 16),
                                  fp8x2_to_f16x2<VK>(y1 & 0xffffu), fp8x2_to_f16x2<VK>(y1 >> 16)};
          const int mt = Gm::VEPU / 2 * i + 2 * w;
#pragma unroll
          for (int nr = 0; nr < NR; ++nr) {  // B: P of rows 8 nr + g, tokens 2t.. | 2t+8..
            mma16816<false>(o[mt * NR + nr], a0, pa[nr], pa[2 + nr]);
            mma16816<false>(o[(mt + 1) * NR + nr], a1, pa[nr], pa[2 + nr]);
          }
        } else if constexpr (Gm::VEB == 1) {
          const uint32_t x0 = __byte_perm(va[w], vb[w], 0x5140);
          const uint32_t x1 = __byte_perm(va[w], vb[w], 0x7362);
          const uint32_t y0 = __byte_perm(vc[w], vd[w], 0x5140);
          const uint32_t y1 = __byte_perm(vc[w], vd[w], 0x7362);
          const int nb = Gm::VEPU * i + 4 * w;
          mma16816<false>(o[nb + 0], pa, fp8x2_to_f16x2<VK>(x0 & 0xffffu),
                          fp8x2_to_f16x2<VK>(y0 & 0xffffu));
          mma16816<false>(o[nb + 1], pa, fp8x2_to_f16x2<VK>(x0 >> 16),
                          fp8x2_to_f16x2<VK>(y0 >> 16));
          mma16816<false>(o[nb + 2], pa, fp8x2_to_f16x2<VK>(x1 & 0xffffu),
                          fp8x2_to_f16x2<VK>(y1 & 0xffffu));
          mma16816<false>(o[nb + 3], pa, fp8x2_to_f16x2<VK>(x1 >> 16),
                          fp8x2_to_f16x2<VK>(y1 >> 16));
        } else {
          const int nb = Gm::VEPU * i + 2 * w;
          mma16816<VBF>(o[nb + 0], pa, __byte_perm(va[w], vb[w], 0x5410),
                        __byte_perm(vc[w], vd[w], 0x5410));
          mma16816<VBF>(o[nb + 1], pa, __byte_perm(va[w], vb[w], 0x7632),
                        __byte_perm(vc[w], vd[w], 0x7632));
        }
      }
    }
    __syncwarp();
  }
  cp_wait<0>();

  // ---- merge the warps: each writes (m, l, O) of its real rows into its own ring
  if constexpr (SWQ) {  // rows 2t, 2t + 1: sums over the lanes g = 0..7
#pragma unroll
    for (int o2 = 4; o2 <= 16; o2 <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
      l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
      zacc0 += __shfl_xor_sync(0xffffffffu, zacc0, o2);
      zacc1 += __shfl_xor_sync(0xffffffffu, zacc1, o2);
    }
  } else {
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  }
  if constexpr (VSM == KVC_SC_TOKZP && !SWQ) {
    zacc0 += __shfl_xor_sync(0xffffffffu, zacc0, 1);
    zacc0 += __shfl_xor_sync(0xffffffffu, zacc0, 2);
    zacc1 += __shfl_xor_sync(0xffffffffu, zacc1, 1);
    zacc1 += __shfl_xor_sync(0xffffffffu, zacc1, 2);
  }
  __syncthreads();  // every warp is past its last stage read
  float* mo = reinterpret_cast<float*>(ring);  // [ROWS][DV] then m [ROWS], l [ROWS]
  const float ounit = VSM == KVC_SC_PAGE || VSM == KVC_SC_TOKEN || VSM == KVC_SC_TOKZP
                          ? exp2f(static_cast<float>(vexp)) : 1.f;  // O's units back to 1
  float* ml = mo + ROWS * DV;
#pragma unroll
  for (int nb = 0; nb < OT; ++nb)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      int r = g + 8 * (c >> 1);
      const int col = 2 * t + (c & 1);  // column of the n-tile -> value element
      int dv = Gm::VEPU * (col + 8 * (nb / Gm::VEPU)) + nb % Gm::VEPU;
      if constexpr (PVT) {  // tile (mt, nr): M row g / g + 8 = element 2 (mt % (VEPU / 2)) / + 1
        const int mt = nb / NR, nr = nb % NR;
        r = 8 * nr + col;
        dv = Gm::VEPU * (g + 8 * (mt / (Gm::VEPU / 2))) + 2 * (mt % (Gm::VEPU / 2)) + (c >> 1);
      }
      if (r < ROWS) {
        if constexpr (I4NV) {  // codes came as c * 2^-24 (rows g) / 16 c * 2^-24 (rows g + 8);
          // the zero points' term of row r is added at the warps' merge (its lanes hold row g's)
          mo[r * DV + dv] = o[nb][c] * (ounit * ((c >> 1) ? 0x1p20f : 0x1p24f));
        } else if constexpr (VSM == KVC_SC_TOKZP) {
          mo[r * DV + dv] = o[nb][c] * ounit + (c < 2 ? zacc0 : zacc1);
        } else {
          mo[r * DV + dv] = o[nb][c] * ounit;
        }
      }
    }
  if (SWQ && g == 0) {  // rows 2t, 2t + 1
    ml[2 * t] = m0;
    ml[2 * t + 1] = m1;
    ml[ROWS + 2 * t] = l0;
    ml[ROWS + 2 * t + 1] = l1;
    ml[2 * ROWS + 2 * t] = zacc0;
    ml[2 * ROWS + 2 * t + 1] = zacc1;
  }
  if (!SWQ && t == 0) {
    ml[g] = m0;
    ml[ROWS + g] = l0;
    if (ROWS == 16) {
      ml[g + 8] = m1;
      ml[ROWS + g + 8] = l1;
    }
    if constexpr (I4NV) {  // the values' zero-point term of rows g, g + 8
      ml[2 * ROWS + g] = zacc0;
      if (ROWS == 16) ml[2 * ROWS + g + 8] = zacc1;
    }
  }
  __syncthreads();
  const int slot = NS * Gm::STAGE_ALIGNED / 4;  // floats between two warps' rings
  const float* all = reinterpret_cast<const float*>(stages);
  for (int e = threadIdx.x; e < R * DV; e += WARPS * 32) {
    const int r = e / DV, dv = e % DV;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, all[w * slot + ROWS * DV + r]);
    const float Ms = M == NEG_INF ? 0.f : M;
    float lsum = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float mw = all[w * slot + ROWS * DV + r];
      const float sw = mw == NEG_INF ? 0.f : exp2f(mw - Ms);
      lsum += all[w * slot + ROWS * DV + ROWS + r] * sw;
      if constexpr (I4NV) {
        acc += (all[w * slot + r * DV + dv] + all[w * slot + ROWS * DV + 2 * ROWS + r]) * sw;
      } else {
        acc += all[w * slot + r * DV + dv] * sw;
      }
    }
    const float outv = lsum == 0.f ? 0.f : acc / lsum * vt;  // NaN propagates
    const long long qrow = (b * Hq + (long long)h * G + r / SQ) * SQ + r % SQ;
    if (p.direct) {
      store_o<QT>(p.out, qrow * DV + dv, outv);
    } else {
      p.acc[(qrow * p.num_splits + split) * DV + dv] = outv;
      if (dv == 0) p.lse[qrow * p.num_splits + split] = lsum == 0.f ? NEG_INF : Ms + log2f(lsum);
    }
  }
}

}  // namespace kvc
