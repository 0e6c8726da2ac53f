"""The data readers of the kinds beyond classification and regression (READERS, by kind: a new kind registers
its reader here, beside its spec, aot.serving.kinds, and its training kind, aot.training.kinds): multi-label texts
and embedding pairs, token tags (aot.training.data.conll), and the label sets of the kinds that have one.

    multilabel  JSON lines {"text", "text_pair"?, "labels": [...]} (an empty list is valid); CSV/TSV with a column
                `labels`, the labels separated by `label_separator` (task.json; "|" by default), empty for none
    embedding   {"text": anchor, "text_pair": positive} (retrieval pairs, in-batch negatives), or with "score"
                added (scored pairs, a cosine loss): every row of a task scored, or none
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from aot.serving.kinds import KINDS
from aot.training.data.conll import CONLL_SUFFIXES, read_tagged, tag_order
from aot.training.data.records import FORMATS, read_records
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


def kind_examples(records: Iterable, row: Callable[[dict, str, str], Example], problems: Problems,
                  separator: str = LABEL_SEPARATOR) -> list[tuple[Example, str]]:
    """The examples in a file's records (aot.training.data.records.Record: fields and where) by a kind's `row`
    reader, each with where it was read; a bad row goes to `problems`."""
    rows = []
    for rec in records:
        try:
            rows.append((row(rec.fields, rec.where(), separator), rec.where()))
        except DataError as exc:
            problems.add(exc)
    return rows


def scored_pairs(rows: list[tuple[Example, str]]) -> list[tuple[Example, str]]:
    """An embedding task's pairs, every one scored or none (DataError naming the first that differs)."""
    scored = [ex.label is not None for ex, _ in rows]
    if any(scored) and not all(scored):
        where = rows[scored.index(not scored[0])][1]
        raise DataError(f"{where}: some pairs have a score and some do not: score every pair (a cosine loss), "
                        "or none (retrieval pairs, in-batch negatives)")
    return rows


def _tagged(path: Path, problems: Problems, separator: str) -> list[tuple[Example, str]]:
    try:
        return read_tagged(path)
    except DataError as exc:  # a CoNLL file stops at its first bad row
        problems.add(exc)
        return []


@dataclass(frozen=True)
class KindReader:
    """How the split files of a kind with rows of its own are read (aot.training.data.files.load_folder): their
    suffixes, a file's examples each with where it was read (its bad rows to `problems`), what one of its labels
    is called and how those found in train are ordered. A kind without a reader reads the plain columns text,
    text_pair?, label (classification, regression: aot.training.data.files.read_examples)."""

    read: Callable[[Path, Problems, str], list[tuple[Example, str]]]
    suffixes: tuple[str, ...] = FORMATS
    item: str = "label"
    order: Callable[[str], object] | None = None


def _records(row: Callable[[dict, str, str], Example], required: tuple[str, ...], check=lambda rows: rows):
    return lambda path, problems, separator: check(kind_examples(read_records(path, problems, required=required),
                                                                row, problems, separator))


READERS: dict[str, KindReader] = {}


def register_reader(kind: str, reader: KindReader) -> KindReader:
    READERS[kind] = reader
    return reader


register_reader("multilabel", KindReader(_records(multilabel_row, ("text", "labels"))))
register_reader("tokens", KindReader(_tagged, ("jsonl", *CONLL_SUFFIXES), item="tag", order=tag_order))
register_reader("embedding", KindReader(_records(embedding_row, ("text", "text_pair"), scored_pairs)))


def label_set(kind: str, rows: dict[str, list[tuple[Example, str]]], declared: list[str] | None,
              problems: Problems) -> tuple | None:
    """The labels (multilabel) or tags (tokens) of a task: the declared ones, else those of train; a row whose label
    is outside them goes to `problems`, naming where. None for a kind without (embedding)."""
    if not KINDS[kind].labelled:
        return None
    reader = READERS[kind]
    if declared is not None:
        labels, known = list(declared), set(declared)
        unknown = "is not in the declared label set"
    else:
        found = {name for ex, _ in rows.get("train", []) for name in ex.label}
        labels = sorted(found, key=reader.order)
        known, unknown = found, "never occurs in train"
    for split, pairs in rows.items():
        for ex, where in pairs:
            for name in ex.label:
                if name not in known:
                    problems.add(f"{where}: {split} {reader.item} {name!r} {unknown} "
                                 f"({labels})")
    return tuple(labels)
