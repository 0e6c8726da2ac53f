"""Whether a server's store can serve: what /ready says beside the steps' health.

A server started on a store that cannot be read (its store.json missing: a wrong mount, a deleted file; a store in
object storage that does not answer and of which this host kept no copy, aot.serving.store.mirror) serves no task:
its steps have nothing to fall back on. Triton still says ready, so /ready must not: `problem` says why (503). So does a
change log that cannot be parsed when the server starts: its fresh steps know nothing of what changed from that
generation on, which the replicas that read the log before it was damaged serve.

What a server can serve with is a `warning` (/ready stays 200 and lists it): a shard of the index that cannot be parsed
(only the tasks in it fail, aot.serving.store.shards); a log damaged after the server read the index (its steps serve
what they applied; a step that restarts stops before the log, and publishes are refused until `aot export repair`);
or a store in object storage that stopped answering after the index was read (the steps serve what they hold; tasks
not fetched yet fail until it answers). Taking every replica of a fleet out of its load balancer for any of them would
stop the tasks that still serve.

A folder store is read until it was read whole once; then every STORE_CHECK_RETRY_SECONDS its logs since the newest
index are checked, each parsed again when its stat changed (a log cut short by a full disk or edited by hand), and
while it has damage, the index is read again whenever it changed (`aot export repair`). A store in object storage is
read from a thread of its own, never from the supervisor's loop, and asked every STORE_CHECK_RETRY_SECONDS whether it
answers (its logs are not watched: each host reads a log once and keeps its copy, aot.serving.store.mirror); one that
has not answered for STALL_SECONDS is reported before the client's own timeout ends the call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from aot.serving.formats import FormatError
from aot.serving.repository import read_repository
from aot.serving.store.backend import BackendError
from aot.serving.store.layout import LOG
from aot.serving.store.log import generation_of
from aot.serving.store.reader import StoreError, StoreIndex, StoreReader

STORE_CHECK_RETRY_SECONDS = 1.0  # a store that could not be read is read again at most this often
STALL_SECONDS = 2.0  # a store in object storage that has not answered a read for this long is reported


def store_check_of(models_dir: str | Path) -> Callable[[Callable[[str], None]], StoreCheck] | None:
    """What the supervisor of a server on `models_dir` builds its store check with (None: not an AoT repository)."""
    try:
        repo = read_repository(Path(models_dir).parent)
    except (ValueError, OSError):
        return None
    return partial(StoreCheck, repo.store_root, url=repo.store_url)


class StoreCheck:
    """`problem`: why no task can be served, or None; `warning`: what the server serves without, or None.
    `refresh()` (the supervisor's loop) reads again when due and never waits on a remote store; `problem` and
    `warning` read nothing."""

    def __init__(self, store_root: str | Path, log: Callable[[str], None], url: str | None = None):
        self.reader = StoreReader(store_root, url)
        self.log = log
        self.problem: str | None = None
        self.warning: str | None = None
        self._served = False  # the index was read (or this host's copy of it, which the steps serve then)
        self._damage: str | None = None  # what of the index read could not be parsed
        self._log_tags: dict[str, tuple] = {}  # a folder store's logs since its newest index -> their stat when parsed
        self._next = 0.0
        self._asking_since: float | None = None  # a read of a remote store under way since then (time.time())
        self._silent_since: float | None = None  # the remote store has not answered since then (time.time())
        self._lock = threading.Lock()

    def refresh(self) -> None:
        with self._lock:
            asking = self._asking_since
        if asking is not None:
            if time.time() - asking > STALL_SECONDS:
                self._silent(asking)
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + STORE_CHECK_RETRY_SECONDS
        if not self.reader.remote:
            self._check()
            return
        with self._lock:
            self._asking_since = time.time()
        threading.Thread(target=self._ask, name="aot-store-check", daemon=True).start()

    def _ask(self) -> None:
        try:
            self._check()
        finally:
            with self._lock:
                self._asking_since = None

    def _check(self) -> None:
        """Read the index until it was read whole once (again when it changed, while it was damaged); then (a
        remote store) whether it answers."""
        if self._served and not self.reader.remote:
            if self._damage is None:
                self._damage = self._log_damage()
                self._report(None, self._damage)
                return
            if not self.reader.log.changed():  # damaged: read again once something changed (a repair)
                return
        elif self._served:
            try:
                changed = self.reader.log.changed()
            except (BackendError, OSError) as exc:
                if self._silent_since is None:
                    self._scrub(exc)  # the details, to the log once
                self._silent(self._asking_since or time.time())
                return
            self._silent_since = None
            self._report(None, self._damage)
            if not (changed and self._damage):
                return
        try:
            index = self._first_index(copy=not self._served)
        except StoreError as exc:
            self._report(f"the task store cannot be read ({self._scrub(exc)}): no task can be served", None)
            return
        damage = [self._scrub(d) for d in index.damage()]
        if index.damaged_log is not None and not self._served:  # read again: a repair mends it
            self._report(f"{damage[-1]}; run `aot export repair`", None)
            return
        self._served = True
        self._damage = f"{'; '.join(damage)}; run `aot export repair`" if damage else None
        self._report(None, self._damage)

    def _log_damage(self) -> str | None:
        """A folder store's logs since its newest index, each parsed again when its stat changed: what of them a step
        that starts now would stop at, or None."""
        log, backend = self.reader.log, self.reader.backend
        newest, tags = max(log.indexes(), default=0), {}
        for key in sorted(backend.list(LOG)):
            generation = generation_of(key)
            if generation is None or generation <= newest or (tag := backend.tag(key)) is None:
                continue
            if self._log_tags.get(key) != tag:
                try:
                    log.check_log(generation)
                except FormatError as exc:
                    return (f"the change log cannot be parsed at generation {generation} ({self._scrub(exc)}): the "
                            f"steps serve what they applied, a step that starts now serves the index as of generation "
                            f"{generation - 1}, and publishes are refused; run `aot export repair`")
            tags[key] = tag
        self._log_tags = tags
        return None

    def _first_index(self, copy: bool) -> StoreIndex:
        """What the steps start from: a remote store's copy on this host (aot.serving.store.mirror) if it has one
        and `copy` (its reachability is asked next), else the store's index."""
        if self.reader.remote and copy:
            try:
                state = self.reader.last_read_state()
            except StoreError:
                pass
            else:
                index = StoreIndex()
                index.update(state, None)
                return index
        return self.reader.index()

    def _silent(self, since: float) -> None:
        """The remote store has not answered since `since`: a warning while the steps serve, else the problem."""
        self._silent_since = self._silent_since or since
        silent = f"the task store has not answered since {time.strftime('%H:%M:%S', time.localtime(self._silent_since))}"
        if self._served:
            self._report(self.problem, f"{silent}: the tasks already held serve, the others fail until it answers")
        else:
            self._report(f"{silent} and this host has no copy of its index: no task can be served yet", None)

    def _scrub(self, what) -> str:
        """A message without server paths or the store's address (/ready is read by load balancers): a folder
        store's relative to the repository; a remote store's details (its bucket, prefix, endpoint, what its client
        said) only in the supervisor's log."""
        if self.reader.url:
            self.log(f"supervisor: the task store {self.reader.url}: {' '.join(str(what).split())}")
            return "details in the server log"
        return " ".join(str(what).replace(str(self.reader.root.parent) + "/", "").split())

    def _report(self, problem: str | None, warning: str | None) -> None:
        """Set what /ready says, logging each change."""
        if problem != self.problem:
            self.log(f"supervisor: warning: {problem}; /ready says 503 until it is fixed" if problem else
                     "supervisor: the task store can be read: its tasks serve")
        if warning != self.warning and warning:
            self.log(f"supervisor: warning: {warning}")
        self.problem, self.warning = problem, warning
