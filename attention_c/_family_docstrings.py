"""The docstrings of the attention family's C functions (and of the keys'
projection) and of their gradients' named tuples, as ``_docstrings`` has
the layer's.  Pieces shared by several docstrings (``{shapes}``,
``{masks}``, ...) are written once, in ``_PIECES``, and substituted.
"""

DOCS: dict[str, str] = {}
GRADS_DOCS: dict[str, str] = {}

# --------------------------------------------------------------------------
# The attention family (docs/contract.md sections 4 and 5): a query scored
# against keys, masked softmax, weighted sum of values; for the dot and
# general scores also a float bias, dropout and a streamed path that never
# forms the weights.

GRADS_DOCS["AdditiveAttentionGrads"] = """\
Gradients returned by
:func:`additive_attention_backward`.

Attributes
----------
query : ndarray, the shape of ``query``
keys : ndarray (..., T, H)
    Includes the values' share when the keys are the values.
values : ndarray (..., T, Hv), or None when no values were given
W : ndarray (A, H + Hq), summed over the batch and the queries
v : ndarray (A,), summed likewise
b : ndarray (A,) summed likewise, or None when no bias was given

Examples
--------
>>> import numpy as np, attention_c as ac
>>> rng = np.random.default_rng(0)
>>> q, k = rng.standard_normal((2, 3)), rng.standard_normal((2, 7, 4))
>>> W, v = rng.standard_normal((5, 7)), rng.standard_normal(5)
>>> out, alpha = ac.additive_attention(q, k, W, v)
>>> g = ac.additive_attention_backward(np.ones_like(out), q, k, W, v, alpha)
>>> g._fields
('query', 'keys', 'values', 'W', 'v', 'b')
>>> g.query.shape, g.keys.shape, g.values, g.W.shape, g.b
((2, 3), (2, 7, 4), None, (5, 7), None)
"""

GRADS_DOCS["DotAttentionGrads"] = """\
Gradients returned by
:func:`dot_attention_backward`.

Attributes
----------
query : ndarray, the shape of ``query``
keys : ndarray (..., T, H)
    Includes the values' share when the keys are the values.
values : ndarray (..., T, Hv), or None when no values were given
bias : ndarray, the shape of ``bias``, or None when no bias was given
    ``dL/ds``, summed over the axes along which the bias was broadcast;
    0 where a key was invisible.

Examples
--------
>>> import numpy as np, attention_c as ac
>>> rng = np.random.default_rng(0)
>>> q, k = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 7, 4))
>>> vals = rng.standard_normal((2, 7, 5))
>>> bias = np.zeros((3, 7))                     # shared by both sequences
>>> out, alpha = ac.dot_attention(q, k, values=vals, bias=bias)
>>> g = ac.dot_attention_backward(np.ones_like(out), q, k, alpha,
...                               values=vals, bias=bias)
>>> g._fields
('query', 'keys', 'values', 'bias')
>>> g.query.shape, g.keys.shape, g.values.shape, g.bias.shape
((2, 3, 4), (2, 7, 4), (2, 7, 5), (3, 7))
"""

GRADS_DOCS["GeneralAttentionGrads"] = """\
Gradients returned by
:func:`general_attention_backward`.

Attributes
----------
query : ndarray, the shape of ``query``
keys : ndarray (..., T, H)
    Includes the values' share when the keys are the values.
values : ndarray (..., T, Hv), or None when no values were given
W : ndarray (Hq, H), summed over the batch and the queries
bias : ndarray, the shape of ``bias``, or None when no bias was given
    Summed over the axes along which the bias was broadcast.

Examples
--------
>>> import numpy as np, attention_c as ac
>>> rng = np.random.default_rng(0)
>>> q, k = rng.standard_normal((2, 3)), rng.standard_normal((2, 7, 4))
>>> W = rng.standard_normal((3, 4))
>>> out, alpha = ac.general_attention(q, k, W)
>>> g = ac.general_attention_backward(np.ones_like(out), q, k, W, alpha)
>>> g._fields
('query', 'keys', 'values', 'W', 'bias')
>>> g.query.shape, g.keys.shape, g.values, g.W.shape, g.bias
((2, 3), (2, 7, 4), None, (3, 4), None)
"""

# Pieces shared by the family's docstrings, substituted below.
_PIECES = {}

_PIECES["shapes"] = """
    Shapes (any leading batch axes ``...``; heads are one more of them):

    - ``query``: (..., Hq) for one query per sequence, or (..., Tq, Hq) for
      several (when ``query.ndim == keys.ndim``);
    - ``keys``: (..., T, H); ``values``: (..., T, Hv), default the keys;
    - ``alpha``: (..., T) or (..., Tq, T); ``out``: (..., Hv) or
      (..., Tq, Hv).

    The keys a query sees are those allowed by all of ``mask`` (per key),
    ``attn_mask`` (per query and key) and ``causal``.  Invisible keys get
    exactly 0 weight and 0 gradient; a query with no visible key gets
    ``alpha = 0``, ``out = 0`` and zero gradients (never NaN, nor the
    uniform weights of some libraries).  Keys invisible to every query,
    and queries with no visible key, are padding: a NaN there reaches no
    result.  Masks (and ``bias``) broadcast against the leading axes of
    ``query`` and ``keys`` by NumPy rules and are read in place: one
    (Tq, T) mask serves every sequence and head without a copy.
"""

_PIECES["masks"] = """\
    mask : array_like of bool (..., T), optional
        The key mask, the same for every query: True = valid key.  This is
        its only form; a mask with a query axis, (..., Tq, T), is refused
        (ValueError): pass it as ``attn_mask``.
    attn_mask : array_like of bool, optional
        A mask per query, broadcastable by NumPy rules to (..., Tq, T):
        True = query i may attend to key t.  ``np.tril(np.ones((Tq, T),
        bool))`` serves any batch shape.  Only with several queries.  It
        must be boolean: for a float mask use ``bias``.  The boolean masks
        of ``nn.MultiheadAttention`` mean True = masked, the opposite of
        ours (pass ``~m``); ``F.scaled_dot_product_attention``'s mean True
        = take part, as ours.
    causal : bool, optional
        Key t is visible to query i iff ``t <= i + (T - Tq)``, aligned at
        the bottom right: ``np.tril`` when Tq == T, and Tq new queries
        appended to a cache of T - Tq keys see the whole cache.  No mask
        array is formed.  Only with several queries.  Default False.
"""

_PIECES["bias_dropout"] = """\
    bias : array_like of float, optional
        Broadcastable to (..., Tq, T) ((..., T) for one query per
        sequence): added to the scores (after ``scale``) before the
        softmax, e.g. ALiBi, relative positions, or PyTorch's float
        ``attn_mask``.  ``-inf`` is allowed and hides the key; a query
        whose visible keys all have ``-inf`` has no visible key.
    dropout : float, optional
        Rate p, 0 <= p < 1, of dropout on the weights:
        ``out_i = sum_t alpha_it keep_it / (1 - p) val_t``.  The returned
        ``alpha`` is the weights before dropout.  Default 0.
    seed : int, optional
        0 <= seed < 2**64; required when ``dropout > 0``.  ``keep_it`` is
        a function of (seed, sequence, i, t) only (see Notes): the same
        for any thread count, regenerated by the backward, never stored.
"""

_PIECES["return_weights"] = """\
    return_weights : bool, optional
        Default True: return the weights ``alpha``.  False: return
        ``lse`` instead, and never form the (..., Tq, T) weights (keys
        are streamed block by block with an online softmax; the memory is
        ``lse`` plus a few blocks per thread).  The results agree within
        rounding.
"""

_PIECES["variants"] = """\
    window : (int or None, int or None), optional
        ``(left, right)``: key t is visible to query i iff
        ``i' - left <= t <= i' + right`` with ``i' = i + (T - Tq)``; a
        side of None is unbounded; with ``causal`` the right side is 0.
        Only with several queries.  Blocks of keys outside every query's
        window are never computed on the streamed path (a window of w
        keys costs O(Tq w d)).  Default None.
    softcap : float, optional
        c > 0: the scaled score ``s`` becomes ``c tanh(s / c)`` before
        the bias and the masks.  Default None.
    alibi_slopes : array_like of float, optional
        One slope per sequence, broadcastable to the leading axes of
        ``out`` (without Tq and the feature axis; read in place, never
        expanded): ``-slope |i' - t|`` is added to the score, after
        ``softcap``, with the bias.  Default None.
    sinks : array_like of float, optional
        One extra logit per sequence (same broadcasting), without a
        value: ``lse_i = log(exp(sink) + sum_t exp(s_it))`` over the
        visible keys, so the weights sum to less than 1; a query with no
        visible key gets ``out = 0`` and ``lse = sink``.  The backward
        needs ``out=`` and ``lse=`` (not ``alpha``).  Default None.
    cu_seqlens_q, cu_seqlens_k : array_like of int (n + 1,), optional
        Packed sequences: the Tq axis holds n segments of queries back to
        back, the T axis n segments of keys; ``cu_seqlens_q[s]`` is the
        start of query segment s (0 first, Tq last, never decreasing),
        likewise for the keys.  A query sees only the keys of its segment,
        and the alignment ``i'``, ``causal`` and ``window`` are per
        segment.  Both or neither; only with several queries.
"""

_PIECES["returns"] = """\
    Returns
    -------
    out : ndarray (..., Hv) or (..., Tq, Hv)
    alpha : ndarray (..., T) or (..., Tq, T)
        With ``return_weights=True``: the weights, before dropout.
    lse : ndarray (...) or (..., Tq)
        With ``return_weights=False``, in place of ``alpha``:
        ``lse_i = log sum_t exp(s_it)`` over the visible keys (scale and
        bias included), ``-inf`` for a query with no visible key.  Give
        it with ``out`` to the backward.
"""

_PIECES["philox"] = """\
    Notes
    -----
    Dropout keeps key t for query i of the sequence of flat index b (the
    row-major index in the broadcast leading shape of ``out``) when
    ``u >= floor(p 2**32)``, with u the word ``t & 3`` of Philox4x32-10
    (Salmon et al. 2011, as in Random123 and cuRAND) on the counter
    ``(t >> 2, i, b mod 2**32, b >> 32)`` with the key
    ``(seed mod 2**32, seed >> 32)``; i = 0 for one query per sequence.
    The pattern depends on nothing else (not the threads, the blocking,
    the SIMD path or the dtype), so a run is reproducible from its seed,
    and ``attention_c.reference.dropout_keep(seed, p, b, Tq, T)`` gives
    the same bits in NumPy.
"""

_PIECES["backward_state"] = """\
    alpha : array_like, the forward's ``alpha``, optional
        The weights of a ``return_weights=True`` forward.  Either
        ``alpha`` or ``out=`` and ``lse=``.
    out : array_like, the shape of ``out``, optional
        The forward's ``out``, with ``lse``: the backward recomputes the
        weights block by block, ``P_it = exp(s_it - lse_i)``, and never
        forms the (..., Tq, T) weights.
    lse : array_like, optional
        The ``lse`` of a ``return_weights=False`` forward; needs ``out``,
        and refuses ``alpha`` and ``grad_alpha``.
"""

_PIECES["backward_args"] = """\
    mask, attn_mask, causal, bias, dropout, seed
        As given to the forward: the same seed regenerates the same keep
        pattern.
    window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k
        As given to the forward.  Through ``softcap`` the gradient of the
        raw score is ``delta_it (1 - (capped_it / softcap)**2)``, the
        capped score recomputed.  The gradients of ``alibi_slopes``
        (``sum_it delta_it (-|i' - t|)``) and ``sinks``
        (``-sum_i exp(sink - lse_i) D_i``) are the last two fields of
        the result, summed back to their shapes (None when not given).
    grad_alpha : array_like, the shape of ``alpha``, optional
        Gradient of the loss with respect to ``alpha``; only with
        ``alpha``.
"""

_PIECES["backward_formulas"] = """
    With ``g_i = dL/dout_i``, ``P_it`` the weights (``alpha``, or
    ``exp(s_it - lse_i)`` on the visible keys, recomputed from ``lse``),
    ``gamma_it = (g_i . val_t) keep_it / (1 - p) (+ grad_alpha_it)`` and
    ``D_i = g_i . out_i`` (given ``out``) or ``sum_t P_it gamma_it``
    (given ``alpha``): ``delta_it = dL/ds_it = P_it (gamma_it - D_i)``,
    ``dval_t = sum_i P_it keep_it / (1 - p) g_i``, and ``dbias`` is
    ``delta`` summed back to the shape of ``bias``.
"""


DOCS["additive_attention"] = """\
Additive (Bahdanau, Luong "concat") attention of queries over keys.

    ``s_it = v . tanh(W_k k_t + W_q q_i + b)``, ``alpha_i = masked
    softmax of s_i``, ``out_i = sum_t alpha_it val_t``, with
    ``W = [W_k | W_q]``.  ``W_k k_t`` is computed once per key and
    ``W_q q_i + b`` once per query; the (..., Tq, T, A) activations are
    streamed, never stored.  The additive score takes no ``bias``,
    ``dropout`` or ``return_weights`` (those are for the dot and general
    scores).
    {shapes}
    Parameters
    ----------
    query : array_like (..., Hq) or (..., Tq, Hq)
    keys : array_like (..., T, H)
    W : array_like (A, H + Hq)
        Layout of ``torch.nn.Linear(H + Hq, A).weight`` applied to
        ``[k_t; q_i]``: ``W[:, :H]`` multiplies the key, ``W[:, H:]`` the
        query.
    v : array_like (A,)
    b : array_like (A,), optional
        The bias of the hidden layer (not a bias of the scores).
{masks}\
    values : array_like (..., T, Hv), optional
        Default: the keys.
    key_proj : array_like (..., T, A), optional
        ``project_keys(keys, W)``, computed once per sequence: a decoder
        that attends to the same keys at every output step passes it to
        skip projecting them again.  Results are the same as without it.

    Returns
    -------
    out : ndarray (..., Hv) or (..., Tq, Hv)
    alpha : ndarray (..., T) or (..., Tq, T)

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> keys = rng.standard_normal((2, 7, 4))        # B=2, T=7, H=4
    >>> query = rng.standard_normal((2, 3))          # one query, Hq=3
    >>> W = rng.standard_normal((5, 4 + 3)); v = rng.standard_normal(5)
    >>> out, alpha = ac.additive_attention(query, keys, W, v)
    >>> out.shape, alpha.shape
    ((2, 4), (2, 7))

    Self-attention with a causal mask, and keys 5 and 6 of the second
    sequence padding:

    >>> x = rng.standard_normal((2, 7, 4))
    >>> W = rng.standard_normal((5, 4 + 4))
    >>> lengths = np.array([[7], [5]])
    >>> out, alpha = ac.additive_attention(x, x, W, v, causal=True,
    ...                                    mask=np.arange(7) < lengths)
    >>> bool(alpha[0, 2, 3:].any()), bool(alpha[1, 6, 5:].any())
    (False, False)
    """


DOCS["additive_attention_backward"] = """\
Gradients of :func:`additive_attention` in one call.

    ``delta_it = alpha_it (gamma_it - sum_j alpha_ij gamma_ij)`` with
    ``gamma_it = g_i . val_t + ga_it``; ``eps_it = delta_it v (1 -
    u_it^2)``; then ``dv = sum delta_it u_it``, ``db = sum eps_it``,
    ``dW_k = sum_t (sum_i eps_it) k_t^T``, ``dW_q = sum_i (sum_t eps_it)
    q_i^T``, ``dk_t = W_k^T sum_i eps_it (+ sum_i alpha_it g_i)``,
    ``dq_i = W_q^T sum_t eps_it``.

    Parameters
    ----------
    grad_out : array_like, the shape of ``out``
    query, keys, W, v, b, mask, attn_mask, causal, values, key_proj
        As given to :func:`additive_attention`.
    alpha : array_like, the shape of the forward's ``alpha``
    grad_alpha : array_like, the shape of ``alpha``, optional
        Gradient of the loss with respect to ``alpha``, if it uses it.
    stop_at_key_proj : bool, optional
        With ``key_proj``: stop the gradient there (see Notes).

    Returns
    -------
    AdditiveAttentionGrads
        ``(query, keys, values, W, v, b)``; ``values`` is None when no
        values were given, ``b`` when no bias was.
    grad_key_proj : ndarray (..., T, A)
        Only with ``stop_at_key_proj=True``: the gradient of ``key_proj``.

    Notes
    -----
    A decoder loop attends to the same keys at every step.  With
    ``stop_at_key_proj=True`` each step's backward stops at ``key_proj``:
    it returns ``(grads, grad_key_proj)``, and ``grads.keys`` and
    ``grads.W`` leave out the projection's share (``keys`` keeps only the
    values' share, ``W[:, :H]`` is 0).  Sum ``grad_key_proj`` over the
    steps and call :func:`project_keys_backward` once per sequence: the
    keys' products then run once per sequence in both directions, as
    autograd does them in PyTorch.

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> keys = rng.standard_normal((2, 7, 4))        # B=2, T=7, H=4
    >>> W, v = rng.standard_normal((5, 4 + 3)), rng.standard_normal(5)
    >>> kp = ac.project_keys(keys, W)                # once per sequence
    >>> total = np.zeros_like(kp)
    >>> grad_q = []
    >>> for step in range(3):                        # a decoder loop
    ...     state = rng.standard_normal((2, 3))
    ...     out, alpha = ac.additive_attention(state, keys, W, v, key_proj=kp)
    ...     grads, gkp = ac.additive_attention_backward(
    ...         np.ones_like(out), state, keys, W, v, alpha, key_proj=kp,
    ...         stop_at_key_proj=True)
    ...     total += gkp
    ...     grad_q.append(grads.query)
    >>> dkeys, dW = ac.project_keys_backward(total, keys, W)   # once
    >>> dkeys.shape, dW.shape, grad_q[0].shape
    ((2, 7, 4), (5, 7), (2, 3))

    With a causal mask, a query's gradient has no share of later keys:

    >>> x = rng.standard_normal((2, 7, 4)); W = rng.standard_normal((5, 8))
    >>> out, alpha = ac.additive_attention(x, x, W, v, causal=True)
    >>> g = ac.additive_attention_backward(np.ones_like(out), x, x, W, v,
    ...                                    alpha, causal=True)
    >>> g.query.shape, g.W.shape
    ((2, 7, 4), (5, 8))
    """


DOCS["dot_attention"] = """\
Dot-product (Luong "dot", scaled dot) attention, self-attention at scale.

    ``s_it = scale q_i . k_t + bias_it`` (Hq = H), ``alpha_i = masked
    softmax of s_i``, ``out_i = sum_t alpha_it val_t``.  With several
    queries the scores and the weighted sum are matrix products
    (``Q K^T``, ``alpha V``) on the blocked product core; with
    ``return_weights=False`` they are streamed block by block (online
    softmax, as FlashAttention), and with ``causal`` the blocks that no
    query can see are skipped.
    {shapes}
    Parameters
    ----------
    query : array_like (..., H) or (..., Tq, H)
    keys : array_like (..., T, H)
{masks}{bias_dropout}\
    values : array_like (..., T, Hv), optional
        Default: the keys.
    scale : float, optional
        Default ``1/sqrt(H)``, as ``torch.nn.functional.
        scaled_dot_product_attention``; 1 gives Luong's "dot".
{return_weights}{variants}
{returns}
{philox}
    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> x = np.random.default_rng(0).standard_normal((4, 6, 8))  # B, T, H
    >>> out, alpha = ac.dot_attention(x, x, causal=True)   # self-attention
    >>> out.shape, bool(alpha[0, 0, 1] == 0)
    ((4, 6, 8), True)
    >>> tril = np.tril(np.ones((6, 6), bool))     # (Tq, T) for every batch
    >>> bool(np.allclose(ac.dot_attention(x, x, attn_mask=tril)[0], out))
    True

    The streamed path gives ``lse`` instead of the weights:

    >>> out2, lse = ac.dot_attention(x, x, causal=True, return_weights=False)
    >>> lse.shape, bool(np.allclose(out2, out))
    ((4, 6), True)

    ``causal`` is aligned at the bottom right: the last 2 queries against
    all 6 keys (a decoder step with a cache) see 5 and 6 keys:

    >>> _, a = ac.dot_attention(x[:, 4:], x, causal=True)
    >>> (a[0] > 0).sum(axis=-1)
    array([5, 6])

    A float bias (here a linear distance penalty, as ALiBi); ``-inf``
    hides a key:

    >>> i = np.arange(6)
    >>> bias = -0.5 * np.abs(i[:, None] - i[None, :])
    >>> bias[:, 0] = -np.inf                             # key 0 for nobody
    >>> _, a = ac.dot_attention(x, x, bias=bias)
    >>> bool((a[..., 0] == 0).all())
    True

    Dropout is a function of its seed:

    >>> o1, _ = ac.dot_attention(x, x, dropout=0.1, seed=42)
    >>> o2, _ = ac.dot_attention(x, x, dropout=0.1, seed=42)
    >>> bool((o1 == o2).all())
    True
    """


DOCS["dot_attention_backward"] = """\
Gradients of :func:`dot_attention` in one call.

    ``dq_i = scale sum_t delta_it k_t``, ``dk_t = scale sum_i delta_it
    q_i (+ dval_t when the values are the keys)``.
{backward_formulas}
    Parameters
    ----------
    grad_out : array_like, the shape of ``out``
    query, keys
        As given to :func:`dot_attention`.
{backward_state}{backward_args}\
    values, scale
        As given to the forward.

    Returns
    -------
    DotAttentionGrads
        ``(query, keys, values, bias)``; ``values`` is None when no values
        were given, ``bias`` when no bias was.

    Examples
    --------
    From the streamed forward (``out`` and ``lse``), with a bias shared
    by the batch, whose gradient is summed over it:

    >>> import numpy as np, attention_c as ac
    >>> x = np.random.default_rng(0).standard_normal((4, 6, 8))
    >>> bias = np.zeros((6, 6))
    >>> out, lse = ac.dot_attention(x, x, causal=True, bias=bias,
    ...                             return_weights=False)
    >>> g = ac.dot_attention_backward(np.ones_like(out), x, x, out=out,
    ...                               lse=lse, causal=True, bias=bias)
    >>> g.query.shape, g.keys.shape, g.values, g.bias.shape
    ((4, 6, 8), (4, 6, 8), None, (6, 6))

    From the weights, the same gradients within rounding:

    >>> out, alpha = ac.dot_attention(x, x, causal=True, bias=bias)
    >>> g2 = ac.dot_attention_backward(np.ones_like(out), x, x, alpha,
    ...                                causal=True, bias=bias)
    >>> bool(np.allclose(g.query, g2.query) and np.allclose(g.bias, g2.bias))
    True
    """


DOCS["general_attention"] = """\
General (Luong "general", bilinear) attention.

    ``s_it = q_i . (W_a k_t) + bias_it``, ``alpha_i = masked softmax of
    s_i``, ``out_i = sum_t alpha_it val_t``.  ``W_a k_t`` is computed once
    per key; the rest runs as :func:`dot_attention` with ``scale = 1``
    (matrix products, or the streamed path with ``return_weights=False``).
    {shapes}
    Parameters
    ----------
    query : array_like (..., Hq) or (..., Tq, Hq)
    keys : array_like (..., T, H)
    W : array_like (Hq, H)
        ``W_a``, the layout of ``torch.nn.Linear(H, Hq, bias=False)
        .weight`` applied to the keys.
{masks}{bias_dropout}\
    values : array_like (..., T, Hv), optional
        Default: the keys.
    key_proj : array_like (..., T, Hq), optional
        ``project_keys(keys, W)``, computed once per sequence (see
        :func:`additive_attention`).  Results are the same as without it.
{return_weights}{variants}
{returns}
    Notes
    -----
    Dropout draws the same keep bits as :func:`dot_attention` (see its
    Notes and ``attention_c.reference.dropout_keep``).

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> query = rng.standard_normal((2, 5, 3))      # B=2, Tq=5 queries, Hq=3
    >>> keys = rng.standard_normal((2, 7, 4))       # T=7 keys, H=4
    >>> W = rng.standard_normal((3, 4))             # W_a (Hq, H)
    >>> mask = np.arange(7) < np.array([[7], [4]])  # keys per sequence
    >>> out, alpha = ac.general_attention(query, keys, W, mask=mask)
    >>> out.shape, alpha.shape, bool((alpha[1, :, 4:] == 0).all())
    ((2, 5, 4), (2, 5, 7), True)
    >>> out2, lse = ac.general_attention(query, keys, W, mask=mask,
    ...                                  causal=True, return_weights=False)
    >>> lse.shape
    (2, 5)
    """


DOCS["general_attention_backward"] = """\
Gradients of :func:`general_attention` in one call.

    ``dq_i = W_a sum_t delta_it k_t``, ``dk_t = W_a^T sum_i delta_it q_i
    (+ dval_t when the values are the keys)``, ``dW_a = sum_it delta_it
    q_i k_t^T``.
{backward_formulas}
    Parameters
    ----------
    grad_out : array_like, the shape of ``out``
    query, keys, W
        As given to :func:`general_attention`.
{backward_state}{backward_args}\
    values, key_proj
        As given to the forward.
    stop_at_key_proj : bool, optional
        With ``key_proj``: stop the gradient there and also return it, as
        in :func:`additive_attention_backward`.

    Returns
    -------
    GeneralAttentionGrads
        ``(query, keys, values, W, bias)``; ``values`` is None when no
        values were given, ``bias`` when no bias was.
    grad_key_proj : ndarray (..., T, Hq)
        Only with ``stop_at_key_proj=True``.

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> query = rng.standard_normal((2, 3))
    >>> keys = rng.standard_normal((2, 7, 4))
    >>> W = rng.standard_normal((3, 4))
    >>> out, alpha = ac.general_attention(query, keys, W)
    >>> g = ac.general_attention_backward(np.ones_like(out), query, keys, W,
    ...                                   alpha)
    >>> g.query.shape, g.keys.shape, g.W.shape, g.bias
    ((2, 3), (2, 7, 4), (3, 4), None)

    Self-attention with dropout, streamed both ways (the backward
    regenerates the keep pattern from the seed):

    >>> x = rng.standard_normal((2, 6, 4)); W = rng.standard_normal((4, 4))
    >>> out, lse = ac.general_attention(x, x, W, causal=True, dropout=0.1,
    ...                                 seed=7, return_weights=False)
    >>> g = ac.general_attention_backward(
    ...     np.ones_like(out), x, x, W, out=out, lse=lse, causal=True,
    ...     dropout=0.1, seed=7)
    >>> g.query.shape, g.W.shape
    ((2, 6, 4), (4, 4))
    """


DOCS["project_keys"] = """\
The keys' side of a score, once per key: ``keys @ W[:, :H].T``.

    For the additive score (``W = [W_k | W_q]``, (A, H + Hq)) this is
    ``W_k k_t`` (..., T, A); for the general score (``W = W_a``, (Hq, H))
    it is ``W_a k_t`` (..., T, Hq).  A decoder loop that attends to the
    same keys at every step computes it once per sequence and passes it as
    ``key_proj=``.

    Parameters
    ----------
    keys : array_like (..., T, H)
    W : array_like (P, L), L >= H
        Only its first H columns are used.

    Returns
    -------
    key_proj : ndarray (..., T, P)

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> keys = rng.standard_normal((2, 7, 4)); W = rng.standard_normal((5, 7))
    >>> v = rng.standard_normal(5)
    >>> kp = ac.project_keys(keys, W)                 # once per sequence
    >>> for step in range(3):                         # a decoder loop
    ...     state = rng.standard_normal((2, 3))
    ...     out, alpha = ac.additive_attention(state, keys, W, v, key_proj=kp)
    >>> out.shape
    (2, 4)
    """


DOCS["project_keys_backward"] = """\
Backward of :func:`project_keys`.

    Parameters
    ----------
    grad_proj : array_like (..., T, P)
    keys : array_like (..., T, H)
    W : array_like (P, L)

    Returns
    -------
    dkeys : ndarray (..., T, H)
        ``grad_proj @ W[:, :H]``.
    dW : ndarray (P, L)
        ``sum_t grad_t k_t^T`` in the first H columns, 0 in the others.

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> keys, W = rng.standard_normal((2, 7, 4)), rng.standard_normal((5, 7))
    >>> kp = ac.project_keys(keys, W)                 # (2, 7, 5)
    >>> dkeys, dW = ac.project_keys_backward(np.ones_like(kp), keys, W)
    >>> dkeys.shape, dW.shape, bool((dW[:, 4:] == 0).all())
    ((2, 7, 4), (5, 7), True)
    """


# The family's docstrings with their shared pieces.
for _name in ("additive_attention", "additive_attention_backward",
              "dot_attention", "dot_attention_backward",
              "general_attention", "general_attention_backward"):
    for _key, _text in _PIECES.items():
        DOCS[_name] = DOCS[_name].replace("{" + _key + "}", _text)
del _name, _key, _text
