"""Benchmark of attention_c against one NumPy matmul, NumPy and PyTorch.

``python -m attention_c.bench --help`` lists the options.  In one process,
for each shape, dtype, thread count and mask, it measures median times of:

* ours: ``context_attention`` (fwd), the same keeping the activations
  (fwd_kp), ``context_attention_backward`` recomputing them (bwd) or given
  them (bwd_sv), and forward + backward both ways (f+b, f+b_sv);
* S1: the NumPy product ``(rows, H) @ (H, A)``, the layer's main product
  ``h W_h^T`` over exactly the rows the layer computes (the valid items,
  gathered before timing), as a yardstick of what the machine's BLAS can
  do with the same work;
* the NumPy reference (``attention_c.reference``), forward and backward,
  and PyTorch's seed form, on the smaller shapes;
* when PyTorch is importable: eager PyTorch in its best form (W split into
  W_h and W_c, the context product once per sequence), and
  ``torch.compile`` of it (float32, medium and large).  Forward runs under
  no_grad; forward + backward is autograd of ``(out * G).sum()`` for h, W,
  v and b.  PyTorch gets the same data and mask (none on full sequences).

Masks: ``full`` (every item valid, no mask passed to anyone) and
``ragged`` (each sequence keeps a random prefix of T/2 to T items),
reported as separate rows.  Shapes: those of issue 10, from tiny (8, 16,
32, 32) to wide2 (16, 256, 1024, 1024) and long1, one sequence of 65536
items; ``--quick`` runs them all, the large ones with 8 times fewer rows.

Beside them: our product core alone (``attention_c.project_keys``)
against NumPy's BLAS on the layer's main product, in GFLOP/s next to the
machine's measured FMA peak (the SIMD path's FMA loop timed on the
threads used, ``harness.measure_fma_peak``), and the fixed cost of a call
(shape (1, 1, 1, 1)) in microseconds.

Ours, NumPy's BLAS (through threadpoolctl) and PyTorch all get the same
thread count.  Before timing, the results of every implementation, ours
included, are checked against the NumPy reference computed in float64
(normwise relative error, as in the tests).  The implementations are
timed in interleaved rounds (see ``harness.measure``), and the share of
the CPUs that other processes used meanwhile is reported.  Ratios are
ours / theirs (< 1: ours faster) and are compared with the targets of
issue 10 (PASS / MISS), each on full and ragged sequences at every thread
count, with a count of PASS and MISS at the end.

PyTorch, matplotlib and threadpoolctl are optional and imported lazily.
``python -m attention_c.bench --family`` (or ``python -m
attention_c.bench.family``) benchmarks the attention family instead;
``--variants`` (``attention_c.bench.variants``) today's variants of
issue 25 (window, packed sequences, softcap, ALiBi slopes, sinks);
``--transformers`` (``attention_c.bench.transformers``) transformers
models with attention_c as their backend against sdpa or eager (issue 27);
``--peers`` (``attention_c.bench.peers``) attention against PyTorch SDPA,
ONNX Runtime, OpenVINO and JAX, each in its own process (issue 26).

The modules, by role: ``harness`` (the machine's facts and measured FMA peak,
threads, timing, peak memory, the accuracy check), ``run`` (the layer's
problem and implementations, one configuration at a time), ``core`` (the
product core against BLAS, the cost of a call), ``torch_forms`` (the
PyTorch forms timed), ``targets`` (ratios and targets), ``report`` (text,
JSON, plot), ``cli`` (the options and ``main``) and ``family`` (the
attention family's benchmark).
"""

from attention_c.bench.cli import main

__all__ = ["main"]
