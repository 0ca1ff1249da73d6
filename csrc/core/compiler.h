/*
 * core/compiler.h - internal: ATT_UNUSED marks the static functions of
 * the template headers (ref/formulas.h, ref/scalar.h), which every file
 * that includes them gets for both types whether it calls them or not.
 * ATT_ALWAYS_INLINE keeps a helper split out of a long function inlined
 * into its callers' loops, as the code was before the split; ATT_NOINLINE
 * keeps a rare path out of a hot loop's registers.
 */
#ifndef ATTENTION_C_CORE_COMPILER_H
#define ATTENTION_C_CORE_COMPILER_H

#if defined(__GNUC__) || defined(__clang__)
#define ATT_UNUSED __attribute__((unused))
#define ATT_ALWAYS_INLINE inline __attribute__((always_inline))
#define ATT_NOINLINE __attribute__((noinline))
#else
#define ATT_UNUSED
#define ATT_ALWAYS_INLINE inline
#define ATT_NOINLINE
#endif

#endif /* ATTENTION_C_CORE_COMPILER_H */
