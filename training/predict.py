"""Running a trained task in PyTorch: the reference every served answer is compared with."""

from __future__ import annotations

from pathlib import Path

import torch

from training.artifact import TaskArtifact, load_task
from training.backbone import Backbone
from serving.labels import answer, label_for
from training.data.task import Example
from training.model import TaskModel
from training.trainer import encode, predict_logits


class Predictor:
    def __init__(self, artifact: TaskArtifact, model: TaskModel, backbone: Backbone, device: str = "cpu"):
        self.artifact, self.model, self.backbone = artifact, model, backbone
        self.device = torch.device(device)
        self.model.to(self.device)

    @classmethod
    def load(cls, task_dir: str | Path, backbone: Backbone | None = None, device: str = "cpu") -> "Predictor":
        return cls(*load_task(task_dir, backbone), device=device)

    def logits(self, texts: list[str], pairs: list[str | None] | None = None) -> torch.Tensor:
        spec = self.artifact.spec
        pairs = pairs or [None] * len(texts)
        label = 0.0 if spec.is_regression else spec.labels[0]
        examples = [Example(t, label, p) for t, p in zip(texts, pairs)]
        encoded = encode(self.backbone.tokenizer, examples, spec, self.artifact.max_length)
        pad = self.backbone.tokenizer.pad_token_id or 0
        return predict_logits(self.model, encoded, pad, self.device)

    def predict(self, texts: list[str], pairs: list[str | None] | None = None) -> list[dict]:
        spec = self.artifact.spec
        logits = self.logits(texts, pairs)
        return [answer(label_for(spec.labels, row), row) for row in logits]

