// Shared memory, cp.async and the guarded copies of the kernel's global buffers.
//
// cp.async (PTX ISA, "cp.async"): copies cp_size bytes, the first src_size of them from global
// memory and zeros for the rest, asynchronously: the bytes may land any time between the issue
// and the cp.async.wait_group that covers the copy's commit group ("wait until at most N of the
// executing thread's most recent groups are pending"); other threads see them only after that
// wait and a barrier. The emulation takes the latest moment: at issue it poisons the destination
// (0xff: NaN in every float format the kernel reads) and marks it in flight; the copy lands when
// its own thread's wait covers it. ld.shared of bytes still in flight, or landed by another lane
// with no __syncwarp / __syncthreads since (read after write), a cp.async to bytes another lane
// read with no such barrier since (write after read), and a second copy to bytes in flight are
// errors. (mma.sync and shfl order nothing in PTX's memory model, so they do not count.)
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "state.h"

namespace kvc {
__attribute__((aligned(128))) uint8_t smem[kvc_emu::SMEM_CAP + kvc_emu::SMEM_TAIL];
}

namespace kvc_emu {
namespace {

constexpr uint8_t POISON = 0xff, CANARY = 0xa5;
constexpr uint16_t NOBODY = 0xffff;  // thread ids are 16-bit: CTAs of up to MAX_THREADS (256)
uint8_t s_pend[SMEM_CAP];       // 1 while a cp.async to the byte is in flight
uint16_t s_pend_tid[SMEM_CAP];  // the thread that issued it
uint16_t s_land_tid[SMEM_CAP];  // the thread whose copy landed there last (NOBODY: none)
uint32_t s_land_wep[SMEM_CAP], s_land_cep[SMEM_CAP];  // its warp's / the CTA's epoch then
uint16_t s_rd_tid[SMEM_CAP];   // the thread that read the byte (ld.shared) last
uint8_t s_rd_multi[SMEM_CAP];  // 1: more than one thread read it in that epoch
uint32_t s_rd_wep[SMEM_CAP], s_rd_cep[SMEM_CAP];  // the reader's warp's / the CTA's epoch then

struct Guard {
  const void* orig;
  uint8_t* map;
  size_t map_len, n;
  uint8_t* data;
  bool writable;
  std::string name;
};
std::vector<Guard> g_guards;
char g_fault[512];

void check_range(uint32_t addr, int bytes, const char* what) {
  if (addr % bytes)
    fail("%s of %d bytes at shared address %u, not %d-byte aligned", what, bytes, addr, bytes);
  if (static_cast<long long>(addr) + bytes > cta.smem_bytes)
    fail("%s of %d bytes at shared address %u, past the CTA's %d bytes", what, bytes, addr,
         cta.smem_bytes);
}

const Guard* buffer_of(const uint8_t* p, const Guard** near) {
  *near = nullptr;
  for (const Guard& g : g_guards) {
    if (p >= g.data && p < g.data + g.n) return &g;
    if (p >= g.map && p < g.map + g.map_len) *near = &g;
  }
  return nullptr;
}

void land(Lane& me, const Copy& c) {
  memcpy(kvc::smem + c.dst, c.src, c.src_size);
  memset(kvc::smem + c.dst + c.src_size, 0, c.cp_size - c.src_size);
  const uint32_t wep = cta.warps[me.warp].epoch;
  for (int i = 0; i < c.cp_size; ++i) {
    s_pend[c.dst + i] = 0;
    s_land_tid[c.dst + i] = static_cast<uint16_t>(me.id);
    s_land_wep[c.dst + i] = wep;
    s_land_cep[c.dst + i] = cta.epoch;
  }
}

}  // namespace

void smem_reset(int smem_bytes) {
  memset(kvc::smem, POISON, smem_bytes);  // what a previous CTA left: reads of it show as NaN
  memset(kvc::smem + smem_bytes, CANARY, SMEM_CAP + SMEM_TAIL - smem_bytes);
  memset(s_pend, 0, smem_bytes);
  std::fill(s_land_tid, s_land_tid + smem_bytes, NOBODY);
  std::fill(s_rd_tid, s_rd_tid + smem_bytes, NOBODY);
}

const char* smem_check_tail() {
  static char msg[256];
  msg[0] = 0;
  for (int i = cta.smem_bytes; i < SMEM_CAP + SMEM_TAIL; ++i)
    if (kvc::smem[i] != CANARY) {
      snprintf(msg, sizeof msg, "a store to shared byte %d, past the CTA's %d bytes", i,
               cta.smem_bytes);
      break;
    }
  return msg;
}

bool pending(const Lane& l) {
  if (!l.open.empty()) return true;
  for (const auto& g : l.groups)
    if (!g.empty()) return true;
  return false;
}

uint32_t cvta_shared(const void* p) {
  const uint8_t* q = static_cast<const uint8_t*>(p);
  if (q < kvc::smem || q > kvc::smem + cta.smem_bytes)
    fail("__cvta_generic_to_shared of %p, outside the CTA's shared memory", p);
  return static_cast<uint32_t>(q - kvc::smem);
}

void cp_async(uint32_t dst, const void* src, int cp_size, int src_size) {
  Lane& me = *cur;
  if (cp_size != 4 && cp_size != 8 && cp_size != 16) fail("cp.async with cp-size %d", cp_size);
  if (src_size < 0 || src_size > cp_size)
    fail("cp.async with src-size %d > cp-size %d (undefined behaviour)", src_size, cp_size);
  check_range(dst, cp_size, "cp.async destination");
  const uint8_t* s = static_cast<const uint8_t*>(src);
  if (reinterpret_cast<uintptr_t>(s) % cp_size)
    fail("cp.async source %p not %d-byte aligned", src, cp_size);
  if (src_size > 0) {
    const Guard* near;
    const Guard* g = buffer_of(s, &near);
    if (!g && near)
      fail("cp.async reads %d bytes at %p, %lld bytes from the end of '%s' (%zu bytes)",
           src_size, src, static_cast<long long>(s - (near->data + near->n)), near->name.c_str(),
           near->n);
    if (!g) fail("cp.async reads %d bytes at %p, outside every buffer", src_size, src);
    if (s + src_size > g->data + g->n)
      fail("cp.async reads %d bytes at offset %lld of '%s', past its %zu bytes", src_size,
           static_cast<long long>(s - g->data), g->name.c_str(), g->n);
  }
  for (uint32_t a = dst; a < dst + cp_size; ++a) {
    if (s_pend[a])
      fail("cp.async to shared byte %u while a copy there (thread %d's) is still in flight", a,
           s_pend_tid[a]);
    const int r = s_rd_tid[a];
    if (r == NOBODY || (r == me.id && !s_rd_multi[a])) continue;
    if (r / WARP == me.warp && s_rd_wep[a] == cta.warps[me.warp].epoch)
      fail("cp.async to shared byte %u, read by lane %d with no __syncwarp since", a, r % WARP);
    if (r / WARP != me.warp && s_rd_cep[a] == cta.epoch)
      fail("cp.async to shared byte %u, read by thread %d (another warp) with no "
           "__syncthreads since", a, r);
  }
  memset(kvc::smem + dst, POISON, cp_size);
  memset(s_pend + dst, 1, cp_size);
  std::fill(s_pend_tid + dst, s_pend_tid + dst + cp_size, static_cast<uint16_t>(me.id));
  me.open.push_back(Copy{dst, s, cp_size, src_size});
}

void cp_commit() {
  Lane& me = *cur;
  me.groups.push_back(std::move(me.open));
  me.open.clear();
}

void cp_wait(int n) {
  Lane& me = *cur;
  while (static_cast<int>(me.groups.size()) > n) {
    for (const Copy& c : me.groups.front()) land(me, c);
    me.groups.pop_front();
  }
}

void ld_shared(uint32_t addr, void* out, int bytes) {
  Lane& me = *cur;
  check_range(addr, bytes, "ld.shared");
  for (int i = 0; i < bytes; ++i) {
    const uint32_t a = addr + i;
    if (s_pend[a])
      fail("ld.shared of byte %u, whose cp.async (thread %d's) has not been waited for", a,
           s_pend_tid[a]);
    const int t = s_land_tid[a];
    if (t == NOBODY || t == me.id) continue;  // (read-after-read needs nothing)
    if (t / WARP == me.warp && s_land_wep[a] == cta.warps[me.warp].epoch)
      fail("ld.shared of byte %u, landed by lane %d's cp.async with no __syncwarp since", a,
           t % WARP);
    if (t / WARP != me.warp && s_land_cep[a] == cta.epoch)
      fail("ld.shared of byte %u, landed by thread %d (another warp) with no __syncthreads "
           "since", a, t);
  }
  const uint32_t wep = cta.warps[me.warp].epoch;
  for (uint32_t a = addr; a < addr + bytes; ++a) {
    const int r = s_rd_tid[a];
    const bool same_epoch = r != NOBODY && s_rd_wep[a] == cta.warps[r / WARP].epoch &&
                            s_rd_cep[a] == cta.epoch;
    if (same_epoch && r != me.id) s_rd_multi[a] = 1;
    if (same_epoch) continue;  // keep the first reader; multi says there were others
    s_rd_tid[a] = static_cast<uint16_t>(me.id);
    s_rd_multi[a] = 0;
    s_rd_wep[a] = wep;
    s_rd_cep[a] = cta.epoch;
  }
  memcpy(out, kvc::smem + addr, bytes);
}

// ---- guarded copies of the global buffers
void guard_begin(const Buffer* bufs, int n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (int i = 0; i < n; ++i) {
    if (!bufs[i].ptr) continue;
    bool dup = false;
    for (Guard& g : g_guards)
      if (g.orig == bufs[i].ptr) {  // one tensor passed twice (out = acc = lse when direct)
        dup = true;
        g.writable = g.writable || bufs[i].writable;
        if (static_cast<size_t>(bufs[i].nbytes) != g.n) __builtin_trap();
      }
    if (dup) continue;
    Guard g;
    g.orig = bufs[i].ptr;
    g.n = static_cast<size_t>(bufs[i].nbytes);
    g.writable = bufs[i].writable != 0;
    g.name = bufs[i].name;
    const size_t body = (g.n + 15) / 16 * 16, pages = (body + page - 1) / page;
    g.map_len = (pages + 2) * page;
    void* m = mmap(nullptr, g.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                   0);
    if (m == MAP_FAILED) __builtin_trap();
    g.map = static_cast<uint8_t*>(m);
    memset(g.map, POISON, g.map_len);
    mprotect(g.map, page, PROT_NONE);
    mprotect(g.map + g.map_len - page, page, PROT_NONE);
    g.data = g.map + g.map_len - page - body;  // 16-byte aligned, ends at (or < 16 B before)
    memcpy(g.data, g.orig, g.n);               // the trailing guard page
    g_guards.push_back(std::move(g));
  }
}

void* guard_map(const void* orig, bool* ok) {
  if (!orig) return nullptr;
  for (const Guard& g : g_guards)
    if (g.orig == orig) return g.data;
  *ok = false;
  return nullptr;
}

void guard_end(bool copy_back) {
  for (Guard& g : g_guards) {
    if (copy_back && g.writable) memcpy(const_cast<void*>(g.orig), g.data, g.n);
    munmap(g.map, g.map_len);
  }
  g_guards.clear();
}

const char* guard_fault(const void* addr) {
  const uint8_t* a = static_cast<const uint8_t*>(addr);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (const Guard& g : g_guards) {
    if (a >= g.map && a < g.map + page) {
      snprintf(g_fault, sizeof g_fault, "a load or store at %lld bytes before the start of '%s'",
               static_cast<long long>(g.data - a), g.name.c_str());
      return g_fault;
    }
    if (a >= g.map + g.map_len - page && a < g.map + g.map_len) {
      snprintf(g_fault, sizeof g_fault, "a load or store at byte %lld of '%s', past its %zu "
               "bytes", static_cast<long long>(a - g.data), g.name.c_str(), g.n);
      return g_fault;
    }
  }
  return nullptr;
}

}  // namespace kvc_emu
