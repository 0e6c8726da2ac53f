"""One cache of task versions per host, shared by its step processes: a version loaded by one process is served by
the others from the same memory, without reading or hashing it again, and the host keeps at most `max_bytes` of
versions however many processes serve them.

Each entry is a sealed copy of a version's files (aot.serving.store.sealed: a memfd that no one can write, checked
once, after it was sealed). The processes find each other's copies through an index in a folder of this user's
(AOT_HOST_CACHE_DIR, default /dev/shm/aot-task-cache-<uid>): the file `index-v1`, mapped by every process and
changed under a lock (flock), holds for each entry its key (a version and its published digests), size, last use,
segment and the processes holding its descriptor (pid, start time, descriptor), and a frequency sketch of every
version asked for. Another process's copy is opened as /proc/PID/fd/FD and taken only if it is the same sealed copy
(inode, size, seals, a directory naming the same version and digests). The folder must be this user's, 0700 and not
a link, and the index a regular file of this user's that no one else can read (a folder another user created in
/dev/shm is not used): otherwise `problem` says why, and each process seals its own copies.

Safe under concurrent loads, evictions and restarts:
- an entry is listed only once its copy is sealed and checked: no process ever maps a copy being written;
- two processes loading one version at the same moment both load it; the first listed is kept, the other takes it;
- an evicted entry leaves the index at once, and each process lets go of its descriptor at its next batch
  (`evicted`); a request reading the copy meanwhile keeps its map, and the memory goes with the last map;
- a process that dies holds nothing: its descriptors close, the kernel releases its lock, and an entry whose
  holders are all gone is removed by the next process that looks at it (and at start).

Which entries stay: W-TinyLFU (aot.serving.store.admission), with the uses of every process (written to the index
at most every FLUSH_SECONDS, and at each miss).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from aot import settings
from aot.serving.shm import SHM
from aot.serving.store.admission import FREE, SKETCH_ROWS, Sketch, TinyLfu
from aot.serving.store.sealed import SealedVersion, SealError, open_sealed, seal_files

INDEX = "index-v1"
MAGIC = b"AOTHC001"
SLOTS = 4096  # entries the index holds at most (past it the least recently used goes, whatever the bytes)
HOLDERS = 8  # processes an entry names as holders (more may map it)
SKETCH_WIDTH = 1 << 15
FLUSH_SECONDS = 0.5
PRUNE_EVERY = 64  # listings between two looks for entries whose holders are all gone
HOLDER = np.dtype([("pid", "<i4"), ("fd", "<i4"), ("start", "<u8")])
ENTRY = np.dtype([("key", "<u8", (2,)), ("size", "<i8"), ("segment", "i1"), ("used", "<f8"), ("ino", "<u8"),
                  ("holders", HOLDER, (HOLDERS,))])
HEADER = np.dtype([("magic", "S8"), ("slots", "<i8"), ("width", "<i8"), ("generation", "<u8"), ("additions", "<i8")])
_instances: dict[Path, HostCache] = {}
_instances_lock = threading.Lock()
_TABLE_AT = 4096
_SKETCH_AT = _TABLE_AT + SLOTS * ENTRY.itemsize
_SIZE = _SKETCH_AT + SKETCH_ROWS * SKETCH_WIDTH

Sources = Callable[[], Mapping[str, "Path | bytes"]]


def version_key(version: str, digests: Mapping[str, str]) -> bytes:
    """An entry's key: 16 bytes of the sha256 of a version and its published digests."""
    return hashlib.sha256(json.dumps([version, sorted(digests.items())]).encode()).digest()[:16]


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot: with its pid, a process no reuse of the pid repeats)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def default_folder() -> Path:
    folder = settings.HOST_CACHE_DIR.read()
    return Path(folder) if folder else SHM / f"aot-task-cache-{os.geteuid()}"


class HostCache:
    """This process's side of its host's version cache (module docstring)."""

    def __init__(self, folder: Path | None, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.problem: str | None = None if folder is not None else "no host cache folder"
        self.listed = self.opened = 0  # copies this process listed (loaded) and took from another process
        self._me = (os.getpid(), start_time(os.getpid()) or 0)
        self._lock = threading.Lock()
        self._held: dict[bytes, list] = {}  # key -> [its slot, the copy, its users in this process]
        self.releases = 0  # times copies were let go because the host evicted them (a registry looks for them)
        self._uses: Counter[bytes] = Counter()
        self._flushed = time.monotonic()
        self._generation = 0
        self._fd: int | None = None
        if folder is not None:
            try:
                self._open_index(Path(folder))
            except OSError as exc:
                self.problem = f"{folder}: {exc.strerror or exc}"
            except SealError as exc:
                self.problem = str(exc)

    @classmethod
    def for_host(cls, max_bytes: int) -> HostCache:
        """This process's one HostCache of its host's folder (default_folder): every registry of the process shares
        it, and the bound is the largest any asked for."""
        folder = default_folder()
        with _instances_lock:
            cache = _instances.get(folder)
            if cache is None:
                cache = _instances[folder] = cls(folder, max_bytes)
            cache.max_bytes = max(cache.max_bytes, max_bytes)
            if cache.shared:
                cache.policy.max_bytes = cache.max_bytes
            return cache

    @property
    def shared(self) -> bool:
        return self._fd is not None

    def _open_index(self, folder: Path) -> None:
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700, parents=True)
        try:
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise SealError(f"{folder} is a symbolic link or not a folder: not trusted; each process keeps its "
                                "own copies") from None
            raise
        try:
            _trusted(os.fstat(dir_fd), folder, "folder")
            fd = os.open(INDEX, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SealError(f"{folder / INDEX} is a symbolic link: not trusted; each process keeps its own "
                                "copies") from None
            raise
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            _trusted(st, folder / INDEX, "file")
            if st.st_nlink != 1:
                raise SealError(f"{folder / INDEX} has other names (hard links): not trusted")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if st.st_size != _SIZE or os.pread(fd, 8, 0) != MAGIC:  # new, torn, or of another layout: made anew
                    os.ftruncate(fd, 0)
                    os.ftruncate(fd, _SIZE)
                    os.pwrite(fd, np.array([(MAGIC, SLOTS, SKETCH_WIDTH, 0, 0)], dtype=HEADER).tobytes(), 0)
                os.posix_fallocate(fd, 0, _SIZE)  # its memory now: a full /dev/shm is an error here, not a SIGBUS later
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            self._memory = mmap.mmap(fd, _SIZE, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._header = np.frombuffer(self._memory, HEADER, 1, 0)
        self._table = np.frombuffer(self._memory, ENTRY, SLOTS, _TABLE_AT)
        sketch = Sketch(np.frombuffer(self._memory, np.uint8, SKETCH_ROWS * SKETCH_WIDTH, _SKETCH_AT).reshape(
            SKETCH_ROWS, SKETCH_WIDTH), self._header["additions"], 10 * SLOTS)
        t = self._table
        self.policy = TinyLfu(t["key"], t["size"], t["segment"], t["used"], self.max_bytes, sketch)
        with self._locked():
            self._prune()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # --- what the registry calls ------------------------------------------------------------------------------------

    def get(self, version: str, digests: Mapping[str, str] | None, sources: Sources) -> SealedVersion:
        """The sealed copy of `version`: this process's, another's from the index, or made now from `sources()`
        (called only then: it may fetch them) and listed. A version without digests is sealed unchecked and never
        shared."""
        if digests is None or not self.shared:
            return seal_files(version, sources(), digests)
        key = version_key(version, digests)
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held[2] += 1
                return held[1]
        try:
            with self._locked():
                copy = self._find(key, version, digests)
        except OSError:  # out of descriptors: this process's own copy, not shared
            return seal_files(version, sources(), digests)
        if copy is not None:
            return copy
        copy = seal_files(version, sources(), digests)
        with self._locked():
            return self._list(key, copy, version, digests)

    def record(self, copy: SealedVersion) -> None:
        """A request used `copy` (counted, written to the index with the next flush)."""
        if copy.shared:
            self._uses[copy.key] += 1

    def refresh(self) -> None:
        """Per batch: write the uses recorded since the last flush (once FLUSH_SECONDS passed), and let go of the
        copies the host evicted since the last look (each marked `evicted`, `releases` counted)."""
        if not self.shared:
            return
        due = self._uses and time.monotonic() - self._flushed >= FLUSH_SECONDS
        if not due and int(self._header["generation"][0]) == self._generation:
            return
        with self._locked():
            self._flush()
            self._generation = int(self._header["generation"][0])
            gone = [k for k, (slot, _, _) in self._held.items() if self._table["key"][slot].tobytes() != k]
            for key in gone:
                copy = self._held.pop(key)[1]
                copy.evicted = True
                copy.release()
            if gone:
                self.releases += 1

    def release(self, copy: SealedVersion) -> None:
        """This process no longer serves `copy` (its registry dropped the version): off its holders."""
        if not copy.shared:
            copy.release()
            return
        with self._locked():
            held = self._held.get(copy.key)
            if held is None or held[1] is not copy:
                return
            held[2] -= 1
            if held[2] == 0:
                del self._held[copy.key]
                self._leave(held[0], copy.key)
                copy.release()

    def close(self) -> None:
        if not self.shared:
            return
        with self._locked():
            for key, (slot, copy, _) in list(self._held.items()):
                self._leave(slot, key)
                copy.release()
            self._held.clear()
        os.close(self._fd)
        self._fd = None

    def entries(self) -> list[dict]:
        """The host's entries now (for `aot tasks`-like reports and tests): key, size, segment, holders."""
        if not self.shared:
            return []
        with self._locked():
            return [{"key": self._table["key"][s].tobytes(), "size": int(self._table["size"][s]),
                     "segment": int(self._table["segment"][s]), "holders": int((self._table["holders"][s]["pid"]
                                                                                > 0).sum())}
                    for s in np.flatnonzero(self._table["segment"] != FREE).tolist()]

    # --- under the lock ---------------------------------------------------------------------------------------------

    def _slot(self, key: bytes) -> int | None:
        k = np.frombuffer(key, dtype="<u8")
        found = np.flatnonzero((self._table["key"][:, 0] == k[0]) & (self._table["key"][:, 1] == k[1])
                               & (self._table["segment"] != FREE))
        return int(found[0]) if len(found) else None

    def _find(self, key: bytes, version: str, digests: Mapping[str, str]) -> SealedVersion | None:
        self._flush()
        self.policy.record([], np.frombuffer(key, dtype="<u8")[None, :], time.monotonic())
        slot = self._slot(key)
        if slot is None:
            return None
        copy = self._open_held(slot, version, digests)
        if copy is None:
            self._free(slot)
            return None
        self.opened += 1
        self._join(slot, key, copy)
        return copy

    def _open_held(self, slot: int, version: str, digests: Mapping[str, str]) -> SealedVersion | None:
        """A holder's copy of the entry in `slot`; holders that are gone or do not hold that copy are struck off."""
        entry = self._table[slot]
        for h in range(HOLDERS):
            pid, fd, started = (int(x) for x in entry["holders"][h])
            if pid == 0:
                continue
            try:
                copy = open_sealed(f"/proc/{pid}/fd/{fd}", int(entry["ino"]), int(entry["size"]), version, digests)
            except SealError:
                entry["holders"][h] = (0, 0, 0)
                continue
            if start_time(pid) != started:  # the pid of a process that ended, reused (the copy checked anyway)
                copy.release()
                entry["holders"][h] = (0, 0, 0)
                continue
            return copy
        return None

    def _join(self, slot: int, key: bytes, copy: SealedVersion) -> None:
        copy.shared, copy.key = True, key
        self._held[key] = [slot, copy, 1]
        holders = self._table[slot]["holders"]
        empty = np.flatnonzero(holders["pid"] == 0)
        if len(empty):
            holders[empty[0]] = (self._me[0], copy.fd, self._me[1])
        self._table["used"][slot] = time.monotonic()

    def _list(self, key: bytes, copy: SealedVersion, version: str, digests: Mapping[str, str]) -> SealedVersion:
        """List a copy this process made (or take the one another listed meanwhile)."""
        slot = self._slot(key)
        if slot is not None:
            theirs = self._open_held(slot, version, digests)
            if theirs is not None:
                copy.release()
                self._join(slot, key, theirs)
                return theirs
            self._free(slot)
        free = np.flatnonzero(self._table["segment"] == FREE)
        if not len(free):  # every slot taken: the least recently used entry goes
            listed = np.flatnonzero(self._table["segment"] != FREE)
            self._free(int(listed[np.argmin(self._table["used"][listed])]))
            free = np.flatnonzero(self._table["segment"] == FREE)
        slot = int(free[0])
        self._table[slot] = np.zeros(1, ENTRY)[0]
        t = self._table[slot]
        t["key"], t["size"], t["used"], t["ino"] = np.frombuffer(key, "<u8"), copy.size, time.monotonic(), copy.ino
        self.listed += 1
        evicted = self.policy.place(slot)
        for gone in evicted:
            if gone != slot:
                self._free(gone)
        if slot in evicted:  # larger than the host's bound: this process's own copy
            self._table[slot] = np.zeros(1, ENTRY)[0]
            return copy
        self._join(slot, key, copy)
        if self.listed % PRUNE_EVERY == 0:
            self._prune()
        return copy

    def _leave(self, slot: int, key: bytes) -> None:
        """Strike this process off the holders of `slot` if it still holds `key`; an entry no one holds goes."""
        if self._table["key"][slot].tobytes() != key or self._table["segment"][slot] == FREE:
            return
        holders = self._table[slot]["holders"]
        holders[(holders["pid"] == self._me[0]) & (holders["start"] == self._me[1])] = (0, 0, 0)
        if not (holders["pid"] > 0).any():
            self._free(slot)

    def _free(self, slot: int) -> None:
        self._table[slot] = np.zeros(1, ENTRY)[0]
        self._header["generation"] += 1

    def _flush(self) -> None:
        """Write this process's recorded uses to the index: last use of the entries, the sketch's counts."""
        if not self._uses:
            return
        uses, self._uses = self._uses, Counter()
        self._flushed = time.monotonic()
        slots = [held[0] for k in uses
                 if (held := self._held.get(k)) is not None and self._table["key"][held[0]].tobytes() == k]
        keys = np.frombuffer(b"".join(k * n for k, n in uses.items()), dtype="<u8").reshape(-1, 2)
        self.policy.record(slots, keys, self._flushed)

    def _prune(self) -> None:
        """Strike off holders that are gone (their pid ended, or is another process now); free entries left with
        none (a crashed or restarted server's)."""
        for slot in np.flatnonzero(self._table["segment"] != FREE).tolist():
            holders = self._table[slot]["holders"]
            for h in np.flatnonzero(holders["pid"] > 0).tolist():
                if start_time(int(holders[h]["pid"])) != int(holders[h]["start"]):
                    holders[h] = (0, 0, 0)
            if not (holders["pid"] > 0).any():
                self._free(slot)


def _trusted(st: os.stat_result, path: Path, what: str) -> None:
    """SealError unless `path` is this user's and no one else may read or write it."""
    kind = stat.S_ISDIR if what == "folder" else stat.S_ISREG
    if not kind(st.st_mode):
        raise SealError(f"{path} is not a {what}: not trusted; each process keeps its own copies")
    if st.st_uid != os.geteuid():
        raise SealError(f"{path} belongs to uid {st.st_uid}, not this user ({os.geteuid()}): not trusted (created "
                        "by someone else); each process keeps its own copies")
    if st.st_mode & 0o077:
        raise SealError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}: others may use it, not trusted; each process "
                        "keeps its own copies")
