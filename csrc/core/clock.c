/*
 * core/clock.c - see core/clock.h.  Plain C11 with POSIX's clock_gettime.
 */
#define _POSIX_C_SOURCE 200809L
#include <time.h>

#include "core/clock.h"

double att_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
