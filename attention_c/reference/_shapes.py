"""Shape helpers of the reference: leading axes stacked, and a
broadcast input's gradient summed back to its shape."""

import numpy as np


def _rows(x):
    """Stack every leading axis: (..., n) -> (rows, n)."""
    return x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1])


def _sum_to(x, shape):
    """Sum x back to ``shape``, the shape of an array NumPy broadcast to
    x.shape: the gradient of np.broadcast_to (sum over the added leading
    axes and over the axes of size 1 that were stretched)."""
    x = np.asarray(x)
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    stretched = tuple(a for a, n in enumerate(shape)
                      if n == 1 and x.shape[a] != 1)
    return x.sum(axis=stretched, keepdims=True).reshape(shape)
