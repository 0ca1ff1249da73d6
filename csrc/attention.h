/*
 * attention.h - plain C11 kernels of context-pooled additive attention.
 *
 * The layer, for one sequence (docs/contract.md section 1):
 *
 *   c       = (1/n) sum_t m_t h_t            mean context      (H)
 *   z_t     = W_h h_t + W_c c + b            pre-activation    (T, A)
 *   s_t     = v . tanh(z_t)                  additive score    (T)
 *   alpha_t = masked softmax_t(s)                              (T)
 *   out     = sum_t alpha_t h_t              weighted sum      (H)
 *
 * Conventions shared by every function here:
 *   - Arrays are C-contiguous and aligned for their type; the caller (the
 *     Python binding) makes them so.  A batch of B sequences is stacked on
 *     the leading axis: h is (B, T, H), mask is (B, T), c is (B, H).
 *   - W is (A, 2H) row-major, the layout of torch.nn.Linear(2H, A).weight:
 *     columns [0, H) are W_h, columns [H, 2H) are W_c.
 *   - mask is one byte per item, nonzero = valid; NULL means all valid.
 *     Masked items are skipped, never multiplied by zero, so a NaN in the
 *     padding cannot reach any output.  A row with no valid item gives
 *     c = 0, alpha = 0, out = 0 and zero gradients.
 *   - The bias b (and its gradient db) may be NULL.  So may act (B, T, A),
 *     the activations tanh(z) the fused forward can keep for its backward
 *     (zero for masked items): memory for speed.
 *   - Kernels never allocate.  Those that need scratch take `work`, a
 *     buffer of at least *_workspace(d, simd) bytes, aligned for the type;
 *     a workspace function returns -1 when the byte count overflows.
 *   - The fused kernels take an att_exec: the instruction set (every path
 *     gives the same results within rounding) and the threads.  Their
 *     results are bitwise the same for any thread count: work is split in
 *     a way that depends on the sizes only, and summed in a fixed order.
 *     Small problems run on the calling thread.
 *   - Kernels write every element of their outputs (parameter gradients
 *     are zeroed, then summed over the batch), never print, never abort,
 *     keep no state, and return ATT_OK or ATT_EINVAL (bad sizes).
 *   - Inputs and outputs must not overlap.
 */
#ifndef ATTENTION_C_ATTENTION_H
#define ATTENTION_C_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum att_status {
    ATT_OK = 0,
    ATT_EINVAL = -1   /* a size is negative or T < 1 */
};

/* Instruction sets of the fused kernels, chosen at run time. */
enum att_simd {
    ATT_SIMD_SCALAR = 0,   /* portable C, the reference path */
    ATT_SIMD_AVX2 = 1,     /* AVX2 + FMA */
    ATT_SIMD_AVX512 = 2,   /* AVX-512 F, DQ, BW, VL */
    ATT_SIMD_NEON = 3      /* AArch64 Advanced SIMD (always there) */
};

/* The widest instruction set this CPU (and OS) runs. */
int att_simd_best(void);

/* 1 when this build and CPU run the instruction set `simd`, else 0. */
int att_simd_supported(int simd);

/* The products a float32 call may run on (PyTorch's fp32_precision):
 * float32 FMAs, or bf16 units that round the operands to bf16 and sum
 * in float32, where the CPU has fast ones (att_bf16_products). */
enum att_precision {
    ATT_PRECISION_IEEE = 0,
    ATT_PRECISION_BF16 = 1
};

/* The units bf16 products run on: vector dot products (AVX512_BF16's
 * vdpbf16ps) or matrix tiles (AMX). */
enum att_bf16_unit {
    ATT_BF16_DOT = 1,
    ATT_BF16_AMX = 2
};

/* 1 when this build, CPU and OS run bf16 products of float32 calls that
 * allow them (today: the streamed forward) on `unit` on path simd (the
 * OS must grant this process AMX's tiles, which this call asks for),
 * else 0. */
int att_bf16_supported(int simd, int unit);

/* The unit bf16 products should run on, where they beat float32 FMAs:
 * AMX's tiles, else the dot products where this CPU runs them at more
 * than ATT_BF16_DOT_GAIN times its FMAs' rate (AMD Zen 4: 2; a Xeon
 * Sapphire Rapids: 0.5), measured by this call (about 0.2 ms: the caller
 * keeps the answer); 0 when there is none. */
#define ATT_BF16_DOT_GAIN 1.2
int att_bf16_products(int simd);

/* How the fused kernels run: instruction set, threads, precision. */
struct att_pool;
typedef struct {
    int simd;                 /* enum att_simd, att_simd_supported */
    int threads;              /* use at most this many threads (>= 1) */
    struct att_pool *pool;    /* threads (core/pool.h); NULL: the caller's */
    int precision;            /* enum att_precision (float32 calls) */
    int bf16;                 /* enum att_bf16_unit of the bf16 products
                                 (att_bf16_supported), 0: none */
} att_exec;

/* B sequences of T items with H features; A hidden units in the score. */
typedef struct {
    ptrdiff_t B, T, H, A;
} att_dims;

/*
 * The kernels, once per dtype: suffix _f32 takes float, _f64 double.
 * Shapes are given as (B, T, H) etc. in the comments of pooled/kernels.inc.
 */
#define ATT_DECLARE(R, SFX)                                                  \
    ptrdiff_t att_additive_score_workspace_##SFX(att_dims d);                \
    ptrdiff_t att_additive_score_backward_workspace_##SFX(att_dims d);       \
    ptrdiff_t att_context_attention_workspace_##SFX(att_dims d,              \
                                                    const att_exec *ex);     \
    ptrdiff_t att_context_attention_backward_workspace_##SFX(                \
        att_dims d, const att_exec *ex);                                     \
    int att_mean_context_##SFX(att_dims d, const R *h,                       \
                               const unsigned char *mask, R *c);             \
    int att_mean_context_backward_##SFX(att_dims d, const R *grad_c,         \
                                        const unsigned char *mask, R *dh);   \
    int att_additive_score_##SFX(att_dims d, const R *h, const R *context,   \
                                 const R *W, const R *v, const R *b, R *s,   \
                                 R *work);                                   \
    int att_additive_score_backward_##SFX(                                   \
        att_dims d, const R *grad_s, const R *h, const R *context,           \
        const R *W, const R *v, const R *b, R *dh, R *dcontext, R *dW,       \
        R *dv, R *db, R *work);                                              \
    int att_masked_softmax_##SFX(att_dims d, const R *scores,                \
                                 const unsigned char *mask, R *alpha);       \
    int att_masked_softmax_backward_##SFX(att_dims d, const R *grad_alpha,   \
                                          const R *alpha, R *dscores);       \
    int att_weighted_sum_##SFX(att_dims d, const R *alpha, const R *h,       \
                               R *out);                                      \
    int att_weighted_sum_backward_##SFX(att_dims d, const R *grad_out,       \
                                        const R *alpha, const R *h,          \
                                        R *dalpha, R *dh);                   \
    int att_context_attention_##SFX(att_dims d, const att_exec *ex,          \
                                    const R *h,                              \
                                    const R *W, const R *v, const R *b,      \
                                    const unsigned char *mask, R *out,       \
                                    R *alpha, R *act, void *work);           \
    int att_context_attention_backward_##SFX(                                \
        att_dims d, const att_exec *ex, const R *grad_out, const R *h,       \
        const R *W,                                                          \
        const R *v, const R *alpha, const R *b, const unsigned char *mask,   \
        const R *grad_alpha, const R *act, R *dh, R *dW, R *dv, R *db,      \
        void *work);

ATT_DECLARE(float, f32)
ATT_DECLARE(double, f64)

#undef ATT_DECLARE

/*
 * The attention family (docs/contract.md section 4): a query against keys.
 *
 *   additive  s_it = v . tanh(W_k k_t + W_q q_i + b)    W = [W_k | W_q]
 *   dot       s_it = scale q_i . k_t
 *   general   s_it = q_i . (W_a k_t)                    W = W_a (Hq, H)
 *   cosine    s_it = beta_i n(q_i) . n(k_t)       n(x) = x / max(|x|, 1e-12)
 *   alpha_i = masked softmax_t(s_i),  out_i = sum_t alpha_it val_t
 *
 * B sequences, each with Tq queries (Hq wide) and T keys (H wide) whose
 * values are Hv wide.  The keys' side of the score is projected once per
 * key (P = A for additive, Hq for general), never once per (query, key)
 * pair, and the additive activations (Tq, T, A) are never stored.  W is
 * row-major with ldw columns (A x (H + Hq), or Hq x H).
 * Key t is visible to query i when the key mask, the per-query attn_mask
 * and its range of keys [lo_i, hi_i) allow it: causal (t <= i' = i + T -
 * Tq), the window and the packed segments narrow it (docs/contract.md
 * 5.1); blocks of the streamed path outside every range are skipped.  Keys
 * visible to no query of their sequence, and queries with no visible key,
 * are padding: a NaN there reaches no result.
 */
enum att_score {
    ATT_SCORE_ADDITIVE = 0,
    ATT_SCORE_DOT = 1,
    ATT_SCORE_GENERAL = 2,
    ATT_SCORE_COSINE = 3    /* the dot score of n(q) beta and n(k) */
};

typedef struct {
    int score;              /* enum att_score */
    int causal;             /* key t visible to query i iff t <= i+T-Tq */
    int bias_shared;        /* the bias is broadcast over sequences: its
                               gradient sums over them */
    int dropout;            /* the call has dropout (p > 0) */
    int stream;             /* dot, general: no (Tq, T) weights (alpha
                               NULL): blocks of keys, lse */
    ptrdiff_t nbias;        /* elements of the bias as given (dbias) */
    ptrdiff_t B, Tq, T;     /* sequences; queries and keys of each */
    ptrdiff_t Bq, Bk, Bv;   /* query, key, value sequences (0: B): fewer
                               when one serves several (broadcast) */
    ptrdiff_t H, Hq, Hv;    /* widths of a key, a query, a value */
    ptrdiff_t P;            /* width of a projected key: A, Hq (general) */
    /* dot and general only (issue 25): */
    int window;             /* key t visible to query i iff i' - wleft <=
                               t <= i' + wright (i' = i + T - Tq) */
    ptrdiff_t wleft, wright;    /* window sides, -1: unbounded */
    ptrdiff_t nseg;         /* packed segments (in->cu_q, cu_k); 0: one
                               sequence.  i', causal and the window are
                               per segment; query i sees only its own */
    int softcap;            /* the score s is in->softcap tanh(s / softcap)
                               before the bias */
    int alibi;              /* in->alibi: -slope_b |i' - t| added */
    int sinks;              /* in->sinks: one more logit per sequence */
    ptrdiff_t nslopes, nsinks;  /* elements of alibi and sinks as given
                               (their gradients) */
    ptrdiff_t nsharp;       /* cosine: elements of in->sharpness as given
                               (0: beta = 1) */
    int io_store;           /* the call's in->io_store (below), which a
                               float16 backward's scratch is sized by */
} att_fdims;

/*
 * A (B, rows, cols) operand read where it is: element (b, i, t) at
 * (off ? off[b] : b bs) + i rs + t cs, in elements.  Strides 0 repeat it
 * (NumPy's broadcasting, without a copy); p NULL: not given.
 */
typedef struct {
    const void *p;
    const ptrdiff_t *off;
    ptrdiff_t bs, rs, cs;
} att_view;

/*
 * Inputs of a family call.  values NULL: the keys are the values.  kproj
 * (B, T, P) NULL: project the keys here; else it must be the keys
 * projected (att_project_keys).  v, b: additive only (b may be NULL).
 * mask (bytes, rows 0: (B, T)), attn_mask (bytes, (B, Tq, T)) and bias
 * (REAL, (B, Tq, T); dot and general) are views.  dropout p in [0, 1)
 * with its seed (core/philox.h); dot and general.
 * Forward outputs: out (B, Tq, Hv); alpha (B, Tq, T), or NULL to stream
 * the keys by blocks without storing the weights, writing lse (B, Tq)
 * (log sum_t exp(s_it) over the visible keys, -inf with none) instead.
 * Sequence b reads query qidx[b] of Bq, keys kidx[b] of Bk (and key_proj),
 * values vidx[b] of Bv (NULL: b); the gradients of query, keys and values
 * have their shapes and sum over the sequences that share them.  The
 * backward runs the groups of sequences that share any (order[gstart[g]
 * .. gstart[g + 1]), ngroups of them; order NULL: each sequence alone).
 * alibi and sinks (views of one REAL per sequence, dot and general):
 * -slope_b |i' - t| added to the scores (i' per segment); sink_b one
 * more logit of the softmax (lse includes it, no value: the weights sum
 * to less than 1; a query with no visible key gets out 0, lse sink_b).
 * Backward inputs: grad_out (B, Tq, Hv) with alpha and grad_alpha (may be
 * NULL), or (alpha NULL; dot and general) the forward's out and lse, from
 * which the weights are recomputed block by block.  Backward outputs:
 * dquery, dkeys, dvalues (NULL when values is NULL: the keys take that
 * gradient), dW, dv, db (NULL without b), dbias (a view of nbias
 * elements, p NULL without bias; broadcast elements sum), dalibi and
 * dsinks likewise (sinks need the streamed backward: out and lse).
 * The cosine score (Hq = H) takes the dot score's inputs but scale, and
 * sharpness, a view of beta (b, i) at VIEW_AT + i cs (p NULL: 1); its
 * backward writes dsharpness (a view likewise, nsharp elements; p NULL:
 * not wanted).  It runs the dot path on n(q) beta and n(k), made in the
 * scratch (O((B Tq + Bk T) H) more of it), the values being the keys as
 * given when values is NULL.
 * With dkproj
 * not NULL the backward stops at kproj: dkproj gets dL/dkproj, the key
 * columns of dW are 0, and dkeys only has the values' share (0 when
 * values given).
 * Keys and values are C-contiguous, except where
 * att_family_reads_strided(f, backward) says the call reads them in place
 * (ATT_STRIDED_KEYS: the keys, dot decoding; ATT_STRIDED_VALUES: the
 * values, dot and general decoding; values NULL: the keys are read as the
 * keys are): row t of key
 * sequence j of Bk at keys + (koff ? koff[j] : j T H) + t (krs ? krs : H),
 * of value sequence j of Bv at values + (voff ? voff[j] : j T Hv) +
 * t (vrs ? vrs : Hv), in elements (offsets and strides may be negative;
 * the last axis is contiguous).  Elsewhere koff, voff, krs, vrs must be
 * NULL or 0.  Where it also says ATT_STORED16_KEYS (_VALUES: float calls)
 * they may be stored in 16 bits: kstore (vstore) ATT_STORE_BF16 or
 * ATT_STORE_F16, keys (values) then pointing at uint16_t elements, each
 * widened to float exactly as it is loaded (the result is the float
 * call's on the widened arrays, bit for bit); ATT_STORE_NATIVE (0)
 * everywhere else.
 * io_store ATT_STORE_BF16 or ATT_STORE_F16 (a float call, where
 * att_family_takes16(f, ex, in) said 1 for these inputs and this
 * io_store): a forward's query, keys and values are 16-bit as stored,
 * C-contiguous, and out is written so, rounded to nearest even; a
 * backward's (in->grad_out given: how att_family_takes16 tells them
 * apart) query, keys, values, out and grad_out are 16-bit as stored,
 * its gradients float as always (one on the float products needs
 * f->io_store set as in->io_store: its scratch holds each block
 * widened); the bits of
 * the call on the widened arrays (with out rounded after), without
 * their float32 copies.  It says 1 for a dot score streamed (lse), values
 * given, no kproj, koff or voff, every element finite (it reads them
 * all); for a forward, more than a decoding step's queries, visibility
 * by ranges alone (no bias; causal, window, segments, a key mask of one
 * run of keys a sequence, padding, and an attn_mask of one run of keys
 * a query are ranges), no
 * softcap, alibi or dropout, and a fused kernel that reads them: the
 * float products' (on a SIMD path) or, for bfloat16, the one on the bf16
 * products (ATT_PRECISION_BF16, ex->bf16 ATT_BF16_DOT or ATT_BF16_AMX);
 * for a backward, more than one query a sequence and no sinks,
 * bfloat16 on the dot products where they run, else on the float
 * products.  io_store ATT_STORE_NATIVE (0) everywhere else.
 */
enum att_strided {
    ATT_STRIDED_KEYS = 1,
    ATT_STRIDED_VALUES = 2,
    ATT_STORED16_KEYS = 4,      /* and as stored in 16 bits (kstore) */
    ATT_STORED16_VALUES = 8     /* (vstore) */
};

enum att_store {
    ATT_STORE_NATIVE = 0,
    ATT_STORE_BF16 = 1,
    ATT_STORE_F16 = 2,
    ATT_STORE_Q8 = 3        /* int8 with a scale per group: caches only */
};

/* n elements of 16-bit kind store (ATT_STORE_BF16, ATT_STORE_F16) at src
 * widened to float at dst (widen), exactly; or n floats at src rounded to
 * it at dst (!widen), to nearest even (NaN: the quiet NaN of its sign for
 * bfloat16, as ml_dtypes gives it; sign and payload's top for binary16,
 * as the conversion instructions give them).  On SIMD path simd (a
 * supported one).  Returns ATT_OK, or ATT_EINVAL for a bad argument. */
int att_convert16(int simd, int store, int widen, ptrdiff_t n,
                  const void *src, void *dst);

#define ATT_FAMILY_DECLARE(R, SFX)                                           \
    typedef struct {                                                         \
        const R *query, *keys, *kproj, *values, *W, *v, *b;                  \
        ptrdiff_t ldw;                                                       \
        R scale;                                                             \
        att_view mask, attn_mask, bias;                                      \
        double dropout;                                                      \
        uint64_t seed;                                                       \
        const R *alpha, *grad_out, *grad_alpha, *out, *lse;                  \
        const ptrdiff_t *qidx, *kidx, *vidx, *order, *gstart;                \
        ptrdiff_t ngroups;                                                   \
        const ptrdiff_t *koff, *voff;                                        \
        ptrdiff_t krs, vrs;                                                  \
        const int64_t *cu_q, *cu_k;   /* (nseg + 1,): segment starts */    \
        R softcap;                    /* > 0 when f->softcap */            \
        att_view alibi, sinks;        /* REAL, element b at VIEW_AT */     \
        att_view sharpness;           /* cosine: REAL beta (b, i) */       \
        int kstore, vstore;           /* enum att_store: keys, values */   \
        int io_store;                 /* query, keys, values and out */    \
    } att_family_in_##SFX;                                                   \
    typedef struct {                                                         \
        R *out, *alpha, *lse;                                                \
        R *dquery, *dkeys, *dkproj, *dvalues, *dW, *dv, *db;                 \
        att_view dbias;                                                      \
        att_view dalibi, dsinks;      /* p NULL: not wanted (backward) */  \
        att_view dsharpness;          /* cosine backward, likewise */      \
    } att_family_out_##SFX;                                                  \
    int att_family_reads_strided_##SFX(const att_fdims *f, int backward);   \
    int att_family_takes16_##SFX(const att_fdims *f, const att_exec *ex,    \
                                 const att_family_in_##SFX *in);             \
    ptrdiff_t att_family_workspace_##SFX(const att_fdims *f, int backward,  \
                                         const att_exec *ex);                \
    int att_family_forward_##SFX(const att_fdims *f, const att_exec *ex,     \
                                 const att_family_in_##SFX *in,              \
                                 att_family_out_##SFX *out, void *work);     \
    int att_family_backward_##SFX(const att_fdims *f, const att_exec *ex,    \
                                  const att_family_in_##SFX *in,             \
                                  att_family_out_##SFX *out, void *work);    \
    /* kp (n, P) = keys (n, H) W[:, :H]^T, and its backward: dkeys (n, H), \
     * dW (P, ldw) with zeros past column H.  d = {n, 1, H, P}. */          \
    ptrdiff_t att_project_keys_workspace_##SFX(att_dims d,                   \
                                               const att_exec *ex);          \
    int att_project_keys_##SFX(att_dims d, const att_exec *ex,               \
                               const R *keys, const R *W, ptrdiff_t ldw,     \
                               R *kp, void *work);                           \
    int att_project_keys_backward_##SFX(att_dims d, const att_exec *ex,      \
                                        const R *grad, const R *keys,        \
                                        const R *W, ptrdiff_t ldw,           \
                                        R *dkeys, R *dW, void *work);

ATT_FAMILY_DECLARE(float, f32)
ATT_FAMILY_DECLARE(double, f64)

#undef ATT_FAMILY_DECLARE

/*
 * Attention against a cache of keys and values (docs/contract.md section
 * 7.5): B sequences, each with Tq new queries (B, Tq, Hq, d) and lens[b]
 * keys and values in a cache of blocks of `block` rows, (nblocks, block,
 * Hkv, d) and (nblocks, block, Hkv, dv); position t of sequence b is row
 * t % block of block table[b maxblocks + t / block] (table NULL: block
 * b, a contiguous cache, maxblocks 1).  Query head h reads kv head
 * h / (Hq / Hkv).  Query i of sequence b is at position p = lens[b] - Tq
 * + i and sees key t < lens[b] iff (!causal or t <= p) and p - wleft <=
 * t <= p + wright (a side of -1: unbounded).  Scores scale q . k_t,
 * then softcap tanh(s / softcap) (softcap > 0), then -slope |p - t|
 * (alibi NULL: none; slope (b, h) at alibi[b alibi_bs + h]); sinks (Hq,)
 * one more logit per head (NULL: none).  out (B, Tq, Hq, dv) and lse
 * (B, Tq, Hq), C-contiguous; a query that sees no key gets out 0 and lse
 * -inf (or its sink).  The query's rows and the caches' rows have a
 * contiguous last axis and any other strides (elements: of REAL, or of
 * the store kstore / vstore, attention.h's att_store, for float).  An
 * ATT_STORE_Q8 cache (float) holds int8 q with scales (kscale: float, or
 * binary16 with kscale16) laid out as the cache with d / kgroup elements
 * a row (strides ksbs, ksrs, kshs): element c is the float product
 * scale[c / kgroup] q[c], exactly the float call on those values.
 * The cache is read where it is, never written.  Results are bitwise
 * the same for any thread count, and for any block size and table that
 * place the same rows at the same positions.  Returns ATT_EINVAL for bad
 * sizes, a length beyond the capacity (maxblocks block) or a block
 * index out of range, before reading anything.  B, block and maxblocks
 * may be 0 (no sequence; caches or tables that hold no key, every
 * length 0).
 */
typedef struct {
    ptrdiff_t B, Tq, Hq, Hkv, d, dv;
    ptrdiff_t nblocks, block, maxblocks;
    int causal;
    ptrdiff_t wleft, wright;
} att_cache_dims;

#define ATT_CACHE_DECLARE(R, SFX)                                            \
    typedef struct {                                                         \
        const R *query;                                                      \
        ptrdiff_t qbs, qis, qhs;        /* strides: b, i, head */          \
        const void *kc, *vc;                                                 \
        int kstore, vstore;                                                  \
        ptrdiff_t kbs, krs, khs;        /* strides: block, row, head */    \
        ptrdiff_t vbs, vrs, vhs;                                             \
        const void *kscale, *vscale;    /* ATT_STORE_Q8 only */            \
        int kscale16, vscale16;                                              \
        ptrdiff_t ksbs, ksrs, kshs, kgroup;                                  \
        ptrdiff_t vsbs, vsrs, vshs, vgroup;                                  \
        const int64_t *lens;            /* (B,) */                         \
        const int64_t *table;           /* (B, maxblocks) or NULL */       \
        R scale, softcap;                                                    \
        const R *alibi;                                                      \
        ptrdiff_t alibi_bs;                                                  \
        const R *sinks;                                                      \
    } att_cache_in_##SFX;                                                    \
    ptrdiff_t att_cache_workspace_##SFX(const att_cache_dims *c,             \
                                        const att_cache_in_##SFX *in,        \
                                        const att_exec *ex);                 \
    int att_cache_attention_##SFX(const att_cache_dims *c,                   \
                                  const att_exec *ex,                        \
                                  const att_cache_in_##SFX *in, R *out,      \
                                  R *lse, void *work);

ATT_CACHE_DECLARE(float, f32)
ATT_CACHE_DECLARE(double, f64)

#undef ATT_CACHE_DECLARE

#ifdef __cplusplus
}
#endif

#endif /* ATTENTION_C_ATTENTION_H */
