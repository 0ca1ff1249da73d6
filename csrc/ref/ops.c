/*
 * ref/ops.c - the scalar path's table of core/dispatch.h: the primitives
 * of ref/scalar.h.  The scalar fused layer is the pooled layer's own
 * (pooled/kernels.inc), so its entries here are NULL.  Its keep_row is
 * core/philox.h's, the generator the SIMD ones reproduce.
 */
#include <stddef.h>

#include "core/dispatch.h"
#include "core/philox.h"
#include "ref/scalar.h"

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

#define SCALAR_TABLE(SFX)                                                    \
    {                                                                        \
        .vlen = 1,                                                           \
        .gemm_work = 0,                                                      \
        .gemm = gemm_##SFX,                                                  \
        .gemv = gemv_##SFX,                                                  \
        .add_scores = add_scores_##SFX,                                      \
        .add_scores_backward = add_scores_backward_##SFX,                    \
        .softmax = family_softmax_##SFX,                                     \
        .softmax_backward = seq_softmax_backward_##SFX,                      \
        .exp_shift = exp_shift_##SFX,                                        \
        .max_row = max_row_##SFX,                                            \
        .ds_row = ds_row_##SFX,                                              \
        .dot_keys = dot_keys_##SFX,                                          \
        .sum_values = sum_values_##SFX,                                      \
        .keep_row = att_keep_row,                                            \
        .apply_keep = apply_keep_##SFX,                                      \
        .workspace = NULL,                                                   \
        .context_attention = NULL,                                           \
        .context_attention_backward = NULL,                                  \
        .tanh = tanh_all_##SFX,                                              \
    }

const att_ops_f32 att_ops_table_f32_scalar = SCALAR_TABLE(f32);
const att_ops_f64 att_ops_table_f64_scalar = SCALAR_TABLE(f64);
