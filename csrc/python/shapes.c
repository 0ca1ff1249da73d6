/*
 * shapes.c - step 3 of a call: every shape checked on the arrays as
 * given, binding the symbols of the rows' patterns (T, H, ...) from the
 * first argument that has them, with a message that names the argument,
 * its shape, the shape it should have and the arguments that fixed it.
 * The family's inputs (query, keys, values, key_proj) have leading axes
 * that broadcast against each other; the masks and the bias broadcast to
 * their patterns by NumPy's rules (checked here, read in views.c).
 */
#include "binding.h"

/* ---------------------------------------------------------------------
 * Shapes in messages
 */

/* Writes "(2, 3)", "(5,)" or "()" into buf. */
const char *fmt_shape(char *buf, size_t size, int nd,
                      const npy_intp *dims)
{
    size_t used = (size_t)PyOS_snprintf(buf, size, "(");
    for (int i = 0; i < nd && used < size; i++) {
        used += (size_t)PyOS_snprintf(buf + used, size - used, "%s%zd",
                                      i ? ", " : "", (Py_ssize_t)dims[i]);
    }
    if (used < size) {
        PyOS_snprintf(buf + used, size - used, nd == 1 ? ",)" : ")");
    }
    return buf;
}

/* ---------------------------------------------------------------------
 * Shape patterns (binding.h)
 */

static const char *const sym_names[N_SYMS] = {"T", "H", "A", "Tq", "Hq",
                                              "Hv", "L", "N"};

static int parse_symbol(const char **p)
{
    for (int s = N_SYMS - 1; s >= 0; s--) {    /* "Tq" before "T" */
        size_t len = strlen(sym_names[s]);
        if (strncmp(*p, sym_names[s], len) == 0) {
            *p += len;
            return s;
        }
    }
    return -1;
}

/* Parses text into pat; -1 (SystemError) for a malformed table entry. */
int parse_pattern(const char *text, Pattern *pat)
{
    const char *p = text;
    memset(pat, 0, sizeof *pat);
    pat->text = text;
    if (*p++ != '(') {
        goto bad;
    }
    while (*p == ' ') {
        p++;
    }
    if (strncmp(p, "...", 3) == 0) {
        pat->lead = 1;
        p += 3;
    }
    while (*p != ')') {
        while (*p == ',' || *p == ' ') {
            p++;
        }
        if (*p == ')') {
            break;
        }
        if (pat->n == MAX_AXES) {
            goto bad;
        }
        Axis *a = &pat->ax[pat->n++];
        a->sym[1] = -1;
        a->coef = 1;
        if (*p >= '2' && *p <= '9' && p[1] == '*') {
            a->coef = (signed char)(*p - '0');
            p += 2;
        }
        if ((a->sym[0] = (signed char)parse_symbol(&p)) < 0) {
            goto bad;
        }
        if (*p == '+') {
            p++;
            if ((a->sym[1] = (signed char)parse_symbol(&p)) < 0) {
                goto bad;
            }
        }
        if (*p == '?') {
            a->query_axis = 1;
            p++;
        }
        if (*p != ',' && *p != ')') {
            goto bad;
        }
    }
    return 0;
bad:
    PyErr_Format(PyExc_SystemError, "attention_c: bad shape pattern %s",
                 text);
    return -1;
}

/* ---------------------------------------------------------------------
 * Step 3: the shapes
 */

/* The axes of pattern p an argument has in this call (the query axis only
 * with several queries; a mask may leave it out). */
int axes_present(const Call *c, const ArgSpec *a, int nd,
                 int present[MAX_AXES])
{
    const Pattern *p = &a->pat;
    int n = 0, with_q = c->several;
    if ((a->flags & F_MASK) && with_q) {
        with_q = nd == c->nlead + p->n;       /* a mask per query */
    }
    for (int k = 0; k < p->n; k++) {
        present[k] = !p->ax[k].query_axis || with_q;
        n += present[k];
    }
    return n;
}

/* Value of an axis, or -1 while one of its symbols is free.  With
 * `own`, the symbols argument own fixed count as free (shown by name). */
static npy_intp axis_value(const Call *c, const Axis *ax, int own)
{
    npy_intp v = 0;
    for (int s = 0; s < 2; s++) {
        int sym = ax->sym[s];
        if (sym < 0) {
            continue;
        }
        if (c->binder[sym] < 0 || c->binder[sym] == own) {
            return -1;
        }
        v += (s == 0 ? ax->coef : 1) * c->sym[sym];
    }
    return v;
}

/* Writes the pattern as the call sees it (text) and as numbers where
 * they are known (want), e.g. "(..., T)" and "(3, 5)". */
static void describe(const Call *c, int i, int nd, char *text, char *want,
                     size_t size)
{
    const ArgSpec *a = &c->fn->args[i];
    const Pattern *p = &a->pat;
    int present[MAX_AXES], n = axes_present(c, a, nd, present), items = 0;
    size_t t = 0, w = 0;
    t += (size_t)PyOS_snprintf(text + t, size - t, "(");
    w += (size_t)PyOS_snprintf(want + w, size - w, "(");
    if (p->lead) {
        t += (size_t)PyOS_snprintf(text + t, size - t, "...");
        if (c->lead_binder < 0 || c->lead_binder == i) {
            w += (size_t)PyOS_snprintf(want + w, size - w, "...");
            items++;
        }
        for (int k = 0; c->lead_binder >= 0 && c->lead_binder != i &&
                        k < c->nlead && w < size; k++) {
            w += (size_t)PyOS_snprintf(want + w, size - w, "%s%zd",
                                       items++ ? ", " : "",
                                       (Py_ssize_t)c->lead[k]);
        }
    }
    for (int k = 0; k < p->n && t < size && w < size; k++) {
        const Axis *ax = &p->ax[k];
        if (!present[k]) {
            continue;
        }
        char tm[32];
        int len = ax->coef > 1 ? PyOS_snprintf(tm, sizeof tm, "%d*",
                                               ax->coef) : 0;
        PyOS_snprintf(tm + len, sizeof tm - (size_t)len, "%s%s%s",
                      sym_names[ax->sym[0]], ax->sym[1] >= 0 ? "+" : "",
                      ax->sym[1] >= 0 ? sym_names[ax->sym[1]] : "");
        t += (size_t)PyOS_snprintf(text + t, size - t, "%s%s",
                                   p->lead || k ? ", " : "", tm);
        npy_intp v = axis_value(c, ax, i);
        if (v >= 0) {
            w += (size_t)PyOS_snprintf(want + w, size - w, "%s%zd",
                                       items++ ? ", " : "", (Py_ssize_t)v);
        }
        else {
            w += (size_t)PyOS_snprintf(want + w, size - w, "%s%s",
                                       items++ ? ", " : "", tm);
        }
    }
    int one = !p->lead && n == 1;
    if (t < size) {
        PyOS_snprintf(text + t, size - t, one ? ",)" : ")");
    }
    if (w < size) {
        PyOS_snprintf(want + w, size - w, items == 1 ? ",)" : ")");
    }
}

/* ValueError: argument i does not have the shape its pattern asks for.
 * Names the arguments that fixed the pattern's symbols, with shapes. */
static int shape_error(const Call *c, int i, int fixed_here)
{
    const ArgSpec *a = &c->fn->args[i];
    char got[SHAPE_BUF], text[SHAPE_BUF], want[SHAPE_BUF];
    char refs[4 * SHAPE_BUF] = "";
    int nd = PyArray_NDIM(c->arr[i]), seen[MAX_ARGS] = {0}, nrefs = 0;
    size_t used = 0;
    describe(c, i, nd, text, want, SHAPE_BUF);
    int present[MAX_AXES];
    axes_present(c, a, nd, present);
    for (int k = -1; k < a->pat.n; k++) {
        for (int s = 0; s < 2; s++) {
            int b;
            if (k < 0) {
                b = a->pat.lead && s == 0 ? c->lead_binder : -1;
            }
            else {
                int sym = present[k] ? a->pat.ax[k].sym[s] : -1;
                b = sym >= 0 ? c->binder[sym] : -1;
            }
            if (b < 0 || b == i || seen[b]) {
                continue;
            }
            seen[b] = 1;
            char buf[SHAPE_BUF];
            used += (size_t)PyOS_snprintf(
                refs + used, sizeof refs - used, "%s%s with shape %s",
                nrefs++ ? " and " : "", arg_names[c->fn->args[b].id],
                SHAPE(buf, c->arr[b]));
            if (used >= sizeof refs) {
                used = sizeof refs - 1;
            }
        }
    }
    PyErr_Format(PyExc_ValueError, "%s has shape %s; expected %s = %s%s%s%s%s",
                 arg_names[a->id], SHAPE(got, c->arr[i]), text, want,
                 nrefs ? (fixed_here ? " for " : " to match ") : "", refs,
                 a->hint ? " " : "", a->hint ? a->hint : "");
    return -1;
}

/* Step 3 for argument i: fixes the symbols it is first to have, checks
 * the others. */
static int bind_shape(Call *c, int i)
{
    const ArgSpec *a = &c->fn->args[i];
    const Pattern *p = &a->pat;
    PyArrayObject *x = c->arr[i];
    int nd = PyArray_NDIM(x), present[MAX_AXES], fixed_here = 0;
    const npy_intp *dims = PyArray_DIMS(x);
    int n = axes_present(c, a, nd, present);
    char buf[SHAPE_BUF], text[SHAPE_BUF], want[SHAPE_BUF];
    if (p->lead && c->lead_binder < 0) {
        if (nd < n) {
            describe(c, i, nd, text, want, SHAPE_BUF);
            PyErr_Format(PyExc_ValueError,
                         "%s must have shape %s, at least %d dimension%s; "
                         "got shape %s", arg_names[a->id], text, n,
                         n == 1 ? "" : "s", SHAPE(buf, x));
            return -1;
        }
        c->nlead = nd - n;
        c->lead_binder = i;
        for (int k = 0; k < c->nlead; k++) {
            c->lead[k] = dims[k];
        }
    }
    int nlead = p->lead ? c->nlead : 0;
    if ((a->flags & F_LEADB) && nd >= n && nd < nlead + n) {
        nlead = nd - n;     /* fewer leading axes: the first ones repeat */
    }
    if (nd != nlead + n) {
        return shape_error(c, i, 0);
    }
    for (int k = 0; k < nlead; k++) {
        npy_intp d = c->lead[k + c->nlead - nlead];
        if (dims[k] != d &&
            !(dims[k] == 1 && (a->flags & (F_BCAST | F_LEADB)))) {
            return shape_error(c, i, 0);
        }
    }
    int pos = nlead;
    for (int k = 0; k < p->n; k++) {
        const Axis *ax = &p->ax[k];
        if (!present[k]) {
            continue;
        }
        npy_intp got = dims[pos++];
        int sym = ax->sym[0];
        if (ax->sym[1] < 0 && ax->coef == 1 && c->binder[sym] < 0) {
            c->sym[sym] = got;
            c->binder[sym] = i;
            fixed_here = 1;
            if (sym == S_T && got == 0) {
                PyErr_Format(PyExc_ValueError,
                             "%s has shape %s: T = 0 items; every sequence "
                             "needs at least one item (mask out the ones you "
                             "do not want)", arg_names[a->id], SHAPE(buf, x));
                return -1;
            }
            continue;
        }
        if (axis_value(c, ax, -1) != got) {
            return shape_error(c, i, fixed_here);
        }
    }
    return 0;
}

/* The shape of pattern p in this call: the call's leading axes (with
 * `lead`), then the pattern's axes (the query axis only with several
 * queries); returns their number. */
int pattern_dims(const Call *c, const Pattern *p, int lead,
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
int view_target(const Call *c, int i, npy_intp *dims)
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
                     "Hq) with query.ndim == %s.ndim); one query per "
                     "sequence attends to its keys through mask=",
                     c->fn->name, c->fn->location ? "values" : "keys");
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
                             "equal, 1 or missing)%s", arg_names[a->id],
                             SHAPE(xs, x), arg_names[fn->args[first].id],
                             SHAPE(fs, c->arr[first]),
                             c->several ? ""
                             : "; the query was read as one query per "
                               "sequence (..., Hq), as query.ndim differs "
                               "from keys.ndim: several queries (..., Tq, "
                               "Hq) need query.ndim == keys.ndim");
                return -1;
            }
            *l = d != 1 ? d : *l;
        }
    }
    return 0;
}

/* Step 3: the family's leading axes, then every argument's shape, the
 * rows' .order first (they fix the symbols), then the views. */
int check_shapes(Call *c)
{
    const FuncSpec *fn = c->fn;
    int done[MAX_ARGS] = {0};
    if (fn->family) {       /* several queries: query.ndim == keys.ndim
                               (the location score's: values.ndim); one
                               with fewer axes; more: which is unclear */
        int ik = fn->pos[fn->location ? X_VALUES : X_KEYS];
        PyArrayObject *q = c->arr[fn->pos[X_QUERY]], *k = c->arr[ik];
        if (PyArray_NDIM(q) > PyArray_NDIM(k) && PyArray_NDIM(k) >= 2) {
            char qs[SHAPE_BUF], ks[SHAPE_BUF];
            PyErr_Format(PyExc_ValueError,
                         "query has shape %s, more axes than %s %s: several "
                         "queries (..., Tq, Hq) have as many axes as the "
                         "%s, one query per sequence (..., Hq) fewer (give "
                         "the %s leading axes of size 1, e.g. %s[None])",
                         SHAPE(qs, q), arg_names[fn->args[ik].id],
                         SHAPE(ks, k), arg_names[fn->args[ik].id],
                         arg_names[fn->args[ik].id],
                         arg_names[fn->args[ik].id]);
            return -1;
        }
        c->several = PyArray_NDIM(q) == PyArray_NDIM(k);
        if (broadcast_inputs(c) < 0) {
            return -1;
        }
    }
    for (int r = 0; r < 3 + fn->nargs; r++) {
        int i = r < 3 ? (fn->order[r] != X_NONE ? fn->pos[fn->order[r]]
                                                : -1)
                      : r - 3;
        if (i < 0 || done[i] || c->arr[i] == NULL ||
            (fn->args[i].flags & F_VIEW)) {
            continue;
        }
        done[i] = 1;
        if (bind_shape(c, i) < 0) {
            return -1;
        }
        if (fn->args[i].id == X_KEYS && c->binder[S_HV] < 0 &&
            !given(c, X_VALUES)) {
            c->sym[S_HV] = c->sym[S_H];      /* the keys are the values */
            c->binder[S_HV] = c->binder[S_H];
        }
    }
    c->d.B = 1;
    for (int k = 0; k < c->nlead; k++) {
        c->d.B *= c->lead[k];
    }
    for (int i = 0; i < fn->nargs; i++) {
        if (c->arr[i] != NULL && (fn->args[i].flags & F_VIEW) &&
            check_view(c, i) < 0) {
            return -1;
        }
    }
    c->d.T = c->sym[S_T];
    c->d.H = c->sym[S_H];
    c->d.A = c->sym[S_A];
    return 0;
}
