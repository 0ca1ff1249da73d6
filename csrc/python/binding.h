/*
 * binding.h - the internal types and declarations of the binding, the
 * only C code that speaks CPython and NumPy (the .c files of csrc/python).
 *
 * A call flows one way, through one file per concern:
 *   module.c  the module: its init, its private functions, _publish and
 *             _table, and each row's entry points, which call
 *   call.c    call_function, steps 1-6 in order for one row (the outputs
 *             are its own; the scratch and the threads state.c's), through
 *   parse.c   steps 1 and 2: the arguments taken (positional, keywords)
 *             and each one as an array or a value;
 *   shapes.c  step 3: the shape patterns and their checks;
 *   views.c   step 4: casts, and the arguments read where they are
 *             (views, broadcast indices, groups);
 *   table.c   the rows of the table (args.h names their arguments) and
 *             their kernel calls, which call_function makes last (the
 *             family's and the key projection's in rows_family.c).
 * A file calls no other but the ones after it in the flow, the shape
 * helpers of shapes.c (fmt_shape for messages, pattern_dims, axes_present)
 * that every later step uses, and state.c (what the calls share: kept
 * scratch, instruction set, threads); what all of them read (a call's
 * arguments by id) is inline here.
 *
 * Compiled twice (setup.py): as attention_c._core, and with ATT_TEST_HOOKS
 * as attention_c._core_tests, which adds what only the tests use: the
 * allocation points' counter and fault injection, and the vector tanh of
 * each SIMD path.  In _core an allocation point is nothing.
 *
 * NumPy's C API is one table per extension: module.c imports it
 * (BINDING_IMPORT_ARRAY), the other files see it through
 * PY_ARRAY_UNIQUE_SYMBOL.
 */
#ifndef ATTENTION_C_PYTHON_BINDING_H
#define ATTENTION_C_PYTHON_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL attention_c_ARRAY_API
#ifndef BINDING_IMPORT_ARRAY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "attention.h"
#include "core/pool.h"
#include "args.h"

/* The binding's own functions and data are shared by its files, not
 * exported from the extension (only its PyInit is): hidden, a call from
 * one file to another is a direct call, not one through the PLT, and the
 * tables are read without the GOT (a tiny call's fixed cost). */
#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

/* ---------------------------------------------------------------------
 * Names
 */

/* The names of the arguments (X_...) and outputs (Y_...), from args.h,
 * and the arguments' kinds; the names as interned str, made at import: a
 * keyword written in the caller's source is the same object, so matching
 * it is one compare. */
extern const char *const arg_names[N_ARG_IDS];
extern const unsigned arg_kinds[N_ARG_IDS];
extern const char *const out_names[N_OUT_IDS];
extern PyObject *arg_name_objs[N_ARG_IDS];

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
extern Py_ssize_t fault_count;       /* points passed since the reset */
extern Py_ssize_t fault_after;       /* the point to fail; -1: none */
extern int fault_armed;              /* fault_after >= 0 or tracing */
extern PyObject *fault_trace;        /* list of point names, or NULL */

int alloc_point_debug(const char *kind, const char *what, Py_ssize_t index,
                      int raise);

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
 * Shapes and their patterns (shapes.c)
 *
 * "(..., Tq?, Hv)": leading batch axes, then one entry per axis.  An
 * entry is a symbol, k*symbol or symbol+symbol; a symbol marked "?" is
 * the query axis, there only when the call has several queries.  Parsed
 * once, when the module is imported.
 */

enum { S_T, S_H, S_A, S_TQ, S_HQ, S_HV, S_L, S_N, N_SYMS };

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

/* Writes "(2, 3)", "(5,)" or "()" into buf. */
const char *fmt_shape(char *buf, size_t size, int nd, const npy_intp *dims);

#define SHAPE_BUF 256
#define SHAPE(buf, arr) \
    fmt_shape(buf, SHAPE_BUF, PyArray_NDIM(arr), PyArray_DIMS(arr))

/* ---------------------------------------------------------------------
 * The table's rows and a call
 */

#define MAX_ARGS 24
#define MAX_OUTS 8

typedef struct {
    int id;                  /* X_...; X_NONE ends the list */
    unsigned flags;          /* F_... (args.h): the row's, and at import
                                the argument's kind */
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

/* Everything a row's workspace function may read (the sizes, each
 * argument's presence, size, broadcast and storage, the dtype, the
 * instruction set, units and threads), zero-padded so that memcmp
 * compares it: a field missing here let a float16 call take the scratch
 * size of a float32 one of the same shapes (too small: a crash). */
typedef struct {
    npy_intp size;               /* elements of the array (-1: none) */
    npy_intp nseq;               /* its own sequences (0: the call's) */
    int given;                   /* given(): flags' values too */
    int store;
} WorkArg;
typedef struct {
    npy_intp sym[N_SYMS];
    npy_intp B;
    const void *pool;
    ptrdiff_t window[2];
    int typenum, several, simd, threads, pool_threads, precision, bf16;
    int bias_shared, stream, io16;
    WorkArg arg[MAX_ARGS];       /* the row's arguments: compared (and
                                    zeroed) up to its nargs */
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
    int family;              /* the attention family (query, keys) */
    int score;               /* the family's: enum att_score */
    int location;            /* the location score: W (L, Hq) is the keys
                                of every sequence, b (L,) their bias */
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

/* state.c: buffers kept between calls, one per use (keep_take) */
enum keep {
    KEEP_WORK,      /* the kernels' scratch */
    KEEP_WIDE,      /* 16-bit inputs widened to float32 (views.c) */
    KEEP_OUT,       /* float32 outputs of a 16-bit call, before rounding */
    N_KEEP
};

struct Call {
    const FuncSpec *fn;
    PyObject *obj[MAX_ARGS];          /* borrowed; NULL when left out */
    PyArrayObject *arr[MAX_ARGS];     /* owned */
    int flag[MAX_ARGS];               /* F_FLAG: value; F_SCALE, F_SEED,
                                         F_WINDOW: given */
    double scale;
    double num[MAX_ARGS];             /* F_NUMBER; F_SCALE: its value */
    ptrdiff_t window[2];              /* F_WINDOW: left, right (-1: None) */
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
    att_view gview[3];                /* alibi_slopes, sinks, sharpness
                                         made C-contiguous: their
                                         gradients */
    ptrdiff_t *goffs[3];              /* their offsets (owned) */
    int bias_shared;                  /* the bias repeats over sequences */
    npy_intp sym[N_SYMS];
    int binder[N_SYMS];               /* argument that fixed it, or -1 */
    int nlead, lead_binder;
    npy_intp lead[NPY_MAXDIMS];
    att_dims d;                       /* B = prod(lead), T, H, A */
    int several;                      /* the family: several queries */
    int typenum;                      /* NPY_FLOAT or NPY_DOUBLE */
    PyArray_Descr *ret;               /* the results' 16-bit dtype when
                                         every floating input has it,
                                         else NULL (owned) */
    int store[MAX_ARGS];              /* enum att_store of keys and
                                         values read in place */
    unsigned maybe16;                 /* bit i: argument i (query, keys,
                                         values, ...) left in 16 bits for
                                         settle16 */
    int io16;                         /* ... and read so, out written so:
                                         their att_store (attention.h's
                                         io_store), else 0 */
    PyObject *out[MAX_OUTS];          /* owned until returned */
    void *work;
    char *kept[N_KEEP];               /* KEEP_WIDE, KEEP_OUT: taken by */
    size_t kept_size[N_KEEP];         /* kept_reserve, carved by */
    size_t kept_used[N_KEEP];         /* kept_array */
    att_exec ex;
};

/* The argument of id as given (not None), its data, an output's data. */
static inline int given(const Call *c, int id)
{
    int i = c->fn->pos[id];
    if (i < 0) {
        return 0;
    }
    if (c->fn->args[i].flags & (F_FLAG | F_SCALE | F_SEED | F_WINDOW)) {
        return c->flag[i];
    }
    if (c->fn->args[i].flags & F_NUMBER) {
        return c->num[i] != 0;
    }
    return c->obj[i] != NULL && c->obj[i] != Py_None;
}

/* An F_NUMARR argument given as a number: a constant, no gradient. */
static inline int as_number(const Call *c, int id)
{
    int i = c->fn->pos[id];
    return i >= 0 && (c->fn->args[i].flags & F_NUMARR) && c->flag[i];
}

/* The bias added to the scores as given (bias=, or the location score's
 * b=), or NULL. */
static inline PyArrayObject *bias_arg(const Call *c)
{
    int i = c->fn->pos[c->fn->location ? X_B : X_BIAS];
    return i >= 0 ? c->arr[i] : NULL;
}

static inline void *arg_data(const Call *c, int id)
{
    int i = c->fn->pos[id];
    return i >= 0 && c->arr[i] != NULL ? PyArray_DATA(c->arr[i]) : NULL;
}

static inline void *out_data(const Call *c, int id)
{
    int k = c->fn->opos[id];
    return k >= 0 && c->out[k] != NULL
           ? PyArray_DATA((PyArrayObject *)c->out[k]) : NULL;
}

/* A backward of the family or of the layer: it takes grad_out. */
static inline int is_backward(const FuncSpec *fn)
{
    return fn->pos[X_GRAD_OUT] >= 0;
}

/* Whether a family call streams (no weights): a forward asked for no
 * weights, a backward given no alpha (but out and lse). */
static inline int stream_of(const Call *c)
{
    const FuncSpec *fn = c->fn;
    if (is_backward(fn)) {
        return fn->pos[X_ALPHA] >= 0 && !given(c, X_ALPHA);
    }
    return fn->pos[X_RETURN_WEIGHTS] >= 0 && !given(c, X_RETURN_WEIGHTS);
}

/* ---------------------------------------------------------------------
 * The steps of a call, in order
 */

/* parse.c: step 1, the arguments taken from METH_FASTCALL; step 2, each
 * one as an array (no copy) or a value, its dtype checked. */
int take_args(Call *c, PyObject *const *args, Py_ssize_t nargs,
              PyObject *kwnames);
int view_args(Call *c);
/* A 16-bit floating dtype (attention.h's att_store): NumPy's float16,
 * ml_dtypes' bfloat16; ATT_STORE_NATIVE for any other. */
int half_store(const PyArray_Descr *dt);

/* shapes.c: step 3, every shape checked and the symbols bound; the
 * patterns parsed at import. */
int parse_pattern(const char *text, Pattern *pat);
int check_shapes(Call *c);
int pattern_dims(const Call *c, const Pattern *p, int lead, npy_intp *dims);
int axes_present(const Call *c, const ArgSpec *a, int nd,
                 int present[MAX_AXES]);
int view_target(const Call *c, int i, npy_intp *dims);

/* views.c: step 4, the floating arguments cast to one dtype; 4a, the
 * views, indices and groups of sequences. */
int cast_args(Call *c);
int make_views(Call *c);
int settle16(Call *c);

/* rows_family.c: whether the family takes the call's inputs as stored in
 * c->io16's 16 bits (att_family_takes16; reads them) */
int family_takes16(Call *c);
/* rows_family.c: the checks, scratch and kernel calls of table.c's rows
 * of the family (FAMILY, LOCATION) and the key projection (PROJECT) */
int check_family(Call *c);
int check_location(Call *c);
int check_project(Call *c);
ptrdiff_t w_family(Call *c);
ptrdiff_t w_project(Call *c);
int k_family(Call *c);
int k_location(Call *c);
int k_project_keys(Call *c);
int k_project_keys_backward(Call *c);

/* call.c: steps 1-6 for row fn (grads: the public function's named tuple
 * of a backward, or NULL); the error of a kernel's status. */
PyObject *call_function(const FuncSpec *fn, PyObject *const *args,
                        Py_ssize_t nargs, PyObject *kwnames,
                        PyTypeObject *grads);
int check_status(int st);

/* state.c: the instruction set and the threads of the fused kernels,
 * and the scratch kept between calls; all read and written with the
 * GIL. */
extern int simd_level;
extern const char *const simd_names[];
/* module.c: the path named by the str `name` (enum att_simd), or -1 with
 * a ValueError */
int simd_from_name(PyObject *name);
#ifdef ATT_TEST_HOOKS
/* hooks.c: the private functions of attention_c._core_tests that call
 * one primitive of one path (see there) */
PyObject *py_tanh(PyObject *self, PyObject *args);
PyObject *py_convert16(PyObject *self, PyObject *args);
PyObject *py_keep_row(PyObject *self, PyObject *args);
PyObject *py_gemm(PyObject *self, PyObject *args);
#endif
#define N_PRECISION 2
extern int fp32_precision;
extern const char *const precision_names[];
#define N_BF16_UNIT 3
extern int bf16_unit;
extern const char *const bf16_unit_names[];
int bf16_units_have(int simd);
int bf16_unit_used(void);
#define N_SIMD 4
#define MAX_THREADS 256
extern int num_threads;
extern att_pool *pool;
extern int pool_users;
void release_exec_state(void);
/* A new C-contiguous array of dims (steals descr), its data from the
 * handler that keeps the large outputs' freed blocks for the next call
 * (state.c) */
PyObject *output_array(int nd, const npy_intp *dims, PyArray_Descr *descr);
/* The buffer of use `use`, of at least `bytes` (NULL: no memory); every
 * keep_take is paired with one keep_give of what it returned. */
void *keep_take(int use, size_t bytes);
void keep_give(int use, void *p);
/* The bytes a float32 array of dims takes in a kept buffer (rounded up
 * to 64: each array aligned) */
size_t kept_bytes(int nd, const npy_intp *dims);
/* Takes c's buffer of use (KEEP_WIDE, KEEP_OUT) for arrays of `bytes` in
 * all, a sum of kept_bytes (none taken: kept_array makes new arrays); the
 * call gives it back after releasing its arrays. */
void kept_reserve(Call *c, int use, size_t bytes);
/* A C-contiguous float32 array of dims in c's buffer of use, which owns
 * its data (so it must not outlive the call), or a new array when the
 * buffer has no room. */
PyObject *kept_array(Call *c, int use, int nd, const npy_intp *dims);
/* att_convert16 on the current SIMD path, on the threads of ex where the
 * array is large (without the GIL then); returns its status. */
int convert_on_threads(const att_exec *ex, int store, int widen,
                       ptrdiff_t n, const void *src, void *dst);
/* The pool with at least `threads` threads (made, or remade when no call
 * holds a smaller one), held until drop_pool; NULL when no threads could
 * be started (then a job runs on the calling thread). */
att_pool *take_pool(int threads);
void drop_pool(att_pool *p);
/* The att_exec of one kernel call (simd, threads, pool, precision):
 * takes the pool; every begin_exec is paired with one end_exec. */
att_exec begin_exec(void);
void end_exec(const att_exec *ex);

/* attention_c._core._cache_attention (cache.c) */
PyObject *py_cache_attention(PyObject *self, PyObject *args);

/* table.c: the rows of the table. */
extern FuncSpec funcs[];
extern const int n_funcs;

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif /* ATTENTION_C_PYTHON_BINDING_H */
