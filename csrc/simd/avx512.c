/*
 * simd/avx512.c - the SIMD path (the simd/ bodies) for AVX-512 (F, DQ, BW,
 * VL: Skylake-SP and later).  Compiled for that target by the pragmas
 * below, whatever the build's flags; called only when the CPU has it.
 * Micro-tile: 12 rows x 2 vectors (24 accumulators of the 32 registers).
 */
#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target( \
    "avx512f,avx512dq,avx512bw,avx512vl,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,fma")
#endif

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "core/arena.h"
#include "core/dispatch.h"
#include "core/half.h"
#include "ref/formulas.h"

#define MR 12
/* A short micro-panel's tile (simd/gemm.inc): 4 rows, 8 chains of FMAs,
 * latency x pipes on every x86 with AVX-512 (a float32 backward at (8,
 * 1024, 64) spent 3 % of its time on 4-row panels run as 12) */
#define MR_SMALL 4
/* A whole micro-panel against two whole B panels runs as two tiles of 6
 * rows x 4 vectors (simd/gemm.inc's tile_rows_wide): 10 loads a k step
 * for 24 FMAs, where 12 x 2 takes 14 */
#define GEMM_MR_WIDE 6
/* The FMA peak's chains (ops.inc's fma_loop): 24 of the 32 registers, a
 * margin over latency x ports (Skylake-SP to Sapphire Rapids 4 x 2, Zen 4
 * and 5 4 x 2 pipes). */
#define FMA_LIST ATT_FMA_LIST_24

/* ---- 32-bit integer lanes, for dropout's Philox (simd/ops.inc's
 * keep_row): simd/avx2.c's macros, 16 lanes ---- */
#define IVEC __m512i
#define ILANES 16
#define ISET1(x) _mm512_set1_epi32((int)(x))
#define IIOTA() _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, \
                                  13, 14, 15)
#define ILOAD(p) _mm512_loadu_si512((const void *)(p))
#define ISTORE(p, x) _mm512_storeu_si512((void *)(p), x)
#define IADD _mm512_add_epi32
#define IXOR _mm512_xor_si512
#define IAND _mm512_and_si512
#define IMUL_EVEN _mm512_mul_epu32
#define ISRL64(x) _mm512_srli_epi64(x, 32)
#define ISLL64(x) _mm512_slli_epi64(x, 32)
#define IBLEND_ODD(e, o) _mm512_mask_blend_epi32(0xAAAA, e, o)
/* The high (low) words of the 64-bit products e of the even lanes and o
 * of the odd ones, each lane's own: the other word of each 64-bit lane
 * swapped in by vpshufd under a merge mask (one port-5 instruction where
 * a shift and a blend took two, one of them on port 0 with the
 * multiplies); a ^ b ^ c by vpternlogd (0x96) */
#define IHI_OF(e, o) _mm512_mask_shuffle_epi32(o, 0x5555, e, _MM_PERM_CDAB)
#define ILO_OF(e, o) _mm512_mask_shuffle_epi32(e, 0xAAAA, o, _MM_PERM_CDAB)
#define IXOR3(a, b, c) _mm512_ternarylogic_epi32(a, b, c, 0x96)
#define IGE_U32(u, t) _mm512_movm_epi32(_mm512_cmpge_epu32_mask(u, t))
#define IPACK32 _mm512_packs_epi32
#define IPACK16 _mm512_packs_epi16
#define ISHUFFLE8 _mm512_shuffle_epi8

/* the lanes of x whose byte of keep (0 or 1) is not 0, the others 0 */
static inline __m512 keep_ps(__m512 x, const unsigned char *keep)
{
    __m128i k = _mm_loadu_si128((const __m128i *)keep);
    return _mm512_maskz_mov_ps(_mm_test_epi8_mask(k, k), x);
}

static inline __m512d keep_pd(__m512d x, const unsigned char *keep)
{
    __m128i k = _mm_loadl_epi64((const __m128i *)keep);
    return _mm512_maskz_mov_pd((__mmask8)_mm_test_epi8_mask(k, k), x);
}

/* The 16 x 16 transpose of the 32-bit words of r[0..15] in place (rows
 * of bf16 pairs, or of floats): word c of r[i] goes to word i of r[c] */
static inline void transpose16_epi32(__m512i r[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + c], lane L: column 4L + c of rows 4g .. 4g + 3 */
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[c + 8] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        r[c + 4] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[c + 12] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

/* The same on floats: the float section's VTRANSPOSE (vmath.inc) */
static inline void transpose16_ps(__m512 r[16])
{
    __m512i x[16];
    for (int i = 0; i < 16; i++) {
        x[i] = _mm512_castps_si512(r[i]);
    }
    transpose16_epi32(x);
    for (int i = 0; i < 16; i++) {
        r[i] = _mm512_castsi512_ps(x[i]);
    }
}

/* ---- float: 16 lanes ---- */
#define REAL float
#define FSFX(name) name##_f32_avx512
#define RSFX(name) name##_f32
#define VEC __m512
#define VLEN 16
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps(p, x)
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMUL _mm512_mul_ps
/* a / b for 1 <= |b| <= 2 (tanh's denominator): the quotient from rcp14
 * (14 bits), corrected once by its residual (~28 bits, nearly correctly
 * rounded), costs a fraction of vdivps, which holds port 0 for ten cycles
 * per vector. */
static inline __m512 div_ps(__m512 a, __m512 b)
{
    __m512 r = _mm512_rcp14_ps(b), q = _mm512_mul_ps(a, r);
    return _mm512_fmadd_ps(_mm512_fnmadd_ps(b, q, a), r, q);
}
#define VDIV div_ps
#define VFMA _mm512_fmadd_ps
#define VMAX _mm512_max_ps
#define VAND _mm512_and_ps
/* x, or 0 in the lanes where y < t (a NaN y keeps x) */
#define VFLUSH_BELOW(x, y, t) \
    _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(y, t, _CMP_NLT_UQ), x)
#define VREDUCE _mm512_reduce_add_ps
/* Decoding's blocks of 16 dot products (simd/decode.inc): a[4 u + c],
 * each reduced in one tree by the pairs _mm512_reduce_add_ps adds (lanes
 * i and i + 8, then i + 4, i + 2, i + 1: the same bits), 45 operations
 * for the 16 where one at a time takes 128; times alpha, the sums of
 * a[c], a[4 + c], a[8 + c], a[12 + c] stored at dst[c]. */
static inline void reduce4x4_ps(const __m512 *a, float alpha,
                                float *const *dst)
{
    __m512 h[8], q[4], e[2];
    for (int k = 0; k < 8; k++) {       /* 256-bit halves */
        __m512 x = a[2 * k], y = a[2 * k + 1];
        h[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44),
                             _mm512_shuffle_f32x4(x, y, 0xee));
    }
    for (int k = 0; k < 4; k++) {       /* 128-bit quarters */
        __m512 x = h[2 * k], y = h[2 * k + 1];
        q[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88),
                             _mm512_shuffle_f32x4(x, y, 0xdd));
    }
    for (int k = 0; k < 2; k++) {       /* 64-bit pairs */
        __m512d x = _mm512_castps_pd(q[2 * k]);
        __m512d y = _mm512_castps_pd(q[2 * k + 1]);
        e[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88),
                             _mm512_shuffle_ps(e[0], e[1], 0xdd));
    r = _mm512_mul_ps(r, _mm512_set1_ps(alpha));
    /* lane 4 c + j holds a[4 j + c] */
    _mm_storeu_ps(dst[0], _mm512_castps512_ps128(r));
    _mm_storeu_ps(dst[1], _mm512_extractf32x4_ps(r, 1));
    _mm_storeu_ps(dst[2], _mm512_extractf32x4_ps(r, 2));
    _mm_storeu_ps(dst[3], _mm512_extractf32x4_ps(r, 3));
}
#define VREDUCE_BLOCK reduce4x4_ps
/* 32 registers: 4 x 4 accumulators for the keys, 4 x 4 for the values */
#define DECODE_WIDE 4
#define REAL_DIGITS 24
#define VSCALE _mm512_scalef_ps
/* x 2^n, 0 in the lanes where y < t (a NaN y keeps it): the scale itself
 * zeroes them, so their arithmetic needs no care (simd/vmath.inc) */
#define VSCALE_FLUSH(x, n, y, t) \
    _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(y, t, _CMP_NLT_UQ), x, n)
#define VABS _mm512_abs_ps
#define VCOPYSIGN(m, s) _mm512_or_ps(_mm512_abs_ps(m), _mm512_and_ps( \
    s, _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u))))
#define VKEEP keep_ps
#define VANY_GT(a, b) (_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0)
#define VTRANSPOSE transpose16_ps
/* 16 bfloat16 (binary16) at p widened to float: zero-extended, shifted
 * into the upper half (AVX-512F's conversion) */
#define VLOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(                 \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VLOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
/* 16 int8 at p as floats */
#define VLOAD_I8(p) _mm512_cvtepi32_ps(                                      \
    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
/* 16 floats rounded to bfloat16 at p: to nearest even by adding 0x7fff
 * and the kept lowest bit (no AVX512_BF16 needed), NaN to the quiet NaN
 * of its sign (core/half.h); to binary16 by the conversion instruction */
static inline void store_bf16_ps(uint16_t *p, __m512 x)
{
    const __m512i one = _mm512_set1_epi32(1);
    __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(
        u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                            _mm512_and_si512(hi, one))), 16);
    __m512i qnan = _mm512_or_si512(
        _mm512_and_si512(hi, _mm512_set1_epi32(0x8000)),
        _mm512_set1_epi32(0x7fc0));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              qnan);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
#define VSTORE_BF16(p, x) store_bf16_ps(p, x)
#define VSTORE_F16(p, x) _mm256_storeu_si256((__m256i *)(p),                 \
    _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#define FLASH_MR 6
#define FLASH_NV 4
#include "simd/vmath.inc"
#include "simd/tile.inc"
#include "simd/fused.inc"
#include "simd/fused_backward.inc"
/* The bf16 products of float calls that allow them: on AVX512_BF16's
 * dot products (simd/flash.inc's loops with FLASH_DP) and on AMX tiles
 * (simd/flash_amx.inc), under a target that adds the instructions the
 * build has (ATT_HAVE_AMX implies ATT_HAVE_BF16DOT); core/dispatch.c
 * checks the CPU and the OS at run time. */
#if ATT_HAVE_BF16DOT
#if defined(__clang__)
/* clang keeps the outer target of nested attribute pushes: replace it */
#pragma clang attribute pop
#if ATT_HAVE_AMX
#pragma clang attribute push(__attribute__((target( \
    "avx512f,avx512dq,avx512bw,avx512vl,fma,avx512bf16,amx-tile,amx-bf16"))), \
    apply_to = function)
#else
#pragma clang attribute push(__attribute__((target( \
    "avx512f,avx512dq,avx512bw,avx512vl,fma,avx512bf16"))), \
    apply_to = function)
#endif
#else
#pragma GCC push_options
#if ATT_HAVE_AMX
#pragma GCC target( \
    "avx512f,avx512dq,avx512bw,avx512vl,fma,avx512bf16,amx-tile,amx-bf16")
#else
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,fma,avx512bf16")
#endif
#endif
#include "simd/bf16.inc"
#define FLASH_DP 1
#include "simd/flash.inc"
#undef FLASH_DP
#define FLASH_DOT FSFX(flash_forward_dp)
#define FLASH_DOT_WORK FSFX(flash_work_dp)
/* The dot products' rate (core/dispatch.h's dot_loop), as fma_loop's:
 * the chains of FMA_LIST, a += x x + x x each (x in bf16), iters steps
 * in registers: 4 VLEN chains iters flops */
static double FSFX(dot_loop)(ptrdiff_t iters)
{
    const __m512 xf = _mm512_set1_ps((float)(1.0 / ((double)iters + 2.0)));
    const __m512bh x = _mm512_cvtne2ps_pbh(xf, xf);
#define DOT_INIT(i) __m512 a##i = _mm512_set1_ps(1 + (i) / 32.0f);
#define DOT_STEP(i) a##i = _mm512_dpbf16_ps(a##i, x, x);
#define DOT_SUM(i) s = _mm512_add_ps(s, a##i);
    FMA_LIST(DOT_INIT)
    for (ptrdiff_t it = 0; it < iters; it++) {
        FMA_LIST(DOT_STEP)
    }
    __m512 s = _mm512_setzero_ps();
    FMA_LIST(DOT_SUM)
#undef DOT_INIT
#undef DOT_STEP
#undef DOT_SUM
    return (double)_mm512_reduce_add_ps(s);
}
#define FLASH_DOT_LOOP FSFX(dot_loop)
#include "simd/gemm_dp.inc"
#if ATT_HAVE_AMX
#include "simd/flash_amx.inc"
#include "simd/gemm_amx.inc"
#endif
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target( \
    "avx512f,avx512dq,avx512bw,avx512vl,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#endif
#endif
#include "simd/ops.inc"
#include "simd/undef.inc"

/* ---- double: 8 lanes ---- */
#define REAL double
#define FSFX(name) name##_f64_avx512
#define RSFX(name) name##_f64
#define VEC __m512d
#define VLEN 8
#define VZERO() _mm512_setzero_pd()
#define VSET1(x) _mm512_set1_pd(x)
#define VLOAD(p) _mm512_loadu_pd(p)
#define VSTORE(p, x) _mm512_storeu_pd(p, x)
#define VADD _mm512_add_pd
#define VSUB _mm512_sub_pd
#define VMUL _mm512_mul_pd
/* a / b for 1 <= |b| <= 2: rcp14 and two Newton steps (~56 bits) */
static inline __m512d div_pd(__m512d a, __m512d b)
{
    __m512d two = _mm512_set1_pd(2.0), r = _mm512_rcp14_pd(b);
    r = _mm512_mul_pd(r, _mm512_fnmadd_pd(b, r, two));
    r = _mm512_mul_pd(r, _mm512_fnmadd_pd(b, r, two));
    return _mm512_mul_pd(a, r);
}
#define VDIV div_pd
#define VFMA _mm512_fmadd_pd
#define VMAX _mm512_max_pd
#define VAND _mm512_and_pd
#define VFLUSH_BELOW(x, y, t) \
    _mm512_maskz_mov_pd(_mm512_cmp_pd_mask(y, t, _CMP_NLT_UQ), x)
#define VREDUCE _mm512_reduce_add_pd
#define REAL_DIGITS 53
#define VSCALE _mm512_scalef_pd
#define VSCALE_FLUSH(x, n, y, t) \
    _mm512_maskz_scalef_pd(_mm512_cmp_pd_mask(y, t, _CMP_NLT_UQ), x, n)
#define VABS _mm512_abs_pd
#define VCOPYSIGN(m, s) _mm512_or_pd(_mm512_abs_pd(m), _mm512_and_pd( \
    s, _mm512_castsi512_pd(                                            \
           _mm512_set1_epi64((long long)0x8000000000000000ull))))
#define VKEEP keep_pd
#define VANY_GT(a, b) (_mm512_cmp_pd_mask(a, b, _CMP_GT_OQ) != 0)
#define FLASH_MR 6
#define FLASH_NV 4
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
