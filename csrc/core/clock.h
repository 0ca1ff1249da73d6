/*
 * core/clock.h - internal: the monotonic clock in seconds, for the waits
 * that are bounded in time (core/pool.c's watch, core/peak.c's start and
 * timings).  The including file defines _POSIX_C_SOURCE before any
 * header, for clock_gettime.
 */
#ifndef ATTENTION_C_CORE_CLOCK_H
#define ATTENTION_C_CORE_CLOCK_H

#include <time.h>

static inline double att_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif /* ATTENTION_C_CORE_CLOCK_H */
