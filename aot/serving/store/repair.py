"""`aot export repair`: a task store's index rebuilt from what still reads, after a shard, a log or an index object was
damaged (truncated by a full disk, overwritten, deleted by hand).

What is read (the store's lock held; publishers elsewhere on an object store must be stopped meanwhile):
- the newest index that parses (an older one, and the logs after it, when the newest does not), and its shards;
- every log after it that parses, in order (with their parts); one that does not is skipped;
- when a shard or a log could not be read, the version folders of the store: a task whose name the index cannot tell
  (it falls in a damaged shard, and no readable change named it) or that a skipped log may have published (no entry
  names it) gets an entry for its newest folder (by modification time), its files hashed and the whole version
  loaded as a server loads it. What such an entry had besides its current version (kept versions, a route, its
  retention) is gone; a task a skipped log removed or re-routed is not known to be.

What is written: the state so rebuilt as a new index at the next generation G (its shards, the damaged ones anew),
then log G, a marker that tells every reader to read index G whole (aot.serving.store.log, REREAD); then the damaged
objects are deleted. A reader that stopped before a damaged log, and one that applied it before it was damaged, both
end at index G: every server holds the same index again.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from aot.serving.formats import FormatError
from aot.serving.store.digests import folder_digests
from aot.serving.store.layout import GENERATION, LOG, TASK_JSON
from aot.serving.store.log import (
    REREAD,
    Change,
    ChangeLog,
    StoreState,
    generation_of,
    index_key,
    log_key,
)
from aot.serving.store.lost_changes import lost_log
from aot.serving.store.reader import StoreError, check_version, folder_name, task_of, version_of_folder
from aot.serving.store.shards import DamagedShard, shard_key
from aot.serving.store.writer import TaskStore, VersionCheck, index_meta


@dataclass
class RepairReport:
    """What a repair found and did (or, with dry_run, would do)."""

    generation: int = 0  # the index it wrote (0: nothing written)
    tasks: int = 0  # entries in it
    damaged_shards: list[str] = field(default_factory=list)
    damaged_logs: list[int] = field(default_factory=list)
    damaged_indexes: list[int] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)  # versions given an entry from their folders
    unrecoverable: dict[str, str] = field(default_factory=dict)  # version -> why its folder cannot serve
    discarded: list[str] = field(default_factory=list)  # what it loses, in words (aot.serving.store.lost_changes)

    @property
    def damaged(self) -> bool:
        return bool(self.damaged_shards or self.damaged_logs or self.damaged_indexes)

    def summary(self) -> dict:
        return {"generation": self.generation, "tasks": self.tasks, "damaged_shards": self.damaged_shards,
                "damaged_logs": self.damaged_logs, "damaged_indexes": self.damaged_indexes,
                "recovered": self.recovered, "unrecoverable": self.unrecoverable, "discarded": self.discarded}


def repair_store(store: TaskStore, check: VersionCheck, dry_run: bool = False) -> RepairReport:
    """Rebuild `store`'s index from what still reads (module docstring); `check` loads a version folder as a server
    does before it gets an entry (aot.exporter.version_check.loads_as_served); `dry_run`: only say what it would do.
    A store that reads whole is left as it is."""
    with store.locked():
        log = ChangeLog(store.backend)
        found = RepairReport()
        state, last = _tolerant_state(log, found)
        found.damaged_shards = sorted(state.tasks.damaged)
        found.discarded += [f"shard {shard} of the index does not parse ({why}): the tasks in it that no later change "
                            "names lose their kept versions, route and retention" for shard, why in
                            sorted(state.tasks.damaged.items())]
        if not found.damaged:
            found.tasks = len(state.tasks)
            return found
        entries = _recover(store, state, found, check)
        found.tasks = len(state.tasks) + len([n for n in entries if n not in state.tasks])
        if dry_run:
            return found
        found.generation = _write(log, state, entries, last, found)
    return found


def _tolerant_state(log: ChangeLog, found: RepairReport) -> tuple[StoreState, int]:
    """The newest index that parses, its shards (the damaged ones recorded), every log after it that parses; and
    the newest generation any log or index holds."""
    state = None
    for generation in reversed(log.indexes()):
        try:
            state = log.index_state(generation)
        except FormatError as exc:
            found.damaged_indexes.append(generation)
            found.discarded.append(f"index {generation} does not parse ({exc}): read from an older index and the logs "
                                   "after it instead")
            continue
        if state is not None:
            break
    state = state or StoreState()
    state.tasks.read_all()
    logs = sorted(g for g in map(generation_of, log.backend.list(LOG)) if g is not None)
    last = max([state.generation, *logs, *found.damaged_indexes])
    for generation in (g for g in logs if g > state.generation):
        data = log.backend.read(log_key(generation))
        try:
            value = json.loads(data) if data is not None else None
            if not isinstance(value, dict) or value.get(REREAD) is True:
                raise FormatError(f"{log_key(generation)}: not a change set")
            change, _ = log.read_change(value, generation, log_key(generation))
        except (FormatError, ValueError) as exc:
            found.damaged_logs.append(generation)
            found.discarded.append(lost_log(generation, data, _why(exc), partial(_entry_before, state)))
            continue
        state.apply(change)
    return state, last


def _recover(store: TaskStore, state: StoreState, found: RepairReport, check: VersionCheck) -> dict[str, dict]:
    """Entries for the tasks the state cannot tell, from their newest version folders (module docstring)."""
    newest: dict[str, tuple[float, str]] = {}
    for folder, modified in _folders(store).items():
        try:
            version = check_version(version_of_folder(folder))
        except StoreError:
            continue
        name = task_of(version)
        if version in state.retired:
            continue
        try:
            state.tasks[name]
            continue  # an entry that reads: kept as it is
        except DamagedShard:
            pass  # in a damaged shard, and no change since named it: unknown
        except KeyError:
            if not found.damaged_logs:
                continue  # absent for sure: nothing unread could have published it
        if name not in newest or modified > newest[name][0]:
            newest[name] = (modified, version)
    entries = {}
    for name, (_, version) in sorted(newest.items()):
        try:
            entries[name] = _entry_of(store, version, check)
            found.recovered.append(version)
            found.discarded.append(f"{name}: given an entry for its newest folder, {version}: what its entry held "
                                   "besides (kept versions, a route, its retention) is gone")
        except (OSError, ValueError) as exc:
            found.unrecoverable[version] = str(exc).replace(str(store.root) + "/", "")
    return entries


def _why(exc: Exception) -> str:
    """A parse error, short: JSON's own message without the document's position noise."""
    text = str(exc)
    return "truncated or not JSON" if isinstance(exc, json.JSONDecodeError) else text[:200]


def _entry_before(state: StoreState, name: str):
    """A task's entry in `state` (None: none), or ... when it is in a damaged shard (unknown)."""
    try:
        return state.tasks.get(name)
    except DamagedShard:
        return ...


def _folders(store: TaskStore) -> dict[str, float]:
    """The store's version folders -> when they were last modified."""
    if store.remote:
        return store.backend.folders()
    return {p.name: p.stat().st_mtime for p in store.root.iterdir()
            if "@" in p.name and not p.name.startswith(".") and p.is_dir()}


def _entry_of(store: TaskStore, version: str, check: VersionCheck) -> dict:
    """An index entry for a version folder: its files hashed now, the version loaded as a server loads it."""
    with tempfile.TemporaryDirectory(prefix="aot-repair-") as scratch:
        folder = store.root / folder_name(version)
        if store.remote:  # a copy here, to hash and load
            folder = Path(scratch) / folder_name(version)
            folder.mkdir()
            for key in store.backend.list(folder_name(version)):
                store.backend.download(key, folder / key.rsplit("/", 1)[1])
        digests = folder_digests(folder)
        storage = json.loads((folder / TASK_JSON).read_text()).get("storage")
        check(folder, version, store.root, digests)
        return {"folder": version, "storage": storage, "digests": digests, "meta": index_meta(folder)}


def _write(log: ChangeLog, state: StoreState, entries: dict[str, dict], last: int, found: RepairReport) -> int:
    """The rebuilt state as index G, then the marker log G, then the damaged objects deleted; G."""
    generation = last + 1
    damaged_files = {shard: state.tasks.files[shard] for shard in state.tasks.damaged if shard in state.tasks.files}
    state.tasks.damaged.clear()  # rewritten whole from what is known of them now
    state.tasks.dirty |= set(damaged_files)
    state.apply(Change(tasks=entries))
    state.generation = generation
    log.compact(state)
    marker = json.dumps({"generation": generation, "time": time.time(), REREAD: True}).encode()
    if not log.backend.create(log_key(generation), marker):
        raise StoreError(f"another writer appended generation {generation} during the repair: run it again with "
                         "no publisher running")
    log.backend.write(GENERATION, f"{generation}\n".encode())
    for shard, file_generation in damaged_files.items():
        log.backend.delete(shard_key(file_generation, shard))
    for g in found.damaged_logs:
        log.backend.delete(log_key(g))
    for g in found.damaged_indexes:
        log.backend.delete(index_key(g))
    return generation
