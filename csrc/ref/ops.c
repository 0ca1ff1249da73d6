/*
 * ref/ops.c - the scalar path's table of core/dispatch.h: the primitives
 * of ref/scalar.h.  The scalar fused layer is the pooled layer's own
 * (pooled/kernels.inc), so its entries here are NULL.
 */
#include <stddef.h>

#include "core/dispatch.h"
#include "ref/scalar.h"

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
        .dot_keys_multi = dot_keys_multi_##SFX,                              \
        .sum_values_multi = sum_values_multi_##SFX,                          \
        .workspace = NULL,                                                   \
        .context_attention = NULL,                                           \
        .context_attention_backward = NULL,                                  \
        .tanh = tanh_all_##SFX,                                              \
    }

const att_ops_f32 att_ops_table_f32_scalar = SCALAR_TABLE(f32);
const att_ops_f64 att_ops_table_f64_scalar = SCALAR_TABLE(f64);
