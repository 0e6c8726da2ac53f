"""A task store's entries by name, compacted into shards and read one shard at a time (format 4, docs/formats.md).

    shards/<generation>-<ss>.json   {"generation", "shard": "ss", "tasks": {name: entry}}: the entries of every task
                                    whose name's sha256 starts with the two hex digits `ss`, as of the compaction at
                                    `generation`; written once, never changed

An index (aot.serving.store.log) names the file that holds each shard. A compaction writes only the shards a change
touched since the previous index and names the others' files again, so its cost is what changed; a writer that
publishes one task reads the one shard that task's name falls in. A reader that lists every task reads them all.

A shard file that cannot be parsed (truncated, overwritten) is damaged: the names it holds are unknown, so a lookup of
any name that falls in it raises DamagedShard (a KeyError: `get` answers None) unless a change since the index named
it; the other shards serve. `aot export repair` rebuilds it (aot.serving.store.repair).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import ThreadPoolExecutor

from aot.serving.formats import FormatError
from aot.serving.store.layout import SHARDS

READS_AT_ONCE = 8  # shards read in parallel when every one is needed (object storage is latency-bound)


class StaleIndex(LookupError):
    """A shard the index named was deleted by a later compaction: read the newest index again."""


class DamagedShard(KeyError):
    """A name falls in a shard whose file cannot be parsed: whether the store holds it is unknown. A KeyError, so that
    a reader's `get` answers None (and asks `damaged` why); a writer refuses to change that shard."""

    def __init__(self, shard: str, why: str):
        super().__init__(shard)
        self.shard, self.why = shard, why

    def __str__(self) -> str:
        return f"shard {self.shard} of the task store's index is damaged ({self.why}): run `aot export repair`"


def shard_of(name: str) -> str:
    """The shard of a task name: the first two hex digits of its sha256 (256 shards, whatever the number of tasks)."""
    return hashlib.sha256(name.encode()).hexdigest()[:2]


def shard_key(generation: int, shard: str) -> str:
    return f"{SHARDS}/{generation:016d}-{shard}.json"


def parse_shard_key(key: str) -> tuple[int, str] | None:
    """(generation, shard) of a shard file's key; None for any other name."""
    stem = key.rsplit("/", 1)[-1].removesuffix(".json")
    generation, _, shard = stem.partition("-")
    hexadecimal = len(shard) == 2 and all(c in "0123456789abcdef" for c in shard)
    if len(generation) == 16 and generation.isdigit() and hexadecimal:
        return int(generation), shard
    return None


ShardReader = Callable[[str, int], bytes]  # (shard, generation) -> its file's bytes (StaleIndex when it is gone)
ShardParser = Callable[[str, int, bytes], dict[str, dict]]  # (shard, generation, bytes) -> its entries


class TaskEntries(MutableMapping):
    """Raw task entries by name. The shards an index names (`files`: shard -> generation of its file) are read on
    first use; changes to an unread shard wait in an overlay until it is read, so a writer that applies a hundred
    logs reads no shard but those it asks for. `dirty`: the shards changed since the index (what the next compaction
    writes). `damaged`: shard -> why its file could not be parsed (the changes since the index still apply to it)."""

    def __init__(self, entries: dict[str, dict] | None = None, files: dict[str, int] | None = None,
                 read: ShardReader | None = None, parse: ShardParser | None = None):
        self.files = dict(files or {})
        self._unread = dict(self.files)
        self._read, self._parse = read, parse
        self._shards: dict[str, dict[str, dict]] = {}
        self._overlay: dict[str, dict[str, dict | None]] = {}
        self.dirty: set[str] = set()
        self.damaged: dict[str, str] = {}
        self._removed: dict[str, set[str]] = {}  # of a damaged shard: names a change removed (known absent)
        for name, entry in (entries or {}).items():  # an index of format 3 holds every entry inline
            self._shards.setdefault(shard_of(name), {})[name] = entry
            self.dirty.add(shard_of(name))

    def apply(self, changes: dict[str, dict | None]) -> None:
        """Set (a dict) or remove (None) entries, reading no shard."""
        for name, entry in changes.items():
            shard = shard_of(name)
            self.dirty.add(shard)
            if shard in self._unread:
                self._overlay.setdefault(shard, {})[name] = entry
                continue
            self._set(shard, self._shards.setdefault(shard, {}), name, entry)

    def indexed(self, files: dict[str, int]) -> None:
        """After a compaction wrote the changed shards: the index now names `files`, and nothing is changed since."""
        self.files, self.dirty = dict(files), set()
        self._unread = {shard: files[shard] for shard in self._unread}

    def shard(self, shard: str) -> dict[str, dict]:
        """The entries of one shard (read now if it was not); DamagedShard when its file cannot be parsed."""
        self._read_unread(shard)
        if shard in self.damaged:
            raise DamagedShard(shard, self.damaged[shard])
        return self._shards.get(shard, {})

    def read_all(self) -> None:
        """Read every unread shard: the reads in parallel (object storage is latency-bound), the parsing here. A
        damaged shard is recorded (`damaged`), the others are read."""
        unread = sorted(self._unread.items())
        if not unread:
            return
        with ThreadPoolExecutor(min(READS_AT_ONCE, len(unread))) as pool:
            data = list(pool.map(lambda item: self._read(*item), unread))
        for (shard, generation), raw in zip(unread, data, strict=True):
            self._take(shard, generation, raw)

    def _read_unread(self, shard: str) -> None:
        if shard in self._unread:
            generation = self._unread[shard]
            self._take(shard, generation, self._read(shard, generation))

    def _take(self, shard: str, generation: int, raw: bytes) -> None:
        try:
            entries = self._parse(shard, generation, raw)
        except FormatError as exc:
            self.damaged[shard] = str(exc)
            entries = {}
        self._merge(shard, entries)

    def _merge(self, shard: str, entries: dict[str, dict]) -> None:
        del self._unread[shard]
        mine = self._shards.setdefault(shard, dict(entries))
        for name, entry in self._overlay.pop(shard, {}).items():
            self._set(shard, mine, name, entry)

    def _set(self, shard: str, mine: dict[str, dict], name: str, entry: dict | None) -> None:
        """Set or remove one entry of a read shard; of a damaged one, what a change says of a name is known."""
        if entry is None:
            mine.pop(name, None)
        else:
            mine[name] = entry
        if shard in self.damaged:
            removed = self._removed.setdefault(shard, set())
            if entry is None:
                removed.add(name)
            else:
                removed.discard(name)

    def __getitem__(self, name: str) -> dict:
        shard = shard_of(name)
        overlay = self._overlay.get(shard, {})
        if name in overlay:  # changed since the index: known without reading the shard
            entry = overlay[name]
        else:
            self._read_unread(shard)
            entry = self._shards.get(shard, {}).get(name)
            if entry is None and shard in self.damaged and name not in self._removed.get(shard, ()):
                raise DamagedShard(shard, self.damaged[shard])
        if entry is None:
            raise KeyError(name)
        return entry

    def __setitem__(self, name: str, entry: dict) -> None:
        self.apply({name: entry})

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self.apply({name: None})

    def __iter__(self) -> Iterator[str]:
        self.read_all()
        return iter([name for entries in self._shards.values() for name in entries])

    def items(self) -> Iterator[tuple[str, dict]]:
        """Every (name, entry), each shard's in turn: no hash of each name, as a lookup by name takes."""
        self.read_all()
        return iter([item for entries in self._shards.values() for item in entries.items()])

    def __len__(self) -> int:
        self.read_all()
        return sum(len(entries) for entries in self._shards.values())

    def __repr__(self) -> str:
        return f"TaskEntries({len(self._unread)} of {len(self.files)} shards unread, {len(self.dirty)} changed)"
