// latent_decode.cuh's kernel, one variant (the -D constants latent_sm90.py passes, as to nvcc),
// as a C function that runs its grid on the CPU (the twin of emu_decode.cpp):
//
//   int kvc_emu_latent(const LatentParams* p, int grid_x, int grid_y, int smem_bytes,
//                      const kvc_emu::Buffer* bufs, int nbufs, uint64_t seed, char* err, int n)
#include <stdio.h>

#include <type_traits>

#include "../latent_decode.cuh"
#include "runtime.h"

namespace {

void body(const void* arg) {
  kvc::latent_decode<KVC_CK, KVC_RK, KVC_R, KVC_DR, KVC_LOG2P, KVC_NS, KVC_QT,
                     KVC_LVAR, KVC_LW>(
      *static_cast<const LatentParams*>(arg));
}

}  // namespace

extern "C" int kvc_emu_latent(const LatentParams* p, int grid_x, int grid_y, int smem_bytes,
                              const kvc_emu::Buffer* bufs, int nbufs, uint64_t seed, char* err,
                              int errlen) {
  std::lock_guard<std::mutex> lock(kvc_emu::launch_lock());
  kvc_emu::guard_begin(bufs, nbufs);
  LatentParams g = *p;
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
  map(g.c, "c");
  map(g.r, "r");
  map(g.cs, "cs");
  map(g.rs, "rs");
  map(g.bt, "bt");
  map(g.seq_lens, "seq_lens");
  map(g.out, "out");
  map(g.acc, "acc");
  map(g.ml, "ml");
  map(g.prof, "prof");
  map(g.cnt, "cnt");
  map(g.km, "km");
  map(g.scores, "scores");
  if (!ok) {
    kvc_emu::guard_end(false);
    snprintf(err, errlen, "LatentParams.%s is not the start of any buffer passed", bad);
    return -1;
  }
  const int rc = kvc_emu::run_grid(body, &g, grid_x, grid_y, KVC_LW * 32, smem_bytes, seed,
                                   err, errlen);
  kvc_emu::guard_end(true);
  return rc;
}
