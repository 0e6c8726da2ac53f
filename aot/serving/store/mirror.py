"""What this host last read of a remote store's index, on its own disk: a step instance that starts while the store
cannot be reached (a network partition, the store stopped) serves from it instead of from nothing.

    CACHE/.index/store.json, log/, index/, shards/, parts/   copies of the store's objects, as this host read them

The change log's objects are written once and never changed (aot.serving.store.log), so a copy is the object: every
one a reader fetches is kept here as it arrives, except an index, which is kept only once the state it begins was
read whole (its shards and the logs after it are here then: the newest index here is always complete). Each kept
index lets older copies go, as a compaction does in the store, so the folder holds one index, its shards and the logs
since. Read back with a FileBackend on the folder (StoreReader.last_read_state), it is the state this host last read.
The processes of a host share it (the version cache's folder, aot.serving.store.version_cache).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from aot.serving.store.backend import FileBackend
from aot.serving.store.layout import INDEX, LOG, PARTS, SHARDS, STORE_FILE
from aot.serving.store.log import ChangeLog, StoreState, generation_of, index_key
from aot.serving.store.parts import part_generation
from aot.serving.store.shards import parse_shard_key

MIRROR_DIR = ".index"  # under the version cache's folder (its names starting with '.' are not versions)
_WRITTEN_ONCE = (f"{LOG}/", f"{SHARDS}/", f"{PARTS}/")


class MirroredBackend:
    """A remote backend for readers (read, read_if_changed, list) that keeps a copy of what it reads under `folder`."""

    def __init__(self, remote, folder: str | Path):
        self.remote = remote
        self.local = FileBackend(folder)
        self.local.root.mkdir(parents=True, exist_ok=True)
        self._indexes: dict[str, bytes] = {}  # index objects read, kept once their state is read whole

    def __repr__(self) -> str:
        return repr(self.remote)

    @property
    def bytes_read(self) -> int:
        return self.remote.bytes_read

    def read(self, key: str) -> bytes | None:
        data = self.remote.read(key)
        if data is None:
            return None
        if key.startswith(f"{INDEX}/"):
            self._indexes[key] = data
        elif key.startswith(_WRITTEN_ONCE) and not self.local.path(key).exists() or key == STORE_FILE:
            self.local.write(key, data)
        return data

    def read_if_changed(self, key: str, tag) -> tuple[bytes | None, object]:
        return self.remote.read_if_changed(key, tag)

    def list(self, prefix: str) -> Iterator[str]:
        return self.remote.list(prefix)

    def remember(self, state: StoreState) -> None:
        """`state` was read whole: keep its index, then let older copies go (ChangeLog's `on_read`)."""
        data = self._indexes.pop(index_key(state.index_generation), None)
        self._indexes.clear()
        if data is None:  # format 3, or an empty store: nothing to keep
            return
        with self._locked():
            self.local.write(index_key(state.index_generation), data)
            self._prune()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.local.path(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _prune(self) -> None:
        """Under the lock: only the newest index kept, with the shards it names and the logs and parts after it (a
        shard file named by a newer index and written at or before an older one is named by that one too)."""
        indexes = sorted(g for g in map(generation_of, self.local.list(INDEX)) if g is not None)
        if not indexes:
            return
        newest = indexes[-1]
        named = ChangeLog(self.local).shard_files(newest)
        if named is None:
            return
        for key in self.local.list(INDEX):
            if key != index_key(newest):
                self.local.delete(key)
        for key in [*self.local.list(LOG), *self.local.list(PARTS)]:
            generation = part_generation(key) if key.startswith(PARTS) else generation_of(key)
            if generation is not None and generation <= newest:
                self.local.delete(key)
        for key in self.local.list(SHARDS):
            parsed = parse_shard_key(key)
            if parsed is not None and parsed[0] <= newest and named.get(parsed[1]) != parsed[0]:
                self.local.delete(key)
