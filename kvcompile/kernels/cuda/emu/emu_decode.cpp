// paged_decode.cuh's kernel, one variant (the -D constants build_emu.py passes, as build.py
// passes them to nvcc), as a C function that runs its grid on the CPU:
//
//   int kvc_emu_decode(const DecodeParams* p, int grid_x, int grid_y, int smem_bytes,
//                      const kvc_emu::Buffer* bufs, int nbufs, uint64_t seed, char* err, int n)
//
// `bufs` lists every tensor the kernel may touch (DecodeParams' pointers must each be the start
// of one); the kernel runs on guarded copies of them (runtime.h). Returns 0, or -1 with why.
#include <stdio.h>

#include <type_traits>

#include "../paged_decode.cuh"
#include "runtime.h"

namespace {

void body(const void* arg) {
  kvc::paged_decode<KVC_KK, KVC_VK, KVC_KSM, KVC_VSM, KVC_D, KVC_DV, KVC_ROWS, KVC_NS, KVC_QT,
                    KVC_Q8 != 0>(*static_cast<const DecodeParams*>(arg));
}

}  // namespace

extern "C" int kvc_emu_decode(const DecodeParams* p, int grid_x, int grid_y, int smem_bytes,
                              const kvc_emu::Buffer* bufs, int nbufs, uint64_t seed, char* err,
                              int errlen) {
  std::lock_guard<std::mutex> lock(kvc_emu::launch_lock());
  kvc_emu::guard_begin(bufs, nbufs);
  DecodeParams g = *p;
  bool ok = true;
  const char* bad = nullptr;
  auto map = [&](auto*& field, const char* name) {
    bool f = true;
    using T = std::remove_reference_t<decltype(field)>;
    field = static_cast<T>(kvc_emu::guard_map(field, &f));
    if (!f && ok) {
      ok = false;
      bad = name;
    }
  };
  map(g.q, "q");
  map(g.k, "k");
  map(g.v, "v");
  map(g.ks, "ks");
  map(g.vs, "vs");
  map(g.bt, "bt");
  map(g.seq_lens, "seq_lens");
  map(g.kmask, "kmask");
  map(g.out, "out");
  map(g.acc, "acc");
  map(g.lse, "lse");
  map(g.kz, "kz");
  map(g.vz, "vz");
  if (!ok) {
    kvc_emu::guard_end(false);
    snprintf(err, errlen, "DecodeParams.%s is not the start of any buffer passed", bad);
    return -1;
  }
  const int rc = kvc_emu::run_grid(body, &g, grid_x, grid_y, kvc::WARPS * 32, smem_bytes, seed,
                                   err, errlen);
  kvc_emu::guard_end(true);
  return rc;
}

// Bit conversions, exported so that the tests can check them against torch on every code.
// kind: 0 f32 -> f16, 1 f32 -> bf16, 2 f16 -> f32, 3 e4m3 -> f16, 4 e5m2 -> f16,
// 5 f32 -> e4m3 (saturating, as the kernel's cvt.rn.satfinite.e4m3x2.f32)
extern "C" void kvc_emu_convert(int kind, const void* in, void* out, long long n) {
  for (long long i = 0; i < n; ++i) {
    switch (kind) {
      case 0: static_cast<uint16_t*>(out)[i] =
                  kvc_emu::f32_to_f16(static_cast<const float*>(in)[i]); break;
      case 1: static_cast<uint16_t*>(out)[i] =
                  kvc_emu::f32_to_bf16(static_cast<const float*>(in)[i]); break;
      case 2: static_cast<float*>(out)[i] =
                  kvc_emu::f16_to_f32(static_cast<const uint16_t*>(in)[i]); break;
      case 3: static_cast<uint16_t*>(out)[i] =
                  kvc_emu::e4m3_to_f16(static_cast<const uint8_t*>(in)[i]); break;
      case 4: static_cast<uint16_t*>(out)[i] =
                  kvc_emu::e5m2_to_f16(static_cast<const uint8_t*>(in)[i]); break;
      default: static_cast<uint8_t*>(out)[i] =
                  kvc_emu::f32_to_e4m3(static_cast<const float*>(in)[i]); break;
    }
  }
}

extern "C" unsigned kvc_emu_byte_perm(unsigned x, unsigned y, unsigned s) {
  return __byte_perm(x, y, s);
}
