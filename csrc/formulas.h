/*
 * formulas.h - the scalar formulas of the contract (docs/contract.md)
 * that the scalar path (kernels_impl.h, family_impl.h) and the SIMD path
 * (fast_impl.h, fast_ops_impl.h) share: one C function each, so that the
 * two paths cannot drift apart.  The SIMD path keeps its own vector loops
 * (its tanh, exp, products, reductions in lanes) around them.
 *
 * Included once per type (and instruction set), with
 *   REAL      float or double
 *   FML(x)    the names' suffix: kernels_impl.h passes its SFX (x_f32),
 *             fast_impl.h its FSFX (x_f32_avx2 ...)
 * and WEIGHT_FLOOR (fast.h) defined; #undefs FML at its end.  Not a
 * public header.
 */

/* y += a x  (n) */
static void FML(axpy)(ptrdiff_t n, REAL a, const REAL *restrict x,
                      REAL *restrict y)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        y[i] += a * x[i];
    }
}

/* The running max M of a softmax's scores after x: the larger, except
 * that a NaN wins and stays (as in np.max, so a NaN score makes the row
 * NaN rather than being skipped). */
static inline REAL FML(max_nan)(REAL M, REAL x)
{
    return (x > M || isnan(x)) && !isnan(M) ? x : M;
}

/* The max of the valid scores s[t], t < n (m NULL: all valid); -inf when
 * none is. */
static REAL FML(row_max)(ptrdiff_t n, const REAL *s, const unsigned char *m)
{
    REAL M = -INFINITY;
    for (ptrdiff_t t = 0; t < n; t++) {
        if (m == NULL || m[t]) {
            M = FML(max_nan)(M, s[t]);
        }
    }
    return M;
}

/* A valid item's softmax weight from its e = exp(s - M) and the total of
 * the row's e summed in double (float32 sums over long rows would lose
 * digits), never below the least normal number (see WEIGHT_FLOOR). */
static inline REAL FML(weight)(REAL e, double total)
{
    return WEIGHT_FLOOR((REAL)(e / total));
}

/*
 * Softmax backward over the n valid items of a row: with g_r the gradient
 * of alpha and alpha_r the weight of item r (alpha[idx[r]], or alpha[r]
 * when idx is NULL),
 *   ds_r = alpha_r (g_r - sum_j alpha_j g_j), evaluated as
 *   ds_r = alpha_r ((g_r - g_k) - sum_j alpha_j (g_j - g_k))
 * with k the first item of largest weight: the same value (the weights
 * sum to 1), but when alpha_k is near 1 the weighted mean no longer
 * cancels against g_k, which costs float32 several digits otherwise.  The
 * mean is summed in double, in item order.  ds may be g.
 */
static void FML(softmax_backward)(ptrdiff_t n, const ptrdiff_t *idx,
                                  const REAL *g, const REAL *alpha, REAL *ds)
{
#define ALPHA_AT(r) alpha[idx ? idx[r] : (r)]
    ptrdiff_t k = 0;
    for (ptrdiff_t r = 1; r < n; r++) {
        k = ALPHA_AT(r) > ALPHA_AT(k) ? r : k;
    }
    REAL ref = n > 0 ? g[k] : 0;
    double acc = 0;
    for (ptrdiff_t r = 0; r < n; r++) {
        acc += (double)ALPHA_AT(r) * (double)(g[r] - ref);
    }
    REAL mean = (REAL)acc;
    for (ptrdiff_t r = 0; r < n; r++) {
        ds[r] = ALPHA_AT(r) * ((g[r] - ref) - mean);
    }
#undef ALPHA_AT
}

/* The additive score's backward at one element: s = v . u, u = tanh(z)
 * -> dL/dz = ds v (1 - u^2) (dv gets ds u). */
static inline REAL FML(tanh_score_backward)(REAL ds, REAL v, REAL u)
{
    return ds * v * (1 - u * u);
}

/* out = sum_t w_t h_t over the valid rows t < T of h (T, H) (m NULL: all
 * valid; w NULL: w_t = 1).  Blocks of 64 valid rows are summed in REAL
 * (vectorised), the blocks in double: float32 summed row by row over a
 * long sequence would lose digits (error ~ T eps; this is ~64 eps at
 * worst).  Columns go 64 at a time so the accumulators stay in registers
 * or L1.   out (H) */
static void FML(sum_rows)(ptrdiff_t T, ptrdiff_t H, const REAL *h,
                          const unsigned char *m, const REAL *w, REAL *out)
{
    for (ptrdiff_t k0 = 0; k0 < H; k0 += 64) {
        ptrdiff_t nk = H - k0 < 64 ? H - k0 : 64, inblk = 0;
        double acc[64];
        REAL blk[64];
        for (ptrdiff_t k = 0; k < nk; k++) {  /* not `= {0}`: a rep stos of */
            acc[k] = 0;                       /* all 768 bytes took a     */
            blk[k] = 0;                       /* quarter of a short sum   */
        }
        for (ptrdiff_t t = 0; t < T; t++) {
            if (m != NULL && !m[t]) {
                continue;
            }
            const REAL *ht = h + t * H + k0;
            REAL wt = w ? w[t] : 1;
            for (ptrdiff_t k = 0; k < nk; k++) {
                blk[k] += wt * ht[k];
            }
            if (++inblk == 64) {
                for (ptrdiff_t k = 0; k < nk; k++) {
                    acc[k] += (double)blk[k];
                    blk[k] = 0;
                }
                inblk = 0;
            }
        }
        for (ptrdiff_t k = 0; k < nk; k++) {
            out[k0 + k] = (REAL)(acc[k] + (double)blk[k]);
        }
    }
}

/* c = (1/n) sum_t m_t h_t, the mean of the n valid rows of h (T, H);
 * c = 0 when n = 0.  Returns n.   c (H) */
static ptrdiff_t FML(seq_mean)(ptrdiff_t T, ptrdiff_t H, const REAL *h,
                               const unsigned char *m, REAL *c)
{
    ptrdiff_t n = 0;
    for (ptrdiff_t t = 0; t < T; t++) {
        n += m == NULL || m[t];
    }
    FML(sum_rows)(T, H, h, m, NULL, c);
    for (ptrdiff_t k = 0; k < H && n > 0; k++) {
        c[k] /= (REAL)n;
    }
    return n;
}

/*
 * The context's share of the score backward, given E = sum_t eps_t (A),
 * the gradient of q = W_c c + b:
 *   db   += E                                   (db may be NULL)
 *   dW_c += E c^T                               (columns [H, 2H) of dW)
 *   dc    = W_c^T E                             (H)
 * W and dW are (A, 2H).
 */
static void FML(context_backward)(ptrdiff_t H, ptrdiff_t A, const REAL *W,
                                  const REAL *c, const REAL *E, REAL *dW,
                                  REAL *db, REAL *dc)
{
    for (ptrdiff_t k = 0; k < H; k++) {
        dc[k] = 0;
    }
    for (ptrdiff_t a = 0; a < A; a++) {
        if (db) {
            db[a] += E[a];
        }
        FML(axpy)(H, E[a], c, dW + a * 2 * H + H);
        FML(axpy)(H, E[a], W + a * 2 * H + H, dc);
    }
}

/* c = mean of the n valid rows -> the share of dL/dc each valid row's
 * dh gets: dc / n, in place (n = 0: no row takes it). */
static void FML(mean_backward)(ptrdiff_t H, ptrdiff_t n, REAL *dc)
{
    for (ptrdiff_t k = 0; k < H && n > 0; k++) {
        dc[k] /= (REAL)n;
    }
}

#undef FML
