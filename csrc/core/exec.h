/*
 * core/exec.h - internal: the checks and the thread count every kernel
 * call shares (sizes, the att_exec a caller passes), and the byte counts
 * of the pooled layer's workspace queries.
 */
#ifndef ATTENTION_C_CORE_EXEC_H
#define ATTENTION_C_CORE_EXEC_H

#include <stddef.h>
#include <stdint.h>

#include "attention.h"
#include "core/pool.h"

/* Every kernel checks its sizes first: nonnegative, at least one item. */
static inline int dims_ok(att_dims d)
{
    return d.B >= 0 && d.T >= 1 && d.H >= 0 && d.A >= 0;
}

static inline int exec_ok(const att_exec *ex)
{
    return ex != NULL && att_simd_supported(ex->simd) && ex->threads >= 1;
}

/* Threads a fused kernel uses: a thread costs a wake-up (~5-10 us), so
 * each must get at least 2^22 multiply-adds (~25 us); the scalar path
 * runs on one. */
static inline int exec_threads(const att_exec *ex, att_dims d)
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
static inline ptrdiff_t workspace_elems(att_dims d, ptrdiff_t n_h,
                                        ptrdiff_t n_a, ptrdiff_t n_t)
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
static inline ptrdiff_t fast_bytes(size_t bytes)
{
    return bytes == 0 || bytes > (size_t)PTRDIFF_MAX ? -1
                                                     : (ptrdiff_t)bytes;
}

#endif /* ATTENTION_C_CORE_EXEC_H */
