"""OpenVINO as an implementation of ``attention_c.bench.peers``: a
one-node model of opset 13 ``ScaledDotProductAttention`` compiled for the
CPU."""

import numpy as np

from attention_c.bench.peers_cases import as_outputs


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
