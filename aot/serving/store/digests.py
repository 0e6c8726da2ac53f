"""Digests of a task version's files: written into the store's manifest at publish, checked when a version is
loaded, mapped or changed on disk, so a damaged file is refused instead of answering wrong.

A digest is `sha256:<64 hex digits>` of a file's bytes (its cost per table: docs/benchmarks.md, "The serving tax"). Only
regular files are read: a symbolic link, device or FIFO planted in a version's folder is refused, never followed.
A file's stamp (inode, size, modification and status-change times) says when its bytes may have changed since it was
checked: a restored modification time does not restore the status-change time, which only the kernel sets.

A file is hashed once per host, not once per process: every step process of a server (2 instances of the fused step,
several servers on one host) trusts a record of the stamp a process of the same user found the file's bytes at
(HostVerified: a private folder in /dev/shm, one small file per verified file). Any write changes the stamp, so a
file changed after its record was written is hashed again before it is served.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
from collections import OrderedDict
from pathlib import Path

from aot.serving.shm import SHM
from aot.serving.store.backend import open_regular

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a plain file of a version folder, never a path
_CHUNK = 1 << 20
VERIFIED_REMEMBERED = 65536  # files whose verified stamp a process remembers (verify_file_once), ~200 bytes each
VERIFIED_ON_HOST = 131072  # records a host keeps (HostVerified); past it the oldest half go (~1 KiB of tmpfs each)


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


def check_regular(path: Path) -> Path:
    """`path`, if it is a regular file (DigestError naming it otherwise: a link, device or FIFO, or missing)."""
    try:
        os.close(open_regular(path))
    except FileNotFoundError:
        raise DigestError(f"{path.name} is missing") from None
    except OSError as exc:
        raise DigestError(f"{path.name}: {exc}".replace(str(path), path.name)) from None
    return path


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


class _Verified:
    """The stamps of files this process hashed and found as published, by (path, digest), least recently used
    first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.stamps: OrderedDict[tuple[str, str], tuple[int, int, int, int]] = OrderedDict()
        self.lock = threading.Lock()

    def holds(self, key: tuple[str, str], stamp: tuple[int, int, int, int]) -> bool:
        with self.lock:
            if self.stamps.get(key) != stamp:
                return False
            self.stamps.move_to_end(key)
            return True

    def add(self, key: tuple[str, str], stamp: tuple[int, int, int, int]) -> None:
        with self.lock:
            self.stamps[key] = stamp
            self.stamps.move_to_end(key)
            while len(self.stamps) > self.capacity:
                self.stamps.popitem(last=False)


_verified = _Verified(VERIFIED_REMEMBERED)


class HostVerified:
    """Stamps of files a process of this user on this host hashed and found as published: one file each in a folder
    only this user can write (`folder`, 0700; a folder of another owner or mode is not trusted, and nothing is
    recorded there), named by the sha256 of (path, digest), holding the stamp. Written atomically (a temporary name,
    then a rename), read with one open: a process that finds a record whose stamp is the file's stamp now skips the
    hash."""

    def __init__(self, folder: Path, capacity: int = VERIFIED_ON_HOST):
        self.folder, self.capacity = Path(folder), capacity
        self._added = 0
        self._trusted: bool | None = None

    def _usable(self) -> bool:
        if self._trusted is None:
            try:
                self.folder.mkdir(mode=0o700, exist_ok=True)
                st = os.stat(self.folder, follow_symlinks=False)
                self._trusted = (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
                                 and stat.S_IMODE(st.st_mode) & 0o077 == 0)
            except OSError:
                self._trusted = False
        return self._trusted

    def _record(self, key: tuple[str, str]) -> Path:
        return self.folder / hashlib.sha256("\0".join(key).encode("utf-8", "surrogatepass")).hexdigest()

    def holds(self, key: tuple[str, str], stamp: tuple[int, int, int, int]) -> bool:
        if not self._usable():
            return False
        try:
            return self._record(key).read_text() == " ".join(map(str, stamp))
        except (OSError, UnicodeDecodeError):
            return False

    def add(self, key: tuple[str, str], stamp: tuple[int, int, int, int]) -> None:
        if not self._usable():
            return
        record = self._record(key)
        temporary = record.with_name(f".{record.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            temporary.write_text(" ".join(map(str, stamp)))
            os.replace(temporary, record)
        except OSError:
            temporary.unlink(missing_ok=True)
            return
        self._added += 1
        if self._added % 1024 == 0:
            self._prune()

    def _prune(self) -> None:
        """Past `capacity` records, the oldest half go (a record is cheap to write again: one hash)."""
        try:
            records = [(p.stat().st_mtime_ns, p) for p in self.folder.iterdir() if not p.name.startswith(".")]
        except OSError:
            return
        if len(records) <= self.capacity:
            return
        for _, path in sorted(records)[: len(records) // 2]:
            path.unlink(missing_ok=True)


host_verified = HostVerified(SHM / f"aot-verified-{os.getuid()}")


def verify_file_once(path: Path, digests: dict[str, str] | None, where: str) -> None:
    """verify_file, but a file this process, or another of this user on this host (host_verified), already hashed and
    found as published is not hashed again while its stamp is unchanged (any write changes its status-change time,
    which only the kernel sets): a version evicted and loaded again, or loaded by a second step instance, costs its
    reads, not its hashes. The background audit (aot.serving.store.audit) and `aot export verify` hash every time,
    which is what finds bytes that rotted without a write."""
    if digests is None or path.name not in digests:
        verify_file(path, digests, where)
        return
    try:
        stamp = file_stamp(path)
    except OSError:
        stamp = None
    key = (str(Path(path).absolute()), digests[path.name])
    if stamp is not None and (_verified.holds(key, stamp) or host_verified.holds(key, stamp)):
        _verified.add(key, stamp)
        return
    verify_file(path, digests, where)
    if stamp is not None:  # taken before the hash: a write during it changes the stamp, and the next load hashes
        _verified.add(key, stamp)
        host_verified.add(key, stamp)
