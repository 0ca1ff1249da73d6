/*
 * kernels.c - instantiates kernels_impl.h for float and double, and picks
 * the instruction set of the fused kernels.  Plain C11 with libm; no
 * Python here.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "testhooks.h"
#include "fast.h"
#include "philox.h"
#include "pool.h"

#ifndef ATT_HAVE_X86
#define ATT_HAVE_X86 0
#endif
#ifndef ATT_HAVE_NEON
#define ATT_HAVE_NEON 0
#endif
/* Some fast path (fast.h) is compiled in: x86-64's two, or AArch64's. */
#if ATT_HAVE_X86 || ATT_HAVE_NEON
#define ATT_HAVE_FAST 1
#else
#define ATT_HAVE_FAST 0
#endif

int att_simd_best(void)
{
#if ATT_HAVE_NEON
    /* Advanced SIMD is part of AArch64: every such CPU and OS runs it */
    return ATT_SIMD_NEON;
#else
#if ATT_HAVE_X86 && (defined(__GNUC__) || defined(__clang__))
    /* libgcc's check includes the OS saving the wide registers (XGETBV) */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
        return ATT_SIMD_AVX512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        return ATT_SIMD_AVX2;
    }
#endif
    return ATT_SIMD_SCALAR;
#endif
}

int att_simd_supported(int simd)
{
    switch (simd) {
    case ATT_SIMD_SCALAR:
        return 1;
    case ATT_SIMD_AVX2:     /* the best x86 path implies the narrower one */
    case ATT_SIMD_AVX512:
        return ATT_HAVE_X86 && att_simd_best() >= simd;
    case ATT_SIMD_NEON:     /* every AArch64 CPU runs it */
        return ATT_HAVE_NEON;
    default:
        return 0;
    }
}

/* Every kernel checks its sizes first: nonnegative, at least one item. */
static int dims_ok(att_dims d)
{
    return d.B >= 0 && d.T >= 1 && d.H >= 0 && d.A >= 0;
}

static int exec_ok(const att_exec *ex)
{
    return ex != NULL && att_simd_supported(ex->simd) && ex->threads >= 1;
}

/* Threads a fused kernel uses: a thread costs a wake-up (~5-10 us), so
 * each must get at least 2^22 multiply-adds (~25 us); the scalar path
 * runs on one. */
static int exec_threads(const att_exec *ex, att_dims d)
{
    if (ex->simd == ATT_SIMD_SCALAR || ex->pool == NULL) {
        return 1;
    }
    double work = (double)d.B * (double)d.T * (double)(d.H + 1) *
                  (double)(d.A + 1);
    double by_work = work / (double)(1 << 22);
    int threads = ex->threads < att_pool_threads(ex->pool)
                  ? ex->threads : att_pool_threads(ex->pool);
    return by_work < 1 ? 1 : (by_work < threads ? (int)by_work : threads);
}

/* Elements of the scalar path's scratch: WT (2H, A), n_h vectors of H,
 * n_a of A and n_t of T; -1 when a count would overflow. */
static ptrdiff_t workspace_elems(att_dims d, ptrdiff_t n_h, ptrdiff_t n_a,
                                 ptrdiff_t n_t)
{
    if (!dims_ok(d) || d.H > PTRDIFF_MAX / 4 || d.A > PTRDIFF_MAX / 4 ||
        d.T > PTRDIFF_MAX / 4) {
        return -1;
    }
    if (d.A != 0 && 2 * d.H > (PTRDIFF_MAX / 2) / d.A) {
        return -1;
    }
    ptrdiff_t wt = 2 * d.H * d.A, rest = n_h * d.H + n_a * d.A + n_t * d.T;
    return rest > PTRDIFF_MAX - wt ? -1 : wt + rest;
}

/* A fast path's byte count (0 = overflow) as a workspace result. */
static ptrdiff_t fast_bytes(size_t bytes)
{
    return bytes == 0 || bytes > (size_t)PTRDIFF_MAX ? -1
                                                     : (ptrdiff_t)bytes;
}

/* a * b, a + b, or -1 when an operand is negative or the result would
 * not fit: byte counts of the family's scratch. */
static ptrdiff_t mul_or_neg(ptrdiff_t a, ptrdiff_t b)
{
    if (a < 0 || b < 0 || (a != 0 && b > PTRDIFF_MAX / a)) {
        return -1;
    }
    return a * b;
}

static ptrdiff_t add_or_neg(ptrdiff_t a, ptrdiff_t b)
{
    return a < 0 || b < 0 || b > PTRDIFF_MAX - a ? -1 : a + b;
}

/* Scratch carved from one buffer in 64-byte aligned parts; with base
 * NULL it only counts.  A negative count marks the arena overflowed. */
typedef struct {
    char *base;
    size_t used;
    int overflow;
} arena;

static void *arena_take(arena *ar, ptrdiff_t n, size_t size)
{
    if (n < 0 || (size != 0 && (size_t)n > ((size_t)PTRDIFF_MAX / 2 -
                                            ar->used) / size)) {
        ar->overflow = 1;
        return NULL;
    }
    void *p = ar->base ? ar->base + ar->used : NULL;
    ar->used += ((size_t)n * size + 63) / 64 * 64;
    return n > 0 ? p : NULL;
}

/* The fast kernel `name` of the path simd (not ATT_SIMD_SCALAR, and
 * supported: callers check both) for the type TSFX: name_<type>_neon on
 * AArch64, where NEON is the only one; name_<type>_avx512 or
 * name_<type>_avx2 on x86-64. */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#if ATT_HAVE_NEON
#define FAST(simd, name) CAT(CAT(name##_, TSFX), _neon)
#else
#define FAST(simd, name)                                                     \
    ((simd) == ATT_SIMD_AVX512 ? CAT(CAT(name##_, TSFX), _avx512)            \
                               : CAT(CAT(name##_, TSFX), _avx2))
#endif

#define REAL float
#define SFX(name) name##_f32
#define TSFX f32
#define TANH tanhf
#define EXP expf
#include "kernels_impl.h"
#include "family_impl.h"
#undef REAL
#undef SFX
#undef TSFX
#undef TANH
#undef EXP

#define REAL double
#define SFX(name) name##_f64
#define TSFX f64
#define TANH tanh
#define EXP exp
#include "kernels_impl.h"
#include "family_impl.h"
#undef REAL
#undef SFX
#undef TSFX
#undef TANH
#undef EXP
