"""Helpers to test attention_c, shared by its tests, its self-check
(``python -m attention_c``) and its benchmark (``attention_c.bench``).

What is here, like ``numpy.testing``:

* tolerances and the error metric: the normwise relative error
  ``||x - ref|| / ||ref||`` (:func:`rel_err`), with a floor from the
  inputs' scale where the exact answer can be 0 (:func:`noise_floor`),
  the bound it must meet per computing dtype (:data:`TOL`,
  :func:`assert_close`) and central finite differences
  (:func:`numerical_grad`);
* random problems: :class:`Problem` (every argument of the layer's
  functions, any leading batch axes, the masks of :data:`MASK_KINDS`) and
  :func:`ragged_batch` (a batch of prefix-masked sequences and a freshly
  initialised layer, for the self-check and the benchmark);
* the argument table of the public functions (:data:`SIGNATURES`,
  :data:`API_ARGS`);
* the layer and the attention family in plain PyTorch, whose gradients
  come from autograd (``attention_c.torch._pure`` with the adapter's call
  signatures), and small tensor problems for them (defined in
  ``attention_c.testing.pytorch``, which imports torch inside its
  functions only: this package imports without torch).

Examples
--------
>>> import numpy as np
>>> import attention_c as ac
>>> from attention_c import reference, testing
>>> p = testing.Problem(np.random.default_rng(0), (3,), 5, 4, 6)
>>> x = p.cast(np.float32)
>>> out, _ = ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
...                               mask=p.mask)
>>> f64 = {k: v.astype(np.float64) for k, v in x.items() if k != "mask"}
>>> want, _ = reference.context_attention(f64["h"], f64["W"], f64["v"],
...                                       b=f64["b"], mask=p.mask)
>>> testing.assert_close(out, want, np.float32, "out")
"""

import math
import platform

import numpy as np

from attention_c._functions import TABLE as _TABLE

# The PyTorch half; torch is imported when its functions run.
from attention_c.testing.pytorch import (
    TORCH_ATTENTION, TORCH_FAMILY_MASKS, TORCH_FAMILY_SIZES,
    TORCH_LAYER_MASKS, TORCH_LAYER_SIZES, flash_kw_as_numpy,
    torch_additive_attention, torch_causal_mask, torch_context_attention,
    torch_dot_attention, torch_family_problem, torch_general_attention,
    torch_key_mask, torch_layer_problem, torch_masked_softmax)

__all__ = [
    "TOL", "ILL_FACTOR", "FD_RTOL", "DTYPES", "MASK_KINDS",
    "NOISE_ULPS", "rel_err", "noise_floor", "assert_close",
    "numerical_grad", "f64",
    "make_mask", "Problem", "ragged_batch",
    "SIGNATURES", "DEFAULTS", "OPTIONAL_POSITIONAL", "SEC5_ARGS",
    "API_ARGS", "LAYER_FUNCTIONS", "FAMILY_FUNCTIONS",
    "FIGURES", "record_figure", "assert_identical", "assert_all_identical",
    "HALF_DTYPES", "assert_rounded", "misaligned",
    "run_quick_bench", "page_section",
    "torch_context_attention", "torch_masked_softmax",
    "torch_additive_attention", "torch_dot_attention",
    "torch_general_attention", "TORCH_ATTENTION",
    "TORCH_LAYER_SIZES", "TORCH_LAYER_MASKS", "torch_layer_problem",
    "TORCH_FAMILY_SIZES", "TORCH_FAMILY_MASKS", "torch_key_mask",
    "torch_causal_mask", "torch_family_problem", "flash_kw_as_numpy",
]

# --------------------------------------------------------------------------
# Tolerances and the error metric

# Normwise relative error allowed against the float64 reference
# (||x - ref|| / ||ref||), per computing dtype.
TOL = {np.float64: 1e-12, np.float32: 1e-5}

# Ill-conditioned gradients (dv = sum_t delta_t u_t with sum_t delta_t = 0,
# worst with A = 1 or H = 1) lose digits in any evaluation in the dtype:
# their bounds are raised to ILL_FACTOR times the error of NumPy evaluating
# the reference in that dtype.
ILL_FACTOR = 8.0

# Normwise relative error allowed between an analytic gradient in float64
# and central differences (numerical_grad, step 1e-6).
FD_RTOL = 1e-6

DTYPES = [np.float32, np.float64]


def _half_dtypes():
    try:
        import ml_dtypes
    except ImportError:
        return [np.float16]
    return [np.float16, ml_dtypes.bfloat16]


# The 16-bit dtypes NumPy can hold here: float16, and ml_dtypes' bfloat16
# when it is installed.  They compute in float32 and come back in their own
# dtype (the log-sum-exp in float32).
HALF_DTYPES = _half_dtypes()

# Masks every test should meet: none, random (with at least one fully
# masked row when there are several), all masked, one valid item per row.
MASK_KINDS = ["none", "random", "all_masked", "single"]


def _as_float64(x):
    """x as a float64 NumPy array; torch tensors too (detached, on the CPU:
    bfloat16 has no NumPy dtype)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def f64(x):
    """x as a float64 NumPy array, None as None: the reference's input.

    Examples
    --------
    >>> f64(np.float32(0.5)).dtype, f64(None)
    (dtype('float64'), None)
    """
    return None if x is None else _as_float64(x)


# bf16's largest finite value
BF16_MAX = np.float32(3.38953139e38)


def round_bf16(x):
    """x (float32) rounded to bf16 as the bf16 products round their
    operands: clamped to bf16's finite range, then to nearest even (kept
    in float32).

    Examples
    --------
    >>> float(round_bf16(np.float32(1 + 2**-8))), float(round_bf16(1e39))
    (1.0, 3.3895313892515355e+38)
    """
    x = np.clip(np.asarray(x, np.float32), -BF16_MAX, BF16_MAX)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def add_odd(x, y):
    """x + y (float32) as Arm's BFDOT adds: rounded to odd (truncated, the
    lowest bit set when inexact), a result below the least normal float
    flushed to 0.

    Examples
    --------
    >>> float(add_odd(np.float32(1), np.float32(2**-31))) == 1 + 2**-23
    True
    """
    x = np.asarray(x, np.float32).astype(np.float64)
    y = np.asarray(y, np.float32).astype(np.float64)
    s = x + y
    bp = s - x
    e = (x - (s - bp)) + (y - bp)               # x + y == s + e exactly
    f = s.astype(np.float32)
    f = np.where(np.abs(f) > np.abs(s), np.nextafter(f, np.float32(0)), f)
    below = (f == s) & (e != 0) & ((e < 0) != (s < 0))
    inexact = (f != s) | (e != 0)
    f = np.where(below, np.nextafter(f, np.float32(0)), f)
    u = f.view(np.uint32) | inexact.astype(np.uint32)
    f = u.view(np.float32)
    tiny = np.abs(f) < np.finfo(np.float32).tiny
    return np.where(tiny, np.copysign(np.float32(0), f), f)


def dot_bf16(a, b, sums=None):
    """a @ b^T (last axes; float32 holding bf16 values) as the CPU's bf16
    dot products sum it: over pairs of elements in order, each product
    exact, and

    * ``sums="nearest"`` (x86's vdpbf16ps): each pair's odd product added
      before its even one, each sum rounded to nearest;
    * ``sums="odd"`` (Arm's BFDOT): each pair's two products summed, then
      added, each sum rounded to odd (:func:`add_odd`).

    The default is this machine's (Arm on AArch64, else x86).

    Examples
    --------
    >>> dot_bf16(np.float32([[1, 2, 3]]), np.float32([[4, 5, 6]]))
    array([[32.]], dtype=float32)
    """
    if sums is None:
        arm = platform.machine().lower() in ("aarch64", "arm64")
        sums = "odd" if arm else "nearest"
    if sums not in ("nearest", "odd"):
        raise ValueError(f"sums must be 'nearest' or 'odd', not {sums!r}")
    a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, a.shape[-1] % 2)])
    b = np.pad(b, [(0, 0)] * (b.ndim - 1) + [(0, b.shape[-1] % 2)])
    acc = np.zeros(a.shape[:-1] + (b.shape[-2],), np.float32)
    for j in range(0, a.shape[-1], 2):
        p0, p1 = (a[..., e, None] * b[..., None, :, e]    # exact products
                  for e in (j, j + 1))
        if sums == "odd":
            acc = add_odd(acc, add_odd(p0, p1))
        else:
            acc = (acc + p1) + p0
    return acc


def rel_err(x, ref, floor=0.0):
    """Normwise relative error of x against ref.

    Parameters
    ----------
    x, ref : array_like or torch.Tensor
        Of the same shape.
    floor : float
        The error is measured against ``max(||ref||, floor)``.  Give one
        (:func:`noise_floor`) wherever the exact answer can be 0 (a
        softmax gradient through a single visible key, a sum that cancels):
        there ref is rounding noise, different on every host, and a
        relative error would divide by it.

    Returns
    -------
    float
        ``||x - ref|| / max(||ref||, floor)`` (Frobenius norms, in
        float64), or the absolute ``||x - ref||`` when ref and floor are 0
        (e.g. the gradients of a fully masked row).

    Examples
    --------
    >>> rel_err([3.0, 4.0], [3.0, 4.5])
    0.0924...
    >>> rel_err([1e-3, 0.0], [0.0, 0.0])
    0.001
    >>> rel_err([0.0, 0.0], [4e-18, 0.0], floor=1e-5)
    4e-13
    """
    x, ref = _as_float64(x), _as_float64(ref)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    scale = max(float(np.linalg.norm(ref)), float(floor))
    diff = float(np.linalg.norm(x - ref))
    return diff / scale if scale > 0 else diff


# Roundoffs of its bound an answer that is 0 in exact arithmetic may carry
# (see noise_floor).  Measured: the query gradient of SDPA with one key,
# ours and PyTorch's, in float32 and float64, stays under 0.3.
NOISE_ULPS = 2


def _eps(dtype):
    """Machine epsilon of a NumPy or a torch floating dtype."""
    if type(dtype).__module__ == "torch":
        import torch
        return float(torch.finfo(dtype).eps)
    return float(np.finfo(dtype).eps)


def noise_floor(bound, dtype, tol, ulps=NOISE_ULPS):
    """The :func:`rel_err` floor of an answer that can be 0 in exact
    arithmetic, such as a sum that cancels.

    Evaluated in ``dtype``, such an answer is off by about ``eps(dtype) *
    bound``, ``bound`` being the sum of the magnitudes of its terms
    (taken from the inputs' norms): so its error is measured against
    ``max(||ref||, ulps * eps * bound / tol)``, that is, ``rel_err <=
    tol`` admits an absolute error of ``ulps`` roundoffs of ``bound`` and
    is unchanged wherever ``||ref||`` is above that.

    Parameters
    ----------
    bound : float
        An upper bound of the answer's norm without cancellation.
    dtype : NumPy or torch dtype
        The dtype the answer is computed in (the coarser one of the two
        compared).
    tol : float
        The bound rel_err must meet.
    ulps : float

    Examples
    --------
    >>> print(f"{noise_floor(2.0, np.float64, 1e-10):.3g}")
    8.88e-06
    """
    return ulps * _eps(dtype) * float(bound) / tol


def assert_close(x, ref, dtype, what="", floor=0.0):
    """Assert that x agrees with the float64 reference within TOL[dtype].

    Parameters
    ----------
    x, ref : array_like
        The result computed in ``dtype`` and the float64 reference.
    dtype : dtype_like
        The computing dtype, float32 or float64.
    what : str
        Names x in the message.
    floor : float
        Of :func:`rel_err`, where the exact answer can be 0.

    Examples
    --------
    >>> assert_close(np.float32(1 / 3), 1 / 3, np.float32, "a third")
    """
    kind = np.dtype(dtype).type
    err = rel_err(x, ref, floor)
    assert err <= TOL[kind], (
        f"{what}: normwise relative error {err:.3g} > {TOL[kind]:g} "
        f"({np.dtype(dtype).name})")


def numerical_grad(loss, x, step=1e-6):
    """Central-difference gradient of ``loss()`` with respect to x.

    Parameters
    ----------
    loss : callable
        No arguments; returns a scalar computed from x.
    x : numpy.ndarray
        Perturbed in place, one element at a time, and restored.
    step : float

    Returns
    -------
    numpy.ndarray
        ``(loss(x + step e_i) - loss(x - step e_i)) / (2 step)`` for each
        element i, in x's shape.

    Examples
    --------
    >>> x = np.array([1.0, 2.0])
    >>> numerical_grad(lambda: float(np.sum(x ** 2)), x).round(6)
    array([2., 4.])
    """
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + step
        up = loss()
        x[idx] = old - step
        down = loss()
        x[idx] = old
        grad[idx] = (up - down) / (2 * step)
    return grad


# --------------------------------------------------------------------------
# Random problems

def make_mask(rng, lead, T, kind):
    """A boolean mask of shape ``lead + (T,)`` of one of MASK_KINDS.

    Parameters
    ----------
    rng : numpy.random.Generator
    lead : tuple of int
        The leading (batch) axes.
    T : int
        The number of items.
    kind : {'none', 'random', 'all_masked', 'single'}
        'random': each item valid with probability 0.7, the second row
        fully masked and the third fully valid (when there are that many).

    Returns
    -------
    numpy.ndarray of bool or None
        None for kind 'none'.

    Examples
    --------
    >>> make_mask(np.random.default_rng(0), (2,), 3, "single").sum(-1)
    array([1, 1])
    """
    shape = tuple(lead) + (T,)
    if kind == "none":
        return None
    if kind == "all_masked":
        return np.zeros(shape, dtype=bool)
    if kind == "single":
        m = np.zeros(shape, dtype=bool)
        idx = rng.integers(0, T, size=lead)
        np.put_along_axis(m, np.asarray(idx)[..., None], True, axis=-1)
        return m
    m = rng.random(shape) < 0.7
    flat = m.reshape(-1, T)
    if flat.shape[0] > 1:
        flat[1] = False           # one fully masked row
    if flat.shape[0] > 2:
        flat[2] = True            # and one fully valid row
    return m


class Problem:
    """A random problem of the layer's functions, in float64.

    Attributes h, W, v, b (None without bias), mask, context, grad_out,
    grad_alpha and grad_s hold every argument the functions of contract
    section 3 take; ``cast(dtype)`` gives them in another dtype (compute
    the float64 reference from the cast values, so that a comparison
    measures only the rounding of the computation itself).

    Parameters
    ----------
    rng : numpy.random.Generator
    lead : tuple of int
        The leading (batch) axes.
    T, H, A : int
        Items per sequence, hidden size, attention size.
    bias : bool
    mask : str
        One of MASK_KINDS (see make_mask).
    scale : float
        Multiplies h.

    Examples
    --------
    >>> p = Problem(np.random.default_rng(0), (2, 3), 5, 4, 6, mask="none")
    >>> p.h.shape, p.W.shape, p.mask is None
    ((2, 3, 5, 4), (6, 8), True)
    >>> p.cast(np.float32)["h"].dtype
    dtype('float32')
    """

    def __init__(self, rng, lead, T, H, A, bias=True, mask="random",
                 scale=1.0):
        self.lead, self.T, self.H, self.A = tuple(lead), T, H, A
        self.h = rng.standard_normal(self.lead + (T, H)) * scale
        self.W = rng.standard_normal((A, 2 * H)) / np.sqrt(max(2 * H, 1))
        self.v = rng.standard_normal(A)
        self.b = rng.standard_normal(A) * 0.1 if bias else None
        self.mask = make_mask(rng, self.lead, T, mask)
        self.context = rng.standard_normal(self.lead + (H,))
        self.grad_out = rng.standard_normal(self.lead + (H,))
        self.grad_alpha = rng.standard_normal(self.lead + (T,))
        self.grad_s = rng.standard_normal(self.lead + (T,))

    def cast(self, dtype):
        """The float arrays of the problem in dtype (b stays None) and the
        mask, by name."""
        names = ["h", "W", "v", "b", "context", "grad_out", "grad_alpha",
                 "grad_s"]
        out = {}
        for n in names:
            x = getattr(self, n)
            out[n] = None if x is None else x.astype(dtype)
        out["mask"] = self.mask
        return out


def ragged_batch(rng, B, T, H, A, min_length=1, empty_row=False):
    """A batch of ragged sequences and a freshly initialised layer.

    Parameters
    ----------
    rng : numpy.random.Generator
    B, T, H, A : int
        Sequences, items per sequence, hidden size, attention size.
    min_length : int
        Each sequence has a uniform random number of valid items (a
        prefix) in ``[min_length, T]``.
    empty_row : bool
        Make the last sequence fully masked.

    Returns
    -------
    h, W, v, b, mask : numpy.ndarray
        float64 h (B, T, H) standard normal; W (A, 2H), v (A,), b (A,) as
        ``torch.nn.Linear(2H, A)`` and ``Linear(A, 1)`` initialise them
        (uniform, scaled by the fan-in); mask (B, T) bool.

    Examples
    --------
    >>> h, W, v, b, mask = ragged_batch(np.random.default_rng(0), 4, 8, 6,
    ...                                 5, empty_row=True)
    >>> h.shape, W.shape, mask.shape, int(mask[-1].sum())
    ((4, 8, 6), (5, 12), (4, 8), 0)
    """
    lengths = rng.integers(min_length, T + 1, size=B)
    if empty_row:
        lengths[-1] = 0
    scale = 1.0 / math.sqrt(2 * H)
    h = rng.standard_normal((B, T, H))
    W = rng.uniform(-scale, scale, (A, 2 * H))
    v = rng.uniform(-1, 1, A) / math.sqrt(A)
    b = rng.uniform(-scale, scale, A)
    return h, W, v, b, np.arange(T) < lengths[:, None]


# --------------------------------------------------------------------------
# The arguments of the public functions

# (positional, keyword-only) arguments of each public function, in the
# binding's order (inspect.signature), derived from the binding's table
# (attention_c._functions.TABLE).  The savings are left out, except
# key_proj, which the family's functions check like any other input: the
# context layer's keep_activations and activations, and stop_at_key_proj.
# Keyword-only arguments default to None except those in DEFAULTS; a
# dot/general backward's alpha is positional with default None (it may be
# left out when out= and lse= are given, docs/contract.md 5.3).
_SAVINGS = ("keep_activations", "activations", "stop_at_key_proj")
SIGNATURES = {
    fn: ([a.name for a in f.args if a.positional],
         [a.name for a in f.args
          if not a.positional and a.name not in _SAVINGS])
    for fn, f in _TABLE.items()}
# The defaults of the keyword-only arguments that are not None.
DEFAULTS = {a.name: a.default for f in _TABLE.values() for a in f.args
            if not a.required and a.default is not None
            and a.name not in _SAVINGS}
# Positional arguments with a default (None): alpha of these backwards.
OPTIONAL_POSITIONAL = {
    fn: [a.name for a in f.args if a.positional and not a.required]
    for fn, f in _TABLE.items()
    if any(a.positional and not a.required for a in f.args)}
# The arguments of docs/contract.md section 5 (self-attention at scale).
SEC5_ARGS = ["attn_mask", "causal", "bias", "dropout", "seed",
             "return_weights", "out", "lse"]
# The functions of the layer (contract section 3), then of the family.
LAYER_FUNCTIONS = list(SIGNATURES)[:10]
FAMILY_FUNCTIONS = list(SIGNATURES)[10:]

# The inputs of every public function, in order: SIGNATURES without
# key_proj (an optional saving, like the context layer's activations).
API_ARGS = {fn: [a for a in required + optional if a != "key_proj"]
            for fn, (required, optional) in SIGNATURES.items()}


# --------------------------------------------------------------------------
# Figures the hard-conditions tests report at the end of a run (property
# cases per function, allocation points walked, threads x iterations, leak
# loop memory, ...): tests add to FIGURES, tests/conftest.py prints them.

FIGURES: dict[str, float] = {}


def assert_identical(a, b, what=""):
    """Both plain ndarrays of the same shape, dtype and bits (NaN payloads
    and signed zeros included); None matches None only."""
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert type(a) is np.ndarray and type(b) is np.ndarray, what
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape,
                                                       b.shape)
    assert a.tobytes() == b.tobytes(), f"{what}: not bit-for-bit identical"


def assert_all_identical(got, want, what=""):
    """:func:`assert_identical` on each output of two calls (a tuple or a
    list of them, or one array)."""
    got = tuple(got) if isinstance(got, (tuple, list)) else (got,)
    want = tuple(want) if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert_identical(g, w, f"{what} output {i}")


def misaligned(x):
    """A C-contiguous copy of ``x`` one byte past an aligned address
    (unaligned for any element wider than a byte)."""
    buf = bytearray(x.nbytes + 1)
    y = np.frombuffer(buf, dtype=x.dtype, count=x.size, offset=1)
    y = y.reshape(x.shape)
    y[...] = x
    return y


def assert_rounded(got, want, dtype, what="", lse=None):
    """The outputs of a 16-bit call (``got``) are those of the float32
    call (``want``) rounded once to ``dtype``, bit for bit, but for output
    number ``lse``, which stays float32."""
    got = tuple(got) if isinstance(got, (tuple, list)) else (got,)
    want = tuple(want) if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is not None and i != lse:
            w = w.astype(dtype)
        assert_identical(g, w, f"{what} output {i}")


def record_figure(key, value, add=False):
    """Set FIGURES[key] to value, or with add=True add value to it.

    Examples
    --------
    >>> record_figure("doctest calls", 2, add=True)
    """
    if add:
        FIGURES[key] = FIGURES.get(key, 0) + value
    else:
        FIGURES[key] = value


def run_quick_bench(args, folder, page):
    """Run ``python -m <args> --quick --threads 1,2`` in ``folder``, with
    ``--json`` and ``--write-docs`` on a copy of ``page``: ``(the JSON
    data, the report, the rewritten page)``.  AssertionError (with its
    stderr) if it fails.  The benchmarks' tests run each once."""
    import json
    import shutil
    import subprocess
    import sys
    shutil.copy(page, folder / "performance.md")
    proc = subprocess.run(
        [sys.executable, "-m", *args, "--quick", "--threads", "1,2",
         "--json", str(folder / "run.json"),
         "--write-docs", str(folder / "performance.md")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    with open(folder / "run.json", encoding="utf-8") as f:
        data = json.load(f)
    return (data, proc.stdout,
            (folder / "performance.md").read_text(encoding="utf-8"))


def page_section(text, name):
    r"""The body of the section ``name`` of docs/performance.md's text (the
    lines between ``<!-- bench:name -->`` and ``<!-- /bench:name -->``),
    which the benchmarks' --write-docs rewrites.

    Examples
    --------
    >>> page_section("a\n<!-- bench:x -->\nbody\n<!-- /bench:x -->\n", "x")
    'body'
    """
    start = f"<!-- bench:{name} -->\n"
    begin = text.index(start) + len(start)
    return text[begin:text.index(f"\n<!-- /bench:{name} -->", begin)]
