"""The variants of issue 25 in the kernels and the binding: window,
softcap, alibi_slopes, sinks and packed sequences (cu_seqlens_q/k) of
dot_attention, general_attention and their backwards.

Oracles: attention_c.reference on random combinations of every variant
with the existing arguments; the call each is equivalent to (a window,
causal and packed segments are an attn_mask: the visibility as a range
of keys per query must give what the mask gives; softcap is a bias that
takes the raw score to the capped one); finite differences for the
gradients of softcap, the slopes and the sinks.  Every path: the stored
weights, the streamed one (return_weights=False, several blocks of
keys), decoding (few queries), each SIMD path, 1, 2 and 3 threads
(bitwise).
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import TOL, noise_floor, numerical_grad, rel_err

SIMD_PATHS = list(_core._simd_paths())
DTYPES = [np.float32, np.float64]
SIZES = [1, 3, 17, 65]


@pytest.fixture
def restore_config():
    simd, n = _core._get_simd(), ac.get_num_threads()
    yield
    _core._set_simd(simd)
    ac.set_num_threads(n)


def close(x, ref, dtype, what="", bound=0.0):
    """Normwise, within a few hundred roundoffs of long sums; with a noise
    floor where the answer can be 0 in exact arithmetic (bound: the size
    of its terms, see noise_floor)."""
    tol = TOL[np.dtype(dtype).type] * (50 if dtype == np.float32 else 1e3)
    floor = noise_floor(bound, dtype, tol) if bound else 0.0
    err = rel_err(x, ref, floor)
    assert err <= tol, f"{what}: {err:.3g} > {tol:.3g}"


def visible(Tq, T, window=None, causal=False, cu_q=None, cu_k=None):
    """The (Tq, T) attn_mask equivalent to window, causal and segments."""
    if cu_q is None:
        cu_q, cu_k = [0, Tq], [0, T]
    m = np.zeros((Tq, T), bool)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        i = np.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        t = np.arange(k1 - k0)[None]
        v = np.ones((q1 - q0, k1 - k0), bool)
        if causal:
            v &= t <= i
        if window is not None and window[0] is not None:
            v &= t >= i - window[0]
        if window is not None and window[1] is not None:
            v &= t <= i + window[1]
        m[q0:q1, k0:k1] = v
    return m


def cuts(rng, n, total):
    """n segments over total items (some may be empty): (n + 1,) ints."""
    inner = np.sort(rng.integers(0, total + 1, n - 1))
    return np.concatenate([[0], inner, [total]]).astype(np.int64)


def problem(rng, dtype, lead_q, lead_k, Tq, T, H=8, Hv=5):
    q = rng.standard_normal(lead_q + (Tq, H)).astype(dtype)
    k = rng.standard_normal(lead_k + (T, H)).astype(dtype)
    v = rng.standard_normal(lead_k + (T, Hv)).astype(dtype)
    return q, k, v


def call(score, q, k, v, W=None, **kw):
    if score == "dot":
        return ac.dot_attention(q, k, values=v, **kw)
    return ac.general_attention(q, k, W, values=v, **kw)


def call_backward(score, g, q, k, v, fwd, W=None, **kw):
    saved = ({"out": fwd[0], "lse": fwd[1]} if "lse" in kw.pop("saved", ())
             else {})
    alpha = None if saved else fwd[1]
    if score == "dot":
        return ac.dot_attention_backward(g, q, k, alpha, values=v, **saved,
                                         **kw)
    return ac.general_attention_backward(g, q, k, W, alpha, values=v,
                                         **saved, **kw)


CASES = [  # window, causal, segments
    ((2, 1), False, False), ((None, 0), False, False),
    ((3, None), True, False), ((0, 0), False, False),
    ((None, None), False, False), (None, False, True),
    ((1, 2), True, True), (None, True, True), ((4, 0), False, True)]


# --------------------------------------------------------------------------
# window, causal and packed segments give what their attn_mask gives

@pytest.mark.parametrize("score", ["dot", "general"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_ranges_as_attn_mask(score, dtype, weights, case, rng):
    window, causal, segs = case
    for Tq, T in [(1, 3), (3, 1), (17, 17), (17, 65), (65, 17), (9, 9)]:
        q, k, v = problem(rng, dtype, (2,), (2,), Tq, T)
        W = rng.standard_normal((8, 8)).astype(dtype)
        kw = {}
        cu_q = cu_k = None
        if segs:
            n = int(rng.integers(1, 4))
            cu_q, cu_k = cuts(rng, n, Tq), cuts(rng, n, T)
            kw = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
        m = visible(Tq, T, window, causal, cu_q, cu_k)
        got = call(score, q, k, v, W, window=window, causal=causal,
                   return_weights=weights, **kw)
        want = call(score, q, k, v, W, attn_mask=m, return_weights=weights)
        close(got[0], want[0], dtype, "out")
        if weights:
            close(got[1], want[1], dtype, "alpha")
        else:
            finite = np.isfinite(want[1])
            assert (np.isfinite(got[1]) == finite).all()
            close(got[1][finite], want[1][finite], dtype, "lse")
        g = rng.standard_normal(got[0].shape).astype(dtype)
        saved = () if weights else ("lse",)
        gg = call_backward(score, g, q, k, v, got, W, window=window,
                           causal=causal, saved=saved, **kw)
        gw = call_backward(score, g, q, k, v, want, W, attn_mask=m,
                           saved=saved)
        bound = np.linalg.norm(g) * np.abs(v).max() * (
            np.linalg.norm(q) + np.linalg.norm(k))
        for name in gw._fields:
            if getattr(gw, name) is not None:
                close(getattr(gg, name), getattr(gw, name), dtype, name,
                      bound=bound)


@pytest.mark.parametrize("weights", [True, False])
def test_many_blocks(weights, rng, restore_config):
    """Several blocks of keys and queries (streamed: 256 keys, 64
    queries a block): a narrow window, packed segments, with bias,
    broadcast (GQA-style) keys and the key mask."""
    Tq, T = 300, 600
    q, k, v = problem(rng, np.float64, (2, 3), (2, 1), Tq, T, H=16)
    bias = rng.standard_normal((Tq, T))
    mask = rng.random((2, 1, T)) > 0.1
    cu_q, cu_k = np.array([0, 100, 100, 300]), np.array([0, 250, 260, 600])
    for window, kw in [((40, 3), {}), ((None, 0), {}),
                       ((20, 20), {"cu_seqlens_q": cu_q,
                                   "cu_seqlens_k": cu_k})]:
        cq = kw.get("cu_seqlens_q")
        ck = kw.get("cu_seqlens_k")
        m = visible(Tq, T, window, True, cq, ck)
        got = ac.dot_attention(q, k, values=v, window=window, causal=True,
                               bias=bias, mask=mask, return_weights=weights,
                               **kw)
        want = ac.dot_attention(q, k, values=v, attn_mask=m, bias=bias,
                                mask=mask, return_weights=weights)
        close(got[0], want[0], np.float64, "out")
        g = rng.standard_normal(got[0].shape)
        saved = () if weights else ("lse",)
        gg = call_backward("dot", g, q, k, v, got, window=window,
                           causal=True, bias=bias, mask=mask, saved=saved,
                           **kw)
        gw = call_backward("dot", g, q, k, v, want, attn_mask=m, bias=bias,
                           mask=mask, saved=saved)
        for name in gw._fields:
            if getattr(gw, name) is not None:
                close(getattr(gg, name), getattr(gw, name), np.float64, name)


@pytest.mark.parametrize("score", ["dot", "general"])
@pytest.mark.parametrize("weights", [True, False])
def test_decoding(score, weights, rng):
    """Few queries per sequence (the decoding path) with a window."""
    for Tq, T in [(1, 65), (3, 17), (8, 300)]:
        q, k, v = problem(rng, np.float64, (3,), (3,), Tq, T)
        W = rng.standard_normal((8, 8))
        for window in [(4, 0), (0, None), (10, 10)]:
            m = visible(Tq, T, window)
            got = call(score, q, k, v, W, window=window, softcap=2.0,
                       return_weights=weights)
            raw = call(score, q, k, v, W, attn_mask=m, softcap=2.0,
                       return_weights=weights)
            close(got[0], raw[0], np.float64, "out")


# --------------------------------------------------------------------------
# softcap

def raw_scores(score, q, k, W):
    if score == "dot":
        return q @ np.swapaxes(k, -1, -2) / np.sqrt(k.shape[-1])
    return q @ np.swapaxes(k @ W.T, -1, -2)


@pytest.mark.parametrize("score", ["dot", "general"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", [True, False])
def test_softcap_forward(score, dtype, weights, rng):
    """softcap c: the score c tanh(s / c) before the bias: the same as a
    bias that takes s there, plus the bias."""
    for Tq, T in [(1, 3), (17, 17), (65, 17), (3, 65)]:
        q, k, v = problem(rng, dtype, (2,), (2,), Tq, T)
        q *= 3
        W = rng.standard_normal((8, 8)).astype(dtype)
        bias = rng.standard_normal((Tq, T))
        s = raw_scores(score, q.astype(np.float64), k.astype(np.float64),
                       W.astype(np.float64))
        c = 1.5
        to_cap = (c * np.tanh(s / c) - s + bias).astype(dtype)
        got = call(score, q, k, v, W, softcap=c, bias=bias, causal=True,
                   return_weights=weights)
        want = call(score, q, k, v, W, bias=to_cap, causal=True,
                    return_weights=weights)
        close(got[0], want[0], dtype, "out")


@pytest.mark.parametrize("score", ["dot", "general"])
@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("simd", SIMD_PATHS)
def test_softcap_gradients(score, weights, simd, rng, restore_config):
    """The backward through softcap (with a window, a bias and packed
    segments) against finite differences of sum(out * g)."""
    _core._set_simd(simd)
    Tq, T = 7, 9
    q, k, v = problem(rng, np.float64, (2,), (2,), Tq, T, H=4, Hv=3)
    q *= 2
    W = rng.standard_normal((4, 4))
    bias = rng.standard_normal((2, Tq, T))
    kw = {"softcap": 1.3, "window": (3, 1), "bias": bias,
          "cu_seqlens_q": np.array([0, 3, 7]),
          "cu_seqlens_k": np.array([0, 5, 9])}
    g = rng.standard_normal((2, Tq, 3))
    fwd = call(score, q, k, v, W, return_weights=weights, **kw)
    grads = call_backward(score, g, q, k, v, fwd, W,
                          saved=() if weights else ("lse",), **kw)

    def loss():
        return float((call(score, q, k, v, W, **kw)[0] * g).sum())

    inputs = [("query", q), ("keys", k), ("values", v), ("bias", bias)]
    inputs += [("W", W)] if score == "general" else []
    for name, x in inputs:
        num = numerical_grad(loss, x)
        assert rel_err(getattr(grads, name), num) < 1e-6, name


# --------------------------------------------------------------------------
# Every SIMD path, threads, blocks never computed

@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_simd_path(simd, dtype, rng, restore_config):
    _core._set_simd(simd)
    for Tq, T in [(3, 17), (17, 65), (65, 65)]:
        q, k, v = problem(rng, dtype, (2,), (1,), Tq, T)
        cu_q, cu_k = cuts(rng, 2, Tq), cuts(rng, 2, T)
        m = visible(Tq, T, (5, 2), True, cu_q, cu_k)
        for weights in (True, False):
            got = ac.dot_attention(q, k, values=v, window=(5, 2),
                                   causal=True, cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k, softcap=4.0,
                                   return_weights=weights)
            want = ac.dot_attention(q, k, values=v, attn_mask=m,
                                    softcap=4.0, return_weights=weights)
            close(got[0], want[0], dtype, f"out {simd}")


ALL = {"window": (30, 7), "causal": True, "softcap": 3.0, "dropout": 0.2,
       "seed": 7}


@pytest.mark.parametrize("score", ["dot", "general"])
@pytest.mark.parametrize("weights", [True, False])
def test_threads_bitwise(score, weights, rng, restore_config):
    """Every variant at once: the same bits with 1, 2 and 3 threads."""
    Tq, T = 300, 520
    q, k, v = problem(rng, np.float32, (4,), (4,), Tq, T, H=32, Hv=32)
    W = rng.standard_normal((32, 32)).astype(np.float32)
    bias = rng.standard_normal((Tq, T)).astype(np.float32)
    kw = dict(ALL, bias=bias, cu_seqlens_q=np.array([0, 120, 300]),
              cu_seqlens_k=np.array([0, 200, 520]),
              alibi_slopes=rng.uniform(0, 0.1, (4,)).astype(np.float32))
    if not weights:      # (the backward from alpha refuses sinks)
        kw["sinks"] = rng.standard_normal((4,)).astype(np.float32)
    g = rng.standard_normal((4, Tq, 32)).astype(np.float32)
    results = []
    for n in (1, 2, 3):
        ac.set_num_threads(n)
        fwd = call(score, q, k, v, W, return_weights=weights, **kw)
        bwd = call_backward(score, g, q, k, v, fwd, W,
                            saved=() if weights else ("lse",), **kw)
        results.append([fwd[0], fwd[1]] + [x for x in bwd if x is not None])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("weights", [True, False])
def test_nan_outside_every_window(weights, rng):
    """Keys (and values) no query's window reaches hold NaN: nothing
    sees them, forward or backward."""
    Tq, T = 200, 700
    q, k, v = problem(rng, np.float64, (2,), (2,), Tq, T)
    # queries see [i' - 10, i'] with i' = i + 500: keys < 490 never
    k[:, :480] = np.nan
    v[:, :480] = np.nan
    out, x = ac.dot_attention(q, k, values=v, window=(10, 0),
                              return_weights=weights)
    assert np.isfinite(out).all() and np.isfinite(x).all()
    g = rng.standard_normal(out.shape)
    saved = () if weights else ("lse",)
    grads = call_backward("dot", g, q, k, v, (out, x), window=(10, 0),
                          saved=saved)
    assert np.isfinite(grads.query).all()
    assert (grads.keys[:, :480] == 0).all()
    assert np.isfinite(grads.keys[:, 480:]).all()


# --------------------------------------------------------------------------
# Bad input: named, before any work

def bad(exc, match, **kw):
    q = np.zeros((2, 4, 8))
    k = np.zeros((2, 6, 8))
    with pytest.raises(exc, match=match):
        ac.dot_attention(q, k, **kw)
    g = np.zeros((2, 4, 8))
    with pytest.raises(exc, match=match):
        ac.dot_attention_backward(g, q, k, np.zeros((2, 4, 6)), **kw)


def test_bad_input():
    bad(ValueError, "window", window=(-1, 0))
    bad(ValueError, "window", window=(0, -3))
    bad(TypeError, "window", window=(1, 2, 3))
    bad(TypeError, "window", window=3)
    bad(TypeError, "window", window=(1.5, 0))
    bad(ValueError, "softcap", softcap=0.0)
    bad(ValueError, "softcap", softcap=-1.0)
    bad(ValueError, "softcap", softcap=float("nan"))
    bad(TypeError, "softcap", softcap="big")
    bad(ValueError, "softcap", softcap=float("inf"))


def test_softcap_beyond_float32():
    """A softcap beyond float32's range (found by the fuzzer: 1e-300 was
    passed on as 0, and the kernel refused its sizes) computes as the
    nearest positive finite float32, which gives the float64 result
    within float32 rounding: scores of about 0 for 1e-300, uncapped
    scores for 1e300."""
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((2, 1, 9, 4)) * 0.3
    for cap in (1e-300, 1e300):
        for fn in (ac.dot_attention, ac.cosine_attention):
            want = fn(q, k, softcap=cap)
            got = fn(q.astype(np.float32), k.astype(np.float32),
                     softcap=cap)
            for g, w in zip(got, want):
                assert np.allclose(g, w, rtol=1e-5, atol=1e-6), (fn, cap)
    cq, ck = np.array([0, 2, 4]), np.array([0, 3, 6])
    bad(ValueError, "cu_seqlens_k", cu_seqlens_q=cq)
    bad(ValueError, "cu_seqlens_q", cu_seqlens_k=ck)
    bad(ValueError, "cu_seqlens_k", cu_seqlens_q=cq,
        cu_seqlens_k=np.array([0, 6]))
    bad(ValueError, "cu_seqlens_q.*start", cu_seqlens_q=np.array([1, 2, 4]),
        cu_seqlens_k=ck)
    bad(ValueError, "cu_seqlens_q.*end", cu_seqlens_q=np.array([0, 2, 3]),
        cu_seqlens_k=ck)
    bad(ValueError, "cu_seqlens_k.*end", cu_seqlens_q=cq,
        cu_seqlens_k=np.array([0, 2, 7]))
    bad(ValueError, "cu_seqlens_k.*decrease", cu_seqlens_q=cq,
        cu_seqlens_k=np.array([0, 7, 6]))
    # the entry that decreases is named (it was hidden in "[0, ..., 6]")
    bad(ValueError, r"cu_seqlens_q\[1\] = -1 after 0",
        cu_seqlens_q=np.array([0, -1, 4]), cu_seqlens_k=ck)
    bad(ValueError, "cu_seqlens_q", cu_seqlens_q=cq[:, None],
        cu_seqlens_k=ck[:, None])
    bad(TypeError, "cu_seqlens_q.*integer",
        cu_seqlens_q=cq.astype(float), cu_seqlens_k=ck)
    bad(TypeError, "cu_seqlens_k.*integer", cu_seqlens_q=cq,
        cu_seqlens_k=ck.astype(bool))
    bad(ValueError, "cu_seqlens_q", cu_seqlens_q=np.array([], np.int64),
        cu_seqlens_k=np.array([], np.int64))
    # one query per sequence: no window, no segments (softcap applies)
    q1, k = np.zeros((2, 8)), np.zeros((2, 6, 8))
    with pytest.raises(ValueError, match="window"):
        ac.dot_attention(q1, k, window=(1, 1))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ac.dot_attention(q1, k, cu_seqlens_q=np.array([0, 1]),
                         cu_seqlens_k=np.array([0, 6]))
    assert np.isfinite(ac.dot_attention(q1, k, softcap=1.0)[0]).all()


def test_window_none_sides_are_no_restriction(rng):
    q, k, v = problem(rng, np.float64, (2,), (2,), 17, 17)
    for weights in (True, False):
        a = ac.dot_attention(q, k, values=v, window=(None, None),
                             return_weights=weights)
        b = ac.dot_attention(q, k, values=v, return_weights=weights)
        assert a[0].tobytes() == b[0].tobytes()
    a = ac.dot_attention(q, k, values=v, window=[np.int64(2), None])
    b = ac.dot_attention(q, k, values=v, window=(2, None))
    assert a[0].tobytes() == b[0].tobytes()


@pytest.mark.parametrize("causal", [False, True])
def test_window_sides_near_the_int_limit_are_no_restriction(causal, rng):
    """A side of 2**63 - 1 (sys.maxsize, a natural "unbounded") is the
    same as None, also for a query before the first key (more queries
    than keys: i' < 0): out, weights, lse and the backward of both paths,
    and cache_attention's window.  i' + side overflowed: such queries saw
    no key."""
    big = 2**63 - 1
    q, k, v = problem(rng, np.float64, (2,), (2,), 23, 17)
    for side in [(0, big), (big, big), (big, None), (None, big)]:
        want_side = tuple(None if x == big else x for x in side)
        for weights in (True, False):
            kw = dict(values=v, causal=causal, return_weights=weights)
            got = ac.dot_attention(q, k, window=side, **kw)
            want = ac.dot_attention(q, k, window=want_side, **kw)
            for g, w in zip(got, want):
                assert g.tobytes() == w.tobytes(), (side, weights)
            g = np.ones_like(got[0])
            back = {} if weights else {"out": got[0], "lse": got[1]}
            second = got[1] if weights else None
            dg = ac.dot_attention_backward(g, q, k, second, values=v,
                                           causal=causal, window=side,
                                           **back)
            dw = ac.dot_attention_backward(g, q, k, second, values=v,
                                           causal=causal, window=want_side,
                                           **back)
            for x, y in zip(dg, dw):
                assert x is None and y is None or x.tobytes() == y.tobytes()
    cache = rng.standard_normal((1, 9, 1, 4)).astype(np.float32)
    qc = rng.standard_normal((1, 3, 1, 4)).astype(np.float32)
    for side in [(big, big), (big, None), (None, big)]:
        got = ac.cache_attention(qc, cache, cache, [6], window=side,
                                 causal=causal)
        want = ac.cache_attention(qc, cache, cache, [6], causal=causal,
                                  window=tuple(None if x == big else x
                                               for x in side))
        assert got.tobytes() == want.tobytes(), side


# --------------------------------------------------------------------------
# Against attention_c.reference: every variant, random combinations


def combo(rng, Tq, T, several):
    """Random keyword arguments of a combination of variants (and of the
    existing arguments), for leading axes (2, 3) of the call."""
    kw = {}
    if rng.random() < 0.5:
        kw["window"] = tuple(None if rng.random() < 0.3
                             else int(rng.integers(0, 5)) for _ in range(2))
    if rng.random() < 0.5:
        kw["softcap"] = float(rng.uniform(0.5, 4))
    if rng.random() < 0.5:      # per head, broadcast over the batch
        kw["alibi_slopes"] = rng.uniform(0, 0.5, (3,) if rng.random() < .5
                                         else (2, 1))
    if rng.random() < 0.5:
        kw["sinks"] = rng.standard_normal((2, 3) if rng.random() < .5
                                          else ())
    if several and rng.random() < 0.4:
        n = int(rng.integers(1, 4))
        kw["cu_seqlens_q"], kw["cu_seqlens_k"] = cuts(rng, n, Tq), cuts(
            rng, n, T)
    if several and rng.random() < 0.4:
        kw["causal"] = True
    if rng.random() < 0.3:
        kw["mask"] = rng.random((2, 1, T)) > 0.2
    if several and rng.random() < 0.3:
        kw["attn_mask"] = rng.random((Tq, T)) > 0.2
    if rng.random() < 0.4:
        kw["bias"] = rng.standard_normal((3,) + ((Tq,) if several else ())
                                         + (T,))
    if rng.random() < 0.3:
        kw["dropout"], kw["seed"] = 0.25, int(rng.integers(0, 2**63))
    if not several:
        kw.pop("window", None)
    return kw


def as64(kw):
    return {n: (x.astype(np.float64) if isinstance(x, np.ndarray)
                and x.dtype.kind == "f" else x) for n, x in kw.items()}


def run_both(score, rng, dtype, Tq, T, several, weights):
    lead_q, lead_k = (2, 3), (2, 1) if rng.random() < 0.5 else (2, 3)
    H, Hv = 8, 5
    q = rng.standard_normal(lead_q + ((Tq,) if several else ()) + (H,))
    k = rng.standard_normal(lead_k + (T, H))
    v = rng.standard_normal(lead_k + (T, Hv))
    W = rng.standard_normal((H, H))
    kw = combo(rng, Tq, T, several)
    cast = {n: (x.astype(dtype) if isinstance(x, np.ndarray)
                and x.dtype.kind == "f" else x) for n, x in kw.items()}
    args = [q, k] if score == "dot" else [q, k, W]
    fn = getattr(ac, score + "_attention")
    rfn = getattr(ref, score + "_attention")
    got = fn(*[a.astype(dtype) for a in args], values=v.astype(dtype),
             return_weights=weights, **cast)
    want = rfn(*args, values=v, return_weights=weights, **as64(kw))
    return args, v, kw, cast, got, want


@pytest.mark.parametrize("score", ["dot", "general"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("several", [True, False])
def test_combinations_against_reference(score, dtype, weights, several, rng):
    """Random combinations of every variant with mask, attn_mask, causal,
    bias, dropout and broadcast (GQA-style) keys, over odd sizes, forward
    and backward (alpha, or out= and lse=), against the reference."""
    for trial in range(12):
        Tq = int(rng.choice(SIZES)) if several else 1
        T = int(rng.choice(SIZES))
        args, v, kw, cast, got, want = run_both(score, rng, dtype, Tq, T,
                                                several, weights)
        what = f"{score} Tq={Tq} T={T} {sorted(kw)}"
        close(got[0], want[0], dtype, "out " + what)
        if weights:
            close(got[1], want[1], dtype, "alpha " + what)
        else:
            fin = np.isfinite(want[1])
            assert (np.isfinite(got[1]) == fin).all(), what
            close(got[1][fin], want[1][fin], dtype, "lse " + what)
        if weights and "sinks" in kw:
            continue                      # the backward needs out and lse
        g = rng.standard_normal(got[0].shape)
        bfn = getattr(ac, score + "_attention_backward")
        rbfn = getattr(ref, score + "_attention_backward")
        saved_c = ({"out": got[0], "lse": got[1]} if not weights else {})
        saved_r = ({"out": want[0], "lse": want[1]} if not weights else {})
        gc = bfn(g.astype(dtype), *[a.astype(dtype) for a in args],
                 got[1] if weights else None, values=v.astype(dtype),
                 **saved_c, **cast)
        gr = rbfn(g, *args, want[1] if weights else None, values=v,
                  **saved_r, **as64(kw))
        assert gc._fields[-2:] == ("alibi_slopes", "sinks")
        # gradients cancel (one visible key: dquery = 0): their terms'
        # size, |g| max|v| (|q| + |k|), is the floor
        bound = np.linalg.norm(g) * np.abs(v).max() * (
            np.linalg.norm(args[0]) + np.linalg.norm(args[1]))
        for name, a, b in zip(gc._fields, gc, gr):
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.shape == b.shape and a.dtype == dtype, name
                close(a, b, dtype, f"d{name} {what}", bound=bound)


@pytest.mark.parametrize("score", ["dot", "general"])
@pytest.mark.parametrize("simd", SIMD_PATHS)
def test_slopes_and_sinks_gradients(score, simd, rng, restore_config):
    """dslopes and dsinks (broadcast: summed back to their shapes) against
    finite differences of sum(out * g), with softcap, a window and
    segments, on every SIMD path."""
    _core._set_simd(simd)
    Tq, T = 7, 9
    q = rng.standard_normal((2, 3, Tq, 4))
    k = rng.standard_normal((2, 1, T, 4))
    v = rng.standard_normal((2, 1, T, 3))
    W = rng.standard_normal((4, 4))
    slopes, sinks = rng.uniform(0, 0.5, (3,)), rng.standard_normal((2, 1))
    kw = {"softcap": 2.0, "window": (4, 1), "alibi_slopes": slopes,
          "sinks": sinks, "cu_seqlens_q": np.array([0, 2, 7]),
          "cu_seqlens_k": np.array([0, 4, 9])}
    args = [q, k] if score == "dot" else [q, k, W]
    fn = getattr(ac, score + "_attention")
    g = rng.standard_normal((2, 3, Tq, 3))
    out, lse = fn(*args, values=v, return_weights=False, **kw)
    grads = getattr(ac, score + "_attention_backward")(
        g, *args, None, out=out, lse=lse, values=v, **kw)

    def loss():
        return float((fn(*args, values=v, **kw)[0] * g).sum())

    for name, x in [("alibi_slopes", slopes), ("sinks", sinks),
                    ("query", q), ("keys", k)]:
        got = getattr(grads, name)
        assert got.shape == x.shape
        assert rel_err(got, numerical_grad(loss, x)) < 1e-6, name


@pytest.mark.parametrize("weights", [True, False])
def test_sinks_no_visible_key(weights, rng):
    """A query that sees no key: out 0 and lse = its sink; the weights of
    the others sum to less than 1."""
    q, k, v = problem(rng, np.float64, (2,), (2,), 4, 6)
    attn = np.ones((4, 6), bool)
    attn[1] = False
    sinks = np.array([0.5, -1.0])
    out, w = ac.dot_attention(q, k, values=v, attn_mask=attn, sinks=sinks,
                              return_weights=weights)
    assert (out[:, 1] == 0).all()
    if weights:
        assert (w[:, 1] == 0).all()
        assert (w.sum(-1)[:, [0, 2, 3]] < 1).all()
    else:
        assert (w[:, 1] == sinks).all()


def test_variant_bad_input():
    bad(ValueError, "alibi_slopes", alibi_slopes=np.zeros(3))
    bad(ValueError, "sinks", sinks=np.zeros((2, 2)))
    bad(TypeError, "alibi_slopes", alibi_slopes=np.zeros(2, bool))
    q, k = np.zeros((2, 4, 8)), np.zeros((2, 6, 8))
    with pytest.raises(ValueError, match="sinks.*alpha"):
        ac.dot_attention_backward(np.zeros((2, 4, 8)), q, k,
                                  np.full((2, 4, 6), 1 / 6),
                                  sinks=np.zeros(2))


def test_slopes_and_sinks_follow_the_dtype(rng):
    """float64 slopes and sinks in a float32 call: computed in float32,
    their gradients float32 in their own shapes."""
    q, k, v = problem(rng, np.float32, (2,), (2,), 5, 7)
    out, lse = ac.dot_attention(q, k, values=v, alibi_slopes=np.ones(1),
                                sinks=np.zeros(2), return_weights=False)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    g = ac.dot_attention_backward(out, q, k, out=out, lse=lse, values=v,
                                  alibi_slopes=np.ones(1), sinks=np.zeros(2))
    assert g.alibi_slopes.dtype == np.float32 and g.alibi_slopes.shape == (1,)
    assert g.sinks.dtype == np.float32 and g.sinks.shape == (2,)


# --------------------------------------------------------------------------
# Allocation failures with every variant (the new allocation points: the
# cu_seqlens' conversion, the views of the slopes and the sinks and of
# their gradients)

def test_every_allocation_point_with_the_variants(rng, restore_config):
    import gc
    import tracemalloc

    from attention_c import _core_tests as hooks
    q, k, v = problem(rng, np.float64, (2, 3), (2, 1), 7, 9)
    kw = {"values": v, "window": (3, 1), "softcap": 2.0, "causal": True,
          "alibi_slopes": np.full((3,), 0.25, np.float32),
          "sinks": np.zeros((2, 1)), "cu_seqlens_q": [0, 3, 7],
          "cu_seqlens_k": np.array([0, 4, 9], np.int32)}
    out, lse = ac.dot_attention(q, k, return_weights=False, **kw)
    calls = [("dot_attention", (q, k), dict(kw, return_weights=False)),
             ("dot_attention_backward", (out, q, k),
              dict(kw, out=out, lse=lse))]
    for fn, args, kws in calls:
        func = getattr(hooks, fn)
        base = func(*args, **kws)
        hooks._fail_alloc_after(-1, trace=True)
        func(*args, **kws)
        names = hooks._alloc_trace()
        for want in ("conversion of cu_seqlens_q", "offsets of sinks",
                     "offsets of alibi_slopes"):
            assert any(n.startswith(want) for n in names), (want, names)

        def walk():
            for n, name in enumerate(names):
                hooks._fail_alloc_after(n)
                try:
                    if name == "thread pool":
                        func(*args, **kws)
                    else:
                        with pytest.raises(MemoryError):
                            func(*args, **kws)
                finally:
                    hooks._fail_alloc_after(-1)
                for a, b in zip(func(*args, **kws), base):
                    assert (a is None and b is None) or np.array_equal(a, b)

        walk()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(3):
                walk()
            gc.collect()
            grew = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grew < 32 * 1024, (fn, grew)
