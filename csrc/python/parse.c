/*
 * parse.c - steps 1 and 2 of a call: the arguments taken as a Python
 * function takes them (the required ones by position or name, the
 * optional ones by name only, a row's .npos), with its messages and a
 * hint for the usual slips; then each one as an array, without copying,
 * its dtype checked (real floats or integers; masks boolean), or as a
 * value (flags, numbers, the seed, the scale).
 */
#include "binding.h"

#include <math.h>

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
int take_args(Call *c, PyObject *const *args, Py_ssize_t nargs,
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
 * Step 2: arrays and values
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

/* Step 2 for a seed (argument i): an int, or an integer that says so
 * (__index__: NumPy's), in [0, 2**64); None or left out: not given. */
static int take_seed(Call *c, int i, PyObject *obj)
{
    const char *name = arg_names[c->fn->args[i].id];
    int none = obj == NULL || obj == Py_None;
    c->flag[i] = !none;
    if (none) {
        return 0;
    }
    PyObject *n = PyBool_Check(obj) ? NULL : PyNumber_Index(obj);
    if (n == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be an int in [0, "
                     "2**64), got %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    c->seed = PyLong_AsUnsignedLongLong(n);
    Py_DECREF(n);
    if (c->seed == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be in [0, "
                     "2**64), got %R", name, obj);
        return -1;
    }
    return 0;
}

/* One side of a window: an int >= 0 (or an integer that says so), or
 * None (unbounded: -1). */
static int take_side(Call *c, int i, PyObject *obj, ptrdiff_t *side)
{
    const char *name = arg_names[c->fn->args[i].id];
    if (obj == Py_None) {
        *side = -1;
        return 0;
    }
    PyObject *n = PyBool_Check(obj) ? NULL : PyNumber_Index(obj);
    Py_ssize_t v = n != NULL ? PyLong_AsSsize_t(n) : -1;
    Py_XDECREF(n);
    if (n == NULL || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a pair (left, right) of "
                     "ints >= 0 or None, got a side %R", name, obj);
        return -1;
    }
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s: a side must be >= 0 (or None: "
                     "unbounded), got %zd", name, v);
        return -1;
    }
    *side = (ptrdiff_t)v;
    return 0;
}

/* Step 2 for a window (argument i): None, or a pair (left, right), each
 * an int >= 0 or None, into c->window. */
static int take_window(Call *c, int i, PyObject *obj)
{
    const char *name = arg_names[c->fn->args[i].id];
    c->flag[i] = obj != NULL && obj != Py_None;
    c->window[0] = c->window[1] = -1;
    if (!c->flag[i]) {
        return 0;
    }
    PyObject *seq = PySequence_Check(obj) && !PyUnicode_Check(obj)
                    ? PySequence_Tuple(obj) : NULL;
    if (seq == NULL || PyTuple_GET_SIZE(seq) != 2) {
        Py_XDECREF(seq);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be None or a pair (left, "
                     "right) of ints >= 0 or None, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int st = take_side(c, i, PyTuple_GET_ITEM(seq, 0), &c->window[0]);
    if (st == 0) {
        st = take_side(c, i, PyTuple_GET_ITEM(seq, 1), &c->window[1]);
    }
    Py_DECREF(seq);
    return st;
}

/* Step 2 for a flag, a number, a seed, a scale or a window (argument i,
 * obj as given or NULL): its value into c. */
static int take_value(Call *c, int i, PyObject *obj)
{
    const ArgSpec *a = &c->fn->args[i];
    const char *name = arg_names[a->id];
    int none = obj == NULL || obj == Py_None;
    if (a->flags & F_FLAG) {
        int dflt = (a->flags & F_TRUE) != 0;
        /* a bool, NumPy's too, or an int (None: False, as before); a
         * string or another object is no flag ("no" would be true) */
        if (obj != NULL && !none && !PyBool_Check(obj) &&
            !PyArray_IsScalar(obj, Bool) && !PyLong_Check(obj) &&
            !PyArray_IsScalar(obj, Integer)) {
            PyErr_Format(PyExc_TypeError, "%s must be a bool, got %.100s",
                         name, Py_TYPE(obj)->tp_name);
            return -1;
        }
        c->flag[i] = obj ? PyObject_IsTrue(obj) : dflt;
        return c->flag[i] < 0 ? -1 : 0;
    }
    if (!none && (PyBool_Check(obj) || PyArray_IsScalar(obj, Bool)) &&
        (a->flags & (F_NUMBER | F_SCALE))) {
        PyErr_Format(PyExc_TypeError, "%s must be a real number%s, got "
                     "bool", name, a->flags & F_SCALE ? " or None" : "");
        return -1;
    }
    if (a->flags & F_NUMBER) {
        c->num[i] = none ? 0 : PyFloat_AsDouble(obj);
        if (c->num[i] == -1.0 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s must be a real number, "
                         "got %.100s", name, Py_TYPE(obj)->tp_name);
            return -1;
        }
        return 0;
    }
    if (a->flags & F_SEED) {
        return take_seed(c, i, obj);
    }
    if (a->flags & F_WINDOW) {
        return take_window(c, i, obj);
    }
    c->flag[i] = !none;             /* F_SCALE */
    if (!none) {
        c->num[i] = PyFloat_AsDouble(obj);
        if (c->num[i] == -1.0 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s must be a real number "
                         "or None, got %.100s", name,
                         Py_TYPE(obj)->tp_name);
            return -1;
        }
        if (a->id == X_SCALE) {
            c->scale = c->num[i];
        }
    }
    return 0;
}

/* Step 2 for an array that may be given as a number (F_NUMARR): a
 * Python int or float is a constant (c->flag[i] set: no gradient), and
 * must be finite. */
static int take_number(Call *c, int i, PyObject *obj)
{
    const char *name = arg_names[c->fn->args[i].id];
    if (!PyFloat_Check(obj) && !PyLong_Check(obj)) {
        return 0;
    }
    double x = PyFloat_AsDouble(obj);
    if (x == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    if (!isfinite(x)) {
        PyErr_Format(PyExc_ValueError, "%s must be finite, got %R (an "
                     "array's NaN propagates as data; a number's is an "
                     "error)", name, obj);
        return -1;
    }
    c->flag[i] = 1;
    return 0;
}

int half_store(const PyArray_Descr *dt)
{
    if (dt->type_num == NPY_HALF) {
        return ATT_STORE_F16;
    }
    /* ml_dtypes' bfloat16 is a user dtype, known by its scalar type's
     * name: no import of ml_dtypes, an optional dependency */
    if (dt->kind == 'V' && PyDataType_ELSIZE(dt) == 2 &&
        dt->typeobj != NULL) {
        const char *name = strrchr(dt->typeobj->tp_name, '.');
        name = name != NULL ? name + 1 : dt->typeobj->tp_name;
        return strcmp(name, "bfloat16") == 0 ? ATT_STORE_BF16
                                              : ATT_STORE_NATIVE;
    }
    return ATT_STORE_NATIVE;
}

/* Step 2 for an array argument: its dtype, a mask's boolean, the others'
 * real floating (16-bit ones included) or integer. */
static int check_dtype(const Call *c, int i)
{
    const ArgSpec *a = &c->fn->args[i];
    const char *name = arg_names[a->id];
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
    else if ((a->flags & F_INDEX) && dt->kind != 'i' && dt->kind != 'u') {
        PyErr_Format(PyExc_TypeError,
                     "%s must be an integer array (the starts of the packed "
                     "segments, then the total); got dtype %S", name,
                     (PyObject *)dt);
        return -1;
    }
    else if (!(dt->type_num == NPY_FLOAT || dt->type_num == NPY_DOUBLE ||
               dt->kind == 'i' || dt->kind == 'u' || half_store(dt))) {
        /* (by type: ml_dtypes' float8_e5m2 says kind 'f', its other
         * 8-bit floats 'V', and all of them are refused alike) */
        PyErr_Format(PyExc_TypeError,
                     "%s has dtype %S; attention_c computes in float32 or "
                     "float64 and accepts float16, bfloat16 (ml_dtypes), "
                     "float32, float64 or integer input%s", name,
                     (PyObject *)dt,
                     dt->type_num == NPY_BOOL && c->fn->pos[X_MASK] >= 0
                     ? " (a boolean array is a mask: did you mean "
                       "mask=...?)" : "");
        return -1;
    }
    return 0;
}

/* Step 2: every argument as an array (no copy) or a value. */
int view_args(Call *c)
{
    const FuncSpec *fn = c->fn;
    for (int i = 0; i < fn->nargs; i++) {
        const ArgSpec *a = &fn->args[i];
        const char *name = arg_names[a->id];
        PyObject *obj = c->obj[i];
        if (a->flags & (F_FLAG | F_NUMBER | F_SEED | F_SCALE |
                         F_WINDOW)) {
            if (take_value(c, i, obj) < 0) {
                return -1;
            }
            continue;
        }
        if (obj == NULL || obj == Py_None) {
            if (a->flags & F_OPT) {
                continue;
            }
            PyErr_Format(PyExc_TypeError, "%s is required and cannot be "
                         "None", name);
            return -1;
        }
        if ((a->flags & F_NUMARR) && take_number(c, i, obj) < 0) {
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
        if (check_dtype(c, i) < 0) {
            return -1;
        }
    }
    return 0;
}
