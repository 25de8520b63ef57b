/* fp8 pages' CPU decode step in C (kvcompile/kernels/cpu_fp8.py builds and calls it).
 *
 * The same fp32 IEEE operations as the numpy route (kernels/dense.py _fp8_rows_host,
 * cache/paged.py PagedTensor.write_tokens_fp8), in the same order, so the bytes are the same:
 *   decode:  float(code) * scale         (the code's value is exact in fp32; one rounding)
 *   encode:  clamp(x / scale, -fmax, fmax) cast to fp8 as c10's Float8_e4m3fn / e5m2 casts
 *            (round to nearest even, NaN -> 0x7F | sign)
 * Built with -ffp-contract=off (no fused multiply-add) and no -ffast-math (NaN kept). No code
 * value is made as an fp32 denormal (the numpy route makes none either).
 *
 * Pools: codes [N * H, P * Ds] uint8 (one row per page-head), page scales [N * H] fp32.
 * bf16 pages (kvc_bf16_step, at the end) share the library: their write and gather.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The gather runs as the CPU's best of AVX-512 / AVX2 / baseline code, chosen when the library
 * loads (gcc / clang function multiversioning): no -march, so a cached build runs anywhere.
 * 320 tokens of K + V: ~64 us baseline (SSE2), ~34 AVX2, ~18 AVX-512 (2026-12-04, EPYC). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVC_NO_CLONES)
#define KVC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVC_CLONES
#endif

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Exact value of an fp8 code as fp32 bits, NaN codes as the numpy route's NaN (E4M3: +qNaN
 * whatever the sign, as fp8_widen's 0x7E00; E5M2: the fp16 NaN's payload, quiet). Normal codes:
 * the exponent rebiased; subnormal ones: the mantissa's integer times 2^-9 (E4M3) / 2^-16
 * (E5M2), exact. Branch-free (masks), so that gcc vectorizes the loops that use them. */
static inline uint32_t sel(uint32_t mask, uint32_t a, uint32_t b) {
  return (a & mask) | (b & ~mask);
}

static inline uint32_t e4m3_bits(uint32_t c) {
  uint32_t em = c & 0x7Fu;
  uint32_t normal = (em << 20) + (120u << 23);
  uint32_t sub = to_bits((float)(int32_t)em * 0x1p-9f);
  uint32_t v = sel(-(uint32_t)(em < 8u), sub, normal) | ((c & 0x80u) << 24);
  return sel(-(uint32_t)(em == 0x7Fu), 0x7FC00000u, v);
}

static inline uint32_t e5m2_bits(uint32_t c) {
  uint32_t em = c & 0x7Fu;
  uint32_t normal = (em << 21) + (112u << 23);
  uint32_t sub = to_bits((float)(int32_t)em * 0x1p-16f);
  uint32_t special = 0x7F800000u | ((em & 3u) << 21) | (em > 0x7Cu ? 0x00400000u : 0u);
  uint32_t v = sel(-(uint32_t)(em < 4u), sub, sel(-(uint32_t)(em >= 0x7Cu), special, normal));
  return v | ((c & 0x80u) << 24);
}

static inline float e4m3_value(uint8_t c) { return from_bits(e4m3_bits(c)); }
static inline float e5m2_value(uint8_t c) { return from_bits(e5m2_bits(c)); }

/* c10's fp32 -> Float8_e4m3fn / Float8_e5m2 conversions (what torch's .to(fp8) computes). */
static inline uint8_t e4m3_code(float f) {
  uint32_t b = to_bits(f), sign = b & 0x80000000u, r;
  b ^= sign;
  if (b >= (1087u << 20)) {
    r = 0x7Fu;
  } else if (b < (121u << 23)) {
    r = (to_bits(from_bits(b) + from_bits(141u << 23)) - (141u << 23)) & 0xFFu;
  } else {
    uint32_t odd = (b >> 20) & 1u;
    b += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu;
    r = ((b + odd) >> 20) & 0xFFu;
  }
  return (uint8_t)(r | (sign >> 24));
}

static inline uint8_t e5m2_code(float f) {
  uint32_t b = to_bits(f), sign = b & 0x80000000u, r;
  b ^= sign;
  if (b >= (143u << 23)) {
    r = b > (255u << 23) ? 0x7Fu : 0x7Cu;
  } else if (b < (113u << 23)) {
    r = (to_bits(from_bits(b) + from_bits(134u << 23)) - (134u << 23)) & 0xFFu;
  } else {
    uint32_t odd = (b >> 21) & 1u;
    b += ((uint32_t)(15 - 127) << 23) + 0xFFFFFu;
    r = ((b + odd) >> 21) & 0xFFu;
  }
  return (uint8_t)(r | (sign >> 24));
}

static inline uint8_t encode(int e5m2, float f) { return e5m2 ? e5m2_code(f) : e4m3_code(f); }

/* out [H, n, PD] fp32 = decoded codes of the page-heads (pages[j] * H + h) times their page
 * scale. NaN codes give their NaN (the numpy route's NaN * scale), a NaN scale its own. */
static inline void gather_one(int e5m2, const uint8_t *restrict codes,
                              const float *restrict scales, const int64_t *restrict pages,
                              int n, int H, int PD, float *restrict out) {
  for (int h = 0; h < H; h++) {
    for (int j = 0; j < n; j++) {
      int64_t row = pages[j] * H + h;
      const uint8_t *c = codes + row * PD;
      float s = scales[row];
      float *o = out + ((int64_t)h * n + j) * PD;
      if (s != s) {   /* a NaN scale: its NaN (quiet) everywhere, NaN codes too, as torch's */
        float q = from_bits(to_bits(s) | 0x00400000u);
        for (int i = 0; i < PD; i++) o[i] = q;
      } else if (e5m2) {
        for (int i = 0; i < PD; i++) {   /* NaN codes: their NaN; others times s */
          uint32_t v = e5m2_bits(c[i]);
          uint32_t r = to_bits(from_bits(v) * s);
          o[i] = from_bits(sel(-(uint32_t)((c[i] & 0x7Fu) > 0x7Cu), v, r));
        }
      } else {
        for (int i = 0; i < PD; i++) {
          uint32_t v = e4m3_bits(c[i]);
          uint32_t r = to_bits(from_bits(v) * s);
          o[i] = from_bits(sel(-(uint32_t)((c[i] & 0x7Fu) == 0x7Fu), v, r));
        }
      }
    }
  }
}

/* K and V (k = 1 or 2 parts) of one sequence, out [k, H, n, PD]. */
KVC_CLONES void kvc_fp8_gather(int e5m2, int k, const uint8_t *codes0, const float *scales0,
                    const uint8_t *codes1, const float *scales1, const int64_t *pages, int n,
                    int H, int PD, float *out) {
  gather_one(e5m2, codes0, scales0, pages, n, H, PD, out);
  if (k > 1) gather_one(e5m2, codes1, scales1, pages, n, H, PD, out + (int64_t)H * n * PD);
}

/* fp8.grow_page_scale on one page-head (cover > scale > 0), as paged.py _grown_scale: scale *
 * 2^k with the smallest k such that it is >= cover; INFINITY past fp32's range. */
static double grown_scale(double scale, double cover) {
  int e_s, e_c;
  double m_s = frexp(scale, &e_s), m_c = frexp(cover, &e_c);
  double g = ldexp(m_s, e_c + (m_c > m_s));
  return g <= (double)FLT_MAX ? g : INFINITY;
}

/* One decode step's token of k tensors (a layer's K and V) at offset o of page p, as
 * PagedTensor.write_tokens_fp8 writes it. x[i]: [H, Ds] fp32. s_old: page p's scales (the kept
 * facts', o > 0). With the kept fact (o > 0): the quotients x / s_old, taken if no |quotient|
 * exceeds `screen`; else (or at o == 0), with `decide`, the full decision: scales fresh (o == 0)
 * or grown by powers of two, the grown heads' first o codes re-encoded, the token encoded.
 * s_new [k * H]: the scales after it; work: [k * H * P * Ds] fp32 scratch.
 * Returns -1: nothing written (NaN / Inf in x, a scale past fp32, or the screen refused and
 * not `decide`); 0: written under the kept scales; 1: decided, a fact may be kept at o + 1;
 * 2: decided, no fact. */
int kvc_fp8_write(int e5m2, int k, int H, int Ds, int P, int64_t p, int o, uint8_t *codes0,
                  float *scales0, uint8_t *codes1, float *scales1, const float *x0,
                  const float *x1, double divisor, float fmax, float screen, float min_scale,
                  int decide, float *s_new, float *work) {
  uint8_t *codes[2] = {codes0, codes1};
  float *scales[2] = {scales0, scales1};
  const float *xs[2] = {x0, x1};
  const int64_t PDs = (int64_t)P * Ds;
  int kH = k * H;
  if (o) {   /* the kept fact's screen */
    int ok = 1;
    for (int i = 0; i < k; i++)
      for (int h = 0; h < H; h++) {
        float s = scales[i][p * H + h];
        const float *x = xs[i] + (int64_t)h * Ds;
        float *y = work + ((int64_t)i * H + h) * Ds;
        for (int d = 0; d < Ds; d++) {
          y[d] = x[d] / s;
          ok &= fabsf(y[d]) <= screen;
        }
      }
    if (ok) {
      for (int i = 0; i < k; i++)
        for (int h = 0; h < H; h++) {
          uint8_t *c = codes[i] + (p * H + h) * PDs + (int64_t)o * Ds;
          const float *y = work + ((int64_t)i * H + h) * Ds;
          for (int d = 0; d < Ds; d++) c[d] = encode(e5m2, y[d]);
          s_new[i * H + h] = scales[i][p * H + h];
        }
      return 0;
    }
    if (!decide) return -1;
  } else if (!decide) {
    return -1;
  }
  /* the full decision: amax, cover (the double quotient rounded to fp32), the new scales */
  int keep = o + 1 < P;
  for (int j = 0; j < kH; j++) {
    const float *x = xs[j / H] + (int64_t)(j % H) * Ds;
    float a = 0.0f;
    for (int d = 0; d < Ds; d++) {
      float v = fabsf(x[d]);
      if (!(v <= FLT_MAX)) return -1;   /* NaN / Inf: the general path */
      a = v > a ? v : a;
    }
    float cover = (float)((double)a / divisor);
    float s_old = scales[j / H][p * H + j % H];
    if (o) {
      float g = s_old;
      if (cover > s_old) {
        double gd = grown_scale((double)s_old, (double)cover);
        if (gd == INFINITY) return -1;
        g = (float)gd;
      }
      s_new[j] = g;
    } else {
      int live = a > 0.0f;
      s_new[j] = live ? (cover > min_scale ? cover : min_scale) : 1.0f;
      keep &= live && cover >= min_scale;
    }
  }
  /* nothing written before this point: now the grown heads' earlier codes, the token, scales */
  for (int j = 0; j < kH; j++) {
    int i = j / H, h = j % H;
    float s_old = scales[i][p * H + h], sn = s_new[j];
    uint8_t *row = codes[i] + (p * H + h) * PDs;
    if (o && sn != s_old) {   /* decoded under s_old, encoded under s_new */
      int64_t m = (int64_t)o * Ds;
      for (int64_t t = 0; t < m; t++) {
        float v = e5m2 ? e5m2_value(row[t]) : e4m3_value(row[t]);
        v = (v * s_old) / sn;
        v = v > fmax ? fmax : v < -fmax ? -fmax : v;   /* (NaN stays NaN) */
        row[t] = encode(e5m2, v);
      }
    }
    const float *x = xs[i] + (int64_t)h * Ds;
    uint8_t *c = row + (int64_t)o * Ds;
    for (int d = 0; d < Ds; d++) {
      float v = x[d] / sn;
      v = v > fmax ? fmax : v < -fmax ? -fmax : v;
      c[d] = encode(e5m2, v);
    }
    scales[i][p * H + h] = sn;
  }
  return keep ? 1 : 2;
}

/* The decode and the encode alone, for the tests: out[i] = value(codes[i]) (NaN codes as
 * above), codes[i] = encode(x[i]) (no clamp). */
void kvc_fp8_values(int e5m2, const uint8_t *codes, int64_t n, float *out) {
  for (int64_t i = 0; i < n; i++) out[i] = e5m2 ? e5m2_value(codes[i]) : e4m3_value(codes[i]);
}

void kvc_fp8_encode(int e5m2, const float *x, int64_t n, uint8_t *codes) {
  for (int64_t i = 0; i < n; i++) codes[i] = encode(e5m2, x[i]);
}

/* bf16 pages (unquantized, c10::BFloat16 bits) of a decode step, one call per layer:
 * the token of K and V (x0, x1: [H, D] fp32) written at offset o of page p as torch's
 * .to(bfloat16) rounds it (round to nearest even: (u + 0x7FFF + (u >> 16 & 1)) >> 16), then
 * the sequence's pages widened (exact: the bits shifted) into out [2, H, n, P * D] fp32, heads
 * first. Pools: [N * H, P * D] uint16, one row per page-head. A NaN in x (whose bits torch's
 * vectorized and scalar casts make differently) writes nothing and returns -1 (the caller
 * writes with torch, then calls again with x0 = NULL: the gather only); else 0. */
KVC_CLONES int kvc_bf16_step(int H, int D, int P, int64_t p, int o, uint16_t *pages0,
                             uint16_t *pages1, const float *x0, const float *x1,
                             const int64_t *pages, int n, float *out) {
  uint16_t *parts[2] = {pages0, pages1};
  const int64_t PD = (int64_t)P * D;
  if (x0) {
    const float *xs[2] = {x0, x1};
    int nan = 0;
    for (int i = 0; i < 2; i++)
      for (int64_t e = 0; e < (int64_t)H * D; e++) nan |= xs[i][e] != xs[i][e];
    if (nan) return -1;
    for (int i = 0; i < 2; i++)
      for (int h = 0; h < H; h++) {
        uint16_t *t = parts[i] + (p * H + h) * PD + (int64_t)o * D;
        const float *x = xs[i] + (int64_t)h * D;
        for (int d = 0; d < D; d++) {
          uint32_t u = to_bits(x[d]);
          t[d] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        }
      }
  }
  for (int i = 0; i < 2; i++)
    for (int h = 0; h < H; h++)
      for (int j = 0; j < n; j++) {
        const uint16_t *restrict s = parts[i] + (pages[j] * H + h) * PD;
        float *restrict d = out + (((int64_t)i * H + h) * n + j) * PD;
        for (int64_t e = 0; e < PD; e++) d[e] = from_bits((uint32_t)s[e] << 16);
      }
  return 0;
}

/* kvc_fp8_write, then (where it wrote: a return >= 0) kvc_fp8_gather of the same K and V
 * pages: a decode step's layer in one call. */
int kvc_fp8_step(int e5m2, int k, int H, int Ds, int P, int64_t p, int o, uint8_t *codes0,
                 float *scales0, uint8_t *codes1, float *scales1, const float *x0,
                 const float *x1, double divisor, float fmax, float screen, float min_scale,
                 int decide, float *s_new, float *work, const int64_t *pages, int n,
                 float *out) {
  int rc = kvc_fp8_write(e5m2, k, H, Ds, P, p, o, codes0, scales0, codes1, scales1, x0, x1,
                         divisor, fmax, screen, min_scale, decide, s_new, work);
  if (rc >= 0) kvc_fp8_gather(e5m2, k, codes0, scales0, codes1, scales1, pages, n, H, P * Ds,
                              out);
  return rc;
}
