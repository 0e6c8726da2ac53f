"""Digests of a task version's files: written into the store's manifest at publish, checked when a version is
loaded and by the background audit, so a damaged file is refused instead of answering wrong.

A digest is `sha256:<64 hex digits>` of a file's bytes (its cost per table: docs/benchmarks.md, "The serving tax"). Only
regular files are read: a symbolic link, device or FIFO planted in a version's folder is refused, never followed.
A file's stamp (inode, size, modification and status-change times) changes with most writes: a restored
modification time does not restore the status-change time, which only the kernel sets.

A stamp is no proof that bytes did not change: a write through a shared writable mapping to a page that is already
dirty changes no timestamp. So what a request reads is never trusted by a stamp: a version's files are copied, sealed
and hashed in the copy (aot.serving.store.sealed), a fused table read by hashed blocks (aot.serving.store.table_blocks).
Stamps only tell the background audit (aot.serving.store.audit) which files to hash again first.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

from aot.serving.store.backend import open_regular

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a plain file of a version folder, never a path
_CHUNK = 1 << 20


class DigestError(ValueError):
    """A file whose bytes are not the ones published."""


_buffers = threading.local()  # each thread's read buffer, reused: a fresh one per read costs its page faults


def file_digest(path: Path) -> str:
    """The digest of a regular file (a symbolic link, device or FIFO planted in its place is refused, never read).
    Read into one buffer per thread, reused: a version's first load hashes its files in the request's path, and
    reading them into new memory took a quarter longer (docs/benchmarks.md, "Many tasks on one server")."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = memoryview(bytearray(_CHUNK))
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:
        while size := f.readinto(buffer):
            digest.update(buffer[:size])
    return f"sha256:{digest.hexdigest()}"


def file_stamp(path: str | os.PathLike) -> tuple[int, int, int, int]:
    """What changes whenever a file's bytes may have: inode, size, mtime and ctime (ns); the link itself, never
    what it points to."""
    st = os.stat(path, follow_symlinks=False)
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


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
    except OSError as exc:  # a link, device or FIFO in the version's folder (BackendError), or unreadable
        raise DigestError(f"{where}: {path.name}: {exc}".replace(str(path), path.name)) from None
    if actual != expected:
        raise DigestError(f"{where}: {path.name} is damaged (its sha256 differs from the one published)")
