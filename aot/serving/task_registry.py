"""The task versions of a store as one served step sees them: names resolved through the store's index (followed
one change at a time), versions loaded on their first request and kept in a least-recently-used set under a byte
budget, damage found and reported, and a batch's rows through the step's task pool (aot.serving.pool) or from each
version's storage (aot.serving.tasks).

Residency is lazy and bounded: at start a step reads the index and nothing per task; a version is loaded (its files
checked against their digests) when a request first needs it, and dropped when the loaded versions' bytes (heads,
factors) pass `cache_bytes` and it is the least recently used. Concurrent first requests for one version load it
once. A version that fails to load is kept as its error: its requests fail with that message, the others serve.

Names are resolved for a caller (aot.serving.store.tenants): a task the request's tenant key does not open is answered
exactly as a task the store does not hold, and an unknown task's answer suggests only tasks the caller may call. A task
with a route (aot.exporter.versions) answers each request from a version drawn by weight, one draw per request.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from aot.serving import protocol
from aot.serving.errors import RequestError
from aot.serving.pool import RowPool
from aot.serving.store.audit import TaskAudit
from aot.serving.store.backend import BackendError
from aot.serving.store.digests import DigestError
from aot.serving.store.reader import RETIRED_GRACE, StoreError, StoreReader, TaskEntry, check_version, task_of
from aot.serving.store.tenants import Caller, may_call
from aot.serving.store.view import StoreView
from aot.serving.tasks import PARTS, ServedTask, load_task_version

KNOWN_IN_MESSAGE = 10  # task names an unknown task's 404 suggests
DEFAULT_CACHE_BYTES = 256 << 20
REMOTE_POLL_SECONDS = 1.0  # how often a step looks at an object store's generation hint (one conditional GET)
RETRY_FETCH_SECONDS = 2.0  # a version that could not be fetched fails its requests at once this long, then is retried


STORE = ""  # the key of _unreachable that pauses every fetch: the store did not answer
_draw = random.SystemRandom()  # a route's draw: one per request, from the OS, never shared state seeded per batch


class FetchError(OSError):
    """A version could not be fetched from a remote store: unreachable (then every cold version waits
    RETRY_FETCH_SECONDS before the store is asked again), or one object failed its digest (that version waits)."""

    def __init__(self, message: str, unreachable: bool):
        super().__init__(message)
        self.unreachable = unreachable


class TaskRegistry:
    """The tasks of a store as one served step sees them."""

    def __init__(self, store_root: str | Path, parts: str = "all", grace: float = 120.0,
                 on_index_error: Callable[[str], None] | None = None, pool: RowPool | None = None,
                 on_task_error: Callable[[str, str], None] | None = None, pool_fused: bool = True,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, url: str | None = None, require_tenant_keys: bool = False):
        """`pool`: keep the rows of the current versions in this pool (aot.serving.pool); a version that leaves the
        index is detached from it (a request still pinned to one reads its storage directly); one dropped from the
        loaded set keeps its rows there until the pool evicts them, for when it is loaded again.
        `pool_fused` False: only factored versions' rows go in the pool, fused tables are read through their memory
        maps (a step of several instances on CPU: the page cache shares one copy of each table between them).
        `grace`: seconds a version that left the index stays loaded after it last served a request.
        `on_task_error(version, message)`: a version failed to load or was found damaged (log it, count it).
        `url`: the tasks live in object storage (aot.serving.store.s3): the index is followed by a thread of its own
        every REMOTE_POLL_SECONDS, so that no request waits on the bucket, and a version not cached on disk is fetched
        on its first request (a store that cannot be reached fails that request alone, 503, and it is tried again).
        `require_tenant_keys`: tasks without a tenant answer only requests with a valid key of some tenant."""
        if parts not in PARTS:
            raise ValueError(f"parts={parts!r}: expected one of {', '.join(PARTS)}")
        self.store = StoreReader(store_root, url)
        self.view = StoreView(self.store)
        self.pool, self.pool_fused = pool, pool_fused
        self.parts, self.grace, self.cache_bytes = parts, grace, cache_bytes
        self.require_tenant_keys = require_tenant_keys
        self.on_index_error = on_index_error
        self.on_task_error = on_task_error
        self.audit = TaskAudit(self.store, self.view)
        self.loads = 0  # versions loaded (a test or benchmark counts cold loads)
        self.resident_bytes = 0
        self._versions: OrderedDict[str, ServedTask | StoreError] = OrderedDict()  # least recently used first
        self._bytes: dict[str, int] = {}
        self._loading: dict[str, threading.Event] = {}
        self._last_used: dict[str, float] = {}
        self._batch = 0  # refresh() count: a fused table is checked against the disk once per batch
        self._table_checked: dict[str, int] = {}  # version -> the batch its table was last checked in
        self._reported_error: str | None = None
        self._unreachable: dict[str, tuple[float, str]] = {}  # version -> (until when, why): not retried sooner
        self._lock = threading.RLock()
        self._refresh()
        self._stop = threading.Event()
        if self.store.remote:
            threading.Thread(target=self._follow_remote, name="aot-store-watch", daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def _follow_remote(self) -> None:
        while not self._stop.wait(REMOTE_POLL_SECONDS):
            self._refresh()

    # --- the index -------------------------------------------------------------------------------------------------

    @property
    def index_error(self) -> str | None:
        """Why the store's index could not be read (the last good one serves meanwhile), or None."""
        return self.view.error

    def refresh(self) -> None:
        """Before each batch (and in the audit's thread): apply what changed in the index (a stat when nothing
        did; nothing for a store in object storage, which a thread of its own follows)."""
        self._batch += 1
        if not self.store.remote:
            self._refresh()

    def _refresh(self) -> None:
        with self._lock:
            changed = self.view.refresh()
            if self.view.error and self.view.error != self._reported_error and self.on_index_error is not None:
                self.on_index_error(self.view.error)
            self._reported_error = self.view.error
            if changed == set() or not self._versions and (self.pool is None or not self.pool.versions()):
                return  # nothing new, or nothing loaded that a change could take away (a start parses no entry)
            index = self.view.index  # each version asked on its own: no entry parsed beyond those in use
            if self.pool is not None:  # rows of versions no bare name answers go at once (kept ones too)
                for version in self.pool.versions():
                    if not index.is_current(version):
                        self.pool.detach(version)
            for version in [v for v in self._versions if not index.is_current(v)]:  # a version the index no longer
                # holds (a deleted tenant's) goes at once: a loaded one must not outlive it for a pinned request
                if not self.known(version) or time.monotonic() - self._last_used.get(version, 0.0) > self.grace:
                    self._drop(version)

    def entries(self) -> dict[str, TaskEntry]:
        return self.view.index.entries

    def names(self) -> list[str]:
        """Every task the index names, loadable or not."""
        index = self.view.index
        return sorted(set(index.entries) | set(index.errors))

    def caller(self, key: str | None) -> Caller:
        """Who a request carrying tenant key `key` is (aot.serving.store.tenants)."""
        return Caller.of(key, self.view.index.tenants)

    def visible(self, caller: Caller) -> list[str]:
        """The task names (sorted, loadable or not) the caller may call."""
        return [n for n in self.names() if caller.may_call(n, self.require_tenant_keys)]

    def known(self, version: str) -> bool:
        """A version the index names as current or kept, or retired less than RETIRED_GRACE ago (a request may be
        pinned to it): after that it is gone, even before the next export deletes its folder."""
        index = self.view.index
        entry = index.entries.get(task_of(version))
        if entry is not None and version in entry.held():
            return True
        retired = index.retired.get(version)
        return retired is not None and time.time() - retired < RETIRED_GRACE

    def errors(self) -> dict[str, str]:
        """Task name -> why its requests fail: a bad index entry, a loaded version that failed, or a file the audit
        found damaged. Versions not loaded yet are not read for this."""
        index = self.view.index
        errors = dict(index.errors)
        with self._lock:
            for version, loaded in self._versions.items():
                entry = index.entries.get(task_of(version))
                if isinstance(loaded, StoreError) and entry is not None and entry.folder == version:
                    errors[entry.name] = str(loaded)
        for name, damage in self.audit.damaged().items():
            errors.setdefault(name, damage)
        return errors

    def loaded(self) -> dict[str, ServedTask]:
        """The current versions loaded now, by task name."""
        index = self.view.index
        with self._lock:
            return {task_of(v): t for v, t in self._versions.items() if isinstance(t, ServedTask)
                    and (e := index.entries.get(task_of(v))) is not None and e.folder == v}

    # --- resolving a request's task -------------------------------------------------------------------------------

    def resolve(self, name: str, key: str | None = None) -> ServedTask:
        """The current version of task `name` (or the one its route draws), or exactly the version `name@<id>`
        names (aot.serving.store.reader check_task_spec) if the index still holds it: the first step pins it for the
        request. `key`: the request's tenant key; a task it does not open is answered as one that does not exist."""
        if "@" in name:
            return self.version(name, key)
        index = self.view.index
        allowed = may_call(name, key, index.tenants, self.require_tenant_keys)
        entry = index.entries.get(name) if allowed else None
        if entry is None:
            if allowed and name in index.errors:
                raise RequestError(index.errors[name], "unavailable")
            raise self.unknown(name, key)
        return self._version(entry.routed(_draw.random()) if entry.route else entry.folder)

    def unknown(self, name: str, key: str | None) -> RequestError:
        """The answer for a task that does not exist, or that `key` does not open: the same bytes either way, naming
        only tasks the caller may call."""
        caller = self.caller(key)
        errors = self.errors()
        names = [n for n in self.view.index.entries if n not in errors and caller.may_call(n, self.require_tenant_keys)]
        first = heapq.nsmallest(KNOWN_IN_MESSAGE + 1, names)
        known = ", ".join(first[:KNOWN_IN_MESSAGE]) or "(none)"
        if len(first) > KNOWN_IN_MESSAGE:
            known += f", ... ({len(names) - KNOWN_IN_MESSAGE} more: aot tasks lists them)"
        return RequestError(f"unknown task {name[:200]!r}; known tasks: {known}", "not_found")

    def version(self, version: str, key: str | None = None) -> ServedTask:
        """Exactly this task version, loaded on its first request (version folders are immutable), if `key` (the
        request's tenant key) may call its task."""
        try:
            check_version(version)
        except StoreError as exc:
            raise RequestError(str(exc)) from None
        if not may_call(version, key, self.view.index.tenants, self.require_tenant_keys):
            raise _not_in_store(version)
        return self._version(version)

    def _version(self, version: str) -> ServedTask:
        """version() for a caller whose key was checked already (resolve: one check per request)."""
        with self._lock:
            task = self._versions.get(version)
            if task is not None:
                self._versions.move_to_end(version)
        if task is None:
            if not self.known(version) or not self.store.remote and not self.store.version_folder(version).is_dir():
                raise _not_in_store(version)
            unreachable = self._unreachable.get(version) or self._unreachable.get(STORE)
            if unreachable is not None and time.monotonic() < unreachable[0]:
                raise RequestError(unreachable[1], "unavailable")
            task = self._load_once(version)
        if isinstance(task, ServedTask) and task.table is not None and self._table_checked.get(version) != self._batch:
            self._table_checked[version] = self._batch  # once per batch: its requests all read the table now
            try:
                task.check_table()
            except StoreError as exc:  # damaged under the server: refused from now on, its pool rows dropped
                with self._lock:
                    task = self._versions[version] = self._damaged(version, exc)
                    if self.pool is not None:
                        self.pool.detach(version)
        self._last_used[version] = time.monotonic()
        if isinstance(task, StoreError):
            raise RequestError(str(task), "unavailable")
        return task

    def _load_once(self, version: str) -> ServedTask | StoreError:
        """Load `version` once, however many requests ask for it at the same moment."""
        with self._lock:
            task = self._versions.get(version)
            if task is not None:
                return task
            loading = self._loading.get(version)
            if loading is None:
                loading = self._loading[version] = threading.Event()
                mine = True
            else:
                mine = False
        if not mine:
            loading.wait()
            with self._lock:
                task = self._versions.get(version)
            if task is None:  # the load it waited for could not fetch the version
                why = self._unreachable.get(version) or self._unreachable.get(STORE) or (0, f"{version}: not loaded")
                raise RequestError(why[1], "unavailable")
            return task
        task: ServedTask | StoreError = StoreError(f"{version}: not loaded")
        try:
            task = self._load(version)
        except FetchError as exc:  # the store: not kept, tried again after a pause (the others serve meanwhile)
            with self._lock:
                del self._loading[version]
                loading.set()
                until = (time.monotonic() + RETRY_FETCH_SECONDS, str(exc))
                self._unreachable[STORE if exc.unreachable else version] = until
            raise RequestError(str(exc), "unavailable") from None
        finally:
            with self._lock:
                if version in self._loading:
                    self._keep(version, task)
                    del self._loading[version]
                    loading.set()
        self._unreachable.pop(version, None)
        self._unreachable.pop(STORE, None)
        return task

    def _load(self, version: str) -> ServedTask | StoreError:
        self.loads += 1
        digests = self.view.index.digests(version)
        try:
            folder = self.store.version_folder(version, digests)
        except (BackendError, DigestError, OSError) as exc:  # unreachable, or an object damaged on its way
            raise FetchError(f"task {task_of(version)!r} ({version}) cannot be fetched from the task store "
                             f"{self.store.location}: {exc}", unreachable=isinstance(exc, BackendError)) from None
        try:
            return load_task_version(folder, version, self.store.root, self.parts, digests)
        except Exception as exc:  # noqa: BLE001 - a corrupt task must not take the others down
            return self._damaged(version, exc)

    def _keep(self, version: str, task: ServedTask | StoreError) -> None:
        """Under the lock: add a loaded version (or its error), attach it to the pool, and drop the least recently
        used versions while the loaded bytes pass the budget (never the one just loaded)."""
        self._versions[version] = task
        size = task.resident_bytes() if isinstance(task, ServedTask) else 0
        self._bytes[version] = size
        self.resident_bytes += size
        if isinstance(task, ServedTask) and self.pool is not None and self.view.index.is_current(version) \
                and (self.pool_fused or task.storage != "fused"):
            self.pool.attach(version, task.rows)
        for old in list(self._versions):
            if self.resident_bytes <= self.cache_bytes:
                break
            if old != version:
                self._drop(old)

    def _drop(self, version: str) -> None:
        """Forget a loaded version. Its pooled rows stay (the pool evicts rows by its own budget): a version loaded
        again finds them, and computes only the rows the pool no longer holds."""
        self._versions.pop(version, None)
        self.resident_bytes -= self._bytes.pop(version, 0)
        self._last_used.pop(version, None)
        self._table_checked.pop(version, None)
        if self.pool is not None:
            self.pool.let_go(version)

    def _damaged(self, version: str, exc: BaseException) -> StoreError:
        detail = str(exc).replace(str(self.store.root) + "/", "")
        error = StoreError(f"task {task_of(version)!r} ({version}) is corrupt: {type(exc).__name__}: {detail}")
        if self.on_task_error is not None:
            self.on_task_error(version, str(error))
        return error

    # --- a batch's rows ---------------------------------------------------------------------------------------------

    def pool_slots(self, requests: list[tuple[ServedTask, np.ndarray]]) -> list[np.ndarray | None]:
        """Pool slots for a batch's (task, sorted distinct token ids), its misses filled together; None for a
        request the pool does not hold (a version that left the index, no pool, or a batch that needs more rows
        than the whole pool): its rows come from storage (`task.rows`)."""
        if self.pool is None:
            return [None] * len(requests)
        with self._lock:
            pooled = [i for i, (task, _) in enumerate(requests) if self.pool.holds(task.version)]
            for i in pooled:  # the loaded task fills its misses (a version dropped and loaded again: this one)
                self.pool.attach(requests[i][0].version, requests[i][0].rows)
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


def _not_in_store(version: str) -> RequestError:
    return RequestError(f"task version {version!r} is not in the store (removed, or never exported)", "not_found")
