"""AoT P-Tuning bodies: the frozen encoder with P^i[x] added before every layer (paper eq. 1)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from training.backbone import Architecture, Backbone
from training.methods.aot.config import FCConfig, KronConfig
from training.methods.aot.layer import FCPrompt, KronPrompt


class BiasedEncoder(nn.Module):
    """The frozen encoder whose layer i sees H^i + rows[index, i].

    `rows` is [N, L, d] (token-major, as stored by the exporter) and `index` [B, S] says which of the N rows each
    token takes. Training passes the unique tokens of the batch; the exported graph receives both as inputs. One
    implementation serves both, so the exported graph adds exactly what training added.
    """

    def __init__(self, encoder: nn.Module, architecture: Architecture):
        super().__init__()
        self.encoder = encoder
        self.uses_token_type_ids = architecture.uses_token_type_ids(encoder.config)
        # Python ints, so that the exported graph reshapes with constants rather than Shape ops.
        self.num_layers = len(architecture.layers(encoder))
        self.hidden_size = int(encoder.config.hidden_size)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self._hooks = [layer.register_forward_pre_hook(partial(self._add_bias, i), with_kwargs=True)
                       for i, layer in enumerate(architecture.layers(encoder))]

    def remove_hooks(self) -> None:
        """Detach from the encoder (benchmarks share one encoder between methods)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _add_bias(self, i: int, module: nn.Module, args: tuple, kwargs: dict):
        if self._bias is None:
            return None
        flat, base = self._bias
        # One gather of the B*S rows layer i needs from the flat [N*L, d] table; the cast touches only those rows.
        if args:
            hidden = args[0]
            return (hidden + F.embedding(base + i, flat).to(hidden.dtype), *args[1:]), kwargs
        hidden = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": hidden + F.embedding(base + i, flat).to(hidden.dtype)}

    def forward(self, input_ids, attention_mask, token_type_ids, rows, index) -> torch.Tensor:
        """`rows` [N, L, d]; `index` [B, S] picks each token's row. Returns the first token's state [B, d]."""
        self._bias = (rows.reshape(-1, self.hidden_size), index.long() * self.num_layers)
        try:
            extra = {"token_type_ids": token_type_ids} if self.uses_token_type_ids and token_type_ids is not None else {}
            out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra)
        finally:
            self._bias = None
        return out.last_hidden_state[:, 0]


class AoTBody(nn.Module):
    """Training-time AoT: rows of P for the batch's unique tokens only, then the biased encoder."""

    def __init__(self, backbone: Backbone, prompt: nn.Module):
        super().__init__()
        self.biased = BiasedEncoder(backbone.encoder, backbone.architecture)
        self.aot = prompt

    @property
    def embeddings(self) -> torch.Tensor:
        return self.biased.encoder.get_input_embeddings().weight

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of P for `token_ids`, [U, L, d]."""
        return self.aot.rows(token_ids, self.embeddings)

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        unique, inverse = torch.unique(input_ids, return_inverse=True)
        return self.biased(input_ids, attention_mask, token_type_ids, self.rows(unique), inverse)


def build_fc(backbone: Backbone, config: FCConfig) -> AoTBody:
    std = float(backbone.embeddings.detach().float().std())
    return AoTBody(backbone, FCPrompt(config, backbone.num_layers, backbone.hidden_size, std))


def build_kron(backbone: Backbone, config: KronConfig) -> AoTBody:
    config.resolve(backbone.embeddings.shape[0])
    return AoTBody(backbone, KronPrompt(config, backbone.num_layers, backbone.hidden_size))
