/*
 * call.c - the generic half of the binding: call_function, the same steps
 * for every row of the table (table.c):
 *   1. take the arguments (METH_FASTCALL; parse.c);
 *   2. view each array argument as an array, without copying, and check
 *      its dtype (parse.c);
 *   3. check every shape on the arrays as given, binding the symbols of
 *      the patterns (shapes.c);
 *   4. only then cast the floating arguments to one computing dtype
 *      (float32 or float64, promoted as np.result_type does), C-contiguous
 *      and aligned, copying only when they are not already, and make the
 *      views (views.c); a backward's alpha is checked against its masks;
 *   5. allocate the outputs and the kernel's scratch, every byte count
 *      checked first;
 *   6. run the kernel with the GIL released, then clean up on one path.
 * Leading batch axes (...) are flattened into B: after step 4 the data is
 * contiguous, so (..., T, H) is (B, T, H) without a copy.
 * The state the calls share (scratch, instruction set, threads) is
 * state.c's.
 */
#include "binding.h"

#include <math.h>

/* Whether key t is in query i's range by causal, the window and the
 * packed segments (the kernels' key_range, family/visibility.inc). */
static int in_range(const Call *c, npy_intp i, npy_intp t)
{
    npy_intp q0 = 0, nq = c->several ? c->sym[S_TQ] : 1, k0 = 0;
    npy_intp nk = c->sym[S_T];
    if (given(c, X_CU_SEQLENS_Q)) {       /* int64 by check_variants */
        const int64_t *cq = arg_data(c, X_CU_SEQLENS_Q);
        const int64_t *ck = arg_data(c, X_CU_SEQLENS_K);
        npy_intp s = 0;
        while (s + 2 < c->sym[S_N] && cq[s + 1] <= i) {
            s++;
        }
        q0 = (npy_intp)cq[s];
        nq = (npy_intp)cq[s + 1] - q0;
        k0 = (npy_intp)ck[s];
        nk = (npy_intp)ck[s + 1] - k0;
        if (t < k0 || t >= k0 + nk) {
            return 0;
        }
    }
    npy_intp ip = i - q0 + (nk - nq), tl = t - k0;
    if (given(c, X_CAUSAL) && tl > ip) {
        return 0;
    }
    if (given(c, X_WINDOW)) {
        /* (distances against sides: a side near PTRDIFF_MAX, which
         * stands for unbounded, must not overflow) */
        return (c->window[0] < 0 || ip - tl <= c->window[0]) &&
               (c->window[1] < 0 || tl - ip <= c->window[1]);
    }
    return 1;
}

/* Whether key t is visible to query i of sequence b: the key mask, the
 * attn_mask, its range (causal, window, segments) and a bias of -inf
 * (it masks) all allow it. */
static int visible(const Call *c, npy_intp b, npy_intp i, npy_intp t)
{
    const FuncSpec *fn = c->fn;
    npy_intp T = c->sym[S_T];
    int im = fn->pos[X_MASK], ia = fn->pos[X_ATTN_MASK];
    int ib = fn->pos[X_BIAS];
    if (!in_range(c, i, t)) {
        return 0;
    }
    for (int k = 0; k < 2; k++) {
        int x = k == 0 ? im : ia;
        if (x < 0 || c->arr[x] == NULL) {
            continue;
        }
        const att_view *v = &c->view[x];
        const unsigned char *m = PyArray_DATA(c->arr[x]);
        /* a view, or (the pooling layer's) a C-contiguous (B, T) mask */
        if (!(v->p != NULL ? m[v->off[b] + i * v->rs + t * v->cs]
                           : m[b * T + t])) {
            return 0;
        }
    }
    if (ib >= 0 && c->arr[ib] != NULL) {
        const att_view *v = &c->view[ib];
        ptrdiff_t e = v->off[b] + i * v->rs + t * v->cs;
        double bias = c->typenum == NPY_FLOAT
                      ? (double)((const float *)v->p)[e]
                      : ((const double *)v->p)[e];
        return bias != -INFINITY;
    }
    return 1;
}

/* alpha[k] == 0, for either computing dtype. */
static int alpha_zero(const Call *c, const void *alpha, npy_intp k)
{
    return c->typenum == NPY_FLOAT ? ((const float *)alpha)[k] == 0
                                   : ((const double *)alpha)[k] == 0;
}

/* The first k in [k0, k1) where alpha is 0, or k1: the scan of a call
 * without masks, where every key is visible. */
static npy_intp first_zero(const Call *c, const void *alpha, npy_intp k0,
                           npy_intp k1)
{
    if (c->typenum == NPY_FLOAT) {
        const float *a = alpha;
        for (npy_intp k = k0; k < k1; k++) {
            if (a[k] == 0) {
                return k;
            }
        }
        return k1;
    }
    const double *a = alpha;
    for (npy_intp k = k0; k < k1; k++) {
        if (a[k] == 0) {
            return k;
        }
    }
    return k1;
}

/* The error of check_alpha at flat index k of alpha. */
static int bad_alpha(const Call *c, npy_intp k, int zero, int valid,
                     int masks)
{
    PyArrayObject *alpha = c->arr[c->fn->pos[X_ALPHA]];
    npy_intp idx[NPY_MAXDIMS + 2];
    char at[SHAPE_BUF];
    npy_intp r = k;
    for (int d = PyArray_NDIM(alpha) - 1; d >= 0; d--) {
        idx[d] = r % PyArray_DIM(alpha, d);
        r /= PyArray_DIM(alpha, d);
    }
    fmt_shape(at, SHAPE_BUF, PyArray_NDIM(alpha), idx);
    PyErr_Format(PyExc_ValueError,
                 "%s: alpha at %s is %s but %s; alpha must be the "
                 "forward's output for the same masks (its weights are "
                 "exactly 0 where%s a key is not visible)%s",
                 c->fn->name, at, zero ? "0" : "nonzero",
                 !masks ? "no mask was given"
                 : valid ? "the masks make that key visible"
                 : "the masks hide that key",
                 c->fn->family ? "ver" : ", and only where,",
                 !masks ? ": pass the masks the forward used" : "");
    return -1;
}

/* Step 4b, for a backward given alpha and masks: alpha must be the
 * forward's for these masks.  The forward's alpha is exactly 0 where a key
 * is not visible (and on rows with no visible key).  The pooled layer's is
 * also never 0 where one is (ref/formulas.h WEIGHT_FLOOR); the family's
 * may be, where a weight is below the least normal number (WEIGHT_FLUSH:
 * no denormal, ever), so for the family alpha need only be nonzero ONLY
 * where visible.  So a backward called with masks its forward lacked, or
 * (the pooled layer) without the masks it had, is caught here instead of
 * returning gradients that are silently wrong.  Runs on every backward:
 * loops over (b, i, t) rather than dividing a flat index (three divisions
 * an element were a third of a tiny backward's fixed cost), and without
 * masks only looks for a zero (the pooled layer) or nothing (the
 * family). */
static int check_alpha(const Call *c)
{
    int ia = c->fn->pos[X_ALPHA];
    if (ia < 0 || c->arr[ia] == NULL || !is_backward(c->fn) ||
        c->fn->pos[X_MASK] < 0) {
        return 0;
    }
    PyArrayObject *alpha = c->arr[ia];
    const void *a = PyArray_DATA(alpha);
    int masks = given(c, X_MASK) || given(c, X_ATTN_MASK) ||
                given(c, X_BIAS) || given(c, X_CAUSAL) ||
                given(c, X_WINDOW) || given(c, X_CU_SEQLENS_Q);
    npy_intp Tq = c->several ? c->sym[S_TQ] : 1, T = c->sym[S_T];
    npy_intp n = PyArray_SIZE(alpha);
    if (!masks && c->fn->family) {     /* every key visible: any alpha */
        return 0;
    }
    if (!masks) {
        npy_intp k = first_zero(c, a, 0, n);
        return k < n ? bad_alpha(c, k, 1, 1, 0) : 0;
    }
    if (Tq * T <= 0) {
        return 0;
    }
    for (npy_intp b = 0, k = 0; k < n; b++) {
        for (npy_intp i = 0; i < Tq; i++) {
            for (npy_intp t = 0; t < T; t++, k++) {
                int zero = alpha_zero(c, a, k);
                int valid = visible(c, b, i, t);
                if (zero != !valid && (!valid || !c->fn->family)) {
                    return bad_alpha(c, k, zero, valid, masks);
                }
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------
 * Step 5: outputs and scratch
 */

/* The shape of output k; returns its number of axes. */
static int out_shape(const Call *c, int k, npy_intp *dims)
{
    const Pattern *p = &c->fn->outs[k].pat;
    int nd = 0, like = c->fn->outs[k].like;
    if (like != X_NONE) {       /* a gradient of an argument's shape */
        PyArrayObject *x = c->arr[c->fn->pos[like]];
        for (int j = 0; x != NULL && j < PyArray_NDIM(x); j++) {
            dims[nd++] = PyArray_DIM(x, j);
        }
        return nd;
    }
    return pattern_dims(c, p, p->lead, dims);
}

static int wanted(const Call *c, int k)
{
    int when = c->fn->outs[k].when, unless = c->fn->outs[k].unless;
    return (when == X_NONE || (given(c, when) && !as_number(c, when))) &&
           (unless == X_NONE || !given(c, unless));
}

/* The scratch bytes of the call (-1: overflow).  A decoder calls with
 * the same sizes at every step: the last call's count is kept per row
 * (under the GIL) and the kernels' sizing, 5% of a small call, is
 * skipped when nothing it reads changed. */
/* A family call with several queries, none of them (Tq = 0): no kernel
 * runs; its outputs are empty, its gradients 0. */
static int no_queries(const Call *c)
{
    return c->fn->family && c->several && c->sym[S_TQ] == 0;
}

static ptrdiff_t work_size(Call *c)
{
    FuncSpec *fn = (FuncSpec *)c->fn;     /* a row of funcs, not const */
    WorkKey key;
    size_t used = offsetof(WorkKey, arg) + (size_t)fn->nargs *
                                            sizeof(WorkArg);
    memset(&key, 0, used);
    memcpy(key.sym, c->sym, sizeof key.sym);
    key.B = c->d.B;
    key.pool = c->ex.pool;
    for (int i = 0; i < fn->nargs; i++) {
        key.arg[i].size = c->arr[i] != NULL ? PyArray_SIZE(c->arr[i]) : -1;
        key.arg[i].nseq = c->idx[i] != NULL ? c->nseq[i] : 0;
        key.arg[i].given = given(c, fn->args[i].id);
        key.arg[i].store = c->store[i];
    }
    key.window[0] = c->window[0];
    key.window[1] = c->window[1];
    key.typenum = c->typenum;
    key.several = c->several;
    key.bias_shared = c->bias_shared;
    key.stream = stream_of(c);
    key.io16 = c->io16;                  /* 16 bits widened by blocks */
    key.simd = c->ex.simd;
    key.precision = c->ex.precision;     /* the bf16 kernels' scratch */
    key.bf16 = c->ex.bf16;
    key.threads = c->ex.threads;
    key.pool_threads = c->ex.pool != NULL ? att_pool_threads(c->ex.pool) : 0;
    if (fn->work_bytes > 0 && memcmp(&key, &fn->work_key, used) == 0) {
        return fn->work_bytes;
    }
    ptrdiff_t bytes = fn->workspace(c);
    if (bytes > 0) {
        memcpy(&fn->work_key, &key, used);
        fn->work_bytes = bytes;
    }
    return bytes;
}

/* Whether output k is made in float32 and rounded to the call's 16-bit
 * dtype after (round_outputs): not the log-sum-exp, which stays float32,
 * nor the out of a kernel that writes it so (settle16). */
static int rounded(const Call *c, int k)
{
    int id = c->fn->outs[k].id;
    return c->ret != NULL && id != Y_LSE && !(c->io16 && id == Y_OUT);
}

/* Makes the wanted outputs and the scratch.  Every byte count is checked
 * before anything is allocated, so sizes that overflow give MemoryError
 * without touching memory.  On failure what was made is left in c for
 * the cleanup path. */
static int make_outputs(Call *c)
{
    const FuncSpec *fn = c->fn;
    npy_intp dims[MAX_OUTS][NPY_MAXDIMS + MAX_AXES];
    int nds[MAX_OUTS];
    char buf[SHAPE_BUF];
    size_t item = c->typenum == NPY_FLOAT ? 4 : 8;
    for (int k = 0; k < fn->nouts; k++) {
        int nd = nds[k] = out_shape(c, k, dims[k]);
        size_t bytes = item;
        int overflow = 0;
        for (int j = 0; j < nd; j++) {   /* zero dims are skipped, as NumPy
                                            does */
            if (dims[k][j] != 0) {
                overflow |= __builtin_mul_overflow(bytes,
                                                   (size_t)dims[k][j],
                                                   &bytes);
            }
        }
        overflow |= bytes > (size_t)PY_SSIZE_T_MAX;
        if (wanted(c, k) && overflow) {
            PyErr_Format(PyExc_MemoryError,
                         "attention_c: output %s of shape %s would need more "
                         "bytes than memory can address",
                         out_names[fn->outs[k].id],
                         fmt_shape(buf, SHAPE_BUF, nd, dims[k]));
            return -1;
        }
    }
    ptrdiff_t work_bytes = fn->workspace && !no_queries(c) ? work_size(c)
                                                           : 0;
    if (work_bytes < 0) {
        PyErr_SetString(PyExc_MemoryError,
                        "attention_c: sizes too large for scratch memory");
        return -1;
    }
    size_t kept = 0;             /* rounded by round_outputs: see keep */
    for (int k = 0; k < fn->nouts && c->ret != NULL; k++) {
        if (wanted(c, k) && rounded(c, k)) {
            kept += kept_bytes(nds[k], dims[k]);
        }
    }
    kept_reserve(c, KEEP_OUT, kept);
    for (int k = 0; k < fn->nouts; k++) {
        if (!wanted(c, k)) {
            continue;
        }
        if (ALLOC_POINT("output", out_names[fn->outs[k].id], 1) < 0) {
            return -1;
        }
        if (rounded(c, k)) {
            c->out[k] = kept_array(c, KEEP_OUT, nds[k], dims[k]);
        }
        else if (c->io16 && fn->outs[k].id == Y_OUT) {  /* written so */
            Py_INCREF(c->ret);      /* PyArray_NewFromDescr steals it */
            c->out[k] = output_array(nds[k], dims[k], c->ret);
        }
        else {
            c->out[k] = output_array(nds[k], dims[k],
                                     PyArray_DescrFromType(c->typenum));
        }
        if (c->out[k] == NULL) {
            return -1;
        }
    }
    if (fn->workspace != NULL && !no_queries(c)) {
        if (ALLOC_POINT("scratch", "memory", 1) < 0) {
            return -1;
        }
        c->work = keep_take(KEEP_WORK, (size_t)work_bytes + 1);
        if (c->work == NULL) {
            PyErr_Format(PyExc_MemoryError, "attention_c: no memory for "
                         "the %zd bytes of %s's scratch",
                         (Py_ssize_t)work_bytes, c->fn->name);
            return -1;
        }
    }
    return 0;
}

int check_status(int st)
{
    if (st == ATT_OK) {
        return 0;
    }
    PyErr_Format(PyExc_SystemError,
                 "attention_c: a kernel rejected its sizes (status %d); "
                 "this is a bug, please report it", st);
    return -1;
}

/* r = (fields..., extra) as the named tuple grads of the fields, alone
 * or followed by the extra output: (grads, extra).  Steals r. */
static PyObject *as_grads(PyObject *r, int nfields, PyTypeObject *grads)
{
    Py_ssize_t n = PyTuple_GET_SIZE(r);
    PyObject *fields = n > nfields ? PyTuple_GetSlice(r, 0, nfields)
                                   : Py_NewRef(r);
    PyObject *args = fields != NULL ? PyTuple_Pack(1, fields) : NULL;
    /* tuple.__new__(grads, fields), what namedtuple's _make does */
    PyObject *g = args != NULL ? PyTuple_Type.tp_new(grads, args, NULL)
                               : NULL;
    PyObject *result = g;
    if (g != NULL && n > nfields) {
        result = PyTuple_Pack(2, g, PyTuple_GET_ITEM(r, nfields));
        Py_DECREF(g);
    }
    Py_XDECREF(args);
    Py_XDECREF(fields);
    Py_DECREF(r);
    return result;
}

/* A valid item's weight is never 0 (the contract's rule 2: float32's
 * floor is its smallest normal), but a float32 weight below 2^-25 rounds
 * to 0 in float16: such weights become float16's smallest subnormal,
 * 2^-24, so that the weights' zeros are still the masked items (which a
 * backward given them checks). */
static void keep_weights_positive(npy_intp n, const float *w, uint16_t *h)
{
    for (npy_intp i = 0; i < n; i++) {
        if (h[i] == 0 && w[i] > 0) {
            h[i] = 1;
        }
    }
}

/* The outputs (C-contiguous float32, make_outputs) in the inputs' 16-bit
 * dtype (c->ret), rounded to nearest even by the kernels' conversion
 * (att_convert16); the log-sum-exp stays float32. */
static int round_outputs(Call *c)
{
    for (int k = 0; c->ret != NULL && k < c->fn->nouts; k++) {
        if (c->out[k] == NULL || !rounded(c, k)) {
            continue;
        }
        PyArrayObject *o = (PyArrayObject *)c->out[k];
        if (ALLOC_POINT("rounding of", out_names[c->fn->outs[k].id], 1) < 0) {
            return -1;
        }
        Py_INCREF(c->ret);          /* PyArray_NewFromDescr steals it */
        PyObject *r = output_array(PyArray_NDIM(o), PyArray_DIMS(o),
                                   c->ret);
        if (r == NULL) {
            return -1;
        }
        if (convert_on_threads(&c->ex, half_store(c->ret), 0,
                               PyArray_SIZE(o), PyArray_DATA(o),
                               PyArray_DATA((PyArrayObject *)r)) != ATT_OK) {
            Py_DECREF(r);
            return check_status(ATT_EINVAL);
        }
        if (c->fn->outs[k].id == Y_ALPHA &&
            half_store(c->ret) == ATT_STORE_F16) {
            keep_weights_positive(PyArray_SIZE(o), PyArray_DATA(o),
                                  PyArray_DATA((PyArrayObject *)r));
        }
        Py_SETREF(c->out[k], r);
    }
    return 0;
}

/* The result: one array, or a tuple with None for outputs not made; the
 * public function of a backward gives its named tuple (grads). */
static PyObject *take_result(Call *c, PyTypeObject *grads)
{
    const FuncSpec *fn = c->fn;
    if (round_outputs(c) < 0) {
        return NULL;
    }
    if (fn->nouts == 1) {
        PyObject *r = c->out[0];
        c->out[0] = NULL;
        return r;
    }
    int n = 0;
    for (int k = 0; k < fn->nouts; k++) {
        n += wanted(c, k) || !fn->outs[k].drop;
    }
    PyObject *r = PyTuple_New(n);
    if (r == NULL) {
        return NULL;
    }
    for (int k = 0, j = 0; k < fn->nouts; k++) {
        if (wanted(c, k)) {
            PyTuple_SET_ITEM(r, j++, c->out[k]);
            c->out[k] = NULL;
        }
        else if (!fn->outs[k].drop) {
            PyTuple_SET_ITEM(r, j++, Py_NewRef(Py_None));
        }
    }
    return grads != NULL ? as_grads(r, fn->nfields, grads) : r;
}

/* Whether the kernel's work is so small (under 2^14 multiply-adds,
 * counted generously: B Tq T (H + Hq + Hv + 1)(A + 1)) that it runs with
 * the GIL held: releasing and taking it back costs more than another
 * thread could gain in the time.  Such a call never uses the pool (see
 * exec_threads) and never waits on anything. */
static int tiny_call(const Call *c)
{
    double tq = c->several ? (double)c->sym[S_TQ] : 1.0;
    double w = (double)c->d.B * tq * (double)c->sym[S_T] *
               (double)(c->sym[S_H] + c->sym[S_HQ] + c->sym[S_HV] + 1) *
               (double)(c->sym[S_A] + 1);
    for (int i = 0; i < c->fn->nargs; i++) {   /* and little to read */
        if (c->arr[i] != NULL && PyArray_SIZE(c->arr[i]) > 4096) {
            return 0;
        }
    }
    return w < (double)(1 << 14);
}

/* A bfloat16 call (every floating input bfloat16) takes bf16 products
 * where the kernels have fast ones, as set_fp32_precision("bf16") lets a
 * float32 call: its operands are bf16 already. */
static int exec_for_dtype(Call *c)
{
    if (c->fn->fused && c->ret != NULL &&
        half_store(c->ret) == ATT_STORE_BF16) {
        c->ex.precision = ATT_PRECISION_BF16;
    }
    return 0;
}

/* Steps 1-6 for the function of row fn; grads: see take_result. */
PyObject *call_function(const FuncSpec *fn, PyObject *const *args,
                        Py_ssize_t nargs, PyObject *kwnames,
                        PyTypeObject *grads)
{
    Call c;
    PyObject *result = NULL;
    int st = ATT_OK;
    memset(&c, 0, sizeof c);
    c.fn = fn;
    c.lead_binder = -1;
    for (int s = 0; s < N_SYMS; s++) {
        c.binder[s] = -1;
    }
    if (fn->fused) {
        c.ex = begin_exec();
    }
    if (take_args(&c, args, nargs, kwnames) < 0 || view_args(&c) < 0 ||
        check_shapes(&c) < 0 || (fn->check && fn->check(&c) < 0) ||
        cast_args(&c) < 0 || exec_for_dtype(&c) < 0 || make_views(&c) < 0 ||
        check_alpha(&c) < 0 || settle16(&c) < 0 || make_outputs(&c) < 0) {
        goto done;
    }
    if (no_queries(&c)) {
        for (int k = 0; k < fn->nouts; k++) {
            if (c.out[k] != NULL) {
                PyArrayObject *o = (PyArrayObject *)c.out[k];
                memset(PyArray_DATA(o), 0, (size_t)PyArray_NBYTES(o));
            }
        }
    }
    else if (tiny_call(&c)) {
        st = fn->kernel(&c);        /* see tiny_call */
    }
    else {
        Py_BEGIN_ALLOW_THREADS
        st = fn->kernel(&c);
        Py_END_ALLOW_THREADS
    }
    if (check_status(st) == 0) {
        result = take_result(&c, grads);
    }
done:
    if (fn->fused) {
        end_exec(&c.ex);
    }
    /* only the row's arguments and outputs can hold anything; most hold
     * nothing, and a call of PyMem_Free(NULL) per slot was 0.1 us */
    for (int i = 0; i < fn->nargs; i++) {
        Py_XDECREF(c.arr[i]);
        if (c.offs[i] != NULL) {
            PyMem_Free(c.offs[i]);
        }
        if (c.idx[i] != NULL) {
            PyMem_Free(c.idx[i]);
        }
    }
    if (c.doffs != NULL || c.order != NULL || c.gstart != NULL ||
        c.goffs[0] != NULL || c.goffs[1] != NULL || c.goffs[2] != NULL) {
        PyMem_Free(c.doffs);
        PyMem_Free(c.goffs[0]);
        PyMem_Free(c.goffs[1]);
        PyMem_Free(c.goffs[2]);
        PyMem_Free(c.order);
        PyMem_Free(c.gstart);
    }
    for (int k = 0; k < fn->nouts; k++) {
        Py_XDECREF(c.out[k]);
    }
    Py_XDECREF(c.ret);
    keep_give(KEEP_WORK, c.work);        /* after the arrays in them */
    keep_give(KEEP_WIDE, c.kept[KEEP_WIDE]);
    keep_give(KEEP_OUT, c.kept[KEEP_OUT]);
    return result;
}

