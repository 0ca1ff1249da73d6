/*
 * hooks.c - the tests' hooks into the kernels (attention_c._core_tests
 * only, built with ATT_TEST_HOOKS): one path's tanh, 16-bit conversions,
 * dropout's keep bytes and products, called on arrays so that the tests
 * check each primitive against its NumPy model.
 */
#include "binding.h"

#ifdef ATT_TEST_HOOKS
#include <string.h>

#include "core/dispatch.h"
#include "core/testhooks.h"

/* _tanh(x, simd): tanh of a float32 or float64 array by a given path. */
PyObject *py_tanh(PyObject *self, PyObject *args)
{
    PyObject *obj, *name, *y = NULL;
    PyArrayObject *x = NULL;
    int st = ATT_OK, level;
    (void)self;
    if (!PyArg_ParseTuple(args, "OU:_tanh", &obj, &name) ||
        (level = simd_from_name(name)) < 0) {
        return NULL;
    }
    if (!att_simd_supported(level)) {
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
    st = tn == NPY_FLOAT ? att_tanh_f32(level, n, PyArray_DATA(x),
                                      PyArray_DATA((PyArrayObject *)y))
                         : att_tanh_f64(level, n, PyArray_DATA(x),
                                      PyArray_DATA((PyArrayObject *)y));
    Py_END_ALLOW_THREADS
    if (check_status(st) < 0) {
        Py_CLEAR(y);
    }
done:
    Py_DECREF(x);
    return y;
}

/* _convert16(x, fmt, simd): x (uint16 bits of fmt "bf16"/"f16") widened
 * to float32, or x (float32) rounded to them (uint16 bits), by one
 * path's att_convert16. */
PyObject *py_convert16(PyObject *self, PyObject *args)
{
    PyObject *obj, *name, *y = NULL;
    const char *fmt;
    int level;
    (void)self;
    if (!PyArg_ParseTuple(args, "OsU:_convert16", &obj, &fmt, &name) ||
        (level = simd_from_name(name)) < 0) {
        return NULL;
    }
    int store = strcmp(fmt, "bf16") == 0 ? ATT_STORE_BF16
                : strcmp(fmt, "f16") == 0 ? ATT_STORE_F16 : -1;
    if (store < 0 || !att_simd_supported(level)) {
        return PyErr_Format(PyExc_ValueError, "bad format or path");
    }
    PyArrayObject *x = (PyArrayObject *)PyArray_FromAny(
        obj, NULL, 0, 0, NPY_ARRAY_IN_ARRAY, NULL);
    if (x == NULL) {
        return NULL;
    }
    int widen = PyArray_TYPE(x) == NPY_UINT16;
    if (!widen && PyArray_TYPE(x) != NPY_FLOAT) {
        PyErr_SetString(PyExc_TypeError, "_convert16 takes uint16 (bits) "
                        "or float32");
        goto done;
    }
    y = PyArray_SimpleNew(PyArray_NDIM(x), PyArray_DIMS(x),
                          widen ? NPY_FLOAT : NPY_UINT16);
    if (y != NULL &&
        check_status(att_convert16(level, store, widen, PyArray_SIZE(x),
                                   PyArray_DATA(x),
                                   PyArray_DATA((PyArrayObject *)y))) < 0) {
        Py_CLEAR(y);
    }
done:
    Py_DECREF(x);
    return y;
}

/* _keep_row(seed, p, b, i, t0, n, simd, f64=False): dropout's keep bytes
 * (uint8, 0 or 1) of keys [t0, t0 + n) by one path's keep_row. */
PyObject *py_keep_row(PyObject *self, PyObject *args)
{
    unsigned long long seed;
    double p;
    Py_ssize_t b, i, t0, n;
    PyObject *name;
    int f64 = 0, level, st;
    (void)self;
    if (!PyArg_ParseTuple(args, "KdnnnnU|p:_keep_row", &seed, &p, &b, &i,
                          &t0, &n, &name, &f64) ||
        (level = simd_from_name(name)) < 0) {
        return NULL;
    }
    if (!att_simd_supported(level)) {
        return PyErr_Format(PyExc_ValueError, "this CPU cannot run %s",
                            simd_names[level]);
    }
    npy_intp dims[1] = {n < 0 ? 0 : n};
    PyObject *keep = PyArray_SimpleNew(1, dims, NPY_UINT8);
    if (keep == NULL) {
        return NULL;
    }
    st = att_keep_row_path(level, f64, (uint64_t)seed, p, b, i, t0, n,
                           PyArray_DATA((PyArrayObject *)keep));
    if (st != ATT_OK) {
        Py_DECREF(keep);
        return PyErr_Format(PyExc_ValueError,
                            "_keep_row: need b, i, t0, n >= 0 and "
                            "0 <= p < 1");
    }
    return keep;
}

/* A float32 matrix argument of _gemm (or, where `bits16`, uint16: bf16
 * as stored): rows and columns as element strides (positive, whole
 * elements), shape (*rows, *cols). */
static int gemm_operand(PyArrayObject *x, const char *name, int bits16,
                        ptrdiff_t *rs, ptrdiff_t *cs)
{
    int want = bits16 ? NPY_UINT16 : NPY_FLOAT;
    npy_intp size = bits16 ? 2 : 4;
    if (PyArray_TYPE(x) != want || PyArray_NDIM(x) != 2) {
        PyErr_Format(PyExc_TypeError, "_gemm: %s must be a 2-D %s array",
                     name, bits16 ? "uint16 (bf16 bits)" : "float32");
        return -1;
    }
    npy_intp *st = PyArray_STRIDES(x);
    if (st[0] <= 0 || st[1] <= 0 || st[0] % size || st[1] % size) {
        PyErr_Format(PyExc_ValueError, "_gemm: %s needs positive strides "
                     "of whole elements", name);
        return -1;
    }
    *rs = st[0] / size;
    *cs = st[1] / size;
    return 0;
}

/* _gemm(a, b, c, alpha, beta, simd, unit=0, kmask=None, split=False): c
 * = alpha a b + beta c in place, by one path's gemm, or on its bf16
 * products (unit 1 or True: the dot products' gemm_bf16; 2: AMX's
 * gemm_amx, a split in two bf16 terms where `split`); a (M, K), b (K, N)
 * float32 views with any positive strides (for a unit, either may be
 * uint16: bf16 as stored), c (M, N) float32 with contiguous rows, kmask
 * (K,) uint8 (rows of b counted as zero). */
PyObject *py_gemm(PyObject *self, PyObject *args)
{
    PyArrayObject *a, *b, *c, *km = NULL;
    PyObject *name, *kobj = Py_None;
    double alpha, beta;
    int unit = 0, split = 0, level;
    ptrdiff_t ars, acs, brs, bcs, crs, ccs;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!ddU|iOp:_gemm", &PyArray_Type, &a,
                          &PyArray_Type, &b, &PyArray_Type, &c, &alpha,
                          &beta, &name, &unit, &kobj, &split) ||
        (level = simd_from_name(name)) < 0) {
        return NULL;
    }
    int stored = (unit && PyArray_TYPE(a) == NPY_UINT16 ? ATT_DP_A16 : 0) |
                 (unit && PyArray_TYPE(b) == NPY_UINT16 ? ATT_DP_B16 : 0) |
                 (split ? ATT_DP_A_SPLIT : 0);
    if (gemm_operand(a, "a", stored & ATT_DP_A16, &ars, &acs) < 0 ||
        gemm_operand(b, "b", stored & ATT_DP_B16, &brs, &bcs) < 0 ||
        gemm_operand(c, "c", 0, &crs, &ccs) < 0) {
        return NULL;
    }
    npy_intp M = PyArray_DIM(a, 0), K = PyArray_DIM(a, 1);
    npy_intp N = PyArray_DIM(b, 1);
    if (PyArray_DIM(b, 0) != K || PyArray_DIM(c, 0) != M ||
        PyArray_DIM(c, 1) != N || ccs != 1 ||
        !PyArray_ISWRITEABLE(c)) {
        return PyErr_Format(PyExc_ValueError, "_gemm: a (M, K), b (K, N) "
                            "and a writeable c (M, N) with contiguous "
                            "rows");
    }
    if (kobj != Py_None) {
        km = (PyArrayObject *)PyArray_FROMANY(kobj, NPY_UINT8, 1, 1,
                                              NPY_ARRAY_IN_ARRAY);
        if (km == NULL) {
            return NULL;
        }
        if (PyArray_DIM(km, 0) != K) {
            Py_DECREF(km);
            return PyErr_Format(PyExc_ValueError, "_gemm: kmask needs "
                                "K = %zd bytes", (Py_ssize_t)K);
        }
    }
    ptrdiff_t nw = att_gemm_path_work(level);
    float *work = PyMem_Malloc(((size_t)(nw > 0 ? nw : 0) + 1) *
                               sizeof(float));
    if (work == NULL) {
        Py_XDECREF(km);
        return PyErr_NoMemory();
    }
    int st = att_gemm_path(level, unit, stored, M, N, K, (float)alpha,
                           PyArray_DATA(a), ars, acs, PyArray_DATA(b), brs,
                           bcs, km ? PyArray_DATA(km) : NULL, (float)beta,
                           PyArray_DATA(c), crs, work);
    PyMem_Free(work);
    Py_XDECREF(km);
    if (st == ATT_EINVAL) {
        return PyErr_Format(PyExc_ValueError, "_gemm: this CPU or build "
                            "has no %s%s (or split needs AMX and a float a "
                            "by rows or columns)", unit == 2
                            ? "AMX products on "
                            : unit ? "bf16 dot products on " : "",
                            simd_names[level]);
    }
    if (check_status(st) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}
#endif /* ATT_TEST_HOOKS */
