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

#if defined(SL_SIMDE_LEVEL)
/* What SIMDe 0.7.4 lacks of the AVX-512 intrinsics the kernels use, from the two AVX2 halves. */
static inline __m512i sl_simde_join(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
static inline __m512 sl_simde_cvtepi32_ps(__m512i a) {
    const __m256 lo = _mm256_cvtepi32_ps(_mm512_castsi512_si256(a)), hi = _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(a, 1));
    return _mm512_castsi512_ps(sl_simde_join(_mm256_castps_si256(lo), _mm256_castps_si256(hi)));
}
static inline __m512i sl_simde_cvtepi8_epi32(__m128i a) {
    return sl_simde_join(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
static inline __m512i sl_simde_cvtepu8_epi32(__m128i a) {
    return sl_simde_join(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
}
#define _mm512_cvtepi32_ps sl_simde_cvtepi32_ps
#define _mm512_cvtepi8_epi32 sl_simde_cvtepi8_epi32
static inline __m512i sl_simde_cvtepu16_epi32(__m256i a) {
    return sl_simde_join(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
static inline __m512 sl_simde_cvtph_ps(__m256i a) {
    const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(a)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1));
    return _mm512_castsi512_ps(sl_simde_join(_mm256_castps_si256(lo), _mm256_castps_si256(hi)));
}
static inline __m512i sl_simde_cvttps_epi32(__m512 a) {
    const __m256 lo = _mm512_castps512_ps256(a), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return sl_simde_join(_mm256_cvttps_epi32(lo), _mm256_cvttps_epi32(hi));
}
#define _mm512_cvttps_epi32 sl_simde_cvttps_epi32
#define _mm512_cvtps_ph(a, rounding) \
    _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvtps_ph(_mm512_castps512_ps256(a), rounding)), \
                            _mm256_cvtps_ph(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)), rounding), 1)
#define _mm512_cvtepu8_epi32 sl_simde_cvtepu8_epi32
#define _mm512_cvtepu16_epi32 sl_simde_cvtepu16_epi32
#define _mm512_cvtph_ps sl_simde_cvtph_ps
#define _mm512_shuffle_f32x4(a, b, imm8) simde_mm512_shuffle_f32x4(a, b, imm8) /* no alias in 0.7.4 */
#undef _mm512_madd_epi16 /* 0.7.4's alias takes four arguments */
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
#endif

#if defined(SL_AVX512)
/* The halves of a 512-bit vector (the kernels' horizontal sums add them, then sum the 256 bits
 * as their AVX2 paths do: one order at every level that has them, SIMDe's included). */
static inline __m256 sl_lo256(__m512 v) { return _mm512_castps512_ps256(v); }
static inline __m256 sl_hi256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* SL_ROUNDED (fp.h) for a 512-bit vector: SIMDe's is a 64-byte GCC vector that no register
 * constraint fits without AVX-512, so it goes through memory there. */
#if defined(SL_SIMDE_LEVEL) || !defined(__GNUC__)
#define SL_ROUNDED512(v) __asm__("" : "+m"(v))
#else
#define SL_ROUNDED512(v) __asm__("" : "+v"(v))
#endif
#endif
