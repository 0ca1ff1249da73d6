"""Attention against the peers (issue 26): PyTorch SDPA, ONNX Runtime,
OpenVINO and JAX, each in its own process, in the same run.

``python -m attention_c.bench --peers`` (or ``python -m
attention_c.bench.peers``) runs it; ``--help`` lists the options,
``--quick`` runs tiny sizes in a few seconds.  The peers are optional
(``pip install attention_c[peers]``); those not importable are left out
and said so.  PyTorch's SDPA is the reference of the accuracy check, so
PyTorch is required.

The implementations (float32 when timed):

* **ours**: ``attention_c.dot_attention(q, k, values=v,
  return_weights=False)`` on NumPy arrays (B, heads, T, d), and
  ``dot_attention_backward`` from its ``out`` and ``lse``; grouped-query
  heads as keys (B, Hkv, 1, T, d) against queries (B, Hkv, G, 1, d);
* **sdpa**: ``torch.nn.functional.scaled_dot_product_attention`` (forward
  under ``no_grad``; forward + backward ``torch.autograd.grad`` of its
  output given g; ``enable_gqa=True`` for grouped-query heads);
* **ort**: ONNX Runtime's CPU provider, a one-node model of the ONNX
  ``Attention`` operator at opset 23 (4-D (B, heads, T, d), grouped-query
  heads native) and of ``com.microsoft.MultiHeadAttention`` ((B, T,
  heads * d), ``unidirectional`` for causal; no grouped-query form): both
  are checked and timed, and a row reports the faster
  (``com.microsoft.GroupQueryAttention``, which needs a cache laid out
  its own way and the sequence lengths, is not timed);
* **openvino**: a one-node model of opset 13 ``ScaledDotProductAttention``
  compiled for the CPU, f32 inference precision (OpenVINO would pick bf16
  on CPUs that have it); grouped-query heads as ours (5-D, broadcast);
* **jax**: ``jax.nn.dot_product_attention`` (B, T, heads, d) under
  ``jax.jit``; forward + backward ``jax.vjp`` under the same jit.

ONNX Runtime and OpenVINO are inference engines: they have forward rows
only.  Every library gets its inputs in its own layout, made before
timing.

**One process per library.**  Each library runs in a child process
(``python -m attention_c.bench.peers --worker LIB``) that imports only
it, with its thread count set both in the environment (OMP_NUM_THREADS,
MKL_NUM_THREADS, OPENBLAS_NUM_THREADS, ATTENTION_C_NUM_THREADS) and
through its own control: ``attention_c.set_num_threads``,
``torch.set_num_threads``, ONNX Runtime's ``intra_op_num_threads`` (and
``inter_op_num_threads`` = 1), OpenVINO's ``INFERENCE_NUM_THREADS`` (one
stream, latency hint).  JAX (XLA) has no run-time thread count: its
child's CPU affinity is restricted to N CPUs before jax is imported (as
``taskset`` would), which sizes XLA's thread pool, and at 1 thread
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1`` as well (one CPU at a time, though
JAX keeps two threads busy: the Python one dispatches, one of XLA's
computes).  Every child reports, while it timed, the CPU time of all its
threads over that of its busiest one (read from /proc/self/task: about
the number of threads a library really shared its work among, whatever
the machine's load; threads that spin while they wait count too, as
ONNX Runtime's do between runs) and its CPU time / wall time.

**Checked before timed.**  At the smallest thread count, every library's
child computes each kind of case on a small shape (``CHECK_SHAPES``) and
its outputs (and gradients) are compared with SDPA in float64 on the same
data (``||x - r|| / ||r||``): in float64 where the library computes in
float64 (ours, SDPA), with tolerance ``TOLERANCE_64``, else in float32
with ``TOLERANCE_32`` (ONNX Runtime and OpenVINO have no float64
attention on the CPU; ``jax.nn.dot_product_attention`` computes its
softmax in float32 whatever its inputs; SDPA's float32 is checked
too).  An implementation that fails is reported as failed and never
timed.

**Interleaved rounds.**  For each thread count, ``--rounds`` rounds; in
each, every library's child runs once (order reversed every other round)
and times all its cases with ``harness.measure`` (medians of repeats
after warm-up).  A time is the median over the rounds; ratios are ours /
peer (< 1: ours faster).  Each child also reports the share of the CPUs
that other processes used while it timed (``harness.others_load``).

Targets of issue 26 (PASS / MISS): ours / SDPA <= 0.75 on every forward
and forward + backward row; ours / ONNX Runtime and ours / OpenVINO <=
0.8 on every forward row; decode (MHA and GQA) <= 0.8 x the best peer.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from attention_c.bench import harness
from attention_c.bench.docs_page import markdown_table, write_page
from attention_c.bench.report import emit, format_load, format_ms

# The libraries, in the order of the report; the module that says whether
# each is installed (the ONNX Runtime child also needs onnx to build its
# models).
LIBS = ("ours", "sdpa", "ort", "openvino", "jax")
MODULES = {"ours": ("attention_c",), "sdpa": ("torch",),
           "ort": ("onnxruntime", "onnx"), "openvino": ("openvino",),
           "jax": ("jax",)}
NAMES = {"ours": "attention_c", "sdpa": "PyTorch SDPA",
         "ort": "ONNX Runtime", "openvino": "OpenVINO", "jax": "JAX"}
INFERENCE = ("ort", "openvino")         # forward only
# Checked in float64: jax.nn.dot_product_attention computes its softmax
# in float32 whatever the inputs, so JAX is checked in float32.
FLOAT64 = ("ours", "sdpa")
ORT_IMPLS = ("ort:Attention", "ort:MultiHeadAttention")

# Forward shapes (B * heads, T, d), B * heads split as (B, 8) where 8
# divides; decode: (query heads, key/value heads of GQA, cache lengths,
# d).  --quick: the same roles on tiny sizes.
SHAPES = ((32, 256, 64), (8, 1024, 64), (2, 4096, 64))
QUICK_SHAPES = ((4, 32, 16), (2, 64, 16))
DECODE = {"heads": 32, "kv_heads": 8, "caches": (1024, 4096), "d": 64}
QUICK_DECODE = {"heads": 8, "kv_heads": 2, "caches": (64, 128), "d": 16}
HEADS = 8
# The accuracy check's small shapes: forward (B * heads, T, d), decode
# (heads, kv_heads, cache, d).
CHECK_SHAPES = {"fwd": (16, 48, 16), "decode": (8, 2, 40, 16)}
TOLERANCE_64 = 1e-10     # float64 against SDPA's float64, normwise
TOLERANCE_32 = 1e-4      # float32 against SDPA's float64, normwise
HEAVY_T = 4096           # from this T: at most 3 samples a round
WORKER_TIMEOUT = 3600
# How each library's thread count is set (besides OMP_NUM_THREADS etc.).
THREAD_CONTROL = {
    "ours": "attention_c.set_num_threads",
    "sdpa": "torch.set_num_threads",
    "ort": "intra_op_num_threads (inter_op 1)",
    "openvino": "INFERENCE_NUM_THREADS (1 stream)",
    "jax": "CPU affinity to N CPUs (+ XLA_FLAGS "
           "--xla_cpu_multi_thread_eigen=false "
           "intra_op_parallelism_threads=1 at 1)",
}

# Targets: (kind, peer, limit); peer "best" = the fastest peer of the row.
TARGETS = (
    ("fwd", "sdpa", 0.75), ("fwdbwd", "sdpa", 0.75),
    ("fwd", "ort", 0.8), ("fwd", "openvino", 0.8),
    ("decode", "best", 0.8),
)
KIND_TEXT = {"fwd": "forward", "fwdbwd": "forward + backward",
             "decode": "decode"}


# --------------------------------------------------------------------------
# The cases and their data

def case_key(case):
    """A case's name: 'fwd full 32x256x64', 'decode gqa 32/8x1024x64'."""
    dims = case["shape"]
    if case["kind"] == "decode":
        text = f"{dims[0]}/{dims[1]}x{dims[2]}x{dims[3]}"
    else:
        text = "x".join(map(str, dims))
    return f"{case['kind']} {case['variant']} {text}"


def make_cases(quick):
    """Every timed case: forward full and causal, forward + backward full
    at each shape; decode MHA and GQA at each cache length."""
    shapes = QUICK_SHAPES if quick else SHAPES
    dec = QUICK_DECODE if quick else DECODE
    cases = [{"kind": "fwd", "variant": v, "shape": list(s)}
             for v in ("full", "causal") for s in shapes]
    cases += [{"kind": "fwdbwd", "variant": "full", "shape": list(s)}
              for s in shapes]
    cases += [{"kind": "decode", "variant": v,
               "shape": [dec["heads"], kv, n, dec["d"]]}
              for v, kv in (("mha", dec["heads"]), ("gqa", dec["kv_heads"]))
              for n in dec["caches"]]
    for case in cases:
        case["key"] = case_key(case)
    return cases


def check_cases():
    """One small case of each kind and variant (the accuracy check)."""
    fwd, dec = CHECK_SHAPES["fwd"], CHECK_SHAPES["decode"]
    cases = [{"kind": "fwd", "variant": v, "shape": list(fwd)}
             for v in ("full", "causal")]
    cases.append({"kind": "fwdbwd", "variant": "full", "shape": list(fwd)})
    cases += [{"kind": "decode", "variant": v,
               "shape": [dec[0], dec[0] if v == "mha" else dec[1],
                         dec[2], dec[3]]} for v in ("mha", "gqa")]
    for case in cases:
        case["key"] = case_key(case)
    return cases


def dims(case):
    """(B, Hq, Hkv, Tq, T, d) of a case."""
    if case["kind"] == "decode":
        hq, hkv, n, d = case["shape"]
        return 1, hq, hkv, 1, n, d
    bh, T, d = case["shape"]
    heads = HEADS if bh % HEADS == 0 else 1
    return bh // heads, heads, heads, T, T, d


def make_problem(case, seed, dtype=np.float32):
    """q, g (B, Hq, Tq, d), k, v (B, Hkv, T, d), standard normal float32
    (then cast to ``dtype``: float64 data hold the same values), the
    scale 1 / sqrt(d) and ``causal``."""
    B, hq, hkv, tq, T, d = dims(case)
    kinds = ("fwd", "fwdbwd", "decode")
    rng = np.random.default_rng([seed, kinds.index(case["kind"]), B, hq,
                                 hkv, tq, T, d])
    p = {n: rng.standard_normal((B, h, t, d), dtype=np.float32).astype(dtype)
         for n, h, t in (("q", hq, tq), ("k", hkv, T), ("v", hkv, T),
                         ("g", hq, tq))}
    p.update(scale=1 / math.sqrt(d), causal=case["variant"] == "causal",
             dims=(B, hq, hkv, tq, T, d))
    return p


def as_outputs(out, grads=None):
    """{out[, dq, dk, dv]} as float64 arrays."""
    found = {"out": np.asarray(out, dtype=np.float64)}
    if grads is not None:
        found.update({n: np.asarray(x, dtype=np.float64)
                      for n, x in zip(("dq", "dk", "dv"), grads)})
    return found


# --------------------------------------------------------------------------
# The implementations: for each library, {implementation: (run, collect)}
# of a case, where run() is what is timed and collect(run()) the outputs
# as {out[, dq, dk, dv]} in the layout (B, heads, T, d), float64.

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


def _onnx_session(node, inputs, output, threads, opsets):
    """An ONNX Runtime CPU session of a one-node model."""
    import onnxruntime as ort
    from onnx import TensorProto, helper
    info = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
            for name, shape in inputs + [output]]
    graph = helper.make_graph([node], "attention", info[:-1], info[-1:])
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid(domain, version) for domain, version in opsets])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def ort_impls(case, p, threads):
    """ONNX Attention (opset 23) and com.microsoft.MultiHeadAttention;
    forward only, float32."""
    from onnx import helper
    if case["kind"] == "fwdbwd":
        return {}
    B, hq, hkv, tq, T, d = p["dims"]
    f32 = {n: p[n].astype(np.float32) for n in ("q", "k", "v")}
    found = {}
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"],
                            is_causal=int(p["causal"]), scale=p["scale"])
    sess = _onnx_session(node, [("Q", list(f32["q"].shape)),
                                ("K", list(f32["k"].shape)),
                                ("V", list(f32["v"].shape))],
                         ("Y", [B, hq, tq, d]), threads, [("", 23)])
    feeds = {"Q": f32["q"], "K": f32["k"], "V": f32["v"]}
    found["ort:Attention"] = (
        lambda s=sess, f=feeds: s.run(None, f)[0],
        as_outputs)
    if hkv == hq:            # MultiHeadAttention has no grouped-query form
        def bsd(x):
            b, h, t, e = x.shape
            return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(
                b, t, h * e)
        node = helper.make_node(
            "MultiHeadAttention", ["Q", "K", "V"], ["Y"],
            domain="com.microsoft", num_heads=hq, scale=p["scale"],
            unidirectional=int(p["causal"]))
        sess = _onnx_session(node, [("Q", [B, tq, hq * d]),
                                    ("K", [B, T, hkv * d]),
                                    ("V", [B, T, hkv * d])],
                             ("Y", [B, tq, hq * d]), threads,
                             [("", 23), ("com.microsoft", 1)])
        feeds = {"Q": bsd(f32["q"]), "K": bsd(f32["k"]), "V": bsd(f32["v"])}
        found["ort:MultiHeadAttention"] = (
            lambda s=sess, f=feeds: s.run(None, f)[0],
            lambda r: as_outputs(r.reshape(B, tq, hq, d).transpose(
                0, 2, 1, 3)))
    return found


def openvino_impls(case, p, threads):
    """opset13.scaled_dot_product_attention compiled for the CPU;
    forward only, float32."""
    if case["kind"] == "fwdbwd":
        return {}
    import openvino as ov
    import openvino.opset13 as ops
    B, hq, hkv, tq, T, d = p["dims"]
    arrays = [p[n].astype(np.float32) for n in ("q", "k", "v")]
    if hkv != hq:                        # broadcast over the group axis
        arrays = [arrays[0].reshape(B, hkv, hq // hkv, tq, d),
                  arrays[1][:, :, None], arrays[2][:, :, None]]
    arrays = [np.ascontiguousarray(a) for a in arrays]
    params = [ops.parameter(list(a.shape), ov.Type.f32) for a in arrays]
    node = ops.scaled_dot_product_attention(
        *params, scale=ops.constant(np.float32(p["scale"])),
        causal=p["causal"])
    compiled = ov.Core().compile_model(
        ov.Model([node], params), "CPU",
        {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32",
         "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    for i, a in enumerate(arrays):
        request.set_input_tensor(i, ov.Tensor(a, shared_memory=True))

    def run(keep=arrays):            # the tensors share these arrays
        request.infer()
        return request

    return {"openvino": (run, lambda r: as_outputs(
        r.get_output_tensor(0).data.reshape(B, hq, tq, d)))}


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


def impls(lib, case, p, threads):
    """{implementation: (run, collect)} of ``lib`` on a case (empty where
    the library has no such call)."""
    if lib == "ours":
        return ours_impls(case, p)
    if lib == "sdpa":
        return sdpa_impls(case, p)
    if lib == "ort":
        return ort_impls(case, p, threads)
    if lib == "openvino":
        return openvino_impls(case, p, threads)
    if lib == "jax":
        return jax_impls(case, p)
    raise ValueError(f"unknown library {lib!r}; choose from {LIBS}")


# --------------------------------------------------------------------------
# The child process of one library

def child_env(lib, threads, cache_dir=None):
    """The environment of ``lib``'s child at ``threads`` threads."""
    env = dict(os.environ)
    # the child imports the attention_c this process runs
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + [x for x in [env.get("PYTHONPATH")] if x])
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                 "OPENBLAS_NUM_THREADS", "ATTENTION_C_NUM_THREADS"):
        env[name] = str(threads)
    if lib == "jax":
        env["JAX_PLATFORMS"] = "cpu"
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        flags = [f"--xla_cpu_multi_thread_eigen={str(threads > 1).lower()}",
                 f"intra_op_parallelism_threads={threads}"]
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "")] + flags
                                    ).strip()
        if cache_dir:
            env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    return env


def set_threads(lib, threads):
    """Set ``lib``'s own thread control in this (child) process; JAX's
    CPU affinity (its thread pool is sized from it) before jax is
    imported.  Returns the library's version."""
    if lib == "jax":
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[:threads])
        import jax
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            # the rounds compile the same functions: compile once
            jax.config.update("jax_compilation_cache_dir",
                              os.environ["JAX_COMPILATION_CACHE_DIR"])
            jax.config.update("jax_persistent_cache_min_compile_time_secs",
                              0)
        return jax.__version__
    if lib == "ours":
        import attention_c as ac
        ac.set_num_threads(threads)
        return ac.__version__
    if lib == "sdpa":
        import torch
        torch.set_num_threads(threads)
        return torch.__version__
    if lib == "ort":
        import onnxruntime
        return onnxruntime.__version__
    if lib == "openvino":
        import openvino
        return openvino.__version__
    raise ValueError(f"unknown library {lib!r}")


def check_dtypes(lib):
    """The dtypes ``lib`` is checked in: float64 where it has it (SDPA
    both: its float64 is the reference)."""
    if lib == "sdpa":
        return ("float64", "float32")
    return ("float64",) if lib in FLOAT64 else ("float32",)


def compute_outputs(lib, cases, seed, threads, compute=None):
    """{(implementation, dtype, case key): outputs} of ``lib`` on the
    check cases, in this process.  ``compute`` (tests only) replaces the
    library: a function (lib, case, problem, threads) -> {implementation:
    (run, collect)}, to show that a wrong peer is caught."""
    compute = compute or (lambda lib, case, p, n: impls(lib, case, p, n))
    found = {}
    for dtype in check_dtypes(lib):
        for case in cases:
            p = make_problem(case, seed, np.dtype(dtype))
            for name, (run, collect) in compute(lib, case, p,
                                                threads).items():
                found[name, dtype, case["key"]] = collect(run())
    return found


def thread_ticks():
    """{thread id: CPU ticks (user + system)} of this process's threads,
    from /proc/self/task; empty where there is no /proc."""
    found = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        found[tid] = int(fields[11]) + int(fields[12])
    return found


def effective_threads(before, after):
    """The CPU time of all the process's threads between two
    ``thread_ticks()`` over that of its busiest thread: about N for a
    library that shares its work among N threads, whatever the machine's
    load and however many thread pools it holds (ONNX Runtime has one a
    session); None where unknown."""
    used = [ticks - before.get(t, 0) for t, ticks in after.items()]
    if not used or max(used) <= 0:
        return None
    return sum(used) / max(used)


def time_cases(lib, cases, seed, threads, target, min_repeats):
    """{implementation|case key: ms} of ``lib`` on ``cases`` (float32,
    ``harness.measure``), with the CPU use and others' share meanwhile."""
    funcs, heavy = {}, []
    for case in cases:
        p = make_problem(case, seed)
        for name, (run, _) in impls(lib, case, p, threads).items():
            funcs[f"{name}|{case['key']}"] = run
            if p["dims"][4] >= HEAVY_T and case["kind"] != "decode":
                heavy.append(f"{name}|{case['key']}")
    light = [k for k in funcs if k not in heavy]
    times = {}
    ticks = thread_ticks()
    before, start = harness.cpu_seconds(), time.perf_counter()
    for group, repeats in ((light, min_repeats),
                           (heavy, min(min_repeats, 3))):
        if group:
            timed = harness.measure({k: funcs[k] for k in group}, target,
                                    repeats)
            times.update({k: s * 1e3 for k, (s, _) in timed.items()})
    wall = time.perf_counter() - start
    own = harness.cpu_seconds()[1] - before[1]
    return {"times_ms": times, "cpu_per_wall": own / wall,
            "threads_used": effective_threads(ticks, thread_ticks()),
            "others_load": harness.others_load(before, wall)}


def worker(lib, spec):
    """The child's work: set the threads, import the library, then
    check (write the outputs to spec['out'], an .npz) or time; prints
    one JSON line."""
    threads = spec["threads"]
    version = set_threads(lib, threads)
    found = {"lib": lib, "version": version, "threads": threads,
             "mode": spec["mode"]}
    if spec["mode"] == "check":
        outputs = compute_outputs(lib, spec["cases"], spec["seed"], threads)
        np.savez(spec["out"], **{
            f"{name}|{dtype}|{key}|{array}": x
            for (name, dtype, key), arrays in outputs.items()
            for array, x in arrays.items()})
        found["impls"] = sorted({name for name, _, _ in outputs})
    else:
        found.update(time_cases(lib, spec["cases"], spec["seed"], threads,
                                spec["target"], spec["min_repeats"]))
    found["modules"] = sorted(m for m in ("torch", "jax", "onnxruntime",
                                          "openvino")
                              if m in sys.modules)
    print(json.dumps(found))
    return 0


def run_worker(lib, spec, cache_dir=None):
    """Run ``lib``'s child on ``spec``; its JSON line, or {'error': ...}
    when it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "attention_c.bench.peers", "--worker", lib,
         "--spec", json.dumps(spec)],
        capture_output=True, text=True, timeout=WORKER_TIMEOUT,
        env=child_env(lib, spec["threads"], cache_dir), check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-1500:] or
                f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# The accuracy check

def installed(lib):
    """Whether every module ``lib`` needs can be found (not imported)."""
    return all(importlib.util.find_spec(m) is not None for m in MODULES[lib])


def compare(found, reference):
    """{implementation: {'dtype', 'errors': {case key/array: error},
    'ok'}} of outputs ``found`` against SDPA's float64 ``reference``
    ({case key: outputs}); an implementation passes when every array of
    every case is within the tolerance of its dtype."""
    verdicts = {}
    for (name, dtype, key), arrays in found.items():
        tolerance = TOLERANCE_64 if dtype == "float64" else TOLERANCE_32
        v = verdicts.setdefault(f"{name} {dtype}", {
            "impl": name, "dtype": dtype, "tolerance": tolerance,
            "errors": {}, "ok": True})
        for array, x in arrays.items():
            exact = reference[key][array]
            err = (harness.errors({array: x}, {array: exact})[array]
                   if x.shape == exact.shape else math.inf)
            v["errors"][f"{key} {array}"] = err
            v["ok"] = v["ok"] and err <= tolerance
    return verdicts


def load_outputs(path):
    """The outputs an .npz of a check child holds."""
    found = {}
    with np.load(path) as data:
        for name in data.files:
            impl, dtype, key, array = name.split("|")
            found.setdefault((impl, dtype, key), {})[array] = data[name]
    return found


def check_lib(lib, reference, seed, threads, folder, compute=None):
    """Check ``lib`` against SDPA in float64 (``reference``); returns
    (version, {implementation: passed}, verdicts, error or None).  The
    outputs come from the library's child process; ``compute`` (tests
    only, see ``compute_outputs``) computes them in this process
    instead."""
    cases = check_cases()
    if compute is not None:
        found, version = compute_outputs(lib, cases, seed, threads,
                                         compute), "test"
    else:
        out = os.path.join(folder, f"check-{lib}.npz")
        child = run_worker(lib, {"mode": "check", "threads": threads,
                                 "cases": cases, "seed": seed, "out": out})
        if "error" in child:
            return None, {}, {}, child["error"]
        found, version = load_outputs(out), child["version"]
    verdicts = compare(found, reference)
    passed = {}
    for v in verdicts.values():
        passed[v["impl"]] = passed.get(v["impl"], True) and v["ok"]
    return version, passed, verdicts, None


def sdpa_reference(seed, threads, folder):
    """SDPA's float64 outputs on the check cases ({case key: outputs}),
    SDPA's version and its check's error (None when it ran)."""
    out = os.path.join(folder, "check-sdpa.npz")
    child = run_worker("sdpa", {"mode": "check", "threads": threads,
                                "cases": check_cases(), "seed": seed,
                                "out": out})
    if "error" in child:
        return None, None, child["error"]
    found = load_outputs(out)
    return ({key: x for (name, dtype, key), x in found.items()
             if dtype == "float64"}, child["version"], None)


# --------------------------------------------------------------------------
# Rounds, rows and targets

def run_rounds(libs, cases, threads, options, cache_dir):
    """``options.rounds`` interleaved rounds at ``threads`` threads: every
    library's child once a round, order reversed every other round.
    Returns {lib: [child results]}."""
    found = {lib: [] for lib in libs}
    spec = {"mode": "time", "threads": threads, "seed": options.seed,
            "target": options.target, "min_repeats": options.min_repeats}
    for r in range(options.rounds):
        for lib in libs if r % 2 == 0 else libs[::-1]:
            start = time.perf_counter()
            lib_cases = [c for c in cases
                         if not (lib in INFERENCE and c["kind"] == "fwdbwd")]
            child = run_worker(lib, dict(spec, cases=lib_cases), cache_dir)
            found[lib].append(child)
            print(f"  round {r + 1}/{options.rounds} {threads} thr {lib:<9}"
                  f"{time.perf_counter() - start:6.1f} s"
                  + (" FAILED" if "error" in child else ""),
                  file=sys.stderr)
    return found


def median_times(children, passed):
    """{implementation|case key: median ms over the rounds} of one
    library's children, for the implementations that passed the check."""
    samples = {}
    for child in children:
        for key, ms in child.get("times_ms", {}).items():
            if passed.get(key.split("|")[0]):
                samples.setdefault(key, []).append(ms)
    return {k: statistics.median(v) for k, v in samples.items()}


def make_rows(cases, threads, medians, children):
    """One row per case: each library's time (ONNX Runtime: the faster of
    its operators, named), the ratios ours / peer and the others' CPU
    share (mean over every child of the thread count)."""
    loads = [c["others_load"] for runs in children.values() for c in runs
             if c.get("others_load") is not None]
    rows = []
    for case in cases:
        row = {"case": case["key"], "kind": case["kind"],
               "variant": case["variant"], "shape": case["shape"],
               "threads": threads, "times_ms": {}, "impl": {},
               "others_load": statistics.mean(loads) if loads else None}
        for lib, times in medians.items():
            found = {k.split("|")[0]: ms for k, ms in times.items()
                     if k.split("|")[1] == case["key"]}
            if found:
                impl = min(found, key=found.get)
                row["times_ms"][lib], row["impl"][lib] = found[impl], impl
                if lib == "ort":
                    row["ort_ms"] = found
        ours = row["times_ms"].get("ours")
        row["ratios"] = {lib: ours / ms for lib, ms in row["times_ms"].items()
                         if lib != "ours" and ours is not None}
        peers = {lib: r for lib, r in row["ratios"].items()}
        if peers:
            best = max(peers, key=peers.get)     # the fastest peer
            row["best_peer"] = best
            row["ratios"]["best"] = peers[best]
        rows.append(row)
    return rows


def evaluate(rows):
    """PASS / MISS of every target of issue 26 that has its peer in a
    row."""
    targets = []
    for row in rows:
        for kind, peer, limit in TARGETS:
            ratio = row["ratios"].get(peer)
            if row["kind"] != kind or ratio is None:
                continue
            load = row["others_load"]
            targets.append({
                "target": f"{KIND_TEXT[kind]} ours/{peer}", "limit": limit,
                "case": row["case"], "threads": row["threads"],
                "peer": row.get("best_peer") if peer == "best" else peer,
                "ratio": ratio,
                "status": "PASS" if ratio <= limit else "MISS",
                "disturbed": load is not None and load > harness.DISTURBED})
    return targets


# --------------------------------------------------------------------------
# Report

def _verdicts(targets, row):
    found = [t for t in targets if t["case"] == row["case"]
             and t["threads"] == row["threads"]]
    return "; ".join(
        ("best " if t["target"].endswith("/best") else "")
        + f"{t['peer']} ≤ {t['limit']} {t['status']}" + "*" * t["disturbed"]
        for t in found) or ""


def _ratio(value):
    """A ratio to 2 decimals (3 significant digits below 0.1), or '-'."""
    if value is None:
        return "-"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def table(rows, targets, libs):
    """The Markdown table: a line per case and thread count."""
    peers = [lib for lib in libs if lib != "ours"]
    head = (["case", "thr", "ours ms"] + [f"{lib} ms" for lib in peers]
            + [f"ours/{lib}" for lib in peers]
            + ["targets", "others' CPU"])
    body = []
    for row in rows:
        t = row["times_ms"]
        cells = [row["case"], str(row["threads"]), format_ms(t.get("ours"))]
        for lib in peers:
            cell = format_ms(t.get(lib))
            if lib == "ort" and lib in t:
                cell += f" ({row['impl'][lib].split(':')[1]})"
            cells.append(cell)
        cells += [_ratio(row["ratios"].get(lib)) for lib in peers]
        load = row["others_load"]
        cells += [_verdicts(targets, row),
                  "?" if load is None else f"{load:.0%}"]
        body.append(cells)
    return markdown_table(head, body)


def _used(meta, threads, lib):
    used = meta["threads_used"].get(threads, {}).get(lib)
    return "?" if used is None else f"{used:.1f}"


def report(meta, rows, targets):
    """The whole text report (Markdown)."""
    return "\n".join(report_lines(meta, rows, targets))


def docs_section(meta, rows, targets):
    """{"peers": the report as docs/performance.md's section}: the command
    and date first, each sentence its own paragraph."""
    lines = report_lines(meta, rows, targets)
    lines[0] = (f"`python -m attention_c.bench --peers` on {meta['cpu']}, "
                f"{meta['date'][:10]}.")
    text = "\n".join(lines)
    return {"peers": re.sub(r"\n(?!\|)", "\n\n",
                            text).replace("\n\n\n\n", "\n\n")}


def report_lines(meta, rows, targets):
    """The report, a line per sentence (the table one block)."""
    lines = [
        f"attention_c against its peers, {meta['date']}",
        f"CPU: {meta['cpu']} ({meta['cpus']} CPUs available); load "
        f"average {format_load(meta['load_start'])} at start; others' CPU "
        f"share while timing: " + ", ".join(
            f"{n} thr {'?' if s is None else f'{s:.0%}'}"
            for n, s in meta["others_load"].items()),
        f"attention_c {meta['config']['version']}, SIMD path "
        f"{meta['config']['simd']}; float32, each library in its own "
        f"process; medians of {meta['rounds']} interleaved rounds (each a "
        f"median of >= {meta['min_repeats']} runs, ~{meta['target_s']:g} s "
        f"a case).",
        "Libraries: " + "; ".join(
            f"{NAMES[lib]} {s['version'] or '-'}: {s['status']}"
            for lib, s in meta["libs"].items()) + ".",
        "Threads set by: " + "; ".join(
            f"{lib} {THREAD_CONTROL[lib]}" for lib in meta["timed"])
        + "; OMP/MKL/OPENBLAS_NUM_THREADS in every child's environment.",
        "Threads each child used while timing (CPU time of its threads / "
        "of its busiest one; in parentheses its CPU time / wall time, "
        "medians over the rounds): " + "; ".join(
            f"{n} thr " + ", ".join(
                f"{lib} {_used(meta, n, lib)} ({u:.2f})"
                for lib, u in use.items())
            for n, use in meta["cpu_use"].items()) + ".",
    ]
    if meta["quick"]:
        lines.append("--quick: tiny sizes, indicative only.")
    lines += [
        "Checked before timing against SDPA in float64 (worst ||x - r|| / "
        "||r|| over out and the gradients): " + ", ".join(
            f"{v['impl']} {v['dtype']} {max(v['errors'].values()):.1e}"
            + ("" if v["ok"] else " FAILED")
            for lib in meta["checks"].values() for v in lib.values()) + ".",
        "",
        table(rows, targets, meta["timed"]),
        "",
        "Times in ms, ratios ours / peer (< 1: ours faster); ort: the "
        "faster of Attention-23 and MultiHeadAttention (named); decode "
        "targets against the fastest peer; *: others used more than "
        f"{harness.DISTURBED:.0%} of the CPUs.",
        harness.targets_line(targets, 26),
        harness.targets_count(targets),
    ]
    return lines


# --------------------------------------------------------------------------
# Command line

def parse_args(argv):
    """The options of ``python -m attention_c.bench --peers``."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench --peers",
        description="Benchmark attention_c against PyTorch SDPA, ONNX "
                    "Runtime, OpenVINO and JAX (those installed), each in "
                    "its own process, checked against SDPA in float64 "
                    "before timing, in interleaved rounds: forward full "
                    "and causal, forward + backward, decode MHA and GQA, "
                    "with the targets of issue 26.")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, short measurements, 2 rounds")
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated thread counts; 'all' = the "
                             "available CPUs (default: 1,2)")
    parser.add_argument("--libs", default=",".join(LIBS),
                        help="comma-separated, from: " + ", ".join(LIBS)
                             + " (default: all; ours and sdpa always run)")
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds (default 3, 2 with --quick)")
    parser.add_argument("--target", type=float,
                        help="seconds per case in a child (default 0.3, "
                             "0.01 with --quick)")
    parser.add_argument("--min-repeats", type=int,
                        help="least timed runs per case in a child (default"
                             " 3, 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write all results")
    parser.add_argument("--write-docs", metavar="PAGE",
                        help="rewrite the 'peers' section of this page "
                             "(docs/performance.md), keeping its prose")
    parser.add_argument("--worker", choices=LIBS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        return options
    options.threads = harness.thread_counts(options.threads, parser)
    libs = [s.strip() for s in options.libs.split(",") if s.strip()]
    wrong = [s for s in libs if s not in LIBS]
    if wrong:
        parser.error(f"unknown libraries {wrong}; choose from "
                     f"{', '.join(LIBS)}")
    options.libs = [lib for lib in LIBS
                    if lib in libs or lib in ("ours", "sdpa")]
    if options.rounds is None:
        options.rounds = 2 if options.quick else 3
    if options.target is None:
        options.target = 0.01 if options.quick else 0.3
    if options.min_repeats is None:
        options.min_repeats = 1 if options.quick else 3
    if options.rounds < 1 or options.min_repeats < 1:
        parser.error("--rounds and --min-repeats must be at least 1")
    return options


def run(options, folder):
    """The check, the rounds at each thread count, the rows and targets:
    (meta, rows, targets)."""
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": harness.cpu_model(), "cpus": harness.available_cpus(),
        "load_start": harness.load_average(), "config": harness.our_config(),
        "quick": options.quick, "threads": options.threads,
        "rounds": options.rounds, "target_s": options.target,
        "min_repeats": options.min_repeats, "seed": options.seed,
        "libs": {}, "checks": {}, "cpu_use": {}, "threads_used": {},
        "others_load": {}}
    check_threads = min(options.threads)
    reference, version, error = sdpa_reference(options.seed, check_threads,
                                               folder)
    if error:
        raise RuntimeError(f"SDPA's check child failed:\n{error}")
    passed = {}
    for lib in options.libs:
        status = {"version": None, "status": "not installed"}
        meta["libs"][lib] = status
        if not installed(lib):
            continue
        status["version"], passed[lib], verdicts, error = check_lib(
            lib, reference, options.seed, check_threads, folder)
        meta["checks"][lib] = verdicts
        failed = [i for i, ok in passed[lib].items() if not ok]
        if error:
            status["status"] = "failed to run: " + error.splitlines()[-1]
        elif failed or not passed[lib]:
            status["status"] = "FAILED the check: " + ", ".join(failed)
        else:
            status["status"] = "checked"
        print(f"  check {lib:<9} {status['status']}", file=sys.stderr)
    timed = [lib for lib in options.libs if passed.get(lib)
             and any(passed[lib].values())]
    meta["timed"] = timed
    if "ours" not in timed:
        raise RuntimeError("attention_c failed its own check: "
                           + json.dumps(meta["checks"].get("ours"),
                                        default=str))
    cases = make_cases(options.quick)
    rows = []
    for threads in options.threads:
        children = run_rounds(timed, cases, threads, options, folder)
        for lib, runs in children.items():
            errors = [c["error"] for c in runs if "error" in c]
            if errors:
                meta["libs"][lib]["status"] += (
                    f"; {len(errors)} timing run(s) failed at {threads} "
                    f"thr: " + errors[-1].splitlines()[-1])
        medians = {lib: median_times(runs, passed[lib])
                   for lib, runs in children.items()}
        rows += make_rows(cases, threads, medians, children)
        meta["threads_used"][threads] = {
            lib: statistics.median(c["threads_used"] for c in runs
                                   if c.get("threads_used") is not None)
            for lib, runs in children.items()
            if any(c.get("threads_used") is not None for c in runs)}
        meta["cpu_use"][threads] = {
            lib: statistics.median(c["cpu_per_wall"] for c in runs
                                   if "cpu_per_wall" in c)
            for lib, runs in children.items()
            if any("cpu_per_wall" in c for c in runs)}
        loads = [c["others_load"] for runs in children.values()
                 for c in runs if c.get("others_load") is not None]
        meta["others_load"][threads] = (statistics.mean(loads) if loads
                                        else None)
    return meta, rows, evaluate(rows)


def main(argv=None):
    """Entry point of ``python -m attention_c.bench --peers``."""
    options = parse_args(sys.argv[1:] if argv is None else list(argv))
    if options.worker:
        return worker(options.worker, json.loads(options.spec))
    if not installed("sdpa"):
        print("PyTorch is required (SDPA is the reference and a peer)",
              file=sys.stderr)
        return 1
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attention_c_peers_") as folder:
        meta, rows, targets = run(options, folder)
    meta["wall_seconds"] = time.perf_counter() - start
    meta["load_end"] = harness.load_average()
    emit(options, meta, report(meta, rows, targets),
         {"meta": meta, "rows": rows, "targets": targets},
         lambda path: write_page(path, docs_section(meta, rows, targets)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
