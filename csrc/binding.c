/*
 * binding.c - the only file that speaks CPython and NumPy.
 *
 * Each Python function here does the same five things, in order:
 *   1. parse its arguments (keywords allowed);
 *   2. turn the floating arguments into arrays of one computing dtype
 *      (float32 or float64, promoted as np.result_type does) that are
 *      C-contiguous and aligned, copying only when they are not already;
 *   3. check every shape against h (or scores/alpha), with a message that
 *      names the argument, its shape and the shape it should have;
 *   4. allocate the outputs and the kernel's scratch;
 *   5. run the kernel with the GIL released, then clean up on one path.
 * Leading batch axes (...) are flattened into B: after step 2 the data is
 * contiguous, so (..., T, H) is (B, T, H) without a copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include "attention.h"
#include "pool.h"

/* ---------------------------------------------------------------------
 * Allocation points and fault injection (a debug aid for the tests)
 *
 * Every allocation the binding makes or asks NumPy for passes one
 * allocation point first: converting or casting an argument, each output
 * array, the kernels' scratch, the thread pool.  _fail_alloc_after(n)
 * makes point number n (0-based, counted from that call) fail as if
 * memory had run out: MemoryError, except for the thread pool, whose
 * failure means "run on the calling thread".  Off (n = -1), a point costs
 * one increment and one test.  Module state, read and written with the
 * GIL held (every point is passed before the GIL is released).
 */
static Py_ssize_t fault_count = 0;    /* points passed since the reset */
static Py_ssize_t fault_after = -1;   /* the point to fail; -1: none */
static int fault_armed = 0;           /* fault_after >= 0 or tracing */
static PyObject *fault_trace = NULL;  /* list of point names, or NULL */

static int alloc_point_debug(const char *kind, const char *what,
                             Py_ssize_t index, int raise)
{
    if (fault_trace != NULL) {
        PyObject *name = PyUnicode_FromFormat("%s %s", kind, what);
        if (name == NULL || PyList_Append(fault_trace, name) < 0) {
            Py_XDECREF(name);
            return -1;
        }
        Py_DECREF(name);
    }
    if (index != fault_after) {
        return 0;
    }
    fault_after = -1;                 /* one failure per arming */
    fault_armed = fault_trace != NULL;
    if (raise) {
        PyErr_Format(PyExc_MemoryError,
                     "attention_c: allocation failed: %s %s (injected by "
                     "_fail_alloc_after)", kind, what);
    }
    return -1;
}

/* 0, or -1 (with MemoryError set when `raise`) to fail the allocation
 * of `what`; `kind` says which (conversion, cast, output, ...). */
static inline int alloc_point(const char *kind, const char *what, int raise)
{
    Py_ssize_t index = fault_count++;
    return fault_armed ? alloc_point_debug(kind, what, index, raise) : 0;
}

/* ---------------------------------------------------------------------
 * Arguments
 */

typedef struct {
    const char *name;       /* for messages */
    int optional;           /* may be None (or left out) */
    PyObject *obj;          /* borrowed; NULL or None when not given */
    PyArrayObject *arr;     /* owned; the converted array, or NULL */
} Arg;

#define ARG(nm) {.name = (nm), .optional = 0, .obj = NULL, .arr = NULL}
#define OPT(nm) {.name = (nm), .optional = 1, .obj = NULL, .arr = NULL}
#define GIVEN(a) ((a)->obj != NULL && (a)->obj != Py_None)
#define DATA(a) ((a)->arr ? PyArray_DATA((a)->arr) : NULL)
#define OUT(o) PyArray_DATA((PyArrayObject *)(o))

static void release(Arg *args, int n)
{
    for (int i = 0; i < n; i++) {
        Py_CLEAR(args[i].arr);
    }
}

/* Writes "(2, 3)", "(5,)" or "()" into buf. */
static const char *fmt_shape(char *buf, size_t size, int nd,
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

#define SHAPE_BUF 256
#define SHAPE(buf, arr) \
    fmt_shape(buf, SHAPE_BUF, PyArray_NDIM(arr), PyArray_DIMS(arr))

/* The argument as an array, without copying; checks the dtype can be
 * computed with: real floats (not long double) and integers. */
static int to_array(Arg *a)
{
    if (!GIVEN(a)) {
        if (a->optional) {
            return 0;
        }
        PyErr_Format(PyExc_TypeError, "%s is required and cannot be None",
                     a->name);
        return -1;
    }
    if (alloc_point("conversion of", a->name, 1) < 0) {
        return -1;
    }
    a->arr = (PyArrayObject *)PyArray_FromAny(a->obj, NULL, 0, 0, 0, NULL);
    if (a->arr == NULL) {
        return -1;
    }
    PyArray_Descr *dt = PyArray_DESCR(a->arr);
    int ok = (dt->kind == 'f' && PyArray_ITEMSIZE(a->arr) <= 8) ||
             dt->kind == 'i' || dt->kind == 'u';
    if (!ok) {
        PyErr_Format(PyExc_TypeError,
                     "%s has dtype %S; attention_c computes in float32 or "
                     "float64 and accepts real floating or integer input",
                     a->name, (PyObject *)dt);
        return -1;
    }
    return 0;
}

/* Converts the floating arguments to arrays of one dtype: float32 or
 * float64, chosen as np.result_type of the inputs, with float16 computed
 * in float32 and integers in float64.  Sets *typenum. */
static int prepare_floats(Arg *args, int n, int *typenum)
{
    PyArrayObject *arrs[16];
    int count = 0;
    for (int i = 0; i < n; i++) {
        if (to_array(&args[i]) < 0) {
            return -1;
        }
        if (args[i].arr != NULL) {
            arrs[count++] = args[i].arr;
        }
    }
    PyArray_Descr *rt = PyArray_ResultType(count, arrs, 0, NULL);
    if (rt == NULL) {
        return -1;
    }
    *typenum = (rt->kind == 'f' && PyDataType_ELSIZE(rt) <= 4) ? NPY_FLOAT
                                                               : NPY_DOUBLE;
    Py_DECREF(rt);
    for (int i = 0; i < n; i++) {
        if (args[i].arr == NULL) {
            continue;
        }
        if (alloc_point("cast of", args[i].name, 1) < 0) {
            return -1;
        }
        PyObject *cast = PyArray_FromArray(
            args[i].arr, PyArray_DescrFromType(*typenum),
            NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
        if (cast == NULL) {
            return -1;
        }
        Py_SETREF(args[i].arr, (PyArrayObject *)cast);
    }
    return 0;
}

/* ---------------------------------------------------------------------
 * Shapes
 */

typedef struct {
    int nd;                       /* number of leading (batch) axes */
    npy_intp lead[NPY_MAXDIMS];
    att_dims d;                   /* B = prod(lead), T, H, A */
    const Arg *ref;               /* the argument the layout comes from */
} Layout;

/* Reads (..., T, H) from h (tail = 2) or (..., T) from scores (tail = 1). */
static int read_layout(const Arg *a, int tail, Layout *L)
{
    char buf[SHAPE_BUF];
    int nd = PyArray_NDIM(a->arr);
    const npy_intp *dims = PyArray_DIMS(a->arr);
    if (nd < tail) {
        PyErr_Format(PyExc_ValueError,
                     "%s must have shape %s, at least %d dimension%s; got "
                     "shape %s", a->name, tail == 2 ? "(..., T, H)"
                     : "(..., T)", tail, tail == 2 ? "s" : "",
                     SHAPE(buf, a->arr));
        return -1;
    }
    L->nd = nd - tail;
    L->d.B = 1;
    for (int i = 0; i < L->nd; i++) {
        L->lead[i] = dims[i];
        L->d.B *= dims[i];
    }
    L->d.T = dims[L->nd];
    L->d.H = tail == 2 ? dims[nd - 1] : 0;
    L->d.A = 0;
    L->ref = a;
    if (L->d.T < 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s has shape %s: T = 0 items; every sequence needs at "
                     "least one item (mask out the ones you do not want)",
                     a->name, SHAPE(buf, a->arr));
        return -1;
    }
    return 0;
}

/* Builds the shape (lead..., tail...) into dims; returns its length. */
static int layout_shape(const Layout *L, int lead, int ntail,
                        npy_intp t0, npy_intp t1, npy_intp *dims)
{
    int nd = 0;
    for (int i = 0; lead && i < L->nd; i++) {
        dims[nd++] = L->lead[i];
    }
    if (ntail > 0) {
        dims[nd++] = t0;
    }
    if (ntail > 1) {
        dims[nd++] = t1;
    }
    return nd;
}

/* Checks a given argument has shape (lead..., tail...); `pattern` says
 * it symbolically, e.g. "(..., T)". */
static int expect_shape(const Arg *a, const Layout *L, int lead, int ntail,
                        npy_intp t0, npy_intp t1, const char *pattern)
{
    npy_intp want[NPY_MAXDIMS + 2];
    char got_s[SHAPE_BUF], want_s[SHAPE_BUF], ref_s[SHAPE_BUF];
    if (a->arr == NULL) {
        return 0;
    }
    int nd = layout_shape(L, lead, ntail, t0, t1, want);
    if (PyArray_NDIM(a->arr) == nd &&
        PyArray_CompareLists(PyArray_DIMS(a->arr), want, nd)) {
        return 0;
    }
    PyErr_Format(PyExc_ValueError,
                 "%s has shape %s; expected %s = %s to match %s with shape %s",
                 a->name, SHAPE(got_s, a->arr), pattern,
                 fmt_shape(want_s, SHAPE_BUF, nd, want), L->ref->name,
                 SHAPE(ref_s, L->ref->arr));
    return -1;
}

/* W (A, 2H), v (A,), b (A,) or None; sets L->d.A. */
static int check_weights(const Arg *W, const Arg *v, const Arg *b, Layout *L)
{
    char got_s[SHAPE_BUF], ref_s[SHAPE_BUF];
    if (PyArray_NDIM(W->arr) != 2 ||
        PyArray_DIM(W->arr, 1) != 2 * L->d.H) {
        PyErr_Format(PyExc_ValueError,
                     "W has shape %s; expected (A, 2*H) = (A, %zd) for %s "
                     "with shape %s (W has the layout of "
                     "torch.nn.Linear(2*H, A).weight)",
                     SHAPE(got_s, W->arr), (Py_ssize_t)(2 * L->d.H),
                     L->ref->name, SHAPE(ref_s, L->ref->arr));
        return -1;
    }
    L->d.A = PyArray_DIM(W->arr, 0);
    Layout wl = *L;
    wl.ref = W;
    if (expect_shape(v, &wl, 0, 1, L->d.A, 0, "(A,)") < 0 ||
        expect_shape(b, &wl, 0, 1, L->d.A, 0, "(A,)") < 0) {
        return -1;
    }
    return 0;
}

/* The mask as a C-contiguous bool array of shape (lead..., T). */
static int prepare_mask(Arg *m, const Layout *L)
{
    if (!GIVEN(m)) {
        return 0;
    }
    if (alloc_point("conversion of", "mask", 1) < 0) {
        return -1;
    }
    m->arr = (PyArrayObject *)PyArray_FromAny(m->obj, NULL, 0, 0, 0, NULL);
    if (m->arr == NULL) {
        return -1;
    }
    if (PyArray_TYPE(m->arr) != NPY_BOOL) {
        PyErr_Format(PyExc_TypeError,
                     "mask must be a boolean array (True = valid item); got "
                     "dtype %S (use mask.astype(bool))",
                     (PyObject *)PyArray_DESCR(m->arr));
        return -1;
    }
    if (expect_shape(m, L, 1, 1, L->d.T, 0, "(..., T)") < 0) {
        return -1;
    }
    if (alloc_point("cast of", "mask", 1) < 0) {
        return -1;
    }
    PyObject *c = PyArray_FromArray(m->arr, PyArray_DescrFromType(NPY_BOOL),
                                    NPY_ARRAY_IN_ARRAY);
    if (c == NULL) {
        return -1;
    }
    Py_SETREF(m->arr, (PyArrayObject *)c);
    return 0;
}

/* ---------------------------------------------------------------------
 * Outputs, scratch, kernels
 */

/* One output of a function: shape (lead..., tail...) (lead = 0: tail
 * only), made into *dst; dst NULL: not wanted (e.g. db without b). */
typedef struct {
    const char *name;
    int lead, ntail;
    npy_intp t0, t1;
    PyObject **dst;
} OutSpec;

#define NO_WORK ((ptrdiff_t)0)

/* Bytes of an output of the computing dtype, or -1 when the count does
 * not fit in a Py_ssize_t.  Zero dims are skipped in the product, as
 * NumPy does, so an empty array with absurd other dims is refused too. */
static Py_ssize_t out_bytes(const Layout *L, const OutSpec *o, int typenum)
{
    npy_intp dims[NPY_MAXDIMS + 2];
    int nd = layout_shape(L, o->lead, o->ntail, o->t0, o->t1, dims);
    Py_ssize_t bytes = typenum == NPY_FLOAT ? 4 : 8;
    for (int i = 0; i < nd; i++) {
        if (dims[i] != 0) {
            if (dims[i] > PY_SSIZE_T_MAX / bytes) {
                return -1;
            }
            bytes *= dims[i];
        }
    }
    return bytes;
}

/* The kernels' scratch is kept between calls (one buffer of at most
 * WORK_CACHE_MAX bytes): a large one would otherwise be mapped afresh and
 * its pages faulted in by every call (glibc maps blocks above 32 MiB anew
 * each time), 5% of a large backward.  Taken and given back with the GIL
 * held; a call that finds it in use (another thread is inside a kernel)
 * allocates its own. */
#define WORK_CACHE_MAX ((size_t)256 << 20)
static void *work_cache = NULL;
static size_t work_cache_size = 0;
static int work_cache_busy = 0;

static void *work_take(size_t bytes)
{
    if (work_cache_busy || bytes > WORK_CACHE_MAX) {
        return PyMem_RawMalloc(bytes);
    }
    if (work_cache_size < bytes) {
        PyMem_RawFree(work_cache);
        work_cache = PyMem_RawMalloc(bytes);
        work_cache_size = work_cache != NULL ? bytes : 0;
        if (work_cache == NULL) {
            return NULL;
        }
    }
    work_cache_busy = 1;
    return work_cache;
}

static void work_give(void *work)
{
    if (work != NULL && work == work_cache) {
        work_cache_busy = 0;
    }
    else {
        PyMem_RawFree(work);
    }
}

/* Makes the wanted outputs and the kernels' scratch of `work_bytes`
 * bytes (-1: the count overflowed; work NULL: none wanted).  Every byte
 * count is checked before anything is allocated, so sizes that overflow
 * give MemoryError without touching memory.  On
 * failure the outputs already made are left in *dst for the caller's
 * cleanup path. */
static int new_outputs(const Layout *L, int typenum, const OutSpec *spec,
                       int n, ptrdiff_t work_bytes, void **work)
{
    char buf[SHAPE_BUF];
    for (int i = 0; i < n; i++) {
        if (spec[i].dst != NULL && out_bytes(L, &spec[i], typenum) < 0) {
            npy_intp dims[NPY_MAXDIMS + 2];
            int nd = layout_shape(L, spec[i].lead, spec[i].ntail, spec[i].t0,
                                  spec[i].t1, dims);
            PyErr_Format(PyExc_MemoryError,
                         "attention_c: output %s of shape %s would need "
                         "more bytes than memory can address", spec[i].name,
                         fmt_shape(buf, SHAPE_BUF, nd, dims));
            return -1;
        }
    }
    if (work != NULL && work_bytes < 0) {
        PyErr_SetString(PyExc_MemoryError,
                        "attention_c: sizes too large for scratch memory");
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (spec[i].dst == NULL) {
            continue;
        }
        npy_intp dims[NPY_MAXDIMS + 2];
        int nd = layout_shape(L, spec[i].lead, spec[i].ntail, spec[i].t0,
                              spec[i].t1, dims);
        if (alloc_point("output", spec[i].name, 1) < 0 ||
            (*spec[i].dst = PyArray_SimpleNew(nd, dims, typenum)) == NULL) {
            return -1;
        }
    }
    if (work != NULL) {
        if (alloc_point("scratch", "memory", 1) < 0) {
            return -1;
        }
        *work = work_take((size_t)work_bytes + 1);
        if (*work == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

static int check_status(int st)
{
    if (st == ATT_OK) {
        return 0;
    }
    PyErr_Format(PyExc_SystemError,
                 "attention_c: a kernel rejected its sizes (status %d); "
                 "this is a bug, please report it", st);
    return -1;
}

/* Runs att_NAME_f32 or att_NAME_f64 without the GIL; sets st. */
#define RUN(st, typenum, NAME, ...)                                          \
    do {                                                                     \
        Py_BEGIN_ALLOW_THREADS                                               \
        st = (typenum) == NPY_FLOAT ? att_##NAME##_f32(__VA_ARGS__)          \
                                    : att_##NAME##_f64(__VA_ARGS__);         \
        Py_END_ALLOW_THREADS                                                 \
    } while (0)

/* Bytes of scratch att_NAME needs for the computing dtype. */
#define WORKSPACE(typenum, NAME, ...)                                        \
    ((typenum) == NPY_FLOAT ? att_##NAME##_workspace_f32(__VA_ARGS__)        \
                            : att_##NAME##_workspace_f64(__VA_ARGS__))

#define N_ARGS(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* The instruction set of the fused kernels (enum att_simd): the best the
 * CPU has, unless _set_simd (ATTENTION_C_SIMD) chose another.  Read and
 * written with the GIL held. */
static int simd_level = ATT_SIMD_SCALAR;
static const char *const simd_names[] = {"scalar", "avx2", "avx512"};

/* Threads of the fused kernels (set_num_threads), and the pool that runs
 * them, made on first need.  A call holds the pool (pool_users) while it
 * runs without the GIL, so it is freed only when no call uses it.  After
 * fork() the child has the parent's pool but not its threads: it drops it
 * (att_pool_abandon) and makes its own.  All of this under the GIL. */
#define MAX_THREADS 256
static int num_threads = 1;
static att_pool *pool = NULL;
static int pool_users = 0;

/* The att_exec of one fused call: takes the pool (or NULL with one
 * thread); every begin_exec is paired with one end_exec. */
static att_exec begin_exec(void)
{
    att_exec ex = {simd_level, num_threads, NULL};
    if (pool != NULL && !att_pool_owned(pool)) {
        att_pool_abandon(pool);     /* inherited through fork() */
        pool = NULL;
        pool_users = 0;
    }
    if (num_threads > 1 && simd_level != ATT_SIMD_SCALAR) {
        if (pool != NULL && pool_users == 0 &&
            att_pool_threads(pool) < num_threads) {
            att_pool_free(pool);
            pool = NULL;
        }
        if (pool == NULL) {
            /* NULL (no memory, no threads): run on the calling thread */
            if (alloc_point("thread", "pool", 0) < 0) {
                PyErr_Clear();
            }
            else {
                pool = att_pool_new(num_threads);
            }
        }
        ex.pool = pool;
        pool_users += pool != NULL;
    }
    return ex;
}

static void end_exec(const att_exec *ex)
{
    if (ex->pool != NULL && ex->pool == pool) {
        pool_users--;
    }
}

/* ---------------------------------------------------------------------
 * mean_context(h, mask=None) -> c (..., H)
 */
static PyObject *py_mean_context(PyObject *self, PyObject *args,
                                 PyObject *kw)
{
    static char *kwlist[] = {"h", "mask", NULL};
    Arg a[] = {ARG("h"), OPT("mask")};
    PyObject *c = NULL;
    Layout L;
    int tn, st = ATT_OK;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:mean_context", kwlist,
                                     &a[0].obj, &a[1].obj) ||
        prepare_floats(a, 1, &tn) < 0 || read_layout(&a[0], 2, &L) < 0 ||
        prepare_mask(&a[1], &L) < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"c", 1, 1, L.d.H, 0, &c}}, 1, NO_WORK, NULL) < 0) {
        goto fail;
    }
    RUN(st, tn, mean_context, L.d, DATA(&a[0]), DATA(&a[1]), OUT(c));
    if (check_status(st) < 0) {
        goto fail;
    }
    release(a, N_ARGS(a));
    return c;
fail:
    release(a, N_ARGS(a));
    Py_XDECREF(c);
    return NULL;
}

/* ---------------------------------------------------------------------
 * mean_context_backward(grad_c, h, mask=None) -> dh (..., T, H)
 */
static PyObject *py_mean_context_backward(PyObject *self, PyObject *args,
                                          PyObject *kw)
{
    static char *kwlist[] = {"grad_c", "h", "mask", NULL};
    Arg a[] = {ARG("grad_c"), ARG("h"), OPT("mask")};
    PyObject *dh = NULL;
    Layout L;
    int tn, st = ATT_OK;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O:mean_context_backward",
                                     kwlist, &a[0].obj, &a[1].obj,
                                     &a[2].obj) ||
        prepare_floats(a, 2, &tn) < 0 || read_layout(&a[1], 2, &L) < 0 ||
        expect_shape(&a[0], &L, 1, 1, L.d.H, 0, "(..., H)") < 0 ||
        prepare_mask(&a[2], &L) < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"dh", 1, 2, L.d.T, L.d.H, &dh}}, 1, NO_WORK, NULL) < 0) {
        goto fail;
    }
    RUN(st, tn, mean_context_backward, L.d, DATA(&a[0]), DATA(&a[2]),
        OUT(dh));
    if (check_status(st) < 0) {
        goto fail;
    }
    release(a, N_ARGS(a));
    return dh;
fail:
    release(a, N_ARGS(a));
    Py_XDECREF(dh);
    return NULL;
}

/* ---------------------------------------------------------------------
 * additive_score(h, context, W, v, b=None) -> s (..., T)
 */
static PyObject *py_additive_score(PyObject *self, PyObject *args,
                                   PyObject *kw)
{
    static char *kwlist[] = {"h", "context", "W", "v", "b", NULL};
    Arg a[] = {ARG("h"), ARG("context"), ARG("W"), ARG("v"), OPT("b")};
    PyObject *s = NULL;
    void *work = NULL;
    Layout L;
    int tn, st = ATT_OK;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|O:additive_score",
                                     kwlist, &a[0].obj, &a[1].obj, &a[2].obj,
                                     &a[3].obj, &a[4].obj) ||
        prepare_floats(a, 5, &tn) < 0 || read_layout(&a[0], 2, &L) < 0 ||
        expect_shape(&a[1], &L, 1, 1, L.d.H, 0, "(..., H)") < 0 ||
        check_weights(&a[2], &a[3], &a[4], &L) < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"s", 1, 1, L.d.T, 0, &s}}, 1,
            WORKSPACE(tn, additive_score, L.d), &work) < 0) {
        goto fail;
    }
    RUN(st, tn, additive_score, L.d, DATA(&a[0]), DATA(&a[1]), DATA(&a[2]),
        DATA(&a[3]), DATA(&a[4]), OUT(s), work);
    if (check_status(st) < 0) {
        goto fail;
    }
    work_give(work);
    release(a, N_ARGS(a));
    return s;
fail:
    work_give(work);
    release(a, N_ARGS(a));
    Py_XDECREF(s);
    return NULL;
}

/* ---------------------------------------------------------------------
 * additive_score_backward(grad_s, h, context, W, v, b=None)
 *   -> (dh, dcontext, dW, dv, db or None)
 */
static PyObject *py_additive_score_backward(PyObject *self, PyObject *args,
                                            PyObject *kw)
{
    static char *kwlist[] = {"grad_s", "h", "context", "W", "v", "b", NULL};
    Arg a[] = {ARG("grad_s"), ARG("h"), ARG("context"), ARG("W"), ARG("v"),
               OPT("b")};
    PyObject *dh = NULL, *dctx = NULL, *dW = NULL, *dv = NULL, *db = NULL;
    void *work = NULL;
    Layout L;
    int tn, st = ATT_OK;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "OOOOO|O:additive_score_backward", kwlist, &a[0].obj,
            &a[1].obj, &a[2].obj, &a[3].obj, &a[4].obj, &a[5].obj) ||
        prepare_floats(a, 6, &tn) < 0 || read_layout(&a[1], 2, &L) < 0 ||
        expect_shape(&a[0], &L, 1, 1, L.d.T, 0, "(..., T)") < 0 ||
        expect_shape(&a[2], &L, 1, 1, L.d.H, 0, "(..., H)") < 0 ||
        check_weights(&a[3], &a[4], &a[5], &L) < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"dh", 1, 2, L.d.T, L.d.H, &dh},
            {"dcontext", 1, 1, L.d.H, 0, &dctx},
            {"dW", 0, 2, L.d.A, 2 * L.d.H, &dW},
            {"dv", 0, 1, L.d.A, 0, &dv},
            {"db", 0, 1, L.d.A, 0, GIVEN(&a[5]) ? &db : NULL}}, 5,
            WORKSPACE(tn, additive_score_backward, L.d), &work) < 0) {
        goto fail;
    }
    RUN(st, tn, additive_score_backward, L.d, DATA(&a[0]), DATA(&a[1]),
        DATA(&a[2]), DATA(&a[3]), DATA(&a[4]), DATA(&a[5]), OUT(dh),
        OUT(dctx), OUT(dW), OUT(dv), db ? OUT(db) : NULL, work);
    if (check_status(st) < 0) {
        goto fail;
    }
    work_give(work);
    release(a, N_ARGS(a));
    return Py_BuildValue("(NNNNN)", dh, dctx, dW, dv,
                         db ? db : Py_NewRef(Py_None));
fail:
    work_give(work);
    release(a, N_ARGS(a));
    Py_XDECREF(dh);
    Py_XDECREF(dctx);
    Py_XDECREF(dW);
    Py_XDECREF(dv);
    Py_XDECREF(db);
    return NULL;
}

/* ---------------------------------------------------------------------
 * masked_softmax(scores, mask=None) -> alpha (..., T)
 */
static PyObject *py_masked_softmax(PyObject *self, PyObject *args,
                                   PyObject *kw)
{
    static char *kwlist[] = {"scores", "mask", NULL};
    Arg a[] = {ARG("scores"), OPT("mask")};
    PyObject *alpha = NULL;
    Layout L;
    int tn, st = ATT_OK;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:masked_softmax", kwlist,
                                     &a[0].obj, &a[1].obj) ||
        prepare_floats(a, 1, &tn) < 0 || read_layout(&a[0], 1, &L) < 0 ||
        prepare_mask(&a[1], &L) < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"alpha", 1, 1, L.d.T, 0, &alpha}}, 1, NO_WORK, NULL) < 0) {
        goto fail;
    }
    RUN(st, tn, masked_softmax, L.d, DATA(&a[0]), DATA(&a[1]), OUT(alpha));
    if (check_status(st) < 0) {
        goto fail;
    }
    release(a, N_ARGS(a));
    return alpha;
fail:
    release(a, N_ARGS(a));
    Py_XDECREF(alpha);
    return NULL;
}

/* ---------------------------------------------------------------------
 * masked_softmax_backward(grad_alpha, alpha) -> dscores (..., T)
 */
static PyObject *py_masked_softmax_backward(PyObject *self, PyObject *args,
                                            PyObject *kw)
{
    static char *kwlist[] = {"grad_alpha", "alpha", NULL};
    Arg a[] = {ARG("grad_alpha"), ARG("alpha")};
    PyObject *ds = NULL;
    Layout L;
    int tn, st = ATT_OK;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO:masked_softmax_backward",
                                     kwlist, &a[0].obj, &a[1].obj) ||
        prepare_floats(a, 2, &tn) < 0 || read_layout(&a[1], 1, &L) < 0 ||
        expect_shape(&a[0], &L, 1, 1, L.d.T, 0, "(..., T)") < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"dscores", 1, 1, L.d.T, 0, &ds}}, 1, NO_WORK, NULL) < 0) {
        goto fail;
    }
    RUN(st, tn, masked_softmax_backward, L.d, DATA(&a[0]), DATA(&a[1]),
        OUT(ds));
    if (check_status(st) < 0) {
        goto fail;
    }
    release(a, N_ARGS(a));
    return ds;
fail:
    release(a, N_ARGS(a));
    Py_XDECREF(ds);
    return NULL;
}

/* ---------------------------------------------------------------------
 * weighted_sum(alpha, h) -> out (..., H)
 */
static PyObject *py_weighted_sum(PyObject *self, PyObject *args,
                                 PyObject *kw)
{
    static char *kwlist[] = {"alpha", "h", NULL};
    Arg a[] = {ARG("alpha"), ARG("h")};
    PyObject *out = NULL;
    Layout L;
    int tn, st = ATT_OK;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO:weighted_sum", kwlist,
                                     &a[0].obj, &a[1].obj) ||
        prepare_floats(a, 2, &tn) < 0 || read_layout(&a[1], 2, &L) < 0 ||
        expect_shape(&a[0], &L, 1, 1, L.d.T, 0, "(..., T)") < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"out", 1, 1, L.d.H, 0, &out}}, 1, NO_WORK, NULL) < 0) {
        goto fail;
    }
    RUN(st, tn, weighted_sum, L.d, DATA(&a[0]), DATA(&a[1]), OUT(out));
    if (check_status(st) < 0) {
        goto fail;
    }
    release(a, N_ARGS(a));
    return out;
fail:
    release(a, N_ARGS(a));
    Py_XDECREF(out);
    return NULL;
}

/* ---------------------------------------------------------------------
 * weighted_sum_backward(grad_out, alpha, h) -> (dalpha, dh)
 */
static PyObject *py_weighted_sum_backward(PyObject *self, PyObject *args,
                                          PyObject *kw)
{
    static char *kwlist[] = {"grad_out", "alpha", "h", NULL};
    Arg a[] = {ARG("grad_out"), ARG("alpha"), ARG("h")};
    PyObject *dalpha = NULL, *dh = NULL;
    Layout L;
    int tn, st = ATT_OK;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO:weighted_sum_backward",
                                     kwlist, &a[0].obj, &a[1].obj,
                                     &a[2].obj) ||
        prepare_floats(a, 3, &tn) < 0 || read_layout(&a[2], 2, &L) < 0 ||
        expect_shape(&a[0], &L, 1, 1, L.d.H, 0, "(..., H)") < 0 ||
        expect_shape(&a[1], &L, 1, 1, L.d.T, 0, "(..., T)") < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"dalpha", 1, 1, L.d.T, 0, &dalpha},
            {"dh", 1, 2, L.d.T, L.d.H, &dh}}, 2, NO_WORK, NULL) < 0) {
        goto fail;
    }
    RUN(st, tn, weighted_sum_backward, L.d, DATA(&a[0]), DATA(&a[1]),
        DATA(&a[2]), OUT(dalpha), OUT(dh));
    if (check_status(st) < 0) {
        goto fail;
    }
    release(a, N_ARGS(a));
    return Py_BuildValue("(NN)", dalpha, dh);
fail:
    release(a, N_ARGS(a));
    Py_XDECREF(dalpha);
    Py_XDECREF(dh);
    return NULL;
}

/* ---------------------------------------------------------------------
 * context_attention(h, W, v, b=None, mask=None, keep_activations=False)
 *   -> (out, alpha), or (out, alpha, activations (..., T, A))
 */
static PyObject *py_context_attention(PyObject *self, PyObject *args,
                                      PyObject *kw)
{
    static char *kwlist[] = {"h", "W", "v", "b", "mask", "keep_activations",
                             NULL};
    Arg a[] = {ARG("h"), ARG("W"), ARG("v"), OPT("b"), OPT("mask")};
    PyObject *out = NULL, *alpha = NULL, *act = NULL;
    void *work = NULL;
    Layout L;
    int tn, st = ATT_OK, keep = 0;
    att_exec ex = begin_exec();
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOp:context_attention",
                                     kwlist, &a[0].obj, &a[1].obj, &a[2].obj,
                                     &a[3].obj, &a[4].obj, &keep) ||
        prepare_floats(a, 4, &tn) < 0 || read_layout(&a[0], 2, &L) < 0 ||
        check_weights(&a[1], &a[2], &a[3], &L) < 0 ||
        prepare_mask(&a[4], &L) < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"out", 1, 1, L.d.H, 0, &out},
            {"alpha", 1, 1, L.d.T, 0, &alpha},
            {"activations", 1, 2, L.d.T, L.d.A, keep ? &act : NULL}}, 3,
            WORKSPACE(tn, context_attention, L.d, &ex), &work) < 0) {
        goto fail;
    }
    RUN(st, tn, context_attention, L.d, &ex, DATA(&a[0]), DATA(&a[1]),
        DATA(&a[2]), DATA(&a[3]), DATA(&a[4]), OUT(out), OUT(alpha),
        act ? OUT(act) : NULL, work);
    if (check_status(st) < 0) {
        goto fail;
    }
    end_exec(&ex);
    work_give(work);
    release(a, N_ARGS(a));
    return act ? Py_BuildValue("(NNN)", out, alpha, act)
               : Py_BuildValue("(NN)", out, alpha);
fail:
    end_exec(&ex);
    work_give(work);
    release(a, N_ARGS(a));
    Py_XDECREF(out);
    Py_XDECREF(alpha);
    Py_XDECREF(act);
    return NULL;
}

/* ---------------------------------------------------------------------
 * context_attention_backward(grad_out, h, W, v, alpha, b=None, mask=None,
 *                            grad_alpha=None, activations=None)
 *   -> (dh, dW, dv, db or None)
 */
static PyObject *py_context_attention_backward(PyObject *self,
                                               PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"grad_out", "h", "W", "v", "alpha", "b",
                             "mask", "grad_alpha", "activations", NULL};
    /* the floating arguments first, the mask last */
    Arg a[] = {ARG("grad_out"), ARG("h"), ARG("W"), ARG("v"), ARG("alpha"),
               OPT("b"), OPT("grad_alpha"), OPT("activations"), OPT("mask")};
    PyObject *dh = NULL, *dW = NULL, *dv = NULL, *db = NULL;
    void *work = NULL;
    Layout L;
    int tn, st = ATT_OK;
    att_exec ex = begin_exec();
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "OOOOO|OOOO:context_attention_backward", kwlist,
            &a[0].obj, &a[1].obj, &a[2].obj, &a[3].obj, &a[4].obj,
            &a[5].obj, &a[8].obj, &a[6].obj, &a[7].obj) ||
        prepare_floats(a, 8, &tn) < 0 || read_layout(&a[1], 2, &L) < 0 ||
        expect_shape(&a[0], &L, 1, 1, L.d.H, 0, "(..., H)") < 0 ||
        expect_shape(&a[4], &L, 1, 1, L.d.T, 0, "(..., T)") < 0 ||
        expect_shape(&a[6], &L, 1, 1, L.d.T, 0, "(..., T)") < 0 ||
        check_weights(&a[2], &a[3], &a[5], &L) < 0 ||
        expect_shape(&a[7], &L, 1, 2, L.d.T, L.d.A, "(..., T, A)") < 0 ||
        prepare_mask(&a[8], &L) < 0 ||
        new_outputs(&L, tn, (const OutSpec[]){
            {"dh", 1, 2, L.d.T, L.d.H, &dh},
            {"dW", 0, 2, L.d.A, 2 * L.d.H, &dW},
            {"dv", 0, 1, L.d.A, 0, &dv},
            {"db", 0, 1, L.d.A, 0, GIVEN(&a[5]) ? &db : NULL}}, 4,
            WORKSPACE(tn, context_attention_backward, L.d, &ex),
            &work) < 0) {
        goto fail;
    }
    RUN(st, tn, context_attention_backward, L.d, &ex, DATA(&a[0]),
        DATA(&a[1]), DATA(&a[2]), DATA(&a[3]), DATA(&a[4]), DATA(&a[5]),
        DATA(&a[8]), DATA(&a[6]), DATA(&a[7]), OUT(dh), OUT(dW), OUT(dv),
        db ? OUT(db) : NULL, work);
    if (check_status(st) < 0) {
        goto fail;
    }
    end_exec(&ex);
    work_give(work);
    release(a, N_ARGS(a));
    return Py_BuildValue("(NNNN)", dh, dW, dv, db ? db : Py_NewRef(Py_None));
fail:
    end_exec(&ex);
    work_give(work);
    release(a, N_ARGS(a));
    Py_XDECREF(dh);
    Py_XDECREF(dW);
    Py_XDECREF(dv);
    Py_XDECREF(db);
    return NULL;
}

/* ---------------------------------------------------------------------
 * Private: the instruction set, and the vector tanh for the tests
 */

static int simd_from_name(PyObject *name)
{
    for (int i = 0; i < 3; i++) {
        if (PyUnicode_Check(name) &&
            PyUnicode_CompareWithASCIIString(name, simd_names[i]) == 0) {
            return i;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "unknown SIMD path %R; expected 'scalar', 'avx2' or "
                 "'avx512'", name);
    return -1;
}

static PyObject *py_simd_best(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(simd_names[att_simd_best()]);
}

static PyObject *py_get_simd(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(simd_names[simd_level]);
}

static PyObject *py_set_simd(PyObject *self, PyObject *name)
{
    (void)self;
    int level = simd_from_name(name);
    if (level < 0) {
        return NULL;
    }
    if (level > att_simd_best()) {
        PyErr_Format(PyExc_ValueError,
                     "this CPU cannot run the %s path; the best it has is %s",
                     simd_names[level], simd_names[att_simd_best()]);
        return NULL;
    }
    simd_level = level;
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(num_threads);
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg)
{
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 1 || n > MAX_THREADS) {
        return PyErr_Format(PyExc_ValueError,
                            "the number of threads must be in [1, %d], "
                            "got %ld", MAX_THREADS, n);
    }
    num_threads = (int)n;
    if (pool != NULL && pool_users == 0 && att_pool_owned(pool) &&
        att_pool_threads(pool) != num_threads) {
        att_pool_free(pool);    /* remade to size on the next call */
        pool = NULL;
    }
    Py_RETURN_NONE;
}

/* _fail_alloc_after(n, trace=False): restart counting allocation points;
 * fail point n (0-based) once, or none for n = -1; with trace, record the
 * name of every point passed (read by _alloc_trace). */
static PyObject *py_fail_alloc_after(PyObject *self, PyObject *args,
                                     PyObject *kw)
{
    static char *kwlist[] = {"n", "trace", NULL};
    Py_ssize_t n;
    int trace = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n|p:_fail_alloc_after",
                                     kwlist, &n, &trace)) {
        return NULL;
    }
    if (n < -1) {
        return PyErr_Format(PyExc_ValueError,
                            "n must be >= -1 (-1: no failure), got %zd", n);
    }
    PyObject *list = trace ? PyList_New(0) : NULL;
    if (trace && list == NULL) {
        return NULL;
    }
    Py_XSETREF(fault_trace, list);
    fault_count = 0;
    fault_after = n;
    fault_armed = n >= 0 || trace;
    Py_RETURN_NONE;
}

/* _alloc_count(): allocation points passed since _fail_alloc_after. */
static PyObject *py_alloc_count(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromSsize_t(fault_count);
}

/* _alloc_trace(): names of the points passed, or None when not tracing. */
static PyObject *py_alloc_trace(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    if (fault_trace == NULL) {
        Py_RETURN_NONE;
    }
    return PyList_GetSlice(fault_trace, 0, PyList_GET_SIZE(fault_trace));
}

/* _tanh(x, simd): tanh of a float32 or float64 array by a given path. */
static PyObject *py_tanh(PyObject *self, PyObject *args)
{
    PyObject *obj, *name, *y = NULL;
    PyArrayObject *x = NULL;
    int st = ATT_OK, level;
    (void)self;
    if (!PyArg_ParseTuple(args, "OU:_tanh", &obj, &name) ||
        (level = simd_from_name(name)) < 0) {
        return NULL;
    }
    if (level > att_simd_best()) {
        return PyErr_Format(PyExc_ValueError, "this CPU cannot run %s",
                            simd_names[level]);
    }
    x = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, NPY_ARRAY_IN_ARRAY,
                                         NULL);
    if (x == NULL) {
        return NULL;
    }
    int tn = PyArray_TYPE(x);
    if (tn != NPY_FLOAT && tn != NPY_DOUBLE) {
        PyErr_SetString(PyExc_TypeError, "_tanh takes float32 or float64");
        goto done;
    }
    y = PyArray_SimpleNew(PyArray_NDIM(x), PyArray_DIMS(x), tn);
    if (y == NULL) {
        goto done;
    }
    npy_intp n = PyArray_SIZE(x);
    Py_BEGIN_ALLOW_THREADS
    st = tn == NPY_FLOAT ? att_tanh_f32(level, n, PyArray_DATA(x), OUT(y))
                         : att_tanh_f64(level, n, PyArray_DATA(x), OUT(y));
    Py_END_ALLOW_THREADS
    if (check_status(st) < 0) {
        Py_CLEAR(y);
    }
done:
    Py_DECREF(x);
    return y;
}

/* ---------------------------------------------------------------------
 * The module
 */

#define METHOD(name)                                                         \
    {#name, (PyCFunction)(void (*)(void))py_##name,                          \
     METH_VARARGS | METH_KEYWORDS, NULL}

static PyMethodDef methods[] = {
    METHOD(mean_context),
    METHOD(mean_context_backward),
    METHOD(additive_score),
    METHOD(additive_score_backward),
    METHOD(masked_softmax),
    METHOD(masked_softmax_backward),
    METHOD(weighted_sum),
    METHOD(weighted_sum_backward),
    METHOD(context_attention),
    METHOD(context_attention_backward),
    {"_simd_best", py_simd_best, METH_NOARGS,
     "Name of the widest SIMD path this CPU runs."},
    {"_get_simd", py_get_simd, METH_NOARGS,
     "Name of the SIMD path the fused kernels use."},
    {"_set_simd", py_set_simd, METH_O,
     "Choose the SIMD path: 'scalar', 'avx2' or 'avx512'."},
    {"_get_num_threads", py_get_num_threads, METH_NOARGS,
     "Threads the fused kernels may use."},
    {"_set_num_threads", py_set_num_threads, METH_O,
     "Set the threads the fused kernels may use (1 .. 256)."},
    {"_fail_alloc_after", (PyCFunction)(void (*)(void))py_fail_alloc_after,
     METH_VARARGS | METH_KEYWORDS,
     "_fail_alloc_after(n, trace=False): make allocation point n fail once "
     "(-1: never) and restart counting; debug aid for the tests."},
    {"_alloc_count", py_alloc_count, METH_NOARGS,
     "Allocation points passed since _fail_alloc_after."},
    {"_alloc_trace", py_alloc_trace, METH_NOARGS,
     "Names of the allocation points passed since _fail_alloc_after(n, "
     "trace=True), or None."},
    {"_tanh", py_tanh, METH_VARARGS,
     "_tanh(x, simd): tanh of a float32/float64 array by one path."},
    {NULL, NULL, 0, NULL}
};

/* Stops the pool's threads when the module goes (interpreter exit). */
static void module_free(void *m)
{
    (void)m;
    Py_CLEAR(fault_trace);
    if (!work_cache_busy) {
        PyMem_RawFree(work_cache);
        work_cache = NULL;
        work_cache_size = 0;
    }
    if (pool != NULL && pool_users == 0) {
        if (att_pool_owned(pool)) {
            att_pool_free(pool);
        }
        else {
            att_pool_abandon(pool);
        }
        pool = NULL;
    }
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "attention_c._core",
    .m_doc = "C kernels of attention_c; use the functions of attention_c.",
    .m_size = 0,
    .m_methods = methods,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__core(void)
{
    import_array();
    simd_level = att_simd_best();
    PyObject *m = PyModule_Create(&module);
#if defined(__clang__)
    const char *compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
    const char *compiler = "gcc " __VERSION__;
#elif defined(_MSC_VER)
    const char *compiler = "msvc " Py_STRINGIFY(_MSC_VER);
#else
    const char *compiler = "unknown";
#endif
    if (m != NULL &&
        PyModule_AddStringConstant(m, "_compiler", compiler) < 0) {
        Py_CLEAR(m);
    }
    return m;
}
