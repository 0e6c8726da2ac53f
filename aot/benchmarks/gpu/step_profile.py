"""py-spy of one instance of the served step while a window of `aot bench gpu-perf` loads it: where the step's time
goes (the tokenizer, the heads, the answers, waiting on the GPU), the profile raw beside the results and summarised in
perf.md.

py-spy (PyPI `py-spy`, a static binary: scripts/gpu-kit.sh carries its wheel) samples the stub's Python stacks from
outside (`--nonblocking`: the stub is never paused), `rate` times a second for `seconds`, after `delay` seconds of the
window's load. Its raw output is one line per distinct stack, root first, `frame;frame;... count`; a sample is taken
only of a thread running Python (py-spy leaves idle threads out), so samples / (seconds x rate) is the share of the
time the instance's Python was busy.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

PROFILE_WINDOW = "aot-8-t64-c256"  # AoT, 8 tasks mixed, 64-text requests, c=256: the step under its heaviest load
TOP = 25


def step_pid(serve_pid: int, model: str = "aot") -> int | None:
    """The process of the first instance of `model`'s python step under `aot serve` (its tritonserver's child stub)."""
    import psutil

    from aot.benchmarks.tax.onnx_engine import server_processes

    for child in psutil.Process(serve_pid).children(recursive=True):
        try:
            if child.name() == "tritonserver":
                return server_processes(child.pid).get(model)
        except psutil.Error:
            continue
    return None


def summarise(raw: str, seconds: float, rate: int, top: int = TOP) -> dict:
    """Samples, the busy share, and the frames with the most samples: as the leaf (the step's own time there) and
    anywhere in the stack (time within it)."""
    leaf, inclusive, samples = Counter(), Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        samples += n
        leaf[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n

    def shares(counter: Counter) -> list[dict]:
        return [{"frame": f, "share_of_samples": round(n / samples, 4)} for f, n in counter.most_common(top)]

    expected = seconds * rate
    return {"samples": samples, "expected_samples": round(expected), "busy_share": round(samples / expected, 3)
            if expected else None, "leaf": shares(leaf) if samples else [], "inclusive": shares(inclusive)
            if samples else []}


class StepProfile:
    """py-spy on one instance of the step in a thread of its own, from `delay` seconds after start(); result() joins
    it and gives the summary (or {"error": ...}: a profile that failed never fails the window)."""

    def __init__(self, py_spy: str, serve_pid: int, raw: Path, delay: float = 2.0, seconds: float = 7.0,
                 rate: int = 250):
        self.py_spy, self.serve_pid, self.raw = py_spy, serve_pid, raw
        self.delay, self.seconds, self.rate = delay, seconds, rate
        self._result: dict = {}
        self._thread = threading.Thread(target=self._run, name="aot-py-spy", daemon=True)

    def start(self) -> StepProfile:
        self._thread.start()
        return self

    def _run(self) -> None:
        time.sleep(self.delay)
        pid = step_pid(self.serve_pid)
        if pid is None:
            self._result = {"error": "no instance of the aot step found under the server"}
            return
        command = [self.py_spy, "record", "--pid", str(pid), "--duration", str(round(self.seconds)), "--rate",
                   str(self.rate), "--format", "raw", "--nonblocking", "-o", str(self.raw)]
        self.raw.parent.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=self.seconds + 30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._result = {"error": f"py-spy: {exc}"}
            return
        if done.returncode != 0 or not self.raw.is_file():
            self._result = {"error": f"py-spy exited with {done.returncode}: {done.stderr.strip()[-300:]}"}
            return
        self._result = {"pid": pid, "rate": self.rate, "seconds": self.seconds, "raw": self.raw.name,
                        **summarise(self.raw.read_text(), self.seconds, self.rate)}

    def result(self) -> dict:
        self._thread.join(timeout=self.delay + self.seconds + 60)
        return self._result or {"error": "py-spy did not finish"}
