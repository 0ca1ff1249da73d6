/*
 * core/peak.c - see core/peak.h.  Plain C11 (its clock: core/clock.h); no
 * Python.
 */
#include <stdatomic.h>
#include <stddef.h>

#include "attention.h"
#include "core/clock.h"
#include "core/dispatch.h"
#include "core/peak.h"

typedef struct {
    double (*loop)(ptrdiff_t iters);
    ptrdiff_t iters;
    int threads;
    double lanes;               /* fma_accs x vlen */
    atomic_int started;         /* tasks that have begun */
    atomic_int together;        /* least count of started threads seen */
    atomic_int wrong;           /* a loop's sum out of its range */
} peak_job;

static void peak_task(void *arg, ptrdiff_t task, int thread)
{
    peak_job *j = arg;
    (void)task;
    (void)thread;
    int seen = atomic_fetch_add(&j->started, 1) + 1;
    if (seen < j->threads) {
        double deadline = att_seconds() + ATT_PEAK_START_WAIT;
        while ((seen = atomic_load(&j->started)) < j->threads &&
               att_seconds() < deadline) {
        }
    }
    int least = atomic_load(&j->together);
    while (seen < least &&
           !atomic_compare_exchange_weak(&j->together, &least, seen)) {
    }
    /* every lane of every chain ends in [1, 3) (the scalar ones settle
     * at 1 from below within about 60 steps) */
    double r = j->loop(j->iters);
    if (j->iters >= 100 && !(r >= j->lanes && r < 3 * j->lanes)) {
        atomic_store(&j->wrong, 1);
    }
}

int att_fma_loop(int simd, int f64, ptrdiff_t iters, att_pool *pool,
                 int threads, double *flops)
{
    if (!att_simd_supported(simd) || iters < 1 || threads < 1) {
        return ATT_EINVAL;
    }
    peak_job j;
    ptrdiff_t vlen;
    int accs;
    if (f64) {
        const att_ops_f64 *ops = att_ops_for_f64(simd);
        j.loop = ops->fma_loop;
        vlen = ops->vlen;
        accs = ops->fma_accs;
    }
    else {
        const att_ops_f32 *ops = att_ops_for_f32(simd);
        j.loop = ops->fma_loop;
        vlen = ops->vlen;
        accs = ops->fma_accs;
    }
    j.iters = iters;
    j.threads = threads;
    j.lanes = (double)accs * (double)vlen;
    atomic_init(&j.started, 0);
    atomic_init(&j.together, threads);
    atomic_init(&j.wrong, 0);
    att_pool_run(pool, threads, threads, peak_task, &j);
    *flops = 2.0 * (double)threads * (double)vlen * (double)accs *
             (double)iters;
    return atomic_load(&j.wrong) ? -2 : atomic_load(&j.together);
}

double att_bf16_dot_speedup(int simd)
{
    enum { ITERS = 2000, ROUNDS = 3 };
    if (!att_bf16_supported(simd, ATT_BF16_DOT)) {
        return 0;
    }
    const att_ops_f32 *ops = att_ops_for_f32(simd);
    if (ops->dot_loop == NULL) {
        return 0;
    }
    double best[2] = {0, 0}, lanes = (double)ops->fma_accs * ops->vlen;
    (void)ops->fma_loop(ITERS);                 /* the clock ramps up */
    for (int r = 0; r < ROUNDS; r++) {
        for (int k = 0; k < 2; k++) {
            double t = att_seconds();
            double sum = (k ? ops->dot_loop : ops->fma_loop)(ITERS);
            t = att_seconds() - t;
            if (!(sum >= lanes && sum < 3 * lanes)) {
                return 0;               /* a miscompiled loop */
            }
            best[k] = r == 0 || t < best[k] ? t : best[k];
        }
    }
    /* flops: 4 vlen accs ITERS for the dot products, 2 for the FMAs */
    return best[1] > 0 ? 2.0 * best[0] / best[1] : 0;
}
