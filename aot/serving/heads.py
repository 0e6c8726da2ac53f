"""The head stage: each request's own task head, by its task's kind, and the answer it makes (aot.serving.answers).

One source for the CPU fused step and the GPU head step: each gives, per request, its pooled states and (a token
task's) its tokens' states and words; each task version's requests of a batch go through its head in one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from aot.serving import protocol
from aot.serving.answers import READS_TOKENS, pooled_answer, tokens_answer
from aot.serving.tasks import ServedTask
from aot.serving.words import Words


@dataclass
class HeadInput:
    """One request at the head: its pooled states [P, d] and, for a token task, every token's state [S, d], its
    text's words and the word each token starts (-1: none; aot.serving.words.first_pieces)."""

    pooled: np.ndarray
    states: np.ndarray | None = None
    words: Words | None = None
    first: np.ndarray | None = None


@dataclass
class Answer:
    """One request's outputs: LOGITS (`values`), LABEL (`label`) and ANSWER (`body`, JSON: aot.serving.answers)."""

    values: np.ndarray
    label: str
    body: dict

    @property
    def json(self) -> str:
        return json.dumps(self.body)


def _check_finite(states: np.ndarray, what: str) -> None:
    if not np.isfinite(states).all():
        # the engine overflowed: a server fault; the step retries the batch request by request, so only the
        # requests whose own states are not finite fail
        raise FloatingPointError(f"the encoder's {what} states are not finite")


def _pooled(task: ServedTask, inputs: list[HeadInput]) -> list[Answer]:
    pooled = np.stack([i.pooled for i in inputs])
    _check_finite(pooled[:, protocol.pooling_row(task.pooling)], repr(task.pooling))
    kind = task.kind
    outputs = task.embeddings(pooled) if kind == "embedding" else task.logits(pooled)
    answers = []
    for row in outputs:
        body = pooled_answer(kind, task.labels, row, task.threshold)
        label = (task.label(row) if kind in ("classification", "regression")
                 else json.dumps(body["labels"]) if kind == "multilabel" else "")
        answers.append(Answer(row, label, body))
    return answers


def _tokens(task: ServedTask, request: HeadInput) -> Answer:
    _check_finite(request.states, "token")
    logits = task.token_logits(request.states)
    body = tokens_answer(task.labels, request.words, request.first, logits)
    return Answer(logits[request.first >= 0].reshape(-1), "", body)


def head_answers(tasks: list[ServedTask], inputs: list[HeadInput]) -> list[Answer]:
    """Each request's answer by its own task version (a batch may mix versions and kinds): a pooled kind's heads
    once per version over its requests, a token task's per request (its own length). States that are not finite
    raise (never a NaN answer with a label)."""
    groups: dict[str, list[int]] = {}
    for k, task in enumerate(tasks):
        groups.setdefault(task.version, []).append(k)
    out: list = [None] * len(tasks)
    for ks in groups.values():
        task = tasks[ks[0]]
        if task.kind in READS_TOKENS:
            for k in ks:
                out[k] = _tokens(task, inputs[k])
        else:
            for k, answer in zip(ks, _pooled(task, [inputs[k] for k in ks])):
                out[k] = answer
    return out
