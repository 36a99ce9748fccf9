/* blockdot.c: y = x @ w^T for a few rows of x, w in blocks of 32 weights of one output row with a
 * scale and a min each (two of each for the kinds that scale 16 weights), the codes and scales exact,
 * x in float32 or rounded to int16 per block. It runs twelve of GGUF's block types as stored (Q4_0,
 * Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, IQ4_XS, Q6_K, Q3_K and Q2_K: blockdot.py's KINDS),
 * nanoserve's own int4 (Q4_1's form), and rows of several of them stacked in one matrix as int8 codes.
 *
 * Built at first use, with fused_decode.c, into one library by nanoserve/model/cabi.py (cc -O3
 * -march=native -fopenmp -fno-trapping-math), and run in place of torch's kernels unless the start-up
 * probe times theirs BLOCKDOT_MARGIN faster (nanoserve/model/precision.py). Why it exists: torch's
 * one-row int4 kernel rounds a GGUF file's fp16 scales to bf16 (8 of their 11 bits), its int8 Q8_0
 * head needs two int4 passes, it takes no kind that scales 16 weights, and on a CPU without AVX-512
 * bf16 it has no fast path at all.
 *
 * Every block is w[n, k] = d * q + m for 32 consecutive k of one output row n, its codes q either
 * 4 bits (0..15) or 8 (int8); `planes` names which, as the 4-bit planes the codes take:
 *   Q4_1: 4-bit codes (planes = 1), d and m as stored;   Q4_0 (d (q - 8)): 4-bit codes, m = -8 d;
 *   Q8_0 (d q): int8 codes as stored (planes = 2), m = 0; Q5_0, Q5_1 and IQ4_NL as int8 codes (q - 16,
 *   q, the table's value) with fp16 d and m; Q4_K (4-bit) and Q5_K, IQ4_XS (int8) with float heads;
 *   Q6_K, Q3_K and Q2_K, whose groups are 16, as int8 codes with two scales (G16) and, for Q2_K,
 *   two mins (G16M) a block.
 * All of these are exact in the heads' type and in float32 (blockdot.py checks that fp16 ones are).
 *
 * Layout ("panels"): output rows in panels of 16, one vector lane per row. Block (p, b) is
 *   fp16 d[16], fp16 m[16] (float d[16], m[16] where planes has F32_HEADS: a K-quant's group scales,
 *   its fp16 d times a 6-bit scale, exact in float32 and not in fp16; with G16M float d0, d1, m0,
 *   m1, 16 each), then 256 bytes of 4-bit codes or 512 of int8 codes:
 *   4-bit: 4 octets of 16 uint32: lane n of octet o holds the codes of row 16 p + n at
 *          k = 32 b + 8 o + i, i = 0..7, in bits 4 i .. 4 i + 3;
 *   int8:  per octet o and j = 0..3, 32 bytes: row n's codes at k = 32 b + 8 o + j and that k + 4 in
 *          bytes 2 n and 2 n + 1, so that one sign extension to int16 gives each row's pair of k
 *          (the pairs the int16 path multiplies at once, below).
 * So a weight costs 5 bits (4-bit codes, fp16 heads), 6 (4-bit, float heads), 9 (int8, fp16 heads),
 * 10 (int8, float heads or G16) or 12 (G16M); docs/cpu-kernels.md gives each kind's.
 * A step takes each k's 16 codes as floats (a table lookup or a conversion) and multiplies them by
 * x[k] broadcast, so 16 rows advance at once and no sum crosses lanes; g[n] = sum over the block of
 * q[n, k] x[k] is then scaled once: acc[n] += d[n] g[n] + m[n] sum_b(x). bf16 activations are widened
 * to float32 first (exactly).
 *
 * File-bit panels (I8P, below): Q4_K, Q6_K and IQ4_XS, and the 32-weight kinds (Q4_0, IQ4_NL, Q8_0,
 * Q4_1, Q5_0, Q5_1), at the file's bits on x rounded to int8, summed in int32 by VNNI's vpdpbusd (or
 * vpmaddubsw + vpmaddwd), and, for the K-quants in builds with AMX-INT8 where Linux grants the tiles,
 * by TDPBSUD from `amx_rows` rows of x: the same sums and float steps either way.
 *
 * The int16 path (tile16; from `int16_rows` rows of x, PlanOverrides.blockdot_int16_rows) rounds
 * each block of x to int16 against its largest |x| first and sums codes times x in int32, two k a
 * multiply-add (vpdpwssd with AVX-512 VNNI, vpmaddwd without): fewer instructions a code than
 * widening every code to a float, for the same result within x's rounding.
 *
 * One 16-lane vector type, vf (and vi, its int32 twin), is what differs between machines: one
 * __m512 (AVX-512 F and BW, with F16C), two __m256 (AVX2, FMA, F16C), or 16 lanes in plain C
 * (correct and slow; the start-up probe times it like any build). Output rows are split over
 * `nthreads` OpenMP threads, on the libgomp torch has already loaded; the tiles each thread runs,
 * per build, are in blockdot_tasks and task below, and in docs/cpu-kernels.md ("Tiles").
 */
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blockdot.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define SIMD 512
typedef __m512 vf;
typedef __m512i vi;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vhalf(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vbf16(const uint16_t *p) {  /* 16 bf16 widened exactly */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vi viload(const uint32_t *p) { return _mm512_loadu_si512(p); }
/* the code at bit `shift` of every lane, as a float: a 16-entry table lookup reads an index's low 4 bits */
static inline vf vcode(vi v, int shift) {
  const vf table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_permutexvar_ps(shift ? _mm512_srli_epi32(v, shift) : v, table);
}
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vi vizero(void) { return _mm512_setzero_si512(); }
/* 4-bit codes j and j + 4 of every lane as two int16 */
static inline vi vpair(vi v, int j) {
  const __m512i m = _mm512_set1_epi32(0x000F000F);
  return _mm512_and_si512(j ? _mm512_srli_epi32(v, 4 * j) : v, m);
}
/* int8 codes: every lane's pair (32 bytes at p) as two int16, and the first (hi = 0) or second as floats */
static inline vi vpair8(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vcode8(const int8_t *p, int hi) {
  const vi v = vpair8(p);
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(hi ? v : _mm512_slli_epi32(v, 16), 16));
}
/* acc + per lane the dot of its two int16 with the two of s */
static inline vi vdot(vi acc, vi u, int32_t s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, u, _mm512_set1_epi32(s));
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(u, _mm512_set1_epi32(s)));
#endif
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SIMD 256
typedef struct { __m256 a, b; } vf;
typedef struct { __m256i a, b; } vi;
static inline vf vzero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vset1(float a) { return (vf){_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline void vstore(float *p, vf x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline vf vfma(vf x, vf y, vf z) { return (vf){_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
static inline vf vhalf(const uint16_t *p) {
  return (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
static inline vi viload(const uint32_t *p) {
  return (vi){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 8))};
}
static inline vf vload(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline __m256 bf16x8(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vbf16(const uint16_t *p) { return (vf){bf16x8(p), bf16x8(p + 8)}; }
static inline vf vcode(vi v, int shift) {
  const __m256i m4 = _mm256_set1_epi32(15);
  return (vf){_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v.a, shift), m4)),
              _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v.b, shift), m4))};
}
static inline vf vmul(vf x, vf y) { return (vf){_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline vf vadd(vf x, vf y) { return (vf){_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline vf vcvt(vi v) { return (vf){_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)}; }
static inline vi vizero(void) { return (vi){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline vi vpair(vi v, int j) {
  const __m256i m = _mm256_set1_epi32(0x000F000F);
  return (vi){_mm256_and_si256(_mm256_srli_epi32(v.a, 4 * j), m), _mm256_and_si256(_mm256_srli_epi32(v.b, 4 * j), m)};
}
static inline vi vpair8(const int8_t *p) {
  return (vi){_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
              _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
static inline __m256 code8x8(__m256i v, int hi) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(hi ? v : _mm256_slli_epi32(v, 16), 16));
}
static inline vf vcode8(const int8_t *p, int hi) {
  const vi v = vpair8(p);
  return (vf){code8x8(v.a, hi), code8x8(v.b, hi)};
}
static inline vi vdot(vi acc, vi u, int32_t s) {
  const __m256i sv = _mm256_set1_epi32(s);
  return (vi){_mm256_add_epi32(acc.a, _mm256_madd_epi16(u.a, sv)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(u.b, sv))};
}

#else
#define SIMD 0
typedef struct { float v[16]; } vf;
typedef struct { uint32_t v[16]; } vi;
static inline vf vzero(void) { vf r = {{0}}; return r; }
static inline vf vset1(float a) { vf r; for (int j = 0; j < 16; j++) r.v[j] = a; return r; }
static inline void vstore(float *p, vf x) { memcpy(p, x.v, sizeof x.v); }
static inline vf vfma(vf x, vf y, vf z) { for (int j = 0; j < 16; j++) z.v[j] += x.v[j] * y.v[j]; return z; }
static inline vf vhalf(const uint16_t *p) { vf r; for (int j = 0; j < 16; j++) r.v[j] = f16_to_f32(p[j]); return r; }
static inline vf vload(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vf vbf16(const uint16_t *p) { vf r; for (int j = 0; j < 16; j++) r.v[j] = bf16_to_f32(p[j]); return r; }
static inline vi viload(const uint32_t *p) { vi r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vf vcode(vi v, int shift) { vf r; for (int j = 0; j < 16; j++) r.v[j] = (v.v[j] >> shift) & 15; return r; }
static inline vf vmul(vf x, vf y) { for (int j = 0; j < 16; j++) x.v[j] *= y.v[j]; return x; }
static inline vf vadd(vf x, vf y) { for (int j = 0; j < 16; j++) x.v[j] += y.v[j]; return x; }
static inline vf vcvt(vi v) { vf r; for (int j = 0; j < 16; j++) r.v[j] = (float)(int32_t)v.v[j]; return r; }
static inline vi vizero(void) { vi r = {{0}}; return r; }
static inline vi vpair(vi v, int j) {
  for (int n = 0; n < 16; n++) v.v[n] = (v.v[n] >> 4 * j) & 0x000F000Fu;
  return v;
}
static inline vi vpair8(const int8_t *p) {
  vi r;
  for (int n = 0; n < 16; n++) r.v[n] = (uint16_t)(int16_t)p[2 * n] | (uint32_t)(uint16_t)(int16_t)p[2 * n + 1] << 16;
  return r;
}
static inline vf vcode8(const int8_t *p, int hi) { vf r; for (int n = 0; n < 16; n++) r.v[n] = p[2 * n + hi]; return r; }
static inline vi vdot(vi acc, vi u, int32_t s) {
  for (int n = 0; n < 16; n++)
    acc.v[n] += (uint32_t)((int32_t)(int16_t)(u.v[n] & 0xffff) * (int16_t)((uint32_t)s & 0xffff) +
                           (int32_t)(int16_t)(u.v[n] >> 16) * (int16_t)((uint32_t)s >> 16));
  return acc;
}
#endif

/* A line on its way to L2. __builtin_prefetch, not _mm_prefetch: gcc 12
   leaves no prefetch instruction for the intrinsic inside these loops (notes/blockdot.md, "Why
   blockdot.c is as it is"). */
#if SIMD
static inline void prefetch(const void *p) { __builtin_prefetch(p, 0, 2); }
#else
static inline void prefetch(const void *p) { (void)p; }
#endif

#define G 32        /* weights per block */
#define P 16        /* output rows per panel: one vf */
#define AHEAD 4     /* blocks prefetched ahead of the one being read, in each panel */
#define INLINE static inline __attribute__((always_inline))

struct panel_head { uint16_t d[P], m[P]; };  /* then the codes: planes * 4 octets * 16 uint32 */
/* `planes` | F32_HEADS: the head holds float d[16], m[16] (128 bytes) in place of fp16 ones, for scales
   that fp16 does not hold exactly (a K-quant's d times its group's 6-bit scale). */
#define F32_HEADS 4
/* `planes` | G16 (with F32_HEADS): two scales a block, one for each 16 weights, and no min: the
   float head holds d for k 0..15 then d for k 16..31 (Q6_K, Q3_K: int8 codes in groups of 16). */
#define G16 8
/* `planes` | G16M (with G16 and F32_HEADS): a min for each 16 weights too, after the two scales:
   float d0[16], d1[16], m0[16], m1[16] (Q2_K; and rows of 32-weight kinds with mins stacked beside
   16-weight ones, a K-quant q beside a Q6_K v, their scale and min given to both halves). */
#define G16M 16
#define CODES(planes) ((planes) & 3)  /* 1: 4-bit codes, 2: int8 */

static inline int64_t head_bytes(int planes) {
  return planes & F32_HEADS ? (planes & G16M ? 4 : 2) * P * (int64_t)sizeof(float) : (int64_t)sizeof(struct panel_head);
}
static inline int64_t block_bytes(int planes) { return head_bytes(planes) + CODES(planes) * 4 * P * 4; }

int blockdot_simd(void) { return SIMD; }

/* Block (p, b) of panels w with bb bytes a block: its 16 d and m as floats, 4-bit codes' octet o, int8
   codes' pair (o, j). The codes end the block (256 bytes of 4-bit ones, 512 of int8), whatever its head. */
static inline void heads_at(const uint8_t *w, int64_t p, int64_t B, int64_t b, int64_t bb, int planes, vf *d, vf *m) {
  const uint8_t *h = w + (p * B + b) * bb;
  if (planes & F32_HEADS) {
    *d = vload((const float *)h);
    *m = vload((const float *)h + P);
  } else {
    *d = vhalf(((const struct panel_head *)h)->d);
    *m = vhalf(((const struct panel_head *)h)->m);
  }
}
/* G16M: block (p, b)'s mins of its first and second 16 weights */
static inline void mins16_at(const uint8_t *w, int64_t p, int64_t B, int64_t b, int64_t bb, vf *m0, vf *m1) {
  const float *h = (const float *)(w + (p * B + b) * bb);
  *m0 = vload(h + 2 * P);
  *m1 = vload(h + 3 * P);
}
static inline const uint32_t *octet_at(const uint8_t *w, int64_t p, int64_t B, int64_t b, int64_t bb, int o) {
  return (const uint32_t *)(w + (p * B + b + 1) * bb - 4 * 4 * P) + o * P;
}
static inline const int8_t *pair_at(const uint8_t *w, int64_t p, int64_t B, int64_t b, int64_t bb, int o, int j) {
  return (const int8_t *)(w + (p * B + b + 1) * bb - 2 * 4 * 4 * P) + (4 * o + j) * 2 * P;
}
/* AHEAD blocks past block b of each of panels p0 .. p0 + NP - 1, on their way to L2 */
static inline void prefetch_ahead(const uint8_t *w, int64_t p0, int NP, int64_t B, int64_t b, int64_t bb) {
  for (int p = 0; p < NP; p++)
    for (int64_t l = 0; l < bb; l += 64) prefetch(w + ((p0 + p) * B + b + AHEAD) * bb + l);
}


/* NP consecutive panels (16 NP output rows) against MR rows of x: acc[p * MR + r]. NP, MR are
   constants once inlined, so the sums stay in registers (NP * MR <= 8). */
INLINE void tile(const struct xin *in, int64_t K, const uint8_t *w, int64_t B, int planes, int64_t p0, int64_t r0,
                 const int NP, const int MR, vf acc[8]) {
  const int64_t bb = block_bytes(planes);
  for (int a = 0; a < NP * MR; a++) acc[a] = vzero();
  for (int64_t b = 0; b < B; b++) {
    vf g[8];
    for (int a = 0; a < NP * MR; a++) g[a] = vzero();
    prefetch_ahead(w, p0, NP, B, b, bb);
    for (int o = 0; o < 4; o++) {
      const int64_t k = b * G + o * 8;
      if (CODES(planes) == 1) {
        vi codes[4];
        for (int p = 0; p < NP; p++) codes[p] = viload(octet_at(w, p0 + p, B, b, bb, o));
        for (int i = 0; i < 8; i++)
          for (int p = 0; p < NP; p++) {
            const vf q = vcode(codes[p], 4 * i);
            for (int r = 0; r < MR; r++) g[p * MR + r] = vfma(q, vset1(in->x[(r0 + r) * K + k + i]), g[p * MR + r]);
          }
      } else {
        for (int i = 0; i < 8; i++)  /* k + i is byte i / 4 of pair i % 4 */
          for (int p = 0; p < NP; p++) {
            const vf q = vcode8(pair_at(w, p0 + p, B, b, bb, o, i % 4), i / 4);
            for (int r = 0; r < MR; r++) g[p * MR + r] = vfma(q, vset1(in->x[(r0 + r) * K + k + i]), g[p * MR + r]);
          }
      }
      if ((planes & G16) && o == 1)  /* the first 16 weights' scale (and min), then the sums start again */
        for (int p = 0; p < NP; p++) {
          vf d, d1, m0, m1;
          heads_at(w, p0 + p, B, b, bb, planes, &d, &d1);
          if (planes & G16M) mins16_at(w, p0 + p, B, b, bb, &m0, &m1);
          for (int r = 0; r < MR; r++) {
            acc[p * MR + r] = vfma(d, g[p * MR + r], acc[p * MR + r]), g[p * MR + r] = vzero();
            if (planes & G16M) acc[p * MR + r] = vfma(m0, vset1(in->xsum16[((r0 + r) * B + b) * 2]), acc[p * MR + r]);
          }
        }
    }
    for (int p = 0; p < NP; p++) {
      vf d, m, m0, m1;
      heads_at(w, p0 + p, B, b, bb, planes, &d, &m);
      if (planes & G16M) mins16_at(w, p0 + p, B, b, bb, &m0, &m1);
      for (int r = 0; r < MR; r++) {
        acc[p * MR + r] = planes & G16 ? vfma(m, g[p * MR + r], acc[p * MR + r])  /* m: the second 16's d */
                                       : vfma(m, vset1(in->xsum[(r0 + r) * B + b]), vfma(d, g[p * MR + r], acc[p * MR + r]));
        if (planes & G16M) acc[p * MR + r] = vfma(m1, vset1(in->xsum16[((r0 + r) * B + b) * 2 + 1]), acc[p * MR + r]);
      }
    }
  }
}

/* The same tile on the int16 path: per block, integer sums g of codes times x's int16 codes (two
   codes of a lane against two of x at once: AVX-512 VNNI's vpdpwssd, or vpmaddwd and an add without
   it; exact in int32), scaled once: acc[n] += d[n] xd g[n] + m[n] sum_b(x). Against the float path:
   a quarter of the multiply instructions a code; x's rounding, at most amax / 65534 within its
   block, is over a hundred times finer than bf16's (notes/blockdot.md). */
INLINE void tile16(const struct xin *in, const uint8_t *w, int64_t B, int planes, int64_t p0, int64_t r0,
                   const int NP, const int MR, vf acc[8]) {
  const int64_t bb = block_bytes(planes);
  for (int a = 0; a < NP * MR; a++) acc[a] = vzero();
  for (int64_t b = 0; b < B; b++) {
    vi g[8];
    for (int a = 0; a < NP * MR; a++) g[a] = vizero();
    prefetch_ahead(w, p0, NP, B, b, bb);
    for (int o = 0; o < 4; o++) {
      for (int p = 0; p < NP; p++) {
        const vi codes = CODES(planes) == 1 ? viload(octet_at(w, p0 + p, B, b, bb, o)) : vizero();
        for (int j = 0; j < 4; j++) {
          const vi pair = CODES(planes) == 1 ? vpair(codes, j) : vpair8(pair_at(w, p0 + p, B, b, bb, o, j));
          for (int r = 0; r < MR; r++) g[p * MR + r] = vdot(g[p * MR + r], pair, in->xq[((r0 + r) * B + b) * 16 + 4 * o + j]);
        }
      }
      if ((planes & G16) && o == 1)  /* the first 16 weights' scale (and min), then the sums start again */
        for (int p = 0; p < NP; p++) {
          vf d, d1, m0, m1;
          heads_at(w, p0 + p, B, b, bb, planes, &d, &d1);
          if (planes & G16M) mins16_at(w, p0 + p, B, b, bb, &m0, &m1);
          for (int r = 0; r < MR; r++) {
            const int64_t rb = (r0 + r) * B + b;
            acc[p * MR + r] = vfma(vmul(d, vset1(in->xd[rb])), vcvt(g[p * MR + r]), acc[p * MR + r]);
            if (planes & G16M) acc[p * MR + r] = vfma(m0, vset1(in->xsum16[rb * 2]), acc[p * MR + r]);
            g[p * MR + r] = vizero();
          }
        }
    }
    for (int p = 0; p < NP; p++) {
      vf d, m, m0, m1;
      heads_at(w, p0 + p, B, b, bb, planes, &d, &m);
      if (planes & G16M) mins16_at(w, p0 + p, B, b, bb, &m0, &m1);
      for (int r = 0; r < MR; r++) {
        const int64_t rb = (r0 + r) * B + b;
        acc[p * MR + r] = planes & G16
            ? vfma(vmul(m, vset1(in->xd[rb])), vcvt(g[p * MR + r]), acc[p * MR + r])  /* m: the second 16's d */
            : vfma(m, vset1(in->xsum[rb]), vfma(vmul(d, vset1(in->xd[rb])), vcvt(g[p * MR + r]), acc[p * MR + r]));
        if (planes & G16M) acc[p * MR + r] = vfma(m1, vset1(in->xsum16[rb * 2 + 1]), acc[p * MR + r]);
      }
    }
  }
}

#if SIMD == 256
/* tile16 for one panel against four rows of x, written out for AVX2: gcc's register allocation of the
   generic tile (a vf is two registers here) keeps the pair shifts in a register and re-associates the
   integer sums, spilling them inside the loop (notes/blockdot.md, "Why blockdot.c is as it is"). Here
   the 8 int32 sums, the pair of codes, the mask and one broadcast x are 13 of the 16 registers, and an
   empty asm after each pair keeps the sums where they are. Per octet and pair j: the pair of codes
   (4-bit: 2 shifts and 2 ands of the octet re-read from L1; int8: 2 sign extensions), then for each
   row one broadcast, 2 vpmaddwd and 2 vpaddd. */
#define DOT4(pa, pb, j)                                                                                    \
  do {                                                                                                     \
    __m256i s = _mm256_set1_epi32(q0[4 * o + (j)]);                                                        \
    g0a = _mm256_add_epi32(g0a, _mm256_madd_epi16(pa, s)), g0b = _mm256_add_epi32(g0b, _mm256_madd_epi16(pb, s)); \
    s = _mm256_set1_epi32(q1[4 * o + (j)]);                                                                \
    g1a = _mm256_add_epi32(g1a, _mm256_madd_epi16(pa, s)), g1b = _mm256_add_epi32(g1b, _mm256_madd_epi16(pb, s)); \
    s = _mm256_set1_epi32(q2[4 * o + (j)]);                                                                \
    g2a = _mm256_add_epi32(g2a, _mm256_madd_epi16(pa, s)), g2b = _mm256_add_epi32(g2b, _mm256_madd_epi16(pb, s)); \
    s = _mm256_set1_epi32(q3[4 * o + (j)]);                                                                \
    g3a = _mm256_add_epi32(g3a, _mm256_madd_epi16(pa, s)), g3b = _mm256_add_epi32(g3b, _mm256_madd_epi16(pb, s)); \
    __asm__("" : "+x"(g0a), "+x"(g0b), "+x"(g1a), "+x"(g1b), "+x"(g2a), "+x"(g2b), "+x"(g3a), "+x"(g3b));        \
  } while (0)
#define PAIR4(j)                                                                                           \
  do {                                                                                                     \
    const __m256i pa = _mm256_and_si256((j) ? _mm256_srli_epi32(_mm256_loadu_si256(ca), 4 * (j)) : _mm256_loadu_si256(ca), mask); \
    const __m256i pb = _mm256_and_si256((j) ? _mm256_srli_epi32(_mm256_loadu_si256(cb), 4 * (j)) : _mm256_loadu_si256(cb), mask); \
    DOT4(pa, pb, j);                                                                                       \
  } while (0)
#define PAIR8(j)                                                                                           \
  do {                                                                                                     \
    const vi pair = vpair8(pair_at(w, p0, B, b, bb, o, j));                                                \
    DOT4(pair.a, pair.b, j);                                                                               \
  } while (0)

INLINE void block4(const uint8_t *w, int64_t p0, int64_t B, int64_t b, int64_t bb, const int32_t *q0, const int32_t *q1,
                   const int32_t *q2, const int32_t *q3, const int planes, const int o0, const int o1, __m256i g[8]) {
  const __m256i mask = _mm256_set1_epi32(0x000F000F);
  __m256i g0a = g[0], g0b = g[1], g1a = g[2], g1b = g[3], g2a = g[4], g2b = g[5], g3a = g[6], g3b = g[7];
  for (int o = o0; o < o1; o++) {
    if (planes == 1) {
      const __m256i *ca = (const __m256i *)octet_at(w, p0, B, b, bb, o), *cb = ca + 1;
      PAIR4(0);
      PAIR4(1);
      PAIR4(2);
      PAIR4(3);
    } else {
      PAIR8(0);
      PAIR8(1);
      PAIR8(2);
      PAIR8(3);
    }
  }
  g[0] = g0a, g[1] = g0b, g[2] = g1a, g[3] = g1b, g[4] = g2a, g[5] = g2b, g[6] = g3a, g[7] = g3b;
}
#undef PAIR8
#undef PAIR4
#undef DOT4

INLINE void tile16_avx2(const struct xin *in, const uint8_t *w, int64_t B, int planes, int64_t p0, int64_t r0,
                        vf acc[8]) {
  const int64_t bb = block_bytes(planes);
  for (int a = 0; a < 4; a++) acc[a] = vzero();
  for (int64_t b = 0; b < B; b++) {
    __m256i g[8];
    for (int a = 0; a < 8; a++) g[a] = _mm256_setzero_si256();
    prefetch_ahead(w, p0, 1, B, b, bb);
    const int32_t *q0 = in->xq + ((r0 + 0) * B + b) * 16, *q1 = in->xq + ((r0 + 1) * B + b) * 16,
                  *q2 = in->xq + ((r0 + 2) * B + b) * 16, *q3 = in->xq + ((r0 + 3) * B + b) * 16;
    vf d, m;
    heads_at(w, p0, B, b, bb, planes, &d, &m);
    if (planes & G16) {  /* int8 codes, a scale for each 16 weights (d, then m's slot), no min */
      vf m0, m1;
      if (planes & G16M) mins16_at(w, p0, B, b, bb, &m0, &m1);
      block4(w, p0, B, b, bb, q0, q1, q2, q3, 2, 0, 2, g);
      for (int r = 0; r < 4; r++) {
        const int64_t rb = (r0 + r) * B + b;
        const vf sum = {_mm256_cvtepi32_ps(g[2 * r]), _mm256_cvtepi32_ps(g[2 * r + 1])};
        acc[r] = vfma(vmul(d, vset1(in->xd[rb])), sum, acc[r]);
        if (planes & G16M) acc[r] = vfma(m0, vset1(in->xsum16[rb * 2]), acc[r]);
      }
      for (int a = 0; a < 8; a++) g[a] = _mm256_setzero_si256();
      block4(w, p0, B, b, bb, q0, q1, q2, q3, 2, 2, 4, g);
      for (int r = 0; r < 4; r++) {
        const int64_t rb = (r0 + r) * B + b;
        const vf sum = {_mm256_cvtepi32_ps(g[2 * r]), _mm256_cvtepi32_ps(g[2 * r + 1])};
        acc[r] = vfma(vmul(m, vset1(in->xd[rb])), sum, acc[r]);
        if (planes & G16M) acc[r] = vfma(m1, vset1(in->xsum16[rb * 2 + 1]), acc[r]);
      }
      continue;
    }
    if (CODES(planes) == 1) block4(w, p0, B, b, bb, q0, q1, q2, q3, 1, 0, 4, g);
    else block4(w, p0, B, b, bb, q0, q1, q2, q3, 2, 0, 4, g);
    for (int r = 0; r < 4; r++) {
      const int64_t rb = (r0 + r) * B + b;
      const vf sum = {_mm256_cvtepi32_ps(g[2 * r]), _mm256_cvtepi32_ps(g[2 * r + 1])};
      acc[r] = vfma(m, vset1(in->xsum[rb]), vfma(vmul(d, vset1(in->xd[rb])), sum, acc[r]));
    }
  }
}
#endif

/* The tile's sums into y [M, N], past-N rows (a panel's padding) left out. */
INLINE void tile_out(const struct xin *in, int64_t K, int64_t N, const uint8_t *w, int planes, int64_t p0,
                     int64_t r0, const int NP, const int MR, void *y, int y_bf16) {
  vf acc[8];
#if SIMD == 256
  if (in->xq && NP == 1 && MR == 4) tile16_avx2(in, w, K / G, planes, p0, r0, acc);
  else
#endif
  if (in->xq) tile16(in, w, K / G, planes, p0, r0, NP, MR, acc);
  else tile(in, K, w, K / G, planes, p0, r0, NP, MR, acc);
  for (int p = 0; p < NP; p++)
    for (int r = 0; r < MR; r++) {
      float lanes[P];
      vstore(lanes, acc[p * MR + r]);
      for (int n = 0; n < P && (p0 + p) * P + n < N; n++) {
        const int64_t at = (r0 + r) * N + (p0 + p) * P + n;
        if (y_bf16) ((uint16_t *)y)[at] = f32_to_bf16(lanes[n]);
        else ((float *)y)[at] = lanes[n];
      }
    }
}

/* Panels [p0, p0 + NP) against every row of x, in the largest tiles that fit. */
static void task(const struct xin *in, int64_t M, int64_t K, int64_t N, const uint8_t *w, int planes, int64_t p0,
                 int NP, void *y, int y_bf16) {
  for (int64_t r0 = 0; r0 < M;) {
    const int64_t left = M - r0;
    int MR = 1;
#if SIMD == 256
    if (NP == 1 && left >= 4) { r0 += 4; tile_out(in, K, N, w, planes, p0, r0 - 4, 1, 4, y, y_bf16); continue; }
#endif
    if (NP == 4 && left >= 2) { MR = 2; tile_out(in, K, N, w, planes, p0, r0, 4, 2, y, y_bf16); }
    else if (NP == 4) tile_out(in, K, N, w, planes, p0, r0, 4, 1, y, y_bf16);
    else if (NP == 2 && left >= 4) { MR = 4; tile_out(in, K, N, w, planes, p0, r0, 2, 4, y, y_bf16); }
#if SIMD == 512
    /* Three to seven rows in one tile, not two: each tile unpacks the panels' codes once, and a
       verification step of a few speculative rows (or a step of a few decodes) would pay twice. A
       row's sums run in the same order in any tile. */
    else if (NP == 2 && left == 3) { MR = 3; tile_out(in, K, N, w, planes, p0, r0, 2, 3, y, y_bf16); }
    else if (NP == 1 && left == 7) { MR = 7; tile_out(in, K, N, w, planes, p0, r0, 1, 7, y, y_bf16); }
    else if (NP == 1 && left == 6) { MR = 6; tile_out(in, K, N, w, planes, p0, r0, 1, 6, y, y_bf16); }
    else if (NP == 1 && left == 5) { MR = 5; tile_out(in, K, N, w, planes, p0, r0, 1, 5, y, y_bf16); }
    else if (NP == 1 && left == 3) { MR = 3; tile_out(in, K, N, w, planes, p0, r0, 1, 3, y, y_bf16); }
#endif
    else if (NP == 2 && left >= 2) { MR = 2; tile_out(in, K, N, w, planes, p0, r0, 2, 2, y, y_bf16); }
    else if (NP == 2) tile_out(in, K, N, w, planes, p0, r0, 2, 1, y, y_bf16);
    else if (left >= 8) { MR = 8; tile_out(in, K, N, w, planes, p0, r0, 1, 8, y, y_bf16); }
    else if (left >= 4) { MR = 4; tile_out(in, K, N, w, planes, p0, r0, 1, 4, y, y_bf16); }
    else if (left >= 2) { MR = 2; tile_out(in, K, N, w, planes, p0, r0, 1, 2, y, y_bf16); }
    else tile_out(in, K, N, w, planes, p0, r0, 1, 1, y, y_bf16);
    r0 += MR;
  }
}

/* ---- File-bit panels on int8 activations (planes & I8P) ----
 *
 * A matrix kept at its file's bits, multiplied in integers against x rounded to int8 per block of 32
 * (struct xin's x8): each 32-bit lane of a vector holds four codes of its output row as unsigned
 * bytes, and one multiply-add of four byte pairs into an int32 (vpdpbusd with AVX-512 VNNI or
 * AVX-VNNI; vpmaddubsw and vpmaddwd without) advances 16 rows by four k against four bytes of x
 * broadcast. Sums are exact in int32; each block's float scaling runs in one fixed order per row, so
 * a row's bits do not depend on the rows beside it or on the tile it is in.
 *
 * Panels of 16 output rows (as above), per super-block of 256 weights (the K-quants' own unit), in
 * the bytes I8_TYPES gives:
 *   Q4_K  float d[16], dmin[16]; uint8 sc[8][16], mn[8][16] (group j's 6-bit scale and min, row by
 *         row); then 32 octets of 64 bytes: octet 4 j + o holds, in lane n, row n's codes at
 *         k = 32 j + 8 o + i (low half of byte i) and k + 4 (high half), i = 0..3.
 *         w = d sc q - dmin mn: 4.75 bits a weight (the file's 4.5).
 *   Q6_K  float d[16]; int8 sc[16][16] (group g of 16 weights' scale, row by row); the low 4 bits of
 *         q as Q4_K's octets (32 of them, octet 2 g + h for k = 16 g + 8 h ..); then 16 vectors of
 *         the high 2 bits: vector g, lane n, byte i, bits 2 s and 2 s + 1: row n's at k = 16 g + 4 s + i.
 *         w = d sc (q - 32), q in 0..63: 6.625 bits a weight (the file's 6.5625).
 *   IQ4_XS float d[16]; int8 sc[8][16] (group j's ls - 32, row by row); the 4-bit indices into the
 *         16-value table IQ4_VALUES as Q4_K's octets. w = d sc IQ4_VALUES[i]: 4.375 bits a weight
 *         (the file's 4.25). The table is looked up a byte at a time (vpshufb), 128 added to each
 *         value where vpdpbusd takes it as unsigned (sum(v x8) = sum((v + 128) x8) - 128 sum(x8)),
 *         its sign moved onto x where pairs of products go through int16 (vpmaddubsw saturates
 *         past 32767; 2 * 241 * 127 would).
 * d and dmin are float32 (a factor of each group's scale exact with the 6-bit one: blockdot.py's
 * pack_int8 finds them), so d sc and dmin mn are the stored matrix's scales and mins bit for bit.
 * The 32-weight kinds go by blocks of 32 instead (I8_TYPES' weights; K a multiple of 32, not of 256):
 * their layouts are above tile8_block. */
#define I8P 32                          /* `planes` flag: file-bit panels; the type in bits 8 and up */
#define I8_TYPE(planes) ((planes) >> 8)
#define SB 256                          /* weights a super-block */
enum { I8_Q4_K = 1, I8_Q6_K = 2, I8_IQ4_XS = 3, I8_Q4_0 = 4, I8_IQ4_NL = 5, I8_Q8_0 = 6, I8_Q4_1 = 7, I8_Q5_0 = 8,
       I8_Q5_1 = 9, I8_TYPES_END };
/* Rows of several types stacked (Q4_K_M's q and k in Q4_K beside v in Q6_K): a 64-byte head, int32
   count and then (panels, type) for each of up to 7 segments, then each segment's panels in turn. */
#define I8_MIXED 15
#define I8_SEGMENTS 7
struct i8_type {
  const char *name;
  int64_t bytes;    /* a panel's super-block */
  int64_t weights;  /* a super-block's k: 256, or 32 for the 32-weight kinds (one block) */
};
static const struct i8_type I8_TYPES[I8_TYPES_END] = {
    [I8_Q4_K] = {"Q4_K", 2 * P * 4 + 2 * 8 * P + 32 * 64, SB},
    [I8_Q6_K] = {"Q6_K", P * 4 + 16 * P + 32 * 64 + 16 * 64, SB},
    [I8_IQ4_XS] = {"IQ4_XS", P * 4 + 8 * P + 32 * 64, SB},
    [I8_Q4_0] = {"Q4_0", P * 2 + 4 * 64, G},
    [I8_IQ4_NL] = {"IQ4_NL", P * 2 + 4 * 64, G},
    [I8_Q8_0] = {"Q8_0", P * 2 + 8 * 64, G},
    [I8_Q4_1] = {"Q4_1", 2 * P * 2 + 4 * 64, G},
    [I8_Q5_0] = {"Q5_0", P * 2 + 64 + 4 * 64, G},
    [I8_Q5_1] = {"Q5_1", 2 * P * 2 + 64 + 4 * 64, G},
};
/* where a 32-weight kind's codes start in its block, after the fp16 heads (and the fifth bits) */
#define B32_CODES(type) ((type) == I8_Q4_1 ? 4 * P : (type) == I8_Q5_0 ? 2 * P + 64 : (type) == I8_Q5_1 ? 4 * P + 64 : 2 * P)
#define B32_FIFTH(type) ((type) == I8_Q5_0 ? 2 * P : 4 * P)
#define B32_MINS(type) ((type) == I8_Q4_1 || (type) == I8_Q5_1)
#define Q4K_SC (2 * P * 4)
#define Q4K_MN (Q4K_SC + 8 * P)
#define Q4K_CODES (Q4K_MN + 8 * P)
#define Q6K_SC (P * 4)
#define Q6K_LOW (Q6K_SC + 16 * P)
#define Q6K_HIGH (Q6K_LOW + 32 * 64)
#define IQ4_SC (P * 4)
#define IQ4_CODES (IQ4_SC + 8 * P)

/* A panel's super-block bytes for `planes`, or 0 where planes names no file-bit type. */
int64_t blockdot_i8_bytes(int planes) {
  const int t = I8_TYPE(planes);
  return (planes & I8P) && t > 0 && t < I8_TYPES_END ? I8_TYPES[t].bytes : 0;
}

/* The weights of a super-block for `planes` (256, or 32 for the 32-weight kinds), 0 where it names no type. */
int64_t blockdot_i8_weights(int planes) {
  const int t = I8_TYPE(planes);
  return (planes & I8P) && t > 0 && t < I8_TYPES_END ? I8_TYPES[t].weights : 0;
}

/* The bytes of file-bit panels [N, K] whose segments' head is `head` (I8_MIXED), or -1 where the head
   names no type, more than I8_SEGMENTS segments, or panels that do not add up to N's. */
int64_t blockdot_i8_mixed_bytes(const int32_t *head, int64_t N, int64_t K) {
  if (head[0] < 1 || head[0] > I8_SEGMENTS) return -1;
  int64_t bytes = 64, panels = 0;
  for (int i = 0; i < head[0]; i++) {
    const int32_t n = head[1 + 2 * i], t = head[2 + 2 * i];
    if (n < 1 || t < 1 || t >= I8_TYPES_END || K % I8_TYPES[t].weights) return -1;
    bytes += n * (K / I8_TYPES[t].weights) * I8_TYPES[t].bytes;
    panels += n;
  }
  return panels == (N + P - 1) / P ? bytes : -1;
}

#if SIMD == 512
static inline vi vi_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline vi vi_mask(vi a, uint32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32((int)m)); }
static inline vi vi_srl(vi a, int s) { return _mm512_srli_epi32(a, s); }
static inline vi vi_sll(vi a, int s) { return _mm512_slli_epi32(a, s); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_xor(vi a, uint32_t m) { return _mm512_xor_si512(a, _mm512_set1_epi32((int)m)); }
static inline vf vu8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf vs8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
/* acc + per lane the dot of its four unsigned bytes with the four signed bytes at x */
static inline vi vdp8(vi acc, vi u, const int8_t *x) {
  int32_t s;
  memcpy(&s, x, 4);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(s));
#else  /* pairs of products into int16: at most 2 * 63 * 127, no saturation */
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, _mm512_set1_epi32(s)), _mm512_set1_epi16(1)));
#endif
}
/* each byte b (0..15) of idx looked up in the 16 bytes t */
static inline vi vlut(const uint8_t *t, vi idx) {
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t)), idx);
}
#if !defined(__AVX512VNNI__)
/* vdp8 of signed bytes v: |v| against x with v's signs, so that pairs of products stay in int16 */
static inline vi vdp8_signed(vi acc, vi v, const int8_t *x) {
  int32_t s;
  memcpy(&s, x, 4);
  const __m512i xb = _mm512_set1_epi32(s), xs = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(v), _mm512_setzero_si512(), xb);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(v), xs), _mm512_set1_epi16(1)));
}
#endif
#elif SIMD == 256
static inline vi vi_load(const uint8_t *p) {
  return (vi){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
}
static inline vi vi_mask(vi a, uint32_t m) {
  const __m256i v = _mm256_set1_epi32((int)m);
  return (vi){_mm256_and_si256(a.a, v), _mm256_and_si256(a.b, v)};
}
static inline vi vi_srl(vi a, int s) { return (vi){_mm256_srli_epi32(a.a, s), _mm256_srli_epi32(a.b, s)}; }
static inline vi vi_sll(vi a, int s) { return (vi){_mm256_slli_epi32(a.a, s), _mm256_slli_epi32(a.b, s)}; }
static inline vi vi_or(vi a, vi b) { return (vi){_mm256_or_si256(a.a, b.a), _mm256_or_si256(a.b, b.b)}; }
static inline vi vi_xor(vi a, uint32_t m) {
  const __m256i v = _mm256_set1_epi32((int)m);
  return (vi){_mm256_xor_si256(a.a, v), _mm256_xor_si256(a.b, v)};
}
static inline vf vu8(const uint8_t *p) {
  const __m128i v = _mm_loadu_si128((const __m128i *)p);
  return (vf){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))};
}
static inline vf vs8(const uint8_t *p) {
  const __m128i v = _mm_loadu_si128((const __m128i *)p);
  return (vf){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
static inline __m256i dp8x8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
static inline vi vdp8(vi acc, vi u, const int8_t *x) {
  int32_t s;
  memcpy(&s, x, 4);
  const __m256i sv = _mm256_set1_epi32(s);
  return (vi){dp8x8(acc.a, u.a, sv), dp8x8(acc.b, u.b, sv)};
}
static inline vi vlut(const uint8_t *t, vi idx) {
  const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
  return (vi){_mm256_shuffle_epi8(tab, idx.a), _mm256_shuffle_epi8(tab, idx.b)};
}
#if !defined(__AVXVNNI__)
static inline __m256i dp8x8_signed(__m256i acc, __m256i v, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v)),
                                                 _mm256_set1_epi16(1)));
}
static inline vi vdp8_signed(vi acc, vi v, const int8_t *x) {
  int32_t s;
  memcpy(&s, x, 4);
  const __m256i sv = _mm256_set1_epi32(s);
  return (vi){dp8x8_signed(acc.a, v.a, sv), dp8x8_signed(acc.b, v.b, sv)};
}
#endif
#else
static inline vi vi_load(const uint8_t *p) { vi r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vi vi_mask(vi a, uint32_t m) { for (int n = 0; n < 16; n++) a.v[n] &= m; return a; }
static inline vi vi_srl(vi a, int s) { for (int n = 0; n < 16; n++) a.v[n] >>= s; return a; }
static inline vi vi_sll(vi a, int s) { for (int n = 0; n < 16; n++) a.v[n] <<= s; return a; }
static inline vi vi_or(vi a, vi b) { for (int n = 0; n < 16; n++) a.v[n] |= b.v[n]; return a; }
static inline vi vi_xor(vi a, uint32_t m) { for (int n = 0; n < 16; n++) a.v[n] ^= m; return a; }
static inline vf vu8(const uint8_t *p) { vf r; for (int n = 0; n < 16; n++) r.v[n] = p[n]; return r; }
static inline vf vs8(const uint8_t *p) { vf r; for (int n = 0; n < 16; n++) r.v[n] = (int8_t)p[n]; return r; }
static inline vi vdp8(vi acc, vi u, const int8_t *x) {
  for (int n = 0; n < 16; n++) {
    int32_t s = 0;
    for (int i = 0; i < 4; i++) s += (int32_t)((u.v[n] >> 8 * i) & 255) * x[i];  /* little-endian lanes */
    acc.v[n] += (uint32_t)s;
  }
  return acc;
}
static inline vi vlut(const uint8_t *t, vi idx) {
  for (int n = 0; n < 16; n++) {
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) r |= (uint32_t)t[(idx.v[n] >> 8 * i) & 15] << 8 * i;
    idx.v[n] = r;
  }
  return idx;
}
#endif

/* IQ4_XS's 16 values (ggml's kvalues_iq4nl), as the file-bit panels' dot products take them: plus 128,
   as unsigned bytes, where vpdpbusd (or plain C) sums products exactly; as they are where pairs of
   products go through int16 (vdp8_signed). Either way a group's exact sum of values times x8. */
#if (SIMD == 512 && !defined(__AVX512VNNI__)) || (SIMD == 256 && !defined(__AVXVNNI__))
#define IQ4_OFFSET 0
#define vdp8_iq4 vdp8_signed
#else
#define IQ4_OFFSET 128
#define vdp8_iq4 vdp8
#endif
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const uint8_t IQ4_BYTES[16] = {
    (uint8_t)(-127 + IQ4_OFFSET), (uint8_t)(-104 + IQ4_OFFSET), (uint8_t)(-83 + IQ4_OFFSET), (uint8_t)(-65 + IQ4_OFFSET),
    (uint8_t)(-49 + IQ4_OFFSET), (uint8_t)(-35 + IQ4_OFFSET), (uint8_t)(-22 + IQ4_OFFSET), (uint8_t)(-10 + IQ4_OFFSET),
    (uint8_t)(1 + IQ4_OFFSET), (uint8_t)(13 + IQ4_OFFSET), (uint8_t)(25 + IQ4_OFFSET), (uint8_t)(38 + IQ4_OFFSET),
    (uint8_t)(53 + IQ4_OFFSET), (uint8_t)(69 + IQ4_OFFSET), (uint8_t)(89 + IQ4_OFFSET), (uint8_t)(113 + IQ4_OFFSET)};

#define LOW4 0x0F0F0F0Fu
/* Q6_K's high bits of quad s (k = 4 s .. 4 s + 3 of the group) at bits 4 and 5 of each byte */
static inline vi q6_high(vi h, int s) {
  const vi at = s == 0 ? vi_sll(h, 4) : s == 1 ? vi_sll(h, 2) : s == 2 ? h : vi_srl(h, 2);
  return vi_mask(at, 0x30303030u);
}

/* One group's exact int32 sums g (16 outputs of one row of x) into that row's float sums, the only
   float arithmetic of the file-bit panels: tile8 and the AMX tiles both call these, so a row's outputs
   are the same bits whichever ran it. Q4_K: w x summed = x8d (d sc sum(q x8) - dmin mn sum(x8)), given
   neg_xs = -sum(x8) over the group (exact in float). */
static inline vf q4k_step(vf acc, vf ds, vf dm, vi g, float neg_xs, float x8d) {
  const vf t = vfma(ds, vcvt(g), vmul(dm, vset1(neg_xs)));
  return vfma(t, vset1(x8d), acc);
}
/* Q6_K: sum((q - 32) x8) = sum(q x8) - 32 sum(x8), given neg32 = -32 sum(x8) over the 16 (exact in float);
   IQ4_XS the same with its offset, -IQ4_OFFSET sum(x8) over the 32 (iq4_neg). */
static inline vf q6k_step(vf acc, vf dsc, vi g, float neg32, float x8d) {
  const vf t = vadd(vcvt(g), vset1(neg32));
  return vfma(vmul(dsc, vset1(x8d)), t, acc);
}
static inline float q4k_neg_xs(const int32_t *x8sum16) { return -(float)(x8sum16[0] + x8sum16[1]); }
static inline float q6k_neg32(int32_t x8sum) { return -32.0f * (float)x8sum; }
static inline float iq4_neg(float neg_xs) { return (float)IQ4_OFFSET * neg_xs; }

/* NP panels (16 NP output rows) against MR rows of x from r0 (NP * MR <= 8), a K-quant: acc[p * MR + r]. */
INLINE void tile8_super(const struct xin *in, int64_t K, const uint8_t *w, const int type, int64_t p0, int64_t r0, const int NP,
                  const int MR, vf acc[8]) {
  const int64_t S = K / SB, B = K / G, sb = I8_TYPES[type].bytes;
  for (int a = 0; a < NP * MR; a++) acc[a] = vzero();
  for (int64_t s = 0; s < S; s++) {
    const uint8_t *blk[4];
    vf d[4], dmin[4];
    for (int p = 0; p < NP; p++) {
      blk[p] = w + ((p0 + p) * S + s) * sb;
      d[p] = vload((const float *)blk[p]);
      if (type == I8_Q4_K) dmin[p] = vload((const float *)blk[p] + P);
    }
    if (type == I8_Q4_K || type == I8_IQ4_XS) {
      for (int j = 0; j < 8; j++) {  /* group j: x's block 8 s + j */
        const int64_t b = s * 8 + j;
        vi g[8];
        for (int a = 0; a < NP * MR; a++) g[a] = vizero();
        for (int p = 0; p < NP; p++)  /* the next super-block on its way: 38 lines (IQ4_XS 35), 5 a group */
          for (int l = 0; l < 5; l++) prefetch(blk[p] + sb + (5 * j + l) * 64);
        for (int o = 0; o < 4; o++)
          for (int p = 0; p < NP; p++) {
            const vi c = vi_load(blk[p] + (type == I8_Q4_K ? Q4K_CODES : IQ4_CODES) + (4 * j + o) * 64);
            const vi lo = vi_mask(c, LOW4), hi = vi_mask(vi_srl(c, 4), LOW4);
            if (type == I8_Q4_K) {
              for (int r = 0; r < MR; r++) {
                const int8_t *x = in->x8 + (r0 + r) * K + b * G + 8 * o;
                g[p * MR + r] = vdp8(vdp8(g[p * MR + r], lo, x), hi, x + 4);
              }
            } else {
              const vi vlo = vlut(IQ4_BYTES, lo), vhi = vlut(IQ4_BYTES, hi);
              for (int r = 0; r < MR; r++) {
                const int8_t *x = in->x8 + (r0 + r) * K + b * G + 8 * o;
                g[p * MR + r] = vdp8_iq4(vdp8_iq4(g[p * MR + r], vlo, x), vhi, x + 4);
              }
            }
          }
        for (int p = 0; p < NP; p++) {
          if (type == I8_Q4_K) {
            const vf ds = vmul(d[p], vu8(blk[p] + Q4K_SC + j * P)), dm = vmul(dmin[p], vu8(blk[p] + Q4K_MN + j * P));
            for (int r = 0; r < MR; r++) {
              const int64_t rb = (r0 + r) * B + b;
              acc[p * MR + r] = q4k_step(acc[p * MR + r], ds, dm, g[p * MR + r], q4k_neg_xs(in->x8sum16 + 2 * rb),
                                         in->x8d[rb]);
            }
          } else {
            const vf dsc = vmul(d[p], vs8(blk[p] + IQ4_SC + j * P));
            for (int r = 0; r < MR; r++) {
              const int64_t rb = (r0 + r) * B + b;
              acc[p * MR + r] = q6k_step(acc[p * MR + r], dsc, g[p * MR + r], iq4_neg(q4k_neg_xs(in->x8sum16 + 2 * rb)),
                                         in->x8d[rb]);
            }
          }
        }
      }
    } else {  /* I8_Q6_K */
      for (int gi = 0; gi < 16; gi++) {  /* group gi of 16 weights: x's block 8 s + gi / 2 */
        const int64_t b = s * 8 + gi / 2;
        vi g[8];
        for (int a = 0; a < NP * MR; a++) g[a] = vizero();
        for (int p = 0; p < NP; p++)  /* the next super-block: 53 lines, 4 a group */
          for (int l = 0; l < 4; l++) prefetch(blk[p] + sb + (4 * gi + l) * 64);
        for (int p = 0; p < NP; p++) {
          const vi h = vi_load(blk[p] + Q6K_HIGH + gi * 64);
          for (int half = 0; half < 2; half++) {
            const vi c = vi_load(blk[p] + Q6K_LOW + (2 * gi + half) * 64);
            const vi q0 = vi_or(vi_mask(c, LOW4), q6_high(h, 2 * half));
            const vi q1 = vi_or(vi_mask(vi_srl(c, 4), LOW4), q6_high(h, 2 * half + 1));
            for (int r = 0; r < MR; r++) {
              const int8_t *x = in->x8 + (r0 + r) * K + s * SB + 16 * gi + 8 * half;
              g[p * MR + r] = vdp8(vdp8(g[p * MR + r], q0, x), q1, x + 4);
            }
          }
        }
        for (int p = 0; p < NP; p++) {
          const vf dsc = vmul(d[p], vs8(blk[p] + Q6K_SC + gi * P));
          for (int r = 0; r < MR; r++) {
            const int64_t rb = (r0 + r) * B + b;
            acc[p * MR + r] = q6k_step(acc[p * MR + r], dsc, g[p * MR + r],
                                       q6k_neg32(in->x8sum16[(r0 + r) * (K / 16) + s * 16 + gi]), in->x8d[rb]);
          }
        }
      }
    }
  }
}

/* The 32-weight kinds, a block of 32 weights of 16 rows at a time (the bytes I8_TYPES gives):
 *   Q4_0, IQ4_NL  fp16 d[16]; then 4 octets of 64 bytes as Q4_K's (octet o, lane n: row n's codes at
 *                 k = 8 o + i in the low half of byte i, k + 4 in the high half): Q4_0's q (w = d (q - 8)),
 *                 IQ4_NL's indices into IQ4_VALUES (w = d IQ4_VALUES[i]). 4.5 bits a weight, the file's.
 *   Q4_1          fp16 d[16], m[16]; the octets of q: w = d q + m. 5 bits, the file's.
 *   Q5_0, Q5_1    as Q4_0 and Q4_1 with 64 bytes of fifth bits before the octets (lane n, byte i, bit j:
 *                 row n's at k = 4 j + i), q = low | fifth << 4: w = d (q - 16), d q + m. 5.5 and 6 bits.
 *   Q8_0          fp16 d[16]; 8 vectors of int8 codes (vector j, lane n, byte i: row n's at k = 4 j + i):
 *                 w = d q. 8.5 bits, the file's.
 * The scales stay fp16, widened exactly as they are read. Codes in 0..31 go to vpdpbusd as they are and
 * the offsets (8, 16) come off in the float step times x's block sum; IQ4_NL's values and Q8_0's codes
 * are signed: plus 128 (IQ4_OFFSET) where vpdpbusd or plain C sums them, signs moved onto x where pairs
 * of products go through int16, as IQ4_XS's. */
#define S8_OFFSET IQ4_OFFSET
#define vdp8_s8 vdp8_iq4
/* the fifth bits of quad j (k = 4 j .. 4 j + 3) at bit 4 of each byte */
static inline vi q5_high(vi h, int j) { return vi_mask(j <= 4 ? vi_sll(h, 4 - j) : vi_srl(h, j - 4), 0x10101010u); }
/* a block's offset on its codes, times -sum(x8) over the block (exact in float) */
static inline float b32_neg(int type, float neg_xs) {
  return (type == I8_Q4_0 ? 8.0f : type == I8_Q5_0 ? 16.0f : type == I8_IQ4_NL || type == I8_Q8_0 ? (float)S8_OFFSET : 0.0f) *
         neg_xs;
}
/* One block's exact sums g into a row's float sums: d q + m kinds as Q4_K's step (dm = -m), the others as Q6_K's. */
static inline vf b32_step(int type, vf acc, vf d, vf m, vi g, float neg_xs, float x8d) {
  if (B32_MINS(type)) return q4k_step(acc, d, m, g, neg_xs, x8d);
  return q6k_step(acc, d, g, b32_neg(type, neg_xs), x8d);
}
#define B32_AHEAD 8  /* blocks a panel's stream is fetched ahead */

INLINE void tile8_block(const struct xin *in, int64_t K, const uint8_t *w, const int type, int64_t p0, int64_t r0,
                        const int NP, const int MR, vf acc[8]) {
  const int64_t B = K / G, bb = I8_TYPES[type].bytes;
  for (int a = 0; a < NP * MR; a++) acc[a] = vzero();
  for (int64_t b = 0; b < B; b++) {
    const uint8_t *blk[4];
    vi g[8];
    for (int a = 0; a < NP * MR; a++) g[a] = vizero();
    for (int p = 0; p < NP; p++) {
      blk[p] = w + ((p0 + p) * B + b) * bb;
      for (int64_t l = 0; l <= bb / 64; l++) prefetch(blk[p] + B32_AHEAD * bb + 64 * l);
    }
    if (type == I8_Q8_0) {
      for (int j = 0; j < 8; j++)
        for (int p = 0; p < NP; p++) {
          vi c = vi_load(blk[p] + B32_CODES(type) + j * 64);
          if (S8_OFFSET) c = vi_xor(c, 0x80808080u);
          for (int r = 0; r < MR; r++)
            g[p * MR + r] = vdp8_s8(g[p * MR + r], c, in->x8 + (r0 + r) * K + b * G + 4 * j);
        }
    } else {
      for (int o = 0; o < 4; o++)
        for (int p = 0; p < NP; p++) {
          const vi c = vi_load(blk[p] + B32_CODES(type) + o * 64);
          vi lo = vi_mask(c, LOW4), hi = vi_mask(vi_srl(c, 4), LOW4);
          if (type == I8_Q5_0 || type == I8_Q5_1) {
            const vi h = vi_load(blk[p] + B32_FIFTH(type));
            lo = vi_or(lo, q5_high(h, 2 * o)), hi = vi_or(hi, q5_high(h, 2 * o + 1));
          }
          if (type == I8_IQ4_NL) {
            lo = vlut(IQ4_BYTES, lo), hi = vlut(IQ4_BYTES, hi);
            for (int r = 0; r < MR; r++) {
              const int8_t *x = in->x8 + (r0 + r) * K + b * G + 8 * o;
              g[p * MR + r] = vdp8_iq4(vdp8_iq4(g[p * MR + r], lo, x), hi, x + 4);
            }
          } else {
            for (int r = 0; r < MR; r++) {
              const int8_t *x = in->x8 + (r0 + r) * K + b * G + 8 * o;
              g[p * MR + r] = vdp8(vdp8(g[p * MR + r], lo, x), hi, x + 4);
            }
          }
        }
    }
    for (int p = 0; p < NP; p++) {
      const vf d = vhalf((const uint16_t *)blk[p]);
      const vf m = B32_MINS(type) ? vmul(vset1(-1.0f), vhalf((const uint16_t *)blk[p] + P)) : vzero();
      for (int r = 0; r < MR; r++) {
        const int64_t rb = (r0 + r) * B + b;
        acc[p * MR + r] = b32_step(type, acc[p * MR + r], d, m, g[p * MR + r], q4k_neg_xs(in->x8sum16 + 2 * rb),
                                   in->x8d[rb]);
      }
    }
  }
}

INLINE void tile8(const struct xin *in, int64_t K, const uint8_t *w, const int type, int64_t p0, int64_t r0,
                  const int NP, const int MR, vf acc[8]) {
  if (I8_TYPES[type].weights == G) tile8_block(in, K, w, type, p0, r0, NP, MR, acc);
  else tile8_super(in, K, w, type, p0, r0, NP, MR, acc);
}

/* Outputs n < N of each row of y, rows ldy apart. */
INLINE void tile8_out(const struct xin *in, int64_t K, int64_t N, int64_t ldy, const uint8_t *w, const int type,
                      int64_t p0, int64_t r0, const int NP, const int MR, void *y, int y_bf16) {
  vf acc[8];
  tile8(in, K, w, type, p0, r0, NP, MR, acc);
  for (int p = 0; p < NP; p++)
    for (int r = 0; r < MR; r++) {
      float lanes[P];
      vstore(lanes, acc[p * MR + r]);
      for (int n = 0; n < P && (p0 + p) * P + n < N; n++) {
        const int64_t at = (r0 + r) * ldy + (p0 + p) * P + n;
        if (y_bf16) ((uint16_t *)y)[at] = f32_to_bf16(lanes[n]);
        else ((float *)y)[at] = lanes[n];
      }
    }
}

/* Panels [p0, p0 + NP) against rows [r_from, M) of x, in tiles of NP panels by up to 8 / NP rows (AVX2,
   whose vectors are two registers: 4 / NP). Each tile reads its panels' codes once for all its rows. */
#define I8_TILES(type)                                                                                     \
  static void task8_##type(const struct xin *in, int64_t M, int64_t K, int64_t N, int64_t ldy, const uint8_t *w, \
                           int64_t p0, int NP, void *y, int y_bf16, int64_t r_from) {                      \
    const int most = (SIMD == 256 ? 4 : 8) / NP;                                                           \
    for (int64_t r0 = r_from; r0 < M;) {                                                                   \
      const int MR = M - r0 < most ? (int)(M - r0) : most;                                                 \
      switch (NP * 16 + MR) {                                                                              \
        case 4 * 16 + 1: tile8_out(in, K, N, ldy, w, type, p0, r0, 4, 1, y, y_bf16); break;                     \
        case 4 * 16 + 2: tile8_out(in, K, N, ldy, w, type, p0, r0, 4, 2, y, y_bf16); break;                     \
        case 2 * 16 + 1: tile8_out(in, K, N, ldy, w, type, p0, r0, 2, 1, y, y_bf16); break;                     \
        case 2 * 16 + 2: tile8_out(in, K, N, ldy, w, type, p0, r0, 2, 2, y, y_bf16); break;                     \
        case 2 * 16 + 3: tile8_out(in, K, N, ldy, w, type, p0, r0, 2, 3, y, y_bf16); break;                     \
        case 2 * 16 + 4: tile8_out(in, K, N, ldy, w, type, p0, r0, 2, 4, y, y_bf16); break;                     \
        case 1 * 16 + 1: tile8_out(in, K, N, ldy, w, type, p0, r0, 1, 1, y, y_bf16); break;                     \
        case 1 * 16 + 2: tile8_out(in, K, N, ldy, w, type, p0, r0, 1, 2, y, y_bf16); break;                     \
        case 1 * 16 + 3: tile8_out(in, K, N, ldy, w, type, p0, r0, 1, 3, y, y_bf16); break;                     \
        case 1 * 16 + 4: tile8_out(in, K, N, ldy, w, type, p0, r0, 1, 4, y, y_bf16); break;                     \
        case 1 * 16 + 5: tile8_out(in, K, N, ldy, w, type, p0, r0, 1, 5, y, y_bf16); break;                     \
        case 1 * 16 + 6: tile8_out(in, K, N, ldy, w, type, p0, r0, 1, 6, y, y_bf16); break;                     \
        case 1 * 16 + 7: tile8_out(in, K, N, ldy, w, type, p0, r0, 1, 7, y, y_bf16); break;                     \
        default: tile8_out(in, K, N, ldy, w, type, p0, r0, 1, 8, y, y_bf16); break;                             \
      }                                                                                                    \
      r0 += MR;                                                                                            \
    }                                                                                                      \
  }
I8_TILES(I8_Q4_K)
I8_TILES(I8_Q6_K)
I8_TILES(I8_IQ4_XS)
I8_TILES(I8_Q4_0)
I8_TILES(I8_IQ4_NL)
I8_TILES(I8_Q8_0)
I8_TILES(I8_Q4_1)
I8_TILES(I8_Q5_0)
I8_TILES(I8_Q5_1)
#undef I8_TILES

/* One panel (NP = 1) or NP from p0 of one type against rows [r_from, M) of x on the vector tiles. */
static void task8(const struct xin *in, int64_t M, int64_t K, int64_t N, int64_t ldy, const uint8_t *w, int type,
                  int64_t p0, int NP, void *y, int y_bf16, int64_t r_from) {
  switch (type) {
    case I8_Q4_K: task8_I8_Q4_K(in, M, K, N, ldy, w, p0, NP, y, y_bf16, r_from); break;
    case I8_Q6_K: task8_I8_Q6_K(in, M, K, N, ldy, w, p0, NP, y, y_bf16, r_from); break;
    case I8_IQ4_XS: task8_I8_IQ4_XS(in, M, K, N, ldy, w, p0, NP, y, y_bf16, r_from); break;
    case I8_Q4_0: task8_I8_Q4_0(in, M, K, N, ldy, w, p0, NP, y, y_bf16, r_from); break;
    case I8_IQ4_NL: task8_I8_IQ4_NL(in, M, K, N, ldy, w, p0, NP, y, y_bf16, r_from); break;
    case I8_Q8_0: task8_I8_Q8_0(in, M, K, N, ldy, w, p0, NP, y, y_bf16, r_from); break;
    case I8_Q4_1: task8_I8_Q4_1(in, M, K, N, ldy, w, p0, NP, y, y_bf16, r_from); break;
    case I8_Q5_0: task8_I8_Q5_0(in, M, K, N, ldy, w, p0, NP, y, y_bf16, r_from); break;
    default: task8_I8_Q5_1(in, M, K, N, ldy, w, p0, NP, y, y_bf16, r_from); break;
  }
}

/* ---- AMX tiles (Sapphire Rapids and later: builds with __AMX_INT8__, where the kernel grants them) ----
 *
 * tile8's sums for 16 rows of x at a time against one panel: TDPBSUD (TDPBSSD) multiplies a tile of
 * x's int8 codes (16 rows by one group's 32 k; 16 k for Q6_K) by a tile of the panel's unsigned
 * (signed) codes in VNNI order (tile row i: the 16 outputs' codes at k = 4 i .. 4 i + 3, which is what
 * an octet's low, then high, nibbles are: unpacked pair by pair of groups as the panel streams past)
 * into 16 x 16 exact int32 sums: tile8's g, or for Q6_K and IQ4_XS g with its offset term already in
 * (the same integer, so the same float). Those are stored to memory and go through tile8's float
 * steps in the same order, so a row's outputs are bit for bit tile8's: which rows take the tiles
 * (struct xin's amx_rows, the plan's) changes the speed, never a number. Rows past the last whole 16
 * are copied into a zeroed block of 16, whose extra rows sum to 0 and are not stored.
 *
 * Measured (notes/amx-tiles.md): the tile unit's work does not overlap the vector unit's here, so
 * what a pair of groups costs is the tiles' loads, products and stores plus the vector work of the
 * float steps (4 operations a row and group of Q4_K, 3 of Q6_K and IQ4_XS) and the unpacking. */
#if SIMD == 512 && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
struct tile_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static int amx_permitted;  /* 0: not asked yet, 1: granted, -1: refused */

int blockdot_amx(void) {  /* asks Linux, once, for the tile registers' state in this process */
  if (!amx_permitted) amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
  return amx_permitted > 0;
}

/* kb: a group's k (32, or Q6_K's 16). tmm0 and tmm4 hold x's codes (16 rows of kb bytes), tmm1 and
   tmm5 the panel's (kb / 4 rows of 64 bytes), tmm2, 3, 6 and 7 two pairs of groups' sums (16 rows of 16 int32). */
static void amx_configure(int kb) {
  struct tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  c.rows[0] = c.rows[4] = 16, c.colsb[0] = c.colsb[4] = (uint16_t)kb;
  c.rows[1] = c.rows[5] = (uint8_t)(kb / 4), c.colsb[1] = c.colsb[5] = 64;
  c.rows[2] = c.rows[3] = c.rows[6] = c.rows[7] = 16, c.colsb[2] = c.colsb[3] = c.colsb[6] = c.colsb[7] = 64;
  _tile_loadconfig(&c);
}

/* A panel's codes unpacked (u [K / 4][64]) are rows of 64 bytes, row i holding the 16 outputs' codes
   at k = 4 i .. 4 i + 3, as the tiles take them: Q4_K's q (0..15) unsigned, Q6_K's q - 32 and IQ4_XS's
   table values signed (so their sums need no offset term). Octet o of a super-block is k = 8 o ..
   8 o + 7, its low nibbles one row and its high ones the next: octets [o0, o0 + count) of super-block
   blk into rows from us. */
INLINE void amx_unpack_octets(const uint8_t *blk, int type, int o0, int count, uint8_t *us) {
  for (int o = o0; o < o0 + count; o++) {
    const vi c = vi_load(blk + (type == I8_Q4_K ? Q4K_CODES : type == I8_Q6_K ? Q6K_LOW : IQ4_CODES) + o * 64);
    vi lo = vi_mask(c, LOW4), hi = vi_mask(vi_srl(c, 4), LOW4);
    if (type == I8_Q6_K) {  /* octet o is half o % 2 of group o / 2; q - 32 as signed bytes */
      const vi h = vi_load(blk + Q6K_HIGH + (o / 2) * 64);
      lo = _mm512_sub_epi8(vi_or(lo, q6_high(h, 2 * (o % 2))), _mm512_set1_epi8(32));
      hi = _mm512_sub_epi8(vi_or(hi, q6_high(h, 2 * (o % 2) + 1)), _mm512_set1_epi8(32));
    } else if (type == I8_IQ4_XS) {
      lo = vlut((const uint8_t *)IQ4_VALUES, lo), hi = vlut((const uint8_t *)IQ4_VALUES, hi);
    }
    _mm512_storeu_si512(us + 2 * (o - o0) * 64, lo);
    _mm512_storeu_si512(us + (2 * (o - o0) + 1) * 64, hi);
  }
}

/* Pair i of groups (k = 2 i kb .. 2 (i + 1) kb) of panel p into dst, and the lines of the thread's
   stream of panels AMX_DIST bytes ahead on their way to L2. */
#define AMX_DIST 4096
INLINE void amx_unpack_pair(const uint8_t *w, int type, int64_t p, int64_t K, int64_t i, int kb, uint8_t *dst) {
  const int64_t S = K / SB, sb = I8_TYPES[type].bytes, k0 = 2 * i * kb, s = k0 / SB;
  const uint8_t *blk = w + (p * S + s) * sb;
  const int64_t per = SB / (2 * kb), bpp = sb / per, at = (p * S + s) * sb + (i % per) * bpp + AMX_DIST;
  for (int64_t l = at & ~63; l < at + bpp; l += 64) prefetch(w + l);
  amx_unpack_octets(blk, type, (int)(k0 % SB / 8), kb / 4, dst);
}

/* x as the tiles read it, per block of 16 rows (the last one's missing rows zero) and group of 32 k:
   the 16 rows' codes, 32 bytes each (one A tile: a Q4_K group, or at a stride of 32 two Q6_K groups),
   then for each row x8d and Q4_K's neg_xs, as floats: [M16 / 16][K / 32] blocks of AMX_ROWS_BYTES.
   Made by each thread for its own panels' use, once a call: a pass over x. */
#define AMX_ROWS_BYTES (16 * 32 + 2 * 16 * 4)
static void amx_rows_of(const struct xin *in, int64_t M, int64_t K, uint8_t *xa) {
  const int64_t B = K / G;
  for (int64_t r0 = 0; r0 < M; r0 += 16)
    for (int64_t b = 0; b < B; b++) {
      uint8_t *blk = xa + (r0 / 16 * B + b) * AMX_ROWS_BYTES;
      float *f = (float *)(blk + 16 * 32);  /* x8d[16], neg_xs[16] */
      for (int r = 0; r < 16; r++) {
        const int64_t row = r0 + r, rb = row * B + b;
        if (row >= M) {
          memset(blk + 32 * r, 0, 32);
          f[r] = f[16 + r] = 0;
          continue;
        }
        memcpy(blk + 32 * r, in->x8 + row * K + b * G, 32);
        f[r] = in->x8d[rb];
        f[16 + r] = q4k_neg_xs(in->x8sum16 + 2 * rb);
      }
    }
}

/* Two groups' sums (x's A tiles a and a2, kb = 32 k or Q6_K's 16 each) against the pair's unpacked
   codes b (the second group's kb / 4 rows on), into tiles C0 and C1 and from there to c [2][16][16]. */
#define AMX_TWO_GROUPS(type, a, a2, b, kb, C0, C1, c)                                                     \
  do {                                                                                                   \
    _tile_loadd(0, (a), 32);                                                                             \
    _tile_loadd(1, (b), 64);                                                                             \
    _tile_loadd(4, (a2), 32);                                                                            \
    _tile_loadd(5, (b) + (kb) * 16, 64);                                                                 \
    _tile_zero(C0);                                                                                      \
    _tile_zero(C1);                                                                                      \
    if ((type) == I8_Q4_K) {                                                                             \
      _tile_dpbsud(C0, 0, 1);                                                                            \
      _tile_dpbsud(C1, 4, 5);                                                                            \
    } else { /* Q6_K's and IQ4_XS's codes signed */                                                      \
      _tile_dpbssd(C0, 0, 1);                                                                            \
      _tile_dpbssd(C1, 4, 5);                                                                            \
    }                                                                                                    \
    _tile_stored(C0, (c), 64);                                                                           \
    _tile_stored(C1, (c) + 256, 64);                                                                     \
  } while (0)

/* Groups g and g + 1's sums c [2][16][16] (Q4_K's groups of 32, Q6_K's of 16) into the 16 rows' acc;
   xa: this block of rows' blocks of x. */
INLINE void amx_scale(const uint8_t *xa, int64_t K, const uint8_t *w, const int type, int64_t p, int64_t g,
                      const int32_t *c, vf acc[16]) {
  const int64_t S = K / SB, per = SB / (type == I8_Q6_K ? 16 : 32), s = g / per;
  const uint8_t *blk = w + (p * S + s) * I8_TYPES[type].bytes;
  const vf d = vload((const float *)blk);
  for (int h = 0; h < 2; h++) {
    const int j = (int)(g % per) + h;  /* the group in its super-block */
    if (type == I8_Q4_K) {
      const float *f = (const float *)(xa + (s * 8 + j) * AMX_ROWS_BYTES + 16 * 32);
      const vf ds = vmul(d, vu8(blk + Q4K_SC + j * P)), dm = vmul(vload((const float *)blk + P), vu8(blk + Q4K_MN + j * P));
      _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++)
        acc[r] = q4k_step(acc[r], ds, dm, vi_load((const uint8_t *)(c + 256 * h + 16 * r)), f[16 + r], f[r]);
    } else if (type == I8_IQ4_XS) {  /* q6k_step with the offset term in g (signed codes): the same t */
      const float *f = (const float *)(xa + (s * 8 + j) * AMX_ROWS_BYTES + 16 * 32);
      const vf dsc = vmul(d, vs8(blk + IQ4_SC + j * P));
      _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++)
        acc[r] = vfma(vmul(dsc, vset1(f[r])), vcvt(vi_load((const uint8_t *)(c + 256 * h + 16 * r))), acc[r]);
    } else {
      const float *f = (const float *)(xa + (s * 8 + j / 2) * AMX_ROWS_BYTES + 16 * 32);
      const vf dsc = vmul(d, vs8(blk + Q6K_SC + j * P));
      _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++)
        acc[r] = vfma(vmul(dsc, vset1(f[r])), vcvt(vi_load((const uint8_t *)(c + 256 * h + 16 * r))), acc[r]);
    }
  }
}

/* Group g's A tile: block g (Q4_K, IQ4_XS), or Q6_K's block g / 2 from its (g % 2)'th 16 bytes. */
#define AMX_A(xa, type, g) ((xa) + ((type) != I8_Q6_K ? (g) : (g) / 2) * AMX_ROWS_BYTES + ((type) != I8_Q6_K ? 0 : 16 * ((g) % 2)))

/* 16 rows of x (xa) against panel p (its heads in w): acc[16], in tile8's order. The first block of
   rows (unpack) unpacks each pair of groups into u two pairs ahead of its tiles, as the panel streams
   past; later blocks read u as it is. Pipelined: pair i of groups is multiplied on the tiles and
   stored to c's ring of AMX_RING pairs while pair i - AMX_LAG is scaled from there: a tile's store is
   read back only when it has long reached the cache (a load right behind it waited for it, and held
   up the next tiles). */
#define AMX_RING 4
#define AMX_LAG 3
INLINE void amx_block(const uint8_t *xa, int64_t K, const uint8_t *w, const int type, int64_t p, uint8_t *u,
                      int32_t *c, int unpack, vf acc[16]) {
  const int kb = type == I8_Q6_K ? 16 : 32;
  const int64_t pairs = K / kb / 2;  /* a multiple of 4: K is of 256 */
#define AMX_B(i) (u + (i) * 32 * kb)
  _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) acc[r] = vzero();
  if (unpack) amx_unpack_pair(w, type, p, K, 0, kb, AMX_B(0)), amx_unpack_pair(w, type, p, K, 1, kb, AMX_B(1));
  for (int64_t i = 0; i < pairs + AMX_LAG; i += 2) {
    if (unpack && i + 2 < pairs) amx_unpack_pair(w, type, p, K, i + 2, kb, AMX_B(i + 2));
    if (unpack && i + 3 < pairs) amx_unpack_pair(w, type, p, K, i + 3, kb, AMX_B(i + 3));
    if (i < pairs)
      AMX_TWO_GROUPS(type, AMX_A(xa, type, 2 * i), AMX_A(xa, type, 2 * i + 1), AMX_B(i), kb, 2, 3,
                     c + i % AMX_RING * 512);
    if (i >= AMX_LAG) amx_scale(xa, K, w, type, p, 2 * (i - AMX_LAG), c + (i - AMX_LAG) % AMX_RING * 512, acc);
    if (i + 1 < pairs)
      AMX_TWO_GROUPS(type, AMX_A(xa, type, 2 * i + 2), AMX_A(xa, type, 2 * i + 3), AMX_B(i + 1), kb, 6, 7,
                     c + (i + 1) % AMX_RING * 512);
    if (i + 1 >= AMX_LAG && i + 1 - AMX_LAG < pairs)
      amx_scale(xa, K, w, type, p, 2 * (i + 1 - AMX_LAG), c + (i + 1 - AMX_LAG) % AMX_RING * 512, acc);
  }
#undef AMX_B
}

/* The thread's buffers for the tiles (NULL where out of memory): a panel's unpacked codes (16 K
   bytes), AMX_RING pairs of groups' sums (2 KB each), then x's rows (amx_rows_of). */
static uint8_t *amx_buffers(int64_t bytes);

/* One type's panels against every row of x, split among the team's threads by panel: rows in whole
   blocks of 16 on the tiles, and a last block of fewer on the tiles too where it has amx_rows rows,
   on the vector tiles where it has fewer (a block of 16 costs the tiles the same however many of its
   rows are padding). */
static void amx_tasks_of(const struct xin *in, int64_t M, int64_t K, int64_t N, int64_t ldy, const uint8_t *w,
                         int type, void *y, int y_bf16) {
  const int64_t panels = (N + P - 1) / P, B = K / G;
  const int64_t tiled = M % 16 >= in->amx_rows ? M : M / 16 * 16, blocks = (tiled + 15) / 16;
  uint8_t *u = amx_buffers(16 * K + AMX_RING * 2048 + blocks * B * AMX_ROWS_BYTES);
  int32_t *c = (int32_t *)(u + 16 * K);
  uint8_t *xa = u + 16 * K + AMX_RING * 2048;
  if (u) {
    amx_rows_of(in, tiled, K, xa);
    amx_configure(type == I8_Q6_K ? 16 : 32);
  }
  #pragma omp for schedule(static)
  for (int64_t p = 0; p < panels; p++) {
    if (!u) {  /* the vector tiles instead: the same bits */
      task8(in, M, K, N, ldy, w, type, p, 1, y, y_bf16, 0);
      continue;
    }
    for (int64_t r0 = 0; r0 < tiled; r0 += 16) {
      vf acc[16];
      const uint8_t *xr = xa + r0 / 16 * B * AMX_ROWS_BYTES;
      if (type == I8_Q4_K) amx_block(xr, K, w, I8_Q4_K, p, u, c, r0 == 0, acc);
      else if (type == I8_Q6_K) amx_block(xr, K, w, I8_Q6_K, p, u, c, r0 == 0, acc);
      else amx_block(xr, K, w, I8_IQ4_XS, p, u, c, r0 == 0, acc);
      for (int r = 0; r < 16 && r0 + r < tiled; r++) {
        float lanes[P];
        vstore(lanes, acc[r]);
        for (int n = 0; n < P && p * P + n < N; n++) {
          const int64_t at = (r0 + r) * ldy + p * P + n;
          if (y_bf16) ((uint16_t *)y)[at] = f32_to_bf16(lanes[n]);
          else ((float *)y)[at] = lanes[n];
        }
      }
    }
    if (tiled < M) task8(in, M, K, N, ldy, w, type, p, 1, y, y_bf16, tiled);
  }
  if (u) _tile_release();
}
#else
int blockdot_amx(void) { return 0; }
#endif

/* Whether tasks8_of runs M rows of `type` on the AMX tiles (the K-quants' tiles only). */
static int on_tiles(const struct xin *in, int64_t M, int type) {
#if AMX
  return in->amx_rows > 0 && M >= in->amx_rows && I8_TYPES[type].weights == SB;
#else
  (void)in, (void)M, (void)type;
  return 0;
#endif
}

/* Panels a task of the vector tiles takes for M rows of x. */
static int tasks8_np(int64_t M) { return SIMD == 256 ? (M <= 1 ? 2 : 1) : M <= 2 ? 4 : M <= 4 ? 2 : 1; }

/* One type's panels w (N rows, rows of y ldy apart) split among the team's threads. */
static void tasks8_of(const struct xin *in, int64_t M, int64_t K, int64_t N, int64_t ldy, const uint8_t *w, int type,
                      void *y, int y_bf16) {
#if AMX
  if (on_tiles(in, M, type)) {
    amx_tasks_of(in, M, K, N, ldy, w, type, y, y_bf16);
    return;
  }
#endif
  const int64_t panels = (N + P - 1) / P;
  const int NP = tasks8_np(M);
  const int64_t tasks = (panels + NP - 1) / NP;
  #pragma omp for schedule(static)
  for (int64_t t = 0; t < tasks; t++) {
    const int whole = (t + 1) * NP <= panels;  /* the last task's panels one at a time where they run short */
    for (int64_t p = t * NP; p < (whole ? t * NP + 1 : panels); p++) task8(in, M, K, N, ldy, w, type, p, whole ? NP : 1, y, y_bf16, 0);
  }
}

/* Calls f(segment's panels, its type, its first row, its rows) for each segment of w (one, unless I8_MIXED). */
#define FOR_SEGMENTS(w, planes, N, K, ...)                                                               \
  do {                                                                                                   \
    const int32_t *head_ = (const int32_t *)(w);                                                         \
    const int mixed_ = I8_TYPE(planes) == I8_MIXED, count_ = mixed_ ? head_[0] : 1;                      \
    const uint8_t *seg_w = mixed_ ? (w) + 64 : (w);                                                      \
    int64_t seg_n0 = 0;                                                                                  \
    for (int i_ = 0; i_ < count_; i_++) {                                                                \
      const int seg_type = mixed_ ? head_[2 + 2 * i_] : I8_TYPE(planes);                                 \
      const int64_t seg_panels = mixed_ ? head_[1 + 2 * i_] : ((N) + P - 1) / P;                         \
      const int64_t seg_rows = (N) - seg_n0 < seg_panels * P ? (N) - seg_n0 : seg_panels * P;            \
      __VA_ARGS__;                                                                                       \
      seg_w += seg_panels * ((K) / I8_TYPES[seg_type].weights) * I8_TYPES[seg_type].bytes;               \
      seg_n0 += seg_panels * P;                                                                          \
    }                                                                                                    \
  } while (0)

static void tasks8(const struct xin *in, int64_t M, int64_t K, int64_t N, const uint8_t *w, int planes, void *y,
                   int y_bf16) {
  FOR_SEGMENTS(w, planes, N, K,
               tasks8_of(in, M, K, seg_rows, N, seg_w, seg_type, (char *)y + seg_n0 * (y_bf16 ? 2 : 4), y_bf16));
}

/* Row `lane` of panel p of one type's file-bit panels dequantized into dst [K] (float32, or bf16 where
   bf16): Q4_K's d sc q - dmin mn (d sc q exact in float32, one rounding for the min), Q6_K's
   (d sc) (q - 32) and IQ4_XS's (d sc) IQ4_VALUES[i] (one rounding): BlockQuantized.dequantize()'s arithmetic. */
static void dequantize8_row(const uint8_t *w, int type, int64_t p, int lane, int64_t K, void *dst, int bf16) {
  const int64_t S = K / SB, sb = I8_TYPES[type].bytes;
  for (int64_t s = 0; s < S; s++) {
    const uint8_t *blk = w + (p * S + s) * sb;
    float d, dmin = 0, row[SB];
    memcpy(&d, blk + 4 * lane, 4);
    if (type == I8_Q4_K) memcpy(&dmin, blk + 4 * (P + lane), 4);
    for (int k = 0; k < SB; k++) {
      const int octet = k / 8, i = k % 4, upper = (k / 4) % 2;
      const uint8_t low = blk[(type == I8_Q4_K ? Q4K_CODES : type == I8_Q6_K ? Q6K_LOW : IQ4_CODES) + octet * 64 + 4 * lane + i];
      const int q4 = upper ? low >> 4 : low & 15;
      if (type == I8_IQ4_XS) {
        row[k] = d * (float)(int8_t)blk[IQ4_SC + (k / 32) * P + lane] * (float)IQ4_VALUES[q4];
      } else if (type == I8_Q4_K) {
        const float scale = d * (float)blk[Q4K_SC + (k / 32) * P + lane];
        const float min = dmin * (float)blk[Q4K_MN + (k / 32) * P + lane];
        row[k] = fmaf(scale, (float)q4, -min);  /* scale q4 exact: one rounding, as mul then add */
      } else {
        const int gi = k / 16, quad = (k % 16) / 4;
        const int high = (blk[Q6K_HIGH + gi * 64 + 4 * lane + i] >> 2 * quad) & 3;
        row[k] = d * (float)(int8_t)blk[Q6K_SC + gi * P + lane] * (float)((q4 | high << 4) - 32);
      }
    }
    if (bf16) for (int k = 0; k < SB; k++) ((uint16_t *)dst)[s * SB + k] = f32_to_bf16(row[k]);
    else memcpy((float *)dst + s * SB, row, sizeof row);
  }
}

/* The same for the 32-weight kinds: d (q - 8), d q + m (one rounding: d q is exact), d (q - 16),
   d IQ4_VALUES[i], d q, as BlockQuantized.dequantize() computes them. */
static void dequantize32_row(const uint8_t *w, int type, int64_t p, int lane, int64_t K, void *dst, int bf16) {
  const int64_t B = K / G, bb = I8_TYPES[type].bytes;
  for (int64_t b = 0; b < B; b++) {
    const uint8_t *blk = w + (p * B + b) * bb;
    uint16_t h;
    memcpy(&h, blk + 2 * lane, 2);
    const float d = f16_to_f32(h);
    float m = 0, row[G];
    if (B32_MINS(type)) memcpy(&h, blk + 2 * (P + lane), 2), m = f16_to_f32(h);
    uint32_t fifth = 0;
    if (type == I8_Q5_0 || type == I8_Q5_1) memcpy(&fifth, blk + B32_FIFTH(type) + 4 * lane, 4);
    for (int k = 0; k < G; k++) {
      const uint8_t *codes = blk + B32_CODES(type);
      if (type == I8_Q8_0) {
        row[k] = d * (float)(int8_t)codes[(k / 4) * 64 + 4 * lane + k % 4];
        continue;
      }
      const uint8_t byte = codes[(k / 8) * 64 + 4 * lane + k % 4];
      int q = (k / 4) % 2 ? byte >> 4 : byte & 15;
      q |= (int)((fifth >> (8 * (k % 4) + k / 4)) & 1) << 4;  /* 0 but for Q5_0 and Q5_1 */
      row[k] = type == I8_IQ4_NL ? d * (float)IQ4_VALUES[q]
               : B32_MINS(type) ? fmaf(d, (float)q, m)
               : d * (float)(q - (type == I8_Q4_0 ? 8 : type == I8_Q5_0 ? 16 : 0));
    }
    if (bf16) for (int k = 0; k < G; k++) ((uint16_t *)dst)[b * G + k] = f32_to_bf16(row[k]);
    else memcpy((float *)dst + b * G, row, sizeof row);
  }
}

/* Row n of file-bit panels w [N, K] (any segment) into dst. */
static void dequantize8_any(const uint8_t *w, int planes, int64_t N, int64_t K, int64_t n, void *dst, int bf16) {
  FOR_SEGMENTS(w, planes, N, K, {
    if (n >= seg_n0 && n < seg_n0 + seg_rows) {
      if (I8_TYPES[seg_type].weights == G) dequantize32_row(seg_w, seg_type, (n - seg_n0) / P, (int)((n - seg_n0) % P), K, dst, bf16);
      else dequantize8_row(seg_w, seg_type, (n - seg_n0) / P, (int)((n - seg_n0) % P), K, dst, bf16);
    }
  });
}

/* Rows rows[0 .. count - 1] of file-bit panels w [N, K] dequantized into out [count, K] (an embedding's
   lookup from the tied head's panels); returns -1 where a row is out of range, 0 otherwise. */
int blockdot_dequantize_rows(const uint8_t *w, int planes, int64_t N, int64_t K, const int64_t *rows, int64_t count,
                             void *out, int out_bf16) {
  if (!(planes & I8P)) return -1;
  for (int64_t i = 0; i < count; i++)
    if (rows[i] < 0 || rows[i] >= N) return -1;
  for (int64_t i = 0; i < count; i++)
    dequantize8_any(w, planes, N, K, rows[i], (char *)out + i * K * (out_bf16 ? 2 : 4), out_bf16);
  return 0;
}

/* xsum, xsum16 (2), xd, x8d, x8sum16 (2): 7 floats a block; xq K / 2 a row, x8 K / 4. */
int64_t blockdot_scratch_floats(int64_t M, int64_t K) { return 7 * M * (K / G) + M * K / 2 + M * K / 4; }

/* blockdot_scratch's buffers: one a thread, found through a pthread key whose destructor frees it
   when the thread exits. */
struct scratch {
  void *data;
  int64_t bytes;        /* what data holds */
  int64_t allocations;  /* how many times it was (re)allocated: for the tests */
  void *tiles;          /* the AMX tiles' buffers (amx_buffers), apart: a team's first thread holds x's in data */
  int64_t tiles_bytes;
};
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_made;

static void scratch_release(void *s) {
  free(((struct scratch *)s)->data);
  free(((struct scratch *)s)->tiles);
  free(s);
}
static void scratch_key_make(void) { scratch_key_made = pthread_key_create(&scratch_key, scratch_release) == 0; }

static struct scratch *thread_scratch(void) {
  pthread_once(&scratch_once, scratch_key_make);
  if (!scratch_key_made) return NULL;
  struct scratch *s = pthread_getspecific(scratch_key);
  if (s) return s;
  s = calloc(1, sizeof *s);
  if (s && pthread_setspecific(scratch_key, s)) {
    free(s);
    return NULL;
  }
  return s;
}

/* *data, holding *have bytes, kept where it holds `bytes`, else reallocated to half as much again
   as asked, in pages: a decode step's need grows with its longest context, a few hundred bytes a
   token, and should not reallocate every step. Returns 1 where it reallocated. */
static int grow(void **data, int64_t *have, int64_t bytes) {
  if (*data && bytes <= *have) return 0;
  const int64_t grown = ((bytes > 0 ? bytes + bytes / 2 : 0) / 4096 + 1) * 4096;
  free(*data);
  *data = aligned_alloc(64, (size_t)grown);  /* a multiple of 64, as aligned_alloc asks */
  *have = *data ? grown : 0;
  return *data != NULL;
}

void *blockdot_scratch(int64_t bytes) {
  struct scratch *s = thread_scratch();
  if (!s) return NULL;
  s->allocations += grow(&s->data, &s->bytes, bytes);
  return s->data;
}

#if AMX
static uint8_t *amx_buffers(int64_t bytes) {
  struct scratch *s = thread_scratch();
  if (!s) return NULL;
  grow(&s->tiles, &s->tiles_bytes, bytes);
  return s->tiles;
}
#endif

/* The calling thread's scratch: stats[0] its bytes, stats[1] how many times it was allocated. */
void blockdot_scratch_stats(int64_t *stats) {
  const struct scratch *s = thread_scratch();
  stats[0] = s ? s->bytes : 0;
  stats[1] = s ? s->allocations : 0;
}

void blockdot_inputs(const float *x, int64_t M, int64_t K, int q16, float *scratch, struct xin *in) {
  const int64_t B = K / G;
  float *xsum = scratch, *xsum16 = xsum + M * B, *xd = xsum16 + 2 * M * B;
  in->x = x;
  in->xsum = xsum;
  in->xsum16 = xsum16;
  in->xq = q16 ? (const int32_t *)(xd + M * B) : NULL;
  in->xd = xd;
  float *x8d = xd + M * B + M * K / 2;
  in->x8d = x8d;
  in->x8sum16 = (const int32_t *)(x8d + M * B);
  in->x8 = (const int8_t *)(x8d + 3 * M * B);
  in->amx_rows = 0;
}

void blockdot_prepare_rows(const struct xin *in, int64_t K, int64_t r0, int64_t r1) {
  const int64_t B = K / G;
  const float *x = in->x;
  /* the scratch blockdot_inputs laid out, written here a row at a time */
  float *xsum = (float *)in->xsum, *xsum16 = (float *)in->xsum16, *xd = (float *)in->xd;
  int32_t *xq = (int32_t *)in->xq;
  for (int64_t r = r0; r < r1; r++)
    for (int64_t b = 0; b < B; b++) {
      const float *xb = x + r * K + b * G;
      float sum = 0, amax = 0;
      #pragma omp simd reduction(+ : sum) reduction(max : amax)
      for (int j = 0; j < G; j++) {
        const float a = fabsf(xb[j]);
        sum += xb[j];
        amax = a > amax ? a : amax;  /* fmaxf was a call per element here */
      }
      xsum[r * B + b] = sum;
      for (int h = 0; h < 2; h++) {  /* each 16's own sum, for G16M's mins */
        float half = 0;
        #pragma omp simd reduction(+ : half)
        for (int j = 0; j < G / 2; j++) half += xb[h * G / 2 + j];
        xsum16[(r * B + b) * 2 + h] = half;
      }
      {  /* x ~ x8d q8, q8 = round(x / x8d) in -127..127 (to nearest even, as below) */
        const float inv8 = amax > 0 ? 127 / amax : 0, magic = 12582912.0f;
        ((float *)in->x8d)[r * B + b] = amax / 127;
        int8_t *q8 = (int8_t *)in->x8 + r * K + b * G;
        int32_t t8[G];
        #pragma omp simd
        for (int j = 0; j < G; j++) t8[j] = (int32_t)((xb[j] * inv8 + magic) - magic);
        for (int h = 0; h < 2; h++) {
          int32_t sum8 = 0;
          for (int j = 0; j < G / 2; j++) sum8 += t8[h * G / 2 + j], q8[h * G / 2 + j] = (int8_t)t8[h * G / 2 + j];
          ((int32_t *)in->x8sum16)[(r * B + b) * 2 + h] = sum8;
        }
      }
      if (!xq) continue;
      /* x ~ xd q, q = round(x / xd) in -32767..32767 (to nearest even: adding and taking away
         1.5 2^23 leaves the integer nearest a float below 2^22, in vector instructions) */
      const float inv = amax > 0 ? 32767 / amax : 0, magic = 12582912.0f;
      xd[r * B + b] = amax / 32767;
      int32_t t[G];
      #pragma omp simd
      for (int j = 0; j < G; j++) t[j] = (int32_t)((xb[j] * inv + magic) - magic);
      uint32_t *q = (uint32_t *)(xq + (r * B + b) * 16);
      for (int o = 0; o < 4; o++)
        for (int j = 0; j < 4; j++) q[4 * o + j] = (uint16_t)t[8 * o + j] | (uint32_t)(uint16_t)t[8 * o + j + 4] << 16;
    }
}

void blockdot_prepare(const float *x, int64_t M, int64_t K, int q16, float *scratch, struct xin *in) {
  blockdot_inputs(x, M, K, q16, scratch, in);
  blockdot_prepare_rows(in, K, 0, M);
}

void blockdot_tasks(const struct xin *in, int64_t M, int64_t K, int64_t N, const uint8_t *w, int planes, void *y,
                    int y_bf16) {
  if (planes & I8P) {
    tasks8(in, M, K, N, w, planes, y, y_bf16);
    return;
  }
  const int64_t panels = (N + P - 1) / P;
  /* A task is NP panels (16 NP output rows) against every row of x, in tiles of NP panels by MR
     rows (task, below) with NP * MR <= 8: four panels for one or two rows of x, two for three or
     four, one past that. AVX2, whose vf is two registers, keeps NP * MR <= 4: four panels for one
     row, two for two, one (by up to four rows) past that. */
  const int NP = SIMD == 256 ? (M <= 1 ? 4 : M <= 2 ? 2 : 1) : M <= 2 ? 4 : M <= 4 ? 2 : 1;
  const int64_t tasks = (panels + NP - 1) / NP;
  #pragma omp for schedule(static)
  for (int64_t t = 0; t < tasks; t++) {
    if ((t + 1) * NP <= panels) task(in, M, K, N, w, planes, t * NP, NP, y, y_bf16);
    else for (int64_t p = t * NP; p < panels; p++) task(in, M, K, N, w, planes, p, 1, y, y_bf16);
  }
}

/* One segment of one matrix of a group (blockdot_group): tasks8_of's tasks of NP panels. */
struct unit8 {
  const struct xin *in;
  int64_t M, rows, panels, tasks;
  const uint8_t *w;
  char *y;
  int type, NP;
};
#define GROUP_UNITS 512

int blockdot_group(const struct xin *ins, const int64_t *Ms, int64_t K, int64_t N, const uint8_t *const *ws,
                   const int *planes, float *const *ys, int count) {
  struct unit8 units[GROUP_UNITS];
  int n = 0;
  int64_t all = 0;  /* panels in all */
  for (int j = 0; j < count; j++) {
    if (planes[j] <= 0 || !(planes[j] & I8P)) return 0;  /* dense panels (planes < 0) and the other panels: not here */
    FOR_SEGMENTS(ws[j], planes[j], N, K, {
      if (n == GROUP_UNITS || on_tiles(&ins[j], Ms[j], seg_type)) return 0;
      const int NP = tasks8_np(Ms[j]);
      units[n++] = (struct unit8){&ins[j], Ms[j], seg_rows, seg_panels, (seg_panels + NP - 1) / NP, seg_w,
                                  (char *)ys[j] + seg_n0 * 4, seg_type, NP};
      all += seg_panels;
    });
  }
  /* this thread's share: the tasks whose first panel is in [lo, hi) of all the panels in order */
  const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
  const int64_t lo = all * me / threads, hi = all * (me + 1) / threads;
  int64_t first = 0;  /* the current unit's first panel among all */
  for (int u = 0; u < n && first < hi; first += units[u].panels, u++) {
    const struct unit8 *t = &units[u];
    if (first + t->panels <= lo) continue;
    for (int64_t k = 0; k < t->tasks; k++) {
      const int64_t at = first + k * t->NP;
      if (at < lo) continue;
      if (at >= hi) break;
      const int whole = (k + 1) * t->NP <= t->panels;
      for (int64_t p = k * t->NP; p < (whole ? k * t->NP + 1 : t->panels); p++)
        task8(t->in, t->M, K, t->rows, N, t->w, t->type, p, whole ? t->NP : 1, t->y, 0, 0);
    }
  }
  #pragma omp barrier
  return 1;
}

/* Dense panels: a dense w [N, K] (float32, or bf16 where bf16) regrouped once (blockdot.py's
   DensePanels) into panels of 16 output rows, k-major: panel p holds, for each k, the 16 weights
   w[16 p + j, k] in one vector (bf16 in AVX2 builds in the order 0, 8, 1, 9, .. 7, 15, so that each
   32-bit word holds rows j and j + 8: one shift and one mask widen a k's 16 weights exactly; rows past
   N are zero). A tile of MR rows of x against one panel keeps MR vector sums (MR * 16 outputs) in
   registers for the whole of K, each k a broadcast x[r, k] times the panel's vector: no horizontal
   sum, one pass over the panel per tile of rows (from L2 after the first), and the panel read as one
   contiguous stream. A dot-product form (rows of w against rows of x, the sums reduced across lanes
   at the end) reads x once per pair of w rows, and ran at under half this form's rate at 32 rows
   (notes/blockdot.md, "Why blockdot.c is as it is"). */
/* Rows of x a tile: 12 (AVX-512) or 3 (AVX2 and plain C; AVX2's vf is two registers): two vector sums a
   row, 24 (12) of the 32 (16) vector registers. */
#define DP_MR (SIMD == 512 ? 12 : 3)
INLINE vf dense_k(const void *p, int64_t k, const int bf16) {
#if SIMD == 256
  if (bf16) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + 16 * k));
    return (vf){_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
                _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)))};
  }
#endif
  return bf16 ? vbf16((const uint16_t *)p + 16 * k) : vload((const float *)p + 16 * k);
}
/* Rows r0 .. r0 + MR - 1 of x against panel p: y[r, n0 .. n0 + nn - 1]. Two sums a row (even and odd k,
   added at the end) at every MR: a row's sums are the same whatever tile it is in, so its output bits
   do not change with the width of the call (a tile that summed a row in one chain at some widths and
   two at others would change them: notes/batch-invariance.md).
   `next` (or NULL): the panel to fetch to L2 on the way, a line every `stride` steps of k from byte
   *cursor up to `end` (the cursor goes on from one tile of the panel to the next). */
INLINE void dense_tile(const float *x, int64_t K, const void *p, const int bf16, int64_t r0, const int MR, float *y,
                       int64_t N, int64_t n0, int64_t nn, const char *next, int64_t *cursor, int64_t end, int stride) {
  enum { U = 2 };
  vf acc[U][DP_MR];
  for (int s = 0; s < U; s++)
    for (int r = 0; r < MR; r++) acc[s][r] = vzero();
  const float *xr = x + r0 * K;
  int64_t k = 0;
  int64_t c = *cursor;
  int countdown = stride;
  for (; k + U <= K; k += U)
    for (int s = 0; s < U; s++) {
      if (next && --countdown == 0) { countdown = stride; if (c < end) { prefetch(next + c); c += 64; } }
      const vf wv = dense_k(p, k + s, bf16);
      for (int r = 0; r < MR; r++) acc[s][r] = vfma(wv, vset1(xr[r * K + k + s]), acc[s][r]);
    }
  for (; k < K; k++) {
    const vf wv = dense_k(p, k, bf16);
    for (int r = 0; r < MR; r++) acc[0][r] = vfma(wv, vset1(xr[r * K + k]), acc[0][r]);
  }
  *cursor = c;
  for (int r = 0; r < MR; r++) {
    const vf sum = vadd(acc[0][r], acc[1][r]);
    if (nn == P) vstore(y + (r0 + r) * N + n0, sum);
    else {
      float lanes[P];
      vstore(lanes, sum);
      memcpy(y + (r0 + r) * N + n0, lanes, nn * sizeof(float));
    }
  }
}
INLINE void dense_panel(const float *x, int64_t M, int64_t K, const void *p, const int bf16, float *y, int64_t N,
                        int64_t n0, const char *next) {
  if (M <= 0) return;
  const int64_t nn = N - n0 < P ? N - n0 : P;
  const int64_t tiles = (M + DP_MR - 1) / DP_MR, base = M / tiles, extra = M % tiles;  /* tiles as even as they go */
  int64_t r0 = 0;
  /* the next panel's lines spread evenly over all the tiles of this one: end / 64 lines in tiles * K
     steps of k. Fetched all in the first tile, they would queue behind that tile's own misses
     (notes/blockdot.md, "Why blockdot.c is as it is"). */
  const int64_t end = K * P * (bf16 ? 2 : 4);
  int64_t cursor = 0;
  const int stride = (int)((tiles * K * 64) / end > 1 ? (tiles * K * 64) / end : 1);
  for (int64_t t = 0; t < tiles; t++) {
    const int mr = (int)(base + (t < extra));
    switch (mr) {  /* each width its own unrolled tile */
#define TILE(n) case n: dense_tile(x, K, p, bf16, r0, n, y, N, n0, nn, next, &cursor, end, stride); break;
      TILE(1) TILE(2) TILE(3)
#if DP_MR > 3
      TILE(4) TILE(5) TILE(6)
#endif
#if DP_MR > 6
      TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#endif
#undef TILE
    }
    r0 += mr;
  }
}

/* dense_tasks on its own: y [M, N] float32 = x [M, K] float32 @ w^T over nthreads threads (blockdot.DensePanels). */
void blockdot_dense(const float *x, int64_t M, int64_t K, int64_t N, const void *w, int w_bf16, float *y, int nthreads) {
  #pragma omp parallel num_threads(nthreads)
  dense_tasks(x, M, K, N, w, w_bf16, y);
}

void dense_tasks(const float *x, int64_t M, int64_t K, int64_t N, const void *w, int w_bf16, float *y) {
  const int64_t panels = (N + P - 1) / P, bytes = K * P * (w_bf16 ? 2 : 4);  /* a task: one panel, every row of x */
  /* Static: each thread's panels are one run, so while it reads a panel (from memory: a step's
     weights are not in cache) it fetches the next to L2; the hardware's prefetchers alone left the
     panels' FMAs waiting on memory in whole decode steps. But not at one row: there a panel is read
     once, as one stream, at the memory rate on the hardware's prefetchers, and a second stream of
     software prefetches slows it (notes/blockdot.md, "Why blockdot.c is as it is"). */
  #pragma omp for schedule(static)
  for (int64_t g = 0; g < panels; g++) {
    const char *p = (const char *)w + g * bytes, *next = g + 1 < panels && M > 1 ? p + bytes : NULL;
    if (w_bf16) dense_panel(x, M, K, p, 1, y, N, P * g, next);
    else dense_panel(x, M, K, p, 0, y, N, P * g, next);
  }
}

int blockdot_dense_pairs(void) { return SIMD == 256; }  /* whether bf16 panels hold rows j and j + 8 in a word */

/* The codes of row n at k = 8 o .. 8 o + 7 of block (p, b), as int32; then eight weights of one row,
   d c + m for those codes c, into dst as float32 or bf16 (rounded to nearest even, as torch rounds). */
#if defined(__AVX2__) && defined(__FMA__)
typedef __m256i codes8;
static inline codes8 codes_at(const uint8_t *w, int64_t p, int64_t B, int64_t b, int64_t bb, int planes, int o, int n) {
  if (CODES(planes) == 1)
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)octet_at(w, p, B, b, bb, o)[n]),
                                              _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), _mm256_set1_epi32(15));
  uint16_t pairs[4];  /* pair j: the codes at k = 8 o + j and k + 4 */
  for (int j = 0; j < 4; j++) memcpy(pairs + j, pair_at(w, p, B, b, bb, o, j) + 2 * n, 2);
  const __m128i v = _mm_setr_epi16((short)pairs[0], (short)pairs[1], (short)pairs[2], (short)pairs[3], 0, 0, 0, 0);
  return _mm256_cvtepi8_epi32(_mm_shuffle_epi8(v, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, -1, -1, -1, -1, -1, -1, -1, -1)));
}
static inline void dequant8(codes8 c, float d, float m, void *dst, int bf16) {
  const __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(c), _mm256_set1_ps(m));  /* d c exact: one rounding */
  if (!bf16) { _mm256_storeu_ps(dst, v); return; }
  const __m256i u = _mm256_castps_si256(v);
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                 _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(64)), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128((__m128i *)dst, packed);
}
#else
typedef struct { int32_t c[8]; } codes8;
static inline codes8 codes_at(const uint8_t *w, int64_t p, int64_t B, int64_t b, int64_t bb, int planes, int o, int n) {
  codes8 r;
  for (int i = 0; i < 8; i++)
    r.c[i] = CODES(planes) == 1 ? (int32_t)((octet_at(w, p, B, b, bb, o)[n] >> 4 * i) & 15) : pair_at(w, p, B, b, bb, o, i % 4)[2 * n + i / 4];
  return r;
}
static inline void dequant8(codes8 c, float d, float m, void *dst, int bf16) {
  for (int i = 0; i < 8; i++) {
    const float v = d * (float)c.c[i] + m;
    if (bf16) ((uint16_t *)dst)[i] = f32_to_bf16(v);
    else ((float *)dst)[i] = v;
  }
}
#endif

/* w [N, K] in panels -> the dense matrix out [N, K] (float32, or bf16 where out_bf16): d c + m per
   weight, each product exact in float32, so the result is bit for bit BlockQuantized.dequantize()'s.
   What a step wider than the kernels' rows multiplies by in place of a dense copy held for the
   model's life. */
/* Panel p of w dequantized; planes and bf16 are constants where inlined, so each pair has its own loop. */
INLINE void dequantize_panel(const uint8_t *w, int64_t p, int64_t B, int64_t bb, int64_t N, int64_t K, void *out,
                             const int planes, const int bf16) {
  for (int64_t b = 0; b < B; b++) {
    float dl[P], ml[P], m0l[P] = {0}, m1l[P] = {0};
    vf d, m;
    heads_at(w, p, B, b, bb, planes, &d, &m);
    vstore(dl, d);
    vstore(ml, m);
    if (planes & G16M) {
      vf m0, m1;
      mins16_at(w, p, B, b, bb, &m0, &m1);
      vstore(m0l, m0);
      vstore(m1l, m1);
    }
    for (int n = 0; n < P && p * P + n < N; n++)
      for (int o = 0; o < 4; o++)  /* G16: d for octets 0-1, m's slot (the second d) for 2-3; G16M's mins */
        dequant8(codes_at(w, p, B, b, bb, planes, o, n), planes & G16 && o >= 2 ? ml[n] : dl[n],
                 planes & G16 ? (o >= 2 ? m1l[n] : m0l[n]) : ml[n],
                 (char *)out + ((p * P + n) * K + b * G + 8 * o) * (bf16 ? 2 : 4), bf16);
  }
}

void blockdot_dequantize(const uint8_t *w, int planes, int64_t N, int64_t K, void *out, int out_bf16, int nthreads) {
  const int64_t B = K / G, panels = (N + P - 1) / P, bb = block_bytes(planes);
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t p = 0; p < panels; p++) {
    if (planes & I8P) {
      for (int64_t n = p * P; n < (p + 1) * P && n < N; n++)
        dequantize8_any(w, planes, N, K, n, (char *)out + n * K * (out_bf16 ? 2 : 4), out_bf16);
      continue;
    }
    const int heads = planes & (F32_HEADS | G16 | G16M);
    if (CODES(planes) == 1) {
      if (out_bf16) dequantize_panel(w, p, B, bb, N, K, out, 1 | heads, 1);
      else dequantize_panel(w, p, B, bb, N, K, out, 1 | heads, 0);
    } else {
      if (out_bf16) dequantize_panel(w, p, B, bb, N, K, out, 2 | heads, 1);
      else dequantize_panel(w, p, B, bb, N, K, out, 2 | heads, 0);
    }
  }
}

/* y [M, N] = x [M, K] @ w^T, w in panels of 4-bit (planes 1) or int8 (2) codes, | F32_HEADS for float heads,
   | G16 and G16M for two scales (and mins) a block ([ceil(N / 16), K / 32] blocks; rows
   past N all zero). x and y are float32, or bf16 where x_bf16 / y_bf16; from int16_rows rows of x (0:
   never) x is rounded to int16 per block of 32 (the int16 path). Returns 0, or -1 when out of memory
   for the activations' float32 copies (the thread's scratch, blockdot_scratch). */
int blockdot(const void *x, int x_bf16, int64_t M, int64_t K, int64_t N, const uint8_t *w, int planes, void *y,
             int y_bf16, int nthreads, int64_t int16_rows, int64_t amx_rows) {
  float *scratch = blockdot_scratch(sizeof(float) * ((x_bf16 ? M * K : 0) + blockdot_scratch_floats(M, K)));
  if (!scratch) return -1;
  const float *x32 = x;
  if (x_bf16) {
    for (int64_t i = 0; i < M * K; i++) scratch[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    x32 = scratch;
  }
  struct xin in;
  blockdot_prepare(x32, M, K, int16_rows > 0 && M >= int16_rows, scratch + (x_bf16 ? M * K : 0), &in);
  in.amx_rows = amx_rows > 0 && blockdot_amx() ? amx_rows : 0;
  #pragma omp parallel num_threads(nthreads)
  blockdot_tasks(&in, M, K, N, w, planes, y, y_bf16);
  return 0;
}

/* blockdot_group on its own, for the tests: count matrices ws of one shape [N, K] on file-bit panels
   against x_j [M_j, K] float32 into y_j [M_j, N] float32, over nthreads threads. Returns 1, 0 where
   blockdot_group did not take them (nothing written), -1 when out of memory. */
int blockdot_grouped(const float *const *xs, const int64_t *Ms, int64_t K, int64_t N, const uint8_t *const *ws,
                     const int *planes, float *const *ys, int count, int nthreads) {
  int64_t floats = 0;
  for (int j = 0; j < count; j++) floats += blockdot_scratch_floats(Ms[j], K);
  float *scratch = blockdot_scratch(sizeof(float) * floats);
  struct xin *ins = malloc(sizeof(struct xin) * (count > 0 ? count : 1));
  if (!scratch || !ins) {
    free(ins);
    return -1;
  }
  for (int j = 0, at = 0; j < count; at += blockdot_scratch_floats(Ms[j], K), j++) {
    blockdot_prepare(xs[j], Ms[j], K, 0, scratch + at, &ins[j]);
    ins[j].amx_rows = 0;
  }
  int done = 0;
  #pragma omp parallel num_threads(nthreads)
  {
    const int mine = blockdot_group(ins, Ms, K, N, ws, planes, ys, count);
    #pragma omp single
    done = mine;
  }
  free(ins);
  return done;
}
