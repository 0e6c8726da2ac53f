"""Export the frozen encoder to ONNX, with AoT bias inputs ("aot") or without them ("vanilla").

The AoT graph adds the looked-up rows before every layer through the very module training used
(aot.serving_torch.encoder.BiasedEncoder), is optimized by ONNX Runtime's transformer optimizer, and is
checked against PyTorch on random inputs and random non-zero biases before anything is written.
"""

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aot.exporter.configs import FP16_FILE
from aot.serving import protocol
from aot.serving.engine import cpu_session
from aot.serving_torch.encoder import BiasedEncoder, pool_states
from aot.training.backbone import Backbone

OPSET = 17
# Fused operators of ONNX Runtime's transformer optimizer that the AoT graph must keep (compared with vanilla).
FUSED_OPS = ("Attention", "MultiHeadAttention", "EmbedLayerNormalization", "SkipLayerNormalization",
             "LayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
             "Gelu", "BiasGelu", "FastGelu")


class ExportError(RuntimeError):
    """An export that failed validation; nothing was written."""


class ExportableBackbone(nn.Module):
    """The graph a server runs: token inputs (+ the AoT bias in `interface`: rows, index and offsets, or the dense
    bias) -> pooled states [B, K, d] and every token's final state [B, S, d] (what a token task's head reads; a
    session that asks only for the pooled states pays nothing for it)."""

    def __init__(self, backbone: Backbone, aot: bool, interface: str = "rows"):
        super().__init__()
        self.aot = aot
        self.interface = interface
        self.uses_token_type_ids = backbone.uses_token_type_ids
        self.encoder = backbone.encoder
        # Only the AoT graph hooks into the (shared) encoder; close() detaches it again.
        self.biased = BiasedEncoder(backbone.encoder, backbone.uses_token_type_ids) if aot else None
        self.row_elements = backbone.num_layers * backbone.hidden_size

    def close(self) -> None:
        if self.biased is not None:
            self.biased.remove_hooks()

    def input_names(self) -> list[str]:
        names = protocol.token_inputs(self.uses_token_type_ids)
        return names + (protocol.bias_inputs(self.interface) if self.aot else [])

    def forward(self, input_ids, attention_mask, token_type_ids=None, aot_rows=None, aot_index=None,
                aot_row_offsets=None, aot_bias=None):
        if not self.aot:
            extra = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        elif self.interface == "dense":
            hidden = self.biased.forward_dense(input_ids, attention_mask, token_type_ids, aot_bias)
        else:
            first_row = aot_row_offsets[:-1].long() // self.row_elements  # [B]: where each sequence's rows start
            index = aot_index.long() + first_row[:, None]
            rows = aot_rows.reshape(-1, self.biased.num_layers, self.biased.hidden_size)
            hidden = self.biased.states(input_ids, attention_mask, token_type_ids, rows, index)
        return pool_states(hidden, attention_mask), hidden


def example_inputs(backbone: Backbone, aot: bool, batch: int, seq: int, seed: int,
                   rows_dtype=getattr(torch, protocol.ROWS_DTYPE.name),
                   interface: str = "rows") -> dict[str, torch.Tensor]:
    """Random token inputs with padding, and random non-zero rows laid out exactly as the lookup step sends them in
    `interface` (the same rows for the same seed in both: dense is rows[index])."""
    g = torch.Generator().manual_seed(seed)
    vocab = backbone.embeddings.shape[0]
    lengths = torch.randint(max(2, seq // 2), seq + 1, (batch,), generator=g)
    lengths[0] = seq
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    feeds = {protocol.INPUT_IDS: ids, protocol.ATTENTION_MASK: mask}
    if backbone.uses_token_type_ids:
        feeds[protocol.TOKEN_TYPE_IDS] = (torch.arange(seq)[None, :] >= lengths[:, None] // 2).long() * mask
    if aot:
        L, d = backbone.num_layers, backbone.hidden_size
        rows, index, offsets = [], [], [0]
        for b in range(batch):
            unique, inverse = torch.unique(ids[b, : lengths[b]], return_inverse=True)
            rows.append((0.5 * torch.randn(len(unique), L, d, generator=g)).to(rows_dtype).reshape(-1))
            local = torch.zeros(seq, dtype=torch.int32)
            local[: lengths[b]] = inverse.int()
            index.append(local)
            offsets.append(offsets[-1] + rows[-1].numel())
        if interface == "dense":
            # the dense interface's bias: each token's row of its request's distinct tokens' rows
            feeds[protocol.AOT_BIAS] = torch.stack([r.reshape(-1, L, d)[i.long()]
                                                    for r, i in zip(rows, index, strict=True)])
        else:
            feeds[protocol.AOT_ROWS] = torch.cat(rows)
            feeds[protocol.AOT_INDEX] = torch.stack(index)
            feeds[protocol.AOT_ROW_OFFSETS] = torch.tensor(offsets, dtype=torch.int32)
    return feeds


def export_onnx(backbone: Backbone, path: Path, aot: bool, interface: str = "rows") -> None:
    """TorchScript-based export (the graphs ONNX Runtime's optimizer fuses best), dynamic batch and sequence."""
    module = ExportableBackbone(backbone, aot, interface).eval()
    feeds = example_inputs(backbone, aot, batch=2, seq=8, seed=0, interface=interface)
    names = module.input_names()
    axes = {n: {0: "batch", 1: "sequence"} for n in protocol.token_inputs(module.uses_token_type_ids)}
    if aot:
        axes.update({protocol.AOT_ROWS: {0: "row_elements"}, protocol.AOT_INDEX: {0: "batch", 1: "sequence"},
                     protocol.AOT_ROW_OFFSETS: {0: "batch_plus_one"}, protocol.AOT_BIAS: {0: "batch", 1: "sequence"}})
        axes = {n: a for n, a in axes.items() if n in names}
    axes[protocol.POOLED_HIDDEN] = {0: "batch"}
    axes[protocol.TOKEN_HIDDEN] = {0: "batch", 1: "sequence"}
    big = sum(p.numel() * p.element_size() for p in backbone.encoder.parameters()) > 1.8e9
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (), str(path), kwargs={n: feeds[n] for n in names}, input_names=names,
                              output_names=[protocol.POOLED_HIDDEN, protocol.TOKEN_HIDDEN], dynamic_axes=axes,
                              opset_version=OPSET,
                              do_constant_folding=True, dynamo=False)
    finally:
        module.close()
    if big:  # over the 2 GB protobuf limit: move weights to external data beside the graph
        import onnx

        model = onnx.load(str(path))
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data")


def optimize(src: Path, dst: Path, backbone: Backbone, aot: bool) -> None:
    """ONNX Runtime's transformer fusions (attention, layer norm, GELU) for CPU and CUDA execution."""
    import logging

    from onnxruntime.transformers.fusion_options import AttentionMaskFormat, FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)  # chatty about expected fp16 casts
    options = FusionOptions("bert")
    # A raw 0/1 mask is right for any padding side (the default mask-index format assumes right padding).
    options.attention_mask_format = AttentionMaskFormat.AttentionMask
    config = backbone.encoder.config
    model = optimize_model(str(src), model_type="bert", num_heads=config.num_attention_heads,
                           hidden_size=config.hidden_size, opt_level=1, use_gpu=False, optimization_options=options)
    if aot:
        _fuse_embed_layer_norm(model, options)
    model.save_model_to_file(str(dst), use_external_data_format=(src.with_name(src.name + ".data")).exists())


def _fuse_embed_layer_norm(model, options) -> None:
    """Give the AoT graph the EmbedLayerNormalization fusion the vanilla graph gets.

    ORT fuses the embedding LayerNorm only when it feeds Attention directly; with AoT the path is
    LayerNorm -> Add(bias of layer 0) -> Attention. The fused node's first output equals the LayerNorm output,
    so the Add stays in place and the graph is unchanged in meaning (the parity check below confirms it).
    """
    from onnxruntime.transformers.fusion_embedlayer import FusionEmbedLayerNormalization
    from onnxruntime.transformers.fusion_options import AttentionMaskFormat

    if any(n.op_type == "EmbedLayerNormalization" for n in model.model.graph.node):
        return

    class AotEmbedLayerNormFusion(FusionEmbedLayerNormalization):
        def check_attention_subgraph(self, layernorm, input_name_to_nodes, is_distil_bert):
            children = input_name_to_nodes.get(layernorm.output[0], [])
            if len(children) == 1 and children[0].op_type == "Add":
                for node in input_name_to_nodes.get(children[0].output[0], []):
                    if node.op_type == "Attention":
                        self.attention = node
                        return True
            return super().check_attention_subgraph(layernorm, input_name_to_nodes, is_distil_bert)

    AotEmbedLayerNormFusion(model, options.attention_mask_format == AttentionMaskFormat.MaskIndexEnd).apply()
    model.prune_graph()
    model.remove_unused_constant()


def fused_op_counts(path: Path) -> dict[str, int]:
    import onnx

    counts = collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
    return {op: counts[op] for op in FUSED_OPS if counts[op]}


def max_abs_difference(path: Path, backbone: Backbone, aot: bool, interface: str = "rows",
                       trials: tuple[tuple[int, int], ...] = ((3, 13), (1, 5))) -> float:
    """ONNX Runtime against PyTorch at shapes other than the export's, with random non-zero biases: the pooled
    states and every real token's state."""
    module = ExportableBackbone(backbone, aot, interface).eval()
    sess = cpu_session(path)  # with the CPU engine's graph optimizations
    names = {i.name for i in sess.get_inputs()}
    worst = 0.0
    try:
        for k, (batch, seq) in enumerate(trials):
            feeds = example_inputs(backbone, aot, batch, seq, seed=100 + k, interface=interface)
            with torch.no_grad():
                pooled, states = (t.numpy() for t in module(**feeds))
            got_pooled, got_states = sess.run([protocol.POOLED_HIDDEN, protocol.TOKEN_HIDDEN],
                                              {n: v.numpy() for n, v in feeds.items() if n in names})
            real = feeds[protocol.ATTENTION_MASK].numpy().astype(bool)  # padded positions' states are read by none
            worst = max(worst, float(np.abs(got_pooled - pooled).max()),
                        float(np.abs(got_states[real] - states[real]).max()))
    finally:
        module.close()
    return worst


FP16_TOLERANCE = 5e-2  # pooled states of the fp16 graph against PyTorch fp32 (fp32 graphs: 1e-4)


def export_fp16_graph(backbone: Backbone, fp32_graph: Path, aot: bool, interface: str = "rows",
                      tolerance: float = FP16_TOLERANCE) -> tuple[Path | None, float]:
    """The fp16 twin of an optimized graph for ONNX Runtime on a GPU (its CUDA provider runs the fused attention and
    GEMMs in fp16; inputs and outputs keep their types), checked against PyTorch like the fp32 graph. Returns its
    path, or None (nothing kept) when it differs by more than `tolerance`, and the difference."""
    import onnx
    from onnxruntime.transformers.onnx_model import OnnxModel

    dst = fp32_graph.with_name(FP16_FILE)
    model = OnnxModel(onnx.load(str(fp32_graph)))
    model.convert_float_to_float16(keep_io_types=True)
    model.save_model_to_file(str(dst), use_external_data_format=fp32_graph.with_name(fp32_graph.name + ".data").exists())
    diff = max_abs_difference(dst, backbone, aot, interface)
    if not diff <= tolerance:
        dst.unlink()
        dst.with_name(dst.name + ".data").unlink(missing_ok=True)
        return None, diff
    return dst, diff


@dataclass
class ExportedGraph:
    raw: Path
    optimized: Path
    max_abs_diff: float
    fused_ops: dict[str, int]


def export_backbone_graph(backbone: Backbone, folder: Path, aot: bool, tolerance: float = 1e-4,
                          interface: str = "rows") -> ExportedGraph:
    """Export, optimize and validate one graph into `folder` (model.raw.onnx, model.onnx); an AoT graph takes its
    bias in `interface` (aot.serving.protocol.BIAS_INTERFACES)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw, optimized = folder / "model.raw.onnx", folder / "model.onnx"
    export_onnx(backbone, raw, aot, interface)
    optimize(raw, optimized, backbone, aot)
    diff = max_abs_difference(optimized, backbone, aot, interface)
    kind = "AoT" if aot else "vanilla"
    if not diff <= tolerance:
        raise ExportError(f"{kind} graph: ONNX Runtime differs from PyTorch by {diff:.3g} (> {tolerance:g}); "
                          "nothing was written")
    return ExportedGraph(raw, optimized, diff, fused_op_counts(optimized))
