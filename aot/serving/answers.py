"""What the answers of the kinds are made of (each kind's answer is its spec's: aot.serving.kinds), one rule for the
served head stage, `aot predict` and the client: softmax and sigmoid, a classification's or regression's answer from
its logits, a token task's entities from its words.

A served answer ends with the `version` that produced it; `aot predict` puts the task's name first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aot.serving.words import Words, entities


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
