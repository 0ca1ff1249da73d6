/*
 * core/half.h - internal: 16-bit floats (bfloat16, IEEE binary16) widened
 * to float and float rounded to them, one element at a time.  Widening is
 * exact; rounding is to nearest even.  The SIMD paths convert whole
 * vectors the same way (their VLOAD_BF16, VLOAD_F16, VSTORE_BF16,
 * VSTORE_F16) and use these for the elements past the last vector.
 */
#ifndef ATTENTION_C_CORE_HALF_H
#define ATTENTION_C_CORE_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"

/* bfloat16 is float's upper half: shift it back. */
static inline float att_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* binary16: 1 sign, 5 exponent (bias 15), 10 fraction bits.  Normal
 * numbers rebias the exponent; subnormals (exponent 0) are m 2^-24,
 * exact in float; exponent 31 is inf or NaN (the payload kept). */
static inline float att_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0) {
        float x = (float)m * 0x1p-24f;
        memcpy(&u, &x, sizeof u);
        u |= sign;
    }
    else if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);
    }
    else {
        u = sign | ((e + 112u) << 23) | (m << 13);
    }
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* x rounded to bfloat16, to nearest even (a finite x past bf16's range
 * gives inf, as IEEE rounding does); a NaN gives the quiet NaN of its
 * sign, 0x7fc0 or 0xffc0, as ml_dtypes does. */
static inline uint16_t att_f32_to_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((u >> 16) & 0x8000u) | 0x7fc0u;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bfloat16's largest finite value, and x rounded to bfloat16 after
 * clamping to it, as the bf16 products round their operands (a NaN stays
 * a NaN) */
#define ATT_BF16_MAX 3.38953139e38f

static inline uint16_t att_f32_to_bf16_clamped(float x)
{
    return att_f32_to_bf16(x > ATT_BF16_MAX ? ATT_BF16_MAX
                           : (x < -ATT_BF16_MAX ? -ATT_BF16_MAX : x));
}

/* x rounded to binary16, to nearest even: subnormal results kept, a
 * finite x past 65520 gives inf; a NaN keeps its sign and the top of its
 * payload with the quiet bit set (the conversion instructions' result;
 * NumPy's too for a quiet NaN). */
static inline uint16_t att_f32_to_f16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {                       /* NaN */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    }
    if (a >= 0x477ff000u) {                      /* 65520 and up: inf */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (a < 0x38800000u) {                       /* below 2^-14 */
        /* m 2^-24 for m = round(|x| 2^24), exact in float arithmetic
         * (the product is exact; rint rounds to nearest even) */
        float f;
        memcpy(&f, &a, sizeof f);
        return (uint16_t)(sign | (uint16_t)nearbyintf(f * 0x1p24f));
    }
    /* normal: rebias, then round the 13 dropped bits to nearest even */
    a += 0xfffu + ((a >> 13) & 1u) - (112u << 23);
    return (uint16_t)(sign | (a >> 13));
}

/* Element i of a 16-bit array of kind store (ATT_STORE_BF16, _F16). */
static inline float att_half_at(int store, const void *p, ptrdiff_t i)
{
    uint16_t h = ((const uint16_t *)p)[i];
    return store == ATT_STORE_BF16 ? att_bf16_to_f32(h) : att_f16_to_f32(h);
}

#endif /* ATTENTION_C_CORE_HALF_H */
