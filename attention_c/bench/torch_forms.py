"""The PyTorch forms the benchmarks time: of the layer, eager PyTorch in
its best form and in the seed's and ``torch.compile`` of the best form; of
the attention family, eager PyTorch in the form of each case (and
``F.scaled_dot_product_attention`` for dot).  torch is passed in: it is
optional."""

import math
import time

import numpy as np


def torch_forms(torch):
    """The eager PyTorch forms of the layer, ``(best, seed)``.

    Both map tensors (h, W, v, b, mask) to (out, alpha) with the contract's
    masking: masked items get exactly 0 weight, and a row with no valid
    item gives zeros (and zero gradients), not NaN.  With mask None (full
    sequences) they do no masking work at all, as a user with full
    sequences would write them.  These are the forms timed, written as
    fast as eager PyTorch allows; the tests' reference is
    ``attention_c.testing.torch_context_attention``.
    """
    linear = torch.nn.functional.linear

    def mean_context(h, mask):
        if mask is None:
            return h.mean(1)                               # (B, H)
        m = mask.to(h.dtype).unsqueeze(1)                  # (B, 1, T)
        n = m.sum(-1).clamp_min(1)                         # (B, 1)
        return torch.bmm(m, h).squeeze(1) / n              # (B, H)

    def softmax_and_sum(z, v, h, mask):
        s = torch.tanh(z) @ v
        if mask is None:
            alpha = torch.softmax(s, -1)
        else:
            # An all-masked row: softmax gives NaN, replaced by exact 0.
            alpha = torch.softmax(s.masked_fill(~mask, -math.inf),
                                  -1).masked_fill(~mask, 0.0)
        return torch.bmm(alpha.unsqueeze(1), h).squeeze(1), alpha

    def best(h, W, v, b, mask):
        H = h.shape[-1]
        c = mean_context(h, mask=mask)
        z = linear(h, W[:, :H], b) + linear(c, W[:, H:]).unsqueeze(1)
        return softmax_and_sum(z, v, h, mask)

    def seed(h, W, v, b, mask):
        c = mean_context(h, mask=mask).unsqueeze(1).expand_as(h)
        return softmax_and_sum(linear(torch.cat([h, c], -1), W, b), v, h,
                               mask)

    return best, seed


def torch_tensors(torch, p):
    """The problem as tensors sharing its memory; h, W, v, b require grad;
    mask None stays None (full sequences)."""
    t = {k: None if p[k] is None else torch.from_numpy(p[k])
         for k in ("h", "W", "v", "b", "G", "mask")}
    for k in ("h", "W", "v", "b"):
        t[k].requires_grad_(True)
    return t


def torch_functions(torch, layer, t, prefix):
    """Forward (no grad) and forward + backward (autograd) of ``layer``."""
    args = tuple(t[k] for k in ("h", "W", "v", "b", "mask"))
    params = args[:4]

    def forward():
        with torch.no_grad():
            return layer(*args)

    def forward_backward():
        out, _ = layer(*args)
        return torch.autograd.grad((out * t["G"]).sum(), params)

    return {f"{prefix}_fwd": forward, f"{prefix}_fwdbwd": forward_backward}


def compile_best(torch, best, t):
    """``torch.compile`` of the best form, compiled now so no compiling is
    timed.  Returns (compiled layer, its timing functions, seconds taken).

    Inductor specialises its C++ kernels on the thread count, so Dynamo's
    caches are reset first.
    """
    torch._dynamo.reset()
    start = time.perf_counter()
    layer = torch.compile(best, dynamic=False)
    funcs = torch_functions(torch, layer, t, "compile")
    for fn in funcs.values():
        fn()
    return layer, funcs, time.perf_counter() - start


def torch_result(torch, layer, t):
    """(out, alpha, dh, dW, dv, db) from a PyTorch form."""
    params = tuple(t[k] for k in ("h", "W", "v", "b"))
    out, alpha = layer(*params, t["mask"])
    grads = torch.autograd.grad((out * t["G"]).sum(), params)
    return tuple(x.detach().numpy() for x in (out, alpha, *grads))


# --------------------------------------------------------------------------
# The attention family

def stack_steps(steps):
    """Per-step result dicts -> one dict of arrays with a leading step axis."""
    return {k: np.stack([s[k] for s in steps]) for k in steps[0]}


def _masked_softmax(torch, scores, mask):
    """Softmax over the last axis; masked scores get exactly 0 weight (no
    row is fully masked here)."""
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, -1)


def family_forms(torch, case, p, dtype):
    """{name: (forward, forward + backward, results)} of the PyTorch forms
    of one case of the family's benchmark (attention_c.bench.family) in
    ``dtype``: 'torch' (eager, the same form as ours) and,
    for dot, 'sdpa' (F.scaled_dot_product_attention with the same mask)
    and on causal rows 'sdpa_causal' (is_causal=True)."""
    F = torch.nn.functional

    def leaf(x):
        return torch.tensor(np.asarray(x, dtype)).requires_grad_(True)

    def const(x):
        return None if x is None else torch.tensor(
            x if x.dtype == bool else np.asarray(x, dtype))

    mask, G = const(p["mask"]), const(p["G"])
    k = leaf(p["keys"])
    vals = leaf(p["values"]) if "values" in p else None
    forms = {}

    def autograd(forward, params, names, extra=None):
        def fwd():
            with torch.no_grad():
                return forward()

        def fwdbwd():
            out = forward()
            out = out if isinstance(out, tuple) else (out, None)
            return out, torch.autograd.grad(out[0], params, G)

        def results(r):
            (out, alpha), grads = r
            found = {"out": out, "alpha": alpha, **dict(zip(names, grads))}
            if extra:
                found = extra(found)
            return {n: x.detach().numpy() for n, x in found.items()
                    if x is not None}

        return fwd, fwdbwd, results

    if case == "additive":
        # d2l: W_q = Linear(Hq, A), W_k = Linear(H, A), w_v = Linear(A, 1),
        # all bias=False; W = [W_k | W_q].
        H = p["keys"].shape[-1]
        q = leaf(p["query"])
        W_k, W_q = leaf(p["W"][:, :H]), leaf(p["W"][:, H:])
        w_v = leaf(p["v"][None, :])
        key_mask = None if mask is None else mask.unsqueeze(1)

        def join_weights(r):
            W = torch.cat([r.pop("dW_k"), r.pop("dW_q")], 1)
            return {**r, "dW": W, "dv": r.pop("dv").reshape(-1)}

        def additive():
            features = (F.linear(q, W_q).unsqueeze(2)
                        + F.linear(k, W_k).unsqueeze(1))    # (B, Tq, T, A)
            scores = F.linear(torch.tanh(features), w_v).squeeze(-1)
            alpha = _masked_softmax(torch, scores, key_mask)
            return torch.bmm(alpha, vals), alpha

        forms["torch"] = autograd(
            additive, (q, k, vals, W_k, W_q, w_v),
            ("dquery", "dkeys", "dvalues", "dW_k", "dW_q", "dv"),
            join_weights)
    elif case in ("decoder", "decoder_once"):
        H = p["keys"].shape[-1]
        Q = [leaf(qs) for qs in p["query"]]
        W_k, W_q = leaf(p["W"][:, :H]), leaf(p["W"][:, H:])
        w_v = leaf(p["v"][None, :])
        params = (k, W_k, W_q, w_v)

        def step(K, q):
            features = F.linear(q, W_q).unsqueeze(1) + K     # (B, T, A)
            scores = F.linear(torch.tanh(features), w_v).squeeze(-1)
            alpha = _masked_softmax(torch, scores, mask)
            return torch.bmm(alpha.unsqueeze(1), k).squeeze(1), alpha

        def fwd():
            with torch.no_grad():
                K = F.linear(k, W_k)              # once per sequence
                return [step(K, q) for q in Q]

        def fwdbwd_each():
            K = F.linear(k, W_k)                  # once per sequence
            steps = []
            for q, g in zip(Q, G):
                out, alpha = step(K, q)
                steps.append((out, alpha, torch.autograd.grad(
                    out, (q, *params), g, retain_graph=True)))
            return steps

        def results_each(steps):
            found = []
            for out, alpha, (dq, dk, dW_k, dW_q, dv) in steps:
                found.append({n: x.detach().numpy() for n, x in (
                    ("out", out), ("alpha", alpha), ("dquery", dq),
                    ("dkeys", dk), ("dW", torch.cat([dW_k, dW_q], 1)),
                    ("dv", dv.reshape(-1)))})
            return stack_steps(found)

        def fwdbwd_once():
            # what autograd does for a loss summed over the steps: each
            # step's backward reaches K (a leaf here, accumulating), and
            # K = W_k(keys) is differentiated once
            for t in (*Q, *params):
                t.grad = None                 # zero_grad, as a step does
            K = F.linear(k, W_k)
            K_leaf = K.detach().requires_grad_()
            steps = []
            for q, g in zip(Q, G):
                out, alpha = step(K_leaf, q)
                out.backward(g)
                steps.append((out, alpha))
            K.backward(K_leaf.grad)
            return steps

        def results_once(steps):
            found = stack_steps([{"out": o.detach().numpy(),
                                  "alpha": a.detach().numpy()}
                                 for o, a in steps])
            grads = {"dquery": np.stack([q.grad.numpy() for q in Q]),
                     "dkeys": k.grad.numpy(),
                     "dW": torch.cat([W_k.grad, W_q.grad], 1).numpy(),
                     "dv": w_v.grad.reshape(-1).numpy()}
            return dict(found, **grads)

        forms["torch"] = ((fwd, fwdbwd_each, results_each)
                          if case == "decoder" else
                          (fwd, fwdbwd_once, results_once))
    else:
        q = leaf(p["query"])
        names = ("dquery", "dkeys", "dvalues")
        if case == "dot":
            scale = 1.0 / math.sqrt(p["keys"].shape[-1])
            params = (q, k, vals)

            def scores():
                return torch.matmul(q, k.transpose(-2, -1)) * scale
        else:
            W = leaf(p["W"])
            params, names = (q, k, vals, W), names + ("dW",)

            def scores():
                return torch.matmul(q, F.linear(k, W).transpose(-2, -1))

        def eager():
            alpha = _masked_softmax(torch, scores(), mask)
            return torch.matmul(alpha, vals), alpha

        forms["torch"] = autograd(eager, params, names)
        if case == "dot":
            forms["sdpa"] = autograd(
                lambda: F.scaled_dot_product_attention(q, k, vals,
                                                       attn_mask=mask),
                params, names)
            if p["mask"] is not None:
                forms["sdpa_causal"] = autograd(
                    lambda: F.scaled_dot_product_attention(q, k, vals,
                                                           is_causal=True),
                    params, names)
    return forms
