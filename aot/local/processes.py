"""Stopping a helper process that runs in a process group of its own (HAProxy, SeaweedFS): SIGTERM to the group,
SIGKILL after a grace period, reaped either way."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(process: subprocess.Popen, grace: float, resume: bool = False) -> None:
    """`resume`: send SIGCONT first (a stopped group cannot act on SIGTERM)."""
    if process.poll() is not None:
        return
    if resume:
        os.killpg(process.pid, signal.SIGCONT)
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
