// State shared by the emulation runtime: lanes.cpp (fibers, scheduling, errors),
// collectives.cpp (warp collectives, barrier), memory.cpp (shared memory, cp.async, buffers).
#pragma once
#include <deque>
#include <vector>

#include "cuda_emu.h"
#include "runtime.h"

namespace kvc_emu {

constexpr int WARP = 32;
constexpr int MAX_THREADS = 256;  // 8 warps (the latent kernel's 8-warp CTAs)
constexpr uint32_t FULL = 0xffffffffu;
constexpr int SMEM_TAIL = 4096;  // canary bytes past the CTA's shared memory (stray stores)

struct Copy {  // one cp.async: lands (src -> smem[dst], zero-filled to cp_size) at its wait
  uint32_t dst;
  const uint8_t* src;
  int cp_size, src_size;
};

enum State { RUNNABLE, BLOCKED, DONE, FAILED };

struct Lane {
  void* sp = nullptr;  // saved stack pointer (x86-64 switch) while not running
  void* uctx = nullptr;  // ucontext_t* on other targets
  uint8_t* stack = nullptr;
  Dim3 tid{0, 0, 0};
  int id = 0, warp = 0, lane = 0;
  State state = RUNNABLE;
  const char* where = "start";  // the meeting point it waits at (deadlock reports)
  std::vector<Copy> open;                  // cp.async issued since the last commit_group
  std::deque<std::vector<Copy>> groups;    // committed, not yet waited for
};

struct Warp {
  int arrived = 0, op = 0;
  const char* name = "";
  const void* site = nullptr;
  uint32_t val[WARP], res[WARP][4];
  int arg[WARP];
  uint32_t a[WARP][4], b[WARP][2];
  float c[WARP][4];
  bool bf16[WARP];
  uint32_t epoch = 0;  // __syncwarp / __syncthreads completed: orders the warp's smem accesses
};

struct Cta {
  int threads = 0, smem_bytes = 0, arrived = 0;
  const void* site = nullptr;
  uint32_t epoch = 0;  // __syncthreads completed
  Lane lanes[MAX_THREADS];
  Warp warps[MAX_THREADS / WARP];
};

extern Cta cta;

// Records the first error (prefixed with the running lane) and parks the lane for good.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void yield();  // back to the scheduler (the lane stays in its state)

// memory.cpp
void smem_reset(int smem_bytes);
const char* smem_check_tail();   // "" or what a stray store overwrote
bool pending(const Lane& l);     // cp.async issued and not waited for
const char* guard_fault(const void* addr);  // what a fault address is (a guard page), or null

}  // namespace kvc_emu
