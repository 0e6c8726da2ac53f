"""A task's kind, and the answer of each kind: one rule for the served head stage, `aot predict` and the client.

    classification  {"label", "logits", "probabilities"}     the arg-max label, softmax
    regression      {"score"}
    multilabel      {"labels": [...], "scores": {label: p}}   every label whose sigmoid reaches the task's threshold
                                                             (in label order; an empty list is a valid answer)
    tokens          {"entities": [{"text", "label", "start", "end", "score"}]}   character offsets into the text
    embedding       {"embedding": [...]}                      the task's pooled state, unit length if it normalizes

A served answer ends with the `version` that produced it; `aot predict` puts the task's name first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aot.serving.words import Words, entities

TASK_KINDS = ("classification", "regression", "multilabel", "tokens", "embedding")
# What each kind's head reads: the pooled state of its pooling, or every token's final state
READS_TOKENS = ("tokens",)
# The multi-label threshold of a task that records none
DEFAULT_THRESHOLD = 0.5


def kind_of(meta: dict) -> str:
    """The kind a task record (task.json, an artifact's task) declares; one without `kind` was exported before
    kinds existed: a classifier, or a regressor when it has no labels."""
    kind = meta.get("kind")
    if kind is None:
        return "regression" if meta.get("labels") is None else "classification"
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown kind {kind!r}: expected one of {', '.join(TASK_KINDS)}")
    return kind


def sigmoid(values: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(values, dtype=np.float64)))


def softmax(values: np.ndarray) -> np.ndarray:
    """Along the last axis, in float64."""
    values = np.asarray(values, dtype=np.float64)
    exps = np.exp(values - values.max(axis=-1, keepdims=True))
    return exps / exps.sum(axis=-1, keepdims=True)


def label_for(labels: Sequence[str] | None, logits) -> str:
    """The arg-max label name (the first of equal ones), or the score as text for regression (labels None)."""
    values = np.asarray(logits, dtype=np.float64).reshape(-1)
    if labels is None:
        return f"{values[0]:.6g}"
    return labels[int(np.argmax(values))]


def answer(label: str, logits, version: str | None = None) -> dict:
    """What predict, infer and the client return: a classification's label, logits and probabilities (softmax), or
    a regression's score. A regression task has one output and a classification at least two labels, so the
    logits alone say which (the client sees no label set). A served answer ends with the task `version` that
    produced it (`<name>@<id>`; `aot predict` reads an artifact, not the store, and has none)."""
    values = [float(v) for v in np.asarray(logits).reshape(-1)]
    version_key = {} if version is None else {"version": version}
    if len(values) == 1:
        return {"score": values[0]} | version_key
    return {"label": label, "logits": values, "probabilities": softmax(values).tolist()} | version_key


def carried_answer(kind: str, label: str, values) -> dict:
    """The answer of a kind whose LOGITS and LABEL carry it all (aot.serving.heads.CARRIED_KINDS): what a client
    builds from them where a request asked for compact answers (protocol.ANSWERS_PARAMETER), equal to the server's
    own (pooled_answer)."""
    if kind == "embedding":
        return {"embedding": [float(v) for v in values]}
    return answer(label, values)


def pooled_answer(kind: str, names: Sequence[str] | None, values: np.ndarray,
                  threshold: float = DEFAULT_THRESHOLD) -> dict:
    """The answer of a pooled kind from its head's output: logits (classification, multilabel), the score
    (regression) or the vector (embedding)."""
    if kind in ("classification", "regression"):
        return answer(label_for(names, values), values)
    if kind == "multilabel":
        scores = sigmoid(values)
        return {"labels": [name for name, p in zip(names, scores, strict=True) if p >= threshold],
                "scores": {name: float(p) for name, p in zip(names, scores, strict=True)}}
    if kind == "embedding":
        return {"embedding": [float(v) for v in values]}
    raise ValueError(f"kind {kind!r} does not answer from a pooled state")


def tokens_answer(names: Sequence[str], words: Words, first: np.ndarray, token_logits: np.ndarray) -> dict:
    """Entities from the logits of each word's first token: `first` [S] is the word each token starts (-1: none,
    aot.serving.words.first_pieces), `token_logits` [S, n]. A word with no token (cut off by the max length) is outside
    every entity."""
    tags, scores = ["O"] * len(words.spans), [1.0] * len(words.spans)
    starts = np.flatnonzero(first >= 0)
    if len(starts):
        probabilities = softmax(token_logits[starts])
        for word, k, p in zip(first[starts], probabilities.argmax(-1), probabilities.max(-1), strict=True):
            tags[word], scores[word] = names[k], float(p)
    return {"entities": entities(words, tags, scores)}
