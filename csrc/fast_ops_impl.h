/*
 * fast_ops_impl.h - the attention family's primitives (fast.h, att_ops)
 * for one floating type and instruction set.  Included by fast_impl.h,
 * after its micro-kernels and vector math and before it #undefs its
 * parameters.  Not a public header.
 *
 * The product is a BLIS-style loop frame around fast_impl.h's
 * micro-kernels: K is cut in blocks of KC (a KC x NR panel of B stays in
 * L1), B is packed panel by panel, A is read in place when its rows are
 * contiguous and packed into micro-panels otherwise.
 */

#if REAL_DIGITS == 24
#define OPS_T att_ops_f32
#else
#define OPS_T att_ops_f64
#endif

#define KC 256

/* Elements of scratch one gemm call needs: a B panel, an A micro-panel,
 * a row of zeros and a tile. */
#define GEMM_WORK (KC * NR + KC * MR + KC + MR * NR)

/* Bp (kc x NR) = rows k0 .. k0 + kc, columns j0 .. j0 + nc of B, zero
 * past nc and in the rows kmask marks as padding. */
static void FSFX(pack_panel)(ptrdiff_t kc, ptrdiff_t nc, const REAL *B,
                             ptrdiff_t brs, ptrdiff_t bcs,
                             const unsigned char *kmask, REAL *Bp)
{
    if (nc < NR) {
        memset(Bp, 0, (size_t)(kc * NR) * sizeof(REAL));
    }
    if (bcs == 1) {
        for (ptrdiff_t k = 0; k < kc; k++) {
            memcpy(Bp + k * NR, B + k * brs, (size_t)nc * sizeof(REAL));
        }
    }
    else {
        for (ptrdiff_t c = 0; c < nc; c++) {
            for (ptrdiff_t k = 0; k < kc; k++) {
                Bp[k * NR + c] = B[k * brs + c * bcs];
            }
        }
    }
    for (ptrdiff_t k = 0; kmask != NULL && k < kc; k++) {
        if (!kmask[k]) {
            memset(Bp + k * NR, 0, NR * sizeof(REAL));
        }
    }
}

/* C rows (mr x nc) = beta C + alpha tile; C is not read when beta = 0. */
static void FSFX(gemm_store)(const REAL *tile, ptrdiff_t mr, ptrdiff_t nc,
                             REAL alpha, REAL beta, REAL *C, ptrdiff_t ldc)
{
    for (ptrdiff_t r = 0; r < mr; r++) {
        REAL *c = C + r * ldc;
        const REAL *t = tile + r * NR;
        if (beta == 0) {
            for (ptrdiff_t j = 0; j < nc; j++) {
                c[j] = alpha * t[j];
            }
        }
        else {
            for (ptrdiff_t j = 0; j < nc; j++) {
                c[j] = beta * c[j] + alpha * t[j];
            }
        }
    }
}

static void FSFX(gemm)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, REAL alpha,
                       const REAL *A, ptrdiff_t ars, ptrdiff_t acs,
                       const REAL *B, ptrdiff_t brs, ptrdiff_t bcs,
                       const unsigned char *kmask, REAL beta, REAL *C,
                       ptrdiff_t ldc, REAL *work)
{
    REAL *Bp = work, *Ap = Bp + KC * NR, *zero = Ap + KC * MR;
    REAL *tile = zero + KC;
    if (K == 0) {
        for (ptrdiff_t i = 0; i < M; i++) {
            for (ptrdiff_t j = 0; j < N; j++) {
                C[i * ldc + j] = beta == 0 ? 0 : beta * C[i * ldc + j];
            }
        }
        return;
    }
    memset(zero, 0, KC * sizeof(REAL));
    for (ptrdiff_t k0 = 0; k0 < K; k0 += KC) {
        ptrdiff_t kc = K - k0 < KC ? K - k0 : KC;
        REAL bk = k0 == 0 ? beta : 1;     /* later K blocks accumulate */
        const unsigned char *km = kmask ? kmask + k0 : NULL;
        for (ptrdiff_t j0 = 0; j0 < N; j0 += NR) {
            ptrdiff_t nc = N - j0 < NR ? N - j0 : NR;
            FSFX(pack_panel)(kc, nc, B + k0 * brs + j0 * bcs, brs, bcs, km,
                             Bp);
            for (ptrdiff_t i0 = 0; i0 < M; i0 += MR) {
                ptrdiff_t mr = M - i0 < MR ? M - i0 : MR;
                const REAL *Ai = A + i0 * ars + k0 * acs;
                if (acs == 1) {
                    const REAL *rows[MR];
                    for (ptrdiff_t r = 0; r < MR; r++) {
                        rows[r] = r < mr ? Ai + r * ars : zero;
                    }
                    FSFX(micro_kernel_rows)(kc, rows, Bp, tile);
                }
                else {
                    for (ptrdiff_t k = 0; k < kc; k++) {
                        for (ptrdiff_t r = 0; r < MR; r++) {
                            Ap[k * MR + r] = r < mr ? Ai[r * ars + k * acs]
                                                    : 0;
                        }
                    }
                    FSFX(micro_kernel_packed)(kc, Ap, Bp, tile);
                }
                FSFX(gemm_store)(tile, mr, nc, alpha, bk,
                                 C + i0 * ldc + j0, ldc);
            }
        }
    }
}

/* s_t = v . tanh(qp + kp_t) over apad (a multiple of VLEN) columns. */
static void FSFX(add_scores)(ptrdiff_t T, ptrdiff_t apad, const REAL *qp,
                             const REAL *kp, ptrdiff_t ldk, const REAL *v,
                             const unsigned char *m, REAL *s)
{
    for (ptrdiff_t t = 0; t < T; t++) {
        if (m != NULL && !m[t]) {
            s[t] = 0;
            continue;
        }
        const REAL *kt = kp + t * ldk;
        VEC acc0 = VZERO(), acc1 = VZERO();
        ptrdiff_t a = 0;
        for (; a + 2 * VLEN <= apad; a += 2 * VLEN) {  /* two chains */
            VEC u0 = FSFX(v_tanh)(VADD(VLOAD(qp + a), VLOAD(kt + a)));
            VEC u1 = FSFX(v_tanh)(VADD(VLOAD(qp + a + VLEN),
                                       VLOAD(kt + a + VLEN)));
            acc0 = VFMA(u0, VLOAD(v + a), acc0);
            acc1 = VFMA(u1, VLOAD(v + a + VLEN), acc1);
        }
        if (a < apad) {
            VEC u = FSFX(v_tanh)(VADD(VLOAD(qp + a), VLOAD(kt + a)));
            acc0 = VFMA(u, VLOAD(v + a), acc0);
        }
        s[t] = VREDUCE(VADD(acc0, acc1));
    }
}

static void FSFX(add_scores_backward)(ptrdiff_t T, ptrdiff_t apad,
                                      const REAL *qp, const REAL *kp,
                                      ptrdiff_t ldk, const REAL *v,
                                      const REAL *delta,
                                      const unsigned char *m, REAL *eq,
                                      REAL *ek, ptrdiff_t lde, REAL *dv)
{
    VEC one = VSET1(1);
    for (ptrdiff_t t = 0; t < T; t++) {
        if (m != NULL && !m[t]) {
            continue;
        }
        const REAL *kt = kp + t * ldk;
        REAL *et = ek + t * lde;
        VEC g = VSET1(delta[t]);
        for (ptrdiff_t a = 0; a < apad; a += VLEN) {
            VEC u = FSFX(v_tanh)(VADD(VLOAD(qp + a), VLOAD(kt + a)));
            VEC e = VMUL(VMUL(g, VLOAD(v + a)), VSUB(one, VMUL(u, u)));
            VSTORE(dv + a, VFMA(g, u, VLOAD(dv + a)));
            VSTORE(eq + a, VADD(VLOAD(eq + a), e));
            VSTORE(et + a, VADD(VLOAD(et + a), e));
        }
    }
}

/* Sum of x[0 .. n): blocks of 64 in vectors, the blocks in double (as
 * sum_rows: float32 summed one by one over long rows loses digits). */
static double FSFX(v_sum)(ptrdiff_t n, const REAL *x)
{
    double total = 0;
    ptrdiff_t i = 0;
    for (; i + 64 <= n; i += 64) {
        VEC acc = VZERO();
        for (ptrdiff_t j = 0; j < 64; j += VLEN) {
            acc = VADD(acc, VLOAD(x + i + j));
        }
        total += (double)VREDUCE(acc);
    }
    for (; i < n; i++) {
        total += (double)x[i];
    }
    return total;
}

/* One row of the masked softmax (seq_softmax's contract): masked items
 * exactly 0, all 0 when none is valid.  alpha may be s. */
static void FSFX(softmax_row)(ptrdiff_t T, const REAL *s,
                              const unsigned char *m, REAL *alpha)
{
    ptrdiff_t n = 0;
    for (ptrdiff_t t = 0; t < T; t++) {         /* compiles to blends */
        int valid = m == NULL || m[t];
        alpha[t] = valid ? s[t] : -INFINITY;
        n += valid;
    }
    if (n == 0) {
        memset(alpha, 0, (size_t)T * sizeof(REAL));
        return;
    }
    /* M = max of the valid scores.  A NaN among them need not win here:
     * exp(NaN - M) is NaN, and so is the total, as with M = NaN. */
    VEC vmax = VSET1(-INFINITY);
    ptrdiff_t t = 0;
    for (; t + VLEN <= T; t += VLEN) {
        vmax = VMAX(vmax, VLOAD(alpha + t));
    }
    REAL lanes[VLEN], M = -INFINITY;
    VSTORE(lanes, vmax);
    for (int l = 0; l < VLEN; l++) {
        M = lanes[l] > M || isnan(lanes[l]) ? lanes[l] : M;
    }
    for (ptrdiff_t r = t; r < T; r++) {
        M = alpha[r] > M || isnan(alpha[r]) ? alpha[r] : M;
    }
    VEC vM = VSET1(M);
    for (t = 0; t + VLEN <= T; t += VLEN) {
        VSTORE(alpha + t, FSFX(v_exp_neg)(VSUB(VLOAD(alpha + t), vM)));
    }
    if (t < T) {
        for (int l = 0; l < VLEN; l++) {
            lanes[l] = t + l < T ? alpha[t + l] - M : 0;
        }
        VSTORE(lanes, FSFX(v_exp_neg)(VLOAD(lanes)));
        for (int l = 0; t + l < T; l++) {
            alpha[t + l] = lanes[l];
        }
    }
    /* v_exp_neg stops at its least normal: masked items back to 0 */
    for (t = 0; m != NULL && t < T; t++) {
        alpha[t] = m[t] ? alpha[t] : 0;
    }
    double total = FSFX(v_sum)(T, alpha);
    for (t = 0; t < T; t++) {
        alpha[t] = (REAL)(alpha[t] / total);
    }
}

/* ds_t = alpha_t ((g_t - g_k) - sum_j alpha_j (g_j - g_k)), k the
 * heaviest item: seq_softmax_backward's evaluation, vectorised.  ds may
 * be g. */
static void FSFX(softmax_backward_row)(ptrdiff_t T, const REAL *g,
                                       const REAL *alpha, REAL *ds)
{
    ptrdiff_t k = 0;
    for (ptrdiff_t t = 1; t < T; t++) {
        k = alpha[t] > alpha[k] ? t : k;
    }
    REAL ref = g[k];
    VEC vref = VSET1(ref);
    double acc = 0;
    ptrdiff_t t = 0;
    for (; t + 64 <= T; t += 64) {
        VEC blk = VZERO();
        for (ptrdiff_t j = t; j < t + 64; j += VLEN) {
            blk = VFMA(VLOAD(alpha + j), VSUB(VLOAD(g + j), vref), blk);
        }
        acc += (double)VREDUCE(blk);
    }
    for (; t < T; t++) {
        acc += (double)alpha[t] * (double)(g[t] - ref);
    }
    VEC vmean = VSET1((REAL)acc);
    for (t = 0; t + VLEN <= T; t += VLEN) {
        VEC d = VSUB(VSUB(VLOAD(g + t), vref), vmean);
        VSTORE(ds + t, VMUL(VLOAD(alpha + t), d));
    }
    for (; t < T; t++) {
        ds[t] = alpha[t] * ((g[t] - ref) - (REAL)acc);
    }
}

void FSFX(att_fast_ops)(OPS_T *ops)
{
    ops->vlen = VLEN;
    ops->gemm_work = GEMM_WORK;
    ops->gemm = FSFX(gemm);
    ops->add_scores = FSFX(add_scores);
    ops->add_scores_backward = FSFX(add_scores_backward);
    ops->softmax = FSFX(softmax_row);
    ops->softmax_backward = FSFX(softmax_backward_row);
}

#undef OPS_T
#undef KC
#undef GEMM_WORK
