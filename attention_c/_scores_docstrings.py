"""The docstrings of the family's last two scores (docs/contract.md
section 9), Luong's location score and the content (cosine) score, and
of their gradients' named tuples; the pieces they share with the other
scores' docstrings are ``_family_docstrings._PIECES``.
"""

from ._family_docstrings import _PIECES

DOCS: dict[str, str] = {}
GRADS_DOCS: dict[str, str] = {}

GRADS_DOCS["LocationAttentionGrads"] = """\
Gradients returned by :func:`location_attention_backward`.

Attributes
----------
query : ndarray, the shape of ``query``
values : ndarray, the shape of ``values``
W : ndarray (T_max, Hq)
    ``sum_i delta_it q_i`` summed over the batch; exactly 0 in the rows
    t >= T that no score read.
b : ndarray (T_max,), or None when no ``b`` was given
    ``sum_i delta_it`` summed over the batch; 0 for t >= T.
"""

GRADS_DOCS["CosineAttentionGrads"] = """\
Gradients returned by :func:`cosine_attention_backward`.

Attributes
----------
query : ndarray, the shape of ``query``
keys : ndarray, the shape of ``keys``
    Includes the values' share when the keys are the values.
values : ndarray, the shape of ``values``, or None when none were given
sharpness : ndarray, the shape of ``sharpness``, or None
    ``dL/dbeta_i = sum_t delta_it n(q_i) . n(k_t)``, summed over the axes
    along which ``sharpness`` was broadcast; None when ``sharpness`` was
    None or a number (a constant).
bias, alibi_slopes, sinks : ndarray or None
    As :class:`DotAttentionGrads`' (None when not given).
"""

DOCS["location_attention"] = """\
Location-based attention (Luong et al. 2015, eq. 8).

    ``s_it = W_t . q_i + b_t``: the score of position t comes from the
    query alone, through one row of ``W`` per source position
    (``torch.nn.Linear(Hq, T_max)(q)[..., :T]``); then ``alpha_i =
    masked softmax of s_i`` and ``out_i = sum_t alpha_it val_t``.  It
    runs as :func:`dot_attention` with ``W[:T]`` as every sequence's keys,
    ``scale = 1`` and ``b[:T]`` as a bias.

    Shapes (any leading batch axes ``...``): ``query`` (..., Hq) for one
    query per sequence, or (..., Tq, Hq) for several (when ``query.ndim
    == values.ndim``); ``values`` (..., T, Hv); ``alpha`` (..., T) or
    (..., Tq, T); ``out`` (..., Hv) or (..., Tq, Hv).  Masked positions
    get exactly 0 weight and 0 gradient; a query with no visible position
    gets ``alpha = 0``, ``out = 0`` and zero gradients.  The leading axes
    of ``query`` and ``values`` broadcast against each other.

    Parameters
    ----------
    query : array_like (..., Hq) or (..., Tq, Hq)
    values : array_like (..., T, Hv)
        What the weights average (an encoder's states, a feature map's
        positions); T <= T_max.
    W : array_like (T_max, Hq)
        One row per source position, the layout of
        ``torch.nn.Linear(Hq, T_max).weight``; rows t >= T are not read.
    b : array_like (T_max,), optional
        One bias per position, ``torch.nn.Linear(Hq, T_max).bias``.
    mask : array_like of bool (..., T), optional
        True = valid position, the same for every query.
    attn_mask : array_like of bool, optional
        Broadcastable to (..., Tq, T): True = query i may attend to
        position t.  Only with several queries.

    Returns
    -------
    out : ndarray (..., Hv) or (..., Tq, Hv)
    alpha : ndarray (..., T) or (..., Tq, T)

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> state = rng.standard_normal((2, 6))        # a decoder state, Hq = 6
    >>> enc = rng.standard_normal((2, 5, 4))       # T = 5 positions
    >>> W, b = rng.standard_normal((9, 6)), np.zeros(9)   # T_max = 9
    >>> out, alpha = ac.location_attention(state, enc, W, b=b)
    >>> out.shape, alpha.shape
    ((2, 4), (2, 5))
    >>> s = state @ W[:5].T                        # the scores, by hand
    >>> ref = np.exp(s - s.max(-1, keepdims=True))
    >>> bool(np.allclose(alpha, ref / ref.sum(-1, keepdims=True)))
    True
    """

DOCS["location_attention_backward"] = """\
Gradients of :func:`location_attention` in one call.

    With ``delta_it = dL/ds_it`` (the softmax backward of
    :func:`dot_attention_backward`): ``dq_i = sum_t delta_it W_t``,
    ``dW_t = sum_i delta_it q_i`` and ``db_t = sum_i delta_it``, both
    summed over the batch (0 for t >= T), ``dval_t = sum_i alpha_it g_i``.

    Parameters
    ----------
    grad_out : array_like, the shape of ``out``
    query, values, W
        As given to :func:`location_attention`.
    alpha : array_like, the forward's ``alpha``
    b, mask, attn_mask
        As given to the forward.
    grad_alpha : array_like, the shape of ``alpha``, optional
        Gradient of the loss with respect to ``alpha``.

    Returns
    -------
    LocationAttentionGrads
        ``(query, values, W, b)``; ``b`` is None when no ``b`` was given.

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> state = rng.standard_normal((2, 6))
    >>> enc = rng.standard_normal((2, 5, 4))
    >>> W, b = rng.standard_normal((9, 6)), np.zeros(9)
    >>> out, alpha = ac.location_attention(state, enc, W, b=b)
    >>> g = ac.location_attention_backward(np.ones_like(out), state, enc, W,
    ...                                    alpha, b=b)
    >>> g._fields
    ('query', 'values', 'W', 'b')
    >>> g.W.shape, bool((g.W[5:] == 0).all() and (g.b[5:] == 0).all())
    ((9, 6), True)
    """

DOCS["cosine_attention"] = """\
Content-based (cosine) attention (Graves et al. 2014).

    ``s_it = beta_i n(q_i) . n(k_t)`` with ``n(x) = x / max(|x|, 1e-12)``
    (``torch.nn.functional.normalize``'s: a zero vector scores 0), then
    every step of :func:`dot_attention` (``bias``, ``softcap``, the masks,
    dropout, the streamed path...), ``alpha_i = masked softmax of s_i``,
    ``out_i = sum_t alpha_it val_t``.  It is the dot score of the
    normalised vectors: its cost is the dot score's plus O((Tq + T) H).
    The scores lie in [-beta, beta], so ``sharpness`` sets how peaked the
    weights can be.
    {shapes}
    Parameters
    ----------
    query : array_like (..., H) or (..., Tq, H)
    keys : array_like (..., T, H)
{masks}{bias_dropout}\
    values : array_like (..., T, Hv), optional
        Default: the keys (as given, not normalised).
    sharpness : float or array_like, optional
        ``beta``: None (1), a finite number, or an array broadcastable to
        the query positions (``out.shape[:-1]``: (..., Tq), or (...) for
        one query per sequence), whose gradient the backward returns; a
        NaN in it propagates as data.
{return_weights}{variants}
{returns}
    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 7, 4))
    >>> out, alpha = ac.cosine_attention(q, k, sharpness=5.0)
    >>> out.shape, alpha.shape
    ((2, 3, 4), (2, 3, 7))
    >>> n = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    >>> s = 5.0 * n(q) @ n(k).swapaxes(-1, -2)
    >>> ref = np.exp(s - s.max(-1, keepdims=True))
    >>> bool(np.allclose(alpha, ref / ref.sum(-1, keepdims=True)))
    True
    >>> bool(np.isfinite(ac.cosine_attention(np.zeros((3, 4)), k[0])[0]).all())
    True
    """

DOCS["cosine_attention_backward"] = """\
Gradients of :func:`cosine_attention` in one call.

    The backward of :func:`dot_attention` on ``q'_i = beta_i n(q_i)`` and
    ``k'_t = n(k_t)`` with ``scale = 1``, then through the normalisation:
    ``dbeta_i = dq'_i . n(q_i)``, and for x a query or a key with
    ``dy = beta_i dq'_i`` or ``dk'_t``, ``dx = (dy - n(x) (n(x) . dy)) /
    |x|`` (``dy / 1e-12`` where ``|x| < 1e-12``).
{backward_formulas}
    Parameters
    ----------
    grad_out : array_like, the shape of ``out``
    query, keys
        As given to :func:`cosine_attention`.
{backward_state}{backward_args}\
    values, sharpness
        As given to the forward.

    Returns
    -------
    CosineAttentionGrads
        ``(query, keys, values, sharpness, bias, alibi_slopes, sinks)``;
        ``values`` is None when no values were given, ``sharpness`` when it
        was None or a number, and the others when not given.

    Examples
    --------
    >>> import numpy as np, attention_c as ac
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 7, 4))
    >>> beta = np.full((3,), 4.0)                  # per query, shared by B
    >>> out, lse = ac.cosine_attention(q, k, sharpness=beta, causal=True,
    ...                                return_weights=False)
    >>> g = ac.cosine_attention_backward(np.ones_like(out), q, k, out=out,
    ...                                  lse=lse, sharpness=beta, causal=True)
    >>> g.query.shape, g.keys.shape, g.values, g.sharpness.shape
    ((2, 3, 4), (2, 7, 4), None, (3,))
    """

for _name in ("cosine_attention", "cosine_attention_backward"):
    for _key, _text in _PIECES.items():
        DOCS[_name] = DOCS[_name].replace("{" + _key + "}", _text)
del _name, _key, _text
