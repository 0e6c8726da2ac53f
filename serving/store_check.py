"""Whether a server's task store can serve any task: what /ready says beside the steps' health.

A server started on a store whose manifest is missing (a wrong mount, a deleted file) or unreadable serves no task:
its steps have no last good manifest to fall back on. Triton still says ready, and so did /ready, with every model
loaded and answering. Once a good manifest was read after the start, the steps keep serving it whatever happens to
the file later (serving.task_registry), so only the start counts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from serving.repository import read_repository
from serving.store import MANIFEST, StoreError, StoreReader


def store_root_of(models_dir: str | Path) -> Path | None:
    """The task store of the model repository `models_dir` (REPO/models); None when it is not an AoT repository."""
    try:
        return read_repository(Path(models_dir).parent).store_root
    except (ValueError, OSError):
        return None


class StoreCheck:
    """`problem()`: why no task can be served, or None. The manifest is read again only when its stamp changed, and
    never again once it was read whole: a stat per call until then."""

    def __init__(self, store_root: str | Path, log: Callable[[str], None]):
        self.reader = StoreReader(store_root)
        self.log = log
        self._stamp: object = object()  # no stamp seen yet
        self._problem: str | None = None
        self._served = False

    def problem(self) -> str | None:
        if self._served:
            return None
        stamp = self.reader.manifest_stamp()
        if stamp == self._stamp:
            return self._problem
        self._stamp, problem = stamp, None
        if stamp is None:
            problem = (f"the task store has no manifest ({self.reader.root.name}/{MANIFEST} missing): no task can be "
                       "served; restore it, or publish a task with `aot export task`")
        else:
            try:
                self.reader.manifest_data()
            except StoreError as exc:
                detail = str(exc).replace(str(self.reader.root.parent) + "/", "")  # no server path on the port
                problem = f"the task store's manifest cannot be read ({detail}): no task can be served"
        if problem != self._problem:
            self.log(f"supervisor: warning: {problem}; /ready says 503 until it is fixed" if problem else
                     "supervisor: the task store's manifest is readable: tasks serve")
        self._problem, self._served = problem, problem is None
        return problem
