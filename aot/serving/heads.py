"""The head stage: each item's task head by its kind, on a whole batch, and what it answers, in columns.

One source for the fused step (CPU and torch engines), the GPU head step and the repository's CPU engine in process
(aot.exporter.cpu_engine):
    classification, regression, multilabel   out(f(dense(h))) on the pooled state h of the task's pooling (f its
                head_activation): in numpy here, once per task version of the batch, or on the engine's device (the
                torch engine's device heads, aot.serving_torch.heads: their outputs come with the encoder's, EncoderOutput
                .logits; the arithmetic is this module's, in torch);
    embedding   the pooled state of its pooling, of unit length if it normalizes;
    tokens      out(s) on every token's final state s, each item at its own length.
Which head a task has is its kind's spec's (aot.serving.kinds.KindSpec.head). The LABEL of each item is found here
for the whole batch, by its kind's rule (KindSpec.label: the arg-max label, a regressor's score as text, a
multi-label task's labels as a JSON list); the ANSWER JSON only for the items whose request asks for it
(HeadOutputs.bodies), by its kind's answer (KindSpec.answer).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from aot.serving import protocol
from aot.serving.answers import tokens_answer
from aot.serving.engine import EncoderOutput
from aot.serving.kinds import NONE
from aot.serving.tasks import ServedTask
from aot.serving.words import Words

_erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has no erf; a head's dense output is small
# The activations a served head applies (aot.training.model.HEAD_ACTIVATIONS, the same functions in torch;
# aot.serving_torch.heads on the device).
HEAD_ACTIVATIONS = {"tanh": np.tanh, "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))}


def chosen_state(task: ServedTask, pooled: np.ndarray) -> np.ndarray:
    """The pooled state a task's head reads, [B, d] fp32, from the pooled states [B, K, d] (protocol.POOLINGS)."""
    return pooled[:, protocol.pooling_row(task.pooling)].astype(np.float32)


def pooled_logits(task: ServedTask, pooled: np.ndarray) -> np.ndarray:
    """A pooled kind's head (aot.training.model.ClassificationHead in eval mode): pooled [B, K, d] -> [B, n]."""
    activation = HEAD_ACTIVATIONS[task.meta.get("head_activation", "tanh")]
    h = activation(chosen_state(task, pooled) @ task.head["dense.weight"].T + task.head["dense.bias"])
    return (h.astype(np.float32) @ task.head["out.weight"].T + task.head["out.bias"]).astype(protocol.LOGITS_DTYPE)


def token_logits(task: ServedTask, states: np.ndarray) -> np.ndarray:
    """A token task's head (aot.training.model.TokenHead in eval mode) on every token's state [S, d] -> [S, n]."""
    out = states.astype(np.float32) @ task.head["out.weight"].T + task.head["out.bias"]
    return out.astype(protocol.LOGITS_DTYPE)


def embeddings(task: ServedTask, pooled: np.ndarray) -> np.ndarray:
    """An embedding task's vectors (aot.training.model.EmbeddingHead): [B, d], of unit length if it normalizes."""
    chosen = chosen_state(task, pooled)
    if task.meta.get("normalize", True):
        chosen = chosen / np.maximum(np.linalg.norm(chosen, axis=-1, keepdims=True), 1e-12)
    return chosen.astype(protocol.LOGITS_DTYPE)


@dataclass
class Answer:
    """One item's outputs: LOGITS (`values`), LABEL (`label`) and ANSWER (`body`: aot.serving.answers)."""

    values: np.ndarray
    label: str
    body: dict


class NotFinite(FloatingPointError):
    """The engine overflowed: a server fault. The step retries the batch request by request, so only the requests
    whose own states are not finite fail (never a NaN answer with a label)."""


@dataclass
class HeadOutputs:
    """A batch's head outputs in columns: LOGITS of each item (`values` [B, W] fp32, zero past its width `widths[k]`),
    its LABEL (`labels` [B], bytes), and what its ANSWER is made of (bodies())."""

    values: np.ndarray
    widths: np.ndarray
    labels: np.ndarray
    groups: list[tuple[ServedTask, np.ndarray]]
    words: list[Words | None] = field(default_factory=list)
    first: np.ndarray | None = None
    tokens: dict[int, np.ndarray] = field(default_factory=dict)  # a token item's logits [S, n]

    @functools.cached_property
    def item_tasks(self) -> list[ServedTask]:
        """Each item's task version, in the batch's order."""
        out: list = [None] * len(self.widths)
        for task, rows in self.groups:
            for k in rows.tolist():
                out[k] = task
        return out

    def bodies(self, rows: range, compact: bool = False) -> list[dict | str]:
        """The ANSWER of each item of `rows` (aot.serving.answers), without its version; with `compact`, the kind's
        name for an item whose answer LOGITS and LABEL carry (KindSpec.carried: protocol.ANSWERS_PARAMETER)."""
        out = []
        for k in rows:
            task = self.item_tasks[k]
            if compact and task.spec.carried is not None:
                out.append(task.kind)
            elif task.spec.reads_tokens:
                out.append(tokens_answer(task.labels, self.words[k], self.first[k], self.tokens[k]))
            else:
                out.append(task.spec.answer(task.labels, self.values[k, :self.widths[k]], task.threshold))
        return out


    def answers(self, rows: range) -> list[Answer]:
        """Each item of `rows` as one Answer (the repository's CPU engine in process: aot.exporter.cpu_engine)."""
        return [Answer(self.values[k, :self.widths[k]], self.labels[k].decode(), body)
                for k, body in zip(rows, self.bodies(rows), strict=True)]


def head_width(task: ServedTask) -> int:
    """How many outputs a pooled kind's head has (its labels; a regressor's 1)."""
    return int(task.head["out.weight"].shape[0])


def head_outputs(groups: list[tuple[ServedTask, np.ndarray]], encoded: EncoderOutput, lengths: np.ndarray,
                 words: list[Words | None] | None = None, first: np.ndarray | None = None,
                 on_device: np.ndarray | None = None) -> HeadOutputs:
    """Each item's head by its task version (`groups`: each version and its items' rows of a batch whose sequences
    have `lengths`): a pooled kind's once per version over its items (in numpy, or read from `encoded.logits` for
    the rows `on_device`), a token task's per item at its own length. States that are not finite raise NotFinite."""
    size = len(lengths)
    values: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, their outputs [n, w])
    labels = np.empty(size, dtype=np.object_)
    tokens: dict[int, np.ndarray] = {}
    for task, rows in groups:
        if task.spec.reads_tokens:
            for k in rows.tolist():
                states = encoded.states[k, : lengths[k]]
                _check_finite(states, "token")
                tokens[k] = logits = token_logits(task, states)
                values.append((np.array([k]), logits[first[k][: len(logits)] >= 0].reshape(1, -1)))
            labels[rows] = b""
            continue
        if on_device is not None and on_device[rows].all():
            out = encoded.logits[rows, : head_width(task)]
            _check_finite(out, "head")
        else:
            _check_finite(encoded.pooled[rows][:, protocol.pooling_row(task.pooling)], repr(task.pooling))
            out = embeddings(task, encoded.pooled[rows]) if task.spec.head == NONE else \
                pooled_logits(task, encoded.pooled[rows])
        values.append((rows, out))
        labels[rows] = task.spec.label(task, out)
    width = max(v.shape[1] for _, v in values)
    matrix = np.zeros((size, width), dtype=protocol.LOGITS_DTYPE)
    widths = np.zeros(size, np.int64)
    for rows, v in values:
        matrix[rows, : v.shape[1]] = v
        widths[rows] = v.shape[1]
    return HeadOutputs(matrix, widths, labels, groups, words or [], first, tokens)


def _check_finite(states: np.ndarray, what: str) -> None:
    if not np.isfinite(states).all():
        raise NotFinite(f"the encoder's {what} states are not finite")
