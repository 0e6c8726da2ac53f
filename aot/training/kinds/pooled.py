"""The kinds whose head reads one pooled state and answers from its outputs: classification (cross-entropy),
regression (mean squared error) and multilabel (binary cross-entropy; a threshold on the sigmoids, tuned on dev)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from aot.serving.answers import sigmoid
from aot.serving.kinds import DEFAULT_THRESHOLD
from aot.training.data.task import Example, TaskSpec
from aot.training.kinds.base import Encoded, Kind, run_model
from aot.training.metrics import compute_metric

# Thresholds a multi-label task's dev score is tuned over (0.05 ... 0.95)
THRESHOLDS = np.round(np.arange(0.05, 0.951, 0.05), 2)


class PooledKind(Kind):
    """A head on one pooled state whose outputs answer: a kind's targets, its criterion and what its metric scores
    are its subclass's."""

    def targets(self, examples: list[Example], spec: TaskSpec) -> torch.Tensor:
        raise NotImplementedError

    def scored(self, predictions: torch.Tensor) -> np.ndarray:
        """What the task's metric scores of the head's outputs [N, n]."""
        raise NotImplementedError

    def encode(self, tokenizer, examples: list[Example], spec: TaskSpec, max_length: int) -> Encoded:
        texts = [ex.text for ex in examples]
        with_pairs = any(ex.text_pair is not None for ex in examples)
        pairs = [ex.text_pair or "" for ex in examples] if with_pairs else None
        enc = tokenizer(texts, pairs, truncation=True, max_length=max_length)
        labels = None if any(ex.label is None for ex in examples) else self.targets(examples, spec)
        return Encoded(enc["input_ids"], enc.get("token_type_ids"), labels)

    def loss_from(self, outputs, inputs, encoded: Encoded, rows, spec: TaskSpec) -> torch.Tensor:
        logits = outputs[0]
        return self.criterion(logits, encoded.labels[rows].to(logits.device))

    def predict(self, model, encoded: Encoded, pad_id, device) -> torch.Tensor:
        """[N, n]: logits (the score, for regression)."""
        return torch.stack(run_model(model, encoded, pad_id, device))

    def score(self, predictions: torch.Tensor, encoded: Encoded, spec: TaskSpec) -> float:
        return compute_metric(spec.metric, self.scored(predictions), encoded.labels.numpy(), spec.num_outputs)

    def answers(self, spec: TaskSpec, predictions: torch.Tensor, encoded: Encoded) -> list[dict]:
        threshold = DEFAULT_THRESHOLD if spec.threshold is None else spec.threshold
        return [spec.kind_spec.answer(spec.labels, row.numpy(), threshold) for row in predictions]


class ClassificationKind(PooledKind):
    """Cross-entropy over the labels; the arg-max label is scored."""

    name = "classification"

    def targets(self, examples, spec):
        index = {name: i for i, name in enumerate(spec.labels)}
        return torch.tensor([index[ex.label] for ex in examples], dtype=torch.long)

    def criterion(self, logits, targets):
        return F.cross_entropy(logits.float(), targets)

    def scored(self, predictions):
        return predictions.argmax(-1).numpy()


class RegressionKind(PooledKind):
    """Mean squared error of the one output, the score."""

    name = "regression"

    def targets(self, examples, spec):
        return torch.tensor([float(ex.label) for ex in examples], dtype=torch.float32)

    def criterion(self, logits, targets):
        return F.mse_loss(logits.squeeze(-1).float(), targets)

    def scored(self, predictions):
        return predictions.squeeze(-1).numpy()


class MultilabelKind(PooledKind):
    """Binary cross-entropy per label; a threshold on the sigmoids, tuned on dev after training."""

    name = "multilabel"
    tunes = True

    def targets(self, examples, spec):
        index = {name: i for i, name in enumerate(spec.labels)}
        targets = torch.zeros(len(examples), len(spec.labels))
        for row, ex in enumerate(examples):
            targets[row, [index[name] for name in ex.label]] = 1.0
        return targets

    def criterion(self, logits, targets):
        return F.binary_cross_entropy_with_logits(logits.float(), targets.float())

    def score(self, predictions: torch.Tensor, encoded: Encoded, spec: TaskSpec) -> float:
        return max(self._tuned(predictions, encoded.labels.numpy(), spec))[0]

    @staticmethod
    def _tuned(predictions: torch.Tensor, gold: np.ndarray, spec: TaskSpec) -> list[tuple[float, float, float]]:
        """(score, -distance from 0.5, threshold) at the task's threshold, or at each of THRESHOLDS when it has
        none yet (training: its dev score is the best one, ties to the threshold nearest 0.5)."""
        probabilities = sigmoid(predictions.numpy())
        thresholds = THRESHOLDS if spec.threshold is None else [spec.threshold]
        return [(compute_metric(spec.metric, (probabilities >= t).astype(int), gold, spec.num_outputs),
                 -abs(t - DEFAULT_THRESHOLD), float(t)) for t in thresholds]

    def calibrate(self, predictions: torch.Tensor, encoded: Encoded, spec: TaskSpec) -> TaskSpec:
        free = dataclasses.replace(spec, threshold=None)
        return dataclasses.replace(spec, threshold=max(self._tuned(predictions, encoded.labels.numpy(), free))[2])
