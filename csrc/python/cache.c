/*
 * cache.c - the binding of attention against a key/value cache
 * (attention.h's att_cache_attention): attention_c._core._cache_attention,
 * called by attention_c/cache.py once it has checked every argument
 * against the contract and written the new keys and values into the
 * cache.  Not a row of the table (table.c): its caches are written in
 * place by the caller and read where they are, with any strides and in
 * four dtypes, which the table's gufunc-style rows (inputs cast to one
 * contiguous dtype) do not describe.  The checks here only guard the
 * kernel's memory (types, shapes, strides); the kernel checks lengths
 * and table entries itself.
 */
#include "binding.h"

#include <string.h>

/* An ndarray of `nd` axes (nd < 0: any), or NULL with TypeError. */
static PyArrayObject *as_array(PyObject *o, const char *name, int nd)
{
    if (!PyArray_Check(o) ||
        (nd >= 0 && PyArray_NDIM((PyArrayObject *)o) != nd)) {
        PyErr_Format(PyExc_TypeError, "_cache_attention: %s must be an "
                     "ndarray of %d axes", name, nd);
        return NULL;
    }
    return (PyArrayObject *)o;
}

/* The element store of a cache: ATT_STORE_* for the 16-bit dtypes and
 * int8 with a float32 call, ATT_STORE_NATIVE for the call's own dtype;
 * -1 else. */
static int cache_store(PyArrayObject *a, int typenum)
{
    int h = half_store(PyArray_DESCR(a));
    if (h != ATT_STORE_NATIVE || PyArray_TYPE(a) == NPY_INT8) {
        return typenum != NPY_FLOAT ? -1
               : h != ATT_STORE_NATIVE ? h : ATT_STORE_Q8;
    }
    return PyArray_TYPE(a) == typenum ? ATT_STORE_NATIVE : -1;
}

/* Strides in elements of a's axes, the last one 1; -1 when a stride is
 * not a whole number of elements or the last is not 1.  An empty array's
 * (whose strides NumPy may give as 0) are 0: none is read. */
static int elem_strides(PyArrayObject *a, ptrdiff_t *s)
{
    npy_intp size = PyArray_ITEMSIZE(a);
    int nd = PyArray_NDIM(a);
    for (int k = 0; k < nd && PyArray_SIZE(a) == 0; k++) {
        s[k] = 0;
    }
    if (PyArray_SIZE(a) == 0) {
        return 0;
    }
    for (int k = 0; k < nd; k++) {
        npy_intp st = PyArray_STRIDE(a, k);
        if (st % size != 0) {
            return -1;
        }
        s[k] = st / size;
    }
    return nd > 0 && PyArray_DIM(a, nd - 1) > 1 && s[nd - 1] != 1 ? -1 : 0;
}

/* An int8 cache's scales (None for the others): float32 or float16, the
 * cache's first three axes and ng groups of `width` / ng elements, the
 * last axis contiguous.  Their strides (elements) in s, the group size in
 * *group, 1 in *half for float16.  0, or -1 with an exception. */
static int cache_scales(PyObject *o, PyArrayObject *cache, int store,
                        ptrdiff_t width, ptrdiff_t *s, ptrdiff_t *group,
                        int *half)
{
    *group = 0;
    *half = 0;
    if (store != ATT_STORE_Q8) {
        if (o != Py_None) {
            PyErr_SetString(PyExc_ValueError, "_cache_attention: scales "
                            "go with an int8 cache only");
            return -1;
        }
        return 0;
    }
    PyArrayObject *a = as_array(o, "scales", 4);
    if (a == NULL) {
        return -1;
    }
    npy_intp *d = PyArray_DIMS(a), *c = PyArray_DIMS(cache);
    int t = PyArray_TYPE(a);
    if ((t != NPY_FLOAT && t != NPY_HALF) || d[0] != c[0] || d[1] != c[1] ||
        d[2] != c[2] || d[3] < 1 || width % d[3] != 0 ||
        elem_strides(a, s) < 0 || !PyArray_ISALIGNED(a)) {
        PyErr_SetString(PyExc_ValueError, "_cache_attention: an int8 "
                        "cache's scales must be float32 or float16, shaped "
                        "as the cache with a group axis dividing its rows, "
                        "aligned, their last axis contiguous");
        return -1;
    }
    *group = width / d[3];
    *half = t == NPY_HALF;
    return 0;
}

/* A C-contiguous aligned array of type `typenum` and `nd` axes, or None
 * (allowed when `opt`). */
static int c_array(PyObject *o, const char *name, int nd, int typenum,
                   int opt, PyArrayObject **out)
{
    *out = NULL;
    if (o == Py_None && opt) {
        return 0;
    }
    PyArrayObject *a = as_array(o, name, nd);
    if (a == NULL) {
        return -1;
    }
    if (PyArray_TYPE(a) != typenum || !PyArray_IS_C_CONTIGUOUS(a) ||
        !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_TypeError, "_cache_attention: %s must be a "
                     "C-contiguous aligned array of the call's dtype", name);
        return -1;
    }
    *out = a;
    return 0;
}

typedef struct {
    PyArrayObject *q, *kc, *vc, *lens, *table, *alibi, *sinks, *out, *lse;
} CacheArrays;

/* Shapes and dtypes: the kernel's memory is what these say. */
static int cache_shapes(const CacheArrays *a, att_cache_dims *c, int typenum)
{
    npy_intp *q = PyArray_DIMS(a->q), *k = PyArray_DIMS(a->kc);
    npy_intp *v = PyArray_DIMS(a->vc);
    c->B = q[0];
    c->Tq = q[1];
    c->Hq = q[2];
    c->d = q[3];
    c->Hkv = k[2];
    c->dv = v[3];
    c->nblocks = k[0];
    c->block = k[1];
    c->maxblocks = a->table != NULL ? PyArray_DIM(a->table, 1) : 1;
    npy_intp *o = PyArray_DIMS(a->out), *l = PyArray_DIMS(a->lse);
    int ok = k[0] == v[0] && k[1] == v[1] && k[2] == v[2] && k[3] == q[3] &&
             PyArray_DIM(a->lens, 0) == q[0] &&
             (a->table == NULL || PyArray_DIM(a->table, 0) == q[0]) &&
             o[0] == q[0] && o[1] == q[1] && o[2] == q[2] && o[3] == v[3] &&
             l[0] == q[0] && l[1] == q[1] && l[2] == q[2] &&
             (a->sinks == NULL || PyArray_DIM(a->sinks, 0) == q[2]) &&
             (a->alibi == NULL ||
              (PyArray_DIM(a->alibi, 1) == q[2] &&
               (PyArray_DIM(a->alibi, 0) == 1 ||
                PyArray_DIM(a->alibi, 0) == q[0])));
    if (!ok || PyArray_TYPE(a->q) != typenum) {
        PyErr_SetString(PyExc_ValueError, "_cache_attention: the arrays' "
                        "shapes or dtypes do not agree");
        return -1;
    }
    return 0;
}

/* A call's arguments as the kernel takes them: the arrays, their
 * element strides and stores, the scales' groups, the sizes. */
typedef struct {
    PyObject *o[11];
    double scale, softcap;
    int causal, typenum, kstore, vstore, k16, v16;
    Py_ssize_t wleft, wright;
    CacheArrays a;
    att_cache_dims c;
    ptrdiff_t qs[4], ks[4], vs[4], kss[4], vss[4], kgroup, vgroup;
} CacheCall;

/* _cache_attention's arguments parsed and checked into k: 0, or -1 with
 * an exception. */
static int cache_call(PyObject *args, CacheCall *k)
{
    PyObject **o = k->o;
    CacheArrays *a = &k->a;
    if (!PyArg_ParseTuple(args, "OOOOOOOdpnndOOOO:_cache_attention", &o[0],
                          &o[1], &o[2], &o[3], &o[4], &o[9], &o[10],
                          &k->scale, &k->causal, &k->wleft, &k->wright,
                          &k->softcap, &o[5], &o[6], &o[7], &o[8])) {
        return -1;
    }
    if ((a->q = as_array(o[0], "query", 4)) == NULL ||
        (a->kc = as_array(o[1], "k_cache", 4)) == NULL ||
        (a->vc = as_array(o[2], "v_cache", 4)) == NULL) {
        return -1;
    }
    int typenum = k->typenum = PyArray_TYPE(a->q);
    if (typenum != NPY_FLOAT && typenum != NPY_DOUBLE) {
        PyErr_SetString(PyExc_TypeError, "_cache_attention: query must be "
                        "float32 or float64");
        return -1;
    }
    if (c_array(o[3], "cache_seqlens", 1, NPY_INT64, 0, &a->lens) < 0 ||
        c_array(o[4], "block_table", 2, NPY_INT64, 1, &a->table) < 0 ||
        c_array(o[5], "alibi_slopes", 2, typenum, 1, &a->alibi) < 0 ||
        c_array(o[6], "sinks", 1, typenum, 1, &a->sinks) < 0 ||
        c_array(o[7], "out", 4, typenum, 0, &a->out) < 0 ||
        c_array(o[8], "lse", 3, typenum, 0, &a->lse) < 0) {
        return -1;
    }
    if (!PyArray_ISWRITEABLE(a->out) || !PyArray_ISWRITEABLE(a->lse)) {
        PyErr_SetString(PyExc_ValueError, "_cache_attention: out and lse "
                        "must be writeable");
        return -1;
    }
    k->kstore = cache_store(a->kc, typenum);
    k->vstore = cache_store(a->vc, typenum);
    if (cache_shapes(a, &k->c, typenum) < 0) {
        return -1;
    }
    if (k->kstore < 0 || k->vstore < 0 || elem_strides(a->q, k->qs) < 0 ||
        elem_strides(a->kc, k->ks) < 0 || elem_strides(a->vc, k->vs) < 0 ||
        !PyArray_ISALIGNED(a->q) || !PyArray_ISALIGNED(a->kc) ||
        !PyArray_ISALIGNED(a->vc)) {
        PyErr_SetString(PyExc_ValueError, "_cache_attention: a cache's "
                        "dtype does not suit the query's, or an array is "
                        "unaligned or its last axis not contiguous");
        return -1;
    }
    if (cache_scales(o[9], a->kc, k->kstore, k->c.d, k->kss, &k->kgroup,
                     &k->k16) < 0 ||
        cache_scales(o[10], a->vc, k->vstore, k->c.dv, k->vss, &k->vgroup,
                     &k->v16) < 0) {
        return -1;
    }
    k->c.causal = k->causal;
    k->c.wleft = k->wleft;
    k->c.wright = k->wright;
    return 0;
}

/* _cache_attention(query, k_cache, v_cache, lens, table, k_scales,
 * v_scales, scale, causal, wleft, wright, softcap, alibi, sinks, out,
 * lse): lens int64 (B,), table int64 (B, maxblocks) or None, scales for
 * int8 caches (else None), alibi (1 or B, Hq) or None, sinks (Hq,) or
 * None, out and lse C-contiguous of the query's dtype, float32 or float64
 * (written). */
PyObject *py_cache_attention(PyObject *self, PyObject *args)
{
    CacheCall k;
    (void)self;
    if (cache_call(args, &k) < 0) {
        return NULL;
    }
    const CacheArrays *a = &k.a;
    const att_cache_dims *c = &k.c;
    att_cache_in_f32 in32;
    att_cache_in_f64 in64;
    /* the same fields in both; REAL ones set per type below */
#define FILL(in)                                                             \
    do {                                                                     \
        memset(&(in), 0, sizeof(in));                                        \
        (in).qbs = k.qs[0];                                                  \
        (in).qis = k.qs[1];                                                  \
        (in).qhs = k.qs[2];                                                  \
        (in).kc = PyArray_DATA(a->kc);                                       \
        (in).vc = PyArray_DATA(a->vc);                                       \
        (in).kstore = k.kstore;                                              \
        (in).vstore = k.vstore;                                              \
        (in).kbs = k.ks[0];                                                  \
        (in).krs = k.ks[1];                                                  \
        (in).khs = k.ks[2];                                                  \
        (in).vbs = k.vs[0];                                                  \
        (in).vrs = k.vs[1];                                                  \
        (in).vhs = k.vs[2];                                                  \
        (in).lens = PyArray_DATA(a->lens);                                   \
        if (k.kgroup > 0) {                                                  \
            (in).kscale = PyArray_DATA((PyArrayObject *)k.o[9]);             \
            (in).kscale16 = k.k16;                                           \
            (in).ksbs = k.kss[0];                                            \
            (in).ksrs = k.kss[1];                                            \
            (in).kshs = k.kss[2];                                            \
            (in).kgroup = k.kgroup;                                          \
        }                                                                    \
        if (k.vgroup > 0) {                                                  \
            (in).vscale = PyArray_DATA((PyArrayObject *)k.o[10]);            \
            (in).vscale16 = k.v16;                                           \
            (in).vsbs = k.vss[0];                                            \
            (in).vsrs = k.vss[1];                                            \
            (in).vshs = k.vss[2];                                            \
            (in).vgroup = k.vgroup;                                          \
        }                                                                    \
        (in).table = a->table != NULL ? PyArray_DATA(a->table) : NULL;       \
        (in).query = PyArray_DATA(a->q);                                     \
        (in).scale = k.scale;                                                \
        (in).softcap = k.softcap;                                            \
        (in).alibi = a->alibi != NULL ? PyArray_DATA(a->alibi) : NULL;       \
        (in).alibi_bs = a->alibi != NULL && PyArray_DIM(a->alibi, 0) > 1     \
                        ? c->Hq : 0;                                         \
        (in).sinks = a->sinks != NULL ? PyArray_DATA(a->sinks) : NULL;       \
    } while (0)
    FILL(in32);
    FILL(in64);
#undef FILL
    att_exec ex = begin_exec();
    ptrdiff_t bytes = k.typenum == NPY_FLOAT
                      ? att_cache_workspace_f32(c, &in32, &ex)
                      : att_cache_workspace_f64(c, &in64, &ex);
    void *work = NULL;
    int status = ATT_EINVAL;
    if (bytes >= 0) {
        work = ALLOC_POINT("scratch of", "_cache_attention", 1) < 0 ? NULL
               : PyMem_RawMalloc(bytes > 0 ? (size_t)bytes : 1);
        if (work == NULL) {
            end_exec(&ex);
            return PyErr_Occurred() ? NULL : PyErr_NoMemory();
        }
        Py_BEGIN_ALLOW_THREADS
        status = k.typenum == NPY_FLOAT
                 ? att_cache_attention_f32(c, &ex, &in32,
                                           PyArray_DATA(a->out),
                                           PyArray_DATA(a->lse), work)
                 : att_cache_attention_f64(c, &ex, &in64,
                                           PyArray_DATA(a->out),
                                           PyArray_DATA(a->lse), work);
        Py_END_ALLOW_THREADS
    }
    PyMem_RawFree(work);
    end_exec(&ex);
    if (status != ATT_OK) {
        PyErr_SetString(PyExc_ValueError, "_cache_attention: sizes, "
                        "lengths or block table out of range");
        return NULL;
    }
    Py_RETURN_NONE;
}
