/*
 * fast_impl.h - the blocked SIMD path for one floating type and one
 * instruction set.
 *
 * fast_avx512.c, fast_avx2.c and fast_neon.c include this file once per
 * type, with
 *   REAL, FSFX(x)            the type and the names' suffix (_f32_avx512 ...)
 *   VEC, VLEN, MR            vector type, lanes, rows of the micro-tile
 *   VZERO VSET1 VLOAD VSTORE VADD VSUB VMUL VDIV VFMA VMAX VAND VREDUCE
 *   VSCALE VABS VCOPYSIGN    thin wrappers of the intrinsics
 *   REAL_DIGITS              bits of the significand (24, 53): picks the
 *                            constants of the vector math below
 * and #undefs them all at its end.  Not a public header.
 *
 * The layer's cost is the product Z = H_valid W_h^T (n x A per sequence).
 * It runs as a GotoBLAS-style loop: W_h^T is packed once per call into
 * panels of NR = 2 VLEN columns; valid rows of h are gathered, MC at a
 * time, into micro-panels of MR rows; a register-tiled micro-kernel
 * computes an MR x NR tile of Z over the whole K = H (a panel of W_h^T,
 * K x NR, stays in L1/L2).  The tile is consumed at once by an epilogue:
 * the forward adds q = W_c c + b, applies tanh and dots with v; the
 * backward also forms eps = ds v (1 - u^2).  So the n x A activations
 * never reach memory in the forward, and only MCB x A of them per block in
 * the backward, where eps feeds two more products (dW_h and dh) that run
 * through the same micro-kernel.
 *
 * Assumptions: packed buffers are 64-byte aligned (carved from the
 * workspace); K loops need no unrolling beyond what the compiler does;
 * masked rows are never loaded into the product, so NaN in padding stays
 * out, and padded columns are cleared with a lane mask before they can
 * turn inf * 0 into NaN.
 */

/* Constants of the vector math, by type */
#if REAL_DIGITS == 24
/* expm1(r) = r + r^2 t(r) on |r| <= ln2/2 with t of degree 4, fitted
 * (Lawson's iteration) for relative error 1.3e-8 (0.2 ulp) in expm1 */
#define EXPM1_COEFS {0.49999998155020553f, 0.1666654366696324f,         \
                     0.041667199686921466f, 0.008366514313475985f,       \
                     0.001388252050197691f}
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.42860676533018e-06f
#define TANH_CLAMP 40.0f
#define EXP_MIN -87.0f
#else
#define EXPM1_DEGREE 13
#define LN2_HI 6.93147180369123816490e-01
#define LN2_LO 1.90821492927058770002e-10
#define TANH_CLAMP 80.0
#define EXP_MIN -708.0
#endif

#define NR (2 * VLEN)
#define MC (10 * MR)
/* The backward's blocks: at most MCB rows, split evenly (each block adds
 * its share into dW_h once, so fewer, fuller blocks move less memory) */
#define MCB (2 * MC)

/* The formulas the scalar path shares (kernels_impl.h), with this type's
 * and instruction set's names */
#define FML FSFX
#include "formulas.h"

/* ---------------------------------------------------------------------
 * Vector math.  expm1 is accurate to ~1 ulp over y <= 0 (Cody-Waite
 * reduction y = n ln2 + r, |r| <= ln2/2, then a Taylor polynomial of r);
 * tanh and exp are built on it, so tanh keeps full relative accuracy at
 * small |x| where 1 - 2/(e^2x + 1) would cancel.
 */

/* y = n ln2 + r with n integral and |r| <= ln2/2; returns n and sets
 * *p = expm1(r).  n is rounded by adding and removing 1.5 2^(digits - 1)
 * (|y / ln2| is far below that for every caller). */
static inline VEC FSFX(v_reduce)(VEC y, VEC *p)
{
    const REAL shifter = (REAL)1.5 * (REAL)(1ULL << (REAL_DIGITS - 1));
    VEC n = VSUB(VFMA(y, VSET1((REAL)1.4426950408889634), VSET1(shifter)),
                 VSET1(shifter));
    VEC r = VFMA(n, VSET1(-LN2_HI), y);
    r = VFMA(n, VSET1(-LN2_LO), r);
#ifdef EXPM1_COEFS
    /* t ~ (expm1(r) - r) / r^2: a near-minimax fit (see EXPM1_COEFS) */
    static const REAL coefs[] = EXPM1_COEFS;
    const int ncoefs = (int)(sizeof(coefs) / sizeof(coefs[0]));
    VEC t = VSET1(coefs[ncoefs - 1]);
    for (int k = ncoefs - 2; k >= 0; k--) {
        t = VFMA(t, r, VSET1(coefs[k]));
    }
#else
    /* t = sum_{k>=2} r^(k-2) / k!, Horner from the highest degree */
    REAL coef = 1;
    for (int k = 2; k <= EXPM1_DEGREE; k++) {
        coef /= (REAL)k;
    }
    VEC t = VSET1(coef);
    for (int k = EXPM1_DEGREE; k > 2; k--) {
        coef *= (REAL)k;
        t = VFMA(t, r, VSET1(coef));
    }
#endif
    *p = VFMA(t, VMUL(r, r), r);              /* expm1(r) = r + r^2 t */
    return n;
}

/* expm1(y) for y in [-TANH_CLAMP, 0] or NaN (the callers clamp). */
static inline VEC FSFX(v_expm1_neg)(VEC y)
{
    VEC p, n = FSFX(v_reduce)(y, &p);
    VEC s = VSCALE(VSET1(1), n);              /* 2^n */
    return VFMA(s, p, VSUB(s, VSET1(1)));     /* 2^n expm1(r) + 2^n - 1 */
}

/* tanh(x) = sign(x) * -e / (2 + e), e = expm1(-2|x|); exact at 0 and
 * +-inf, NaN stays NaN. */
static inline VEC FSFX(v_tanh)(VEC x)
{
    /* VMAX(a, b) returns b when either is NaN: a NaN x survives */
    VEC y = VMAX(VSET1(-TANH_CLAMP), VMUL(VSET1(-2), VABS(x)));
    VEC e = FSFX(v_expm1_neg)(y);
    VEC t = VDIV(e, VSUB(VSET1(-2), e));     /* -e / (2 + e), 2 + e >= 1 */
    return VCOPYSIGN(t, x);
}

/* exp(y) = 2^n (1 + expm1(r)) for y <= 0 (softmax: y = s - M); y below
 * EXP_MIN (where exp is at most the least normal) is raised to it. */
static inline VEC FSFX(v_exp_neg)(VEC y)
{
    VEC p, n = FSFX(v_reduce)(VMAX(VSET1(EXP_MIN), y), &p);
    return VSCALE(VADD(p, VSET1(1)), n);
}

/* dot(x, y) of length n, VLEN lanes at a time. */
static REAL FSFX(v_dot)(ptrdiff_t n, const REAL *x, const REAL *y)
{
    VEC acc0 = VZERO(), acc1 = VZERO();
    ptrdiff_t i = 0;
    for (; i + 2 * VLEN <= n; i += 2 * VLEN) {
        acc0 = VFMA(VLOAD(x + i), VLOAD(y + i), acc0);
        acc1 = VFMA(VLOAD(x + i + VLEN), VLOAD(y + i + VLEN), acc1);
    }
    for (; i + VLEN <= n; i += VLEN) {
        acc0 = VFMA(VLOAD(x + i), VLOAD(y + i), acc0);
    }
    REAL tail = 0;
    for (; i < n; i++) {
        tail += x[i] * y[i];
    }
    return VREDUCE(VADD(acc0, acc1)) + tail;
}

/* ---------------------------------------------------------------------
 * Micro-kernel and packing
 */

/* The register tile: MR rows x 2 vectors of accumulators c0, c1 from
 * zero, updated by c[r] += a(r, k) b(k) for k < K, a(r, k) read through
 * A_AT(r, k), b(k) at B_AT(k) (also the tiles of fast_ops_impl.h) */
#define TILE_ACCUMULATE(A_AT, B_AT)                                          \
    VEC c0[MR], c1[MR];                                                      \
    for (int r = 0; r < MR; r++) {                                           \
        c0[r] = VZERO();                                                     \
        c1[r] = VZERO();                                                     \
    }                                                                        \
    for (ptrdiff_t k = 0; k < K; k++) {                                      \
        const REAL *bk = B_AT(k);                                            \
        VEC b0 = VLOAD(bk), b1 = VLOAD(bk + VLEN);                           \
        for (int r = 0; r < MR; r++) {                                       \
            VEC a = VSET1(A_AT(r, k));                                       \
            c0[r] = VFMA(a, b0, c0[r]);                                      \
            c1[r] = VFMA(a, b1, c1[r]);                                      \
        }                                                                    \
    }

/* ... then stored to the tile (MR x NR, row-major).  Unrolled on
 * purpose: left as a loop, GCC for AArch64 keeps the accumulators in
 * memory and stores them on every k step of the loop above. */
#define MICRO_KERNEL_BODY(A_AT, B_AT)                                        \
    TILE_ACCUMULATE(A_AT, B_AT)                                              \
    _Pragma("GCC unroll 16")                                                 \
    for (int r = 0; r < MR; r++) {                                           \
        VSTORE(tile + r * NR, c0[r]);                                        \
        VSTORE(tile + r * NR + VLEN, c1[r]);                                 \
    }

/* tile (MR x NR, row-major) = A Bp for A given by MR row pointers (rows
 * of h or of eps, read in place: no packing) and Bp a packed K x NR panel.
 * Rows past the end of a block point to a row of zeros. */
static void FSFX(micro_kernel_rows)(ptrdiff_t K, const REAL *const *rows,
                                    const REAL *restrict Bp,
                                    REAL *restrict tile)
{
    const REAL *a_rows[MR];
    for (int r = 0; r < MR; r++) {
        a_rows[r] = rows[r];
    }
#define ROWS_AT(r, k) a_rows[r][k]
#define PANEL_AT(k) (Bp + (k) * NR)
    MICRO_KERNEL_BODY(ROWS_AT, PANEL_AT)
#undef ROWS_AT
}

/* The same for A packed k-major in a K x MR micro-panel Ap. */
static void FSFX(micro_kernel_packed)(ptrdiff_t K, const REAL *restrict Ap,
                                      const REAL *restrict Bp,
                                      REAL *restrict tile)
{
#define PACKED_AT(r, k) Ap[(k) * MR + (r)]
    MICRO_KERNEL_BODY(PACKED_AT, PANEL_AT)
#undef PACKED_AT
}

#undef MICRO_KERNEL_BODY

/* B panels of a K x N operand given as element (k, j) = src[j*ldj + k*ldk]
 * for k < Kvalid: Bp[p][k][c] for column j = p NR + c, zero where j >= N
 * or k >= Kvalid.  The inner loop runs along whichever index is contiguous
 * in src. */
static void FSFX(pack_B)(ptrdiff_t K, ptrdiff_t Kvalid, ptrdiff_t N,
                         const REAL *src, ptrdiff_t ldk, ptrdiff_t ldj,
                         REAL *Bp)
{
    for (ptrdiff_t p = 0; p * NR < N; p++) {
        REAL *dst = Bp + p * K * NR;
        const REAL *sp = src + p * NR * ldj;
        ptrdiff_t nc = N - p * NR < NR ? N - p * NR : NR;
        if (nc < NR || Kvalid < K) {
            memset(dst, 0, (size_t)(K * NR) * sizeof(REAL));
        }
        if (ldj == 1) {
            for (ptrdiff_t k = 0; k < Kvalid; k++) {
                for (ptrdiff_t c = 0; c < nc; c++) {
                    dst[k * NR + c] = sp[k * ldk + c];
                }
            }
        }
        else {
            for (ptrdiff_t c = 0; c < nc; c++) {
                for (ptrdiff_t k = 0; k < Kvalid; k++) {
                    dst[k * NR + c] = sp[c * ldj + k * ldk];
                }
            }
        }
    }
}

/* ---------------------------------------------------------------------
 * Workspace: one buffer carved into 64-byte aligned parts: one ws struct
 * per thread, the parts all threads share (packed W, padded v, ...), each
 * thread's scratch, and the backward's partial parameter gradients (one
 * per chunk of sequences or segment of a sequence's rows).
 */

typedef struct {
    /* shared by all threads, written once per call (segsums: by the
     * backward's segment tasks, one slot each) */
    ptrdiff_t Apad, Hpad, nA, nH;     /* padded sizes, panels of A and H */
    REAL *Bz;        /* W_h^T panels (H x Apad): Z = h W_h^T            */
    REAL *Bc;        /* W_c^T panels (H x Apad): q = W_c c + b          */
    REAL *Bd;        /* W_h panels (Apad x Hpad): dh = eps W_h           */
    REAL *vp, *colmask;   /* (Apad) v padded; lane mask of real columns  */
    REAL *zero;      /* (max(H, Apad)) zeros: the rows past a block's end */
    double *segsums; /* (partials x 2 Apad) E and dv of each segment of a
                        sequence whose rows are split (backward)         */
    /* this thread's */
    REAL *q, *E, *dv;     /* (Apad) each                                 */
    double *sums;         /* (2 Apad) E and dv of a sequence, in double  */
    REAL *c, *dc;    /* (H)                                              */
    REAL *sbuf;      /* (T + MR) scores or ds of the valid rows; the MR
                        past the end absorb a partial last micro-panel   */
    REAL *tile;      /* (MR x NR)                                        */
    REAL *sacc;      /* (MC x VLEN) score accumulators of a block's rows */
    REAL *eps;       /* eps of a block (MC x Apad), row-major            */
    REAL *AeT;       /* eps^T as A micro-panels (Apad + MR) x MC        */
    REAL *Bh;        /* one panel of a block's h rows, packed (MCB x NR)   */
    const REAL **rows;   /* (MCB + MR) row pointers of a block           */
    ptrdiff_t *idx;      /* (T) indices of the valid items               */
} FSFX(ws);

/* The backward's partial parameter gradients (dW, dv, db): the work is
 * summed in at most this many groups (chunks of sequences, or segments of
 * a sequence's rows), each into its own partial, then the partials in
 * order; the grouping depends on the sizes only, so results do not depend
 * on the thread count.  The partials together take at most CHUNK_BYTES
 * when W is large (beyond glibc's largest mmap threshold, 32 MiB, each
 * call would fault in fresh pages), but there are always two, for two
 * threads.  The count is a power of two: the pool hands whole groups to
 * threads, and 3 groups on 2 threads would leave one idle a third of the
 * time. */
#define MAX_CHUNKS 8
#define CHUNK_BYTES ((size_t)16 << 20)

static ptrdiff_t FSFX(n_partials)(att_dims d)
{
    double bytes = (double)d.A * (double)(2 * d.H + 2) * sizeof(REAL);
    ptrdiff_t fit = (ptrdiff_t)((double)CHUNK_BYTES / (bytes + 1)), n = 2;
    while (2 * n <= fit && 2 * n <= MAX_CHUNKS) {
        n *= 2;
    }
    return n;
}

/* Carves the workspace for `threads` threads from base (or only counts
 * when base is NULL); sets *wsp to the ws structs and *partials to the
 * chunk gradients.  Returns the bytes needed, 0 when a size overflows. */
static size_t FSFX(ws_carve)(att_dims d, int backward, int threads,
                             char *base, FSFX(ws) **wsp, REAL **partials)
{
    const size_t align = 64;
    size_t used = 0;
    ptrdiff_t Apad = (d.A + NR - 1) / NR * NR;
    ptrdiff_t Hpad = (d.H + NR - 1) / NR * NR;
    ptrdiff_t npartials = backward ? FSFX(n_partials)(d) : 0;
    ptrdiff_t chunk = npartials * (d.A * 2 * d.H + 2 * Apad);
    /* every count below is at most a product of two sizes the caller
     * already holds in memory, times a small constant */
    if (d.H > PTRDIFF_MAX / 64 / (Apad + 1) || Hpad > PTRDIFF_MAX / 64 /
        (Apad + 1) || d.T > PTRDIFF_MAX / 64 / MAX_CHUNKS ||
        threads < 1 || threads > 1024) {
        return 0;
    }
    FSFX(ws) w0;
    FSFX(ws) *ws = base ? (FSFX(ws) *)base : &w0;
    used += ((size_t)threads * sizeof(FSFX(ws)) + align - 1) / align * align;
    for (int t = -1; t < threads; t++) {
        FSFX(ws) *w = &ws[t < 0 ? 0 : (base ? t : 0)];
        /* t = -1: the shared parts; t >= 0: thread t's parts */
        struct { void *slot; ptrdiff_t n; size_t size; } shared[] = {
            {&w->Bz, d.H * Apad, sizeof(REAL)},
            {&w->Bc, d.H * Apad, sizeof(REAL)},
            {&w->Bd, backward ? Apad * Hpad : 0, sizeof(REAL)},
            {&w->vp, Apad, sizeof(REAL)},
            {&w->colmask, Apad, sizeof(REAL)},
            {&w->zero, d.H > Apad ? d.H : Apad, sizeof(REAL)},
            {partials, chunk, sizeof(REAL)},
            {&w->segsums, npartials * 2 * Apad, sizeof(double)},
        }, own[] = {
            {&w->q, Apad, sizeof(REAL)}, {&w->E, Apad, sizeof(REAL)},
            {&w->dv, Apad, sizeof(REAL)},
            {&w->sums, backward ? 2 * Apad : 0, sizeof(double)},
            {&w->c, d.H, sizeof(REAL)}, {&w->dc, d.H, sizeof(REAL)},
            {&w->sbuf, d.T + MR, sizeof(REAL)},
            {&w->tile, MR * NR, sizeof(REAL)},
            {&w->sacc, MC * VLEN, sizeof(REAL)},
            {&w->eps, backward ? MCB * Apad : 0, sizeof(REAL)},
            {&w->AeT, backward ? (Apad + MR) * MCB : 0, sizeof(REAL)},
            {&w->Bh, backward ? MCB * NR : 0, sizeof(REAL)},
            {&w->rows, MCB + MR, sizeof(REAL *)},
            {&w->idx, d.T, sizeof(ptrdiff_t)},
        };
        size_t nparts = t < 0 ? sizeof(shared) / sizeof(shared[0])
                              : sizeof(own) / sizeof(own[0]);
        for (size_t i = 0; i < nparts; i++) {
            size_t bytes = (size_t)(t < 0 ? shared : own)[i].n *
                           (t < 0 ? shared : own)[i].size;
            if (base != NULL) {
                *(void **)(t < 0 ? shared : own)[i].slot = base + used;
            }
            used += (bytes + align - 1) / align * align;
        }
    }
    if (base != NULL) {
        for (int t = 0; t < threads; t++) {
            FSFX(ws) *w = &ws[t];
            /* every thread sees the shared parts */
            w->Bz = ws[0].Bz;
            w->Bc = ws[0].Bc;
            w->Bd = ws[0].Bd;
            w->vp = ws[0].vp;
            w->colmask = ws[0].colmask;
            w->zero = ws[0].zero;
            w->segsums = ws[0].segsums;
            w->Apad = Apad;
            w->Hpad = Hpad;
            w->nA = Apad / NR;
            w->nH = Hpad / NR;
        }
        *wsp = ws;
    }
    return used + align;   /* slack to align the base itself */
}

static FSFX(ws) *FSFX(ws_init)(att_dims d, int backward, int threads,
                               void *work, REAL **partials)
{
    char *base = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    FSFX(ws) *ws = NULL;
    REAL *unused;
    FSFX(ws_carve)(d, backward, threads, base, &ws,
                   partials ? partials : &unused);
    return ws;
}

size_t FSFX(att_fast_workspace)(att_dims d, int backward, int threads)
{
    FSFX(ws) *ws;
    REAL *partials;
    return FSFX(ws_carve)(d, backward, threads, NULL, &ws, &partials);
}

/* Per-call setup shared by both directions: packed W_h^T, padded v and
 * the lane mask of real columns (all bits set, or zero past A). */
static void FSFX(setup)(att_dims d, const REAL *W, const REAL *v,
                        FSFX(ws) *w)
{
    FSFX(pack_B)(d.H, d.H, d.A, W, 1, 2 * d.H, w->Bz);
    FSFX(pack_B)(d.H, d.H, d.A, W + d.H, 1, 2 * d.H, w->Bc);
    for (ptrdiff_t k = 0; k < (d.H > w->Apad ? d.H : w->Apad); k++) {
        w->zero[k] = 0;
    }
    for (ptrdiff_t a = 0; a < w->Apad; a++) {
        REAL ones;
        memset(&ones, a < d.A ? 0xff : 0, sizeof ones);
        w->vp[a] = a < d.A ? v[a] : 0;
        w->colmask[a] = ones;
    }
}

/* Per-sequence setup: the valid rows, c, q = W_c c + b.  Returns n. */
static ptrdiff_t FSFX(seq_setup)(att_dims d, const REAL *h,
                                 const unsigned char *m, const REAL *b,
                                 FSFX(ws) *w)
{
    ptrdiff_t n = 0;
    for (ptrdiff_t t = 0; t < d.T; t++) {
        if (m == NULL || m[t]) {
            w->idx[n++] = t;
        }
    }
    FSFX(seq_mean)(d.T, d.H, h, m, w->c);
    /* q (Apad) = c^T W_c^T, a row times the packed panels, + b */
    for (ptrdiff_t p = 0; p < w->nA; p++) {
        const REAL *Bp = w->Bc + p * d.H * NR;
        VEC q0 = VZERO(), q1 = VZERO();
        for (ptrdiff_t k = 0; k < d.H; k++) {
            VEC ck = VSET1(w->c[k]);
            q0 = VFMA(ck, VLOAD(Bp + k * NR), q0);
            q1 = VFMA(ck, VLOAD(Bp + k * NR + VLEN), q1);
        }
        VSTORE(w->q + p * NR, q0);
        VSTORE(w->q + p * NR + VLEN, q1);
    }
    for (ptrdiff_t a = 0; b != NULL && a < d.A; a++) {
        w->q[a] += b[a];
    }
    return n;
}

/* ---------------------------------------------------------------------
 * Epilogues: consume one MR x NR tile of Z for rows r of a block and
 * columns of panel p.
 */

/* sacc_r += v_c tanh(z_rc + q_c), lane-wise: each row's score is the sum
 * of its VLEN lanes, reduced once after the last panel.  In a panel with
 * padded columns (their W and v are 0) the lane mask clears u there, lest
 * an inf in h make inf * 0 = NaN. */
static void FSFX(epi_scores)(REAL *tile, const REAL *q, const REAL *v,
                             const REAL *mask, int padded, REAL *sacc,
                             int keep_u)
{
    VEC q0 = VLOAD(q), q1 = VLOAD(q + VLEN);
    VEC v0 = VLOAD(v), v1 = VLOAD(v + VLEN);
    VEC m0 = VLOAD(mask), m1 = VLOAD(mask + VLEN);
    for (int r = 0; r < MR; r++) {
        VEC u0 = FSFX(v_tanh)(VADD(VLOAD(tile + r * NR), q0));
        VEC u1 = FSFX(v_tanh)(VADD(VLOAD(tile + r * NR + VLEN), q1));
        if (padded) {
            u0 = VAND(u0, m0);
            u1 = VAND(u1, m1);
        }
        VEC acc = VFMA(u0, v0, VLOAD(sacc + r * VLEN));
        VSTORE(sacc + r * VLEN, VFMA(u1, v1, acc));
        if (keep_u) {             /* the tile now holds u = tanh(z + q) */
            VSTORE(tile + r * NR, u0);
            VSTORE(tile + r * NR + VLEN, u1);
        }
    }
}

/* Points rows[0 .. mc) at the given rows and the rest of the last
 * micro-panel at the zero row. */
static void FSFX(block_rows)(ptrdiff_t mc, FSFX(ws) *w)
{
    for (ptrdiff_t i = mc; i < (mc + MR - 1) / MR * MR; i++) {
        w->rows[i] = w->zero;
    }
}

/* u = tanh(z + q);  dv += sum_r ds_r u_r;  eps_r = ds_r v (1 - u_r^2);
 * E += sum_r eps_r; eps rows stored row-major with stride ld. */
static void FSFX(epi_backward)(const REAL *tile, int tile_is_u,
                               const REAL *q, const REAL *v,
                               const REAL *mask, const REAL *ds, REAL *dv,
                               REAL *E, REAL *eps, ptrdiff_t ld)
{
    VEC q0 = VLOAD(q), q1 = VLOAD(q + VLEN);
    VEC v0 = VLOAD(v), v1 = VLOAD(v + VLEN);
    VEC m0 = VLOAD(mask), m1 = VLOAD(mask + VLEN);
    VEC dv0 = VZERO(), dv1 = VZERO(), E0 = VZERO(), E1 = VZERO();
    VEC one = VSET1(1);
    for (int r = 0; r < MR; r++) {
        VEC g = VSET1(ds[r]), u0, u1;
        if (tile_is_u) {
            u0 = VLOAD(tile + r * NR);
            u1 = VLOAD(tile + r * NR + VLEN);
        }
        else {
            u0 = VAND(FSFX(v_tanh)(VADD(VLOAD(tile + r * NR), q0)), m0);
            u1 = VAND(FSFX(v_tanh)(VADD(VLOAD(tile + r * NR + VLEN), q1)),
                      m1);
        }
        dv0 = VFMA(g, u0, dv0);
        dv1 = VFMA(g, u1, dv1);
        VEC e0 = VMUL(VMUL(g, v0), VSUB(one, VMUL(u0, u0)));
        VEC e1 = VMUL(VMUL(g, v1), VSUB(one, VMUL(u1, u1)));
        E0 = VADD(E0, e0);
        E1 = VADD(E1, e1);
        VSTORE(eps + r * ld, e0);
        VSTORE(eps + r * ld + VLEN, e1);
    }
    VSTORE(dv, VADD(VLOAD(dv), dv0));
    VSTORE(dv + VLEN, VADD(VLOAD(dv + VLEN), dv1));
    VSTORE(E, VADD(VLOAD(E), E0));
    VSTORE(E + VLEN, VADD(VLOAD(E + VLEN), E1));
}

/* rows[i][j] = tile[i][j] (to_tile = 0) or tile[i][j] = rows[i][j], zero
 * past mrows x ncols (to_tile = 1): moves u between a tile and act. */
static void FSFX(tile_copy)(REAL *tile, ptrdiff_t mrows, ptrdiff_t ncols,
                            REAL *const *rows, int to_tile)
{
    if (mrows == MR && ncols >= NR) {
        for (int i = 0; i < MR; i++) {
            REAL *src = to_tile ? rows[i] : tile + i * NR;
            REAL *dst = to_tile ? tile + i * NR : rows[i];
            VSTORE(dst, VLOAD(src));
            VSTORE(dst + VLEN, VLOAD(src + VLEN));
        }
        return;
    }
    for (ptrdiff_t i = 0; i < MR; i++) {
        for (ptrdiff_t j = 0; j < NR; j++) {
            int in = i < mrows && j < ncols;
            if (to_tile) {
                tile[i * NR + j] = in ? rows[i][j] : 0;
            }
            else if (in) {
                rows[i][j] = tile[i * NR + j];
            }
        }
    }
}

/* dst[i][j] += tile[i][j] for i < mrows, j < ncols; row i at rows[i]. */
static void FSFX(epi_add)(const REAL *tile, ptrdiff_t mrows, ptrdiff_t ncols,
                          REAL *const *rows)
{
    if (ncols >= NR) {
        for (ptrdiff_t i = 0; i < mrows; i++) {
            VSTORE(rows[i], VADD(VLOAD(rows[i]), VLOAD(tile + i * NR)));
            VSTORE(rows[i] + VLEN, VADD(VLOAD(rows[i] + VLEN),
                                        VLOAD(tile + i * NR + VLEN)));
        }
        return;
    }
    for (ptrdiff_t i = 0; i < mrows; i++) {
        for (ptrdiff_t j = 0; j < ncols; j++) {
            rows[i][j] += tile[i * NR + j];
        }
    }
}

/* dst[i][j] = alpha_i g_j + tile[i][j] for i < mrows, j < ncols. */
static void FSFX(epi_dh)(const REAL *tile, ptrdiff_t mrows, ptrdiff_t ncols,
                         const REAL *alpha, const REAL *g, REAL *const *rows)
{
    if (ncols >= NR) {
        VEC g0 = VLOAD(g), g1 = VLOAD(g + VLEN);
        for (ptrdiff_t i = 0; i < mrows; i++) {
            VEC a = VSET1(alpha[i]);
            VSTORE(rows[i], VFMA(a, g0, VLOAD(tile + i * NR)));
            VSTORE(rows[i] + VLEN, VFMA(a, g1, VLOAD(tile + i * NR + VLEN)));
        }
        return;
    }
    for (ptrdiff_t i = 0; i < mrows; i++) {
        for (ptrdiff_t j = 0; j < ncols; j++) {
            rows[i][j] = alpha[i] * g[j] + tile[i * NR + j];
        }
    }
}

/* ---------------------------------------------------------------------
 * Per-sequence passes
 */

/* Scores of the valid rows i0 .. i0 + mc (indices idx, q = W_c c + b of
 * their sequence) into s[i0 ..]; their activations u = tanh(z) into act
 * (T, A) when it is not NULL.  Uses w's scratch only. */
static void FSFX(score_block)(att_dims d, const REAL *h, const ptrdiff_t *idx,
                              ptrdiff_t i0, ptrdiff_t mc, const REAL *q,
                              REAL *s, REAL *act, FSFX(ws) *w)
{
    for (ptrdiff_t i = 0; i < mc; i++) {
        w->rows[i] = h + idx[i0 + i] * d.H;
    }
    FSFX(block_rows)(mc, w);
    memset(w->sacc, 0, (size_t)((mc + MR - 1) / MR * MR * VLEN) *
                       sizeof(REAL));
    for (ptrdiff_t p = 0; p < w->nA; p++) {
        for (ptrdiff_t i = 0; i < mc; i += MR) {
            FSFX(micro_kernel_rows)(d.H, w->rows + i, w->Bz + p * d.H * NR,
                                    w->tile);
            FSFX(epi_scores)(w->tile, q + p * NR, w->vp + p * NR,
                             w->colmask + p * NR, (p + 1) * NR > d.A,
                             w->sacc + i * VLEN, act != NULL);
            if (act != NULL) {
                REAL *arows[MR];
                ptrdiff_t mr = mc - i < MR ? mc - i : MR;
                for (ptrdiff_t r = 0; r < mr; r++) {
                    arows[r] = act + idx[i0 + i + r] * d.A + p * NR;
                }
                FSFX(tile_copy)(w->tile, mr, d.A - p * NR, arows, 0);
            }
        }
    }
    for (ptrdiff_t i = 0; i < mc; i++) {
        s[i0 + i] = VREDUCE(VLOAD(w->sacc + i * VLEN));
    }
}

/* alpha (T) over the n valid rows idx from their scores s[0 .. n). */
static void FSFX(seq_softmax)(ptrdiff_t T, ptrdiff_t n, const ptrdiff_t *idx,
                              REAL *s, REAL *alpha)
{
    double total = 0;     /* double: see weight */
    for (ptrdiff_t t = 0; t < T; t++) {
        alpha[t] = 0;
    }
    if (n == 0) {
        return;
    }
    REAL M = FSFX(row_max)(n, s, NULL);
    ptrdiff_t i = 0;
    VEC vM = VSET1(M);
    for (; i + VLEN <= n; i += VLEN) {
        VSTORE(s + i, FSFX(v_exp_neg)(VSUB(VLOAD(s + i), vM)));
    }
    if (i < n) {
        REAL buf[VLEN];
        for (int l = 0; l < VLEN; l++) {
            buf[l] = i + l < n ? s[i + l] - M : 0;
        }
        VSTORE(buf, FSFX(v_exp_neg)(VLOAD(buf)));
        for (int l = 0; i + l < n; l++) {
            s[i + l] = buf[l];
        }
    }
    for (i = 0; i < n; i++) {
        total += s[i];
    }
    for (i = 0; i < n; i++) {
        alpha[idx[i]] = FSFX(weight)(s[i], total);
    }
}

/* ---------------------------------------------------------------------
 * The forward: one task per sequence, or, when there are few sequences,
 * one task per block of MC rows of each sequence in turn.  A row's score
 * is computed the same way whichever thread does it.
 */

typedef struct {
    att_dims d;
    const REAL *h, *W, *v, *b;
    const unsigned char *mask;
    REAL *out, *alpha, *act;
    FSFX(ws) *ws;
    ptrdiff_t seq, n;     /* block tasks: the sequence and its valid rows */
} FSFX(fwd_job);

/* Steps 1-2 of sequence i on w: valid rows, c, q; clears the masked rows
 * of act.  Returns n. */
static ptrdiff_t FSFX(fwd_start)(const FSFX(fwd_job) *j, ptrdiff_t i,
                                 FSFX(ws) *w)
{
    att_dims d = j->d;
    const unsigned char *m = j->mask ? j->mask + i * d.T : NULL;
    for (ptrdiff_t t = 0; j->act && m && t < d.T; t++) {
        if (!m[t]) {
            memset(j->act + (i * d.T + t) * d.A, 0,
                   (size_t)d.A * sizeof(REAL));
        }
    }
    return FSFX(seq_setup)(d, j->h + i * d.T * d.H, m, j->b, w);
}

/* Steps 4-5 of sequence i from the scores in w->sbuf. */
static void FSFX(fwd_finish)(const FSFX(fwd_job) *j, ptrdiff_t i,
                             ptrdiff_t n, FSFX(ws) *w)
{
    att_dims d = j->d;
    const REAL *hi = j->h + i * d.T * d.H;
    const unsigned char *m = j->mask ? j->mask + i * d.T : NULL;
    REAL *ai = j->alpha + i * d.T, *oi = j->out + i * d.H;
    /* 4. alpha = masked softmax(s) */
    FSFX(seq_softmax)(d.T, n, w->idx, w->sbuf, ai);
    /* 5. out = sum_t alpha_t h_t */
    FSFX(sum_rows)(d.T, d.H, hi, m, ai, oi);
}

static void FSFX(fwd_sequence_task)(void *arg, ptrdiff_t i, int thread)
{
    const FSFX(fwd_job) *j = arg;
    FSFX(ws) *w = &j->ws[thread];
    att_dims d = j->d;
    /* 1-2. valid rows, c = mean of them, q = W_c c + b */
    ptrdiff_t n = FSFX(fwd_start)(j, i, w);
    /* 3. s_t = v . tanh(W_h h_t + q), fused into the product */
    for (ptrdiff_t i0 = 0; i0 < n; i0 += MC) {
        FSFX(score_block)(d, j->h + i * d.T * d.H, w->idx, i0,
                          n - i0 < MC ? n - i0 : MC, w->q, w->sbuf,
                          j->act ? j->act + i * d.T * d.A : NULL, w);
    }
    FSFX(fwd_finish)(j, i, n, w);
}

/* Block task: step 3 for rows blk MC .. of sequence j->seq, whose rows
 * and q thread 0 prepared in ws[0]. */
static void FSFX(fwd_block_task)(void *arg, ptrdiff_t blk, int thread)
{
    const FSFX(fwd_job) *j = arg;
    att_dims d = j->d;
    const FSFX(ws) *w0 = &j->ws[0];
    ptrdiff_t i0 = blk * MC;
    FSFX(score_block)(d, j->h + j->seq * d.T * d.H, w0->idx, i0,
                      j->n - i0 < MC ? j->n - i0 : MC, w0->q, w0->sbuf,
                      j->act ? j->act + j->seq * d.T * d.A : NULL,
                      &j->ws[thread]);
}

int FSFX(att_fast_context_attention)(att_dims d, att_pool *pool,
                                     int threads, const REAL *h,
                                     const REAL *W, const REAL *v,
                                     const REAL *b, const unsigned char *mask,
                                     REAL *out, REAL *alpha, REAL *act,
                                     void *work)
{
    FSFX(fwd_job) j = {d, h, W, v, b, mask, out, alpha, act, NULL, 0, 0};
    j.ws = FSFX(ws_init)(d, 0, threads, work, NULL);
    FSFX(setup)(d, W, v, &j.ws[0]);
    if (threads == 1 || d.B >= 2 * threads) {
        att_pool_run(pool, threads, d.B, FSFX(fwd_sequence_task), &j);
        return ATT_OK;
    }
    for (ptrdiff_t i = 0; i < d.B; i++) {
        j.seq = i;
        j.n = FSFX(fwd_start)(&j, i, &j.ws[0]);
        att_pool_run(pool, threads, (j.n + MC - 1) / MC,
                     FSFX(fwd_block_task), &j);
        FSFX(fwd_finish)(&j, i, j.n, &j.ws[0]);
    }
    return ATT_OK;
}

/* ---------------------------------------------------------------------
 * The backward.  Each step undoes the forward step of its number:
 *   setup    recompute steps 1-2: the valid rows, c and q
 *   ds       5. out = sum_t alpha_t h_t -> gamma_t = g . h_t (+ ga_t);
 *            4. alpha = softmax(s) -> ds_t
 *   block    3. s_t = v . tanh(W_h h_t + q), by blocks of rows: eps, dv
 *            and E; dW_h += eps^T H_blk; dh_blk = alpha_t g + eps W_h
 *   context  2. q = W_c c + b -> db, dW_c, dc = W_c^T E (E summed over
 *            every block first); 1. c = mean of the valid h_t -> dc / n
 *   mean     dh_t += dc / n for every valid row
 * Many sequences (B >= the partials): one task per chunk of sequences,
 * each summing into its own partial.  Fewer: a sequence at a time, its
 * blocks of rows in segments, one task each, segment s summing dW_h into
 * partial s and its E, dv into segsums s; the segments' sums are then
 * added in order before the context step, and the mean step runs by
 * segments again.  Blocks and segments depend on the sizes and the mask
 * only, and the partials are added in order at the end.
 */

typedef struct FSFX(bwd_job) {
    att_dims d;
    const REAL *grad_out, *h, *W, *v, *alpha, *b;
    const unsigned char *mask;
    const REAL *grad_alpha, *act;
    REAL *dh, *partials;
    ptrdiff_t nparts, psize;   /* the partials: count, elements of each */
    FSFX(ws) *ws;
    /* split rows: the sequence, its valid rows, block size, blocks,
     * segments; partials zeroed so far; the per-row pass that
     * bwd_rows_task runs (bwd_gamma or bwd_mean) */
    ptrdiff_t seq, n, mcb, nblk, nseg, used;
    void (*pass)(const struct FSFX(bwd_job) *j, ptrdiff_t i,
                 const FSFX(ws) *s, ptrdiff_t r0, ptrdiff_t r1);
} FSFX(bwd_job);

/* A partial: dW (A, 2H) | dv (Apad) | db (Apad). */
static REAL *FSFX(partial)(const FSFX(bwd_job) *j, ptrdiff_t k)
{
    return j->partials + k * j->psize;
}

/* Blocks of a sequence's n valid rows: at most MCB rows, split evenly
 * (each block adds its share into dW_h once, so fewer, fuller blocks move
 * less memory), in whole micro-panels (only the last block may end in a
 * partial one, whose padded rows read ds past n, which is 0).  Returns
 * the block size; *nblk the number of blocks. */
static ptrdiff_t FSFX(bwd_blocks)(ptrdiff_t n, ptrdiff_t *nblk)
{
    ptrdiff_t nb = (n + MCB - 1) / MCB;
    ptrdiff_t mcb = nb ? ((n + nb - 1) / nb + MR - 1) / MR * MR : MR;
    *nblk = (n + mcb - 1) / mcb;
    return mcb;
}

/* Setup: forward steps 1-2 of sequence i again on s (valid rows, c, q);
 * the dh rows of its masked items cleared.  Returns n. */
static ptrdiff_t FSFX(bwd_setup)(const FSFX(bwd_job) *j, ptrdiff_t i,
                                 FSFX(ws) *s)
{
    att_dims d = j->d;
    const unsigned char *m = j->mask ? j->mask + i * d.T : NULL;
    REAL *dhi = j->dh + i * d.T * d.H;
    for (ptrdiff_t t = 0; m && t < d.T; t++) {
        if (!m[t]) {
            memset(dhi + t * d.H, 0, (size_t)d.H * sizeof(REAL));
        }
    }
    return FSFX(seq_setup)(d, j->h + i * d.T * d.H, m, j->b, s);
}

/* Step 5 for the valid rows r0 .. r1 of sequence i: gamma_r = dL/dalpha
 * = g . h_t + ga_t into s->sbuf (dh_t = alpha_t g is written by the
 * block's dh product). */
static void FSFX(bwd_gamma)(const FSFX(bwd_job) *j, ptrdiff_t i,
                            const FSFX(ws) *s, ptrdiff_t r0, ptrdiff_t r1)
{
    att_dims d = j->d;
    const REAL *hi = j->h + i * d.T * d.H, *g = j->grad_out + i * d.H;
    const REAL *gai = j->grad_alpha ? j->grad_alpha + i * d.T : NULL;
    for (ptrdiff_t r = r0; r < r1; r++) {
        ptrdiff_t t = s->idx[r];
        s->sbuf[r] = FSFX(v_dot)(d.H, g, hi + t * d.H) + (gai ? gai[t] : 0);
    }
}

/* Step 4 over the n valid rows: ds from gamma, in place in s->sbuf, by
 * the softmax backward of formulas.h; the MR entries past n are zeroed,
 * so the rows of a partial micro-panel add nothing. */
static void FSFX(bwd_ds)(const FSFX(bwd_job) *j, ptrdiff_t i, ptrdiff_t n,
                         const FSFX(ws) *s)
{
    FSFX(softmax_backward)(n, s->idx, s->sbuf, j->alpha + i * j->d.T,
                           s->sbuf);
    for (ptrdiff_t r = n; r < n + MR; r++) {
        s->sbuf[r] = 0;
    }
}

/* Step 3, eps/dv/E, for the block of valid rows i0 .. i0 + mc of
 * sequence i (its rows, q and ds in s): u = tanh(z) from act or from the
 * product h W_h^T again; eps = ds v (1 - u^2) into w->eps (mc x Apad);
 * the block's dv and E into w->dv, w->E, summed in REAL.  Leaves w->rows
 * at the block's h rows. */
static void FSFX(bwd_eps)(const FSFX(bwd_job) *j, ptrdiff_t i,
                          const FSFX(ws) *s, ptrdiff_t i0, ptrdiff_t mc,
                          FSFX(ws) *w)
{
    att_dims d = j->d;
    const REAL *hi = j->h + i * d.T * d.H;
    for (ptrdiff_t a = 0; a < w->Apad; a++) {
        w->E[a] = 0;
        w->dv[a] = 0;
    }
    for (ptrdiff_t r = 0; r < mc; r++) {
        w->rows[r] = hi + s->idx[i0 + r] * d.H;
    }
    FSFX(block_rows)(mc, w);
    for (ptrdiff_t p = 0; p < w->nA; p++) {
        for (ptrdiff_t r0 = 0; r0 < mc; r0 += MR) {
            if (j->act != NULL) {    /* u from the forward */
                REAL *arows[MR];
                ptrdiff_t mr = mc - r0 < MR ? mc - r0 : MR;
                for (ptrdiff_t r = 0; r < mr; r++) {
                    arows[r] = (REAL *)j->act + (i * d.T +
                               s->idx[i0 + r0 + r]) * d.A + p * NR;
                }
                FSFX(tile_copy)(w->tile, mr, d.A - p * NR, arows, 1);
            }
            else {
                FSFX(micro_kernel_rows)(d.H, w->rows + r0,
                                        w->Bz + p * d.H * NR, w->tile);
            }
            FSFX(epi_backward)(w->tile, j->act != NULL, s->q + p * NR,
                               w->vp + p * NR, w->colmask + p * NR,
                               s->sbuf + i0 + r0, w->dv + p * NR,
                               w->E + p * NR,
                               w->eps + r0 * w->Apad + p * NR, w->Apad);
        }
    }
}

/* Step 3, dW_h: dW_h (A x H) += eps^T (A x mc) H_blk (mc x H), H_blk
 * the block's h rows in w->rows. */
static void FSFX(bwd_dWh)(att_dims d, ptrdiff_t mc, FSFX(ws) *w, REAL *dW)
{
    /* A: eps^T in micro-panels of MR columns of eps (k = row) */
    for (ptrdiff_t r = 0; r < mc; r++) {
        const REAL *src = w->eps + r * w->Apad;
        for (ptrdiff_t a0 = 0; a0 < d.A; a0 += MR) {
            REAL *dst = w->AeT + a0 * mc + r * MR;
            if (a0 + MR <= w->Apad) {
                memcpy(dst, src + a0, MR * sizeof(REAL));
                continue;
            }
            for (ptrdiff_t x = 0; x < MR; x++) {
                dst[x] = a0 + x < w->Apad ? src[a0 + x] : 0;
            }
        }
    }
    /* panel p of the block's h rows (mc x NR), packed contiguous and
     * zero-padded past H, stays in L1 while every micro-panel of eps^T
     * goes by.  Packed rather than read in place: at H a multiple of 1024
     * the rows are 4 KiB apart, all in one L1 set, and the panel would
     * not stay there. */
    for (ptrdiff_t p = 0; p < w->nH; p++) {
        ptrdiff_t nc = d.H - p * NR < NR ? d.H - p * NR : NR;
        for (ptrdiff_t r = 0; r < mc; r++) {
            memcpy(w->Bh + r * NR, w->rows[r] + p * NR,
                   (size_t)nc * sizeof(REAL));
            for (ptrdiff_t c = nc; c < NR; c++) {
                w->Bh[r * NR + c] = 0;
            }
        }
        for (ptrdiff_t a0 = 0; a0 < d.A; a0 += MR) {
            REAL *dWrows[MR];
            ptrdiff_t ma = d.A - a0 < MR ? d.A - a0 : MR;
            for (ptrdiff_t x = 0; x < ma; x++) {
                dWrows[x] = dW + (a0 + x) * 2 * d.H + p * NR;
            }
            FSFX(micro_kernel_packed)(mc, w->AeT + a0 * mc, w->Bh,
                                      w->tile);
            FSFX(epi_add)(w->tile, ma, nc, dWrows);
        }
    }
}

/* Step 3, dh: dh_blk (mc x H) = alpha_t g + eps (mc x Apad) W_h
 * (Apad x H) for the block of valid rows i0 .. i0 + mc of sequence i,
 * both terms written by the product's epilogue. */
static void FSFX(bwd_dh)(const FSFX(bwd_job) *j, ptrdiff_t i,
                         const FSFX(ws) *s, ptrdiff_t i0, ptrdiff_t mc,
                         FSFX(ws) *w)
{
    att_dims d = j->d;
    const REAL *g = j->grad_out + i * d.H, *ai = j->alpha + i * d.T;
    REAL *dhi = j->dh + i * d.T * d.H;
    for (ptrdiff_t r = 0; r < mc; r++) {
        w->rows[r] = w->eps + r * w->Apad;
    }
    FSFX(block_rows)(mc, w);
    /* panel p of W_h (Apad x NR) stays in L2 while the block's eps rows
     * go by (all of W_h may not fit) */
    for (ptrdiff_t p = 0; p < w->nH; p++) {
        ptrdiff_t nc = d.H - p * NR < NR ? d.H - p * NR : NR;
        for (ptrdiff_t r0 = 0; r0 < mc; r0 += MR) {
            REAL *dhrows[MR], arow[MR];
            ptrdiff_t mr = mc - r0 < MR ? mc - r0 : MR;
            for (ptrdiff_t x = 0; x < mr; x++) {
                ptrdiff_t t = s->idx[i0 + r0 + x];
                dhrows[x] = dhi + t * d.H + p * NR;
                arow[x] = ai[t];
            }
            FSFX(micro_kernel_rows)(w->Apad, w->rows + r0,
                                    w->Bd + p * w->Apad * NR, w->tile);
            FSFX(epi_dh)(w->tile, mr, nc, arow, g + p * NR, dhrows);
        }
    }
}

/* Step 3 for one block on w's scratch: dW_h summed into dW; the block's
 * E and dv (REAL) added to sums (2 Apad, double: sums over a long
 * sequence would lose digits). */
static void FSFX(bwd_block)(const FSFX(bwd_job) *j, ptrdiff_t i,
                            const FSFX(ws) *s, ptrdiff_t i0, ptrdiff_t mc,
                            FSFX(ws) *w, REAL *dW, double *sums)
{
    FSFX(bwd_eps)(j, i, s, i0, mc, w);
    FSFX(bwd_dWh)(j->d, mc, w, dW);
    FSFX(bwd_dh)(j, i, s, i0, mc, w);
    for (ptrdiff_t a = 0; a < w->Apad; a++) {
        sums[a] += (double)w->E[a];
        sums[w->Apad + a] += (double)w->dv[a];
    }
}

/* Steps 2-1 of a sequence of n valid rows, from the sums of E and dv over
 * all its blocks: dv += its dv; db += E, dW_c += E c^T, dc = W_c^T E
 * (formulas.h's context_backward); then s->dc = dc / n, the share of
 * every valid row. */
static void FSFX(bwd_context)(const FSFX(bwd_job) *j, ptrdiff_t n,
                              FSFX(ws) *s, const double *sums, REAL *dW,
                              REAL *dv, REAL *db)
{
    att_dims d = j->d;
    for (ptrdiff_t a = 0; a < s->Apad; a++) {
        s->E[a] = (REAL)sums[a];
        dv[a] += (REAL)sums[s->Apad + a];
    }
    FSFX(context_backward)(d.H, d.A, j->W, s->c, s->E, dW, db, s->dc);
    FSFX(mean_backward)(d.H, n, s->dc);
}

/* Mean: dh_t += dc / n (s->dc) for the valid rows r0 .. r1 of sequence
 * i. */
static void FSFX(bwd_mean)(const FSFX(bwd_job) *j, ptrdiff_t i,
                           const FSFX(ws) *s, ptrdiff_t r0, ptrdiff_t r1)
{
    att_dims d = j->d;
    REAL *dhi = j->dh + i * d.T * d.H;
    for (ptrdiff_t r = r0; r < r1; r++) {
        FSFX(axpy)(d.H, 1, s->dc, dhi + s->idx[r] * d.H);
    }
}

/* Sequence i whole on w: dh rows, and dW, dv (Apad), db (Apad) summed
 * into the given partial. */
static void FSFX(bwd_sequence)(const FSFX(bwd_job) *j, ptrdiff_t i,
                               FSFX(ws) *w, REAL *dW, REAL *dv, REAL *db)
{
    ptrdiff_t nblk, n = FSFX(bwd_setup)(j, i, w);
    ptrdiff_t mcb = FSFX(bwd_blocks)(n, &nblk);
    FSFX(bwd_gamma)(j, i, w, 0, n);
    FSFX(bwd_ds)(j, i, n, w);
    for (ptrdiff_t a = 0; a < 2 * w->Apad; a++) {
        w->sums[a] = 0;
    }
    for (ptrdiff_t k = 0; k < nblk; k++) {
        ptrdiff_t i0 = k * mcb;
        FSFX(bwd_block)(j, i, w, i0, n - i0 < mcb ? n - i0 : mcb, w, dW,
                        w->sums);
    }
    FSFX(bwd_context)(j, n, w, w->sums, dW, dv, db);
    FSFX(bwd_mean)(j, i, w, 0, n);
}

/* Task k: chunk k of the sequences, into partial k. */
static void FSFX(bwd_chunk_task)(void *arg, ptrdiff_t k, int thread)
{
    const FSFX(bwd_job) *j = arg;
    att_dims d = j->d;
    REAL *dW = FSFX(partial)(j, k), *dv = dW + d.A * 2 * d.H;
    memset(dW, 0, (size_t)j->psize * sizeof(REAL));
    for (ptrdiff_t i = k * d.B / j->nparts; i < (k + 1) * d.B / j->nparts;
         i++) {
        FSFX(bwd_sequence)(j, i, &j->ws[thread], dW, dv, dv + j->ws[0].Apad);
    }
}

/* The valid rows r0 .. r1 of segment k of the current sequence: blocks
 * k nblk / nseg .. (k + 1) nblk / nseg. */
static void FSFX(segment_rows)(const FSFX(bwd_job) *j, ptrdiff_t k,
                               ptrdiff_t *r0, ptrdiff_t *r1)
{
    ptrdiff_t b1 = (k + 1) * j->nblk / j->nseg;
    *r0 = k * j->nblk / j->nseg * j->mcb;
    *r1 = b1 * j->mcb < j->n ? b1 * j->mcb : j->n;
}

/* A per-row pass (j->pass) over segment k's rows. */
static void FSFX(bwd_rows_task)(void *arg, ptrdiff_t k, int thread)
{
    const FSFX(bwd_job) *j = arg;
    ptrdiff_t r0, r1;
    (void)thread;
    FSFX(segment_rows)(j, k, &r0, &r1);
    j->pass(j, j->seq, &j->ws[0], r0, r1);
}

/* Step 3 for segment k's blocks on this thread's scratch: dW_h into
 * partial k, E and dv into segsums k. */
static void FSFX(bwd_segment_task)(void *arg, ptrdiff_t k, int thread)
{
    const FSFX(bwd_job) *j = arg;
    const FSFX(ws) *s = &j->ws[0];
    double *sums = s->segsums + k * 2 * s->Apad;
    ptrdiff_t r0, r1;
    FSFX(segment_rows)(j, k, &r0, &r1);
    for (ptrdiff_t a = 0; a < 2 * s->Apad; a++) {
        sums[a] = 0;
    }
    for (ptrdiff_t i0 = r0; i0 < r1; i0 += j->mcb) {
        FSFX(bwd_block)(j, j->seq, s, i0, r1 - i0 < j->mcb ? r1 - i0
                                                          : j->mcb,
                        &j->ws[thread], FSFX(partial)(j, k), sums);
    }
}

/* Few sequences: each in turn, its rows split in segments (the sequence's
 * state in ws[0]); dv, db and dW_c of every sequence go to partial 0. */
static void FSFX(bwd_split_rows)(FSFX(bwd_job) *j, att_pool *pool,
                                 int threads)
{
    FSFX(ws) *s = &j->ws[0];
    REAL *p0 = FSFX(partial)(j, 0), *dv0 = p0 + j->d.A * 2 * j->d.H;
    memset(p0, 0, (size_t)j->psize * sizeof(REAL));
    j->used = 1;
    for (ptrdiff_t i = 0; i < j->d.B; i++) {
        j->seq = i;
        j->n = FSFX(bwd_setup)(j, i, s);
        j->mcb = FSFX(bwd_blocks)(j->n, &j->nblk);
        j->nseg = j->nblk < j->nparts ? j->nblk : j->nparts;
        for (; j->used < j->nseg; j->used++) {
            memset(FSFX(partial)(j, j->used), 0,
                   (size_t)j->psize * sizeof(REAL));
        }
        j->pass = FSFX(bwd_gamma);
        att_pool_run(pool, threads, j->nseg, FSFX(bwd_rows_task), j);
        FSFX(bwd_ds)(j, i, j->n, s);
        att_pool_run(pool, threads, j->nseg, FSFX(bwd_segment_task), j);
        for (ptrdiff_t a = 0; a < 2 * s->Apad; a++) {  /* segments in order */
            s->sums[a] = 0;
            for (ptrdiff_t k = 0; k < j->nseg; k++) {
                s->sums[a] += s->segsums[k * 2 * s->Apad + a];
            }
        }
        FSFX(bwd_context)(j, j->n, s, s->sums, p0, dv0, dv0 + s->Apad);
        j->pass = FSFX(bwd_mean);
        att_pool_run(pool, threads, j->nseg, FSFX(bwd_rows_task), j);
    }
}

int FSFX(att_fast_context_attention_backward)(
    att_dims d, att_pool *pool, int threads, const REAL *grad_out,
    const REAL *h, const REAL *W, const REAL *v, const REAL *alpha,
    const REAL *b, const unsigned char *mask, const REAL *grad_alpha,
    const REAL *act, REAL *dh, REAL *dW, REAL *dv, REAL *db, void *work)
{
    FSFX(bwd_job) j = {d, grad_out, h, W, v, alpha, b, mask, grad_alpha, act,
                       dh, NULL, FSFX(n_partials)(d), 0, NULL,
                       0, 0, 0, 0, 0, 0, NULL};
    j.ws = FSFX(ws_init)(d, 1, threads, work, &j.partials);
    ptrdiff_t Apad = j.ws[0].Apad;
    j.psize = d.A * 2 * d.H + 2 * Apad;
    FSFX(setup)(d, W, v, &j.ws[0]);
    /* W_h as B panels for dh = eps W_h: element (a, k) = W[a*2H + k] */
    FSFX(pack_B)(Apad, d.A, d.H, W, 2 * d.H, 1, j.ws[0].Bd);
    if (d.B >= j.nparts) {
        att_pool_run(pool, threads, j.nparts, FSFX(bwd_chunk_task), &j);
        j.used = j.nparts;
    }
    else {
        FSFX(bwd_split_rows)(&j, pool, threads);
    }
    /* the partial sums, added in order */
    for (ptrdiff_t x = 0; x < d.A * 2 * d.H; x++) {
        dW[x] = 0;
    }
    for (ptrdiff_t a = 0; a < d.A; a++) {
        dv[a] = 0;
        if (db) {
            db[a] = 0;
        }
    }
    for (ptrdiff_t k = 0; k < j.used; k++) {
        const REAL *pW = FSFX(partial)(&j, k), *pv = pW + d.A * 2 * d.H;
        FSFX(axpy)(d.A * 2 * d.H, 1, pW, dW);
        FSFX(axpy)(d.A, 1, pv, dv);
        if (db) {
            FSFX(axpy)(d.A, 1, pv + Apad, db);
        }
    }
    return ATT_OK;
}

/* y = tanh(x) over n elements with this path's vector tanh; for the
 * tests. */
void FSFX(att_fast_tanh)(ptrdiff_t n, const REAL *x, REAL *y)
{
    ptrdiff_t i = 0;
    for (; i + VLEN <= n; i += VLEN) {
        VSTORE(y + i, FSFX(v_tanh)(VLOAD(x + i)));
    }
    if (i < n) {
        REAL buf[VLEN];
        for (int l = 0; l < VLEN; l++) {
            buf[l] = i + l < n ? x[i + l] : 0;
        }
        VSTORE(buf, FSFX(v_tanh)(VLOAD(buf)));
        for (int l = 0; i + l < n; l++) {
            y[i + l] = buf[l];
        }
    }
}

/* The attention family's primitives, on the same micro-kernels */
#include "fast_ops_impl.h"

/* This file consumes its parameters, so that the next type can set them */
#undef TILE_ACCUMULATE
#undef PANEL_AT
#undef NR
#undef MC
#undef MCB
#undef EXPM1_COEFS
#undef EXPM1_DEGREE
#undef LN2_HI
#undef LN2_LO
#undef TANH_CLAMP
#undef EXP_MIN
#undef REAL
#undef FSFX
#undef VEC
#undef VLEN
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VSTORE
#undef VADD
#undef VSUB
#undef VMUL
#undef VDIV
#undef VFMA
#undef VMAX
#undef VAND
#undef VREDUCE
#undef REAL_DIGITS
#undef VSCALE
#undef VABS
#undef VCOPYSIGN
