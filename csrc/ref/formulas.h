/*
 * ref/formulas.h - the scalar formulas of the contract (docs/contract.md)
 * that the scalar path (ref/, pooled/) and the SIMD path (simd/) share:
 * one C function each, so that the two paths cannot drift apart.  The
 * SIMD path keeps its own vector loops (its tanh, exp, products,
 * reductions in lanes) around them.  Static functions for float (x_f32)
 * and double (x_f64), from ref/formulas.inc; a SIMD file includes this
 * header under its target pragma, so they are compiled for its
 * instruction set as the rest of it.
 */
#ifndef ATTENTION_C_REF_FORMULAS_H
#define ATTENTION_C_REF_FORMULAS_H

#include <float.h>
#include <math.h>
#include <stddef.h>

#include "core/compiler.h"

/* A valid item's softmax weight w, raised to at least the least normal
 * number of REAL (a NaN stays NaN): then alpha is exactly 0 exactly where
 * an item is masked, even when exp underflows or flush-to-zero is on, and
 * the binding can check a backward's alpha against its mask.  REAL is the
 * type where the macro is used. */
#define LEAST_NORMAL ((REAL)(sizeof(REAL) == sizeof(float) ? FLT_MIN \
                                                          : DBL_MIN))
#define WEIGHT_FLOOR(w) ((w) < LEAST_NORMAL ? LEAST_NORMAL : (w))

/* The attention family flushes instead (docs/contract.md section 8, "no
 * denormal, ever"): a weight exp(x) with x below LOG_LEAST_NORMAL, the
 * least x of REAL whose exp is normal (float: log(FLT_MIN) rounded up),
 * is exactly 0, and so is a weight below LEAST_NORMAL; a NaN stays NaN.
 * Then a score of finfo.min (T5's masks) costs what -inf costs instead
 * of running the products on denormals. */
#define LOG_LEAST_NORMAL ((REAL)(sizeof(REAL) == sizeof(float)           \
                                 ? -87.33654f : -708.3964185322641))
#define WEIGHT_FLUSH(w) ((w) < LEAST_NORMAL ? (REAL)0 : (w))

/* sum_rows's columns at a time: a row's read of 2 KB (float32) at once */
#define ATT_SUM_COLS 512

#define REAL float
#define FML(x) x##_f32
#include "ref/formulas.inc"
#undef REAL

#define REAL double
#define FML(x) x##_f64
#include "ref/formulas.inc"
#undef REAL

#endif /* ATTENTION_C_REF_FORMULAS_H */
