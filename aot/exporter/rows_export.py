"""The rows graphs of a task store: training's own row formulas (aot.training.methods.aot_ptuning.layer) as small ONNX
graphs whose inputs are the factors, so that serving computes a factored task's rows with ONNX Runtime (one fused GEMM
pipeline, fp16 output) instead of re-implementing them. One graph per formula serves every task and every rank:

    REPO/tasks/rows/fc-<activation>.onnx   e [U, d] fp32, w1, b1, w2, b2 -> rows [U, L, d] fp16
    REPO/tasks/rows/kron.onnx              token_ids [U] int64, w_left, w_mid, w_right -> rows [U, L, d] fp16

Each graph is checked against PyTorch on random factors of two ranks before it is written.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aot.exporter.onnx_export import OPSET, ExportError
from aot.serving import protocol
from aot.serving.store.atomic import write_atomic
from aot.serving.store.layout import ROWS_DIR
from aot.serving.store.reader import rows_graph_name
from aot.training.methods.aot_ptuning.config import ACTIVATIONS
from aot.training.methods.aot_ptuning.layer import ACTIVATION_MODULES, fc_rows, kron_rows

_FP16 = getattr(torch, protocol.ROWS_DTYPE.name)
_FC_INPUTS = ("e", "w1", "b1", "w2", "b2")
_KRON_INPUTS = ("token_ids", "w_left", "w_mid", "w_right")


class _FCRowsGraph(nn.Module):
    def __init__(self, activation: str):
        super().__init__()
        self.act = ACTIVATION_MODULES[activation]()

    def forward(self, e, w1, b1, w2, b2):
        return fc_rows(e, w1, b1, w2, b2, self.act).to(_FP16)


class _KronRowsGraph(nn.Module):
    def forward(self, token_ids, w_left, w_mid, w_right):
        return kron_rows(token_ids, w_left, w_mid, w_right).to(_FP16)


def _fc_inputs(L: int, d: int, r: int, U: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"e": torch.randn(U, d, generator=g) * 0.05, "w1": torch.randn(L, d, r, generator=g) / d ** 0.5 / 0.05,
            "b1": torch.randn(L, r, generator=g), "w2": torch.randn(L, r, d, generator=g) * 0.1,
            "b2": torch.randn(L, d, generator=g) * 0.1}


def _kron_inputs(L: int, d: int, r: int, U: int, g: torch.Generator, vocab: int = 1000) -> dict[str, torch.Tensor]:
    b = 5 + 3 * r  # b, like the rank, differs between the traced example and the checks
    return {"token_ids": torch.randint(0, vocab, (U,), generator=g),
            "w_left": torch.randn(L, vocab // b + 1, r, generator=g), "w_mid": torch.randn(L, b, r, generator=g),
            "w_right": torch.randn(L, r * r, d, generator=g) * 0.1}


def _graphs() -> dict[str, tuple[nn.Module, tuple[str, ...], callable]]:
    graphs = {rows_graph_name({"method": "fc", "activation": a}): (_FCRowsGraph(a), _FC_INPUTS, _fc_inputs)
              for a in ACTIVATIONS}
    graphs[rows_graph_name({"method": "kron"})] = (_KronRowsGraph(), _KRON_INPUTS, _kron_inputs)
    return graphs


def _onnx_bytes(module: nn.Module, names: tuple[str, ...], example: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    dynamic = {name: {i: f"{name}_{i}" for i in range(example[name].dim())} for name in names}
    dynamic["rows"] = {0: "tokens"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(example[n] for n in names), buffer, input_names=list(names),
                          output_names=["rows"], dynamic_axes=dynamic, opset_version=OPSET, dynamo=False)
    return buffer.getvalue()


def _check(name: str, graph: bytes, module: nn.Module, names: tuple[str, ...], make, L: int, d: int) -> None:
    """Served rows equal PyTorch's (to fp16 rounding) at ranks and token counts other than the traced ones."""
    import onnxruntime as ort

    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(1)
    for r, U in ((3, 1), (16, 37)):
        example = make(L, d, r, U, g)
        want = module(*(example[n] for n in names)).float().numpy()
        got = session.run(None, {n: example[n].numpy() for n in names})[0]
        if got.dtype != protocol.ROWS_DTYPE or got.shape != want.shape:
            raise ExportError(f"rows graph {name}: {got.dtype} {got.shape}, expected fp16 {want.shape}")
        error = float(np.abs(got.astype(np.float32) - want).max())
        if error > 2e-3 * max(1.0, float(np.abs(want).max())):
            raise ExportError(f"rows graph {name}: differs from PyTorch by {error:.2e} (rank {r}, {U} tokens)")


def write_rows_graphs(store_root: Path, num_layers: int, hidden_size: int) -> list[str]:
    """Export, check and write every rows graph into `store_root/rows/` (atomically, file by file)."""
    folder = Path(store_root) / ROWS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (module, names, make) in _graphs().items():
        module.eval()
        example = make(num_layers, hidden_size, 8, 5, torch.Generator().manual_seed(0))
        graph = _onnx_bytes(module, names, example)
        _check(name, graph, module, names, make, num_layers, hidden_size)
        write_atomic(folder / f"{name}.onnx", graph)
        written.append(name)
    return written
