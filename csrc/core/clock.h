/*
 * core/clock.h - internal: the monotonic clock in seconds, for the waits
 * that are bounded in time (core/pool.c's watch, core/peak.c's start and
 * timings).  Defined in core/clock.c, which asks for POSIX's
 * clock_gettime, so that this header needs nothing first.
 */
#ifndef ATTENTION_C_CORE_CLOCK_H
#define ATTENTION_C_CORE_CLOCK_H

/* Seconds of CLOCK_MONOTONIC (from an arbitrary origin) */
double att_seconds(void);

#endif /* ATTENTION_C_CORE_CLOCK_H */
