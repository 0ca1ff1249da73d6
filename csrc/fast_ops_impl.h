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

/* Blocking: a KC x GNC block of B and a GMC x KC block of A are packed
 * once and reused by every micro-tile that needs them (B stays in L2, a
 * KC x NR panel of it in L1).  GMC is a multiple of every MR. */
#define KC 256
#define GNC 512
#define GMC 96

/* Elements of scratch one gemm call needs: the B and A blocks, a row of
 * zeros and a tile. */
#define GEMM_WORK (KC * GNC + KC * GMC + KC + MR * NR)

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

/* Row 0 of a tile: the micro-kernel's arithmetic for one row (the same
 * FMAs in the same order, so a row gives the same bits either way), for
 * the rows of a partial micro-panel.  a(k) = a[k * astep]. */
static void FSFX(micro_kernel_row)(ptrdiff_t K, const REAL *restrict a,
                                   ptrdiff_t astep, const REAL *restrict Bp,
                                   REAL *restrict tile)
{
    VEC c0 = VZERO(), c1 = VZERO();
    for (ptrdiff_t k = 0; k < K; k++) {
        VEC ak = VSET1(a[k * astep]);
        c0 = VFMA(ak, VLOAD(Bp + k * NR), c0);
        c1 = VFMA(ak, VLOAD(Bp + k * NR + VLEN), c1);
    }
    VSTORE(tile, c0);
    VSTORE(tile + VLEN, c1);
}

/* A full MR x NR tile of C = alpha A Bp (beta 0) or beta C + alpha A Bp,
 * stored from the registers: the arithmetic of the micro-kernel
 * (fast_impl.h's TILE_ACCUMULATE, B a packed panel) followed by
 * gemm_store, without the trip through the tile buffer. */
#define TILE_BODY(A_AT)                                                      \
    TILE_ACCUMULATE(A_AT, PANEL_AT)                                          \
    VEC va = VSET1(alpha), vb = VSET1(beta);                                 \
    for (int r = 0; r < MR; r++) {                                           \
        REAL *cr = C + r * ldc;                                              \
        VEC x0 = VMUL(va, c0[r]), x1 = VMUL(va, c1[r]);                      \
        if (beta != 0) {                                                     \
            x0 = VFMA(vb, VLOAD(cr), x0);                                    \
            x1 = VFMA(vb, VLOAD(cr + VLEN), x1);                             \
        }                                                                    \
        VSTORE(cr, x0);                                                      \
        VSTORE(cr + VLEN, x1);                                               \
    }

/* A read in place: row r at A + r ars, contiguous along k. */
static void FSFX(tile_rows)(ptrdiff_t K, const REAL *restrict A,
                            ptrdiff_t ars, const REAL *restrict Bp,
                            REAL alpha, REAL beta, REAL *restrict C,
                            ptrdiff_t ldc)
{
#define ROWS_AT(r, k) A[(r) * ars + (k)]
    TILE_BODY(ROWS_AT)
#undef ROWS_AT
}

static void FSFX(tile_packed)(ptrdiff_t K, const REAL *restrict Ap,
                              const REAL *restrict Bp, REAL alpha, REAL beta,
                              REAL *restrict C, ptrdiff_t ldc)
{
#define PACKED_AT(r, k) Ap[(k) * MR + (r)]
    TILE_BODY(PACKED_AT)
#undef PACKED_AT
}

#undef TILE_BODY

/* C rows (mr x nc) = beta C + alpha tile; C is not read when beta = 0. */
static void FSFX(gemm_store)(const REAL *tile, ptrdiff_t mr, ptrdiff_t nc,
                             REAL alpha, REAL beta, REAL *C, ptrdiff_t ldc)
{
    VEC va = VSET1(alpha), vb = VSET1(beta);
    for (ptrdiff_t r = 0; r < mr; r++) {
        REAL *c = C + r * ldc;
        const REAL *t = tile + r * NR;
        if (nc == NR) {
            for (int h = 0; h < NR; h += VLEN) {
                VEC x = VMUL(va, VLOAD(t + h));
                VSTORE(c + h, beta == 0 ? x : VFMA(vb, VLOAD(c + h), x));
            }
            continue;
        }
        for (ptrdiff_t j = 0; j < nc; j++) {
            c[j] = beta == 0 ? alpha * t[j] : beta * c[j] + alpha * t[j];
        }
    }
}

/* Ap: the rows of A (mc x kc, A(i, k) = A[i ars + k acs]) as micro-panels
 * of MR rows, k-major, zero past mc. */
static void FSFX(pack_rows)(ptrdiff_t mc, ptrdiff_t kc, const REAL *A,
                            ptrdiff_t ars, ptrdiff_t acs, REAL *Ap)
{
    for (ptrdiff_t r0 = 0; r0 < mc; r0 += MR) {
        REAL *dst = Ap + r0 * kc;
        ptrdiff_t mr = mc - r0 < MR ? mc - r0 : MR;
        if (ars == 1 && mr == MR) {      /* A transposed: columns copy */
            for (ptrdiff_t k = 0; k < kc; k++) {
                memcpy(dst + k * MR, A + r0 + k * acs, MR * sizeof(REAL));
            }
            continue;
        }
        for (ptrdiff_t k = 0; k < kc; k++) {
            for (ptrdiff_t r = 0; r < MR; r++) {
                dst[k * MR + r] = r < mr ? A[(r0 + r) * ars + k * acs] : 0;
            }
        }
    }
}

/* The macro-kernel: C (mc x nc) = alpha A B + beta C for the packed B
 * panels Bb (kc x nc) and A either read in place (rows Ai + r ars,
 * contiguous along k; Ab NULL) or packed in micro-panels Ab.  Full tiles
 * go straight to C; partial ones through the tile buffer. */
static void FSFX(gemm_macro)(ptrdiff_t mc, ptrdiff_t nc, ptrdiff_t kc,
                             const REAL *Ai, ptrdiff_t ars, const REAL *Ab,
                             const REAL *Bb, REAL alpha, REAL beta, REAL *C,
                             ptrdiff_t ldc, REAL *tile)
{
    for (ptrdiff_t p = 0; p * NR < nc; p++) {
        const REAL *Bp = Bb + p * kc * NR;
        ptrdiff_t nr = nc - p * NR < NR ? nc - p * NR : NR;
        for (ptrdiff_t r0 = 0; r0 < mc; r0 += MR) {
            ptrdiff_t mr = mc - r0 < MR ? mc - r0 : MR;
            REAL *Ci = C + r0 * ldc + p * NR;
            const REAL *Ap = Ab ? Ab + r0 * kc : NULL;
            if (mr == MR && nr == NR && Ap) {
                FSFX(tile_packed)(kc, Ap, Bp, alpha, beta, Ci, ldc);
                continue;
            }
            if (mr == MR && nr == NR) {
                FSFX(tile_rows)(kc, Ai + r0 * ars, ars, Bp, alpha, beta, Ci,
                                ldc);
                continue;
            }
            if (mr == MR && Ap) {
                FSFX(micro_kernel_packed)(kc, Ap, Bp, tile);
            }
            else if (mr == MR) {
                const REAL *rows[MR];
                for (ptrdiff_t r = 0; r < MR; r++) {
                    rows[r] = Ai + (r0 + r) * ars;
                }
                FSFX(micro_kernel_rows)(kc, rows, Bp, tile);
            }
            else {
                for (ptrdiff_t r = 0; r < mr; r++) {
                    FSFX(micro_kernel_row)(kc, Ap ? Ap + r
                                                  : Ai + (r0 + r) * ars,
                                           Ap ? MR : 1, Bp, tile + r * NR);
                }
            }
            FSFX(gemm_store)(tile, mr, nr, alpha, beta, Ci, ldc);
        }
    }
}

static void FSFX(gemm)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, REAL alpha,
                       const REAL *A, ptrdiff_t ars, ptrdiff_t acs,
                       const REAL *B, ptrdiff_t brs, ptrdiff_t bcs,
                       const unsigned char *kmask, REAL beta, REAL *C,
                       ptrdiff_t ldc, REAL *work)
{
    REAL *Bb = work, *Ab = Bb + KC * GNC, *zero = Ab + KC * GMC;
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
    int packed = acs != 1;        /* else rows of A are read in place */
    for (ptrdiff_t jc = 0; jc < N; jc += GNC) {
        ptrdiff_t nc = N - jc < GNC ? N - jc : GNC;
        for (ptrdiff_t k0 = 0; k0 < K; k0 += KC) {
            ptrdiff_t kc = K - k0 < KC ? K - k0 : KC;
            REAL bk = k0 == 0 ? beta : 1;     /* later K blocks add up */
            for (ptrdiff_t p = 0; p * NR < nc; p++) {
                FSFX(pack_panel)(kc, nc - p * NR < NR ? nc - p * NR : NR,
                                 B + k0 * brs + (jc + p * NR) * bcs, brs,
                                 bcs, kmask ? kmask + k0 : NULL,
                                 Bb + p * kc * NR);
            }
            for (ptrdiff_t ic = 0; ic < M; ic += GMC) {
                ptrdiff_t mc = M - ic < GMC ? M - ic : GMC;
                const REAL *Ai = A + ic * ars + k0 * acs;
                if (packed) {
                    FSFX(pack_rows)(mc, kc, Ai, ars, acs, Ab);
                }
                FSFX(gemm_macro)(mc, nc, kc, Ai, ars, packed ? Ab : NULL, Bb,
                                 alpha, bk, C + ic * ldc + jc, ldc, tile);
            }
        }
    }
}

/* c (N) = alpha a B + beta c for one row a (K): rows of B added in
 * place when they are contiguous (bcs = 1), else one dot product per
 * column (then kmask must be NULL). */
static void FSFX(gemv)(ptrdiff_t N, ptrdiff_t K, REAL alpha, const REAL *a,
                       const REAL *B, ptrdiff_t brs, ptrdiff_t bcs,
                       const unsigned char *kmask, REAL beta, REAL *c,
                       REAL *work)
{
    if (bcs != 1 && kmask == NULL && brs == 1) {
        for (ptrdiff_t j = 0; j < N; j++) {
            REAL x = alpha * FSFX(v_dot)(K, a, B + j * bcs);
            c[j] = beta == 0 ? x : beta * c[j] + x;
        }
        return;
    }
    if (bcs != 1 || N > GEMM_WORK) {
        FSFX(gemm)(1, N, K, alpha, a, K, 1, B, brs, bcs, kmask, beta, c, N,
                   work);
        return;
    }
    REAL *acc = work;     /* (N) */
    memset(acc, 0, (size_t)N * sizeof(REAL));
    for (ptrdiff_t k = 0; k < K; k++) {
        if (kmask == NULL || kmask[k]) {
            FSFX(axpy)(N, a[k], B + k * brs, acc);
        }
    }
    for (ptrdiff_t j = 0; j < N; j++) {
        c[j] = beta == 0 ? alpha * acc[j] : beta * c[j] + alpha * acc[j];
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
                                      const unsigned char *m, int first,
                                      REAL *eq, REAL *ek, ptrdiff_t lde,
                                      REAL *dv)
{
    VEC one = VSET1(1);
    memset(eq, 0, (size_t)apad * sizeof(REAL));
    for (ptrdiff_t t = 0; t < T; t++) {
        REAL *et = ek + t * lde;
        if (m != NULL && !m[t]) {
            if (first) {
                memset(et, 0, (size_t)apad * sizeof(REAL));
            }
            continue;
        }
        const REAL *kt = kp + t * ldk;
        VEC g = VSET1(delta[t]);
        for (ptrdiff_t a = 0; a < apad; a += VLEN) {
            VEC u = FSFX(v_tanh)(VADD(VLOAD(qp + a), VLOAD(kt + a)));
            VEC e = VMUL(VMUL(g, VLOAD(v + a)), VSUB(one, VMUL(u, u)));
            VSTORE(dv + a, VFMA(g, u, VLOAD(dv + a)));
            VSTORE(eq + a, VADD(VLOAD(eq + a), e));
            VSTORE(et + a, first ? e : VADD(VLOAD(et + a), e));
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
        M = FSFX(max_nan)(M, lanes[l]);
    }
    for (ptrdiff_t r = t; r < T; r++) {
        M = FSFX(max_nan)(M, alpha[r]);
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
        int valid = m == NULL || m[t];
        alpha[t] = valid ? FSFX(weight)(alpha[t], total) : 0;
    }
}

/* s_t = exp(s_t - M) in place for the visible t (vis NULL: all), exactly
 * 0 for the others; returns their sum, by blocks of 64 in lanes, the
 * blocks in double (as the softmax row).  M is the streamed softmax's
 * running max, finite. */
static double FSFX(exp_shift_row)(ptrdiff_t n, REAL *s, REAL M,
                                  const unsigned char *vis)
{
    VEC vM = VSET1(M);
    ptrdiff_t t = 0;
    for (; t + VLEN <= n; t += VLEN) {
        VSTORE(s + t, FSFX(v_exp_neg)(VSUB(VLOAD(s + t), vM)));
    }
    if (t < n) {
        REAL lanes[VLEN];
        for (int l = 0; l < VLEN; l++) {
            lanes[l] = t + l < n ? s[t + l] - M : 0;
        }
        VSTORE(lanes, FSFX(v_exp_neg)(VLOAD(lanes)));
        for (int l = 0; t + l < n; l++) {
            s[t + l] = lanes[l];
        }
    }
    /* v_exp_neg stops at its least normal: the invisible back to 0 */
    for (t = 0; vis != NULL && t < n; t++) {
        s[t] = vis[t] ? s[t] : 0;
    }
    return FSFX(v_sum)(n, s);
}

/* The max of s[0 .. n), -inf for n = 0 (a NaN need not win: exp of it
 * makes the row NaN anyway, as in softmax_row). */
static REAL FSFX(max_row)(ptrdiff_t n, const REAL *s)
{
    VEC vmax = VSET1(-INFINITY);
    ptrdiff_t t = 0;
    for (; t + VLEN <= n; t += VLEN) {
        vmax = VMAX(vmax, VLOAD(s + t));
    }
    REAL lanes[VLEN], M = -INFINITY;
    VSTORE(lanes, vmax);
    for (int l = 0; l < VLEN; l++) {
        M = FSFX(max_nan)(M, lanes[l]);
    }
    for (; t < n; t++) {
        M = FSFX(max_nan)(M, s[t]);
    }
    return M;
}

/* dp_t = p_t (dp_t - D): the streamed backward's dL/ds of a row whose
 * keys are all visible, without dropout. */
static void FSFX(ds_row)(ptrdiff_t n, const REAL *p, REAL *dp, REAL D)
{
    VEC vD = VSET1(D);
    ptrdiff_t t = 0;
    for (; t + VLEN <= n; t += VLEN) {
        VSTORE(dp + t, VMUL(VLOAD(p + t), VSUB(VLOAD(dp + t), vD)));
    }
    for (; t < n; t++) {
        dp[t] = p[t] * (dp[t] - D);
    }
}

/* ds_t = alpha_t ((g_t - g_k) - sum_j alpha_j (g_j - g_k)), k the
 * heaviest item: formulas.h's softmax_backward, vectorised (the mean is
 * summed by blocks of 64 in lanes, the blocks in double).  ds may be g. */
static void FSFX(softmax_backward_row)(ptrdiff_t T, const REAL *g,
                                       const REAL *alpha, REAL *ds)
{
    /* k: the first item of the largest weight (a vector max, then a
     * search that stops there) */
    VEC vmax = VSET1(0);
    ptrdiff_t k = 0, t = 0;
    for (; t + VLEN <= T; t += VLEN) {
        vmax = VMAX(vmax, VLOAD(alpha + t));
    }
    REAL lanes[VLEN], top = 0;
    VSTORE(lanes, vmax);
    for (int l = 0; l < VLEN; l++) {
        top = lanes[l] > top ? lanes[l] : top;
    }
    for (; t < T; t++) {
        top = alpha[t] > top ? alpha[t] : top;
    }
    while (k < T - 1 && !(alpha[k] >= top)) {
        k++;
    }
    REAL ref = g[k];
    VEC vref = VSET1(ref);
    double acc = 0;
    for (t = 0; t + 64 <= T; t += 64) {
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

/* ---------------------------------------------------------------------
 * Decoding's matrix-vector primitives: one query against rows read where
 * they are, no packing
 */

/* A hint to fetch the cache line at p (never faults, even past an
 * array's end); rows PF_AHEAD ahead of the one read. */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif
#define PF_AHEAD 16
#define LINE ((ptrdiff_t)(64 / sizeof(REAL)))

/* q . k over d columns: the vectors in one accumulator, its lanes
 * reduced, then the columns past the last whole vector one by one (one
 * key's dot, whichever of dot_keys' loops takes it). */
#define DOT_REDUCE(acc, k, r)                                                \
    REAL r = VREDUCE(acc);                                                   \
    for (ptrdiff_t c = dv; c < d; c++) {                                     \
        r += q[c] * (k)[c];                                                  \
    }

/* s_t = alpha q . K_t, four keys at a time on four accumulators (their
 * loads and FMAs interleave; the row of each is read once, in order). */
static void FSFX(dot_keys)(ptrdiff_t n, ptrdiff_t d, REAL alpha,
                           const REAL *q, const REAL *K, ptrdiff_t ldk,
                           REAL *s)
{
    ptrdiff_t dv = d / VLEN * VLEN, t = 0;
    for (; t + 4 <= n; t += 4) {
        const REAL *k0 = K + t * ldk, *k1 = k0 + ldk, *k2 = k1 + ldk;
        const REAL *k3 = k2 + ldk;
        VEC a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
        for (ptrdiff_t c = 0; c < d; c += LINE) {
            const REAL *ahead = k0 + PF_AHEAD * ldk + c;
            PREFETCH(ahead);
            PREFETCH(ahead + ldk);
            PREFETCH(ahead + 2 * ldk);
            PREFETCH(ahead + 3 * ldk);
        }
        for (ptrdiff_t c = 0; c < dv; c += VLEN) {
            VEC x = VLOAD(q + c);
            a0 = VFMA(x, VLOAD(k0 + c), a0);
            a1 = VFMA(x, VLOAD(k1 + c), a1);
            a2 = VFMA(x, VLOAD(k2 + c), a2);
            a3 = VFMA(x, VLOAD(k3 + c), a3);
        }
        DOT_REDUCE(a0, k0, r0)
        DOT_REDUCE(a1, k1, r1)
        DOT_REDUCE(a2, k2, r2)
        DOT_REDUCE(a3, k3, r3)
        s[t] = alpha * r0;
        s[t + 1] = alpha * r1;
        s[t + 2] = alpha * r2;
        s[t + 3] = alpha * r3;
    }
    for (; t < n; t++) {
        const REAL *k0 = K + t * ldk;
        VEC a0 = VZERO();
        for (ptrdiff_t c = 0; c < dv; c += VLEN) {
            a0 = VFMA(VLOAD(q + c), VLOAD(k0 + c), a0);
        }
        DOT_REDUCE(a0, k0, r0)
        s[t] = alpha * r0;
    }
}

#undef DOT_REDUCE

/* Columns [c0, c0 + nv VLEN) of sum_values: nv (a constant where it is
 * called, inlined there) accumulators held in registers over the rows. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((always_inline))
#endif
static inline void FSFX(sum_block)(ptrdiff_t n, int nv, const REAL *w,
                                   const REAL *V, ptrdiff_t ldv,
                                   const unsigned char *use, REAL *out)
{
    VEC acc[8];
    for (int v = 0; v < nv; v++) {
        acc[v] = VZERO();
    }
    for (ptrdiff_t t = 0; t < n; t++) {
        if (use != NULL && !use[t]) {
            continue;
        }
        VEC wt = VSET1(w[t]);
        const REAL *row = V + t * ldv;
        for (int v = 0; v < nv * VLEN; v += LINE) {
            PREFETCH(row + PF_AHEAD * ldv + v);
        }
        for (int v = 0; v < nv; v++) {
            acc[v] = VFMA(wt, VLOAD(row + v * VLEN), acc[v]);
        }
    }
    for (int v = 0; v < nv; v++) {
        VSTORE(out + v * VLEN, acc[v]);
    }
}

/* out = sum_t w_t V_t over the used rows: blocks of 8, 4, 2, 1 vectors
 * of columns (each summed over t in order), then the columns past the
 * last whole vector. */
static void FSFX(sum_values)(ptrdiff_t n, ptrdiff_t d, const REAL *w,
                           const REAL *V, ptrdiff_t ldv,
                           const unsigned char *use, REAL *out)
{
    ptrdiff_t c = 0;
    for (; c + 8 * VLEN <= d; c += 8 * VLEN) {
        FSFX(sum_block)(n, 8, w, V + c, ldv, use, out + c);
    }
    for (int nv = 4; nv >= 1; nv /= 2) {
        if (c + nv * VLEN <= d) {
            FSFX(sum_block)(n, nv, w, V + c, ldv, use, out + c);
            c += nv * VLEN;
        }
    }
    for (; c < d; c++) {
        REAL acc = 0;
        for (ptrdiff_t t = 0; t < n; t++) {
            acc += use == NULL || use[t] ? w[t] * V[t * ldv + c] : 0;
        }
        out[c] = acc;
    }
}

void FSFX(att_fast_ops)(OPS_T *ops)
{
    ops->vlen = VLEN;
    ops->gemm_work = GEMM_WORK;
    ops->gemm = FSFX(gemm);
    ops->gemv = FSFX(gemv);
    ops->add_scores = FSFX(add_scores);
    ops->add_scores_backward = FSFX(add_scores_backward);
    ops->softmax = FSFX(softmax_row);
    ops->softmax_backward = FSFX(softmax_backward_row);
    ops->exp_shift = FSFX(exp_shift_row);
    ops->max_row = FSFX(max_row);
    ops->ds_row = FSFX(ds_row);
    ops->dot_keys = FSFX(dot_keys);
    ops->sum_values = FSFX(sum_values);
}

#undef OPS_T
#undef PREFETCH
#undef PF_AHEAD
#undef LINE
#undef KC
#undef GNC
#undef GMC
#undef GEMM_WORK
