"""int8 twins of the exported graphs for the CPU configs (`aot export backbone --precision int8`).

ONNX Runtime's dynamic quantization of the optimized (fused) graph: the weights of every MatMul and of the fused
Attention's input projection become int8, symmetric, one scale per output channel; their inputs are quantized to
uint8 at run time, one scale per tensor (DynamicQuantizeLinear, QAttention, DynamicQuantizeMatMul); everything else
(embeddings, layer norms, softmax, GELU, the AoT bias add) stays fp32. The settings were chosen by measurement
(docs/benchmarks.md, "int8 on CPU"). Their one record is aot.training.quantized.QUANTIZATION, which emulates exactly
these in PyTorch for re-fitting; the repository records it (`aot_repository.json`: `quantization`).

Each of ONNX Runtime's SkipLayerNormalization nodes is then written as the ops it fuses: Add (the MatMul's bias, which
ONNX Runtime then folds into DynamicQuantizeMatMul), Add (the residual) and ONNX's LayerNormalization. On CPU its
contrib kernel is several times slower than those three (docs/benchmarks.md, "int8 on CPU"); the int8 twin runs only
on CPU, while the fp32 graph, which the GPU configs share, keeps its fused nodes.

The activation scale is taken over the whole input tensor, so in a batch of several sequences one sequence's range
(and padding) would change another's answer: the int8 graph is run one request at a time
(aot.serving.engine.BackboneRunner, `per_request`), which keeps every answer independent of its neighbours.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aot.training.quantized import QUANTIZATION

# Pooled states of the int8 graph against PyTorch fp32 on random inputs: a sanity bound that catches a broken
# quantization (whether a task keeps its accuracy is measured per task at publish: aot.exporter.accuracy_gate)
INT8_SANITY_BOUND = 1.0


def quantize_graph(src: Path, dst: Path) -> None:
    """Write the int8 twin of optimized graph `src` to `dst` (its weights inside the file)."""
    import logging

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs a generic "consider pre-processing" on the root logger
    try:
        quantize_dynamic(str(src), str(dst), op_types_to_quantize=list(QUANTIZATION["ops"]), per_channel=True,
                         reduce_range=False, weight_type=QuantType.QInt8,
                         # the fused operators' outputs (com.microsoft domain) have no inferred type: they are fp32
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        root.setLevel(level)
    model = onnx.load(str(dst), load_external_data=False)  # the rewrite touches nodes, never a weight
    if unfuse_skip_layer_norms(model):
        onnx.save_model(model, str(dst))


def unfuse_skip_layer_norms(model) -> int:
    """Rewrite each SkipLayerNormalization of `model` (onnx.ModelProto, in place) whose mean and inverse deviation no
    node reads as Add(input, bias), Add(·, skip) and LayerNormalization(·, gamma, beta) over the last axis: the same
    arithmetic up to rounding (the bias is added first, where ONNX Runtime folds it into the MatMul that produced the
    input); its sum output, when read, is the second Add's. Returns how many were rewritten (none where the graph's
    ONNX opset predates LayerNormalization, 17)."""
    from onnx import helper

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 17:
        return 0
    read = {name for node in model.graph.node for name in node.input if name} | {o.name for o in model.graph.output}
    nodes, rewritten = [], 0
    for node in model.graph.node:
        outputs = list(node.output) + [""] * (4 - len(node.output))
        if node.op_type != "SkipLayerNormalization" or node.domain != "com.microsoft" or read & {*outputs[1:3]}:
            nodes.append(node)
            continue
        epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-12)
        x, skip, gamma, beta, bias = (list(node.input) + [""] * 2)[:5]
        prefix = f"{node.name or 'SkipLayerNormalization'}/unfused{rewritten}"
        if bias:
            nodes.append(helper.make_node("Add", [x, bias], [f"{prefix}/biased"], name=f"{prefix}/bias_add"))
            x = f"{prefix}/biased"
        total = outputs[3] or f"{prefix}/sum"
        nodes.append(helper.make_node("Add", [x, skip], [total], name=f"{prefix}/skip_add"))
        nodes.append(helper.make_node("LayerNormalization", [total, gamma] + ([beta] if beta else []), [outputs[0]],
                                      name=f"{prefix}/layer_norm", axis=-1, epsilon=epsilon))
        rewritten += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return rewritten


def int8_difference(path: Path, backbone, aot: bool, interface: str = "rows") -> float:
    """The int8 graph against PyTorch fp32 at two shapes, run one sequence at a time as served."""
    from aot.exporter.onnx_export import max_abs_difference

    return max_abs_difference(path, backbone, aot, interface, trials=((1, 13), (1, 5)))


def check_int8(diff: float, name: str) -> None:
    if not np.isfinite(diff) or diff > INT8_SANITY_BOUND:
        raise ValueError(f"{name}: the int8 graph differs from PyTorch by {diff:.3g} (> {INT8_SANITY_BOUND:g}): the "
                         "quantization is broken for this backbone; nothing was written: export with --precision fp32")
