/*
 * pooled/kernels.c - the context-pooled layer (pooled/kernels.inc) for
 * float and double.  Plain C11 with libm; no Python here.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "core/dispatch.h"
#include "core/exec.h"
#include "core/testhooks.h"
#include "ref/formulas.h"
#include "ref/scalar.h"

#define REAL float
#define SFX(name) name##_f32
#define TANH tanhf
#define OPS_FOR att_ops_for_f32
#include "pooled/kernels.inc"
#undef REAL
#undef SFX
#undef TANH
#undef OPS_FOR

#define REAL double
#define SFX(name) name##_f64
#define TANH tanh
#define OPS_FOR att_ops_for_f64
#include "pooled/kernels.inc"
#undef REAL
#undef SFX
#undef TANH
#undef OPS_FOR
