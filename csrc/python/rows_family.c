/*
 * rows_family.c - the kernel calls of the table's rows of the attention
 * family (FAMILY, LOCATION) and of the key projection (PROJECT): their
 * sizes and views from the bound symbols, the checks that their shapes
 * alone do not make (masks against alpha, packed segments, dropout, the
 * saved forward), their scratch and their kernel calls.  table.c's rows
 * name them; the generic driver (call.c) calls them.
 */
#include "binding.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* att_NAME_f32 or att_NAME_f64 for the call's dtype. */
#define TYPED(c, NAME, ...)                                                  \
    ((c)->typenum == NPY_FLOAT ? att_##NAME##_f32(__VA_ARGS__)               \
                               : att_##NAME##_f64(__VA_ARGS__))
#define IN(id) arg_data(c, id)
#define OUT(id) out_data(c, id)

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

/* The family's sizes from the bound symbols. */
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

ptrdiff_t w_family(Call *c)
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

int k_family(Call *c)
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
int k_location(Call *c)
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
        if (x[k] < x[k - 1]) {
            PyErr_Format(PyExc_ValueError, "%s must never decrease (the "
                         "starts of the packed segments, then the total "
                         "%zd); got %s[%zd] = %lld after %lld", name,
                         (Py_ssize_t)end, name, (Py_ssize_t)k,
                         (long long)x[k], (long long)x[k - 1]);
            return -1;
        }
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
int check_family(Call *c)
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
int check_location(Call *c)
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
int check_project(Call *c)
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

ptrdiff_t w_project(Call *c)
{
    return TYPED(c, project_keys_workspace, project_dims(c), &c->ex);
}

int k_project_keys(Call *c)
{
    return TYPED(c, project_keys, project_dims(c), &c->ex, IN(X_KEYS),
                 IN(X_W), c->sym[S_L], OUT(Y_KEY_PROJ), c->work);
}

int k_project_keys_backward(Call *c)
{
    return TYPED(c, project_keys_backward, project_dims(c), &c->ex,
                 IN(X_GRAD_PROJ), IN(X_KEYS), IN(X_W), c->sym[S_L],
                 OUT(Y_DKEYS), OUT(Y_DW), c->work);
}

#undef TYPED
#undef IN
#undef OUT
