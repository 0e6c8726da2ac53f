"""A trainable task model: a method's body plus a classification (or regression) head, and its loss.

Below the methods (training.methods.aot_ptuning's AotModel is a TaskModel); training.factory builds one by method.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.protocol import pooling_row
from training.data.task import TaskSpec


HEAD_ACTIVATIONS = {"tanh": torch.tanh, "gelu": F.gelu}  # serving.tasks.HEAD_ACTIVATIONS computes the same


class ClassificationHead(nn.Module):
    """dropout -> dense -> activation -> dropout -> out on the pooled state: RoBERTa's and XLM-R's head (tanh), BERT's
    pooler + classifier (tanh, no dropout before the pooler), DeBERTa-v2's ContextPooler + classifier (its
    `pooler_hidden_act`, gelu by default). Every method shares it, so serving needs one head format:
    out(activation(dense(h))). `input_dropout` None: `dropout`."""

    def __init__(self, hidden_size: int, num_outputs: int, dropout: float = 0.1, activation: str = "tanh",
                 input_dropout: float | None = None, inner_size: int | None = None):
        super().__init__()
        if activation not in HEAD_ACTIVATIONS:
            raise ValueError(f"head activation {activation!r} is not served: expected one of "
                             f"{', '.join(HEAD_ACTIVATIONS)}")
        inner = inner_size or hidden_size
        self.dense = nn.Linear(hidden_size, inner)
        self.out = nn.Linear(inner, num_outputs)
        self.dropout = nn.Dropout(dropout)
        self.input_dropout = nn.Dropout(dropout if input_dropout is None else input_dropout)
        self.activation = activation

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        hidden = HEAD_ACTIVATIONS[self.activation](self.dense(self.input_dropout(pooled)))
        return self.out(self.dropout(hidden))


class TaskModel(nn.Module):
    """A body, which pools every way in POOLINGS, and a head that reads the row of the task's `pooling`."""

    def __init__(self, body: nn.Module, head: ClassificationHead, pooling: str):
        super().__init__()
        self.body = body
        self.head = head
        self.row = pooling_row(pooling)
        self.pooling = pooling

    def logits(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        """[B, n]: what the trainer, `aot predict` and export validation call (AotModel's forward returns more)."""
        return self.head(self.body(input_ids, attention_mask, token_type_ids)[:, self.row])

    forward = logits

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu").clone() for n, p in self.named_parameters() if p.requires_grad}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        expected = {n for n, p in self.named_parameters() if p.requires_grad}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(f"weights do not match the method: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                if params[name].shape != value.shape:
                    raise ValueError(f"weight {name}: shape {tuple(value.shape)} != expected {tuple(params[name].shape)}")
                params[name].copy_(value)


def init_head_from_pooler(head: ClassificationHead, encoder: nn.Module) -> None:
    """BERT's pretrained pooler is a better start for the head's dense layer than a random one."""
    dense = getattr(getattr(encoder, "pooler", None), "dense", None)
    if isinstance(dense, nn.Linear) and dense.weight.shape == head.dense.weight.shape:
        with torch.no_grad():
            head.dense.weight.copy_(dense.weight)
            head.dense.bias.copy_(dense.bias)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, spec: TaskSpec) -> torch.Tensor:
    """Cross-entropy; mean squared error for a regression task (one output)."""
    if spec.is_regression:
        return F.mse_loss(logits.squeeze(-1).float(), labels)
    return F.cross_entropy(logits.float(), labels)


def trainable_parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
