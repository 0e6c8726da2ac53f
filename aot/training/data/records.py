"""The rows of a JSONL, CSV or TSV data file, each with its file and line, and the checks of a row's shape.

A row whose shape is wrong is refused with its line and its cause, never read as something else: a CSV row with more
fields than the header names (an unquoted comma: `Très bon service, merci !,positif` would otherwise train with the
label ` merci !`), or fewer, a quote that is never closed (the rest of the file would become one text), a JSON line
that is not an object. Such a row goes to the reader's Problems and the reading goes on, so that one pass names
every bad row.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aot.serving.formats import json_lines
from aot.training.data.task import DataError, Problems

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
        """The row's value of `column`; a required one that is absent (a JSON line without the key) or empty is a
        DataError saying which."""
        value = self.fields.get(column)
        if required and (value is None or value == ""):
            if column not in self.fields:
                raise DataError(f"{self.where()}: missing column {column!r}")
            raise DataError(f"{self.where()}: column {column!r} is empty")
        return value


def read_records(path: Path, problems: Problems, header: bool = True, fieldnames: list[str] | None = None,
                 required: tuple[str, ...] = ()) -> Iterator[Record]:
    """Rows of a .jsonl, .csv or .tsv file as dicts; a row of the wrong shape goes to `problems` (module docstring).
    A byte-order mark is skipped. A CSV/TSV header that lacks a `required` column is an error of the whole file,
    naming the columns found (and the delimiter the header seems to use when it reads as one column)."""
    suffix = path.suffix.lstrip(".").lower()
    if suffix == "jsonl":
        for line in json_lines(path):
            if line.item is None:
                problems.add(f"{line.where}: {line.error}")
            else:
                yield Record(line.item, path, line.number)
        return
    if suffix not in ("csv", "tsv"):
        raise DataError(f"{path}: unsupported file type {suffix!r}: expected one of {', '.join(FORMATS)}")
    delimiter = "\t" if suffix == "tsv" else ","
    quoting = csv.QUOTE_NONE if suffix == "tsv" else csv.QUOTE_MINIMAL  # GLUE TSVs contain bare quotes
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter, quoting=quoting, strict=True)
        names = fieldnames
        if header:
            names = next(reader, None)
            if names is None:
                return
            _check_header(path, names, required)
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                problems.add(_malformed(path, start, reader.line_num, str(exc)))
                continue
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(names):
                problems.add(_field_count(path, start, row, names, delimiter))
                continue
            yield Record(dict(zip(names, row, strict=True)), path, start)


def _malformed(path: Path, start: int, line: int, error: str) -> str:
    """A CSV row the csv module could not parse, in words."""
    if "unexpected end of data" in error:
        return (f"{path}:{start}: a quoted field opened on this line is never closed (it runs to the end of the file, "
                f"line {line}): close its quote, or double each quote inside it (\"\")")
    if "expected after" in error:
        return (f"{path}:{line}: a quote closes a quoted field before the field ends: double each quote inside a "
                "quoted field (\"\"), or quote the whole field")
    return f"{path}:{line}: not a CSV row ({error})"


def _field_count(path: Path, line: int, row: list[str], names: list[str], delimiter: str) -> str:
    """A row with more or fewer fields than the header names."""
    shown = ", ".join(names)
    if len(row) > len(names):
        inside = "a tab inside a text?" if delimiter == "\t" else 'an unquoted comma inside a text? (quote it: "a, b")'
        return f"{path}:{line}: {len(row)} fields where the header names {len(names)} ({shown}): {inside}"
    return f"{path}:{line}: {len(row)} field(s) where the header names {len(names)} ({shown}): missing column " \
           f"{names[len(row)]!r}"


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
