"""The task versions one step process holds (the other half of aot.serving.task_registry, which resolves names and
fetches): each a ServedTask whose head and factors are arrays over the host's sealed copy of its files
(aot.serving.store.host_cache: loaded by one process, served by all of them), or the StoreError it was refused with.

A version is loaded through the host's cache (its files read, a remote store's fetched, only when no process of the
host holds a copy); a copy the host evicted is let go at the next batch (`refresh`), a request reading it meanwhile
keeping its map. Copies that this process could not share count against `cache_bytes` here, and the least recently
used go past it. A version whose table a request found damaged is refused from the next batch on; every refused
version is checked again in the background after a backoff (aot.serving.store.rechecks), so that a restored version
serves again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from aot.serving.errors import RequestError
from aot.serving.remote_fetches import FetchError, fetch_error
from aot.serving.store.backend import BackendError
from aot.serving.store.digests import DigestError
from aot.serving.store.host_cache import HostCache
from aot.serving.store.reader import StoreError, StoreReader, folder_name, task_of
from aot.serving.store.rechecks import Rechecks
from aot.serving.tasks import ServedTask, load_task_version


class DamagedTable(RequestError):
    """A request read a damaged block of `version`'s table while its batch ran (aot.serving.steps answers it): it
    fails with its task's refusal, naming the item at fault in a request of several (a client then sends the others
    again)."""

    def __init__(self, message: str, version: str):
        super().__init__(message, "unavailable")
        self.version = version

    def at_item(self, column) -> RequestError:
        """This error naming the first item of a request that `version` serves (`column`: the request's
        aot.serving.columns.TaskColumn), so that a request of several answers "item K of N: ..."."""
        served = [t.version for t in column.tasks]
        if self.version not in served:
            return self
        first = int(np.flatnonzero(column.index == served.index(self.version))[0])
        return RequestError(str(self), self.reason, item=first)


class LoadedVersions:
    """`digests(version)`: the index's; `attach(version, task)`: a loaded version joins the pool (the registry says
    whether); `let_go(version)` and `detach(version)`: the pool keeps its rows without a source, or drops them;
    `on_task_error(version, message)`: log and count a refusal. `lock`: the registry's (what requests share)."""

    def __init__(self, store: StoreReader, parts: str, cache_bytes: int, host: HostCache, lock: threading.RLock,
                 digests: Callable[[str], dict[str, str] | None], attach: Callable[[str, ServedTask], None],
                 let_go: Callable[[str], None], detach: Callable[[str], None],
                 on_task_error: Callable[[str, str], None] | None):
        self.store, self.parts, self.cache_bytes, self.lock = store, parts, cache_bytes, lock
        self.digests, self.attach, self.let_go, self.detach = digests, attach, let_go, detach
        self.on_task_error = on_task_error
        self.versions: OrderedDict[str, ServedTask | StoreError] = OrderedDict()  # least recently used first
        self.last_used: dict[str, float] = {}
        self.loads = 0  # versions loaded (a test or benchmark counts cold loads)
        self.resident_bytes = 0  # of copies this process holds alone
        self._bytes: dict[str, int] = {}
        self.host = host
        self._releases = self.host.releases  # the host's evictions acted on
        self._damage: dict[str, Exception] = {}  # versions whose table a request found damaged, to refuse
        self.rechecks = Rechecks(self._recheck, self._recheck_passed)

    def get(self, version: str) -> ServedTask | StoreError | None:
        with self.lock:
            task = self.versions.get(version)
            if task is not None:
                self.versions.move_to_end(version)
            return task

    def used(self, version: str, task: ServedTask | StoreError) -> ServedTask | StoreError:
        """A request asks for `version` now: its use counted, a damage found meanwhile applied, a refused one's
        re-check started if it is due."""
        if version in self._damage:
            with self.lock:
                self.refuse(version, self._damage.pop(version))
                task = self.versions[version]
        self.last_used[version] = time.monotonic()
        if isinstance(task, StoreError):
            self.rechecks.asked(version)
        elif task.copy is not None:
            self.host.record(task.copy)
        return task

    def refresh(self) -> None:
        """Per batch: the host's evictions let go of, damage found by the last batch's requests refused."""
        self.host.refresh()
        if self.host.releases == self._releases and not self._damage:
            return
        with self.lock:
            self._releases = self.host.releases
            for version, task in list(self.versions.items()):
                if isinstance(task, ServedTask) and task.copy is not None and task.copy.evicted:
                    self.drop(version)
            for version in list(self._damage):
                self.refuse(version, self._damage.pop(version))

    def close(self) -> None:
        with self.lock:
            for version in list(self.versions):
                self.drop(version)

    def load(self, version: str, digests: dict[str, str] | None) -> ServedTask | StoreError:
        """Load `version` through the host's cache (a FetchError when a remote store could not give its files)."""
        self.loads += 1
        try:
            return load_task_version(lambda: self.folder(version, digests), version, self.store.root, self.parts,
                                     digests, self.host)
        except FetchError:
            raise
        except Exception as exc:  # noqa: BLE001 - a corrupt task must not take the others down
            return self.damaged(version, exc)

    def folder(self, version: str, digests: dict[str, str] | None) -> Path:
        try:
            return self.store.version_folder(version, digests)
        except (BackendError, DigestError, OSError) as exc:  # unreachable, or an object damaged on its way
            raise fetch_error(version, self.store.location, exc) from None

    def keep(self, version: str, task: ServedTask | StoreError) -> None:
        """Under the lock: add a loaded version (or its error), attach it to the pool, and drop the least recently
        used versions while the bytes held alone pass `cache_bytes` (never the one just loaded)."""
        self.versions[version] = task
        size = 0
        if isinstance(task, ServedTask):
            task.on_damage = lambda exc: self._found_damaged(version, exc)
            size = task.resident_bytes()
            self.attach(version, task)
        self._bytes[version] = size
        self.resident_bytes += size
        for old in list(self.versions):
            if self.resident_bytes <= self.cache_bytes:
                break
            if old != version and self._bytes.get(old):
                self.drop(old)

    def drop(self, version: str) -> None:
        """Forget a loaded version. Its pooled rows stay (the pool evicts rows by its own budget): a version loaded
        again finds them, and computes only the rows the pool no longer holds."""
        task = self.versions.pop(version, None)
        if isinstance(task, ServedTask) and task.copy is not None:
            self.host.release(task.copy)
        self.resident_bytes -= self._bytes.pop(version, 0)
        self.last_used.pop(version, None)
        self.let_go(version)

    def _found_damaged(self, version: str, exc: Exception) -> DamagedTable:
        """A request read a damaged block of `version`'s table: the version is refused from the next batch on, and
        the request fails with what its task answers from then on."""
        self._damage.setdefault(version, exc)
        return DamagedTable(str(self._corrupt(version, exc)), version)

    def _corrupt(self, version: str, exc: BaseException) -> StoreError:
        """What a refused version's requests read (no path, no store address)."""
        detail = str(exc).replace(str(self.store.root) + "/", "")
        if self.store.url:
            detail = detail.replace(self.store.url, "the task store")
        return StoreError(f"task {task_of(version)!r} ({version}) is corrupt: {type(exc).__name__}: {detail}")

    def damaged(self, version: str, exc: BaseException) -> StoreError:
        error = self._corrupt(version, exc)
        if self.on_task_error is not None:
            self.on_task_error(version, str(error))
        self.rechecks.refused(version)
        return error

    def refuse(self, version: str, exc: Exception) -> None:
        """Under the lock: a loaded version found damaged is refused from now on, its pooled rows dropped."""
        if isinstance(self.versions.get(version), ServedTask):
            self.drop(version)
        self.keep(version, self.damaged(version, exc))
        self.detach(version)

    def _recheck(self, version: str) -> None:
        """A refused version checked again: every file against its published digest, a fused table whole (raises
        while it is still damaged); a remote store's fetched anew."""
        digests = self.digests(version)
        if digests is None:
            raise StoreError(f"{version}: no published digests to check it against")
        if self.store.cache is not None:
            self.store.cache.discard(folder_name(version))
        load_task_version(self.folder(version, digests), version, self.store.root, "all", digests).check_table()

    def _recheck_passed(self, version: str) -> None:
        with self.lock:
            if isinstance(self.versions.get(version), StoreError):
                self.drop(version)
