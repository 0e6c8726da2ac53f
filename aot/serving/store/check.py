"""Whether a server's task store can serve any task: what /ready says beside the steps' health.

A server started on a store that cannot be read (its store.json missing: a wrong mount, a deleted file; or an index
that cannot be parsed) serves no task: its steps have no last good index to fall back on. Triton still says ready,
and so did /ready, with every model loaded and answering. Once the index was read after the start, the steps keep
serving the last good one whatever happens to the files later (aot.serving.store.view.StoreView), so only the start
counts. A store in object storage is not checked here: its steps follow it from a thread of their own, and report it."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from aot.serving.repository import read_repository
from aot.serving.store.reader import StoreError, StoreReader

STORE_CHECK_RETRY_SECONDS = 1.0  # a store that could not be read is read again at most this often


def store_check_of(models_dir: str | Path) -> Callable[[Callable[[str], None]], StoreCheck] | None:
    """What the supervisor of a server on `models_dir` builds its store check with (None: nothing to check)."""
    root = store_root_of(models_dir)
    return None if root is None else partial(StoreCheck, root)


def store_root_of(models_dir: str | Path) -> Path | None:
    """The task store folder of the model repository `models_dir` (REPO/models); None when it is not an AoT
    repository, or its tasks live in object storage."""
    try:
        repo = read_repository(Path(models_dir).parent)
    except (ValueError, OSError):
        return None
    return None if repo.store_url else repo.store_root


class StoreCheck:
    """`problem`: why no task can be served, or None. `refresh()` (the supervisor's loop) reads the store's index
    until it was read whole once, at most every STORE_CHECK_RETRY_SECONDS; `problem` itself reads nothing."""

    def __init__(self, store_root: str | Path, log: Callable[[str], None]):
        self.reader = StoreReader(store_root)
        self.log = log
        self.problem: str | None = None
        self._served = False
        self._next = 0.0

    def refresh(self) -> None:
        if self._served or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + STORE_CHECK_RETRY_SECONDS
        try:
            self.reader.state()
        except StoreError as exc:
            detail = " ".join(str(exc).replace(str(self.reader.root.parent) + "/", "").split())  # no server path
            problem = f"the task store cannot be read ({detail}): no task can be served"
        else:
            problem = None
            self._served = True
        if problem != self.problem:
            self.log(f"supervisor: warning: {problem}; /ready says 503 until it is fixed" if problem else
                     "supervisor: the task store can be read: its tasks serve")
        self.problem = problem
