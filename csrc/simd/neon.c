/*
 * simd/neon.c - the SIMD path (the simd/ bodies) for AArch64 Advanced SIMD
 * (Apple Silicon, Graviton, any ARMv8-A 64-bit CPU: NEON is part of the
 * architecture, so no target pragma and no run-time check are needed).
 * Compiles to nothing on other targets.
 *
 * Micro-tile: 8 rows x 2 vectors (8 x 8 float32, 8 x 4 float64): 16
 * accumulators of the 32 registers, plus the 2 vectors of B and the 8
 * broadcasts of A, so the tile never spills whether the compiler keeps
 * the broadcasts (dup) or multiplies by lane (fmla v.s[i]).  12 rows would
 * need 24 + 2 + 12 registers in the first case.  MR = 8 also divides the
 * family's row blocks (GMC = 96, par_gemm's 48).
 */
#if defined(__aarch64__)

#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "core/arena.h"
#include "core/dispatch.h"
#include "core/half.h"
#include "ref/formulas.h"

#define MR 8
/* The FMA peak's chains (ops.inc's fma_loop): 24 of the 32 registers
 * cover latency x pipes up to 4 x 4 (Neoverse V1/V2, Apple M). */
#define FMA_LIST ATT_FMA_LIST_24

/* The macro layer follows the x86 semantics the simd/ bodies rely on:
 * VFMA(a, b, c) = a b + c fused; VMAX(a, b) = a > b ? a : b, so it
 * returns b when either is NaN (maxps; NEON's fmax would return the NaN
 * and fmaxnm the number, and v_tanh relies on b = NaN surviving). */

/* x 2^n for integral n in [-126, 127]; a NaN n converts to 0, so x (NaN
 * whenever n is) carries the NaN. */
static inline float32x4_t scale_f32(float32x4_t x, float32x4_t n)
{
    int32x4_t e = vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127));
    return vmulq_f32(x, vreinterpretq_f32_s32(vshlq_n_s32(e, 23)));
}

/* x 2^n for integral n in [-1022, 1023] (AArch64 converts to 64-bit
 * integers directly). */
static inline float64x2_t scale_f64(float64x2_t x, float64x2_t n)
{
    int64x2_t e = vaddq_s64(vcvtnq_s64_f64(n), vdupq_n_s64(1023));
    return vmulq_f64(x, vreinterpretq_f64_s64(vshlq_n_s64(e, 52)));
}

static inline float32x4_t max_f32(float32x4_t a, float32x4_t b)
{
    return vbslq_f32(vcgtq_f32(a, b), a, b);
}

static inline float64x2_t max_f64(float64x2_t a, float64x2_t b)
{
    return vbslq_f64(vcgtq_f64(a, b), a, b);
}

static inline float32x4_t and_f32(float32x4_t a, float32x4_t b)
{
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a),
                                           vreinterpretq_u32_f32(b)));
}

static inline float64x2_t and_f64(float64x2_t a, float64x2_t b)
{
    return vreinterpretq_f64_u64(vandq_u64(vreinterpretq_u64_f64(a),
                                           vreinterpretq_u64_f64(b)));
}

/* |m| with the sign of s: the sign bit from s, the rest from m */
static inline float32x4_t copysign_f32(float32x4_t m, float32x4_t s)
{
    return vbslq_f32(vdupq_n_u32(0x80000000u), s, m);
}

static inline float64x2_t copysign_f64(float64x2_t m, float64x2_t s)
{
    return vbslq_f64(vdupq_n_u64(0x8000000000000000ull), s, m);
}

/* ---- 32-bit integer lanes, for dropout's Philox (simd/ops.inc's
 * keep_row): simd/avx2.c's macros, 4 lanes, with the x86 semantics ---- */
static const uint32_t iota_u32[4] = {0, 1, 2, 3};
#define IVEC uint32x4_t
#define ILANES 4
#define ISET1(x) vdupq_n_u32((uint32_t)(x))
#define IIOTA() vld1q_u32(iota_u32)
#define ILOAD(p) vreinterpretq_u32_u8(vld1q_u8((const uint8_t *)(p)))
#define ISTORE(p, x) vst1q_u8((uint8_t *)(p), vreinterpretq_u8_u32(x))
#define IADD vaddq_u32
#define IXOR veorq_u32
#define IAND vandq_u32
#define U64(x) vreinterpretq_u64_u32(x)
#define U32(x) vreinterpretq_u32_u64(x)
/* mul_epu32: the 64-bit products of the even lanes */
#define IMUL_EVEN(a, m) U32(vmull_u32(vmovn_u64(U64(a)), vmovn_u64(U64(m))))
#define ISRL64(x) U32(vshrq_n_u64(U64(x), 32))
#define ISLL64(x) U32(vshlq_n_u64(U64(x), 32))
#define IBLEND_ODD(e, o) \
    vbslq_u32(U32(vdupq_n_u64(0xFFFFFFFF00000000ull)), o, e)
#define IGE_U32 vcgeq_u32
/* packssdw, packsswb (saturating narrows of a then b), pshufb (indices
 * below 16) */
#define IPACK32(a, b) vreinterpretq_u32_s16(vcombine_s16(                   \
    vqmovn_s32(vreinterpretq_s32_u32(a)),                                   \
    vqmovn_s32(vreinterpretq_s32_u32(b))))
#define IPACK16(a, b) vreinterpretq_u32_s8(vcombine_s8(                     \
    vqmovn_s16(vreinterpretq_s16_u32(a)),                                   \
    vqmovn_s16(vreinterpretq_s16_u32(b))))
#define ISHUFFLE8(b, idx) vreinterpretq_u32_u8(vqtbl1q_u8(                  \
    vreinterpretq_u8_u32(b), vreinterpretq_u8_u32(idx)))

/* the lanes of x whose byte of keep (0 or 1) is not 0, the others 0 */
static inline float32x4_t keep_f32(float32x4_t x, const unsigned char *keep)
{
    uint32_t four;
    memcpy(&four, keep, sizeof four);
    uint16x8_t k16 = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four)));
    uint32x4_t k = vmovl_u16(vget_low_u16(k16));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x),
                                           vtstq_u32(k, k)));
}

static inline float64x2_t keep_f64(float64x2_t x, const unsigned char *keep)
{
    uint16_t two;
    memcpy(&two, keep, sizeof two);
    uint16x8_t k16 = vmovl_u8(vreinterpret_u8_u16(vdup_n_u16(two)));
    uint64x2_t k = vmovl_u32(vget_low_u32(vmovl_u16(vget_low_u16(k16))));
    return vreinterpretq_f64_u64(vandq_u64(vreinterpretq_u64_f64(x),
                                           vtstq_u64(k, k)));
}

/* ---- float: 4 lanes ---- */
#define REAL float
#define FSFX(name) name##_f32_neon
#define RSFX(name) name##_f32
#define VEC float32x4_t
#define VLEN 4
#define VZERO() vdupq_n_f32(0.0f)
#define VSET1(x) vdupq_n_f32(x)
#define VLOAD(p) vld1q_f32(p)
#define VSTORE(p, x) vst1q_f32(p, x)
#define VADD vaddq_f32
#define VSUB vsubq_f32
#define VMUL vmulq_f32
#define VDIV vdivq_f32
#define VFMA(a, b, c) vfmaq_f32(c, a, b)
#define VMAX max_f32
#define VAND and_f32
/* x, or 0 in the lanes where y < t (a NaN y keeps x: y < t is false) */
#define VFLUSH_BELOW(x, y, t) vreinterpretq_f32_u32(vbicq_u32( \
    vreinterpretq_u32_f32(x), vcltq_f32(y, t)))
#define VREDUCE vaddvq_f32
#define REAL_DIGITS 24
#define VSCALE scale_f32
#define VABS vabsq_f32
#define VCOPYSIGN copysign_f32
#define VKEEP keep_f32
#define VANY_GT(a, b) (vmaxvq_u32(vcgtq_f32(a, b)) != 0)
/* VTRANSPOSE: the 4 x 4 transpose of r[0..3] in place (vmath.inc) */
static inline void transpose4_f32(float32x4_t r[4])
{
    float32x4x2_t a = vtrnq_f32(r[0], r[1]), b = vtrnq_f32(r[2], r[3]);
    r[0] = vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(b.val[0]));
    r[1] = vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(b.val[1]));
    r[2] = vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(b.val[0]));
    r[3] = vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(b.val[1]));
}
#define VTRANSPOSE transpose4_f32
#define FLASH_MR 6
/* 4 bfloat16 (binary16) at p widened to float: shifted into the upper
 * half (the base conversion of AArch64) */
#define VLOAD_BF16(p) \
    vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)(p)), 16))
#define VLOAD_F16(p) \
    vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(p))))
/* 4 int8 at p as floats (4 bytes read, never past them) */
static inline float32x4_t load_i8_f32(const int8_t *p)
{
    int32_t w;
    memcpy(&w, p, sizeof w);
    int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}
#define VLOAD_I8(p) load_i8_f32(p)
/* 4 floats rounded to bfloat16: to nearest even by adding 0x7fff and the
 * kept lowest bit, NaN to the quiet NaN of its sign (core/half.h) */
static inline uint16x4_t round_bf16_f32(float32x4_t x)
{
    uint32x4_t u = vreinterpretq_u32_f32(x), hi = vshrq_n_u32(u, 16);
    uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(
        vdupq_n_u32(0x7fff), vandq_u32(hi, vdupq_n_u32(1)))), 16);
    uint32x4_t qnan = vorrq_u32(vandq_u32(hi, vdupq_n_u32(0x8000)),
                                vdupq_n_u32(0x7fc0));
    return vmovn_u32(vbslq_u32(vceqq_f32(x, x), r, qnan));
}
/* 4 floats rounded to bfloat16 at p; to binary16 by the conversion
 * instruction (FPCR: nearest) */
static inline void store_bf16_f32(uint16_t *p, float32x4_t x)
{
    vst1_u16(p, round_bf16_f32(x));
}
#define VSTORE_BF16(p, x) store_bf16_f32(p, x)
#define VSTORE_F16(p, x) \
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x)))
#define FLASH_NV 4
#include "simd/vmath.inc"
#include "simd/tile.inc"
#include "simd/fused.inc"
#include "simd/fused_backward.inc"
#if ATT_HAVE_NEON_BF16
/* The bf16 products of float calls that allow them, on the BF16
 * extension's BFDOT (simd/flash.inc's loops with FLASH_DP, the backward's
 * simd/gemm_dp.inc), under a target that adds it; core/dispatch.c checks
 * the CPU at run time. */
/* GCC 12's arm_neon.h declares the bf16 intrinsics for armv8.2-a+bf16, so
 * "+bf16" alone on armv8-a would not inline them; a build that targets
 * the extension already keeps its own, higher, target. */
#if !defined(__clang__) && !ATT_NEON_BF16_BUILD
#define NEON_BF16_PRAGMA 1
#else
#define NEON_BF16_PRAGMA 0
#endif
#if NEON_BF16_PRAGMA
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+bf16")
#endif
#include "simd/bf16_neon.inc"

/* 4 keys a tile, not FLASH_MR's 6: 16 accumulators, 4 vectors of Q and
 * 4 broadcast pairs fit the 32 registers (GCC 12 spilled three of the
 * 6 x 4 tile's accumulators at every pair of d) */
#define FLASH_DP_MR 4
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
    const bfloat16x8_t x = vreinterpretq_bf16_u16(vdupq_n_u16(
        att_f32_to_bf16((float)(1.0 / ((double)iters + 2.0)))));
#define DOT_INIT(i) float32x4_t a##i = vdupq_n_f32(1 + (i) / 32.0f);
#define DOT_STEP(i) a##i = vbfdotq_f32(a##i, x, x);
#define DOT_SUM(i) s = vaddq_f32(s, a##i);
    FMA_LIST(DOT_INIT)
    for (ptrdiff_t it = 0; it < iters; it++) {
        FMA_LIST(DOT_STEP)
    }
    float32x4_t s = vdupq_n_f32(0);
    FMA_LIST(DOT_SUM)
#undef DOT_INIT
#undef DOT_STEP
#undef DOT_SUM
    return (double)vaddvq_f32(s);
}
#define FLASH_DOT_LOOP FSFX(dot_loop)
#include "simd/gemm_dp.inc"
#if NEON_BF16_PRAGMA
#pragma GCC pop_options
#endif
#undef NEON_BF16_PRAGMA
#endif
#include "simd/ops.inc"
#include "simd/undef.inc"

/* ---- double: 2 lanes ---- */
#define REAL double
#define FSFX(name) name##_f64_neon
#define RSFX(name) name##_f64
#define VEC float64x2_t
#define VLEN 2
#define VZERO() vdupq_n_f64(0.0)
#define VSET1(x) vdupq_n_f64(x)
#define VLOAD(p) vld1q_f64(p)
#define VSTORE(p, x) vst1q_f64(p, x)
#define VADD vaddq_f64
#define VSUB vsubq_f64
#define VMUL vmulq_f64
#define VDIV vdivq_f64
#define VFMA(a, b, c) vfmaq_f64(c, a, b)
#define VMAX max_f64
#define VAND and_f64
#define VFLUSH_BELOW(x, y, t) vreinterpretq_f64_u64(vbicq_u64( \
    vreinterpretq_u64_f64(x), vcltq_f64(y, t)))
#define VREDUCE vaddvq_f64
#define REAL_DIGITS 53
#define VSCALE scale_f64
#define VABS vabsq_f64
#define VCOPYSIGN copysign_f64
#define VKEEP keep_f64
#define VANY_GT(a, b) \
    (vmaxvq_u32(vreinterpretq_u32_u64(vcgtq_f64(a, b))) != 0)
#define FLASH_MR 6
#define FLASH_NV 4
#include "simd/vmath.inc"
#include "simd/tile.inc"
#include "simd/fused.inc"
#include "simd/fused_backward.inc"
#include "simd/ops.inc"
#include "simd/undef.inc"

#endif /* __aarch64__ */
