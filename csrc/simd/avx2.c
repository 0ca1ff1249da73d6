/*
 * simd/avx2.c - the SIMD path (the simd/ bodies) for AVX2 with FMA (Haswell
 * and later).  Compiled for that target by the pragmas below; called only
 * when the CPU has it.  Micro-tile: 6 rows x 2 vectors (12 accumulators
 * of the 16 registers).
 */
#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "core/arena.h"
#include "core/dispatch.h"
#include "ref/formulas.h"

#define MR 6
/* The FMA peak's chains (ops.inc's fma_loop): 12 of the 16 registers
 * cover latency x ports on every AVX2 CPU (Haswell 5 x 2, Skylake and
 * Zen 2-4 4 x 2), the two constants take two more. */
#define FMA_LIST ATT_FMA_LIST_12

static inline float hsum_ps(__m256 x)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x),
                          _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline double hsum_pd(__m256d x)
{
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x),
                           _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* x 2^n for integral n in [-126, 127] (NaN n: a NaN x makes it NaN). */
static inline __m256 scale_ps(__m256 x, __m256 n)
{
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n),
                                 _mm256_set1_epi32(127));
    return _mm256_mul_ps(x, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

/* x 2^n for integral n in [-1022, 1023]: adding 1.5 2^52 puts n in the
 * low bits of the mantissa, a 64-bit integer conversion AVX2 lacks. */
static inline __m256d scale_pd(__m256d x, __m256d n)
{
    const __m256d magic = _mm256_set1_pd(6755399441055744.0);
    __m256i i = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(n, magic)),
                                 _mm256_castpd_si256(magic));
    __m256i e = _mm256_add_epi64(i, _mm256_set1_epi64x(1023));
    return _mm256_mul_pd(x, _mm256_castsi256_pd(_mm256_slli_epi64(e, 52)));
}

/* ---- 32-bit integer lanes, for dropout's Philox (simd/ops.inc's
 * keep_row; the same macros as simd/avx512.c's, so both run one body) ---- */
#define IVEC __m256i
#define ILANES 8
#define ISET1(x) _mm256_set1_epi32((int)(x))
#define IIOTA() _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
#define ILOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define ISTORE(p, x) _mm256_storeu_si256((__m256i *)(p), x)
#define IADD _mm256_add_epi32
#define IXOR _mm256_xor_si256
#define IAND _mm256_and_si256
/* the 64-bit products of the even 32-bit lanes (the low words of a, m) */
#define IMUL_EVEN _mm256_mul_epu32
#define ISRL64(x) _mm256_srli_epi64(x, 32)
#define ISLL64(x) _mm256_slli_epi64(x, 32)
/* the even 32-bit lanes of e, the odd ones of o */
#define IBLEND_ODD(e, o) _mm256_blend_epi32(e, o, 0xAA)
/* all ones in the lanes where u >= t, unsigned; else 0 */
#define IGE_U32(u, t) _mm256_cmpeq_epi32(_mm256_max_epu32(u, t), u)
/* per 128-bit lane, as SSE's packssdw, packsswb, pshufb */
#define IPACK32 _mm256_packs_epi32
#define IPACK16 _mm256_packs_epi16
#define ISHUFFLE8 _mm256_shuffle_epi8

/* the lanes of x whose byte of keep (0 or 1) is not 0, the others 0 */
static inline __m256 keep_ps(__m256 x, const unsigned char *keep)
{
    __m128i b = _mm_loadl_epi64((const __m128i *)keep);
    __m256i k = _mm256_cvtepu8_epi32(b), z = _mm256_setzero_si256();
    return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, z)));
}

static inline __m256d keep_pd(__m256d x, const unsigned char *keep)
{
    int32_t four;
    memcpy(&four, keep, sizeof four);
    __m256i k = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(four));
    __m256i z = _mm256_setzero_si256();
    return _mm256_and_pd(x, _mm256_castsi256_pd(_mm256_cmpgt_epi64(k, z)));
}

/* ---- float: 8 lanes ---- */
#define REAL float
#define FSFX(name) name##_f32_avx2
#define RSFX(name) name##_f32
#define VEC __m256
#define VLEN 8
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps(p, x)
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VMUL _mm256_mul_ps
#define VDIV _mm256_div_ps
#define VFMA _mm256_fmadd_ps
#define VMAX _mm256_max_ps
#define VAND _mm256_and_ps
/* x, or 0 in the lanes where y < t (a NaN y keeps x) */
#define VFLUSH_BELOW(x, y, t) \
    _mm256_and_ps(x, _mm256_cmp_ps(y, t, _CMP_NLT_UQ))
#define VREDUCE hsum_ps
/* Decoding's blocks of 8 dot products (simd/decode.inc): a[4 u + c],
 * each reduced in one tree by the pairs hsum_ps adds (lanes i and i + 4,
 * then i + 2, i + 1: the same bits), 21 operations for the 8 where one
 * at a time takes 48; times alpha, the sums of a[c] and a[4 + c] stored
 * at dst[c]. */
static inline void reduce4x2_ps(const __m256 *a, float alpha,
                                float *const *dst)
{
    /* b[4 (c % 2) + 2 u + c / 2]: chunks 0 and 1 end in the low half */
    __m256 b[8], h[4], e[2];
    for (int u = 0; u < 2; u++) {
        for (int c = 0; c < 4; c++) {
            b[4 * (c % 2) + 2 * u + c / 2] = a[4 * u + c];
        }
    }
    for (int k = 0; k < 4; k++) {       /* 128-bit halves */
        __m256 x = b[2 * k], y = b[2 * k + 1];
        h[k] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20),
                             _mm256_permute2f128_ps(x, y, 0x31));
    }
    for (int k = 0; k < 2; k++) {       /* 64-bit pairs */
        __m256d x = _mm256_castps_pd(h[2 * k]);
        __m256d y = _mm256_castps_pd(h[2 * k + 1]);
        e[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(e[0], e[1], 0x88),
                             _mm256_shuffle_ps(e[0], e[1], 0xdd));
    r = _mm256_mul_ps(r, _mm256_set1_ps(alpha));
    /* lane j holds b[2 j], lane 4 + j b[2 j + 1] */
    __m128 lo = _mm256_castps256_ps128(r), hi = _mm256_extractf128_ps(r, 1);
    _mm_storel_pi((__m64 *)(void *)dst[0], lo);
    _mm_storeh_pi((__m64 *)(void *)dst[1], lo);
    _mm_storel_pi((__m64 *)(void *)dst[2], hi);
    _mm_storeh_pi((__m64 *)(void *)dst[3], hi);
}
#define VREDUCE_BLOCK reduce4x2_ps
#define REAL_DIGITS 24
#define VSCALE scale_ps
#define VABS(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define VCOPYSIGN(m, s) _mm256_or_ps(VABS(m), \
    _mm256_and_ps(_mm256_set1_ps(-0.0f), s))
#define VKEEP keep_ps
#define VANY_GT(a, b) \
    (_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0)
/* VTRANSPOSE: the 8 x 8 transpose of r[0..7] in place (vmath.inc):
 * pairs of rows zipped, then quads, then the 128-bit halves swapped */
static inline void transpose8_ps(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    /* u[4g + c], half h: column 4h + c of rows 4g .. 4g + 3 */
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}
#define VTRANSPOSE transpose8_ps
/* 8 bfloat16 (binary16) at p widened to float: zero-extended, shifted
 * into the upper half (F16C's conversion) */
#define VLOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(                 \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VLOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
/* 8 int8 at p as floats */
#define VLOAD_I8(p) _mm256_cvtepi32_ps(                                      \
    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
/* 8 floats rounded to bfloat16 at p: to nearest even by adding 0x7fff
 * and the kept lowest bit, NaN to the quiet NaN of its sign (core/
 * half.h), packed in lane order; to binary16 by F16C's conversion */
static inline void store_bf16_ps(uint16_t *p, __m256 x)
{
    const __m256i one = _mm256_set1_epi32(1);
    __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(
        u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                            _mm256_and_si256(hi, one))), 16);
    __m256i qnan = _mm256_or_si256(
        _mm256_and_si256(hi, _mm256_set1_epi32(0x8000)),
        _mm256_set1_epi32(0x7fc0));
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(
                               _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(pk));
}
#define VSTORE_BF16(p, x) store_bf16_ps(p, x)
#define VSTORE_F16(p, x) _mm_storeu_si128((__m128i *)(p),                   \
    _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
/* The fused forward's tile: 6 keys x 2 vectors (16 queries), not
 * double's 4 x 3: on Zen 3 the float32 forward took 0.97x the time
 * causal at (8, 1024, 64) and (32, 256, 64), 0.985x full at (32, 256),
 * 0.99-1.00x at (8, 1024) and (2, 4096) (narrower panels waste fewer
 * lanes along a causal diagonal and at T = 256); double's 6 x 2 took
 * 1.00-1.01x. */
#define FLASH_MR 6
#define FLASH_NV 2
/* 96 keys a block, not 48: the forward took 0.97-0.98x the time at (8,
 * 1024, 64) and 0.97-0.99x at (2, 4096, 64) on Zen 3, float32 (0.99x
 * float64; both with the 4 x 3 tile), fewer O^T sums per key
 * outweighing K's and V's blocks leaving L1 (32 KB) for L2 */
#define FLASH_KB_FLOAT 96
#include "simd/vmath.inc"
#include "simd/tile.inc"
#include "simd/fused.inc"
#include "simd/fused_backward.inc"
#include "simd/ops.inc"
#include "simd/undef.inc"

/* ---- double: 4 lanes ---- */
#define REAL double
#define FSFX(name) name##_f64_avx2
#define RSFX(name) name##_f64
#define VEC __m256d
#define VLEN 4
#define VZERO() _mm256_setzero_pd()
#define VSET1(x) _mm256_set1_pd(x)
#define VLOAD(p) _mm256_loadu_pd(p)
#define VSTORE(p, x) _mm256_storeu_pd(p, x)
#define VADD _mm256_add_pd
#define VSUB _mm256_sub_pd
#define VMUL _mm256_mul_pd
#define VDIV _mm256_div_pd
#define VFMA _mm256_fmadd_pd
#define VMAX _mm256_max_pd
#define VAND _mm256_and_pd
#define VFLUSH_BELOW(x, y, t) \
    _mm256_and_pd(x, _mm256_cmp_pd(y, t, _CMP_NLT_UQ))
#define VREDUCE hsum_pd
#define REAL_DIGITS 53
#define VSCALE scale_pd
/* t's bits moved into the exponent's place (vmath.inc's v_exp2_half) */
#define VEXP2_BITS(t) \
    _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(t), 52))
#define VABS(x) _mm256_andnot_pd(_mm256_set1_pd(-0.0), x)
#define VCOPYSIGN(m, s) _mm256_or_pd(VABS(m), \
    _mm256_and_pd(_mm256_set1_pd(-0.0), s))
#define VKEEP keep_pd
#define VANY_GT(a, b) \
    (_mm256_movemask_pd(_mm256_cmp_pd(a, b, _CMP_GT_OQ)) != 0)
#define FLASH_MR 4
#define FLASH_NV 3
#define FLASH_KB_FLOAT 96
#include "simd/vmath.inc"
#include "simd/tile.inc"
#include "simd/fused.inc"
#include "simd/fused_backward.inc"
#include "simd/ops.inc"
#include "simd/undef.inc"

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif /* x86-64 */
