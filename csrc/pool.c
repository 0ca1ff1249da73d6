/*
 * pool.c - see pool.h.  Workers sleep on a condition variable between
 * jobs; a job hands out tasks through an atomic counter, so a fast thread
 * takes more of them.  Plain C11 with POSIX threads; no Python.
 *
 * A call of the family runs several jobs back to back (projections, the
 * rows, the projections' backward), and a decoder calls it at every
 * step: waking a sleeping worker costs a futex call on the caller and
 * 5-50 us before the worker runs.  So for SPIN_NS after a job a worker
 * watches for the next one before it sleeps, and the caller watches for
 * the workers to finish before it sleeps on `done`; a job only signals
 * the condition variables when someone sleeps on them.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* How long a thread watches before it sleeps (ns). */
#define SPIN_NS 50000

#include "pool.h"

struct att_pool {
    int nthreads;               /* the caller and nthreads - 1 workers */
    pid_t pid;                  /* the process that made the pool */
    pthread_t *workers;
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    /* the current job, guarded by lock; generation and active are also
     * read without it by the threads that watch them */
    atomic_ulong generation;    /* bumped for every job */
    int stop;
    atomic_int active;          /* workers still busy with the job */
    int sleepers;               /* workers asleep on wake */
    int waiting;                /* the caller is asleep on done */
    int busy;                   /* a caller is running a job */
    int job_threads;            /* threads (caller included) the job uses */
    att_task_fn fn;
    void *arg;
    ptrdiff_t ntasks;
    atomic_ptrdiff_t next;      /* next task to hand out */
};

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

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Watches the generation for up to SPIN_NS while it is `seen`. */
static void spin_for_job(att_pool *p, unsigned long seen)
{
    long long start = now_ns();
    for (int i = 1; atomic_load_explicit(&p->generation,
                                         memory_order_acquire) == seen; i++) {
        CPU_RELAX();
        if (i % 64 == 0 && now_ns() - start > SPIN_NS) {
            return;
        }
    }
}

/* Watches for up to SPIN_NS until the workers are done with the job. */
static void spin_for_done(att_pool *p)
{
    long long start = now_ns();
    for (int i = 1; atomic_load_explicit(&p->active,
                                         memory_order_acquire) > 0; i++) {
        CPU_RELAX();
        if (i % 64 == 0 && now_ns() - start > SPIN_NS) {
            return;
        }
    }
}

static void *worker_main(void *varg)
{
    worker_arg wa = *(worker_arg *)varg;
    att_pool *p = wa.pool;
    unsigned long seen = 0;
    free(varg);
    pthread_mutex_lock(&p->lock);
    for (;;) {
        if (!p->stop && atomic_load(&p->generation) == seen) {
            pthread_mutex_unlock(&p->lock);
            spin_for_job(p, seen);
            pthread_mutex_lock(&p->lock);
        }
        while (!p->stop && atomic_load(&p->generation) == seen) {
            p->sleepers++;
            pthread_cond_wait(&p->wake, &p->lock);
            p->sleepers--;
        }
        if (p->stop) {
            break;
        }
        seen = atomic_load(&p->generation);
        if (wa.index >= p->job_threads) {
            continue;           /* this job uses fewer threads */
        }
        att_task_fn fn = p->fn;
        void *arg = p->arg;
        ptrdiff_t ntasks = p->ntasks;
        pthread_mutex_unlock(&p->lock);
        work(p, fn, arg, ntasks, wa.index);
        pthread_mutex_lock(&p->lock);
        if (atomic_fetch_sub(&p->active, 1) == 1 && p->waiting) {
            pthread_cond_signal(&p->done);
        }
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

att_pool *att_pool_new(int nthreads)
{
    att_pool *p = calloc(1, sizeof *p);
    if (p == NULL) {
        return NULL;
    }
    p->nthreads = nthreads < 1 ? 1 : nthreads;
    p->pid = getpid();
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
    return p != NULL && p->pid == getpid();
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
    atomic_store(&p->active, threads - 1);
    atomic_store(&p->next, 0);
    atomic_fetch_add(&p->generation, 1);
    if (p->sleepers > 0) {      /* the others watch generation */
        pthread_cond_broadcast(&p->wake);
    }
    pthread_mutex_unlock(&p->lock);
    work(p, fn, arg, ntasks, 0);
    spin_for_done(p);
    pthread_mutex_lock(&p->lock);
    while (atomic_load(&p->active) > 0) {
        p->waiting = 1;
        pthread_cond_wait(&p->done, &p->lock);
        p->waiting = 0;
    }
    p->busy = 0;
    pthread_mutex_unlock(&p->lock);
}
