"""ONNX Runtime's CPU provider as an implementation of
``attention_c.bench.peers``: one-node models of the ONNX ``Attention``
operator (opset 23) and of ``com.microsoft.MultiHeadAttention``."""

import numpy as np

from attention_c.bench.peers_cases import as_outputs


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
