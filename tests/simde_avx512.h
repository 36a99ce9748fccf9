/* Included ahead of blockdot.c and fused_decode.c (cc -include) by test_blockdot's emulated builds:
 * SIMDe (github.com/simd-everywhere/simde) implements the AVX-512 intrinsics in portable C (on AVX2
 * where the CPU has it), under their own names (native aliases), so blockdot.c's AVX-512 branch is
 * compiled and run on a CPU without AVX-512. The branch is chosen by __AVX512F__ and __AVX512BW__ (and
 * the VNNI instruction by __AVX512VNNI__, where EMULATE_VNNI): defined here, after SIMDe has looked
 * for the real ones, so that it emulates them all. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include "simde/x86/avx512.h"
#include "simde/x86/f16c.h"

/* Intrinsics blockdot.c and fused_decode.c use that older SIMDe releases lack (Debian 12's
 * libsimde-dev 0.7.4 has none of these four; SIMDe 0.8 has them all): where SIMDe gave no native
 * alias, one here, lane by lane through memory, so that the name does not fall through to the
 * compiler's own AVX-512 intrinsic (which will not inline into code built without -mavx512f). */
#ifndef _mm512_cvtepi32_ps
static inline simde__m512 nanoserve_mm512_cvtepi32_ps(simde__m512i a) {
  int32_t in[16];
  simde_float32 out[16];
  simde_mm512_storeu_si512(in, a);
  for (int i = 0; i < 16; i++) out[i] = (simde_float32)in[i]; /* rounds to nearest, as vcvtdq2ps does */
  return simde_mm512_loadu_ps(out);
}
#define _mm512_cvtepi32_ps(a) nanoserve_mm512_cvtepi32_ps(a)
#endif
#ifndef _mm512_cvtepu16_epi32
static inline simde__m512i nanoserve_mm512_cvtepu16_epi32(simde__m256i a) {
  uint16_t in[16];
  int32_t out[16];
  simde_mm256_storeu_si256(in, a);
  for (int i = 0; i < 16; i++) out[i] = in[i];
  return simde_mm512_loadu_si512(out);
}
#define _mm512_cvtepu16_epi32(a) nanoserve_mm512_cvtepu16_epi32(a)
#endif
#ifndef _mm512_cvtph_ps
static inline simde__m512 nanoserve_mm512_cvtph_ps(simde__m256i a) {
  uint16_t in[16];
  simde_float32 out[16];
  simde_mm256_storeu_si256(in, a);
  for (int i = 0; i < 16; i++) out[i] = simde_float16_to_float32(simde_uint16_as_float16(in[i])); /* exact */
  return simde_mm512_loadu_ps(out);
}
#define _mm512_cvtph_ps(a) nanoserve_mm512_cvtph_ps(a)
#endif
#ifndef _mm512_srai_epi32
static inline simde__m512i nanoserve_mm512_srai_epi32(simde__m512i a, unsigned int count) {
  int32_t lanes[16];
  simde_mm512_storeu_si512(lanes, a);
  for (int i = 0; i < 16; i++) lanes[i] >>= count > 31 ? 31 : count; /* a count past 31 fills with the sign */
  return simde_mm512_loadu_si512(lanes);
}
#define _mm512_srai_epi32(a, count) nanoserve_mm512_srai_epi32(a, count)
#endif
#ifndef _mm512_cvtepu8_epi32
static inline simde__m512i nanoserve_mm512_cvtepu8_epi32(simde__m128i a) {
  uint8_t in[16];
  int32_t out[16];
  simde_mm_storeu_si128(in, a);
  for (int i = 0; i < 16; i++) out[i] = in[i];
  return simde_mm512_loadu_si512(out);
}
#define _mm512_cvtepu8_epi32(a) nanoserve_mm512_cvtepu8_epi32(a)
#endif
#ifndef _mm512_cvtepi8_epi32
static inline simde__m512i nanoserve_mm512_cvtepi8_epi32(simde__m128i a) {
  int8_t in[16];
  int32_t out[16];
  simde_mm_storeu_si128(in, a);
  for (int i = 0; i < 16; i++) out[i] = in[i];
  return simde_mm512_loadu_si512(out);
}
#define _mm512_cvtepi8_epi32(a) nanoserve_mm512_cvtepi8_epi32(a)
#endif
/* SIMDe 0.7.4 aliases this one with its masked form's four arguments; the two-argument alias. */
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

#define __AVX512F__ 1
#define __AVX512BW__ 1
#ifdef EMULATE_VNNI
#define __AVX512VNNI__ 1
#endif
