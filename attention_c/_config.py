"""The run-time settings of attention_c: the SIMD path and the threads,
from the environment at import and by set_num_threads; show_config."""

import os
import warnings

from . import _core  # type: ignore[attr-defined]
from ._version import __version__


def _name_from_environment(variable, apply):
    """Apply the name in the environment variable (lower-cased), if set:
    ATTENTION_C_SIMD=scalar|avx2|avx512|neon, ATTENTION_C_BF16_UNIT=
    auto|dot|amx.  A name the setter refuses is ignored with a warning."""
    name = os.environ.get(variable, "").strip().lower()
    if not name:
        return
    try:
        apply(name)
    except ValueError as exc:
        warnings.warn(f"{variable}={name!r} ignored: {exc}",
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


# the SIMD path first: the bf16 unit is checked against it
_name_from_environment("ATTENTION_C_SIMD", _core._set_simd)
_name_from_environment("ATTENTION_C_BF16_UNIT", _core._set_bf16_unit)
_threads_from_environment()


def set_num_threads(n):
    """Set how many threads the fused layer and the attention family
    (forward and backward) may use.

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

    Examples
    --------
    >>> import attention_c as ac
    >>> before = ac.get_num_threads()
    >>> ac.set_num_threads(1)
    >>> ac.get_num_threads()
    1
    >>> ac.set_num_threads(before)
    """
    if isinstance(n, bool) or not hasattr(type(n), "__index__"):
        raise TypeError(f"set_num_threads expects an int, got "
                        f"{type(n).__name__}")
    _core._set_num_threads(n.__index__())


def get_num_threads():
    """The number of threads the fused layer and the family may use.

    Returns
    -------
    int
        1 to 256; see :func:`set_num_threads`.

    Examples
    --------
    >>> import attention_c as ac
    >>> 1 <= ac.get_num_threads() <= 256
    True
    """
    return _core._get_num_threads()


class _Fp32Precision:
    """What set_fp32_precision returns: the precision before the call,
    restored when a ``with`` block ends."""

    def __init__(self, previous):
        self._previous = previous

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        _core._set_fp32_precision(self._previous)
        return False

    def __repr__(self):
        return (f"<attention_c fp32 precision "
                f"{_core._get_fp32_precision()!r}, restores "
                f"{self._previous!r}>")


def set_fp32_precision(precision):
    """Let float32 calls run their products on bf16 units, or not.

    As PyTorch's ``fp32_precision`` settings do for matrix products:
    ``"ieee"`` (the default) keeps float32 products; ``"bf16"`` allows a
    float32 call to round its operands to bfloat16 for the products,
    which sum in float32, where the CPU multiplies bf16 much faster than
    float32.  Today that is the streamed forward (``return_weights=False``
    of :func:`dot_attention` and :func:`general_attention`, so also the
    forward of ``scaled_dot_product_attention`` and ``flash_attn_func`` of
    ``attention_c.torch`` in float32) on AMX tiles (Intel Sapphire Rapids
    and later) or on the dot products where they beat the float32 FMAs
    (measured once per process: AVX512_BF16's on AMD Zen 4 and later;
    BFDOT on Arm CPUs with the BF16 extension), and the streamed
    backward on either unit.  ``show_config()["bf16_unit"]`` says which
    unit this CPU runs, and the ``ATTENTION_C_BF16_UNIT=dot|amx``
    environment variable chooses one, for instance the dot products on an
    Intel CPU, where they run at half the float32 rate.  Every other call,
    and every call on other CPUs, keeps float32 products.  Results stay
    float32; their error grows from about 4e-7 to about 3.5e-3 (normwise,
    against float64).

    The setting is per process, shared by all Python threads.  Calling it
    sets the precision at once; used as a context manager, the previous
    precision comes back when the block ends.

    Parameters
    ----------
    precision : {"ieee", "bf16"}

    Returns
    -------
    context manager
        It restores the precision in force before the call.

    Examples
    --------
    >>> import numpy as np
    >>> import attention_c as ac
    >>> q = np.ones((1, 4, 8), np.float32)
    >>> with ac.set_fp32_precision("bf16"):
    ...     out, lse = ac.dot_attention(q, q, return_weights=False)
    >>> ac.get_fp32_precision()
    'ieee'
    """
    if not isinstance(precision, str):
        raise TypeError(f"set_fp32_precision expects 'ieee' or 'bf16', got "
                        f"{type(precision).__name__}")
    previous = _core._get_fp32_precision()
    _core._set_fp32_precision(precision)
    return _Fp32Precision(previous)


def get_fp32_precision():
    """The products float32 calls may run on: ``"ieee"`` or ``"bf16"``.

    See :func:`set_fp32_precision`.

    Examples
    --------
    >>> import attention_c as ac
    >>> ac.get_fp32_precision()
    'ieee'
    """
    return _core._get_fp32_precision()


def show_config(file=None):
    """Print the build and run-time configuration: version, compiler, SIMD
    path in use (and the best this CPU has), threads, NumPy version.

    Parameters
    ----------
    file : file-like, optional
        Where to print; default ``sys.stdout``.

    Returns
    -------
    dict
        The same facts: ``version``, ``compiler``, ``simd``, ``simd_best``,
        ``num_threads``, ``available_cores``, ``fp32_precision``,
        ``bf16_products`` (whether float32 calls that allow bf16 run bf16
        products on this CPU and path), ``bf16_unit`` (which: ``"amx"``,
        ``"dot"`` or None), ``numpy``, ``python``, ``machine``.

    Examples
    --------
    >>> import io
    >>> import attention_c as ac
    >>> info = ac.show_config(file=io.StringIO())     # or print to stdout
    >>> info["version"] == ac.__version__
    True
    >>> info["simd"] in ("scalar", "avx2", "avx512", "neon")
    True
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
        "fp32_precision": get_fp32_precision(),
        "bf16_products": _core._bf16_products(),
        "bf16_unit": _core._bf16_unit(),
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}", file=file or sys.stdout)
    return info


# Documented and shown as attention_c's own (they are re-exported there).
for _f in (set_num_threads, get_num_threads, set_fp32_precision,
           get_fp32_precision, show_config):
    _f.__module__ = "attention_c"
del _f
