"""The load of `aot bench gpu-perf`: NVIDIA's perf_analyzer (the judge the issue names), or where it cannot run (this
development machine's glibc is older than its wheel's manylinux_2_38) a stand-in that says so; and the GPU's
utilisation sampled beside every window.

perf_analyzer reads the restricted model config and statistics, so it carries the admin key as gRPC metadata
(`-H triton-grpc-protocol-aot-admin-key:KEY`); its `-b N` sends N texts a request, each a copy of one entry of the
input file (TEXT and TASK of shape [1]), and its "Inferences/Second" counts texts, not requests.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from aot.serving.supervision.admin_key import GRPC_ADMIN_HEADER

PERF_ANALYZER = "perf_analyzer"
STAND_IN = "stand-in (aot.Client.infer_many), not perf_analyzer"
STABILITY_PERCENT = 50  # perf_analyzer's default of 10 asks for more windows than a call of the device tool holds
MAX_TRIALS = 4  # windows of one measurement: three stable ones, after the first that fills the server's queue
RATE_GUESS = 3000.0  # texts/s assumed of a request size not measured yet (the H100 served 4,000-7,000 at 64 texts)
LATENCIES_PER_INTERVAL = 2  # a window lasts at least this many requests' latency
MAX_INTERVAL_MS = 8000
REQUIRED_COLUMNS = ("Concurrency", "Inferences/Second", "p50 latency", "p99 latency")


class LoadError(RuntimeError):
    """A window that gave no figures: perf_analyzer failed, or every request of the stand-in did."""


@dataclass(frozen=True)
class Window:
    """One measurement: `model` (vanilla, aot-1: one task, aot-8: eight tasks mixed) at `concurrency` requests in
    flight, `texts` texts a request."""

    model: str
    texts: int
    concurrency: int

    @property
    def served(self) -> str:
        """The model the server names: the vanilla ensemble, or `aot` for either AoT load."""
        return "vanilla" if self.model == "vanilla" else "aot"

    @property
    def tasks(self) -> int:
        return 8 if self.model == "aot-8" else 1

    @property
    def name(self) -> str:
        return f"{self.model}-t{self.texts}-c{self.concurrency}"


def input_data(texts: list[str], tasks: list[str]) -> dict:
    """perf_analyzer's --input-data JSON (docs/perf_analyzer_input.json's shape): one entry per text, its task the
    next of `tasks` in turn."""
    return {"data": [{"TEXT": {"content": [text], "shape": [1]}, "TASK": {"content": [tasks[i % len(tasks)]],
                                                                          "shape": [1]}}
                     for i, text in enumerate(texts)]}


def interval_ms(window: Window, rate: float, base_ms: int) -> int:
    """perf_analyzer's window for `window`: `base_ms`, or longer where its requests take long. In a closed loop at
    `rate` texts/s, a request of window.texts texts waits for the window.concurrency - 1 before it: a latency of
    texts x concurrency / rate (64-text requests at c=256 and 7,000 texts/s: 2.3 s, longer than the 1.5 s windows that
    found no stable figure on the H100); a window holds LATENCIES_PER_INTERVAL of them, at most MAX_INTERVAL_MS."""
    latency_ms = window.texts * window.concurrency / rate * 1000
    return int(min(MAX_INTERVAL_MS, max(base_ms, LATENCIES_PER_INTERVAL * latency_ms)))


def perf_analyzer_command(binary: str, window: Window, url: str, admin_key: str, data: Path, csv_file: Path,
                          interval_ms: int) -> list[str]:
    """One window of perf_analyzer over gRPC: synchronous (one thread per request in flight), `window.texts` texts
    a request (-b), windows of `interval_ms` (interval_ms()) of which three in a row must agree within
    STABILITY_PERCENT, at most MAX_TRIALS of them."""
    return [binary, "-m", window.served, "-u", url, "-i", "grpc", "-H", f"{GRPC_ADMIN_HEADER}:{admin_key}",
            "--input-data", str(data), "-b", str(window.texts), "--concurrency-range", str(window.concurrency),
            "--measurement-interval", str(interval_ms), "--stability-percentage", str(STABILITY_PERCENT),
            "--max-trials", str(MAX_TRIALS), "-f", str(csv_file)]


def shown(command: list[str]) -> str:
    """A command as the log shows it: the admin key replaced by KEY."""
    return " ".join(f"{GRPC_ADMIN_HEADER}:KEY" if part.startswith(f"{GRPC_ADMIN_HEADER}:") else part
                    for part in command)


def parse_perf_analyzer_csv(text: str, texts_per_request: int) -> dict:
    """The figures of perf_analyzer's `-f` CSV (one concurrency): texts/s ("Inferences/Second" counts each text of a
    request), requests/s, and the latencies of a request, which it writes in microseconds."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise LoadError(f"perf_analyzer's CSV has no measurement: {text[:200]!r}")
    missing = [c for c in REQUIRED_COLUMNS if c not in rows[0]]
    if missing:
        raise LoadError(f"perf_analyzer's CSV lacks the columns {missing}; its header: {list(rows[0])}")
    row = rows[-1]
    texts_per_s = float(row["Inferences/Second"])
    figures = {"texts_per_s": round(texts_per_s, 1), "requests_per_s": round(texts_per_s / texts_per_request, 1)}
    for column in (c for c in row if c.endswith(" latency") and c.startswith("p")):
        figures[f"{column.split()[0]}_ms"] = round(float(row[column]) / 1000, 3)
    if row.get("Server Queue"):
        figures["server_queue_ms"] = round(float(row["Server Queue"]) / 1000, 3)
        figures["server_compute_ms"] = round(sum(float(row.get(c) or 0) for c in (
            "Server Compute Input", "Server Compute Infer", "Server Compute Output")) / 1000, 3)
    return figures


def run_perf_analyzer(command: list[str], csv_file: Path, log: Path, texts_per_request: int, timeout: float) -> dict:
    """Run one window; its output goes to `log`. A failed run (an unstable measurement, a refused request) raises
    LoadError with the last lines it printed."""
    csv_file.unlink(missing_ok=True)
    with log.open("w") as out:
        out.write(shown(command) + "\n")
        out.flush()
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise LoadError(f"perf_analyzer ran past {timeout:.0f} s (log: {log})") from None
    if done.returncode != 0 or not csv_file.is_file():
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
        raise LoadError(f"perf_analyzer exited with {done.returncode}: {tail}")
    return parse_perf_analyzer_csv(csv_file.read_text(), texts_per_request)


def run_stand_in(url: str, window: Window, items: list[dict], requests: int) -> dict:
    """The rehearsal's load: `requests` requests of `window.texts` items each through aot.Client.infer_many (one
    request per call), at most `window.concurrency` in flight; figures in perf_analyzer's terms."""
    from aot.benchmarks.served.serve import closed_loop
    from aot.client.client import Client

    packs = [[items[(r * window.texts + k) % len(items)] for k in range(window.texts)] for r in range(requests)]

    @contextlib.contextmanager
    def sender():
        with Client(url, model=window.served) as client:
            def send(pack: list[dict]) -> None:
                failed = [a["error"] for a in client.infer_many(pack, concurrency=1, pack=len(pack)) if "error" in a]
                if failed:
                    raise LoadError(f"{len(failed)} of {len(pack)} texts failed: {failed[0]}")
            yield send

    start = time.perf_counter()
    try:
        loop = closed_loop(sender, packs, min(window.concurrency, requests))
    except RuntimeError as exc:
        raise LoadError(str(exc)) from None
    if loop["errors"]:
        raise LoadError(f"{loop['errors']} of {requests} requests failed")
    wall = time.perf_counter() - start
    return {"texts_per_s": round(requests * window.texts / wall, 1), "requests_per_s": round(requests / wall, 1),
            "p50_ms": loop["p50_ms"], "p99_ms": loop["p99_ms"]}


def parse_utilisation(line: str) -> float | None:
    """One line of `nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits`: a percentage, or None
    for what it cannot read ("[N/A]", a blank line)."""
    try:
        return float(line.strip())
    except ValueError:
        return None


def summarise_utilisation(samples: list[tuple[float, float]], start: float, end: float) -> dict:
    """Mean and max of the samples taken between `start` and `end` (time.monotonic()); None without samples."""
    values = [v for t, v in samples if start <= t <= end]
    if not values:
        return {"gpu_util_mean": None, "gpu_util_max": None, "gpu_util_samples": 0}
    return {"gpu_util_mean": round(sum(values) / len(values), 1), "gpu_util_max": max(values),
            "gpu_util_samples": len(values)}


class UtilisationSampler:
    """nvidia-smi sampling the GPU's utilisation every 100 ms in the background, each sample stamped on arrival; on
    a machine without nvidia-smi it samples nothing (`available` False) and every window reports None."""

    COMMAND = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"]

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self.available = shutil.which(self.COMMAND[0]) is not None
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> UtilisationSampler:
        if self.available:
            self._process = subprocess.Popen(self.COMMAND, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                             text=True)
            self._reader = threading.Thread(target=self._read, name="aot-gpu-utilisation", daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            value = parse_utilisation(line)
            if value is not None:
                self.samples.append((time.monotonic(), value))

    def between(self, start: float, end: float) -> dict:
        return summarise_utilisation(list(self.samples), start, end)

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._reader.join(timeout=5)


def write_input_data(path: Path, texts: list[str], tasks: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(input_data(texts, tasks), indent=1))
    return path
