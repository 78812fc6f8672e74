/* Vectorized exp shared by the kernels (exp8: AVX2 only, exp16: AVX-512; callers keep a scalar
 * expf tail), and the two passes of a softmax over a row of scores that both attention kernels
 * run. exp16 does exp8's operations lane by lane and the softmax sum keeps AVX2's order, so every
 * level with AVX2 gives the same bits here. */
#pragma once
#include <math.h>
#include <stdint.h>
#include "isa.h"
#ifdef SL_AVX2

/* exp of eight floats in [-87.3, 88.3] (clamped to it), Cephes' polynomial as in SSE/AVX
 * mathfun: relative error ~1e-7, like the vectorized exp inside PyTorch's CPU kernels. */
static inline __m256 exp8(__m256 x) {
    /* below -87.3 expf is ~0 anyway; above 88.3 it overflows, and 2^128 has no float exponent.
     * x goes second: max/min return their second operand when one is NaN, so NaN stays NaN. */
    x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#ifdef SL_AVX512
/* exp8 on sixteen lanes: the same operations in each lane, so the same bits. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.3f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x));
    __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, (_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)); /* floor (SIMDe's macro needs the parentheses) */
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, z, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

/* The largest of init and s[0 .. n). */
static inline float sl_max_f32(const float *s, int64_t n, float init) {
    float m = init;
    int64_t c = 0;
#if defined(SL_AVX512)
    if (n >= 16) { /* the maximum is exact in any order */
        __m512 vmax = _mm512_loadu_ps(s);
        for (c = 16; c + 16 <= n; c += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + c));
        float lanes[16];
        _mm512_storeu_ps(lanes, vmax);
        for (int i = 0; i < 16; i++) m = lanes[i] > m ? lanes[i] : m;
    }
#elif defined(SL_AVX2)
    if (n >= 8) {
        __m256 vmax = _mm256_loadu_ps(s);
        for (c = 8; c + 8 <= n; c += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + c));
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    }
#endif
    for (; c < n; c++) m = s[c] > m ? s[c] : m;
    return m;
}

/* s[0 .. n) = exp(s - m) in place; returns their sum. */
static inline float sl_exp_sub_sum_f32(float *s, int64_t n, float m) {
    float sum = 0.0f;
    int64_t c = 0;
#ifdef SL_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
#ifdef SL_AVX512
    const __m512 vm16 = _mm512_set1_ps(m);
    for (; c + 16 <= n; c += 16) { /* two of AVX2's 8-lane adds: its order, its bits */
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + c), vm16));
        _mm512_storeu_ps(s + c, e);
        vsum = _mm256_add_ps(vsum, sl_lo256(e));
        vsum = _mm256_add_ps(vsum, sl_hi256(e));
    }
#endif
    for (; c + 8 <= n; c += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), vm));
        _mm256_storeu_ps(s + c, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vsum);
    sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#endif
    for (; c < n; c++) {
        s[c] = expf(s[c] - m);
        sum += s[c];
    }
    return sum;
}
