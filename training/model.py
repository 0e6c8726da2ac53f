"""A trainable task model: a method's body plus a classification (or regression) head."""

from __future__ import annotations

import copy

import torch
from torch import nn

from serving.protocol import pooling_row
from training.backbone import Backbone
from training.data.task import TaskSpec
from training.methods.base import MethodConfig, method_spec


class ClassificationHead(nn.Module):
    """dropout -> dense -> tanh -> dropout -> out on the pooled state (RoBERTa's head; BERT's pooler + classifier).
    Every method shares it, so serving needs one head format: out(tanh(dense(h)))."""

    def __init__(self, hidden_size: int, num_outputs: int, dropout: float = 0.1):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, num_outputs)
        self.dropout = nn.Dropout(dropout)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(torch.tanh(self.dense(self.dropout(pooled)))))


class TaskModel(nn.Module):
    """A body, which pools every way in POOLINGS, and a head that reads the row of the task's `pooling`."""

    def __init__(self, body: nn.Module, head: ClassificationHead, pooling: str):
        super().__init__()
        self.body = body
        self.head = head
        self.row = pooling_row(pooling)
        self.pooling = pooling

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        return self.head(self.body(input_ids, attention_mask, token_type_ids)[:, self.row])

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


def build_task_model(backbone: Backbone, config: MethodConfig, spec: TaskSpec,
                     pooling: str | None = None) -> TaskModel:
    """Build on a private copy of the encoder: methods hook into it or unfreeze it, the caller's stays pristine.

    `pooling`: which pooled state the head reads; None takes the one the backbone declares (Backbone.pooling)."""
    own = Backbone(backbone.name, copy.deepcopy(backbone.encoder), backbone.tokenizer, backbone.fingerprint,
                   backbone.pooling)
    own.encoder.requires_grad_(False)
    body = method_spec(config.method).build(own, config)
    head = ClassificationHead(own.hidden_size, spec.num_outputs)
    pooler = getattr(own.encoder, "pooler", None)
    if pooler is not None and isinstance(getattr(pooler, "dense", None), nn.Linear):
        with torch.no_grad():  # BERT's pretrained pooler is a better start for the head's dense layer
            head.dense.weight.copy_(pooler.dense.weight)
            head.dense.bias.copy_(pooler.dense.bias)
    return TaskModel(body, head, pooling or backbone.pooling)


def trainable_parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
