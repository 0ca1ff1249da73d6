"""JAX as an implementation of ``attention_c.bench.peers``:
``jax.nn.dot_product_attention`` under ``jax.jit``."""

import numpy as np

from attention_c.bench.peers_cases import as_outputs


def jax_impls(case, p):
    """jax.nn.dot_product_attention under jax.jit, (B, T, heads, d)."""
    import jax
    attention = jax.nn.dot_product_attention
    kw = {"scale": p["scale"], "is_causal": p["causal"]}
    q, k, v, g = (jax.device_put(np.ascontiguousarray(
        p[n].transpose(0, 2, 1, 3))) for n in ("q", "k", "v", "g"))

    def back(r):
        return np.asarray(r).transpose(0, 2, 1, 3)

    if case["kind"] == "fwdbwd":
        @jax.jit
        def fwdbwd(q, k, v, g):
            out, vjp = jax.vjp(lambda *x: attention(*x, **kw), q, k, v)
            return out, vjp(g)

        return {"jax": (lambda: jax.block_until_ready(fwdbwd(q, k, v, g)),
                        lambda r: as_outputs(back(r[0]),
                                             [back(x) for x in r[1]]))}
    fwd = jax.jit(lambda q, k, v: attention(q, k, v, **kw))
    return {"jax": (lambda: fwd(q, k, v).block_until_ready(),
                    lambda r: as_outputs(back(r)))}
