/*
 * module.c - the module around the table: its init (the table's patterns
 * parsed and each row's signature made, once), its private functions (the
 * SIMD path, the threads, the tests' hooks), _publish (the public
 * functions with their docstrings) and _table (the table, for Python).
 *
 * Each row is two builtins: the module's (a backward returns a plain
 * tuple) and the public attention_c.<name>, made by _publish with the
 * docstring attention_c/_docstrings.py gives and the row's signature (so
 * inspect.signature works), whose backward returns its named tuple.  A
 * decoder calls thousands of times per epoch, so the public functions
 * are these C functions, not Python wrappers, and the common case skips
 * NumPy's conversions (parse.c, views.c).
 */
#define BINDING_IMPORT_ARRAY
#include "binding.h"
#include "core/peak.h"

#ifdef ATT_TEST_HOOKS
#include "core/testhooks.h"
#define MODULE_NAME "attention_c._core_tests"
#define MODULE_DOC "attention_c._core with the tests' hooks (allocation " \
    "points, fault injection, _tanh); for the test suite only."
#define MODULE_INIT PyInit__core_tests
/* __module__ of the functions _publish makes */
#define PUBLIC_MODULE MODULE_NAME
#else
#define MODULE_NAME "attention_c._core"
#define MODULE_DOC "C kernels of attention_c; use the functions of " \
    "attention_c."
#define MODULE_INIT PyInit__core
#define PUBLIC_MODULE "attention_c"
#endif

#define MAX_FUNCS 32

PyObject *arg_name_objs[N_ARG_IDS];

/* ---------------------------------------------------------------------
 * The entry points: two per row (CPython passes no row to a C function),
 * the module's function (results as plain tuples) and the public one that
 * _publish makes (a backward's gradients as its named tuple)
 */

typedef PyObject *(*entry_fn)(PyObject *, PyObject *const *, Py_ssize_t,
                              PyObject *);

#define ENTRY(i)                                                             \
    static PyObject *entry_##i(PyObject *self, PyObject *const *args,       \
                               Py_ssize_t nargs, PyObject *kwnames)          \
    {                                                                        \
        (void)self;                                                          \
        return call_function(&funcs[i], args, nargs, kwnames, NULL);         \
    }                                                                        \
    static PyObject *public_##i(PyObject *self, PyObject *const *args,      \
                                Py_ssize_t nargs, PyObject *kwnames)         \
    {                                                                        \
        (void)self;                                                          \
        return call_function(&funcs[i], args, nargs, kwnames,                \
                             funcs[i].grads);                                \
    }
ENTRY(0) ENTRY(1) ENTRY(2) ENTRY(3) ENTRY(4) ENTRY(5) ENTRY(6) ENTRY(7)
ENTRY(8) ENTRY(9) ENTRY(10) ENTRY(11) ENTRY(12) ENTRY(13) ENTRY(14)
ENTRY(15) ENTRY(16) ENTRY(17) ENTRY(18) ENTRY(19) ENTRY(20) ENTRY(21)
#undef ENTRY

static const entry_fn entries[] = {
    entry_0, entry_1, entry_2, entry_3, entry_4, entry_5, entry_6, entry_7,
    entry_8, entry_9, entry_10, entry_11, entry_12, entry_13, entry_14,
    entry_15, entry_16, entry_17, entry_18, entry_19, entry_20, entry_21};
static const entry_fn public_entries[] = {
    public_0, public_1, public_2, public_3, public_4, public_5, public_6,
    public_7, public_8, public_9, public_10, public_11, public_12, public_13,
    public_14, public_15, public_16, public_17, public_18, public_19,
    public_20, public_21};

#define N_ENTRIES ((int)(sizeof(entries) / sizeof(entries[0])))

/* ---------------------------------------------------------------------
 * The table, made ready at import
 */

/* The default an optional argument shows in its signature. */
static const char *default_text(unsigned flags)
{
    return flags & F_TRUE ? "True"
           : flags & F_FLAG ? "False"
           : flags & F_NUMBER ? "0.0" : "None";
}

/* Row fn's arguments: their kinds (args.h) added to the row's flags,
 * their positions and patterns, and the signature CPython shows. */
static int init_args(FuncSpec *fn)
{
    size_t len = (size_t)PyOS_snprintf(fn->textsig, sizeof fn->textsig,
                                       "%s(", fn->name);
    for (int id = 0; id < N_ARG_IDS; id++) {
        fn->pos[id] = -1;
    }
    if (fn->npos < fn->nreq) {
        fn->npos = fn->nreq;       /* the default: the required ones */
    }
    for (fn->nargs = 0; fn->nargs < MAX_ARGS &&
                        fn->args[fn->nargs].id != X_NONE; fn->nargs++) {
        ArgSpec *a = &fn->args[fn->nargs];
        a->flags |= arg_kinds[a->id];
        fn->pos[a->id] = fn->nargs;
        if (a->shape != NULL && parse_pattern(a->shape, &a->pat) < 0) {
            return -1;
        }
        /* the keyword-only ones after a "*" */
        len += (size_t)PyOS_snprintf(
            fn->textsig + len, sizeof fn->textsig - len, "%s%s%s%s%s",
            fn->nargs ? ", " : "", fn->nargs == fn->npos ? "*, " : "",
            arg_names[a->id], fn->nargs < fn->nreq ? "" : "=",
            fn->nargs < fn->nreq ? "" : default_text(a->flags));
    }
    if (fn->npos > fn->nargs) {
        PyErr_Format(PyExc_SystemError, "attention_c: %s has npos > "
                     "nargs", fn->name);
        return -1;
    }
    len += (size_t)PyOS_snprintf(fn->textsig + len,
                                 sizeof fn->textsig - len, ")\n--\n\n");
    if (len >= sizeof fn->textsig) {
        PyErr_Format(PyExc_SystemError, "attention_c: signature of %s "
                     "too long", fn->name);
        return -1;
    }
    return 0;
}

/* Row fn's outputs: their positions and patterns. */
static int init_outs(FuncSpec *fn)
{
    for (int id = 0; id < N_OUT_IDS; id++) {
        fn->opos[id] = -1;
    }
    fn->nfields = 0;
    for (fn->nouts = 0; fn->nouts < MAX_OUTS &&
                        fn->outs[fn->nouts].shape != NULL; fn->nouts++) {
        OutSpec *o = &fn->outs[fn->nouts];
        fn->opos[o->id] = fn->nouts;
        fn->nfields += !o->drop;
        if (parse_pattern(o->shape, &o->pat) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Parses the table's patterns and makes each row's signature, once. */
static int init_table(void)
{
    if (n_funcs != N_ENTRIES || n_funcs > MAX_FUNCS) {
        PyErr_SetString(PyExc_SystemError, "attention_c: one ENTRY per row "
                        "of the table, at most MAX_FUNCS rows");
        return -1;
    }
    for (int id = X_NONE + 1; id < N_ARG_IDS; id++) {
        if (arg_name_objs[id] == NULL &&
            (arg_name_objs[id] = PyUnicode_InternFromString(arg_names[id]))
            == NULL) {
            return -1;
        }
    }
    for (int f = 0; f < n_funcs; f++) {
        if (init_args(&funcs[f]) < 0 || init_outs(&funcs[f]) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------
 * _table(): the table for Python
 */

/* The kind of an argument, by name. */
static const char *kind_name(unsigned flags)
{
    return flags & F_MASK ? "mask"
           : flags & F_FLAG ? "flag"
           : flags & F_NUMBER ? "number"
           : flags & F_SEED ? "seed"
           : flags & F_SCALE ? "scale"
           : flags & F_WINDOW ? "window"
           : flags & F_NUMARR ? "number_or_array" : "array";
}

/* (name, kind, shape, required, positional, default) of argument i; the
 * default of a required one is None. */
static PyObject *arg_entry(const FuncSpec *fn, int i)
{
    const ArgSpec *a = &fn->args[i];
    int opt = i >= fn->nreq;
    PyObject *dflt = opt && (a->flags & F_NUMBER) ? PyFloat_FromDouble(0.0)
                     : Py_NewRef(opt && (a->flags & F_TRUE) ? Py_True
                                 : opt && (a->flags & F_FLAG) ? Py_False
                                 : Py_None);
    if (dflt == NULL) {
        return NULL;
    }
    return Py_BuildValue("(sszNNN)", arg_names[a->id], kind_name(a->flags),
                         a->shape, PyBool_FromLong(!opt),
                         PyBool_FromLong(i < fn->npos), dflt);
}

/* (name, shape, like, when, unless, extra) of output k: like, when and
 * unless are argument names or None; extra: left out of the result, not
 * None, when not made (an extra result, or one of two alternatives). */
static PyObject *out_entry(const FuncSpec *fn, int k)
{
    const OutSpec *o = &fn->outs[k];
    return Py_BuildValue("(sszzzN)", out_names[o->id], o->shape,
                         o->like != X_NONE ? arg_names[o->like] : NULL,
                         o->when != X_NONE ? arg_names[o->when] : NULL,
                         o->unless != X_NONE ? arg_names[o->unless] : NULL,
                         PyBool_FromLong(o->drop));
}

/* {name: (arguments, outputs)} for every row, in the table's order. */
static PyObject *py_table(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    PyObject *table = PyDict_New();
    for (int f = 0; table != NULL && f < n_funcs; f++) {
        const FuncSpec *fn = &funcs[f];
        PyObject *args = PyTuple_New(fn->nargs);
        PyObject *outs = PyTuple_New(fn->nouts);
        PyObject *row = NULL;
        int ok = args != NULL && outs != NULL;
        for (int i = 0; ok && i < fn->nargs; i++) {
            PyObject *e = arg_entry(fn, i);
            ok = e != NULL;
            if (ok) {
                PyTuple_SET_ITEM(args, i, e);
            }
        }
        for (int k = 0; ok && k < fn->nouts; k++) {
            PyObject *e = out_entry(fn, k);
            ok = e != NULL;
            if (ok) {
                PyTuple_SET_ITEM(outs, k, e);
            }
        }
        row = ok ? PyTuple_Pack(2, args, outs) : NULL;
        if (row == NULL || PyDict_SetItemString(table, fn->name, row) < 0) {
            Py_CLEAR(table);
        }
        Py_XDECREF(row);
        Py_XDECREF(args);
        Py_XDECREF(outs);
    }
    return table;
}

/* ---------------------------------------------------------------------
 * Private: the instruction set, threads; the tests' hooks
 */

/* The index of the str `name` in names[0 .. n), or -1 */
static int name_index(PyObject *name, const char *const *names, int n)
{
    for (int i = 0; i < n; i++) {
        if (PyUnicode_Check(name) &&
            PyUnicode_CompareWithASCIIString(name, names[i]) == 0) {
            return i;
        }
    }
    return -1;
}

int simd_from_name(PyObject *name)
{
    int i = name_index(name, simd_names, N_SIMD);
    if (i < 0) {
        PyErr_Format(PyExc_ValueError,
                     "unknown SIMD path %R; expected 'scalar', 'avx2', "
                     "'avx512' or 'neon'", name);
    }
    return i;
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

static PyObject *py_get_fp32_precision(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(precision_names[fp32_precision]);
}

static PyObject *py_set_fp32_precision(PyObject *self, PyObject *name)
{
    (void)self;
    int i = name_index(name, precision_names, N_PRECISION);
    if (i < 0) {
        return PyErr_Format(PyExc_ValueError,
                            "fp32 precision must be 'ieee' or 'bf16', got "
                            "%R", name);
    }
    fp32_precision = i;
    Py_RETURN_NONE;
}

static PyObject *py_bf16_products(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(bf16_unit_used() != 0);
}

static PyObject *py_bf16_unit(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    int used = bf16_unit_used();
    return used == 0 ? Py_NewRef(Py_None)
                     : PyUnicode_FromString(bf16_unit_names[used]);
}

static PyObject *py_bf16_units(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    int dot = bf16_units_have(simd_level) & 1;
    int amx = bf16_units_have(simd_level) >> 1 & 1;
    return Py_BuildValue(dot && amx ? "(ss)" : dot || amx ? "(s)" : "()",
                         bf16_unit_names[dot ? ATT_BF16_DOT : ATT_BF16_AMX],
                         bf16_unit_names[ATT_BF16_AMX]);
}

static PyObject *py_bf16_dot_speedup(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyFloat_FromDouble(att_bf16_dot_speedup(simd_level));
}

static PyObject *py_get_bf16_unit(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(bf16_unit_names[bf16_unit]);
}

static PyObject *py_set_bf16_unit(PyObject *self, PyObject *name)
{
    (void)self;
    int i = name_index(name, bf16_unit_names, N_BF16_UNIT);
    if (i < 0) {
        return PyErr_Format(PyExc_ValueError,
                            "bf16 unit must be 'auto', 'dot' or 'amx', got "
                            "%R", name);
    }
    if (i != 0 && !(bf16_units_have(simd_level) >> (i - 1) & 1)) {
        return PyErr_Format(PyExc_ValueError,
                            "this CPU and the %s path have no %s",
                            simd_names[simd_level],
                            i == ATT_BF16_DOT
                            ? "bf16 dot products (AVX512_BF16)"
                            : "AMX tiles");
    }
    bf16_unit = i;
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

/* _fma_loop(dtype, simd, iters, threads): the FMA peak loop of a path
 * (core/peak.h) on `threads` threads of the pool at once, without the
 * GIL; returns the flops performed (the caller times the call). */
static PyObject *py_fma_loop(PyObject *self, PyObject *args)
{
    PyObject *dtype_obj, *name;
    PyArray_Descr *dtype = NULL;
    Py_ssize_t iters;
    int threads, level, st;
    double flops = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OUni:_fma_loop", &dtype_obj, &name, &iters,
                          &threads) ||
        (level = simd_from_name(name)) < 0) {
        return NULL;
    }
    /* NumPy reads None as float64: not here */
    if (dtype_obj != Py_None && !PyArray_DescrConverter(dtype_obj, &dtype)) {
        PyErr_Clear();
    }
    int tn = dtype == NULL ? NPY_NOTYPE : dtype->type_num;
    Py_XDECREF(dtype);
    if (tn != NPY_FLOAT && tn != NPY_DOUBLE) {
        return PyErr_Format(PyExc_ValueError,
                            "dtype must be float32 or float64, got %R",
                            dtype_obj);
    }
    if (!att_simd_supported(level)) {
        return PyErr_Format(PyExc_ValueError,
                            "this CPU cannot run the %s path; the best it "
                            "has is %s", simd_names[level],
                            simd_names[att_simd_best()]);
    }
    if (iters < 1) {
        return PyErr_Format(PyExc_ValueError,
                            "iters must be at least 1, got %zd", iters);
    }
    if (threads < 1 || threads > MAX_THREADS) {
        return PyErr_Format(PyExc_ValueError,
                            "the number of threads must be in [1, %d], "
                            "got %d", MAX_THREADS, threads);
    }
    att_pool *p = threads > 1 ? take_pool(threads) : NULL;
    Py_BEGIN_ALLOW_THREADS
    st = att_fma_loop(level, tn == NPY_DOUBLE, iters, p, threads, &flops);
    Py_END_ALLOW_THREADS
    drop_pool(p);
    if (st == -2) {
        return PyErr_Format(PyExc_SystemError,
                            "attention_c: the %s FMA loop's chains did not "
                            "give their known sum; this is a bug, please "
                            "report it", simd_names[level]);
    }
    if (st < 0) {
        check_status(st);
        return NULL;
    }
    if (st < threads) {
        return PyErr_Format(PyExc_RuntimeError,
                            "only %d of the %d threads ran the FMA loop at "
                            "once (threads could not be started, or another "
                            "call held the pool); the time is not the peak",
                            st, threads);
    }
    return PyFloat_FromDouble(flops);
}

/* ---------------------------------------------------------------------
 * _publish: the public functions
 */

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
    while (f < n_funcs && strcmp(funcs[f].name, name) != 0) {
        f++;
    }
    if (f == n_funcs) {
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
            n != funcs[f].nfields) {
            PyErr_Clear();
            return PyErr_Format(PyExc_TypeError, "_publish: grads of %s "
                                "must be a named tuple of %d fields", name,
                                funcs[f].nfields);
        }
    }
    PyObject *text = PyUnicode_FromFormat("%s%U", funcs[f].textsig, doc);
    const char *utf8 = text != NULL ? PyUnicode_AsUTF8(text) : NULL;
    PyObject *module = PyUnicode_FromString(PUBLIC_MODULE);
    if (utf8 == NULL || module == NULL) {
        Py_XDECREF(text);
        Py_XDECREF(module);
        return NULL;
    }
    public_defs[f] = (PyMethodDef){funcs[f].name,
                                   (PyCFunction)(void (*)(void))
                                   public_entries[f],
                                   METH_FASTCALL | METH_KEYWORDS, utf8};
    Py_XSETREF(public_docs[f], text);
    Py_XSETREF(funcs[f].grads, grads != Py_None
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
    {"_get_fp32_precision", py_get_fp32_precision, METH_NOARGS,
     "The products float32 calls may run on: 'ieee' or 'bf16'."},
    {"_set_fp32_precision", py_set_fp32_precision, METH_O,
     "Set the products float32 calls may run on: 'ieee' or 'bf16'."},
    {"_bf16_products", py_bf16_products, METH_NOARGS,
     "Whether float32 calls allowing bf16 run bf16 products on this CPU "
     "and SIMD path."},
    {"_bf16_unit", py_bf16_unit, METH_NOARGS,
     "The unit those bf16 products run on: 'dot', 'amx' or None."},
    {"_bf16_units", py_bf16_units, METH_NOARGS,
     "The units of bf16 products this CPU and SIMD path have."},
    {"_bf16_dot_speedup", py_bf16_dot_speedup, METH_NOARGS,
     "The bf16 dot products' rate over the float32 FMAs' on this path, "
     "measured now (0: none)."},
    {"_get_bf16_unit", py_get_bf16_unit, METH_NOARGS,
     "The chosen unit of bf16 products: 'auto', 'dot' or 'amx'."},
    {"_set_bf16_unit", py_set_bf16_unit, METH_O,
     "Choose the unit of bf16 products: 'auto' (the fastest), 'dot' "
     "(AVX512_BF16) or 'amx'."},
    {"_get_num_threads", py_get_num_threads, METH_NOARGS,
     "Threads the fused kernels may use."},
    {"_set_num_threads", py_set_num_threads, METH_O,
     "Set the threads the fused kernels may use (1 .. 256)."},
    {"_publish", py_publish, METH_VARARGS,
     "_publish(name, doc, grads=None): the public function attention_c.name "
     "with its docstring (and, for a backward, its named tuple)."},
    {"_fma_loop", py_fma_loop, METH_VARARGS,
     "_fma_loop(dtype, simd, iters, threads): run the FMA peak loop of path "
     "simd for dtype (float32, float64), iters steps, on `threads` threads "
     "at once; returns the flops performed, threads x 2 x lanes x "
     "accumulators x iters (the caller times the call)."},
    {"_cache_attention", py_cache_attention, METH_VARARGS,
     "_cache_attention(query, k_cache, v_cache, lens, table, scale, causal, "
     "wleft, wright, softcap, alibi, sinks, out, lse): the kernel of "
     "attention_c.cache_attention, whose arguments it takes checked."},
    {"_table", py_table, METH_NOARGS,
     "_table(): {name: (arguments, outputs)} of every public function: "
     "each argument (name, kind, shape, required, positional, default), "
     "each output (name, shape, like, when, unless, extra)."},
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
    {"_convert16", py_convert16, METH_VARARGS,
     "_convert16(x, fmt, simd): 16-bit bits (uint16) widened to float32, "
     "or float32 rounded to them, by one path."},
    {"_keep_row", py_keep_row, METH_VARARGS,
     "_keep_row(seed, p, b, i, t0, n, simd, f64=False): dropout's keep "
     "bytes of keys t0 .. t0 + n by one path."},
    {"_gemm", py_gemm, METH_VARARGS,
     "_gemm(a, b, c, alpha, beta, simd, unit=0, kmask=None, split=False): "
     "c = alpha a b + beta c in place by one path's product (unit 1: on "
     "bf16 dot products; 2: on AMX tiles, a split in two bf16 terms)."},
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
    for (int f = 0; f < n_funcs; f++) {
        /* the functions may outlive the module: keep ml_doc valid */
        public_defs[f].ml_doc = funcs[f].textsig;
        Py_CLEAR(public_docs[f]);
        Py_CLEAR(funcs[f].grads);
    }
    release_exec_state();
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = MODULE_NAME,
    .m_doc = MODULE_DOC,
    .m_size = 0,
    .m_methods = methods,
    .m_free = module_free,
};

PyMODINIT_FUNC MODULE_INIT(void)
{
    import_array();
    if (init_table() < 0) {
        return NULL;
    }
    for (int f = 0; f < n_funcs; f++) {
        methods[f] = (PyMethodDef){funcs[f].name,
                                   (PyCFunction)(void (*)(void))entries[f],
                                   METH_FASTCALL | METH_KEYWORDS,
                                   funcs[f].textsig};
    }
    for (int p = 0; p < N_PRIVATE; p++) {
        methods[n_funcs + p] = private_methods[p];
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
