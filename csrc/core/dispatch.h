/*
 * core/dispatch.h - internal: which instruction sets are compiled in, and
 * the one SIMD dispatch, a table of kernels per type and instruction set
 * (att_ops_for_f32 / att_ops_for_f64 pick it).  The tables are defined by
 * the layers that implement them (ref/ops.c, simd/avx2.c, simd/avx512.c,
 * simd/neon.c); the pooled layer and the family only call through them.
 * CPU detection (att_simd_best, att_simd_supported) is in attention.h.
 */
#ifndef ATTENTION_C_CORE_DISPATCH_H
#define ATTENTION_C_CORE_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#include "attention.h"
#include "core/pool.h"

struct att_drop;                        /* core/philox.h */

/* x86-64's two SIMD paths (avx2, avx512), AArch64's one (neon). */
#if defined(__x86_64__) || defined(_M_X64)
#define ATT_HAVE_X86 1
#else
#define ATT_HAVE_X86 0
#endif
/* AMX's bf16 tiles (simd/flash_amx.inc): a compiler with their
 * intrinsics, and Linux, whose arch_prctl grants a process the tiles. */
#if ATT_HAVE_X86 && defined(__linux__) &&                                   \
    ((defined(__clang__) && __clang_major__ >= 12) ||                        \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define ATT_HAVE_AMX 1
#else
#define ATT_HAVE_AMX 0
#endif
/* AVX512_BF16's dot products (simd/flash.inc's FLASH_DP): a compiler
 * with their intrinsics. */
#if ATT_HAVE_X86 &&                                                         \
    ((defined(__clang__) && __clang_major__ >= 9) ||                         \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define ATT_HAVE_BF16DOT 1
#else
#define ATT_HAVE_BF16DOT 0
#endif
#if defined(__aarch64__)
#define ATT_HAVE_NEON 1
#else
#define ATT_HAVE_NEON 0
#endif
/* The BF16 extension's dot products (BFDOT, simd/neon.c's FLASH_DP): GCC
 * compiles them under a target pragma; clang 14's arm_neon.h declares
 * them only for a build that targets the extension already
 * (ATT_NEON_BF16_BUILD: -march=...+bf16, armv8.6-a and later). */
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC) ||                        \
    defined(__ARM_FEATURE_BF16)
#define ATT_NEON_BF16_BUILD 1
#else
#define ATT_NEON_BF16_BUILD 0
#endif
#if ATT_HAVE_NEON &&                                                        \
    ((!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10) ||         \
     ATT_NEON_BF16_BUILD)
#define ATT_HAVE_NEON_BF16 1
#else
#define ATT_HAVE_NEON_BF16 0
#endif

/* The SIMD gemm sums along K in blocks of ATT_GEMM_KC from k = 0 (the
 * scalar one in one run), so a product over keys [lo, T) with lo a
 * multiple of it, the weights before lo being 0, gives the bits of the
 * product over all T keys (family/stream.inc's stored_range). */
#define ATT_GEMM_KC 256

/* gemm_bf16's `stored`: which operands are bf16 as stored; and for
 * gemm_amx, A (float, its rows or its columns contiguous) split into two
 * bf16 terms, bf16(a) and bf16(a - bf16(a)), each multiplied: its error
 * 2^-16 of it instead of 2^-9 (others: rounded once) */
enum att_dp_stored {
    ATT_DP_A16 = 1,
    ATT_DP_B16 = 2,
    ATT_DP_A_SPLIT = 4
};

/*
 * THE one SIMD dispatch: a table of kernels per type and instruction set
 * (the scalar one in ref/ops.c, the SIMD ones in simd/), picked by
 * att_ops_for_f32 / att_ops_for_f64 below.  The attention family
 * (family/) runs the loops, threads and scratch around the primitives;
 * the pooled layer (pooled/) calls the fused kernels.
 *   gemm      C (M x N) = alpha A B + beta C (beta 0 or 1; C is not read
 *             when beta is 0).  A(i, k) = A[i ars + k acs], B(k, j) =
 *             B[k brs + j bcs]; rows k with kmask[k] == 0 count as zero
 *             (padding: a NaN there stays out).  Each C element is summed
 *             over k in one fixed order, whatever M.  work: gemm_work
 *             elements.
 *   gemm_bf16 the same on bf16 dot products: A and B rounded to bf16 as
 *             the bf16 forward rounds them (NaN stays NaN), each pair of
 *             k in order added by vdpbf16ps (simd/gemm_dp.inc), alpha
 *             and beta in float32; an operand that `stored` flags
 *             (ATT_DP_A16, ATT_DP_B16) is bf16 as stored (uint16_t
 *             elements, the same strides), finite, taken as it is.  NULL
 *             but in the float tables of the paths with bf16 dot
 *             products (AVX512_BF16, Arm's BF16).
 *   pack_b, gemm_packed  gemm in two steps, for a B several products
 *             share: pack_b packs B (K x N, 1 <= K, N <= ATT_GEMM_KC)
 *             into Bp, K times N rounded up to gemm_nr elements; then
 *             gemm_packed runs gemm (kmask NULL) on the first N' <= N
 *             columns of that B, with the same bits.  NULL in the scalar
 *             table.  pack_b_bf16, gemm_packed_bf16: the same for
 *             gemm_bf16 (NULL where it is), B (A) stored as `stored`
 *             says.
 *   gemm_amx, gemm_packed_amx  gemm_bf16 and gemm_packed_bf16 on AMX
 *             tiles (simd/gemm_amx.inc), on B packed by pack_b_bf16: the
 *             same operands, summed by TDPBF16PS in an order of its own,
 *             each element's fixed whatever M.  NULL but in AVX-512's
 *             float table of a build whose compiler has AMX.
 *   gemv      the same with one row of A (M = 1): c = alpha a B + beta c,
 *             in an order of its own; used when every product of a call
 *             has one row, so that results still depend on sizes only.
 *   add_scores           s_t = v . tanh(qp + kp_t) for the valid t (0 for
 *                        the others); rows of apad elements, zero past A.
 *   add_scores_backward  for the valid t, with u = tanh(qp + kp_t) and
 *                        e = delta_t v (1 - u^2): dv += delta_t u,
 *                        eq = sum_t e, ek_t += e (ek_t = e, and 0 for
 *                        masked t, when `first`).
 *   softmax, softmax_backward  one row, as family_softmax and
 *                        seq_softmax_backward of ref/scalar.inc (weights
 *                        below the least normal number are 0).
 *   exp_shift            the streamed softmax's step: s_t = exp(s_t - M)
 *                        for the visible t (vis NULL: all), 0 for the
 *                        others and below the least normal number;
 *                        returns their sum (in double).
 *   max_row              the max of a row (-inf when empty).
 *   bad_rows             bad[r] = 1 where row r of x (n rows of w, ld
 *                        apart) holds a NaN or an infinity, else 0.
 *   ds_row               dp_t = p_t (dp_t - D), a row's dL/ds.
 *   exp_ds               exp_shift of every t (no sum), then ds_row: the
 *                        streamed backward's row in one pass.
 *   dot_keys             s_t = alpha q . K_t for t < n, K_t = K + t ldk
 *                        (d wide): decoding's scores, one query against
 *                        rows read where they are.  Each s_t is summed in
 *                        an order of its own, whatever n.
 *   sum_values           out = sum_t w_t V_t over the t < n with use[t]
 *                        (use NULL: all), V_t = V + t ldv (d wide), in t
 *                        order: decoding's weighted sum.  A row not used
 *                        is never read (a NaN there reaches nothing).
 *   keep_row             dropout's keep bytes (0 or 1) of query i of
 *                        sequence b for keys [t0, t0 + n): core/philox.h's
 *                        att_keep_row, whose bits every path gives.
 *   apply_keep           y_t = keep_t ? x_t scale : 0 (y may be x): the
 *                        keep bytes applied to a row.
 *   dot_keys_multi, sum_values_multi  the same for g queries that read
 *                        the same keys (values): s[r][t] = alpha q[r] . K_t,
 *                        out[r] = sum_t w[r][t] V_t over the t use[r]
 *                        marks (use[r] NULL: all); each key and value row
 *                        read from memory once for all g, each result
 *                        the bits dot_keys (sum_values) gives the query
 *                        alone (so a query's result does not depend on
 *                        its group).  With `add`, sum_values_multi adds
 *                        to out (the sums continue, in t order, from the
 *                        values there) instead of starting from 0: rows
 *                        met in pieces (a paged cache) sum as one run.
 *                        pf: the bytes from each row read to a row to
 *                        hint (the one read as many rows later, wherever
 *                        it is; 0: none), into the first-level cache or,
 *                        with pf2, the second (far ahead in memory: the
 *                        first's few fill buffers would stall the loads).
 *   widen16, round16     n 16-bit elements ([0] bfloat16, [1] binary16)
 *                        widened to R, or n R rounded to them
 *                        (attention.h's att_convert16).  float only.
 *   finite16             1 when the n 16-bit elements at x ([0]
 *                        bfloat16, [1] binary16) are all finite (no
 *                        infinity, no NaN), else 0.  float only.
 *   widen_q8             n int8 (n a multiple of g) times their group's
 *                        scale, dst[c] = scale[c / g] src[c], one float
 *                        product each: an int8 cache's rows.  float only.
 *   dot_keys_multi16, sum_values_multi16  the same on 16-bit keys
 *                        (values), [0] bfloat16, [1] binary16, each
 *                        element widened exactly as it is loaded: the
 *                        bits of the two above on the widened rows.
 *                        float only (NULL in the double tables).
 *   dot_keys_multi_q8, sum_values_multi_q8  the same on an int8 cache's
 *                        rows, row t's scales at sc + t lds (one per
 *                        group of grp columns, grp a multiple of vlen),
 *                        each element dequantized as it is loaded, as
 *                        widen_q8 makes it: the bits of the two above on
 *                        widen_q8's rows.  NULL where not built (the
 *                        scalar and double tables): widen_q8 first.
 *   flash     the streamed forward of nq queries (dot or general score)
 *             whose visibility is a range of keys:
 *             query i (Q + i ldq, d wide) sees keys [lo[i], hi[i]) of K
 *             (rows ldk apart) and values V (ldv apart, dv wide), and a
 *             sink of score `sink` (-inf: none); out row i (O + i ldo) =
 *             its softmax of scale q_i . k_t (the sink's share left out)
 *             times the values, lse[i] its log-sum-exp (-inf and a row
 *             of 0 when it sees nothing).  The softmax runs inside the
 *             product (simd/flash.inc); each query's result depends on
 *             the sizes, its range and the least lo of the block and of
 *             its panel of queries only.  Returns 0, or 1 (out and lse
 *             then undefined) where an input it reads holds a NaN or an
 *             infinity: it checks those stored in REAL as it reads them
 *             (the rows of Q, and of K and V between the least lo and
 *             the greatest hi); 16-bit ones must be finite.
 *             NULL in the scalar table.  work: flash_work(nq, d, dv)
 *             elements (-1: a size overflows), aligned for REAL.
 *             flash_nr, the queries of its panels (a multiple of vlen, at
 *             most 256), is the block of queries it runs best on.  Q, K,
 *             V and O are REAL (store ATT_STORE_NATIVE), strides in
 *             elements; flash_bf16 (both units) takes store
 *             ATT_STORE_BF16, the float table's flash ATT_STORE_BF16 and
 *             ATT_STORE_F16: Q, K and V 16-bit as stored, O written so
 *             (rounded to nearest even as att_convert16 rounds): the
 *             bits of the float call on the widened Q, K and V, rounded
 *             after (the bf16 products round their operands to bf16
 *             anyway; widening is exact).  drop (core/philox.h): NULL,
 *             or dropout on the weights the values are summed with (not
 *             on the row sums: out is the dropped weights, normalised,
 *             times V; lse the same), query i's keep bits those of drop
 *             -> i0 + i; the float table's flash only (flash_bf16 and
 *             the double table's take NULL).
 *   flash_bf16  the same with the products on bf16 (Q, K, V and P
 *             rounded to bf16, float sums), for float calls that allow
 *             it (ATT_PRECISION_BF16), one per unit (index: enum
 *             att_bf16_unit - 1) where att_bf16_supported(simd, unit):
 *             dot products (simd/flash.inc's FLASH_DP) and AMX tiles
 *             (simd/flash_amx.inc); flash_bf16_nr and flash_bf16_work as
 *             flash's.  NULL but in the float tables of AVX-512 (dot
 *             products: AVX512_BF16; tiles: AMX) and NEON (dot products:
 *             the BF16 extension's BFDOT, whose sums round to odd) of a
 *             build whose compiler has the instructions.
 * apad, the padded width of the additive rows, is a multiple of vlen.
 * The fused context-attention layer (attention.h's context_attention) of
 * a SIMD path; NULL in the scalar table, whose layer is pooled/'s own:
 *   workspace            bytes of `work` for (d, backward, threads), no
 *                        alignment needed; 0 when a size overflows
 *   context_attention, context_attention_backward  the kernels of
 *                        attention.h, on `threads` threads of pool (the
 *                        same `threads` as the workspace)
 * And every table's
 *   tanh                 y = tanh(x) elementwise, the path's tanh (tests)
 *   fma_loop, fma_accs   the path's FMA peak (the bench times it):
 *                        fma_accs independent chains, each a register of
 *                        vlen lanes, one FMA a step (the scalar path: a
 *                        multiply and an add, as its kernels write it),
 *                        iters steps, registers only: 2 vlen fma_accs
 *                        iters flops.  Enough chains to cover the FMA
 *                        latency times the FMA ports of every CPU the
 *                        path runs on.  Returns the sum of the chains'
 *                        lanes, each in [1, 3) once settled (so none is
 *                        dropped, and core/peak.c checks it).
 *   dot_loop             the same with bf16 dot products (a += x x + x x,
 *                        4 vlen fma_accs iters flops), for
 *                        att_bf16_products' measurement; NULL where
 *                        flash_bf16[ATT_BF16_DOT - 1] is.
 */
/* The arguments of flash and flash_bf16 (above) */
#define ATT_FLASH_ARGS(R)                                                    \
    (ptrdiff_t nq, ptrdiff_t d, ptrdiff_t dv, R scale, R sink, int store,    \
     const void *Q, ptrdiff_t ldq, const void *K, ptrdiff_t ldk,            \
     const void *V, ptrdiff_t ldv, const ptrdiff_t *lo, const ptrdiff_t *hi, \
     void *O, ptrdiff_t ldo, R *lse, R *work, const struct att_drop *drop)

/* The arguments of gemm_bf16 and gemm_amx, gemm_packed_bf16 and
 * gemm_packed_amx (above) */
#define ATT_GEMM16_ARGS(R)                                                   \
    (ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, R alpha, const void *A,          \
     ptrdiff_t ars, ptrdiff_t acs, const void *B, ptrdiff_t brs,             \
     ptrdiff_t bcs, const unsigned char *kmask, R beta, R *C, ptrdiff_t ldc, \
     R *work, int stored)
#define ATT_GEMM16_PACKED_ARGS(R)                                            \
    (ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, R alpha, const void *A,          \
     ptrdiff_t ars, ptrdiff_t acs, const R *Bp, R beta, R *C, ptrdiff_t ldc, \
     R *work, int stored)

#define ATT_OPS_DECLARE(R, SFX)                                              \
    typedef struct {                                                         \
        ptrdiff_t vlen;                                                      \
        ptrdiff_t gemm_work;                                                 \
        void (*gemm)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, R alpha,         \
                     const R *A, ptrdiff_t ars, ptrdiff_t acs, const R *B,   \
                     ptrdiff_t brs, ptrdiff_t bcs,                           \
                     const unsigned char *kmask, R beta, R *C,               \
                     ptrdiff_t ldc, R *work);                                \
        ptrdiff_t gemm_nr;                                                   \
        void (*pack_b)(ptrdiff_t K, ptrdiff_t N, const R *B, ptrdiff_t brs,  \
                       ptrdiff_t bcs, R *Bp);                                \
        void (*gemm_packed)(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, R alpha,  \
                            const R *A, ptrdiff_t ars, ptrdiff_t acs,        \
                            const R *Bp, R beta, R *C, ptrdiff_t ldc,        \
                            R *work);                                        \
        void (*pack_b_bf16)(ptrdiff_t K, ptrdiff_t N, const void *B,         \
                            ptrdiff_t brs, ptrdiff_t bcs, R *Bp,             \
                            int stored);                                     \
        void (*gemm_packed_bf16) ATT_GEMM16_PACKED_ARGS(R);                  \
        void (*gemm_bf16) ATT_GEMM16_ARGS(R);                                \
        void (*gemm_packed_amx) ATT_GEMM16_PACKED_ARGS(R);                   \
        void (*gemm_amx) ATT_GEMM16_ARGS(R);                                 \
        void (*gemv)(ptrdiff_t N, ptrdiff_t K, R alpha, const R *a,          \
                     const R *B, ptrdiff_t brs, ptrdiff_t bcs,               \
                     const unsigned char *kmask, R beta, R *c, R *work);     \
        void (*add_scores)(ptrdiff_t T, ptrdiff_t apad, const R *qp,        \
                           const R *kp, ptrdiff_t ldk, const R *v,           \
                           const unsigned char *m, R *s);                    \
        void (*add_scores_backward)(ptrdiff_t T, ptrdiff_t apad,             \
                                    const R *qp, const R *kp,                \
                                    ptrdiff_t ldk, const R *v,               \
                                    const R *delta, const unsigned char *m,  \
                                    int first, R *eq, R *ek, ptrdiff_t lde,  \
                                    R *dv);                                  \
        void (*softmax)(ptrdiff_t T, const R *s, const unsigned char *m,     \
                        R *alpha);                                           \
        void (*softmax_backward)(ptrdiff_t T, const R *g, const R *alpha,    \
                                 R *ds);                                     \
        double (*exp_shift)(ptrdiff_t n, R *s, R M,                          \
                            const unsigned char *vis);                       \
        R (*max_row)(ptrdiff_t n, const R *s);                               \
        void (*bad_rows)(ptrdiff_t n, ptrdiff_t w, const R *x, ptrdiff_t ld, \
                         unsigned char *bad);                                \
        void (*ds_row)(ptrdiff_t n, const R *p, R *dp, R D);                 \
        void (*exp_ds)(ptrdiff_t n, R *s, R M, R *dp, R D);                  \
        void (*dot_keys)(ptrdiff_t n, ptrdiff_t d, R alpha, const R *q,      \
                         const R *K, ptrdiff_t ldk, R *s);                   \
        void (*sum_values)(ptrdiff_t n, ptrdiff_t d, const R *w,            \
                           const R *V, ptrdiff_t ldv,                        \
                           const unsigned char *use, R *out);                \
        void (*keep_row)(uint64_t seed, uint32_t threshold, ptrdiff_t b,     \
                         ptrdiff_t i, ptrdiff_t t0, ptrdiff_t n,             \
                         unsigned char *keep);                               \
        void (*apply_keep)(ptrdiff_t n, const unsigned char *keep, R scale,  \
                           const R *x, R *y);                                \
        void (*dot_keys_multi)(ptrdiff_t g, ptrdiff_t n, ptrdiff_t d,        \
                               R alpha, const R *const *q, const R *K,       \
                               ptrdiff_t ldk, R *const *s,                   \
                               ptrdiff_t pf, int pf2);                       \
        void (*sum_values_multi)(ptrdiff_t g, ptrdiff_t n, ptrdiff_t d,      \
                                 const R *const *w, const R *V,              \
                                 ptrdiff_t ldv,                              \
                                 const unsigned char *const *use,            \
                                 R *const *out, int add,                     \
                                 ptrdiff_t pf, int pf2);                     \
        void (*widen16[2])(ptrdiff_t n, const uint16_t *src, R *dst);        \
        int (*finite16[2])(ptrdiff_t n, const uint16_t *x);                  \
        void (*widen_q8)(ptrdiff_t n, ptrdiff_t g, const int8_t *src,        \
                         const float *scale, R *dst);                        \
        void (*round16[2])(ptrdiff_t n, const R *src, uint16_t *dst);        \
        void (*dot_keys_multi16[2])(ptrdiff_t g, ptrdiff_t n, ptrdiff_t d,   \
                                    R alpha, const R *const *q,              \
                                    const void *K, ptrdiff_t ldk,            \
                                    R *const *s, ptrdiff_t pf, int pf2);     \
        void (*sum_values_multi16[2])(ptrdiff_t g, ptrdiff_t n, ptrdiff_t d, \
                                      const R *const *w, const void *V,      \
                                      ptrdiff_t ldv,                         \
                                      const unsigned char *const *use,       \
                                      R *const *out, int add,                \
                                      ptrdiff_t pf, int pf2);                \
        void (*dot_keys_multi_q8)(ptrdiff_t g, ptrdiff_t n, ptrdiff_t d,     \
                                  R alpha, const R *const *q,                \
                                  const void *K, ptrdiff_t ldk,              \
                                  const float *sc, ptrdiff_t lds,            \
                                  ptrdiff_t grp, R *const *s,                \
                                  ptrdiff_t pf, int pf2);                    \
        void (*sum_values_multi_q8)(ptrdiff_t g, ptrdiff_t n, ptrdiff_t d,   \
                                    const R *const *w, const void *V,        \
                                    ptrdiff_t ldv, const float *sc,          \
                                    ptrdiff_t lds, ptrdiff_t grp,            \
                                    const unsigned char *const *use,         \
                                    R *const *out, int add,                  \
                                    ptrdiff_t pf, int pf2);                  \
        ptrdiff_t flash_nr;                                                  \
        ptrdiff_t (*flash_work)(ptrdiff_t nq, ptrdiff_t d, ptrdiff_t dv);    \
        int (*flash) ATT_FLASH_ARGS(R);                                      \
        ptrdiff_t flash_bf16_nr[2];                                          \
        ptrdiff_t (*flash_bf16_work[2])(ptrdiff_t nq, ptrdiff_t d,          \
                                        ptrdiff_t dv);                       \
        int (*flash_bf16[2]) ATT_FLASH_ARGS(R);                              \
        size_t (*workspace)(att_dims d, int backward, int threads);          \
        int (*context_attention)(att_dims d, att_pool *pool, int threads,    \
                                 const R *h, const R *W, const R *v,         \
                                 const R *b, const unsigned char *mask,      \
                                 R *out, R *alpha, R *act, void *work);      \
        int (*context_attention_backward)(                                   \
            att_dims d, att_pool *pool, int threads, const R *grad_out,      \
            const R *h, const R *W, const R *v, const R *alpha, const R *b,  \
            const unsigned char *mask, const R *grad_alpha, const R *act,    \
            R *dh, R *dW, R *dv, R *db, void *work);                         \
        void (*tanh)(ptrdiff_t n, const R *x, R *y);                         \
        double (*fma_loop)(ptrdiff_t iters);                                 \
        double (*dot_loop)(ptrdiff_t iters);                                 \
        int fma_accs;                                                        \
    } att_ops_##SFX;

ATT_OPS_DECLARE(float, f32)
ATT_OPS_DECLARE(double, f64)

#undef ATT_OPS_DECLARE

/* X(0) ... X(n - 1): the chains of an fma_loop, as named registers (an
 * array of 24 vectors is not always kept in registers). */
#define ATT_FMA_LIST_12(X)                                                   \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define ATT_FMA_LIST_24(X)                                                   \
    ATT_FMA_LIST_12(X) X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19)      \
    X(20) X(21) X(22) X(23)

/* The table of the path simd for each type: the scalar one for
 * ATT_SIMD_SCALAR; simd must be supported (att_simd_supported). */
const att_ops_f32 *att_ops_for_f32(int simd);
const att_ops_f64 *att_ops_for_f64(int simd);

/* The tables themselves (use the two functions above). */
extern const att_ops_f32 att_ops_table_f32_scalar;
extern const att_ops_f64 att_ops_table_f64_scalar;
#if ATT_HAVE_X86
extern const att_ops_f32 att_ops_table_f32_avx2;
extern const att_ops_f64 att_ops_table_f64_avx2;
extern const att_ops_f32 att_ops_table_f32_avx512;
extern const att_ops_f64 att_ops_table_f64_avx512;
#endif
#if ATT_HAVE_NEON
extern const att_ops_f32 att_ops_table_f32_neon;
extern const att_ops_f64 att_ops_table_f64_neon;
#endif

#endif /* ATTENTION_C_CORE_DISPATCH_H */
