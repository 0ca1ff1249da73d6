"""Benchmark of attention_c against one NumPy matmul, NumPy and PyTorch.

``python -m attention_c.bench --help`` lists the options.  In one process,
for each shape, dtype and thread count, it measures median times of:

* ours: ``context_attention`` (fwd), the same keeping the activations
  (fwd_kp), ``context_attention_backward`` recomputing them (bwd) or given
  them (bwd_sv), and forward + backward both ways (f+b, f+b_sv);
* S1: the bare NumPy product ``(B*T, H) @ (H, A)``, the largest product of
  the layer, as a yardstick of what the machine's BLAS can do;
* the NumPy reference (``attention_c.reference``), forward and backward;
* when PyTorch is importable: eager PyTorch in its best form (W split into
  W_h and W_c, the context product once per sequence), in the seed's form
  (context repeated T times and concatenated with h, one Linear over 2H),
  and ``torch.compile`` of the best form.  Forward runs under no_grad;
  forward + backward is autograd of ``(out * G).sum()`` for h, W, v and b.

Ours, NumPy's BLAS (through threadpoolctl) and PyTorch all get the same
thread count.  Before timing, the results of every implementation, ours
included, are checked against the NumPy reference computed in float64
(normwise relative error, as in the tests).  The implementations are
timed in interleaved rounds (see ``harness.measure``), and the share of
the CPUs that other processes used meanwhile is reported.  Ratios are
ours / theirs (< 1: ours faster) and are compared with the project's
performance targets (PASS / MISS).

PyTorch, matplotlib and threadpoolctl are optional and imported lazily.
``python -m attention_c.bench --family`` (or ``python -m
attention_c.bench.family``) benchmarks the attention family instead.

The modules, by role: ``harness`` (the machine's facts, threads, timing,
peak memory, the accuracy check), ``run`` (the layer's problem and
implementations, one configuration at a time), ``torch_forms`` (the
PyTorch forms timed), ``targets`` (ratios and targets), ``report`` (text,
JSON, plot), ``cli`` (the options and ``main``) and ``family`` (the
attention family's benchmark).
"""

from attention_c.bench.cli import main

__all__ = ["main"]
