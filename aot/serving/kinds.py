"""The kinds of task in one registry: what every layer knows of a kind, read from its spec (KindSpec), never from
comparing its name.

A kind registers its spec here (register), as a training method registers in aot.training.method_registry; the five
kinds register below. What a spec says is read by serving (the head stage, the compact answers the client rebuilds),
the torch engine's device heads, the exporter (the task record, the head it writes and checks), the client and the
training package, which attaches its own part by name (aot.training.kinds: how examples become tensors, the loss,
predictions and their score) beside a data reader (aot.training.data.kind_rows). A new kind is one spec, one
training kind and one reader; tests/test_kinds_served.py runs every registered kind end to end.

Numpy only, like the rest of the ground floor: the Triton image imports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from aot.serving.answers import answer, label_for, sigmoid

# What a kind's head is (HEADS): out(f(dense(h))) on the pooled state h of the task's pooling (the torch engine runs it
# on its device), out(s) on every token's final state s, or none (the pooled state is the answer).
DENSE, LINEAR, NONE = "dense", "linear", "none"
HEADS = (DENSE, LINEAR, NONE)


@dataclass(frozen=True)
class KindSpec:
    """One kind of task: its head, its label set, its metrics, its answer and its LABEL.

    `answer` (names, values [w], threshold) -> the answer of a pooled kind from its head's outputs (None: a kind that
    reads tokens answers from its words, aot.serving.answers.tokens_answer). `label` (task, values [n, w]) -> each
    row's LABEL, UTF-8 bytes ([n] object; the task has labels, label_bytes and threshold: aot.serving.tasks
    .ServedTask). `carried` (label, values [w]) -> the answer a client rebuilds from LOGITS and LABEL alone, for a
    kind whose answer they carry (the server then writes only the kind's name: protocol.ANSWERS_PARAMETER)."""

    name: str
    description: str  # its answer's keys
    answer_key: str  # the key its answers alone have (what tells an answer's kind: aot.cli.ranking)
    head: str
    labelled: bool  # it has a label set (classes or tags)
    metrics: tuple[str, ...]  # the metrics that score it (aot.training.metrics.METRICS), the first its default
    answer: Callable[[Sequence[str] | None, np.ndarray, float], dict] | None
    label: Callable[[object, np.ndarray], np.ndarray]
    carried: Callable[[str, np.ndarray], dict] | None = None
    least_labels: int = 0  # how many labels its label set has at least
    text_pairs: bool = False  # it reads a text pair as one input where its data has pairs
    pair_examples: bool = False  # its examples are pairs of texts, each answered alone (an anchor and its positive)
    record: tuple[str, ...] = ()  # the TaskSpec fields its task record (task.json) keeps beyond every kind's
    since_format: int = 1  # the first task-artifact format that holds it (aot.training.artifact)

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"kind {self.name!r}: head {self.head!r}: expected one of {', '.join(HEADS)}")

    @property
    def reads_tokens(self) -> bool:
        """Its head reads every token's final state, not a pooled state."""
        return self.head == LINEAR

    @property
    def unlabelled_outputs(self) -> int:
        """Its head's outputs when it has no label set: a regressor's one score, none without a head."""
        return int(self.head != NONE)


KINDS: dict[str, KindSpec] = {}
DEFAULT_THRESHOLD = 0.5  # the multi-label threshold of a task that records none


def register(spec: KindSpec) -> KindSpec:
    KINDS[spec.name] = spec
    return spec


def kind_spec(name: str) -> KindSpec:
    if name not in KINDS:
        raise ValueError(f"unknown kind {name!r}: expected one of {', '.join(KINDS)}")
    return KINDS[name]


def kind_of(meta: dict) -> str:
    """The kind a task record (task.json, an artifact's task) declares; one without `kind` was exported before
    kinds existed: a classifier, or a regressor when it has no labels."""
    kind = meta.get("kind")
    if kind is None:
        return (CLASSIFICATION if meta.get("labels") is not None else REGRESSION).name
    return kind_spec(kind).name


def pooled_answer(kind: str, names: Sequence[str] | None, values: np.ndarray,
                  threshold: float = DEFAULT_THRESHOLD) -> dict:
    """The answer of a pooled kind from its head's output (what the server, `aot predict` and the client return)."""
    spec = kind_spec(kind)
    if spec.answer is None:
        raise ValueError(f"kind {kind!r} does not answer from a pooled state")
    return spec.answer(names, values, threshold)


def _bytes(texts) -> np.ndarray:
    return np.array([t.encode() for t in texts], dtype=np.object_)


def _embedding(values) -> dict:
    return {"embedding": [float(v) for v in values]}


def _labels_on(names, values, threshold) -> dict:
    scores = sigmoid(values)
    return {"labels": [name for name, p in zip(names, scores, strict=True) if p >= threshold],
            "scores": {name: float(p) for name, p in zip(names, scores, strict=True)}}


def _no_label(task, values) -> np.ndarray:
    return np.full(len(values), b"", dtype=np.object_)


PAPER_METRICS = ("accuracy", "f1", "acc_f1", "mcc", "pearson_spearman")  # the paper's Table 1 scores its tasks so

CLASSIFICATION = register(KindSpec(
    "classification", "{label, logits, probabilities}: the arg-max label, softmax", "label", DENSE, labelled=True,
    metrics=PAPER_METRICS, least_labels=2, text_pairs=True,
    answer=lambda names, values, threshold: answer(label_for(names, values), values),
    label=lambda task, values: task.label_bytes[np.argmax(values, axis=1)],
    carried=lambda label, values: answer(label, values)))
REGRESSION = register(KindSpec(
    "regression", "{score}", "score", DENSE, labelled=False, metrics=("pearson_spearman", *PAPER_METRICS[:-1]),
    text_pairs=True,
    answer=lambda names, values, threshold: answer(label_for(names, values), values),
    label=lambda task, values: _bytes(f"{float(v):.6g}" for v in values[:, 0]),
    carried=lambda label, values: answer(label, values)))
MULTILABEL = register(KindSpec(
    "multilabel", "{labels: [...], scores: {label: p}}: every label whose sigmoid reaches the task's threshold",
    "labels", DENSE, labelled=True, metrics=("micro_f1", "macro_f1"), least_labels=1, text_pairs=True, record=("threshold",),
    since_format=3, answer=_labels_on,
    label=lambda task, values: _bytes(json.dumps([task.labels[j] for j in np.flatnonzero(row)])
                                      for row in sigmoid(values) >= task.threshold)))
TOKENS = register(KindSpec(
    "tokens", "{entities: [{text, label, start, end, score}]}: character offsets into the text", "entities", LINEAR,
    labelled=True, metrics=("entity_f1",), least_labels=1, since_format=3, answer=None, label=_no_label))
EMBEDDING = register(KindSpec(
    "embedding", "{embedding: [...]}: the task's pooled state, unit length if it normalizes", "embedding", NONE, labelled=False,
    metrics=("recall@1", "recall@5", "recall@10", "spearman"), record=("normalize",), pair_examples=True,
    since_format=3,
    answer=lambda names, values, threshold: _embedding(values), label=_no_label,
    carried=lambda label, values: _embedding(values)))
