/*
 * ref/scalar.h - the scalar primitives: small vector helpers, one softmax
 * row and its backward, and the attention family's primitives (the
 * products, the additive scores, the streamed softmax's steps, decoding's
 * passes) in plain loops.  The portable path, and the reference of the
 * SIMD ones (core/dispatch.h's att_ops; ref/ops.c makes their table).
 * Static functions for float (x_f32) and double (x_f64), from
 * ref/scalar.inc, so the pooled layer's loops inline them.
 */
#ifndef ATTENTION_C_REF_SCALAR_H
#define ATTENTION_C_REF_SCALAR_H

#include <math.h>
#include <stddef.h>

#include "core/compiler.h"
#include "ref/formulas.h"

/* Item t of a row is valid (or visible): m NULL means all are. */
#define VALID(m, t) ((m) == NULL || (m)[t])

#define REAL float
#define SFX(name) name##_f32
#define TANH tanhf
#define EXP expf
#include "ref/scalar.inc"
#undef REAL
#undef SFX
#undef TANH
#undef EXP

#define REAL double
#define SFX(name) name##_f64
#define TANH tanh
#define EXP exp
#include "ref/scalar.inc"
#undef REAL
#undef SFX
#undef TANH
#undef EXP

#endif /* ATTENTION_C_REF_SCALAR_H */
