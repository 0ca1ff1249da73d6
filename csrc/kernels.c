/*
 * kernels.c - instantiates kernels_impl.h for float and double, and the
 * scratch sizes they share.  Plain C11 with libm; no Python here.
 */
#include <math.h>
#include <stdint.h>

#include "attention.h"

/* Every kernel checks its sizes first: nonnegative, at least one item. */
static int dims_ok(att_dims d)
{
    return d.B >= 0 && d.T >= 1 && d.H >= 0 && d.A >= 0;
}

/* Sum of the scratch parts below; -1 when a count would overflow. */
static ptrdiff_t workspace(att_dims d, ptrdiff_t n_h, ptrdiff_t n_a,
                           ptrdiff_t n_t)
{
    /* n_h vectors of H, n_a of A, n_t of T, and WT (2H, A) */
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

ptrdiff_t att_additive_score_workspace(att_dims d)
{
    return workspace(d, 0, 2, 0);             /* WT | q z */
}

ptrdiff_t att_additive_score_backward_workspace(att_dims d)
{
    return workspace(d, 0, 4, 0);             /* WT | q z eps E */
}

ptrdiff_t att_context_attention_workspace(att_dims d)
{
    return workspace(d, 1, 2, 0);             /* WT | c | q z */
}

ptrdiff_t att_context_attention_backward_workspace(att_dims d)
{
    return workspace(d, 2, 4, 2);             /* WT | c dc | q z eps E |
                                                 gamma ds */
}

#define REAL float
#define SFX(name) name##_f32
#define TANH tanhf
#define EXP expf
#include "kernels_impl.h"
#undef REAL
#undef SFX
#undef TANH
#undef EXP

#define REAL double
#define SFX(name) name##_f64
#define TANH tanh
#define EXP exp
#include "kernels_impl.h"
#undef REAL
#undef SFX
#undef TANH
#undef EXP
