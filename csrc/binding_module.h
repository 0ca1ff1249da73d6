/*
 * binding_module.h - the module around the table: its private functions
 * (the SIMD path, the threads, the tests' hooks), _publish (the public
 * functions with their docstrings), and make_module, the body of the
 * module's init.  Included once, by binding.c, after binding_driver.h;
 * not a header of its own.
 */

/* ---------------------------------------------------------------------
 * Private: the instruction set, threads; the tests' hooks
 */

static int simd_from_name(PyObject *name)
{
    for (int i = 0; i < N_SIMD; i++) {
        if (PyUnicode_Check(name) &&
            PyUnicode_CompareWithASCIIString(name, simd_names[i]) == 0) {
            return i;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "unknown SIMD path %R; expected 'scalar', 'avx2', "
                 "'avx512' or 'neon'", name);
    return -1;
}

static PyObject *py_simd_best(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(simd_names[att_simd_best()]);
}

/* _simd_paths(): the names of every path this build and CPU run. */
static PyObject *py_simd_paths(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    PyObject *paths = PyList_New(0), *result = NULL;
    if (paths == NULL) {
        return NULL;
    }
    for (int i = 0; i < N_SIMD; i++) {
        if (!att_simd_supported(i)) {
            continue;
        }
        PyObject *name = PyUnicode_FromString(simd_names[i]);
        int st = name == NULL ? -1 : PyList_Append(paths, name);
        Py_XDECREF(name);
        if (st < 0) {
            goto done;
        }
    }
    result = PyList_AsTuple(paths);
done:
    Py_DECREF(paths);
    return result;
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
    if (!att_simd_supported(level)) {
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

/* The module's table, given by make_module: the rows and their two entry
 * points each (CPython passes no row to a C function): the module's
 * function (results as plain tuples) and the public one that _publish
 * makes (a backward's gradients as its named tuple). */
typedef PyObject *(*entry_fn)(PyObject *, PyObject *const *, Py_ssize_t,
                              PyObject *);
#define MAX_FUNCS 32
static FuncSpec *funcs_ = NULL;
static int nfuncs_ = 0;
static const entry_fn *public_entries_ = NULL;

/* The public functions: one method per row, made by _publish. */
static PyMethodDef public_defs[MAX_FUNCS];
static PyObject *public_docs[MAX_FUNCS];    /* their ml_doc, owned */

/* _publish(name, doc, grads=None): the public function of row `name`
 * (attention_c.name): the row's kernel with docstring doc after the
 * signature the table gives (inspect.signature reads it), __module__
 * the package, and for a backward its gradients as the named tuple
 * grads, followed by the extra output when one is asked for. */
static PyObject *py_publish(PyObject *self, PyObject *args)
{
    const char *name;
    PyObject *doc, *grads = Py_None;
    int f = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "sU|O:_publish", &name, &doc, &grads)) {
        return NULL;
    }
    while (f < nfuncs_ && strcmp(funcs_[f].name, name) != 0) {
        f++;
    }
    if (f == nfuncs_) {
        return PyErr_Format(PyExc_ValueError, "_publish: no function %s",
                            name);
    }
    if (grads != Py_None) {
        PyObject *fields = PyObject_GetAttrString(grads, "_fields");
        Py_ssize_t n = fields != NULL && PyTuple_Check(fields)
                       ? PyTuple_GET_SIZE(fields) : -1;
        Py_XDECREF(fields);
        if (!PyType_Check(grads) ||
            !PyType_IsSubtype((PyTypeObject *)grads, &PyTuple_Type) ||
            n != funcs_[f].nfields) {
            PyErr_Clear();
            return PyErr_Format(PyExc_TypeError, "_publish: grads of %s "
                                "must be a named tuple of %d fields", name,
                                funcs_[f].nfields);
        }
    }
    PyObject *text = PyUnicode_FromFormat("%s%U", funcs_[f].textsig, doc);
    const char *utf8 = text != NULL ? PyUnicode_AsUTF8(text) : NULL;
    PyObject *module = PyUnicode_FromString(PUBLIC_MODULE);
    if (utf8 == NULL || module == NULL) {
        Py_XDECREF(text);
        Py_XDECREF(module);
        return NULL;
    }
    public_defs[f] = (PyMethodDef){funcs_[f].name,
                                   (PyCFunction)(void (*)(void))
                                   public_entries_[f],
                                   METH_FASTCALL | METH_KEYWORDS, utf8};
    Py_XSETREF(public_docs[f], text);
    Py_XSETREF(funcs_[f].grads, grads != Py_None
               ? (PyTypeObject *)Py_NewRef(grads) : NULL);
    PyObject *func = PyCMethod_New(&public_defs[f], NULL, module, NULL);
    Py_DECREF(module);
    return func;
}

#ifdef ATT_TEST_HOOKS
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
#endif /* ATT_TEST_HOOKS */

/* ---------------------------------------------------------------------
 * The module
 */

static PyMethodDef private_methods[] = {
    {"_simd_best", py_simd_best, METH_NOARGS,
     "Name of the widest SIMD path this CPU runs."},
    {"_simd_paths", py_simd_paths, METH_NOARGS,
     "Names of every SIMD path this build and CPU run, narrowest first."},
    {"_get_simd", py_get_simd, METH_NOARGS,
     "Name of the SIMD path the fused kernels use."},
    {"_set_simd", py_set_simd, METH_O,
     "Choose the SIMD path: 'scalar', 'avx2', 'avx512' or 'neon'."},
    {"_get_num_threads", py_get_num_threads, METH_NOARGS,
     "Threads the fused kernels may use."},
    {"_set_num_threads", py_set_num_threads, METH_O,
     "Set the threads the fused kernels may use (1 .. 256)."},
    {"_publish", py_publish, METH_VARARGS,
     "_publish(name, doc, grads=None): the public function attention_c.name "
     "with its docstring (and, for a backward, its named tuple)."},
#ifdef ATT_TEST_HOOKS
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
#endif
};

#define N_PRIVATE ((int)(sizeof(private_methods) / sizeof(private_methods[0])))

/* The rows of the table, then the private functions; made at import. */
static PyMethodDef methods[MAX_FUNCS + N_PRIVATE + 1];

/* Stops the pool's threads when the module goes (interpreter exit). */
static void module_free(void *m)
{
    (void)m;
#ifdef ATT_TEST_HOOKS
    Py_CLEAR(fault_trace);
#endif
    for (int f = 0; f < nfuncs_; f++) {
        /* the functions may outlive the module: keep ml_doc valid */
        public_defs[f].ml_doc = funcs_[f].textsig;
        Py_CLEAR(public_docs[f]);
        Py_CLEAR(funcs_[f].grads);
    }
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
    .m_name = MODULE_NAME,
    .m_doc = MODULE_DOC,
    .m_size = 0,
    .m_methods = methods,
    .m_free = module_free,
};

/* The module of the table funcs (nfuncs rows, with nentries entry points
 * of each kind); the body of MODULE_INIT. */
static PyObject *make_module(FuncSpec *funcs, int nfuncs,
                             const entry_fn *entries,
                             const entry_fn *public_entries, int nentries)
{
    import_array();
    if (nentries != nfuncs || nfuncs > MAX_FUNCS) {
        PyErr_SetString(PyExc_SystemError, "attention_c: one entry point "
                        "per row of the table, at most MAX_FUNCS rows");
        return NULL;
    }
    if (init_table(funcs, nfuncs) < 0) {
        return NULL;
    }
    funcs_ = funcs;
    nfuncs_ = nfuncs;
    public_entries_ = public_entries;
    for (int f = 0; f < nfuncs; f++) {
        methods[f] = (PyMethodDef){funcs[f].name,
                                   (PyCFunction)(void (*)(void))entries[f],
                                   METH_FASTCALL | METH_KEYWORDS,
                                   funcs[f].textsig};
    }
    for (int p = 0; p < N_PRIVATE; p++) {
        methods[nfuncs + p] = private_methods[p];
    }
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

