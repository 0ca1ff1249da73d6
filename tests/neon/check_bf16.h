/*
 * check_bf16.h - check.c's checks of the bf16 products of float calls
 * (ATT_PRECISION_BF16 on the dot products, core/dispatch.h's
 * flash_bf16[ATT_BF16_DOT - 1]) on a path whose CPU has them
 * (att_bf16_supported): AVX512_BF16's vdpbf16ps where the host has it,
 * the BF16 extension's BFDOT under qemu-aarch64.  Each ISA rounds its
 * sums its own way, and the model of each is here:
 *   - one key, bit for bit: out is V rounded to bf16, lse the score of Q
 *     and K rounded to bf16 summed pair by pair as the ISA sums, times
 *     scale log2(e), times ln 2 (in float);
 *   - the streamed forward on sizes across the tiles and blocks (full,
 *     causal, a window, grouped heads): within BF16_TOL of the scalar
 *     path's float32 result and further from it than float32 products
 *     come (the bf16 products did run), the same bits on 1 and 2 threads;
 *   - the round-to-odd model itself on sums whose result is known;
 *   - the backward's product on them (gemm_bf16, where the path has it),
 *     its operands as floats and as stored bf16 (the same bits),
 *     bit for bit against the model: operands by rows, by columns and
 *     strided both ways, sizes around the tiles and pairs of k, K past
 *     a block of ATT_GEMM_KC, beta 0 (C not read) and 1, rows of B that
 *     kmask leaves out (a NaN there stays out);
 *   - the streamed backward on them: dq, dk, dv within BF16_TOL of the
 *     float32 products' and beyond BF16_SEEN, 1 and 2 threads bitwise.
 * And on every path, bfloat16 and float16 as stored on the float
 * products (check_stored16_float): the fused forward on q, k and v in 16
 * bits gives the bits of the same path on them widened, out rounded
 * after; the streamed backward on q, k, v, out and grad_out in 16 bits,
 * the bits of it on them widened.
 */

/* The streamed backward's sizes (bf16_backward_case,
 * float_backward_case) */
#define FF(B_, Tq_, T_, H_, Hv_, causal_) \
    {.B = B_, .Tq = Tq_, .T = T_, .H = H_, .Hv = Hv_, .causal = causal_}
static const att_fdims back_sizes[] = {
    FF(1, 17, 47, 8, 5, 0), FF(2, 65, 49, 17, 9, 1),
    FF(1, 130, 300, 64, 64, 0), FF(1, 200, 200, 32, 32, 1),
};
#undef FF
#define N_BACK_SIZES (sizeof(back_sizes) / sizeof(back_sizes[0]))

/* Normwise error of the bf16 forward against float32 (attention_c.testing's
 * BF16_TOL: each operand and weight rounded to bf16 costs up to 2^-9
 * relative), and the least it must show (float32 products stay within
 * TOL = 1e-5) */
#define BF16_TOL 8e-3
#define BF16_SEEN 1e-5

/* x clamped to bf16's finite range, rounded to nearest even, widened */
static float bf16_of(float x)
{
    return att_bf16_to_f32(att_f32_to_bf16_clamped(x));
}

/* x with its lowest bit set */
static float odd_bit(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u |= 1;
    memcpy(&x, &u, sizeof u);
    return x;
}

/* a + b rounded to odd (truncated, the lowest bit set when inexact), a
 * result below the least normal float flushed to 0: BFDOT's sums.  The
 * exact sum is s + e (Knuth's two-sum in double). */
static float add_odd(float a, float b)
{
    double x = a, y = b, s = x + y, bp = s - x;
    double e = (x - (s - bp)) + (y - bp);
    float f = (float)s;
    if (fabs((double)f) > fabs(s)) {
        f = nextafterf(f, 0);                 /* s toward 0 */
    }
    int inexact = (double)f != s || e != 0;
    if ((double)f == s && e != 0 && (e < 0) != (s < 0)) {
        f = nextafterf(f, 0);                 /* s + e is below |s| */
    }
    f = inexact ? odd_bit(f) : f;
    return fabsf(f) < FLT_MIN ? copysignf(0, f) : f;
}

/* One lane's product acc + a[0] b[0] + a[1] b[1] (bf16 values; their
 * products are exact in float) as path simd sums it */
static float dot_pair(int simd, float acc, const float *a, const float *b)
{
    if (simd == ATT_SIMD_NEON) {        /* BFDOT: the pair, then acc */
        return add_odd(acc, add_odd(a[0] * b[0], a[1] * b[1]));
    }
    /* vdpbf16ps: the odd product first, each sum to nearest */
    return fmaf(a[0], b[0], fmaf(a[1], b[1], acc));
}

/* The model on sums whose result is known. */
static void check_add_odd(ctx *c)
{
    snprintf(c->what, sizeof c->what, "round-to-odd model");
    float ulp1 = 0x1p-23f;
    expect(c, add_odd(1, 0x1p-31f) == 1 + ulp1 &&   /* inexact: odd */
              add_odd(1, -0x1p-31f) == 1 - ulp1 / 2 &&
              add_odd(2, 1 + ulp1) == odd_bit(3) &&
              add_odd(1, 1) == 2 && add_odd(1.5f, -1.5f) == 0 &&
              add_odd(0x1p-126f, -0x1p-127f) == 0 &&  /* flushed */
              add_odd(-1, -0x1p-40f) == -(1 + ulp1),
           "a sum rounds otherwise than to odd");
}

/* The forward of B query sequences of Tq (Bk = (B + 1) / 2 key sequences
 * of T), dot score, on path simd (ATT_SIMD_SCALAR: float32 products) or
 * its bf16 products on `threads` threads; out and lse returned. */
static int bf16_forward(ctx *c, int simd, int bf16, int threads,
                        att_fdims f, const float *q, const float *k,
                        const float *v, const ptrdiff_t *kidx, float *out,
                        float *lse)
{
    att_exec ex = {simd, threads, c->pool,
                   bf16 ? ATT_PRECISION_BF16 : ATT_PRECISION_IEEE,
                   bf16 ? ATT_BF16_DOT : 0};
    att_family_in_f32 in = {.query = q, .keys = k, .values = v,
                            .kidx = kidx, .vidx = kidx,
                            .scale = (float)(1 / sqrt((double)f.H))};
    att_family_out_f32 fo = {.out = out, .lse = lse};
    void *work = workspace_f32(c, att_family_workspace_f32(&f, 0, &ex));
    int st = att_family_forward_f32(&f, &ex, &in, &fo, work);
    free(work);
    c->calls++;
    return st;
}

/* One key: out = bf16(V), lse = the modelled score, bit for bit. */
static void bf16_one_key(ctx *c, ptrdiff_t H)
{
    ptrdiff_t Tq = 40, H2 = (H + 1) / 2;
    snprintf(c->what, sizeof c->what, "bf16 one key H=%td", H);
    float *q = rand_f32(c, Tq * H, 1), *k = rand_f32(c, H, 1);
    float *v = rand_f32(c, H, 1);
    float *out = nans_f32(Tq * H), *lse = nans_f32(Tq);
    float *a = xmalloc((size_t)(2 * H2) * sizeof(float));
    float *b = xmalloc((size_t)(2 * H2) * sizeof(float));
    ptrdiff_t kidx[1] = {0};
    att_fdims f = {.B = 1, .Tq = Tq, .T = 1, .H = H, .Hv = H, .Hq = H,
                   .score = ATT_SCORE_DOT, .stream = 1};
    v[0] = FLT_MAX;                     /* past bf16's range: clamped */
    int st = bf16_forward(c, c->simd, 1, 1, f, q, k, v, kidx, out, lse);
    expect(c, st == ATT_OK, "forward returned %d", st);
    long bad = 0;
    for (ptrdiff_t i = 0; i < Tq * H; i++) {
        bad += out[i] != bf16_of(v[i % H]);
    }
    expect(c, bad == 0, "%ld of out differ from V rounded to bf16", bad);
    const float scale = (float)(1 / sqrt((double)H));
    const float cs = scale * (float)1.4426950408889634;
    bad = 0;
    for (ptrdiff_t i = 0; i < Tq; i++) {
        float s = 0;
        for (ptrdiff_t j = 0; j < 2 * H2; j++) {     /* 0 past H */
            a[j] = j < H ? bf16_of(k[j]) : 0;
            b[j] = j < H ? bf16_of(q[i * H + j]) : 0;
        }
        for (ptrdiff_t p = 0; p < H2; p++) {
            s = dot_pair(c->simd, s, a + 2 * p, b + 2 * p);
        }
        float m = s * cs;
        bad += lse[i] != m * (float)0.6931471805599453;
    }
    expect(c, bad == 0, "%ld of lse differ from the modelled score", bad);
    free(q);
    free(k);
    free(v);
    free(out);
    free(lse);
    free(a);
    free(b);
}

/* 16-bit as stored (io_store `store`, attention.h's att_family_takes16):
 * query, keys and values rounded to bfloat16 (float16), the forward on
 * them as stored gives the bits of the same path's forward on them
 * widened (on the bf16 dot products where `dp`, else on float ones), out
 * rounded after, on 1 and 2 threads, wherever the kernel takes them
 * (the dot products, or the float ones on a SIMD path, the scalar one
 * having no fused kernel); a key of infinity, a value's NaN are
 * refused. */
static void stored16_case(ctx *c, att_fdims f, int store, int dp,
                          const float *q, const float *k, const float *v,
                          const ptrdiff_t *kidx)
{
    int bf16 = store == ATT_STORE_BF16;
    ptrdiff_t n[3] = {f.B * f.Tq * f.H, f.Bk * f.T * f.H, f.Bk * f.T * f.Hv};
    const float *x[3] = {q, k, v};
    uint16_t *h[3];
    float *w[3];
    for (int a = 0; a < 3; a++) {
        h[a] = xmalloc((size_t)(n[a] + 1) * sizeof(uint16_t));
        w[a] = xmalloc((size_t)(n[a] + 1) * sizeof(float));
        for (ptrdiff_t i = 0; i < n[a]; i++) {
            h[a][i] = bf16 ? att_f32_to_bf16_clamped(x[a][i])
                           : att_f32_to_f16(x[a][i]);
            w[a][i] = bf16 ? att_bf16_to_f32(h[a][i])
                           : att_f16_to_f32(h[a][i]);
        }
    }
    ptrdiff_t no = f.B * f.Tq * f.Hv, nl = f.B * f.Tq;
    float *out = nans_f32(no), *lse = nans_f32(nl), *lse16 = nans_f32(nl);
    uint16_t *out16 = xmalloc((size_t)no * sizeof(uint16_t));
    int st = bf16_forward(c, c->simd, dp, 1, f, w[0], w[1], w[2], kidx,
                          out, lse);
    expect(c, st == ATT_OK, "widened run returned %d", st);
    att_family_in_f32 in = {.query = (const float *)(const void *)h[0],
                            .keys = (const float *)(const void *)h[1],
                            .values = (const float *)(const void *)h[2],
                            .kidx = kidx, .vidx = kidx,
                            .scale = (float)(1 / sqrt((double)f.H)),
                            .io_store = store};
    int takes = dp || c->simd != ATT_SIMD_SCALAR;
    att_exec ex = {c->simd, 1, c->pool,
                   dp ? ATT_PRECISION_BF16 : ATT_PRECISION_IEEE,
                   dp ? ATT_BF16_DOT : 0};
    for (ex.threads = 1; ex.threads <= 2; ex.threads++) {
        expect(c, att_family_takes16_f32(&f, &ex, &in) == takes,
               "takes as stored: not %d", takes);
        if (!takes) {
            break;
        }
        memset(out16, 0xff, (size_t)no * sizeof(uint16_t));
        att_family_out_f32 fo = {.out = (float *)(void *)out16,
                                 .lse = lse16};
        void *work = workspace_f32(c, att_family_workspace_f32(&f, 0, &ex));
        st = att_family_forward_f32(&f, &ex, &in, &fo, work);
        free(work);
        c->calls++;
        expect(c, st == ATT_OK, "stored run returned %d", st);
        long bad = 0;
        for (ptrdiff_t i = 0; i < no; i++) {
            bad += out16[i] != (bf16 ? att_f32_to_bf16(out[i])
                                     : att_f32_to_f16(out[i]));
        }
        expect(c, bad == 0 && memcmp(lse, lse16, (size_t)nl *
                                                 sizeof(float)) == 0,
               "%ld of out (or lse) differ as stored, %d threads", bad,
               ex.threads);
    }
    ex.threads = 1;
    h[1][n[1] / 2] = bf16 ? 0x7f80 : 0x7c00;    /* +inf: the general path's */
    expect(c, att_family_takes16_f32(&f, &ex, &in) == 0,
           "a key of infinity taken as stored");
    h[1][n[1] / 2] = 0;
    h[2][n[2] - 1] = bf16 ? 0xffc1 : 0xfe01;    /* a NaN, the last value's */
    expect(c, att_family_takes16_f32(&f, &ex, &in) == 0,
           "a value's NaN taken as stored");
    for (int a = 0; a < 3; a++) {
        free(h[a]);
        free(w[a]);
    }
    free(out);
    free(lse);
    free(lse16);
    free(out16);
}

/* Sizes across the tiles: against float32 products, and threads; out's
 * error returned. */
static double bf16_case(ctx *c, att_fdims f)
{
    ptrdiff_t B = f.B, Tq = f.Tq, T = f.T, H = f.H, Hv = f.Hv;
    ptrdiff_t Bk = (B + 1) / 2;
    snprintf(c->what, sizeof c->what, "bf16 flash B=%td Tq=%td T=%td H=%td "
             "Hv=%td causal=%d window=%d", B, Tq, T, H, Hv, f.causal,
             f.window);
    c->shapes++;
    float *q = rand_f32(c, B * Tq * H, 1), *k = rand_f32(c, Bk * T * H, 1);
    float *v = rand_f32(c, Bk * T * Hv, 1);
    ptrdiff_t *kidx = xmalloc((size_t)B * sizeof(ptrdiff_t));
    for (ptrdiff_t b = 0; b < B; b++) {
        kidx[b] = b / 2;
    }
    f.score = ATT_SCORE_DOT;
    f.stream = 1;
    f.Hq = H;
    f.Bk = f.Bv = Bk;
    float *out[3], *lse[3];
    for (int r = 0; r < 3; r++) {   /* float32; bf16 on 1, on 2 threads */
        out[r] = nans_f32(B * Tq * Hv);
        lse[r] = nans_f32(B * Tq);
        int st = bf16_forward(c, r ? c->simd : ATT_SIMD_SCALAR, r > 0,
                              r == 2 ? 2 : 1, f, q, k, v, kidx, out[r],
                              lse[r]);
        expect(c, st == ATT_OK, "run %d returned %d", r, st);
    }
    double e = rel_err_f32(B * Tq * Hv, out[1], out[0]), e_out = e;
    expect(c, e <= BF16_TOL && e > BF16_SEEN,
           "out: normwise error %.3g against float32, not in (%g, %g]", e,
           BF16_SEEN, BF16_TOL);
    for (ptrdiff_t i = 0; i < B * Tq; i++) {    /* no key seen: -inf */
        int none = lse[0][i] == -INFINITY;
        for (int r = 0; r < 3 && none; r++) {
            expect(c, lse[r][i] == -INFINITY, "lse %td not -inf", i);
            lse[r][i] = 0;
        }
    }
    e = rel_err_f32(B * Tq, lse[1], lse[0]);
    expect(c, e <= BF16_TOL, "lse: normwise error %.3g against float32",
           e);
    size_t nout = (size_t)(B * Tq * Hv), nlse = (size_t)(B * Tq);
    expect(c, memcmp(out[1], out[2], nout * sizeof(float)) == 0 &&
              memcmp(lse[1], lse[2], nlse * sizeof(float)) == 0,
           "1 and 2 threads differ");
    if (B * Tq > 0 && T > 0 && H > 0 && Tq > 8) {     /* (not decoding) */
        stored16_case(c, f, ATT_STORE_BF16, 1, q, k, v, kidx);
    }
    for (int r = 0; r < 3; r++) {
        free(out[r]);
        free(lse[r]);
    }
    free(q);
    free(k);
    free(v);
    free(kidx);
    return e_out;
}

/* gemm_bf16 against its model: A and B rounded to bf16 (rows of B that
 * kmask clears as 0), each K block of ATT_GEMM_KC from 0 summed pair by
 * pair as the ISA sums, times alpha; the first block plus beta C (fused)
 * unless beta is 0, each later one added (fused, times 1). */
static void bf16_gemm_case(ctx *c, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                           int layout, float beta, int masked)
{
    snprintf(c->what, sizeof c->what, "bf16 gemm M=%td N=%td K=%td "
             "layout=%d beta=%g kmask=%d", M, N, K, layout, beta, masked);
    /* layout 0: A by rows, B by rows; 1: both transposed; 2: strided */
    ptrdiff_t ars = layout == 0 ? K : (layout == 1 ? 1 : 2 * K + 3);
    ptrdiff_t acs = layout == 0 ? 1 : (layout == 1 ? M : 2);
    ptrdiff_t brs = layout == 0 ? N : (layout == 1 ? 1 : 2 * N + 5);
    ptrdiff_t bcs = layout == 0 ? 1 : (layout == 1 ? K : 2);
    ptrdiff_t na = (M - 1) * ars + (K - 1) * acs + 1;
    ptrdiff_t nb = (K - 1) * brs + (N - 1) * bcs + 1;
    float *A = nans_f32(na), *B = nans_f32(nb), *C = rand_f32(c, M * N, 1);
    float *want = xmalloc((size_t)(M * N) * sizeof(float));
    float *work = xmalloc((size_t)att_gemm_path_work(c->simd) *
                          sizeof(float));
    unsigned char *kmask = masked ? xmalloc((size_t)K) : NULL;
    for (ptrdiff_t k = 0; k < K; k++) {
        for (ptrdiff_t i = 0; i < M; i++) {
            A[i * ars + k * acs] = (float)(2 * uniform(c) - 1);
        }
        int live = !masked || (kmask[k] = (unsigned char)(k % 3 != 1));
        for (ptrdiff_t j = 0; j < N; j++) {   /* left out: NaN stays */
            B[k * brs + j * bcs] = live ? (float)(2 * uniform(c) - 1) : NAN;
        }
    }
    const float alpha = 0.75f;
    for (ptrdiff_t i = 0; i < M; i++) {
        for (ptrdiff_t j = 0; j < N; j++) {
            float cij = C[i * N + j];
            for (ptrdiff_t k0 = 0; k0 < K; k0 += ATT_GEMM_KC) {
                ptrdiff_t kc = K - k0 < ATT_GEMM_KC ? K - k0 : ATT_GEMM_KC;
                float acc = 0;
                for (ptrdiff_t k = k0; k < k0 + kc; k += 2) {
                    float a[2], b[2];
                    for (int h = 0; h < 2; h++) {
                        int in = k + h < k0 + kc;
                        int live = in && (!masked || kmask[k + h]);
                        a[h] = in ? bf16_of(A[i * ars + (k + h) * acs]) : 0;
                        b[h] = live ? bf16_of(B[(k + h) * brs + j * bcs])
                                    : 0;
                    }
                    acc = dot_pair(c->simd, acc, a, b);
                }
                float x = alpha * acc;
                float bk = k0 == 0 ? beta : 1;
                cij = bk != 0 ? fmaf(bk, cij, x) : x;
            }
            want[i * N + j] = cij;
        }
    }
    /* A and B also as stored bf16 (the backward's inputs): their bits */
    uint16_t *A16 = xmalloc((size_t)na * sizeof(uint16_t));
    uint16_t *B16 = xmalloc((size_t)nb * sizeof(uint16_t));
    for (ptrdiff_t e = 0; e < na; e++) {
        A16[e] = att_f32_to_bf16_clamped(A[e]);
    }
    for (ptrdiff_t e = 0; e < nb; e++) {
        B16[e] = att_f32_to_bf16_clamped(B[e]);
    }
    float *C0 = xmalloc((size_t)(M * N) * sizeof(float));
    memcpy(C0, C, (size_t)(M * N) * sizeof(float));
    for (int stored = 0; stored < 4; stored++) {
        memcpy(C, C0, (size_t)(M * N) * sizeof(float));
        if (beta == 0) {                /* C must not be read */
            for (ptrdiff_t i = 0; i < M * N; i++) {
                C[i] = NAN;
            }
        }
        int st = att_gemm_path(c->simd, 1, stored, M, N, K, alpha,
                               stored & 1 ? (const void *)A16 : A, ars, acs,
                               stored & 2 ? (const void *)B16 : B, brs, bcs,
                               kmask, beta, C, N, work);
        c->calls++;
        expect(c, st == ATT_OK, "stored %d: returned %d", stored, st);
        long bad = 0;
        for (ptrdiff_t i = 0; i < M * N; i++) {
            bad += memcmp(C + i, want + i, sizeof(float)) != 0;
        }
        expect(c, bad == 0, "stored %d: %ld of %td differ from the model",
               stored, bad, M * N);
    }
    free(A);
    free(B);
    free(A16);
    free(B16);
    free(C);
    free(C0);
    free(want);
    free(work);
    free(kmask);
}

static void bf16_gemm_all(ctx *c)
{
    static const ptrdiff_t Ms[] = {1, 3, 9, 17}, Ns[] = {1, 7, 8, 9, 33};
    static const ptrdiff_t Ks[] = {1, 17, 64, 300};
    for (size_t m = 0; m < sizeof(Ms) / sizeof(Ms[0]); m++) {
        for (size_t n = 0; n < sizeof(Ns) / sizeof(Ns[0]); n++) {
            for (size_t k = 0; k < sizeof(Ks) / sizeof(Ks[0]); k++) {
                int v = (int)(m + n + k);
                bf16_gemm_case(c, Ms[m], Ns[n], Ks[k], v % 3,
                               v % 2 ? 1.0f : 0.0f, v % 4 == 1);
            }
        }
    }
}

/* The streamed backward with q, k, v, out and grad_out as stored in 16
 * bits (io_store `store`, on the bf16 dot products where `dp`, else on
 * the float ones, any path) against the same on their widened values,
 * bit for bit, on 1 and 2 threads; a NaN in grad_out refused. */
static void stored16_backward(ctx *c, att_fdims f, int store, int dp,
                              const float *q, const float *k, const float *v,
                              const float *out, const float *g,
                              const float *lse, const ptrdiff_t *kidx)
{
    int bf16 = store == ATT_STORE_BF16;
    ptrdiff_t n[5] = {f.B * f.Tq * f.H, f.B * f.T * f.H, f.B * f.T * f.Hv,
                      f.B * f.Tq * f.Hv, f.B * f.Tq * f.Hv};
    const float *x[5] = {q, k, v, out, g};
    uint16_t *h[5];
    float *w[5];
    for (int a = 0; a < 5; a++) {
        h[a] = xmalloc((size_t)n[a] * sizeof(uint16_t));
        w[a] = xmalloc((size_t)n[a] * sizeof(float));
        for (ptrdiff_t i = 0; i < n[a]; i++) {
            h[a][i] = bf16 ? att_f32_to_bf16_clamped(x[a][i])
                           : att_f32_to_f16(x[a][i]);
            w[a][i] = bf16 ? att_bf16_to_f32(h[a][i])
                           : att_f16_to_f32(h[a][i]);
        }
    }
    att_family_in_f32 in[2];
    att_fdims fs[2] = {f, f};           /* (a float16 one's scratch) */
    fs[1].io_store = store;
    for (int r = 0; r < 2; r++) {       /* widened, then as stored */
        const void *const *p = r ? (const void *const *)h
                                 : (const void *const *)w;
        in[r] = (att_family_in_f32){
            .query = p[0], .keys = p[1], .values = p[2], .out = p[3],
            .grad_out = p[4], .kidx = kidx, .vidx = kidx, .lse = lse,
            .scale = (float)(1 / sqrt((double)f.H)),
            .io_store = r ? store : ATT_STORE_NATIVE};
    }
    att_exec ex = {c->simd, 1, c->pool,
                   dp ? ATT_PRECISION_BF16 : ATT_PRECISION_IEEE,
                   dp ? ATT_BF16_DOT : 0};
    for (ex.threads = 1; ex.threads <= 2; ex.threads++) {
        expect(c, att_family_takes16_f32(&fs[1], &ex, &in[1]) == 1,
               "backward's 16 bits as stored refused");
        float *grad[2][3];
        for (int r = 0; r < 2; r++) {
            for (int i = 0; i < 3; i++) {
                grad[r][i] = nans_f32(n[i]);
            }
            att_family_out_f32 fo = {.dquery = grad[r][0],
                                     .dkeys = grad[r][1],
                                     .dvalues = grad[r][2]};
            void *work = workspace_f32(c, att_family_workspace_f32(&fs[r],
                                                                   1, &ex));
            int st = att_family_backward_f32(&fs[r], &ex, &in[r], &fo,
                                             work);
            free(work);
            c->calls++;
            expect(c, st == ATT_OK, "backward (stored %d) returned %d", r,
                   st);
        }
        for (int i = 0; i < 3; i++) {
            expect(c, memcmp(grad[0][i], grad[1][i],
                             (size_t)n[i] * sizeof(float)) == 0,
                   "gradient %d differs as stored, %d threads", i,
                   ex.threads);
            free(grad[0][i]);
            free(grad[1][i]);
        }
    }
    h[4][n[4] - 1] = bf16 ? 0xffc1 : 0xfe01;    /* a NaN: widened */
    ex.threads = 1;
    expect(c, att_family_takes16_f32(&fs[1], &ex, &in[1]) == 0,
           "a NaN of grad_out taken as stored");
    for (int a = 0; a < 5; a++) {
        free(h[a]);
        free(w[a]);
    }
}

/* A streamed backward's problem: f made the dot score streamed, q, k, v
 * and grad_out drawn, out and lse from the forward of float products on
 * path simd; freed by problem_free. */
typedef struct {
    float *q, *k, *v, *g, *out, *lse;
    ptrdiff_t *kidx;
} bproblem;

static bproblem backward_problem(ctx *c, att_fdims *f, int simd)
{
    ptrdiff_t B = f->B, Tq = f->Tq, T = f->T, H = f->H, Hv = f->Hv;
    f->score = ATT_SCORE_DOT;
    f->stream = 1;
    f->Hq = H;
    bproblem p = {rand_f32(c, B * Tq * H, 1), rand_f32(c, B * T * H, 1),
                  rand_f32(c, B * T * Hv, 1), rand_f32(c, B * Tq * Hv, 1),
                  nans_f32(B * Tq * Hv), nans_f32(B * Tq),
                  xmalloc((size_t)B * sizeof(ptrdiff_t))};
    for (ptrdiff_t b = 0; b < B; b++) {
        p.kidx[b] = b;
    }
    int st = bf16_forward(c, simd, 0, 1, *f, p.q, p.k, p.v, p.kidx, p.out,
                          p.lse);
    expect(c, st == ATT_OK, "forward returned %d", st);
    return p;
}

static void problem_free(bproblem *p)
{
    free(p->q);
    free(p->k);
    free(p->v);
    free(p->g);
    free(p->out);
    free(p->lse);
    free(p->kidx);
}

/* The streamed backward on bf16 products against float32 products'
 * (each given the forward's out and lse of float32 products), and 1
 * against 2 threads; then as stored (stored16_backward). */
static void bf16_backward_case(ctx *c, att_fdims f)
{
    ptrdiff_t B = f.B, Tq = f.Tq, T = f.T, H = f.H, Hv = f.Hv;
    snprintf(c->what, sizeof c->what, "bf16 backward B=%td Tq=%td T=%td "
             "H=%td Hv=%td causal=%d", B, Tq, T, H, Hv, f.causal);
    bproblem p = backward_problem(c, &f, ATT_SIMD_SCALAR);
    att_family_in_f32 in = {.query = p.q, .keys = p.k, .values = p.v,
                            .kidx = p.kidx, .vidx = p.kidx, .out = p.out,
                            .lse = p.lse, .grad_out = p.g,
                            .scale = (float)(1 / sqrt((double)H))};
    ptrdiff_t n[3] = {B * Tq * H, B * T * H, B * T * Hv};
    float *grad[3][3];                  /* [run][dq, dk, dv] */
    for (int r = 0; r < 3; r++) {       /* float32; bf16 on 1, 2 threads */
        att_exec ex = {r ? c->simd : ATT_SIMD_SCALAR, r == 2 ? 2 : 1,
                       c->pool, r ? ATT_PRECISION_BF16 : ATT_PRECISION_IEEE,
                       r ? ATT_BF16_DOT : 0};
        for (int i = 0; i < 3; i++) {
            grad[r][i] = nans_f32(n[i]);
        }
        att_family_out_f32 fo = {.dquery = grad[r][0], .dkeys = grad[r][1],
                                 .dvalues = grad[r][2]};
        void *work = workspace_f32(c, att_family_workspace_f32(&f, 1, &ex));
        int st = att_family_backward_f32(&f, &ex, &in, &fo, work);
        c->calls++;
        expect(c, st == ATT_OK, "backward run %d returned %d", r, st);
        free(work);
    }
    static const char *const names[] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; i++) {
        double e = rel_err_f32(n[i], grad[1][i], grad[0][i]);
        if (c->verbose) {
            printf("  %s: %s normwise error %.3g\n", c->what, names[i], e);
        }
        expect(c, e <= BF16_TOL && e > BF16_SEEN, "%s: normwise error "
               "%.3g against float32, not in (%g, %g]", names[i], e,
               BF16_SEEN, BF16_TOL);
        expect(c, memcmp(grad[1][i], grad[2][i],
                         (size_t)n[i] * sizeof(float)) == 0,
               "%s: 1 and 2 threads differ", names[i]);
        for (int r = 0; r < 3; r++) {
            free(grad[r][i]);
        }
    }
    stored16_backward(c, f, ATT_STORE_BF16, 1, p.q, p.k, p.v, p.out, p.g,
                      p.lse, p.kidx);
    problem_free(&p);
}

static void check_bf16(ctx *c)
{
    if (!att_bf16_supported(c->simd, ATT_BF16_DOT)) {
        return;
    }
    check_add_odd(c);
    static const ptrdiff_t heads[] = {1, 2, 3, 17, 32, 33, 64, 65};
    for (size_t i = 0; i < sizeof(heads) / sizeof(heads[0]); i++) {
        bf16_one_key(c, heads[i]);
    }
#define FF(B_, Tq_, T_, H_, Hv_) \
    {.B = B_, .Tq = Tq_, .T = T_, .H = H_, .Hv = Hv_}
    static const att_fdims sizes[] = {
        FF(2, 9, 1, 3, 2), FF(3, 17, 47, 8, 5), FF(2, 65, 49, 17, 9),
        FF(1, 130, 97, 8, 8), FF(2, 257, 300, 16, 16), FF(1, 40, 200, 64, 64),
    };
#undef FF
    double lo = INFINITY, hi = 0;
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        for (int v = 0; v < 3; v++) {
            double e = bf16_case(c, with_visibility(sizes[s], v));
            lo = e < lo ? e : lo;
            hi = e > hi ? e : hi;
        }
    }
    if (c->verbose) {
        printf("  bf16 out against float32 products: normwise error "
               "%.3g to %.3g\n", lo, hi);
    }
    if (att_gemm_path(c->simd, 1, 0, 0, 0, 0, 1, NULL, 0, 0, NULL, 0, 0,
                      NULL, 0, NULL, 0, NULL) != ATT_OK) {
        return;                         /* no gemm_bf16 on this path */
    }
    bf16_gemm_all(c);
    for (size_t i = 0; i < N_BACK_SIZES; i++) {
        bf16_backward_case(c, back_sizes[i]);
    }
}

/* 16 bits (`store`) as stored on the float products, on sizes across
 * the kernel's panels and blocks (stored16_case), grouped heads. */
static void float_stored_case(ctx *c, att_fdims f, int store)
{
    ptrdiff_t Bk = (f.B + 1) / 2;
    snprintf(c->what, sizeof c->what, "%s as stored B=%td Tq=%td T=%td "
             "H=%td Hv=%td causal=%d window=%d",
             store == ATT_STORE_BF16 ? "bfloat16" : "float16", f.B, f.Tq,
             f.T, f.H, f.Hv, f.causal, f.window);
    c->shapes++;
    f.score = ATT_SCORE_DOT;
    f.stream = 1;
    f.Hq = f.H;
    f.Bk = f.Bv = Bk;
    float *q = rand_f32(c, f.B * f.Tq * f.H, 1);
    float *k = rand_f32(c, Bk * f.T * f.H, 1);
    float *v = rand_f32(c, Bk * f.T * f.Hv, 1);
    ptrdiff_t *kidx = xmalloc((size_t)f.B * sizeof(ptrdiff_t));
    for (ptrdiff_t b = 0; b < f.B; b++) {
        kidx[b] = b / 2;
    }
    stored16_case(c, f, store, 0, q, k, v, kidx);
    free(q);
    free(k);
    free(v);
    free(kidx);
}

/* The backward of 16 bits (`store`) as stored on the float products
 * against the widened one (stored16_backward), given the forward's out
 * and lse. */
static void float_backward_case(ctx *c, att_fdims f, int store)
{
    snprintf(c->what, sizeof c->what, "%s backward as stored B=%td "
             "Tq=%td T=%td H=%td Hv=%td causal=%d",
             store == ATT_STORE_BF16 ? "bfloat16" : "float16", f.B, f.Tq,
             f.T, f.H, f.Hv, f.causal);
    c->shapes++;
    bproblem p = backward_problem(c, &f, c->simd);
    stored16_backward(c, f, store, 0, p.q, p.k, p.v, p.out, p.g, p.lse,
                      p.kidx);
    problem_free(&p);
}

/* bfloat16 and float16 as stored on the float products, every path */
static void check_stored16_float(ctx *c)
{
    for (int store = ATT_STORE_BF16; store <= ATT_STORE_F16; store++) {
        for (size_t s = 0; s < N_FLASH_SIZES; s++) {
            for (int v = 0; v < 3; v++) {
                float_stored_case(c, with_visibility(flash_sizes[s], v),
                                  store);
            }
        }
        for (size_t i = 0; i < N_BACK_SIZES; i++) {
            float_backward_case(c, back_sizes[i], store);
        }
    }
}
