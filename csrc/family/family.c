/*
 * family/family.c - the attention family (attention.h, docs/contract.md
 * section 4) for float and double: the family/ bodies, included once per
 * type in the order they build on (plan, visibility, nonfinite, stream,
 * decode, backward, project, cosine), with
 *   REAL, SFX(x)   the type and its names' suffix (x_f32, x_f64)
 *   TANH, EXP      its libm functions
 *   OPS, FIN, FOUT its att_ops (core/dispatch.h), att_family_in and
 *                  att_family_out (attention.h) types
 *   OPS_FOR        its table lookup (att_ops_for_f32 / _f64)
 * All in one translation unit, so the helpers stay inlined where they
 * were; cosine.inc, last, holds the entry points (attention.h), which
 * run the content score on the dot path.  Plain C11 with libm; no Python
 * here.
 *
 * Every score is the same frame around a few primitives (core/dispatch.h,
 * att_ops: a product, the additive score of one query, one softmax row),
 * taken from the scalar table (ref/ops.c) or a SIMD one:
 *
 *   forward   kp = keys W_k^T, qp = query W_q^T + b   once per key, query
 *             S = scores (Q K^T, Q kp^T, or v . tanh(qp_i + kp_t))
 *             alpha = masked softmax of S rows; out = alpha V
 *   backward  gamma = G V^T + ga;  delta = softmax backward;  dV = alpha^T G
 *             dot/general: dQ = delta K, dK = delta^T Q (times scale)
 *             additive: eq_i = sum_t eps_it, ek_t = sum_i eps_it, dv
 *             then the projections' backward, once over all rows.
 * dot and general also stream (docs/contract.md section 5): blocks of
 * queries against blocks of keys with an online softmax, lse instead of
 * the weights, the backward recomputing P = exp(S - lse) block by block;
 * with causal, blocks no query sees are never computed.  What a query
 * sees (key mask, attn_mask, causal, a bias of -inf) is read in place per
 * row, or as a range of keys where it is one (causal, window, padding,
 * an attn_mask of one run a row); sequences read their query, keys and
 * values by index (broadcast), and the backward runs the groups that
 * share one in order.
 * Work is split by sizes only, and every sum runs in an order fixed by
 * the sizes, so results are bitwise the same for any thread count.
 * Decoding (dot and general forward, at most DECODE_TQ queries per
 * sequence) runs neither: one task per group of queries that read the
 * same keys and values (grouped query heads, a sequence's queries), their
 * scores by one pass over the keys and out by one over the values
 * (dot_keys_multi, sum_values_multi), no packing, no search for
 * non-finite rows first; few queries on a long cache split it in chunks
 * of keys, merged in order.
 */


#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "core/arena.h"
#include "core/compiler.h"
#include "core/dispatch.h"
#include "core/exec.h"
#include "core/half.h"
#include "core/philox.h"
#include "core/pool.h"
#include "ref/formulas.h"
#include "ref/scalar.h"


#define REAL float
#define SFX(name) name##_f32
#define TANH tanhf
#define EXP expf
#define OPS att_ops_f32
#define FIN att_family_in_f32
#define FOUT att_family_out_f32
#define OPS_FOR att_ops_for_f32
#include "family/plan.inc"
#include "family/visibility.inc"
#include "family/nonfinite.inc"
#include "family/stream.inc"
#include "family/decode.inc"
#include "family/cache.inc"
#include "family/backward.inc"
#include "family/project.inc"
#include "family/cosine.inc"
#undef REAL
#undef SFX
#undef TANH
#undef EXP
#undef OPS
#undef FIN
#undef FOUT
#undef OPS_FOR

#define REAL double
#define SFX(name) name##_f64
#define TANH tanh
#define EXP exp
#define OPS att_ops_f64
#define FIN att_family_in_f64
#define FOUT att_family_out_f64
#define OPS_FOR att_ops_for_f64
#include "family/plan.inc"
#include "family/visibility.inc"
#include "family/nonfinite.inc"
#include "family/stream.inc"
#include "family/decode.inc"
#include "family/cache.inc"
#include "family/backward.inc"
#include "family/project.inc"
#include "family/cosine.inc"
#undef REAL
#undef SFX
#undef TANH
#undef EXP
#undef OPS
#undef FIN
#undef FOUT
#undef OPS_FOR
