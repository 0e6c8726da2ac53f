"""Where `aot infer --input` writes its answers, as they come: standard output, or a file it appends whole lines to,
so that a client that dies keeps every line written so far and never half of one; and what `--resume` reads back.

Each answer names its input line: the line's `id` and `task` echoed, or, for a line without an id, its line number
(`line`). That is its key (line_key, answer_key): `--resume` skips every input line whose key an answer in the file
already holds, drops the lines answered with an error (they are sent again) and an incomplete last line (a disk that
filled up), and appends the rest, in input order.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

Key = tuple  # ("id", the id as JSON, task) or ("line", number)


def line_key(number: int, record: dict | None) -> Key:
    """The key of input line `number` holding `record` (None: not a JSON object)."""
    if record is not None and "id" in record:
        return "id", json.dumps(record["id"], sort_keys=True), record.get("task")
    return "line", number


def answer_key(answer: dict) -> Key | None:
    """The key of the input line an answer answers (None: it names none)."""
    if "id" in answer:
        return "id", json.dumps(answer["id"], sort_keys=True), answer.get("task")
    if isinstance(answer.get("line"), int):
        return "line", answer["line"]
    return None


def describe(key: Key) -> str:
    return f"line {key[1]}" if key[0] == "line" else f"id {key[1]}" + (f" of task {key[2]!r}" if key[2] else "")


@dataclass
class Resumed:
    """What an output file held when `--resume` read it: the keys of its answered lines, and what was dropped."""

    answered: set[Key] = field(default_factory=set)
    failed: int = 0  # lines answered with an error: dropped, sent again
    unreadable: int = 0  # lines that are no answer (an incomplete last line): dropped


def read_answered(path: str) -> Resumed:
    """The answered lines of `path` (none when it does not exist); the file is rewritten without its failed and
    unreadable lines (atomically) when it holds any, so that the answers appended next are the only ones of theirs."""
    from aot.serving.store.atomic import write_atomic

    resumed = Resumed()
    try:
        with open(path, "rb") as stream:
            raw = stream.read()
    except FileNotFoundError:
        return resumed
    kept = []
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            answer = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            resumed.unreadable += 1
            continue
        key = answer_key(answer) if isinstance(answer, dict) else None
        if key is None:
            resumed.unreadable += 1
        elif "error" in answer:
            resumed.failed += 1
        else:
            resumed.answered.add(key)
            kept.append(line + b"\n")
    if resumed.failed or resumed.unreadable or (raw and not raw.endswith(b"\n")):
        write_atomic(path, b"".join(kept))
    return resumed


class AnswerSink:
    """Answers as JSON lines, each written whole as soon as it is given: appended to `path` (created, or emptied
    unless `append`), else on standard output. A write that fails (a full disk) leaves the file at its last whole
    line and raises an OSError naming it."""

    def __init__(self, path: str | None, append: bool = False):
        self.path, self.written = path, 0
        self._fd = None
        if path is not None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
            self._fd = os.open(path, flags, 0o644)
            self._size = os.fstat(self._fd).st_size

    def write(self, answer: dict) -> None:
        text = json.dumps(answer, ensure_ascii=False) + "\n"
        if self._fd is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            self._append(text.encode("utf-8"))
        self.written += 1

    def _append(self, data: bytes) -> None:
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as exc:
            os.ftruncate(self._fd, self._size)  # never half a line
            raise OSError(exc.errno, f"cannot write {self.path}: {exc.strerror}") from None
        self._size += len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
