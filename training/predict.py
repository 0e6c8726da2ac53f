"""Running trained tasks in PyTorch: the reference every served answer is compared with, and `aot predict`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import BinaryIO

import torch

from training.artifact import TaskArtifact, load_task, read_task
from training.backbone import Backbone, load_backbone
from serving import labels
from training.data.task import Example, TaskSpec
from training.methods.base import method_spec
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

    def predict(self, texts: list[str], pairs: list[str | None] | None = None, name: str | None = None) -> list[dict]:
        """answer() for each text; `name`: the task's name in them (default: the one it was trained as)."""
        spec = self.artifact.spec
        return [answer(name or spec.name, spec, row) for row in self.logits(texts, pairs)]


def answer(name: str, spec: TaskSpec, logits: torch.Tensor) -> dict:
    """One JSON answer, the same rule as the served one (serving.labels.answer: a classification's label, logits and
    probabilities, a regression's score), with the task's name first."""
    values = logits[: spec.num_outputs].float().tolist()  # MultiTaskModel pads narrower tasks' rows
    return {"task": name, **labels.answer(labels.label_for(spec.labels, values), values)}

