/*
 * core/pool.c - see core/pool.h.  Workers sleep on a condition variable
 * between jobs; a job hands out tasks through an atomic counter, so a fast
 * thread takes more of them.  Plain C11 with POSIX threads; no Python.
 *
 * A wake through a condition variable is a system call and, on a
 * virtual machine, an interrupt to a halted vCPU: tens of us before the
 * thread runs, as long as a small job.  So a worker that ends a job
 * watches for the next one for SPIN_SECONDS before it sleeps, and a caller
 * whose workers are still at work watches for them as long before it
 * sleeps: the jobs of one call (a scan of the inputs, then the
 * attention) and calls made back to back hand over in memory.  The watch
 * is short because a longer one takes a core from the work between two
 * calls: 100 us made a Llama-like model's generation with PyTorch's
 * threads 1.07x slower on 2 cores; 10 us, 1.00x. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/pool.h"

/* How long a thread watches before it sleeps (see above) */
#define SPIN_SECONDS 10e-6
/* Bytes of a cache line, at least (128: the pairs of lines Intel's
 * prefetcher fetches together) */
#define LINE_BYTES 128

struct att_pool {
    int nthreads;               /* the caller and nthreads - 1 workers */
    pid_t pid;                  /* the process that made the pool */
    unsigned long forks;        /* fork_count when the pool was made */
    pthread_t *workers;
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    /* the current job, guarded by lock (the atomics are also read
     * without it, by the threads that watch) */
    int stop;
    int closed;                 /* the caller is done: no one may join */
    int busy;                   /* a caller is running a job */
    int job_threads;            /* threads (caller included) the job uses */
    att_task_fn fn;
    void *arg;
    ptrdiff_t ntasks;
    /* Each counter on a cache line of its own (a line apart from all
     * else): a thread watching one must not pull the line of the task
     * counter from the threads taking tasks, once a task */
    char gap0[LINE_BYTES];
    atomic_ulong generation;    /* bumped for every job */
    char gap1[LINE_BYTES];
    atomic_ulong active;        /* workers that took the job, not done */
    char gap2[LINE_BYTES];
    atomic_ptrdiff_t next;      /* next task to hand out */
    char gap3[LINE_BYTES];
};

/* Forks this process has been through, counted in the child by an
 * atfork handler: a pool made before the last fork belongs to the parent.
 * Counted rather than compared with getpid(), which is a system call on
 * every call of the binding (0.2 us, a quarter of an empty call). */
static atomic_ulong fork_count;
static atomic_int forks_counted;     /* the handler is installed */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void count_fork(void)
{
    atomic_fetch_add(&fork_count, 1);
}

static void watch_forks(void)
{
    /* without the handler (no memory) the pools compare pids instead */
    atomic_store(&forks_counted, pthread_atfork(NULL, NULL, count_fork)
                                 == 0);
}

/* Takes tasks until none is left. */
static void work(att_pool *p, att_task_fn fn, void *arg, ptrdiff_t ntasks,
                 int thread)
{
    for (;;) {
        ptrdiff_t task = atomic_fetch_add(&p->next, 1);
        if (task >= ntasks) {
            return;
        }
        fn(arg, task, thread);
    }
}

typedef struct {
    att_pool *pool;
    int index;                  /* 1 .. nthreads - 1; the caller is 0 */
} worker_arg;

/* A pause in a watching loop: lets the core's other thread run, and
 * keeps the loop from flooding the memory system with loads */
static inline void relax(void)
{
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_ia32_pause();
#elif defined(__GNUC__) && defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Watches *x, the lock not held, for at most SPIN_SECONDS: until it equals
 * `value` (equal 1) or differs from it (equal 0).  A worker watches for
 * a new job (generation past the one it saw), the caller for its workers
 * to be done (active 0); what it sees is checked again under the lock. */
static void watch(atomic_ulong *x, unsigned long value, int equal)
{
    double end = att_seconds() + SPIN_SECONDS;
    do {
        for (int i = 0; i < 64; i++) {
            if ((atomic_load_explicit(x, memory_order_relaxed) == value)
                == equal) {
                return;
            }
            relax();
        }
    } while (att_seconds() < end);
}

static void *worker_main(void *varg)
{
    worker_arg wa = *(worker_arg *)varg;
    att_pool *p = wa.pool;
    unsigned long seen = 0;
    free(varg);
    for (;;) {
        /* the next job, if it comes soon, without a wake; then under
         * the lock as ever (a job bumped after the check below wakes the
         * condition variable) */
        watch(&p->generation, seen, 0);
        pthread_mutex_lock(&p->lock);
        while (!p->stop && atomic_load(&p->generation) == seen) {
            pthread_cond_wait(&p->wake, &p->lock);
        }
        if (p->stop) {
            pthread_mutex_unlock(&p->lock);
            break;
        }
        seen = atomic_load(&p->generation);
        if (wa.index >= p->job_threads || p->closed) {
            pthread_mutex_unlock(&p->lock);
            continue;   /* fewer threads, or the others did every task */
        }
        atomic_fetch_add(&p->active, 1);
        att_task_fn fn = p->fn;
        void *arg = p->arg;
        ptrdiff_t ntasks = p->ntasks;
        pthread_mutex_unlock(&p->lock);
        work(p, fn, arg, ntasks, wa.index);
        pthread_mutex_lock(&p->lock);
        /* the caller, watching or asleep, sees the results written
         * before this (sequentially consistent) decrement */
        if (atomic_fetch_sub(&p->active, 1) == 1) {
            pthread_cond_signal(&p->done);
        }
        pthread_mutex_unlock(&p->lock);
    }
    return NULL;
}

att_pool *att_pool_new(int nthreads)
{
    att_pool *p = calloc(1, sizeof *p);
    if (p == NULL) {
        return NULL;
    }
    p->nthreads = nthreads < 1 ? 1 : nthreads;
    pthread_once(&fork_once, watch_forks);
    p->pid = getpid();
    p->forks = atomic_load(&fork_count);
    atomic_init(&p->next, 0);
    atomic_init(&p->generation, 0);
    atomic_init(&p->active, 0);
    p->workers = calloc((size_t)p->nthreads, sizeof *p->workers);
    if (p->workers == NULL || pthread_mutex_init(&p->lock, NULL) != 0) {
        free(p->workers);
        free(p);
        return NULL;
    }
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int i = 1; i < p->nthreads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (wa != NULL) {
            wa->pool = p;
            wa->index = i;
        }
        if (wa == NULL ||
            pthread_create(&p->workers[i], NULL, worker_main, wa) != 0) {
            free(wa);
            p->nthreads = i;    /* keep the workers already started */
            break;
        }
    }
    return p;
}

void att_pool_free(att_pool *p)
{
    if (p == NULL) {
        return;
    }
    pthread_mutex_lock(&p->lock);
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i < p->nthreads; i++) {
        pthread_join(p->workers[i], NULL);
    }
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->lock);
    free(p->workers);
    free(p);
}

int att_pool_threads(const att_pool *p)
{
    return p == NULL ? 1 : p->nthreads;
}

int att_pool_owned(const att_pool *p)
{
    if (p == NULL) {
        return 0;
    }
    return atomic_load_explicit(&forks_counted, memory_order_relaxed)
           ? p->forks == atomic_load(&fork_count) : p->pid == getpid();
}

void att_pool_abandon(att_pool *p)
{
    if (p != NULL) {
        free(p->workers);
        free(p);
    }
}

static void serial(att_task_fn fn, void *arg, ptrdiff_t ntasks)
{
    for (ptrdiff_t t = 0; t < ntasks; t++) {
        fn(arg, t, 0);
    }
}

void att_pool_run(att_pool *p, int threads, ptrdiff_t ntasks,
                  att_task_fn fn, void *arg)
{
    if (p != NULL && threads > p->nthreads) {
        threads = p->nthreads;
    }
    if (threads > ntasks) {
        threads = (int)ntasks;
    }
    if (p == NULL || threads <= 1 || !att_pool_owned(p)) {
        serial(fn, arg, ntasks);
        return;
    }
    pthread_mutex_lock(&p->lock);
    if (p->busy) {
        /* another caller (a second Python thread) has the workers: run
         * alone rather than wait; the results are the same */
        pthread_mutex_unlock(&p->lock);
        serial(fn, arg, ntasks);
        return;
    }
    p->busy = 1;
    p->fn = fn;
    p->arg = arg;
    p->ntasks = ntasks;
    p->job_threads = threads;
    atomic_store(&p->active, 0);
    p->closed = 0;
    atomic_store(&p->next, 0);
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    work(p, fn, arg, ntasks, 0);
    /* wait for the workers that took the job; one not yet woken (its
     * core busy elsewhere) would only find no task left: it skips the
     * job instead of holding the caller until the scheduler runs it */
    pthread_mutex_lock(&p->lock);
    p->closed = 1;
    if (atomic_load(&p->active) > 0) {
        pthread_mutex_unlock(&p->lock);
        watch(&p->active, 0, 1);
        pthread_mutex_lock(&p->lock);
    }
    while (atomic_load(&p->active) > 0) {
        pthread_cond_wait(&p->done, &p->lock);
    }
    p->busy = 0;
    pthread_mutex_unlock(&p->lock);
}
