/*
 * core/peak.h - internal: the FMA peak of a path (core/dispatch.h's
 * fma_loop) run on several threads at once, for the bench's measured
 * peak (attention_c._core._fma_loop; the caller times it).
 */
#ifndef ATTENTION_C_CORE_PEAK_H
#define ATTENTION_C_CORE_PEAK_H

#include <stddef.h>

#include "core/pool.h"

/* Seconds a thread waits for the others to start the loop with it. */
#define ATT_PEAK_START_WAIT 1.0

/*
 * Runs the fma_loop of path `simd` (enum att_simd) for float (f64 = 0) or
 * double (f64 = 1), `iters` steps, once on each of `threads` threads of
 * `pool` (NULL for one thread), the threads starting together: each waits
 * (at most ATT_PEAK_START_WAIT seconds) until all have started, so no
 * thread runs two loops while another runs none.  Sets *flops to the
 * flops performed, threads x 2 x vlen x fma_accs x iters.
 * Returns ATT_EINVAL (simd not supported, iters < 1, threads < 1), or the
 * number of threads that ran the loop together: `threads` unless the
 * pool has fewer or another caller held its workers (then some loops ran
 * one after another and a timing of the call is not the peak), or -2
 * when a loop's sum is outside what its chains can give (a miscompiled
 * loop).
 */
int att_fma_loop(int simd, int f64, ptrdiff_t iters, att_pool *pool,
                 int threads, double *flops);

/*
 * The rate of path simd's bf16 dot products (dot_loop) over its float32
 * FMAs' (fma_loop), each the best of three timings of 24 chains on this
 * thread (about 0.2 ms in all); 0 where the path has none.
 */
double att_bf16_dot_speedup(int simd);

#endif /* ATTENTION_C_CORE_PEAK_H */
