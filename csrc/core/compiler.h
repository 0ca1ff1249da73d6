/*
 * core/compiler.h - internal: ATT_UNUSED marks the static functions of
 * the template headers (ref/formulas.h, ref/scalar.h), which every file
 * that includes them gets for both types whether it calls them or not.
 * ATT_ALWAYS_INLINE keeps a helper split out of a long function inlined
 * into its callers' loops, as the code was before the split; ATT_NOINLINE
 * keeps a rare path out of a hot loop's registers.  ATT_PREFETCH_L2
 * hints the cache line at p into the second-level cache (never faults):
 * an asm statement, as GCC deletes a loop of __builtin_prefetch alone (it
 * counts them as free of side effects).
 */
#ifndef ATTENTION_C_CORE_COMPILER_H
#define ATTENTION_C_CORE_COMPILER_H

#if defined(__GNUC__) || defined(__clang__)
#define ATT_UNUSED __attribute__((unused))
#define ATT_ALWAYS_INLINE inline __attribute__((always_inline))
#define ATT_NOINLINE __attribute__((noinline))
/* A rare path: laid out away from the loop that calls it */
#define ATT_COLD __attribute__((noinline, cold))
#if defined(__x86_64__) || defined(__i386__)
#define ATT_PREFETCH_L2(p) __asm__ __volatile__("prefetcht1 (%0)" : : "r"(p))
#elif defined(__aarch64__)
#define ATT_PREFETCH_L2(p)                                                  \
    __asm__ __volatile__("prfm pldl2keep, [%0]" : : "r"(p))
#else
#define ATT_PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#endif
#else
#define ATT_UNUSED
#define ATT_ALWAYS_INLINE inline
#define ATT_NOINLINE
#define ATT_COLD
#define ATT_PREFETCH_L2(p) ((void)0)
#endif

#endif /* ATTENTION_C_CORE_COMPILER_H */
