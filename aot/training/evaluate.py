"""Scoring a trained task on a labelled file with its own metric, in PyTorch (`aot evaluate`): the score, per class,
the rows whose labels the task does not know (counted and left out, not a reason to refuse the file), and each
row's prediction when asked."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from aot.training.backbone import Backbone
from aot.training.data.files import read_examples, read_kind_file
from aot.training.data.kind_rows import READERS
from aot.training.data.task import DataError, Example, Problems, TaskSpec
from aot.training.kinds import kind_for
from aot.training.predict import Predictor
from aot.training.trainer import encode


def _unknown_labels(example: Example, spec: TaskSpec) -> list[str]:
    names = example.label if isinstance(example.label, tuple) else [example.label]
    return [name for name in names if name not in spec.labels]


def read_labelled_file(path: str | Path, spec: TaskSpec, unknown: Counter | None = None) -> list[Example]:
    """The examples of a labelled file its kind's training reads: JSONL, CSV or TSV with the columns text,
    text_pair?, label (classification, regression), labels (multilabel), text and text_pair (+ score) (embedding);
    CoNLL or JSONL tags (tokens). A label that is not one of the task's is a DataError naming the row, unless
    `unknown` is given: such a row is then left out and its unknown labels counted there. An embedding's pairs must
    be scored as its metric needs."""
    problems = Problems()
    if spec.kind in READERS:
        rows = read_kind_file(Path(path), spec.kind, problems)
    else:
        rows = read_examples(Path(path), spec.is_regression, problems)
    kept = []
    for example, where in rows:
        strangers = _unknown_labels(example, spec) if spec.labels is not None else []
        if strangers and unknown is not None:
            unknown.update(strangers)
            continue
        for name in strangers:
            problems.add(f"{where}: label {name!r} is not one of the task's labels {list(spec.labels)}")
        kept.append(example)
    problems.check(str(path))
    if not kept and unknown:
        raise DataError(f"{path}: no row has a label of task {spec.name!r} ({list(spec.labels or [])}); labels "
                        f"found: {dict(unknown or {})}")
    if spec.kind_spec.pair_examples and (kept[0].label is not None) != (spec.metric == "spearman"):
        raise DataError(f"{path}: task {spec.name!r} is scored by {spec.metric}: give "
                        + ("scored pairs" if spec.metric == "spearman" else "pairs without scores"))
    return kept


def per_class(spec: TaskSpec, examples: list[Example], predicted: list) -> dict[str, dict] | None:
    """Precision, recall, F1 and support per label (classification: `predicted` labels; multilabel: label lists)
    or entity type (tokens: `predicted` tags per word, by seqeval); None for kinds without classes."""
    if spec.kind_spec.reads_tokens:  # tags per word: scored by entity (seqeval)
        from seqeval.metrics import classification_report

        report = classification_report([list(e.label) for e in examples], [list(t) for t in predicted],
                                       output_dict=True, zero_division=0)
        return {name: {"precision": float(row["precision"]), "recall": float(row["recall"]),
                       "f1": float(row["f1-score"]), "support": int(row["support"])}
                for name, row in report.items() if not name.endswith(" avg")}
    if not spec.kind_spec.labelled:
        return None
    counts = {name: Counter() for name in spec.labels}
    for example, guess in zip(examples, predicted, strict=True):
        gold = set(example.label) if isinstance(example.label, tuple) else {example.label}  # a label set, or one
        guess = set(guess) if isinstance(guess, list) else {guess}
        for name in gold | guess:
            counts[name]["tp" if name in gold and name in guess else "fn" if name in gold else "fp"] += 1
    out = {}
    for name, c in counts.items():
        precision = c["tp"] / (c["tp"] + c["fp"]) if c["tp"] + c["fp"] else 0.0
        recall = c["tp"] / (c["tp"] + c["fn"]) if c["tp"] + c["fn"] else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        out[name] = {"precision": precision, "recall": recall, "f1": f1, "support": c["tp"] + c["fn"]}
    return out


def evaluate_file(task_dir: str | Path, path: str | Path, backbone: Backbone | None = None,
                  predictions: str | Path | None = None) -> dict:
    """The task's metric on a labelled file its kind's training reads (read_labelled_file), per class, and the
    rows left out for labels the task does not know (`unknown_labels`: label -> rows). `predictions`: a JSONL file
    to write each scored row's prediction to, in file order: `{"task", "text", "text_pair"?, "expected", ...answer}`."""
    predictor = Predictor.load(task_dir, backbone)
    spec, kind = predictor.artifact.spec, kind_for(predictor.artifact.spec)
    unknown: Counter = Counter()
    examples = read_labelled_file(path, spec, unknown)
    tokenizer = predictor.backbone.tokenizer
    encoded = encode(tokenizer, examples, spec, predictor.artifact.max_length)
    outputs = kind.predict(predictor.model, encoded, tokenizer.pad_token_id or 0, predictor.device)
    answers = kind.answers(spec, outputs, encoded)
    if predictions is not None:
        from aot.serving.store.atomic import write_atomic

        write_atomic(predictions, "".join(json.dumps(_prediction(spec.name, example, answer), ensure_ascii=False) + "\n"
                                          for example, answer in zip(examples, answers, strict=True)))
    predicted = (kind.word_tags(spec, outputs, encoded) if spec.kind_spec.reads_tokens else
                 [a.get(spec.kind_spec.answer_key) for a in answers])
    return {"task": spec.name, "metric": spec.metric, "score": kind.score(outputs, encoded, spec),
            "examples": len(examples), "data": str(path), "unknown_labels": dict(unknown.most_common()),
            "per_class": per_class(spec, examples, predicted)}


def _prediction(task: str, example: Example, answer: dict) -> dict:
    """A row's line of --predictions: its text (and pair), its label as the file gives it, and the task's answer."""
    expected = list(example.label) if isinstance(example.label, tuple) else example.label
    pair = {} if example.text_pair is None else {"text_pair": example.text_pair}
    return {"task": task, "text": example.text, **pair, "expected": expected, **answer}
