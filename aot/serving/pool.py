"""The task pool: rows of P for every served task version, inside one preallocated buffer of `budget` bytes.

A served task is a table of V rows (one per token) of L x d fp16 values. Fused tables are memory-mapped files and
factored tasks compute rows from their factors; the pool keeps rows in memory so that a request's lookup is a gather:

- **Resident** while every version's V rows fit in the budget: each version owns a contiguous range of rows, each row
  filled the first time a request reads it (a batch's new rows read from the table, or computed in one rows-graph
  run): a lookup is `buffer[base + ids]`, and nothing is ever evicted. Filling the whole range at the first request
  made a factored MiniLM task's first answer take 0.8-1 s (30,522 rows computed for the ~20 it needed).
- **Cache** beyond that: rows are kept per (version, token id) and a batch's misses are filled together, one
  gather (fused) or one rows-graph run (factored) per version. When the buffer is full, 1/16 of it is evicted at
  once, chosen by the policy: `lru` (a last-use tick per slot: the oldest go) or `lfu` (frequency-aware: rows of
  the tokens requested least often go first, ties by last use; token counts are kept across tasks and evictions,
  since token ids follow a Zipf law in every task, and halve whenever 8 buffers' worth of rows were filled, so
  that old popularity fades). `aot bench tasks` measures both on one request trace; the default is the one that
  measured best (docs/benchmarks.md, "Many tasks on one engine").

The pool hands out slots (`slots_many`): a request's rows are `buffer[slots]`. The buffer lives where the backbone
runs: host memory (`HostRows`, numpy) for the ONNX Runtime step; for an engine that keeps rows on its device, the
storage it registers (aot.serving.engine.Engine.storage: the torch engine's device memory, whose captured graph gathers
from the buffer itself). Bookkeeping is the same.

A version that is removed or replaced is detached and its rows are dropped at once; keys carry the version, so
rows of one version are never served for another. Counters per version: hits, misses, evictions, fill seconds,
resident rows (`stats`).
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from aot.serving import protocol

EVICT_FRACTION = 16  # evict 1/16 of the buffer when it is full: one argpartition per many fills
# a version holding this share of the vocabulary's rows finds its slots in an array (4 bytes per token of the
# vocabulary) rather than a dict: memory stays bounded (at most 1 / DENSE_SHARE of the pool's rows in such versions)
DENSE_SHARE = 1 / 64
FILL_CHUNK = 1024  # a fill computes at most this many rows in one run: ONNX Runtime keeps its peak working
# memory, so one run over all of a table's rows would keep several times the RSS of chunks (docs/benchmarks.md, "Second pass")
POLICIES = ("lru", "lfu")
AGING_TURNOVERS = 8  # lfu: use counts halve once AGING_TURNOVERS x the buffer's rows were filled
DEFAULT_POLICY = "lfu"  # the higher hit rates of the two in the replayed traces (docs/benchmarks.md, "Second pass")


class RowStorage(Protocol):
    """Where a pool's rows live: allocates the buffer, writes rows into slots of it, gathers rows from slots."""

    def allocate(self, slots: int, num_layers: int, hidden_size: int): ...

    def write(self, buffer, slots: np.ndarray, rows: np.ndarray) -> None: ...

    def gather(self, buffer, slots: np.ndarray): ...


class HostRows:
    """Pool rows in host memory: a numpy buffer."""

    def allocate(self, slots: int, num_layers: int, hidden_size: int) -> np.ndarray:
        """The buffer, in anonymous memory of ordinary pages. numpy asks the kernel for transparent huge pages for a
        large array, and the first write into a huge page then zeroes all 2 MiB of it: a task's first rows,
        scattered over its range of the buffer, would cost a cold request tens of milliseconds of page faults."""
        shape = (slots, num_layers, hidden_size)
        size = slots * num_layers * hidden_size * np.dtype(protocol.ROWS_DTYPE).itemsize
        if size == 0:
            return np.empty(shape, dtype=protocol.ROWS_DTYPE)
        memory = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
            memory.madvise(mmap.MADV_NOHUGEPAGE)
        return np.frombuffer(memory, dtype=protocol.ROWS_DTYPE).reshape(shape)

    def write(self, buffer: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
        buffer[slots] = rows

    def gather(self, buffer: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return buffer[slots]


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    fill_seconds: float = 0.0
    resident_rows: int = 0


class RowPool:
    def __init__(self, budget_bytes: int, num_layers: int, hidden_size: int, vocab_size: int,
                 policy: str = DEFAULT_POLICY, storage: RowStorage | None = None):
        """`storage`: where the rows live (HostRows by default; an engine's own, aot.serving.engine.Engine.storage)."""
        if policy not in POLICIES:
            raise ValueError(f"pool policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.row_shape = (num_layers, hidden_size)
        self.row_bytes = num_layers * hidden_size * protocol.ROWS_DTYPE.itemsize
        self.vocab_size = vocab_size
        self.slots = int(budget_bytes // self.row_bytes)
        self.budget_bytes = self.slots * self.row_bytes
        self.storage = storage or HostRows()
        self.buffer = self.storage.allocate(self.slots, num_layers, hidden_size)
        self._lock = threading.RLock()  # rows_many holds it across slots_many and its gather
        self._sources: dict[str, Callable[[np.ndarray], np.ndarray] | None] = {}  # None: let go (let_go)
        self.stats: dict[str, PoolStats] = {}
        self.touched: set[str] = set()  # versions whose stats changed since the last snapshot()
        # resident mode: version -> first slot of its V rows; ranges of detached versions, reused first
        self._base: dict[str, int] = {}
        self._free_bases: list[int] = []
        self._next_base = 0
        self._filled: dict[str, np.ndarray] = {}  # resident mode: per version, which of its V rows are filled
        # cache mode: per version its tokens' slots, a dict token -> slot while it holds few rows (memory grows with
        # the rows held, not with V x versions), an int32 array over the vocabulary once it holds DENSE_SHARE of it
        # (a batch's lookup is then one vectorised take, not Python per token); per slot its key (version number *
        # V + token, -1 free) and its last use
        self._resident = True
        self._slot_of: dict[str, dict[int, int] | np.ndarray] = {}
        self._owner = np.full(self.slots, -1, dtype=np.int64)  # version number * V + token, -1 free
        self._owner_version: list[str] = []
        self._version_number: dict[str, int] = {}
        self._last_use = np.zeros(self.slots, dtype=np.int64)
        self._token_uses = np.zeros(vocab_size, dtype=np.int64)  # lfu: requests per token, aged
        self._filled_since_aging = 0
        self._tick = 0
        self._free = np.empty(0, dtype=np.int64)  # a stack of free slots: the first _free_count are free
        self._free_count = 0

    def holds(self, version: str) -> bool:
        return version in self._sources

    @property
    def resident(self) -> bool:
        """True while every attached version is fully resident (no eviction ever)."""
        return self._resident

    def attach(self, version: str, source: Callable[[np.ndarray], np.ndarray]) -> None:
        """Serve `version` from the pool; `source(sorted ids) -> [U, L, d]` reads or computes missing rows (an
        attached version takes the new source: the one its loaded task offers now)."""
        with self._lock:
            known = version in self._sources
            self._sources[version] = source
            if not known:
                self.stats[version] = PoolStats()
                self._layout()

    def let_go(self, version: str) -> None:
        """Keep a version's rows but not its source (the task its registry dropped from memory): its next request
        loads the task again and attaches its source before any row is filled."""
        with self._lock:
            if version in self._sources:
                self._sources[version] = None

    def versions(self) -> list[str]:
        """The attached versions."""
        with self._lock:
            return list(self._sources)

    def detach(self, version: str) -> None:
        """Drop a removed or replaced version's rows at once."""
        with self._lock:
            if version not in self._sources:
                return
            del self._sources[version]
            self.touched.add(version)
            self.stats.pop(version, None)  # its resident range, if any, goes back to the free ranges in _layout
            slot_of = self._slot_of.pop(version, None)
            if isinstance(slot_of, np.ndarray):
                freed = slot_of[slot_of >= 0].astype(np.int64)
            else:
                freed = np.fromiter((slot_of or {}).values(), dtype=np.int64, count=len(slot_of or {}))
            if len(freed):
                self._owner[freed] = -1
                self._release(freed)
            self._layout()

    def _layout(self) -> None:
        """Resident while every version's V rows fit: each version keeps its range for as long as it is attached
        (a detached version's range is reused by the next one, never shifted under a live version). Beyond that,
        switch to the cache (once: it never switches back while versions are attached)."""
        if not self._resident:
            return
        for version in [v for v in self._base if v not in self._sources]:
            self._free_bases.append(self._base.pop(version))
            self._filled.pop(version, None)
        for version in self._sources:
            if version in self._base:
                continue
            if self._free_bases:
                self._base[version] = self._free_bases.pop()
            elif self._next_base + self.vocab_size <= self.slots:
                self._base[version] = self._next_base
                self._next_base += self.vocab_size
            else:
                self._resident = False
                self._base, self._filled, self._free_bases = {}, {}, []
                for stats in self.stats.values():
                    stats.resident_rows = 0
                self.touched.update(self.stats)
                self._owner[:] = -1
                self._free, self._free_count = np.arange(self.slots, dtype=np.int64), self.slots
                self._slot_of = {}
                return

    def snapshot(self) -> tuple[set[str], dict[str, PoolStats]]:
        """The versions whose counters changed since the last call (metrics publish only those), and a copy of every
        version's counters, taken together under the pool's lock (the metrics thread reads them while requests
        change them)."""
        with self._lock:
            touched, self.touched = self.touched, set()
            return touched, {version: dataclasses.replace(stats) for version, stats in self.stats.items()}

    def slots_many(self, requests: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """The buffer slots of each (version, sorted distinct token ids) of a batch, its misses filled. The slots
        hold those rows until the next call (the caller gathers before it asks again)."""
        with self._lock:
            self.touched.update(version for version, _ in requests)
            if self._resident:
                return self._resident_slots(requests)
            return self._cached_slots(requests)

    def rows_many(self, requests: list[tuple[str, np.ndarray]]) -> list:
        """Rows for each (version, sorted distinct token ids) of a batch, [U, L, d] fp16 each, where the pool
        keeps them (numpy arrays, or tensors on the storage's device)."""
        with self._lock:
            return [self.gather(slots) for slots in self.slots_many(requests)]

    def gather(self, slots: np.ndarray):
        """The rows in `slots` (as `slots_many` handed them out), copied out of the buffer on its device."""
        return self.storage.gather(self.buffer, slots)

    def _resident_slots(self, requests: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """Each version's range of rows; the rows the batch needs that are not filled yet filled now, in one fill per
        version (the batch's items of one task share it)."""
        misses: dict[str, np.ndarray] = {}
        missed = []
        for version, ids in requests:
            filled = self._filled.get(version)
            if filled is None:
                filled = self._filled[version] = np.zeros(self.vocab_size, dtype=bool)
            missing = ids[~filled[ids]]
            missed.append(len(missing))
            if len(missing):
                misses[version] = np.union1d(misses[version], missing) if version in misses else missing
        for version, missing in misses.items():
            base, stats, start = self._base[version], self.stats[version], time.perf_counter()
            for first in range(0, len(missing), FILL_CHUNK):
                chunk = missing[first:first + FILL_CHUNK]
                self.storage.write(self.buffer, base + chunk, self._sources[version](chunk))
            self._filled[version][missing] = True
            stats.fill_seconds += time.perf_counter() - start
            stats.resident_rows += len(missing)
        for (version, ids), count in zip(requests, missed, strict=True):
            self.stats[version].misses += count
            self.stats[version].hits += len(ids) - count
        return [self._base[version] + ids for version, ids in requests]

    def _slots(self, version: str, ids: np.ndarray) -> np.ndarray:
        """Each token's slot (-1: not held)."""
        slot_of = self._slot_of.setdefault(version, {})
        if isinstance(slot_of, np.ndarray):
            return slot_of[ids].astype(np.int64)
        get = slot_of.get
        return np.fromiter((get(t, -1) for t in ids.tolist()), dtype=np.int64, count=len(ids))

    def _cached_slots(self, requests: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        self._tick += 1
        slots = [self._slots(version, ids) for version, ids in requests]
        misses: dict[str, np.ndarray] = {}
        for (version, ids), found in zip(requests, slots, strict=True):
            self._last_use[found[found >= 0]] = self._tick  # protect this batch's hits from eviction
            if self.policy == "lfu":
                self._token_uses[ids] += 1
            missing = ids[found < 0]
            if len(missing):
                misses[version] = np.union1d(misses[version], missing) if version in misses else missing
        for version, ids in misses.items():  # one fill (gather or matmul) per version
            self._fill(version, ids)
        out = []
        for (version, ids), found in zip(requests, slots, strict=True):
            stats = self.stats[version]
            missed = int((found < 0).sum())
            if missed:
                found = self._slots(version, ids)
            stats.misses += missed
            stats.hits += len(ids) - missed
            self._last_use[found] = self._tick
            out.append(found)
        return out

    def _release(self, slots: np.ndarray) -> None:
        self._free[self._free_count:self._free_count + len(slots)] = slots
        self._free_count += len(slots)

    def _take(self, count: int) -> np.ndarray:
        if self._free_count < count:
            self._evict(max(count - self._free_count, self.slots // EVICT_FRACTION), count - self._free_count)
        self._free_count -= count
        return self._free[self._free_count:self._free_count + count].copy()

    def _evict(self, want: int, need: int) -> None:
        """Evict `want` rows (at least `need`) that this batch does not use, chosen by the policy."""
        candidates = np.flatnonzero((self._owner >= 0) & (self._last_use < self._tick))
        if len(candidates) < need:
            raise MemoryError(f"the task pool holds {self.slots} rows; one batch needs more "
                              f"({need + self._free_count}): raise --pool-bytes")
        want = min(want, len(candidates))
        score = self._last_use[candidates]
        if self.policy == "lfu":
            score = (self._token_uses[self._owner[candidates] % self.vocab_size] << 32) | (score & 0xFFFFFFFF)
            if self._filled_since_aging >= AGING_TURNOVERS * self.slots:
                self._token_uses >>= 1
                self._filled_since_aging = 0
        oldest = candidates[np.argpartition(score, want - 1)[:want]] if want < len(candidates) else candidates
        numbers, tokens = np.divmod(self._owner[oldest], self.vocab_size)
        for number in np.unique(numbers).tolist():
            version = self._owner_version[number]
            slot_of, gone = self._slot_of.get(version), tokens[numbers == number]
            if slot_of is not None:
                if isinstance(slot_of, np.ndarray):
                    slot_of[gone] = -1
                else:
                    for token in gone.tolist():
                        del slot_of[token]
                self.stats[version].evictions += len(gone)
                self.stats[version].resident_rows -= len(gone)
                self.touched.add(version)
        self._owner[oldest] = -1
        self._release(oldest)

    def _number(self, version: str) -> int:
        if version not in self._version_number:
            self._version_number[version] = len(self._owner_version)
            self._owner_version.append(version)
        return self._version_number[version]

    def _fill(self, version: str, ids: np.ndarray) -> None:
        start = time.perf_counter()
        rows = self._sources[version](ids)  # first: a source that fails (a damaged table's block) takes no slot
        slots = self._take(len(ids))
        self.storage.write(self.buffer, slots, rows)
        slot_of = self._slot_of[version]
        if isinstance(slot_of, dict):
            slot_of.update(zip(ids.tolist(), slots.tolist(), strict=True))
            if len(slot_of) >= self.vocab_size * DENSE_SHARE:  # many rows: one array over the vocabulary from now on
                dense = np.full(self.vocab_size, -1, dtype=np.int32)
                dense[np.fromiter(slot_of, dtype=np.int64)] = np.fromiter(slot_of.values(), dtype=np.int32)
                self._slot_of[version] = dense
        else:
            slot_of[ids] = slots
        self._owner[slots] = self._number(version) * self.vocab_size + ids
        self._last_use[slots] = self._tick  # rows filled for this batch are not evicted by its next fill
        self._filled_since_aging += len(slots)
        stats = self.stats[version]
        stats.fill_seconds += time.perf_counter() - start
        stats.resident_rows += len(ids)
