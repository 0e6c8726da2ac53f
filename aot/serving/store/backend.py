"""Where a task store's objects live: a folder (local, or a volume a fleet shares) or an S3 bucket
(aot.serving.store.s3).

The store (aot.serving.store.log) speaks to a backend in keys, `/`-separated paths under the store's root, and needs
five things of it: read an object (or learn it is missing), read it only if it changed since a tag, create an object
only if no other writer did (the change log's one rule of concurrency), replace an object, and list and delete keys
(garbage collection). Every byte read is counted, so that a test or a benchmark can say what a reader paid.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from aot.serving.store.atomic import fsync_dir, temporary_name, write_atomic

MAX_OBJECT_BYTES = 256 << 20  # the store's own objects (logs, indexes) are small; a larger one is refused unread


class BackendError(OSError):
    """The store cannot be reached or answered something unexpected (the message names the store)."""


def open_regular(path: str | Path) -> int:
    """A read-only descriptor of the regular file `path`: a symbolic link, a device or a FIFO is refused before any
    read (a FIFO would block forever, /dev/zero never end). FileNotFoundError when it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BackendError(f"{path}: a symbolic link, refused") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BackendError(f"{path}: not a regular file, refused")
    return fd


class FileBackend:
    """A store in a folder. Objects are regular files under `root`, opened without following symbolic links: a
    link, a device or a FIFO planted in the store is refused, never read."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.bytes_read = 0

    def __repr__(self) -> str:
        return f"FileBackend({str(self.root)!r})"

    def path(self, key: str) -> Path:
        return self.root / key

    def _open_regular(self, key: str) -> int:
        return open_regular(self.path(key))

    def read(self, key: str) -> bytes | None:
        """The object's bytes; None when it does not exist."""
        try:
            fd = self._open_regular(key)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > MAX_OBJECT_BYTES:
                raise BackendError(f"{self.path(key)}: {size} bytes, over the {MAX_OBJECT_BYTES} a store object may "
                                   "have")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(MAX_OBJECT_BYTES + 1)
        finally:
            os.close(fd)
        self.bytes_read += len(data)
        return data

    def tag(self, key: str) -> tuple | None:
        """What changes whenever the object is replaced (None: missing): a stat, no read."""
        try:
            st = os.stat(self.path(key))
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def read_if_changed(self, key: str, tag) -> tuple[bytes | None, object]:
        """(bytes, new tag) when the object changed since `tag`, else (None, tag)."""
        now = self.tag(key)
        if now == tag:
            return None, tag
        return self.read(key), now

    def create(self, key: str, data: bytes) -> bool:
        """Write the object only if it does not exist yet (False if it does): written whole under a temporary name,
        then linked into place, so a reader never sees half of it and two writers never both succeed."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_name(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return True

    def download(self, key: str, path: Path) -> int:
        """Copy the object `key` to the local file `path` (bytes copied); FileNotFoundError when it is missing."""
        fd = self._open_regular(key)
        try:
            with os.fdopen(fd, "rb", closefd=False) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                copied = dst.tell()
        finally:
            os.close(fd)
        self.bytes_read += copied
        return copied

    def write(self, key: str, data: bytes) -> None:
        """Replace the object atomically."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def list(self, prefix: str) -> Iterator[str]:
        """Keys of the regular files directly under the folder `prefix` (no temporaries: they start with '.')."""
        folder = self.path(prefix)
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return iter(())
        return iter(sorted(f"{prefix}/{e.name}" for e in entries if not e.name.startswith(".")
                           and e.is_file(follow_symlinks=False)))
