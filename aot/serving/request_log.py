"""The optional request log: one JSON line per sampled item (a text of a request; a request of one text is one line)
and step, appended by every step instance.

    {"time": "2025-01-31T12:00:00.123Z", "step": "aot", "task": "acme/intent", "tenant": "acme",
     "version": "acme/intent@3f2a9c41d0e7", "latency_ms": 12.4, "status": "OK"}

`status` is the gRPC status name the client saw (aot.serving.errors.STATUS); `task` is the task a request named (as
sent, cut to 128 characters, when the store does not hold it; null when it named none), `version` the version that
served it (null if none did) and `tenant` that version's tenant, as the metrics label it ("" for a public task; null
when no version served: a name the store does not hold says nothing of a tenant). The request's text (`text`, `text_pair`) is written only when asked: texts are the
callers' data. Configured by the environment of the server (what `aot serve --request-log` sets; in a container,
its environment): AOT_REQUEST_LOG (the file; its folder must exist), AOT_REQUEST_LOG_SAMPLE (the share of texts
written, 0 to 1, default 1) and AOT_REQUEST_LOG_TEXT=1. The file is created 0600 and opened for appending: each
batch's lines are one write, so the lines of several instances never interleave, and a log rotation that truncates
the file (copytruncate) loses nothing that comes after it. On the GPU ensembles each step samples on its own.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from aot import settings
from aot.serving.store.tenants import tenant_of

TASK_CHARACTERS = 128  # of a task name the store does not hold (a client's string)


@dataclass(frozen=True)
class RequestLogSettings:
    path: str
    sample: float = 1.0
    text: bool = False

    def __post_init__(self):
        if not 0.0 <= self.sample <= 1.0:
            raise ValueError(f"request log sample {self.sample!r}: expected a share of requests from 0 to 1")

    @classmethod
    def from_environment(cls, environ: dict | None = None) -> "RequestLogSettings | None":
        """The settings the environment names (module docstring), or None: no request log."""
        path = settings.REQUEST_LOG.read(environ)
        if not path:
            return None
        return cls(path, settings.REQUEST_LOG_SAMPLE.read(environ), settings.REQUEST_LOG_TEXT.read(environ))

    def as_environment(self) -> dict[str, str]:
        return {settings.REQUEST_LOG.name: self.path, settings.REQUEST_LOG_SAMPLE.name: repr(self.sample),
                settings.REQUEST_LOG_TEXT.name: "1" if self.text else "0"}


@dataclass(frozen=True)
class LoggedRequest:
    """One request as the log writes it."""

    task: str | None
    version: str | None
    latency: float  # seconds
    status: str  # gRPC status name
    text: str | None = None
    text_pair: str | None = None


class RequestLog:
    """Appends sampled requests to the settings' file (opened once per step instance)."""

    def __init__(self, settings: RequestLogSettings, step: str, chance: Callable[[], float] = random.random):
        self.settings, self.step, self._chance = settings, step, chance
        try:
            self._fd = os.open(settings.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ValueError(f"request log {settings.path}: cannot be opened for appending ({exc.strerror})") from None

    def sampled(self) -> bool:
        """Whether to write the next request (each request drawn on its own)."""
        return self.settings.sample >= 1.0 or self._chance() < self.settings.sample

    def write(self, requests: list[LoggedRequest]) -> None:
        """One line per request, in one write."""
        if not requests:
            return
        now = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        lines = []
        for r in requests:
            line = {"time": now, "step": self.step, "task": r.task and r.task[:TASK_CHARACTERS],
                    "tenant": None if r.version is None else tenant_of(r.version) or "", "version": r.version,
                    "latency_ms": round(r.latency * 1e3, 3), "status": r.status}
            if self.settings.text:
                line |= {"text": r.text, "text_pair": r.text_pair}
            lines.append(json.dumps(line, ensure_ascii=False) + "\n")
        os.write(self._fd, "".join(lines).encode("utf-8", "replace"))

    def close(self) -> None:
        os.close(self._fd)
