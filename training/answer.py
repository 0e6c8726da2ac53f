"""A task's JSON answer from its logits in PyTorch: what `aot predict` prints, one task alone (training.predict) or
several in one batch (training.multitask)."""

from __future__ import annotations

import torch

from serving import labels
from training.data.task import TaskSpec


def answer(name: str, spec: TaskSpec, logits: torch.Tensor) -> dict:
    """One JSON answer, the same rule as the served one (serving.labels.answer: a classification's label, logits and
    probabilities, a regression's score), with the task's name first."""
    values = logits[: spec.num_outputs].float().tolist()  # MultiTaskModel pads narrower tasks' rows
    return {"task": name, **labels.answer(labels.label_for(spec.labels, values), values)}
