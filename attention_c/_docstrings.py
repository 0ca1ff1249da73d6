"""The docstrings of attention_c's C functions and of their gradients'
named tuples, attached at import by ``attention_c._functions``: here the
context-pooled layer's, in ``_family_docstrings`` the attention family's.

The public functions are the C functions of ``attention_c._core``
themselves (their signatures come from the binding's table), so their
docstrings are written here, as NumPy writes its C functions' in
``numpy/_core/_add_newdocs.py``.  ``DOCS[name]`` is the docstring of
``attention_c.<name>``; ``GRADS_DOCS[name]`` the one of a backward's named
tuple.
"""

DOCS: dict[str, str] = {}
GRADS_DOCS: dict[str, str] = {}

GRADS_DOCS["AttentionGrads"] = """\
Gradients of the loss with respect to the layer's
inputs, returned by :func:`context_attention_backward`.

Attributes
----------
h : ndarray (..., T, H)
W : ndarray (A, 2H), summed over the batch
v : ndarray (A,), summed over the batch
b : ndarray (A,) summed over the batch, or None when no bias was given

Examples
--------
>>> import numpy as np, attention_c as ac
>>> rng = np.random.default_rng(0)
>>> h = rng.standard_normal((2, 5, 4))
>>> W, v = rng.standard_normal((3, 8)), rng.standard_normal(3)
>>> out, alpha = ac.context_attention(h, W, v)
>>> g = ac.context_attention_backward(np.ones_like(out), h, W, v, alpha)
>>> g.h.shape, g.W.shape, g.v.shape, g.b
((2, 5, 4), (3, 8), (3,), None)
"""


DOCS["mean_context"] = """\
Mean of the valid items of each sequence.

    ``c = (1/n) sum_t m_t h_t`` with ``n = sum_t m_t``; ``c = 0`` when n = 0.
    Masked items are left out of the sum (a NaN in padding does not matter).

    Parameters
    ----------
    h : array_like (..., T, H)
        States, one row per item.
    mask : array_like of bool (..., T), optional
        True marks a valid item.  Default: all items valid.

    Returns
    -------
    c : ndarray (..., H)

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> h = np.arange(12.0).reshape(2, 3, 2)          # B=2, T=3, H=2
    >>> mask = np.array([[True, True, False], [False, False, False]])
    >>> ac.mean_context(h, mask=mask)             # row 1: no valid item
    array([[1., 2.],
           [0., 0.]])
    """


DOCS["mean_context_backward"] = """\
Backward of :func:`mean_context`: ``dh_t = (m_t / n) grad_c``.

    Parameters
    ----------
    grad_c : array_like (..., H)
        Gradient of the loss with respect to ``c``.
    h : array_like (..., T, H)
        The states given to the forward (only their shape and dtype are used).
    mask : array_like of bool (..., T), optional

    Returns
    -------
    dh : ndarray (..., T, H)
        Zero for masked items and for rows with no valid item.

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> h = np.zeros((3, 2))                          # T=3, H=2
    >>> mask = np.array([True, True, False])
    >>> ac.mean_context_backward(np.array([1.0, -2.0]), h, mask=mask)
    array([[ 0.5, -1. ],
           [ 0.5, -1. ],
           [ 0. ,  0. ]])
    """


DOCS["additive_score"] = """\
Additive score of each item given its sequence's context.

    ``s_t = v . tanh(W_h h_t + W_c c + b)`` where ``W = [W_h | W_c]``.
    ``W_c c + b`` is computed once per sequence.

    Parameters
    ----------
    h : array_like (..., T, H)
    context : array_like (..., H)
        One context vector per sequence (e.g. :func:`mean_context`).
    W : array_like (A, 2H)
        Layout of ``torch.nn.Linear(2H, A).weight``: ``W[:, :H]`` multiplies
        the item, ``W[:, H:]`` the context.
    v : array_like (A,)
    b : array_like (A,), optional
        Bias of the hidden layer.  Default: none.

    Returns
    -------
    s : ndarray (..., T)

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> h = rng.standard_normal((2, 5, 4))            # B=2, T=5, H=4
    >>> W, v = rng.standard_normal((3, 8)), rng.standard_normal(3)
    >>> s = ac.additive_score(h, ac.mean_context(h), W, v)
    >>> s.shape
    (2, 5)
    """


DOCS["additive_score_backward"] = """\
Backward of :func:`additive_score`.

    With ``u_t = tanh(z_t)`` and ``eps_t = grad_s_t v (1 - u_t^2)``:
    ``dv = sum_t grad_s_t u_t``, ``db = sum_t eps_t``,
    ``dW_h = sum_t eps_t h_t^T``, ``dW_c = (sum_t eps_t) c^T``,
    ``dh_t = W_h^T eps_t``, ``dcontext = W_c^T sum_t eps_t``.

    Parameters
    ----------
    grad_s : array_like (..., T)
        Gradient of the loss with respect to the scores.
    h, context, W, v, b
        As given to :func:`additive_score`.

    Returns
    -------
    dh : ndarray (..., T, H)
    dcontext : ndarray (..., H)
    dW : ndarray (A, 2H), summed over the batch
    dv : ndarray (A,), summed over the batch
    db : ndarray (A,) summed over the batch, or None when ``b`` is None

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> h = rng.standard_normal((2, 5, 4)); c = ac.mean_context(h)
    >>> W, v, b = (rng.standard_normal((3, 8)), rng.standard_normal(3),
    ...            np.zeros(3))
    >>> grad_s = np.ones((2, 5))
    >>> dh, dc, dW, dv, db = ac.additive_score_backward(grad_s, h, c, W, v,
    ...                                                 b=b)
    >>> dh.shape, dc.shape, dW.shape, dv.shape, db.shape
    ((2, 5, 4), (2, 4), (3, 8), (3,), (3,))
    """


DOCS["masked_softmax"] = """\
Softmax over the last axis, restricted to the valid items.

    ``alpha_t = m_t exp(s_t - M) / sum_j m_j exp(s_j - M)`` with ``M`` the
    largest valid score, so no exponential overflows.  Masked items get
    exactly 0; a row with no valid item is all zeros.

    Parameters
    ----------
    scores : array_like (..., T)
    mask : array_like of bool (..., T), optional

    Returns
    -------
    alpha : ndarray (..., T)

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> scores = np.array([[1000.0, 1000.0, 5.0], [1.0, 2.0, 3.0]])
    >>> mask = np.array([[True, True, False], [False, False, False]])
    >>> ac.masked_softmax(scores, mask=mask)      # no overflow, no NaN
    array([[0.5, 0.5, 0. ],
           [0. , 0. , 0. ]])
    """


DOCS["masked_softmax_backward"] = """\
Backward of :func:`masked_softmax`.

    ``ds_t = alpha_t (g_t - sum_j alpha_j g_j)``; masked items (alpha = 0)
    get 0.  Evaluated as ``alpha_t ((g_t - g_k) - sum_j alpha_j (g_j -
    g_k))`` with k the item of largest weight, which is the same value
    because the weights sum to 1, and stays accurate when one weight is
    near 1.

    Parameters
    ----------
    grad_alpha : array_like (..., T)
    alpha : array_like (..., T)
        The forward's output (weights summing to 1 over the valid items,
        or all 0).

    Returns
    -------
    dscores : ndarray (..., T)

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> alpha = ac.masked_softmax(np.zeros(4),
    ...                           mask=np.array([1, 1, 0, 0], bool))
    >>> ac.masked_softmax_backward(np.array([1.0, 3.0, 5.0, 7.0]), alpha)
    array([-0.5,  0.5,  0. ,  0. ])
    """


DOCS["weighted_sum"] = """\
``out = sum_t alpha_t h_t``.

    Parameters
    ----------
    alpha : array_like (..., T)
    h : array_like (..., T, H)

    Returns
    -------
    out : ndarray (..., H)

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> h = np.array([[1.0, 0.0], [0.0, 1.0], [4.0, 4.0]])    # T=3, H=2
    >>> ac.weighted_sum(np.array([0.25, 0.75, 0.0]), h)
    array([0.25, 0.75])
    """


DOCS["weighted_sum_backward"] = """\
Backward of :func:`weighted_sum`.

    Parameters
    ----------
    grad_out : array_like (..., H)
    alpha : array_like (..., T)
    h : array_like (..., T, H)

    Returns
    -------
    dalpha : ndarray (..., T)
        ``dalpha_t = grad_out . h_t``.
    dh : ndarray (..., T, H)
        ``dh_t = alpha_t grad_out``.

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> h = np.array([[1.0, 0.0], [0.0, 1.0], [4.0, 4.0]])    # T=3, H=2
    >>> alpha = np.array([0.25, 0.75, 0.0])
    >>> dalpha, dh = ac.weighted_sum_backward(np.array([1.0, 2.0]), alpha, h)
    >>> dalpha
    array([ 1.,  2., 12.])
    >>> dh
    array([[0.25, 0.5 ],
           [0.75, 1.5 ],
           [0.  , 0.  ]])
    """


DOCS["context_attention"] = """\
The whole layer: mean context, additive score, masked softmax, sum.

    ``c = mean of valid h_t``; ``s_t = v . tanh(W_h h_t + W_c c + b)``;
    ``alpha = masked softmax(s)``; ``out = sum_t alpha_t h_t``.  One pass
    over the data; the (T, A) activations are never stored.

    Parameters
    ----------
    h : array_like (..., T, H)
    W : array_like (A, 2H)
        Layout of ``torch.nn.Linear(2H, A).weight``.
    v : array_like (A,)
    b : array_like (A,), optional
    mask : array_like of bool (..., T), optional
        True marks a valid item.  Masked items never influence any output.
    keep_activations : bool, optional
        Also return the activations ``u_t = tanh(z_t)``, which
        :func:`context_attention_backward` then uses instead of recomputing
        them: memory (..., T, A) for a faster backward.

    Returns
    -------
    out : ndarray (..., H)
        Zero for a row with no valid item.
    alpha : ndarray (..., T)
        Attention weights; exactly 0 for masked items.
    activations : ndarray (..., T, A)
        Only with ``keep_activations=True``: ``tanh(z_t)``, 0 for masked
        items.

    Examples
    --------
    >>> import numpy as np, attention_c
    >>> rng = np.random.default_rng(0)
    >>> h = rng.standard_normal((2, 5, 4))          # B=2, T=5, H=4
    >>> W = rng.standard_normal((3, 8)); v = rng.standard_normal(3)
    >>> out, alpha = attention_c.context_attention(h, W, v)
    >>> out.shape, alpha.shape
    ((2, 4), (2, 5))
    >>> np.allclose(alpha.sum(axis=-1), 1)
    True
    """


DOCS["context_attention_backward"] = """\
Gradients of the whole layer (docs/contract.md section 2) in one call.

    Parameters
    ----------
    grad_out : array_like (..., H)
        Gradient of the loss with respect to ``out``.
    h, W, v, b, mask
        As given to :func:`context_attention`.
    alpha : array_like (..., T)
        The attention weights returned by :func:`context_attention`.
    grad_alpha : array_like (..., T), optional
        Gradient of the loss with respect to ``alpha``, if the loss uses it.
    activations : array_like (..., T, A), optional
        The activations returned by ``context_attention(...,
        keep_activations=True)`` for the same inputs; they spare
        recomputing ``tanh(W_h h_t + W_c c + b)`` (the backward's largest
        product).  Results are the same within rounding.

    Returns
    -------
    AttentionGrads
        Named tuple ``(h, W, v, b)``: ``h`` is (..., T, H) and zero for
        masked items; ``W``, ``v``, ``b`` are summed over the batch; ``b``
        is None when no bias was given.

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> h = rng.standard_normal((2, 5, 4))            # B=2, T=5, H=4
    >>> W, v, b = (rng.standard_normal((3, 8)), rng.standard_normal(3),
    ...            np.zeros(3))
    >>> mask = np.arange(5) < np.array([[5], [2]])    # lengths 5 and 2
    >>> out, alpha, act = ac.context_attention(h, W, v, b=b, mask=mask,
    ...                                        keep_activations=True)
    >>> g = ac.context_attention_backward(np.ones_like(out), h, W, v, alpha,
    ...                                   b=b, mask=mask, activations=act)
    >>> g.h.shape, g.W.shape, g.b.shape
    ((2, 5, 4), (3, 8), (3,))
    >>> bool((g.h[1, 2:] == 0).all())                 # masked items: 0
    True
    """
