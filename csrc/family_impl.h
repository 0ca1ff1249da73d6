/*
 * family_impl.h - the attention family (attention.h, docs/contract.md
 * section 4) for one floating type; kernels.c includes it after
 * kernels_impl.h, with the same parameters (REAL, SFX, TSFX, TANH).  Not a
 * public header.
 *
 * Every score is the same frame around a few primitives (fast.h, att_ops:
 * a product, the additive score of one query, one softmax row), taken
 * from the scalar table below or a SIMD one:
 *
 *   forward   kp = keys W_k^T, qp = query W_q^T + b   once per key, query
 *             S = scores (Q K^T, Q kp^T, or v . tanh(qp_i + kp_t))
 *             alpha = masked softmax of S rows; out = alpha V
 *   backward  gamma = G V^T + ga;  delta = softmax backward;  dV = alpha^T G
 *             dot/general: dQ = delta K, dK = delta^T Q (times scale)
 *             additive: eq_i = sum_t eps_it, ek_t = sum_i eps_it, dv
 *             then the projections' backward, once over all rows.
 * Work is split by sizes only, and every sum runs in an order fixed by
 * the sizes, so results are bitwise the same for any thread count.
 */

#define OPS CAT(att_ops_, TSFX)
#define FIN CAT(att_family_in_, TSFX)
#define FOUT CAT(att_family_out_, TSFX)

/* ---------------------------------------------------------------------
 * The scalar primitives (the portable path, and the reference of the
 * SIMD ones)
 */

static void SFX(gemm)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, REAL alpha,
                      const REAL *A, ptrdiff_t ars, ptrdiff_t acs,
                      const REAL *B, ptrdiff_t brs, ptrdiff_t bcs,
                      const unsigned char *kmask, REAL beta, REAL *C,
                      ptrdiff_t ldc, REAL *work)
{
    (void)work;
    for (ptrdiff_t i = 0; i < M; i++) {
        for (ptrdiff_t j = 0; j < N; j++) {
            REAL acc = 0;
            for (ptrdiff_t k = 0; k < K; k++) {
                if (kmask == NULL || kmask[k]) {
                    acc += A[i * ars + k * acs] * B[k * brs + j * bcs];
                }
            }
            REAL *c = C + i * ldc + j;
            *c = beta == 0 ? alpha * acc : beta * *c + alpha * acc;
        }
    }
}

static void SFX(gemv)(ptrdiff_t N, ptrdiff_t K, REAL alpha, const REAL *a,
                      const REAL *B, ptrdiff_t brs, ptrdiff_t bcs,
                      const unsigned char *kmask, REAL beta, REAL *c,
                      REAL *work)
{
    SFX(gemm)(1, N, K, alpha, a, K, 1, B, brs, bcs, kmask, beta, c, N, work);
}

static void SFX(add_scores)(ptrdiff_t T, ptrdiff_t apad, const REAL *qp,
                            const REAL *kp, ptrdiff_t ldk, const REAL *v,
                            const unsigned char *m, REAL *s)
{
    for (ptrdiff_t t = 0; t < T; t++) {
        REAL acc = 0;
        for (ptrdiff_t a = 0; VALID(m, t) && a < apad; a++) {
            acc += v[a] * TANH(qp[a] + kp[t * ldk + a]);
        }
        s[t] = acc;
    }
}

static void SFX(add_scores_backward)(ptrdiff_t T, ptrdiff_t apad,
                                     const REAL *qp, const REAL *kp,
                                     ptrdiff_t ldk, const REAL *v,
                                     const REAL *delta,
                                     const unsigned char *m, int first,
                                     REAL *eq, REAL *ek, ptrdiff_t lde,
                                     REAL *dv)
{
    SFX(fill_zero)(apad, eq);
    for (ptrdiff_t t = 0; t < T; t++) {
        if (first && !VALID(m, t)) {
            SFX(fill_zero)(apad, ek + t * lde);
        }
        for (ptrdiff_t a = 0; VALID(m, t) && a < apad; a++) {
            REAL u = TANH(qp[a] + kp[t * ldk + a]);
            REAL e = SFX(tanh_score_backward)(delta[t], v[a], u);
            dv[a] += delta[t] * u;
            eq[a] += e;
            ek[t * lde + a] = first ? e : ek[t * lde + a] + e;
        }
    }
}

/* The primitives of the instruction set asked for. */
static void SFX(family_ops)(int simd, OPS *ops)
{
#if ATT_HAVE_FAST
    if (simd != ATT_SIMD_SCALAR) {
        FAST(simd, att_fast_ops)(ops);
        return;
    }
#endif
    (void)simd;
    ops->vlen = 1;
    ops->gemm_work = 0;
    ops->gemm = SFX(gemm);
    ops->gemv = SFX(gemv);
    ops->add_scores = SFX(add_scores);
    ops->add_scores_backward = SFX(add_scores_backward);
    ops->softmax = SFX(seq_softmax);
    ops->softmax_backward = SFX(seq_softmax_backward);
}

/* ---------------------------------------------------------------------
 * One call: sizes, scratch and the products run by row blocks
 */

typedef struct {
    att_fdims f;
    OPS ops;
    att_exec ex;
    int threads;
    const FIN *in;
    FOUT *out;
    ptrdiff_t apad;          /* additive: A rounded up to ops.vlen        */
    const REAL *vals;        /* the values (the keys when none are given) */
    const REAL *kp;          /* projected keys (B T, ldk)                 */
    ptrdiff_t ldk;
    REAL *kbuf;              /* kp when made here                         */
    REAL *qp, *vp;           /* additive: (B Tq, apad) W_q q + b; v padded */
    REAL *eq, *ek, *dvpart;  /* additive backward: (B Tq | B T | B, apad) */
    REAL *dkp;               /* general backward: dL/dkp (B T, Hq)        */
    unsigned char *live_k, *live_q;   /* (B T), (B Tq); NULL: no mask     */
    char *thread_work;       /* per thread: thread_bytes                  */
    size_t thread_bytes;
    ptrdiff_t qblk;          /* forward: queries per task                 */
} SFX(fjob);

/* Threads worth waking: each must get 2^22 multiply-adds (see
 * exec_threads). */
static int SFX(family_threads)(const att_fdims *f, const att_exec *ex)
{
    if (ex->simd == ATT_SIMD_SCALAR || ex->pool == NULL) {
        return 1;
    }
    double w = (double)f->B * ((double)f->Tq * (double)f->T *
               (double)(f->H + f->Hv + f->P + 1) + ((double)f->T +
               (double)f->Tq) * (double)(f->H + f->Hq) * (double)f->P);
    int threads = ex->threads < att_pool_threads(ex->pool)
                  ? ex->threads : att_pool_threads(ex->pool);
    double by_work = w / (double)(1 << 22);
    return by_work < 1 ? 1 : (by_work < threads ? (int)by_work : threads);
}

/* Carves the call's scratch from work (or only counts it, work NULL);
 * returns the bytes, or -1 when a size overflows. */
static ptrdiff_t SFX(family_carve)(SFX(fjob) *j, int backward, char *work)
{
    const att_fdims *f = &j->f;
    arena ar = {work, 0, 0};
    int additive = f->score == ATT_SCORE_ADDITIVE;
    int general = f->score == ATT_SCORE_GENERAL;
    int make_kp = f->score != ATT_SCORE_DOT &&
                  (j->in == NULL || j->in->kproj == NULL ||
                   (additive && j->apad != f->P));
    ptrdiff_t BT = mul_or_neg(f->B, f->T), BTq = mul_or_neg(f->B, f->Tq);
    ptrdiff_t kw = additive ? j->apad : f->P;
    j->kbuf = arena_take(&ar, mul_or_neg(make_kp ? BT : 0, kw),
                         sizeof(REAL));
    j->qp = arena_take(&ar, mul_or_neg(additive ? BTq : 0, j->apad),
                       sizeof(REAL));
    j->vp = arena_take(&ar, additive ? j->apad : 0, sizeof(REAL));
    j->eq = arena_take(&ar, mul_or_neg(additive && backward ? BTq : 0,
                                       j->apad), sizeof(REAL));
    j->ek = arena_take(&ar, mul_or_neg(additive && backward ? BT : 0,
                                       j->apad), sizeof(REAL));
    j->dvpart = arena_take(&ar, mul_or_neg(additive && backward ? f->B : 0,
                                           j->apad), sizeof(REAL));
    j->dkp = arena_take(&ar, mul_or_neg(general && backward ? BT : 0, f->P),
                        sizeof(REAL));
    int masked = j->in == NULL || j->in->mask != NULL;
    j->live_k = arena_take(&ar, masked ? BT : 0, 1);
    j->live_q = arena_take(&ar, masked ? BTq : 0, 1);
    /* per thread: the product's scratch, and the backward's gamma */
    ptrdiff_t own = add_or_neg(j->ops.gemm_work, backward
                               ? mul_or_neg(f->Tq, f->T) : 0);
    j->thread_bytes = (size_t)mul_or_neg(own, sizeof(REAL)) / 64 * 64 + 64;
    j->thread_work = arena_take(&ar, mul_or_neg(j->threads, own < 0 ? -1
                                : (ptrdiff_t)j->thread_bytes), 1);
    return ar.overflow || own < 0 ? -1 : (ptrdiff_t)ar.used + 64;
}

/* Sets up j for a call (in NULL: sizing only); returns 0, or -1 when the
 * sizes are not those of a family call. */
static int SFX(family_init)(SFX(fjob) *j, const att_fdims *f,
                            const att_exec *ex, const FIN *in, FOUT *out)
{
    memset(j, 0, sizeof *j);
    if (f == NULL || !exec_ok(ex) || f->B < 0 || f->Tq < 1 || f->T < 1 ||
        f->H < 0 || f->Hq < 0 || f->Hv < 0 || f->P < 0 ||
        f->score < ATT_SCORE_ADDITIVE || f->score > ATT_SCORE_GENERAL ||
        (f->score == ATT_SCORE_DOT && f->Hq != f->H) ||
        (f->score == ATT_SCORE_GENERAL && f->P != f->Hq) ||
        f->P > PTRDIFF_MAX / 2) {
        return -1;
    }
    j->f = *f;
    j->ex = *ex;
    SFX(family_ops)(ex->simd, &j->ops);
    j->threads = SFX(family_threads)(f, ex);
    j->in = in;
    j->out = out;
    j->apad = (f->P + j->ops.vlen - 1) / j->ops.vlen * j->ops.vlen;
    return 0;
}

/* The scratch of thread `thread`, aligned for REAL. */
static REAL *SFX(thread_scratch)(const SFX(fjob) *j, int thread)
{
    return (REAL *)(j->thread_work + (size_t)thread * j->thread_bytes);
}

/* A product C = alpha A B + beta C whose rows are split over the threads
 * (each C element is summed the same way whichever thread has it). */
typedef struct {
    const SFX(fjob) *j;
    ptrdiff_t M, N, K, ars, acs, brs, bcs, ldc, rows;
    REAL alpha, beta;
    const REAL *A, *B;
    const unsigned char *kmask;
    REAL *C;
} SFX(pgemm);

static void SFX(pgemm_task)(void *arg, ptrdiff_t task, int thread)
{
    const SFX(pgemm) *g = arg;
    ptrdiff_t r0 = task * g->rows;
    ptrdiff_t mr = g->M - r0 < g->rows ? g->M - r0 : g->rows;
    g->j->ops.gemm(mr, g->N, g->K, g->alpha, g->A + r0 * g->ars, g->ars,
                   g->acs, g->B, g->brs, g->bcs, g->kmask, g->beta,
                   g->C + r0 * g->ldc, g->ldc,
                   SFX(thread_scratch)(g->j, thread));
}

static void SFX(par_gemm)(const SFX(fjob) *j, ptrdiff_t M, ptrdiff_t N,
                          ptrdiff_t K, REAL alpha, const REAL *A,
                          ptrdiff_t ars, ptrdiff_t acs, const REAL *B,
                          ptrdiff_t brs, ptrdiff_t bcs,
                          const unsigned char *kmask, REAL beta, REAL *C,
                          ptrdiff_t ldc)
{
    /* blocks of whole 48-row groups (a multiple of every MR), 4 a thread */
    ptrdiff_t rows = (M + 4 * j->threads - 1) / (4 * j->threads);
    rows = rows < 48 ? 48 : (rows + 47) / 48 * 48;
    SFX(pgemm) g = {j, M, N, K, ars, acs, brs, bcs, ldc, rows, alpha, beta,
                    A, B, kmask, C};
    att_pool_run(j->ex.pool, j->threads, M > 0 ? (M + rows - 1) / rows : 0,
                 SFX(pgemm_task), &g);
}

/* The mask row of query i of sequence b, or NULL. */
static const unsigned char *SFX(mask_row)(const SFX(fjob) *j, ptrdiff_t b,
                                          ptrdiff_t i)
{
    const att_fdims *f = &j->f;
    if (j->in->mask == NULL) {
        return NULL;
    }
    return j->in->mask + (f->mask_per_query ? (b * f->Tq + i) * f->T
                                            : b * f->T);
}

/* live_k: keys valid for some query; live_q: queries with a valid key. */
static void SFX(find_live)(SFX(fjob) *j)
{
    const att_fdims *f = &j->f;
    if (j->in->mask == NULL) {
        j->live_k = j->live_q = NULL;
        return;
    }
    for (ptrdiff_t b = 0; b < f->B; b++) {
        unsigned char *lk = j->live_k + b * f->T;
        memset(lk, 0, (size_t)f->T);
        for (ptrdiff_t i = 0; i < f->Tq; i++) {
            const unsigned char *m = SFX(mask_row)(j, b, i);
            unsigned char any = 0;
            for (ptrdiff_t t = 0; t < f->T; t++) {
                lk[t] |= m[t] != 0;
                any |= m[t] != 0;
            }
            j->live_q[b * f->Tq + i] = any;
        }
    }
}

/* Rows of n x w: columns [w0, w) set to 0. */
static void SFX(zero_cols)(ptrdiff_t n, ptrdiff_t w0, ptrdiff_t w, REAL *x)
{
    for (ptrdiff_t r = 0; r < n && w0 < w; r++) {
        memset(x + r * w + w0, 0, (size_t)(w - w0) * sizeof(REAL));
    }
}

/* The projections every score shares, once per key and per query:
 * kp = keys W_k^T (unless given), and for additive qp = query W_q^T + b
 * and v padded.  Rows of the additive ones are apad wide, zero past A. */
static void SFX(project)(SFX(fjob) *j)
{
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    ptrdiff_t BT = f->B * f->T, BTq = f->B * f->Tq, A = f->P;
    if (f->score == ATT_SCORE_DOT) {
        return;
    }
    ptrdiff_t ldk = f->score == ATT_SCORE_ADDITIVE ? j->apad : f->P;
    if (in->kproj != NULL && ldk == f->P) {
        j->kp = in->kproj;                      /* used as it is */
    }
    else if (in->kproj != NULL) {               /* padded copy */
        for (ptrdiff_t r = 0; r < BT; r++) {
            memcpy(j->kbuf + r * ldk, in->kproj + r * A,
                   (size_t)A * sizeof(REAL));
        }
        SFX(zero_cols)(BT, A, ldk, j->kbuf);
        j->kp = j->kbuf;
    }
    else {
        SFX(par_gemm)(j, BT, A, f->H, 1, in->keys, f->H, 1, in->W, 1,
                      in->ldw, NULL, 0, j->kbuf, ldk);
        SFX(zero_cols)(BT, A, ldk, j->kbuf);
        j->kp = j->kbuf;
    }
    j->ldk = ldk;
    if (f->score != ATT_SCORE_ADDITIVE) {
        return;
    }
    SFX(par_gemm)(j, BTq, A, f->Hq, 1, in->query, f->Hq, 1, in->W + f->H, 1,
                  in->ldw, NULL, 0, j->qp, j->apad);
    for (ptrdiff_t r = 0; in->b != NULL && r < BTq; r++) {
        for (ptrdiff_t a = 0; a < A; a++) {
            j->qp[r * j->apad + a] += in->b[a];
        }
    }
    SFX(zero_cols)(BTq, A, j->apad, j->qp);
    memcpy(j->vp, in->v, (size_t)A * sizeof(REAL));
    SFX(zero_cols)(1, A, j->apad, j->vp);
}

/* A product of one sequence's queries.  With one query per sequence (the
 * same in every task, whatever the threads) it is a matrix-vector product
 * (M = 1) or an outer product (K = 1, from the query axis). */
static void SFX(product)(const SFX(fjob) *j, ptrdiff_t M, ptrdiff_t N,
                         ptrdiff_t K, REAL alpha, const REAL *A,
                         ptrdiff_t ars, ptrdiff_t acs, const REAL *B,
                         ptrdiff_t brs, ptrdiff_t bcs,
                         const unsigned char *kmask, REAL beta, REAL *C,
                         ptrdiff_t ldc, REAL *work)
{
    if (j->f.Tq == 1 && M == 1 && acs == 1) {
        j->ops.gemv(N, K, alpha, A, B, brs, bcs, kmask, beta, C, work);
        return;
    }
    if (j->f.Tq == 1 && K == 1) {
        int live = kmask == NULL || kmask[0];
        for (ptrdiff_t i = 0; i < M; i++) {
            REAL a = live ? alpha * A[i * ars] : 0;
            REAL *c = C + i * ldc;
            for (ptrdiff_t n = 0; n < N; n++) {
                REAL x = live ? a * B[n * bcs] : 0;
                c[n] = beta == 0 ? x : beta * c[n] + x;
            }
        }
        return;
    }
    j->ops.gemm(M, N, K, alpha, A, ars, acs, B, brs, bcs, kmask, beta, C,
                ldc, work);
}

/* ---------------------------------------------------------------------
 * Forward: one task per block of queries of one sequence
 */

static void SFX(forward_task)(void *arg, ptrdiff_t task, int thread)
{
    const SFX(fjob) *j = arg;
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    REAL *work = SFX(thread_scratch)(j, thread);
    ptrdiff_t nqb = (f->Tq + j->qblk - 1) / j->qblk;
    ptrdiff_t b = task / nqb, i0 = task % nqb * j->qblk;
    ptrdiff_t nq = f->Tq - i0 < j->qblk ? f->Tq - i0 : j->qblk;
    ptrdiff_t row = b * f->Tq + i0;           /* first query's row */
    REAL *alpha = j->out->alpha + row * f->T; /* scores, then weights */
    /* 1. the scores */
    if (f->score == ATT_SCORE_ADDITIVE) {
        for (ptrdiff_t i = 0; i < nq; i++) {
            j->ops.add_scores(f->T, j->apad, j->qp + (row + i) * j->apad,
                              j->kp + b * f->T * j->ldk, j->ldk, j->vp,
                              SFX(mask_row)(j, b, i0 + i),
                              alpha + i * f->T);
        }
    }
    else {           /* S = scale Q K^T, or Q kp^T: K^T read transposed */
        int dot = f->score == ATT_SCORE_DOT;
        SFX(product)(j, nq, f->T, f->Hq, dot ? in->scale : 1,
                     in->query + row * f->Hq, f->Hq, 1,
                     dot ? in->keys + b * f->T * f->H : j->kp + b * f->T *
                     j->ldk, 1, dot ? f->H : j->ldk, NULL, 0, alpha, f->T,
                     work);
    }
    /* 2. alpha = masked softmax of each row, in place */
    for (ptrdiff_t i = 0; i < nq; i++) {
        j->ops.softmax(f->T, alpha + i * f->T, SFX(mask_row)(j, b, i0 + i),
                       alpha + i * f->T);
    }
    /* 3. out = alpha V, padding keys left out */
    SFX(product)(j, nq, f->Hv, f->T, 1, alpha, f->T, 1,
                j->vals + b * f->T * f->Hv, f->Hv, 1,
                 j->live_k ? j->live_k + b * f->T : NULL, 0,
                 j->out->out + row * f->Hv, f->Hv, work);
}

/* What both directions start with: the sizes checked, the scratch
 * carved, the padding found, the keys and queries projected.  Returns 0,
 * or -1 when the sizes are not those of a family call. */
static int SFX(family_start)(SFX(fjob) *j, const att_fdims *f,
                             const att_exec *ex, const FIN *in, FOUT *out,
                             void *work, int backward)
{
    if (in == NULL || out == NULL ||
        SFX(family_init)(j, f, ex, in, out) < 0) {
        return -1;
    }
    char *base = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    if (SFX(family_carve)(j, backward, base) < 0) {
        return -1;
    }
    j->vals = in->values ? in->values : in->keys;
    if (backward && out->dkproj != NULL &&
        f->score == ATT_SCORE_ADDITIVE && j->apad == f->P) {
        j->ek = out->dkproj;       /* the caller's dL/dkp: no copy */
    }
    SFX(find_live)(j);
    SFX(project)(j);
    return 0;
}

int SFX(att_family_forward)(const att_fdims *f, const att_exec *ex,
                            const FIN *in, FOUT *out, void *work)
{
    SFX(fjob) j;
    if (SFX(family_start)(&j, f, ex, in, out, work, 0) < 0) {
        return ATT_EINVAL;
    }
    /* whole sequences per task when there are enough of them */
    ptrdiff_t per = (f->B * f->Tq + 4 * j.threads - 1) / (4 * j.threads);
    j.qblk = f->B >= 4 * j.threads || per >= f->Tq ? f->Tq
             : (per < 12 ? 12 : per);
    att_pool_run(j.ex.pool, j.threads,
                 f->B * ((f->Tq + j.qblk - 1) / j.qblk),
                 SFX(forward_task), &j);
    return ATT_OK;
}

/* ---------------------------------------------------------------------
 * Backward: one task per sequence (its keys gather every query), then
 * the projections' backward over all rows at once
 */

static void SFX(backward_task)(void *arg, ptrdiff_t b, int thread)
{
    const SFX(fjob) *j = arg;
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    FOUT *out = j->out;
    REAL *work = SFX(thread_scratch)(j, thread);
    REAL *delta = work + j->ops.gemm_work;              /* (Tq, T) */
    ptrdiff_t T = f->T, Tq = f->Tq, Hv = f->Hv;
    const REAL *G = in->grad_out + b * Tq * Hv, *al = in->alpha + b * Tq * T;
    const REAL *Q = in->query + b * Tq * f->Hq, *K = in->keys + b * T * f->H;
    const unsigned char *lk = j->live_k ? j->live_k + b * T : NULL;
    const unsigned char *lq = j->live_q ? j->live_q + b * Tq : NULL;
    /* out = alpha V  ->  gamma = G V^T + ga;  dV = alpha^T G */
    SFX(product)(j, Tq, T, Hv, 1, G, Hv, 1, j->vals + b * T * Hv, 1, Hv,
                 NULL, 0, delta, T, work);
    for (ptrdiff_t i = 0; i < Tq; i++) {
        const unsigned char *m = SFX(mask_row)(j, b, i);
        const REAL *ga = in->grad_alpha ? in->grad_alpha + (b * Tq + i) * T
                                        : NULL;
        REAL *row = delta + i * T;
        for (ptrdiff_t t = 0; t < T; t++) {  /* masked: alpha 0, gamma 0 */
            row[t] = VALID(m, t) ? row[t] + (ga ? ga[t] : 0) : 0;
        }
        /* alpha = softmax(s)  ->  delta = dL/ds, in place */
        j->ops.softmax_backward(T, row, al + i * T, row);
    }
    REAL *dV = in->values ? out->dvalues + b * T * Hv
                          : out->dkeys + b * T * f->H;
    SFX(product)(j, T, Hv, Tq, 1, al, 1, T, G, Hv, 1, lq, 0, dV, Hv, work);
    /* the scores' backward */
    REAL beta_k = in->values ? 0 : 1;           /* dkeys already holds dV */
    if (f->score == ATT_SCORE_DOT) {            /* dQ = s D K, dK = s D^T Q */
        SFX(product)(j, Tq, f->H, T, in->scale, delta, T, 1, K, f->H, 1, lk,
                     0, out->dquery + b * Tq * f->Hq, f->Hq, work);
        SFX(product)(j, T, f->H, Tq, in->scale, delta, 1, T, Q, f->Hq, 1, lq,
                     beta_k, out->dkeys + b * T * f->H, f->H, work);
    }
    else if (f->score == ATT_SCORE_GENERAL) {   /* on kp: dQ, dkp */
        REAL *dkp = out->dkproj ? out->dkproj : j->dkp;
        SFX(product)(j, Tq, f->Hq, T, 1, delta, T, 1,
                     j->kp + b * T * j->ldk, j->ldk, 1, lk, 0,
                     out->dquery + b * Tq * f->Hq, f->Hq, work);
        SFX(product)(j, T, f->P, Tq, 1, delta, 1, T, Q, f->Hq, 1, lq, 0,
                     dkp + b * T * f->P, f->P, work);
    }
    else {                                      /* eq, ek, dv by pairs */
        REAL *eq = j->eq + b * Tq * j->apad, *ek = j->ek + b * T * j->apad;
        REAL *dv = j->dvpart + b * j->apad;
        memset(dv, 0, (size_t)j->apad * sizeof(REAL));
        for (ptrdiff_t i = 0; i < Tq; i++) {
            j->ops.add_scores_backward(
                T, j->apad, j->qp + (b * Tq + i) * j->apad,
                j->kp + b * T * j->ldk, j->ldk, j->vp, delta + i * T,
                SFX(mask_row)(j, b, i), i == 0, eq + i * j->apad, ek,
                j->apad, dv);
        }
    }
}

/* sum over n rows of x (n, ld) of the first w columns, in double, in
 * row order. */
static void SFX(sum_cols)(ptrdiff_t n, ptrdiff_t w, const REAL *x,
                          ptrdiff_t ld, REAL *out)
{
    for (ptrdiff_t a = 0; a < w; a++) {
        double acc = 0;
        for (ptrdiff_t r = 0; r < n; r++) {
            acc += (double)x[r * ld + a];
        }
        out[a] = (REAL)acc;
    }
}

/* The projections' backward: from eq, ek (additive) or dkp (general) to
 * dquery, dkeys and dW, over all rows at once. */
static void SFX(project_backward)(SFX(fjob) *j)
{
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    FOUT *out = j->out;
    ptrdiff_t BT = f->B * f->T, BTq = f->B * f->Tq, P = f->P, ld = in->ldw;
    REAL beta_k = in->values ? 0 : 1;
    int stop = out->dkproj != NULL;   /* the caller differentiates kp */
    const REAL *dk = f->score == ATT_SCORE_ADDITIVE ? j->ek : j->dkp;
    ptrdiff_t ldd = f->score == ATT_SCORE_ADDITIVE ? j->apad : P;
    if (f->score == ATT_SCORE_ADDITIVE) {
        /* qp = W_q q + b: dq = eq W_q, dW_q = eq^T Q, db = sum eq */
        SFX(par_gemm)(j, BTq, f->Hq, P, 1, j->eq, j->apad, 1, in->W + f->H,
                      ld, 1, NULL, 0, out->dquery, f->Hq);
        SFX(par_gemm)(j, P, f->Hq, BTq, 1, j->eq, 1, j->apad, in->query,
                      f->Hq, 1, j->live_q, 0, out->dW + f->H, ld);
        if (out->db != NULL) {
            SFX(sum_cols)(BTq, P, j->eq, j->apad, out->db);
        }
        SFX(sum_cols)(f->B, P, j->dvpart, j->apad, out->dv);
        if (stop && j->ek != out->dkproj) {
            for (ptrdiff_t r = 0; r < BT; r++) {
                memcpy(out->dkproj + r * P, j->ek + r * j->apad,
                       (size_t)P * sizeof(REAL));
            }
        }
    }
    if (stop) {             /* no key columns in dW; dkeys: dV or 0 */
        for (ptrdiff_t a = 0; a < P; a++) {
            memset(out->dW + a * ld, 0, (size_t)f->H * sizeof(REAL));
        }
        if (in->values != NULL && out->dkeys != NULL) {
            memset(out->dkeys, 0, (size_t)(BT * f->H) * sizeof(REAL));
        }
        return;
    }
    /* kp = keys W_k^T: dkeys (+)= dkp W_k, dW_k = dkp^T K */
    SFX(par_gemm)(j, BT, f->H, P, 1, dk, ldd, 1, in->W, ld, 1, NULL, beta_k,
                  out->dkeys, f->H);
    SFX(par_gemm)(j, P, f->H, BT, 1, dk, 1, ldd, in->keys, f->H, 1,
                  j->live_k, 0, out->dW, ld);
}

int SFX(att_family_backward)(const att_fdims *f, const att_exec *ex,
                             const FIN *in, FOUT *out, void *work)
{
    SFX(fjob) j;
    if (SFX(family_start)(&j, f, ex, in, out, work, 1) < 0) {
        return ATT_EINVAL;
    }
    att_pool_run(j.ex.pool, j.threads, f->B, SFX(backward_task), &j);
    if (f->score != ATT_SCORE_DOT) {
        SFX(project_backward)(&j);
    }
    return ATT_OK;
}

ptrdiff_t SFX(att_family_workspace)(const att_fdims *f, int backward,
                                    const att_exec *ex)
{
    SFX(fjob) j;
    if (SFX(family_init)(&j, f, ex, NULL, NULL) < 0) {
        return -1;
    }
    return SFX(family_carve)(&j, backward, NULL);
}

/* ---------------------------------------------------------------------
 * project_keys and its backward, on their own (d = {n, 1, H, P})
 */

/* A job for the products alone: keys as the only sequence. */
static int SFX(project_init)(SFX(fjob) *j, att_dims d, const att_exec *ex)
{
    /* one "sequence" of n keys (at least 1: n = 0 is no work at all) */
    att_fdims f = {ATT_SCORE_GENERAL, 0, 1, 1, d.B > 0 ? d.B : 1, d.H,
                   d.A, d.H, d.A};
    if (d.B < 0 || d.H < 0 || d.A < 0 ||
        SFX(family_init)(j, &f, ex, NULL, NULL) < 0) {
        return -1;
    }
    return 0;
}

ptrdiff_t SFX(att_project_keys_workspace)(att_dims d, const att_exec *ex)
{
    SFX(fjob) j;
    if (SFX(project_init)(&j, d, ex) < 0) {
        return -1;
    }
    ptrdiff_t bytes = mul_or_neg(mul_or_neg(j.threads, j.ops.gemm_work + 8),
                                 sizeof(REAL));
    return bytes < 0 ? -1 : bytes + 64;
}

static void SFX(project_work)(SFX(fjob) *j, void *work)
{
    j->thread_work = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    j->thread_bytes = (size_t)(j->ops.gemm_work + 8) * sizeof(REAL);
}

int SFX(att_project_keys)(att_dims d, const att_exec *ex, const REAL *keys,
                          const REAL *W, ptrdiff_t ldw, REAL *kp, void *work)
{
    SFX(fjob) j;
    if (SFX(project_init)(&j, d, ex) < 0 || ldw < d.H) {
        return ATT_EINVAL;
    }
    SFX(project_work)(&j, work);
    SFX(par_gemm)(&j, d.B, d.A, d.H, 1, keys, d.H, 1, W, 1, ldw, NULL, 0, kp,
                  d.A);
    return ATT_OK;
}

int SFX(att_project_keys_backward)(att_dims d, const att_exec *ex,
                                   const REAL *grad, const REAL *keys,
                                   const REAL *W, ptrdiff_t ldw, REAL *dkeys,
                                   REAL *dW, void *work)
{
    SFX(fjob) j;
    if (SFX(project_init)(&j, d, ex) < 0 || ldw < d.H) {
        return ATT_EINVAL;
    }
    SFX(project_work)(&j, work);
    SFX(par_gemm)(&j, d.B, d.H, d.A, 1, grad, d.A, 1, W, ldw, 1, NULL, 0,
                  dkeys, d.H);
    SFX(par_gemm)(&j, d.A, d.H, d.B, 1, grad, 1, d.A, keys, d.H, 1, NULL, 0,
                  dW, ldw);
    for (ptrdiff_t a = 0; a < d.A; a++) {
        memset(dW + a * ldw + d.H, 0, (size_t)(ldw - d.H) * sizeof(REAL));
    }
    return ATT_OK;
}

#undef OPS
#undef FIN
#undef FOUT
#undef VALID
