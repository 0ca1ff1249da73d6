"""The shared setup of ``python -m attention_c.bench --peers``
(``attention_c.bench.peers``): the libraries, their names and thread
controls, the shapes, tolerances and targets, the cases and their data."""

import math

import numpy as np

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
# Not a library: the host reading a decode step's keys and values once
# (the fastest of PyTorch's reductions over them, at the row's thread
# count), timed in its own child in the same rounds.  A decode step reads
# every key and value once, so where the cache is megabytes no
# implementation takes less time than this (tiny ones time the calls'
# overheads): the floor of each decode row, never checked nor a peer.
FLOOR = "read"
FLOOR_IMPLS = ("read:amax", "read:sum")
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
    FLOOR: "torch.set_num_threads",
    "jax": "CPU affinity to N CPUs (+ XLA_FLAGS "
           "--xla_cpu_multi_thread_eigen=false "
           "intra_op_parallelism_threads=1 at 1)",
}

# Targets of issue 32 (those of issue 26, 0.75 and 0.8, asked more than
# the FMA peak): (kind, peer, limit); peer "best" = the fastest peer of
# the row.
TARGETS = (
    ("fwd", "sdpa", 0.85), ("fwdbwd", "sdpa", 0.85),
    ("fwd", "ort", 0.93), ("fwd", "openvino", 0.93),
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
