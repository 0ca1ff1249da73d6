/*
 * table.c - the table of the public functions: every one is a row of
 * `funcs` below, its arguments in signature order (args.h names them),
 * each with a shape pattern in the style of NumPy's gufunc signatures
 * ("(..., T, H)", "(A, H+Hq)"), its outputs with theirs, and the kernel
 * call, a few lines above the table.  The generic driver (call.c) parses,
 * checks, casts, allocates, releases the GIL and maps the status the same
 * way for every row.  Adding a function: its argument names in args.h if
 * new, one kernel call, one row, and its ENTRY in module.c.
 *
 * Arguments up to .npos (default: the required ones, .nreq) may be given
 * by position; the rest are keyword-only, so that an optional array can
 * never be read as another (a mask in the place of the bias).
 */
#include "binding.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* ---------------------------------------------------------------------
 * The vocabulary (args.h): names and kinds
 */

#define ATT_ARG_NAME(ID, name, kind) #name,
const char *const arg_names[N_ARG_IDS] = {NULL, ATT_ARGS(ATT_ARG_NAME)};
#undef ATT_ARG_NAME

#define ATT_ARG_KIND(ID, name, kind) kind,
const unsigned arg_kinds[N_ARG_IDS] = {0, ATT_ARGS(ATT_ARG_KIND)};
#undef ATT_ARG_KIND

#define ATT_OUT_NAME(ID, name) #name,
const char *const out_names[N_OUT_IDS] = {ATT_OUTS(ATT_OUT_NAME)};
#undef ATT_OUT_NAME

/* ---------------------------------------------------------------------
 * The kernels of the rows
 */

/* att_NAME_f32 or att_NAME_f64 for the call's dtype. */
#define TYPED(c, NAME, ...)                                                  \
    ((c)->typenum == NPY_FLOAT ? att_##NAME##_f32(__VA_ARGS__)               \
                               : att_##NAME##_f64(__VA_ARGS__))
#define IN(id) arg_data(c, id)
#define OUT(id) out_data(c, id)

static int k_mean_context(Call *c)
{
    return TYPED(c, mean_context, c->d, IN(X_H), IN(X_MASK), OUT(Y_C));
}

static int k_mean_context_backward(Call *c)
{
    return TYPED(c, mean_context_backward, c->d, IN(X_GRAD_C), IN(X_MASK),
                 OUT(Y_DH));
}

static ptrdiff_t w_additive_score(Call *c)
{
    return TYPED(c, additive_score_workspace, c->d);
}

static int k_additive_score(Call *c)
{
    return TYPED(c, additive_score, c->d, IN(X_H), IN(X_CONTEXT), IN(X_W),
                 IN(X_V), IN(X_B), OUT(Y_S), c->work);
}

static ptrdiff_t w_additive_score_backward(Call *c)
{
    return TYPED(c, additive_score_backward_workspace, c->d);
}

static int k_additive_score_backward(Call *c)
{
    return TYPED(c, additive_score_backward, c->d, IN(X_GRAD_S), IN(X_H),
                 IN(X_CONTEXT), IN(X_W), IN(X_V), IN(X_B), OUT(Y_DH),
                 OUT(Y_DCONTEXT), OUT(Y_DW), OUT(Y_DV), OUT(Y_DB), c->work);
}

static int k_masked_softmax(Call *c)
{
    return TYPED(c, masked_softmax, c->d, IN(X_SCORES), IN(X_MASK),
                 OUT(Y_ALPHA));
}

static int k_masked_softmax_backward(Call *c)
{
    return TYPED(c, masked_softmax_backward, c->d, IN(X_GRAD_ALPHA),
                 IN(X_ALPHA), OUT(Y_DSCORES));
}

static int k_weighted_sum(Call *c)
{
    return TYPED(c, weighted_sum, c->d, IN(X_ALPHA), IN(X_H), OUT(Y_OUT));
}

static int k_weighted_sum_backward(Call *c)
{
    return TYPED(c, weighted_sum_backward, c->d, IN(X_GRAD_OUT),
                 IN(X_ALPHA), IN(X_H), OUT(Y_DALPHA), OUT(Y_DH));
}

static ptrdiff_t w_context_attention(Call *c)
{
    return TYPED(c, context_attention_workspace, c->d, &c->ex);
}

static int k_context_attention(Call *c)
{
    return TYPED(c, context_attention, c->d, &c->ex, IN(X_H), IN(X_W),
                 IN(X_V), IN(X_B), IN(X_MASK), OUT(Y_OUT), OUT(Y_ALPHA),
                 OUT(Y_ACTIVATIONS), c->work);
}

static ptrdiff_t w_context_attention_backward(Call *c)
{
    return TYPED(c, context_attention_backward_workspace, c->d, &c->ex);
}

static int k_context_attention_backward(Call *c)
{
    return TYPED(c, context_attention_backward, c->d, &c->ex,
                 IN(X_GRAD_OUT), IN(X_H), IN(X_W), IN(X_V), IN(X_ALPHA),
                 IN(X_B), IN(X_MASK), IN(X_GRAD_ALPHA), IN(X_ACTIVATIONS),
                 OUT(Y_DH),
                 OUT(Y_DW), OUT(Y_DV), OUT(Y_DB), c->work);
}

/* The family's sizes from the bound symbols. */
/* The sequences of input id when it has fewer than the call (0: the
 * call's); and which one each of the call's reads (NULL: its own). */
static ptrdiff_t seqs_of(const Call *c, int id)
{
    int i = c->fn->pos[id];
    return i >= 0 && c->idx[i] != NULL ? c->nseq[i] : 0;
}

static const ptrdiff_t *index_of(const Call *c, int id)
{
    int i = c->fn->pos[id];
    return i >= 0 ? c->idx[i] : NULL;
}

/* The elements of array argument id as given (0: not given). */
static ptrdiff_t size_of(const Call *c, int id)
{
    int i = c->fn->pos[id];
    return i >= 0 && c->arr[i] != NULL ? PyArray_SIZE(c->arr[i]) : 0;
}

static att_fdims family_dims(const Call *c)
{
    int score = c->fn->score, loc = c->fn->location;
    int dot = score == ATT_SCORE_DOT || score == ATT_SCORE_COSINE;
    att_fdims f = {
        .score = score, .causal = given(c, X_CAUSAL),
        /* the location score's b (L,): every sequence's and query's */
        .bias_shared = c->bias_shared || (loc && bias_arg(c) != NULL &&
                                          c->d.B > 1),
        .nbias = bias_arg(c) != NULL ? PyArray_SIZE(bias_arg(c)) : 0,
        .dropout = given(c, X_DROPOUT), .stream = stream_of(c),
        .B = c->d.B, .Tq = c->several ? c->sym[S_TQ] : 1, .T = c->sym[S_T],
        .Bq = seqs_of(c, X_QUERY), .Bk = seqs_of(c, loc ? X_W : X_KEYS),
        .Bv = seqs_of(c, X_VALUES),
        .H = loc ? c->sym[S_HQ] : c->sym[S_H],
        .Hq = dot && !loc ? c->sym[S_H] : c->sym[S_HQ],
        .Hv = c->sym[S_HV],
        .P = score == ATT_SCORE_ADDITIVE ? c->sym[S_A]
             : score == ATT_SCORE_GENERAL ? c->sym[S_HQ] : 0,
        .window = given(c, X_WINDOW), .wleft = c->window[0],
        .wright = c->window[1],
        .nseg = given(c, X_CU_SEQLENS_Q) ? c->sym[S_N] - 1 : 0,
        .softcap = given(c, X_SOFTCAP), .alibi = given(c, X_ALIBI_SLOPES),
        .sinks = given(c, X_SINKS), .nslopes = size_of(c, X_ALIBI_SLOPES),
        .nsinks = size_of(c, X_SINKS),
        .nsharp = as_number(c, X_SHARPNESS) ? 0 : size_of(c, X_SHARPNESS),
        .io_store = c->io16};
    return f;
}

static ptrdiff_t w_family(Call *c)
{
    att_fdims f = family_dims(c);
    return TYPED(c, family_workspace, &f, is_backward(c->fn), &c->ex);
}

/* A view argument as the kernel reads it, or keys and values read where
 * they are (read_rows: offsets and row stride); zeros when not given or
 * C-contiguous. */
static att_view view_of(const Call *c, int id)
{
    int i = c->fn->pos[id];
    att_view none = {NULL, NULL, 0, 0, 0};
    return i >= 0 && c->arr[i] != NULL ? c->view[i] : none;
}

/* How the keys or values (id) are stored where read in place (read_rows):
 * attention.h's att_store. */
static int store_of(const Call *c, int id)
{
    int i = c->fn->pos[id];
    return i >= 0 ? c->store[i] : ATT_STORE_NATIVE;
}

/* The bias gradient, laid out as the bias made C-contiguous (make_views),
 * or nothing. */
static att_view dbias_view(const Call *c)
{
    int k = c->fn->opos[Y_DBIAS];
    att_view v = c->dbias;
    v.p = k >= 0 && c->out[k] != NULL
          ? PyArray_DATA((PyArrayObject *)c->out[k]) : NULL;
    return v;
}

/* The gradient of alibi_slopes (g 0), sinks (1) or sharpness (2),
 * output id, laid out
 * as the argument made C-contiguous (make_views), or nothing. */
static att_view grad_view(const Call *c, int g, int id)
{
    att_view v = c->gview[g];
    v.p = out_data(c, id);
    return v;
}

/* The family's call for one type: its inputs and outputs by name; or,
 * ask, whether its forward takes this call's query, keys and values as
 * stored in c->io16's 16 bits (attention.h's att_family_takes16). */
#define FAMILY_CALL(R, SFX)                                                  \
    do {                                                                     \
        int wi = c->fn->pos[X_W];                                            \
        att_family_in_##SFX in = {                                           \
            .query = IN(X_QUERY), .keys = IN(X_KEYS),                        \
            .kproj = IN(X_KEY_PROJ),                                         \
            .values = IN(X_VALUES), .W = IN(X_W), .v = IN(X_V),              \
            .b = IN(X_B),                                                    \
            .ldw = wi >= 0 ? PyArray_DIM(c->arr[wi], 1) : 0,                 \
            .scale = (R)scale, .mask = view_of(c, X_MASK),                   \
            .attn_mask = view_of(c, X_ATTN_MASK),                            \
            .bias = view_of(c, X_BIAS), .dropout = dropout,                  \
            .seed = c->seed, .alpha = IN(X_ALPHA),                           \
            .grad_out = IN(X_GRAD_OUT), .grad_alpha = IN(X_GRAD_ALPHA),      \
            .out = IN(X_OUT), .lse = IN(X_LSE),                              \
            .qidx = index_of(c, X_QUERY), .kidx = index_of(c, X_KEYS),       \
            .vidx = index_of(c, X_VALUES), .order = c->order,                \
            .gstart = c->gstart, .ngroups = c->ngroups,                      \
            .koff = view_of(c, X_KEYS).off, .voff = view_of(c, X_VALUES).off, \
            .krs = view_of(c, X_KEYS).rs, .vrs = view_of(c, X_VALUES).rs,    \
            .cu_q = IN(X_CU_SEQLENS_Q), .cu_k = IN(X_CU_SEQLENS_K),          \
            .softcap = (R)softcap, .alibi = view_of(c, X_ALIBI_SLOPES),      \
            .sinks = view_of(c, X_SINKS),                                    \
            .sharpness = view_of(c, X_SHARPNESS),                            \
            .kstore = store_of(c, X_KEYS), .vstore = store_of(c, X_VALUES), \
            .io_store = c->io16};                                            \
        att_family_out_##SFX out = {                                         \
            .out = OUT(Y_OUT), .alpha = OUT(Y_ALPHA), .lse = OUT(Y_LSE),     \
            .dquery = OUT(Y_DQUERY), .dkeys = OUT(Y_DKEYS),                  \
            .dkproj = OUT(Y_DKEY_PROJ), .dvalues = OUT(Y_DVALUES),           \
            .dW = OUT(Y_DW), .dv = OUT(Y_DV), .db = OUT(Y_DB),               \
            .dbias = dbias, .dalibi = grad_view(c, 0, Y_DALIBI_SLOPES),      \
            .dsinks = grad_view(c, 1, Y_DSINKS),                             \
            .dsharpness = grad_view(c, 2, Y_DSHARPNESS)};                    \
        if (c->fn->location) {    /* the dot score of W[:T] plus b[:T] */  \
            in.keys = IN(X_W);                                               \
            in.kidx = index_of(c, X_W);                                      \
            in.W = in.b = NULL;                                              \
            in.bias = (att_view){IN(X_B), NULL, 0, 0, 1};                    \
            out.dkeys = OUT(Y_DW);                                           \
            out.dbias = (att_view){OUT(Y_DB), NULL, 0, 0, 1};                \
        }                                                                    \
        if (ask) {                                                           \
            return att_family_takes16_##SFX(&f, &c->ex, &in);                \
        }                                                                    \
        return is_backward(c->fn)                                            \
               ? att_family_backward_##SFX(&f, &c->ex, &in, &out, c->work)   \
               : att_family_forward_##SFX(&f, &c->ex, &in, &out, c->work);   \
    } while (0)

static int family_call(Call *c, int ask)
{
    att_fdims f = family_dims(c);
    /* dot: scale None means 1/sqrt(H) (1 when H = 0: no score at all);
     * the location and cosine scores have none */
    double scale = given(c, X_SCALE) ? c->scale
                   : c->fn->location || f.score == ATT_SCORE_COSINE ? 1.0
                   : 1.0 / sqrt(f.H > 1 ? (double)f.H : 1.0);
    int id = c->fn->pos[X_DROPOUT];
    double dropout = id >= 0 ? c->num[id] : 0;
    att_view dbias = dbias_view(c);
    int ic = c->fn->pos[X_SOFTCAP];
    double softcap = ic >= 0 && given(c, X_SOFTCAP) ? c->num[ic] : 0;
    if (c->typenum == NPY_FLOAT) {
        /* a cap beyond float's range computes as its nearest float that
         * is > 0 and finite: the same scores within float's rounding
         * (1e-300 would round to 0, which the kernel refuses) */
        softcap = softcap <= 0 ? 0 : softcap < FLT_TRUE_MIN ? FLT_TRUE_MIN
                  : softcap > FLT_MAX ? FLT_MAX : softcap;
        FAMILY_CALL(float, f32);
    }
    FAMILY_CALL(double, f64);
}

static int k_family(Call *c)
{
    return family_call(c, 0);
}

int family_takes16(Call *c)
{
    return family_call(c, 1);
}

/* The location score: the family's call, then W's rows t >= T, which no
 * score reads, get a gradient of exactly 0 (b's are zeroed with the rest
 * of the bias gradient). */
static int k_location(Call *c)
{
    int st = k_family(c);
    char *dW = out_data(c, Y_DW);
    if (st == ATT_OK && dW != NULL) {
        size_t item = c->typenum == NPY_FLOAT ? sizeof(float)
                                              : sizeof(double);
        size_t row = (size_t)c->sym[S_HQ] * item;
        memset(dW + (size_t)c->sym[S_T] * row, 0,
               (size_t)(c->sym[S_L] - c->sym[S_T]) * row);
    }
    return st;
}

/* The additive score adds query and keys per sequence: their leading
 * axes (and the values') must be the same, not broadcast. */
static int check_additive_lead(const Call *c)
{
    static const int ids[] = {X_QUERY, X_KEYS, X_VALUES};
    int ik = c->fn->pos[X_KEYS];
    for (int n = 0; n < 3; n++) {
        int id = ids[n], i = c->fn->pos[id];
        int same = i < 0 || c->arr[i] == NULL ||
                   PyArray_NDIM(c->arr[i]) == PyArray_NDIM(c->arr[ik]) -
                                              (id == X_QUERY && !c->several);
        for (int k = 0; same && i >= 0 && c->arr[i] != NULL &&
                        k < c->nlead; k++) {
            same = PyArray_DIM(c->arr[i], k) == c->lead[k];
        }
        if (!same) {
            PyErr_Format(PyExc_ValueError,
                         "%s: query, keys and values need the same leading "
                         "axes here (broadcasting them against each other "
                         "is for the dot and general scores)", c->fn->name);
            return -1;
        }
    }
    return 0;
}

/* key_proj is the keys projected: their leading axes; stop_at_key_proj
 * needs it. */
static int check_key_proj(const Call *c)
{
    int ik = c->fn->pos[X_KEYS], ip = c->fn->pos[X_KEY_PROJ];
    if (ip >= 0 && c->arr[ip] != NULL) {
        int nd = PyArray_NDIM(c->arr[ip]);
        int same = nd == PyArray_NDIM(c->arr[ik]);
        for (int k = 0; same && k < nd - 2; k++) {
            same = PyArray_DIM(c->arr[ip], k) == PyArray_DIM(c->arr[ik], k);
        }
        if (!same) {
            char ps[SHAPE_BUF], ks[SHAPE_BUF];
            PyErr_Format(PyExc_ValueError,
                         "key_proj has shape %s; expected the keys' leading "
                         "axes (keys have shape %s): key_proj is "
                         "project_keys(keys, W)", SHAPE(ps, c->arr[ip]),
                         SHAPE(ks, c->arr[ik]));
            return -1;
        }
    }
    if (given(c, X_STOP_AT_KEY_PROJ) && !given(c, X_KEY_PROJ)) {
        PyErr_SetString(PyExc_ValueError,
                        "stop_at_key_proj=True needs key_proj: the gradient "
                        "stops at the projected keys given");
        return -1;
    }
    return 0;
}

/* The dropout's range, its seed, and the sizes its bits cover. */
static int check_dropout(const Call *c)
{
    int id = c->fn->pos[X_DROPOUT];
    double p = id >= 0 ? c->num[id] : 0;
    if (!(p >= 0 && p < 1)) {
        char text[64];
        PyOS_snprintf(text, sizeof text, "%g", p);
        PyErr_Format(PyExc_ValueError, "dropout must be in [0, 1), got %s",
                     text);
        return -1;
    }
    if (p > 0 && !given(c, X_SEED)) {
        PyErr_SetString(PyExc_ValueError,
                        "dropout > 0 needs seed= (an int >= 0): the keep "
                        "pattern is a function of (seed, sequence, query, "
                        "key), regenerated by the backward");
        return -1;
    }
    if (p > 0 && ((c->several && c->sym[S_TQ] >= ((npy_intp)1 << 32)) ||
                  c->sym[S_T] > ((npy_intp)1 << 34))) {
        PyErr_SetString(PyExc_ValueError,
                        "dropout draws its bits for at most 2**32 queries "
                        "and 2**34 keys per sequence");
        return -1;
    }
    return 0;
}

/* A dot or general backward takes the forward's alpha, or its out= and
 * lse= (return_weights=False), never both. */
static int check_saved(const Call *c)
{
    const char *name = c->fn->name;
    int a = given(c, X_ALPHA), o = given(c, X_OUT), l = given(c, X_LSE);
    const char *why =
        a && (o || l) ? "give alpha, or out= and lse= of a forward "
                        "with return_weights=False, not both"
        : !a && o != l ? "out= and lse= go together (the forward's "
                         "with return_weights=False)"
        : !a && !o ? "missing alpha (the forward's weights), or out= "
                     "and lse= (a forward with return_weights=False)"
        : NULL;
    if (why != NULL) {
        PyErr_Format(!a && !o && !l ? PyExc_TypeError : PyExc_ValueError,
                     "%s: %s", name, why);
        return -1;
    }
    if (l && given(c, X_GRAD_ALPHA)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: grad_alpha needs alpha: a forward with "
                     "return_weights=False returns no weights to "
                     "differentiate", name);
        return -1;
    }
    return 0;
}

/* cu_seqlens_q or _k (id), its length checked by its shape (N,): made
 * int64 C-contiguous in place (an allocation point), then its values: 0
 * first, never decreasing, `end` (Tq or T) last. */
static int check_cu_seqlens(Call *c, int id, npy_intp end)
{
    int i = c->fn->pos[id];
    const char *name = arg_names[id];
    if (ALLOC_POINT("conversion of", name, 1) < 0) {
        return -1;
    }
    PyObject *a = PyArray_FROMANY((PyObject *)c->arr[i], NPY_INT64, 1, 1,
                                  NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (a == NULL) {
        return -1;
    }
    Py_SETREF(c->arr[i], (PyArrayObject *)a);
    const int64_t *x = PyArray_DATA(c->arr[i]);
    npy_intp n = PyArray_DIM(c->arr[i], 0);
    const char *why = n < 2 ? "needs two entries or more"
                      : x[0] != 0 ? "must start at 0"
                      : x[n - 1] != (int64_t)end ? "must end at the length "
                                                   "of its axis"
                      : NULL;
    for (npy_intp k = 1; why == NULL && k < n; k++) {
        why = x[k] < x[k - 1] ? "must never decrease" : NULL;
    }
    if (why != NULL) {
        PyErr_Format(PyExc_ValueError, "%s %s (the starts of the packed "
                     "segments, then the total %zd); got [%lld, ..., %lld] "
                     "of %zd", name, why, (Py_ssize_t)end,
                     (long long)(n > 0 ? x[0] : 0),
                     (long long)(n > 0 ? x[n - 1] : 0), (Py_ssize_t)n);
        return -1;
    }
    return 0;
}

/* The variants (issue 25): window and cu_seqlens need several queries;
 * softcap > 0; cu_seqlens_q and _k together, each valid. */
static int check_variants(Call *c)
{
    const char *name = c->fn->name;
    int w = given(c, X_WINDOW), q = given(c, X_CU_SEQLENS_Q);
    int k = given(c, X_CU_SEQLENS_K), ic = c->fn->pos[X_SOFTCAP];
    if (!c->several && (w || q || k)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s needs several queries (query (..., Tq, Hq) "
                     "with query.ndim == keys.ndim)", name,
                     w ? "window" : q ? "cu_seqlens_q" : "cu_seqlens_k");
        return -1;
    }
    if (ic >= 0 && given(c, X_SOFTCAP) &&
        (!(c->num[ic] > 0) || !isfinite(c->num[ic]))) {
        char text[64];
        PyOS_snprintf(text, sizeof text, "%g", c->num[ic]);
        PyErr_Format(PyExc_ValueError, "%s: softcap must be a finite "
                     "number > 0 or None, got %s", name, text);
        return -1;
    }
    if (q != k) {
        PyErr_Format(PyExc_ValueError, "%s: cu_seqlens_q and cu_seqlens_k "
                     "go together (%s given without %s)", name,
                     q ? "cu_seqlens_q" : "cu_seqlens_k",
                     q ? "cu_seqlens_k" : "cu_seqlens_q");
        return -1;
    }
    if (given(c, X_SINKS) && is_backward(c->fn) && given(c, X_ALPHA)) {
        PyErr_Format(PyExc_ValueError, "%s: sinks need out= and lse= of "
                     "a forward with return_weights=False, not alpha (the "
                     "sink's share is lost from alpha alone)", name);
        return -1;
    }
    if (q && (check_cu_seqlens(c, X_CU_SEQLENS_Q, c->sym[S_TQ]) < 0 ||
              check_cu_seqlens(c, X_CU_SEQLENS_K, c->sym[S_T]) < 0)) {
        return -1;
    }
    return 0;
}

/* What the table cannot say: arguments that go together or exclude each
 * other, the dropout's range and seed. */
static int check_family(Call *c)
{
    if (c->fn->score == ATT_SCORE_ADDITIVE && check_additive_lead(c) < 0) {
        return -1;
    }
    if (check_key_proj(c) < 0) {
        return -1;
    }
    if (!c->several && (given(c, X_ATTN_MASK) || given(c, X_CAUSAL))) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s needs several queries (query (..., Tq, Hq) "
                     "with query.ndim == %s.ndim); one query per sequence "
                     "attends to its keys through mask=", c->fn->name,
                     given(c, X_CAUSAL) ? "causal" : "attn_mask",
                     c->fn->location ? "values" : "keys");
        return -1;
    }
    if (check_dropout(c) < 0 || check_variants(c) < 0) {
        return -1;
    }
    if (c->fn->pos[X_LSE] >= 0 && is_backward(c->fn)) {
        return check_saved(c);
    }
    return 0;
}

/* The location score: W (L, Hq) has a row for each of the T keys, and
 * more (those of longer sequences). */
static int check_location(Call *c)
{
    if (c->sym[S_L] < c->sym[S_T]) {
        char w_s[SHAPE_BUF], v_s[SHAPE_BUF];
        PyErr_Format(PyExc_ValueError,
                     "W has shape %s; expected (T_max, Hq) with at least "
                     "T = %zd rows, one per position of the values (shape "
                     "%s)", SHAPE(w_s, c->arr[c->fn->pos[X_W]]),
                     (Py_ssize_t)c->sym[S_T],
                     SHAPE(v_s, c->arr[c->fn->pos[X_VALUES]]));
        return -1;
    }
    return check_family(c);
}

/* project_keys: W (A, L) multiplies keys with its first H columns. */
static int check_project(Call *c)
{
    char w_s[SHAPE_BUF], k_s[SHAPE_BUF];
    PyArrayObject *W = c->arr[c->fn->pos[X_W]];
    PyArrayObject *K = c->arr[c->fn->pos[X_KEYS]];
    if (c->sym[S_L] < c->sym[S_H]) {
        PyErr_Format(PyExc_ValueError,
                     "W has shape %s; expected (A, L) with at least H = %zd "
                     "columns (the first H multiply the keys) for keys with "
                     "shape %s", SHAPE(w_s, W), (Py_ssize_t)c->sym[S_H],
                     SHAPE(k_s, K));
        return -1;
    }
    return 0;
}

/* n = B T rows of keys, projected to A. */
static att_dims project_dims(const Call *c)
{
    att_dims d = {c->d.B * c->d.T, 1, c->d.H, c->d.A};
    return d;
}

static ptrdiff_t w_project(Call *c)
{
    return TYPED(c, project_keys_workspace, project_dims(c), &c->ex);
}

static int k_project_keys(Call *c)
{
    return TYPED(c, project_keys, project_dims(c), &c->ex, IN(X_KEYS),
                 IN(X_W), c->sym[S_L], OUT(Y_KEY_PROJ), c->work);
}

static int k_project_keys_backward(Call *c)
{
    return TYPED(c, project_keys_backward, project_dims(c), &c->ex,
                 IN(X_GRAD_PROJ), IN(X_KEYS), IN(X_W), c->sym[S_L],
                 OUT(Y_DKEYS), OUT(Y_DW), c->work);
}

#undef IN
#undef OUT

/* ---------------------------------------------------------------------
 * The table
 */

/* An argument: required array, optional array, boolean mask, flag (the
 * kinds, args.h, are added at import); with a hint for its shape errors.
 * An output: always, only when an argument is given (RES_IF), or an
 * extra one appended to a backward's named tuple (RES_EXTRA). */
#define ARR(i, s) {.id = i, .shape = s}
#define OPT(i, s) {.id = i, .flags = F_OPT, .shape = s}
#define MASK(s) {.id = X_MASK, .flags = F_OPT, .shape = s}
#define FLAG(i) {.id = i}
#define SCALE {.id = X_SCALE}
#define HINT(i, s, h) {.id = i, .shape = s, .hint = h}
#define RES(i, s) {.id = i, .shape = s}
#define RES_IF(i, s, w) {.id = i, .shape = s, .when = w}
#define RES_EXTRA(i, s, w) {.id = i, .shape = s, .when = w, .drop = 1}

#define W_CONTEXT HINT(X_W, "(A, 2*H)", "(W has the layout of " \
                       "torch.nn.Linear(2*H, A).weight)")
#define W_ADDITIVE HINT(X_W, "(A, H+Hq)", "(W = [W_k | W_q] has the layout " \
                        "of torch.nn.Linear(H + Hq, A).weight)")
#define W_GENERAL HINT(X_W, "(Hq, H)", "(W has the layout of " \
                       "torch.nn.Linear(H, Hq, bias=False).weight)")
/* the family's inputs: leading axes broadcast against each other */
#define QUERY(wide) {.id = X_QUERY, .flags = F_LEADB,                        \
                     .shape = "(..., Tq?, " wide ")",                        \
                     .hint = "(one query (..., Hq) or several (..., Tq, "    \
                     "Hq), with query.ndim == keys.ndim)"}
#define QUERY_DOT {.id = X_QUERY, .flags = F_LEADB,                          \
                   .shape = "(..., Tq?, H)",                                 \
                   .hint = "(the dot score needs queries as wide as the "    \
                   "keys)"}
/* the masks and the bias are read where they are (F_VIEW), broadcast by
 * NumPy's rules */
#define FAMILY_MASK {.id = X_MASK, .flags = F_OPT | F_VIEW,                  \
                     .shape = "(..., T)",                                    \
                     .hint = "(the key mask, the same for every query)"}
#define ATTN_MASK {.id = X_ATTN_MASK, .flags = F_OPT | F_VIEW,               \
                   .shape = "(..., Tq?, T)",                                 \
                   .hint = "(True = query i may attend to key t)"}
#define CAUSAL FLAG(X_CAUSAL)
#define BIAS {.id = X_BIAS, .flags = F_OPT | F_VIEW,                         \
              .shape = "(..., Tq?, T)",                                      \
              .hint = "(added to the scores; -inf masks)"}
#define DROPOUT {.id = X_DROPOUT}
#define SEED {.id = X_SEED}
#define RETURN_WEIGHTS {.id = X_RETURN_WEIGHTS}
/* the variants of dot and general (issue 25), keyword-only, last */
#define CU_SEQLENS(i) {.id = i, .flags = F_OPT, .shape = "(N,)",           \
                       .hint = "(1-D: the starts of the packed segments, " \
                       "then the total; cu_seqlens_q and _k of one length)"}
#define PER_SEQ(i, h) {.id = i, .flags = F_OPT | F_VIEW | F_FOLLOW,         \
                       .shape = "(...)", .hint = h}
#define VARIANTS {.id = X_WINDOW}, {.id = X_SOFTCAP},                       \
    PER_SEQ(X_ALIBI_SLOPES, "(one slope per sequence: -slope |i' - t| "    \
            "added to the scores)"),                                        \
    PER_SEQ(X_SINKS, "(one logit per sequence, without a value)"),          \
    CU_SEQLENS(X_CU_SEQLENS_Q), CU_SEQLENS(X_CU_SEQLENS_K)
/* their gradients, at the end of the named tuples */
#define VARIANT_GRADS                                                        \
    {.id = Y_DALIBI_SLOPES, .shape = "(...)", .like = X_ALIBI_SLOPES,        \
     .when = X_ALIBI_SLOPES},                                                \
    {.id = Y_DSINKS, .shape = "(...)", .like = X_SINKS, .when = X_SINKS}
#define KEYS {.id = X_KEYS, .flags = F_LEADB, .shape = "(..., T, H)"}
#define VALUES {.id = X_VALUES, .flags = F_OPT | F_LEADB,                    \
                .shape = "(..., T, Hv)"}
#define KPROJ(wide) {.id = X_KEY_PROJ, .flags = F_OPT | F_LEADB,             \
                     .shape = "(..., T, " wide ")"}
#define ALPHA_Q ARR(X_ALPHA, "(..., Tq?, T)")
#define ALPHA_OPT OPT(X_ALPHA, "(..., Tq?, T)")
/* lse never chooses the dtype: a 16-bit forward returns it in float32 */
#define SAVED OPT(X_OUT, "(..., Tq?, Hv)"),                                 \
    {.id = X_LSE, .flags = F_OPT | F_FOLLOW, .shape = "(..., Tq?)"}
#define GRAD_OUT_Q ARR(X_GRAD_OUT, "(..., Tq?, Hv)")
#define GRAD_ALPHA_Q OPT(X_GRAD_ALPHA, "(..., Tq?, T)")
#define FAMILY_OUTS RES(Y_OUT, "(..., Tq?, Hv)"), RES(Y_ALPHA, "(..., Tq?, T)")
/* (out, alpha), or (out, lse) with return_weights=False */
#define STREAM_OUTS                                                          \
    RES(Y_OUT, "(..., Tq?, Hv)"),                                            \
    {.id = Y_ALPHA, .shape = "(..., Tq?, T)", .when = X_RETURN_WEIGHTS,      \
     .drop = 1},                                                             \
    {.id = Y_LSE, .shape = "(..., Tq?)", .unless = X_RETURN_WEIGHTS,         \
     .drop = 1}
#define DBIAS {.id = Y_DBIAS, .shape = "(..., Tq?, T)", .like = X_BIAS,       \
               .when = X_BIAS}
/* the inputs' gradients have their shapes (summed where they broadcast) */
#define FAMILY_GRADS(wide)                                                   \
    {.id = Y_DQUERY, .shape = "(..., Tq?, " wide ")", .like = X_QUERY},      \
    {.id = Y_DKEYS, .shape = "(..., T, H)", .like = X_KEYS},                 \
    {.id = Y_DVALUES, .shape = "(..., T, Hv)", .like = X_VALUES,             \
     .when = X_VALUES}
/* the location score: W (T_max, Hq) and b (T_max,) hold a row and a
 * bias per position, the values fix T */
#define QUERY_LOC {.id = X_QUERY, .flags = F_LEADB,                          \
                   .shape = "(..., Tq?, Hq)",                                \
                   .hint = "(one query (..., Hq) or several (..., Tq, "      \
                   "Hq), with query.ndim == values.ndim)"}
#define VALUES_LOC {.id = X_VALUES, .flags = F_LEADB, .shape = "(..., T, Hv)"}
#define W_LOCATION {.id = X_W, .flags = F_LEADB, .shape = "(L, Hq)",         \
                    .hint = "(a row per position t < T_max: the layout of " \
                    "torch.nn.Linear(Hq, T_max).weight)"}
#define B_LOCATION {.id = X_B, .flags = F_OPT, .shape = "(L,)",              \
                    .hint = "(a bias per position, as W's rows)"}
#define LOCATION                                                             \
    .order = {X_VALUES, X_QUERY, X_W}, .fused = 1, .family = 1,              \
    .score = ATT_SCORE_DOT, .location = 1, .check = check_location,         \
    .workspace = w_family, .kernel = k_location
/* the cosine score's beta: a number, or one per query position */
#define SHARPNESS {.id = X_SHARPNESS, .flags = F_OPT | F_VIEW | F_FOLLOW,    \
                   .shape = "(..., Tq?)",                                    \
                   .hint = "(beta, one per query position, or a number)"}
#define DSHARPNESS {.id = Y_DSHARPNESS, .shape = "(..., Tq?)",               \
                    .like = X_SHARPNESS, .when = X_SHARPNESS}
/* the family's rows: the keys fix T and H first */
#define FAMILY(sc)                                                           \
    .order = {X_KEYS, X_QUERY, X_VALUES}, .fused = 1,                        \
    .family = 1, .score = (sc), .check = check_family,                       \
    .workspace = w_family,                                                   \
    .kernel = k_family

FuncSpec funcs[] = {
    {.name = "mean_context",
     .args = {ARR(X_H, "(..., T, H)"), MASK("(..., T)")}, .nreq = 1,
     .order = {X_H}, .outs = {RES(Y_C, "(..., H)")},
     .kernel = k_mean_context},
    {.name = "mean_context_backward",
     .args = {ARR(X_GRAD_C, "(..., H)"), ARR(X_H, "(..., T, H)"),
              MASK("(..., T)")}, .nreq = 2,
     .order = {X_H}, .outs = {RES(Y_DH, "(..., T, H)")},
     .kernel = k_mean_context_backward},
    {.name = "additive_score",
     .args = {ARR(X_H, "(..., T, H)"), ARR(X_CONTEXT, "(..., H)"), W_CONTEXT,
              ARR(X_V, "(A,)"), OPT(X_B, "(A,)")}, .nreq = 4,
     .order = {X_H}, .outs = {RES(Y_S, "(..., T)")},
     .workspace = w_additive_score, .kernel = k_additive_score},
    {.name = "additive_score_backward",
     .args = {ARR(X_GRAD_S, "(..., T)"), ARR(X_H, "(..., T, H)"),
              ARR(X_CONTEXT, "(..., H)"), W_CONTEXT, ARR(X_V, "(A,)"),
              OPT(X_B, "(A,)")}, .nreq = 5,
     .order = {X_H},
     .outs = {RES(Y_DH, "(..., T, H)"), RES(Y_DCONTEXT, "(..., H)"),
              RES(Y_DW, "(A, 2*H)"), RES(Y_DV, "(A,)"),
              RES_IF(Y_DB, "(A,)", X_B)},
     .workspace = w_additive_score_backward,
     .kernel = k_additive_score_backward},
    {.name = "masked_softmax",
     .args = {ARR(X_SCORES, "(..., T)"), MASK("(..., T)")}, .nreq = 1,
     .order = {X_SCORES}, .outs = {RES(Y_ALPHA, "(..., T)")},
     .kernel = k_masked_softmax},
    {.name = "masked_softmax_backward",
     .args = {ARR(X_GRAD_ALPHA, "(..., T)"), ARR(X_ALPHA, "(..., T)")},
     .nreq = 2, .order = {X_ALPHA}, .outs = {RES(Y_DSCORES, "(..., T)")},
     .kernel = k_masked_softmax_backward},
    {.name = "weighted_sum",
     .args = {ARR(X_ALPHA, "(..., T)"), ARR(X_H, "(..., T, H)")}, .nreq = 2,
     .order = {X_H}, .outs = {RES(Y_OUT, "(..., H)")},
     .kernel = k_weighted_sum},
    {.name = "weighted_sum_backward",
     .args = {ARR(X_GRAD_OUT, "(..., H)"), ARR(X_ALPHA, "(..., T)"),
              ARR(X_H, "(..., T, H)")}, .nreq = 3,
     .order = {X_H},
     .outs = {RES(Y_DALPHA, "(..., T)"), RES(Y_DH, "(..., T, H)")},
     .kernel = k_weighted_sum_backward},
    {.name = "context_attention",
     .args = {ARR(X_H, "(..., T, H)"), W_CONTEXT, ARR(X_V, "(A,)"),
              OPT(X_B, "(A,)"), MASK("(..., T)"),
              FLAG(X_KEEP_ACTIVATIONS)}, .nreq = 3,
     .order = {X_H},
     .outs = {RES(Y_OUT, "(..., H)"), RES(Y_ALPHA, "(..., T)"),
              RES_EXTRA(Y_ACTIVATIONS, "(..., T, A)", X_KEEP_ACTIVATIONS)},
     .fused = 1, .workspace = w_context_attention,
     .kernel = k_context_attention},
    {.name = "context_attention_backward",
     .args = {ARR(X_GRAD_OUT, "(..., H)"), ARR(X_H, "(..., T, H)"),
              W_CONTEXT, ARR(X_V, "(A,)"), ARR(X_ALPHA, "(..., T)"),
              OPT(X_B, "(A,)"), MASK("(..., T)"),
              OPT(X_GRAD_ALPHA, "(..., T)"),
              OPT(X_ACTIVATIONS, "(..., T, A)")},
     .nreq = 5, .order = {X_H},
     .outs = {RES(Y_DH, "(..., T, H)"), RES(Y_DW, "(A, 2*H)"),
              RES(Y_DV, "(A,)"), RES_IF(Y_DB, "(A,)", X_B)},
     .fused = 1, .workspace = w_context_attention_backward,
     .kernel = k_context_attention_backward},
    {.name = "additive_attention",
     .args = {QUERY("Hq"), KEYS, W_ADDITIVE, ARR(X_V, "(A,)"),
              OPT(X_B, "(A,)"), FAMILY_MASK, ATTN_MASK, CAUSAL, VALUES,
              KPROJ("A")}, .nreq = 4,
     .outs = {FAMILY_OUTS}, FAMILY(ATT_SCORE_ADDITIVE)},
    {.name = "additive_attention_backward",
     .args = {GRAD_OUT_Q, QUERY("Hq"), KEYS, W_ADDITIVE, ARR(X_V, "(A,)"),
              ALPHA_Q, OPT(X_B, "(A,)"), FAMILY_MASK, ATTN_MASK, CAUSAL,
              VALUES, GRAD_ALPHA_Q, KPROJ("A"),
              FLAG(X_STOP_AT_KEY_PROJ)}, .nreq = 6,
     .outs = {FAMILY_GRADS("Hq"), RES(Y_DW, "(A, H+Hq)"), RES(Y_DV, "(A,)"),
              RES_IF(Y_DB, "(A,)", X_B),
              {.id = Y_DKEY_PROJ, .shape = "(..., T, A)", .like = X_KEY_PROJ,
               .when = X_STOP_AT_KEY_PROJ, .drop = 1}},
     FAMILY(ATT_SCORE_ADDITIVE)},
    {.name = "dot_attention",
     .args = {QUERY_DOT, KEYS, FAMILY_MASK, ATTN_MASK, CAUSAL, BIAS, DROPOUT,
              SEED, VALUES, SCALE, RETURN_WEIGHTS, VARIANTS}, .nreq = 2,
     .outs = {STREAM_OUTS}, FAMILY(ATT_SCORE_DOT)},
    {.name = "dot_attention_backward",
     .args = {GRAD_OUT_Q, QUERY_DOT, KEYS, ALPHA_OPT, SAVED, FAMILY_MASK,
              ATTN_MASK, CAUSAL, BIAS, DROPOUT, SEED, VALUES, SCALE,
              GRAD_ALPHA_Q, VARIANTS}, .nreq = 3, .npos = 4,
     .outs = {FAMILY_GRADS("H"), DBIAS, VARIANT_GRADS},
     FAMILY(ATT_SCORE_DOT)},
    {.name = "general_attention",
     .args = {QUERY("Hq"), KEYS, W_GENERAL, FAMILY_MASK, ATTN_MASK, CAUSAL,
              BIAS, DROPOUT, SEED, VALUES, KPROJ("Hq"),
              RETURN_WEIGHTS, VARIANTS}, .nreq = 3,
     .outs = {STREAM_OUTS}, FAMILY(ATT_SCORE_GENERAL)},
    {.name = "general_attention_backward",
     .args = {GRAD_OUT_Q, QUERY("Hq"), KEYS, W_GENERAL, ALPHA_OPT, SAVED,
              FAMILY_MASK, ATTN_MASK, CAUSAL, BIAS, DROPOUT, SEED, VALUES,
              GRAD_ALPHA_Q, KPROJ("Hq"), VARIANTS,
              FLAG(X_STOP_AT_KEY_PROJ)}, .nreq = 4, .npos = 5,
     .outs = {FAMILY_GRADS("Hq"), RES(Y_DW, "(Hq, H)"), DBIAS,
              VARIANT_GRADS,
              {.id = Y_DKEY_PROJ, .shape = "(..., T, Hq)", .like = X_KEY_PROJ,
               .when = X_STOP_AT_KEY_PROJ, .drop = 1}},
     FAMILY(ATT_SCORE_GENERAL)},
    {.name = "location_attention",
     .args = {QUERY_LOC, VALUES_LOC, W_LOCATION, B_LOCATION, FAMILY_MASK,
              ATTN_MASK}, .nreq = 3,
     .outs = {FAMILY_OUTS}, LOCATION},
    {.name = "location_attention_backward",
     .args = {GRAD_OUT_Q, QUERY_LOC, VALUES_LOC, W_LOCATION, ALPHA_Q,
              B_LOCATION, FAMILY_MASK, ATTN_MASK, GRAD_ALPHA_Q}, .nreq = 5,
     .outs = {{.id = Y_DQUERY, .shape = "(..., Tq?, Hq)", .like = X_QUERY},
              {.id = Y_DVALUES, .shape = "(..., T, Hv)", .like = X_VALUES},
              RES(Y_DW, "(L, Hq)"), RES_IF(Y_DB, "(L,)", X_B)},
     LOCATION},
    {.name = "cosine_attention",
     .args = {QUERY_DOT, KEYS, FAMILY_MASK, ATTN_MASK, CAUSAL, BIAS, DROPOUT,
              SEED, VALUES, SHARPNESS, RETURN_WEIGHTS, VARIANTS}, .nreq = 2,
     .outs = {STREAM_OUTS}, FAMILY(ATT_SCORE_COSINE)},
    {.name = "cosine_attention_backward",
     .args = {GRAD_OUT_Q, QUERY_DOT, KEYS, ALPHA_OPT, SAVED, FAMILY_MASK,
              ATTN_MASK, CAUSAL, BIAS, DROPOUT, SEED, VALUES, SHARPNESS,
              GRAD_ALPHA_Q, VARIANTS}, .nreq = 3, .npos = 4,
     .outs = {FAMILY_GRADS("H"), DSHARPNESS, DBIAS, VARIANT_GRADS},
     FAMILY(ATT_SCORE_COSINE)},
    {.name = "project_keys",
     .args = {KEYS, ARR(X_W, "(A, L)")}, .nreq = 2,
     .order = {X_KEYS}, .outs = {RES(Y_KEY_PROJ, "(..., T, A)")},
     .fused = 1, .check = check_project, .workspace = w_project,
     .kernel = k_project_keys},
    {.name = "project_keys_backward",
     .args = {ARR(X_GRAD_PROJ, "(..., T, A)"), KEYS, ARR(X_W, "(A, L)")},
     .nreq = 3, .order = {X_KEYS, X_W},
     .outs = {RES(Y_DKEYS, "(..., T, H)"), RES(Y_DW, "(A, L)")},
     .fused = 1, .check = check_project, .workspace = w_project,
     .kernel = k_project_keys_backward},
};

#define N_FUNCS ((int)(sizeof(funcs) / sizeof(funcs[0])))
const int n_funcs = N_FUNCS;
