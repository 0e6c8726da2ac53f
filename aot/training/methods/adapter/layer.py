"""One Houlsby adapter: h + up(gelu(down(h))), with `up` zero so that it starts as the identity."""

from __future__ import annotations

import torch
from torch import nn


class HoulsbyAdapter(nn.Module):
    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden_size, rank)
        self.up = nn.Linear(rank, hidden_size)
        nn.init.normal_(self.down.weight, std=1e-2)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        self.act = nn.GELU()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.up(self.act(self.down(hidden)))
