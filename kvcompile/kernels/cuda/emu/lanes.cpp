// Lanes as fibers: each thread of the CTA has its own stack and runs, cooperatively, until it
// reaches a meeting point (a warp collective, __syncthreads: collectives.cpp) or exits; the
// scheduler then resumes every runnable lane, in lane order or in a seeded random order per
// round. A lane that skips a collective, or meets a different one, is reported.
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

std::mutex& launch_lock() {
  static std::mutex mu;
  return mu;
}

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
