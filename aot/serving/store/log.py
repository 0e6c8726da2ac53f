"""The task store's index as an append-only change log: a publish costs what it changes, for writer and readers.

    store.json                the store's identity: {"format": "aot-task-store", "format_version": 5, "backbone"}
    log/<generation>.json     one change set, written once and never changed: {"generation": g, "time": t,
                              "tasks": {name: entry, or null for a removed task},
                              "retired": {version: {"time": t, "digests": {...}}, or null when it is gone},
                              "tenants": {tenant: {"key_sha256", "time"}, or null for a deleted one} (format 3;
                              absent: no tenant changed)}; or, for a change set larger than MAX_CHANGE_BYTES (format
                              5), {"generation", "time", "parts": [keys of parts/...]}; or, written by
                              `aot export repair` after index g, {"generation", "time", "reread": true}: read index g
    parts/<generation>-<token>-<k>.json   part k of a large change set: {"generation", "part": k, "tasks", "retired",
                              "tenants"}, each at most about MAX_CHANGE_BYTES; written before the log that names them
    index/<generation>.json   the state after generation g (a compaction): {"generation", "shards": {ss: the generation
                              of the file holding shard ss}, "retired", "tenants"}; the task entries are in
                              shards/ (aot.serving.store.shards). An index of format 3 holds them inline ("tasks").
    generation                the newest generation, as text: a hint that readers poll cheaply (one stat, or one
                              conditional GET on S3); the log is the truth

Generations are numbered from 1 and named with 16 digits. A writer appends generation g+1 with a create that fails if
the object exists, so two publishers racing never both succeed: the loser reads the winner's change and tries again
with g+2. A reader that holds generation g reads only log/g+1, g+2, ...: a publish costs every reader one small object,
whatever the number of tasks. When COMPACT_EVERY generations or COMPACT_LOG_BYTES of logs followed the newest index,
the writer also writes index/<g> (and the shards the logs since the previous index touched) and deletes the logs,
indexes and shards older than the previous index, so a new reader reads one index and a bounded tail of logs; a reader
left so far behind that its next log was deleted reads the newest index again. A writer reads the index, that tail,
and only the shards of the tasks it changes: a publish costs it what it changes, not the store's size.

A large change set (a batch publish of 100,000 tasks was one 43 MB log, parsed in one call that held the interpreter
3.6 s) is written in parts of at most about MAX_CHANGE_BYTES each, so that no single object costs a reader more than
that to parse; a step applies such a change off its request path (aot.serving.task_registry). Readers still see it
whole or not at all: the log that names the parts is written last, and a reader applies them together.

A log that cannot be parsed stops a reader at the generation before it (`StoreState.damaged_log`): it keeps serving
what it holds, and a writer refuses to append until `aot export repair` (aot.serving.store.repair) rebuilds the index.

Entries are opaque to this module (aot.serving.store.reader parses and checks them); it only applies change sets in
order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aot.serving.formats import FormatError
from aot.serving.store.backend import BackendError
from aot.serving.store.layout import GENERATION, INDEX, LOG, PARTS, SHARDS
from aot.serving.store.parts import MAX_CHANGE_BYTES, part_generation, part_keys, split, write_parts
from aot.serving.store.shards import StaleIndex, TaskEntries, parse_shard_key, shard_key, shard_of

COMPACT_EVERY = 128
COMPACT_LOG_BYTES = 256 << 10  # logs since the newest index past which the writer compacts (a batch's log is large)
READ_ATTEMPTS = 5  # a reader that finds a shard compacted away under it reads the newest index again
HINT_RECHECK = 10.0  # seconds after which a reader probes the next log even if the hint did not move
REPAIR = "run `aot export repair --repo REPO` to rebuild the index from what still reads"
REREAD = "reread"  # a log {"generation": g, "time", "reread": true}: the state as of g is index g (a repair wrote it)


def _name(generation: int) -> str:
    return f"{generation:016d}.json"


def log_key(generation: int) -> str:
    return f"{LOG}/{_name(generation)}"


def index_key(generation: int) -> str:
    return f"{INDEX}/{_name(generation)}"


def generation_of(key: str) -> int | None:
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
    """The index as of `generation`: raw task entries (read by shard, on first use), retired versions and tenants;
    and what the writer's compaction needs: the generation of the index it was read from and the bytes of the logs
    followed since."""

    generation: int = 0
    tasks: TaskEntries = field(default_factory=TaskEntries)
    retired: dict[str, dict] = field(default_factory=dict)
    tenants: dict[str, dict] = field(default_factory=dict)
    index_generation: int = 0
    log_bytes: int = 0
    damaged_log: tuple[int, str] | None = None  # (generation, why) of a log that cannot be parsed: followed up to it
    pending_parts: int | None = None  # a large change set a reader left to apply off its request path (follow)

    def apply(self, change: Change) -> None:
        self.tasks.apply(change.tasks)
        for mine, changed in ((self.retired, change.retired), (self.tenants, change.tenants)):
            for key, value in changed.items():
                if value is None:
                    mine.pop(key, None)
                else:
                    mine[key] = value


class ChangeRefused(FormatError):
    """A writer's change refused before anything was appended: the log or a shard it touches is damaged."""


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


def _change(value: dict, generation: int, where: str) -> Change:
    if value.get("generation") != generation:
        raise FormatError(f"{where}: holds generation {value.get('generation')!r}, expected {generation}")
    return Change(_objects(value, where, "tasks", True), _objects(value, where, "retired", True),
                  _objects(value, where, "tenants", True))


class ChangeLog:
    """Reads and appends a store's change log through a backend (aot.serving.store.backend). `on_read(state)`: told
    of every state read whole (aot.serving.store.mirror keeps what this host read)."""

    def __init__(self, backend, on_read: Callable[[StoreState], None] | None = None):
        self.backend = backend
        self.on_read = on_read
        self._hint_tag = None
        self._probed = 0.0

    # --- readers ----------------------------------------------------------------------------------------------------

    def read_state(self, every_shard: bool = True) -> StoreState:
        """The newest state: the newest index, then every log after it. `every_shard`: read every task entry now (a
        reader that lists them); else a shard is read when an entry of it is first asked for (a writer)."""
        for _ in range(READ_ATTEMPTS):
            state = self._read_index()
            try:
                if every_shard:
                    state.tasks.read_all()
            except StaleIndex:
                continue  # a compaction replaced the index under us: read the new one
            if self._follow(state) is None:
                continue  # a repair's index replaced the logs since this one (REREAD): read it
            if self.on_read is not None and state.pending_parts is None:
                self.on_read(state)
            return state
        raise BackendError(f"{self.backend!r}: the index kept changing while it was read ({READ_ATTEMPTS} attempts)")

    def indexes(self) -> list[int]:
        """The generations of the indexes the store holds, oldest first."""
        return sorted(g for g in map(generation_of, self.backend.list(INDEX)) if g is not None)

    def _read_index(self) -> StoreState:
        for generation in reversed(self.indexes()):
            state = self.index_state(generation)
            if state is not None:
                return state
        return StoreState()

    def index_state(self, generation: int) -> StoreState | None:
        """The state index `generation` holds (its shards read on first use); None when it is gone (compacted away
        between a listing and this read); FormatError when it does not parse."""
        data = self.backend.read(index_key(generation))
        if data is None:
            return None
        where = f"{self.backend!r} {index_key(generation)}"
        value = _parse(data, where)
        if value.get("generation") != generation:
            raise FormatError(f"{where}: holds generation {value.get('generation')!r}, expected {generation}")
        if "shards" in value:
            tasks = TaskEntries(files=_shard_files(value, where), read=self._read_shard, parse=self._parse_shard)
        else:  # format 3: every entry inline
            tasks = TaskEntries(entries=dict(_objects(value, where, "tasks", False)))
        return StoreState(generation, tasks, dict(_objects(value, where, "retired", False)),
                          dict(_objects(value, where, "tenants", False)), index_generation=generation)

    def shard_files(self, generation: int) -> dict[str, int] | None:
        """The shard files index `generation` names (shard -> generation of its file); None when it is missing."""
        data = self.backend.read(index_key(generation))
        if data is None:
            return None
        where = f"{self.backend!r} {index_key(generation)}"
        return _shard_files(_parse(data, where), where)

    def _read_shard(self, shard: str, generation: int) -> bytes:
        data = self.backend.read(shard_key(generation, shard))
        if data is None:
            raise StaleIndex(shard_key(generation, shard))
        return data

    def _parse_shard(self, shard: str, generation: int, data: bytes) -> dict[str, dict]:
        where = f"{self.backend!r} {shard_key(generation, shard)}"
        value = _parse(data, where)
        if value.get("generation") != generation or value.get("shard") != shard:
            raise FormatError(f"{where}: holds shard {value.get('shard')!r} of generation "
                              f"{value.get('generation')!r}, expected {shard!r} of {generation}")
        tasks = _objects(value, where, "tasks", False)
        strays = [name for name in tasks if shard_of(name) != shard]
        if strays:  # a lookup by name would never find them, a listing would: refused whole
            raise FormatError(f"{where}: holds {len(strays)} task(s) of other shards, e.g. {strays[0][:80]!r}")
        return dict(tasks)

    def changed(self) -> bool:
        """Cheap: whether the generation hint moved since the last call (or HINT_RECHECK seconds passed, in case a
        writer died between its log and the hint)."""
        data, self._hint_tag = self.backend.read_if_changed(GENERATION, self._hint_tag)
        now = time.monotonic()
        if data is not None or now - self._probed > HINT_RECHECK:
            self._probed = now
            return True
        return False

    def follow(self, state: StoreState, defer_parts: bool = False) -> set[str] | None:
        """Apply the logs after `state.generation` to it; the names of the tasks whose entries changed (an empty set:
        nothing new), or None when the state had to be read again whole (it fell behind the compaction).
        `defer_parts`: stop before a change set in parts (`state.pending_parts` says which): the caller applies it
        off its request path."""
        changed = self._follow(state, defer_parts)
        if changed is not None:
            return changed
        fresh = self.read_state()
        for key in ("generation", "tasks", "retired", "tenants", "index_generation", "log_bytes", "damaged_log",
                    "pending_parts"):
            setattr(state, key, getattr(fresh, key))
        return None

    def _follow(self, state: StoreState, defer_parts: bool = False) -> set[str] | None:
        changed: set[str] = set()
        start = state.generation
        state.damaged_log = state.pending_parts = None
        while True:
            generation = state.generation + 1
            data = self.backend.read(log_key(generation))
            if data is None:  # the end of the log, or (when no log followed) a reader left behind the compaction
                if state.generation == start and self._compacted_past(start):
                    return None
                return changed
            where = f"{self.backend!r} {log_key(generation)}"
            try:
                value = _parse(data, where)
                if value.get(REREAD) is True and value.get("generation") == generation:
                    return None  # a repair wrote the state as of this generation as an index: read it whole
                if "parts" in value and defer_parts:
                    state.pending_parts = generation
                    return changed
                change, size = self.read_change(value, generation, where)
            except FormatError as exc:  # what it changed is unknown: followed up to it, reported
                state.damaged_log = (generation, str(exc))
                return changed
            state.apply(change)
            state.generation = generation
            state.log_bytes += len(data) + size
            changed |= set(change.tasks)

    def check_log(self, generation: int) -> None:
        """Parse log `generation` (and its parts) as a reader would; FormatError when it does not (a missing log, or
        a repair's marker, is no error)."""
        data = self.backend.read(log_key(generation))
        where = f"{self.backend!r} {log_key(generation)}"
        if data is not None:
            value = _parse(data, where)
            if value.get(REREAD) is not True:
                self.read_change(value, generation, where)

    def read_change(self, value: dict, generation: int, where: str) -> tuple[Change, int]:
        """A log's change set, its parts read and joined (each parsed on its own); and the bytes of its parts."""
        if "parts" not in value:
            return _change(value, generation, where), 0
        whole, size = Change(), 0
        for key in part_keys(value, generation, where):
            data = self.backend.read(key)
            if data is None:
                raise FormatError(f"{where}: its part {key} is missing")
            part = _change(_parse(data, f"{self.backend!r} {key}"), generation, f"{self.backend!r} {key}")
            for section in ("tasks", "retired", "tenants"):
                getattr(whole, section).update(getattr(part, section))
            size += len(data)
        return whole, size

    def _compacted_past(self, generation: int) -> bool:
        """Whether the log after `generation` was deleted (an index newer than it exists, and so do logs after it)."""
        indexes = [g for g in map(generation_of, self.backend.list(INDEX)) if g is not None]
        return any(g > generation for g in indexes)

    # --- writers ----------------------------------------------------------------------------------------------------

    def commit(self, make: Callable[[StoreState], Change], attempts: int = 20) -> tuple[StoreState, Change]:
        """Append the change `make(state)` computes from the newest state, as the next generation; if another
        writer appended it first, read theirs and compute again. Returns the new state and the change (an empty
        change appends nothing). The state's shards are read as `make` asks for their entries."""
        state = self.read_state(every_shard=False)
        for _ in range(attempts):
            _refuse_damage(state)
            try:
                change = make(state)
            except StaleIndex:  # another writer's compaction deleted a shard this state named
                state = self.read_state(every_shard=False)
                continue
            if not change:
                return state, change
            damaged = sorted({shard_of(n) for n in change.tasks} & set(state.tasks.damaged))
            if damaged:
                raise ChangeRefused(f"{self.backend!r}: shard {damaged[0]} of the index, which this change touches, is "
                                  f"damaged ({state.tasks.damaged[damaged[0]]}); {REPAIR}")
            generation = state.generation + 1
            data, parts = self._record(generation, change)
            if self.backend.create(log_key(generation), data):
                state.apply(change)
                state.generation = generation
                state.log_bytes += len(data) + sum(parts.values())
                self.backend.write(GENERATION, f"{generation}\n".encode())
                if (generation - state.index_generation >= COMPACT_EVERY
                        or state.log_bytes >= COMPACT_LOG_BYTES):
                    try:
                        self.compact(state)
                    except StaleIndex:  # another writer compacted meanwhile (it deleted a shard read here): the
                        pass            # change is appended; the next writer compacts from the new index
                return state, change
            for key in parts:  # lost the race: its parts are named by no log
                self.backend.delete(key)
            if self._follow(state) is None:  # another writer's change first (a repair's: read its index)
                state = self.read_state(every_shard=False)
        raise BackendError(f"{self.backend!r}: could not append to the change log after {attempts} attempts "
                           "(other writers kept winning)")

    def _record(self, generation: int, change: Change) -> tuple[bytes, dict[str, int]]:
        """The log of `change` as generation `generation`; a large one's parts written first (key -> bytes)."""
        record = {"generation": generation, "time": time.time(), "tasks": change.tasks, "retired": change.retired,
                  **({"tenants": change.tenants} if change.tenants else {})}
        data = json.dumps(record, separators=(",", ":")).encode()
        if len(data) <= MAX_CHANGE_BYTES:
            return data, {}
        sections = {"tasks": change.tasks, "retired": change.retired, "tenants": change.tenants}
        parts = write_parts(self.backend, generation, split(sections, MAX_CHANGE_BYTES))
        record = {"generation": generation, "time": record["time"], "parts": list(parts)}
        return json.dumps(record, separators=(",", ":")).encode(), parts

    def compact(self, state: StoreState) -> None:
        """Write the index of `state`: the shards changed since the index it was read from, then the index naming
        them and the unchanged shards' files. Then delete what no reader needs: logs, indexes and shards older than
        the previous index (a reader at any generation since then still follows the logs)."""
        g, files = state.generation, dict(state.tasks.files)
        for shard in sorted(state.tasks.dirty):
            entries = state.tasks.shard(shard)
            files.pop(shard, None)
            if entries:
                record = {"generation": g, "shard": shard, "tasks": entries}
                self.backend.create(shard_key(g, shard), json.dumps(record, separators=(",", ":")).encode())
                files[shard] = g
        head = {"generation": g, "shards": dict(sorted(files.items())), "retired": state.retired,
                "tenants": state.tenants}
        self.backend.create(index_key(g), json.dumps(head, separators=(",", ":")).encode())
        state.tasks.indexed(files)
        state.index_generation, state.log_bytes = g, 0
        indexes = sorted(i for i in map(generation_of, self.backend.list(INDEX)) if i is not None)
        older = [i for i in indexes if i < g]
        if not older:
            return
        keep_from = older[-1]
        kept_shards = {shard_key(gen, shard) for shard, gen in files.items()}
        previous = self.shard_files(keep_from)
        if previous is None:  # another writer compacted past it meanwhile: its own clean-up deletes the rest
            return
        kept_shards |= {shard_key(gen, shard) for shard, gen in previous.items()}
        for i in older[:-1]:
            self.backend.delete(index_key(i))
        for key in [*self.backend.list(LOG), *self.backend.list(PARTS)]:
            i = generation_of(key) if key.startswith(LOG) else part_generation(key)
            if i is not None and i <= keep_from:
                self.backend.delete(key)
        for key in list(self.backend.list(SHARDS)):
            parsed = parse_shard_key(key)
            if parsed is not None and parsed[0] <= keep_from and key not in kept_shards:
                self.backend.delete(key)


def _refuse_damage(state: StoreState) -> None:
    """A writer appends nothing after a log it cannot read: what that log changed is unknown."""
    if state.damaged_log is not None:
        generation, why = state.damaged_log
        raise ChangeRefused(f"the task store's change log is damaged at generation {generation} ({why}); {REPAIR}")


def _shard_files(value: dict, where: str) -> dict[str, int]:
    """An index's "shards": shard -> the generation of the file holding it."""
    files = value.get("shards", {})
    if not isinstance(files, dict) or not all(
            isinstance(s, str) and len(s) == 2 and isinstance(g, int) and not isinstance(g, bool) and 0 < g
            for s, g in files.items()):
        raise FormatError(f"{where}: 'shards' must be an object of two hex digits -> generation")
    return files
