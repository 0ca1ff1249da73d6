/*
 * core/compiler.h - internal: ATT_UNUSED marks the static functions of
 * the template headers (ref/formulas.h, ref/scalar.h), which every file
 * that includes them gets for both types whether it calls them or not.
 * ATT_ALWAYS_INLINE keeps a helper split out of a long function inlined
 * into its callers' loops, as the code was before the split.
 */
#ifndef ATTENTION_C_CORE_COMPILER_H
#define ATTENTION_C_CORE_COMPILER_H

#if defined(__GNUC__) || defined(__clang__)
#define ATT_UNUSED __attribute__((unused))
#define ATT_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ATT_UNUSED
#define ATT_ALWAYS_INLINE inline
#endif

#endif /* ATTENTION_C_CORE_COMPILER_H */
