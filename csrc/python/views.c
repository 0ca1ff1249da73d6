/*
 * views.c - step 4 of a call: the arrays as the kernels read them.  The
 * floating arguments cast to one computing dtype, C-contiguous and
 * aligned, copying only when they are not already; but read where they
 * are: the masks and the bias, as views that broadcast by NumPy's rules
 * (offsets per sequence, strides 0 where they repeat), a decoder's keys
 * and values (rows with a stride), the family's inputs whose leading axes
 * broadcast against each other (an index per sequence), and the groups of
 * sequences that share an input (their gradients sum in order).
 */
#include "binding.h"

/* A table of n sequence offsets: sequence b's index (in C order over nd
 * axes of sizes dims) times the strides st, summed.  NULL with the
 * exception set. */
static ptrdiff_t *offset_table(npy_intp n, int nd, const npy_intp *dims,
                               const npy_intp *st)
{
    ptrdiff_t *off = PyMem_Malloc((size_t)(n > 0 ? n : 1) *
                                  sizeof(ptrdiff_t));
    if (off == NULL) {
        PyErr_Format(PyExc_MemoryError, "attention_c: no memory for the "
                     "offsets of %zd sequences", (Py_ssize_t)n);
        return NULL;
    }
    for (npy_intp b = 0; b < n; b++) {
        npy_intp r = b, o = 0;
        for (int k = nd - 1; k >= 0; k--) {
            o += (r % dims[k]) * st[k];
            r /= dims[k];
        }
        off[b] = o;
    }
    return off;
}

/* Step 4, the family's keys or values (argument i): whether the call
 * reads them where they are (attention.h, att_family_reads_strided:
 * decoding), needing no cast: the computing dtype or a 16-bit one the
 * kernel reads as stored (*store), native and aligned, the last axis
 * contiguous, every stride whole elements.  No side effect. */
static int reads_in_place(const Call *c, int i, int *store)
{
    const FuncSpec *fn = c->fn;
    PyArrayObject *x = c->arr[i];
    int id = fn->args[i].id, nd = PyArray_NDIM(x);
    if (!fn->family || (id != X_KEYS && id != X_VALUES) || nd < 2) {
        return 0;
    }
    att_fdims f = {.score = fn->score,
                   .Tq = c->several ? c->sym[S_TQ] : 1};
    int backward = is_backward(fn);
    int what = c->typenum == NPY_FLOAT
               ? att_family_reads_strided_f32(&f, backward)
               : att_family_reads_strided_f64(&f, backward);
    npy_intp item = PyArray_ITEMSIZE(x);
    /* 16-bit keys and values read as stored, where the kernel can */
    *store = what & (id == X_KEYS ? ATT_STORED16_KEYS
                                  : ATT_STORED16_VALUES)
             ? half_store(PyArray_DESCR(x)) : ATT_STORE_NATIVE;
    if (!(what & (id == X_KEYS ? ATT_STRIDED_KEYS : ATT_STRIDED_VALUES)) ||
        (PyArray_TYPE(x) != c->typenum && *store == ATT_STORE_NATIVE) ||
        !PyArray_ISNOTSWAPPED(x) ||
        !PyArray_ISALIGNED(x) ||
        (PyArray_DIM(x, nd - 1) > 1 && PyArray_STRIDE(x, nd - 1) != item) ||
        (PyArray_DIM(x, nd - 2) > 1 && PyArray_STRIDE(x, nd - 2) == 0)) {
        return 0;           /* (a row stride of 0 means "H" to the C) */
    }
    for (int k = 0; k < nd; k++) {
        if (PyArray_STRIDE(x, k) % item != 0) {
            return 0;
        }
    }
    return 1;
}

/* Argument i read where it is (reads_in_place): c->offs[i] gets the
 * offset of each of its own sequences (its leading axes in C order) and
 * c->view[i].rs the rows' stride, in elements; returns 1, 0 when it must
 * be copied, -1 on error. */
static int read_rows(Call *c, int i)
{
    int store;
    if (!reads_in_place(c, i, &store)) {
        return 0;
    }
    PyArrayObject *x = c->arr[i];
    int nd = PyArray_NDIM(x);
    npy_intp item = PyArray_ITEMSIZE(x), n = 1, st[NPY_MAXDIMS];
    for (int k = 0; k < nd; k++) {
        st[k] = PyArray_STRIDE(x, k) / item;
        n *= k < nd - 2 ? PyArray_DIM(x, k) : 1;
    }
    if (ALLOC_POINT("offsets of", arg_names[c->fn->args[i].id], 1) < 0) {
        return -1;
    }
    c->offs[i] = offset_table(n, nd - 2, PyArray_DIMS(x), st);
    if (c->offs[i] == NULL) {
        return -1;
    }
    c->view[i] = (att_view){PyArray_DATA(x), c->offs[i], 0,
                            PyArray_DIM(x, nd - 2) > 1
                            ? PyArray_STRIDE(x, nd - 2) / item : 0, 1};
    c->store[i] = store;
    return 1;
}

/* Step 4a: each view as the kernels read it (attention.h att_view): per
 * sequence b of the call's leading axes, the offset of its first element;
 * the strides of its query and key axes, in elements (0 where it
 * repeats). */

/* Argument i (whose leading axes are the call's or 1) as a view with the
 * call's leading axes: stride 0 along the ones it broadcasts. */
static int broadcast_lead(Call *c, int i)
{
    PyArrayObject *x = c->arr[i];
    int nd = PyArray_NDIM(x), same = 1;
    npy_intp dims[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    for (int k = 0; k < nd; k++) {
        int lead = k < c->nlead;
        dims[k] = lead ? c->lead[k] : PyArray_DIM(x, k);
        strides[k] = lead && PyArray_DIM(x, k) != dims[k]
                     ? 0 : PyArray_STRIDE(x, k);
        same &= dims[k] == PyArray_DIM(x, k);
    }
    if (same) {
        return 0;
    }
    if (ALLOC_POINT("broadcast of", arg_names[c->fn->args[i].id], 1) < 0) {
        return -1;
    }
    PyArray_Descr *dt = PyArray_DESCR(x);
    Py_INCREF(dt);
    PyObject *view = PyArray_NewFromDescr(&PyArray_Type, dt, nd, dims,
                                          strides, PyArray_DATA(x), 0, NULL);
    if (view == NULL) {
        return -1;
    }
    Py_INCREF(x);
    if (PyArray_SetBaseObject((PyArrayObject *)view, (PyObject *)x) < 0) {
        Py_DECREF(view);
        return -1;
    }
    Py_SETREF(c->arr[i], (PyArrayObject *)view);
    return 0;
}

/* The call's dtype from its floating arguments' (neither all float32
 * nor all float64).  16-bit ones compute in float32 (with the others,
 * as a float32 would: NumPy cannot promote bfloat16 with float16 or an
 * integer) and, when every one has the same 16-bit dtype, the results
 * come back in it (c->ret); otherwise np.result_type of them: float16
 * and float32 compute in float32, the rest (integers) in float64. */
static int result_type(Call *c, int count, PyArrayObject **arrs)
{
    PyArrayObject *full[MAX_ARGS];
    PyArray_Descr *half = NULL;
    int nfull = 0, nhalf = 0, mixed = 0;
    for (int k = 0; k < count; k++) {
        PyArray_Descr *dt = PyArray_DESCR(arrs[k]);
        if (half_store(dt) == ATT_STORE_NATIVE) {
            full[nfull++] = arrs[k];
            continue;
        }
        mixed |= half != NULL && half_store(half) != half_store(dt);
        half = dt;
        nhalf++;
    }
    if (nfull == 0) {
        c->typenum = NPY_FLOAT;
        if (!mixed) {
            c->ret = (PyArray_Descr *)Py_NewRef(half);
        }
        return 0;
    }
    PyArray_Descr *f32 = PyArray_DescrFromType(NPY_FLOAT);
    PyArray_Descr *rt = PyArray_ResultType(nfull, full, nhalf > 0,
                                           &f32);
    Py_DECREF(f32);
    if (rt == NULL) {
        return -1;
    }
    c->typenum = rt->kind == 'f' && PyDataType_ELSIZE(rt) <= 4
                 ? NPY_FLOAT : NPY_DOUBLE;
    Py_DECREF(rt);
    return 0;
}

/* Argument i, a C-contiguous 16-bit array of a float32 call, widened to
 * float32 (in the call's kept buffer: kept_array) by the kernels'
 * conversion (att_convert16: NumPy's cast of float16 takes a few ns an
 * element, ours a fraction of one).
 * Returns 1 when done, 0 when i is not such an array (NumPy casts it),
 * -1 on error. */
static int widen_half(Call *c, int i)
{
    PyArrayObject *a = c->arr[i];
    int store = half_store(PyArray_DESCR(a));
    if (store == ATT_STORE_NATIVE || c->typenum != NPY_FLOAT ||
        !PyArray_ISCARRAY_RO(a)) {
        return 0;
    }
    PyObject *w = kept_array(c, KEEP_WIDE, PyArray_NDIM(a),
                             PyArray_DIMS(a));
    if (w == NULL) {
        return -1;
    }
    if (convert_on_threads(&c->ex, store, 1, PyArray_SIZE(a),
                           PyArray_DATA(a),
                           PyArray_DATA((PyArrayObject *)w)) != ATT_OK) {
        Py_DECREF(w);
        PyErr_SetString(PyExc_SystemError,
                        "attention_c: the 16-bit conversion failed");
        return -1;
    }
    Py_SETREF(c->arr[i], (PyArrayObject *)w);
    return 1;
}

/* Whether argument i is an input that the family's streamed forward or
 * backward may read as stored in 16 bits (settle16 asks the kernel once
 * the views are made), by what the call says (the kernel's conditions,
 * attention.h's att_family_takes16, but the values' finiteness: where
 * they fail, the copies settle16 makes are not in the kept buffer): a
 * bfloat16 or float16 call (every floating input in that dtype:
 * exec_for_dtype), the dot score streamed, the array C-contiguous in
 * the call's dtype: a forward's query, keys or values, with no bias,
 * dropout, softcap or ALiBi (a key mask only where it is padding, an
 * attn_mask only where its rows are runs of keys: the kernel checks); a
 * backward's, out or grad_out, with no sinks. */
static int may_stay16(const Call *c, int i)
{
    const FuncSpec *fn = c->fn;
    int id = fn->args[i].id;
    PyArrayObject *a = c->arr[i];
    int backward = is_backward(fn);
    int store = c->ret != NULL ? half_store(c->ret) : ATT_STORE_NATIVE;
    static const int forward_none[] = {X_BIAS, X_DROPOUT, X_SOFTCAP,
                                       X_ALIBI_SLOPES};
    for (size_t n = 0; !backward && n < sizeof forward_none /
                                         sizeof forward_none[0]; n++) {
        if (given(c, forward_none[n])) {
            return 0;
        }
    }
    if (backward && given(c, X_SINKS)) {
        return 0;
    }
    int input = id == X_QUERY || id == X_KEYS || id == X_VALUES ||
                (backward && (id == X_OUT || id == X_GRAD_OUT));
    int kind = store == ATT_STORE_BF16 || store == ATT_STORE_F16;
    return c->typenum == NPY_FLOAT && kind && fn->fused && fn->family &&
           !fn->location && fn->score == ATT_SCORE_DOT && stream_of(c) &&
           input && half_store(PyArray_DESCR(a)) == store &&
           PyArray_ISCARRAY_RO(a) && PyArray_ISNOTSWAPPED(a);
}

/* Step 4b, for a call that left its inputs in 16 bits (may_stay16):
 * the kernel reads them so if it can (family_takes16: this call's
 * options and finite values), else they are widened now. */
int settle16(Call *c)
{
    if (!c->maybe16) {
        return 0;
    }
    int all = is_backward(c->fn) ? 5 : 3;
    c->io16 = half_store(c->ret);   /* the question's store */
    if (__builtin_popcount(c->maybe16) != all || !family_takes16(c)) {
        c->io16 = ATT_STORE_NATIVE;
    }
    for (int i = 0; i < c->fn->nargs && !c->io16; i++) {
        if ((c->maybe16 >> i & 1) && widen_half(c, i) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Step 4: the floating arrays in one dtype (result_type), C-contiguous
 * and aligned, but for the keys and values a decoding call reads where
 * they are, as stored (read_rows), and a bfloat16 call's query, keys and
 * values that settle16 decides on; masks C-contiguous. */
int cast_args(Call *c)
{
    const FuncSpec *fn = c->fn;
    PyArrayObject *arrs[MAX_ARGS];
    int count = 0;
    for (int i = 0; i < fn->nargs; i++) {
        unsigned other = F_MASK | F_INDEX | F_FOLLOW;
        if (c->arr[i] != NULL && !(fn->args[i].flags & other)) {
            arrs[count++] = c->arr[i];
        }
    }
    /* every floating argument float32, or every one float64, in native
     * byte order (the usual call): that is the result type */
    int same = count > 0;
    for (int k = 0; k < count && same; k++) {
        same = PyArray_TYPE(arrs[k]) == PyArray_TYPE(arrs[0]) &&
               PyArray_ISNOTSWAPPED(arrs[k]);
    }
    c->typenum = NPY_DOUBLE;
    if (same && (PyArray_TYPE(arrs[0]) == NPY_FLOAT ||
                 PyArray_TYPE(arrs[0]) == NPY_DOUBLE)) {
        c->typenum = PyArray_TYPE(arrs[0]);
    }
    else if (count > 0 && result_type(c, count, arrs) < 0) {
        return -1;
    }
    size_t wide = 0;            /* the most widen_half can make: see keep */
    for (int i = 0; i < fn->nargs && c->typenum == NPY_FLOAT; i++) {
        PyArrayObject *a = c->arr[i];
        int store;
        if (a != NULL && !(fn->args[i].flags & (F_MASK | F_INDEX)) &&
            half_store(PyArray_DESCR(a)) != ATT_STORE_NATIVE &&
            !reads_in_place(c, i, &store) &&   /* a decoding step's cache */
            !may_stay16(c, i)) {       /* (widened later if need be) */
            wide += kept_bytes(PyArray_NDIM(a), PyArray_DIMS(a));
        }
    }
    kept_reserve(c, KEEP_WIDE, wide);
    for (int i = 0; i < fn->nargs; i++) {
        if (c->arr[i] == NULL || (fn->args[i].flags & F_INDEX)) {
            continue;           /* an index: int64 already (check_family) */
        }
        int mask = (fn->args[i].flags & F_MASK) != 0;
        if ((fn->args[i].flags & F_BCAST) && broadcast_lead(c, i) < 0) {
            return -1;
        }
        if (ALLOC_POINT("cast of", arg_names[fn->args[i].id], 1) < 0) {
            return -1;
        }
        PyArrayObject *a = c->arr[i];
        if (PyArray_TYPE(a) == (mask ? NPY_BOOL : c->typenum) &&
            PyArray_ISNOTSWAPPED(a) &&
            ((fn->args[i].flags & F_VIEW) ? PyArray_ISALIGNED(a)
                                         : PyArray_ISCARRAY_RO(a))) {
            continue;       /* as PyArray_FromArray would return it */
        }
        int rows = read_rows(c, i);        /* decoding: keys in place */
        if (rows == 0 && may_stay16(c, i)) {
            c->maybe16 |= 1u << i;
            continue;
        }
        if (rows == 0 && !mask) {
            rows = widen_half(c, i);
        }
        if (rows != 0) {
            if (rows < 0) {
                return -1;
            }
            continue;
        }
        PyObject *cast = PyArray_FromArray(
            c->arr[i], PyArray_DescrFromType(mask ? NPY_BOOL : c->typenum),
            NPY_ARRAY_IN_ARRAY | (mask ? 0 : NPY_ARRAY_FORCECAST));
        if (cast == NULL) {
            return -1;
        }
        Py_SETREF(c->arr[i], (PyArrayObject *)cast);
    }
    return 0;
}


/* Argument i as an att_view of the call's sequences (the array as it is,
 * or, `contiguous`, as a C-contiguous copy of it would be laid out: its
 * gradient); the offsets into *off (owned by the caller). */
static int make_view(Call *c, int i, int contiguous, att_view *v,
                     ptrdiff_t **off)
{
    PyArrayObject *x = c->arr[i];
    npy_intp want[NPY_MAXDIMS + MAX_AXES], st[NPY_MAXDIMS + MAX_AXES];
    npy_intp cst[NPY_MAXDIMS], item = PyArray_ITEMSIZE(x);
    int nt = view_target(c, i, want), nd = PyArray_NDIM(x);
    npy_intp run = 1;
    for (int k = nd - 1; k >= 0; k--) {          /* C-contiguous */
        cst[k] = run;
        run *= PyArray_DIM(x, k);
    }
    for (int k = 0; k < nt; k++) {     /* aligned: strides / item */
        int xk = k - (nt - nd);
        st[k] = xk < 0 || PyArray_DIM(x, xk) == 1 ? 0
                : contiguous ? cst[xk] : PyArray_STRIDE(x, xk) / item;
    }
    if (ALLOC_POINT("offsets of", arg_names[c->fn->args[i].id], 1) < 0) {
        return -1;
    }
    *off = offset_table(c->d.B, c->nlead, c->lead, st);
    if (*off == NULL) {
        return -1;
    }
    /* the key axis is last; the query axis, if any, before it */
    int with_q = nt - c->nlead == 2;
    *v = (att_view){PyArray_DATA(x), *off, 0, with_q ? st[nt - 2] : 0,
                    nt > c->nlead ? st[nt - 1] : 0};
    for (int k = 0; contiguous && c->fn->args[i].id == X_BIAS &&
                    k < c->nlead; k++) {
        /* the gradient sums over sequences that share an element */
        c->bias_shared |= st[k] == 0 && c->lead[k] > 1;
    }
    return 0;
}

/* The sequence of argument i (F_LEADB) that each of the call's reads,
 * into c->idx[i] (NULL when it has the call's leading axes), and the
 * number of its own sequences. */
static int make_index(Call *c, int i)
{
    PyArrayObject *x = c->arr[i];
    int present[MAX_AXES], nd = PyArray_NDIM(x);
    int nl = nd - axes_present(c, &c->fn->args[i], nd, present);
    npy_intp st[NPY_MAXDIMS], run = 1;
    int same = nl == c->nlead;
    for (int k = c->nlead - 1; k >= 0; k--) {   /* in sequences */
        int xk = k - (c->nlead - nl);
        npy_intp d = xk >= 0 ? PyArray_DIM(x, xk) : 1;
        st[k] = d == 1 ? 0 : run;
        run *= d;
        same &= d == c->lead[k];
    }
    c->nseq[i] = run;
    if (same) {
        return 0;
    }
    if (ALLOC_POINT("indices of", arg_names[c->fn->args[i].id], 1) < 0) {
        return -1;
    }
    c->idx[i] = offset_table(c->d.B, c->nlead, c->lead, st);
    return c->idx[i] == NULL ? -1 : 0;
}

static npy_intp find_root(npy_intp *parent, npy_intp b)
{
    while (parent[b] != b) {
        parent[b] = parent[parent[b]];
        b = parent[b];
    }
    return b;
}

/* The groups of sequences that share a query, keys or values (their
 * gradients sum over them): c->order lists each group's sequences in
 * order, group g at [gstart[g], gstart[g + 1]), groups by first member. */
static int make_groups(Call *c)
{
    const FuncSpec *fn = c->fn;
    npy_intp B = c->d.B;
    int any = 0;
    for (int i = 0; i < fn->nargs; i++) {
        any |= c->idx[i] != NULL;
    }
    if (!any || B == 0 || !is_backward(fn)) {
        return 0;
    }
    if (ALLOC_POINT("groups of", "sequences", 1) < 0) {
        return -1;
    }
    npy_intp *parent = PyMem_Malloc((size_t)B * 2 * sizeof(npy_intp));
    c->order = PyMem_Malloc((size_t)B * sizeof(ptrdiff_t));
    c->gstart = PyMem_Malloc((size_t)(B + 1) * sizeof(ptrdiff_t));
    if (parent == NULL || c->order == NULL || c->gstart == NULL) {
        PyMem_Free(parent);
        PyErr_Format(PyExc_MemoryError, "attention_c: no memory to group "
                     "%zd sequences by the inputs they share",
                     (Py_ssize_t)B);
        return -1;
    }
    npy_intp *first = parent + B;     /* first sequence of each input's */
    for (npy_intp b = 0; b < B; b++) {
        parent[b] = b;
    }
    for (int i = 0; i < fn->nargs; i++) {
        if (c->idx[i] == NULL) {
            continue;
        }
        for (npy_intp e = 0; e < c->nseq[i] && e < B; e++) {
            first[e] = -1;
        }
        for (npy_intp b = 0; b < B; b++) {
            npy_intp e = c->idx[i][b], *f = &first[e];
            if (*f < 0) {
                *f = b;
            }
            else {
                npy_intp ra = find_root(parent, *f), rb = find_root(parent,
                                                                    b);
                parent[ra > rb ? ra : rb] = ra < rb ? ra : rb;
            }
        }
    }
    /* group ids in order of first member; counting sort of the members */
    npy_intp ng = 0;
    for (npy_intp b = 0; b < B; b++) {
        npy_intp r = find_root(parent, b);
        first[b] = r == b ? ng++ : first[r];
    }
    for (npy_intp g = 0; g <= ng; g++) {
        c->gstart[g] = 0;
    }
    for (npy_intp b = 0; b < B; b++) {
        c->gstart[first[b] + 1]++;
    }
    for (npy_intp g = 0; g < ng; g++) {
        c->gstart[g + 1] += c->gstart[g];
    }
    for (npy_intp b = 0; b < B; b++) {
        parent[b] = c->gstart[first[b]]++;
    }
    for (npy_intp b = 0; b < B; b++) {
        c->order[parent[b]] = b;
    }
    for (npy_intp g = ng; g > 0; g--) {
        c->gstart[g] = c->gstart[g - 1];
    }
    c->gstart[0] = 0;
    c->ngroups = ng;
    PyMem_Free(parent);
    return 0;
}

int make_views(Call *c)
{
    const FuncSpec *fn = c->fn;
    for (int i = 0; i < fn->nargs; i++) {
        PyArrayObject *x = c->arr[i];
        if (x == NULL || !(fn->args[i].flags & F_VIEW)) {
            continue;
        }
        if (make_view(c, i, 0, &c->view[i], &c->offs[i]) < 0) {
            return -1;
        }
        if (fn->args[i].id == X_BIAS &&
            make_view(c, i, 1, &c->dbias, &c->doffs) < 0) {
            return -1;
        }
        /* alibi_slopes, sinks, sharpness: their gradients' layout (a
         * backward's) */
        int g = fn->args[i].id == X_ALIBI_SLOPES ? 0
                : fn->args[i].id == X_SINKS ? 1
                : fn->args[i].id == X_SHARPNESS ? 2 : -1;
        if (g >= 0 && is_backward(fn) &&
            make_view(c, i, 1, &c->gview[g], &c->goffs[g]) < 0) {
            return -1;
        }
    }
    for (int i = 0; fn->family && i < fn->nargs; i++) {
        if (c->arr[i] != NULL && (fn->args[i].flags & F_LEADB) &&
            make_index(c, i) < 0) {
            return -1;
        }
    }
    return make_groups(c);
}
