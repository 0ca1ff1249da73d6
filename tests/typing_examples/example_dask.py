"""A Dask user's script, type-checked by tests/binding/test_typing.py."""
# Dask's own functions (from_array, ones_like, ...) are not annotated.
# mypy: disallow-untyped-calls=False

import dask.array as da
import numpy as np
from typing_extensions import assert_type

import attention_c.dask as acd

rng = np.random.default_rng(0)
h: da.Array = da.from_array(rng.standard_normal((6, 5, 4)),
                            chunks=(2, 5, 4))
mask = np.ones((6, 5), bool)
W, v = rng.standard_normal((3, 8)), rng.standard_normal(3)
out, alpha = acd.context_attention(h, W, v, mask=mask)
assert_type(out, da.Array)
out, alpha, act = acd.context_attention(h, W, v, keep_activations=True)
grad_out: da.Array = da.ones_like(out)
grads = acd.context_attention_backward(grad_out, h, W, v, alpha,
                                       activations=act)
assert_type(grads, acd.AttentionGrads)
assert_type(grads.b, da.Array | None)

query = rng.standard_normal((6, 3))
Wa = rng.standard_normal((3, 7))
kp = acd.project_keys(h, Wa)
out, alpha = acd.additive_attention(query, h, Wa, v, key_proj=kp)
g, gkp = acd.additive_attention_backward(out, query, h, Wa, v, alpha,
                                         key_proj=kp, stop_at_key_proj=True)
assert_type(g, acd.AdditiveAttentionGrads)
assert_type(gkp, da.Array)
assert_type(acd.additive_attention_backward(out, query, h, Wa, v, alpha),
            acd.AdditiveAttentionGrads)
dkeys, dW = acd.project_keys_backward(gkp, h, Wa)
assert_type(dW, da.Array)
out, alpha = acd.dot_attention(h, h, scale=0.5)
assert_type(acd.dot_attention_backward(out, h, h, alpha),
            acd.DotAttentionGrads)
out, alpha = acd.general_attention(query, h, rng.standard_normal((3, 4)))
assert_type(acd.general_attention_backward(out, query, h, Wa[:, :4], alpha),
            acd.GeneralAttentionGrads)
# Section 5: return_weights=False gives (out, lse); the backward takes
# out= and lse=, and its tuple has the bias's gradient.
x = da.from_array(rng.standard_normal((6, 5, 4)), chunks=(2, 5, 4))
out, lse = acd.dot_attention(x, x, causal=True, bias=np.zeros((5, 5)),
                             return_weights=False)
dg = acd.dot_attention_backward(out, x, x, out=out, lse=lse, causal=True,
                                bias=np.zeros((5, 5)))
assert_type(dg.bias, da.Array | None)
gg = acd.general_attention_backward(out, x, x, Wa[:, :4], out=out, lse=lse)
assert_type(gg.bias, da.Array | None)
