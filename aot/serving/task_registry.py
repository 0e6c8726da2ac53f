"""The task versions of a store as one served step sees them: names resolved through the store's index (followed
one change at a time), versions loaded on their first request and kept in a least-recently-used set under a byte
budget, damage found and reported, and a batch's rows through the step's task pool (aot.serving.pool) or from each
version's storage (aot.serving.tasks).

Residency is lazy and bounded: at start a step reads the index and nothing per task; a version is loaded when a
request first needs it, into a sealed copy checked against its digests that the host's step processes share, and the
host keeps at most `cache_bytes` of such copies whatever the number of processes (aot.serving.loaded_versions: what a
step holds; aot.serving.store.host_cache). Concurrent first requests for one version load it once. A version that
fails to load, or whose table a request finds damaged, is kept as its error: its requests fail with that message,
the others serve, and it is checked again in the background so that a restored version serves again.

Nothing a request waits on waits on the store's network: the index of a store in object storage is followed by a
thread of its own and applied under a short lock; a version not on this host is fetched by a thread of its own, and
its request waits only while the store answers (a store that stopped answering fails that request at once, 503 with a
retry hint, and never the requests of tasks held here, whatever shares their batch). A large change of a folder
store's index is applied by a thread too (aot.serving.store.parts), never by a batch. While the index may lack a name
that exists (not read yet, the store not answering, a log or shard of it damaged), a name it lacks is answered 503,
not "unknown". What a client reads names the task, never the store's address: the details go to the server's log.

Names are resolved for a caller (aot.serving.store.tenants): a task the request's tenant key does not open is answered
exactly as a task the store does not hold, and an unknown task's answer suggests only tasks the caller may call, at a
bounded cost (aot.serving.store.names). A task with a route (aot.serving.store.version_admin) answers each request from a version
drawn by weight, one draw per request.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from aot.serving.errors import RequestError, retry_hint
from aot.serving.loaded_versions import LoadedVersions
from aot.serving.pool import RowPool
from aot.serving.remote_fetches import RETRY_FETCH_SECONDS, FetchError, RemoteFetches
from aot.serving.store.audit import TaskAudit
from aot.serving.store.host_cache import HostCache
from aot.serving.store.reader import RETIRED_GRACE, StoreError, StoreReader, TaskEntry, check_version, task_of
from aot.serving.store.shards import shard_of
from aot.serving.store.tenants import Caller, may_call
from aot.serving.store.view import StoreView
from aot.serving.tasks import PARTS, ServedTask

KNOWN_IN_MESSAGE = 10  # task names an unknown task's 404 suggests
KNOWN_SCAN = 256  # names it looks at, at most, to find them (skipping tasks that cannot serve): a bounded cost
DEFAULT_CACHE_BYTES = 512 << 20  # the host's (aot.serving.repository.ServingOptions.task_cache_bytes)
REMOTE_POLL_SECONDS = 1.0  # how often a step looks at an object store's generation hint (one conditional GET)
_draw = random.SystemRandom()  # a route's draw: one per request, from the OS, never shared state seeded per batch


class TaskRegistry:
    """The tasks of a store as one served step sees them."""

    def __init__(self, store_root: str | Path, parts: str = "all", grace: float = 120.0,
                 on_index_error: Callable[[str], None] | None = None, pool: RowPool | None = None,
                 on_task_error: Callable[[str, str], None] | None = None, pool_fused: bool = True,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, url: str | None = None, require_tenant_keys: bool = False,
                 on_store_error: Callable[[str], None] | None = None, host: HostCache | None = None):
        """`pool`: keep the rows of the current versions in this pool (aot.serving.pool); a version that leaves the
        index is detached from it (a request still pinned to one reads its storage directly); one dropped from the
        loaded set keeps its rows there until the pool evicts them, for when it is loaded again.
        `pool_fused` False: only factored versions' rows go in the pool, fused tables are read through their memory
        maps (a step of several instances on CPU: the page cache shares one copy of each table between them).
        `grace`: seconds a version that left the index stays loaded after it last served a request.
        `on_index_error(message)`: the index could not be read, or part of it is damaged (log it, count it).
        `on_task_error(version, message)`: a version failed to load or was found damaged (log it, count it).
        `on_store_error(message)`: a version could not be fetched from the object store (log it, count it): the
        store's details, which its clients do not read.
        `cache_bytes`: the bound of the host's cache of versions (`host`: by default this process's share of it,
        aot.serving.store.host_cache.HostCache.for_host), and of the versions this process holds alone.
        `url`: the tasks live in object storage (aot.serving.store.s3): the index is followed by a thread of its own
        every REMOTE_POLL_SECONDS, and a version not cached on this host is fetched on its first request (module
        docstring). `require_tenant_keys`: tasks without a tenant answer only requests with a valid key of some
        tenant."""
        if parts not in PARTS:
            raise ValueError(f"parts={parts!r}: expected one of {', '.join(PARTS)}")
        self.store = StoreReader(store_root, url)
        self.view = StoreView(self.store)
        self.pool, self.pool_fused = pool, pool_fused
        self.parts, self.grace, self.cache_bytes = parts, grace, cache_bytes
        self.require_tenant_keys = require_tenant_keys
        self.on_index_error, self.on_task_error, self.on_store_error = on_index_error, on_task_error, on_store_error
        self.audit = TaskAudit(self.store, self.view)
        self._loading: dict[str, Future] = {}
        self._reported_error: str | None = None
        self._lock = threading.RLock()  # what requests share: the loaded versions, the pool
        self.held = LoadedVersions(self.store, parts, cache_bytes, host or HostCache.for_host(cache_bytes), self._lock, lambda v: self.view.index.digests(v),
                                   self._attach,
                                   pool.let_go if pool else _nothing, pool.detach if pool else _nothing, on_task_error)
        self._versions = self.held.versions
        self._refreshing = threading.Lock()  # one index read at a time; a batch never waits for it
        self._applier: threading.Thread | None = None
        self.fetches = RemoteFetches(lambda: self.view.error is not None) if self.store.remote else None
        self._stop = threading.Event()
        self._refresh()
        if self.store.remote:
            threading.Thread(target=self._follow_remote, name="aot-store-watch", daemon=True).start()

    @property
    def loads(self) -> int:
        return self.held.loads

    @property
    def resident_bytes(self) -> int:
        return self.held.resident_bytes

    @property
    def host(self) -> HostCache:
        return self.held.host

    def close(self) -> None:
        self._stop.set()
        self.held.close()
        if self.fetches is not None:
            self.fetches.close()

    def _follow_remote(self) -> None:
        while not self._stop.wait(REMOTE_POLL_SECONDS):
            with self.fetches.polling():
                self._refresh()

    # --- the index -------------------------------------------------------------------------------------------------

    @property
    def index_error(self) -> str | None:
        """Why the store's index could not be read (the last good one serves meanwhile), or None: for the server's
        operator (it may name the store's address)."""
        return self.view.error

    @property
    def index_problem(self) -> str | None:
        """What a client may read of what is wrong with the index (`aot tasks`): no path, no store address."""
        if self.view.error:
            return "the task store's index cannot be read now (the server log says why); the last good one serves"
        damage = self.view.index.damage()
        return f"{len(damage)} part(s) of the task store's index cannot be read: aot export repair" if damage else None

    def refresh(self) -> None:
        """Before each batch (and in the audit's thread): apply what changed in the index (a stat when nothing
        did). Never waits: a store in object storage is followed by a thread of its own, a large change is applied
        by one, and while either runs the batch serves the index as it is."""
        self.held.refresh()
        if self.store.remote or not self._refreshing.acquire(blocking=False):
            return
        try:
            self._apply(defer_parts=True)
        finally:
            self._refreshing.release()
        if self.view.pending and (self._applier is None or not self._applier.is_alive()):
            self._applier = threading.Thread(target=self._refresh, name="aot-store-apply", daemon=True)
            self._applier.start()

    def _refresh(self) -> None:
        with self._refreshing:
            self._apply(defer_parts=False)

    def _apply(self, defer_parts: bool) -> None:
        """Under _refreshing: read what changed (no lock that requests take is held meanwhile), then apply it."""
        changed = self.view.refresh(defer_parts)
        problem = self.view.error or "; ".join(self.view.index.damage()) or None
        if problem and problem != self._reported_error and self.on_index_error is not None:
            self.on_index_error(problem)
        self._reported_error = problem
        if changed == set() or not self._versions and (self.pool is None or not self.pool.versions()):
            return  # nothing new, or nothing loaded that a change could take away (a start parses no entry)
        index = self.view.index  # each version asked on its own: no entry parsed beyond those in use
        with self._lock:
            if self.pool is not None:  # rows of versions no bare name answers go at once (kept ones too)
                for version in self.pool.versions():
                    if not index.is_current(version):
                        self.pool.detach(version)
            for version in [v for v in self._versions if not index.is_current(v)]:  # a version the index no longer
                # holds (a deleted tenant's) goes at once: a loaded one must not outlive it for a pinned request
                if not self.known(version) or time.monotonic() - self.held.last_used.get(version, 0.0) > self.grace:
                    self.held.drop(version)

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
            if allowed and shard_of(name) in index.damaged_shards:
                raise RequestError(f"task {name!r} cannot be resolved: the part of the task store's index that holds "
                                   "it is damaged (an operator repairs it: aot export repair)", "unavailable")
            raise self._absent(name, key)
        return self._version(entry.routed(_draw.random()) if entry.route else entry.folder)

    def routed(self, name: str) -> bool:
        """Whether task `name` splits its requests between versions (a route): each of its items draws its own."""
        entry = self.view.index.entries.get(name)
        return entry is not None and bool(entry.route)

    def _absent(self, name: str, key: str | None) -> RequestError:
        """A name the index lacks (or `key` does not open: the same bytes): unknown, unless the index may lack a
        name the store holds (then 503, and a retry hint): it could not be read, or the store does not answer now."""
        if self.view.stale or self.fetches is not None and not self.fetches.answers():
            return RequestError(f"task {name[:200]!r} is not in the index this server holds, and the task store "
                                f"cannot be read now to look for it; {retry_hint(RETRY_FETCH_SECONDS)}",
                                "unavailable")
        return self.unknown(name, key)

    def unknown(self, name: str, key: str | None) -> RequestError:
        """The answer for a task that does not exist, or that `key` does not open: the same bytes either way, naming
        only tasks the caller may call, found among at most KNOWN_SCAN names (aot.serving.store.names)."""
        caller = self.caller(key)
        public = caller.tenant is not None or not self.require_tenant_keys
        first, total = self.view.index.names.first(caller.tenant, public, KNOWN_IN_MESSAGE, self._serves, KNOWN_SCAN)
        known = ", ".join(first) or "(none)"
        if total > len(first):
            known += f", ... ({total - len(first)} more: aot tasks lists them)"
        return RequestError(f"unknown task {name[:200]!r}; known tasks: {known}", "not_found")

    def _serves(self, name: str) -> bool:
        """Whether task `name` may serve as far as this step knows at no cost: a valid entry whose current version
        did not fail to load and was not found damaged (O(1): one entry parsed, one audit record)."""
        entry = self.view.index.entries.get(name)
        return (entry is not None and not isinstance(self._versions.get(entry.folder), StoreError)
                and self.audit.damage(entry.folder) is None)

    def version(self, version: str, key: str | None = None) -> ServedTask:
        """Exactly this task version, loaded on its first request (version folders are immutable), if `key` (the
        request's tenant key) may call its task."""
        try:
            check_version(version)
        except StoreError as exc:
            raise RequestError(str(exc)) from None
        if not may_call(version, key, self.view.index.tenants, self.require_tenant_keys):
            raise self._version_absent(version)
        return self._version(version)

    def _version_absent(self, version: str) -> RequestError:
        if self.view.stale:
            return self._absent(version, None)
        return RequestError(f"task version {version!r} is not in the store (removed, or never exported)", "not_found")

    def _version(self, version: str) -> ServedTask:
        """version() for a caller whose key was checked already (resolve: one check per request)."""
        task = self.held.get(version)
        if task is None:
            if not self.known(version) or not self.store.remote and not self.store.version_folder(version).is_dir():
                raise self._version_absent(version)
            task = self._load_once(version)
        task = self.held.used(version, task)
        if isinstance(task, StoreError):
            raise RequestError(str(task), "unavailable")
        return task

    # --- loading a version ------------------------------------------------------------------------------------------

    def _load_once(self, version: str) -> ServedTask | StoreError:
        """Load `version` once, however many requests ask for it at the same moment: here when its files are on this
        host, else fetched by a thread of its own while the request waits as long as the store answers."""
        with self._lock:
            task = self._versions.get(version)
            if task is not None:
                return task
            pending = self._loading.get(version)
            mine = pending is None
            if mine:
                pending = self._loading[version] = Future()
        if mine:
            digests = self.view.index.digests(version)
            if self.store.held_here(version, digests):
                self._settle(version, pending, digests)
            elif (refused := self.fetches.refusal(version)) is not None:  # the store silent, or the version paused
                with self._lock:
                    del self._loading[version]
                pending.set_exception(FetchError(refused, refused, unreachable=True))
            else:
                self.fetches.submit(self._settle, version, pending, digests)
        if self.fetches is None:
            return pending.result()
        return self.fetches.wait(version, pending)

    def _settle(self, version: str, pending: Future, digests: dict[str, str] | None) -> None:
        """Load `version` and keep it (or its error), then answer whoever waits on `pending`."""
        try:
            task = self.held.load(version, digests)
        except BaseException as exc:  # noqa: BLE001 - the store (tried again after a pause), or a fault: no hang
            if isinstance(exc, FetchError):
                self.fetches.failed(version, exc)
                if self.on_store_error is not None:
                    self.on_store_error(str(exc))
            with self._lock:
                del self._loading[version]
            pending.set_exception(exc)
            return
        with self._lock:
            self.held.keep(version, task)
            del self._loading[version]
        if self.fetches is not None:
            self.fetches.fetched(version)
        pending.set_result(task)

    def _attach(self, version: str, task: ServedTask) -> None:
        """A loaded version's rows join the pool if it is current (and, with pool_fused False, factored)."""
        if self.pool is not None and self.view.index.is_current(version) and (self.pool_fused or task.storage != "fused"):
            self.pool.attach(version, task.rows)

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
        for i, s in zip(pooled, slots, strict=True):
            out[i] = s
        return out


def _nothing(version: str) -> None:
    """What a registry without a pool does with a version's rows."""
