/*
 * args.h - the vocabulary of the binding's table: every argument and every
 * output of the public functions, each one entry of an X-macro list from
 * which their ids (X_..., Y_...), names and kinds are generated.  Adding
 * an argument is one line here (then its place in the rows, table.c).
 *
 * An argument's kind is what it is wherever it appears (a mask, a flag, a
 * number); whether it is required, positional, and its shape pattern are
 * a row's.  The kind also gives an optional argument's default in the
 * signature: a flag False (K_TRUE: True), a number 0.0, the others None.
 * The module hands the whole table to Python (_core._table()), from which
 * attention_c derives the gradients' named tuples and attention_c.testing
 * its SIGNATURES.
 */
#ifndef ATTENTION_C_PYTHON_ARGS_H
#define ATTENTION_C_PYTHON_ARGS_H

/* Kinds of arguments (ArgSpec.flags, with the row's F_OPT, F_VIEW, ...) */
#define F_OPT 1u       /* may be None or left out */
#define F_MASK 2u      /* a boolean mask, not a floating input */
#define F_FLAG 4u      /* a truth value, not an array */
#define F_SCALE 8u     /* a real number or None, not an array */
#define F_BCAST 16u    /* leading axes of size 1 broadcast (family masks) */
#define F_VIEW 32u     /* read where it is: broadcast to its pattern by
                          NumPy's rules, never copied to that shape */
#define F_TRUE 64u     /* with F_FLAG: True when left out */
#define F_NUMBER 128u  /* a real number, 0 when left out */
#define F_SEED 256u    /* an integer in [0, 2**64), or None */
#define F_LEADB 512u   /* the family's inputs: leading axes broadcast
                          against each other (missing or 1) */
#define F_WINDOW 1024u /* a pair (left, right) of ints >= 0 or None, or
                          None: a value, not an array */
#define F_INDEX 2048u  /* an integer array (int64 once checked), never
                          cast to the call's floating dtype */
#define F_FOLLOW 4096u /* cast to the call's dtype, never choosing it */
#define F_NUMARR 8192u /* an array, or a real number (Python's int or
                          float): finite, a constant without gradient */

/* The kinds of the list below: a value, not an array, is always optional */
#define K_ARRAY 0u
#define K_MASK F_MASK
#define K_FLAG (F_FLAG | F_OPT)
#define K_TRUE (F_FLAG | F_TRUE | F_OPT)
#define K_NUMBER (F_NUMBER | F_OPT)
#define K_SEED (F_SEED | F_OPT)
#define K_SCALE (F_SCALE | F_OPT)
#define K_WINDOW (F_WINDOW | F_OPT)
#define K_INDEX F_INDEX
#define K_NUMARR F_NUMARR

/* X(ID, name, kind): the arguments, X_ID = "name" */
#define ATT_ARGS(X)                                                          \
    X(H, h, K_ARRAY)                                                         \
    X(MASK, mask, K_MASK)                                                    \
    X(GRAD_C, grad_c, K_ARRAY)                                               \
    X(CONTEXT, context, K_ARRAY)                                             \
    X(W, W, K_ARRAY)                                                         \
    X(V, v, K_ARRAY)                                                         \
    X(B, b, K_ARRAY)                                                         \
    X(GRAD_S, grad_s, K_ARRAY)                                               \
    X(SCORES, scores, K_ARRAY)                                               \
    X(GRAD_ALPHA, grad_alpha, K_ARRAY)                                       \
    X(ALPHA, alpha, K_ARRAY)                                                 \
    X(GRAD_OUT, grad_out, K_ARRAY)                                           \
    X(KEEP_ACTIVATIONS, keep_activations, K_FLAG)                            \
    X(ACTIVATIONS, activations, K_ARRAY)                                     \
    X(QUERY, query, K_ARRAY)                                                 \
    X(KEYS, keys, K_ARRAY)                                                   \
    X(VALUES, values, K_ARRAY)                                               \
    X(KEY_PROJ, key_proj, K_ARRAY)                                           \
    X(SCALE, scale, K_SCALE)                                                 \
    X(STOP_AT_KEY_PROJ, stop_at_key_proj, K_FLAG)                            \
    X(GRAD_PROJ, grad_proj, K_ARRAY)                                         \
    X(ATTN_MASK, attn_mask, K_MASK)                                          \
    X(CAUSAL, causal, K_FLAG)                                                \
    X(BIAS, bias, K_ARRAY)                                                   \
    X(DROPOUT, dropout, K_NUMBER)                                            \
    X(SEED, seed, K_SEED)                                                    \
    X(RETURN_WEIGHTS, return_weights, K_TRUE)                                \
    X(OUT, out, K_ARRAY)                                                     \
    X(LSE, lse, K_ARRAY)                                                     \
    X(WINDOW, window, K_WINDOW)                                              \
    X(SOFTCAP, softcap, K_SCALE)                                             \
    X(ALIBI_SLOPES, alibi_slopes, K_ARRAY)                                   \
    X(SINKS, sinks, K_ARRAY)                                                 \
    X(CU_SEQLENS_Q, cu_seqlens_q, K_INDEX)                                   \
    X(CU_SEQLENS_K, cu_seqlens_k, K_INDEX)                                   \
    X(SHARPNESS, sharpness, K_NUMARR)

/* Y(ID, name): the outputs, Y_ID = "name".  A backward's gradient of
 * argument x is named "d" + x: its field x in the named tuple. */
#define ATT_OUTS(Y)                                                          \
    Y(C, c)                                                                  \
    Y(DH, dh)                                                                \
    Y(S, s)                                                                  \
    Y(DCONTEXT, dcontext)                                                    \
    Y(DW, dW)                                                                \
    Y(DV, dv)                                                                \
    Y(DB, db)                                                                \
    Y(ALPHA, alpha)                                                          \
    Y(DSCORES, dscores)                                                      \
    Y(OUT, out)                                                              \
    Y(DALPHA, dalpha)                                                        \
    Y(ACTIVATIONS, activations)                                              \
    Y(DQUERY, dquery)                                                        \
    Y(DKEYS, dkeys)                                                          \
    Y(DVALUES, dvalues)                                                      \
    Y(DKEY_PROJ, dkey_proj)                                                  \
    Y(KEY_PROJ, key_proj)                                                    \
    Y(LSE, lse)                                                              \
    Y(DBIAS, dbias)                                                          \
    Y(DALIBI_SLOPES, dalibi_slopes)                                          \
    Y(DSINKS, dsinks)                                                        \
    Y(DSHARPNESS, dsharpness)

/* X_NONE (0) ends a row's argument list, so that a row's unused entries,
 * zeroed, need no end marker. */
#define ATT_ARG_ID(ID, name, kind) X_##ID,
enum { X_NONE, ATT_ARGS(ATT_ARG_ID) N_ARG_IDS };
#undef ATT_ARG_ID

#define ATT_OUT_ID(ID, name) Y_##ID,
enum { ATT_OUTS(ATT_OUT_ID) N_OUT_IDS };
#undef ATT_OUT_ID

#endif /* ATTENTION_C_PYTHON_ARGS_H */
