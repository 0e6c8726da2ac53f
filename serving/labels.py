"""The answer's label, one rule for `aot predict` and the served head (their JSON lines compare equal)."""

from __future__ import annotations


def label_for(labels, logits) -> str:
    """The arg-max label name, or the score as text for regression (labels None)."""
    values = [float(v) for v in logits]
    if labels is None:
        return f"{values[0]:.6g}"
    return labels[max(range(len(values)), key=values.__getitem__)]
