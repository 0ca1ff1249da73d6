/*
 * check.c - the SIMD paths of the C kernels against the scalar path, in
 * plain C11 (no Python): built for AArch64 and run under qemu-aarch64 by
 * .ci/neon, it proves the NEON path on an x86 machine; built natively it
 * checks the x86 paths the CPU runs (AVX2, AVX-512) the same way.
 *
 * For every SIMD path att_simd_supported() reports, and float and double:
 *   - context_attention and its backward (with and without the saved
 *     activations, bias, grad_alpha), the attention family (additive, dot,
 *     general; forward and backward; no mask, key masks, per-query masks;
 *     one query and several; values given or not; keys projected by the
 *     caller or here; the backward stopping at kproj) and project_keys,
 *     against the scalar path within a normwise relative error of TOL
 *     (see check_impl.h), on sizes around the micro-tiles and blocks, B = 0,
 *     fully masked rows and queries, NaN in every padding entry;
 *   - the same calls at 1 and 2 threads of a pool give the same bits
 *     (a few cases are big enough that the kernels do use 2 threads);
 *   - NaN and inf in one sequence leave the next one's results alone;
 *   - the path's tanh within an ulp bound of libm over a sweep, exact at
 *     the special values;
 *   - the FMA peak's loop of every path: its flop count on 1 and 2
 *     threads run together;
 *   - decoding against 16-bit keys and values: the bits of the widened
 *     arrays', every 16-bit pattern widened exactly;
 *   - attention against an int8 cache (float or binary16 scales, groups
 *     on and off the vectors): the bits of the float call on the
 *     dequantized cache;
 *   - the 16-bit conversions (att_convert16) against the scalar path's;
 *   - where the CPU has bf16 dot products, the bf16 forward of float
 *     calls, the backward's product and the backward, against a model
 *     of the ISA's rounding and float32 products (check_bf16.h);
 *   - the fused forward and the backward on float16 as stored: the bits
 *     of the same path on the widened arrays (check_bf16.h).
 * Prints one line per failure and the summary "N passed, M failed"; exits
 * 1 on any failure (2 when it cannot run at all).
 *
 * Usage: check [-v]   (-v: the worst error of every output kind)
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attention.h"
#include "core/dispatch.h"        /* ATT_GEMM_KC */
#include "core/half.h"
#include "core/testhooks.h"
#include "core/peak.h"
#include "core/pool.h"

static const char *const simd_names[] = {"scalar", "avx2", "avx512",
                                         "neon"};

/* What a run has found so far, and what every check needs. */
typedef struct {
    long passed, failed;
    int verbose;
    int simd;                 /* the path under test */
    att_pool *pool;           /* 2 threads */
    uint64_t rng;
    char what[256];           /* the current case, for failure lines */
    long shapes, calls;
    double worst[2][32];      /* [type][kind]: largest error seen (-v) */
    long raised[2][32];       /* [type][kind]: bounds raised (-v) */
} ctx;

/* The output kinds seen so far, in order (-v). */
#define N_KINDS 32
static const char *kinds[N_KINDS];

static void pass(ctx *c)
{
    c->passed++;
}

static void expect(ctx *c, int ok, const char *fmt, ...)
{
    if (ok) {
        pass(c);
        return;
    }
    va_list ap;
    c->failed++;
    printf("FAIL %s [%s]: ", c->what, simd_names[c->simd]);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
}

/* splitmix64: a fixed sequence, so every run checks the same inputs */
static uint64_t next_u64(ctx *c)
{
    uint64_t z = (c->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* uniform in [0, 1) */
static double uniform(ctx *c)
{
    return (double)(next_u64(c) >> 11) * 0x1.0p-53;
}

static ptrdiff_t below(ctx *c, ptrdiff_t n)
{
    return n > 0 ? (ptrdiff_t)(next_u64(c) % (uint64_t)n) : 0;
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "check: out of memory (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

/*
 * Masks.  Context attention, (B, T):
 *   0 none (NULL)   1 all valid   2 ragged prefixes, sequence 0 fully
 *   masked (B >= 2), the last one full   3 random (60 % valid), sequence
 *   1 fully masked (B >= 3)
 * The family adds kind 4, per query (B, Tq, T): random rows, query 1 of
 * every sequence and every query of sequence 1 fully masked, key T - 1
 * masked for every query (dead).
 */
static unsigned char *make_mask(ctx *c, int kind, ptrdiff_t B, ptrdiff_t Tq,
                                ptrdiff_t T)
{
    if (kind == 0) {
        return NULL;
    }
    ptrdiff_t rows = kind == 4 ? B * Tq : B;
    unsigned char *m = xmalloc((size_t)(rows * T));
    for (ptrdiff_t r = 0; r < rows; r++) {
        ptrdiff_t b = kind == 4 ? r / Tq : r, i = kind == 4 ? r % Tq : 0;
        ptrdiff_t len = 1 + below(c, T);
        for (ptrdiff_t t = 0; t < T; t++) {
            unsigned char on;
            switch (kind) {
            case 1:
                on = 1;
                break;
            case 2:
                on = t < (B >= 2 && b == 0 ? 0 : (b == B - 1 ? T : len));
                break;
            case 3:
                on = uniform(c) < 0.6 && !(B >= 3 && b == 1);
                break;
            default:
                on = uniform(c) < 0.6 && !(Tq >= 2 && i == 1) &&
                     !(B >= 2 && b == 1) && !(T >= 2 && t == T - 1);
                break;
            }
            m[r * T + t] = on;
        }
    }
    return m;
}

/* f with visibility kind v: 0 full, 1 causal, 2 a window (13 keys
 * before, 5 after): the fused forward's cases. */
static att_fdims with_visibility(att_fdims f, int v)
{
    f.causal = v == 1;
    f.window = v == 2;
    f.wleft = 13;
    f.wright = 5;
    return f;
}

/* The streamed forward's sizes: across the fused kernel's panels of
 * queries and blocks of keys (check_impl.h's flash_all, check_bf16.h's
 * float16 as stored) */
#define FF(B_, Tq_, T_, H_, Hv_) \
    {.B = B_, .Tq = Tq_, .T = T_, .H = H_, .Hv = Hv_}
static const att_fdims flash_sizes[] = {
    FF(2, 9, 1, 3, 2), FF(3, 17, 47, 8, 5), FF(2, 65, 49, 17, 9),
    FF(1, 130, 97, 8, 8), FF(2, 257, 300, 16, 16),
};
#undef FF
#define N_FLASH_SIZES (sizeof(flash_sizes) / sizeof(flash_sizes[0]))

#define REAL float
#define SFX(name) name##_f32
#define TYPE_INDEX 0
#define TYPE_NAME "float32"
#define ATT(name) att_##name##_f32
#include "check_impl.h"

#define REAL double
#define SFX(name) name##_f64
#define TYPE_INDEX 1
#define TYPE_NAME "float64"
#define ATT(name) att_##name##_f64
#include "check_impl.h"

#include "check_bf16.h"

/* The scalar path is always there; on AArch64 NEON is the best path and
 * no x86 path is offered; on x86-64 NEON is never offered. */
static void check_paths(ctx *c)
{
    snprintf(c->what, sizeof c->what, "instruction sets");
    c->simd = ATT_SIMD_SCALAR;
    expect(c, att_simd_supported(ATT_SIMD_SCALAR), "scalar not supported");
    expect(c, !att_simd_supported(-1) && !att_simd_supported(4),
           "an unknown path is supported");
#if defined(__aarch64__)
    expect(c, att_simd_best() == ATT_SIMD_NEON, "best path is %d, not neon",
           att_simd_best());
    expect(c, att_simd_supported(ATT_SIMD_NEON), "neon not supported");
    expect(c, !att_simd_supported(ATT_SIMD_AVX2) &&
              !att_simd_supported(ATT_SIMD_AVX512),
           "an x86 path is supported on AArch64");
#else
    expect(c, !att_simd_supported(ATT_SIMD_NEON),
           "neon supported off AArch64");
#endif
}

/* The FMA peak's loop (core/peak.h) on every path this CPU runs: the
 * documented flop count, threads x 2 x lanes x accumulators x iters, on
 * 1 and 2 threads that run it together, and its sum of chains in range
 * (att_fma_loop returns -2 otherwise). */
static void check_fma_loop(ctx *c)
{
    static const int lanes[4][2] = {{1, 1}, {8, 4}, {16, 8}, {4, 2}};
    static const int accs[4] = {12, 12, 24, 24};
    for (int simd = ATT_SIMD_SCALAR; simd <= ATT_SIMD_NEON; simd++) {
        if (!att_simd_supported(simd)) {
            continue;
        }
        for (int f64 = 0; f64 <= 1; f64++) {
            for (int threads = 1; threads <= 2; threads++) {
                double flops = 0;
                int st = att_fma_loop(simd, f64, 1000,
                                      threads > 1 ? c->pool : NULL,
                                      threads, &flops);
                double want = 2.0 * threads * lanes[simd][f64] *
                              accs[simd] * 1000;
                snprintf(c->what, sizeof c->what, "fma_loop %s %s %d thr",
                         simd_names[simd], f64 ? "float64" : "float32",
                         threads);
                expect(c, st == threads && flops == want,
                       "status %d (want %d), flops %g (want %g)", st,
                       threads, flops, want);
            }
        }
        double flops = 0;
        snprintf(c->what, sizeof c->what, "fma_loop %s bad sizes",
                 simd_names[simd]);
        expect(c, att_fma_loop(simd, 0, 0, NULL, 1, &flops) == ATT_EINVAL &&
                  att_fma_loop(simd, 0, 10, NULL, 0, &flops) == ATT_EINVAL,
               "iters 0 or threads 0 accepted");
    }
    double flops = 0;
    snprintf(c->what, sizeof c->what, "fma_loop unknown path");
    expect(c, att_fma_loop(4, 0, 10, NULL, 1, &flops) == ATT_EINVAL,
           "an unknown path accepted");
}

/* Dropout's keep bytes (att_keep_row_path: the path's float32 and float64
 * tables) equal the scalar path's, bitwise, for seeds, thresholds (0, 1,
 * 2^31, near 2^32), batch indices and counters past 2^32, offsets no
 * multiple of 4, 8 or 16 and lengths from 0 past two vector runs. */
static void check_keep_rows(ctx *c)
{
    static const struct {
        uint64_t seed;
        double p;
        ptrdiff_t b, i;
    } rows[] = {{0, 0.1, 0, 0}, {1234, 0.1, 3, 7},
                {UINT64_MAX, 0.5, 1, 2},
                {(uint64_t)1 << 32, 0.25, ((ptrdiff_t)1 << 32) + 5, 9},
                {0xDEADBEEFCAFEF00Dull, 0.9, 17, 4294967295},
                {42, 0.0, 5, 1}, {7, 0x1.0p-32, 0, 3},
                {99, 1 - 0x1.0p-30, 4, 4}};
    static const ptrdiff_t offsets[] = {0, 1, 2, 3, 5, 7, 13, 16, 17, 33, 63,
                                        ((ptrdiff_t)1 << 34) - 5};
    static const ptrdiff_t lengths[] = {0, 1, 3, 4, 7, 15, 16, 17, 31, 32,
                                        33, 63, 64, 65, 129, 200, 1000};
    unsigned char want[1000], got[1000];
    long bad = 0, total = 0;
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        for (size_t o = 0; o < sizeof offsets / sizeof offsets[0]; o++) {
            for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++) {
                ptrdiff_t t0 = offsets[o], n = lengths[l];
                int st = att_keep_row_path(ATT_SIMD_SCALAR, 0, rows[r].seed,
                                           rows[r].p, rows[r].b, rows[r].i,
                                           t0, n, want);
                for (int f64 = 0; f64 < 2; f64++) {
                    memset(got, 0xAA, sizeof got);
                    st |= att_keep_row_path(c->simd, f64, rows[r].seed,
                                            rows[r].p, rows[r].b, rows[r].i,
                                            t0, n, got);
                    int same = st == ATT_OK && memcmp(got, want,
                                                      (size_t)n) == 0;
                    for (ptrdiff_t t = n; t < 1000; t++) {
                        same = same && got[t] == 0xAA;  /* nothing past n */
                    }
                    total++;
                    if (!same && bad++ < 5) {
                        snprintf(c->what, sizeof c->what,
                                 "keep_row row %zu t0 %td n %td f64 %d", r,
                                 t0, n, f64);
                        expect(c, 0, "keep bytes differ from the scalar "
                               "path's");
                    }
                }
            }
        }
    }
    snprintf(c->what, sizeof c->what, "keep_row: %ld rows", total);
    expect(c, bad == 0, "%ld of them differ from the scalar path's", bad);
}

/* Decoding with keys and values stored in 16 bits (bfloat16, binary16;
 * float calls): the bits of the same call on the widened arrays, on the
 * path under test, with every 16-bit pattern widened exactly (one key of
 * weight 1: out = its value row), and sizes around the vectors. */
static void check_half_decode(ctx *c)
{
    static const att_fdims sizes[] = {
        {.B = 1, .Tq = 1, .T = 1, .H = 1, .Hv = 65536},
        {.B = 1, .Tq = 1, .T = 1, .H = 1, .Hv = 65521},
        {.B = 3, .Tq = 1, .T = 17, .H = 3, .Hv = 65},
        {.B = 2, .Tq = 3, .T = 65, .H = 17, .Hv = 17},
        {.B = 4, .Tq = 4, .T = 300, .H = 64, .Hv = 33},
    };
    for (int store = ATT_STORE_BF16; store <= ATT_STORE_F16; store++) {
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            att_fdims f = sizes[s];
            int patterns = f.T == 1;
            f.score = ATT_SCORE_DOT;
            f.stream = 1;
            f.Hq = f.H;
            f.Bk = f.Bv = 1;          /* every query sequence on one cache */
            f.causal = s == 3;
            snprintf(c->what, sizeof c->what, "16-bit decode store=%d B=%td "
                     "Tq=%td T=%td H=%td Hv=%td", store, f.B, f.Tq, f.T, f.H,
                     f.Hv);
            c->shapes++;
            ptrdiff_t nk = f.T * f.H, nv = f.T * f.Hv, nq = f.B * f.Tq * f.H;
            uint16_t *k16 = xmalloc((size_t)(nk + nv) * sizeof(uint16_t));
            uint16_t *v16 = k16 + nk;
            float *wide = xmalloc((size_t)(nk + nv + nq) * sizeof(float));
            float *q = wide + nk + nv;
            for (ptrdiff_t i = 0; i < nk + nv; i++) {
                float x;
                do {        /* a random pattern, finite; or every one */
                    k16[i] = patterns && i >= nk ? (uint16_t)(i - nk)
                             : (uint16_t)next_u64(c);
                    x = att_half_at(store, k16, i);
                } while (!(patterns && i >= nk) && !(fabsf(x) <= 8));
                wide[i] = x;
            }
            for (ptrdiff_t i = 0; i < nq; i++) {
                q[i] = patterns ? 1 : (float)(2 * uniform(c) - 1);
            }
            ptrdiff_t *kidx = xmalloc((size_t)f.B * sizeof(ptrdiff_t));
            ptrdiff_t off[1] = {0};
            memset(kidx, 0, (size_t)f.B * sizeof(ptrdiff_t));
            att_family_in_f32 in[2] = {
                {.query = q, .keys = (const float *)(const void *)k16,
                 .values = (const float *)(const void *)v16, .kidx = kidx,
                 .vidx = kidx, .koff = off, .voff = off, .scale = 0.25f,
                 .kstore = store, .vstore = store},
                {.query = q, .keys = wide, .values = wide + nk,
                 .kidx = kidx, .vidx = kidx, .koff = off, .voff = off,
                 .scale = 0.25f}};
            float *out[2], *lse[2];
            att_exec ex = {c->simd, 2, c->pool, ATT_PRECISION_IEEE, 0};
            for (int k = 0; k < 2; k++) {
                out[k] = xmalloc((size_t)(f.B * f.Tq * f.Hv) * sizeof(float));
                lse[k] = xmalloc((size_t)(f.B * f.Tq) * sizeof(float));
                att_family_out_f32 fo = {.out = out[k], .lse = lse[k]};
                ptrdiff_t bytes = att_family_workspace_f32(&f, 0, &ex);
                void *work = xmalloc(bytes > 0 ? (size_t)bytes : 1);
                int st = att_family_forward_f32(&f, &ex, &in[k], &fo, work);
                c->calls++;
                expect(c, st == ATT_OK, "forward %d returned %d", k, st);
                free(work);
            }
            size_t n = (size_t)(f.B * f.Tq * f.Hv);
            expect(c, memcmp(out[0], out[1], n * sizeof(float)) == 0 &&
                      memcmp(lse[0], lse[1], (size_t)(f.B * f.Tq) *
                             sizeof(float)) == 0,
                   "16-bit rows differ from the widened ones");
            for (size_t i = 0; patterns && i < n; i++) {
                float x = out[0][i], w = wide[nk + (ptrdiff_t)i];
                if (!(x == w || (isnan(x) && isnan(w)))) {
                    expect(c, 0, "pattern %zu widened to %a, not %a", i,
                           (double)x, (double)w);
                    break;
                }
            }
            for (int k = 0; k < 2; k++) {
                free(out[k]);
                free(lse[k]);
            }
            free(k16);
            free(wide);
            free(kidx);
        }
    }
}

/* att_cache_attention on an int8 cache (ATT_STORE_Q8) against the same
 * call on the float cache it stands for (scale times value, one product
 * each), bit for bit on the path under test: groups of 8, 16, 32 and 64
 * (on and off the vectors: dequantized as loaded or widened first), float
 * and binary16 scales, ragged lengths, Tq 1 and 3, GQA. */
static void check_cache_q8(ctx *c)
{
    static const ptrdiff_t groups[] = {8, 16, 32, 64};
    enum { B = 3, S = 300, HQ = 8, HKV = 2, D = 64 };
    static const int64_t lens[B] = {300, 17, 129};
    const ptrdiff_t nel = (ptrdiff_t)B * S * HKV * D;
    int8_t *q8 = xmalloc((size_t)(2 * nel));
    float *wide = xmalloc((size_t)(2 * nel) * sizeof(float));
    float *sc = xmalloc((size_t)(2 * nel / 8) * sizeof(float));
    uint16_t *sc16 = xmalloc((size_t)(2 * nel / 8) * sizeof(uint16_t));
    float *query = xmalloc((size_t)(B * 3 * HQ * D) * sizeof(float));
    float *out[2], *lse[2];
    for (int k = 0; k < 2; k++) {
        out[k] = xmalloc((size_t)(B * 3 * HQ * D) * sizeof(float));
        lse[k] = xmalloc((size_t)(B * 3 * HQ) * sizeof(float));
    }
    for (ptrdiff_t i = 0; i < 2 * nel; i++) {
        q8[i] = (int8_t)((int)(next_u64(c) % 255) - 127);
    }
    for (ptrdiff_t i = 0; i < B * 3 * HQ * D; i++) {
        query[i] = (float)(2 * uniform(c) - 1);
    }
    for (size_t gi = 0; gi < sizeof groups / sizeof groups[0]; gi++) {
        for (int half = 0; half < 2; half++) {
            ptrdiff_t g = groups[gi], ng = D / g, ns = 2 * nel / g;
            for (ptrdiff_t i = 0; i < ns; i++) {
                sc16[i] = att_f32_to_f16((float)(uniform(c) / 64));
                sc[i] = half ? att_f16_to_f32(sc16[i])
                             : (float)(uniform(c) / 64);
            }
            for (ptrdiff_t i = 0; i < 2 * nel; i++) {
                wide[i] = sc[i / g] * (float)q8[i];
            }
            for (ptrdiff_t tq = 1; tq <= 3; tq += 2) {
                snprintf(c->what, sizeof c->what, "int8 cache group=%td "
                         "binary16 scales=%d Tq=%td", g, half, tq);
                c->shapes++;
                att_cache_dims cd = {.B = B, .Tq = tq, .Hq = HQ, .Hkv = HKV,
                                     .d = D, .dv = D, .nblocks = B,
                                     .block = S, .maxblocks = 1,
                                     .causal = 1, .wleft = -1,
                                     .wright = -1};
                att_cache_in_f32 in = {
                    .query = query, .qbs = tq * HQ * D, .qis = HQ * D,
                    .qhs = D, .kbs = S * HKV * D, .krs = HKV * D, .khs = D,
                    .vbs = S * HKV * D, .vrs = HKV * D, .vhs = D,
                    .lens = lens, .scale = 0.125f};
                att_exec ex = {c->simd, 2, c->pool, ATT_PRECISION_IEEE, 0};
                for (int k = 0; k < 2; k++) {
                    in.kc = k ? (const void *)wide : (const void *)q8;
                    in.vc = k ? (const void *)(wide + nel)
                              : (const void *)(q8 + nel);
                    in.kstore = in.vstore = k ? ATT_STORE_NATIVE
                                              : ATT_STORE_Q8;
                    in.kscale = k ? NULL : half ? (const void *)sc16
                                                : (const void *)sc;
                    in.vscale = k ? NULL
                                : half ? (const void *)(sc16 + nel / g)
                                       : (const void *)(sc + nel / g);
                    in.kscale16 = in.vscale16 = half;
                    in.ksbs = in.vsbs = S * HKV * ng;
                    in.ksrs = in.vsrs = HKV * ng;
                    in.kshs = in.vshs = ng;
                    in.kgroup = in.vgroup = g;
                    ptrdiff_t bytes = att_cache_workspace_f32(&cd, &in, &ex);
                    void *work = xmalloc(bytes > 0 ? (size_t)bytes : 1);
                    int st = att_cache_attention_f32(&cd, &ex, &in, out[k],
                                                     lse[k], work);
                    c->calls++;
                    expect(c, st == ATT_OK, "call %d returned %d", k, st);
                    free(work);
                }
                expect(c, memcmp(out[0], out[1], (size_t)(B * tq * HQ * D) *
                                 sizeof(float)) == 0 &&
                          memcmp(lse[0], lse[1], (size_t)(B * tq * HQ) *
                                 sizeof(float)) == 0,
                       "int8 rows differ from the dequantized ones");
            }
        }
    }
    for (int k = 0; k < 2; k++) {
        free(out[k]);
        free(lse[k]);
    }
    free(q8);
    free(wide);
    free(sc);
    free(sc16);
    free(query);
}

/* att_convert16 on the path under test against the scalar path, bit for
 * bit: every 16-bit pattern widened (NaN: both NaN), random and edge
 * floats rounded, lengths off the vectors. */
static void check_convert16(ctx *c)
{
    enum { N = 65536 + 13 };
    uint16_t *h = xmalloc(N * sizeof(uint16_t));
    uint16_t *h2 = xmalloc(N * sizeof(uint16_t));
    float *f = xmalloc(N * sizeof(float)), *f2 = xmalloc(N * sizeof(float));
    for (int store = ATT_STORE_BF16; store <= ATT_STORE_F16; store++) {
        snprintf(c->what, sizeof c->what, "convert16 store=%d", store);
        for (ptrdiff_t i = 0; i < N; i++) {
            h[i] = (uint16_t)i;
        }
        int st = att_convert16(c->simd, store, 1, N, h, f) |
                 att_convert16(ATT_SIMD_SCALAR, store, 1, N, h, f2);
        long bad = 0;
        for (ptrdiff_t i = 0; i < N; i++) {
            bad += !(isnan(f[i]) ? isnan(f2[i])
                     : memcmp(f + i, f2 + i, sizeof(float)) == 0);
        }
        expect(c, st == ATT_OK && bad == 0, "widening: %ld differ", bad);
        for (ptrdiff_t i = 0; i < N; i++) {
            uint32_t u = (uint32_t)next_u64(c);
            if (i % 7 == 0) {       /* near 1 and near float16's edges */
                u = (i % 3 ? 0x3f800000u : 0x477fe000u) + (u & 0x3fffu);
            }
            memcpy(f + i, &u, sizeof u);
        }
        st = att_convert16(c->simd, store, 0, N, f, h) |
             att_convert16(ATT_SIMD_SCALAR, store, 0, N, f, h2);
        expect(c, st == ATT_OK && memcmp(h, h2, N * sizeof(uint16_t)) == 0,
               "rounding differs from the scalar path's");
        st = att_convert16(c->simd, store, 0, 17, f + 3, h + 1);
        expect(c, st == ATT_OK && memcmp(h + 1, h2 + 3, 17 * 2) == 0,
               "17 elements off the vectors differ");
    }
    free(h);
    free(h2);
    free(f);
    free(f2);
}

int main(int argc, char **argv)
{
    ctx c;
    memset(&c, 0, sizeof c);
    c.verbose = argc > 1 && strcmp(argv[1], "-v") == 0;
    c.pool = att_pool_new(2);
    if (c.pool == NULL || att_pool_threads(c.pool) != 2) {
        fprintf(stderr, "check: cannot start a pool of 2 threads\n");
        return 2;
    }
    check_paths(&c);
    check_fma_loop(&c);
    int paths = 0;
    for (int simd = ATT_SIMD_AVX2; simd <= ATT_SIMD_NEON; simd++) {
        if (!att_simd_supported(simd)) {
            continue;
        }
        paths++;
        c.simd = simd;
        c.rng = 12345;
        long before = c.passed + c.failed;
        run_all_f32(&c);
        run_all_f64(&c);
        check_keep_rows(&c);
        check_half_decode(&c);
        check_cache_q8(&c);
        check_convert16(&c);
        check_bf16(&c);
        check_stored16_float(&c);
        printf("%s: %ld checks on %ld shapes (%ld kernel calls)\n",
               simd_names[simd], c.passed + c.failed - before, c.shapes,
               c.calls);
        c.shapes = c.calls = 0;
    }
    if (paths == 0) {
        fprintf(stderr, "check: this CPU runs no SIMD path to check\n");
        att_pool_free(c.pool);
        return 2;
    }
    att_pool_free(c.pool);
    printf("%ld passed, %ld failed\n", c.passed, c.failed);
    return c.failed ? 1 : 0;
}
