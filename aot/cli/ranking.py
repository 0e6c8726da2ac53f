"""`--top-k K` of `aot predict` and `aot infer`: a classification answer's K most probable labels, by name, and a
multi-label answer's K highest scores.

A 100-label answer carries 100 logits and 100 probabilities (about 4.5 KB of JSON) that say nothing of which label
each is; `"top": [{"label": "positive", "probability": 0.93}, ...]` says it in K entries, most probable first, in
place of "logits" and "probabilities". A multi-label answer keeps its "labels" (those at or over its threshold) and
gets `"top": [{"label", "score"}, ...]`, the K highest scores, in place of "scores". An answer with no labels to rank
(a regression's score, an embedding, entities) is left as it is, and the command says how many were (unranked_note).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence

from aot.serving.kinds import KINDS


def ranked(answer: dict) -> bool:
    """Whether --top-k ranks this kind of answer: a classification's (probabilities) or a multi-label one's (scores by
    label)."""
    return "probabilities" in answer or isinstance(answer.get("scores"), dict)


def top_scores(answer: dict, k: int) -> dict:
    """A multi-label answer with "top" (its k highest scores, named) where its scores by label were."""
    scores = answer["scores"]
    top = [{"label": name, "score": scores[name]} for name in sorted(scores, key=lambda n: -scores[n])[:k]]
    return {("top" if key == "scores" else key): (top if key == "scores" else value) for key, value in answer.items()}


def unranked_note(answers, k: int) -> None:
    """Say once on standard error how many answers --top-k left as they are (kinds without labels to rank), so that
    the flag is never silently ignored."""
    kinds = Counter(_kind(a) for a in answers if "error" not in a and "top" not in a and not ranked(a))
    if kinds:
        shown = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        print(f"aot: warning: --top-k {k} ranks classification and multi-label answers; {sum(kinds.values())} "
              f"answer(s) have no labels to rank and are as usual ({shown})", file=sys.stderr)


def _kind(answer: dict) -> str:
    return next((kind for kind, spec in KINDS.items() if spec.answer_key in answer), "other")


def top_labels(answer: dict, labels: Sequence[str], k: int) -> dict:
    """`answer` with "top" (the k most probable of `labels`, named) where its logits and probabilities were; a
    multi-label answer's k highest scores (top_scores)."""
    if isinstance(answer.get("scores"), dict):
        return top_scores(answer, k)
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
