"""The two parametrizations of P. Both compute only the rows of the tokens asked for, token-major [U, L, d]:
the same layout as the fused table the exporter writes, so training, fusing and serving share one formula."""

from __future__ import annotations

import math

import torch
from torch import nn

from training.methods.aot.config import FCConfig, KronConfig

_ACTIVATIONS = {"tanh": nn.Tanh, "gelu": nn.GELU, "relu": nn.ReLU, "identity": nn.Identity}


class FCPrompt(nn.Module):
    """P^i = f(dropout(E) W1^i + b1^i) W2^i + b2^i for all layers at once."""

    def __init__(self, config: FCConfig, num_layers: int, hidden_size: int, embedding_std: float):
        super().__init__()
        r, d, L = config.rank, hidden_size, num_layers
        # W1 is scaled so that E W1 is of order one whatever the scale of E (fresh models ~0.02, MiniLM ~0.056):
        # then f works in its useful range and the gradient reaching W2 is neither vanishing nor saturated.
        w1_std = 1.0 / (max(embedding_std, 1e-8) * math.sqrt(d))
        self.w1 = nn.Parameter(torch.randn(L, d, r) * w1_std)
        self.b1 = nn.Parameter(torch.zeros(L, r))
        self.w2 = nn.Parameter(torch.zeros(L, r, d))
        self.b2 = nn.Parameter(torch.zeros(L, d))
        self.act = _ACTIVATIONS[config.activation]()
        self.dropout = nn.Dropout(config.dropout)

    def rows(self, token_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        e = self.dropout(embeddings[token_ids].to(self.w1.dtype))  # [U, d]
        h = self.act(torch.einsum("ud,ldr->lur", e, self.w1) + self.b1[:, None, :])  # [L, U, r]
        return torch.einsum("lur,lrd->uld", h, self.w2) + self.b2  # [U, L, d]


class KronPrompt(nn.Module):
    """P^i = (W_L^i ⊗ W_M^i) W_R^i; row x = (W_L[x // b] ⊗ W_M[x % b]) W_R."""

    def __init__(self, config: KronConfig, num_layers: int, hidden_size: int):
        super().__init__()
        r, L = config.rank, num_layers
        self.b = int(config.b)
        # Unit-variance factors make every entry of W_L ⊗ W_M of order one, like E W1 in the FC form.
        self.w_left = nn.Parameter(torch.randn(L, int(config.a), r))
        self.w_mid = nn.Parameter(torch.randn(L, self.b, r))
        self.w_right = nn.Parameter(torch.zeros(L, r * r, hidden_size))
        self.dropout = nn.Dropout(config.dropout)

    def rows(self, token_ids: torch.Tensor, embeddings: torch.Tensor | None = None) -> torch.Tensor:
        left = self.w_left[:, token_ids // self.b]  # [L, U, r]
        mid = self.w_mid[:, token_ids % self.b]  # [L, U, r]
        L, U, r = left.shape
        kron = (left[..., :, None] * mid[..., None, :]).reshape(L, U, r * r)
        return self.dropout(torch.einsum("luk,lkd->uld", kron, self.w_right))
