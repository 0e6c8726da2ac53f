"""Plain rows of the kinds beyond classification and regression: multi-label texts and embedding pairs (token tags
are read by aot.training.data.conll), and the label sets of the kinds that have one.

    multilabel  JSON lines {"text", "text_pair"?, "labels": [...]} (an empty list is valid); CSV/TSV with a column
                `labels`, the labels separated by `label_separator` (task.json; "|" by default), empty for none
    embedding   {"text": anchor, "text_pair": positive} (retrieval pairs, in-batch negatives), or with "score"
                added (scored pairs, a cosine loss): every row of a task scored, or none
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aot.training.data.conll import tag_order
from aot.training.data.task import DataError, Example, Problems

LABEL_SEPARATOR = "|"


def _text(fields: dict, column: str, where: str, required: bool = True) -> str | None:
    value = fields.get(column)
    if value is None or value == "":
        if required:
            raise DataError(f"{where}: " + (f"column {column!r} is empty" if column in fields else
                                            f"missing column {column!r}"))
        return None
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: column {column!r} must be a non-empty text")
    return value


def multilabel_row(fields: dict, where: str, separator: str = LABEL_SEPARATOR) -> Example:
    if "labels" not in fields:
        raise DataError(f"{where}: missing column 'labels' (a list; empty for none)")
    raw = fields["labels"]
    if isinstance(raw, str):  # CSV / TSV
        raw = [part.strip() for part in raw.split(separator)] if raw.strip() else []
    if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        raise DataError(f"{where}: labels {raw!r}: expected a list of label names")
    return Example(_text(fields, "text", where), tuple(dict.fromkeys(raw)), _text(fields, "text_pair", where, False))


def embedding_row(fields: dict, where: str, separator: str = LABEL_SEPARATOR) -> Example:
    text, pair = _text(fields, "text", where), _text(fields, "text_pair", where)
    score = fields.get("score")
    if score is None or score == "":
        return Example(text, None, pair)
    try:
        return Example(text, float(score), pair)
    except (TypeError, ValueError):
        raise DataError(f"{where}: score {score!r} is not a number") from None


ROW_READERS: dict[str, Callable[[dict, str, str], Example]] = {"multilabel": multilabel_row,
                                                               "embedding": embedding_row}
REQUIRED = {"multilabel": ("text", "labels"), "embedding": ("text", "text_pair")}


def kind_examples(records: Iterable, kind: str, problems: Problems,
                  separator: str = LABEL_SEPARATOR) -> list[tuple[Example, str]]:
    """The examples of `kind` (multilabel, embedding) in a file's records (aot.training.data.records.Record: fields
    and where), each with where it was read; a bad row goes to `problems`."""
    rows = []
    for rec in records:
        try:
            rows.append((ROW_READERS[kind](rec.fields, rec.where(), separator), rec.where()))
        except DataError as exc:
            problems.add(exc)
    if kind == "embedding" and rows:
        scored = [ex.label is not None for ex, _ in rows]
        if any(scored) and not all(scored):
            where = rows[scored.index(not scored[0])][1]
            raise DataError(f"{where}: some pairs have a score and some do not: score every pair (a cosine loss), "
                            "or none (retrieval pairs, in-batch negatives)")
    return rows


def label_set(kind: str, rows: dict[str, list[tuple[Example, str]]], declared: list[str] | None,
              problems: Problems) -> tuple | None:
    """The labels (multilabel) or tags (tokens) of a task: the declared ones, else those of train; a row whose label
    is outside them goes to `problems`, naming where. None for embedding."""
    if kind == "embedding":
        return None
    if declared is not None:
        labels, known = list(declared), set(declared)
        unknown = "is not in the declared label set"
    else:
        found = {name for ex, _ in rows.get("train", []) for name in ex.label}
        labels = sorted(found, key=tag_order) if kind == "tokens" else sorted(found)
        known, unknown = found, "never occurs in train"
    for split, pairs in rows.items():
        for ex, where in pairs:
            for name in ex.label:
                if name not in known:
                    problems.add(f"{where}: {split} {'tag' if kind == 'tokens' else 'label'} {name!r} {unknown} "
                                 f"({labels})")
    return tuple(labels)
