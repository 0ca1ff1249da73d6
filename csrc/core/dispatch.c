/*
 * core/dispatch.c - the CPU's instruction sets (attention.h's
 * att_simd_best, att_simd_supported) and the one SIMD dispatch: the table
 * of kernels of a path (core/dispatch.h).  Plain C11; no Python here.
 */
#if defined(__linux__)
#define _GNU_SOURCE     /* syscall(), for att_bf16_products */
#endif
#include <stdatomic.h>
#include <stddef.h>

#include "attention.h"
#include "core/dispatch.h"
#include "core/peak.h"
#include "core/philox.h"
#include "core/testhooks.h"

/* The CPU's facts that CPUID (or the OS) tells, asked once each: under
 * a hypervisor CPUID traps to it (7 us a time on a KVM guest with AMD
 * Zen 4), and every kernel call asks (exec_ok, the family's choice of
 * products).  Not state: each holds -1 until its one true answer, the
 * same whichever thread stores it first. */
static atomic_int cpu_fact[3] = {-1, -1, -1};
enum { FACT_F16C, FACT_BF16, FACT_AMX };

static int cpu_knows(int fact, int (*ask)(void))
{
    int v = atomic_load_explicit(&cpu_fact[fact], memory_order_relaxed);
    if (v < 0) {
        v = ask() != 0;
        atomic_store_explicit(&cpu_fact[fact], v, memory_order_relaxed);
    }
    return v;
}

#if ATT_HAVE_X86 && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

/* F16C (leaf 1: ECX bit 29), binary16's conversions, which the avx2 path
 * widens 16-bit keys and values with: every AVX2 CPU has it, but
 * libgcc's check cannot ask for it under every compiler. */
static int x86_has_f16c(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}

/* AVX512_BF16 (leaf 7, subleaf 1: EAX bit 5): the dot products, and the
 * conversions both bf16 kernels round with */
static int x86_has_bf16(void)
{
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}
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
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        cpu_knows(FACT_F16C, x86_has_f16c)) {
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

#if ATT_HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

/* Linux's request for the tiles' state (arch/x86/include/uapi/asm/prctl.h)
 * and their data's feature number. */
#define ATT_ARCH_REQ_XCOMP_PERM 0x1023
#define ATT_XFEATURE_XTILEDATA 18

/* AMX-BF16 and AMX-TILE (leaf 7: EDX bits 22, 24), and the OS's grant of
 * the tiles' state to this process, which it gives on request (asking
 * again once granted is harmless) */
static int x86_amx_granted(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) ||
        !(d & (1u << 24))) {
        return 0;
    }
    return syscall(SYS_arch_prctl, ATT_ARCH_REQ_XCOMP_PERM,
                   ATT_XFEATURE_XTILEDATA) == 0;
}
#endif

#if ATT_HAVE_NEON_BF16 && defined(__linux__)
#include <sys/auxv.h>

/* The BF16 extension (Linux's HWCAP2_BF16, arch/arm64/include/uapi/asm/
 * hwcap.h): BFDOT and the other bf16 instructions */
static int arm_has_bf16(void)
{
    return (getauxval(AT_HWCAP2) >> 14) & 1;
}
#elif ATT_HAVE_NEON_BF16
/* Elsewhere: a build that targets the extension runs where it is */
static int arm_has_bf16(void)
{
    return ATT_NEON_BF16_BUILD;
}
#endif

int att_bf16_supported(int simd, int unit)
{
#if ATT_HAVE_NEON_BF16
    return simd == ATT_SIMD_NEON && unit == ATT_BF16_DOT &&
           cpu_knows(FACT_BF16, arm_has_bf16);
#elif ATT_HAVE_BF16DOT
    if (simd != ATT_SIMD_AVX512 || !att_simd_supported(simd) ||
        !cpu_knows(FACT_BF16, x86_has_bf16)) {
        return 0;
    }
    if (unit == ATT_BF16_DOT) {
        return 1;
    }
#if ATT_HAVE_AMX
    return unit == ATT_BF16_AMX && cpu_knows(FACT_AMX, x86_amx_granted);
#else
    return 0;
#endif
#else
    (void)simd;
    (void)unit;
    return 0;
#endif
}

int att_bf16_products(int simd)
{
    /* Measured: AMX's tiles ran at 8 to 10 times the float32 FMA rate of
     * a Sapphire-Rapids-class Xeon, whose vdpbf16ps ran at half of it;
     * on AMD Zen 4 vdpbf16ps runs at twice the FMA rate.  So the dot
     * products run where this CPU runs them faster than its FMAs. */
    if (att_bf16_supported(simd, ATT_BF16_AMX)) {
        return ATT_BF16_AMX;
    }
    return att_bf16_dot_speedup(simd) > ATT_BF16_DOT_GAIN ? ATT_BF16_DOT : 0;
}

/* Any path but the scalar one is the only SIMD path on AArch64 (neon),
 * and avx512 or else avx2 on x86-64; callers pass supported paths. */
const att_ops_f32 *att_ops_for_f32(int simd)
{
    if (simd == ATT_SIMD_SCALAR) {
        return &att_ops_table_f32_scalar;
    }
#if ATT_HAVE_NEON
    return &att_ops_table_f32_neon;
#elif ATT_HAVE_X86
    return simd == ATT_SIMD_AVX512 ? &att_ops_table_f32_avx512
                                   : &att_ops_table_f32_avx2;
#else
    return &att_ops_table_f32_scalar;
#endif
}

const att_ops_f64 *att_ops_for_f64(int simd)
{
    if (simd == ATT_SIMD_SCALAR) {
        return &att_ops_table_f64_scalar;
    }
#if ATT_HAVE_NEON
    return &att_ops_table_f64_neon;
#elif ATT_HAVE_X86
    return simd == ATT_SIMD_AVX512 ? &att_ops_table_f64_avx512
                                   : &att_ops_table_f64_avx2;
#else
    return &att_ops_table_f64_scalar;
#endif
}

int att_keep_row_path(int simd, int f64, uint64_t seed, double p,
                      ptrdiff_t b, ptrdiff_t i, ptrdiff_t t0, ptrdiff_t n,
                      unsigned char *keep)
{
    if (b < 0 || i < 0 || t0 < 0 || n < 0 || !(p >= 0 && p < 1) ||
        !att_simd_supported(simd)) {
        return ATT_EINVAL;
    }
    uint32_t threshold = att_keep_threshold(p);
    if (f64) {
        att_ops_for_f64(simd)->keep_row(seed, threshold, b, i, t0, n, keep);
    }
    else {
        att_ops_for_f32(simd)->keep_row(seed, threshold, b, i, t0, n, keep);
    }
    return ATT_OK;
}

int att_gemm_path(int simd, int unit, int stored, ptrdiff_t M, ptrdiff_t N,
                  ptrdiff_t K, float alpha, const void *A, ptrdiff_t ars,
                  ptrdiff_t acs, const void *B, ptrdiff_t brs, ptrdiff_t bcs,
                  const unsigned char *kmask, float beta, float *C,
                  ptrdiff_t ldc, float *work)
{
    if (M < 0 || N < 0 || K < 0 || !att_simd_supported(simd) ||
        unit < 0 || unit > ATT_BF16_AMX ||
        (unit && !att_bf16_supported(simd, unit)) ||
        (stored & ~(ATT_DP_A16 | ATT_DP_B16 | ATT_DP_A_SPLIT)) ||
        (stored && !unit) ||
        ((stored & ATT_DP_A_SPLIT) && (unit != ATT_BF16_AMX ||
                                       (stored & ATT_DP_A16) ||
                                       (ars != 1 && acs != 1)))) {
        return ATT_EINVAL;
    }
    const att_ops_f32 *ops = att_ops_for_f32(simd);
    int amx = unit == ATT_BF16_AMX;
    if (unit && (amx ? ops->gemm_amx : ops->gemm_bf16) == NULL) {
        return ATT_EINVAL;
    }
    if (unit) {
        (amx ? ops->gemm_amx : ops->gemm_bf16)(M, N, K, alpha, A, ars, acs, B,
                                               brs, bcs, kmask, beta, C, ldc,
                                               work, stored);
    }
    else {
        ops->gemm(M, N, K, alpha, A, ars, acs, B, brs, bcs, kmask, beta, C,
                  ldc, work);
    }
    return ATT_OK;
}

ptrdiff_t att_gemm_path_work(int simd)
{
    return att_simd_supported(simd) ? att_ops_for_f32(simd)->gemm_work : -1;
}

int att_convert16(int simd, int store, int widen, ptrdiff_t n,
                  const void *src, void *dst)
{
    if (!att_simd_supported(simd) || n < 0 || (n > 0 && (!src || !dst)) ||
        (store != ATT_STORE_BF16 && store != ATT_STORE_F16)) {
        return ATT_EINVAL;
    }
    const att_ops_f32 *ops = att_ops_for_f32(simd);
    if (widen) {
        ops->widen16[store - 1](n, src, dst);
    }
    else {
        ops->round16[store - 1](n, src, dst);
    }
    return ATT_OK;
}
