/*
 * binding_driver.h - the generic half of the binding: everything that is
 * the same for every public function.  Included once, by binding.c, after
 * the names of the arguments and outputs (X_..., Y_...) and before the
 * table; not a header of its own.
 *
 * For one row of the table, call_function does the same steps:
 *   1. take the arguments (METH_FASTCALL): the required ones by position
 *      or name, the optional ones by name only (a row's .npos), with the
 *      messages of a Python function and a hint for the usual slips;
 *   2. view each array argument as an array, without copying, and check
 *      its dtype (real floats or integers; masks boolean);
 *   3. check every shape on the arrays as given, binding the symbols of
 *      the patterns (T, H, ...) from the first argument that has them,
 *      with a message that names the argument, its shape, the shape it
 *      should have and the arguments that fixed it;
 *   4. only then cast the floating arguments to one computing dtype
 *      (float32 or float64, promoted as np.result_type does), C-contiguous
 *      and aligned, copying only when they are not already;
 *   5. allocate the outputs and the kernel's scratch, every byte count
 *      checked first;
 *   6. run the kernel with the GIL released, then clean up on one path.
 * Leading batch axes (...) are flattened into B: after step 4 the data is
 * contiguous, so (..., T, H) is (B, T, H) without a copy.
 *
 * The module itself (its private functions, _publish, making it from a
 * table) is binding_module.h.
 */

/* ---------------------------------------------------------------------
 * Allocation points and fault injection (_core_tests only)
 *
 * Every allocation the binding makes or asks NumPy for passes one
 * allocation point first: converting or casting an argument, each output
 * array, the kernels' scratch, the thread pool.  In _core_tests,
 * _fail_alloc_after(n) makes point number n (0-based, counted from that
 * call) fail as if memory had run out: MemoryError, except for the thread
 * pool, whose failure means "run on the calling thread".  Module state,
 * read and written with the GIL held (every point is passed before the
 * GIL is released).  In _core, ALLOC_POINT is the constant 0: no code.
 */
#ifdef ATT_TEST_HOOKS
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
#define ALLOC_POINT(kind, what, raise) alloc_point(kind, what, raise)
#else
#define ALLOC_POINT(kind, what, raise) 0
#endif

/* ---------------------------------------------------------------------
 * Shapes in messages
 */

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

/* ---------------------------------------------------------------------
 * Shape patterns
 *
 * "(..., Tq?, Hv)": leading batch axes, then one entry per axis.  An
 * entry is a symbol, k*symbol or symbol+symbol; a symbol marked "?" is
 * the query axis, there only when the call has several queries.  Parsed
 * once, when the module is imported.
 */

enum { S_T, S_H, S_A, S_TQ, S_HQ, S_HV, S_L, N_SYMS };
static const char *const sym_names[N_SYMS] = {"T", "H", "A", "Tq", "Hq",
                                              "Hv", "L"};

#define MAX_AXES 4

typedef struct {
    signed char sym[2];       /* symbols of the axis (-1: none) */
    signed char coef;         /* sym[0] counts coef times */
    signed char query_axis;   /* "?": only with several queries */
} Axis;

typedef struct {
    const char *text;         /* as written, for messages */
    int lead;                 /* starts with "..." */
    int n;                    /* axes after the lead */
    Axis ax[MAX_AXES];
} Pattern;

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
static int parse_pattern(const char *text, Pattern *pat)
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
 * Scratch and threads
 */

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

/* The instruction set of the fused kernels (enum att_simd): the best the
 * CPU has, unless _set_simd (ATTENTION_C_SIMD) chose another.  Read and
 * written with the GIL held. */
static int simd_level = ATT_SIMD_SCALAR;
static const char *const simd_names[] = {"scalar", "avx2", "avx512",
                                          "neon"};
#define N_SIMD ((int)(sizeof(simd_names) / sizeof(simd_names[0])))

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
            if (ALLOC_POINT("thread", "pool", 0) < 0) {
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

/* Kinds of arguments (ArgSpec.flags) */
#define F_OPT 1u       /* may be None or left out */
#define F_MASK 2u      /* a boolean mask, not a floating input */
#define F_FLAG 4u      /* a truth value, not an array */
#define F_SCALE 8u     /* a real number or None, not an array */
#define F_BCAST 16u    /* leading axes of size 1 broadcast (family masks) */
#define F_VIEW 32u     /* read where it is: broadcast to its pattern by
                          NumPy's rules, never copied to that shape */
#define F_TRUE 64u     /* with F_FLAG: True when left out */
#define F_NUMBER 128u  /* a real number, 0 when left out */
#define F_SEED 256u    /* an integer in [0, 2**64), or None */
#define F_LEADB 512u   /* the family's inputs: leading axes broadcast
                          against each other (missing or 1) */

#define MAX_ARGS 20
#define MAX_OUTS 8

typedef struct {
    int id;                  /* X_...; X_NONE ends the list */
    unsigned flags;          /* F_... */
    const char *shape;       /* pattern of an array argument */
    const char *hint;        /* appended to its shape errors, or NULL */
    Pattern pat;             /* parsed at import */
} ArgSpec;

typedef struct {
    int id;                  /* Y_... */
    const char *shape;       /* NULL ends the list */
    int when;                /* made only when this argument is given
                                (or true); X_NONE: always */
    int unless;              /* made only when this one is not */
    int like;                /* the shape of this argument, not `shape` */
    int drop;                /* not made: left out of the result, not None */
    Pattern pat;
} OutSpec;

typedef struct Call Call;

/* Everything a row's workspace function reads (the sizes, the dtype, the
 * instruction set and threads), zero-padded so that memcmp compares it. */
typedef struct {
    npy_intp sym[N_SYMS];
    npy_intp B;
    const void *pool;
    npy_intp nbias;
    int typenum, several, simd, threads, pool_threads;
    int causal, bias, bias_shared, dropout, stream;
} WorkKey;

typedef struct {
    const char *name;
    ArgSpec args[MAX_ARGS];  /* signature order, required ones first */
    int nreq;                /* the first nreq are required */
    int npos;                /* the first npos may be positional, the
                                rest are keyword-only (0: nreq) */
    int order[3];            /* argument ids whose shapes are checked
                                first (they fix the symbols) */
    OutSpec outs[MAX_OUTS];  /* in the order of the result */
    int fused;               /* runs with threads and SIMD (att_exec) */
    int score;               /* the family: enum att_score + 1, else 0 */
    int (*check)(Call *c);   /* more checks after the shapes, or NULL */
    ptrdiff_t (*workspace)(Call *c);  /* scratch bytes (-1: overflow) */
    int (*kernel)(Call *c);  /* runs without the GIL */
    /* made at import */
    int nargs, nouts;
    int pos[N_ARG_IDS];      /* index of each argument id, or -1 */
    int opos[N_OUT_IDS];     /* index of each output id, or -1 */
    int nfields;             /* outputs that are not `drop` */
    /* "name(h, mask=None)\n--\n\n": the signature CPython shows */
    char textsig[MAX_ARGS * 24 + 64];
    PyTypeObject *grads;     /* the public function's named tuple (owned;
                                set by _publish), or NULL */
    WorkKey work_key;        /* the last call's, with its scratch bytes */
    ptrdiff_t work_bytes;    /* (0: none yet; a workspace is never 0) */
} FuncSpec;

struct Call {
    const FuncSpec *fn;
    PyObject *obj[MAX_ARGS];          /* borrowed; NULL when left out */
    PyArrayObject *arr[MAX_ARGS];     /* owned */
    int flag[MAX_ARGS];               /* F_FLAG: value; F_SCALE, F_SEED:
                                         given */
    double scale;
    double num[MAX_ARGS];             /* F_NUMBER */
    unsigned long long seed;          /* F_SEED */
    att_view view[MAX_ARGS];          /* F_VIEW, once made */
    ptrdiff_t *offs[MAX_ARGS];        /* their offsets (owned) */
    ptrdiff_t *idx[MAX_ARGS];         /* F_LEADB: the argument's sequence
                                         of each of the call's (owned;
                                         NULL: the same) */
    npy_intp nseq[MAX_ARGS];          /* F_LEADB: its own sequences */
    ptrdiff_t *order, *gstart;        /* groups sharing one (owned) */
    npy_intp ngroups;
    att_view dbias;                   /* the bias made C-contiguous: the
                                         layout of its gradient (p NULL) */
    ptrdiff_t *doffs;                 /* its offsets (owned) */
    int bias_shared;                  /* the bias repeats over sequences */
    npy_intp sym[N_SYMS];
    int binder[N_SYMS];               /* argument that fixed it, or -1 */
    int nlead, lead_binder;
    npy_intp lead[NPY_MAXDIMS];
    att_dims d;                       /* B = prod(lead), T, H, A */
    int several;                      /* the family: several queries */
    int typenum;                      /* NPY_FLOAT or NPY_DOUBLE */
    PyObject *out[MAX_OUTS];          /* owned until returned */
    void *work;
    att_exec ex;
};

/* The argument of id as given (not None), its data, an output's data. */
static int given(const Call *c, int id)
{
    int i = c->fn->pos[id];
    if (i < 0) {
        return 0;
    }
    if (c->fn->args[i].flags & (F_FLAG | F_SCALE | F_SEED)) {
        return c->flag[i];
    }
    if (c->fn->args[i].flags & F_NUMBER) {
        return c->num[i] != 0;
    }
    return c->obj[i] != NULL && c->obj[i] != Py_None;
}

static void *arg_data(const Call *c, int id)
{
    int i = c->fn->pos[id];
    return i >= 0 && c->arr[i] != NULL ? PyArray_DATA(c->arr[i]) : NULL;
}

static void *out_data(const Call *c, int id)
{
    int k = c->fn->opos[id];
    return k >= 0 && c->out[k] != NULL
           ? PyArray_DATA((PyArrayObject *)c->out[k]) : NULL;
}

/* ---------------------------------------------------------------------
 * Step 1: the arguments
 */

/* Index of the argument named key in row fn, or -1. */
static int arg_index(const FuncSpec *fn, PyObject *key)
{
    for (int i = 0; i < fn->nargs; i++) {
        if (key == arg_name_objs[fn->args[i].id]) {
            return i;
        }
    }
    /* a name made at run time: not the interned object */
    for (int i = 0; PyUnicode_Check(key) && i < fn->nargs; i++) {
        if (PyUnicode_CompareWithASCIIString(
                key, arg_names[fn->args[i].id]) == 0) {
            return i;
        }
    }
    return -1;
}

/* TypeError "f() missing 2 required positional arguments: 'W' and 'v'",
 * as a Python function says it. */
static int missing_error(const Call *c)
{
    const FuncSpec *fn = c->fn;
    char names[MAX_ARGS * 24] = "";
    size_t used = 0;
    int n = 0, k = 0;
    for (int i = 0; i < fn->nreq; i++) {
        n += c->obj[i] == NULL;
    }
    for (int i = 0; i < fn->nreq && used < sizeof names; i++) {
        if (c->obj[i] != NULL) {
            continue;
        }
        k++;
        used += (size_t)PyOS_snprintf(
            names + used, sizeof names - used, "%s'%s'",
            k == 1 ? "" : k < n ? ", " : n > 2 ? ", and " : " and ",
            arg_names[fn->args[i].id]);
    }
    PyErr_Format(PyExc_TypeError,
                 "%s() missing %d required positional argument%s: %s",
                 fn->name, n, n == 1 ? "" : "s", names);
    return -1;
}

/* A boolean array (or a list of truth values): a mask, most likely. */
static int looks_like_mask(PyObject *obj)
{
    if (PyArray_Check(obj)) {
        return PyArray_TYPE((PyArrayObject *)obj) == NPY_BOOL;
    }
    return PyList_Check(obj) && PyList_GET_SIZE(obj) > 0 &&
           PyBool_Check(PyList_GET_ITEM(obj, 0));
}

/* TypeError for too many positional arguments, as a Python function says
 * it, naming the keyword-only arguments; when the first extra one is a
 * boolean array and the row takes a mask: did you mean mask=...? */
static int positional_error(const FuncSpec *fn, PyObject *const *args,
                            Py_ssize_t nargs)
{
    if (fn->npos == fn->nargs) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d positional argument%s "
                     "but %zd were given", fn->name, fn->npos,
                     fn->npos == 1 ? "" : "s", nargs);
        return -1;
    }
    char names[MAX_ARGS * 24] = "";
    size_t used = 0;
    for (int i = fn->npos; i < fn->nargs && used < sizeof names; i++) {
        used += (size_t)PyOS_snprintf(names + used, sizeof names - used,
                                      "%s%s", i > fn->npos ? ", " : "",
                                      arg_names[fn->args[i].id]);
    }
    const char *hint = "";
    int extra = fn->npos;
    while (fn->pos[X_MASK] >= 0 && extra < nargs && extra < fn->nargs &&
           !looks_like_mask(args[extra])) {
        extra++;
    }
    if (fn->pos[X_MASK] >= 0 && extra < nargs && extra < fn->nargs) {
        hint = ". Argument %d is a boolean array: did you mean mask=...?";
    }
    char text[MAX_ARGS * 24 + 256];
    int several = fn->nargs - fn->npos > 1;
    PyOS_snprintf(text, sizeof text, "%s() takes %d positional argument%s "
                  "but %zd were given; %s %s keyword-only (pass %s by "
                  "name, e.g. %s=...)", fn->name, fn->npos,
                  fn->npos == 1 ? "" : "s", nargs, names,
                  several ? "are" : "is", several ? "them" : "it",
                  arg_names[fn->args[fn->npos].id]);
    if (*hint) {
        size_t n = strlen(text);
        PyOS_snprintf(text + n, sizeof text - n, hint, extra + 1);
    }
    PyErr_SetString(PyExc_TypeError, text);
    return -1;
}

/* Step 1: c->obj[i] is argument i (borrowed) or NULL when left out.
 * args holds nargs positional values, then one value per name of
 * kwnames (METH_FASTCALL | METH_KEYWORDS). */
static int take_args(Call *c, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames)
{
    const FuncSpec *fn = c->fn;
    if (nargs > fn->npos) {
        return positional_error(fn, args, nargs);
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        c->obj[i] = args[i];
    }
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = arg_index(fn, key);
        if (i < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword "
                         "argument '%S'", fn->name, key);
            return -1;
        }
        if (c->obj[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for "
                         "argument '%s'", fn->name,
                         arg_names[fn->args[i].id]);
            return -1;
        }
        c->obj[i] = args[nargs + k];
    }
    for (int i = 0; i < fn->nreq; i++) {
        if (c->obj[i] == NULL) {
            return missing_error(c);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------
 * Steps 2-4: arrays, shapes, casts
 */

/* A tensor of PyTorch (its type's module is torch or below). */
static int is_torch_tensor(PyObject *obj)
{
    PyObject *mod = PyObject_GetAttrString((PyObject *)Py_TYPE(obj),
                                           "__module__");
    const char *text = mod != NULL && PyUnicode_Check(mod)
                       ? PyUnicode_AsUTF8(mod) : NULL;
    int yes = text != NULL && strncmp(text, "torch", 5) == 0 &&
              (text[5] == '\0' || text[5] == '.');
    Py_XDECREF(mod);
    PyErr_Clear();
    return yes;
}

/* NumPy could not make an array of obj (its error is set).  A torch tensor
 * that requires grad is refused by its __array__ with "use
 * tensor.detach()", which would silently cut autograd: point to the
 * adapter instead. */
static int conversion_error(const FuncSpec *fn, const char *name,
                            PyObject *obj)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!is_torch_tensor(obj)) {
        PyErr_Restore(type, value, tb);
        return -1;
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Format(PyExc_TypeError,
                 "%s is a torch.Tensor that NumPy cannot read (it requires "
                 "grad); attention_c.%s takes NumPy arrays and records no "
                 "gradients for autograd.  For tensors use the PyTorch "
                 "adapter, attention_c.torch: its functions and modules are "
                 "PyTorch operators with autograd.  To compute in NumPy "
                 "without gradients, pass %s.detach().numpy()", name,
                 fn->name, name);
    return -1;
}

/* Step 2: every argument as an array (no copy) or a value. */
static int view_args(Call *c)
{
    const FuncSpec *fn = c->fn;
    for (int i = 0; i < fn->nargs; i++) {
        const ArgSpec *a = &fn->args[i];
        const char *name = arg_names[a->id];
        PyObject *obj = c->obj[i];
        int none = obj == NULL || obj == Py_None;
        if (a->flags & F_FLAG) {
            int dflt = (a->flags & F_TRUE) != 0;
            if ((c->flag[i] = obj ? PyObject_IsTrue(obj) : dflt) < 0) {
                return -1;
            }
            continue;
        }
        if (a->flags & F_NUMBER) {
            c->num[i] = none ? 0 : PyFloat_AsDouble(obj);
            if (c->num[i] == -1.0 && PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "%s must be a real number, "
                             "got %.100s", name, Py_TYPE(obj)->tp_name);
                return -1;
            }
            continue;
        }
        if (a->flags & F_SEED) {
            c->flag[i] = !none;
            /* an int, or an integer that says so (__index__: NumPy's) */
            PyObject *n = none || PyBool_Check(obj) ? NULL
                          : PyNumber_Index(obj);
            if (!none && n == NULL) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "%s must be an int in [0, "
                             "2**64), got %.100s", name,
                             Py_TYPE(obj)->tp_name);
                return -1;
            }
            if (!none) {
                c->seed = PyLong_AsUnsignedLongLong(n);
                Py_DECREF(n);
                if (c->seed == (unsigned long long)-1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    PyErr_Format(PyExc_ValueError, "%s must be in [0, "
                                 "2**64), got %R", name, obj);
                    return -1;
                }
            }
            continue;
        }
        if (a->flags & F_SCALE) {
            c->flag[i] = !none;
            if (!none) {
                c->scale = PyFloat_AsDouble(obj);
                if (c->scale == -1.0 && PyErr_Occurred()) {
                    PyErr_Format(PyExc_TypeError, "%s must be a real number "
                                 "or None, got %.100s", name,
                                 Py_TYPE(obj)->tp_name);
                    return -1;
                }
            }
            continue;
        }
        if (none) {
            if (a->flags & F_OPT) {
                continue;
            }
            PyErr_Format(PyExc_TypeError, "%s is required and cannot be "
                         "None", name);
            return -1;
        }
        if (ALLOC_POINT("conversion of", name, 1) < 0) {
            return -1;
        }
        if (PyArray_Check(obj)) {
            /* what PyArray_FromAny(obj, NULL, 0, 0, 0, NULL) returns for
             * an array (subclasses included), without its dtype
             * discovery: a third of a small call */
            c->arr[i] = (PyArrayObject *)Py_NewRef(obj);
        }
        else if ((c->arr[i] = (PyArrayObject *)PyArray_FromAny(
                      obj, NULL, 0, 0, 0, NULL)) == NULL) {
            return conversion_error(fn, name, obj);
        }
        PyArray_Descr *dt = PyArray_DESCR(c->arr[i]);
        if (a->flags & F_MASK) {
            if (dt->type_num != NPY_BOOL && a->id == X_ATTN_MASK) {
                PyErr_Format(PyExc_TypeError,
                             "attn_mask must be a boolean array (True = query "
                             "i may attend to key t); got dtype %S.  For a "
                             "float mask added to the scores use bias=.  Note "
                             "that nn.MultiheadAttention's (PyTorch) boolean "
                             "masks mean True = masked, the opposite of ours "
                             "(pass ~mask), while scaled_dot_product_"
                             "attention's mean True = take part, as ours",
                             (PyObject *)dt);
                return -1;
            }
            if (dt->type_num != NPY_BOOL) {
                PyErr_Format(PyExc_TypeError,
                             "%s must be a boolean array (True = valid item); "
                             "got dtype %S (use %s.astype(bool))", name,
                             (PyObject *)dt, name);
                return -1;
            }
        }
        else if (!((dt->kind == 'f' && PyArray_ITEMSIZE(c->arr[i]) <= 8) ||
                   dt->kind == 'i' || dt->kind == 'u')) {
            PyErr_Format(PyExc_TypeError,
                         "%s has dtype %S; attention_c computes in float32 or "
                         "float64 and accepts real floating or integer "
                         "input%s", name, (PyObject *)dt,
                         dt->type_num == NPY_BOOL && fn->pos[X_MASK] >= 0
                         ? " (a boolean array is a mask: did you mean "
                           "mask=...?)" : "");
            return -1;
        }
    }
    return 0;
}

/* The axes of pattern p an argument has in this call (the query axis only
 * with several queries; a mask may leave it out). */
static int axes_present(const Call *c, const ArgSpec *a, int nd,
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

#include "binding_views.h"

static int check_shapes(Call *c)
{
    const FuncSpec *fn = c->fn;
    int done[MAX_ARGS] = {0};
    if (fn->score) {        /* several queries: query.ndim == keys.ndim */
        c->several = PyArray_NDIM(c->arr[fn->pos[X_QUERY]]) ==
                     PyArray_NDIM(c->arr[fn->pos[X_KEYS]]);
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

/* Step 4: the floating arrays in one dtype, C-contiguous and aligned
 * (np.result_type of them; float16 computes in float32, integers in
 * float64), but for the keys and values a decoding call reads where they
 * are (read_rows); masks C-contiguous. */
static int cast_args(Call *c)
{
    const FuncSpec *fn = c->fn;
    PyArrayObject *arrs[MAX_ARGS];
    int count = 0;
    for (int i = 0; i < fn->nargs; i++) {
        if (c->arr[i] != NULL && !(fn->args[i].flags & F_MASK)) {
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
    else if (count > 0) {
        PyArray_Descr *rt = PyArray_ResultType(count, arrs, 0, NULL);
        if (rt == NULL) {
            return -1;
        }
        c->typenum = rt->kind == 'f' && PyDataType_ELSIZE(rt) <= 4
                     ? NPY_FLOAT : NPY_DOUBLE;
        Py_DECREF(rt);
    }
    for (int i = 0; i < fn->nargs; i++) {
        if (c->arr[i] == NULL) {
            continue;
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

/* Whether key t is visible to query i of sequence b: the key mask, the
 * attn_mask, causal and a bias of -inf (it masks) all allow it. */
static int visible(const Call *c, npy_intp b, npy_intp i, npy_intp t)
{
    const FuncSpec *fn = c->fn;
    npy_intp Tq = c->several ? c->sym[S_TQ] : 1, T = c->sym[S_T];
    int im = fn->pos[X_MASK], ia = fn->pos[X_ATTN_MASK];
    int ib = fn->pos[X_BIAS], ic = fn->pos[X_CAUSAL];
    if (ic >= 0 && c->flag[ic] && t > i + (T - Tq)) {
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
                 "exactly 0 where, and only where, a key is not "
                 "visible)%s",
                 c->fn->name, at, zero ? "0" : "nonzero",
                 !masks ? "no mask was given"
                 : valid ? "the masks make that key visible"
                 : "the masks hide that key",
                 !masks ? ": pass the masks the forward used" : "");
    return -1;
}

/* Step 4b, for a backward given alpha and masks: alpha must be the
 * forward's for these masks.  The forward's alpha is exactly 0 where a key
 * is not visible (and on rows with no visible key) and never 0 where one
 * is (fast.h WEIGHT_FLOOR), so a backward called without the masks the
 * forward had, or with others, is caught here instead of returning
 * gradients that are silently wrong.  Runs on every backward: loops over
 * (b, i, t) rather than dividing a flat index (three divisions an element
 * were a third of a tiny backward's fixed cost), and without masks only
 * looks for a zero. */
static int check_alpha(const Call *c)
{
    int ia = c->fn->pos[X_ALPHA];
    if (ia < 0 || c->arr[ia] == NULL || c->fn->pos[X_GRAD_OUT] < 0 ||
        c->fn->pos[X_MASK] < 0) {
        return 0;
    }
    PyArrayObject *alpha = c->arr[ia];
    const void *a = PyArray_DATA(alpha);
    int masks = given(c, X_MASK) || given(c, X_ATTN_MASK) ||
                given(c, X_BIAS) || given(c, X_CAUSAL);
    npy_intp Tq = c->several ? c->sym[S_TQ] : 1, T = c->sym[S_T];
    npy_intp n = PyArray_SIZE(alpha);
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
                if (zero != !valid) {
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
    return (when == X_NONE || given(c, when)) &&
           (unless == X_NONE || !given(c, unless));
}

/* Whether a family call streams (no weights): a forward asked for no
 * weights, a backward given no alpha (but out and lse). */
static int stream_of(const Call *c)
{
    const FuncSpec *fn = c->fn;
    if (fn->pos[X_GRAD_OUT] >= 0) {
        return fn->pos[X_ALPHA] >= 0 && !given(c, X_ALPHA);
    }
    return fn->pos[X_RETW] >= 0 && !given(c, X_RETW);
}

/* The scratch bytes of the call (-1: overflow).  A decoder calls with
 * the same sizes at every step: the last call's count is kept per row
 * (under the GIL) and the kernels' sizing, 5% of a small call, is
 * skipped when nothing it reads changed. */
static ptrdiff_t work_size(Call *c)
{
    FuncSpec *fn = (FuncSpec *)c->fn;     /* a row of funcs, not const */
    WorkKey key;
    memset(&key, 0, sizeof key);
    memcpy(key.sym, c->sym, sizeof key.sym);
    key.B = c->d.B;
    key.pool = c->ex.pool;
    key.typenum = c->typenum;
    key.several = c->several;
    key.causal = given(c, X_CAUSAL);
    key.bias = given(c, X_BIAS);
    key.bias_shared = c->bias_shared;
    key.dropout = given(c, X_DROPOUT);
    key.stream = stream_of(c);
    key.nbias = given(c, X_BIAS) ? PyArray_SIZE(c->arr[c->fn->pos[X_BIAS]])
                                 : 0;
    key.simd = c->ex.simd;
    key.threads = c->ex.threads;
    key.pool_threads = c->ex.pool != NULL ? att_pool_threads(c->ex.pool) : 0;
    if (fn->work_bytes > 0 && memcmp(&key, &fn->work_key, sizeof key) == 0) {
        return fn->work_bytes;
    }
    ptrdiff_t bytes = fn->workspace(c);
    if (bytes > 0) {
        fn->work_key = key;
        fn->work_bytes = bytes;
    }
    return bytes;
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
    ptrdiff_t work_bytes = fn->workspace ? work_size(c) : 0;
    if (work_bytes < 0) {
        PyErr_SetString(PyExc_MemoryError,
                        "attention_c: sizes too large for scratch memory");
        return -1;
    }
    for (int k = 0; k < fn->nouts; k++) {
        if (!wanted(c, k)) {
            continue;
        }
        if (ALLOC_POINT("output", out_names[fn->outs[k].id], 1) < 0 ||
            (c->out[k] = PyArray_SimpleNew(nds[k], dims[k], c->typenum))
            == NULL) {
            return -1;
        }
    }
    if (fn->workspace != NULL) {
        if (ALLOC_POINT("scratch", "memory", 1) < 0) {
            return -1;
        }
        c->work = work_take((size_t)work_bytes + 1);
        if (c->work == NULL) {
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

/* The result: one array, or a tuple with None for outputs not made; the
 * public function of a backward gives its named tuple (grads). */
static PyObject *take_result(Call *c, PyTypeObject *grads)
{
    const FuncSpec *fn = c->fn;
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

/* Steps 1-6 for the function of row fn; grads: see take_result. */
static PyObject *call_function(const FuncSpec *fn, PyObject *const *args,
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
        cast_args(&c) < 0 || make_views(&c) < 0 ||
        check_alpha(&c) < 0 || make_outputs(&c) < 0) {
        goto done;
    }
    if (tiny_call(&c)) {
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
    work_give(c.work);
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
    if (c.doffs != NULL || c.order != NULL || c.gstart != NULL) {
        PyMem_Free(c.doffs);
        PyMem_Free(c.order);
        PyMem_Free(c.gstart);
    }
    for (int k = 0; k < fn->nouts; k++) {
        Py_XDECREF(c.out[k]);
    }
    return result;
}

/* Parses the table's patterns and makes each row's signature, once. */
static int init_table(FuncSpec *funcs, int nfuncs)
{
    for (int id = X_NONE + 1; id < N_ARG_IDS; id++) {
        if (arg_name_objs[id] == NULL &&
            (arg_name_objs[id] = PyUnicode_InternFromString(arg_names[id]))
            == NULL) {
            return -1;
        }
    }
    for (int f = 0; f < nfuncs; f++) {
        FuncSpec *fn = &funcs[f];
        size_t len = (size_t)PyOS_snprintf(fn->textsig, sizeof fn->textsig,
                                           "%s(", fn->name);
        for (int id = 0; id < N_ARG_IDS; id++) {
            fn->pos[id] = -1;
        }
        for (int id = 0; id < N_OUT_IDS; id++) {
            fn->opos[id] = -1;
        }
        if (fn->npos < fn->nreq) {
            fn->npos = fn->nreq;       /* the default: the required ones */
        }
        for (fn->nargs = 0; fn->nargs < MAX_ARGS &&
                            fn->args[fn->nargs].id != X_NONE; fn->nargs++) {
            ArgSpec *a = &fn->args[fn->nargs];
            fn->pos[a->id] = fn->nargs;
            if (a->shape != NULL && parse_pattern(a->shape, &a->pat) < 0) {
                return -1;
            }
            /* optional: flags default to False, the others to None; the
             * keyword-only ones after a "*" */
            len += (size_t)PyOS_snprintf(
                fn->textsig + len, sizeof fn->textsig - len, "%s%s%s%s",
                fn->nargs ? ", " : "", fn->nargs == fn->npos ? "*, " : "",
                arg_names[a->id],
                fn->nargs < fn->nreq ? ""
                : a->flags & F_TRUE ? "=True"
                : a->flags & F_FLAG ? "=False"
                : a->flags & F_NUMBER ? "=0.0" : "=None");
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
        fn->nfields = 0;
        for (fn->nouts = 0; fn->nouts < MAX_OUTS &&
                            fn->outs[fn->nouts].shape != NULL;
             fn->nouts++) {
            OutSpec *o = &fn->outs[fn->nouts];
            fn->opos[o->id] = fn->nouts;
            fn->nfields += !o->drop;
            if (parse_pattern(o->shape, &o->pat) < 0) {
                return -1;
            }
        }
    }
    return 0;
}
