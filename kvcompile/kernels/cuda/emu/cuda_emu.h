// Host emulation of the CUDA features paged_decode.cuh uses, so that the kernel's own source
// compiles with g++ alone (no CUDA toolkit) and runs on the CPU, one fiber per thread (lane).
//
//   g++ -DKVC_EMU ... emu_decode.cpp runtime.cpp      (build_emu.py does this)
//
// What the kernel sees here:
//   - threadIdx / blockIdx of the running lane and CTA; `__shared__` memory is one static array
//     (kvc::smem) that the runtime poisons before each CTA and bounds-checks after it;
//   - __syncthreads / __syncwarp / __shfl_xor_sync / __shfl_sync / __any_sync: lanes are
//     independent fibers that meet there (runtime.cpp), so a missing or mismatched collective
//     deadlocks or is reported;
//   - __half / __nv_bfloat16 with round-to-nearest-even conversions written out bit by bit, and
//     fp8 (e4m3 / e5m2) decoding, checked bit-exact against torch by the tests;
//   - the PTX the kernel inlines (mma.sync f16 / bf16 m16n8k16 and e4m3 m16n8k32, cvt f16x2 from
//     fp8x2 and e4m3x2 from f32, cp.async + groups, ld.shared)
//     as calls into kvc_emu::, placed next to each asm block under #ifdef KVC_EMU.
#pragma once
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline __attribute__((always_inline))
#define __align__(n) __attribute__((aligned(n)))
#define __shared__
#define __grid_constant__

using std::max;
using std::min;

struct uint2 { unsigned int x, y; } __attribute__((aligned(8)));
struct uint4 { unsigned int x, y, z, w; } __attribute__((aligned(16)));

namespace kvc_emu {

struct Dim3 { unsigned int x, y, z; };

// ---- fp16 / bf16 / fp8 bit conversions (IEEE 754 binary16, bfloat16; OCP fp8 e4m3fn / e5m2)
inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// f32 -> f16, round to nearest even; NaN -> 0x7fff (the canonical NaN cvt.rn.f16.f32 writes)
inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return 0x7fffu;
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (tie above 65504, odd) -> inf
  if (x < 0x38800000u) {                         // below 2^-14: an f16 subnormal or zero
    if (x < 0x33000000u) return sign;            // below 2^-25 (half the least subnormal)
    const int e = static_cast<int>(x >> 23);     // 102 .. 112
    const uint32_t m = (x & 0x7fffffu) | 0x800000u;
    const int shift = 126 - e;                   // value / 2^-24 = m >> shift
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the least normal
    return sign | static_cast<uint16_t>(q);
  }
  const uint32_t r = x - 0x38000000u;            // exponent bias 127 -> 15
  uint32_t q = r >> 13;
  const uint32_t rem = r & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));  // inf / NaN (payload kept)
  if (e == 0) {
    const float v = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// f32 -> bf16, round to nearest even; NaN -> 0x7fff (as __float2bfloat16_rn)
inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// fp8 code -> f16 bits, exact (every e4m3 / e5m2 value is an f16 value)
inline uint16_t e4m3_to_f16(uint8_t c) {
  const uint16_t sign = static_cast<uint16_t>((c & 0x80u) << 8);
  const int e = (c >> 3) & 0xf, m = c & 7;
  if (e == 0xf && m == 7) return 0x7fffu;        // e4m3fn: S.1111.111 is NaN, no infinities
  if (e == 0) return sign | f32_to_f16(static_cast<float>(m) * 0.001953125f);  // m * 2^-9
  return sign | static_cast<uint16_t>(((e + 8) << 10) | (m << 7));  // bias 7 -> 15
}

inline uint16_t e5m2_to_f16(uint8_t c) { return static_cast<uint16_t>(c) << 8; }  // f16's top

inline float e4m3_to_f32(uint8_t c) { return f16_to_f32(e4m3_to_f16(c)); }

// f32 -> e4m3fn code, round to nearest even, saturating (cvt.rn.satfinite.e4m3x2.f32): |x| at or
// past 448 (infinities included) -> +-448, NaN -> 0x7f
inline uint8_t f32_to_e4m3(float f) {
  const uint32_t x = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;
  if (a >= 0x43e00000u) return sign | 0x7e;       // >= 448
  if (a < 0x3c800000u) {                          // below 2^-6: subnormal codes m * 2^-9
    const float v = bits_f32(a) * 512.f;          // exact (a power-of-two scaling)
    uint32_t q = static_cast<uint32_t>(v);
    const float rem = v - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;  // q == 8: the least normal, 2^-6
    return sign | static_cast<uint8_t>(q);
  }
  uint32_t q = a >> 20;                           // exponent and 3 mantissa bits
  const uint32_t rem = a & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) ++q;
  return sign | static_cast<uint8_t>(q - (120u << 3));  // bias 127 -> 7; < 448: at most 0x7e
}

// ---- runtime hooks (runtime.cpp): the current lane, collectives, async copies, shared memory
struct Lane;
extern Lane* cur;           // the lane (fiber) running now
extern Dim3 block_idx;      // blockIdx of the CTA being run
const Dim3& thread_idx();   // threadIdx of `cur`

void syncthreads(const void* site);
void syncwarp(uint32_t mask, const void* site);
uint32_t shfl_xor(uint32_t mask, uint32_t value, int lane_mask, const void* site);
uint32_t shfl_idx(uint32_t mask, uint32_t value, int src_lane, const void* site);
int any(uint32_t mask, int pred, const void* site);
void mma_at(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16,
            const void* site);
void mma_e4m3_at(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                 const void* site);
uint32_t cvta_shared(const void* p);  // generic -> shared address, checked
void cp_async(uint32_t dst, const void* src, int cp_size, int src_size);
void cp_commit();
void cp_wait(int n);
void ld_shared(uint32_t addr, void* out, int bytes);

}  // namespace kvc_emu

namespace kvc {
extern uint8_t smem[];  // the kernel's `extern __shared__ uint8_t smem[]` (runtime.cpp)
}

#define threadIdx (::kvc_emu::thread_idx())
#define blockIdx (::kvc_emu::block_idx)
#define KVC_EMU_SITE __builtin_return_address(0)

// Collectives are out of line so that the call site (return address) identifies the instruction:
// .aligned ones (bar.sync, mma.sync) must be reached by every lane at the same one.
__attribute__((noinline)) inline void __syncthreads() { kvc_emu::syncthreads(KVC_EMU_SITE); }
__attribute__((noinline)) inline void __syncwarp(unsigned mask = 0xffffffffu) {
  kvc_emu::syncwarp(mask, KVC_EMU_SITE);
}
__attribute__((noinline)) inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
  return kvc_emu::bits_f32(
      kvc_emu::shfl_xor(mask, kvc_emu::f32_bits(v), lane_mask, KVC_EMU_SITE));
}
__attribute__((noinline)) inline float __shfl_sync(unsigned mask, float v, int src_lane) {
  return kvc_emu::bits_f32(
      kvc_emu::shfl_idx(mask, kvc_emu::f32_bits(v), src_lane, KVC_EMU_SITE));
}
__attribute__((noinline)) inline int __any_sync(unsigned mask, int pred) {
  return kvc_emu::any(mask, pred, KVC_EMU_SITE);
}
namespace kvc_emu {  // the kernel's mma16816 (always inlined) calls this: one call per mma site
__attribute__((noinline)) inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1, bool bf16) {
  mma_at(d, a, b0, b1, bf16, KVC_EMU_SITE);
}
__attribute__((noinline)) inline void mma_m16n8k32_e4m3(float (&d)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  mma_e4m3_at(d, a, b0, b1, KVC_EMU_SITE);
}
}  // namespace kvc_emu

inline float __int_as_float(int i) { return kvc_emu::bits_f32(static_cast<uint32_t>(i)); }

// prmt's default mode as __byte_perm documents it: byte n of the result is byte s<4n+2:4n> of
// the 8 bytes {y, x} (x = bytes 0-3)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) {
    const unsigned sel = (s >> (4 * n)) & 7u;
    r |= static_cast<unsigned>((v >> (8 * sel)) & 0xffu) << (8 * n);
  }
  return r;
}

inline size_t __cvta_generic_to_shared(const void* p) { return kvc_emu::cvta_shared(p); }

// ---- half / bfloat16 types (layout of cuda_fp16.h / cuda_bf16.h: 2 bytes, pairs x low, y high)
struct __half { uint16_t __x; };
struct __half2 { __half x, y; };
struct __nv_bfloat16 { uint16_t __x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };

inline __half __float2half_rn(float f) { return __half{kvc_emu::f32_to_f16(f)}; }
inline float __half2float(__half h) { return kvc_emu::f16_to_f32(h.__x); }
inline __half2 __floats2half2_rn(float lo, float hi) {
  return __half2{__float2half_rn(lo), __float2half_rn(hi)};
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __nv_bfloat16{kvc_emu::f32_to_bf16(f)};
}
inline float __bfloat162float(__nv_bfloat16 h) { return kvc_emu::bf16_to_f32(h.__x); }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
