"""Task versions fetched from a remote store into a bounded local folder, kept across restarts.

A replica serving from object storage reads a version's files from its own disk: the first request for a version
downloads them (every file checked against the digest the store's index publishes before it is used), later ones and
later starts find them here, and the request path never touches the bucket for a cached version.

    CACHE/<name>@<id>/            a complete version: its files and `.complete` (its digests, as published)
    CACHE/.tmp-<pid>-<random>/    a download in progress (removed when its writer died)
    CACHE/.locks/<name>@<id>      one download of a version at a time, across the processes of a replica

A version's files are fetched at once (one request each, in parallel) and written without fsync: nothing served
rests on this folder's durability, since every load copies a version's files into a sealed copy and hashes them
there (aot.serving.store.sealed), and a copy torn by a crash is refused, then fetched anew by its re-check
(aot.serving.store.rechecks). The bytes of complete versions stay under `max_bytes`: after a download, the least recently used versions are
removed (by the time `.complete` was last touched: a process touches a version when it loads it, and at most once a
`TOUCH_EVERY` while it serves it). A version touched in the last `KEEP_RECENT` seconds is not removed, since a process
may still read it (a fused table is memory-mapped); the cache then stays over its bound until they age.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from aot import settings
from aot.serving.store.atomic import pid_alive
from aot.serving.store.digests import FILE_NAME, DigestError, file_digest

COMPLETE = ".complete"
LOCKS = ".locks"
TOUCH_EVERY = 60.0
KEEP_RECENT = 300.0
FETCHES_AT_ONCE = 4  # a version's objects fetched in parallel (a handful of files: latency-bound)


@dataclass(frozen=True)
class CachedVersion:
    version: str
    bytes: int
    used: float  # the mtime of its `.complete`


class VersionCache:
    """Version folders of a remote store (aot.serving.store.s3.S3Backend: `download(key, path)`) under `root`."""

    def __init__(self, backend, root: str | Path, max_bytes: int):
        self.backend = backend
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / LOCKS).mkdir(exist_ok=True)
        self._touched: dict[str, float] = {}
        self._estimate: int | None = None
        self._lock = threading.Lock()
        self.downloads = 0
        self._fetchers = ThreadPoolExecutor(FETCHES_AT_ONCE, thread_name_prefix="aot-fetch-file")
        self._remove_debris()

    @classmethod
    def for_store(cls, backend, url: str) -> VersionCache:
        """A replica's cache of the versions it fetched from the store at `url`: AOT_TASK_CACHE_DIR, else a folder
        per store under ~/.cache/aot/task-versions, bounded by AOT_TASK_CACHE_BYTES."""
        folder = settings.TASK_CACHE_DIR.read()
        root = Path(folder) if folder else (Path.home() / ".cache" / "aot" / "task-versions" /
                                            hashlib.sha256(url.encode()).hexdigest()[:16])
        return cls(backend, root, settings.TASK_CACHE_BYTES.read())

    def folder(self, version: str, digests: dict[str, str]) -> Path:
        """The local folder of `version` (a checked version name, aot.serving.store.reader.check_version), downloaded
        and verified first if it is not here."""
        local = self.root / version
        if self._complete(local, digests):
            self.touch(version)
            return local
        with self._fetch_lock(version):
            if not self._complete(local, digests):  # another process may have fetched it meanwhile
                self._download(version, digests, local)
        self.touch(version, force=True)
        self._evict(keep=version)
        return local

    def discard(self, version: str) -> None:
        """Remove `version`'s copy (a refused version checked again is fetched anew: aot.serving.store.rechecks)."""
        with self._fetch_lock(version):
            shutil.rmtree(self.root / version, ignore_errors=True)

    def holds(self, version: str, digests: dict[str, str]) -> bool:
        """Whether `version` is here complete, as published (a local read: no request to the store)."""
        return self._complete(self.root / version, digests)

    def touch(self, version: str, force: bool = False) -> None:
        """Mark `version` used now (at most once a TOUCH_EVERY unless forced)."""
        now = time.time()
        if not force and now - self._touched.get(version, 0.0) < TOUCH_EVERY:
            return
        self._touched[version] = now
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.root / version / COMPLETE)

    def versions(self) -> list[CachedVersion]:
        """The complete versions here, least recently used first."""
        found = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            folder = Path(entry.path)
            try:
                used = (folder / COMPLETE).stat().st_mtime
                size = sum(f.stat(follow_symlinks=False).st_size for f in os.scandir(folder))
            except FileNotFoundError:  # incomplete (a crash mid-rename is impossible: renamed whole) or just evicted
                continue
            found.append(CachedVersion(entry.name, size, used))
        return sorted(found, key=lambda v: v.used)

    # --- internals --------------------------------------------------------------------------------------------------

    @staticmethod
    def _complete(local: Path, digests: dict[str, str]) -> bool:
        try:
            return json.loads((local / COMPLETE).read_text()) == digests
        except (OSError, ValueError):
            return False

    @contextlib.contextmanager
    def _fetch_lock(self, version: str) -> Iterator[None]:
        with open(self.root / LOCKS / version, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _download(self, version: str, digests: dict[str, str], local: Path) -> None:
        tmp = self.root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for name in digests:
                if not FILE_NAME.fullmatch(name):
                    raise DigestError(f"{version}: {name!r} is not a file name")
            fetches = [self._fetchers.submit(self._fetch, version, tmp, *item) for item in sorted(digests.items())]
            wait(fetches)  # all of them ended before the folder is renamed or removed
            total = sum(f.result() for f in fetches)
            (tmp / COMPLETE).write_text(json.dumps(digests))
            if local.exists():  # a stale or damaged copy: replaced whole
                shutil.rmtree(local)
            os.rename(tmp, local)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.downloads += 1
        with self._lock:
            if self._estimate is not None:
                self._estimate += total

    def _fetch(self, version: str, tmp: Path, name: str, digest: str) -> int:
        """One file of a version, checked against its published digest; its size."""
        size = self.backend.download(f"{version}/{name}", tmp / name)
        if file_digest(tmp / name) != digest:
            raise DigestError(f"{version}: {name} as downloaded from {self.backend!r} is damaged (its sha256 "
                              "differs from the one published)")
        return size

    def _evict(self, keep: str) -> None:
        """Remove least recently used versions until the cache holds at most max_bytes (see the module docstring)."""
        with self._lock:
            if self._estimate is not None and self._estimate <= self.max_bytes:
                return
        with open(self.root / LOCKS / ".evict", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = self.versions()
            total = sum(v.bytes for v in cached)
            now = time.time()
            for v in cached:
                if total <= self.max_bytes:
                    break
                if v.version == keep or now - v.used < KEEP_RECENT:
                    continue
                shutil.rmtree(self.root / v.version, ignore_errors=True)  # its lock file stays: another process
                total -= v.bytes                                           # may hold it
        with self._lock:
            self._estimate = total

    def _remove_debris(self) -> None:
        for entry in os.scandir(self.root):
            if entry.name.startswith(".tmp-"):
                try:
                    pid = int(entry.name.split("-")[1])
                except (IndexError, ValueError):
                    continue
                if not pid_alive(pid):
                    shutil.rmtree(entry.path, ignore_errors=True)
