/*
 * core/half.h - internal: 16-bit floats (bfloat16, IEEE binary16) widened
 * to float, one element at a time.  Both widen exactly; the SIMD paths
 * widen whole vectors the same way (their VLOAD_BF16, VLOAD_F16) and use
 * these for the columns past the last whole vector.
 */
#ifndef ATTENTION_C_CORE_HALF_H
#define ATTENTION_C_CORE_HALF_H

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

/* Element i of a 16-bit array of kind store (ATT_STORE_BF16, _F16). */
static inline float att_half_at(int store, const void *p, ptrdiff_t i)
{
    uint16_t h = ((const uint16_t *)p)[i];
    return store == ATT_STORE_BF16 ? att_bf16_to_f32(h) : att_f16_to_f32(h);
}

#endif /* ATTENTION_C_CORE_HALF_H */
