"""The store's audit: every file of every current task version checked against its published digest in the
background, at a bounded rate, so that a task damaged on disk is named (`aot tasks`, the task_list step's log) before
a request meets it, without start-up reading every task.

The task_list step calls `run(budget)` every few seconds with the bytes it may hash (a serving option, bytes per
second). Versions are visited in turn; a file is hashed when it was never checked or when its stat changed since
(inode, size, modification and status-change times: `touch -d` restores a modification time, not the status-change
time, which only the kernel sets). A version whose files all hold is not hashed again until one changes; a damaged
file is hashed again at each pass, so that a restored one (even through a mapping, which may move no timestamp) is
no longer named. What requests read does not rest on the audit (aot.serving.store.sealed).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from aot.serving.store.digests import DigestError, file_stamp, verify_file
from aot.serving.store.reader import StoreReader, folder_name
from aot.serving.store.view import StoreView

STATS_PER_RUN = 4096  # versions stat'ed at most per run (a stat each file): bounded work with 100,000 tasks


@dataclass
class AuditProgress:
    """What `aot tasks` reports of the audit."""

    versions: int = 0  # current versions in the index
    verified: int = 0  # of them, every file checked since it last changed
    damaged: int = 0
    bytes_hashed: int = 0
    passes: int = 0  # complete rounds over every version
    last_pass_seconds: float | None = None


@dataclass
class _Checked:
    stamps: dict[str, tuple] = field(default_factory=dict)  # file -> its stamp when it was last hashed
    damages: dict[str, str] = field(default_factory=dict)  # file -> what is wrong with it

    @property
    def damage(self) -> str | None:
        return next(iter(self.damages.values()), None)


class TaskAudit:
    def __init__(self, store: StoreReader, view: StoreView):
        self.store, self.view = store, view
        self.progress = AuditProgress()
        self._checked: dict[str, _Checked] = {}  # version -> what the audit knows of it
        self._cursor = 0
        self._pass_started = time.monotonic()
        self._lock = threading.Lock()

    def damage(self, version: str) -> str | None:
        """The damage found in `version`'s files, or None (O(1): a task's answer may ask per request)."""
        checked = self._checked.get(version)
        return None if checked is None else checked.damage

    def damaged(self) -> dict[str, str]:
        """Task name -> the damage found in its current version."""
        index = self.view.index
        with self._lock:
            return {name: c.damage for name, e in index.entries.items()
                    if (c := self._checked.get(e.folder)) is not None and c.damage}

    def run(self, budget_bytes: int) -> None:
        """Check the next versions in turn, hashing at most about `budget_bytes` (a file started is finished)."""
        entries = sorted(self.view.index.entries.values(), key=lambda e: e.folder)
        with self._lock:
            live = {e.folder for e in entries}
            for version in [v for v in self._checked if v not in live]:
                del self._checked[version]
        self.progress.versions = len(entries)
        spent = 0
        for _ in range(min(len(entries), STATS_PER_RUN)):
            if spent >= budget_bytes:
                break
            if self._cursor >= len(entries):
                self._cursor = 0
                self.progress.passes += 1
                self.progress.last_pass_seconds = round(time.monotonic() - self._pass_started, 1)
                self._pass_started = time.monotonic()
            entry = entries[self._cursor]
            self._cursor += 1
            spent += self._check(entry.name, entry.folder, entry.digests)
        self.progress.bytes_hashed += spent
        with self._lock:
            self.progress.verified = sum(1 for c in self._checked.values() if c.stamps and not c.damages)
            self.progress.damaged = sum(1 for c in self._checked.values() if c.damage)

    def _check(self, name: str, version: str, digests: dict[str, str] | None) -> int:
        """Hash the files of `version` that changed since they were last checked; the bytes hashed."""
        if not digests:
            return 0
        if self.store.remote:  # what this replica keeps of it: its cached copy, if it fetched one
            folder = self.store.cache.root / folder_name(version)
            if not folder.is_dir():
                return 0
        else:
            folder = self.store.version_folder(version)
        with self._lock:
            checked = self._checked.setdefault(version, _Checked())
        hashed = 0
        for file in sorted(digests):
            try:
                stamp = file_stamp(folder / file)
            except OSError as exc:
                checked.damages[file] = f"task {name!r} ({version}) is corrupt: {file}: {exc.strerror}"
                checked.stamps.pop(file, None)
                continue
            if checked.stamps.get(file) == stamp and file not in checked.damages:  # a damaged one: every pass
                continue
            checked.stamps[file] = stamp
            hashed += stamp[1]
            try:
                verify_file(folder / file, digests, version)
                checked.damages.pop(file, None)
            except (DigestError, OSError) as exc:
                checked.damages[file] = f"task {name!r} ({version}) is corrupt: {exc}"
        return hashed
