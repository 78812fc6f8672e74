/* 16-bit floats: fp16 (IEEE half) and bf16 to and from fp32, scalar, rounding to nearest even
 * like PyTorch's .half() / .bfloat16(), so a finite value stored by C and one stored by torch
 * have the same bits (NaN stays NaN, its payload is not kept). Used for GGUF block scales and for
 * a KV cache kept in 16 bits. */
#pragma once
#include <stdint.h>
#include <string.h>
#include "isa.h" /* F16C comes with SL_AVX2 in our builds */

/* A KV cache's storage format, as native.py's KV_FORMATS passes it, and its bytes an element. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
static inline int64_t sl_kv_size(int64_t kv_format) { return kv_format == KV_F32 ? 4 : 2; }

static inline uint32_t sl_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float sl_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float sl_f16_to_f32(uint16_t h) {
#ifdef SL_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return sl_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp != 0) return sl_bits_f32(sign | ((exp + 112) << 23) | (man << 13));
    if (man == 0) return sl_bits_f32(sign);
    int e = -1; /* subnormal: normalise */
    uint32_t m = man;
    do { e++; m <<= 1; } while (!(m & 0x400));
    return sl_bits_f32(sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13));
#endif
}

/* Keeps `q` if the dropped bits `rem` are under half of the last kept bit (`half`), adds one
 * above it, and on a tie rounds to the even neighbour. */
static inline uint32_t sl_round_even(uint32_t q, uint32_t rem, uint32_t half) {
    return q + (rem > half || (rem == half && (q & 1)));
}

static inline uint16_t sl_f32_to_f16(float f) {
#ifdef SL_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    const uint32_t x = sl_f32_bits(f), sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return (uint16_t)(sign | (ax > 0x7f800000 ? 0x7e00 : 0x7c00)); /* NaN, inf */
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* 65520 and up round to inf */
    const uint32_t e = ax >> 23, man = ax & 0x7fffff;
    if (e >= 113) /* normal in fp16: rebias the exponent, keep 10 of 23 mantissa bits */
        return (uint16_t)(sign | sl_round_even(((e - 112) << 10) | (man >> 13), man & 0x1fff, 0x1000));
    if (e < 102) return (uint16_t)sign; /* under 2^-25: rounds to zero */
    /* subnormal in fp16: units of 2^-24 (a carry into 0x400 is the smallest normal, as it should be) */
    const uint32_t m = man | 0x800000, shift = 126 - e;
    return (uint16_t)(sign | sl_round_even(m >> shift, m & ((1u << shift) - 1), 1u << (shift - 1)));
#endif
}

static inline float sl_bf16_to_f32(uint16_t h) { return sl_bits_f32((uint32_t)h << 16); }

static inline uint16_t sl_f32_to_bf16(float f) {
    const uint32_t x = sl_f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) return 0x7fc0; /* NaN: a quiet one */
    return (uint16_t)(sl_round_even(x >> 16, x & 0xffff, 0x8000));
}
