/*
 * core/compiler.h - internal: ATT_UNUSED marks the static functions of
 * the template headers (ref/formulas.h, ref/scalar.h), which every file
 * that includes them gets for both types whether it calls them or not.
 */
#ifndef ATTENTION_C_CORE_COMPILER_H
#define ATTENTION_C_CORE_COMPILER_H

#if defined(__GNUC__) || defined(__clang__)
#define ATT_UNUSED __attribute__((unused))
#else
#define ATT_UNUSED
#endif

#endif /* ATTENTION_C_CORE_COMPILER_H */
