"""The torch engine's backbone (`aot export backbone --format torch`): the encoder's config and weights, checked
through the very engine that will serve them (aot.serving_torch.engine) against PyTorch before anything is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from aot.exporter.onnx_export import ExportableBackbone, ExportError, example_inputs
from aot.serving import protocol
from aot.serving.engine import Prepared
from aot.serving_torch.encoder import save_encoder
from aot.serving_torch.engine import TorchBackbone
from aot.training.backbone import Backbone


def _prepared(feeds: dict[str, torch.Tensor], aot: bool, num_layers: int, hidden: int) -> list[Prepared]:
    """The example batch as the served step hands it to the engine: per request its tokens, index and rows."""
    names = [n for n in protocol.token_inputs(protocol.TOKEN_TYPE_IDS in feeds)]
    lengths = feeds[protocol.ATTENTION_MASK].sum(1).tolist()
    out = []
    for b, n in enumerate(lengths):
        p = Prepared({k: feeds[k][b, :n].numpy() for k in names}, want_states=True)
        if aot:
            lo, hi = feeds[protocol.AOT_ROW_OFFSETS][b].item(), feeds[protocol.AOT_ROW_OFFSETS][b + 1].item()
            p.rows = feeds[protocol.AOT_ROWS][lo:hi].numpy().reshape(-1, num_layers, hidden)
            p.index = feeds[protocol.AOT_INDEX][b, :n].numpy()
        out.append(p)
    return out


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
                requests = _prepared(feeds, aot, backbone.num_layers, backbone.hidden_size)
                worst = max(worst, float(np.abs(engine.run(requests) - pooled).max()))
                for b, r in enumerate(requests):  # each request's token states, its own length
                    worst = max(worst, float(np.abs(r.states - states[b, : len(r.states)]).max()))
        finally:
            module.close()
    if not worst <= tolerance:
        raise ExportError(f"torch engine: differs from PyTorch by {worst:.3g} (> {tolerance:g}); nothing was written")
    return worst
