"""Scoring a trained task on a labelled file with its own metric, in PyTorch (`aot evaluate`)."""

from __future__ import annotations

from pathlib import Path

from aot.training.backbone import Backbone
from aot.training.data.files import read_examples, read_kind_file
from aot.training.data.kind_rows import READERS
from aot.training.data.task import DataError, Example, Problems, TaskSpec
from aot.training.predict import Predictor
from aot.training.trainer import encode, evaluate


def read_labelled_file(path: str | Path, spec: TaskSpec) -> list[Example]:
    """The examples of a labelled file its kind's training reads: JSONL, CSV or TSV with the columns text,
    text_pair?, label (classification, regression), labels (multilabel), text and text_pair (+ score) (embedding);
    CoNLL or JSONL tags (tokens). Every label must be one of the task's, and an embedding's pairs scored as its
    metric needs (DataError naming the row)."""
    problems = Problems()
    if spec.kind in READERS:
        rows = read_kind_file(Path(path), spec.kind, problems)
    else:
        rows = read_examples(Path(path), spec.is_regression, problems)
    if spec.labels is not None:
        for example, where in rows:
            for name in example.label if isinstance(example.label, tuple) else [example.label]:
                if name not in spec.labels:
                    problems.add(f"{where}: label {name!r} is not one of the task's labels {list(spec.labels)}")
    problems.check(str(path))
    if spec.kind_spec.pair_examples and (rows[0][0].label is not None) != (spec.metric == "spearman"):
        raise DataError(f"{path}: task {spec.name!r} is scored by {spec.metric}: give "
                        + ("scored pairs" if spec.metric == "spearman" else "pairs without scores"))
    return [example for example, _ in rows]


def evaluate_file(task_dir: str | Path, path: str | Path, backbone: Backbone | None = None) -> dict:
    """The task's metric on a labelled file its kind's training reads (read_labelled_file)."""
    predictor = Predictor.load(task_dir, backbone)
    spec = predictor.artifact.spec
    examples = read_labelled_file(path, spec)
    tokenizer = predictor.backbone.tokenizer
    encoded = encode(tokenizer, examples, spec, predictor.artifact.max_length)
    score = evaluate(predictor.model, encoded, spec, tokenizer.pad_token_id or 0, predictor.device)
    return {"task": spec.name, "metric": spec.metric, "score": score, "examples": len(examples), "data": str(path)}
