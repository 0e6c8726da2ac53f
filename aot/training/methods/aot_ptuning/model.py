"""AoT P-Tuning bodies: the frozen encoder with P^i[x] added before every layer (paper eq. 1)."""

from __future__ import annotations

import torch
from torch import nn

from aot.serving_torch.encoder import BiasedEncoder
from aot.training.backbone import Backbone
from aot.training.methods.aot_ptuning.config import FCConfig, KronConfig
from aot.training.methods.aot_ptuning.layer import FCPrompt, KronPrompt


class AotBody(nn.Module):
    """Training-time AoT: rows of P for the batch's unique tokens only, then the biased encoder."""

    def __init__(self, backbone: Backbone, prompt: nn.Module):
        super().__init__()
        self.biased = BiasedEncoder(backbone.encoder, backbone.uses_token_type_ids)
        self.aot = prompt

    @property
    def embeddings(self) -> torch.Tensor:
        return self.biased.encoder.get_input_embeddings().weight

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of P for `token_ids`, [U, L, d]."""
        return self.aot.rows(token_ids, self.embeddings)

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        unique, inverse = torch.unique(input_ids, return_inverse=True)
        return self.biased.states(input_ids, attention_mask, token_type_ids, self.rows(unique), inverse)


def build_fc(backbone: Backbone, config: FCConfig) -> AotBody:
    std = float(backbone.embeddings.detach().float().std())
    return AotBody(backbone, FCPrompt(config, backbone.num_layers, backbone.hidden_size, std))


def build_kron(backbone: Backbone, config: KronConfig) -> AotBody:
    config.resolve(backbone.embeddings.shape[0])
    return AotBody(backbone, KronPrompt(config, backbone.num_layers, backbone.hidden_size))
