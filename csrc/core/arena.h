/*
 * core/arena.h - internal: THE scratch carver.  A caller's buffer is cut
 * into 64-byte aligned parts in order, by the family (family/plan.inc) and
 * the SIMD path's fused kernels (simd/fused.inc); with base NULL it only
 * counts, so the same code gives both the workspace size and the parts.
 * Also the overflow-checked size arithmetic of the workspace queries.
 */
#ifndef ATTENTION_C_CORE_ARENA_H
#define ATTENTION_C_CORE_ARENA_H

#include <stddef.h>
#include <stdint.h>

/* A buffer being carved: base (NULL: counting only), the bytes used so
 * far, and whether a count overflowed. */
typedef struct {
    char *base;
    size_t used;
    int overflow;
} arena;

/* The next part of n elements of size bytes, rounded up to 64 bytes;
 * NULL when n is 0 or when only counting.  A negative n, or a size that
 * would not fit, marks the arena overflowed. */
static inline void *arena_take(arena *ar, ptrdiff_t n, size_t size)
{
    if (n < 0 || (size != 0 && (size_t)n > ((size_t)PTRDIFF_MAX / 2 -
                                            ar->used) / size)) {
        ar->overflow = 1;
        return NULL;
    }
    void *p = ar->base ? ar->base + ar->used : NULL;
    ar->used += ((size_t)n * size + 63) / 64 * 64;
    return n > 0 ? p : NULL;
}

/* As arena_take, but an empty part still gets its address (the fused
 * kernels' parts are all placed, empty or not). */
static inline void *arena_place(arena *ar, ptrdiff_t n, size_t size)
{
    void *p = ar->base ? ar->base + ar->used : NULL;
    arena_take(ar, n, size);
    return p;
}

/* a * b, a + b, or -1 when an operand is negative or the result would
 * not fit: byte counts of the scratch. */
static inline ptrdiff_t mul_or_neg(ptrdiff_t a, ptrdiff_t b)
{
    if (a < 0 || b < 0 || (a != 0 && b > PTRDIFF_MAX / a)) {
        return -1;
    }
    return a * b;
}

static inline ptrdiff_t add_or_neg(ptrdiff_t a, ptrdiff_t b)
{
    return a < 0 || b < 0 || b > PTRDIFF_MAX - a ? -1 : a + b;
}

#endif /* ATTENTION_C_CORE_ARENA_H */
