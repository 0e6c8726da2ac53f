"""The task versions of a store as one served step sees them: names resolved through the last good manifest,
versions loaded on demand and kept while they may still serve, damage found and reported, and a batch's rows
through the step's task pool (serving.pool) or from each version's storage (serving.tasks)."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from serving import protocol
from serving.digests import DigestError, verify_file
from serving.errors import RequestError
from serving.pool import RowPool
from serving.store import RETIRED_GRACE, Manifest, StoreError, StoreReader, check_version, task_of
from serving.tasks import PARTS, ServedTask, load_task_version

KNOWN_IN_MESSAGE = 10  # task names an unknown task's 404 suggests


class TaskRegistry:
    """The tasks of a store as one served step sees them.

    Names resolve through the last good manifest (re-read when it changes: a stat per batch, no restart); a manifest
    that cannot be read is reported (`on_manifest_error`) and the last good one stays in use. Versions load on
    demand and stay while the manifest names them or they served a request in the last `grace` seconds, so a
    request pinned to a version by the first step is served by that version even after a re-export.
    A version that fails to load is kept as its error: its requests fail with that message, the others serve.
    """

    def __init__(self, store_root: str | Path, parts: str = "all", grace: float = 120.0,
                 on_manifest_error: Callable[[str], None] | None = None, pool: RowPool | None = None,
                 on_task_error: Callable[[str, str], None] | None = None, pool_fused: bool = True):
        """`pool`: keep the rows of the current versions in this pool (serving.pool); versions that leave the
        manifest are detached from it at once (a request still pinned to one reads its storage directly).
        `pool_fused` False: only factored versions' rows go in the pool, fused tables are read through their memory
        maps (a step of several instances on CPU: the page cache shares one copy of each table between them, where
        each instance's pool, holding its share of the budget, would hold a copy of its own).
        `on_task_error(version, message)`: a version failed to load or was found damaged (log it, count it)."""
        self.store = StoreReader(store_root)
        self.pool, self.pool_fused = pool, pool_fused
        if parts not in PARTS:
            raise ValueError(f"parts={parts!r}: expected one of {', '.join(PARTS)}")
        self.parts, self.grace = parts, grace
        self.on_manifest_error = on_manifest_error
        self.on_task_error = on_task_error
        self.manifest_error: str | None = None
        self._stamp = None
        self._manifest = Manifest({}, {})
        self._current: set[str] = set()
        self._entries: dict = {}
        self._entry_errors: dict[str, str] = {}
        self._audit: dict[str, tuple[tuple, str | None]] = {}  # version -> (files' stamps, damage found by audit())
        self._versions: dict[str, ServedTask | StoreError] = {}
        self._last_used: dict[str, float] = {}
        self._lock = threading.RLock()
        self.refresh()

    def refresh(self) -> None:
        stamp = self.store.manifest_stamp()
        if stamp == self._stamp:
            return
        with self._lock:
            try:
                manifest = self.store.manifest()
            except StoreError as exc:
                self._stamp = stamp
                self.manifest_error = str(exc)
                if self.on_manifest_error is not None:
                    self.on_manifest_error(self.manifest_error)
                return
            self._entries, self._entry_errors, self._stamp = manifest.entries, manifest.errors, stamp
            self._manifest = manifest
            self._current = {e.folder for e in self._entries.values()}
            self.manifest_error = None
            current = {e.folder for e in self._entries.values()}
            now = time.monotonic()
            for version in list(self._versions):
                if version in current:
                    continue
                if self.pool is not None:
                    self.pool.detach(version)
                if now - self._last_used.get(version, 0.0) > self.grace:
                    del self._versions[version]
                    self._last_used.pop(version, None)
            for version in current - set(self._versions):
                self._load(version)
            if self.pool is not None:
                for version in current:
                    task = self._versions.get(version)
                    if isinstance(task, ServedTask) and (self.pool_fused or task.storage != "fused"):
                        self.pool.attach(version, task.rows)

    def check(self) -> dict[str, str]:
        """Load every current version whole (table or factors, head) without keeping it: task name -> why its
        requests will fail. What `aot serve` reports at start-up, in constant memory whatever the task count."""
        errors = dict(self._entry_errors)
        for name, entry in self._entries.items():
            loaded = self._load(entry.folder, "all", keep=False)
            if isinstance(loaded, StoreError):
                errors[name] = str(loaded)
        return errors

    def _load(self, version: str, parts: str | None = None, keep: bool = True) -> ServedTask | StoreError:
        try:
            task: ServedTask | StoreError = load_task_version(self.store.version_folder(version), version,
                                                              self.store.root, parts or self.parts,
                                                              self._manifest.digests(version))
        except Exception as exc:  # noqa: BLE001 - a corrupt task must not take the others down
            task = self._damaged(version, exc)
        if keep:
            self._versions[version] = task
        return task

    def _damaged(self, version: str, exc: BaseException) -> StoreError:
        detail = str(exc).replace(str(self.store.root) + "/", "")
        error = StoreError(f"task {task_of(version)!r} ({version}) is corrupt: {type(exc).__name__}: {detail}")
        if self.on_task_error is not None:
            self.on_task_error(version, str(error))
        return error

    def known(self, version: str) -> bool:
        """A version the manifest names as current, or retired less than RETIRED_GRACE ago (a request may be pinned
        to it): after that it is gone, even before the next export deletes its folder."""
        if version in self._current:
            return True
        retired = self._manifest.retired.get(version)
        return retired is not None and time.time() - retired < RETIRED_GRACE

    def audit(self) -> dict[str, str]:
        """Check every current version's task.json against its digest, and any of its files once it changes on disk
        (stats otherwise; the other files are checked by the steps that load them): the task_list step runs it in
        the background, so `aot tasks` names a task damaged under the server before a request meets it. Returns
        task name -> damage."""
        found = {}
        for name, entry in list(self._entries.items()):
            folder = self.store.version_folder(entry.folder)
            try:
                stamps = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()))
            except OSError as exc:
                stamps = (str(exc),)
            seen = self._audit.get(entry.folder)
            if seen is None or seen[0] != stamps:
                # First sighting: task.json only, what this step reads. The head, factors and table are hashed by
                # the steps that load them (the fused step, or the head and backbone steps, when they load or first
                # map them); hashing them here too read every head twice at each start, gigabytes with many tasks
                # (docs/benchmarks.md section 6, "Figures behind the serving code"). Any file that changes
                # afterwards is hashed again here, whichever it is.
                changed = set(entry.digests or ()) if seen is not None else {"task.json"} & set(entry.digests or ())
                damage = None
                try:
                    for file in sorted(changed):
                        verify_file(folder / file, entry.digests, entry.folder)
                except (DigestError, OSError) as exc:
                    damage = f"task {name!r} ({entry.folder}) is corrupt: {exc}"
                seen = (stamps, damage)
                self._audit[entry.folder] = seen
            if seen[1]:
                found[name] = seen[1]
        return found

    def names(self) -> list[str]:
        """Every task the manifest names, loadable or not."""
        return sorted(set(self._entries) | set(self._entry_errors))

    def errors(self) -> dict[str, str]:
        """Task name -> why its requests fail (a bad manifest entry, a version that does not load, or a file that
        audit() found damaged)."""
        errors = dict(self._entry_errors)
        for name, entry in self._entries.items():
            loaded = self._versions.get(entry.folder)
            if isinstance(loaded, StoreError):
                errors[name] = str(loaded)
            elif entry.folder in self._audit and self._audit[entry.folder][1]:
                errors[name] = self._audit[entry.folder][1]
        return errors

    def served(self) -> dict[str, ServedTask]:
        """The tasks that serve now, by name."""
        return {n: t for n, e in self._entries.items() if isinstance(t := self._versions.get(e.folder), ServedTask)}

    def resolve(self, name: str) -> ServedTask:
        """The current version of task `name`, or exactly the version `name@<id>` names (serving.store
        check_task_spec) if the manifest still holds it: the first step pins it for the request."""
        if "@" in name:
            return self.version(name)
        entry = self._entries.get(name)
        if entry is None:
            if name in self._entry_errors:
                raise RequestError(self._entry_errors[name], "unavailable")
            served = self.served()
            first = heapq.nsmallest(KNOWN_IN_MESSAGE, served)  # bounded: an answer to a typo, not a listing
            known = ", ".join(first) or "(none)"
            if len(served) > KNOWN_IN_MESSAGE:
                known += f", ... ({len(served) - KNOWN_IN_MESSAGE} more: aot tasks lists them)"
            raise RequestError(f"unknown task {name[:200]!r}; known tasks: {known}", "not_found")
        return self.version(entry.folder)

    def version(self, version: str) -> ServedTask:
        """Exactly this task version (loaded on demand: version folders are immutable)."""
        try:
            check_version(version)
        except StoreError as exc:
            raise RequestError(str(exc)) from None
        with self._lock:
            task = self._versions.get(version)
            if not self.known(version) or task is None and not self.store.version_folder(version).is_dir():
                raise RequestError(f"task version {version!r} is not in the store (removed, or never exported)",
                                   "not_found")
            if task is None:
                task = self._load(version)
            if isinstance(task, ServedTask) and task.table is not None:
                try:
                    task.check_table()
                except StoreError as exc:  # damaged under the server: refused from now on, its pool rows dropped
                    task = self._versions[version] = self._damaged(version, exc)
                    if self.pool is not None:
                        self.pool.detach(version)
            self._last_used[version] = time.monotonic()
        if isinstance(task, StoreError):
            raise RequestError(str(task), "unavailable")
        return task

    def pool_slots(self, requests: list[tuple[ServedTask, np.ndarray]]) -> list[np.ndarray | None]:
        """Pool slots for a batch's (task, sorted distinct token ids), its misses filled together; None for a
        request the pool does not hold (a version that left the manifest, no pool, or a batch that needs more rows
        than the whole pool): its rows come from storage (`task.rows`)."""
        if self.pool is None:
            return [None] * len(requests)
        with self._lock:
            pooled = [i for i, (task, _) in enumerate(requests) if self.pool.holds(task.version)]
            try:
                slots = self.pool.slots_many([(requests[i][0].version, requests[i][1]) for i in pooled])
            except MemoryError:
                pooled, slots = [], []
        out: list[np.ndarray | None] = [None] * len(requests)
        for i, s in zip(pooled, slots):
            out[i] = s
        return out

    def rows_many(self, requests: list[tuple[ServedTask, np.ndarray]],
                  indexes: list[np.ndarray] | None = None) -> list:
        """Rows for a batch's (task, sorted distinct token ids), [U, L, d] fp16 each: gathered where the pool keeps
        them (a numpy array, or a tensor on the pool's device), or read or computed from storage (numpy). With
        `indexes` (each request's token_index), each token's row instead, [S, L, d]: the dense bias, gathered from
        the pool's slots in one step."""
        with self._lock:
            slots = self.pool_slots(requests)
            out = []
            for s, (task, ids), index in zip(slots, requests, indexes or [None] * len(requests)):
                if s is not None:
                    out.append(self.pool.gather(s if index is None else s[index]))
                else:
                    rows = task.rows(ids)
                    out.append(rows if index is None else protocol.dense_bias(rows, index))
            return out
