"""The two parametrizations of P. Both compute only the rows of the tokens asked for, token-major [U, L, d]:
the same layout as the fused table the exporter writes. `fc_rows` and `kron_rows` are the one formula: training
calls them here, and the exporter turns them into the ONNX graphs that serving computes factored rows with
(aot.exporter.rows_export)."""

from __future__ import annotations

import math

import torch
from torch import nn

from aot.training.methods.aot_ptuning.config import FCConfig, KronConfig

ACTIVATION_MODULES = {"tanh": nn.Tanh, "gelu": nn.GELU, "relu": nn.ReLU, "identity": nn.Identity}


def fc_rows(e: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
            act: nn.Module) -> torch.Tensor:
    """f(e W1 + b1) W2 + b2 for every layer: e [U, d], w1 [L, d, r], b1 [L, r], w2 [L, r, d], b2 [L, d] -> [U, L, d]."""
    h = act(torch.matmul(e, w1) + b1[:, None, :])  # [L, U, r]
    return (torch.matmul(h, w2) + b2[:, None, :]).transpose(0, 1)


def kron_rows(token_ids: torch.Tensor, w_left: torch.Tensor, w_mid: torch.Tensor,
              w_right: torch.Tensor) -> torch.Tensor:
    """(W_L[x // b] ⊗ W_M[x % b]) W_R for every layer: w_left [L, a, r], w_mid [L, b, r], w_right [L, r*r, d]."""
    b = w_mid.shape[1]
    left, mid = w_left[:, token_ids // b], w_mid[:, token_ids % b]  # [L, U, r]
    L, U, r = left.shape
    kron = (left[..., :, None] * mid[..., None, :]).reshape(L, U, r * r)
    return torch.matmul(kron, w_right).transpose(0, 1)


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
        self.act = ACTIVATION_MODULES[config.activation]()
        self.dropout = nn.Dropout(config.dropout)

    def rows(self, token_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        e = self.dropout(embeddings[token_ids].to(self.w1.dtype))  # [U, d]
        return fc_rows(e, self.w1, self.b1, self.w2, self.b2, self.act)


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
        return self.dropout(kron_rows(token_ids, self.w_left, self.w_mid, self.w_right))
