/*
 * fast.h - internal: the blocked SIMD kernels, one set per instruction set
 * and type (fast_avx512.c, fast_avx2.c), called by kernels.c's dispatch.
 * Same arguments and layouts as the kernels of attention.h; `work` is a
 * buffer of att_fast_workspace_*(d, backward, threads) bytes (no alignment
 * needed), and the kernel must get the same `threads`.
 */
#ifndef ATTENTION_C_FAST_H
#define ATTENTION_C_FAST_H

#include <stddef.h>

#include "attention.h"
#include "pool.h"

#define ATT_FAST_DECLARE(R, SFX)                                             \
    size_t att_fast_workspace_##SFX(att_dims d, int backward, int threads);  \
    int att_fast_context_attention_##SFX(                                    \
        att_dims d, att_pool *pool, int threads, const R *h, const R *W,     \
        const R *v, const R *b,                                              \
        const unsigned char *mask, R *out, R *alpha, R *act, void *work);    \
    int att_fast_context_attention_backward_##SFX(                           \
        att_dims d, att_pool *pool, int threads, const R *grad_out,          \
        const R *h, const R *W, const R *v,                                  \
        const R *alpha, const R *b, const unsigned char *mask,               \
        const R *grad_alpha, const R *act, R *dh, R *dW, R *dv, R *db,       \
        void *work);                                                         \
    void att_fast_tanh_##SFX(ptrdiff_t n, const R *x, R *y);

#if defined(__x86_64__) || defined(_M_X64)
#define ATT_HAVE_X86 1
ATT_FAST_DECLARE(float, f32_avx512)
ATT_FAST_DECLARE(double, f64_avx512)
ATT_FAST_DECLARE(float, f32_avx2)
ATT_FAST_DECLARE(double, f64_avx2)
#endif

#undef ATT_FAST_DECLARE

#endif /* ATTENTION_C_FAST_H */
