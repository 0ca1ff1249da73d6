/*
 * check_impl.h - the checks of check.c for one floating type: included
 * once per type with REAL, SFX(name), ATT(name) (the kernel of that
 * type), TYPE_INDEX and TYPE_NAME, which it #undefs at its end.
 */

/* Normwise relative error allowed between a SIMD path and the scalar
 * path (~100 eps: they sum in other orders; attention_c.testing's TOL).
 * Ill-conditioned outputs (the additive gradients are sums of delta_t
 * terms with sum_t delta_t = 0, worst with A = 1) lose more digits in any
 * evaluation: their bound is raised to ILL_FACTOR times the change of the
 * scalar path's result when every input moves by one rounding, at most
 * ILL_CAP times TOL. */
#define ILL_FACTOR 16.0
#define ILL_CAP 100.0
#if TYPE_INDEX == 0
#define TOL 1e-5
#define NEXTAFTER nextafterf
/* tanh: ulps from the correctly rounded value (tanh in double, rounded) */
#define TANH_ULP 3
#define WHOLE_BITS uint32_t
#else
#define TOL 1e-12
#define NEXTAFTER nextafter
/* ulps from tanh in long double rounded (one more when long double is
 * only double) */
#define TANH_ULP (LDBL_MANT_DIG > DBL_MANT_DIG ? 5 : 6)
#define WHOLE_BITS uint64_t
#endif

/* n elements, set to NaN: an output the kernel does not write shows. */
static REAL *SFX(nans)(ptrdiff_t n)
{
    REAL *x = xmalloc((size_t)n * sizeof(REAL));
    for (ptrdiff_t i = 0; i < n; i++) {
        x[i] = (REAL)NAN;
    }
    return x;
}

/* n elements uniform in [-scale, scale). */
static REAL *SFX(rand)(ctx *c, ptrdiff_t n, double scale)
{
    REAL *x = xmalloc((size_t)n * sizeof(REAL));
    for (ptrdiff_t i = 0; i < n; i++) {
        x[i] = (REAL)(scale * (2 * uniform(c) - 1));
    }
    return x;
}

static REAL *SFX(copy)(ptrdiff_t n, const REAL *x)
{
    REAL *y = xmalloc((size_t)n * sizeof(REAL));
    memcpy(y, x, (size_t)n * sizeof(REAL));
    return y;
}

/* x with every element moved by one ulp, up or down at random (NaN stays
 * NaN); NULL stays NULL. */
static REAL *SFX(jiggle)(ctx *c, ptrdiff_t n, const REAL *x)
{
    if (x == NULL) {
        return NULL;
    }
    REAL *y = xmalloc((size_t)n * sizeof(REAL));
    for (ptrdiff_t i = 0; i < n; i++) {
        REAL to = next_u64(c) & 1 ? (REAL)INFINITY : -(REAL)INFINITY;
        y[i] = NEXTAFTER(x[i], to);
    }
    return y;
}

/* Rows r (w wide) of x set to NaN where keep[r] is 0. */
static void SFX(poison)(ptrdiff_t rows, ptrdiff_t w, const unsigned char *keep,
                        REAL *x)
{
    for (ptrdiff_t r = 0; x != NULL && r < rows; r++) {
        for (ptrdiff_t k = 0; !keep[r] && k < w; k++) {
            x[r * w + k] = (REAL)NAN;
        }
    }
}

/* ||got - want|| / ||want|| in double; NaN when either holds a NaN or an
 * inf (no output of these inputs may), inf when want is 0 and got not. */
static double SFX(rel_err)(ptrdiff_t n, const REAL *got, const REAL *want)
{
    double num = 0, den = 0;
    for (ptrdiff_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) || !isfinite(want[i])) {
            return NAN;
        }
        double e = (double)got[i] - (double)want[i];
        num += e * e;
        den += (double)want[i] * (double)want[i];
    }
    if (den == 0) {
        return num == 0 ? 0 : INFINITY;
    }
    return sqrt(num / den);
}

/* The worst error of each output kind, for -v. */
static void SFX(note)(ctx *c, const char *name, double e, int raised);

/* Run k of a case: 0 the scalar path; 1, 2 the path under test on 1 and
 * on 2 threads of the pool; 3 the scalar path again, on the inputs moved
 * by one ulp (jiggle): how much its results move shows how ill-conditioned
 * they are. */
#define RUNS 4
static att_exec SFX(exec)(const ctx *c, int k)
{
    att_exec ex = {k == 1 || k == 2 ? c->simd : ATT_SIMD_SCALAR,
                   k == 2 ? 2 : 1, c->pool, ATT_PRECISION_IEEE, 0};
    return ex;
}

/* Output `name` (n elements) of the runs x: run 1 against run 0 within
 * the bound, run 2 the same bits as run 1.  x[0] NULL: not asked for. */
static void SFX(judge)(ctx *c, const char *name, ptrdiff_t n, REAL *const *x)
{
    if (x[0] == NULL) {
        return;
    }
    double ill = ILL_FACTOR * SFX(rel_err)(n, x[3], x[0]);
    double bound = ill > TOL ? (ill < ILL_CAP * TOL ? ill : ILL_CAP * TOL)
                             : TOL;
    double e = SFX(rel_err)(n, x[1], x[0]);
    SFX(note)(c, name, e, bound > TOL);
    expect(c, e <= bound, "%s: normwise relative error %.3g > %.3g", name,
           e, bound);
    expect(c, n == 0 || memcmp(x[1], x[2], (size_t)n * sizeof(REAL)) == 0,
           "%s: 1 and 2 threads give different bits", name);
}

static void SFX(free_runs)(REAL **x)
{
    for (int k = 0; k < RUNS; k++) {
        free(x[k]);
        x[k] = NULL;
    }
}

static void *SFX(workspace)(ctx *c, ptrdiff_t bytes)
{
    expect(c, bytes >= 0, "workspace size %td", bytes);
    return xmalloc(bytes > 0 ? (size_t)bytes : 1);
}

/* ---------------------------------------------------------------------
 * context_attention and its backward
 */

static void SFX(context_case)(ctx *c, att_dims d, int mk, int bias,
                              int keep, int gal)
{
    ptrdiff_t B = d.B, T = d.T, H = d.H, A = d.A;
    /* H = 0: every score of a sequence is the same, so dv and db are
     * sum_t ds_t (...) with sum_t ds_t = 0, rounding noise that no
     * relative bound fits; without grad_alpha ds is exactly 0 instead */
    gal = gal && H > 0;
    snprintf(c->what, sizeof c->what,
             "%s context B=%td T=%td H=%td A=%td mask=%d bias=%d act=%d "
             "grad_alpha=%d", TYPE_NAME, B, T, H, A, mk, bias, keep, gal);
    c->shapes++;
    unsigned char *m = make_mask(c, mk, B, 1, T);
    /* inputs [0] and, jiggled, [1] (run 3's) */
    REAL *h[2], *W[2], *v[2], *b[2];
    h[0] = SFX(rand)(c, B * T * H, 1);
    W[0] = SFX(rand)(c, A * 2 * H, 1.5 / sqrt(H > 0 ? (double)H : 1));
    v[0] = SFX(rand)(c, A, 1);
    b[0] = bias ? SFX(rand)(c, A, 0.5) : NULL;
    if (m != NULL) {
        SFX(poison)(B * T, H, m, h[0]);   /* padding reaches no result */
    }
    h[1] = SFX(jiggle)(c, B * T * H, h[0]);
    W[1] = SFX(jiggle)(c, A * 2 * H, W[0]);
    v[1] = SFX(jiggle)(c, A, v[0]);
    b[1] = SFX(jiggle)(c, A, b[0]);
    REAL *out[RUNS], *alpha[RUNS], *act[RUNS];
    for (int k = 0; k < RUNS; k++) {
        att_exec ex = SFX(exec)(c, k);
        int i = k == 3;
        out[k] = SFX(nans)(B * H);
        alpha[k] = SFX(nans)(B * T);
        act[k] = keep ? SFX(nans)(B * T * A) : NULL;
        void *work = SFX(workspace)(
            c, ATT(context_attention_workspace)(d, &ex));
        int st = ATT(context_attention)(d, &ex, h[i], W[i], v[i], b[i], m,
                                        out[k], alpha[k], act[k], work);
        c->calls++;
        expect(c, st == ATT_OK, "forward run %d returned %d", k, st);
        free(work);
    }
    SFX(judge)(c, "out", B * H, out);
    SFX(judge)(c, "alpha", B * T, alpha);
    SFX(judge)(c, "act", B * T * A, act);
    /* masked items: alpha and their activations exactly 0 */
    int zeros = 1;
    for (ptrdiff_t r = 0; m != NULL && r < B * T; r++) {
        zeros &= m[r] || alpha[1][r] == 0;
        for (ptrdiff_t a = 0; keep && !m[r] && a < A; a++) {
            zeros &= act[1][r * A + a] == 0;
        }
    }
    expect(c, zeros, "a masked item has alpha or act not 0");

    /* the backward, from the scalar path's alpha (and activations, NaN in
     * the masked rows: never read) */
    REAL *g[2], *ga[2], *al[2], *act_in[2];
    g[0] = SFX(rand)(c, B * H, 1);
    ga[0] = gal ? SFX(rand)(c, B * T, 1) : NULL;
    al[0] = alpha[0];
    act_in[0] = keep ? SFX(copy)(B * T * A, act[0]) : NULL;
    if (keep && m != NULL) {
        SFX(poison)(B * T, A, m, act_in[0]);
    }
    g[1] = SFX(jiggle)(c, B * H, g[0]);
    ga[1] = SFX(jiggle)(c, B * T, ga[0]);
    al[1] = SFX(jiggle)(c, B * T, al[0]);
    act_in[1] = SFX(jiggle)(c, B * T * A, act_in[0]);
    REAL *dh[RUNS], *dW[RUNS], *dv[RUNS], *db[RUNS];
    for (int k = 0; k < RUNS; k++) {
        att_exec ex = SFX(exec)(c, k);
        int i = k == 3;
        dh[k] = SFX(nans)(B * T * H);
        dW[k] = SFX(nans)(A * 2 * H);
        dv[k] = SFX(nans)(A);
        db[k] = bias ? SFX(nans)(A) : NULL;
        void *work = SFX(workspace)(
            c, ATT(context_attention_backward_workspace)(d, &ex));
        int st = ATT(context_attention_backward)(
            d, &ex, g[i], h[i], W[i], v[i], al[i], b[i], m, ga[i], act_in[i],
            dh[k], dW[k], dv[k], db[k], work);
        c->calls++;
        expect(c, st == ATT_OK, "backward run %d returned %d", k, st);
        free(work);
    }
    SFX(judge)(c, "dh", B * T * H, dh);
    SFX(judge)(c, "dW", A * 2 * H, dW);
    SFX(judge)(c, "dv", A, dv);
    SFX(judge)(c, "db", A, db);
    REAL **runs[] = {out, alpha, act, dh, dW, dv, db};
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        SFX(free_runs)(runs[i]);
    }
    for (int i = 0; i < 2; i++) {
        free(h[i]);
        free(W[i]);
        free(v[i]);
        free(b[i]);
        free(g[i]);
        free(ga[i]);
        free(act_in[i]);
    }
    free(al[1]);
    free(m);
}

/* Sizes (B, T, H, A) around the micro-tiles of every path (NEON: MR = 8
 * rows, NR = 8 float32 / 4 float64 columns; AVX2 6 x 16 / 8; AVX-512
 * 12 x 32 / 16), the forward's row blocks (MC = 10 MR) and the backward's
 * (MCB = 20 MR), odd sizes, B = 0. */
static const att_dims SFX(context_sizes)[] = {
    {0, 1, 1, 1}, {0, 3, 5, 7}, {1, 1, 1, 1}, {1, 3, 3, 3}, {3, 1, 2, 5},
    {2, 17, 17, 17}, {3, 65, 17, 9}, {2, 17, 65, 65}, {1, 8, 8, 8},
    {2, 7, 9, 7}, {2, 9, 7, 9}, {2, 16, 4, 16}, {1, 79, 5, 15},
    {1, 80, 3, 4}, {1, 81, 4, 17}, {2, 159, 9, 8}, {1, 160, 8, 3},
    {1, 161, 17, 33}, {1, 321, 3, 5}, {4, 33, 33, 1}, {1, 5, 1, 65},
    {3, 4, 2, 2}, {5, 12, 16, 32}, {1, 200, 12, 24}, {2, 13, 0, 5},
    {2, 11, 6, 0},
};

/* Big enough (B T (H + 1) (A + 1) >= 2^23) that 2 threads do run: one
 * sequence split in row blocks, and several sequences. */
static const att_dims SFX(context_big)[] = {
    {1, 2000, 64, 64}, {8, 260, 64, 64},
};

static void SFX(context_all)(ctx *c)
{
    const int n = (int)(sizeof(SFX(context_sizes)) /
                        sizeof(SFX(context_sizes)[0]));
    for (int s = 0; s < n; s++) {
        for (int mk = 0; mk < 4; mk++) {
            /* two complementary sets of options per mask kind */
            int o = (s + mk) % 8;
            for (int twice = 0; twice < 2; twice++, o ^= 7) {
                SFX(context_case)(c, SFX(context_sizes)[s], mk, o & 1,
                                  (o >> 1) & 1, (o >> 2) & 1);
            }
        }
    }
    for (int s = 0; s < 2; s++) {
        SFX(context_case)(c, SFX(context_big)[s], 3, 1, s, 1);
    }
}

/* ---------------------------------------------------------------------
 * The attention family and project_keys
 */

typedef struct {
    int score, mk;            /* enum att_score; mask kind (make_mask) */
    int values, bias, gal;    /* values given; b given; grad_alpha given */
    int kp_mode;              /* 0 keys projected here, 1 kproj given,
                                 2 also the backward stops at kproj */
} SFX(fopts);

static void SFX(family_case)(ctx *c, att_fdims f, SFX(fopts) o)
{
    int additive = o.score == ATT_SCORE_ADDITIVE;
    int dot = o.score == ATT_SCORE_DOT;
    f.score = o.score;
    int per_query = o.mk == 4;      /* mask kind 4: a mask per query */
    if (dot) {
        f.Hq = f.H;
        f.P = 0;
    }
    else if (!additive) {
        f.P = f.Hq;
    }
    if (f.H == 0) {
        /* scores constant over the keys: the additive gradients would be
         * sums of ds with sum_t ds_t = 0, noise no relative bound fits;
         * without values and grad_alpha ds is exactly 0 instead (see
         * context_case) */
        o.values = o.gal = 0;
    }
    if (!o.values) {
        f.Hv = f.H;
    }
    int kp_mode = dot ? 0 : o.kp_mode, bias = additive && o.bias;
    ptrdiff_t B = f.B, Tq = f.Tq, T = f.T, H = f.H, Hq = f.Hq, Hv = f.Hv;
    ptrdiff_t P = f.P, ldw = additive ? H + Hq : H;
    snprintf(c->what, sizeof c->what,
             "%s family %s B=%td Tq=%td T=%td H=%td Hq=%td Hv=%td P=%td "
             "mask=%d values=%d bias=%d grad_alpha=%d kproj=%d", TYPE_NAME,
             additive ? "additive" : (dot ? "dot" : "general"), B, Tq, T, H,
             Hq, Hv, P, o.mk, o.values, bias, o.gal, kp_mode);
    c->shapes++;
    unsigned char *m = make_mask(c, o.mk, B, Tq, T);
    REAL *query = SFX(rand)(c, B * Tq * Hq, 1);
    REAL *keys = SFX(rand)(c, B * T * H, 1);
    REAL *values = o.values ? SFX(rand)(c, B * T * Hv, 1) : NULL;
    REAL *W = dot ? NULL : SFX(rand)(c, P * ldw, 1.5 / sqrt((double)ldw +
                                                          (ldw == 0)));
    REAL *v = additive ? SFX(rand)(c, P, 1) : NULL;
    REAL *b = bias ? SFX(rand)(c, P, 0.5) : NULL;
    /* the padding: keys masked for every query, queries with no key */
    unsigned char *live_k = xmalloc((size_t)(B * T));
    unsigned char *live_q = xmalloc((size_t)(B * Tq));
    for (ptrdiff_t bi = 0; bi < B; bi++) {
        for (ptrdiff_t t = 0; t < T; t++) {
            live_k[bi * T + t] = 0;
        }
        for (ptrdiff_t i = 0; i < Tq; i++) {
            const unsigned char *mr = m == NULL ? NULL
                                      : m + (per_query ? (bi * Tq + i)
                                                       : bi) * T;
            unsigned char any = 0;
            for (ptrdiff_t t = 0; t < T; t++) {
                unsigned char on = mr == NULL || mr[t];
                live_k[bi * T + t] |= on;
                any |= on;
            }
            live_q[bi * Tq + i] = any;
        }
    }
    SFX(poison)(B * T, H, live_k, keys);
    SFX(poison)(B * T, Hv, live_k, values);
    SFX(poison)(B * Tq, Hq, live_q, query);
    REAL *kproj = NULL;
    if (kp_mode) {            /* the scalar path's projection */
        att_dims pd = {B * T, 1, H, P};
        att_exec ex = SFX(exec)(c, 0);
        kproj = SFX(nans)(B * T * P);
        void *work = SFX(workspace)(c, ATT(project_keys_workspace)(pd, &ex));
        int st = ATT(project_keys)(pd, &ex, keys, W, ldw, kproj, work);
        expect(c, st == ATT_OK, "project_keys returned %d", st);
        free(work);
        SFX(poison)(B * T, P, live_k, kproj);
    }
    REAL scale = dot ? (REAL)(1 / sqrt(H > 1 ? (double)H : 1)) : 1;
    /* the mask: the keys' (B, T), or per query (B, Tq, T) as attn_mask */
    att_view none = {NULL, NULL, 0, 0, 0};
    att_view key_mask = {per_query ? NULL : m, NULL, T, 0, 1};
    att_view query_mask = {per_query ? m : NULL, NULL, Tq * T, T, 1};
    /* in[1]: run 3's inputs, moved by one ulp */
    ATT(family_in) in[2] = {
        {.query = query, .keys = keys, .kproj = kproj, .values = values,
         .W = W, .v = v, .b = b, .ldw = ldw, .scale = scale,
         .mask = m ? key_mask : none, .attn_mask = m ? query_mask : none},
        {.query = SFX(jiggle)(c, B * Tq * Hq, query),
         .keys = SFX(jiggle)(c, B * T * H, keys),
         .kproj = SFX(jiggle)(c, B * T * P, kproj),
         .values = SFX(jiggle)(c, B * T * Hv, values),
         .W = SFX(jiggle)(c, P * ldw, W), .v = SFX(jiggle)(c, P, v),
         .b = SFX(jiggle)(c, P, b), .ldw = ldw, .scale = scale,
         .mask = m ? key_mask : none, .attn_mask = m ? query_mask : none}};
    REAL *out[RUNS], *alpha[RUNS];
    for (int k = 0; k < RUNS; k++) {
        att_exec ex = SFX(exec)(c, k);
        out[k] = SFX(nans)(B * Tq * Hv);
        alpha[k] = SFX(nans)(B * Tq * T);
        ATT(family_out) fo = {.out = out[k], .alpha = alpha[k]};
        void *work = SFX(workspace)(c, ATT(family_workspace)(&f, 0, &ex));
        int st = ATT(family_forward)(&f, &ex, &in[k == 3], &fo, work);
        c->calls++;
        expect(c, st == ATT_OK, "forward run %d returned %d", k, st);
        free(work);
    }
    SFX(judge)(c, "family out", B * Tq * Hv, out);
    SFX(judge)(c, "family alpha", B * Tq * T, alpha);

    in[0].alpha = alpha[0];
    in[0].grad_out = SFX(rand)(c, B * Tq * Hv, 1);
    in[0].grad_alpha = o.gal ? SFX(rand)(c, B * Tq * T, 1) : NULL;
    in[1].alpha = SFX(jiggle)(c, B * Tq * T, in[0].alpha);
    in[1].grad_out = SFX(jiggle)(c, B * Tq * Hv, in[0].grad_out);
    in[1].grad_alpha = SFX(jiggle)(c, B * Tq * T, in[0].grad_alpha);
    REAL *dq[RUNS], *dk[RUNS], *dval[RUNS], *dW[RUNS], *dv[RUNS], *db[RUNS];
    REAL *dkp[RUNS];
    for (int k = 0; k < RUNS; k++) {
        att_exec ex = SFX(exec)(c, k);
        dq[k] = SFX(nans)(B * Tq * Hq);
        dk[k] = SFX(nans)(B * T * H);
        dval[k] = o.values ? SFX(nans)(B * T * Hv) : NULL;
        dW[k] = dot ? NULL : SFX(nans)(P * ldw);
        dv[k] = additive ? SFX(nans)(P) : NULL;
        db[k] = bias ? SFX(nans)(P) : NULL;
        dkp[k] = kp_mode == 2 ? SFX(nans)(B * T * P) : NULL;
        ATT(family_out) fo = {.dquery = dq[k], .dkeys = dk[k],
                              .dkproj = dkp[k], .dvalues = dval[k],
                              .dW = dW[k], .dv = dv[k], .db = db[k]};
        void *work = SFX(workspace)(c, ATT(family_workspace)(&f, 1, &ex));
        int st = ATT(family_backward)(&f, &ex, &in[k == 3], &fo, work);
        c->calls++;
        expect(c, st == ATT_OK, "backward run %d returned %d", k, st);
        free(work);
    }
    SFX(judge)(c, "dquery", B * Tq * Hq, dq);
    SFX(judge)(c, "dkeys", B * T * H, dk);
    SFX(judge)(c, "dvalues", B * T * Hv, dval);
    SFX(judge)(c, "family dW", P * ldw, dW);
    SFX(judge)(c, "family dv", P, dv);
    SFX(judge)(c, "family db", P, db);
    SFX(judge)(c, "dkproj", B * T * P, dkp);
    REAL **runs[] = {out, alpha, dq, dk, dval, dW, dv, db, dkp};
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        SFX(free_runs)(runs[i]);
    }
    for (int i = 0; i < 2; i++) {
        free((void *)in[i].query);
        free((void *)in[i].keys);
        free((void *)in[i].kproj);
        free((void *)in[i].values);
        free((void *)in[i].W);
        free((void *)in[i].v);
        free((void *)in[i].b);
        free((void *)in[i].grad_out);
        free((void *)in[i].grad_alpha);
    }
    free((void *)in[1].alpha);
    free(m);
    free(live_k);
    free(live_q);
}

#define FD(B_, Tq_, T_, H_, Hq_, Hv_, P_)                                    \
    {.B = B_, .Tq = Tq_, .T = T_, .H = H_, .Hq = Hq_, .Hv = Hv_, .P = P_}

/* Sizes (B, Tq, T, H, Hq, Hv, P) (dot: Hq = H; general: P = Hq; values
 * not given: Hv = H): one query and several, odd sizes, the micro-tiles,
 * the gemm's blocks (GMC = 96 rows of A, KC = 256 deep, GNC = 512 columns
 * of B), B = 0, zero widths. */
static const att_fdims SFX(family_sizes)[] = {
    FD(0, 3, 5, 3, 3, 3, 3),     FD(1, 1, 1, 1, 1, 1, 1),
    FD(2, 1, 3, 3, 3, 3, 3),     FD(2, 3, 17, 17, 17, 17, 17),
    FD(3, 17, 65, 9, 5, 17, 9),  FD(1, 3, 65, 65, 17, 3, 65),
    FD(2, 5, 9, 8, 8, 8, 8),     FD(2, 9, 8, 4, 4, 4, 4),
    FD(1, 100, 33, 7, 9, 11, 13), FD(1, 3, 300, 5, 6, 7, 8),
    FD(1, 2, 520, 3, 3, 3, 3),   FD(3, 1, 17, 65, 3, 9, 17),
    FD(4, 2, 16, 16, 16, 16, 16), FD(1, 12, 13, 1, 1, 1, 1),
    FD(2, 4, 7, 0, 5, 3, 2),     FD(5, 1, 1, 2, 3, 4, 5),
};

/* Big enough for 2 threads (family_threads: 2^23 multiply-adds): several
 * queries (whole sequences per task), one query per sequence, and one
 * sequence cut into query blocks; for additive and general, then for dot.
 * Wide keys and values but few projected columns: the emulated scalar
 * tanh is what costs. */
static const att_fdims SFX(family_big)[2][3] = {
    {FD(4, 64, 256, 64, 8, 64, 4),
     FD(40, 1, 512, 64, 8, 64, 4),
     FD(1, 512, 160, 64, 8, 64, 4)},
    {FD(4, 64, 256, 64, 64, 64, 0),
     FD(64, 1, 1024, 64, 64, 64, 0),
     FD(1, 1024, 64, 64, 64, 64, 0)},
};
#undef FD

static void SFX(family_all)(ctx *c)
{
    const int n = (int)(sizeof(SFX(family_sizes)) /
                        sizeof(SFX(family_sizes)[0]));
    for (int s = 0; s < n; s++) {
        for (int score = 0; score < 3; score++) {
            for (int mk = 0; mk <= 4; mk++) {
                int k = s * 7 + score * 3 + mk;
                for (int twice = 0; twice < 2; twice++, k = ~k) {
                    SFX(fopts) o = {score, mk, k & 1, (k >> 1) & 1,
                                    (k >> 2) & 1, (k & 0xff) % 3};
                    SFX(family_case)(c, SFX(family_sizes)[s], o);
                }
            }
        }
    }
    for (int s = 0; s < 3; s++) {
        for (int score = 0; score < 3; score++) {
            SFX(fopts) o = {score, s == 1 ? 2 : 4, 1, 1, 1, score == 2};
            SFX(family_case)(c, SFX(family_big)[score == 1][s], o);
        }
    }
}

/* The streamed forward (out, lse), dot score, whose visibility is a range
 * of keys per query: the SIMD paths run it in the fused kernel
 * (csrc/simd/flash.inc).  Full, causal and a window; sizes across its
 * panels of queries and blocks of keys, grouped heads (2 query sequences
 * per key sequence), scores that climb along the keys (kind 1), so
 * that the running max is raised on nearly every tile, and dropout (kind
 * 2: float in the kernel, its keep bits by lanes against the scalar
 * path's by rows). */
static void SFX(flash_case)(ctx *c, att_fdims f, int kind)
{
    ptrdiff_t B = f.B, Tq = f.Tq, T = f.T, H = f.H, Hv = f.Hv;
    ptrdiff_t Bk = (B + 1) / 2;
    snprintf(c->what, sizeof c->what, "%s flash B=%td Tq=%td T=%td H=%td "
             "Hv=%td causal=%d window=%d climbing=%d dropout=%d", TYPE_NAME,
             B, Tq, T, H, Hv, f.causal, f.window, kind == 1, kind == 2);
    c->shapes++;
    REAL *query = SFX(rand)(c, B * Tq * H, 1);
    REAL *keys = SFX(rand)(c, Bk * T * H, 1);
    REAL *values = SFX(rand)(c, Bk * T * Hv, 1);
    ptrdiff_t *kidx = xmalloc((size_t)B * sizeof(ptrdiff_t));
    for (ptrdiff_t b = 0; b < B; b++) {
        kidx[b] = b / 2;
    }
    for (ptrdiff_t t = 0; kind == 1 && t < Bk * T; t++) {
        for (ptrdiff_t h = 0; h < H; h++) {     /* s_it ~ 1.2 t */
            keys[t * H + h] = (REAL)(1.2 * (double)(t % T) / sqrt(
                (double)H)) + (REAL)0.01 * keys[t * H + h];
        }
    }
    for (ptrdiff_t i = 0; kind == 1 && i < B * Tq * H; i++) {
        query[i] = 1 + (REAL)0.01 * query[i];
    }
    f.score = ATT_SCORE_DOT;
    f.stream = 1;
    f.Hq = H;
    f.Bk = f.Bv = Bk;
    ATT(family_in) in[2] = {
        {.query = query, .keys = keys, .values = values, .kidx = kidx,
         .vidx = kidx, .scale = (REAL)(1 / sqrt((double)H))},
        {.query = SFX(jiggle)(c, B * Tq * H, query),
         .keys = SFX(jiggle)(c, Bk * T * H, keys),
         .values = SFX(jiggle)(c, Bk * T * Hv, values), .kidx = kidx,
         .vidx = kidx, .scale = (REAL)(1 / sqrt((double)H))}};
    for (int k = 0; kind == 2 && k < 2; k++) {  /* (float: in the kernel) */
        f.dropout = 1;
        in[k].dropout = 0.3;
        in[k].seed = 0x123456789ULL;
    }
    REAL *out[RUNS], *lse[RUNS];
    for (int k = 0; k < RUNS; k++) {
        att_exec ex = SFX(exec)(c, k);
        out[k] = SFX(nans)(B * Tq * Hv);
        lse[k] = SFX(nans)(B * Tq);
        ATT(family_out) fo = {.out = out[k], .lse = lse[k]};
        void *work = SFX(workspace)(c, ATT(family_workspace)(&f, 0, &ex));
        int st = ATT(family_forward)(&f, &ex, &in[k == 3], &fo, work);
        c->calls++;
        expect(c, st == ATT_OK, "forward run %d returned %d", k, st);
        free(work);
    }
    /* a query that sees no key: lse -inf on every run (then 0, which
     * the normwise error can take) */
    for (ptrdiff_t i = 0; i < B * Tq; i++) {
        int none = 0;
        for (int k = 0; k < RUNS; k++) {
            none += lse[k][i] == -(REAL)INFINITY;
        }
        expect(c, none == 0 || none == RUNS, "lse %td: -inf on %d runs", i,
               none);
        for (int k = 0; none == RUNS && k < RUNS; k++) {
            lse[k][i] = 0;
        }
    }
    SFX(judge)(c, "flash out", B * Tq * Hv, out);
    SFX(judge)(c, "flash lse", B * Tq, lse);
    free(query);
    free(keys);
    free(values);
    free(kidx);
    free((void *)in[1].query);
    free((void *)in[1].keys);
    free((void *)in[1].values);
}

static void SFX(flash_all)(ctx *c)
{
    for (size_t s = 0; s < N_FLASH_SIZES; s++) {
        for (int v = 0; v < 3; v++) {
            SFX(flash_case)(c, with_visibility(flash_sizes[s], v), 0);
        }
        att_fdims f = flash_sizes[s];
        f.causal = 1;
        SFX(flash_case)(c, f, 1);
        SFX(flash_case)(c, with_visibility(flash_sizes[s], s % 3), 2);
    }
}

/* project_keys and its backward on their own: kp (n, P) = keys W^T with
 * W (P, ldw) read in its first H columns (NaN past them). */
static void SFX(project_case)(ctx *c, ptrdiff_t n, ptrdiff_t H, ptrdiff_t P,
                              ptrdiff_t ldw)
{
    snprintf(c->what, sizeof c->what, "%s project_keys n=%td H=%td P=%td "
             "ldw=%td", TYPE_NAME, n, H, P, ldw);
    c->shapes++;
    att_dims d = {n, 1, H, P};
    REAL *keys = SFX(rand)(c, n * H, 1), *W = SFX(rand)(c, P * ldw, 1);
    REAL *grad = SFX(rand)(c, n * P, 1);
    for (ptrdiff_t a = 0; a < P; a++) {
        for (ptrdiff_t k = H; k < ldw; k++) {
            W[a * ldw + k] = (REAL)NAN;
        }
    }
    REAL *keys1 = SFX(jiggle)(c, n * H, keys), *W1 = SFX(jiggle)(c, P * ldw, W);
    REAL *grad1 = SFX(jiggle)(c, n * P, grad);
    REAL *kp[RUNS], *dk[RUNS], *dW[RUNS];
    for (int k = 0; k < RUNS; k++) {
        att_exec ex = SFX(exec)(c, k);
        kp[k] = SFX(nans)(n * P);
        dk[k] = SFX(nans)(n * H);
        dW[k] = SFX(nans)(P * ldw);
        void *work = SFX(workspace)(c, ATT(project_keys_workspace)(d, &ex));
        int st = ATT(project_keys)(d, &ex, k == 3 ? keys1 : keys,
                                   k == 3 ? W1 : W, ldw, kp[k], work);
        int st2 = ATT(project_keys_backward)(d, &ex, k == 3 ? grad1 : grad,
                                             k == 3 ? keys1 : keys,
                                             k == 3 ? W1 : W, ldw, dk[k],
                                             dW[k], work);
        c->calls += 2;
        expect(c, st == ATT_OK && st2 == ATT_OK, "run %d returned %d, %d",
               k, st, st2);
        free(work);
    }
    SFX(judge)(c, "kp", n * P, kp);
    SFX(judge)(c, "project dkeys", n * H, dk);
    SFX(judge)(c, "project dW", P * ldw, dW);
    SFX(free_runs)(kp);
    SFX(free_runs)(dk);
    SFX(free_runs)(dW);
    free(keys);
    free(W);
    free(grad);
    free(keys1);
    free(W1);
    free(grad1);
}

static void SFX(project_all)(ctx *c)
{
    static const ptrdiff_t sizes[][4] = {
        {0, 3, 5, 3}, {1, 1, 1, 1}, {3, 17, 65, 20}, {65, 3, 17, 3},
        {97, 8, 9, 11}, {300, 5, 7, 5}, {17, 520, 3, 521}, {2048, 64, 64, 64},
    };
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        SFX(project_case)(c, sizes[s][0], sizes[s][1], sizes[s][2],
                          sizes[s][3]);
    }
}

/* ---------------------------------------------------------------------
 * NaN and inf in valid data stay in their own sequence: with a bad value
 * in sequence 0, sequence 1's results have the bits it gets alone
 * (the parameter gradients, summed over the batch, are left out).
 */

static int SFX(same_bits)(ptrdiff_t n, const REAL *a, const REAL *b)
{
    return n == 0 || memcmp(a, b, (size_t)n * sizeof(REAL)) == 0;
}

static void SFX(contain_case)(ctx *c, REAL bad)
{
    att_exec ex = {c->simd, 1, c->pool, ATT_PRECISION_IEEE, 0};
    const ptrdiff_t T = 17, H = 9, A = 13;
    att_dims d2 = {2, T, H, A}, d1 = {1, T, H, A};
    snprintf(c->what, sizeof c->what, "%s context with %g in sequence 0",
             TYPE_NAME, (double)bad);
    c->shapes++;
    REAL *h = SFX(rand)(c, 2 * T * H, 1), *W = SFX(rand)(c, A * 2 * H, 0.5);
    REAL *v = SFX(rand)(c, A, 1), *g = SFX(rand)(c, 2 * H, 1);
    h[3 * H + 2] = bad;
    REAL *out = SFX(nans)(2 * H), *alpha = SFX(nans)(2 * T);
    REAL *out1 = SFX(nans)(H), *alpha1 = SFX(nans)(T);
    REAL *dh = SFX(nans)(2 * T * H), *dh1 = SFX(nans)(T * H);
    REAL *dW = SFX(nans)(A * 2 * H), *dv = SFX(nans)(A);
    void *work = SFX(workspace)(
        c, ATT(context_attention_backward_workspace)(d2, &ex));
    int st = ATT(context_attention)(d2, &ex, h, W, v, NULL, NULL, out,
                                    alpha, NULL, work) |
             ATT(context_attention)(d1, &ex, h + T * H, W, v, NULL, NULL,
                                    out1, alpha1, NULL, work) |
             ATT(context_attention_backward)(d2, &ex, g, h, W, v, alpha,
                                             NULL, NULL, NULL, NULL, dh, dW,
                                             dv, NULL, work) |
             ATT(context_attention_backward)(d1, &ex, g + H, h + T * H, W, v,
                                             alpha1, NULL, NULL, NULL, NULL,
                                             dh1, dW, dv, NULL, work);
    c->calls += 4;
    expect(c, st == ATT_OK, "a call failed");
    expect(c, SFX(same_bits)(H, out + H, out1) &&
              SFX(same_bits)(T, alpha + T, alpha1) &&
              SFX(same_bits)(T * H, dh + T * H, dh1),
           "sequence 1 differs from its results alone");
    free(work);
    REAL *all[] = {h, W, v, g, out, alpha, out1, alpha1, dh, dh1, dW, dv};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        free(all[i]);
    }
    /* the family's forward, the bad value in a key */
    for (int score = 0; score < 3; score++) {
        int additive = score == ATT_SCORE_ADDITIVE;
        att_fdims f2 = {.score = score, .B = 2, .Tq = 3, .T = 11, .H = 5,
                        .Hq = score == 1 ? 5 : 6, .Hv = 7,
                        .P = score == 0 ? 4 : (score == 1 ? 0 : 6)};
        att_fdims f1 = f2;
        f1.B = 1;
        ptrdiff_t ldw = additive ? f2.H + f2.Hq : f2.H;
        snprintf(c->what, sizeof c->what, "%s family score %d with %g in "
                 "sequence 0", TYPE_NAME, score, (double)bad);
        c->shapes++;
        REAL *q = SFX(rand)(c, 2 * f2.Tq * f2.Hq, 1);
        REAL *k = SFX(rand)(c, 2 * f2.T * f2.H, 1);
        REAL *val = SFX(rand)(c, 2 * f2.T * f2.Hv, 1);
        REAL *Wf = SFX(rand)(c, f2.P * ldw + 1, 0.5);
        REAL *vf = SFX(rand)(c, f2.P + 1, 1);
        k[2 * f2.H + 1] = bad;
        ATT(family_in) in2 = {.query = q, .keys = k, .values = val,
                              .W = Wf, .v = additive ? vf : NULL,
                              .ldw = ldw, .scale = (REAL)0.5};
        ATT(family_in) in1 = in2;
        in1.query = q + f2.Tq * f2.Hq;
        in1.keys = k + f2.T * f2.H;
        in1.values = val + f2.T * f2.Hv;
        REAL *o2 = SFX(nans)(2 * f2.Tq * f2.Hv), *a2 = SFX(nans)(2 * f2.Tq *
                                                              f2.T);
        REAL *o1 = SFX(nans)(f2.Tq * f2.Hv), *a1 = SFX(nans)(f2.Tq * f2.T);
        ATT(family_out) fo2 = {.out = o2, .alpha = a2};
        ATT(family_out) fo1 = {.out = o1, .alpha = a1};
        void *fw = SFX(workspace)(c, ATT(family_workspace)(&f2, 0, &ex));
        st = ATT(family_forward)(&f2, &ex, &in2, &fo2, fw) |
             ATT(family_forward)(&f1, &ex, &in1, &fo1, fw);
        c->calls += 2;
        expect(c, st == ATT_OK, "a call failed");
        expect(c, SFX(same_bits)(f2.Tq * f2.Hv, o2 + f2.Tq * f2.Hv, o1) &&
                  SFX(same_bits)(f2.Tq * f2.T, a2 + f2.Tq * f2.T, a1),
               "sequence 1 differs from its results alone");
        REAL *fall[] = {q, k, val, Wf, vf, o2, a2, o1, a1};
        for (size_t i = 0; i < sizeof(fall) / sizeof(fall[0]); i++) {
            free(fall[i]);
        }
        free(fw);
    }
}

static void SFX(contain_all)(ctx *c)
{
    SFX(contain_case)(c, (REAL)NAN);
    SFX(contain_case)(c, (REAL)INFINITY);
    SFX(contain_case)(c, -(REAL)INFINITY);
}

/* ---------------------------------------------------------------------
 * tanh
 */

/* Bit patterns mapped to integers in the order of the values (+0 and -0
 * both to 0): |a - b| counts the ulps between a and b. */
static int64_t SFX(ordered)(REAL x)
{
    WHOLE_BITS u;
    memcpy(&u, &x, sizeof u);
    const WHOLE_BITS sign = (WHOLE_BITS)1 << (8 * sizeof(u) - 1);
    return u & sign ? -(int64_t)(u & ~sign) : (int64_t)u;
}

#if TYPE_INDEX == 0
static REAL SFX(from_bits)(WHOLE_BITS u)
{
    REAL x;
    memcpy(&x, &u, sizeof x);
    return x;
}
#endif

/* The reference: tanh correctly rounded (float32: tanh in double,
 * rounded; float64: tanh in long double, rounded, or libm's tanh). */
static REAL SFX(tanh_ref)(REAL x)
{
#if TYPE_INDEX == 0
    return (REAL)tanh((double)x);
#else
    return (REAL)tanhl((long double)x);
#endif
}

/* The sweep: magnitudes over the whole range with a stride, a dense
 * grid where tanh bends, the subnormals, the saturation point and the
 * steps of the argument reduction (odd multiples of ln(2)/4); both signs.
 * Returns the count, stores up to cap values. */
static ptrdiff_t SFX(tanh_sweep)(ctx *c, REAL *x, ptrdiff_t cap)
{
    ptrdiff_t n = 0;
#define PUT(v)                                                               \
    do {                                                                     \
        if (n + 2 <= cap) {                                                  \
            x[n++] = (v);                                                    \
            x[n++] = -(v);                                                   \
        }                                                                    \
    } while (0)
#if TYPE_INDEX == 0
    for (uint32_t u = 0; u < 0x7F800000u; u += 40009) {
        PUT(SFX(from_bits)(u));
    }
    const float lo = 1e-3f, hi = 10;
    uint32_t ulo, uhi;
    memcpy(&ulo, &lo, 4);
    memcpy(&uhi, &hi, 4);
    for (uint32_t u = ulo; u < uhi; u += 1009) {
        PUT(SFX(from_bits)(u));
    }
    for (uint32_t u = 0; u < (1u << 16); u++) {
        PUT(SFX(from_bits)(u * 127u));                     /* subnormals */
    }
    const float sat_lo = 8.75f, sat_hi = 9.25f;
    memcpy(&ulo, &sat_lo, 4);
    memcpy(&uhi, &sat_hi, 4);
    for (uint32_t u = ulo; u < uhi; u += 7) {
        PUT(SFX(from_bits)(u));
    }
    for (int k = 1; k <= 7; k += 2) {
        float center = (float)(0.6931471805599453 / 4 * k);
        uint32_t u0;
        memcpy(&u0, &center, 4);
        for (uint32_t u = u0 - 4096; u <= u0 + 4096; u++) {
            PUT(SFX(from_bits)(u));
        }
    }
    (void)c;
#else
    for (int i = 0; i < 60000; i++) {           /* log-uniform, 5e-324..40 */
        PUT((REAL)exp(log(5e-324) + uniform(c) * (log(40.0) -
                                                   log(5e-324))));
    }
    for (int i = 0; i <= 60000; i++) {
        PUT((REAL)(20.0 * i / 60000));
    }
    for (int k = 1; k <= 7; k += 2) {
        for (int i = -1000; i <= 1000; i++) {
            PUT((REAL)(0.6931471805599453 / 4 * k * (1 + 1e-9 * i)));
        }
    }
#endif
#undef PUT
    return n;
}

static void SFX(tanh_all)(ctx *c)
{
    snprintf(c->what, sizeof c->what, "%s tanh", TYPE_NAME);
    const ptrdiff_t cap = 1 << 20;
    REAL *x = xmalloc((size_t)cap * sizeof(REAL));
    ptrdiff_t n = SFX(tanh_sweep)(c, x, cap);
    n -= n % 4 == 0;          /* a length with a tail for every VLEN */
    REAL *y = SFX(nans)(n);
    int st = ATT(tanh)(c->simd, n, x, y);
    expect(c, st == ATT_OK, "att_tanh returned %d", st);
    int64_t worst = 0;
    ptrdiff_t at = 0;
    for (ptrdiff_t i = 0; i < n; i++) {
        int64_t e = SFX(ordered)(y[i]) - SFX(ordered)(SFX(tanh_ref)(x[i]));
        e = isnan(y[i]) ? INT64_MAX : (e < 0 ? -e : e);
        if (e > worst) {
            worst = e;
            at = i;
        }
    }
    printf("%s %s tanh: at most %lld ulp from libm over %td values "
           "(bound %d)\n", simd_names[c->simd], TYPE_NAME, (long long)worst,
           n, TANH_ULP);
    expect(c, worst <= TANH_ULP, "%lld ulp at x = %.17g: %.17g, want %.17g",
           (long long)worst, (double)x[at], (double)y[at],
           (double)SFX(tanh_ref)(x[at]));
    /* every length's tail gives the same bits as the long call */
    int tails = 1;
    for (ptrdiff_t len = 0; len <= 9; len++) {
        REAL z[9];
        tails &= ATT(tanh)(c->simd, len, x + 1000, z) == ATT_OK &&
                 (len == 0 || memcmp(z, y + 1000, (size_t)len *
                                     sizeof(REAL)) == 0);
    }
    expect(c, tails, "short calls differ from the long one");
    /* special values */
    const REAL big = sizeof(REAL) == 4 ? (REAL)FLT_MAX : (REAL)DBL_MAX;
    const REAL sub = sizeof(REAL) == 4 ? (REAL)FLT_TRUE_MIN
                                       : (REAL)DBL_TRUE_MIN;
    const REAL least = sizeof(REAL) == 4 ? (REAL)FLT_MIN : (REAL)DBL_MIN;
    REAL sx[] = {0, -(REAL)0, (REAL)INFINITY, -(REAL)INFINITY, (REAL)NAN,
                 sub, -sub, least / 3, 25, -25, big, -big};
    REAL sy[sizeof(sx) / sizeof(sx[0])];
    ATT(tanh)(c->simd, (ptrdiff_t)(sizeof(sx) / sizeof(sx[0])), sx, sy);
    expect(c, sy[0] == 0 && !signbit(sy[0]) && sy[1] == 0 &&
              signbit(sy[1]), "tanh(+-0) is %g, %g", (double)sy[0],
           (double)sy[1]);
    expect(c, sy[2] == 1 && sy[3] == -1, "tanh(+-inf) is %g, %g",
           (double)sy[2], (double)sy[3]);
    expect(c, isnan(sy[4]), "tanh(NaN) is %g", (double)sy[4]);
    expect(c, sy[5] == sx[5] && sy[6] == sx[6] && sy[7] == sx[7],
           "tanh of a subnormal is not itself");
    expect(c, sy[8] == 1 && sy[9] == -1 && sy[10] == 1 && sy[11] == -1,
           "tanh of a large argument is not +-1");
    free(x);
    free(y);
}

/* ---------------------------------------------------------------------
 * Everything, for one type
 */

static void SFX(note)(ctx *c, const char *name, double e, int raised)
{
    if (!c->verbose) {
        return;
    }
    for (int i = 0; i < N_KINDS; i++) {
        if (kinds[i] == NULL) {
            kinds[i] = name;
        }
        if (strcmp(kinds[i], name) == 0) {
            double *w = &c->worst[TYPE_INDEX][i];
            *w = isnan(e) || e > *w ? e : *w;
            c->raised[TYPE_INDEX][i] += raised;
            return;
        }
    }
}

static void SFX(run_all)(ctx *c)
{
    void (*const parts[])(ctx *) = {SFX(tanh_all), SFX(context_all),
                                    SFX(family_all), SFX(flash_all),
                                    SFX(project_all), SFX(contain_all)};
    static const char *const names[] = {"tanh", "context", "family",
                                        "flash", "project", "non-finite"};
    for (int i = 0; i < 6; i++) {
        clock_t t0 = clock();
        parts[i](c);
        if (c->verbose) {
            printf("  %s %s: %.1f s of CPU\n", TYPE_NAME, names[i],
                   (double)(clock() - t0) / CLOCKS_PER_SEC);
        }
    }
    for (int i = 0; c->verbose && i < N_KINDS && kinds[i] != NULL; i++) {
        printf("  %s %s: worst normwise error %.3g (bound raised %ld "
               "times)\n", TYPE_NAME, kinds[i], c->worst[TYPE_INDEX][i],
               c->raised[TYPE_INDEX][i]);
        c->worst[TYPE_INDEX][i] = 0;
        c->raised[TYPE_INDEX][i] = 0;
    }
}

#undef TOL
#undef ILL_FACTOR
#undef ILL_CAP
#undef RUNS
#undef NEXTAFTER
#undef TANH_ULP
#undef WHOLE_BITS
#undef REAL
#undef SFX
#undef TYPE_INDEX
#undef TYPE_NAME
#undef ATT
