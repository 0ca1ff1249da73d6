"""A user's script, type-checked by tests/binding/test_typing.py with mypy
--strict.

Every public function of attention_c is called as a user would; assert_type
pins the types that mypy infers for the results.
"""

from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import assert_type

import attention_c as ac

Array = npt.NDArray[np.floating[Any]]

rng = np.random.default_rng(0)
h = rng.standard_normal((2, 5, 4))
W = rng.standard_normal((3, 8))
v = rng.standard_normal(3)
mask = np.ones((2, 5), dtype=bool)

c = ac.mean_context(h, mask=mask)
assert_type(c, Array)
assert_type(ac.mean_context_backward(c, h, mask=mask), Array)
s = ac.additive_score(h, c, W, v)
dh, dc, dW, dv, db = ac.additive_score_backward(s, h, c, W, v, b=None)
assert_type(db, Array | None)
alpha = ac.masked_softmax(s, mask=mask)
assert_type(ac.masked_softmax_backward(alpha, alpha), Array)
out = ac.weighted_sum(alpha, h)
dalpha, dh = ac.weighted_sum_backward(out, alpha, h)

out, alpha = ac.context_attention(h, W, v, mask=mask)
grads = ac.context_attention_backward(out, h, W, v, alpha, mask=mask)
assert_type(grads, ac.AttentionGrads)
assert_type(grads.W, Array)
assert_type(grads.b, Array | None)
assert_type(ac.__version__, str)

layer = ac.ContextAttention(4, 3, dtype=np.float32, seed=0)
y = layer(h, mask=mask)
assert_type(y, Array)
assert_type(layer.backward(np.ones_like(y)), Array)
assert_type(layer.attention_weights, Array | None)
params: dict[str, Array] = layer.parameters()
state: dict[str, Any] = {}
ac.adam_step(params, layer.grads(), state, lr=1e-3)
ac.sgd_step(params, layer.grads(), lr=0.1)

# The attention family: functions, gradient tuples, layers
query = rng.standard_normal((2, 3))
keys = rng.standard_normal((2, 5, 4))
values = rng.standard_normal((2, 5, 6))
Wa = rng.standard_normal((7, 4 + 3))
va = rng.standard_normal(7)
kp = ac.project_keys(keys, Wa)
assert_type(kp, Array)
out, alpha = ac.additive_attention(query, keys, Wa, va, mask=mask,
                                   values=values, key_proj=kp)
ag = ac.additive_attention_backward(out, query, keys, Wa, va, alpha,
                                    mask=mask, values=values, key_proj=kp)
assert_type(ag, ac.AdditiveAttentionGrads)
assert_type(ag.values, Array | None)
assert_type(ag.b, Array | None)
dkeys, dWa = ac.project_keys_backward(kp, keys, Wa)
assert_type(dWa, Array)
out, alpha = ac.dot_attention(keys, keys, values=values, scale=0.5)
dg = ac.dot_attention_backward(out, keys, keys, alpha, values=values,
                               scale=0.5, grad_alpha=alpha)
assert_type(dg, ac.DotAttentionGrads)
assert_type(dg.bias, Array | None)
# Self-attention (docs/contract.md section 5): per-query masks, causal,
# bias, dropout, and the streamed path with its (out, lse) backward.
tril = np.tril(np.ones((5, 5), dtype=bool))
bias = np.zeros((5, 5))
out, alpha = ac.dot_attention(keys, keys, attn_mask=tril, bias=bias,
                              dropout=0.1, seed=3)
out, lse = ac.dot_attention(keys, keys, mask=mask, causal=True,
                            return_weights=False)
assert_type(lse, Array)
dg = ac.dot_attention_backward(out, keys, keys, out=out, lse=lse, mask=mask,
                               causal=True)
gg_self = ac.general_attention_backward(
    out, keys, keys, np.eye(4), out=out, lse=lse, causal=True, bias=bias,
    dropout=0.1, seed=3)
assert_type(gg_self.bias, Array | None)
Wg = rng.standard_normal((3, 4))
out, alpha = ac.general_attention(query, keys, Wg, mask=mask)
gg = ac.general_attention_backward(out, query, keys, Wg, alpha, mask=mask)
assert_type(gg, ac.GeneralAttentionGrads)
assert_type(gg.W, Array)

additive = ac.AdditiveAttention(4, 3, 7, bias=False, dtype=np.float32,
                                seed=0)
y = additive(query, keys, values=values, mask=mask,
             key_proj=additive.project_keys(keys))
grads_in = additive.backward(np.ones_like(y))
assert_type(grads_in, ac.AttentionInputGrads)
assert_type(grads_in.query, Array)
assert_type(grads_in.values, Array | None)
ac.adam_step(additive.parameters(), additive.grads(), {}, lr=1e-3)
dot = ac.DotAttention(scale=None)
assert_type(dot(keys, keys, mask=mask), Array)
assert_type(dot.backward(np.ones((2, 5, 4))).keys, Array)
general = ac.GeneralAttention(3, 4, seed=np.random.default_rng(1))
z = general(query, keys)
assert_type(z, Array)
assert_type(general.attention_weights, Array | None)
general.backward(np.ones_like(z), grad_alpha=np.zeros((2, 5)))
ac.sgd_step(general.parameters(), general.grads(), lr=0.1)
