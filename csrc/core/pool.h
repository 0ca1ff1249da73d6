/*
 * core/pool.h - a minimal thread pool for the kernels (POSIX threads).
 *
 * The pool is an object its owner (the Python binding) creates and passes
 * to the kernels; the kernels keep no global state.  att_pool_run runs
 * fn(arg, task, thread) for every task in [0, ntasks), on the calling
 * thread and the pool's workers, and returns when all are done.  Which
 * thread runs a task is not fixed, so a kernel must make each task's
 * result independent of that (per-thread scratch is indexed by `thread`).
 */
#ifndef ATTENTION_C_POOL_H
#define ATTENTION_C_POOL_H

#include <stddef.h>

typedef struct att_pool att_pool;
typedef void (*att_task_fn)(void *arg, ptrdiff_t task, int thread);

/* A pool of nthreads threads in all (nthreads - 1 workers); NULL when
 * threads cannot be started. */
att_pool *att_pool_new(int nthreads);

/* Stops and joins the workers and frees the pool (NULL is fine). */
void att_pool_free(att_pool *pool);

/* Threads of the pool, the caller included (1 for NULL). */
int att_pool_threads(const att_pool *pool);

/* True when this process made the pool: after fork() the child has no
 * workers, and the pool must be dropped (att_pool_abandon) and remade. */
int att_pool_owned(const att_pool *pool);

/* Frees a pool inherited through fork() without touching its threads or
 * locks, which belong to the parent. */
void att_pool_abandon(att_pool *pool);

/* Runs the tasks on at most `threads` threads (>= 1) of the pool; with a
 * NULL pool, threads == 1, or while another caller runs a job on the same
 * pool, on the caller alone, in order (thread index 0).  Safe to call from
 * several threads at once. */
void att_pool_run(att_pool *pool, int threads, ptrdiff_t ntasks,
                  att_task_fn fn, void *arg);

#endif /* ATTENTION_C_POOL_H */
