/*
 * core/testhooks.h - kernels that only the tests' extension
 * (attention_c._core_tests, the binding with ATT_TEST_HOOKS) calls; not part
 * of the public kernel API in attention.h.
 */
#ifndef ATTENTION_C_TESTHOOKS_H
#define ATTENTION_C_TESTHOOKS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y = tanh(x) for n items by the instruction set `simd` (enum att_simd),
 * the vector tanh the fused kernels use; ATT_OK, or ATT_EINVAL (n < 0). */
int att_tanh_f32(int simd, ptrdiff_t n, const float *x, float *y);
int att_tanh_f64(int simd, ptrdiff_t n, const double *x, double *y);

#ifdef __cplusplus
}
#endif

#endif /* ATTENTION_C_TESTHOOKS_H */
