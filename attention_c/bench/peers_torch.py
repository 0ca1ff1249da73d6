"""Ours (attention_c on NumPy) and PyTorch SDPA, the reference, as
implementations of ``attention_c.bench.peers``: {implementation: (run,
collect)} of a case (see ``attention_c.bench.peers_child.impls``); and
the read floor of a decode case."""

from attention_c.bench.peers_cases import as_outputs


def ours_impls(case, p):
    """attention_c.dot_attention (NumPy) and its backward."""
    import attention_c as ac
    B, hq, hkv, tq, T, d = p["dims"]
    q, k, v, g = p["q"], p["k"], p["v"], p["g"]
    if hkv != hq:                        # GQA: (B, Hkv, G, Tq, d)
        q = q.reshape(B, hkv, hq // hkv, tq, d)
        k, v = k[:, :, None], v[:, :, None]
    kw = {"causal": p["causal"], "scale": p["scale"]}

    def fwd():
        return ac.dot_attention(q, k, values=v, return_weights=False, **kw)

    if case["kind"] == "fwdbwd":
        def run():
            o, lse = fwd()
            return o, ac.dot_attention_backward(g, q, k, out=o, lse=lse,
                                                values=v, **kw)
        return {"ours": (run, lambda r: as_outputs(r[0], r[1][:3]))}
    return {"ours": (fwd, lambda r: as_outputs(
        r[0].reshape(B, hq, tq, d)))}


def sdpa_impls(case, p):
    """torch.nn.functional.scaled_dot_product_attention."""
    import torch
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t = {n: torch.from_numpy(p[n]) for n in ("q", "k", "v", "g")}
    kw = {"is_causal": p["causal"], "scale": p["scale"],
          "enable_gqa": p["dims"][1] != p["dims"][2]}
    if case["kind"] == "fwdbwd":
        leaves = [t[n].requires_grad_(True) for n in ("q", "k", "v")]

        def run():
            out = sdpa(*leaves, **kw)
            return out, torch.autograd.grad(out, leaves, t["g"])
        return {"sdpa": (run, lambda r: as_outputs(
            r[0].detach().numpy(), [x.numpy() for x in r[1]]))}

    def fwd():
        with torch.no_grad():
            return sdpa(t["q"], t["k"], t["v"], **kw)
    return {"sdpa": (fwd, lambda r: as_outputs(r.numpy()))}


def read_impls(case, p):
    """The read floor of a decode case (peers_cases.FLOOR): its keys and
    values reduced once by ``torch.amax`` and by ``torch.sum``, on
    PyTorch's threads; no outputs to collect.  Other kinds: none."""
    if case["kind"] != "decode":
        return {}
    import torch
    k, v = torch.from_numpy(p["k"]), torch.from_numpy(p["v"])
    return {"read:amax": (lambda: (k.amax(), v.amax()), None),
            "read:sum": (lambda: (k.sum(), v.sum()), None)}
