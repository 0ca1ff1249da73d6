"""attention_c: fast, exact context-pooled additive attention for NumPy.

For a sequence of states ``h`` (T, H) with an optional validity mask::

    c       = mean of the valid h_t                       (H,)
    s_t     = v . tanh(W_h h_t + W_c c + b)                (T,)
    alpha   = softmax of s over the valid items            (T,)
    out     = sum_t alpha_t h_t                            (H,)

with ``W = [W_h | W_c]`` of shape (A, 2H), the layout of
``torch.nn.Linear(2H, A).weight``.  Every step is a C kernel with its
backward; :func:`context_attention` and :func:`context_attention_backward`
run the whole layer in one call each way.

All functions take array-likes with any number of leading batch axes,
never modify their inputs and return new arrays.  float32 and float64 are
computed natively; other dtypes are promoted like ``np.result_type`` (integers
compute in float64, float16 in float32).  Masks are boolean, True = valid.
A row with no valid item gives zeros, never NaN.  ``attention_c.reference``
holds a plain NumPy version of every function.
"""

import os
import warnings
from collections import namedtuple

from . import _core
from ._version import __version__


def _simd_from_environment():
    """Apply ATTENTION_C_SIMD=scalar|avx2|avx512, if set."""
    name = os.environ.get("ATTENTION_C_SIMD", "").strip().lower()
    if not name:
        return
    try:
        _core._set_simd(name)
    except ValueError as exc:
        warnings.warn(f"ATTENTION_C_SIMD={name!r} ignored: {exc}",
                      RuntimeWarning, stacklevel=3)


def _available_cores():
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _threads_from_environment():
    """Default threads: ATTENTION_C_NUM_THREADS, else the available cores."""
    text = os.environ.get("ATTENTION_C_NUM_THREADS", "").strip()
    n = _available_cores()
    if text:
        try:
            n = int(text)
            _core._set_num_threads(n)
            return
        except ValueError as exc:
            warnings.warn(f"ATTENTION_C_NUM_THREADS={text!r} ignored: {exc}",
                          RuntimeWarning, stacklevel=3)
            n = _available_cores()
    _core._set_num_threads(min(n, 256))


_simd_from_environment()
_threads_from_environment()


def set_num_threads(n):
    """Set how many threads the fused layer (forward and backward) may use.

    The default is the ``ATTENTION_C_NUM_THREADS`` environment variable, or
    else the cores this process may run on.  Results are bitwise the same
    for every thread count.  Problems too small to pay for waking a thread
    run on the calling thread anyway.  The building-block kernels always run
    on the calling thread.  The setting is per process, shared by all
    Python threads.

    Parameters
    ----------
    n : int
        1 to 256.
    """
    if isinstance(n, bool) or not hasattr(type(n), "__index__"):
        raise TypeError(f"set_num_threads expects an int, got "
                        f"{type(n).__name__}")
    _core._set_num_threads(n.__index__())


def get_num_threads():
    """The number of threads the fused layer may use (see set_num_threads)."""
    return _core._get_num_threads()


def show_config(file=None):
    """Print the build and run-time configuration: version, compiler, SIMD
    path in use (and the best this CPU has), threads, NumPy version.

    Returns the same facts as a dict.
    """
    import platform
    import sys

    import numpy

    info = {
        "version": __version__,
        "compiler": _core._compiler,
        "simd": _core._get_simd(),
        "simd_best": _core._simd_best(),
        "num_threads": get_num_threads(),
        "available_cores": _available_cores(),
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}", file=file or sys.stdout)
    return info

__all__ = [
    "mean_context", "mean_context_backward",
    "additive_score", "additive_score_backward",
    "masked_softmax", "masked_softmax_backward",
    "weighted_sum", "weighted_sum_backward",
    "context_attention", "context_attention_backward",
    "AttentionGrads", "set_num_threads", "get_num_threads", "show_config",
    "__version__",
]

AttentionGrads = namedtuple("AttentionGrads", ["h", "W", "v", "b"])
AttentionGrads.__doc__ = """Gradients of the loss with respect to the layer's
inputs, returned by :func:`context_attention_backward`.

Attributes
----------
h : ndarray (..., T, H)
W : ndarray (A, 2H), summed over the batch
v : ndarray (A,), summed over the batch
b : ndarray (A,) summed over the batch, or None when no bias was given
"""


def mean_context(h, mask=None):
    """Mean of the valid items of each sequence.

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
    """
    return _core.mean_context(h, mask)


def mean_context_backward(grad_c, h, mask=None):
    """Backward of :func:`mean_context`: ``dh_t = (m_t / n) grad_c``.

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
    """
    return _core.mean_context_backward(grad_c, h, mask)


def additive_score(h, context, W, v, b=None):
    """Additive score of each item given its sequence's context.

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
    """
    return _core.additive_score(h, context, W, v, b)


def additive_score_backward(grad_s, h, context, W, v, b=None):
    """Backward of :func:`additive_score`.

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
    """
    return _core.additive_score_backward(grad_s, h, context, W, v, b)


def masked_softmax(scores, mask=None):
    """Softmax over the last axis, restricted to the valid items.

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
    """
    return _core.masked_softmax(scores, mask)


def masked_softmax_backward(grad_alpha, alpha):
    """Backward of :func:`masked_softmax`.

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
    """
    return _core.masked_softmax_backward(grad_alpha, alpha)


def weighted_sum(alpha, h):
    """``out = sum_t alpha_t h_t``.

    Parameters
    ----------
    alpha : array_like (..., T)
    h : array_like (..., T, H)

    Returns
    -------
    out : ndarray (..., H)
    """
    return _core.weighted_sum(alpha, h)


def weighted_sum_backward(grad_out, alpha, h):
    """Backward of :func:`weighted_sum`.

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
    """
    return _core.weighted_sum_backward(grad_out, alpha, h)


def context_attention(h, W, v, b=None, mask=None, keep_activations=False):
    """The whole layer: mean context, additive score, masked softmax, sum.

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
    return _core.context_attention(h, W, v, b, mask, keep_activations)


def context_attention_backward(grad_out, h, W, v, alpha, b=None, mask=None,
                               grad_alpha=None, activations=None):
    """Gradients of the whole layer (SPEC.md section 2) in one call.

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
    """
    return AttentionGrads(*_core.context_attention_backward(
        grad_out, h, W, v, alpha, b, mask, grad_alpha, activations))


# The trainable layer builds on the functions above, so it comes last.
from .layer import ContextAttention, adam_step, sgd_step  # noqa: E402

__all__ += ["ContextAttention", "sgd_step", "adam_step"]
