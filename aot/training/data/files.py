"""Reading task data from files: a plain folder (JSONL/CSV/TSV), GLUE TSV folders, SuperGLUE JSONL folders.

Every record is read with its file and line (aot.training.data.records) so that a bad value can be reported where it
is. A folder is checked whole before anything is trained: every bad row of every split is collected (Problems) and
reported at once, the first MAX_LISTED with their causes and a count. A label seen once or twice in a large train
split is named in a warning: it is often a typo or a shifted column.
"""

from __future__ import annotations

import difflib
import json
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aot.serving.kinds import KINDS
from aot.training.data.kind_rows import LABEL_SEPARATOR, READERS, label_set
from aot.training.data.records import FORMATS, Record, read_records
from aot.training.data.task import PROBLEMS, DataError, DataWarning, Example, Problems, TaskData, TaskSpec
from aot.training.metrics import METRICS

SPLITS = ("train", "dev", "test")
# A label seen at most RARE_LABEL_ROWS times in a train split of at least RARE_LABEL_SPLIT rows is named in a warning.
RARE_LABEL_ROWS, RARE_LABEL_SPLIT = 2, 100


def _split_file(folder: Path, split: str, extensions=FORMATS) -> Path | None:
    found = [folder / f"{split}.{ext}" for ext in extensions if (folder / f"{split}.{ext}").is_file()]
    if len(found) > 1:
        raise DataError(f"{folder}: several files for split {split!r}: {', '.join(p.name for p in found)}")
    return found[0] if found else None


def finalize(name: str, rows: dict[str, list[tuple[Example, str]]], metric: str,
             declared_labels: list[str] | None, regression: bool, source: str, problems: Problems) -> TaskData:
    """Check the splits against the label set and build a TaskData. `rows[split]` holds (example, where) pairs;
    `where` names the file and line. A row's label outside the label set goes to `problems` with those of reading,
    which are all reported here (DataErrors) before the checks of the whole data."""
    labels = None
    if not regression:
        if declared_labels is not None:
            labels, unknown = list(declared_labels), "is not in the declared label set"
        else:
            labels, unknown = sorted({ex.label for ex, _ in rows.get("train", [])}, key=_label_sort_key), \
                "never occurs in train"
        known = set(labels)
        for split, pairs in rows.items():
            for ex, where in pairs:
                if ex.label not in known:
                    problems.add(f"{where}: {split} label {ex.label!r} {unknown} ({_shown(labels)})")
    problems.check(source)
    for split in ("train", "dev"):
        if not rows.get(split):
            raise DataError(f"{source}: split {split!r} is empty or missing")
    if labels is not None and len(labels) < 2:
        raise DataError(f"{source}: need at least 2 labels, found {labels}")
    if labels is not None and declared_labels is None:
        _warn_rare_labels(rows["train"])
    splits = {s: [ex for ex, _ in r] for s, r in rows.items()}
    has_pair = any(ex.text_pair is not None for ex in splits["train"])
    return TaskData(TaskSpec(name, None if labels is None else tuple(labels), metric, has_pair), splits, source)


def _shown(labels: list[str], most: int = 10) -> str:
    return ", ".join(map(repr, labels[:most])) + (f", ... ({len(labels) - most} more)" if len(labels) > most else "")


def _warn_rare_labels(train: list[tuple[Example, str]]) -> None:
    """A label seen once or twice in a large train split is named, with where it is: often a typo or a shifted
    column, which trains a class of its own."""
    if len(train) < RARE_LABEL_SPLIT:
        return
    counts = Counter(ex.label for ex, _ in train)
    rare = sorted((label for label, n in counts.items() if n <= RARE_LABEL_ROWS), key=_label_sort_key)
    if not rare:
        return
    first = {}
    for ex, where in train:
        first.setdefault(ex.label, where)
    named = "; ".join(f"{label!r} {'once' if counts[label] == 1 else 'twice'} ({first[label]})" for label in rare[:10])
    more = f"; and {len(rare) - 10} more" if len(rare) > 10 else ""
    warnings.warn(f"{len(rare)} label(s) of {len(counts)} seen at most {RARE_LABEL_ROWS} times in {len(train)} train "
                  f"rows: {named}{more}. A typo, or a text whose comma shifted its label? Each trains a class of its "
                  "own; declare the labels (task.json \"labels\", --labels) to refuse any other", DataWarning,
                  stacklevel=2)


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
    if declared in READERS:
        return load_kind_folder(folder, declared, meta, labels, metric)
    regression = declared is not None and not KINDS[declared].labelled
    if regression and labels is not None:
        raise DataError(f"{folder}: a regression task has no label set (labels {labels} declared)")
    metric = metric or meta.get("metric") or ("pearson_spearman" if regression else "accuracy")
    rows: dict[str, list[tuple[Example, str]]] = {}
    problems = Problems()
    for split in SPLITS:
        path = _split_file(folder, split)
        if path is None:
            if split != "test":
                raise DataError(f"{folder}: no {split}.jsonl, {split}.csv or {split}.tsv")
            continue
        pairs = read_examples(path, regression, problems)
        rows[split] = pairs
        if split == "train" and declared is None and labels is None:
            _warn_if_numeric(path, [ex.label for ex, _ in pairs])
    return finalize(meta.get("name", folder.name), rows, metric, labels, regression, str(folder), problems)


def load_kind_folder(folder: Path, kind: str, meta: dict, labels: list[str] | None,
                     metric: str | None) -> TaskData:
    """A plain folder of a kind with a reader of its own (multilabel, tokens, embedding: READERS)."""
    suffixes = READERS[kind].suffixes
    rows: dict[str, list[tuple[Example, str]]] = {}
    problems = Problems()
    for split in SPLITS:
        path = _split_file(folder, split, suffixes)
        if path is None:
            if split != "test":
                raise DataError(f"{folder}: no {split} file ({', '.join(f'{split}.{x}' for x in suffixes)})")
            continue
        rows[split] = read_kind_file(path, kind, problems, meta.get("label_separator", LABEL_SEPARATOR))
    return finalize_kind(meta.get("name", folder.name), kind, rows, metric, labels, str(folder), problems)


def read_kind_file(path: Path, kind: str, problems: Problems,
                   separator: str = LABEL_SEPARATOR) -> list[tuple[Example, str]]:
    """A split file of a kind with a reader of its own (READERS), each example with where it was read; its bad rows
    go to `problems` (a CoNLL file stops at its first)."""
    before = problems.total
    rows = READERS[kind].read(path, problems, separator)
    if not rows and problems.total == before:
        raise DataError(f"{path} has no data rows")
    return rows


def finalize_kind(name: str, kind: str, rows: dict[str, list[tuple[Example, str]]], metric: str | None,
                  declared_labels: list[str] | None, source: str, problems: Problems) -> TaskData:
    """Check the splits of a multilabel, tokens or embedding task and build its TaskData (its default metric: the
    kind's first; spearman for scored pairs). The rows' problems (reading's, and labels outside the label set) are
    reported first, all at once."""
    labels = label_set(kind, rows, declared_labels, problems)
    problems.check(source)
    for split in ("train", "dev"):
        if not rows.get(split):
            raise DataError(f"{source}: split {split!r} is empty or missing")
    spec = KINDS[kind]
    if not spec.labelled and declared_labels is not None:
        raise DataError(f"{source}: a task of kind {kind} has no label set (labels {declared_labels} declared)")
    scored = spec.pair_examples and rows["train"][0][0].label is not None
    if spec.pair_examples:
        for split, pairs in rows.items():
            if (pairs[0][0].label is not None) != scored:
                raise DataError(f"{pairs[0][1]}: {split} pairs are {'not ' if scored else ''}scored, train pairs "
                                f"are{'' if scored else ' not'}: score every split's pairs or none")
    metric = metric or ("spearman" if scored else spec.metrics[0])
    if spec.pair_examples and (metric == "spearman") != scored:
        raise DataError(f"{source}: metric {metric} needs " + ("scored pairs" if metric == "spearman" else
                                                               "retrieval pairs (spearman scores scored ones)"))
    if labels is not None and not labels:
        raise DataError(f"{source}: no {READERS[kind].item}s in train")
    splits = {s: [ex for ex, _ in r] for s, r in rows.items()}
    has_pair = spec.text_pairs and any(ex.text_pair is not None for ex in splits["train"])
    return TaskData(TaskSpec(name, labels, metric, has_pair, kind), splits, source)


def read_examples(path: Path, regression: bool, problems: Problems) -> list[tuple[Example, str]]:
    """A plain file's examples (columns text, optional text_pair, label), each with where it was read; a bad row goes
    to `problems` with its cause."""
    pairs, before = [], problems.total
    for rec in read_records(path, problems, required=("text", "label")):
        try:
            text = _text(rec, "text")
            pair = _text(rec, "text_pair", required=False) if "text_pair" in rec.fields else None
            label = _label_value(rec.get("label"), rec.where(), regression)
        except DataError as exc:
            problems.add(exc)
            continue
        pairs.append((Example(text, label, pair or None), rec.where()))
    if not pairs and problems.total == before:
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
    problems = Problems()
    for split, stem in (("train", "train"), ("dev", task.dev_file)):
        path = folder / f"{stem}.{task.extension}"
        if not path.is_file():
            raise DataError(f"{folder}: {task.name} needs {path.name}")
        pairs = []
        fieldnames = list(task.fieldnames) if task.fieldnames else None
        for rec in read_records(path, problems, header=task.header, fieldnames=fieldnames):
            try:
                pairs.append((_benchmark_example(task, rec, regression), rec.where()))
            except DataError as exc:
                problems.add(exc)
        rows[split] = pairs
    return finalize(task.name, rows, task.metric, None if regression else list(task.labels), regression, str(folder),
                    problems)


def _benchmark_example(task: BenchmarkTask, rec: Record, regression: bool) -> Example:
    if task.to_text is not None:
        try:
            text, pair = task.to_text(rec.fields)
        except (KeyError, TypeError) as exc:
            raise DataError(f"{rec.where()}: missing column {exc}") from None
    else:
        text = _text(rec, task.text)
        pair = _text(rec, task.text_pair) if task.text_pair else None
    return Example(text, _label_value(rec.get(task.label), rec.where(), regression), pair)


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
