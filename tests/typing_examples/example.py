"""A user's script, type-checked by tests/test_typing.py with mypy --strict.

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

c = ac.mean_context(h, mask)
assert_type(c, Array)
assert_type(ac.mean_context_backward(c, h, mask=mask), Array)
s = ac.additive_score(h, c, W, v)
dh, dc, dW, dv, db = ac.additive_score_backward(s, h, c, W, v, b=None)
assert_type(db, Array | None)
alpha = ac.masked_softmax(s, mask)
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
y = layer(h, mask)
assert_type(y, Array)
assert_type(layer.backward(np.ones_like(y)), Array)
assert_type(layer.attention_weights, Array | None)
params: dict[str, Array] = layer.parameters()
state: dict[str, Any] = {}
ac.adam_step(params, layer.grads(), state, lr=1e-3)
ac.sgd_step(params, layer.grads(), lr=0.1)
