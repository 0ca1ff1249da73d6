/*
 * core/pool.c - see core/pool.h.  Workers sleep on a condition variable
 * between jobs; a job hands out tasks through an atomic counter, so a fast
 * thread takes more of them.  Plain C11 with POSIX threads; no Python.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "core/pool.h"

struct att_pool {
    int nthreads;               /* the caller and nthreads - 1 workers */
    pid_t pid;                  /* the process that made the pool */
    unsigned long forks;        /* fork_count when the pool was made */
    pthread_t *workers;
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    /* the current job, guarded by lock */
    unsigned long generation;   /* bumped for every job */
    int stop, active;           /* workers that took the job, not done */
    int closed;                 /* the caller is done: no one may join */
    int busy;                   /* a caller is running a job */
    int job_threads;            /* threads (caller included) the job uses */
    att_task_fn fn;
    void *arg;
    ptrdiff_t ntasks;
    atomic_ptrdiff_t next;      /* next task to hand out */
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

static void *worker_main(void *varg)
{
    worker_arg wa = *(worker_arg *)varg;
    att_pool *p = wa.pool;
    unsigned long seen = 0;
    free(varg);
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (!p->stop && p->generation == seen) {
            pthread_cond_wait(&p->wake, &p->lock);
        }
        if (p->stop) {
            break;
        }
        seen = p->generation;
        if (wa.index >= p->job_threads || p->closed) {
            continue;   /* fewer threads, or the others did every task */
        }
        p->active++;
        att_task_fn fn = p->fn;
        void *arg = p->arg;
        ptrdiff_t ntasks = p->ntasks;
        pthread_mutex_unlock(&p->lock);
        work(p, fn, arg, ntasks, wa.index);
        pthread_mutex_lock(&p->lock);
        if (--p->active == 0) {
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
    pthread_once(&fork_once, watch_forks);
    p->pid = getpid();
    p->forks = atomic_load(&fork_count);
    atomic_init(&p->next, 0);
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
    p->active = 0;
    p->closed = 0;
    atomic_store(&p->next, 0);
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    work(p, fn, arg, ntasks, 0);
    /* wait for the workers that took the job; one not yet woken (its
     * core busy elsewhere) would only find no task left: it skips the
     * job instead of holding the caller until the scheduler runs it */
    pthread_mutex_lock(&p->lock);
    p->closed = 1;
    while (p->active > 0) {
        pthread_cond_wait(&p->done, &p->lock);
    }
    p->busy = 0;
    pthread_mutex_unlock(&p->lock);
}
