// Small kernels with one known bug each (and one without), so the tests can check that the
// emulation reports what a GPU would fault on or race at:
//
//   int kvc_emu_selftest(int which, char* err, int errlen)   // 0 ok, -1 with the report in err
//
// which: 0 correct ring | 1 wait_group one too loose | 2 no __syncwarp after the wait (read
// after write) | 3 no __syncwarp before refilling a slot (write after read) | 4 divergent
// collectives | 5 a lane skips __syncthreads | 6 a load past a global buffer | 7 a cp.async
// reading past a buffer | 8 misaligned ld.shared | 9 a store past the CTA's shared memory |
// 10 mma.sync reached from two different instructions
#include <stdio.h>

#include "cuda_emu.h"
#include "runtime.h"

namespace kvc {
extern uint8_t smem[];
}

namespace {

struct Args {
  int which;
  const float* src;  // [64] floats
  float* dst;        // [128]
};

constexpr int NS = 2, STEPS = 4;

__attribute__((noinline)) void mma_elsewhere(float (&d)[4], const uint32_t (&q)[4]) {
  kvc_emu::mma_m16n8k16(d, q, 0, 0, false);
}

// one warp per CTA streams STEPS chunks of 32 floats through a ring of NS slots; every lane
// reads a neighbour's float, so lanes depend on each other's copies
void ring(const Args& a) {
  const int lane = threadIdx.x & 31;
  float* ringf = reinterpret_cast<float*>(kvc::smem);
  auto issue = [&](int i) {
    const uint32_t d = kvc_emu::cvta_shared(ringf + (i % NS) * 32 + lane);
    kvc_emu::cp_async(d, a.src + (i * 32 + lane) % 64, 4, 4);
  };
  float acc = 0.f;
  issue(0);
  kvc_emu::cp_commit();
  for (int it = 0; it < STEPS; ++it) {
    if (it + 1 < STEPS) issue(it + 1);
    kvc_emu::cp_commit();
    kvc_emu::cp_wait(a.which == 1 ? NS : NS - 1);
    if (a.which != 2) __syncwarp();
    float x;
    kvc_emu::ld_shared(kvc_emu::cvta_shared(ringf + (it % NS) * 32 + (lane ^ 1)), &x, 4);
    acc += x;
    if (a.which != 3) __syncwarp();
  }
  kvc_emu::cp_wait(0);
  a.dst[threadIdx.x] = acc;
}

void body(const void* p) {
  const Args& a = *static_cast<const Args*>(p);
  const int lane = threadIdx.x & 31;
  switch (a.which) {
    case 4:
      if (lane == 3) __syncwarp();
      else __shfl_xor_sync(0xffffffffu, 1.f, 1);
      break;
    case 5:
      if (threadIdx.x != 70) __syncthreads();
      break;
    case 6:
      a.dst[threadIdx.x] = a.src[64 + (threadIdx.x & 7)];  // just past the 64 floats
      break;
    case 7:
      kvc_emu::cp_async(kvc_emu::cvta_shared(kvc::smem + 16 * threadIdx.x), a.src + 64, 16, 16);
      kvc_emu::cp_commit();
      kvc_emu::cp_wait(0);
      break;
    case 8: {
      uint4 r;
      kvc_emu::ld_shared(kvc_emu::cvta_shared(kvc::smem + 8), &r, 16);
      break;
    }
    case 9:
      kvc::smem[4096 + threadIdx.x] = 1;  // the launch has 4096 bytes
      break;
    case 10: {
      float d[4] = {0, 0, 0, 0};
      const uint32_t q[4] = {0, 0, 0, 0};
      if (lane < 16) kvc_emu::mma_m16n8k16(d, q, 0, 0, false);
      else mma_elsewhere(d, q);
      break;
    }
    default:
      if (threadIdx.x < 32) ring(a);
  }
}

}  // namespace

extern "C" int kvc_emu_selftest(int which, char* err, int errlen) {
  std::lock_guard<std::mutex> lock(kvc_emu::launch_lock());
  float src[64], dst[128];
  for (int i = 0; i < 64; ++i) src[i] = static_cast<float>(i);
  const kvc_emu::Buffer bufs[2] = {{src, sizeof src, 0, "src"}, {dst, sizeof dst, 1, "dst"}};
  kvc_emu::guard_begin(bufs, 2);
  bool ok = true;
  Args a{which, static_cast<const float*>(kvc_emu::guard_map(src, &ok)),
         static_cast<float*>(kvc_emu::guard_map(dst, &ok))};
  const int threads = which == 5 ? 128 : 32;
  int rc = kvc_emu::run_grid(body, &a, 1, 1, threads, 4096, 7, err, errlen);
  kvc_emu::guard_end(true);
  if (rc == 0 && which == 0) {  // lane l sums the floats of lane l ^ 1 of every step
    for (int l = 0; l < 32 && rc == 0; ++l) {
      float want = 0.f;
      for (int it = 0; it < STEPS; ++it) want += src[(it * 32 + (l ^ 1)) % 64];
      if (dst[l] != want) {
        snprintf(err, errlen, "ring: lane %d got %g, want %g", l, dst[l], want);
        rc = -1;
      }
    }
  }
  return rc;
}
