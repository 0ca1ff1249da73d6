/*
 * state.c - what the binding's calls share: the scratch kept between
 * calls, the 16-bit conversions run on the threads, the instruction set,
 * the precision and bf16 unit of the products, the thread pool and the
 * att_exec of a call, and (_core_tests) the allocation points' counter.
 * Everything here is read and written with the GIL held.
 */
#include "binding.h"

#ifdef ATT_TEST_HOOKS
/* The allocation points (binding.h); set by _fail_alloc_after (module.c) */
Py_ssize_t fault_count = 0;
Py_ssize_t fault_after = -1;
int fault_armed = 0;
PyObject *fault_trace = NULL;

int alloc_point_debug(const char *kind, const char *what, Py_ssize_t index,
                      int raise)
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

#endif

/* ---------------------------------------------------------------------
 * Scratch and threads
 */

/* Buffers kept between calls, one per use (enum keep): the kernels'
 * scratch, and a 16-bit call's float32 copies of its inputs and its
 * outputs before rounding.  Allocated afresh, each would be mapped and its
 * pages faulted in by every call: glibc maps blocks above 32 MiB anew each
 * time (5% of a large backward), and smaller ones too until a free raised
 * its threshold (a bfloat16 forward at (8, 1024, 64): 1.5x the time on a
 * KVM guest).  Each holds at most keep_max bytes; taken and given back with
 * the GIL held; a call that finds one in use (another thread is inside a
 * kernel) allocates its own. */
static const size_t keep_max[N_KEEP] = {
    (size_t)256 << 20,          /* KEEP_WORK */
    (size_t)64 << 20,           /* KEEP_WIDE: a larger call's products */
    (size_t)64 << 20            /* KEEP_OUT: outweigh its page faults */
};
static struct {
    void *p;
    size_t size;
    int busy;
} keep[N_KEEP];

void *keep_take(int use, size_t bytes)
{
    if (keep[use].busy || bytes > keep_max[use]) {
        return PyMem_RawMalloc(bytes);
    }
    if (keep[use].size < bytes) {
        PyMem_RawFree(keep[use].p);
        keep[use].p = PyMem_RawMalloc(bytes);
        keep[use].size = keep[use].p != NULL ? bytes : 0;
        if (keep[use].p == NULL) {
            return NULL;
        }
    }
    keep[use].busy = 1;
    return keep[use].p;
}

void keep_give(int use, void *p)
{
    if (p != NULL && p == keep[use].p) {
        keep[use].busy = 0;
    }
    else {
        PyMem_RawFree(p);
    }
}

void kept_reserve(Call *c, int use, size_t bytes)
{
    if (bytes > 0) {
        c->kept[use] = keep_take(use, bytes);
        c->kept_size[use] = c->kept[use] != NULL ? bytes : 0;
    }
}

size_t kept_bytes(int nd, const npy_intp *dims)
{
    size_t bytes = sizeof(float);
    for (int k = 0; k < nd; k++) {
        bytes *= (size_t)dims[k];
    }
    return (bytes + 63) / 64 * 64;
}

PyObject *kept_array(Call *c, int use, int nd, const npy_intp *dims)
{
    size_t bytes = kept_bytes(nd, dims);
    if (c->kept[use] == NULL ||
        bytes > c->kept_size[use] - c->kept_used[use]) {
        return PyArray_SimpleNew(nd, (npy_intp *)dims, NPY_FLOAT);
    }
    char *data = c->kept[use] + c->kept_used[use];
    c->kept_used[use] += bytes;
    return PyArray_NewFromDescr(&PyArray_Type,
                                PyArray_DescrFromType(NPY_FLOAT), nd,
                                (npy_intp *)dims, NULL, data,
                                NPY_ARRAY_CARRAY, NULL);
}

/* A 16-bit conversion (att_convert16) in chunks of CONVERT_CHUNK
 * elements on the threads of ex, where there are two chunks or more: on
 * one thread, widening the inputs and rounding the outputs of a bfloat16
 * forward took 5-10 % of its 2-thread time.  Elementwise: the same bits
 * for any split.  Runs without the GIL. */
#define CONVERT_CHUNK ((ptrdiff_t)1 << 16)
typedef struct {
    int simd, store, widen;
    ptrdiff_t n;
    const char *src;
    char *dst;
} Convert;

static void convert_task(void *arg, ptrdiff_t task, int thread)
{
    const Convert *cv = arg;
    ptrdiff_t i = task * CONVERT_CHUNK;
    ptrdiff_t m = cv->n - i < CONVERT_CHUNK ? cv->n - i : CONVERT_CHUNK;
    size_t from = cv->widen ? 2 : sizeof(float);
    size_t to = cv->widen ? sizeof(float) : 2;
    (void)thread;
    /* (checked whole before: a chunk cannot fail) */
    (void)att_convert16(cv->simd, cv->store, cv->widen, m,
                        cv->src + (size_t)i * from,
                        cv->dst + (size_t)i * to);
}

int convert_on_threads(const att_exec *ex, int store, int widen,
                       ptrdiff_t n, const void *src, void *dst)
{
    Convert cv = {simd_level, store, widen, n, src, dst};
    ptrdiff_t tasks = (n + CONVERT_CHUNK - 1) / CONVERT_CHUNK;
    int threads = ex->threads < 1 ? 1 : ex->threads;
    if (tasks < 2 || threads == 1 || ex->pool == NULL) {
        return att_convert16(simd_level, store, widen, n, src, dst);
    }
    int st = att_convert16(simd_level, store, widen, 0, src, dst);
    if (st != ATT_OK) {                 /* the arguments, n aside */
        return st;
    }
    Py_BEGIN_ALLOW_THREADS
    att_pool_run(ex->pool, threads, tasks, convert_task, &cv);
    Py_END_ALLOW_THREADS
    return ATT_OK;
}

/* The instruction set of the fused kernels (enum att_simd): the best the
 * CPU has, unless _set_simd (ATTENTION_C_SIMD) chose another.  Read and
 * written with the GIL held. */
int simd_level = ATT_SIMD_SCALAR;
const char *const simd_names[N_SIMD] = {"scalar", "avx2", "avx512", "neon"};

/* The products float32 calls may run on (enum att_precision):
 * set_fp32_precision.  Read and written with the GIL held. */
int fp32_precision = ATT_PRECISION_IEEE;
const char *const precision_names[N_PRECISION] = {"ieee", "bf16"};

/* The unit of bf16 products (enum att_bf16_unit; 0: the one
 * att_bf16_products picks): _set_bf16_unit (ATTENTION_C_BF16_UNIT).  Read
 * and written with the GIL held, as the answers kept per path below. */
int bf16_unit = 0;
const char *const bf16_unit_names[N_BF16_UNIT] = {"auto", "dot", "amx"};
static int bf16_have[N_SIMD] = {-1, -1, -1, -1};    /* bit u - 1: unit u */
static int bf16_pick[N_SIMD] = {-1, -1, -1, -1};

int bf16_units_have(int simd)
{
    if (bf16_have[simd] < 0) {
        bf16_have[simd] = att_bf16_supported(simd, ATT_BF16_DOT) |
                          att_bf16_supported(simd, ATT_BF16_AMX) << 1;
    }
    return bf16_have[simd];
}

int bf16_unit_used(void)
{
    if (bf16_unit != 0) {
        return bf16_units_have(simd_level) >> (bf16_unit - 1) & 1
               ? bf16_unit : 0;
    }
    if (bf16_pick[simd_level] < 0) {        /* measures: once a path */
        bf16_pick[simd_level] = att_bf16_products(simd_level);
    }
    return bf16_pick[simd_level];
}

/* Threads of the fused kernels (set_num_threads), and the pool that runs
 * them, made on first need.  A call holds the pool (pool_users) while it
 * runs without the GIL, so it is freed only when no call uses it.  After
 * fork() the child has the parent's pool but not its threads: it drops it
 * (att_pool_abandon) and makes its own.  All of this under the GIL. */
int num_threads = 1;
att_pool *pool = NULL;
int pool_users = 0;

/* The pool, dropped if it was inherited through fork(). */
static void check_pool_owner(void)
{
    if (pool != NULL && !att_pool_owned(pool)) {
        att_pool_abandon(pool);     /* inherited through fork() */
        pool = NULL;
        pool_users = 0;
    }
}

att_pool *take_pool(int threads)
{
    check_pool_owner();
    if (pool != NULL && pool_users == 0 &&
        att_pool_threads(pool) < threads) {
        att_pool_free(pool);
        pool = NULL;
    }
    if (pool == NULL) {
        /* NULL (no memory, no threads): run on the calling thread */
        if (ALLOC_POINT("thread", "pool", 0) < 0) {
            PyErr_Clear();
        }
        else {
            pool = att_pool_new(threads);
        }
    }
    pool_users += pool != NULL;
    return pool;
}

void drop_pool(att_pool *p)
{
    if (p != NULL && p == pool) {
        pool_users--;
    }
}

/* The att_exec of one fused call: takes the pool (or NULL with one
 * thread); every begin_exec is paired with one end_exec. */
att_exec begin_exec(void)
{
    att_exec ex = {simd_level, num_threads, NULL, fp32_precision,
                   bf16_unit_used()};
    check_pool_owner();
    if (num_threads > 1 && simd_level != ATT_SIMD_SCALAR) {
        ex.pool = take_pool(num_threads);
    }
    return ex;
}

void end_exec(const att_exec *ex)
{
    drop_pool(ex->pool);
}

/* ---------------------------------------------------------------------
 * The outputs' memory
 */

/* The data of a large array a call returns comes from a NumPy handler
 * (NEP 49) that keeps a few freed blocks for the next call.  From
 * malloc, glibc gave the top of its heap back to the system once more
 * than twice its mmap threshold was free there: the outputs of a forward
 * and a backward at (32, 256, 64) (8 MiB) went back after each pair of
 * calls, and the next faulted every page in again (a sixth of the pair's
 * time on a KVM guest).  A block starts with a header of OUT_HEAD bytes
 * (its capacity), so its data stays 64-byte aligned; at most OUT_SLOTS
 * blocks of OUT_MIN bytes or more, OUT_KEEP bytes in all, wait for a
 * call, the newest first out, and a lock keeps them whole whichever
 * thread frees an array.  A call's small outputs come from NumPy's own
 * handler. */
#define OUT_MIN ((size_t)1 << 20)
#define OUT_KEEP ((size_t)64 << 20)
#define OUT_SLOTS 8
#define OUT_HEAD ((size_t)64)

static struct {
    PyThread_type_lock lock;
    char *block[OUT_SLOTS];     /* header first */
    int n;
    size_t bytes;
} outs;

static size_t out_capacity(const char *block)
{
    size_t cap;
    memcpy(&cap, block, sizeof cap);
    return cap;
}

static void *out_malloc(void *ctx, size_t size)
{
    (void)ctx;
    size_t cap = (size + 63) / 64 * 64;
    if (cap < size || cap > (size_t)PY_SSIZE_T_MAX - OUT_HEAD) {
        return NULL;
    }
    char *block = NULL;
    if (cap >= OUT_MIN && PyThread_acquire_lock(outs.lock, WAIT_LOCK)) {
        for (int i = outs.n - 1; i >= 0; i--) {   /* a fit, 1/4 spare */
            size_t have = out_capacity(outs.block[i]);
            if (have >= cap && have - cap <= cap / 4) {
                block = outs.block[i];
                outs.bytes -= have;
                outs.block[i] = outs.block[--outs.n];
                break;
            }
        }
        PyThread_release_lock(outs.lock);
    }
    if (block == NULL) {
        block = aligned_alloc(64, OUT_HEAD + cap);
        if (block == NULL) {
            return NULL;
        }
        memcpy(block, &cap, sizeof cap);
    }
    return block + OUT_HEAD;
}

static void *out_calloc(void *ctx, size_t nelem, size_t elsize)
{
    size_t size = nelem * elsize;
    if (elsize != 0 && size / elsize != nelem) {
        return NULL;
    }
    void *p = out_malloc(ctx, size);
    if (p != NULL) {
        memset(p, 0, size);
    }
    return p;
}

static void out_free(void *ctx, void *ptr, size_t size)
{
    (void)size;                 /* the header's capacity counts */
    if (ptr == NULL) {
        return;
    }
    char *block = (char *)ptr - OUT_HEAD;
    size_t cap = out_capacity(block);
    if (cap >= OUT_MIN && cap <= OUT_KEEP / 2 &&
        PyThread_acquire_lock(outs.lock, WAIT_LOCK)) {
        /* room: the oldest go first */
        while (outs.n > 0 &&
               (outs.n == OUT_SLOTS || outs.bytes + cap > OUT_KEEP)) {
            outs.bytes -= out_capacity(outs.block[0]);
            free(outs.block[0]);
            outs.n--;
            memmove(outs.block, outs.block + 1,
                    (size_t)outs.n * sizeof outs.block[0]);
        }
        outs.block[outs.n++] = block;
        outs.bytes += cap;
        PyThread_release_lock(outs.lock);
        return;
    }
    (void)ctx;
    free(block);
}

static void *out_realloc(void *ctx, void *ptr, size_t new_size)
{
    if (ptr == NULL) {
        return out_malloc(ctx, new_size);
    }
    size_t cap = out_capacity((char *)ptr - OUT_HEAD);
    if (new_size <= cap) {
        return ptr;
    }
    void *p = out_malloc(ctx, new_size);
    if (p != NULL) {
        memcpy(p, ptr, cap);
        out_free(ctx, ptr, cap);
    }
    return p;
}

static PyDataMem_Handler out_handler = {
    "attention_c_outputs", 1,
    {NULL, out_malloc, out_calloc, out_realloc, out_free}
};
static PyObject *out_capsule = NULL;

PyObject *output_array(int nd, const npy_intp *dims, PyArray_Descr *descr)
{
    size_t bytes = (size_t)PyDataType_ELSIZE(descr);
    for (int k = 0; k < nd; k++) {
        bytes *= (size_t)dims[k];
    }
    if (bytes < OUT_MIN) {
        return PyArray_NewFromDescr(&PyArray_Type, descr, nd,
                                    (npy_intp *)dims, NULL, NULL, 0, NULL);
    }
    if (out_capsule == NULL) {
        outs.lock = outs.lock != NULL ? outs.lock : PyThread_allocate_lock();
        out_capsule = outs.lock != NULL
                      ? PyCapsule_New(&out_handler, "mem_handler", NULL)
                      : NULL;
        if (out_capsule == NULL) {
            Py_DECREF(descr);
            return PyErr_Occurred() ? NULL : PyErr_NoMemory();
        }
    }
    PyObject *old = PyDataMem_SetHandler(out_capsule);
    if (old == NULL) {
        Py_DECREF(descr);
        return NULL;
    }
    PyObject *a = PyArray_NewFromDescr(&PyArray_Type, descr, nd,
                                       (npy_intp *)dims, NULL, NULL, 0, NULL);
    PyObject *back = PyDataMem_SetHandler(old);
    Py_DECREF(old);
    if (back == NULL) {
        Py_XDECREF(a);
        return NULL;
    }
    Py_DECREF(back);
    return a;
}

/* When the module goes: frees the scratch and stops the pool's threads,
 * unless a call (in another thread) still uses them. */
void release_exec_state(void)
{
    if (outs.lock != NULL && PyThread_acquire_lock(outs.lock, WAIT_LOCK)) {
        while (outs.n > 0) {            /* the arrays hold their own */
            free(outs.block[--outs.n]);
        }
        outs.bytes = 0;
        PyThread_release_lock(outs.lock);
    }
    for (int use = 0; use < N_KEEP; use++) {
        if (!keep[use].busy) {
            PyMem_RawFree(keep[use].p);
            keep[use].p = NULL;
            keep[use].size = 0;
        }
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
