"""The torch engine's backbone (`aot export backbone --format torch`): the encoder's config and weights, checked
through the very engine that will serve them (aot.serving_torch.engine) against PyTorch before anything is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from aot.exporter.onnx_export import ExportableBackbone, ExportError, example_inputs
from aot.serving import protocol
from aot.serving.engine import EncoderBatch
from aot.serving_torch.encoder import save_encoder
from aot.serving_torch.engine import TorchBackbone
from aot.training.backbone import Backbone


def _batch(feeds: dict[str, torch.Tensor], aot: bool, num_layers: int, hidden: int) -> EncoderBatch:
    """The example batch as the served step hands it to the engine: its tokens, and each token's row of the batch's
    rows (the rows interface's offsets made global)."""
    names = protocol.token_inputs(protocol.TOKEN_TYPE_IDS in feeds)
    batch = EncoderBatch({k: feeds[k].numpy() for k in names}, feeds[protocol.ATTENTION_MASK].sum(1).numpy(),
                         np.ones(len(feeds[protocol.INPUT_IDS]), bool))
    if aot:
        first_row = feeds[protocol.AOT_ROW_OFFSETS][:-1].numpy().astype(np.int64) // (num_layers * hidden)
        batch.index = feeds[protocol.AOT_INDEX].numpy().astype(np.int64) + first_row[:, None]
        batch.rows = [feeds[protocol.AOT_ROWS].numpy().reshape(-1, num_layers, hidden)]
    return batch


def export_torch_encoder(backbone: Backbone, folder: Path, tolerance: float = 1e-4,
                         trials: tuple[tuple[int, int], ...] = ((3, 13), (1, 5))) -> float:
    """Write the encoder to `folder` and return the worst difference between the served engine (AoT and vanilla,
    random non-zero rows: pooled and token states) and training's module; ExportError, and nothing kept, when it
    exceeds `tolerance`."""
    save_encoder(backbone.encoder, folder)
    worst = 0.0
    for aot in (True, False):
        engine = TorchBackbone(folder, backbone.uses_token_type_ids, aot, device="cpu")
        module = ExportableBackbone(backbone, aot).eval()
        try:
            for k, (batch, seq) in enumerate(trials):
                feeds = example_inputs(backbone, aot, batch, seq, seed=200 + k)
                with torch.no_grad():
                    pooled, states = (t.numpy() for t in module(**feeds))
                batch = _batch(feeds, aot, backbone.num_layers, backbone.hidden_size)
                out = engine.run(batch)
                worst = max(worst, float(np.abs(out.pooled - pooled).max()))
                for b, n in enumerate(batch.lengths.tolist()):  # each sequence's token states, its own length
                    worst = max(worst, float(np.abs(out.states[b, :n] - states[b, :n]).max()))
        finally:
            module.close()
    if not worst <= tolerance:
        raise ExportError(f"torch engine: differs from PyTorch by {worst:.3g} (> {tolerance:g}); nothing was written")
    return worst
