"""What a python step instance tells the supervisor through shared memory: when its current `execute` began, and the
warnings its start left (a CUDA graph that could not be captured: the supervisor's /ready says so).

When: the supervisor finds one instance stuck in a batch even while another instance of the same model answers its
liveness probes (probes go to whichever instance is free: with 2 fused instances, or 6 tokenizer and head instances
on a GPU, a deadlocked instance would otherwise hold its batch forever, unseen). A file per instance in shared
memory, /dev/shm/aot-busy-<tritonserver pid>-<instance>, holds one float: the CLOCK_MONOTONIC time (system-wide on
Linux) the running `execute` began, 0 between batches. Writing it is one pwrite per batch (a few microseconds).

Warnings: /dev/shm/aot-notes-<tritonserver pid>-<instance>, one line each, written at start (never per request).

And the other way, what the supervisor tells the steps: /dev/shm/aot-stopping-<tritonserver pid> exists once the
server stops (a graceful stop's end: aot.serving.supervision.lifecycle), and the first step refuses new requests
from then on (aot.serving.rate_limits), on either protocol, while it finishes those it accepted."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

from aot.serving.shm import SHM

PREFIX = "aot-busy-"
NOTES = "aot-notes-"
STOPPING = "aot-stopping-"
_VALUE = struct.Struct("d")


def watch_path(server_pid: int, instance: str) -> Path:
    return SHM / f"{PREFIX}{server_pid}-{instance}"


class ExecuteWatch:
    """The stub's side: `with watch:` around each `execute`."""

    def __init__(self, instance: str):
        self.path = watch_path(os.getppid(), instance)  # the stub's parent is tritonserver
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(self.fd, _VALUE.pack(0.0), 0)

    def __enter__(self) -> "ExecuteWatch":
        os.pwrite(self.fd, _VALUE.pack(time.monotonic()), 0)
        return self

    def __exit__(self, *exc) -> None:
        os.pwrite(self.fd, _VALUE.pack(0.0), 0)


def busy_since(server_pid: int, instance: str) -> float | None:
    """The supervisor's side: when the instance's running `execute` began (time.monotonic()), or None when it runs
    none (or has no watch file: a step of another kind, or one that has not started)."""
    try:
        data = watch_path(server_pid, instance).read_bytes()
    except OSError:
        return None
    if len(data) != _VALUE.size:
        return None
    since = _VALUE.unpack(data)[0]
    return since or None


def add_note(instance: str, line: str) -> None:
    """The stub's side: a warning for the supervisor's /ready (one line; the instance's notes accumulate)."""
    path = SHM / f"{NOTES}{os.getppid()}-{instance}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (" ".join(line.split()) + "\n").encode("utf-8"))
    finally:
        os.close(fd)


def notes(server_pid: int) -> list[str]:
    """The supervisor's side: every warning the server's step instances left, each once, in order."""
    lines: dict[str, None] = {}
    for path in sorted(SHM.glob(f"{NOTES}{server_pid}-*")):
        try:
            lines.update(dict.fromkeys(path.read_text("utf-8", "replace").splitlines()))
        except OSError:
            continue
    return [line for line in lines if line]


def remove_watch(server_pid: int, instance: str) -> None:
    """An instance that left the server: its watch file and notes."""
    watch_path(server_pid, instance).unlink(missing_ok=True)
    (SHM / f"{NOTES}{server_pid}-{instance}").unlink(missing_ok=True)


def remove_watches(server_pid: int) -> None:
    """After the server exited: its instances' watch files and notes, and its stop mark."""
    for prefix in (PREFIX, NOTES):
        for path in SHM.glob(f"{prefix}{server_pid}-*"):
            path.unlink(missing_ok=True)
    stopping_path(server_pid).unlink(missing_ok=True)


def stopping_path(server_pid: int) -> Path:
    return SHM / f"{STOPPING}{server_pid}"


def mark_stopping(server_pid: int) -> None:
    """The supervisor's side: the server stops; its steps take no new request from now on."""
    os.close(os.open(stopping_path(server_pid), os.O_WRONLY | os.O_CREAT, 0o600))


def server_stopping() -> bool:
    """The stub's side: whether its server stops (mark_stopping; a mark another user made does not count); one
    stat."""
    try:
        return os.stat(f"{SHM}/{STOPPING}{os.getppid()}").st_uid == os.getuid()
    except OSError:
        return False
