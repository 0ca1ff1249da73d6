/*
 * kernels_impl.h - the kernels for one floating type.
 *
 * kernels.c includes this file twice, with
 *   REAL      float or double
 *   SFX(x)    x##_f32 or x##_f64 (names of this type's functions)
 *   TANH, EXP tanhf/expf or tanh/exp
 * so both types share one text.  Not a public header.
 *
 * Layout: each public kernel loops over the batch and calls per-sequence
 * helpers (seq_*); the fused layer calls the same helpers in turn, so it
 * is the composition of the building blocks by construction.  Products
 * with W are written as axpy over contiguous rows of a transposed copy
 * WT (2H, A): that loop vectorises without reassociating any sum, so the
 * results do not depend on compiler flags.  The formulas the SIMD path
 * shares (softmax pieces, sums over rows, the context's backward) are in
 * formulas.h, included here with this type's names.
 */

#define FML SFX
#include "formulas.h"

/* ---------------------------------------------------------------------
 * Small vector helpers
 */

/* x . y  (n) */
static REAL SFX(dot)(ptrdiff_t n, const REAL *x, const REAL *y)
{
    REAL acc = 0;
    for (ptrdiff_t i = 0; i < n; i++) {
        acc += x[i] * y[i];
    }
    return acc;
}

static void SFX(fill_zero)(ptrdiff_t n, REAL *x)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        x[i] = 0;
    }
}

/* WT (K, A) = W^T for W (A, K). */
static void SFX(transpose)(ptrdiff_t A, ptrdiff_t K, const REAL *W, REAL *WT)
{
    for (ptrdiff_t a = 0; a < A; a++) {
        for (ptrdiff_t k = 0; k < K; k++) {
            WT[k * A + a] = W[a * K + k];
        }
    }
}

#define VALID(m, t) ((m) == NULL || (m)[t])

/* ---------------------------------------------------------------------
 * Per-sequence forward helpers.  h is one sequence (T, H); m its mask
 * (T) or NULL.
 */

/* q = W_c c + b: the part of z_t shared by all items, once per sequence.
 * WT (2H, A); rows H..2H-1 of WT are W_c^T.   q (A) */
static void SFX(seq_query)(ptrdiff_t H, ptrdiff_t A, const REAL *WT,
                           const REAL *c, const REAL *b, REAL *q)
{
    for (ptrdiff_t a = 0; a < A; a++) {
        q[a] = b ? b[a] : 0;
    }
    for (ptrdiff_t k = 0; k < H; k++) {
        SFX(axpy)(A, c[k], WT + (H + k) * A, q);
    }
}

/* z = W_h h_t + q for one item.   ht (H), z (A) */
static void SFX(item_preact)(ptrdiff_t H, ptrdiff_t A, const REAL *WT,
                             const REAL *ht, const REAL *q, REAL *z)
{
    for (ptrdiff_t a = 0; a < A; a++) {
        z[a] = q[a];
    }
    for (ptrdiff_t k = 0; k < H; k++) {
        SFX(axpy)(A, ht[k], WT + k * A, z);
    }
}

/* s_t = v . tanh(W_h h_t + q) for the valid items; masked items get
 * s_t = 0, which nothing reads.  If act is not NULL, act_t = tanh(z_t)
 * (zero for masked items) is kept for the backward.
 * s (T), act (T, A) or NULL; z is scratch (A) */
static void SFX(seq_scores)(ptrdiff_t T, ptrdiff_t H, ptrdiff_t A,
                            const REAL *h, const unsigned char *m,
                            const REAL *WT, const REAL *q, const REAL *v,
                            REAL *z, REAL *s, REAL *act)
{
    for (ptrdiff_t t = 0; t < T; t++) {
        REAL acc = 0;
        if (VALID(m, t)) {
            SFX(item_preact)(H, A, WT, h + t * H, q, z);
            for (ptrdiff_t a = 0; a < A; a++) {
                REAL u = TANH(z[a]);
                acc += v[a] * u;
                if (act) {
                    act[t * A + a] = u;
                }
            }
        }
        else if (act) {
            SFX(fill_zero)(A, act + t * A);
        }
        s[t] = acc;
    }
}

/* alpha = softmax of s over the valid items, shifted by their max M;
 * masked items get exactly 0, and all are 0 when none is valid.  alpha
 * may be s itself (in place).   s, alpha (T) */
static void SFX(seq_softmax)(ptrdiff_t T, const REAL *s,
                             const unsigned char *m, REAL *alpha)
{
    double total = 0;     /* double: see weight */
    ptrdiff_t n = 0;
    for (ptrdiff_t t = 0; t < T; t++) {
        n += VALID(m, t) ? 1 : 0;
    }
    /* pass 1: M = max of the valid scores (a NaN wins) */
    REAL M = SFX(row_max)(T, s, m);
    /* pass 2: e_t = exp(s_t - M) <= 1, and their sum (>= 1 unless NaN) */
    for (ptrdiff_t t = 0; t < T; t++) {
        if (VALID(m, t)) {
            alpha[t] = EXP(s[t] - M);
            total += alpha[t];
        }
        else {
            alpha[t] = 0;
        }
    }
    if (n == 0) {
        return;
    }
    /* pass 3: normalise the valid items only, so padding stays exactly 0
     * and valid items never reach it (WEIGHT_FLOOR) */
    for (ptrdiff_t t = 0; t < T; t++) {
        if (VALID(m, t)) {
            alpha[t] = SFX(weight)(alpha[t], total);
        }
    }
}

/* out = sum_t alpha_t h_t over the valid items.   out (H) */
static void SFX(seq_weighted_sum)(ptrdiff_t T, ptrdiff_t H,
                                  const REAL *alpha, const REAL *h,
                                  const unsigned char *m, REAL *out)
{
    SFX(sum_rows)(T, H, h, m, alpha, out);
}

/* ---------------------------------------------------------------------
 * Per-sequence backward helpers
 */

/* ds_t = alpha_t (g_t - sum_j alpha_j g_j) over all T items (formulas.h's
 * softmax_backward; masked items have alpha_t = 0 and get ds_t = 0).
 * g, alpha, ds (T) */
static void SFX(seq_softmax_backward)(ptrdiff_t T, const REAL *g,
                                      const REAL *alpha, REAL *ds)
{
    SFX(softmax_backward)(T, NULL, g, alpha, ds);
}

/*
 * Backward of  s_t = v . tanh(z_t),  z_t = W_h h_t + q  for the valid items
 * of one sequence, given ds (T).  Takes u_t = tanh(z_t) from act (T, A)
 * when the forward kept it, else recomputes it, then
 *   dv   += sum_t ds_t u_t
 *   eps_t = ds_t v (1 - u_t^2)                 (dL/dz_t)
 *   E    += sum_t eps_t                        (feeds db, dW_c, dc)
 *   dW_h += sum_t eps_t h_t^T                  (columns [0, H) of dW)
 *   dh_t += W_h^T eps_t
 * W (A, 2H) and WT (2H, A) are the same matrix in both layouts, so every
 * product runs over contiguous rows.  z and eps are scratch (A).
 */
static void SFX(seq_scores_backward)(ptrdiff_t T, ptrdiff_t H, ptrdiff_t A,
                                     const REAL *h, const unsigned char *m,
                                     const REAL *W, const REAL *WT,
                                     const REAL *q, const REAL *v,
                                     const REAL *ds, const REAL *act,
                                     REAL *z, REAL *eps, REAL *dh, REAL *dW,
                                     REAL *dv, REAL *E)
{
    for (ptrdiff_t t = 0; t < T; t++) {
        if (!VALID(m, t)) {
            continue;
        }
        const REAL *ht = h + t * H;
        if (act == NULL) {
            SFX(item_preact)(H, A, WT, ht, q, z);
        }
        for (ptrdiff_t a = 0; a < A; a++) {
            REAL u = act ? act[t * A + a] : TANH(z[a]);
            dv[a] += ds[t] * u;
            eps[a] = SFX(tanh_score_backward)(ds[t], v[a], u);
            E[a] += eps[a];
        }
        for (ptrdiff_t a = 0; a < A; a++) {
            SFX(axpy)(H, eps[a], ht, dW + a * 2 * H);     /* dW_h row a */
            SFX(axpy)(H, eps[a], W + a * 2 * H, dh + t * H); /* W_h row a */
        }
    }
}

/* ---------------------------------------------------------------------
 * Public kernels: the building blocks
 */

/* c (B, H) = masked mean over T of h (B, T, H). */
int SFX(att_mean_context)(att_dims d, const REAL *h,
                          const unsigned char *mask, REAL *c)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    if (d.H == 0) {
        return ATT_OK;    /* c is empty; B T may be huge (h holds no data) */
    }
    for (ptrdiff_t b = 0; b < d.B; b++) {
        SFX(seq_mean)(d.T, d.H, h + b * d.T * d.H,
                      mask ? mask + b * d.T : NULL, c + b * d.H);
    }
    return ATT_OK;
}

/* dh (B, T, H): dh_t = (m_t / n) grad_c; zero for masked items and
 * for rows with no valid item.   grad_c (B, H) */
int SFX(att_mean_context_backward)(att_dims d, const REAL *grad_c,
                                   const unsigned char *mask, REAL *dh)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    if (d.H == 0) {
        return ATT_OK;    /* dh is empty */
    }
    for (ptrdiff_t b = 0; b < d.B; b++) {
        const unsigned char *m = mask ? mask + b * d.T : NULL;
        REAL *dhb = dh + b * d.T * d.H, *share = NULL;
        ptrdiff_t n = 0;
        for (ptrdiff_t t = 0; t < d.T; t++) {
            n += VALID(m, t) ? 1 : 0;
        }
        for (ptrdiff_t t = 0; t < d.T; t++) {
            REAL *dht = dhb + t * d.H;
            if (!VALID(m, t)) {
                SFX(fill_zero)(d.H, dht);
            }
            else if (share != NULL) {
                memcpy(dht, share, (size_t)d.H * sizeof(REAL));
            }
            else {        /* the first valid row: grad_c / n, then copied */
                memcpy(dht, grad_c + b * d.H, (size_t)d.H * sizeof(REAL));
                SFX(mean_backward)(d.H, n, dht);
                share = dht;
            }
        }
    }
    return ATT_OK;
}

/* s (B, T) = v . tanh(W_h h_t + W_c c + b), c = context (B, H). */
int SFX(att_additive_score)(att_dims d, const REAL *h, const REAL *context,
                            const REAL *W, const REAL *v, const REAL *b,
                            REAL *s, REAL *work)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    /* work: WT (2H, A) | q (A) | z (A) */
    REAL *WT = work, *q = WT + 2 * d.H * d.A, *z = q + d.A;
    SFX(transpose)(d.A, 2 * d.H, W, WT);
    for (ptrdiff_t i = 0; i < d.B; i++) {
        SFX(seq_query)(d.H, d.A, WT, context + i * d.H, b, q);
        SFX(seq_scores)(d.T, d.H, d.A, h + i * d.T * d.H, NULL, WT, q, v, z,
                        s + i * d.T, NULL);
    }
    return ATT_OK;
}

/* Backward of att_additive_score given grad_s (B, T):
 * dh (B, T, H), dcontext (B, H); dW (A, 2H), dv (A), db (A) or NULL are
 * summed over the batch. */
int SFX(att_additive_score_backward)(att_dims d, const REAL *grad_s,
                                     const REAL *h, const REAL *context,
                                     const REAL *W, const REAL *v,
                                     const REAL *b, REAL *dh, REAL *dcontext,
                                     REAL *dW, REAL *dv, REAL *db, REAL *work)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    /* work: WT (2H, A) | q (A) | z (A) | eps (A) | E (A) */
    REAL *WT = work, *q = WT + 2 * d.H * d.A, *z = q + d.A, *eps = z + d.A;
    REAL *E = eps + d.A;
    SFX(transpose)(d.A, 2 * d.H, W, WT);
    SFX(fill_zero)(d.B * d.T * d.H, dh);
    SFX(fill_zero)(d.A * 2 * d.H, dW);
    SFX(fill_zero)(d.A, dv);
    if (db) {
        SFX(fill_zero)(d.A, db);
    }
    for (ptrdiff_t i = 0; i < d.B; i++) {
        const REAL *ci = context + i * d.H;
        SFX(seq_query)(d.H, d.A, WT, ci, b, q);
        SFX(fill_zero)(d.A, E);
        SFX(seq_scores_backward)(d.T, d.H, d.A, h + i * d.T * d.H, NULL, W,
                                 WT, q, v, grad_s + i * d.T, NULL, z, eps,
                                 dh + i * d.T * d.H, dW, dv, E);
        SFX(context_backward)(d.H, d.A, W, ci, E, dW, db, dcontext + i * d.H);
    }
    return ATT_OK;
}

/* alpha (B, T) = masked softmax of scores (B, T) over T. */
int SFX(att_masked_softmax)(att_dims d, const REAL *scores,
                            const unsigned char *mask, REAL *alpha)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    for (ptrdiff_t b = 0; b < d.B; b++) {
        SFX(seq_softmax)(d.T, scores + b * d.T, mask ? mask + b * d.T : NULL,
                         alpha + b * d.T);
    }
    return ATT_OK;
}

/* dscores (B, T) = alpha_t (g_t - sum_j alpha_j g_j). */
int SFX(att_masked_softmax_backward)(att_dims d, const REAL *grad_alpha,
                                     const REAL *alpha, REAL *dscores)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    for (ptrdiff_t b = 0; b < d.B; b++) {
        SFX(seq_softmax_backward)(d.T, grad_alpha + b * d.T, alpha + b * d.T,
                                  dscores + b * d.T);
    }
    return ATT_OK;
}

/* out (B, H) = sum_t alpha_t h_t, alpha (B, T), h (B, T, H). */
int SFX(att_weighted_sum)(att_dims d, const REAL *alpha, const REAL *h,
                          REAL *out)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    for (ptrdiff_t b = 0; b < d.B; b++) {
        SFX(seq_weighted_sum)(d.T, d.H, alpha + b * d.T, h + b * d.T * d.H,
                              NULL, out + b * d.H);
    }
    return ATT_OK;
}

/* dalpha (B, T): dalpha_t = g . h_t;  dh (B, T, H): dh_t = alpha_t g. */
int SFX(att_weighted_sum_backward)(att_dims d, const REAL *grad_out,
                                   const REAL *alpha, const REAL *h,
                                   REAL *dalpha, REAL *dh)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    for (ptrdiff_t b = 0; b < d.B; b++) {
        const REAL *g = grad_out + b * d.H;
        for (ptrdiff_t t = 0; t < d.T; t++) {
            ptrdiff_t row = (b * d.T + t) * d.H;
            dalpha[b * d.T + t] = SFX(dot)(d.H, g, h + row);
            for (ptrdiff_t k = 0; k < d.H; k++) {
                dh[row + k] = alpha[b * d.T + t] * g[k];
            }
        }
    }
    return ATT_OK;
}

/* ---------------------------------------------------------------------
 * The fused layer: one call each way, one sequence at a time, so only
 * O(H + A + T) scratch is live and the (T, A) activations never exist.
 */

/* out (B, H), alpha (B, T) of the whole layer on h (B, T, H); act
 * (B, T, A) = tanh(z) when not NULL. */
static int SFX(scalar_context_attention)(att_dims d, const REAL *h,
                                         const REAL *W, const REAL *v,
                                         const REAL *b,
                                         const unsigned char *mask,
                                         REAL *out, REAL *alpha, REAL *act,
                                         REAL *work)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    /* work: WT (2H, A) | c (H) | q (A) | z (A) */
    REAL *WT = work, *c = WT + 2 * d.H * d.A, *q = c + d.H, *z = q + d.A;
    SFX(transpose)(d.A, 2 * d.H, W, WT);
    for (ptrdiff_t i = 0; i < d.B; i++) {
        const REAL *hi = h + i * d.T * d.H;
        const unsigned char *m = mask ? mask + i * d.T : NULL;
        REAL *ai = alpha + i * d.T;
        /* 1. c = (1/n) sum_t m_t h_t */
        SFX(seq_mean)(d.T, d.H, hi, m, c);
        /* 2. q = W_c c + b, once per sequence */
        SFX(seq_query)(d.H, d.A, WT, c, b, q);
        /* 3. s_t = v . tanh(W_h h_t + q), written into alpha */
        SFX(seq_scores)(d.T, d.H, d.A, hi, m, WT, q, v, z, ai,
                        act ? act + i * d.T * d.A : NULL);
        /* 4. alpha = masked softmax(s), in place */
        SFX(seq_softmax)(d.T, ai, m, ai);
        /* 5. out = sum_t alpha_t h_t */
        SFX(seq_weighted_sum)(d.T, d.H, ai, hi, m, out + i * d.H);
    }
    return ATT_OK;
}

/*
 * Backward of the layer given grad_out (B, H), the forward's alpha (B, T)
 * and optionally grad_alpha (B, T) and the forward's act (B, T, A), which
 * spares recomputing tanh(z).  Writes dh (B, T, H) and dW (A, 2H),
 * dv (A), db (A) or NULL summed over the batch.  Each step undoes the
 * forward step of the same number, in reverse order.
 */
static int SFX(scalar_context_attention_backward)(
    att_dims d, const REAL *grad_out, const REAL *h, const REAL *W,
    const REAL *v, const REAL *alpha, const REAL *b,
    const unsigned char *mask, const REAL *grad_alpha, const REAL *act,
    REAL *dh, REAL *dW, REAL *dv, REAL *db, REAL *work)
{
    if (!dims_ok(d)) {
        return ATT_EINVAL;
    }
    /* work: WT (2H, A) | c (H) | dc (H) | q, z, eps, E (A each) |
     *       gamma (T) | ds (T) */
    REAL *WT = work, *c = WT + 2 * d.H * d.A, *dc = c + d.H, *q = dc + d.H;
    REAL *z = q + d.A, *eps = z + d.A, *E = eps + d.A, *gamma = E + d.A;
    REAL *ds = gamma + d.T;
    SFX(transpose)(d.A, 2 * d.H, W, WT);
    SFX(fill_zero)(d.A * 2 * d.H, dW);
    SFX(fill_zero)(d.A, dv);
    if (db) {
        SFX(fill_zero)(d.A, db);
    }
    for (ptrdiff_t i = 0; i < d.B; i++) {
        const REAL *hi = h + i * d.T * d.H, *g = grad_out + i * d.H;
        const REAL *ai = alpha + i * d.T;
        const REAL *gai = grad_alpha ? grad_alpha + i * d.T : NULL;
        const unsigned char *m = mask ? mask + i * d.T : NULL;
        REAL *dhi = dh + i * d.T * d.H;
        /* recompute forward steps 1-2: c and q = W_c c + b */
        ptrdiff_t n = SFX(seq_mean)(d.T, d.H, hi, m, c);
        SFX(seq_query)(d.H, d.A, WT, c, b, q);
        /* 5. out = sum_t alpha_t h_t
         *    -> gamma_t = dL/dalpha_t = g . h_t (+ grad_alpha_t)
         *    -> dh_t = alpha_t g                                         */
        for (ptrdiff_t t = 0; t < d.T; t++) {
            REAL *dht = dhi + t * d.H;
            if (!VALID(m, t)) {
                gamma[t] = 0;
                SFX(fill_zero)(d.H, dht);
                continue;
            }
            gamma[t] = SFX(dot)(d.H, g, hi + t * d.H) + (gai ? gai[t] : 0);
            for (ptrdiff_t k = 0; k < d.H; k++) {
                dht[k] = ai[t] * g[k];
            }
        }
        /* 4. alpha = softmax(s)  ->  ds_t = alpha_t (gamma_t - alpha.gamma) */
        SFX(seq_softmax_backward)(d.T, gamma, ai, ds);
        /* 3. s_t = v . tanh(W_h h_t + q)  ->  dv, dW_h, dh_t += W_h^T eps_t */
        SFX(fill_zero)(d.A, E);
        SFX(seq_scores_backward)(d.T, d.H, d.A, hi, m, W, WT, q, v, ds,
                                 act ? act + i * d.T * d.A : NULL, z,
                                 eps, dhi, dW, dv, E);
        /* 2. q = W_c c + b  ->  db += E, dW_c += E c^T, dc = W_c^T E */
        SFX(context_backward)(d.H, d.A, W, c, E, dW, db, dc);
        /* 1. c = (1/n) sum_t m_t h_t  ->  dh_t += (m_t / n) dc */
        SFX(mean_backward)(d.H, n, dc);
        for (ptrdiff_t t = 0; t < d.T; t++) {
            if (VALID(m, t)) {
                SFX(axpy)(d.H, 1, dc, dhi + t * d.H);
            }
        }
    }
    return ATT_OK;
}

/* ---------------------------------------------------------------------
 * Dispatch of the fused kernels to the instruction set asked for
 */

/* Scratch in bytes of the scalar path: WT (2H, A) plus n_h vectors of H,
 * n_a of A, n_t of T; -1 on overflow. */
static ptrdiff_t SFX(scalar_workspace)(att_dims d, ptrdiff_t n_h,
                                       ptrdiff_t n_a, ptrdiff_t n_t)
{
    ptrdiff_t elems = workspace_elems(d, n_h, n_a, n_t);
    if (elems < 0 || elems > PTRDIFF_MAX / (ptrdiff_t)sizeof(REAL)) {
        return -1;
    }
    return elems * (ptrdiff_t)sizeof(REAL);
}

ptrdiff_t SFX(att_additive_score_workspace)(att_dims d)
{
    return SFX(scalar_workspace)(d, 0, 2, 0);      /* WT | q z */
}

ptrdiff_t SFX(att_additive_score_backward_workspace)(att_dims d)
{
    return SFX(scalar_workspace)(d, 0, 4, 0);      /* WT | q z eps E */
}

ptrdiff_t SFX(att_context_attention_workspace)(att_dims d,
                                               const att_exec *ex)
{
#if ATT_HAVE_FAST
    if (ex->simd != ATT_SIMD_SCALAR) {
        return fast_bytes(FAST(ex->simd, att_fast_workspace)(
            d, 0, exec_threads(ex, d)));
    }
#endif
    return SFX(scalar_workspace)(d, 1, 2, 0);      /* WT | c | q z */
}

ptrdiff_t SFX(att_context_attention_backward_workspace)(
    att_dims d, const att_exec *ex)
{
#if ATT_HAVE_FAST
    if (ex->simd != ATT_SIMD_SCALAR) {
        return fast_bytes(FAST(ex->simd, att_fast_workspace)(
            d, 1, exec_threads(ex, d)));
    }
#endif
    return SFX(scalar_workspace)(d, 2, 4, 2);      /* WT | c dc |
                                                      q z eps E | gamma ds */
}

int SFX(att_context_attention)(att_dims d, const att_exec *ex,
                               const REAL *h, const REAL *W, const REAL *v,
                               const REAL *b, const unsigned char *mask,
                               REAL *out, REAL *alpha, REAL *act, void *work)
{
    if (!dims_ok(d) || !exec_ok(ex)) {
        return ATT_EINVAL;
    }
#if ATT_HAVE_FAST
    if (ex->simd != ATT_SIMD_SCALAR) {
        return FAST(ex->simd, att_fast_context_attention)(
            d, ex->pool, exec_threads(ex, d), h, W, v, b, mask, out, alpha,
            act, work);
    }
#endif
    return SFX(scalar_context_attention)(d, h, W, v, b, mask, out, alpha,
                                         act, work);
}

int SFX(att_context_attention_backward)(
    att_dims d, const att_exec *ex, const REAL *grad_out, const REAL *h,
    const REAL *W, const REAL *v, const REAL *alpha, const REAL *b,
    const unsigned char *mask, const REAL *grad_alpha, const REAL *act,
    REAL *dh, REAL *dW, REAL *dv, REAL *db, void *work)
{
    if (!dims_ok(d) || !exec_ok(ex)) {
        return ATT_EINVAL;
    }
#if ATT_HAVE_FAST
    if (ex->simd != ATT_SIMD_SCALAR) {
        return FAST(ex->simd, att_fast_context_attention_backward)(
            d, ex->pool, exec_threads(ex, d), grad_out, h, W, v, alpha, b,
            mask, grad_alpha, act, dh, dW, dv, db, work);
    }
#endif
    return SFX(scalar_context_attention_backward)(
        d, grad_out, h, W, v, alpha, b, mask, grad_alpha, act, dh, dW, dv, db,
        work);
}

/* y = tanh(x) elementwise with the given path's tanh (for the tests). */
int SFX(att_tanh)(int simd, ptrdiff_t n, const REAL *x, REAL *y)
{
    if (n < 0 || !att_simd_supported(simd)) {
        return ATT_EINVAL;
    }
#if ATT_HAVE_FAST
    if (simd != ATT_SIMD_SCALAR) {
        FAST(simd, att_fast_tanh)(n, x, y);
        return ATT_OK;
    }
#endif
    for (ptrdiff_t i = 0; i < n; i++) {
        y[i] = TANH(x[i]);
    }
    return ATT_OK;
}
