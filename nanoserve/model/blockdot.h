/* blockdot.h: what blockdot.c offers the fused decode (fused_decode.c) besides its ctypes entry
 * blockdot(): the same matmul split in two, so that it can run inside a caller's OpenMP parallel
 * region with no thread start or gap per call. */
#ifndef NANOSERVE_BLOCKDOT_H
#define NANOSERVE_BLOCKDOT_H
#include <stdint.h>
#include <string.h>

/* What the tiles read: x in float32 ([M, K]), per row and block of 32 the sum of x ([M, K / 32]) and
   of each half of it ([M, K / 16]),
   and on the int16 path (xq not NULL) x rounded to int16 per row and block, x ~ xd q: per block 16
   words, for each octet of 8 k the pairs of k = (0, 4), (1, 5), (2, 6), (3, 7) ([M, K / 2] int32),
   and the scales xd ([M, K / 32]). */
struct xin {
  const float *x;
  const float *xsum;
  const float *xsum16;  /* per row and 16 weights the sum of x ([M, K / 16]): for G16M's mins */
  const int32_t *xq;
  const float *xd;
  /* x rounded to int8 per row and block of 32, x ~ x8d q (q = round(127 x / amax), in -127..127), for the
     file-bit panels (I8P): the codes in x's order ([M, K]), the scales ([M, K / 32]) and each 16 codes'
     sum ([M, K / 16]). Always filled: a pass over x, against a matmul's pass over w. */
  const int8_t *x8;
  const float *x8d;
  const int32_t *x8sum16;
  /* from this many rows the file-bit panels multiply on AMX tiles (0: never; blockdot_amx() granted
     them), the same sums as the vector tiles: blockdot_inputs sets 0, its caller what its plan says */
  int64_t amx_rows;
};

/* Whether this build has AMX tiles and Linux grants them to the process (asked once): 1 or 0. */
int blockdot_amx(void);

/* Floats of scratch blockdot_prepare needs for x [M, K]. */
int64_t blockdot_scratch_floats(int64_t M, int64_t K);

/* The calling thread's scratch: at least `bytes`, 64-byte aligned, kept from call to call and grown
   only when a call needs more than it holds, so a step allocates nothing once the widest step has
   run. Each OS thread that calls in has its own (freed when the thread exits): Python threads may
   call at once (ctypes releases the GIL), and an OpenMP team reads the pointer its caller took
   before the parallel region. Its contents do not survive a call: no entry that takes it calls
   another that does. NULL when out of memory. */
void *blockdot_scratch(int64_t bytes);

/* Fills `in` for x [M, K] float32 (kept, not copied), for the
   int16 path where q16 (x rounded to int16 per block of 32), else the float path; serial. */
void blockdot_prepare(const float *x, int64_t M, int64_t K, int q16, float *scratch, struct xin *in);
/* The same in two halves: blockdot_inputs lays out in's pointers into scratch (no work, the same
   for every caller: each thread of a team can hold its own copy), blockdot_prepare_rows fills them
   for rows r0 .. r1 - 1 of x (so a team can split the rows). */
void blockdot_inputs(const float *x, int64_t M, int64_t K, int q16, float *scratch, struct xin *in);
void blockdot_prepare_rows(const struct xin *in, int64_t K, int64_t r0, int64_t r1);

/* y [M, N] (float32, or bf16 where y_bf16) = x @ w^T for w in panels: an orphaned `omp for` over
   the panels, so it splits the work among the threads of an enclosing parallel region (and ends
   at its barrier), or runs on the calling thread alone outside one. */
void blockdot_tasks(const struct xin *in, int64_t M, int64_t K, int64_t N, const uint8_t *w, int planes, void *y,
                    int y_bf16);

/* Several matmuls of one shape's K and N inside a parallel region (every thread of the team calls
   it with the same arguments): y_j [M_j, N] float32 = x_j @ w_j^T for file-bit panels w_j, with
   blockdot_tasks' tasks of all of them dealt out in one pass, each thread a run of consecutive panels
   of about equal length, and one barrier at the end: each row's sums are blockdot_tasks' own, bit for
   bit. Returns 0, having done nothing, where one of them is not for this pass (not file-bit panels,
   or on the AMX tiles at its M): the caller then runs blockdot_tasks on each. */
int blockdot_group(const struct xin *ins, const int64_t *Ms, int64_t K, int64_t N, const uint8_t *const *ws,
                   const int *planes, float *const *ys, int count);

/* y [M, N] float32 = x [M, K] float32 @ w^T for a dense w [N, K] (float32, or bf16 where w_bf16) in
   dense panels (blockdot.c): an orphaned `omp for` over the panels, as blockdot_tasks. */
void dense_tasks(const float *x, int64_t M, int64_t K, int64_t N, const void *w, int w_bf16, float *y);

static inline float bf16_to_f32(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
/* IEEE binary16 in software, for builds without F16C (and compilers without _Float16: gcc 11 has
   none on x86). Widening is exact; narrowing rounds to nearest even, as torch's .half() and F16C's
   vcvtps2ph do: past 65,504 (from 65,520) to infinity, below 2^-14 to a subnormal step of 2^-24. */
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
  float f;
  if (exp == 0) { f = (float)man / (1 << 24); return sign ? -f : f; }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  memcpy(&f, &bits, 4);
  return f;
}
static inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((x >> 13) & 0x3ffu);  /* NaN stays NaN, quiet */
  if (x >= 0x477ff000u) return sign | 0x7c00u;                                    /* from 65,520: infinity */
  if (x >= 0x38800000u) {                                                         /* from 2^-14: a normal */
    const uint32_t r = x - 0x38000000u;                                           /* exponent bias 127 -> 15 */
    return sign | (uint16_t)((r + 0x0fffu + ((r >> 13) & 1u)) >> 13);
  }
  float scaled;                       /* a subnormal (or zero): steps of 2^-24, x 2^24 exact in float */
  memcpy(&scaled, &x, 4);
  scaled *= 16777216.0f;
  const uint32_t q = (uint32_t)scaled, rest = scaled - (float)q > 0.5f || (scaled - (float)q == 0.5f && (q & 1u));
  return sign | (uint16_t)(q + rest);  /* 1024: rounds up into the smallest normal, its bits alike */
}
#endif
