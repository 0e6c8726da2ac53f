"""Embedding tasks (`--problem embedding`): the vector is the task's pooled state (unit length if it normalizes).

Trained on pairs `{"text": anchor, "text_pair": positive}`: retrieval pairs with in-batch negatives, or scored
pairs with a cosine loss, their scores scaled to [0, 1] over the split (aot.training.model.embedding_loss). Scored by
recall@k (each anchor retrieves its own positive among every positive of the split) or the Spearman correlation of
cosines and scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aot.serving.kinds import pooled_answer
from aot.training.data.task import Example, TaskSpec
from aot.training.kinds.base import Encoded, Kind, collate, run_model
from aot.training.metrics import compute_metric
from aot.training.model import embedding_loss


def _scaled(scores: list[float]) -> torch.Tensor:
    values = torch.tensor(scores, dtype=torch.float32)
    low, high = values.min(), values.max()
    return (values - low) / (high - low) if high > low else torch.ones_like(values)


class EmbeddingKind(Kind):
    name = "embedding"

    def encode(self, tokenizer, examples: list[Example], spec: TaskSpec, max_length: int) -> Encoded:
        def tokens(texts):
            enc = tokenizer(texts, truncation=True, max_length=max_length)
            return Encoded(enc["input_ids"], enc.get("token_type_ids"))

        anchors = tokens([ex.text for ex in examples])
        if all(ex.text_pair is not None for ex in examples):
            anchors.pair = tokens([ex.text_pair for ex in examples])
            scores = [ex.label for ex in examples]
            anchors.labels = None if any(s is None for s in scores) else _scaled(scores)
        return anchors

    def inputs(self, encoded: Encoded, rows, pad_id, device) -> list[dict]:
        """The anchors, then their positives."""
        return [collate(encoded, rows, pad_id, device), collate(encoded.pair, rows, pad_id, device)]

    def loss_from(self, outputs, inputs, encoded: Encoded, rows, spec: TaskSpec) -> torch.Tensor:
        anchors, positives = outputs
        scores = None if encoded.labels is None else encoded.labels[rows].to(anchors.device)
        return embedding_loss(anchors, positives, scores)

    def predict(self, model, encoded: Encoded, pad_id, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The anchors' vectors [N, d], and the positives' when the split has pairs."""
        anchors = torch.stack(run_model(model, encoded, pad_id, device))
        positives = None if encoded.pair is None else torch.stack(run_model(model, encoded.pair, pad_id, device))
        return anchors, positives

    def score(self, predictions, encoded: Encoded, spec: TaskSpec) -> float:
        anchors, positives = (F.normalize(p.float(), dim=-1) for p in predictions)
        if spec.metric == "spearman":
            return compute_metric("spearman", (anchors * positives).sum(-1).numpy(), encoded.labels.numpy(), 0)
        return compute_metric(spec.metric, (anchors @ positives.T).numpy(), None, 0)

    def answers(self, spec: TaskSpec, predictions, encoded: Encoded) -> list[dict]:
        return [pooled_answer(spec.kind, None, row.numpy()) for row in predictions[0]]
