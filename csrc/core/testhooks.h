/*
 * core/testhooks.h - kernels that only the tests' extension
 * (attention_c._core_tests, the binding with ATT_TEST_HOOKS) calls; not part
 * of the public kernel API in attention.h.
 */
#ifndef ATTENTION_C_TESTHOOKS_H
#define ATTENTION_C_TESTHOOKS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y = tanh(x) for n items by the instruction set `simd` (enum att_simd),
 * the vector tanh the fused kernels use; ATT_OK, or ATT_EINVAL (n < 0). */
int att_tanh_f32(int simd, ptrdiff_t n, const float *x, float *y);
int att_tanh_f64(int simd, ptrdiff_t n, const double *x, double *y);

/* keep[t] = dropout's keep byte of (seed, b, i, t0 + t) at drop
 * probability p for t < n, by the keep_row of the float64 table (f64) or
 * the float32 one of the path `simd`; ATT_OK, or ATT_EINVAL (a negative
 * size or index, p outside [0, 1), a path the CPU cannot run). */
int att_keep_row_path(int simd, int f64, uint64_t seed, double p,
                      ptrdiff_t b, ptrdiff_t i, ptrdiff_t t0, ptrdiff_t n,
                      unsigned char *keep);

/* C (M x N, rows ldc apart) = alpha A B + beta C by the float32 gemm of
 * the path `simd` (core/dispatch.h's att_ops), or on its bf16 products
 * (`unit`, attention.h's att_bf16_unit: ATT_BF16_DOT gemm_bf16,
 * ATT_BF16_AMX gemm_amx; A and B bf16 as stored as `stored`,
 * core/dispatch.h's ATT_DP_A16 and ATT_DP_B16, says, float elsewhere),
 * ATT_DP_A_SPLIT too for AMX, a float A by rows or columns), with
 * att_gemm_path_work(simd) floats of work; ATT_OK, or ATT_EINVAL (a
 * negative size, a path or product the CPU or build lacks, a stored
 * operand without a unit, a split it cannot take). */
int att_gemm_path(int simd, int unit, int stored, ptrdiff_t M, ptrdiff_t N,
                  ptrdiff_t K, float alpha, const void *A, ptrdiff_t ars,
                  ptrdiff_t acs, const void *B, ptrdiff_t brs, ptrdiff_t bcs,
                  const unsigned char *kmask, float beta, float *C,
                  ptrdiff_t ldc, float *work);
ptrdiff_t att_gemm_path_work(int simd);

#ifdef __cplusplus
}
#endif

#endif /* ATTENTION_C_TESTHOOKS_H */
