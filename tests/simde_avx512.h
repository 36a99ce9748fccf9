/* Included ahead of blockdot.c and fused_decode.c (cc -include) by test_blockdot's emulated builds:
 * SIMDe (github.com/simd-everywhere/simde) implements the AVX-512 intrinsics in portable C (on AVX2
 * where the CPU has it), under their own names (native aliases), so blockdot.c's AVX-512 branch is
 * compiled and run on a CPU without AVX-512. The branch is chosen by __AVX512F__ and __AVX512BW__ (and
 * the VNNI instruction by __AVX512VNNI__, where EMULATE_VNNI): defined here, after SIMDe has looked
 * for the real ones, so that it emulates them all. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include "simde/x86/avx512.h"
#define __AVX512F__ 1
#define __AVX512BW__ 1
#ifdef EMULATE_VNNI
#define __AVX512VNNI__ 1
#endif
