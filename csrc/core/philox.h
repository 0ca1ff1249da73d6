/*
 * core/philox.h - the dropout keep bits: a counter-based generator, so
 * that the backward regenerates the forward's bits instead of storing
 * them, and any thread count or blocking draws the same ones
 * (docs/contract.md 5.1).
 *
 * Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as
 * easy as 1, 2, 3", SC 2011), checked against Random123's known answers.
 * keep(seed, b, i, t) for flat batch index b, query i, key t is
 *     word (t & 3) of philox(counter (t >> 2, i, b_lo, b_hi),
 *                            key (seed_lo, seed_hi))  >=  floor(p 2^32)
 * and attention_c.reference.dropout_keep computes the same bits in NumPy.
 * att_keep_row below is the scalar path's keep_row (core/dispatch.h); the
 * SIMD paths' (simd/ops.inc) run the same rounds on a vector of counters
 * and give its bits, which tests/kernels/test_dropout_keep.py checks.
 * Not a public header.
 */
#ifndef ATTENTION_C_PHILOX_H
#define ATTENTION_C_PHILOX_H

#include <stddef.h>
#include <stdint.h>

/* The 4 words of Philox4x32-10 at counter c under key (k0, k1), in c. */
static inline void att_philox4x32(uint32_t c[4], uint32_t k0, uint32_t k1)
{
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t c1 = c[1], c3 = c[3];
        c[0] = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c[1] = (uint32_t)p1;
        c[2] = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c[3] = (uint32_t)p0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* The least word kept: a word u is kept iff u >= floor(p 2^32), so a key
 * is dropped with probability p (to 2^-32); 0 <= p < 1. */
static inline uint32_t att_keep_threshold(double p)
{
    return p <= 0 ? 0 : (uint32_t)(p * 4294967296.0);
}

/* Dropout inside a fused kernel (core/dispatch.h's flash): the keep
 * bits of the queries i0 + c of flat batch index b (c from the call's
 * first query), the weights kept multiplied by scale = 1 / (1 - p). */
typedef struct att_drop {
    uint64_t seed;
    uint32_t threshold;     /* att_keep_threshold(p) */
    ptrdiff_t b, i0;
    double scale;
} att_drop;

/* keep[t - t0] = keep(seed, b, i, t) for t in [t0, t0 + n). */
static inline void att_keep_row(uint64_t seed, uint32_t threshold,
                                ptrdiff_t b, ptrdiff_t i, ptrdiff_t t0,
                                ptrdiff_t n, unsigned char *keep)
{
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    ptrdiff_t t = t0, end = t0 + n;
    while (t < end) {
        uint32_t c[4] = {(uint32_t)((uint64_t)t >> 2), (uint32_t)i,
                         (uint32_t)(uint64_t)b,
                         (uint32_t)((uint64_t)b >> 32)};
        att_philox4x32(c, k0, k1);
        for (int w = (int)(t & 3); w < 4 && t < end; w++, t++) {
            keep[t - t0] = c[w] >= threshold;
        }
    }
}

#endif /* ATTENTION_C_PHILOX_H */
