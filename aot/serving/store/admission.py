"""Which task versions a host keeps: W-TinyLFU (a small window of recent versions in front of a main part whose
members change only when a version asked for more often than the one it would replace comes along).

Why this policy: a step's working set of versions cycles (the same draws replayed by a busy service), and least
recently used eviction fails a cyclic working set slightly larger than the cache completely: each version is evicted
just before it is asked for again (0 hits; docs/benchmarks.md, "The version cache's policy"). Segmented LRU does not
help a cycle either (nothing is asked twice while it is on probation). An admission filter does: versions asked for
equally often tie, a tie keeps the one already held, so the main part holds a stable share of the cycle and serves it
every time round, and under Zipf it keeps the popular versions over the long tail's one-off requests. The frequencies
are a count-min sketch (4 rows of 4-bit counters, halved after `sample` additions so that old popularity fades),
small and fixed whatever the number of versions; the window (WINDOW_SHARE of the bytes) gives a new version a chance
to prove itself and serves a burst of requests for it.

The policy works on plain numpy arrays (the fields of a table of entries, and the sketch's counters), so that the
host's shared index (aot.serving.store.host_cache) and an in-process replay (`replay`) run the same code. LRU is
kept beside it for that comparison.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

FREE, WINDOW, MAIN = 0, 1, 2  # an entry's segment
WINDOW_SHARE = 0.01  # of the bytes: the window (at least its newest entry), as TinyLFU's authors chose
COUNTER_MAX = 15  # 4-bit counters, as TinyLFU's
SKETCH_ROWS = 4
POLICIES = ("lru", "tinylfu")


class Sketch:
    """Count-min estimates of how often each key was asked for, in `counters` [SKETCH_ROWS, W] uint8 (W a power of
    2) and `additions` (a one-element int64 array: both may live in shared memory). Keys are 16 bytes of a sha256 as
    two uint64: each row indexes by 16 bits of its own."""

    def __init__(self, counters: np.ndarray, additions: np.ndarray, sample: int):
        self.counters, self.additions, self.sample = counters, additions, sample
        self.mask = np.uint64(counters.shape[1] - 1)

    def _columns(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.uint64).reshape(-1, 2)
        shifts = np.array([0, 16, 32, 48], dtype=np.uint64)
        return ((keys[:, (np.arange(SKETCH_ROWS) % 2)] >> shifts) & self.mask).astype(np.int64)  # [n, rows]

    def add(self, keys: np.ndarray) -> None:
        columns = self._columns(keys)
        width = self.counters.shape[1]
        cells, repeats = np.unique((np.arange(SKETCH_ROWS) * width + columns).ravel(), return_counts=True)
        rows, cols = np.divmod(cells, width)  # only the counters asked for are read and written: the sketch is wide
        self.counters[rows, cols] = np.minimum(self.counters[rows, cols] + repeats, COUNTER_MAX)  # saturated
        self.additions[0] += len(columns)
        if self.additions[0] >= self.sample:
            self.counters >>= 1
            self.additions[0] //= 2

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        columns = self._columns(keys)
        return self.counters[np.arange(SKETCH_ROWS), columns].min(axis=1)


class Policy:
    """The bookkeeping both policies share: `key` [N, 2] uint64, `size` [N] int64, `segment` [N] int8 and `used` [N]
    float64 (last use) are the fields of a table of N entries (FREE slots have segment FREE)."""

    def __init__(self, key: np.ndarray, size: np.ndarray, segment: np.ndarray, used: np.ndarray, max_bytes: int):
        self.key, self.size, self.segment, self.used = key, size, segment, used
        self.max_bytes = max_bytes

    def record(self, slots: Sequence[int], keys: np.ndarray, now: float) -> None:
        """Requests for `keys` (held or not); `slots`: those of them held, used at `now`."""
        self.used[list(slots)] = now

    def place(self, slot: int) -> list[int]:
        """A new entry (its key, size and use set, segment FREE) joins; the slots to evict (it may be one of them)."""
        raise NotImplementedError

    def _oldest(self, segment: int, need: int) -> list[int]:
        """The segment's least recently used entries (ties in slot order) whose sizes first reach `need` bytes, or
        all of them. Eviction takes a few of the oldest: they are found by a partition, not a sort of them all."""
        held = np.flatnonzero(self.segment == segment)
        used = self.used[held]
        count = 4
        while True:
            if count < len(held):  # the order's first `count` (and any tied with the last) are those used at or
                # before its count-th smallest time
                first = held[used <= np.partition(used, count - 1)[count - 1]]
            else:
                first = held
            order = first[np.argsort(self.used[first], kind="stable")].tolist()
            total, out = 0, []
            for slot in order:
                if total >= need:
                    return out
                out.append(slot)
                total += int(self.size[slot])
            if total >= need or len(first) == len(held):
                return out
            count *= 4

    def _bytes(self, segment: int) -> int:
        return int(self.size[self.segment == segment].sum())


class Lru(Policy):
    """Least recently used: the comparison (a cyclic working set larger than the cache gets no hit)."""

    def place(self, slot: int) -> list[int]:
        self.segment[slot] = MAIN
        return self._oldest(MAIN, self._bytes(MAIN) - self.max_bytes)


class TinyLfu(Policy):
    """W-TinyLFU (module docstring): a new entry joins the window; the window's least recently used entries leave
    it past WINDOW_SHARE of the bytes, each into the main part if it has room, else if the sketch estimates it asked
    for more often than the main part's least recently used entries it would replace (then they go), else it goes."""

    def __init__(self, key, size, segment, used, max_bytes: int, sketch: Sketch):
        super().__init__(key, size, segment, used, max_bytes)
        self.sketch = sketch

    def record(self, slots: Sequence[int], keys: np.ndarray, now: float) -> None:
        super().record(slots, keys, now)
        if len(keys):
            self.sketch.add(keys)

    def place(self, slot: int) -> list[int]:
        if self.size[slot] > self.max_bytes:
            return [slot]
        self.segment[slot] = WINDOW
        window_bytes = max(int(self.max_bytes * WINDOW_SHARE), int(self.size[slot]))
        main_bytes = self.max_bytes - window_bytes
        evicted: list[int] = []
        for candidate in self._oldest(WINDOW, self._bytes(WINDOW) - window_bytes):
            evicted += self._admit(candidate, main_bytes)
        return evicted

    def _admit(self, candidate: int, main_bytes: int) -> list[int]:
        """The window's candidate into the main part, or out; the slots that leave."""
        need = self._bytes(MAIN) + int(self.size[candidate]) - main_bytes
        victims = self._oldest(MAIN, need)
        if int(self.size[victims].sum()) < need:  # larger than the whole main part
            return [candidate]
        if victims:
            wanted = self.sketch.estimate(self.key[[candidate, *victims]])
            if wanted[0] <= wanted[1:].max():  # a tie keeps what is held: what resists a cycle
                return [candidate]
        self.segment[candidate] = MAIN
        self.segment[victims] = FREE  # gone: the window's next candidate must not count their bytes again
        return victims


def make_policy(name: str, slots: int, max_bytes: int) -> Policy:
    """A policy over a fresh in-process table of `slots` entries (the replay's; the host's lives in shared memory)."""
    key = np.zeros((slots, 2), dtype=np.uint64)
    size = np.zeros(slots, dtype=np.int64)
    segment = np.zeros(slots, dtype=np.int8)
    used = np.zeros(slots, dtype=np.float64)
    if name == "lru":
        return Lru(key, size, segment, used, max_bytes)
    if name == "tinylfu":
        width = 1 << max(10, int(np.ceil(np.log2(4 * slots))))
        sketch = Sketch(np.zeros((SKETCH_ROWS, width), dtype=np.uint8), np.zeros(1, dtype=np.int64), 10 * slots)
        return TinyLfu(key, size, segment, used, max_bytes, sketch)
    raise ValueError(f"version cache policy {name!r}: expected one of {', '.join(POLICIES)}")


def key_of(name: str) -> np.ndarray:
    """A replay's key for a name: 16 bytes of its sha256, as two uint64 (the host cache keys versions alike)."""
    import hashlib

    return np.frombuffer(hashlib.sha256(name.encode()).digest()[:16], dtype=np.uint64).copy()


def replay(policy: Policy, trace: Iterable[str], sizes: dict[str, int] | int) -> dict:
    """Run a trace of version names through `policy` (in process): hits, misses, hit rate."""
    where: dict[str, int] = {}
    owner: dict[int, str] = {}
    free = list(range(len(policy.size) - 1, -1, -1))
    hits = misses = 0
    for now, name in enumerate(trace):
        key = key_of(name)
        slot = where.get(name)
        policy.record([] if slot is None else [slot], key[None, :], float(now))
        if slot is not None:
            hits += 1
            continue
        misses += 1
        slot = free.pop()
        policy.key[slot], policy.used[slot] = key, float(now)
        policy.size[slot] = sizes if isinstance(sizes, int) else sizes[name]
        where[name], owner[slot] = slot, name
        for gone in policy.place(slot):
            policy.segment[gone] = FREE
            free.append(gone)
            del where[owner.pop(gone)]
    return {"hits": hits, "misses": misses, "hit_rate": round(hits / max(hits + misses, 1), 4)}
