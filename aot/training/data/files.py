"""Reading task data from files: a plain folder (JSONL/CSV/TSV), GLUE TSV folders, SuperGLUE JSONL folders.

Every record is read with its file and line so that a bad value can be reported where it is.
"""

from __future__ import annotations

import csv
import difflib
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from aot.serving.formats import read_json_lines
from aot.training.data.conll import CONLL_SUFFIXES, read_tagged
from aot.training.data.kind_rows import LABEL_SEPARATOR, REQUIRED, kind_examples, label_set
from aot.training.data.task import PROBLEMS, DataError, DataWarning, Example, TaskData, TaskSpec
from aot.training.metrics import KIND_METRICS, METRICS

SPLITS = ("train", "dev", "test")
FORMATS = ("jsonl", "csv", "tsv")


@dataclass(frozen=True)
class Record:
    """One row of a file, with where it came from."""

    fields: dict
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def get(self, column: str, required: bool = True):
        value = self.fields.get(column)
        if required and (value is None or value == ""):
            raise DataError(f"{self.where()}: missing column {column!r}")
        return value


def read_records(path: Path, header: bool = True, fieldnames: list[str] | None = None,
                 required: tuple[str, ...] = ()) -> Iterator[Record]:
    """Rows of a .jsonl, .csv or .tsv file as dicts. A byte-order mark is skipped. A CSV/TSV header that lacks a
    `required` column is reported as a header problem, naming the columns found (and the delimiter the header seems
    to use when it reads as one column)."""
    suffix = path.suffix.lstrip(".").lower()
    if suffix == "jsonl":
        for line in read_json_lines(path, DataError):
            yield Record(line.item, path, line.number)
        return
    if suffix not in ("csv", "tsv"):
        raise DataError(f"{path}: unsupported file type {suffix!r}: expected one of {', '.join(FORMATS)}")
    delimiter = "\t" if suffix == "tsv" else ","
    quoting = csv.QUOTE_NONE if suffix == "tsv" else csv.QUOTE_MINIMAL  # GLUE TSVs contain bare quotes
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter, quoting=quoting)
        names = fieldnames
        if header:
            names = next(reader, None)
            if names is None:
                return
            _check_header(path, names, required)
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            yield Record(dict(zip(names, row)), path, reader.line_num)


def _check_header(path: Path, names: list[str], required: tuple[str, ...]) -> None:
    missing = [c for c in required if c not in names]
    if not missing:
        return
    if len(names) == 1:
        try:
            sniffed = csv.Sniffer().sniff(names[0], delimiters=",;\t|").delimiter
        except csv.Error:
            sniffed = None
        if sniffed:
            raise DataError(f"{path}: header: found one column {names[0]!r}: is the delimiter {sniffed!r}? "
                            "(.csv files are read with ',', .tsv files with tabs)")
    found = ", ".join(repr(n) for n in names)
    raise DataError(f"{path}: header: no column {missing[0]!r} (columns found: {found}; expected "
                    f"{', '.join(required)})")


def _split_file(folder: Path, split: str, extensions=FORMATS) -> Path | None:
    found = [folder / f"{split}.{ext}" for ext in extensions if (folder / f"{split}.{ext}").is_file()]
    if len(found) > 1:
        raise DataError(f"{folder}: several files for split {split!r}: {', '.join(p.name for p in found)}")
    return found[0] if found else None


def finalize(name: str, rows: dict[str, list[tuple[Example, str]]], metric: str,
             declared_labels: list[str] | None, regression: bool, source: str) -> TaskData:
    """Check the splits against the label set and build a TaskData.

    `rows[split]` holds (example, where) pairs; `where` names the file and line for error messages.
    """
    for split in ("train", "dev"):
        if not rows.get(split):
            raise DataError(f"{source}: split {split!r} is empty or missing")
    if regression:
        splits = {s: [ex for ex, _ in r] for s, r in rows.items()}
        for split, pairs in rows.items():
            for ex, where in pairs:
                if not isinstance(ex.label, float):
                    raise DataError(f"{where}: label {ex.label!r} is not a number (regression task)")
        has_pair = any(ex.text_pair is not None for ex in splits["train"])
        return TaskData(TaskSpec(name, None, metric, has_pair), splits, source)
    if declared_labels is not None:
        labels = list(declared_labels)
        known = set(labels)
        for split, pairs in rows.items():
            for ex, where in pairs:
                if ex.label not in known:
                    raise DataError(f"{where}: label {ex.label!r} is not in the declared label set {labels}")
    else:
        labels = sorted({ex.label for ex, _ in rows["train"]}, key=_label_sort_key)
        known = set(labels)
        for split in ("dev", "test"):
            for ex, where in rows.get(split, []):
                if ex.label not in known:
                    raise DataError(f"{where}: {split} label {ex.label!r} never occurs in train (train labels: {labels})")
    if len(labels) < 2:
        raise DataError(f"{source}: need at least 2 labels, found {labels}")
    splits = {s: [ex for ex, _ in r] for s, r in rows.items()}
    has_pair = any(ex.text_pair is not None for ex in splits["train"])
    return TaskData(TaskSpec(name, tuple(labels), metric, has_pair), splits, source)


def _label_sort_key(label: str):
    try:
        return (0, float(label), label)
    except ValueError:
        return (1, 0.0, label)


def _label_value(raw, where: str, regression: bool) -> str | float:
    if regression:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise DataError(f"{where}: label {raw!r} is not a number (regression task)") from None
    if isinstance(raw, bool):
        return str(raw).lower()
    if isinstance(raw, float) and raw.is_integer():
        return str(int(raw))
    return str(raw)


def _text(record: Record, column: str, required: bool = True) -> str | None:
    value = record.get(column, required)
    if value is None:
        return None
    if not isinstance(value, str):
        raise DataError(f"{record.where()}: column {column!r} must be text, got {type(value).__name__}")
    if required and not value.strip():
        raise DataError(f"{record.where()}: column {column!r} is empty")
    return value


# ---------------------------------------------------------------------------------------------------------------
# A plain folder: train.*, dev.*, optional test.*, optional task.json


def load_folder(folder: Path, labels: list[str] | None = None, metric: str | None = None,
                problem: str | None = None) -> TaskData:
    """Columns `text`, optional `text_pair`, `label`; the other kinds' rows (aot.training.data.kind_rows,
    aot.training.data.conll) for `problem` multilabel, tokens or embedding. `task.json` may declare name, labels,
    metric and problem (and label_separator); the arguments, when given, take precedence over it."""
    meta = read_task_json(folder / "task.json")
    labels = labels if labels is not None else meta.get("labels")
    declared = problem or meta.get("problem")
    if declared in KIND_METRICS:
        return load_kind_folder(folder, declared, meta, labels, metric)
    regression = declared == "regression"
    if regression and labels is not None:
        raise DataError(f"{folder}: a regression task has no label set (labels {labels} declared)")
    metric = metric or meta.get("metric") or ("pearson_spearman" if regression else "accuracy")
    rows: dict[str, list[tuple[Example, str]]] = {}
    for split in SPLITS:
        path = _split_file(folder, split)
        if path is None:
            if split != "test":
                raise DataError(f"{folder}: no {split}.jsonl, {split}.csv or {split}.tsv")
            continue
        pairs = read_examples(path, regression)
        rows[split] = pairs
        if split == "train" and declared is None and labels is None:
            _warn_if_numeric(path, [ex.label for ex, _ in pairs])
    return finalize(meta.get("name", folder.name), rows, metric, labels, regression, str(folder))


def load_kind_folder(folder: Path, kind: str, meta: dict, labels: list[str] | None,
                     metric: str | None) -> TaskData:
    """A plain folder of a multilabel, tokens or embedding task."""
    suffixes = ("jsonl", *CONLL_SUFFIXES) if kind == "tokens" else FORMATS
    rows: dict[str, list[tuple[Example, str]]] = {}
    for split in SPLITS:
        path = _split_file(folder, split, suffixes)
        if path is None:
            if split != "test":
                raise DataError(f"{folder}: no {split} file ({', '.join(f'{split}.{x}' for x in suffixes)})")
            continue
        rows[split] = read_kind_file(path, kind, meta.get("label_separator", LABEL_SEPARATOR))
    return finalize_kind(meta.get("name", folder.name), kind, rows, metric, labels, str(folder))


def read_kind_file(path: Path, kind: str, separator: str = LABEL_SEPARATOR) -> list[tuple[Example, str]]:
    """A split file of a multilabel, tokens or embedding task, each example with where it was read."""
    rows = read_tagged(path) if kind == "tokens" else kind_examples(read_records(path, required=REQUIRED[kind]),
                                                                    kind, separator)
    if not rows:
        raise DataError(f"{path} has no data rows")
    return rows


def finalize_kind(name: str, kind: str, rows: dict[str, list[tuple[Example, str]]], metric: str | None,
                  declared_labels: list[str] | None, source: str) -> TaskData:
    """Check the splits of a multilabel, tokens or embedding task and build its TaskData (its default metric: the
    kind's first; spearman for scored pairs)."""
    for split in ("train", "dev"):
        if not rows.get(split):
            raise DataError(f"{source}: split {split!r} is empty or missing")
    if kind == "embedding" and declared_labels is not None:
        raise DataError(f"{source}: an embedding task has no label set (labels {declared_labels} declared)")
    scored = kind == "embedding" and rows["train"][0][0].label is not None
    if kind == "embedding":
        for split, pairs in rows.items():
            if (pairs[0][0].label is not None) != scored:
                raise DataError(f"{pairs[0][1]}: {split} pairs are {'not ' if scored else ''}scored, train pairs "
                                f"are{'' if scored else ' not'}: score every split's pairs or none")
    metric = metric or ("spearman" if scored else KIND_METRICS[kind][0])
    if kind == "embedding" and (metric == "spearman") != scored:
        raise DataError(f"{source}: metric {metric} needs " + ("scored pairs" if metric == "spearman" else
                                                               "retrieval pairs (spearman scores scored ones)"))
    splits = {s: [ex for ex, _ in r] for s, r in rows.items()}
    has_pair = kind == "multilabel" and any(ex.text_pair is not None for ex in splits["train"])
    return TaskData(TaskSpec(name, label_set(kind, rows, declared_labels), metric, has_pair, kind), splits, source)


def read_examples(path: Path, regression: bool) -> list[tuple[Example, str]]:
    """A plain file's examples (columns text, optional text_pair, label), each with where it was read."""
    pairs = []
    for rec in read_records(path, required=("text", "label")):
        text = _text(rec, "text")
        pair = _text(rec, "text_pair", required=False) if "text_pair" in rec.fields else None
        label = _label_value(rec.get("label"), rec.where(), regression)
        pairs.append((Example(text, label, pair or None), rec.where()))
    if not pairs:
        raise DataError(f"{path} has no data rows")
    return pairs


# What task.json may say: key -> (check, what it must be).
TASK_JSON = {
    "name": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "labels": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "metric": (lambda v: v in METRICS, f"one of {', '.join(METRICS)}"),
    "problem": (lambda v: v in PROBLEMS, f"one of {', '.join(PROBLEMS)}"),
    "label_separator": (lambda v: isinstance(v, str) and v != "", "a non-empty string (multilabel CSV/TSV)"),
}


def read_task_json(path: Path) -> dict:
    """A plain folder's declarations, checked like any other input: an unknown key or a bad value is refused."""
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON ({exc.msg})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object such as {{\"problem\": \"regression\"}}, "
                        f"got {type(meta).__name__}")
    for key, value in meta.items():
        if key not in TASK_JSON:
            close = difflib.get_close_matches(key, TASK_JSON, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DataError(f"{path}: unknown key {key!r}{hint}: expected one of {', '.join(TASK_JSON)}")
        check, expected = TASK_JSON[key]
        if not check(value):
            raise DataError(f"{path}: {key} {value!r}: expected {expected}")
    return meta


def _warn_if_numeric(path: Path, labels: list[str]) -> None:
    """Numbers as class names are often scores meant for regression: say which problem was assumed."""
    distinct = sorted(set(labels), key=_label_sort_key)
    if all(_label_sort_key(label)[0] == 0 for label in distinct):
        shown = ", ".join(distinct[:5]) + (", ..." if len(distinct) > 5 else "")
        warnings.warn(f"{path}: every label is a number ({shown}): training a {len(distinct)}-class "
                      "classification; --problem regression (or \"problem\": \"regression\" in task.json) "
                      "predicts a score instead, --problem classification silences this", DataWarning, stacklevel=2)


# ---------------------------------------------------------------------------------------------------------------
# GLUE (TSV) and SuperGLUE (JSONL) folders, for users who have the files.

@dataclass(frozen=True)
class BenchmarkTask:
    """How to read one GLUE/SuperGLUE task folder."""

    name: str
    extension: str
    metric: str
    text: str
    text_pair: str | None
    label: str
    labels: tuple[str, ...] | None  # None: regression
    dev_file: str = "dev"
    header: bool = True
    fieldnames: tuple[str, ...] | None = None
    to_text: Callable[[dict], tuple[str, str | None]] | None = None


def _wic_text(row: dict) -> tuple[str, str]:
    return f"{row['word']}: {row['sentence1']}", row["sentence2"]


def _wsc_text(row: dict) -> tuple[str, str]:
    target = row["target"]
    return row["text"], f"{target['span2_text']} refers to {target['span1_text']}"


GLUE_TASKS = {t.name.lower(): t for t in [
    BenchmarkTask("CoLA", "tsv", "mcc", "sentence", None, "label", ("0", "1"), header=False,
                  fieldnames=("source", "label", "original", "sentence")),
    BenchmarkTask("SST-2", "tsv", "accuracy", "sentence", None, "label", ("0", "1")),
    BenchmarkTask("MRPC", "tsv", "acc_f1", "#1 String", "#2 String", "Quality", ("0", "1")),
    BenchmarkTask("STS-B", "tsv", "pearson_spearman", "sentence1", "sentence2", "score", None),
    BenchmarkTask("QQP", "tsv", "acc_f1", "question1", "question2", "is_duplicate", ("0", "1")),
    BenchmarkTask("MNLI", "tsv", "accuracy", "sentence1", "sentence2", "gold_label",
                  ("contradiction", "entailment", "neutral"), dev_file="dev_matched"),
    BenchmarkTask("QNLI", "tsv", "accuracy", "question", "sentence", "label", ("entailment", "not_entailment")),
    BenchmarkTask("RTE", "tsv", "accuracy", "sentence1", "sentence2", "label", ("entailment", "not_entailment")),
    BenchmarkTask("WNLI", "tsv", "accuracy", "sentence1", "sentence2", "label", ("0", "1")),
]}

SUPERGLUE_TASKS = {t.name.lower(): t for t in [
    BenchmarkTask("BoolQ", "jsonl", "accuracy", "question", "passage", "label", ("false", "true"), dev_file="val"),
    BenchmarkTask("CB", "jsonl", "acc_f1", "premise", "hypothesis", "label",
                  ("contradiction", "entailment", "neutral"), dev_file="val"),
    BenchmarkTask("RTE", "jsonl", "accuracy", "premise", "hypothesis", "label",
                  ("entailment", "not_entailment"), dev_file="val"),
    BenchmarkTask("WiC", "jsonl", "accuracy", "sentence1", "sentence2", "label", ("false", "true"),
                  dev_file="val", to_text=_wic_text),
    BenchmarkTask("WSC", "jsonl", "accuracy", "text", None, "label", ("false", "true"),
                  dev_file="val", to_text=_wsc_text),
]}


def load_benchmark_folder(folder: Path, task: BenchmarkTask) -> TaskData:
    regression = task.labels is None
    rows: dict[str, list[tuple[Example, str]]] = {}
    for split, stem in (("train", "train"), ("dev", task.dev_file)):
        path = folder / f"{stem}.{task.extension}"
        if not path.is_file():
            raise DataError(f"{folder}: {task.name} needs {path.name}")
        pairs = []
        fieldnames = list(task.fieldnames) if task.fieldnames else None
        for rec in read_records(path, header=task.header, fieldnames=fieldnames):
            if task.to_text is not None:
                try:
                    text, pair = task.to_text(rec.fields)
                except (KeyError, TypeError) as exc:
                    raise DataError(f"{rec.where()}: missing column {exc}") from None
            else:
                text = _text(rec, task.text)
                pair = _text(rec, task.text_pair) if task.text_pair else None
            label = _label_value(rec.get(task.label), rec.where(), regression)
            pairs.append((Example(text, label, pair), rec.where()))
        rows[split] = pairs
    return finalize(task.name, rows, task.metric, None if regression else list(task.labels), regression, str(folder))


def detect_benchmark(folder: Path) -> BenchmarkTask | None:
    """A GLUE task folder holds train.tsv, a SuperGLUE one train.jsonl; the folder name says which task."""
    key = folder.name.lower()
    if (folder / "task.json").is_file():
        return None  # a declared plain folder, whatever its name
    if (folder / "train.tsv").is_file() and key in GLUE_TASKS:
        return GLUE_TASKS[key]
    if (folder / "train.jsonl").is_file() and key in SUPERGLUE_TASKS:
        return SUPERGLUE_TASKS[key]
    return None
