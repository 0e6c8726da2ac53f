"""Hyperparameters of Houlsby adapters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from aot.training.method_registry import MethodConfig


@dataclass
class AdapterConfig(MethodConfig):
    """Houlsby et al. (2019) bottleneck adapters after the attention and the feed-forward sub-layer of each layer.

    rank: bottleneck width (paper grid: 16, 32, 64, 128, 256).
    train_layer_norms: Houlsby also trains the layer norms.
    """

    method: ClassVar[str] = "adapter"
    rank_field: ClassVar[str] = "rank"
    rank: int = 64
    train_layer_norms: bool = True
