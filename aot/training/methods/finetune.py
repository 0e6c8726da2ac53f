"""Baselines that train the backbone's own weights: full fine-tuning and BitFit (biases only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from aot.training.backbone import Backbone
from aot.training.method_registry import MethodConfig, MethodSpec, register


class PlainBody(nn.Module):
    """The encoder itself; which of its weights train is the method's choice."""

    def __init__(self, backbone: Backbone):
        super().__init__()
        self.encoder = backbone.encoder
        self.uses_token_type_ids = backbone.uses_token_type_ids

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        extra = {"token_type_ids": token_type_ids} if self.uses_token_type_ids and token_type_ids is not None else {}
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state


@dataclass
class FullConfig(MethodConfig):
    """Plain fine-tuning of every weight (the reference the paper omits from the ranking)."""

    method: ClassVar[str] = "full"


@dataclass
class BitFitConfig(MethodConfig):
    """BitFit (Ben Zaken et al., 2022): only the bias terms of the encoder train."""

    method: ClassVar[str] = "bitfit"


def build_full(backbone: Backbone, config: FullConfig) -> PlainBody:
    backbone.encoder.requires_grad_(True)
    return PlainBody(backbone)


def build_bitfit(backbone: Backbone, config: BitFitConfig) -> PlainBody:
    for name, param in backbone.encoder.named_parameters():
        param.requires_grad_(name.endswith(".bias"))
    return PlainBody(backbone)


register(MethodSpec("full", FullConfig, build_full, "full fine-tuning", 5e-5))
register(MethodSpec("bitfit", BitFitConfig, build_bitfit, "BitFit: bias terms only", 1e-3))
