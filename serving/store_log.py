"""The task store's index as an append-only change log: a publish costs what it changes, for writer and readers.

    store.json                the store's identity: {"format": "aot-task-store", "format_version": 2, "backbone"}
    log/<generation>.json     one change set, written once and never changed: {"generation": g, "time": t,
                              "tasks": {name: entry, or null for a removed task},
                              "retired": {version: {"time": t, "digests": {...}}, or null when it is gone},
                              "tenants": {tenant: {"key_sha256", "time"}, or null for a deleted one} (format 3;
                              absent: no tenant changed)}
    index/<generation>.json   the whole state after generation g (a compaction): {"generation", "tasks", "retired",
                              "tenants"}
    generation                the newest generation, as text: a hint that readers poll cheaply (one stat, or one
                              conditional GET on S3); the log is the truth

Generations are numbered from 1 and named with 16 digits. A writer appends generation g+1 with a create that fails if
the object exists, so two publishers racing never both succeed: the loser reads the winner's change and tries again
with g+2. A reader that holds generation g reads only log/g+1, g+2, ...: a publish costs every reader one small object,
whatever the number of tasks. Every COMPACT_EVERY generations the writer also writes index/<g> and deletes the logs and
indexes older than the previous index, so a new reader reads one index and at most 2 x COMPACT_EVERY logs; a reader
left so far behind that its next log was deleted reads the newest index again.

Entries are opaque to this module (serving.store parses and checks them); it only applies change sets in order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serving.formats import FormatError
from serving.store_backend import BackendError

LOG = "log"
INDEX = "index"
GENERATION = "generation"
STORE_FILE = "store.json"
COMPACT_EVERY = 128
HINT_RECHECK = 10.0  # seconds after which a reader probes the next log even if the hint did not move


def _name(generation: int) -> str:
    return f"{generation:016d}.json"


def log_key(generation: int) -> str:
    return f"{LOG}/{_name(generation)}"


def index_key(generation: int) -> str:
    return f"{INDEX}/{_name(generation)}"


def _generation_of(key: str) -> int | None:
    stem = key.rsplit("/", 1)[-1].removesuffix(".json")
    return int(stem) if len(stem) == 16 and stem.isdigit() else None


@dataclass
class Change:
    """One change set: task entries set (a dict) or removed (None), retired versions added (a dict) or dropped,
    tenants set (a dict) or deleted (None)."""

    tasks: dict[str, dict | None] = field(default_factory=dict)
    retired: dict[str, dict | None] = field(default_factory=dict)
    tenants: dict[str, dict | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tasks or self.retired or self.tenants)


@dataclass
class StoreState:
    """The index as of `generation`: raw task entries, retired versions and tenants."""

    generation: int = 0
    tasks: dict[str, dict] = field(default_factory=dict)
    retired: dict[str, dict] = field(default_factory=dict)
    tenants: dict[str, dict] = field(default_factory=dict)

    def apply(self, change: Change) -> None:
        for mine, changed in ((self.tasks, change.tasks), (self.retired, change.retired),
                              (self.tenants, change.tenants)):
            for key, value in changed.items():
                if value is None:
                    mine.pop(key, None)
                else:
                    mine[key] = value

    def to_json(self) -> dict:
        return {"generation": self.generation, "tasks": self.tasks, "retired": self.retired, "tenants": self.tenants}


def _parse(data: bytes, where: str) -> dict:
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{where}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _objects(value, where: str, key: str, nullable: bool) -> dict:
    found = value.get(key, {})
    if not isinstance(found, dict) or not all(isinstance(k, str) and (isinstance(v, dict) or nullable and v is None)
                                              for k, v in found.items()):
        raise FormatError(f"{where}: {key!r} must be an object of name -> object{' or null' if nullable else ''}")
    return found


def _change(data: bytes, generation: int, where: str) -> Change:
    value = _parse(data, where)
    if value.get("generation") != generation:
        raise FormatError(f"{where}: holds generation {value.get('generation')!r}, expected {generation}")
    return Change(_objects(value, where, "tasks", True), _objects(value, where, "retired", True),
                  _objects(value, where, "tenants", True))


class ChangeLog:
    """Reads and appends a store's change log through a backend (serving.store_backend)."""

    def __init__(self, backend):
        self.backend = backend
        self._hint_tag = None
        self._probed = 0.0

    # --- readers ----------------------------------------------------------------------------------------------------

    def read_state(self) -> StoreState:
        """The newest state: the newest index, then every log after it."""
        indexes = sorted(g for g in map(_generation_of, self.backend.list(INDEX)) if g is not None)
        for generation in reversed(indexes):
            data = self.backend.read(index_key(generation))
            if data is None:  # compacted away between the listing and the read
                continue
            where = f"{self.backend!r} {index_key(generation)}"
            value = _parse(data, where)
            if value.get("generation") != generation:
                raise FormatError(f"{where}: holds generation {value.get('generation')!r}, expected {generation}")
            state = StoreState(generation, dict(_objects(value, where, "tasks", False)),
                               dict(_objects(value, where, "retired", False)),
                               dict(_objects(value, where, "tenants", False)))
            break
        else:
            state = StoreState()
        self._follow(state)
        return state

    def changed(self) -> bool:
        """Cheap: whether the generation hint moved since the last call (or HINT_RECHECK seconds passed, in case a
        writer died between its log and the hint)."""
        data, self._hint_tag = self.backend.read_if_changed(GENERATION, self._hint_tag)
        now = time.monotonic()
        if data is not None or now - self._probed > HINT_RECHECK:
            self._probed = now
            return True
        return False

    def follow(self, state: StoreState) -> set[str] | None:
        """Apply the logs after `state.generation` to it; the names of the tasks whose entries changed (an empty set:
        nothing new), or None when the state had to be read again whole (it fell behind the compaction)."""
        changed = self._follow(state)
        if changed is not None:
            return changed
        fresh = self.read_state()
        state.generation, state.tasks, state.retired, state.tenants = (fresh.generation, fresh.tasks, fresh.retired,
                                                                       fresh.tenants)
        return None

    def _follow(self, state: StoreState) -> set[str] | None:
        changed: set[str] = set()
        start = state.generation
        while True:
            generation = state.generation + 1
            data = self.backend.read(log_key(generation))
            if data is None:  # the end of the log, or (when no log followed) a reader left behind the compaction
                if state.generation == start and self._compacted_past(start):
                    return None
                return changed
            change = _change(data, generation, f"{self.backend!r} {log_key(generation)}")
            state.apply(change)
            state.generation = generation
            changed |= set(change.tasks)

    def _compacted_past(self, generation: int) -> bool:
        """Whether the log after `generation` was deleted (an index newer than it exists, and so do logs after it)."""
        indexes = [g for g in map(_generation_of, self.backend.list(INDEX)) if g is not None]
        return any(g > generation for g in indexes)

    # --- writers ----------------------------------------------------------------------------------------------------

    def commit(self, make: Callable[[StoreState], Change], attempts: int = 20) -> tuple[StoreState, Change]:
        """Append the change `make(state)` computes from the newest state, as the next generation; if another
        writer appended it first, read theirs and compute again. Returns the new state and the change (an empty
        change appends nothing)."""
        state = self.read_state()
        for _ in range(attempts):
            change = make(state)
            if not change:
                return state, change
            generation = state.generation + 1
            record = {"generation": generation, "time": time.time(), "tasks": change.tasks, "retired": change.retired,
                      **({"tenants": change.tenants} if change.tenants else {})}
            if self.backend.create(log_key(generation), json.dumps(record, separators=(",", ":")).encode()):
                state.apply(change)
                state.generation = generation
                self.backend.write(GENERATION, f"{generation}\n".encode())
                if generation % COMPACT_EVERY == 0:
                    self.compact(state)
                return state, change
            self._follow(state)  # lost the race: another writer's change first
        raise BackendError(f"{self.backend!r}: could not append to the change log after {attempts} attempts "
                           "(other writers kept winning)")

    def compact(self, state: StoreState) -> None:
        """Write the index of `state`, then delete what no reader needs: logs and indexes older than the previous
        index (a reader at any generation since then still follows the logs)."""
        self.backend.create(index_key(state.generation), json.dumps(state.to_json(), separators=(",", ":")).encode())
        indexes = sorted(g for g in map(_generation_of, self.backend.list(INDEX)) if g is not None)
        older = [g for g in indexes if g < state.generation]
        if not older:
            return
        keep_from = older[-1]
        for g in older[:-1]:
            self.backend.delete(index_key(g))
        for key in list(self.backend.list(LOG)):
            g = _generation_of(key)
            if g is not None and g <= keep_from:
                self.backend.delete(key)
