"""The run-time settings of attention_c: the SIMD path and the threads,
from the environment at import and by set_num_threads; show_config."""

import os
import warnings

from . import _core  # type: ignore[attr-defined]
from ._version import __version__


def _simd_from_environment():
    """Apply ATTENTION_C_SIMD=scalar|avx2|avx512|neon, if set."""
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
        ``num_threads``, ``available_cores``, ``numpy``, ``python``,
        ``machine``.

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
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}", file=file or sys.stdout)
    return info


# Documented and shown as attention_c's own (they are re-exported there).
for _f in (set_num_threads, get_num_threads, show_config):
    _f.__module__ = "attention_c"
del _f
