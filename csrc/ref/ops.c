/*
 * ref/ops.c - the scalar path's table of core/dispatch.h: the primitives
 * of ref/scalar.h.  The scalar fused layer is the pooled layer's own
 * (pooled/kernels.inc), so its entries here are NULL.  Its keep_row is
 * core/philox.h's, the generator the SIMD ones reproduce.
 */
#include <stddef.h>

#include "core/dispatch.h"
#include "core/half.h"
#include "core/philox.h"
#include "ref/scalar.h"

/* The scalar path's FMA peak (core/dispatch.h's fma_loop): 12 chains
 * a = a x + y written as the scalar kernels write their products (a
 * multiply and an add, fused only where the compiler contracts them):
 * 2 x 12 x iters flops.  12 chains cover a multiply then an add of
 * latency 3 each on 2 pipes.  x = y = 1/2: every chain settles at 1
 * exactly (no subnormal, no overflow). */
#define SCALAR_FMA_LOOP(SFX)                                                 \
    static double fma_loop_##SFX(ptrdiff_t iters)                            \
    {                                                                        \
        const FMA_R x = (FMA_R)0.5, y = (FMA_R)0.5;                          \
        ATT_FMA_LIST_12(SCALAR_FMA_INIT)                                     \
        for (ptrdiff_t it = 0; it < iters; it++) {                           \
            ATT_FMA_LIST_12(SCALAR_FMA_STEP)                                 \
        }                                                                    \
        double s = 0;                                                        \
        ATT_FMA_LIST_12(SCALAR_FMA_SUM)                                      \
        return s;                                                            \
    }
#define SCALAR_FMA_INIT(i) FMA_R a##i = (FMA_R)(i) / 32;
#define SCALAR_FMA_STEP(i) a##i = a##i * x + y;
#define SCALAR_FMA_SUM(i) s += (double)a##i;

#define FMA_R float
SCALAR_FMA_LOOP(f32)
#undef FMA_R
#define FMA_R double
SCALAR_FMA_LOOP(f64)
#undef FMA_R

/* y_t = keep_t ? x_t scale : 0: the keep bytes applied to a row. */
#define APPLY_KEEP(R, SFX)                                                   \
    static void apply_keep_##SFX(ptrdiff_t n, const unsigned char *keep,     \
                                 R scale, const R *x, R *y)                  \
    {                                                                        \
        for (ptrdiff_t t = 0; t < n; t++) {                                  \
            y[t] = keep[t] ? x[t] * scale : 0;                               \
        }                                                                    \
    }

APPLY_KEEP(float, f32)
APPLY_KEEP(double, f64)

/* dot_keys_multi16 and sum_values_multi16 (core/dispatch.h): the loops
 * of ref/scalar.inc's dot_keys and sum_values, each element widened as
 * it is read (core/half.h), so the bits are theirs on the widened rows. */
#define SCALAR_MULTI16(NAME, STORE)                                          \
    static void dot_keys_multi_##NAME(ptrdiff_t g, ptrdiff_t n, ptrdiff_t d, \
                                      float alpha, const float *const *q,    \
                                      const void *K, ptrdiff_t ldk,          \
                                      float *const *s, ptrdiff_t pf,         \
                                      int pf2)                               \
    {                                                                        \
        (void)pf;                                                            \
        (void)pf2;                                                           \
        for (ptrdiff_t r = 0; r < g; r++) {                                  \
            for (ptrdiff_t t = 0; t < n; t++) {                              \
                float acc = 0;                                               \
                for (ptrdiff_t c = 0; c < d; c++) {                          \
                    acc += q[r][c] * att_half_at(STORE, K, t * ldk + c);     \
                }                                                            \
                s[r][t] = alpha * acc;                                       \
            }                                                                \
        }                                                                    \
    }                                                                        \
    static void sum_values_multi_##NAME(ptrdiff_t g, ptrdiff_t n,            \
                                        ptrdiff_t d, const float *const *w,  \
                                        const void *V, ptrdiff_t ldv,        \
                                        const unsigned char *const *use,     \
                                        float *const *out, int add,          \
                                        ptrdiff_t pf, int pf2)               \
    {                                                                        \
        (void)pf;                                                            \
        (void)pf2;                                                           \
        for (ptrdiff_t r = 0; r < g; r++) {                                  \
            if (!add) {                                                      \
                fill_zero_f32(d, out[r]);                                    \
            }                                                                \
            for (ptrdiff_t t = 0; t < n; t++) {                              \
                for (ptrdiff_t c = 0; VALID(use[r], t) && c < d; c++) {      \
                    out[r][c] += w[r][t] * att_half_at(STORE, V,             \
                                                       t * ldv + c);         \
                }                                                            \
            }                                                                \
        }                                                                    \
    }

SCALAR_MULTI16(bf16, ATT_STORE_BF16)
SCALAR_MULTI16(f16, ATT_STORE_F16)

/* widen16 and round16: core/half.h's conversions, one by one */
#define SCALAR_CONVERT16(NAME, TO32, TO16)                                   \
    static void widen_##NAME(ptrdiff_t n, const uint16_t *s, float *d)       \
    {                                                                        \
        for (ptrdiff_t i = 0; i < n; i++) {                                  \
            d[i] = TO32(s[i]);                                               \
        }                                                                    \
    }                                                                        \
    static void round_##NAME(ptrdiff_t n, const float *s, uint16_t *d)       \
    {                                                                        \
        for (ptrdiff_t i = 0; i < n; i++) {                                  \
            d[i] = TO16(s[i]);                                               \
        }                                                                    \
    }

SCALAR_CONVERT16(bf16, att_bf16_to_f32, att_f32_to_bf16)
SCALAR_CONVERT16(f16, att_f16_to_f32, att_f32_to_f16)

/* finite16: an exponent of all ones is an infinity or a NaN */
#define SCALAR_FINITE16(NAME, EXP)                                           \
    static int finite_##NAME(ptrdiff_t n, const uint16_t *x)                \
    {                                                                        \
        unsigned bad = 0;                                                    \
        for (ptrdiff_t i = 0; i < n; i++) {                                  \
            bad |= (x[i] & (EXP)) == (EXP);                                  \
        }                                                                    \
        return !bad;                                                         \
    }

SCALAR_FINITE16(bf16, 0x7f80u)
SCALAR_FINITE16(f16, 0x7c00u)

/* widen_q8: an int8 cache's rows, one product each (core/dispatch.h) */
static void widen_q8(ptrdiff_t n, ptrdiff_t g, const int8_t *s,
                     const float *scale, float *d)
{
    for (ptrdiff_t k = 0, gi = 0; k < n; k += g, gi++) {
        for (ptrdiff_t c = k; c < k + g; c++) {
            d[c] = scale[gi] * (float)s[c];
        }
    }
}

#define SCALAR_ENTRIES(SFX)                                                  \
    .vlen = 1,                                                               \
    .gemm_work = 0,                                                          \
    .gemm = gemm_##SFX,                                                      \
    .gemv = gemv_##SFX,                                                      \
    .add_scores = add_scores_##SFX,                                          \
    .add_scores_backward = add_scores_backward_##SFX,                        \
    .softmax = family_softmax_##SFX,                                         \
    .softmax_backward = seq_softmax_backward_##SFX,                          \
    .exp_shift = exp_shift_##SFX,                                            \
    .max_row = max_row_##SFX,                                                \
    .bad_rows = bad_rows_##SFX,                                              \
    .ds_row = ds_row_##SFX,                                                  \
    .exp_ds = exp_ds_##SFX,                                                  \
    .dot_keys = dot_keys_##SFX,                                              \
    .sum_values = sum_values_##SFX,                                          \
    .keep_row = att_keep_row,                                                \
    .apply_keep = apply_keep_##SFX,                                          \
    .dot_keys_multi = dot_keys_multi_##SFX,                                  \
    .sum_values_multi = sum_values_multi_##SFX,                              \
    .workspace = NULL,                                                       \
    .context_attention = NULL,                                               \
    .context_attention_backward = NULL,                                      \
    .tanh = tanh_all_##SFX,                                                  \
    .fma_loop = fma_loop_##SFX,                                              \
    .fma_accs = 12

const att_ops_f32 att_ops_table_f32_scalar = {
    SCALAR_ENTRIES(f32),
    .widen16 = {widen_bf16, widen_f16},
    .finite16 = {finite_bf16, finite_f16},
    .widen_q8 = widen_q8,
    .round16 = {round_bf16, round_f16},
    .dot_keys_multi16 = {dot_keys_multi_bf16, dot_keys_multi_f16},
    .sum_values_multi16 = {sum_values_multi_bf16, sum_values_multi_f16},
};
const att_ops_f64 att_ops_table_f64_scalar = {SCALAR_ENTRIES(f64)};
