"""Writing the task store (format `aot-task-store` v5; aot.serving.store.reader reads it, docs/formats.md).

Publishing versions: each is written into `.staging/<pid>.<host>-<name>@<id>/` and fsynced (no lock held); then, under
an exclusive lock on `tasks/.lock`, they are renamed into place and ONE change set of the index names them all
(aot.serving.store.log: readers see every version of a batch at once, or none of it), retiring the versions they
replace; then garbage is collected. Everything that reads or changes the set of folders happens under that lock, so two
exports at once never delete each other's folders (and the change log's exclusive create keeps two writers' changes
apart even without it).

A retired version stays on disk for RETIRED_GRACE seconds: a request that the first served step pinned to it a
moment before the re-export is still served by it. Garbage: retired versions past their grace (dropped from the
index in the next change set), folders the index does not know (at compactions: finding them lists the store), and
the `.staging/` debris of writers that died (a live writer's folder is left alone; one of another host is left for an
hour; `.tmp-*` folders in the store's own folder are debris of writers from before `.staging/`, swept at compactions).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aot.serving.formats import FormatError, read_json
from aot.serving.store.atomic import fsync_dir, fsync_trees, pid_alive, plain_permissions, write_atomic
from aot.serving.store.compatibility import check_same_labels, current_version, dev_note
from aot.serving.store.digests import DigestError, folder_digests, verify_file
from aot.serving.store.entry_history import expired, held_versions, retire_all, with_history
from aot.serving.store.layout import (
    EMBEDDINGS,
    LEGACY_STAGING_PREFIX,
    LOCK,
    STAGING,
    STORE_FILE,
    TASK_JSON,
    V1_MANIFEST,
)
from aot.serving.store.log import Change, ChangeRefused, StoreState
from aot.serving.store.reader import (
    STORAGES,
    STORE_FORMAT,
    STORE_VERSION,
    StoreError,
    StoreReader,
    TaskEntry,
    check_task_name,
    folder_name,
    parse_entry,
    task_of,
    version_of_folder,
)
from aot.serving.store.shards import StaleIndex
from aot.serving.store.table_blocks import write_table_blocks
from aot.serving.store.tenants import tenant_of

UPLOADS_AT_ONCE = 8  # objects a publisher uploads in parallel to a remote store
FOREIGN_DEBRIS_AGE = 3600.0  # seconds before another host's unfinished export folder counts as debris
# this host, in the names of export folders (pids are per host: a fleet's exports share one volume)
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# Loads a version's folder (folder, version, store root, digests) as a server does; raises OSError or ValueError when
# it cannot serve. The served loader (aot.serving.tasks) imports the store, so its callers hand it in.
VersionCheck = Callable[[Path, str, Path, "dict[str, str] | None"], None]
META_KEYS = ("labels", "metric", "dev", "served_dev", "max_length", "pooling", "has_pair", "kind")  # of task.json


@dataclass(frozen=True)
class Publication:
    """One finished version folder (from new_version_folder) to publish as task `name`."""

    name: str
    folder: Path
    storage: str
    keep: int | None = None  # versions of the task to keep, this one included (None: the task's policy, else
    # aot.serving.store.reader.DEFAULT_KEEP)
    allow_label_change: bool = False  # replace a current version of other labels, kind or pair-ness (compatibility)


def index_meta(folder: Path) -> dict:
    """What the index keeps of a version's task.json: what `aot tasks` lists, so no reader opens the version for it."""
    meta = read_json(folder / TASK_JSON)
    out = {k: meta[k] for k in META_KEYS if k in meta}
    out["method"] = meta.get("method", {}).get("method")
    return out


class TaskStore(StoreReader):
    """Reads and writes a task store (the repository's folder, or object storage: StoreReader)."""

    REMOTE_TIMEOUT = 120.0  # a publisher uploads whole tables
    MIRROR = False  # a writer keeps no copy of the index (aot.serving.store.mirror: for servers)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def create(self, backbone: dict, embeddings: np.ndarray) -> None:
        """A new, empty store for a backbone (keeps an existing one whose backbone is the same; a v1 store is
        upgraded: its tasks become the first change of the index). The embeddings stay in the local folder."""
        with self.locked():
            if self.remote:
                write_atomic(self.root / EMBEDDINGS, _npy_bytes(embeddings.astype(np.float32)))
                if not self.backend.create(STORE_FILE, self._identity_bytes(backbone)):
                    current = self.identity()
                    if current["backbone"].get("fingerprint") != backbone["fingerprint"]:
                        raise StoreError(f"{self.location} holds tasks for backbone "
                                         f"{current['backbone'].get('fingerprint')}, not {backbone['fingerprint']}")
                return
            if (self.root / STORE_FILE).exists() or (self.root / V1_MANIFEST).exists():
                current = self._identity_or_v1()
                if current["backbone"].get("fingerprint") != backbone["fingerprint"]:
                    raise StoreError(f"{self.root} holds tasks for backbone {current['backbone'].get('fingerprint')}, "
                                     f"not {backbone['fingerprint']}")
                if (self.root / V1_MANIFEST).exists():
                    self._upgrade_v1(current)
                return
            write_atomic(self.root / EMBEDDINGS, _npy_bytes(embeddings.astype(np.float32)))
            self._write_identity(backbone)

    def _identity_or_v1(self) -> dict:
        if (self.root / STORE_FILE).exists():
            return self.identity()
        try:
            data = read_json(self.root / V1_MANIFEST)
        except FormatError as exc:
            raise StoreError(f"cannot upgrade the v1 task store: {exc}") from None
        if not isinstance(data.get("backbone"), dict) or not isinstance(data.get("tasks"), dict):
            raise StoreError(f"{self.root / V1_MANIFEST}: not a task store manifest (no 'backbone' or 'tasks')")
        return data

    @staticmethod
    def _identity_bytes(backbone: dict) -> bytes:
        return (json.dumps({"format": STORE_FORMAT, "format_version": STORE_VERSION, "backbone": backbone},
                           indent=2) + "\n").encode()

    def _write_identity(self, backbone: dict) -> None:
        write_atomic(self.root / STORE_FILE, self._identity_bytes(backbone))

    def _upgrade_v1(self, manifest: dict) -> None:
        """Under the lock: the v1 manifest's tasks and retired versions become the index's first change; meta is
        read from each version's task.json once, here."""
        tasks = {}
        for name, entry in manifest["tasks"].items():
            raw = dict(entry) if isinstance(entry, dict) else entry
            if isinstance(raw, dict) and isinstance(raw.get("folder"), str):
                with contextlib.suppress(FormatError, OSError, StoreError, ValueError):
                    raw["meta"] = index_meta(self.version_folder(raw["folder"]))
            tasks[name] = raw
        retired = {v: {"time": t, **({"digests": manifest.get("retired_digests", {})[v]}
                                     if v in manifest.get("retired_digests", {}) else {})}
                   for v, t in manifest.get("retired", {}).items() if isinstance(t, (int, float))}
        self.log.commit(lambda state: Change(tasks=tasks, retired=retired) if state.generation == 0 else Change())
        self._write_identity(manifest["backbone"])
        (self.root / V1_MANIFEST).unlink()
        fsync_dir(self.root)

    @property
    def staging(self) -> Path:
        return self.root / STAGING

    def new_version_folder(self, name: str) -> Path:
        """An empty folder to write a task version into (not yet visible to readers)."""
        check_task_name(name)
        folder = self.staging / f"{os.getpid()}.{HOST}-{folder_name(name)}@{uuid.uuid4().hex[:12]}"
        folder.mkdir(parents=True)
        return folder

    @staticmethod
    def version_name(folder: Path) -> str:
        """The version a folder from new_version_folder becomes: `<pid>.<host>-<name>@<id>` -> `<name>@<id>` (a
        tenant's `T~TASK@<id>` -> `T/TASK@<id>`)."""
        return version_of_folder(folder.name.split("-", 1)[1])

    def commit(self, make) -> StoreState:
        """Under the store's lock: append the change `make(state)` computes from the newest state (a StoreError it
        raises refuses the change: nothing is written), then remove the folders nothing may read any more."""
        with self.locked():
            self.upgrade_identity()
            state, committed = self.log.commit(make)
            self._collect(state, committed)
        return state

    def upgrade_identity(self) -> None:
        """Under the lock, before a change: an older store becomes the current format (what this writer's changes may
        hold: tenants, kept versions, routes, sharded indexes; older servers then refuse the store instead of
        misreading it)."""
        identity = self.identity()
        if identity["format_version"] != STORE_VERSION:
            self.backend.write(STORE_FILE, self._identity_bytes(identity["backbone"]))

    def check_tenants(self, names, state: StoreState) -> None:
        """Refuse task names `TENANT/TASK` whose tenant the store does not hold."""
        tenants = state.tenants
        for tenant in sorted({tenant_of(n) for n in names} - {None} - set(tenants)):
            raise StoreError(f"no tenant {tenant!r} in the task store {self.location}: create it first (aot export "
                             f"tenant create {tenant} --repo REPO)")

    def publish(self, name: str, folder: Path, storage: str) -> TaskEntry:
        """Rename a finished version folder into place and point the index at it, atomically."""
        return self.publish_many([Publication(name, folder, storage)])[0]

    def publish_many(self, publications: list[Publication], notes: dict[str, str] | None = None) -> list[TaskEntry]:
        """Publish finished version folders in one change of the index: readers see all of them, or none. A version
        that changes its task's labels, kind or pair-ness is refused unless its publication allows it, and the whole
        change with it (aot.serving.store.compatibility); `notes` gets what is said of the others, by task (a lower
        dev score)."""
        names = [p.name for p in publications]
        if len(set(names)) != len(names):
            repeated = sorted({n for n in names if names.count(n) > 1})
            raise StoreError(f"a batch publishes each task once; repeated: {repeated}")
        for p in publications:
            if p.keep is not None and p.keep < 1:
                raise StoreError(f"keep {p.keep} for task {p.name!r}: expected a positive number of versions")
        entries, keeps = {}, {p.name: p.keep for p in publications}
        allowed = {p.name: p.allow_label_change for p in publications}
        for p in publications:
            if p.storage not in STORAGES:
                raise StoreError(f"unknown storage {p.storage!r}: expected one of {', '.join(STORAGES)}")
            write_table_blocks(p.folder)  # a fused table's block digests: its rows read without hashing it whole
            plain_permissions(p.folder)  # safetensors writes 0600: a server running as another user could not read it
            entries[p.name] = {"folder": self.version_name(p.folder), "storage": p.storage,
                               "digests": folder_digests(p.folder), "meta": index_meta(p.folder),
                               "time": time.time()}  # since when it is the current version
        if not self.remote:  # a remote store's folders are uploaded, then deleted
            fsync_trees([p.folder for p in publications])
        with self.locked():
            self.upgrade_identity()
            if self.remote:  # the version's objects first, the change that names them last
                uploads = [(p.folder / file, f"{folder_name(self.version_name(p.folder))}/{file}")
                           for p in publications for file in sorted(entries[p.name]["digests"])]
                pool = ThreadPoolExecutor(UPLOADS_AT_ONCE)  # a batch's many small objects: latency-bound
                try:
                    list(pool.map(lambda upload: self.backend.upload(*upload), uploads))
                finally:  # the first failure (or Ctrl-C) ends the publish: the queued uploads are not sent
                    pool.shutdown(wait=True, cancel_futures=True)
            else:
                for p in publications:
                    p.folder.rename(self.root / folder_name(self.version_name(p.folder)))
                fsync_dir(self.root)

            def change(state: StoreState) -> Change:
                # TaskExporter.check refused a missing tenant before anything was written; a tenant deleted since
                # refuses the change here, and the folders renamed or uploaded for it are removed
                self.check_tenants(entries, state)
                tasks, retired, said = {}, {}, {}
                for name, entry in entries.items():
                    old = state.tasks.get(name)
                    current, new = current_version(old), (entry["folder"], entry["meta"])
                    check_same_labels(name, current, new, allowed[name], "publishing")
                    said[name] = dev_note(name, current, new)
                    tasks[name], gone = with_history(entry, old, keeps[name])
                    retired.update(gone)
                if notes is not None:
                    notes.clear()
                    notes.update({name: note for name, note in said.items() if note})
                return Change(tasks=tasks, retired={**retired, **expired(state)})

            try:
                state, committed = self.log.commit(change)
            except (StoreError, ChangeRefused):  # refused before the append (a damaged shard, a tenant deleted
                # meanwhile): nothing left behind
                for p in publications:
                    version = folder_name(self.version_name(p.folder))
                    if self.remote:
                        self.backend.delete_folder(version)
                    shutil.rmtree(p.folder if self.remote else self.root / version, ignore_errors=True)
                raise
            if self.remote:
                for p in publications:
                    shutil.rmtree(p.folder, ignore_errors=True)
            self._collect(state, committed)
        return [parse_entry(name, entry, "publish") for name, entry in entries.items()]

    def remove(self, name: str) -> TaskEntry:
        """Take a task out of the index (its version stays RETIRED_GRACE seconds for pinned requests)."""
        removed: list[TaskEntry] = []

        def change(state: StoreState) -> Change:
            if name not in state.tasks:
                known = sorted(state.tasks)
                listed = ", ".join(known[:10]) + (f", ... ({len(known) - 10} more)" if len(known) > 10 else "")
                raise StoreError(f"unknown task {name!r}; known tasks: {listed or '(none)'}")
            removed[:] = [parse_entry(name, state.tasks[name], "the store's index")]
            return Change(tasks={name: None}, retired={**retire_all(state.tasks[name]), **expired(state)})

        self.commit(change)
        return removed[0]

    def clean(self, sweep: bool = False) -> list[str]:
        """Remove the staging folders of writers that died (a killed `aot export task` leaves one, up to the size of
        a fused table); a live writer's folder is left alone. `sweep`, in object storage: also the versions no change
        names (a killed publisher's uploads) older than FOREIGN_DEBRIS_AGE (a listing of the whole store). Returns
        the names removed."""
        with self.locked():
            removed = self._remove_debris(everywhere=True)
            if sweep and self.remote:
                removed += self._sweep(self.log.read_state(), set())
        return sorted(removed)

    def _remove_debris(self, everywhere: bool) -> list[str]:
        """Under the lock: the staging folders of dead writers; `everywhere`: also `.tmp-*` folders in the store's
        folder (writers from before `.staging/`), which lists the store."""
        candidates = list(self.staging.iterdir()) if self.staging.is_dir() else []
        if everywhere:
            candidates += [p for p in self.root.iterdir() if p.name.startswith(LEGACY_STAGING_PREFIX)]
        removed = []
        for path in candidates:
            if path.is_dir() and not _writer_alive(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed

    def verify(self, check: VersionCheck | None = None) -> dict[str, str | None]:
        """Check every current task version offline: each file against the digest the index publishes, and with
        `check`, the whole version loadable as the server loads it (aot.exporter.version_check.loads_as_served: the
        served loader imports the store, so the store is handed it). Task name -> what is wrong (None: sound); what
        of the index itself cannot be read (damaged shards, a damaged log: aot export repair) under the names
        `<index>`, `<index> 2`, ..."""
        index = self.index()
        found: dict[str, str | None] = {f"<index>{f' {i + 1}' if i else ''}": f"{damage}; run `aot export repair`"
                                        for i, damage in enumerate(index.damage())}
        found.update(index.errors)
        for name, entry in sorted(index.entries.items()):
            try:
                folder = self.version_folder(entry.folder, entry.digests)  # a remote one fetched and checked
                if entry.digests is None:
                    raise DigestError(f"{entry.folder}: published without digests (exported by an older aot): "
                                      "re-export it to have it verified")
                on_disk = {p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}
                if on_disk != set(entry.digests):
                    raise DigestError(f"{entry.folder}: files {sorted(on_disk)} differ from the published "
                                      f"{sorted(entry.digests)}")
                for file in sorted(entry.digests):
                    verify_file(folder / file, entry.digests, entry.folder)
                if check is not None:
                    check(folder, entry.folder, self.root, entry.digests)
                found[name] = None
            except (OSError, ValueError) as exc:
                found[name] = str(exc).replace(str(self.root) + "/", "")
        return found

    def _sweep(self, state: StoreState, skip: set[str]) -> list[str]:
        """In object storage: delete the version folders `state` does not name, last written more than
        FOREIGN_DEBRIS_AGE ago (a killed publisher's uploads; a publisher elsewhere may be uploading one now, to name
        it in its next change). It lists the store: run at compactions and by clean(), never per publish."""
        keep, now, removed = _kept_folders(state) | skip, time.time(), []
        for name, modified in self.backend.folders(skip=keep).items():
            if "@" in name and now - modified > FOREIGN_DEBRIS_AGE:
                self.backend.delete_folder(name)
                removed.append(name)
        return removed

    def _collect(self, state: StoreState, change: Change) -> None:
        """Under the lock, after a change: remove the version folders the change dropped (a publish costs what it
        changed, not the store's size) and the temporary folders of dead writers; at every compaction, also every
        version folder no entry names (a killed publisher's). In object storage that sweep spares what was written
        less than FOREIGN_DEBRIS_AGE ago: a publisher elsewhere may be uploading one now, to name it in its next
        change."""
        gone = sorted(v for v, info in change.retired.items() if info is None and not _names(state, v))
        # a damaged shard's names are unknown: no folder is known to be unnamed until `aot export repair`
        compaction = bool(change) and state.index_generation == state.generation and not state.tasks.damaged
        self._remove_debris(everywhere=compaction)
        if self.remote:
            for version in gone:
                self.backend.delete_folder(folder_name(version))
            if compaction:
                self._sweep(state, {folder_name(v) for v in gone})
            return
        for version in gone:
            shutil.rmtree(self.root / folder_name(version), ignore_errors=True)
        if compaction:
            keep = _kept_folders(state)
            for path in self.root.iterdir():  # by name first: a stat of every version would cost the store's size
                if "@" in path.name and not path.name.startswith(".") and path.name not in keep and path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)


def _names(state: StoreState, version: str) -> bool:
    """Whether the state still names a version (current, kept or retired): its folder must stay (and may, when the
    shard naming it was compacted away meanwhile: the next compaction's sweep decides)."""
    try:
        entry = state.tasks.get(task_of(version))
    except StaleIndex:
        return True
    return version in state.retired or (isinstance(entry, dict) and version in held_versions(entry))


def _kept_folders(state: StoreState) -> set[str]:
    """The version folders the state names: current, kept and retired versions."""
    keep = {folder_name(v) for e in state.tasks.values() if isinstance(e, dict) for v in held_versions(e)}
    return keep | {folder_name(v) for v in state.retired}


def _writer_alive(debris: Path) -> bool:
    """`.staging/<pid>.<host>-<version>`: is the process that writes it still running? A writer on another host (the
    store is a shared volume of a fleet) cannot be asked: its folder counts as alive until it is FOREIGN_DEBRIS_AGE
    seconds old. (`.tmp-<pid>.<host>-<version>` and `.tmp-<pid>-<version>` in the store's folder: writers from before
    `.staging/`, and from before hosts were recorded.)"""
    try:
        legacy = debris.name.startswith(LEGACY_STAGING_PREFIX)
        writer = debris.name.split("-", 2)[1] if legacy else debris.name.split("-", 1)[0]
        pid, _, host = writer.partition(".")
        if host and host != HOST:
            return time.time() - debris.stat().st_mtime < FOREIGN_DEBRIS_AGE
        return pid_alive(int(pid))
    except (IndexError, ValueError, OSError):
        return False


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


__all__ = ["STAGING", "STORAGES", "Publication", "StoreError", "StoreState", "TaskEntry", "TaskStore", "VersionCheck",
           "check_task_name"]
