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
 * dot and general also stream (docs/contract.md section 5): blocks of
 * queries against blocks of keys with an online softmax, lse instead of
 * the weights, the backward recomputing P = exp(S - lse) block by block;
 * with causal, blocks no query sees are never computed.  What a query
 * sees (key mask, attn_mask, causal, a bias of -inf) is read in place per
 * row; sequences read their query, keys and values by index (broadcast),
 * and the backward runs the groups that share one in order.
 * Work is split by sizes only, and every sum runs in an order fixed by
 * the sizes, so results are bitwise the same for any thread count.
 * Decoding (dot and general forward, at most DECODE_TQ queries per
 * sequence) runs neither: one task per query, its scores by one pass over
 * the keys and out by one over the values (dot_keys, sum_values), no
 * packing, no search for non-finite rows first.
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

/* s_t = exp(s_t - M) for the visible t (vis NULL: all), 0 for the
 * others; their sum, in double. */
static double SFX(exp_shift)(ptrdiff_t n, REAL *s, REAL M,
                             const unsigned char *vis)
{
    double total = 0;
    for (ptrdiff_t t = 0; t < n; t++) {
        s[t] = VALID(vis, t) ? EXP(s[t] - M) : 0;
        total += (double)s[t];
    }
    return total;
}

static REAL SFX(max_row)(ptrdiff_t n, const REAL *s)
{
    return SFX(row_max)(n, s, NULL);
}

static void SFX(ds_row)(ptrdiff_t n, const REAL *p, REAL *dp, REAL D)
{
    for (ptrdiff_t t = 0; t < n; t++) {
        dp[t] = p[t] * (dp[t] - D);
    }
}

static void SFX(dot_keys)(ptrdiff_t n, ptrdiff_t d, REAL alpha,
                          const REAL *q, const REAL *K, ptrdiff_t ldk,
                          REAL *s)
{
    for (ptrdiff_t t = 0; t < n; t++) {
        REAL acc = 0;
        for (ptrdiff_t c = 0; c < d; c++) {
            acc += q[c] * K[t * ldk + c];
        }
        s[t] = alpha * acc;
    }
}

static void SFX(sum_values)(ptrdiff_t n, ptrdiff_t d, const REAL *w,
                          const REAL *V, ptrdiff_t ldv,
                          const unsigned char *use, REAL *out)
{
    SFX(fill_zero)(d, out);
    for (ptrdiff_t t = 0; t < n; t++) {
        for (ptrdiff_t c = 0; VALID(use, t) && c < d; c++) {
            out[c] += w[t] * V[t * ldv + c];
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
    ops->exp_shift = SFX(exp_shift);
    ops->max_row = SFX(max_row);
    ops->ds_row = SFX(ds_row);
    ops->dot_keys = SFX(dot_keys);
    ops->sum_values = SFX(sum_values);
}

/* ---------------------------------------------------------------------
 * One call: sizes, scratch and the products run by row blocks
 */

/* The streamed path's blocks: queries and keys per block (the products'
 * M and N); a causal call computes no block that no query of it sees. */
#define SQB 256
#define SKB 256
/* Queries per block: SQB, or 64 with causal, where a block's queries see
 * their keys by a staircase and a smaller step computes fewer hidden
 * pairs (measured: SQB full is 10% faster than 64, causal 10% slower) */
#define QBLK(f) ((f)->causal ? (ptrdiff_t)64 : (ptrdiff_t)SQB)

/* Decoding: a dot or general forward with at most DECODE_TQ queries per
 * sequence runs decode_task, one query against its keys by
 * matrix-vector passes (blocks of 256 queries would run with one useful
 * row); a thread is woken per DECODE_BYTES of keys and values read. */
#define DECODE_TQ 8
#define DECODE_BYTES ((double)(1 << 20))

typedef struct {
    att_fdims f;
    OPS ops;
    att_exec ex;
    int threads;
    const FIN *in;
    FOUT *out;
    int stream;              /* no (Tq, T) weights: blocks, lse           */
    ptrdiff_t apad;          /* additive: A rounded up to ops.vlen        */
    const REAL *vals;        /* the values (the keys when none are given) */
    const REAL *kp;          /* projected keys (B T, ldk)                 */
    ptrdiff_t ldk;
    REAL *kbuf;              /* kp when made here                         */
    REAL *qp, *vp;           /* additive: (B Tq, apad) W_q q + b; v padded */
    REAL *eq, *ek, *dvpart;  /* additive backward: (B Tq | B T | B, apad) */
    REAL *dkp;               /* general backward: dL/dkp (B T, Hq)        */
    unsigned char *live_k, *live_q;   /* (B T), (B Tq); NULL: no mask     */
    unsigned char *live_kr;  /* keys' rows (Bk T) some query sees: the
                                projection's backward leaves out the rest */
    ptrdiff_t Bq, Bk, Bv;    /* query, key, value sequences               */
    unsigned char *bad_q, *bad_k, *bad_v, *bad_g;   /* rows holding a NaN
                                or an infinity (queries, score keys, values,
                                grad_out); NULL when every one is finite */
    ptrdiff_t ngroups;       /* backward: groups sharing q, k or v        */
    uint32_t keep_min;       /* dropout: the least word kept (philox.h)   */
    REAL keep_scale;         /* 1 / (1 - p)                               */
    REAL *dbias_parts;       /* bias shared: partial dbias 1 .. nparts-1  */
    ptrdiff_t nparts;        /* backward tasks: groups of sequences       */
    int two_pass;            /* streamed backward: dK dV, then dQ         */
    char *thread_work;       /* per thread: thread_bytes                  */
    size_t thread_bytes;
    ptrdiff_t qblk;          /* forward: queries per task                 */
    int decode;              /* forward of few queries: decode_task       */
} SFX(fjob);

#define VIEW_AT(v, b) ((v)->off != NULL ? (v)->off[b] : (b) * (v)->bs)
/* The query, key and value sequence that sequence b reads. */
#define QB(j, b) ((j)->in->qidx != NULL ? (j)->in->qidx[b] : (b))
#define KB(j, b) ((j)->in->kidx != NULL ? (j)->in->kidx[b] : (b))
#define VB(j, b) ((j)->in->values == NULL ? KB(j, b)                         \
                  : (j)->in->vidx != NULL ? (j)->in->vidx[b] : (b))
#define SHARED(in) ((in)->qidx != NULL || (in)->kidx != NULL ||              \
                    (in)->vidx != NULL)
#define MASKED(in) ((in)->mask.p != NULL || (in)->attn_mask.p != NULL ||    \
                    (in)->bias.p != NULL)

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

/* Threads for decoding (memory-bound): one per DECODE_BYTES of keys and
 * values, at most one per query. */
static void SFX(decode_threads)(SFX(fjob) *j)
{
    const att_fdims *f = &j->f;
    const att_exec *ex = &j->ex;
    if (ex->simd == ATT_SIMD_SCALAR || ex->pool == NULL) {
        j->threads = 1;
        return;
    }
    double bytes = (double)f->B * (double)f->Tq * (double)f->T *
                   (double)(f->Hq + f->Hv) * (double)sizeof(REAL);
    double tasks = (double)f->B * (double)f->Tq;
    int threads = ex->threads < att_pool_threads(ex->pool)
                  ? ex->threads : att_pool_threads(ex->pool);
    double by = bytes / DECODE_BYTES < tasks ? bytes / DECODE_BYTES : tasks;
    j->threads = by < 1 ? 1 : (by < threads ? (int)by : threads);
}

/* The backward's groups of sequences, by sizes only (so the sums, and the
 * results, are the same for any thread count): one group per sequence,
 * unless a shared bias's gradient sums over them, in partials of at most
 * 64 MiB together (but at least two), added in order at the end. */
static void SFX(plan_backward)(SFX(fjob) *j)
{
    const att_fdims *f = &j->f;
    int bias = j->in == NULL || j->in->bias.p != NULL;
    j->ngroups = j->in != NULL && j->in->order != NULL ? j->in->ngroups
                                                       : f->B;
    j->nparts = j->ngroups;
    if (bias && f->bias_shared) {
        ptrdiff_t fit = ((ptrdiff_t)64 << 20) /
                        (f->nbias > 0 ? f->nbias * (ptrdiff_t)sizeof(REAL)
                                      : 1);
        /* at least two, so that two threads share the work (a bias of
         * 64 MiB or more costs one more copy of it) */
        fit = fit < 2 ? 2 : fit;
        j->nparts = j->ngroups < 8 ? j->ngroups : 8;
        j->nparts = fit < j->nparts ? fit : j->nparts;
        j->nparts = j->nparts < 1 ? 1 : j->nparts;
    }
    /* fewer sequences than threads (and no bias): the keys' blocks in
     * parallel, then the queries'.  Each gradient is summed in the same
     * order as in one pass, so the results are the same bits: the choice
     * may follow the threads. */
    j->two_pass = j->stream && !bias && f->B < j->threads &&
                  (j->in == NULL || !SHARED(j->in));
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
    int dropout = f->dropout;
    j->decode = !backward && !additive && f->Tq <= DECODE_TQ;
    ptrdiff_t BT = mul_or_neg(j->Bk, f->T), BTq = mul_or_neg(j->Bq, f->Tq);
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
    int masked = !f->stream && !j->decode &&
                 (j->in == NULL || MASKED(j->in) || f->causal);
    j->live_k = arena_take(&ar, masked ? mul_or_neg(f->B, f->T) : 0, 1);
    j->live_q = arena_take(&ar, masked ? mul_or_neg(f->B, f->Tq) : 0, 1);
    /* the keys' rows some query sees, for dW_k (general backward) */
    j->live_kr = arena_take(&ar, general && backward ? BT : 0, 1);
    if (!additive && !j->decode) {   /* dot, general: rows not finite */
        j->bad_q = arena_take(&ar, BTq, 1);
        j->bad_k = arena_take(&ar, BT, 1);
        j->bad_v = arena_take(&ar, mul_or_neg(j->Bv, f->T), 1);
        j->bad_g = arena_take(&ar, backward ? mul_or_neg(f->B, f->Tq) : 0,
                              1);
    }
    if (backward) {
        SFX(plan_backward)(j);
        j->dbias_parts = arena_take(&ar, mul_or_neg(f->bias_shared
                                                    ? j->nparts - 1 : 0,
                                                    f->nbias), sizeof(REAL));
    }
    /* per thread: the product's scratch, then the rows of the path */
    ptrdiff_t rows;
    if (j->decode) {         /* scores (streamed), dropped; vis, keep */
        rows = add_or_neg(mul_or_neg(f->T, (f->stream ? 1 : 0) +
                                           (dropout ? 1 : 0)),
                          mul_or_neg(f->T, 2) / (ptrdiff_t)sizeof(REAL) + 1);
        SFX(decode_threads)(j);
    }
    else if (f->stream) {    /* S (or P), dP, P dropped; vis, keep bytes */
        rows = add_or_neg(3 * SQB * SKB + 2 * SQB + 2 * SKB,
                          (2 * SQB * SKB + 3 * SKB + 2 * SQB) /
                          (ptrdiff_t)sizeof(REAL) + 1);
    }
    else {      /* delta, the dropped weights; a row; vis, keep bytes */
        ptrdiff_t TqT = mul_or_neg(f->Tq, f->T);
        rows = add_or_neg(add_or_neg(mul_or_neg(TqT, (backward ? 1 : 0) +
                                                     (dropout ? 1 : 0)),
                                     f->T),
                          add_or_neg(add_or_neg(mul_or_neg(f->T, 3), f->Tq),
                                     backward ? TqT : 0) /
                          (ptrdiff_t)sizeof(REAL) + 1);
    }
    /* (decoding's dot score runs no product) */
    ptrdiff_t own = add_or_neg(j->decode && !make_kp ? 0 : j->ops.gemm_work,
                               rows);
    j->thread_bytes = (size_t)mul_or_neg(own, sizeof(REAL)) / 64 * 64 + 128;
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
        f->H < 0 || f->Hq < 0 || f->Hv < 0 || f->P < 0 || f->nbias < 0 ||
        f->score < ATT_SCORE_ADDITIVE || f->score > ATT_SCORE_GENERAL ||
        (f->score == ATT_SCORE_DOT && f->Hq != f->H) ||
        (f->score == ATT_SCORE_GENERAL && f->P != f->Hq) ||
        (f->score == ATT_SCORE_ADDITIVE && (f->stream || f->dropout ||
                                            f->Bq || f->Bk || f->Bv)) ||
        f->Bq < 0 || f->Bk < 0 || f->Bv < 0 ||
        f->P > PTRDIFF_MAX / 2 || f->T > ((ptrdiff_t)1 << 34) ||
        (in != NULL && (!(in->dropout >= 0 && in->dropout < 1) ||
                        f->dropout != (in->dropout > 0) ||
                        (f->score == ATT_SCORE_ADDITIVE &&
                         in->bias.p != NULL)))) {
        return -1;
    }
    j->f = *f;
    j->ex = *ex;
    SFX(family_ops)(ex->simd, &j->ops);
    j->threads = SFX(family_threads)(f, ex);
    j->in = in;
    j->out = out;
    j->stream = f->stream;
    j->apad = (f->P + j->ops.vlen - 1) / j->ops.vlen * j->ops.vlen;
    j->Bq = f->Bq > 0 ? f->Bq : f->B;
    j->Bk = f->Bk > 0 ? f->Bk : f->B;
    j->Bv = f->Bv > 0 ? f->Bv : f->B;
    if (in != NULL) {
        j->keep_min = att_keep_threshold(in->dropout);
        j->keep_scale = (REAL)(1 / (1 - in->dropout));
    }
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

/* ---------------------------------------------------------------------
 * What a query sees: masks, causal, bias, dropout, read where they are
 */

/* Into vis, the visibility of keys [t0, t0 + n) to query i of sequence b
 * by the key mask, the attn_mask and causal (t <= i + T - Tq); returns
 * vis, or NULL when they are all visible. */
static const unsigned char *SFX(vis_row)(const SFX(fjob) *j, ptrdiff_t b,
                                         ptrdiff_t i, ptrdiff_t t0,
                                         ptrdiff_t n, unsigned char *vis)
{
    const att_fdims *f = &j->f;
    const att_view *km = &j->in->mask, *am = &j->in->attn_mask;
    ptrdiff_t last = f->causal ? i + (f->T - f->Tq) : f->T;
    if (km->p == NULL && am->p == NULL && last >= t0 + n - 1) {
        return NULL;
    }
    for (ptrdiff_t t = 0; t < n; t++) {
        vis[t] = t0 + t <= last;
    }
    if (km->p != NULL) {
        const unsigned char *m = (const unsigned char *)km->p +
                                 VIEW_AT(km, b) + t0 * km->cs;
        for (ptrdiff_t t = 0; t < n; t++) {
            vis[t] &= m[t * km->cs] != 0;
        }
    }
    if (am->p != NULL) {
        const unsigned char *m = (const unsigned char *)am->p +
                                 VIEW_AT(am, b) + i * am->rs + t0 * am->cs;
        for (ptrdiff_t t = 0; t < n; t++) {
            vis[t] &= m[t * am->cs] != 0;
        }
    }
    return vis;
}

/* The scores s of keys [t0, t0 + n) for query i of sequence b made what
 * the softmax takes: the bias added, and the visibility (vis_row, and a
 * score of -inf is as masked) in vis; returns vis or NULL (all
 * visible). */
static const unsigned char *SFX(prepare_row)(const SFX(fjob) *j,
                                             ptrdiff_t b, ptrdiff_t i,
                                             ptrdiff_t t0, ptrdiff_t n,
                                             REAL *s, unsigned char *vis)
{
    const att_view *bv = &j->in->bias;
    const unsigned char *m = SFX(vis_row)(j, b, i, t0, n, vis);
    for (ptrdiff_t t = 0; m != NULL && bv->p == NULL && t < n; t++) {
        s[t] = m[t] ? s[t] : -INFINITY;     /* the max then needs no mask */
    }
    if (bv->p == NULL) {
        return m;
    }
    const REAL *x = (const REAL *)bv->p + VIEW_AT(bv, b) + i * bv->rs +
                    t0 * bv->cs;
    if (m == NULL) {
        memset(vis, 1, (size_t)n);
    }
    for (ptrdiff_t t = 0; t < n; t++) {      /* a bias of -inf masks */
        REAL add = x[t * bv->cs];
        vis[t] = vis[t] && add != -INFINITY;
        s[t] = vis[t] ? s[t] + add : -INFINITY;
    }
    return vis;
}

/* The visibility of every key to query i of sequence b by the masks,
 * causal and a bias of -inf, into vis (T bytes, always written). */
static void SFX(visible_row)(const SFX(fjob) *j, ptrdiff_t b, ptrdiff_t i,
                             unsigned char *vis)
{
    const att_view *bv = &j->in->bias;
    ptrdiff_t T = j->f.T;
    if (SFX(vis_row)(j, b, i, 0, T, vis) == NULL) {
        memset(vis, 1, (size_t)T);
    }
    const REAL *x = bv->p == NULL ? NULL
                    : (const REAL *)bv->p + VIEW_AT(bv, b) + i * bv->rs;
    for (ptrdiff_t t = 0; x != NULL && t < T; t++) {
        vis[t] &= x[t * bv->cs] != -INFINITY;
    }
}

/* w[t] *= keep(b, i, t0 + t) / (1 - p) for t < n: the dropout of the
 * weights (keep: n bytes of scratch). */
static void SFX(drop_row)(const SFX(fjob) *j, ptrdiff_t b, ptrdiff_t i,
                          ptrdiff_t t0, ptrdiff_t n, REAL *w,
                          unsigned char *keep)
{
    att_keep_row(j->in->seed, j->keep_min, b, i, t0, n, keep);
    for (ptrdiff_t t = 0; t < n; t++) {
        w[t] = keep[t] ? w[t] * j->keep_scale : 0;
    }
}

/* dbias[(b, i, t0 + t)] += ds[t] for t < n, into partial `part` (0: the
 * gradient itself); broadcast elements sum in t order. */
static void SFX(add_dbias)(const SFX(fjob) *j, ptrdiff_t part, ptrdiff_t b,
                           ptrdiff_t i, ptrdiff_t t0, ptrdiff_t n,
                           const REAL *ds)
{
    const att_view *v = &j->out->dbias;
    REAL *base = part == 0 ? (REAL *)(uintptr_t)v->p
                           : j->dbias_parts + (part - 1) * j->f.nbias;
    REAL *d = base + VIEW_AT(v, b) + i * v->rs + t0 * v->cs;
    for (ptrdiff_t t = 0; t < n; t++) {
        d[t * v->cs] += ds[t];
    }
}

/* live_k: keys visible to some query; live_q: queries with a visible key
 * (the stored path: the products leave the others out, so that a NaN
 * there reaches no result). */
static void SFX(find_live)(SFX(fjob) *j, REAL *srow, unsigned char *vis)
{
    const att_fdims *f = &j->f;
    if (j->live_k == NULL) {
        return;
    }
    for (ptrdiff_t b = 0; b < f->B; b++) {
        unsigned char *lk = j->live_k + b * f->T;
        memset(lk, 0, (size_t)f->T);
        for (ptrdiff_t i = 0; i < f->Tq; i++) {
            memset(srow, 0, (size_t)f->T * sizeof(REAL));
            const unsigned char *m = SFX(prepare_row)(j, b, i, 0, f->T,
                                                      srow, vis);
            unsigned char any = 0;
            for (ptrdiff_t t = 0; t < f->T; t++) {
                unsigned char v = m == NULL || m[t];
                lk[t] |= v;
                any |= v;
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
    ptrdiff_t BT = j->Bk * f->T, BTq = j->Bq * f->Tq, A = f->P;
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
 * A NaN or an infinity reaches exactly the results that see it
 */

/* Marks the rows of x (n rows of w, ld apart) that hold a NaN or an
 * infinity; returns their number. */
static ptrdiff_t SFX(find_bad)(ptrdiff_t n, ptrdiff_t w, const REAL *x,
                               ptrdiff_t ld, unsigned char *bad)
{
    ptrdiff_t count = 0;
    for (ptrdiff_t r = 0; r < n; r++) {
        const REAL *row = x + r * ld;
        int any = 0;
        for (ptrdiff_t c = 0; c < w; c++) {   /* x - x: NaN unless finite */
            any |= !(row[c] - row[c] == 0);
        }
        bad[r] = (unsigned char)any;
        count += any;
    }
    return count;
}

/* The rows of the inputs that are not finite, or NULL (the usual case:
 * the products then run as they are). */
static void SFX(find_nonfinite)(SFX(fjob) *j, int backward)
{
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    if (j->bad_q == NULL) {
        return;
    }
    int dot = f->score == ATT_SCORE_DOT;
    ptrdiff_t vw = in->values ? f->Hv : f->H;
    if (!SFX(find_bad)(j->Bq * f->Tq, f->Hq, in->query, f->Hq, j->bad_q)) {
        j->bad_q = NULL;
    }
    if (!SFX(find_bad)(j->Bk * f->T, dot ? f->H : f->P,
                       dot ? in->keys : j->kp, dot ? f->H : j->ldk,
                       j->bad_k)) {
        j->bad_k = NULL;
    }
    if (!SFX(find_bad)((in->values ? j->Bv : j->Bk) * f->T, vw, j->vals, vw,
                       j->bad_v)) {
        j->bad_v = NULL;
    }
    if (!backward || !SFX(find_bad)(f->B * f->Tq, f->Hv, in->grad_out,
                                    f->Hv, j->bad_g)) {
        j->bad_g = NULL;
    }
}

/* Which pairs (i, k) of a product see each other: bytes (nonzero), or
 * weights (nonzero; the stored path's alpha), at i rs + k cs; all when
 * both are NULL. */
typedef struct {
    const unsigned char *bytes;
    const REAL *alpha;
    ptrdiff_t rs, cs;
} SFX(pairs);

static int SFX(sees)(const SFX(pairs) *v, ptrdiff_t i, ptrdiff_t k)
{
    ptrdiff_t e = i * v->rs + k * v->cs;
    return v->bytes ? v->bytes[e] != 0 : v->alpha ? v->alpha[e] != 0 : 1;
}

/* product() of C = alpha A B + beta C over k, B's rows bcs = 1 apart,
 * where the rows of B marked bad (a NaN, an infinity) are left out and
 * added back only to the results whose pair (i, k) sees them: a loop over
 * the visible pairs would give the same, and 0 x NaN none.  kbuf: K bytes
 * of scratch. */
static void SFX(product_seen)(const SFX(fjob) *j, ptrdiff_t M, ptrdiff_t N,
                              ptrdiff_t K, REAL alpha, const REAL *A,
                              ptrdiff_t ars, ptrdiff_t acs, const REAL *B,
                              ptrdiff_t brs, const unsigned char *kmask,
                              REAL beta, REAL *C, ptrdiff_t ldc, REAL *work,
                              const unsigned char *bad,
                              const SFX(pairs) *seen, unsigned char *kbuf)
{
    ptrdiff_t nbad = 0;
    for (ptrdiff_t k = 0; bad != NULL && k < K; k++) {
        nbad += bad[k] && (kmask == NULL || kmask[k]);
    }
    if (nbad == 0) {
        SFX(product)(j, M, N, K, alpha, A, ars, acs, B, brs, 1, kmask, beta,
                     C, ldc, work);
        return;
    }
    for (ptrdiff_t k = 0; k < K; k++) {
        kbuf[k] = (kmask == NULL || kmask[k]) && !bad[k];
    }
    SFX(product)(j, M, N, K, alpha, A, ars, acs, B, brs, 1, kbuf, beta, C,
                 ldc, work);
    for (ptrdiff_t k = 0; k < K; k++) {
        if (!bad[k] || (kmask != NULL && !kmask[k])) {
            continue;
        }
        for (ptrdiff_t i = 0; i < M; i++) {
            REAL a = alpha * A[i * ars + k * acs];
            for (ptrdiff_t n = 0; SFX(sees)(seen, i, k) && n < N; n++) {
                C[i * ldc + n] += a * B[k * brs + n];
            }
        }
    }
}

/* ---------------------------------------------------------------------
 * Forward with the weights stored: one task per block of queries of one
 * sequence
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
    ptrdiff_t qrow = QB(j, b) * f->Tq + i0, kb = KB(j, b), T = f->T;
    REAL *alpha = j->out->alpha + row * T;    /* scores, then weights */
    REAL *dropped = work + j->ops.gemm_work;  /* (nq, T) with dropout */
    unsigned char *vis = (unsigned char *)(dropped + (in->dropout > 0
                                                      ? nq * T : 0) + T);
    unsigned char *keep = vis + T, *kbuf = keep + T;
    /* 1. the scores */
    if (f->score == ATT_SCORE_ADDITIVE) {
        for (ptrdiff_t i = 0; i < nq; i++) {
            j->ops.add_scores(T, j->apad, j->qp + (qrow + i) * j->apad,
                              j->kp + kb * T * j->ldk, j->ldk, j->vp,
                              SFX(vis_row)(j, b, i0 + i, 0, T, vis),
                              alpha + i * T);
        }
    }
    else {           /* S = scale Q K^T, or Q kp^T: K^T read transposed */
        int dot = f->score == ATT_SCORE_DOT;
        SFX(product)(j, nq, T, f->Hq, dot ? in->scale : 1,
                     in->query + qrow * f->Hq, f->Hq, 1,
                     dot ? in->keys + kb * T * f->H : j->kp + kb * T *
                     j->ldk, 1, dot ? f->H : j->ldk, NULL, 0, alpha, T,
                     work);
    }
    /* 2. alpha = masked softmax of each row (bias added), in place */
    for (ptrdiff_t i = 0; i < nq; i++) {
        REAL *s = alpha + i * T;
        j->ops.softmax(T, s, SFX(prepare_row)(j, b, i0 + i, 0, T, s, vis),
                       s);
    }
    /* 3. out = alpha V (dropped), padding keys left out */
    const REAL *w = alpha;
    if (in->dropout > 0) {
        memcpy(dropped, alpha, (size_t)(nq * T) * sizeof(REAL));
        for (ptrdiff_t i = 0; i < nq; i++) {
            SFX(drop_row)(j, b, i0 + i, 0, T, dropped + i * T, keep);
        }
        w = dropped;
    }
    SFX(pairs) seen = {NULL, alpha, T, 1};
    SFX(product_seen)(j, nq, f->Hv, T, 1, w, T, 1,
                      j->vals + VB(j, b) * T * f->Hv, f->Hv,
                      j->live_k ? j->live_k + b * T : NULL, 0,
                      j->out->out + row * f->Hv, f->Hv, work,
                      j->bad_v ? j->bad_v + VB(j, b) * T : NULL, &seen,
                      kbuf);
}

/* ---------------------------------------------------------------------
 * The streamed path (dot and general, no weights stored): blocks of SQB
 * queries against blocks of SKB keys, an online softmax (FlashAttention,
 * Dao et al. 2022; the loop order of FlashAttention-2)
 */

/* A thread's scratch for the streamed path: three blocks of scores, the
 * running max and sum of SQB rows, then bytes: visibility of a block,
 * keep bits of a row, the live keys and queries of a block. */
typedef struct {
    REAL *S, *dP, *Pd, *mx, *sum;
    unsigned char *vis, *keep, *klive, *qlive, *kbuf;
} SFX(sblock);

static SFX(sblock) SFX(stream_scratch)(const SFX(fjob) *j, int thread)
{
    REAL *w = SFX(thread_scratch)(j, thread) + j->ops.gemm_work;
    SFX(sblock) s;
    s.S = w;
    s.dP = w + SQB * SKB;
    s.Pd = w + 2 * SQB * SKB;
    s.mx = w + 3 * SQB * SKB;
    s.sum = s.mx + SQB;
    s.vis = (unsigned char *)(s.sum + SQB + 2 * SKB);
    s.keep = s.vis + SQB * SKB;
    s.klive = s.keep + SKB;
    s.qlive = s.klive + SKB;
    s.kbuf = s.qlive + SQB;
    return s;
}

/* The keys of sequence b as the score reads them: K (T, ldk) and the
 * scale (dot: the keys; general: the projected keys, scale 1). */
static const REAL *SFX(score_keys)(const SFX(fjob) *j, ptrdiff_t b,
                                   ptrdiff_t *ldk, REAL *scale)
{
    const att_fdims *f = &j->f;
    if (f->score == ATT_SCORE_DOT) {
        *ldk = f->H;
        *scale = j->in->scale;
        return j->in->keys + KB(j, b) * f->T * f->H;
    }
    *ldk = j->ldk;
    *scale = 1;
    return j->kp + KB(j, b) * f->T * j->ldk;
}

/* Keys a causal block of queries [i0, i0 + nq) sees: [0, end). */
static ptrdiff_t SFX(keys_seen)(const att_fdims *f, ptrdiff_t i0,
                                ptrdiff_t nq)
{
    if (!f->causal) {
        return f->T;
    }
    ptrdiff_t end = i0 + nq + (f->T - f->Tq);
    return end < 0 ? 0 : (end < f->T ? end : f->T);
}

/* Of the block of nk keys from k0, those the queries [i0, i0 + nq) can
 * see (causal: the rest are never computed). */
static ptrdiff_t SFX(block_keys)(const att_fdims *f, ptrdiff_t i0,
                                 ptrdiff_t nq, ptrdiff_t k0, ptrdiff_t nk)
{
    ptrdiff_t seen = SFX(keys_seen)(f, i0, nq) - k0;
    return seen < nk ? seen : nk;
}

/* The first query of the causal block structure that sees key k0. */
static ptrdiff_t SFX(first_query)(const att_fdims *f, ptrdiff_t k0)
{
    ptrdiff_t i = f->causal ? k0 - (f->T - f->Tq) : 0;
    return i < 0 ? 0 : i / QBLK(f) * QBLK(f);
}

static void SFX(stream_forward_task)(void *arg, ptrdiff_t task, int thread)
{
    const SFX(fjob) *j = arg;
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    REAL *work = SFX(thread_scratch)(j, thread);
    SFX(sblock) sb = SFX(stream_scratch)(j, thread);
    ptrdiff_t nqb = (f->Tq + QBLK(f) - 1) / QBLK(f);
    ptrdiff_t b = task / nqb, i0 = task % nqb * QBLK(f);
    ptrdiff_t nq = f->Tq - i0 < QBLK(f) ? f->Tq - i0 : QBLK(f);
    ptrdiff_t Hv = f->Hv, ldk;
    REAL scale;
    const REAL *K = SFX(score_keys)(j, b, &ldk, &scale);
    const REAL *Q = in->query + (QB(j, b) * f->Tq + i0) * f->Hq;
    const REAL *V = j->vals + VB(j, b) * f->T * Hv;
    REAL *O = j->out->out + (b * f->Tq + i0) * Hv;
    REAL *lse = j->out->lse + b * f->Tq + i0;
    ptrdiff_t kend = SFX(keys_seen)(f, i0, nq);
    memset(O, 0, (size_t)(nq * Hv) * sizeof(REAL));
    for (ptrdiff_t i = 0; i < nq; i++) {
        sb.mx[i] = -INFINITY;
        sb.sum[i] = 0;
    }
    for (ptrdiff_t k0 = 0; k0 < kend; k0 += SKB) {
        ptrdiff_t nk = kend - k0 < SKB ? kend - k0 : SKB;
        SFX(product)(j, nq, nk, f->Hq, scale, Q, f->Hq, 1, K + k0 * ldk, 1,
                     ldk, NULL, 0, sb.S, nk, work);
        memset(sb.klive, 0, (size_t)nk);
        for (ptrdiff_t i = 0; i < nq; i++) {
            REAL *s = sb.S + i * nk;
            const unsigned char *m = SFX(prepare_row)(j, b, i0 + i, k0, nk,
                                                      s, sb.vis + i * nk);
            if (m == NULL && j->bad_v != NULL) {   /* product_seen reads it */
                memset(sb.vis + i * nk, 1, (size_t)nk);
            }
            REAL top = j->ops.max_row(nk, s);
            if (top == -INFINITY) {            /* sees none of these keys */
                memset(s, 0, (size_t)nk * sizeof(REAL));
                memset(sb.vis + i * nk, 0, (size_t)nk);
                continue;
            }
            /* rescale what the row has so far to the new max */
            REAL M = SFX(max_nan)(sb.mx[i], top);
            REAL c = sb.mx[i] == -INFINITY ? 0 : EXP(sb.mx[i] - M);
            double e = j->ops.exp_shift(nk, s, M, m);
            sb.sum[i] = (REAL)((double)sb.sum[i] * (double)c + e);
            sb.mx[i] = M;
            for (ptrdiff_t h = 0; c != 1 && h < Hv; h++) {
                O[i * Hv + h] *= c;
            }
            if (in->dropout > 0) {
                SFX(drop_row)(j, b, i0 + i, k0, nk, s, sb.keep);
            }
            for (ptrdiff_t t = 0; t < nk; t++) {
                sb.klive[t] |= m == NULL || m[t];
            }
        }
        SFX(pairs) seen = {sb.vis, NULL, nk, 1};
        SFX(product_seen)(j, nq, Hv, nk, 1, sb.S, nk, 1, V + k0 * Hv, Hv,
                          sb.klive, 1, O, Hv, work,
                          j->bad_v ? j->bad_v + VB(j, b) * f->T + k0 : NULL,
                          &seen, sb.kbuf);
    }
    /* no visible key: 0, -inf.  A NaN sum (a score of +inf) stays NaN:
     * l != 0, not l > 0. */
    for (ptrdiff_t i = 0; i < nq; i++) {
        REAL l = sb.sum[i], r = l != 0 ? 1 / l : 0;
        for (ptrdiff_t h = 0; h < Hv; h++) {
            O[i * Hv + h] = l != 0 ? O[i * Hv + h] * r : 0;
        }
        lse[i] = l != 0 ? sb.mx[i] + (REAL)log((double)l) : -INFINITY;
    }
}

/* One block of the streamed backward: queries [i0, i0 + nq) of sequence
 * b against keys [k0, k0 + nk).  P = exp(S - lse) recomputed, dP = G V^T,
 * dS = P (dP keep / (1 - p) - D) with D_i = g_i . out_i; then (`what`)
 * 1: dV += (P keep / (1 - p))^T G, dK += scale dS^T Q, dbias += dS (into
 * partial `part`); 2: dQ += scale dS K. */
static void SFX(stream_block)(const SFX(fjob) *j, const SFX(sblock) *sb,
                              REAL *work, ptrdiff_t b, ptrdiff_t i0,
                              ptrdiff_t nq, ptrdiff_t k0, ptrdiff_t nk,
                              int what, ptrdiff_t part)
{
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    FOUT *out = j->out;
    ptrdiff_t Hv = f->Hv, Hq = f->Hq, ldk, row = b * f->Tq + i0;
    REAL scale;
    const REAL *K = SFX(score_keys)(j, b, &ldk, &scale) + k0 * ldk;
    ptrdiff_t qrow = QB(j, b) * f->Tq + i0, krow = KB(j, b) * f->T + k0;
    ptrdiff_t vrow = VB(j, b) * f->T + k0;
    const REAL *Q = in->query + qrow * Hq, *G = in->grad_out + row * Hv;
    const REAL *O = in->out + row * Hv, *lse = in->lse + row;
    const REAL *V = j->vals + vrow * Hv;
    SFX(product)(j, nq, nk, Hq, scale, Q, Hq, 1, K, 1, ldk, NULL, 0, sb->S,
                 nk, work);
    SFX(product)(j, nq, nk, Hv, 1, G, Hv, 1, V, 1, Hv, NULL, 0, sb->dP, nk,
                 work);
    memset(sb->klive, 0, (size_t)nk);
    int nonfinite = j->bad_g || j->bad_q || j->bad_k;
    for (ptrdiff_t i = 0; i < nq; i++) {
        REAL *s = sb->S + i * nk, *dp = sb->dP + i * nk;
        REAL *pd = in->dropout > 0 ? sb->Pd + i * nk : s;
        const unsigned char *m = SFX(prepare_row)(j, b, i0 + i, k0, nk, s,
                                                  sb->vis + i * nk);
        if (m == NULL && nonfinite) {         /* product_seen reads it */
            memset(sb->vis + i * nk, 1, (size_t)nk);
        }
        sb->qlive[i] = 0;
        if (lse[i] == -INFINITY) {             /* no visible key at all */
            memset(s, 0, (size_t)nk * sizeof(REAL));
            memset(dp, 0, (size_t)nk * sizeof(REAL));
            memset(pd, 0, (size_t)nk * sizeof(REAL));
            memset(sb->vis + i * nk, 0, (size_t)nk);
            continue;
        }
        j->ops.exp_shift(nk, s, lse[i], m);
        REAL D = 0;
        for (ptrdiff_t h = 0; h < Hv; h++) {
            D += G[i * Hv + h] * O[i * Hv + h];
        }
        if (in->dropout > 0) {
            att_keep_row(in->seed, j->keep_min, b, i0 + i, k0, nk, sb->keep);
        }
        if (m == NULL && in->dropout <= 0) {    /* dS, in place */
            j->ops.ds_row(nk, s, dp, D);
            memset(sb->klive, 1, (size_t)nk);
            sb->qlive[i] = 1;
        }
        for (ptrdiff_t t = 0; (m != NULL || in->dropout > 0) && t < nk; t++) {
            int v = m == NULL || m[t];
            int kept = in->dropout <= 0 || sb->keep[t];
            REAL gamma = kept ? dp[t] * j->keep_scale : 0;
            if (in->dropout > 0) {
                pd[t] = kept ? s[t] * j->keep_scale : 0;
            }
            dp[t] = v ? s[t] * (gamma - D) : 0;
            sb->klive[t] |= v;
            sb->qlive[i] |= v;
        }
        if ((what & 1) && out->dbias.p != NULL) {
            SFX(add_dbias)(j, part, b, i0 + i, k0, nk, dp);
        }
    }
    for (ptrdiff_t t = 0; (what & 1) && j->live_kr != NULL && t < nk; t++) {
        j->live_kr[krow + t] |= sb->klive[t];
    }
    if (what & 1) {
        REAL *dV = (in->values ? out->dvalues : out->dkeys) + vrow * Hv;
        const REAL *pd = in->dropout > 0 ? sb->Pd : sb->S;
        SFX(pairs) seen = {sb->vis, NULL, 1, nk};   /* (key, query) */
        SFX(product_seen)(j, nk, Hv, nq, 1, pd, 1, nk, G, Hv, sb->qlive, 1,
                          dV, Hv, work, j->bad_g ? j->bad_g + row : NULL,
                          &seen, sb->kbuf);
        REAL *dK = f->score == ATT_SCORE_DOT
                   ? out->dkeys + krow * f->H
                   : (out->dkproj ? out->dkproj : j->dkp) + krow * f->P;
        SFX(product_seen)(j, nk, Hq, nq, scale, sb->dP, 1, nk, Q, Hq,
                          sb->qlive, 1, dK,
                          f->score == ATT_SCORE_DOT ? f->H : f->P, work,
                          j->bad_q ? j->bad_q + qrow : NULL, &seen,
                          sb->kbuf);
    }
    if (what & 2) {
        SFX(pairs) seen = {sb->vis, NULL, nk, 1};   /* (query, key) */
        SFX(product_seen)(j, nq, Hq, nk, scale, sb->dP, nk, 1, K, ldk,
                          sb->klive, 1, out->dquery + qrow * Hq, Hq, work,
                          j->bad_k ? j->bad_k + krow : NULL, &seen,
                          sb->kbuf);
    }
}

/* The whole streamed backward of sequence b in one pass: the keys'
 * blocks outer, the queries' that see them inner. */
static void SFX(stream_sequence)(const SFX(fjob) *j, const SFX(sblock) *sb,
                                 REAL *work, ptrdiff_t b, ptrdiff_t part)
{
    const att_fdims *f = &j->f;
    for (ptrdiff_t k0 = 0; k0 < f->T; k0 += SKB) {
        ptrdiff_t nk = f->T - k0 < SKB ? f->T - k0 : SKB;
        for (ptrdiff_t i0 = SFX(first_query)(f, k0); i0 < f->Tq;
             i0 += QBLK(f)) {
            ptrdiff_t nq = f->Tq - i0 < QBLK(f) ? f->Tq - i0 : QBLK(f);
            SFX(stream_block)(j, sb, work, b, i0, nq, k0,
                              SFX(block_keys)(f, i0, nq, k0, nk), 3, part);
        }
    }
}

/* Two passes for few long sequences: task (b, key block) makes dK, dV
 * of its keys; then task (b, query block) dQ of its queries. */
static void SFX(stream_keys_task)(void *arg, ptrdiff_t task, int thread)
{
    const SFX(fjob) *j = arg;
    const att_fdims *f = &j->f;
    SFX(sblock) sb = SFX(stream_scratch)(j, thread);
    ptrdiff_t nkb = (f->T + SKB - 1) / SKB;
    ptrdiff_t b = task / nkb, k0 = task % nkb * SKB;
    ptrdiff_t nk = f->T - k0 < SKB ? f->T - k0 : SKB;
    for (ptrdiff_t i0 = SFX(first_query)(f, k0); i0 < f->Tq; i0 += QBLK(f)) {
        ptrdiff_t nq = f->Tq - i0 < QBLK(f) ? f->Tq - i0 : QBLK(f);
        SFX(stream_block)(j, &sb, SFX(thread_scratch)(j, thread), b, i0, nq,
                          k0, SFX(block_keys)(f, i0, nq, k0, nk), 1, 0);
    }
}

static void SFX(stream_queries_task)(void *arg, ptrdiff_t task, int thread)
{
    const SFX(fjob) *j = arg;
    const att_fdims *f = &j->f;
    SFX(sblock) sb = SFX(stream_scratch)(j, thread);
    ptrdiff_t nqb = (f->Tq + QBLK(f) - 1) / QBLK(f);
    ptrdiff_t b = task / nqb, i0 = task % nqb * QBLK(f);
    ptrdiff_t nq = f->Tq - i0 < QBLK(f) ? f->Tq - i0 : QBLK(f);
    for (ptrdiff_t k0 = 0; k0 < SFX(keys_seen)(f, i0, nq); k0 += SKB) {
        ptrdiff_t nk = f->T - k0 < SKB ? f->T - k0 : SKB;
        SFX(stream_block)(j, &sb, SFX(thread_scratch)(j, thread), b, i0, nq,
                          k0, SFX(block_keys)(f, i0, nq, k0, nk), 2, 0);
    }
}

/* ---------------------------------------------------------------------
 * Decoding: few queries per sequence (DECODE_TQ), one task per query
 */

/* n elements of x to 0 (x may be NULL when n is 0). */
static void SFX(zero)(REAL *x, ptrdiff_t n)
{
    if (n > 0) {
        memset(x, 0, (size_t)n * sizeof(REAL));
    }
}

/* Decoding reads the keys (dot score) and the values where they are:
 * sequence j of Bk (Bv) at koff[j] (voff[j]), rows krs (vrs) apart
 * (attention.h); the keys are the values when none are given. */
static const REAL *SFX(decode_keys)(const SFX(fjob) *j, ptrdiff_t b,
                                    ptrdiff_t *ldk, REAL *scale)
{
    const FIN *in = j->in;
    if (j->f.score != ATT_SCORE_DOT ||
        (in->koff == NULL && in->krs == 0)) {
        return SFX(score_keys)(j, b, ldk, scale);
    }
    ptrdiff_t kb = KB(j, b);
    *ldk = in->krs != 0 ? in->krs : j->f.H;
    *scale = in->scale;
    return in->keys + (in->koff != NULL ? in->koff[kb]
                                        : kb * j->f.T * j->f.H);
}

static const REAL *SFX(decode_values)(const SFX(fjob) *j, ptrdiff_t b,
                                      ptrdiff_t *ldv)
{
    const FIN *in = j->in;
    const att_fdims *f = &j->f;
    if (in->values == NULL) {          /* the keys, as the score reads */
        ptrdiff_t kb = KB(j, b);
        *ldv = in->krs != 0 ? in->krs : f->H;
        return in->keys + (in->koff != NULL ? in->koff[kb]
                                            : kb * f->T * f->H);
    }
    ptrdiff_t vb = VB(j, b);
    *ldv = in->vrs != 0 ? in->vrs : f->Hv;
    return in->values + (in->voff != NULL ? in->voff[vb]
                                          : vb * f->T * f->Hv);
}

/* Query i of sequence b against its keys: the scores by one pass over
 * the keys (dot_keys), the softmax of the row (stored in alpha, or
 * streamed: its max and sum, lse), out by one pass over the values
 * (sum_values).  The keys and values are read once and never searched
 * for a NaN first: the scores of keys the query does not see are dropped
 * (prepare_row), and the values of those rows are never read, so a NaN
 * or an infinity reaches exactly the results that see it.  Keys past
 * those a causal query sees are not computed. */
static void SFX(decode_task)(void *arg, ptrdiff_t task, int thread)
{
    const SFX(fjob) *j = arg;
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    ptrdiff_t b = task / f->Tq, i = task % f->Tq, T = f->T, Hv = f->Hv;
    ptrdiff_t row = b * f->Tq + i, ldk, ldv;
    REAL scale;
    const REAL *K = SFX(decode_keys)(j, b, &ldk, &scale);
    const REAL *V = SFX(decode_values)(j, b, &ldv);
    const REAL *q = in->query + (QB(j, b) * f->Tq + i) * f->Hq;
    REAL *o = j->out->out + row * Hv;
    REAL *work = SFX(thread_scratch)(j, thread);
    REAL *s = f->stream ? work : j->out->alpha + row * T;
    REAL *dropped = work + (f->stream ? T : 0);   /* stored, dropout */
    unsigned char *vis = (unsigned char *)(dropped + (f->stream ||
                                                      !f->dropout ? 0 : T));
    unsigned char *keep = vis + T;
    ptrdiff_t n = SFX(keys_seen)(f, i, 1);
    j->ops.dot_keys(n, f->Hq, scale, q, K, ldk, s);
    if (!f->stream) {         /* alpha: the weights of all T keys */
        SFX(zero)(s + n, T - n);
        const unsigned char *m = SFX(prepare_row)(j, b, i, 0, T, s, vis);
        j->ops.softmax(T, s, m, s);
        const REAL *w = s;
        if (in->dropout > 0) {
            memcpy(dropped, s, (size_t)T * sizeof(REAL));
            SFX(drop_row)(j, b, i, 0, T, dropped, keep);
            w = dropped;
        }
        /* alpha != 0 exactly where a key is visible (WEIGHT_FLOOR) */
        j->ops.sum_values(n, Hv, w, V, ldv, m, o);
        return;
    }
    const unsigned char *m = SFX(prepare_row)(j, b, i, 0, n, s, vis);
    REAL top = j->ops.max_row(n, s);
    if (top == -INFINITY) {                    /* no visible key: 0, -inf */
        SFX(zero)(o, Hv);
        j->out->lse[row] = -INFINITY;
        return;
    }
    /* l > 0 (a visible weight is at least the least normal), or NaN */
    REAL l = (REAL)j->ops.exp_shift(n, s, top, m), r = 1 / l;
    if (in->dropout > 0) {
        SFX(drop_row)(j, b, i, 0, n, s, keep);
    }
    j->ops.sum_values(n, Hv, s, V, ldv, m, o);
    for (ptrdiff_t h = 0; h < Hv; h++) {
        o[h] *= r;
    }
    j->out->lse[row] = top + (REAL)log((double)l);
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
    if (!f->stream && !j->decode) {
        REAL *srow = SFX(thread_scratch)(j, 0) + j->ops.gemm_work;
        SFX(find_live)(j, srow, (unsigned char *)(srow + f->T));
    }
    SFX(project)(j);
    SFX(find_nonfinite)(j, backward);
    return 0;
}

int SFX(att_family_reads_strided)(const att_fdims *f, int backward)
{
    if (f == NULL || backward || f->Tq > DECODE_TQ) {
        return 0;
    }
    return f->score == ATT_SCORE_DOT ? ATT_STRIDED_KEYS | ATT_STRIDED_VALUES
           : f->score == ATT_SCORE_GENERAL ? ATT_STRIDED_VALUES : 0;
}

int SFX(att_family_forward)(const att_fdims *f, const att_exec *ex,
                            const FIN *in, FOUT *out, void *work)
{
    SFX(fjob) j;
    if (f == NULL || out == NULL || f->stream != (out->alpha == NULL) ||
        (f->stream && out->lse == NULL) ||
        SFX(family_start)(&j, f, ex, in, out, work, 0) < 0) {
        return ATT_EINVAL;
    }
    if (j.decode) {
        att_pool_run(j.ex.pool, j.threads, f->B * f->Tq, SFX(decode_task),
                     &j);
        return ATT_OK;
    }
    if (f->stream) {
        att_pool_run(j.ex.pool, j.threads,
                     f->B * ((f->Tq + QBLK(f) - 1) / QBLK(f)),
                     SFX(stream_forward_task), &j);
        return ATT_OK;
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
 * Backward with the weights given: one sequence at a time (its keys
 * gather every query), then the projections' backward over all rows
 */

static void SFX(backward_sequence)(const SFX(fjob) *j, REAL *work,
                                   ptrdiff_t b, ptrdiff_t part)
{
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    FOUT *out = j->out;
    ptrdiff_t T = f->T, Tq = f->Tq, Hv = f->Hv;
    REAL *delta = work + j->ops.gemm_work;              /* (Tq, T) */
    REAL *dropped = delta + Tq * T;           /* (Tq, T) with dropout */
    unsigned char *keep = (unsigned char *)(dropped + (in->dropout > 0
                                                       ? Tq * T : 0) + T);
    unsigned char *kbuf = keep + T, *vis = kbuf + T + Tq;    /* (Tq, T) */
    ptrdiff_t qb = QB(j, b), kb = KB(j, b), vb = VB(j, b);
    const REAL *G = in->grad_out + b * Tq * Hv, *al = in->alpha + b * Tq * T;
    /* which pairs see each other, by the masks (alpha is the caller's) */
    for (ptrdiff_t i = 0; i < Tq; i++) {
        SFX(visible_row)(j, b, i, vis + i * T);
    }
    SFX(pairs) by_key = {vis, NULL, 1, T}, by_query = {vis, NULL, T, 1};
    const REAL *Q = in->query + qb * Tq * f->Hq, *K = in->keys + kb * T * f->H;
    const unsigned char *lk = j->live_k ? j->live_k + b * T : NULL;
    const unsigned char *lq = j->live_q ? j->live_q + b * Tq : NULL;
    /* out = alpha V  ->  gamma = G V^T + ga;  dV = alpha^T G */
    SFX(product)(j, Tq, T, Hv, 1, G, Hv, 1, j->vals + vb * T * Hv, 1, Hv,
                 NULL, 0, delta, T, work);
    for (ptrdiff_t i = 0; i < Tq; i++) {
        const REAL *ga = in->grad_alpha ? in->grad_alpha + (b * Tq + i) * T
                                        : NULL;
        const REAL *a = al + i * T;
        REAL *row = delta + i * T;
        const unsigned char *v = vis + i * T;
        if (in->dropout > 0) {       /* gamma and alpha times keep/(1-p) */
            memcpy(dropped + i * T, a, (size_t)T * sizeof(REAL));
            SFX(drop_row)(j, b, i, 0, T, dropped + i * T, keep);
            for (ptrdiff_t t = 0; t < T; t++) {
                row[t] = keep[t] ? row[t] * j->keep_scale : 0;
            }
        }
        for (ptrdiff_t t = 0; t < T; t++) {  /* masked: alpha 0, gamma 0 */
            row[t] = v[t] ? row[t] + (ga ? ga[t] : 0) : 0;
        }
        /* alpha = softmax(s)  ->  delta = dL/ds, in place */
        j->ops.softmax_backward(T, row, a, row);
        if (out->dbias.p != NULL) {
            SFX(add_dbias)(j, part, b, i, 0, T, row);
        }
    }
    /* the gradients were zeroed: every product adds (sequences that
     * share a query, keys or values sum into them, in order) */
    REAL *dV = in->values ? out->dvalues + vb * T * Hv
                          : out->dkeys + kb * T * f->H;
    SFX(product_seen)(j, T, Hv, Tq, 1, in->dropout > 0 ? dropped : al, 1, T,
                      G, Hv, lq, 1, dV, Hv, work,
                      j->bad_g ? j->bad_g + b * Tq : NULL, &by_key, kbuf);
    /* the scores' backward */
    if (f->score == ATT_SCORE_DOT) {            /* dQ = s D K, dK = s D^T Q */
        SFX(product_seen)(j, Tq, f->H, T, in->scale, delta, T, 1, K, f->H,
                          lk, 1, out->dquery + qb * Tq * f->Hq, f->Hq, work,
                          j->bad_k ? j->bad_k + kb * T : NULL, &by_query,
                          kbuf);
        SFX(product_seen)(j, T, f->H, Tq, in->scale, delta, 1, T, Q, f->Hq,
                          lq, 1, out->dkeys + kb * T * f->H, f->H, work,
                          j->bad_q ? j->bad_q + qb * Tq : NULL, &by_key,
                          kbuf);
    }
    else if (f->score == ATT_SCORE_GENERAL) {   /* on kp: dQ, dkp */
        REAL *dkp = out->dkproj ? out->dkproj : j->dkp;
        SFX(product_seen)(j, Tq, f->Hq, T, 1, delta, T, 1,
                          j->kp + kb * T * j->ldk, j->ldk, lk, 1,
                          out->dquery + qb * Tq * f->Hq, f->Hq, work,
                          j->bad_k ? j->bad_k + kb * T : NULL, &by_query,
                          kbuf);
        SFX(product_seen)(j, T, f->P, Tq, 1, delta, 1, T, Q, f->Hq, lq, 1,
                          dkp + kb * T * f->P, f->P, work,
                          j->bad_q ? j->bad_q + qb * Tq : NULL, &by_key,
                          kbuf);
    }
    else {                                      /* eq, ek, dv by pairs */
        REAL *eq = j->eq + b * Tq * j->apad, *ek = j->ek + b * T * j->apad;
        REAL *dv = j->dvpart + b * j->apad;
        memset(dv, 0, (size_t)j->apad * sizeof(REAL));
        for (ptrdiff_t i = 0; i < Tq; i++) {
            j->ops.add_scores_backward(
                T, j->apad, j->qp + (b * Tq + i) * j->apad,
                j->kp + b * T * j->ldk, j->ldk, j->vp, delta + i * T,
                vis + i * T, i == 0, eq + i * j->apad, ek, j->apad, dv);
        }
    }
}

/* Task p: the sequences of group p, in order, each summing its bias
 * gradient into partial p when the bias is shared. */
static void SFX(backward_task)(void *arg, ptrdiff_t p, int thread)
{
    const SFX(fjob) *j = arg;
    const att_fdims *f = &j->f;
    const FIN *in = j->in;
    ptrdiff_t g0 = p * j->ngroups / j->nparts;
    ptrdiff_t g1 = (p + 1) * j->ngroups / j->nparts;
    ptrdiff_t b0 = in->order ? in->gstart[g0] : g0;
    ptrdiff_t b1 = in->order ? in->gstart[g1] : g1;
    ptrdiff_t part = f->bias_shared ? p : 0;
    REAL *work = SFX(thread_scratch)(j, thread);
    SFX(sblock) sb = SFX(stream_scratch)(j, thread);
    for (ptrdiff_t r = b0; r < b1; r++) {
        ptrdiff_t b = in->order ? in->order[r] : r;
        if (j->stream) {
            SFX(stream_sequence)(j, &sb, work, b, part);
        }
        else {
            SFX(backward_sequence)(j, work, b, part);
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
    ptrdiff_t BT = j->Bk * f->T, BTq = j->Bq * f->Tq, P = f->P, ld = in->ldw;
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
                  f->score == ATT_SCORE_GENERAL ? j->live_kr : j->live_k, 0,
                  out->dW, ld);
}

int SFX(att_family_backward)(const att_fdims *f, const att_exec *ex,
                             const FIN *in, FOUT *out, void *work)
{
    SFX(fjob) j;
    if (f == NULL || in == NULL || out == NULL ||
        (f->stream != (in->alpha == NULL)) ||
        (f->stream && (in->out == NULL || in->lse == NULL ||
                       in->grad_alpha != NULL)) ||
        SFX(family_start)(&j, f, ex, in, out, work, 1) < 0) {
        return ATT_EINVAL;
    }
    /* every product adds to the gradients (see backward_sequence) */
    ptrdiff_t Hkd = f->score == ATT_SCORE_DOT ? f->H : f->P;
    if (f->score != ATT_SCORE_ADDITIVE) {
        SFX(zero)(out->dquery, j.Bq * f->Tq * f->Hq);
        SFX(zero)(f->score == ATT_SCORE_DOT ? out->dkeys
                  : out->dkproj ? out->dkproj : j.dkp, j.Bk * f->T * Hkd);
    }
    if (in->values != NULL) {
        SFX(zero)(out->dvalues, j.Bv * f->T * f->Hv);
    }
    else if (f->score != ATT_SCORE_DOT) {       /* dV goes to dkeys */
        SFX(zero)(out->dkeys, j.Bk * f->T * f->H);
    }
    if (j.live_kr != NULL) {  /* the stored path knows; streams record */
        memset(j.live_kr, 0, (size_t)(j.Bk * f->T));
        for (ptrdiff_t b = 0; !f->stream && b < f->B; b++) {
            unsigned char *kr = j.live_kr + KB(&j, b) * f->T;
            for (ptrdiff_t t = 0; t < f->T; t++) {
                kr[t] |= j.live_k == NULL || j.live_k[b * f->T + t];
            }
        }
    }
    REAL *dbias = (REAL *)(uintptr_t)out->dbias.p;
    ptrdiff_t nparts = dbias != NULL && f->bias_shared ? j.nparts : 1;
    if (dbias != NULL) {
        SFX(zero)(dbias, f->nbias);
        SFX(zero)(j.dbias_parts, (nparts - 1) * f->nbias);
    }
    if (j.two_pass) {
        att_pool_run(j.ex.pool, j.threads, f->B * ((f->T + SKB - 1) / SKB),
                     SFX(stream_keys_task), &j);
        att_pool_run(j.ex.pool, j.threads,
                     f->B * ((f->Tq + QBLK(f) - 1) / QBLK(f)),
                     SFX(stream_queries_task), &j);
    }
    else {
        att_pool_run(j.ex.pool, j.threads, j.nparts, SFX(backward_task), &j);
    }
    for (ptrdiff_t p = 1; p < nparts; p++) {   /* the partials, in order */
        const REAL *x = j.dbias_parts + (p - 1) * f->nbias;
        for (ptrdiff_t e = 0; e < f->nbias; e++) {
            dbias[e] += x[e];
        }
    }
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
    att_fdims f = {.score = ATT_SCORE_GENERAL, .B = 1, .Tq = 1,
                   .T = d.B > 0 ? d.B : 1, .H = d.H, .Hq = d.A, .Hv = d.H,
                   .P = d.A};
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
