// Warp collectives and the CTA barrier. A lane arriving at one parks until its warp's 32nd lane
// (the CTA's last thread for __syncthreads) arrives; that lane computes every lane's result (PTX
// semantics below) and wakes them. All lanes of a warp must meet at the same kind of collective,
// and at the same instruction for .aligned ones (mma.sync, bar.sync).
#include "state.h"

namespace kvc_emu {
namespace {

enum Op { OP_SYNCWARP = 1, OP_SHFL, OP_ANY, OP_MMA_F16, OP_MMA_BF16, OP_MMA_E4M3, OP_SHFL_IDX };

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
    yield();  // woken (RUNNABLE) by the warp's last lane
    return;
  }
  complete(w);
  w.arrived = 0;
  for (int l = 0; l < WARP; ++l) cta.lanes[me.warp * WARP + l].state = RUNNABLE;
  yield();  // the scheduler picks who goes on first
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

// mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 (PTX ISA, "Matrix Fragments for
// mma.m16n8k32", 8-bit types): each 32-bit register holds four codes, the lowest k in the lowest
// byte.
//   A (16 x 32, row): a[0] = (row g, k 4t..4t+3),      a[1] = (row g+8, k 4t..4t+3),
//                     a[2] = (row g, k 16+4t..16+4t+3), a[3] = (row g+8, k 16+4t..16+4t+3)
//   B (32 x 8, col):  b0 = (k 4t..4t+3; col g),        b1 = (k 16+4t..16+4t+3; col g)
//   C, D: as m16n8k16.
// Every product of two e4m3 values is exact in double; the sum is taken in double and rounded
// once. (Hopper's FP8 tensor cores accumulate with fewer bits than f32; here that is over one
// k-step chain of D / 32 MMAs into a fresh accumulator per 16-token step, and the GPU test
// measures it. The emulation is the exact sum.)
void mma_e4m3_complete(Warp& w) {
  float A[16][32], B[32][8], C[16][8];
  auto el = [](uint32_t r, int i) { return e4m3_to_f32(static_cast<uint8_t>(r >> (8 * i))); };
  for (int l = 0; l < WARP; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int e = 0; e < 4; ++e) {
      A[g][4 * t + e] = el(w.a[l][0], e);
      A[g + 8][4 * t + e] = el(w.a[l][1], e);
      A[g][16 + 4 * t + e] = el(w.a[l][2], e);
      A[g + 8][16 + 4 * t + e] = el(w.a[l][3], e);
      B[4 * t + e][g] = el(w.b[l][0], e);
      B[16 + 4 * t + e][g] = el(w.b[l][1], e);
    }
    for (int e = 0; e < 2; ++e) {
      C[g][2 * t + e] = w.c[l][e];
      C[g + 8][2 * t + e] = w.c[l][2 + e];
    }
  }
  for (int l = 0; l < WARP; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int c = 0; c < 4; ++c) {
      const int i = g + 8 * (c >> 1), j = 2 * t + (c & 1);
      double s = C[i][j];
      for (int k = 0; k < 32; ++k) s += static_cast<double>(A[i][k]) * B[k][j];
      w.res[l][c] = f32_bits(static_cast<float>(s));
    }
  }
}

}  // namespace

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

uint32_t shfl_idx(uint32_t mask, uint32_t value, int src_lane, const void* site) {
  Lane& me = *cur;
  Warp& w = arrive(me, OP_SHFL_IDX, "__shfl_sync", mask, site, false);
  w.val[me.lane] = value;
  w.arg[me.lane] = src_lane;
  meet(me, w, [](Warp& x) {
    for (int l = 0; l < WARP; ++l) x.res[l][0] = x.val[x.arg[l] & (WARP - 1)];  // shfl.sync.idx
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

void mma_e4m3_at(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                 const void* site) {
  Lane& me = *cur;
  Warp& w = arrive(me, OP_MMA_E4M3, "mma.sync e4m3", FULL, site, true);
  for (int i = 0; i < 4; ++i) {
    w.a[me.lane][i] = a[i];
    w.c[me.lane][i] = d[i];
  }
  w.b[me.lane][0] = b0;
  w.b[me.lane][1] = b1;
  meet(me, w, mma_e4m3_complete);
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
    yield();
    return;
  }
  cta.arrived = 0;
  ++cta.epoch;
  for (int w = 0; w < cta.threads / WARP; ++w) ++cta.warps[w].epoch;
  for (int i = 0; i < cta.threads; ++i) cta.lanes[i].state = RUNNABLE;
  yield();
}

}  // namespace kvc_emu
