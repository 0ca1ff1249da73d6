"""Shared helpers for the tests: random problems, masks and tolerances."""

import numpy as np
import pytest

# Normwise relative error allowed against the float64 reference
# (||x - ref|| / ||ref||), per computing dtype.
TOL = {np.float64: 1e-12, np.float32: 1e-5}

DTYPES = [np.float32, np.float64]

# Masks every test should meet: none, random (with at least one fully
# masked row when there are several), all masked, one valid item per row.
MASK_KINDS = ["none", "random", "all_masked", "single"]


# The arguments of every public function, in order (keywords accepted).
API_ARGS = {
    "mean_context": ["h", "mask"],
    "mean_context_backward": ["grad_c", "h", "mask"],
    "additive_score": ["h", "context", "W", "v", "b"],
    "additive_score_backward": ["grad_s", "h", "context", "W", "v", "b"],
    "masked_softmax": ["scores", "mask"],
    "masked_softmax_backward": ["grad_alpha", "alpha"],
    "weighted_sum": ["alpha", "h"],
    "weighted_sum_backward": ["grad_out", "alpha", "h"],
    "context_attention": ["h", "W", "v", "b", "mask"],
    "context_attention_backward": ["grad_out", "h", "W", "v", "alpha", "b",
                                   "mask", "grad_alpha"],
    # the attention family (SPEC section 4); key_proj, like activations
    # above, is an optional saving rather than an input, and is left out
    "additive_attention": ["query", "keys", "W", "v", "b", "mask", "values"],
    "additive_attention_backward": ["grad_out", "query", "keys", "W", "v",
                                    "alpha", "b", "mask", "values",
                                    "grad_alpha"],
    "dot_attention": ["query", "keys", "mask", "values", "scale"],
    "dot_attention_backward": ["grad_out", "query", "keys", "alpha", "mask",
                               "values", "scale", "grad_alpha"],
    "general_attention": ["query", "keys", "W", "mask", "values"],
    "general_attention_backward": ["grad_out", "query", "keys", "W", "alpha",
                                   "mask", "values", "grad_alpha"],
    "project_keys": ["keys", "W"],
    "project_keys_backward": ["grad_proj", "keys", "W"],
}


def rel_err(x, ref):
    """Normwise relative error ||x - ref|| / ||ref|| (absolute if ref = 0)."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    scale = np.linalg.norm(ref)
    diff = np.linalg.norm(x - ref)
    return diff / scale if scale > 0 else diff


def assert_close(x, ref, dtype, what=""):
    """x agrees with the float64 reference within TOL[dtype]."""
    err = rel_err(x, ref)
    assert err <= TOL[np.dtype(dtype).type], (
        f"{what}: normwise relative error {err:.3g} > "
        f"{TOL[np.dtype(dtype).type]:g} ({np.dtype(dtype).name})")


def make_mask(rng, lead, T, kind):
    """A boolean mask of shape lead + (T,), or None for kind 'none'."""
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
    """A random layer problem in float64; .cast(dtype) gives its inputs in
    another dtype (the float64 reference is then computed from the cast
    values, so the comparison measures only the kernel's rounding)."""

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
        """The float arrays of the problem in dtype (b stays None)."""
        names = ["h", "W", "v", "b", "context", "grad_out", "grad_alpha",
                 "grad_s"]
        out = {}
        for n in names:
            x = getattr(self, n)
            out[n] = None if x is None else x.astype(dtype)
        out["mask"] = self.mask
        return out


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def numerical_grad(loss, x, step=1e-6):
    """Central-difference gradient of the scalar loss() with respect to the
    array x, which loss reads and which is perturbed in place (restored)."""
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
# Figures the hard-conditions tests report at the end of a run (property
# cases per function, allocation points walked, threads x iterations, leak
# loop memory, ...): tests add to FIGURES, pytest prints them.

FIGURES = {}


def record_figure(key, value, add=False):
    """Sets (or with add=True adds to) a figure shown after the run."""
    if add:
        FIGURES[key] = FIGURES.get(key, 0) + value
    else:
        FIGURES[key] = value


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("attention_c figures")
        for key in sorted(FIGURES):
            terminalreporter.write_line(f"{key}: {FIGURES[key]}")
