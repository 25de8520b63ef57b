// The emulation runtime's entry points for a kernel's host driver (emu_decode.cpp).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include <mutex>

namespace kvc_emu {

constexpr int SMEM_CAP = 227 * 1024;  // the largest dynamic shared memory an sm_90 CTA may have

struct Buffer {          // one tensor the kernel may touch (Python passes a list of them)
  const void* ptr;
  long long nbytes;
  int writable;          // copied back after the run
  const char* name;
};

// One static shared memory, one fiber set, one buffer set: each entry point holds this lock.
std::mutex& launch_lock();

// Copies every buffer into its own mapping that ends at a PROT_NONE page, so that a plain load
// or store past a buffer's end faults (reported, not a crash) and cp.async sources are checked
// against the buffers. Returns the copy of `orig` (nullptr stays nullptr; any other pointer that
// is not a buffer's start is an error: *ok = false).
void guard_begin(const Buffer* bufs, int n);
void* guard_map(const void* orig, bool* ok);
void guard_end(bool copy_back);

// Runs body(arg) as the grid (gx, gy) of CTAs of `threads` lanes, CTAs one after another, each
// lane a fiber. seed 0: lanes resume in lane order at every meeting point; else in a seeded
// random order. Returns 0, or -1 with the first error (which lane, where, why) in err.
int run_grid(void (*body)(const void*), const void* arg, int gx, int gy, int threads,
             int smem_bytes, uint64_t seed, char* err, int errlen);

}  // namespace kvc_emu
