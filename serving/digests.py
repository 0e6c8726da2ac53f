"""Digests of a task version's files: written into the store's manifest at publish, checked when a version is
loaded, mapped or changed on disk, so a damaged file is refused instead of answering wrong.

A digest is `sha256:<64 hex digits>` of a file's bytes (about 1.2 GB/s on one core here: a MiniLM fused table,
140 MB, costs ~0.1 s, once per load).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a plain file of a version folder, never a path
_CHUNK = 1 << 20


class DigestError(ValueError):
    """A file whose bytes are not the ones published."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def folder_digests(folder: Path) -> dict[str, str]:
    """Every file of a version folder (flat: versions hold no subfolders) -> its digest."""
    return {p.name: file_digest(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}


def check_digests(value, where: str) -> dict[str, str]:
    """A manifest's `digests` object, checked: {file name: digest}."""
    if not isinstance(value, dict) or not value:
        raise DigestError(f"{where}: 'digests' must be a non-empty object of file name -> sha256:<hex>")
    for name, digest in value.items():
        if not FILE_NAME.fullmatch(name) or not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise DigestError(f"{where}: bad digest entry {name[:80]!r}: expected a file name -> sha256:<64 hex>")
    return dict(value)


def verify_file(path: Path, digests: dict[str, str] | None, where: str) -> None:
    """Raise DigestError unless `path` has the digest published for it (no digests: a version exported before
    digests existed, read unverified)."""
    if digests is None:
        return
    expected = digests.get(path.name)
    if expected is None:
        raise DigestError(f"{where}: {path.name} has no published digest")
    try:
        actual = file_digest(path)
    except FileNotFoundError:
        raise DigestError(f"{where}: {path.name} is missing") from None
    if actual != expected:
        raise DigestError(f"{where}: {path.name} is damaged (its sha256 differs from the one published)")
