"""A reader's index that follows the store's change log (aot.serving.store.log): what every served step and the audit
read the task store through."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

from aot.serving.formats import FormatError
from aot.serving.store.backend import BackendError
from aot.serving.store.log import StoreState
from aot.serving.store.reader import StoreError, StoreIndex, StoreReader

LARGE_CHANGE = 10_000  # entries changed at once past which the index's objects are frozen out of the collector


class StoreView:
    """A reader's index that follows the store's change log: `refresh()` is a stat when nothing changed and one
    small object per publish otherwise. A log that cannot be read is reported (`error`) and the last good index
    stays in use; the next refresh tries again. The first refresh of a remote store's view starts from the copy its
    host last read (aot.serving.store.mirror; `offline` until the store answers a refresh) and follows the store's
    logs from there: a new step instance serves at once, whether the store answers or not, and reads only what
    changed since; without a copy it reads the store whole."""

    INDEX_RETRY_SECONDS = 1.0  # after a failed read, the whole index is read again at most this often

    def __init__(self, reader: StoreReader):
        self.reader = reader
        self.index = StoreIndex()
        self.error: str | None = None
        self.loaded = False  # an index was read (from the store, or from this host's copy of it)
        self.offline = False  # the index is this host's copy: the store has not answered since this view began
        self._state: StoreState | None = None
        self._retry_at = 0.0

    @property
    def stale(self) -> str | None:
        """Why a name this index lacks may still be in the store (None: the index is the store's, as of its last
        change): it could not be read, or a log of it cannot be parsed."""
        if not self.loaded:
            return self.error or "the task store's index has not been read yet"
        if self.error:
            return self.error
        if self.offline:
            return "the index is this host's copy: the task store has not answered since this reader started"
        return self.index.damage()[-1] if self.index.damaged_log is not None else None

    @property
    def pending(self) -> bool:
        """A large change set waits to be applied (refresh(defer_parts=True) left it)."""
        return self._state is not None and self._state.pending_parts is not None

    def refresh(self, defer_parts: bool = False) -> set[str] | None:
        """Apply what changed: the names whose entries changed (empty: nothing), or None when the whole index was
        read (the first time, after an error, or for a reader left behind the log's compaction). `defer_parts`: stop
        before a change set in parts (`pending`), which a later refresh without it applies. Read with Python's cyclic
        collector paused (each of its full passes over hundreds of thousands of new entries held the interpreter
        ~0.2 s, which every request of a step waited for); a large change's objects are then frozen out of it."""
        with _collector_paused():
            changed = self._apply(defer_parts)
            if changed is None or len(changed) > LARGE_CHANGE:
                gc.freeze()  # the index's objects: never scanned again by a collection (acyclic: freed by count)
        return changed

    def _apply(self, defer_parts: bool) -> set[str] | None:
        try:
            if self._state is None:
                if time.monotonic() < self._retry_at:
                    return set()
                if not self.loaded and self._last_read():
                    return None
                state = self.reader.state()
                self.index.update(state, None)
                self._state, self.error, self.loaded, self.offline = state, None, True, False
                return None
            damaged = self._state.damaged_log is not None
            if damaged and time.monotonic() < self._retry_at:
                return set()  # a damaged log is read again at most every INDEX_RETRY_SECONDS
            if not self.pending and not damaged and not self.reader.log.changed():
                return set()
            changed = self.reader.log.follow(self._state, defer_parts)
        except (StoreError, FormatError, BackendError, OSError) as exc:
            self.error = str(exc)
            self._state = None  # read whole next time: a change set may have been half applied
            self._retry_at = time.monotonic() + self.INDEX_RETRY_SECONDS
            return set()
        self.index.update(self._state, changed)
        self.error, self.offline = None, False
        if self._state.damaged_log is not None:
            self._retry_at = time.monotonic() + self.INDEX_RETRY_SECONDS
        return changed

    def _last_read(self) -> bool:
        """No index yet: start from the one this host last read (False: it kept none)."""
        try:
            state = self.reader.last_read_state()
        except StoreError:
            return False
        self.index.update(state, None)
        self._state, self.loaded, self.offline = state, True, True
        return True


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
