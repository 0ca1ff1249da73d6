/*
 * binding_views.h - the binding's arguments read where they are: the
 * masks and the bias as views that broadcast by NumPy's rules (offsets per
 * sequence, strides 0 where they repeat), the family's inputs whose
 * leading axes broadcast against each other (an index per sequence), and
 * the groups of sequences that share an input (their gradients sum in
 * order).  Included once, by binding_driver.h; not a header of its own.
 */

/* The shape of pattern p in this call: the call's leading axes (with
 * `lead`), then the pattern's axes (the query axis only with several
 * queries); returns their number. */
static int pattern_dims(const Call *c, const Pattern *p, int lead,
                        npy_intp *dims)
{
    int nd = 0;
    for (int k = 0; lead && k < c->nlead; k++) {
        dims[nd++] = c->lead[k];
    }
    for (int k = 0; k < p->n; k++) {
        if (!p->ax[k].query_axis || c->several) {
            dims[nd++] = axis_value(c, &p->ax[k], -1);
        }
    }
    return nd;
}

/* The shape argument i (F_VIEW) broadcasts to: the call's leading axes,
 * then its pattern's axes; returns their number. */
static int view_target(const Call *c, int i, npy_intp *dims)
{
    return pattern_dims(c, &c->fn->args[i].pat, 1, dims);
}

/* Step 3 for a view: it must broadcast to its target by NumPy's rules
 * (missing or size-1 axes), adding no axis of its own.  The key mask has
 * no query axis: one there is a mask per query, which is attn_mask. */
static int check_view(const Call *c, int i)
{
    const ArgSpec *a = &c->fn->args[i];
    PyArrayObject *x = c->arr[i];
    npy_intp want[NPY_MAXDIMS + MAX_AXES];
    char got_s[SHAPE_BUF], want_s[SHAPE_BUF];
    if (a->id == X_ATTN_MASK && !c->several) {
        PyErr_Format(PyExc_ValueError,
                     "%s: attn_mask needs several queries (query (..., Tq, "
                     "Hq) with query.ndim == keys.ndim); one query per "
                     "sequence attends to its keys through mask=",
                     c->fn->name);
        return -1;
    }
    int nt = view_target(c, i, want), nd = PyArray_NDIM(x);
    if (a->id == X_MASK && c->several && nd >= c->nlead + 2) {
        PyErr_Format(PyExc_ValueError,
                     "mask has shape %s: mask is the key mask (..., T), the "
                     "same for every query; for a mask per query (..., Tq, "
                     "T) use attn_mask= (and causal=True for causal "
                     "attention)", SHAPE(got_s, x));
        return -1;
    }
    int ok = nd <= nt;
    for (int k = 1; ok && k <= nd; k++) {
        npy_intp d = PyArray_DIM(x, nd - k);
        ok = d == want[nt - k] || d == 1;
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError,
                     "%s has shape %s; expected a shape that broadcasts to "
                     "%s = %s (missing or size-1 axes repeat)%s%s%s",
                     arg_names[a->id], SHAPE(got_s, x), a->shape,
                     fmt_shape(want_s, SHAPE_BUF, nt, want),
                     a->hint ? " " : "", a->hint ? a->hint : "",
                     a->id == X_MASK && c->several
                     ? "; for a mask per query (..., Tq, T) use attn_mask= "
                       "(or causal=True)" : "");
        return -1;
    }
    return 0;
}

/* The call's leading axes: those of the family's inputs (query, keys,
 * values, key_proj) broadcast against each other by NumPy's rules. */
static int broadcast_inputs(Call *c)
{
    const FuncSpec *fn = c->fn;
    int first = -1;
    for (int r = 0; r < 3 + fn->nargs; r++) {
        int i = r < 3 ? (fn->order[r] != X_NONE ? fn->pos[fn->order[r]]
                                                : -1)
                      : r - 3;
        if (i < 0 || c->arr[i] == NULL || !(fn->args[i].flags & F_LEADB)) {
            continue;
        }
        const ArgSpec *a = &fn->args[i];
        PyArrayObject *x = c->arr[i];
        int present[MAX_AXES], nd = PyArray_NDIM(x);
        int n = axes_present(c, a, nd, present), nl = nd - n;
        if (nl < 0) {                  /* bind_shape says what is wrong */
            c->nlead = 0;
            c->lead_binder = -1;
            return 0;
        }
        if (first < 0) {
            first = i;
            c->nlead = nl;
            c->lead_binder = i;
            memcpy(c->lead, PyArray_DIMS(x), (size_t)nl * sizeof(npy_intp));
            continue;
        }
        if (nl > c->nlead) {           /* more axes: the new ones lead */
            memmove(c->lead + (nl - c->nlead), c->lead,
                    (size_t)c->nlead * sizeof(npy_intp));
            for (int k = 0; k < nl - c->nlead; k++) {
                c->lead[k] = 1;
            }
            c->nlead = nl;
        }
        for (int k = 0; k < nl; k++) {
            npy_intp d = PyArray_DIM(x, k), *l = &c->lead[k + c->nlead - nl];
            if (d != *l && d != 1 && *l != 1) {
                char xs[SHAPE_BUF], fs[SHAPE_BUF];
                PyErr_Format(PyExc_ValueError,
                             "%s has shape %s and %s shape %s: their "
                             "leading axes must broadcast (NumPy's rules: "
                             "equal, 1 or missing)", arg_names[a->id],
                             SHAPE(xs, x), arg_names[fn->args[first].id],
                             SHAPE(fs, c->arr[first]));
                return -1;
            }
            *l = d != 1 ? d : *l;
        }
    }
    return 0;
}

/* A table of n sequence offsets: sequence b's index (in C order over nd
 * axes of sizes dims) times the strides st, summed.  NULL with the
 * exception set. */
static ptrdiff_t *offset_table(npy_intp n, int nd, const npy_intp *dims,
                               const npy_intp *st)
{
    ptrdiff_t *off = PyMem_Malloc((size_t)(n > 0 ? n : 1) *
                                  sizeof(ptrdiff_t));
    if (off == NULL) {
        PyErr_NoMemory();
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
                    st[nt - 1]};
    for (int k = 0; contiguous && k < c->nlead; k++) {
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
    if (!any || B == 0 || fn->pos[X_GRAD_OUT] < 0) {
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
        PyErr_NoMemory();
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

/* Step 4, the family's keys or values (argument i, not C-contiguous):
 * read where they are when the call reads them so (attention.h,
 * att_family_reads_strided: decoding) and they need no cast: the
 * computing dtype, native and aligned, the last axis contiguous, every
 * stride whole elements.  Then c->offs[i] gets the offset of each of its
 * own sequences (its leading axes in C order) and c->view[i].rs the
 * rows' stride, in elements; returns 1, 0 when it must be copied, -1 on
 * error. */
static int read_rows(Call *c, int i)
{
    const FuncSpec *fn = c->fn;
    PyArrayObject *x = c->arr[i];
    int id = fn->args[i].id, nd = PyArray_NDIM(x);
    if (!fn->score || (id != X_KEYS && id != X_VALUES) || nd < 2) {
        return 0;
    }
    att_fdims f = {.score = fn->score - 1,
                   .Tq = c->several ? c->sym[S_TQ] : 1};
    int backward = fn->pos[X_GRAD_OUT] >= 0;
    int what = c->typenum == NPY_FLOAT
               ? att_family_reads_strided_f32(&f, backward)
               : att_family_reads_strided_f64(&f, backward);
    npy_intp item = PyArray_ITEMSIZE(x);
    if (!(what & (id == X_KEYS ? ATT_STRIDED_KEYS : ATT_STRIDED_VALUES)) ||
        PyArray_TYPE(x) != c->typenum || !PyArray_ISNOTSWAPPED(x) ||
        !PyArray_ISALIGNED(x) ||
        (PyArray_DIM(x, nd - 1) > 1 && PyArray_STRIDE(x, nd - 1) != item) ||
        (PyArray_DIM(x, nd - 2) > 1 && PyArray_STRIDE(x, nd - 2) == 0)) {
        return 0;           /* (a row stride of 0 means "H" to the C) */
    }
    npy_intp n = 1, st[NPY_MAXDIMS];
    for (int k = 0; k < nd; k++) {
        if (PyArray_STRIDE(x, k) % item != 0) {
            return 0;
        }
        st[k] = PyArray_STRIDE(x, k) / item;
        n *= k < nd - 2 ? PyArray_DIM(x, k) : 1;
    }
    if (ALLOC_POINT("offsets of", arg_names[id], 1) < 0) {
        return -1;
    }
    c->offs[i] = offset_table(n, nd - 2, PyArray_DIMS(x), st);
    if (c->offs[i] == NULL) {
        return -1;
    }
    c->view[i] = (att_view){PyArray_DATA(x), c->offs[i], 0,
                            PyArray_DIM(x, nd - 2) > 1
                            ? PyArray_STRIDE(x, nd - 2) / item : 0, 1};
    return 1;
}

/* Step 4a: each view as the kernels read it (attention.h att_view): per
 * sequence b of the call's leading axes, the offset of its first element;
 * the strides of its query and key axes, in elements (0 where it
 * repeats). */
static int make_views(Call *c)
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
    }
    for (int i = 0; fn->score && i < fn->nargs; i++) {
        if (c->arr[i] != NULL && (fn->args[i].flags & F_LEADB) &&
            make_index(c, i) < 0) {
            return -1;
        }
    }
    return make_groups(c);
}
