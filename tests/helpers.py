"""Shared set-up for export and serving tests: tiny tasks and repositories, a load of clients, the CLI's errors."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from aot.exporter.backbone_export import export_backbone
from aot.exporter.task_export import export_task
from aot.training.api import train_task

QUICK = dict(batch_size=16, epochs=3, patience=3, max_length=32, progress=False)


def train_tiny_task(model_dir: Path, data_dir: Path, out: Path, method: str = "fc", seed: int = 0, **kw) -> Path:
    # lr 3e-3, inside the paper's range: at 1e-2 (or 5e-3) tiny Kron tasks grow rows so large that their fp16 table
    # misses the exporter's 1e-3 logit tolerance (it then refuses them, as it should).
    train_task(model=str(model_dir), data=str(data_dir), method=method, out=str(out), lr=3e-3, seed=seed,
               **{**QUICK, **kw})
    return out


TINY_TASKS = (("alpha", "fc"), ("beta", "kron"), ("gamma", "fc"), ("delta", "fc"))  # name, method; seed = position


def train_tiny_tasks(model_dir: Path, data_dir: Path, root: Path, count: int) -> dict[str, Path]:
    """The first `count` of TINY_TASKS trained under `root`: the modules' shared cast of tasks."""
    return {name: train_tiny_task(model_dir, data_dir, root / name, method, seed=seed)
            for seed, (name, method) in enumerate(TINY_TASKS[:count])}


def make_repository(model_dir: Path, repo: Path, tasks: dict[str, tuple[Path, str]], **options) -> Path:
    """A repository with `tasks`: name -> (artifact, storage)."""
    from aot.serving.repository import ServingOptions

    export_backbone(str(model_dir), repo, ServingOptions(**options) if options else None)
    for name, (artifact, storage) in tasks.items():
        export_task(artifact, repo, name, storage, progress=False)
    return repo


# Every model of a repository's CPU configs: the fused `aot` / `vanilla` clients call, and the GPU ensembles' separate
# steps, which a CPU server loads only when asked (tests call them directly: they run the same stages)
WITH_STEPS = ("aot", "vanilla", "task_list", "tokenizer", "backbone", "backbone_vanilla", "head")


def serve_for_tests(request, repo: Path, load: tuple[str, ...] | None = None):
    """A LocalServer for a test module's fixture (yield from it); prints the server's log when a test failed.
    `load`: the models to load (default: what the CPU configs serve clients)."""
    from aot.local.server import LocalServer

    failed_before = request.session.testsfailed
    server = LocalServer(repo, load=load).start()
    yield server
    if request.session.testsfailed > failed_before:  # before stop(), which removes a temporary log
        print(f"\n--- tritonserver log ({server.log_path}) ---\n{server.log_tail(80)}")
    server.stop()


def wait_until(condition: Callable, seconds: float, what: str):
    """Wait for `condition()` to be truthy (its value), polling; fail naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} within {seconds:.0f} s"
        time.sleep(0.2)
    return value


def run_cli(*argv: str, exit_code: int = 0) -> tuple[list[dict], str]:
    """`aot ...` run in this process (it must exit `exit_code`): its JSON lines on stdout, and its stderr."""
    import contextlib
    import io
    import json

    from aot.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(list(argv)) == exit_code, err.getvalue()
    return [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue().strip()


def one_line_error(capsys) -> str:
    """What the CLI wrote on stderr, which must be one line."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@dataclass
class Outcome:
    """One request of a Load: its task, the index of its text, when it was sent and answered (time.time()), and the
    answer's logits or the error."""

    task: str
    text: int
    start: float
    end: float
    logits: np.ndarray | None
    error: str | None


class Load:
    """`clients` threads, each with a Client of its own, send request j of client k, `pick(k, j)` -> (task, index in
    `texts`), `requests` times each or, with requests=None, until stopped; every Outcome is recorded.

    A context manager: its block runs while they send; at its end they are joined, stopped first when the block
    raised or when they have no request count."""

    def __init__(self, url: str, texts: list[str], clients: int, pick: Callable[[int, int], tuple[str, int]],
                 requests: int | None = None, timeout: float = 60.0, retry_seconds: float | None = None):
        self.url, self.texts, self.pick, self.requests, self.timeout = url, texts, pick, requests, timeout
        self.retry_seconds = retry_seconds  # None: the client's default; 0: every failure the server answers is seen
        self.outcomes: list[Outcome] = []  # appended by every client (list.append is atomic)
        self._stop = threading.Event()
        self._clients = [threading.Thread(target=self._send, args=(k,)) for k in range(clients)]

    def _send(self, k: int) -> None:
        from aot.client.client import Client, InferenceError

        retry = {} if self.retry_seconds is None else {"retry_seconds": self.retry_seconds}
        with Client(self.url, timeout=self.timeout, **retry) as client:
            for j in range(self.requests) if self.requests is not None else itertools.count():
                if self._stop.is_set():
                    return
                task, i = self.pick(k, j)
                start = time.time()
                try:
                    logits, error = np.array(client.infer(task, self.texts[i])["logits"]), None
                except InferenceError as exc:
                    logits, error = None, str(exc)
                self.outcomes.append(Outcome(task, i, start, time.time(), logits, error))

    def wait_for(self, count: float) -> None:
        """Until `count` outcomes are recorded, or the clients stopped sending."""
        while len(self.outcomes) < count and not self._stop.is_set() and any(t.is_alive() for t in self._clients):
            time.sleep(0.02)

    def stop(self) -> None:
        """No client sends another request (those under way finish)."""
        self._stop.set()

    def __enter__(self) -> "Load":
        for thread in self._clients:
            thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None or self.requests is None:
            self.stop()
        for thread in self._clients:
            thread.join()
