"""Reading word-level BIO tags (`--problem tokens`): CoNLL-style files and JSON lines.

CoNLL: one word per line, `word<TAB>tag` (or columns separated by spaces, the tag last, as CoNLL-2003's), a line
holding only whitespace between sentences (a blank line, or a lone tab as WNUT-16 has), `-DOCSTART-` lines
skipped. JSON lines: `{"tokens": [...], "tags": [...]}`. A sentence becomes an Example whose text is its words
joined by single spaces and whose label is its tags; served texts are split on whitespace the same way
(aot.serving.words), so a word must not hold whitespace. Every error names the file and line.
"""

from __future__ import annotations

from pathlib import Path

from aot.serving.formats import read_json_lines
from aot.serving.words import check_tag
from aot.training.data.task import DataError, Example

CONLL_SUFFIXES = ("conll", "txt", "tsv")


def _sentence(words: list[str], tags: list[str], where: str) -> tuple[Example, str]:
    for word in words:
        if not word or any(ch.isspace() for ch in word):
            raise DataError(f"{where}: token {word!r} is empty or holds whitespace (texts are split into words on "
                            "whitespace)")
    for tag in tags:
        try:
            check_tag(tag)
        except ValueError as exc:
            raise DataError(f"{where}: {exc}") from None
    return Example(" ".join(words), tuple(tags)), where


def read_conll(path: Path) -> list[tuple[Example, str]]:
    """Sentences of a CoNLL-style file, each with the file and line where it starts."""
    sentences: list[tuple[Example, str]] = []
    words: list[str] = []
    tags: list[str] = []
    start = 0
    with path.open(encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                if words:
                    sentences.append(_sentence(words, tags, f"{path}:{start}"))
                words, tags = [], []
                continue
            if line.startswith("-DOCSTART-"):
                continue
            fields = line.split("\t") if "\t" in line else line.split()
            if len(fields) < 2 or not fields[-1].strip():
                raise DataError(f"{path}:{number}: expected a word and its tag (word<TAB>tag), got {line[:80]!r}")
            if not words:
                start = number
            words.append(fields[0])
            tags.append(fields[-1].strip())
            try:
                check_tag(tags[-1])
            except ValueError as exc:
                raise DataError(f"{path}:{number}: {exc}") from None
            if not fields[0] or any(ch.isspace() for ch in fields[0]):
                raise DataError(f"{path}:{number}: token {fields[0]!r} is empty or holds whitespace (texts are split "
                                "into words on whitespace)")
    if words:
        sentences.append(_sentence(words, tags, f"{path}:{start}"))
    return sentences


def read_token_lines(path: Path) -> list[tuple[Example, str]]:
    """Sentences of a JSON lines file: `{"tokens": [...], "tags": [...]}` per line."""
    sentences = []
    for line in read_json_lines(path, DataError):
        item, where = line.item, f"{path}:{line.number}"
        tokens, tags = item.get("tokens"), item.get("tags")
        for key, value in (("tokens", tokens), ("tags", tags)):
            if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                raise DataError(f"{where}: {key!r} must be a non-empty list of strings")
        if len(tokens) != len(tags):
            raise DataError(f"{where}: {len(tokens)} tokens but {len(tags)} tags: give one tag per token")
        sentences.append(_sentence(tokens, tags, where))
    return sentences


def read_tagged(path: Path) -> list[tuple[Example, str]]:
    """A token task's split file, by its suffix: .jsonl, or CoNLL (.conll, .txt, .tsv)."""
    suffix = path.suffix.lstrip(".").lower()
    sentences = read_token_lines(path) if suffix == "jsonl" else read_conll(path)
    if not sentences:
        raise DataError(f"{path} has no sentences")
    return sentences


def tag_order(tag: str) -> tuple:
    """O first, then by entity type, B- before I-."""
    return (tag != "O", tag[2:], tag[:1])
