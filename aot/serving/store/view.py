"""A reader's index that follows the store's change log (aot.serving.store.log): what every served step and the audit
read the task store through."""

from __future__ import annotations

import time

from aot.serving.formats import FormatError
from aot.serving.store.backend import BackendError
from aot.serving.store.log import StoreState
from aot.serving.store.reader import StoreError, StoreIndex, StoreReader


class StoreView:
    """A reader's index that follows the store's change log: `refresh()` is a stat when nothing changed and one
    small object per publish otherwise. A log that cannot be read is reported (`error`) and the last good index
    stays in use; the next refresh tries again."""

    INDEX_RETRY_SECONDS = 1.0  # after a failed read, the whole index is read again at most this often

    def __init__(self, reader: StoreReader):
        self.reader = reader
        self.index = StoreIndex()
        self.error: str | None = None
        self._state: StoreState | None = None
        self._retry_at = 0.0

    def refresh(self) -> set[str] | None:
        """Apply what changed: the names whose entries changed (empty: nothing), or None when the whole index was
        read (the first time, after an error, or for a reader left behind the log's compaction)."""
        try:
            if self._state is None:
                if time.monotonic() < self._retry_at:
                    return set()
                state = self.reader.state()
                self.index.update(state, None)
                self._state, self.error = state, None
                return None
            if not self.reader.log.changed():
                return set()
            changed = self.reader.log.follow(self._state)
        except (StoreError, FormatError, BackendError, OSError) as exc:
            self.error = str(exc)
            self._state = None  # read whole next time: a change set may have been half applied
            self._retry_at = time.monotonic() + self.INDEX_RETRY_SECONDS
            return set()
        self.index.update(self._state, changed)
        self.error = None
        return changed
