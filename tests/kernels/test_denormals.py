"""No denormal, ever (docs/contract.md section 8): in the attention
family a weight exp(x) with x below log(the dtype's smallest normal) is
exactly 0.  So a bias of finfo.min, as T5 and transformers write their
masks, gives weights exactly 0 there and the results of a bias of -inf
(within rounding; in practice the same bits), forward and backward,
stored and streamed, decoding too, on every SIMD path; no weight is
ever a denormal.  (Speed is not asserted: finfo.min no longer runs the
products on denormals.)
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core

SIMD_PATHS = list(_core._simd_paths())
DTYPES = [np.float32, np.float64]
FUNCS = ["dot_attention", "general_attention"]
B, T, H = 2, 97, 8


@pytest.fixture
def restore_config():
    simd, n = _core._get_simd(), ac.get_num_threads()
    yield
    _core._set_simd(simd)
    ac.set_num_threads(n)


def _problem(rng, dtype, name, single=False):
    """(args, kwargs, hide): random inputs; hide (.., Tq, T) or (.., T)
    marks half the keys of each query, never its own (a query always
    sees a key: a query that sees none differs by definition)."""
    q = rng.standard_normal((B, H) if single else (B, T, H)).astype(dtype)
    k = rng.standard_normal((B, T, H)).astype(dtype)
    v = rng.standard_normal((B, T, 5)).astype(dtype)
    kw = {"values": v}
    if name == "general_attention":
        kw["W"] = (rng.standard_normal((H, H)) / np.sqrt(H)).astype(dtype)
    hide = rng.random((B, T) if single else (T, T)) < 0.5
    if single:
        hide[:, 0] = False
    else:
        np.fill_diagonal(hide, False)
    return (q, k), kw, hide


def _biases(hide, dtype):
    lo = np.finfo(dtype).min
    return (np.where(hide, lo, 0).astype(dtype),
            np.where(hide, -np.inf, 0).astype(dtype))


def _close(x, y, dtype, what):
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(x, y, rtol=64 * eps, atol=64 * eps,
                               err_msg=what)


def _no_denormal(a, dtype, what):
    a = np.abs(np.asarray(a))
    assert np.all((a == 0) | (a >= np.finfo(dtype).tiny) | np.isnan(a)), \
        what


def _grads_close(g_min, g_inf, dtype, what):
    for field, x, y in zip(g_min._fields, g_min, g_inf):
        if x is None:
            assert y is None, (what, field)
            continue
        _close(x, y, dtype, f"{what} {field}")


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_stored_weights(name, dtype, rng, restore_config):
    """return_weights=True and the backward from alpha."""
    (q, k), kw, hide = _problem(rng, dtype, name)
    b_min, b_inf = _biases(hide, dtype)
    fwd = getattr(ac, name)
    bwd = getattr(ac, name + "_backward")
    for path in SIMD_PATHS:
        _core._set_simd(path)
        what = f"{name} {path}"
        o_min, a_min = fwd(q, k, bias=b_min, **kw)
        o_inf, a_inf = fwd(q, k, bias=b_inf, **kw)
        assert np.all(a_min[..., hide] == 0), what
        _no_denormal(a_min, dtype, what)
        _close(a_min, a_inf, dtype, what + " alpha")
        _close(o_min, o_inf, dtype, what + " out")
        g = rng.standard_normal(o_min.shape).astype(dtype)
        gr_min = bwd(g, q, k, alpha=a_min, bias=b_min, **kw)
        gr_inf = bwd(g, q, k, alpha=a_inf, bias=b_inf, **kw)
        assert np.all(gr_min.bias[..., hide] == 0), what
        _grads_close(gr_min, gr_inf, dtype, what)


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_streamed(name, dtype, rng, restore_config):
    """return_weights=False (several blocks of keys) and the backward
    from out and lse; bitwise the same for 1 and 3 threads."""
    (q, k), kw, hide = _problem(rng, dtype, name)
    b_min, b_inf = _biases(hide, dtype)
    fwd = getattr(ac, name)
    bwd = getattr(ac, name + "_backward")
    for path in SIMD_PATHS:
        _core._set_simd(path)
        what = f"{name} {path}"
        runs = []
        for threads in (1, 3):
            ac.set_num_threads(threads)
            o_min, l_min = fwd(q, k, bias=b_min, return_weights=False, **kw)
            o_inf, l_inf = fwd(q, k, bias=b_inf, return_weights=False, **kw)
            _close(o_min, o_inf, dtype, what + " out")
            _close(l_min, l_inf, dtype, what + " lse")
            g = np.ones_like(o_min)
            gr_min = bwd(g, q, k, out=o_min, lse=l_min, bias=b_min, **kw)
            gr_inf = bwd(g, q, k, out=o_inf, lse=l_inf, bias=b_inf, **kw)
            assert np.all(gr_min.bias[..., hide] == 0), what
            _grads_close(gr_min, gr_inf, dtype, what)
            runs.append([o_min, l_min, *[x for x in gr_min
                                         if x is not None]])
        for x, y in zip(*runs):
            assert np.array_equal(x, y), what + " threads"


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_decode(name, dtype, rng, restore_config):
    """One query per sequence: weights, out, lse and the gradients."""
    (q, k), kw, hide = _problem(rng, dtype, name, single=True)
    b_min, b_inf = _biases(hide, dtype)
    fwd = getattr(ac, name)
    bwd = getattr(ac, name + "_backward")
    for path in SIMD_PATHS:
        _core._set_simd(path)
        what = f"{name} {path} decode"
        o_min, a_min = fwd(q, k, bias=b_min, **kw)
        o_inf, a_inf = fwd(q, k, bias=b_inf, **kw)
        assert np.all(a_min[hide] == 0), what
        _no_denormal(a_min, dtype, what)
        _close(a_min, a_inf, dtype, what + " alpha")
        _close(o_min, o_inf, dtype, what + " out")
        o_min, l_min = fwd(q, k, bias=b_min, return_weights=False, **kw)
        o_inf, l_inf = fwd(q, k, bias=b_inf, return_weights=False, **kw)
        _close(o_min, o_inf, dtype, what + " streamed out")
        _close(l_min, l_inf, dtype, what + " lse")
        g = np.ones_like(o_min)
        _grads_close(bwd(g, q, k, out=o_min, lse=l_min, bias=b_min, **kw),
                     bwd(g, q, k, out=o_inf, lse=l_inf, bias=b_inf, **kw),
                     dtype, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_underflowing_weights_are_zero_not_denormal(dtype, restore_config):
    """Scores far apart but finite: the small weights are exactly 0
    where exp(s - max) is below the least normal, never a denormal; the
    ones just above are kept."""
    tiny = np.finfo(dtype).tiny
    gap = -np.log(tiny)
    s = np.array([0.0, -(gap + 2), -(gap - 2), -1e30], dtype)
    q = np.ones((1, 1, 1), dtype)
    k = s.reshape(1, 4, 1)
    for path in SIMD_PATHS:
        _core._set_simd(path)
        _, a = ac.dot_attention(q, k, scale=1.0)
        assert a[0, 0, 1] == 0 and a[0, 0, 3] == 0, path
        assert a[0, 0, 2] >= tiny, path
        assert a[0, 0, 0] == 1, path


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_streamed_weights_flush_at_the_least_normal(dtype, restore_config):
    """return_weights=False (the fused kernel where the path has one:
    16 queries against 64 keys): a key whose weight exp(s - max) is just
    below the least normal adds exactly nothing, one just above adds
    its weight; huge values make either visible in out."""
    tiny = np.finfo(dtype).tiny
    gap = -np.log(tiny)
    big = np.sqrt(np.finfo(dtype).max)
    s = np.full(64, -1e30 if dtype == np.float64 else -1e20)
    s[:3] = [0.0, -(gap + 2), -(gap - 2)]
    k = np.zeros((1, 64, 8), dtype)
    k[0, :, 0] = s
    v = np.full((1, 64, 1), big, dtype)
    v[0, 0] = 0
    q = np.zeros((1, 16, 8), dtype)
    q[0, :, 0] = 1
    w = np.exp(-(gap - 2))
    want = w * float(big) / (1 + w)
    for path in SIMD_PATHS:
        _core._set_simd(path)
        out, lse = ac.dot_attention(q, k, values=v, scale=1.0,
                                    return_weights=False)
        np.testing.assert_allclose(out[0, :, 0], want, rtol=1e-4,
                                   err_msg=path)
        # lse = log(1 + w): 0 within rounding
        np.testing.assert_allclose(lse[0], 0, rtol=0,
                                   atol=4 * np.finfo(dtype).eps,
                                   err_msg=path)


def test_pooled_layer_keeps_its_floor(rng):
    """The context-pooled layer (contract 1.3) still keeps a valid
    weight that underflows nonzero: at least the least normal number."""
    h = np.zeros((1, 3, 2))
    h[0, 0] = 1e3
    W = np.zeros((1, 4))
    W[0, 0] = 1.0
    out, alpha = ac.context_attention(h, W, np.array([1e3]))
    assert alpha[0, 0] == 1
    tiny = np.finfo(np.float64).tiny
    assert np.all((alpha[0, 1:] >= tiny) & (alpha[0, 1:] < 16 * tiny))
