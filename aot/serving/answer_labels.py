"""The answer's label and shape, one rule for `aot predict`, the served head and the client (their JSON lines compare
equal)."""

from __future__ import annotations

import math


def label_for(labels, logits) -> str:
    """The arg-max label name, or the score as text for regression (labels None)."""
    values = [float(v) for v in logits]
    if labels is None:
        return f"{values[0]:.6g}"
    return labels[max(range(len(values)), key=values.__getitem__)]


def answer(label: str, logits, version: str | None = None) -> dict:
    """What predict, infer and the client return: a classification's label, logits and probabilities (softmax), or
    a regression's score. A regression task has one output and a classification at least two labels, so the
    logits alone say which (the client sees no label set). A served answer ends with the task `version` that
    produced it (`<name>@<id>`; `aot predict` reads an artifact, not the store, and has none)."""
    values = [float(v) for v in logits]
    version_key = {} if version is None else {"version": version}
    if len(values) == 1:
        return {"score": values[0]} | version_key
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return {"label": label, "logits": values, "probabilities": [e / sum(exps) for e in exps]} | version_key
