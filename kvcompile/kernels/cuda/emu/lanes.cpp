// Lanes as fibers: each thread of the CTA has its own stack and runs, cooperatively, until it
// reaches a meeting point (a warp collective, __syncthreads) or exits; the scheduler then resumes
// every runnable lane, in lane order or in a seeded random order per round. A collective's result
// is computed when the warp's 32nd lane arrives (PTX semantics below), so lanes really are
// independent: a lane that skips a collective, or meets a different one, is reported.
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>

#include "state.h"

#if defined(__x86_64__)
extern "C" __attribute__((visibility("hidden"))) void kvc_emu_swap_ctx(void** save, void* load);
#else
#include <ucontext.h>
#endif

namespace kvc_emu {

Lane* cur = nullptr;
Dim3 block_idx{0, 0, 0};
Cta cta;

const Dim3& thread_idx() { return cur->tid; }

namespace {

constexpr size_t STACK = 256 * 1024;
void (*g_body)(const void*) = nullptr;
const void* g_arg = nullptr;
bool g_failed = false;
char g_err[2048];
sigjmp_buf g_jmp;
size_t g_page = 4096;
struct sigaction g_old_segv, g_old_bus;
stack_t g_old_ss;
uint8_t* g_altstack = nullptr;
constexpr size_t ALTSTACK = 64 * 1024;

enum Op { OP_SYNCWARP = 1, OP_SHFL, OP_ANY, OP_MMA_F16, OP_MMA_BF16 };

void lane_entry();

#if defined(__x86_64__)
void* g_sched_sp = nullptr;
void resume(Lane& l) {
  cur = &l;
  kvc_emu_swap_ctx(&g_sched_sp, l.sp);
}
void switch_out() { kvc_emu_swap_ctx(&cur->sp, g_sched_sp); }
void ctx_init(Lane& l) {
  // the stack as kvc_emu_swap_ctx leaves it: six callee-saved registers, then a return address
  // (lane_entry, entered with rsp = 8 mod 16 as after a call; it never returns)
  uintptr_t top = reinterpret_cast<uintptr_t>(l.stack + g_page + STACK) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(&lane_entry);
  for (int i = 0; i < 6; ++i) *--sp = nullptr;
  l.sp = sp;
}
#else
ucontext_t g_sched_uc;
void resume(Lane& l) {
  cur = &l;
  swapcontext(&g_sched_uc, static_cast<ucontext_t*>(l.uctx));
}
void switch_out() { swapcontext(static_cast<ucontext_t*>(cur->uctx), &g_sched_uc); }
void ctx_init(Lane& l) {
  if (!l.uctx) l.uctx = new ucontext_t;
  ucontext_t* uc = static_cast<ucontext_t*>(l.uctx);
  getcontext(uc);
  uc->uc_stack.ss_sp = l.stack + g_page;
  uc->uc_stack.ss_size = STACK;
  uc->uc_link = nullptr;
  makecontext(uc, lane_entry, 0);
}
#endif

void lane_entry() {
  Lane& me = *cur;
  g_body(g_arg);
  if (pending(me)) fail("exits with cp.async copies it never waited for (cp.async.wait_group)");
  me.state = DONE;
  me.where = "exit";
  switch_out();
  __builtin_trap();
}

void lane_init(Lane& l, int id) {
  if (!l.stack) {
    void* m = mmap(nullptr, STACK + g_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) __builtin_trap();
    l.stack = static_cast<uint8_t*>(m);
    mprotect(l.stack, g_page, PROT_NONE);  // overflow faults (reported as such)
  }
  l.id = id;
  l.warp = id / WARP;
  l.lane = id % WARP;
  l.tid = Dim3{static_cast<unsigned>(id), 0, 0};
  l.state = RUNNABLE;
  l.where = "start";
  l.open.clear();
  l.groups.clear();
  ctx_init(l);
}

void record(const Lane* me, const char* fmt, va_list ap) {
  if (g_failed) return;
  g_failed = true;
  int n = 0;
  if (me)
    n = snprintf(g_err, sizeof g_err, "block (%u, %u) thread %d (warp %d lane %d): ",
                 block_idx.x, block_idx.y, me->id, me->warp, me->lane);
  vsnprintf(g_err + n, sizeof g_err - n, fmt, ap);
}

void record_f(const Lane* me, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  record(me, fmt, ap);
  va_end(ap);
}

void on_fault(int sig, siginfo_t* si, void*) {
  const char* what = guard_fault(si->si_addr);
  if (!what && cur) {
    const uint8_t* a = static_cast<const uint8_t*>(si->si_addr);
    for (int i = 0; i < cta.threads; ++i)
      if (a >= cta.lanes[i].stack && a < cta.lanes[i].stack + g_page) what = "stack overflow";
  }
  if (!what) {  // not ours: the previous handler takes it when the access faults again
    sigaction(sig, sig == SIGSEGV ? &g_old_segv : &g_old_bus, nullptr);
    return;
  }
  record_f(cur, "%s", what);
  siglongjmp(g_jmp, 1);
}

void handlers(bool on) {
  if (on) {
    if (!g_altstack) g_altstack = new uint8_t[ALTSTACK];
    stack_t ss{};
    ss.ss_sp = g_altstack;
    ss.ss_size = ALTSTACK;
    sigaltstack(&ss, &g_old_ss);
    struct sigaction sa{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
  } else {
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    sigaction(SIGBUS, &g_old_bus, nullptr);
    sigaltstack(&g_old_ss, nullptr);
  }
}

// ---- warp collectives: every lane of the warp must arrive at the same kind of collective
Warp& arrive(Lane& me, int op, const char* name, uint32_t mask, const void* site, bool aligned) {
  if (mask != FULL)
    fail("%s with member mask 0x%08x: the emulation takes full warps only", name, mask);
  Warp& w = cta.warps[me.warp];
  if (w.arrived == 0) {
    w.op = op;
    w.name = name;
    w.site = site;
  } else if (w.op != op) {
    fail("%s while other lanes of its warp wait at %s (divergent collectives)", name, w.name);
  } else if (aligned && w.site != site) {
    fail("%s at another instruction (%p) than its warp's other lanes (%p); .aligned needs one",
         name, site, w.site);
  }
  return w;
}

void meet(Lane& me, Warp& w, void (*complete)(Warp&)) {
  me.where = w.name;
  if (++w.arrived < WARP) {
    me.state = BLOCKED;
    switch_out();  // woken (RUNNABLE) by the warp's last lane
    return;
  }
  complete(w);
  w.arrived = 0;
  for (int l = 0; l < WARP; ++l) cta.lanes[me.warp * WARP + l].state = RUNNABLE;
  switch_out();  // the scheduler picks who goes on first
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"): groupID = lane >> 2, tid = lane % 4; each 32-bit
// register holds two elements, the lower-numbered in the low half.
//   A (16 x 16, row): a[0] = (row g, cols 2t, 2t+1), a[1] = (row g+8, cols 2t, 2t+1),
//                     a[2] = (row g, cols 2t+8, 2t+9), a[3] = (row g+8, cols 2t+8, 2t+9)
//   B (16 x 8, col):  b0 = (rows 2t, 2t+1; col g), b1 = (rows 2t+8, 2t+9; col g)
//   C, D (16 x 8 f32): c[0], c[1] = (row g, cols 2t, 2t+1), c[2], c[3] = (row g+8, same cols)
// The sum is taken in double and rounded once (tensor cores round differently, within the
// tolerances the tests use); NaN / Inf propagate as IEEE says.
void mma_complete(Warp& w) {
  float A[16][16], B[16][8], C[16][8];
  const bool bf = w.op == OP_MMA_BF16;
  auto el = [bf](uint32_t r, int hi) {
    const uint16_t h = static_cast<uint16_t>(hi ? r >> 16 : r & 0xffffu);
    return bf ? bf16_to_f32(h) : f16_to_f32(h);
  };
  for (int l = 0; l < WARP; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = el(w.a[l][0], e);
      A[g + 8][2 * t + e] = el(w.a[l][1], e);
      A[g][2 * t + 8 + e] = el(w.a[l][2], e);
      A[g + 8][2 * t + 8 + e] = el(w.a[l][3], e);
      B[2 * t + e][g] = el(w.b[l][0], e);
      B[2 * t + 8 + e][g] = el(w.b[l][1], e);
      C[g][2 * t + e] = w.c[l][e];
      C[g + 8][2 * t + e] = w.c[l][2 + e];
    }
  }
  for (int l = 0; l < WARP; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int c = 0; c < 4; ++c) {
      const int i = g + 8 * (c >> 1), j = 2 * t + (c & 1);
      double s = C[i][j];
      for (int k = 0; k < 16; ++k) s += static_cast<double>(A[i][k]) * B[k][j];
      w.res[l][c] = f32_bits(static_cast<float>(s));
    }
  }
}

}  // namespace

void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  record(cur, fmt, ap);
  va_end(ap);
  cur->state = FAILED;
  switch_out();
  __builtin_trap();
}

void yield() { switch_out(); }

void syncwarp(uint32_t mask, const void* site) {
  Lane& me = *cur;
  Warp& w = arrive(me, OP_SYNCWARP, "__syncwarp", mask, site, false);
  meet(me, w, [](Warp& x) { ++x.epoch; });
}

uint32_t shfl_xor(uint32_t mask, uint32_t value, int lane_mask, const void* site) {
  Lane& me = *cur;
  Warp& w = arrive(me, OP_SHFL, "__shfl_xor_sync", mask, site, false);
  w.val[me.lane] = value;
  w.arg[me.lane] = lane_mask;
  meet(me, w, [](Warp& x) {
    for (int l = 0; l < WARP; ++l) {
      const int src = l ^ x.arg[l];  // shfl.sync.bfly: a source outside the warp reads itself
      x.res[l][0] = x.val[src >= 0 && src < WARP ? src : l];
    }
  });
  return w.res[me.lane][0];
}

int any(uint32_t mask, int pred, const void* site) {
  Lane& me = *cur;
  Warp& w = arrive(me, OP_ANY, "__any_sync", mask, site, false);
  w.val[me.lane] = pred != 0;
  meet(me, w, [](Warp& x) {
    uint32_t r = 0;
    for (int l = 0; l < WARP; ++l) r |= x.val[l];
    for (int l = 0; l < WARP; ++l) x.res[l][0] = r;
  });
  return static_cast<int>(w.res[me.lane][0]);
}

void mma_at(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16,
            const void* site) {
  Lane& me = *cur;
  Warp& w = arrive(me, bf16 ? OP_MMA_BF16 : OP_MMA_F16, bf16 ? "mma.sync bf16" : "mma.sync f16",
                   FULL, site, true);
  for (int i = 0; i < 4; ++i) {
    w.a[me.lane][i] = a[i];
    w.c[me.lane][i] = d[i];
  }
  w.b[me.lane][0] = b0;
  w.b[me.lane][1] = b1;
  meet(me, w, mma_complete);
  for (int i = 0; i < 4; ++i) d[i] = bits_f32(w.res[me.lane][i]);
}

void syncthreads(const void* site) {
  Lane& me = *cur;
  if (cta.arrived == 0) {
    cta.site = site;
  } else if (cta.site != site) {
    fail("__syncthreads at another instruction (%p) than other threads (%p); bar.sync is "
         ".aligned", site, cta.site);
  }
  me.where = "__syncthreads";
  if (++cta.arrived < cta.threads) {
    me.state = BLOCKED;
    switch_out();
    return;
  }
  cta.arrived = 0;
  ++cta.epoch;
  for (int w = 0; w < cta.threads / WARP; ++w) ++cta.warps[w].epoch;
  for (int i = 0; i < cta.threads; ++i) cta.lanes[i].state = RUNNABLE;
  switch_out();
}

namespace {

std::string deadlock_report() {
  std::string s = "deadlock: no lane can go on;";
  for (int w = 0; w < cta.threads / WARP; ++w) {
    s += " warp " + std::to_string(w) + ":";
    for (int l = 0; l < WARP; ++l) {
      const Lane& x = cta.lanes[w * WARP + l];
      if (l == 0 || x.where != cta.lanes[w * WARP + l - 1].where)
        s += std::string(" lane ") + std::to_string(l) + "+ at " + x.where;
    }
    s += ";";
  }
  return s;
}

uint64_t next(uint64_t& x) {  // xorshift64*
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  return x * 0x2545F4914F6CDD1DULL;
}

int run_cta(unsigned bx, unsigned by, uint64_t& rng, bool shuffle) {
  block_idx = Dim3{bx, by, 0};
  smem_reset(cta.smem_bytes);
  cta.arrived = 0;
  cta.epoch = 0;
  for (auto& w : cta.warps) {
    w.arrived = 0;
    w.epoch = 0;
  }
  for (int i = 0; i < cta.threads; ++i) lane_init(cta.lanes[i], i);
  if (sigsetjmp(g_jmp, 1)) return -1;  // a guard page was hit (on_fault recorded it)
  int order[MAX_THREADS];
  for (;;) {
    for (int i = 0; i < cta.threads; ++i) order[i] = i;
    if (shuffle)
      for (int i = cta.threads - 1; i > 0; --i) std::swap(order[i], order[next(rng) % (i + 1)]);
    bool ran = false, done = true;
    for (int k = 0; k < cta.threads; ++k) {
      Lane& l = cta.lanes[order[k]];
      if (l.state != RUNNABLE) continue;
      resume(l);
      ran = true;
      if (g_failed) return -1;
    }
    for (int i = 0; i < cta.threads; ++i) done = done && cta.lanes[i].state == DONE;
    if (done) break;
    if (!ran) {
      record_f(nullptr, "block (%u, %u): %s", bx, by, deadlock_report().c_str());
      return -1;
    }
  }
  const char* tail = smem_check_tail();
  if (*tail) {
    record_f(nullptr, "block (%u, %u): %s", bx, by, tail);
    return -1;
  }
  return 0;
}

}  // namespace

int run_grid(void (*body)(const void*), const void* arg, int gx, int gy, int threads,
             int smem_bytes, uint64_t seed, char* err, int errlen) {
  g_failed = false;
  g_err[0] = 0;
  if (threads <= 0 || threads > MAX_THREADS || threads % WARP || smem_bytes < 0 ||
      smem_bytes > SMEM_CAP) {
    snprintf(err, errlen, "launch of %d threads with %d bytes of shared memory: the emulation "
             "takes 32-%d threads (whole warps) and up to %d bytes", threads, smem_bytes,
             MAX_THREADS, SMEM_CAP);
    return -1;
  }
  g_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  g_body = body;
  g_arg = arg;
  cta.threads = threads;
  cta.smem_bytes = smem_bytes;
  uint64_t rng = seed * 0x9E3779B97F4A7C15ULL + 1;
  handlers(true);
  int rc = 0;
  for (int by = 0; by < gy && rc == 0; ++by)
    for (int bx = 0; bx < gx && rc == 0; ++bx) rc = run_cta(bx, by, rng, seed != 0);
  handlers(false);
  cur = nullptr;
  snprintf(err, errlen, "%s", g_err);
  return rc;
}

}  // namespace kvc_emu

#if defined(__x86_64__)
// kvc_emu_swap_ctx(save, load): push the callee-saved registers, store rsp to *save, load rsp,
// pop the other context's registers and return into it (System V AMD64 ABI)
asm(R"(
  .text
  .p2align 4
  .globl kvc_emu_swap_ctx
  .hidden kvc_emu_swap_ctx
  .type kvc_emu_swap_ctx,@function
kvc_emu_swap_ctx:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kvc_emu_swap_ctx, .-kvc_emu_swap_ctx
)");
#endif
