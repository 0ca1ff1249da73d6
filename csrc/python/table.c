/*
 * table.c - the table of the public functions: every one is a row of
 * `funcs` below, its arguments in signature order (args.h names them),
 * each with a shape pattern in the style of NumPy's gufunc signatures
 * ("(..., T, H)", "(A, H+Hq)"), its outputs with theirs, and the kernel
 * call, a few lines above the table (the family's and the key
 * projection's, with their own checks, in rows_family.c).  The generic
 * driver (call.c) parses, checks, casts, allocates, releases the GIL and
 * maps the status the same way for every row.  Adding a function: its
 * argument names in args.h if new, one kernel call, one row, and its
 * ENTRY in module.c.
 *
 * Arguments up to .npos (default: the required ones, .nreq) may be given
 * by position; the rest are keyword-only, so that an optional array can
 * never be read as another (a mask in the place of the bias).
 */
#include "binding.h"

/* ---------------------------------------------------------------------
 * The vocabulary (args.h): names and kinds
 */

#define ATT_ARG_NAME(ID, name, kind) #name,
const char *const arg_names[N_ARG_IDS] = {NULL, ATT_ARGS(ATT_ARG_NAME)};
#undef ATT_ARG_NAME

#define ATT_ARG_KIND(ID, name, kind) kind,
const unsigned arg_kinds[N_ARG_IDS] = {0, ATT_ARGS(ATT_ARG_KIND)};
#undef ATT_ARG_KIND

#define ATT_OUT_NAME(ID, name) #name,
const char *const out_names[N_OUT_IDS] = {ATT_OUTS(ATT_OUT_NAME)};
#undef ATT_OUT_NAME

/* ---------------------------------------------------------------------
 * The kernels of the rows
 */

/* att_NAME_f32 or att_NAME_f64 for the call's dtype. */
#define TYPED(c, NAME, ...)                                                  \
    ((c)->typenum == NPY_FLOAT ? att_##NAME##_f32(__VA_ARGS__)               \
                               : att_##NAME##_f64(__VA_ARGS__))
#define IN(id) arg_data(c, id)
#define OUT(id) out_data(c, id)

static int k_mean_context(Call *c)
{
    return TYPED(c, mean_context, c->d, IN(X_H), IN(X_MASK), OUT(Y_C));
}

static int k_mean_context_backward(Call *c)
{
    return TYPED(c, mean_context_backward, c->d, IN(X_GRAD_C), IN(X_MASK),
                 OUT(Y_DH));
}

static ptrdiff_t w_additive_score(Call *c)
{
    return TYPED(c, additive_score_workspace, c->d);
}

static int k_additive_score(Call *c)
{
    return TYPED(c, additive_score, c->d, IN(X_H), IN(X_CONTEXT), IN(X_W),
                 IN(X_V), IN(X_B), OUT(Y_S), c->work);
}

static ptrdiff_t w_additive_score_backward(Call *c)
{
    return TYPED(c, additive_score_backward_workspace, c->d);
}

static int k_additive_score_backward(Call *c)
{
    return TYPED(c, additive_score_backward, c->d, IN(X_GRAD_S), IN(X_H),
                 IN(X_CONTEXT), IN(X_W), IN(X_V), IN(X_B), OUT(Y_DH),
                 OUT(Y_DCONTEXT), OUT(Y_DW), OUT(Y_DV), OUT(Y_DB), c->work);
}

static int k_masked_softmax(Call *c)
{
    return TYPED(c, masked_softmax, c->d, IN(X_SCORES), IN(X_MASK),
                 OUT(Y_ALPHA));
}

static int k_masked_softmax_backward(Call *c)
{
    return TYPED(c, masked_softmax_backward, c->d, IN(X_GRAD_ALPHA),
                 IN(X_ALPHA), OUT(Y_DSCORES));
}

static int k_weighted_sum(Call *c)
{
    return TYPED(c, weighted_sum, c->d, IN(X_ALPHA), IN(X_H), OUT(Y_OUT));
}

static int k_weighted_sum_backward(Call *c)
{
    return TYPED(c, weighted_sum_backward, c->d, IN(X_GRAD_OUT),
                 IN(X_ALPHA), IN(X_H), OUT(Y_DALPHA), OUT(Y_DH));
}

static ptrdiff_t w_context_attention(Call *c)
{
    return TYPED(c, context_attention_workspace, c->d, &c->ex);
}

static int k_context_attention(Call *c)
{
    return TYPED(c, context_attention, c->d, &c->ex, IN(X_H), IN(X_W),
                 IN(X_V), IN(X_B), IN(X_MASK), OUT(Y_OUT), OUT(Y_ALPHA),
                 OUT(Y_ACTIVATIONS), c->work);
}

static ptrdiff_t w_context_attention_backward(Call *c)
{
    return TYPED(c, context_attention_backward_workspace, c->d, &c->ex);
}

static int k_context_attention_backward(Call *c)
{
    return TYPED(c, context_attention_backward, c->d, &c->ex,
                 IN(X_GRAD_OUT), IN(X_H), IN(X_W), IN(X_V), IN(X_ALPHA),
                 IN(X_B), IN(X_MASK), IN(X_GRAD_ALPHA), IN(X_ACTIVATIONS),
                 OUT(Y_DH),
                 OUT(Y_DW), OUT(Y_DV), OUT(Y_DB), c->work);
}

#undef IN
#undef OUT

/* ---------------------------------------------------------------------
 * The table
 */

/* An argument: required array, optional array, boolean mask, flag (the
 * kinds, args.h, are added at import); with a hint for its shape errors.
 * An output: always, only when an argument is given (RES_IF), or an
 * extra one appended to a backward's named tuple (RES_EXTRA). */
#define ARR(i, s) {.id = i, .shape = s}
#define OPT(i, s) {.id = i, .flags = F_OPT, .shape = s}
#define MASK(s) {.id = X_MASK, .flags = F_OPT, .shape = s}
#define FLAG(i) {.id = i}
#define SCALE {.id = X_SCALE}
#define HINT(i, s, h) {.id = i, .shape = s, .hint = h}
#define RES(i, s) {.id = i, .shape = s}
#define RES_IF(i, s, w) {.id = i, .shape = s, .when = w}
#define RES_EXTRA(i, s, w) {.id = i, .shape = s, .when = w, .drop = 1}

#define W_CONTEXT HINT(X_W, "(A, 2*H)", "(W has the layout of " \
                       "torch.nn.Linear(2*H, A).weight)")
#define W_ADDITIVE HINT(X_W, "(A, H+Hq)", "(W = [W_k | W_q] has the layout " \
                        "of torch.nn.Linear(H + Hq, A).weight)")
#define W_GENERAL HINT(X_W, "(Hq, H)", "(W has the layout of " \
                       "torch.nn.Linear(H, Hq, bias=False).weight)")
/* the family's inputs: leading axes broadcast against each other */
#define QUERY(wide) {.id = X_QUERY, .flags = F_LEADB,                        \
                     .shape = "(..., Tq?, " wide ")",                        \
                     .hint = "(one query (..., Hq) or several (..., Tq, "    \
                     "Hq), with query.ndim == keys.ndim)"}
#define QUERY_DOT {.id = X_QUERY, .flags = F_LEADB,                          \
                   .shape = "(..., Tq?, H)",                                 \
                   .hint = "(the dot score needs queries as wide as the "    \
                   "keys)"}
/* the masks and the bias are read where they are (F_VIEW), broadcast by
 * NumPy's rules */
#define FAMILY_MASK {.id = X_MASK, .flags = F_OPT | F_VIEW,                  \
                     .shape = "(..., T)",                                    \
                     .hint = "(the key mask, the same for every query)"}
#define ATTN_MASK {.id = X_ATTN_MASK, .flags = F_OPT | F_VIEW,               \
                   .shape = "(..., Tq?, T)",                                 \
                   .hint = "(True = query i may attend to key t)"}
#define CAUSAL FLAG(X_CAUSAL)
#define BIAS {.id = X_BIAS, .flags = F_OPT | F_VIEW,                         \
              .shape = "(..., Tq?, T)",                                      \
              .hint = "(added to the scores; -inf masks)"}
#define DROPOUT {.id = X_DROPOUT}
#define SEED {.id = X_SEED}
#define RETURN_WEIGHTS {.id = X_RETURN_WEIGHTS}
/* the variants of dot and general (issue 25), keyword-only, last */
#define CU_SEQLENS(i) {.id = i, .flags = F_OPT, .shape = "(N,)",           \
                       .hint = "(1-D: the starts of the packed segments, " \
                       "then the total; cu_seqlens_q and _k of one length)"}
#define PER_SEQ(i, h) {.id = i, .flags = F_OPT | F_VIEW | F_FOLLOW,         \
                       .shape = "(...)", .hint = h}
#define VARIANTS {.id = X_WINDOW}, {.id = X_SOFTCAP},                       \
    PER_SEQ(X_ALIBI_SLOPES, "(one slope per sequence: -slope |i' - t| "    \
            "added to the scores)"),                                        \
    PER_SEQ(X_SINKS, "(one logit per sequence, without a value)"),          \
    CU_SEQLENS(X_CU_SEQLENS_Q), CU_SEQLENS(X_CU_SEQLENS_K)
/* their gradients, at the end of the named tuples */
#define VARIANT_GRADS                                                        \
    {.id = Y_DALIBI_SLOPES, .shape = "(...)", .like = X_ALIBI_SLOPES,        \
     .when = X_ALIBI_SLOPES},                                                \
    {.id = Y_DSINKS, .shape = "(...)", .like = X_SINKS, .when = X_SINKS}
#define KEYS {.id = X_KEYS, .flags = F_LEADB, .shape = "(..., T, H)"}
#define VALUES {.id = X_VALUES, .flags = F_OPT | F_LEADB,                    \
                .shape = "(..., T, Hv)"}
#define KPROJ(wide) {.id = X_KEY_PROJ, .flags = F_OPT | F_LEADB,             \
                     .shape = "(..., T, " wide ")"}
#define ALPHA_Q ARR(X_ALPHA, "(..., Tq?, T)")
#define ALPHA_OPT OPT(X_ALPHA, "(..., Tq?, T)")
/* lse never chooses the dtype: a 16-bit forward returns it in float32 */
#define SAVED OPT(X_OUT, "(..., Tq?, Hv)"),                                 \
    {.id = X_LSE, .flags = F_OPT | F_FOLLOW, .shape = "(..., Tq?)"}
#define GRAD_OUT_Q ARR(X_GRAD_OUT, "(..., Tq?, Hv)")
#define GRAD_ALPHA_Q OPT(X_GRAD_ALPHA, "(..., Tq?, T)")
#define FAMILY_OUTS RES(Y_OUT, "(..., Tq?, Hv)"), RES(Y_ALPHA, "(..., Tq?, T)")
/* (out, alpha), or (out, lse) with return_weights=False */
#define STREAM_OUTS                                                          \
    RES(Y_OUT, "(..., Tq?, Hv)"),                                            \
    {.id = Y_ALPHA, .shape = "(..., Tq?, T)", .when = X_RETURN_WEIGHTS,      \
     .drop = 1},                                                             \
    {.id = Y_LSE, .shape = "(..., Tq?)", .unless = X_RETURN_WEIGHTS,         \
     .drop = 1}
#define DBIAS {.id = Y_DBIAS, .shape = "(..., Tq?, T)", .like = X_BIAS,       \
               .when = X_BIAS}
/* the inputs' gradients have their shapes (summed where they broadcast) */
#define FAMILY_GRADS(wide)                                                   \
    {.id = Y_DQUERY, .shape = "(..., Tq?, " wide ")", .like = X_QUERY},      \
    {.id = Y_DKEYS, .shape = "(..., T, H)", .like = X_KEYS},                 \
    {.id = Y_DVALUES, .shape = "(..., T, Hv)", .like = X_VALUES,             \
     .when = X_VALUES}
/* the location score: W (T_max, Hq) and b (T_max,) hold a row and a
 * bias per position, the values fix T */
#define QUERY_LOC {.id = X_QUERY, .flags = F_LEADB,                          \
                   .shape = "(..., Tq?, Hq)",                                \
                   .hint = "(one query (..., Hq) or several (..., Tq, "      \
                   "Hq), with query.ndim == values.ndim)"}
#define VALUES_LOC {.id = X_VALUES, .flags = F_LEADB, .shape = "(..., T, Hv)"}
#define W_LOCATION {.id = X_W, .flags = F_LEADB, .shape = "(L, Hq)",         \
                    .hint = "(a row per position t < T_max: the layout of " \
                    "torch.nn.Linear(Hq, T_max).weight)"}
#define B_LOCATION {.id = X_B, .flags = F_OPT, .shape = "(L,)",              \
                    .hint = "(a bias per position, as W's rows)"}
#define LOCATION                                                             \
    .order = {X_VALUES, X_QUERY, X_W}, .fused = 1, .family = 1,              \
    .score = ATT_SCORE_DOT, .location = 1, .check = check_location,         \
    .workspace = w_family, .kernel = k_location
/* the cosine score's beta: a number, or one per query position */
#define SHARPNESS {.id = X_SHARPNESS, .flags = F_OPT | F_VIEW | F_FOLLOW,    \
                   .shape = "(..., Tq?)",                                    \
                   .hint = "(beta, one per query position, or a number)"}
#define DSHARPNESS {.id = Y_DSHARPNESS, .shape = "(..., Tq?)",               \
                    .like = X_SHARPNESS, .when = X_SHARPNESS}
/* the family's rows: the keys fix T and H first */
#define FAMILY(sc)                                                           \
    .order = {X_KEYS, X_QUERY, X_VALUES}, .fused = 1,                        \
    .family = 1, .score = (sc), .check = check_family,                       \
    .workspace = w_family,                                                   \
    .kernel = k_family

FuncSpec funcs[] = {
    {.name = "mean_context",
     .args = {ARR(X_H, "(..., T, H)"), MASK("(..., T)")}, .nreq = 1,
     .order = {X_H}, .outs = {RES(Y_C, "(..., H)")},
     .kernel = k_mean_context},
    {.name = "mean_context_backward",
     .args = {ARR(X_GRAD_C, "(..., H)"), ARR(X_H, "(..., T, H)"),
              MASK("(..., T)")}, .nreq = 2,
     .order = {X_H}, .outs = {RES(Y_DH, "(..., T, H)")},
     .kernel = k_mean_context_backward},
    {.name = "additive_score",
     .args = {ARR(X_H, "(..., T, H)"), ARR(X_CONTEXT, "(..., H)"), W_CONTEXT,
              ARR(X_V, "(A,)"), OPT(X_B, "(A,)")}, .nreq = 4,
     .order = {X_H}, .outs = {RES(Y_S, "(..., T)")},
     .workspace = w_additive_score, .kernel = k_additive_score},
    {.name = "additive_score_backward",
     .args = {ARR(X_GRAD_S, "(..., T)"), ARR(X_H, "(..., T, H)"),
              ARR(X_CONTEXT, "(..., H)"), W_CONTEXT, ARR(X_V, "(A,)"),
              OPT(X_B, "(A,)")}, .nreq = 5,
     .order = {X_H},
     .outs = {RES(Y_DH, "(..., T, H)"), RES(Y_DCONTEXT, "(..., H)"),
              RES(Y_DW, "(A, 2*H)"), RES(Y_DV, "(A,)"),
              RES_IF(Y_DB, "(A,)", X_B)},
     .workspace = w_additive_score_backward,
     .kernel = k_additive_score_backward},
    {.name = "masked_softmax",
     .args = {ARR(X_SCORES, "(..., T)"), MASK("(..., T)")}, .nreq = 1,
     .order = {X_SCORES}, .outs = {RES(Y_ALPHA, "(..., T)")},
     .kernel = k_masked_softmax},
    {.name = "masked_softmax_backward",
     .args = {ARR(X_GRAD_ALPHA, "(..., T)"), ARR(X_ALPHA, "(..., T)")},
     .nreq = 2, .order = {X_ALPHA}, .outs = {RES(Y_DSCORES, "(..., T)")},
     .kernel = k_masked_softmax_backward},
    {.name = "weighted_sum",
     .args = {ARR(X_ALPHA, "(..., T)"), ARR(X_H, "(..., T, H)")}, .nreq = 2,
     .order = {X_H}, .outs = {RES(Y_OUT, "(..., H)")},
     .kernel = k_weighted_sum},
    {.name = "weighted_sum_backward",
     .args = {ARR(X_GRAD_OUT, "(..., H)"), ARR(X_ALPHA, "(..., T)"),
              ARR(X_H, "(..., T, H)")}, .nreq = 3,
     .order = {X_H},
     .outs = {RES(Y_DALPHA, "(..., T)"), RES(Y_DH, "(..., T, H)")},
     .kernel = k_weighted_sum_backward},
    {.name = "context_attention",
     .args = {ARR(X_H, "(..., T, H)"), W_CONTEXT, ARR(X_V, "(A,)"),
              OPT(X_B, "(A,)"), MASK("(..., T)"),
              FLAG(X_KEEP_ACTIVATIONS)}, .nreq = 3,
     .order = {X_H},
     .outs = {RES(Y_OUT, "(..., H)"), RES(Y_ALPHA, "(..., T)"),
              RES_EXTRA(Y_ACTIVATIONS, "(..., T, A)", X_KEEP_ACTIVATIONS)},
     .fused = 1, .workspace = w_context_attention,
     .kernel = k_context_attention},
    {.name = "context_attention_backward",
     .args = {ARR(X_GRAD_OUT, "(..., H)"), ARR(X_H, "(..., T, H)"),
              W_CONTEXT, ARR(X_V, "(A,)"), ARR(X_ALPHA, "(..., T)"),
              OPT(X_B, "(A,)"), MASK("(..., T)"),
              OPT(X_GRAD_ALPHA, "(..., T)"),
              OPT(X_ACTIVATIONS, "(..., T, A)")},
     .nreq = 5, .order = {X_H},
     .outs = {RES(Y_DH, "(..., T, H)"), RES(Y_DW, "(A, 2*H)"),
              RES(Y_DV, "(A,)"), RES_IF(Y_DB, "(A,)", X_B)},
     .fused = 1, .workspace = w_context_attention_backward,
     .kernel = k_context_attention_backward},
    {.name = "additive_attention",
     .args = {QUERY("Hq"), KEYS, W_ADDITIVE, ARR(X_V, "(A,)"),
              OPT(X_B, "(A,)"), FAMILY_MASK, ATTN_MASK, CAUSAL, VALUES,
              KPROJ("A")}, .nreq = 4,
     .outs = {FAMILY_OUTS}, FAMILY(ATT_SCORE_ADDITIVE)},
    {.name = "additive_attention_backward",
     .args = {GRAD_OUT_Q, QUERY("Hq"), KEYS, W_ADDITIVE, ARR(X_V, "(A,)"),
              ALPHA_Q, OPT(X_B, "(A,)"), FAMILY_MASK, ATTN_MASK, CAUSAL,
              VALUES, GRAD_ALPHA_Q, KPROJ("A"),
              FLAG(X_STOP_AT_KEY_PROJ)}, .nreq = 6,
     .outs = {FAMILY_GRADS("Hq"), RES(Y_DW, "(A, H+Hq)"), RES(Y_DV, "(A,)"),
              RES_IF(Y_DB, "(A,)", X_B),
              {.id = Y_DKEY_PROJ, .shape = "(..., T, A)", .like = X_KEY_PROJ,
               .when = X_STOP_AT_KEY_PROJ, .drop = 1}},
     FAMILY(ATT_SCORE_ADDITIVE)},
    {.name = "dot_attention",
     .args = {QUERY_DOT, KEYS, FAMILY_MASK, ATTN_MASK, CAUSAL, BIAS, DROPOUT,
              SEED, VALUES, SCALE, RETURN_WEIGHTS, VARIANTS}, .nreq = 2,
     .outs = {STREAM_OUTS}, FAMILY(ATT_SCORE_DOT)},
    {.name = "dot_attention_backward",
     .args = {GRAD_OUT_Q, QUERY_DOT, KEYS, ALPHA_OPT, SAVED, FAMILY_MASK,
              ATTN_MASK, CAUSAL, BIAS, DROPOUT, SEED, VALUES, SCALE,
              GRAD_ALPHA_Q, VARIANTS}, .nreq = 3, .npos = 4,
     .outs = {FAMILY_GRADS("H"), DBIAS, VARIANT_GRADS},
     FAMILY(ATT_SCORE_DOT)},
    {.name = "general_attention",
     .args = {QUERY("Hq"), KEYS, W_GENERAL, FAMILY_MASK, ATTN_MASK, CAUSAL,
              BIAS, DROPOUT, SEED, VALUES, KPROJ("Hq"),
              RETURN_WEIGHTS, VARIANTS}, .nreq = 3,
     .outs = {STREAM_OUTS}, FAMILY(ATT_SCORE_GENERAL)},
    {.name = "general_attention_backward",
     .args = {GRAD_OUT_Q, QUERY("Hq"), KEYS, W_GENERAL, ALPHA_OPT, SAVED,
              FAMILY_MASK, ATTN_MASK, CAUSAL, BIAS, DROPOUT, SEED, VALUES,
              GRAD_ALPHA_Q, KPROJ("Hq"), VARIANTS,
              FLAG(X_STOP_AT_KEY_PROJ)}, .nreq = 4, .npos = 5,
     .outs = {FAMILY_GRADS("Hq"), RES(Y_DW, "(Hq, H)"), DBIAS,
              VARIANT_GRADS,
              {.id = Y_DKEY_PROJ, .shape = "(..., T, Hq)", .like = X_KEY_PROJ,
               .when = X_STOP_AT_KEY_PROJ, .drop = 1}},
     FAMILY(ATT_SCORE_GENERAL)},
    {.name = "location_attention",
     .args = {QUERY_LOC, VALUES_LOC, W_LOCATION, B_LOCATION, FAMILY_MASK,
              ATTN_MASK}, .nreq = 3,
     .outs = {FAMILY_OUTS}, LOCATION},
    {.name = "location_attention_backward",
     .args = {GRAD_OUT_Q, QUERY_LOC, VALUES_LOC, W_LOCATION, ALPHA_Q,
              B_LOCATION, FAMILY_MASK, ATTN_MASK, GRAD_ALPHA_Q}, .nreq = 5,
     .outs = {{.id = Y_DQUERY, .shape = "(..., Tq?, Hq)", .like = X_QUERY},
              {.id = Y_DVALUES, .shape = "(..., T, Hv)", .like = X_VALUES},
              RES(Y_DW, "(L, Hq)"), RES_IF(Y_DB, "(L,)", X_B)},
     LOCATION},
    {.name = "cosine_attention",
     .args = {QUERY_DOT, KEYS, FAMILY_MASK, ATTN_MASK, CAUSAL, BIAS, DROPOUT,
              SEED, VALUES, SHARPNESS, RETURN_WEIGHTS, VARIANTS}, .nreq = 2,
     .outs = {STREAM_OUTS}, FAMILY(ATT_SCORE_COSINE)},
    {.name = "cosine_attention_backward",
     .args = {GRAD_OUT_Q, QUERY_DOT, KEYS, ALPHA_OPT, SAVED, FAMILY_MASK,
              ATTN_MASK, CAUSAL, BIAS, DROPOUT, SEED, VALUES, SHARPNESS,
              GRAD_ALPHA_Q, VARIANTS}, .nreq = 3, .npos = 4,
     .outs = {FAMILY_GRADS("H"), DSHARPNESS, DBIAS, VARIANT_GRADS},
     FAMILY(ATT_SCORE_COSINE)},
    {.name = "project_keys",
     .args = {KEYS, ARR(X_W, "(A, L)")}, .nreq = 2,
     .order = {X_KEYS}, .outs = {RES(Y_KEY_PROJ, "(..., T, A)")},
     .fused = 1, .check = check_project, .workspace = w_project,
     .kernel = k_project_keys},
    {.name = "project_keys_backward",
     .args = {ARR(X_GRAD_PROJ, "(..., T, A)"), KEYS, ARR(X_W, "(A, L)")},
     .nreq = 3, .order = {X_KEYS, X_W},
     .outs = {RES(Y_DKEYS, "(..., T, H)"), RES(Y_DW, "(A, L)")},
     .fused = 1, .check = check_project, .workspace = w_project,
     .kernel = k_project_keys_backward},
};

#define N_FUNCS ((int)(sizeof(funcs) / sizeof(funcs[0])))
const int n_funcs = N_FUNCS;
