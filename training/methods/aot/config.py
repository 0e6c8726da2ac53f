"""Hyperparameters of AoT P-Tuning (paper section 3.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from training.methods.base import MethodConfig, MethodError

ACTIVATIONS = ("tanh", "gelu", "relu", "identity")


@dataclass
class FCConfig(MethodConfig):
    """FC reparametrization: P^i = f(dropout(E) W1^i + b1^i) W2^i + b2^i, one MLP per layer.

    rank: width r of the MLP (paper grid: 32, 64, 128, 256, 512).
    activation: f. Default tanh: it keeps every feature of E W1 (order one by construction) in a bounded,
        zero-centred range, so P starts small and smooth and no unit is dead at init (ReLU drops half of them).
    dropout: applied to the embedding rows E before W1 (paper).
    """

    method: ClassVar[str] = "fc"
    rank_field: ClassVar[str] = "rank"
    rank: int = 64
    activation: str = "tanh"
    dropout: float = 0.1

    def validate(self) -> None:
        super().validate()
        if self.activation not in ACTIVATIONS:
            raise MethodError(f"fc: unknown activation {self.activation!r}: expected one of {', '.join(ACTIVATIONS)}")


@dataclass
class KronConfig(MethodConfig):
    """Kronecker reparametrization: P^i = (W_L^i ⊗ W_M^i) W_R^i; token x is row (x // b, x % b).

    rank: r (paper grid: 5, 10, 25, 30, 50); W_R is r^2 x d.
    a, b: factor sizes with a * b >= |V|; None picks the near-square pair (a = ceil(sqrt|V|), b = ceil(|V| / a)).
    dropout: applied to the looked-up rows P_x (paper: 0.1).
    """

    method: ClassVar[str] = "kron"
    rank_field: ClassVar[str] = "rank"
    rank: int = 10
    a: int | None = None
    b: int | None = None
    dropout: float = 0.1

    def resolve(self, vocab_size: int) -> "KronConfig":
        import math

        if self.a is None and self.b is None:
            self.a = math.isqrt(vocab_size - 1) + 1
            self.b = -(-vocab_size // self.a)
        elif self.a is None or self.b is None:
            given = self.a or self.b
            other = -(-vocab_size // given)
            self.a, self.b = (given, other) if self.a else (other, given)
        if self.a * self.b < vocab_size:
            raise MethodError(f"kron: a * b = {self.a} * {self.b} = {self.a * self.b} < vocabulary size {vocab_size}")
        return self
