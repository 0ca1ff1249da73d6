"""Allocation failures: every allocation point of every function.

The binding passes an allocation point before each allocation it makes or
asks NumPy for (converting or casting an argument, each output, the
kernels' scratch, the thread pool).  The tests' extension
``attention_c._core_tests`` (the binding built with ATT_TEST_HOOKS; the
production ``_core`` has no hooks) counts them, and its
``_fail_alloc_after(n)`` makes point n fail once as if memory had run out.
For every function of ``_core_tests`` and a few argument variants, the
tests walk n over all the points of the call: each
gives MemoryError (the thread pool instead falls back to the calling
thread and gives the exact result), leaks nothing, leaves every argument's
refcount as it was, and the next call gives the same result as before.
"""

import gc
import sys
import tracemalloc

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, _core_tests as hooks, reference
from attention_c.testing import Problem, record_figure

FAMILY = ["additive_attention", "additive_attention_backward",
          "dot_attention", "dot_attention_backward", "general_attention",
          "general_attention_backward", "location_attention",
          "location_attention_backward", "cosine_attention",
          "cosine_attention_backward", "project_keys",
          "project_keys_backward"]
FUNCS = ["mean_context", "mean_context_backward", "additive_score",
         "additive_score_backward", "masked_softmax",
         "masked_softmax_backward", "weighted_sum", "weighted_sum_backward",
         "context_attention", "context_attention_backward"] + FAMILY
# the functions that run on the thread pool with kept scratch memory
FUSED = {"context_attention", "context_attention_backward"} | set(FAMILY)
HOOKS = {"_fail_alloc_after", "_alloc_count", "_alloc_trace", "_tanh",
         "_keep_row"}

# the tests' extension on the SIMD path the package uses (ATTENTION_C_SIMD)
hooks._set_simd(_core._get_simd())


def test_hooks_only_in_the_tests_extension():
    """_core, the extension users get, has none of the tests' hooks;
    _core_tests has them and the same functions as _core."""
    assert not HOOKS & set(dir(_core)) and not HOOKS & set(dir(ac))
    assert HOOKS <= set(dir(hooks))
    public = {n for n in dir(_core) if not n.startswith("_")}
    assert public == {n for n in dir(hooks) if not n.startswith("_")}
    assert set(FUNCS) <= public


def _family_calls(rng):
    """Keyword arguments of every family function with every optional
    argument given: several queries, a key mask, a per-query attn_mask
    and causal (a query with no visible key), for dot/general a bias that
    broadcasts over the batch (an "offsets of" view) and dropout, values
    as wide as the keys (so that leaving values out keeps grad_out's
    shape)."""
    lead, Tq, T, H, Hq, A = (3,), 2, 5, 4, 3, 6
    keys = rng.standard_normal(lead + (T, H))
    values = rng.standard_normal(lead + (T, H))
    q = rng.standard_normal(lead + (Tq, Hq))
    q_dot = rng.standard_normal(lead + (Tq, H))
    key_mask = rng.random(lead + (T,)) < 0.8
    key_mask[..., -1] = True                    # causal's first key
    attn_mask = rng.random(lead + (Tq, T)) < 0.7
    attn_mask[..., -1] = True
    attn_mask[1, 1] = False                     # a query with no valid key
    masks = dict(mask=key_mask, attn_mask=attn_mask, causal=True)
    bias = rng.standard_normal((1, Tq, T))
    drop = dict(dropout=0.25, seed=2 ** 40 + 7)
    W_add = rng.standard_normal((A, H + Hq)) / 3
    v, b = rng.standard_normal(A), rng.standard_normal(A)
    W_gen = rng.standard_normal((Hq, H)) / 2
    G = rng.standard_normal(lead + (Tq, H))
    Ga = rng.standard_normal(lead + (Tq, T))
    add = dict(query=q, keys=keys, W=W_add, v=v, b=b, **masks,
               values=values, key_proj=reference.project_keys(keys, W_add))
    dot = dict(query=q_dot, keys=keys, **masks, bias=bias, **drop,
               values=values, scale=0.5)
    gen = dict(query=q, keys=keys, W=W_gen, **masks, bias=bias, **drop,
               values=values, key_proj=reference.project_keys(keys, W_gen))
    # location: W shared by the batch (an "indices of" table); cosine: a
    # sharpness per query position, broadcast over the batch
    loc = dict(query=q, values=values, W=rng.standard_normal((T + 2, Hq)),
               b=rng.standard_normal(T + 2), mask=key_mask,
               attn_mask=attn_mask)
    cos = dict(dot, sharpness=1 + rng.random(Tq))
    del cos["scale"]
    a_add = reference.additive_attention(**add)[1]
    a_dot = reference.dot_attention(**dot)[1]
    a_gen = reference.general_attention(**gen)[1]
    a_loc = reference.location_attention(**loc)[1]
    a_cos = reference.cosine_attention(**cos)[1]
    return {
        "additive_attention": add,
        "additive_attention_backward": dict(add, grad_out=G, alpha=a_add,
                                            grad_alpha=Ga),
        "dot_attention": dot,
        "dot_attention_backward": dict(dot, grad_out=G, alpha=a_dot,
                                       grad_alpha=Ga),
        "general_attention": gen,
        "general_attention_backward": dict(gen, grad_out=G, alpha=a_gen,
                                           grad_alpha=Ga),
        "location_attention": loc,
        "location_attention_backward": dict(loc, grad_out=G, alpha=a_loc,
                                            grad_alpha=Ga),
        "cosine_attention": cos,
        "cosine_attention_backward": dict(cos, grad_out=G, alpha=a_cos,
                                          grad_alpha=Ga),
        "project_keys": dict(keys=keys, W=W_add),
        "project_keys_backward": dict(
            grad_proj=rng.standard_normal(lead + (T, A)), keys=keys,
            W=W_add),
    }


def _lse_variant(fn, full):
    """A dot/general call of docs/contract.md 5.3: the forward with
    return_weights=False (out, lse), the backward from out= and lse=
    instead of alpha."""
    if fn.endswith("_backward"):
        fwd = {k: a for k, a in full.items()
               if k not in ("grad_out", "alpha", "grad_alpha")}
        out, lse = getattr(ac, fn.removesuffix("_backward"))(
            **fwd, return_weights=False)
        return dict(fwd, grad_out=full["grad_out"], out=out, lse=lse)
    return dict(full, return_weights=False)


def _variants(fn, rng):
    """(label, kwargs) calls of fn: float64 with every optional argument,
    and float32 Fortran-ordered (every argument cast and copied) with
    none."""
    if fn in FAMILY:
        return _family_variants(fn, rng)
    p = Problem(rng, (3,), 5, 4, 6)
    alpha = reference.masked_softmax(p.grad_s * 2, mask=p.mask)
    full = {
        "mean_context": dict(h=p.h, mask=p.mask),
        "mean_context_backward": dict(grad_c=p.grad_out, h=p.h, mask=p.mask),
        "additive_score": dict(h=p.h, context=p.context, W=p.W, v=p.v,
                               b=p.b),
        "additive_score_backward": dict(grad_s=p.grad_s, h=p.h,
                                        context=p.context, W=p.W, v=p.v,
                                        b=p.b),
        "masked_softmax": dict(scores=p.grad_s, mask=p.mask),
        "masked_softmax_backward": dict(grad_alpha=p.grad_alpha,
                                        alpha=alpha),
        "weighted_sum": dict(alpha=alpha, h=p.h),
        "weighted_sum_backward": dict(grad_out=p.grad_out, alpha=alpha,
                                      h=p.h),
        "context_attention": dict(h=p.h, W=p.W, v=p.v, b=p.b, mask=p.mask,
                                  keep_activations=True),
        "context_attention_backward": dict(
            grad_out=p.grad_out, h=p.h, W=p.W, v=p.v, alpha=alpha, b=p.b,
            mask=p.mask, grad_alpha=p.grad_alpha,
            activations=ac.context_attention(p.h, p.W, p.v, b=p.b, mask=p.mask,
                                             keep_activations=True)[2]),
    }[fn]
    optional = {"mask", "b", "activations", "keep_activations"}
    if fn == "context_attention_backward":
        optional.add("grad_alpha")
    bare = _forward_alpha(fn, {
        k: np.asfortranarray(np.asarray(v, np.float32))
        for k, v in full.items() if k not in optional})
    return [("float64, all optional arguments", full),
            ("float32 Fortran order, no optional argument", bare)]


def _family_variants(fn, rng):
    """The same two variants for a family function; a dot/general one
    also with (out, lse) instead of the weights (docs/contract.md 5.3)."""
    full = _family_calls(rng)[fn]
    optional = {"b", "mask", "attn_mask", "causal", "bias", "dropout",
                "seed", "values", "key_proj", "scale", "grad_alpha",
                "sharpness"}
    if fn.startswith("location"):         # its values are required
        optional.remove("values")
    bare = _forward_alpha(fn, {
        k: np.asfortranarray(np.asarray(v, np.float32))
        for k, v in full.items() if k not in optional})
    variants = [("float64, all optional arguments", full),
                ("float32 Fortran order, no optional argument", bare)]
    if fn.startswith(("dot", "general", "cosine")):
        variants.append(("float64, out and lse", _lse_variant(fn, full)))
    return variants


def _forward_alpha(fn, kw):
    """kw with a backward's alpha from its forward on the same arguments:
    alpha must be 0 exactly where the mask is False (the binding checks),
    so leaving the mask out changes alpha."""
    if not (fn.endswith("attention_backward") and "alpha" in kw):
        return kw
    forward = getattr(ac, fn.removesuffix("_backward"))
    args = {k: v for k, v in kw.items()
            if k not in ("grad_out", "alpha", "grad_alpha", "activations")}
    return dict(kw, alpha=np.asfortranarray(forward(**args)[1]))


def _results(res):
    return tuple(res) if isinstance(res, tuple) else (res,)


def _assert_same(got, want, what):
    got, want = _results(got), _results(want)
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        if w is None:
            assert g is None, what
        else:
            assert g.dtype == w.dtype and np.array_equal(g, w), what


def _fresh_pool(fn):
    """Makes the next fused call create its thread pool (an allocation
    point) by dropping the current one."""
    if fn in FUSED:
        n = hooks._get_num_threads()
        hooks._set_num_threads(1 if n > 1 else 2)
        hooks._set_num_threads(max(n, 2))


def _walk(fn, kw, baseline):
    """Fails each allocation point of fn(**kw) in turn; returns the point
    names."""
    func = getattr(hooks, fn)
    _fresh_pool(fn)
    hooks._fail_alloc_after(-1, trace=True)
    _assert_same(func(**kw), baseline, f"{fn} traced")
    names = hooks._alloc_trace()
    assert hooks._alloc_count() == len(names) > 0
    for k, name in enumerate(names):
        _fresh_pool(fn)
        hooks._fail_alloc_after(k)
        try:
            if name == "thread pool":
                # no pool: the call runs on the calling thread, same bits
                _assert_same(func(**kw), baseline, f"{fn} without a pool")
            else:
                with pytest.raises(MemoryError, match="injected"):
                    func(**kw)
        finally:
            hooks._fail_alloc_after(-1)
        # the failure left nothing behind
        _assert_same(func(**kw), baseline, f"{fn} after failing {name}")
    return names


@pytest.fixture
def threads_restored():
    n = hooks._get_num_threads()
    yield
    hooks._fail_alloc_after(-1)
    hooks._set_num_threads(n)


@pytest.mark.parametrize("fn", FUNCS)
def test_every_allocation_point_fails_cleanly(fn, rng, threads_restored):
    """Each point gives MemoryError (or, for the pool, the exact result);
    no leak (tracemalloc) and unchanged refcounts over repeated walks."""
    if fn in FUSED:
        hooks._set_num_threads(2)
    total = 0
    for label, kw in _variants(fn, rng):
        baseline = getattr(hooks, fn)(**kw)
        _assert_same(getattr(ac, fn)(**kw), baseline, f"{fn}: _core_tests")
        names = _walk(fn, kw, baseline)               # warm-up walk
        total += len(names)
        assert any(n.startswith("output") for n in names), names
        if fn in FUSED:
            assert "thread pool" in names and "scratch memory" in names
        # the arguments read in place through broadcast views
        for arg in ("mask", "attn_mask", "bias"):
            if fn in FAMILY and kw.get(arg) is not None:
                assert f"offsets of {arg}" in names, (fn, arg, names)
        # (not the bool singletons: their counts move with everything else
        # the interpreter does, e.g. on the first walk in a fresh process)
        objs = [o for o in kw.values() if not isinstance(o, bool)]
        refs = [sys.getrefcount(o) for o in objs]
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(10):
                _walk(fn, kw, baseline)
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert after - before < 32 * 1024, (
            f"{fn} ({label}): traced memory grew by {after - before} bytes "
            f"over 10 walks of {len(names)} failing points")
        assert [sys.getrefcount(o) for o in objs] == refs, (fn, label)
    record_figure(f"allocation points walked: {fn}", total)
    record_figure("allocation points walked: total", total, add=True)


def test_fail_alloc_after_validates_and_is_one_shot(rng):
    p = Problem(rng, (2,), 3, 2, 2)
    with pytest.raises(ValueError):
        hooks._fail_alloc_after(-2)
    hooks._fail_alloc_after(0)
    with pytest.raises(MemoryError):
        hooks.mean_context(p.h)
    assert hooks._alloc_trace() is None
    hooks.mean_context(p.h)               # one failure only
    hooks._fail_alloc_after(-1)
    hooks.mean_context(p.h)
    assert hooks._alloc_count() == 3      # conversion, cast, output c


# --------------------------------------------------------------------------
# Sizes whose byte count overflows: refused before any output or scratch
# is allocated.

TWO31 = 2 ** 31


def _zero_strided(shape, dtype=np.int8):
    seed = np.ones(1, dtype)
    return np.lib.stride_tricks.as_strided(seed, shape=shape,
                                           strides=(0,) * len(shape))


def _overflow_cases():
    """(fn, kwargs): int8 inputs that exist (< 2**63 bytes) but whose
    float64 outputs, or float64 copies, would need >= 2**63 bytes."""
    B, T = TWO31, TWO31
    e = np.zeros((B, T, 0), np.int8)            # empty h, (B, T) outputs
    big = _zero_strided((2 ** 21, 2 ** 21, 2 ** 20))   # 2**62 items
    bT = _zero_strided((2 ** 31, 2 ** 31))              # (B, T), 2**62 items
    bH = _zero_strided((2 ** 21, 2 ** 20))              # (B, H) for big
    W0, v3 = np.zeros((3, 0), np.int8), np.zeros(3, np.int8)
    return [
        ("mean_context", dict(h=big)),
        ("mean_context_backward", dict(grad_c=bH, h=big)),
        ("additive_score", dict(h=e, context=np.zeros((B, 0), np.int8),
                                W=W0, v=v3)),
        ("additive_score_backward", dict(grad_s=bT, h=e,
                                         context=np.zeros((B, 0), np.int8),
                                         W=W0, v=v3)),
        ("masked_softmax", dict(scores=bT)),
        ("masked_softmax_backward", dict(grad_alpha=bT, alpha=bT)),
        ("weighted_sum", dict(alpha=bT, h=e)),
        ("weighted_sum_backward", dict(grad_out=np.zeros((B, 0), np.int8),
                                       alpha=bT, h=e)),
        ("context_attention", dict(h=e, W=W0, v=v3)),
        ("context_attention_backward", dict(
            grad_out=np.zeros((B, 0), np.int8), h=e, W=W0, v=v3, alpha=bT)),
    ] + _family_overflow_cases()


def _family_overflow_cases():
    """The same for the family: one query per sequence with (B, T)
    weights, and several queries whose (B, Tq, T) weights alone would need
    2**65 bytes (refused by the binding's own check)."""
    B, T = TWO31, TWO31
    e = np.zeros((B, T, 0), np.int8)
    q = np.zeros((B, 0), np.int8)
    bT = _zero_strided((B, T))
    W0, v3, Wg = np.zeros((3, 0), np.int8), np.zeros(3, np.int8), \
        np.zeros((0, 0), np.int8)
    qs = np.zeros((2 ** 20, 2 ** 22, 0), np.int8)     # Tq = T = 2**22
    return [
        ("dot_attention", dict(query=q, keys=e)),
        ("dot_attention_backward", dict(grad_out=q, query=q, keys=e,
                                        alpha=bT)),
        ("additive_attention", dict(query=q, keys=e, W=W0, v=v3)),
        ("additive_attention_backward", dict(grad_out=q, query=q, keys=e,
                                             W=W0, v=v3, alpha=bT)),
        ("general_attention", dict(query=q, keys=e, W=Wg)),
        ("general_attention_backward", dict(grad_out=q, query=q, keys=e,
                                            W=Wg, alpha=bT)),
        ("location_attention", dict(query=q, values=e,
                                    W=np.zeros((T, 0), np.int8))),
        ("location_attention_backward", dict(
            grad_out=q, query=q, values=e, W=np.zeros((T, 0), np.int8),
            alpha=bT)),
        ("cosine_attention", dict(query=q, keys=e)),
        ("cosine_attention_backward", dict(grad_out=q, query=q, keys=e,
                                           alpha=bT)),
        ("project_keys", dict(keys=e, W=np.zeros((8, 0), np.int8))),
        ("project_keys_backward", dict(
            grad_proj=_zero_strided((2 ** 21, 2 ** 21, 2 ** 20)),
            keys=np.zeros((2 ** 21, 2 ** 21, 0), np.int8),
            W=np.zeros((2 ** 20, 0), np.int8))),
        ("dot_attention", dict(query=qs, keys=qs)),
        ("additive_attention", dict(query=qs, keys=qs, W=W0, v=v3)),
        ("general_attention", dict(query=qs, keys=qs, W=Wg)),
        ("cosine_attention", dict(query=qs, keys=qs)),
    ]


@pytest.mark.parametrize("case", _overflow_cases(), ids=lambda c: c[0])
def test_overflowing_byte_counts_refused_before_allocation(case, rng):
    fn, kw = case
    hooks._fail_alloc_after(-1, trace=True)
    try:
        with pytest.raises((MemoryError, ValueError)):
            getattr(hooks, fn)(**kw)
        names = hooks._alloc_trace()
    finally:
        hooks._fail_alloc_after(-1)
    made = [n for n in names if n.startswith(("output", "scratch"))]
    assert not made, f"{fn} allocated {made} before refusing the sizes"
    # and the next call is right
    p = Problem(rng, (2,), 3, 4, 5)
    out, alpha = ac.context_attention(p.h, p.W, p.v, b=p.b, mask=p.mask)
    r_out, r_alpha = reference.context_attention(p.h, p.W, p.v, b=p.b,
                                                 mask=p.mask)
    np.testing.assert_allclose(out, r_out, rtol=1e-12, atol=1e-14)


def test_empty_output_with_absurd_dims_is_memory_error():
    """Empty float32 h (2**30, 2**30, 0) exists; its activations (B, T, A)
    with A = 8 would need 2**65 bytes: MemoryError naming the output, from
    the binding's own check, before alpha (2**62 bytes) is tried."""
    h = np.zeros((2 ** 30, 2 ** 30, 0), np.float32)
    W, v = np.zeros((8, 0), np.float32), np.zeros(8, np.float32)
    hooks._fail_alloc_after(-1, trace=True)
    try:
        with pytest.raises(MemoryError, match="activations"):
            hooks.context_attention(h, W, v, keep_activations=True)
        assert not [n for n in hooks._alloc_trace() if "output" in n]
    finally:
        hooks._fail_alloc_after(-1)
