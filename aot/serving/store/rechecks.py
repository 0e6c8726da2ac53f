"""Refused task versions checked again, so that a version restored after damage serves again without a restart.

A version refused as damaged (a file not as published, missing, or a table block that differs) stays refused for
its requests, but is checked again in the background: first RECHECK_FIRST seconds after it was refused, then after
twice as long each time it is still damaged, at most RECHECK_MAX apart; a check runs only when a request asks for
the version (a version no one asks for costs nothing), one at a time per step process, off the request path. A check
that passes forgets the refusal: the next request loads the version afresh (its files checked again as on any load).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

RECHECK_FIRST = 2.0
RECHECK_MAX = 60.0


@dataclass
class _Refusal:
    due: float  # time.monotonic() of its next check
    delay: float


class Rechecks:
    """`check(version)` raises when the version is still damaged; `passed(version)` is called when it holds."""

    def __init__(self, check: Callable[[str], None], passed: Callable[[str], None]):
        self.check, self.passed = check, passed
        self.checks = 0  # checks run (a test counts them)
        self._refused: dict[str, _Refusal] = {}
        self._running = False
        self._lock = threading.Lock()

    def refused(self, version: str) -> None:
        """`version` was refused now (again, if it was before: the delay stays where its checks left it)."""
        with self._lock:
            if version not in self._refused:
                self._refused[version] = _Refusal(time.monotonic() + RECHECK_FIRST, RECHECK_FIRST)

    def forget(self, version: str) -> None:
        with self._lock:
            self._refused.pop(version, None)

    def asked(self, version: str) -> None:
        """A request asked for refused `version`: its check starts in the background if it is due."""
        with self._lock:
            refusal = self._refused.get(version)
            if self._running or refusal is None or time.monotonic() < refusal.due:
                return
            self._running = True
        threading.Thread(target=self._run, args=(version, refusal), name="aot-recheck", daemon=True).start()

    def _run(self, version: str, refusal: _Refusal) -> None:
        try:
            self.checks += 1
            self.check(version)
        except Exception:  # noqa: BLE001 - still damaged (or unreadable): checked again later
            with self._lock:
                refusal.delay = min(2 * refusal.delay, RECHECK_MAX)
                refusal.due = time.monotonic() + refusal.delay
        else:
            self.forget(version)
            self.passed(version)
        finally:
            with self._lock:
                self._running = False
