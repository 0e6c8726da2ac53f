"""The kinds whose head reads one pooled state and answers from its outputs: classification (cross-entropy),
regression (mean squared error) and multilabel (binary cross-entropy; a threshold on the sigmoids, tuned on dev)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from aot.serving.answers import DEFAULT_THRESHOLD, pooled_answer, sigmoid
from aot.training.data.task import Example, TaskSpec
from aot.training.kinds.base import Encoded, Kind, run_model
from aot.training.metrics import compute_metric
from aot.training.model import loss_fn

# Thresholds a multi-label task's dev score is tuned over (0.05 ... 0.95)
THRESHOLDS = np.round(np.arange(0.05, 0.951, 0.05), 2)


def _labels(examples: list[Example], spec: TaskSpec) -> torch.Tensor | None:
    if any(ex.label is None for ex in examples):
        return None
    if spec.kind == "regression":
        return torch.tensor([float(ex.label) for ex in examples], dtype=torch.float32)
    index = {name: i for i, name in enumerate(spec.labels)}
    if spec.kind == "multilabel":
        targets = torch.zeros(len(examples), len(spec.labels))
        for row, ex in enumerate(examples):
            targets[row, [index[name] for name in ex.label]] = 1.0
        return targets
    return torch.tensor([index[ex.label] for ex in examples], dtype=torch.long)


class PooledKind(Kind):
    def __init__(self, name: str):
        self.name = name
        self.tunes = name == "multilabel"

    def encode(self, tokenizer, examples: list[Example], spec: TaskSpec, max_length: int) -> Encoded:
        texts = [ex.text for ex in examples]
        with_pairs = any(ex.text_pair is not None for ex in examples)
        pairs = [ex.text_pair or "" for ex in examples] if with_pairs else None
        enc = tokenizer(texts, pairs, truncation=True, max_length=max_length)
        return Encoded(enc["input_ids"], enc.get("token_type_ids"), _labels(examples, spec))

    def loss_from(self, outputs, inputs, encoded: Encoded, rows, spec: TaskSpec) -> torch.Tensor:
        logits = outputs[0]
        return loss_fn(logits, encoded.labels[rows].to(logits.device), spec)

    def predict(self, model, encoded: Encoded, pad_id, device) -> torch.Tensor:
        """[N, n]: logits (the score, for regression)."""
        return torch.stack(run_model(model, encoded, pad_id, device))

    def score(self, predictions: torch.Tensor, encoded: Encoded, spec: TaskSpec) -> float:
        gold = encoded.labels.numpy()
        if spec.kind == "regression":
            return compute_metric(spec.metric, predictions.squeeze(-1).numpy(), gold, 1)
        if spec.kind == "multilabel":
            return max(self._tuned(predictions, gold, spec))[0]
        return compute_metric(spec.metric, predictions.argmax(-1).numpy(), gold, spec.num_outputs)

    @staticmethod
    def _tuned(predictions: torch.Tensor, gold: np.ndarray, spec: TaskSpec) -> list[tuple[float, float, float]]:
        """(score, -distance from 0.5, threshold) at the task's threshold, or at each of THRESHOLDS when it has
        none yet (training: its dev score is the best one, ties to the threshold nearest 0.5)."""
        probabilities = sigmoid(predictions.numpy())
        thresholds = THRESHOLDS if spec.threshold is None else [spec.threshold]
        return [(compute_metric(spec.metric, (probabilities >= t).astype(int), gold, spec.num_outputs),
                 -abs(t - DEFAULT_THRESHOLD), float(t)) for t in thresholds]

    def calibrate(self, predictions: torch.Tensor, encoded: Encoded, spec: TaskSpec) -> TaskSpec:
        if spec.kind != "multilabel":
            return spec
        free = dataclasses.replace(spec, threshold=None)
        return dataclasses.replace(spec, threshold=max(self._tuned(predictions, encoded.labels.numpy(), free))[2])

    def answers(self, spec: TaskSpec, predictions: torch.Tensor, encoded: Encoded) -> list[dict]:
        threshold = DEFAULT_THRESHOLD if spec.threshold is None else spec.threshold
        return [pooled_answer(spec.kind, spec.labels, row.numpy(), threshold) for row in predictions]
