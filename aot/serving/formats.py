"""The one reader of the project's JSON files: the versioned ones (task artifact, repository record, task store) and
JSON lines (training data, `aot predict` and `aot infer` input).

Every format carries `format` and `format_version`; a reader names the file and what is wrong with it: missing,
not JSON, another format or version, a missing key or a value of the wrong type. No schema library: the checks are
a dict of required keys and types per format, shorter than a JSON Schema and with messages that name the file.
"""

from __future__ import annotations

import codecs
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO


class FormatError(ValueError):
    """A file that is missing, not JSON, or not the expected format and version."""


def _type_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({dict: "object", list: "list", str: "string", int: "integer", float: "number",
                        bool: "boolean", type(None): "null"}.get(k, k.__name__) for k in kinds)


def check_keys(data: dict, required: dict, where: str, error: type[ValueError] = FormatError) -> dict:
    """`required`: key -> type (or tuple of types). Raises `error` (a reader's own error type) naming `where` and
    the key."""
    for key, kind in required.items():
        if key not in data:
            raise error(f"{where}: missing key {key!r}")
        value = data[key]
        if isinstance(value, bool) and kind in (int, float):
            raise error(f"{where}: {key!r} must be {_type_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise error(f"{where}: {key!r} must be {_type_name(kind)}, got {type(value).__name__}")
    return data


def read_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FormatError(f"{path}: file not found") from None
    return parse_json(data, path)


def parse_json(data: bytes, where: str | Path) -> dict:
    """A JSON object from bytes read elsewhere (a file, an object store); errors name `where`."""
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise FormatError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise FormatError(f"{where}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def read_versioned_json(path: str | Path, fmt: str, version: int, required: dict | None = None) -> dict:
    """Read a `fmt` v`version` file and check its required keys."""
    return check_versioned(read_json(path), path, fmt, version, required)


def check_versioned(data: dict, where: str | Path, fmt: str, version: int, required: dict | None = None) -> dict:
    if data.get("format") != fmt or data.get("format_version") != version:
        raise FormatError(f"{where}: not an {fmt} v{version} file (format {data.get('format')!r}, "
                          f"version {data.get('format_version')!r})")
    return check_keys(data, required or {}, str(where))


@dataclass(frozen=True)
class JsonLine:
    """One non-blank line of a JSON-lines file: the object it holds, or why it holds none."""

    source: str  # the file as messages name it: its path, or <stdin>
    number: int  # 1-based, blank lines counted
    item: dict | None
    error: str | None = None  # "not UTF-8 text", "invalid JSON (...)" or "expected a JSON object, got list"

    @property
    def where(self) -> str:
        return f"{self.source}:{self.number}"


def json_lines(path: str | Path) -> Iterator[JsonLine]:
    """Every non-blank line of a JSON-lines file (`-`: standard input), read as UTF-8 (a byte-order mark skipped),
    line by line: a bad line is yielded with its error, not raised, so that a caller may skip it (`aot predict`) or
    stop there (read_json_lines). A file that cannot be opened is an OSError."""
    if path == "-":
        yield from _json_lines(sys.stdin.buffer, "<stdin>")
        return
    with open(path, "rb") as stream:
        yield from _json_lines(stream, str(path))


def _json_lines(stream: BinaryIO, source: str) -> Iterator[JsonLine]:
    for number, raw in enumerate(stream, 1):
        try:
            text = (raw.removeprefix(codecs.BOM_UTF8) if number == 1 else raw).decode("utf-8")
        except UnicodeDecodeError:
            yield JsonLine(source, number, None, "not UTF-8 text")
            continue
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            yield JsonLine(source, number, None, f"invalid JSON ({exc.msg})")
            continue
        if not isinstance(item, dict):
            yield JsonLine(source, number, None, f"expected a JSON object, got {type(item).__name__}")
            continue
        yield JsonLine(source, number, item)


def read_json_lines(path: str | Path, error: type[ValueError] = FormatError) -> Iterator[JsonLine]:
    """json_lines, stopped at the first bad line: `error` (a reader's own error type) names the file and line."""
    for line in json_lines(path):
        if line.item is None:
            raise error(f"{line.where}: {line.error}")
        yield line


def iso_time(seconds: float | None) -> str | None:
    """A time the store records (seconds since the epoch) as what people and scripts read: ISO 8601 in UTC, to the
    second (`2026-11-27T22:03:06Z`); None stays None."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
