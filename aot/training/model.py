"""A trainable task model: a method's body plus the head of the task's kind, and the heads themselves.

Below the methods (aot.training.methods.aot_ptuning's AotModel is a TaskModel); aot.training.factory builds one by
method. The heads: a ClassificationHead on a pooled state (classification, regression, multilabel), a TokenHead on every
token's state (tokens), and an EmbeddingHead that only pools (and normalizes): an embedding task's vector is its
pooled state. Which head a kind has is its spec's (aot.serving.kinds); each kind's loss is aot.training.kinds'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aot.serving.kinds import LINEAR, NONE, kind_spec
from aot.serving.protocol import pooling_row
from aot.serving_torch.encoder import pool_states
from aot.training.data.task import TaskSpec

HEAD_ACTIVATIONS = {"tanh": torch.tanh, "gelu": F.gelu}  # aot.serving.tasks.HEAD_ACTIVATIONS computes the same


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


class TokenHead(nn.Module):
    """dropout -> out on every token's final state: BERT's, RoBERTa's and DeBERTa-v2's token classifier. Served
    format: out.weight [n, d], out.bias."""

    def __init__(self, hidden_size: int, num_outputs: int, dropout: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(hidden_size, num_outputs)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(states))


class EmbeddingHead(nn.Module):
    """No weights: an embedding task's vector is its pooled state, of unit length when it `normalize`s (the
    cosine that its loss and a search compute is then a dot product)."""

    def __init__(self, normalize: bool = True):
        super().__init__()
        self.normalize = normalize

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return F.normalize(pooled.float(), dim=-1) if self.normalize else pooled


def make_head(spec: TaskSpec, hidden_size: int, activation: str = "tanh", inner_size: int | None = None,
              dropout: float = 0.1) -> nn.Module:
    """A new head of the task's kind (a classification head: `activation` and `inner_size` as recorded)."""
    head = spec.kind_spec.head
    if head == LINEAR:
        return TokenHead(hidden_size, spec.num_outputs, dropout)
    if head == NONE:
        return EmbeddingHead(spec.normalize)
    return ClassificationHead(hidden_size, spec.num_outputs, dropout, activation, inner_size=inner_size)


def head_record(head: nn.Module) -> dict:
    """What the artifact records of a head (docs/formats.md): a classification head's activation and width."""
    if isinstance(head, ClassificationHead):
        return {"activation": head.activation, "inner_size": head.dense.out_features}
    return {}


class TaskModel(nn.Module):
    """A body, which gives every token's final state, and the head of the task's kind: a token task's head reads
    each token's state, the others the states pooled as the task's `pooling` says."""

    def __init__(self, body: nn.Module, head: nn.Module, pooling: str, kind: str = "classification"):
        super().__init__()
        self.body = body
        self.head = head
        self.row = pooling_row(pooling)
        self.pooling = pooling
        self.kind = kind

    def logits(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        """The head's output: [B, n] (classification, regression, multilabel), [B, S, n] (tokens) or [B, d]
        (embedding). What the trainer, `aot predict` and export validation call (AotModel's forward returns more)."""
        return self.head_logits(self.body(input_ids, attention_mask, token_type_ids), attention_mask)

    def head_logits(self, states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The head's output on the body's final states [B, S, d]: what `logits` computes after the body, and what a
        job of many tasks computes on the states of a pass its batch shared with others (aot.training.mixed_step)."""
        if kind_spec(self.kind).reads_tokens:
            return self.head(states)
        return self.head(pool_states(states, attention_mask)[:, self.row])

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


def init_head_from_pooler(head: nn.Module, encoder: nn.Module) -> None:
    """BERT's pretrained pooler is a better start for a classification head's dense layer than a random one."""
    dense = getattr(getattr(encoder, "pooler", None), "dense", None)
    if (isinstance(head, ClassificationHead) and isinstance(dense, nn.Linear)
            and dense.weight.shape == head.dense.weight.shape):
        with torch.no_grad():
            head.dense.weight.copy_(dense.weight)
            head.dense.bias.copy_(dense.bias)


EMBEDDING_SCALE = 20.0  # the in-batch softmax's inverse temperature (sentence-transformers' default)


def embedding_loss(anchors: torch.Tensor, positives: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
    """An embedding task's loss on pairs (row i of `anchors` with row i of `positives`): with `scores` (in [0, 1]),
    the mean squared error between each pair's cosine and its score (sentence-transformers' CosineSimilarityLoss);
    without, in-batch negatives: cross-entropy of each anchor over its cosines to every positive of the batch, scaled
    by EMBEDDING_SCALE (MultipleNegativesRankingLoss)."""
    anchors, positives = F.normalize(anchors.float(), dim=-1), F.normalize(positives.float(), dim=-1)
    if scores is not None:
        return F.mse_loss((anchors * positives).sum(-1), scores.float())
    return F.cross_entropy(EMBEDDING_SCALE * anchors @ positives.T, torch.arange(len(anchors), device=anchors.device))


def trainable_parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
