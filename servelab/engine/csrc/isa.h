/* Which x86 instruction sets this build of the kernels may use. Kernels test these macros, not
 * the compiler's: SL_AVX2 (AVX2 + FMA + F16C), SL_AVX512 (F/BW/VL/DQ), SL_AVX512_VNNI and
 * SL_AVX512_BF16. Each ISA level of native.py compiles with the flags that define them.
 *
 * SL_SIMDE_LEVEL (1: AVX-512, 2: +VNNI, 3: +BF16) builds a level this CPU lacks on SIMDe's
 * portable versions of the intrinsics, so its code paths can be checked on any x86 host (slowly:
 * for correctness only). */
#pragma once

#if defined(SL_SIMDE_LEVEL)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define SL_AVX2 1
#define SL_AVX512 1
#if SL_SIMDE_LEVEL >= 2
#define SL_AVX512_VNNI 1
#endif
#if SL_SIMDE_LEVEL >= 3
#define SL_AVX512_BF16 1
#endif
#else
#if defined(__AVX2__)
#include <immintrin.h>
#define SL_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define SL_AVX512 1
#endif
#if defined(SL_AVX512) && defined(__AVX512VNNI__)
#define SL_AVX512_VNNI 1
#endif
#if defined(SL_AVX512_VNNI) && defined(__AVX512BF16__)
#define SL_AVX512_BF16 1
#endif
#endif
