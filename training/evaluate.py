"""Scoring a trained task on a labelled file with its own metric, in PyTorch (`aot evaluate`)."""

from __future__ import annotations

from pathlib import Path

from training.backbone import Backbone
from training.data.files import read_examples
from training.data.task import DataError
from training.predict import Predictor
from training.trainer import encode, predict_logits, score


def evaluate_file(task_dir: str | Path, path: str | Path, backbone: Backbone | None = None) -> dict:
    """The task's metric on a JSONL, CSV or TSV file with the columns training reads (text, text_pair?, label)."""
    predictor = Predictor.load(task_dir, backbone)
    spec = predictor.artifact.spec
    rows = read_examples(Path(path), spec.is_regression)
    if not spec.is_regression:
        for example, where in rows:
            if example.label not in spec.labels:
                raise DataError(f"{where}: label {example.label!r} is not one of the task's labels {list(spec.labels)}")
    examples = [example for example, _ in rows]
    tokenizer = predictor.backbone.tokenizer
    encoded = encode(tokenizer, examples, spec, predictor.artifact.max_length)
    logits = predict_logits(predictor.model, encoded, tokenizer.pad_token_id or 0, predictor.device)
    return {"task": spec.name, "metric": spec.metric, "score": score(logits, encoded, spec),
            "examples": len(examples), "data": str(path)}
