"""A trainable task model: a method's body plus a classification (or regression) head."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from serving.protocol import pooling_row
from training.backbone import Backbone
from training.data.task import TaskSpec
from training.methods.base import MethodConfig, method_spec


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


def build_task_model(backbone: Backbone, config: MethodConfig, spec: TaskSpec, pooling: str | None = None,
                     max_length: int | None = None, head: dict | None = None,
                     copy_encoder: bool = True) -> TaskModel:
    """Build on a private copy of the encoder: methods hook into it or unfreeze it, the caller's stays pristine.

    `pooling`: which pooled state the head reads; None takes the one the backbone declares (Backbone.pooling).
    AoT methods build an AotModel (training.peft_model, what get_aot_model returns); `max_length` and `head` (an
    artifact's head record) are recorded there. `copy_encoder` False: AoT only, hook into the caller's encoder."""
    pooling = pooling or backbone.pooling
    if copy_encoder:
        backbone = Backbone(backbone.name, copy.deepcopy(backbone.encoder), backbone.tokenizer, backbone.fingerprint,
                            backbone.pooling)
    backbone.encoder.requires_grad_(False)
    if method_spec(config.method).shared_backbone:
        from training.peft_model import aot_task_model

        return aot_task_model(backbone, config, spec, pooling, max_length, head)
    if not copy_encoder:
        raise ValueError(f"method {config.method!r} changes the encoder: it cannot share the caller's")
    body = method_spec(config.method).build(backbone, config)
    head_config = head or {}
    head_module = ClassificationHead(backbone.hidden_size, spec.num_outputs,
                                     activation=head_config.get("activation", "tanh"),
                                     inner_size=head_config.get("inner_size"))
    init_head_from_pooler(head_module, backbone.encoder)
    return TaskModel(body, head_module, pooling)


def init_head_from_pooler(head: ClassificationHead, encoder: nn.Module) -> None:
    """BERT's pretrained pooler is a better start for the head's dense layer than a random one."""
    dense = getattr(getattr(encoder, "pooler", None), "dense", None)
    if isinstance(dense, nn.Linear) and dense.weight.shape == head.dense.weight.shape:
        with torch.no_grad():
            head.dense.weight.copy_(dense.weight)
            head.dense.bias.copy_(dense.bias)


def trainable_parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
