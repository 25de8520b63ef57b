// Absorbed MLA decode over latent pages for Hopper (sm_90), CUDA C++ (issue 22; opt-in, the
// Triton kernel of kernels/latent_decode.py stays the default until timed on the H200):
//
//   out[b, h, :] = softmax_j(q[b, h] . [c_j, r_j] * scale) @ c_j      (one latent per token,
//                                                                     shared by every head)
//
// q [B, H, R + DR] (absorbed query), c latent pages [N, 1, P, R], r rotary-key pages [N, 1, P, DR]
// (each bf16 / fp16 / fp8 with one fp32 scale a page), block tables, sequence lengths. GQA with one
// kv head: 16 query heads are exactly one m16 row block of mma.sync (32 heads: two CTAs, the second
// one's pages from L2). It shares paged_decode.cuh's helpers (cp.async, mma.sync m16n8k16, the fp8
// conversions, the emulation) and nothing else: that kernel is unchanged.
//
// Why a kernel of its own and not a mode of paged_decode: there one warp owns a whole [rows, DV]
// accumulator (DV / 8 n-tiles x 4 floats a thread): 256 registers at DV 512. Here the 4 warps of
// a CTA (sequence b, head block, split) share each 64-token tile instead:
//   1. scores: warp w takes the tile's tokens 16 w .. 16 w + 15 (two n-tiles of 8) against all
//      R + DR dims (36 k-steps, q's A fragments read from shared memory, shared by both n-tiles);
//   2. the tile's row max: quad shuffles, then one exchange of 4 x 16 floats through shared
//      memory (barrier); every warp then holds the same running max m, rescales its own part
//      of O and its partial row sums l by the same factor;
//   3. P (16 x 64, p times the latent page's scale, f16 / bf16) to shared memory (barrier);
//   4. O[16, R] += P V: warp w owns output columns [w R / 4, (w + 1) R / 4) (16 n-tiles x 4 =
//      64 f32 registers a thread), 4 k-steps of 16 tokens, V = the first R latent dims of the
//      same shared tile (no second read of the page).
// The tiles stream through a ring of NS half-tile stages (32 tokens each) filled by cp.async
// (16-byte copies, zero-filled past the split's end): a tile computes from two stages while the
// other NS - 2 are in flight, so a ring of 73 KB bf16 tiles that holds only two whole tiles still
// keeps 1.5 tiles in flight (NS 5: 112 KB, 203 KB in all, one CTA an SM); fp8 latent pages (+ a
// bf16 rotary key): 21 KB a stage, NS 10 (8 in flight, 168 KB; 227 KB in all), or NS 4 (103 KB)
// for two CTAs an SM. Each stage's page ids are read one iteration before its copies are issued
// (plain loads into registers, off the critical path). Shared rows are padded to
// 16 mod 128 bytes and each thread of a quad owns 16-byte chunks 8 m + 2 t + {0, 1} of a row:
// the score loads (lds128 by row g, chunk by t) and the value loads (rows 2 t.., unit g) are
// free of bank conflicts. q.k sums over d, so d is permuted alike for q and the keys.
//
// LW = 8 (opt-in, the launcher's warps=8): the same with 8 warps, 8 tokens a warp in the scores
// (one n-tile) and 64 output columns a warp (8-byte fp8 value units): two warps a scheduler at one
// CTA an SM, at the price of q's fragments read twice as often.
// Splits write unnormalized partial outputs and (max, sum) in log2 units, the layout
// latent_decode.py's merge kernel reads: acc [B, S, H, R], ml [B, S, H, 2]; one split writes out
// [B, H, R] fp32 normalized. Built with -DKVC_EMU (emu/emu_latent.cpp) it runs on the CPU.
#pragma once
#include "paged_decode.cuh"

struct LatentParams {
  const void* q;         // [B, H, R + DR]    f16 / bf16 / f32, last dim contiguous
  const uint8_t* c;      // [N, 1, P, R]      latent codes (fp8) or elements (f16 / bf16)
  const uint8_t* r;      // [N, 1, P, DR]     rotary keys
  const float* cs;       // [N]               latent page scales (fp8), else null
  const float* rs;       // [N]               rotary page scales (fp8), else null
  const int* bt;         // [B, stride_bt]    block tables
  const int* seq_lens;   // [B]
  float* out;            // [B, H, R]         normalized (one split)
  float* acc;            // [B, S, H, R]      unnormalized partial outputs (splits)
  float* ml;             // [B, S, H, 2]      their (max, sum), log2 units
  long long stride_qb, stride_qh, stride_bt;
  int H, num_splits, tiles_per_split, direct;
  float qk_scale;        // scale * log2(e)
  unsigned long long* prof;  // [grid, LAT_PROF_SLOTS] (variant bit LAT_VAR_PROF), else null
  int* cnt;              // [B * head blocks] arrivals, zero between launches (LAT_VAR_FMERGE)
  const uint8_t* km;     // [B, n_km] key mask (0 hides key j; j >= n_km seen), else null
  int n_km;
  float* scores;         // [B, H, scores_len] each key's score, log2 units (H2O), else null;
  int scores_len;        // with it, ml is written for one split too ([B, 1, H, 2])
};

namespace kvc {

constexpr int LAT_TILE = 64;  // tokens an iteration: 16 a warp
constexpr int LAT_HALF = 32;  // tokens a ring stage: a tile is two stages

template <int CK, int RK, int R, int DR, int LOG2P, int NS, int LW = 4, bool WIDE = false>
struct LatGeo {
  static constexpr int CEB = CK >= KVC_F16 ? 2 : 1, REB = RK >= KVC_F16 ? 2 : 1;
  static constexpr bool CSC = CK <= KVC_E5M2, RSC = RK <= KVC_E5M2;  // page-scaled fp8
  static constexpr int P = 1 << LOG2P;
  static constexpr int PROWS = P < LAT_HALF ? P : LAT_HALF;  // a stage's rows from one page
  static constexpr int PPT = LAT_HALF / PROWS;                // pages a stage
  static constexpr int NCC = R * CEB / 16, NCR = DR * REB / 16, NCH = NCC + NCR;  // chunks
  static constexpr int ROWB = (NCH * 16 + 127) / 128 * 128 + 16;  // 16 mod 128: no conflicts
  static constexpr int SC_OFF = LAT_HALF * ROWB;              // per page: c scale, r scale
  static constexpr int STAGE = (SC_OFF + (CSC || RSC ? 8 * PPT : 0) + 127) / 128 * 128;
  static constexpr int QROWB = (R + DR) * 2 + 8;              // q in shared: 16-bit, 8 mod 128
  static constexpr int RED_OFF = (16 * QROWB + 127) / 128 * 128;
  static constexpr int P_OFF = RED_OFF + LW * 16 * 4;
  static constexpr int PROWB = LAT_TILE * 2 + 16;             // P row: 16 mod 128
  static constexpr int WROWB = R * 2 + 16;                    // WIDE: a 16-bit latent row
  static constexpr int W_OFF = (P_OFF + 16 * PROWB + 127) / 128 * 128;
  static constexpr int RING_OFF = W_OFF + (WIDE ? (LAT_TILE * WROWB + 127) / 128 * 128 : 0);
  static constexpr int SMEM = RING_OFF + NS * STAGE;
  static constexpr int CEPC = 16 / CEB, REPC = 16 / REB;      // elements a chunk
  static constexpr int CKPC = CEPC / 4, RKPC = REPC / 4;      // k-steps a chunk
  static constexpr int TW = LAT_TILE / LW, NTW = TW / 8;      // a warp's tokens, n-tiles
  static constexpr int VEB = WIDE ? 2 : CEB;                   // value element bytes read
  static constexpr int WB = R * VEB / LW;                     // a warp's output columns, bytes
  static constexpr int VU = WB >= 128 ? 16 : 8;               // value unit a thread loads
  static constexpr int UW = WB / VU;                          // value units a warp
  static constexpr int VUT = UW / 8;                          // ... a thread (g)
  static constexpr int VEPU = VU / VEB;                       // value elements a unit
  static constexpr int NT = VUT * VEPU;                       // n-tiles of O a warp
  static_assert(LW == 4 || LW == 8, "4 or 8 warps");
  static_assert(!WIDE || WROWB >= R * 2 + 16, "WIDE: a unit of padding (lat_wpos)");
  static_assert(NCC % 32 == 0 && WB >= 64 && UW % 8 == 0,
                "latent rows of 512 bytes or more (R 256 bf16, R 512 fp8)");
  static_assert(NCR == 4 || NCR % 8 == 0, "rotary rows of 64 bytes or a multiple of 128");
  static_assert(SMEM <= 232448, "shared memory over the sm_90 limit: fewer stages");
};

// the n-th 16-byte chunk thread t (of a quad) owns in a row of nch chunks
__device__ __forceinline__ int lat_own(int t, int n, int nch) {
  return nch >= 8 ? 8 * (n >> 1) + 2 * t + (n & 1) : t;
}

// two fp8 codes, the 16-bit half HI of x, -> f16x2 (paged_decode.cuh's fp8x2_to_f16x2 takes the
// low half; there the high half costs a SHF a pair, here ptxas reads it as the F2FP's .H1
// operand: 128 SHF a tile a warp fewer in the base kernel)
template <int KIND, int HI>
__device__ __forceinline__ uint32_t lat_cvt8(uint32_t x) {
#ifdef KVC_EMU
  return fp8x2_to_f16x2<KIND>(HI ? x >> 16 : x & 0xffffu);
#else
  uint32_t r;
  if constexpr (KIND == KVC_E5M2) {
    if constexpr (HI)
      asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e5m2x2 %0, hi;\n}\n"
          : "=r"(r) : "r"(x));
    else
      asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e5m2x2 %0, lo;\n}\n"
          : "=r"(r) : "r"(x));
  } else {
    if constexpr (HI)
      asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
          : "=r"(r) : "r"(x));
    else
      asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
          : "=r"(r) : "r"(x));
  }
  return r;
#endif
}

struct __align__(16) float4v { float x, y, z, w; };
constexpr int LAT_PROF_SLOTS = 12;

// 16 bytes to shared memory (a plain store, as P's: ordered by the kernel's barriers)
__device__ __forceinline__ void lat_sts128(uint8_t* p, const uint4& v) {
  *reinterpret_cast<uint4*>(p) = v;
}

// LAT_VAR_PROF's clocks: the global timer (ns, comparable across SMs), the SM's cycle counter,
// the SM id. The emulation counts calls instead (monotonic, so the recorded order is checked).
__device__ __forceinline__ unsigned long long lat_gtimer() {
#ifdef KVC_EMU
  static unsigned long long n = 0;
  return ++n;
#else
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}
__device__ __forceinline__ long long lat_clock() {
#ifdef KVC_EMU
  static long long n = 0;
  return ++n;
#else
  return clock64();
#endif
}
__device__ __forceinline__ unsigned lat_smid() {
#ifdef KVC_EMU
  return 0;
#else
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
#endif
}
// LAT_VAR_FMERGE: the arrival count (returns the value before), the fence, and L1-bypassing
// loads of the other CTAs' partials (their lines were never in this SM's L1, but .cg says so).
// The emulation runs CTAs one after another, so plain memory is enough there.
__device__ __forceinline__ int lat_arrive(int* c) {
#ifdef KVC_EMU
  return (*c)++;
#else
  return atomicAdd(c, 1);
#endif
}
__device__ __forceinline__ void lat_fence() {
#ifndef KVC_EMU
  __threadfence();
#endif
}
__device__ __forceinline__ float4v lat_ldcg4(const float* p) {
#ifdef KVC_EMU
  return float4v{p[0], p[1], p[2], p[3]};
#else
  float4v v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
#endif
}
__device__ __forceinline__ float lat_ldcg(const float* p) {
#ifdef KVC_EMU
  return *p;
#else
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
#endif
}

// WIDE: where 16-byte unit u of a widened latent row `row` lives in it. Rows are 16 mod 128
// bytes apart; a unit's bit 3 flips its bit 0 and odd rows rotate by one unit, so that both the
// scores' stores (lanes g, t: units 4 t + .. of rows g, g + 8) and P V's loads (units g + 8 i
// of rows 2 t ..) touch 8 different 16-byte bank groups in each 8-lane phase (plain order: the
// stores of lanes t and t + 2 share banks, 2-way). Unit 64 is the row's 16 padding bytes.
__device__ __forceinline__ int lat_wpos(int u, int row) {
  return (u ^ ((u >> 3) & 1)) + (row & 1);
}

// b0 / b1 of mma m16n8k16 (keys as B: k = 4 consecutive elements of a chunk, h-th group)
template <int KIND>
__device__ __forceinline__ void lat_kfrag(const uint4& w, int h, uint32_t& b0, uint32_t& b1) {
  if constexpr (KIND >= KVC_F16) {
    b0 = word(w, 2 * h);
    b1 = word(w, 2 * h + 1);
  } else {
    const uint32_t x = word(w, h);
    b0 = lat_cvt8<KIND, 0>(x);
    b1 = lat_cvt8<KIND, 1>(x);
  }
}

// Variant bits (VAR; latent_sm90.py VARIANTS), 0 = the kernel as described above:
//   LAT_VAR_ALU_K: fp8 latent keys widened by integer ops (paged_decode.cuh's
//     fp8x4_to_f16x2x2_alu: prmt + shift + and) instead of F2FP for the scores, the values
//     still by F2FP: the conversions split between the INT and XU pipes (an fp8 tile otherwise
//     takes 256 F2FP a thread, 8 cycles each a warp: 2,048 of the 2,620 cycles a tile may take
//     at 80% of copy). q's latent part is stored in shared memory with each group of 4 in the
//     order 0, 2, 1, 3 (the order the widening pairs the codes in); e4m3 lands as x * 2^-8, the
//     2^8 goes into the scores' page scale. e4m3 NaN codes then read as +-480 (not NaN).
//   LAT_VAR_ALU_V: the values (P V) widened by integer ops too (paged_decode.cuh's ALU_V forms:
//     e4m3 through prmt with sign replication, shift and mask, the 2^8 into P; e5m2 by prmt);
//     with ALU_K ("alu") no F2FP is left but the rotary key's.
//   LAT_VAR_WIDE (fp8 latent pages; "wide"): each latent code is widened once a tile, not twice:
//     the scores' F2FP results (keys, in memory order) are also stored to a 16-bit copy of the
//     tile's 64 latent rows in shared memory (rows of R * 2 + 16 bytes), and P V reads its
//     values from there as the bf16 / fp16 kernel does (no conversion in P V). An fp8 tile
//     otherwise widens its first R dims twice (as keys by the warp that owns the token, as
//     values by the warp that owns the column): 256 F2FP a tile a thread, 144 here. Costs
//     64 KB of shared memory (fewer ring stages) and 32 STS.128 a thread a tile.
#define LAT_VAR_ALU_K 1
#define LAT_VAR_ALU_V 2
//   LAT_VAR_PROF (any pages; the launcher's profile=...): thread 0 of each CTA records, into
//     p.prof[CTA][LAT_PROF_SLOTS] (CTA = blockIdx.x * splits + blockIdx.y): the global timer
//     (ns) at entry, q in shared memory, tile 0 landed, the loop's end, the partials stored,
//     the fused merge done (0 when none); the SM id; the CTA's tiles; warp 0's cycles
//     (clock64, summed over tiles) waiting for a tile (cp.async wait + barrier), scoring it
//     (to the row maxima), in the softmax (two barriers), and issuing P V. For finding a
//     launch's fixed part (benchmarks/bench_latent_decode.py --cuda base:prof).
//   LAT_VAR_FMERGE (any pages; fused_merge=True): the splits merged by the last CTA of each
//     (sequence, head block) to store its partials (an atomic arrival count in p.cnt, which
//     that CTA sets back to 0), instead of a second launch (latent_decode.merge_launch).
#define LAT_VAR_WIDE 4
#define LAT_VAR_PROF 8
#define LAT_VAR_FMERGE 16
#define LAT_VAR_RESCALE 32  // every tile rescales O (the kernel before mla22k; benchmarks' A/B)
//   LAT_VAR_KSPLIT (any pages; "ksplit"): the scores split over the warps by k (4 warps: each
//     all 64 tokens over a quarter of the 576 dims; 8 warps: 32 tokens each, the same quarters;
//     the warp's q fragments in registers for the whole loop) instead of by token (each warp:
//     16 / 8 tokens over all dims, q's 18 KB of fragments read from shared memory by every warp
//     every tile: ~38% of an fp8 tile's shared traffic at 4 warps, twice that at 8); the
//     partial scores are added through shared memory (one barrier more a tile).
#define LAT_VAR_KSPLIT 64
//   LAT_VAR_OSTAGE (any pages; "ostage"): the CTA's O [16, R] (normalized or partial) staged
//     through shared memory and stored as whole rows of 16-byte stores, not as each thread's
//     4-byte elements (32 B apart: 8 rows x 4 sectors a warp instruction, 64 instructions a
//     thread at the end of every CTA).
#define LAT_VAR_OSTAGE 128
//   LAT_VAR_MASKED (any pages; set by the launcher, not a variant name): the key mask (p.km)
//     and H2O's scores (p.scores) are read where given; without the bit neither is (the
//     base loop's instructions unchanged: every tile's first token is seen, so its max is
//     finite)
#define LAT_VAR_MASKED 256

template <int CK, int RK, int R, int DR, int LOG2P, int NS, int QT, int VAR = 0, int LW = 4>
__device__ __forceinline__ void latent_decode(const LatentParams& p) {
  constexpr bool WIDE = (VAR & LAT_VAR_WIDE) && CK <= KVC_E5M2;
  using Gm = LatGeo<CK, RK, R, DR, LOG2P, NS, LW, WIDE>;
  static_assert(NS >= 4, "four half-tile stages or more (two computed, two or more loading)");
  constexpr bool CBF = CK == KVC_BF16, RBF = RK == KVC_BF16;
  constexpr bool ALUK = (VAR & LAT_VAR_ALU_K) && Gm::CEB == 1 && !WIDE;
  constexpr float K_ALU = ALUK && CK == KVC_E4M3 ? 256.f : 1.f;
  constexpr bool ALUV = (VAR & LAT_VAR_ALU_V) && Gm::CEB == 1 && !WIDE;
  constexpr float V_ALU = ALUV && CK == KVC_E4M3 ? 256.f : 1.f;  // 2^8 back into P
  constexpr bool PROF = VAR & LAT_VAR_PROF, FMERGE = VAR & LAT_VAR_FMERGE;
  constexpr bool KSPLIT = VAR & LAT_VAR_KSPLIT, OSTAGE = VAR & LAT_VAR_OSTAGE;
  constexpr bool MASKED = VAR & LAT_VAR_MASKED;
  constexpr int P = Gm::P, D = R + DR;
  const float NEG_INF = -INFINITY;
  unsigned long long pt[6] = {PROF ? lat_gtimer() : 0ull, 0ull, 0ull, 0ull, 0ull, 0ull};
  long long pc[4] = {0, 0, 0, 0}, ck0 = 0, ck1 = 0;  // PROF: warp 0's phase cycles
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int H = p.H, HB = (H + 15) / 16;
  const int b = blockIdx.x / HB, hb = blockIdx.x % HB;
  const int split = blockIdx.y;
  const int L = p.seq_lens[b];
  const int start = split * p.tiles_per_split * LAT_TILE;
  const int end = min(L, start + p.tiles_per_split * LAT_TILE);
  const int ntiles = end > start ? (end - start + LAT_TILE - 1) / LAT_TILE : 0;
  uint8_t* qs = smem;
  float* red = reinterpret_cast<float*>(smem + Gm::RED_OFF);  // [LW][16]
  uint8_t* ps = smem + Gm::P_OFF;                              // [16][LAT_TILE] 16-bit
  uint8_t* ring = smem + Gm::RING_OFF;
  uint8_t* wbuf = smem + Gm::W_OFF;                            // WIDE: [LAT_TILE][WROWB]
  const int* btb = p.bt + (long long)b * p.stride_bt;

  // ---- the page ids of tile `tile` (0 past the split's end: those rows are zero-filled)
  const int nhalf = 2 * ntiles;
  auto load_pids = [&](int hs, int (&pid)[Gm::PPT]) {  // of half-tile stage hs
#pragma unroll
    for (int k = 0; k < Gm::PPT; ++k) {
      const int tok = start + hs * LAT_HALF + k * Gm::PROWS;
      pid[k] = hs < nhalf && tok < end ? btb[tok >> LOG2P] : 0;
    }
  };
  // ---- cp.async of half tile hs into stage hs % NS (one commit group, empty past the end)
  // Thread tid copies latent chunk column tid % NCC of rows tid / NCC + RP n (RP = 128 / NCC
  // rows a pass, NCC a power of two): its source and destination move by constants from one
  // chunk to the next, and chunk n's page slot (RP n / PROWS) is a compile-time index. Rows past
  // the split's end read 0 bytes (zero-filled) from a valid address (page 0 where the entry was
  // not read).
  constexpr int RP = LW * 32 / Gm::NCC;                 // latent rows a pass
  constexpr int RPR = LW * 32 / Gm::NCR;                // rotary rows a pass (may pass 32)
  static_assert(Gm::NCC <= LW * 32 && (LW * 32) % Gm::NCC == 0 &&
                (LW * 32) % Gm::NCR == 0 && Gm::PROWS % RP == 0, "chunk layout");
  const int c_row0 = tid / Gm::NCC, c_off = tid % Gm::NCC * 16;
  const int r_row0 = tid / Gm::NCR, r_off = tid % Gm::NCR * 16;
  auto issue = [&](int hs, const int (&pid)[Gm::PPT]) {
    if (hs < nhalf) {
      uint8_t* st = ring + (hs % NS) * Gm::STAGE;
      const int tok0 = start + hs * LAT_HALF;
      const int in0 = P > LAT_HALF ? (tok0 & (P - 1)) : 0;  // the stage's first row in its page
      const int left = end - tok0;                          // rows with data
      const uint32_t dst0 = smem_u32(st + c_row0 * Gm::ROWB + c_off);
#pragma unroll
      for (int k = 0; k < Gm::PPT; ++k) {
        const uint8_t* src0 = p.c + ((long long)pid[k] * P + in0 + c_row0) * (R * Gm::CEB) +
                              c_off;
#pragma unroll
        for (int n = k * Gm::PROWS / RP; n < (k + 1) * Gm::PROWS / RP; ++n) {
          const int dr = RP * n - k * Gm::PROWS;  // rows past the page slot's first
          cp_async16(dst0 + RP * n * Gm::ROWB, src0 + dr * (R * Gm::CEB),
                     c_row0 + RP * n < left ? 16 : 0);
        }
      }
#pragma unroll
      for (int n = 0; n < (RPR < LAT_HALF ? LAT_HALF / RPR : 1); ++n) {
        const int row = r_row0 + RPR * n;
        if (RPR > LAT_HALF && row >= LAT_HALF) break;  // 8 warps, fp8 rotary rows: half idle
        int pg = pid[0];
#pragma unroll
        for (int k = 1; k < Gm::PPT; ++k) pg = row >= k * Gm::PROWS ? pid[k] : pg;
        const uint8_t* src = p.r + ((long long)pg * P + in0 + (row & (Gm::PROWS - 1))) *
                                       (DR * Gm::REB) + r_off;
        cp_async16(smem_u32(st + row * Gm::ROWB + Gm::NCC * 16 + r_off), src,
                   row < left ? 16 : 0);
      }
      if constexpr (Gm::CSC || Gm::RSC) {
#pragma unroll
        for (int k = 0; k < Gm::PPT; ++k) {
          const bool ok = k * Gm::PROWS < left;
          if (tid == 2 * k && Gm::CSC)
            cp_async4(smem_u32(st + Gm::SC_OFF + 8 * k), p.cs + pid[k], ok ? 4 : 0);
          if (tid == 2 * k + 1 && Gm::RSC)
            cp_async4(smem_u32(st + Gm::SC_OFF + 8 * k + 4), p.rs + pid[k], ok ? 4 : 0);
        }
      }
    }
    cp_commit();
  };

  // ---- q's loads first: they depend on nothing, and the copies below wait for their page ids
  // (issued after them, q's loads would start one page-id latency later; mla22k)
  const int h0 = hb * 16;
  constexpr int QCR = D / 8;                                 // 8-element runs a q row
  constexpr int NQC = (16 * QCR + LW * 32 - 1) / (LW * 32);  // ... a thread
  float xq[NQC][8];
#pragma unroll
  for (int k = 0; k < NQC; ++k) {  // rows past H (and runs past the end) read a valid row
    const int c = min(tid + k * LW * 32, 16 * QCR - 1), rr = c / QCR, dd = c % QCR * 8;
    const long long at = b * p.stride_qb + min(h0 + rr, H - 1) * p.stride_qh + dd;
#pragma unroll
    for (int e = 0; e < 8; ++e) xq[k][e] = load_q<QT>(p.q, at + e);
  }

  // ---- prologue: half tiles 0 .. NS - 3 in flight, then q -> shared (overlaps the copies)
  int pid_a[Gm::PPT], pid_b[Gm::PPT];
#pragma unroll
  for (int s = 0; s < NS - 2; ++s) {
    load_pids(s, pid_a);
    issue(s, pid_a);
  }
  load_pids(NS - 2, pid_a);
  load_pids(NS - 1, pid_b);
  // q -> shared in the MMA's fragment order: k-step s of the score loop (latent (n, h), then
  // rotary (n, h)), lane l, 16 bytes = its A registers {row g d0..d0+1, row g+8 d0..d0+1, row g
  // d0+2..d0+3, row g+8 d0+2..d0+3}, d0 the lane's first dim of that k-step. One lds128 a
  // k-step then gives the four registers in place (row-major q took two lds64 a k-step and
  // ~7 register moves to assemble the quad, 250 IMAD.MOV a tile a warp; RESULTS.md, mla22j).
  constexpr int KSL = Gm::NCC / 4 * Gm::CKPC;                        // latent k-steps
  constexpr int KSR = (Gm::NCR >= 8 ? Gm::NCR / 4 : 1) * Gm::RKPC;   // rotary k-steps
  static_assert((KSL + KSR) * 16 == D && (KSL + KSR) * 512 <= Gm::RED_OFF, "q fragments");
  // Two passes: (1) q row-major, 16-bit, into ring stage NS - 1 (its copies are issued only in
  // the loop, after a barrier): a thread's 8-element runs, every load in flight at once (a
  // load -> store loop waited one memory latency a pass, 36 passes at 4 warps), each run stored
  // as two 8-byte words; (2) each thread assembles fragment quads from it (storing each element
  // straight to its slot took ~2,000 instructions of index arithmetic a thread; mla22j).
  {
    uint8_t* qr = ring + (NS - 1) * Gm::STAGE;  // [16][QROWB]
    static_assert(16 * Gm::QROWB <= Gm::STAGE && R % 8 == 0, "q's staging rows");
#pragma unroll
    for (int k = 0; k < NQC; ++k) {
      const int c = tid + k * LW * 32, rr = c / QCR, dd = c % QCR * 8;
      if (c >= 16 * QCR) break;
      const float z = h0 + rr < H ? 1.f : 0.f;
      float* x = xq[k];
      uint32_t w[4];
      if (dd < R && ALUK) {  // ALU_K: groups of 4 in the order 0, 2, 1, 3
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          w[2 * i] = pack2<CBF>(x[4 * i] * z, x[4 * i + 2] * z);
          w[2 * i + 1] = pack2<CBF>(x[4 * i + 1] * z, x[4 * i + 3] * z);
        }
      } else if (dd < R) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = pack2<CBF>(x[2 * i] * z, x[2 * i + 1] * z);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = pack2<RBF>(x[2 * i] * z, x[2 * i + 1] * z);
      }
      uint8_t* dst = qr + rr * Gm::QROWB + 2 * dd;  // 8-byte aligned (QROWB 8 mod 16)
      *reinterpret_cast<uint2*>(dst) = uint2{w[0], w[1]};
      *reinterpret_cast<uint2*>(dst + 8) = uint2{w[2], w[3]};
    }
    __syncthreads();
    for (int f = tid; f < (KSL + KSR) * 32; f += LW * 32) {
      const int s = f >> 5, ln = f & 31, gg = ln >> 2, tt = ln & 3;
      const int d0 = s < KSL ? Gm::CEPC * lat_own(tt, s / Gm::CKPC, Gm::NCC) + 4 * (s % Gm::CKPC)
                             : R + Gm::REPC * lat_own(tt, (s - KSL) / Gm::RKPC, Gm::NCR) +
                                   4 * ((s - KSL) % Gm::RKPC);
      const uint2 a0 = lds64(qr + gg * Gm::QROWB + 2 * d0);
      const uint2 a1 = lds64(qr + (gg + 8) * Gm::QROWB + 2 * d0);
      lat_sts128(qs + f * 16, uint4{a0.x, a1.x, a0.y, a1.y});
    }
  }
  if constexpr (PROF) pt[1] = lat_gtimer();

  // WIDE: the lane's store offsets in its widened rows and its value units' positions
  // (lat_wpos without the row parity, which is known where each load is)
  const int wo0 = 16 * (((t >> 1) & 1) + (g & 1)), wo1 = 16 * ((((t >> 1) & 1) ^ 1) + (g & 1));
  int vpos[Gm::VUT];
#pragma unroll
  for (int i = 0; i < Gm::VUT; ++i) {
    const int u = Gm::UW * warp + g + 8 * i;
    vpos[i] = 16 * (u ^ ((u >> 3) & 1));
  }

  float o[Gm::NT][4];
#pragma unroll
  for (int n = 0; n < Gm::NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  const float qk = p.qk_scale;

  // KSPLIT: the k-steps split 4 ways (kw = warp % 4: latent chunk iterations [KNL kw,
  // KNL (kw + 1)) and rotary k-step kw), the 64 tokens LW / 4 ways (tg = warp / 4: n-tiles
  // [NJ tg, NJ (tg + 1))); the warp's q fragments in registers for the whole loop (read from
  // qs, which the partial scores then reuse)
  constexpr int KNL = Gm::NCC / 4 / 4, KQ = KNL * Gm::CKPC + 1, NJ = 8 * 4 / LW;
  const int kw = warp & 3, tg = warp >> 2;
  uint32_t qr[KSPLIT ? KQ : 1][4];
  if constexpr (KSPLIT) {
    static_assert(KSR == 4 && !WIDE && Gm::NCC / 4 % 4 == 0, "KSPLIT: 4 rotary k-steps");
    static_assert(4 * 8 * 32 * 16 <= Gm::RED_OFF, "KSPLIT: partial sums in q's space");
    __syncthreads();  // q's fragments assembled
#pragma unroll
    for (int i = 0; i < KQ; ++i) {
      const int s = i < KQ - 1 ? kw * KNL * Gm::CKPC + i : KSL + kw;
      const uint4 v = lds128(qs + (s * 32 + lane) * 16);
      qr[i][0] = v.x;
      qr[i][1] = v.y;
      qr[i][2] = v.z;
      qr[i][3] = v.w;
    }
  }

  for (int it = 0; it < ntiles; ++it) {
    if constexpr (PROF) {
      ck0 = lat_clock();
      if (it > 0) pc[3] += ck0 - ck1;
    }
    // committed so far: NS - 2 + 2 it groups; half tiles 2 it and 2 it + 1 must have landed
    cp_wait<NS - 4>();
    __syncthreads();  // tile `it` landed for every thread; every warp is done with it - 1
    if constexpr (PROF) {
      ck1 = lat_clock();
      pc[0] += ck1 - ck0;
      if (it == 0) pt[2] = lat_gtimer();
    }
    issue(2 * it + NS - 2, pid_a);  // into the stages tile it - 1 used
    issue(2 * it + NS - 1, pid_b);
    load_pids(2 * it + NS, pid_a);
    load_pids(2 * it + NS + 1, pid_b);
    const uint8_t* st0 = ring + ((2 * it) % NS) * Gm::STAGE;
    const uint8_t* st1 = ring + ((2 * it + 1) % NS) * Gm::STAGE;
    const uint8_t* st = warp >= LW / 2 ? st1 : st0;  // the warp's TW tokens' stage
    const int wrow = Gm::TW * (warp % (LW / 2));     // ... and their first row there
    const int tok0 = start + it * LAT_TILE;
    // the key mask's bytes of the warp's score tokens (bit 2 j + e: token TW w + 8 j + 2 t + e
    // seen), loaded before the scores' MMAs and applied after them (a uniform branch: no mask,
    // no loads)
    uint32_t seen = 0xfu;
    if (MASKED && p.km != nullptr) {
      const uint8_t* kmr = p.km + (long long)b * p.n_km;
      seen = 0u;
#pragma unroll
      for (int j = 0; j < Gm::NTW; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = tok0 + Gm::TW * warp + 8 * j + 2 * t + e;
          seen |= (tok >= p.n_km || kmr[tok] != 0 ? 1u : 0u) << (2 * j + e);
        }
    }

    float x[2][4], cf[2];  // scaled scores; cf: the latent page scale (and ALU_V's 2^8) P carries
    if constexpr (KSPLIT) {
      // ---- KSPLIT scores: warp (kw, tg), NJ n-tiles (4 warps: all 64 tokens, eight
      // independent MMA chains) over a quarter of the k-steps, q from registers (no q reads
      // from shared memory in the loop: 36 lds128 a warp a tile before); the partial sums, page
      // scales applied, go through shared memory (q's space), and each warp adds the four for
      // its own TW tokens.
      float sl[NJ][4], sp[NJ][4];
#pragma unroll
      for (int jl = 0; jl < NJ; ++jl)
#pragma unroll
        for (int c = 0; c < 4; ++c) sl[jl][c] = sp[jl][c] = 0.f;
      const int nr = kw / Gm::RKPC, hr = kw % Gm::RKPC;  // the warp's rotary k-step
      const int rofs = (Gm::NCC + lat_own(t, nr, Gm::NCR)) * 16 + hr * 4 * Gm::REB;
      const uint8_t* sg = tg * NJ < 4 ? st0 : st1;  // 8 warps: NJ 4, one stage a token group
      float4v* kbuf = reinterpret_cast<float4v*>(qs);  // [4 k parts][8 n-tiles][32 lanes]
      // an n-tile's partial, page scales applied, to kbuf
      auto store_partial = [&](int jl) {
        const int jt = tg * NJ + jl;
        const float* sj = reinterpret_cast<const float*>((jt < 4 ? st0 : st1) + Gm::SC_OFF);
        const int k = (8 * jt) % LAT_HALF / Gm::PROWS;
        const float kf = (Gm::CSC ? sj[2 * k] : 1.f) * K_ALU, rf = Gm::RSC ? sj[2 * k + 1] : 1.f;
        if constexpr (Gm::CSC || Gm::RSC)
          kbuf[(kw * 8 + jt) * 32 + lane] =
              float4v{sl[jl][0] * kf + sp[jl][0] * rf, sl[jl][1] * kf + sp[jl][1] * rf,
                      sl[jl][2] * kf + sp[jl][2] * rf, sl[jl][3] * kf + sp[jl][3] * rf};
        else
          kbuf[(kw * 8 + jt) * 32 + lane] = float4v{sl[jl][0], sl[jl][1], sl[jl][2], sl[jl][3]};
      };
#pragma unroll
      for (int jl = 0; jl < NJ; ++jl) {
        const uint8_t* krow = (NJ == 8 ? (jl < 4 ? st0 : st1) : sg) +
                              ((8 * jl) % LAT_HALF + g) * Gm::ROWB;
#pragma unroll
        for (int nl = 0; nl < KNL; ++nl) {
          const uint4 w0 = lds128(krow + lat_own(t, kw * KNL + nl, Gm::NCC) * 16);
#pragma unroll
          for (int h = 0; h < Gm::CKPC; ++h) {
            uint32_t b0, b1;
            if constexpr (ALUK)
              fp8x4_to_f16x2x2_alu<CK>(word(w0, h), b0, b1);
            else
              lat_kfrag<CK>(w0, h, b0, b1);
            mma16816<CBF>(sl[jl], qr[nl * Gm::CKPC + h], b0, b1);
          }
        }
        uint32_t b0, b1;
        if constexpr (Gm::REB == 2) {
          const uint2 v = lds64(krow + rofs);
          b0 = v.x;
          b1 = v.y;
        } else {
          const uint32_t v = lds32(krow + rofs);
          b0 = lat_cvt8<RK, 0>(v);
          b1 = lat_cvt8<RK, 1>(v);
        }
        mma16816<RBF>(Gm::CSC || Gm::RSC ? sp[jl] : sl[jl], qr[KQ - 1], b0, b1);  // unscaled: one sum
        if constexpr (NJ == 4) store_partial(jl);  // 8 warps: its accumulators die here
      }
      if constexpr (NJ == 8) {  // 4 warps: after all MMAs (stored in the loop, ptxas waits)
#pragma unroll
        for (int jl = 0; jl < NJ; ++jl) store_partial(jl);
      }
      __syncthreads();  // every warp's partial scores
      const float* scl = reinterpret_cast<const float*>(st + Gm::SC_OFF);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (j >= Gm::NTW) {  // 8 warps: one n-tile a warp
          x[j][0] = x[j][1] = x[j][2] = x[j][3] = NEG_INF;
          cf[j] = 0.f;
          continue;
        }
        float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float4v v = kbuf[(w * 8 + Gm::NTW * warp + j) * 32 + lane];
          a[0] += v.x;
          a[1] += v.y;
          a[2] += v.z;
          a[3] += v.w;
        }
        cf[j] = (Gm::CSC ? scl[2 * ((wrow + 8 * j) / Gm::PROWS)] : 1.f) * V_ALU;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int tok = tok0 + Gm::TW * warp + 8 * j + 2 * t + (c & 1);
          x[j][c] = tok < end ? a[c] * qk : NEG_INF;
        }
      }
    } else {
    // ---- scores of the warp's TW tokens (n-tiles j < NTW: tile rows TW w + 8 j + g)
    // two accumulators a latent n-tile (k-step parity): four independent MMA chains, not two
    float sc[2][4], sc2[2][4], sr[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) sc[j][c] = sc2[j][c] = sr[j][c] = 0.f;
    const uint8_t* krow0 = st + (wrow + g) * Gm::ROWB;
    const uint8_t* krow1 = krow0 + (Gm::NTW == 2 ? 8 * Gm::ROWB : 0);
#pragma unroll
    for (int n = 0; n < Gm::NCC / 4; ++n) {
      const int ch = lat_own(t, n, Gm::NCC);
      const uint4 w0 = lds128(krow0 + ch * 16);
      const uint4 w1 = Gm::NTW == 2 ? lds128(krow1 + ch * 16) : w0;
      uint32_t wk0[WIDE ? 2 * Gm::CKPC : 1], wk1[WIDE ? 2 * Gm::CKPC : 1];  // WIDE: f16 keys
#pragma unroll
      for (int h = 0; h < Gm::CKPC; ++h) {
        const uint4 qv = lds128(qs + ((n * Gm::CKPC + h) * 32 + lane) * 16);
        const uint32_t qa[4] = {qv.x, qv.y, qv.z, qv.w};
        uint32_t b0, b1, e0, e1;
        if constexpr (ALUK) {
          fp8x4_to_f16x2x2_alu<CK>(word(w0, h), b0, b1);
          if constexpr (Gm::NTW == 2) fp8x4_to_f16x2x2_alu<CK>(word(w1, h), e0, e1);
        } else {
          lat_kfrag<CK>(w0, h, b0, b1);
          if constexpr (Gm::NTW == 2) lat_kfrag<CK>(w1, h, e0, e1);
        }
        mma16816<CBF>(h & 1 ? sc2[0] : sc[0], qa, b0, b1);
        if constexpr (Gm::NTW == 2) mma16816<CBF>(h & 1 ? sc2[1] : sc[1], qa, e0, e1);
        if constexpr (WIDE) {
          wk0[2 * h] = b0;
          wk0[2 * h + 1] = b1;
          if constexpr (Gm::NTW == 2) {
            wk1[2 * h] = e0;
            wk1[2 * h + 1] = e1;
          }
        }
      }
      if constexpr (WIDE) {  // the chunk's 16 codes as 32 bytes of f16 (units 2 ch, 2 ch + 1)
        // lat_wpos(2 ch + e, row) = 2 ch + (e ^ tf) + (row & 1): bit 3 of 2 ch is bit 1 of t
        // (lat_own), the row's parity is g's; both lane constants, folded into wo0 / wo1
        uint8_t* wr = wbuf + (Gm::TW * warp + g) * Gm::WROWB + 32 * ch;
        lat_sts128(wr + wo0, uint4{wk0[0], wk0[1], wk0[2], wk0[3]});
        lat_sts128(wr + wo1, uint4{wk0[4], wk0[5], wk0[6], wk0[7]});
        if constexpr (Gm::NTW == 2) {
          wr += 8 * Gm::WROWB;
          lat_sts128(wr + wo0, uint4{wk1[0], wk1[1], wk1[2], wk1[3]});
          lat_sts128(wr + wo1, uint4{wk1[4], wk1[5], wk1[6], wk1[7]});
        }
      }
    }
#pragma unroll
    for (int n = 0; n < (Gm::NCR >= 8 ? Gm::NCR / 4 : 1); ++n) {
      const int ch = lat_own(t, n, Gm::NCR);
      const uint4 w0 = lds128(krow0 + (Gm::NCC + ch) * 16);
      const uint4 w1 = Gm::NTW == 2 ? lds128(krow1 + (Gm::NCC + ch) * 16) : w0;
#pragma unroll
      for (int h = 0; h < Gm::RKPC; ++h) {
        const uint4 qv = lds128(qs + ((KSL + n * Gm::RKPC + h) * 32 + lane) * 16);
        const uint32_t qa[4] = {qv.x, qv.y, qv.z, qv.w};
        uint32_t b0, b1;
        lat_kfrag<RK>(w0, h, b0, b1);
        mma16816<RBF>(sr[0], qa, b0, b1);
        if constexpr (Gm::NTW == 2) {
          lat_kfrag<RK>(w1, h, b0, b1);
          mma16816<RBF>(sr[1], qa, b0, b1);
        }
      }
    }

    // ---- scaled scores (log2 units), tokens past the split's end masked
    const float* scl = reinterpret_cast<const float*>(st + Gm::SC_OFF);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (j >= Gm::NTW) {  // 8 warps: one n-tile a warp
        x[j][0] = x[j][1] = x[j][2] = x[j][3] = NEG_INF;
        cf[j] = 0.f;
        continue;
      }
      const int k = (wrow + 8 * j) / Gm::PROWS;
      cf[j] = Gm::CSC ? scl[2 * k] : 1.f;
      const float rf = Gm::RSC ? scl[2 * k + 1] : 1.f;
      const float kf = cf[j] * K_ALU;
      cf[j] *= V_ALU;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int tok = tok0 + Gm::TW * warp + 8 * j + 2 * t + (c & 1);
        x[j][c] = tok < end ? ((sc[j][c] + sc2[j][c]) * kf + sr[j][c] * rf) * qk : NEG_INF;
      }
    }
    }  // !KSPLIT
    if (MASKED && seen != 0xfu) {  // hidden keys: -inf, as the tokens past the split's end
#pragma unroll
      for (int j = 0; j < Gm::NTW; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (!((seen >> (2 * j + (c & 1))) & 1u)) x[j][c] = NEG_INF;
    }
    float mx0 = fmaxf(fmaxf(x[0][0], x[0][1]), fmaxf(x[1][0], x[1][1]));
    float mx1 = fmaxf(fmaxf(x[0][2], x[0][3]), fmaxf(x[1][2], x[1][3]));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    if constexpr (PROF) {
      ck0 = lat_clock();
      pc[1] += ck0 - ck1;
    }
    if (t == 0) {
      red[warp * 16 + g] = mx0;
      red[warp * 16 + g + 8] = mx1;
    }
    __syncthreads();  // the warps' row maxima
#pragma unroll
    for (int w = 0; w < LW; ++w) {
      mx0 = fmaxf(mx0, red[w * 16 + g]);
      mx1 = fmaxf(mx1, red[w * 16 + g + 8]);
    }
    // mx is -inf only where a key mask hides every token of the tile (and every earlier
    // one): then m stays -inf and the tile's p are 0 (MASKED: exp2 against 0, not -inf)
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    // O and l are rescaled only in tiles that raise some row's max (every warp sees the same
    // maxima, so the branch is uniform over the CTA): exp2(0) is exactly 1, so skipping is
    // bit-identical; past the first tiles most tiles skip 64 FMULs a thread (fp8: ~6% of the
    // loop's issue slots, mla22k)
    const bool grow = __any_sync(0xffffffffu, n0 > m0 || n1 > m1);
    const float a0 = m0 == NEG_INF ? 0.f : exp2f(m0 - n0);
    const float a1 = m1 == NEG_INF ? 0.f : exp2f(m1 - n1);
    m0 = n0;
    m1 = n1;
    const float e0 = MASKED && m0 == NEG_INF ? 0.f : m0;
    const float e1 = MASKED && m1 == NEG_INF ? 0.f : m1;
    float lsum0 = 0.f, lsum1 = 0.f;
#pragma unroll
    for (int j = 0; j < Gm::NTW; ++j) {
      const float p0 = exp2f(x[j][0] - e0), p1 = exp2f(x[j][1] - e0);
      const float p2 = exp2f(x[j][2] - e1), p3 = exp2f(x[j][3] - e1);
      lsum0 += p0 + p1;
      lsum1 += p2 + p3;
      const int col = 2 * (Gm::TW * warp + 8 * j + 2 * t);  // byte offset of the token pair
      *reinterpret_cast<uint32_t*>(ps + g * Gm::PROWB + col) = pack2<CBF>(p0 * cf[j], p1 * cf[j]);
      *reinterpret_cast<uint32_t*>(ps + (g + 8) * Gm::PROWB + col) =
          pack2<CBF>(p2 * cf[j], p3 * cf[j]);
    }
    if (MASKED && p.scores != nullptr) {
      // H2O: each key's score (log2 units, hidden keys -inf) for its attention mass
      // (latent_sm90.py: the probabilities under each head's final lse)
#pragma unroll
      for (int j = 0; j < Gm::NTW; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int tok = tok0 + Gm::TW * warp + 8 * j + 2 * t + (c & 1);
          const int h = h0 + g + 8 * (c >> 1);
          if (h < H && tok < end && tok < p.scores_len)
            p.scores[((long long)b * H + h) * p.scores_len + tok] = x[j][c];
        }
    }
    if (grow || (VAR & LAT_VAR_RESCALE)) {
      l0 = l0 * a0 + lsum0;
      l1 = l1 * a1 + lsum1;
#pragma unroll
      for (int n = 0; n < Gm::NT; ++n) {
        o[n][0] *= a0;
        o[n][1] *= a0;
        o[n][2] *= a1;
        o[n][3] *= a1;
      }
    } else {
      l0 += lsum0;
      l1 += lsum1;
    }
    __syncthreads();  // P of the whole tile
    if constexpr (PROF) {
      ck1 = lat_clock();
      pc[2] += ck1 - ck0;
    }

    // ---- O[:, warp's columns] += P V, V = the tile's latent rows (tokens as k)
#pragma unroll
    for (int ks = 0; ks < LAT_TILE / 16; ++ks) {
      uint32_t pa[4];
      pa[0] = lds32(ps + g * Gm::PROWB + 2 * (16 * ks + 2 * t));
      pa[1] = lds32(ps + (g + 8) * Gm::PROWB + 2 * (16 * ks + 2 * t));
      pa[2] = lds32(ps + g * Gm::PROWB + 2 * (16 * ks + 2 * t + 8));
      pa[3] = lds32(ps + (g + 8) * Gm::PROWB + 2 * (16 * ks + 2 * t + 8));
      constexpr int VROWB = WIDE ? Gm::WROWB : Gm::ROWB;
      const uint8_t* vb0 = WIDE ? wbuf + 16 * ks * Gm::WROWB
                                : (ks >= 2 ? st1 : st0) + (16 * (ks & 1)) * Gm::ROWB;
#pragma unroll
      for (int i = 0; i < Gm::VUT; ++i) {
        const int u = Gm::UW * warp + g + 8 * i;
        auto unit = [&](int row) {  // VU bytes of a value row (8 warps, fp8: 8 bytes)
          const uint8_t* a = vb0 + row * VROWB + (WIDE ? vpos[i] + 16 * (row & 1) : Gm::VU * u);
          if constexpr (Gm::VU == 16) {
            return lds128(a);
          } else {
            const uint2 h = lds64(a);
            return uint4{h.x, h.y, 0u, 0u};
          }
        };
        const uint4 va = unit(2 * t), vb = unit(2 * t + 1), vc = unit(2 * t + 8),
                    vd = unit(2 * t + 9);
#pragma unroll
        for (int ww = 0; ww < Gm::VU / 4; ++ww) {
          const uint32_t xa = word(va, ww), xb = word(vb, ww), xc = word(vc, ww),
                         xd = word(vd, ww);
          if constexpr (ALUV && CK == KVC_E4M3) {
            // element e of tokens 2t / 2t + 1 straight from the two words (one prmt each)
            const int nb = Gm::VEPU * i + 4 * ww;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const uint32_t sel = 0xc480u + 0x1111u * e;
              mma16816<false>(o[nb + e], pa, e4m3x2_sx_to_f16x2(prmt_sx(xa, xb, sel)),
                              e4m3x2_sx_to_f16x2(prmt_sx(xc, xd, sel)));
            }
          } else if constexpr (ALUV) {  // e5m2: [a_e, a_e+1, b_e, b_e+1] -> even / odd codes
            const uint32_t z0 = __byte_perm(xa, xb, 0x5410), z1 = __byte_perm(xa, xb, 0x7632);
            const uint32_t y0 = __byte_perm(xc, xd, 0x5410), y1 = __byte_perm(xc, xd, 0x7632);
            uint32_t xe0, xo0, xe1, xo1, ye0, yo0, ye1, yo1;
            fp8x4_to_f16x2x2_alu<CK>(z0, xe0, xo0);
            fp8x4_to_f16x2x2_alu<CK>(z1, xe1, xo1);
            fp8x4_to_f16x2x2_alu<CK>(y0, ye0, yo0);
            fp8x4_to_f16x2x2_alu<CK>(y1, ye1, yo1);
            const int nb = Gm::VEPU * i + 4 * ww;
            mma16816<false>(o[nb + 0], pa, xe0, ye0);
            mma16816<false>(o[nb + 1], pa, xo0, yo0);
            mma16816<false>(o[nb + 2], pa, xe1, ye1);
            mma16816<false>(o[nb + 3], pa, xo1, yo1);
          } else if constexpr (Gm::VEB == 1) {
            const uint32_t x0 = __byte_perm(xa, xb, 0x5140), x1 = __byte_perm(xa, xb, 0x7362);
            const uint32_t y0 = __byte_perm(xc, xd, 0x5140), y1 = __byte_perm(xc, xd, 0x7362);
            const int nb = Gm::VEPU * i + 4 * ww;
            mma16816<false>(o[nb + 0], pa, lat_cvt8<CK, 0>(x0), lat_cvt8<CK, 0>(y0));
            mma16816<false>(o[nb + 1], pa, lat_cvt8<CK, 1>(x0), lat_cvt8<CK, 1>(y0));
            mma16816<false>(o[nb + 2], pa, lat_cvt8<CK, 0>(x1), lat_cvt8<CK, 0>(y1));
            mma16816<false>(o[nb + 3], pa, lat_cvt8<CK, 1>(x1), lat_cvt8<CK, 1>(y1));
          } else {
            const int nb = Gm::VEPU * i + 2 * ww;
            mma16816<CBF>(o[nb + 0], pa, __byte_perm(xa, xb, 0x5410),
                          __byte_perm(xc, xd, 0x5410));
            mma16816<CBF>(o[nb + 1], pa, __byte_perm(xa, xb, 0x7632),
                          __byte_perm(xc, xd, 0x7632));
          }
        }
      }
    }
  }
  cp_wait<0>();
  if constexpr (PROF) {
    if (ntiles > 0) pc[3] += lat_clock() - ck1;
    pt[3] = lat_gtimer();
  }

  // ---- the warps' partial row sums (same max m in every warp), then O out
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  __syncthreads();  // every warp is past its last read of red
  if (t == 0) {
    red[warp * 16 + g] = l0;
    red[warp * 16 + g + 8] = l1;
  }
  __syncthreads();
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int w = 0; w < LW; ++w) {
    s0 += red[w * 16 + g];
    s1 += red[w * 16 + g + 8];
  }
  const int S = p.num_splits;
  // OSTAGE: O through shared memory (the ring: every warp is past its last read of it, the
  // barrier above), then whole rows out in 16-byte stores; otherwise each thread's 4-byte
  // elements, 32 B apart, go straight out (8 rows x 4 sectors an instruction)
  constexpr int OSR = R + 4;  // a staged row, floats (16-byte aligned)
  float* ostage = reinterpret_cast<float*>(ring);
  static_assert(!OSTAGE || 16 * OSR * 4 <= NS * Gm::STAGE, "OSTAGE: O fits the ring");
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int rr = g + 8 * half, h = h0 + rr;
    if (h >= H) continue;
    const float lsum = half ? s1 : s0, m = half ? m1 : m0;
    const float inv = lsum == 0.f ? 0.f : 1.f / lsum;
    const long long row = p.direct ? (long long)b * H + h
                                   : ((long long)b * S + split) * H + h;
    float* dst = (p.direct ? p.out : p.acc) + row * R;
#pragma unroll
    for (int nb = 0; nb < Gm::NT; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = 2 * t + e;  // the n-tile's column -> latent column
        const int col = Gm::VEPU * (Gm::UW * warp + n + 8 * (nb / Gm::VEPU)) + nb % Gm::VEPU;
        const float v = o[nb][2 * half + e];
        if constexpr (OSTAGE)
          ostage[rr * OSR + col] = p.direct ? v * inv : v;
        else
          dst[col] = p.direct ? v * inv : v;
      }
    if ((!p.direct || p.ml != nullptr) && warp == 0 && t == 0) {  // (one split: H2O's lse)
      p.ml[row * 2] = m;
      p.ml[row * 2 + 1] = lsum;
    }
  }
  if constexpr (OSTAGE) {
    __syncthreads();  // the staged rows
    constexpr int C4 = R / 4;
    for (int i = tid; i < 16 * C4; i += LW * 32) {
      const int rr = i / C4, c4 = i % C4, h = h0 + rr;
      if (h >= H) break;  // rows are in order: the rest are past H too
      const long long row = p.direct ? (long long)b * H + h : ((long long)b * S + split) * H + h;
      *reinterpret_cast<float4v*>((p.direct ? p.out : p.acc) + row * R + 4 * c4) =
          *reinterpret_cast<const float4v*>(ostage + rr * OSR + 4 * c4);
    }
  }
  if constexpr (PROF) pt[4] = lat_gtimer();

  // ---- LAT_VAR_FMERGE: the last of the S CTAs of (b, head block) to arrive merges them (as
  // latent_decode.py's merge kernel and latent_sm90.merge_splits: empty splits weigh 0)
  if constexpr (FMERGE) {
    if (!p.direct) {
      lat_fence();      // this CTA's partials visible device-wide before it counts itself in
      __syncthreads();  // ... every thread's; and every warp is past its reads of red
      int* flag = reinterpret_cast<int*>(red);
      if (tid == 0) flag[0] = lat_arrive(p.cnt + blockIdx.x) == S - 1;
      __syncthreads();
      if (flag[0]) {
        lat_fence();
        float* wsh = reinterpret_cast<float*>(ring);  // [16][S]: weight / denominator
        if (tid < 16 && h0 + tid < H) {
          const long long r0 = (long long)b * S * H + h0 + tid;  // split s: r0 + s H
          float top = NEG_INF;
          for (int s = 0; s < S; ++s) top = fmaxf(top, lat_ldcg(p.ml + (r0 + s * H) * 2));
          const float base = top > NEG_INF ? top : 0.f;
          float den = 0.f;
          for (int s = 0; s < S; ++s) {
            const float ms = lat_ldcg(p.ml + (r0 + s * H) * 2);
            const float w = ms > NEG_INF ? exp2f(ms - base) : 0.f;
            wsh[tid * S + s] = w;
            den += w * lat_ldcg(p.ml + (r0 + s * H) * 2 + 1);
          }
          const float inv = den > 0.f ? 1.f / den : 0.f;
          for (int s = 0; s < S; ++s) wsh[tid * S + s] *= inv;
        }
        __syncthreads();
        constexpr int C4 = R / 4;  // 4-float column groups a row
        for (int i = tid; i < 16 * C4; i += LW * 32) {
          const int rr = i / C4, c4 = i % C4, h = h0 + rr;
          if (h >= H) break;  // rows are in order: the rest are past H too
          const float* src = p.acc + ((long long)b * S * H + h) * R + 4 * c4;
          float4v a{0.f, 0.f, 0.f, 0.f};
          for (int s = 0; s < S; ++s) {
            const float w = wsh[rr * S + s];
            const float4v v = lat_ldcg4(src + (long long)s * H * R);
            a.x += w * v.x;
            a.y += w * v.y;
            a.z += w * v.z;
            a.w += w * v.w;
          }
          *reinterpret_cast<float4v*>(p.out + ((long long)b * H + h) * R + 4 * c4) = a;
        }
        if (tid == 0) p.cnt[blockIdx.x] = 0;  // ready for the next launch
      }
    }
    if constexpr (PROF) pt[5] = lat_gtimer();
  }
  if constexpr (PROF) {
    if (tid == 0) {
      unsigned long long* o = p.prof + ((long long)blockIdx.x * S + split) * LAT_PROF_SLOTS;
      for (int i = 0; i < 6; ++i) o[i] = pt[i];
      o[6] = lat_smid();
      o[7] = ntiles;
      for (int i = 0; i < 4; ++i) o[8 + i] = pc[i];
    }
  }
}

}  // namespace kvc
