"""`--top-k K` of `aot predict` and `aot infer`: a classification answer's K most probable labels, by name.

A 100-label answer carries 100 logits and 100 probabilities (about 4.5 KB of JSON) that say nothing of which label
each is; `"top": [{"label": "positive", "probability": 0.93}, ...]` says it in K entries, most probable first, in
place of "logits" and "probabilities". An answer without probabilities (a regression's score) is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence


def top_labels(answer: dict, labels: Sequence[str], k: int) -> dict:
    """`answer` with "top" (the k most probable of `labels`, named) where its logits and probabilities were."""
    probabilities = answer.get("probabilities")
    if probabilities is None:
        return answer
    if len(labels) != len(probabilities):
        raise ValueError(f"{len(labels)} label names for {len(probabilities)} probabilities")
    order = sorted(range(len(probabilities)), key=lambda i: -probabilities[i])[:k]
    top = [{"label": labels[i], "probability": probabilities[i]} for i in order]
    out = {}
    for key, value in answer.items():
        if key == "logits":
            out["top"] = top
        elif key != "probabilities":
            out[key] = value
    out.setdefault("top", top)
    return out


class ServedLabels:
    """The label names of the task versions a server answers with, from its task listing (Client.tasks()): by
    version, and for a version it no longer lists (a pinned older one), its task's current names when they fit the
    answer (as many, and the answer's label among them at its arg-max)."""

    def __init__(self, listing: dict):
        self.by_version = {t["version"]: t["labels"] for t in listing["tasks"] if t.get("labels")}
        self.by_name = {t["name"]: t["labels"] for t in listing["tasks"] if t.get("labels")}

    def of(self, answer: dict) -> list[str] | None:
        version = answer.get("version", "")
        labels = self.by_version.get(version) or self.by_name.get(version.split("@", 1)[0])
        probabilities = answer.get("probabilities")
        if labels is None or probabilities is None or len(labels) != len(probabilities):
            return None
        best = max(range(len(probabilities)), key=probabilities.__getitem__)
        return labels if labels[best] == answer.get("label") else None
