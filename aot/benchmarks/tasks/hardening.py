"""`aot bench hardening`: the figures of issue 46, each measured through a real tritonserver on one task artifact.

    hung_*        a SeaweedFS store stopped (SIGSTOP: a network partition) `pause_s` seconds while 2 clients loop on a
                  cached task and a third asks for a task never fetched every 2 s: the cached clients' answers,
                  failures, wrong answers and latency before and during; the cold task's answers; /ready meanwhile
    unknown_*     one request for a task that does not exist, at each count of tasks in a folder store (entries as
                  large as a published task's): its latency through the server, and the registry's own cost
    side_*        at the largest count: a client's p50/p99 alone, then beside 2 clients sending made-up names
    damaged_*     at the largest count: a server's start to /ready 200 on the intact store, then with one of its 256
                  shards truncated (ready, with the warning)
    change_*      at the largest count: one change of that many entries (in parts) applied while a client loops:
                  its latency then, the servers' stubs' memory before and after, and the next single publish
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from aot import settings
from aot.benchmarks.report import markdown_table, percentile, write_json, write_text
from aot.benchmarks.served.serve import _texts
from aot.serving.repository import read_repository
from aot.serving.store.writer import TaskStore

BUCKET = "aot-bench-hardening"


@dataclass
class HardeningBenchConfig:
    task: str
    out: str
    counts: tuple[int, ...] = (1000, 10000, 100000)
    pause_s: float = 12.0
    unknown_requests: int = 200
    side_requests: int = 400


class Loop:
    """A client thread sending `task` requests until stopped (or every `every` seconds): each outcome's start time,
    latency (ms), logits or error."""

    def __init__(self, url: str, task: str, text: str, every: float = 0.0):
        self.url, self.task, self.text, self.every = url, task, text, every
        self.outcomes: list[tuple[float, float, np.ndarray | None, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from aot.client.client import Client, InferenceError

        with Client(self.url, retry_seconds=0) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    logits, error = np.array(client.infer(self.task, self.text)["logits"]), None
                except InferenceError as exc:
                    logits, error = None, f"{type(exc).__name__}: {exc}"
                self.outcomes.append((start, (time.monotonic() - start) * 1e3, logits, error))
                if self.every:
                    self._stop.wait(max(0.0, self.every - (time.monotonic() - start)))

    def __enter__(self) -> "Loop":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[tuple]:
        return [o for o in self.outcomes if start <= o[0] < end]


def _hung_store(scratch: Path, model: str, task: str, config: HardeningBenchConfig, text: str) -> dict:
    from aot.client.client import Client
    from aot.exporter.backbone_export import export_backbone
    from aot.exporter.task_export import export_task
    from aot.local.s3_server import LocalS3
    from aot.local.server import LocalServer

    with LocalS3(scratch / "seaweedfs") as s3:
        s3.create_bucket(BUCKET)
        os.environ.update({**s3.environment(), settings.TASK_CACHE_DIR.name: str(scratch / "cache")})
        repo = scratch / "s3-repo"
        export_backbone(model, repo, store=f"s3://{BUCKET}/tasks")
        export_task(task, repo, "s0", "factored", progress=False)
        export_task(task, repo, "s1", "factored", progress=False)
        with LocalServer(repo) as server:
            with Client(server.grpc_url) as client:
                want = np.array(client.infer("s0", text)["logits"])
            readies, cold = [], Loop(server.grpc_url, "s1", text, every=2.0)  # s1: asked only once it is stopped
            with Loop(server.grpc_url, "s0", text) as a, Loop(server.grpc_url, "s0", text) as b:
                time.sleep(5)
                paused = time.monotonic()
                s3.pause()
                try:
                    with cold:
                        while time.monotonic() - paused < config.pause_s:
                            readies.append(server.readiness())
                            time.sleep(0.5)
                finally:
                    s3.resume()
                resumed = time.monotonic()
                with Client(server.grpc_url, retry_seconds=0) as client:
                    while time.monotonic() - resumed < 120:
                        try:
                            client.infer("s1", text)
                            break
                        except Exception:  # noqa: BLE001 - until it serves
                            time.sleep(0.1)
                recovered = time.monotonic() - resumed
            before = a.between(0, paused) + b.between(0, paused)
            during = a.between(paused, resumed) + b.between(paused, resumed)
            cold_during = cold.between(paused, resumed)
    wrong = [o for o in before + during if o[2] is not None and np.abs(o[2] - want).max() > 1e-3]
    return {"hung_pause_s": config.pause_s,
            "hung_cached_before": len(before), "hung_cached_before_p99_ms": percentile([o[1] for o in before], 0.99),
            "hung_cached_during": len(during), "hung_cached_failed": sum(o[3] is not None for o in during),
            "hung_cached_wrong": len(wrong), "hung_cached_p50_ms": percentile([o[1] for o in during], 0.5),
            "hung_cached_p99_ms": percentile([o[1] for o in during], 0.99),
            "hung_cached_max_ms": round(max((o[1] for o in during), default=0.0), 1),
            "hung_cold_requests": len(cold_during), "hung_cold_failed": sum(o[3] is not None for o in cold_during),
            "hung_cold_errors": sorted({o[3].split(";")[0] for o in cold_during if o[3]})[:2],
            "hung_cold_max_ms": round(max((o[1] for o in cold_during), default=0.0), 1),
            "hung_ready_statuses": sorted({s for s, _ in readies}),
            "hung_ready_warning": next((r.get("warnings", [None])[0] for _, r in readies if r.get("warnings")), None),
            "hung_recovered_s": round(recovered, 2)}


def _entries(store: TaskStore, real: str, start: int, count: int) -> dict[str, dict]:
    """`count` entries as large as the published task `real`'s (its digests and meta), folders that need not exist."""
    entry = dict(store.index().parsed.raw[real])
    return {f"u{i:06d}": {**entry, "folder": f"u{i:06d}@{i:012x}"} for i in range(start, start + count)}


def _stub_rss_mb(server) -> float:
    from aot.serving.supervision.procfs import stub_processes

    total = 0
    for stub in stub_processes(server.process.pid):
        try:
            total += int(Path(f"/proc/{stub.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return round(total / 2**20, 1)


def _side(url: str, text: str, requests: int, noise: int) -> dict:
    """A client's latencies on task `real` with `noise` clients each sending about 1.2 made-up names a second."""
    from aot.client.client import Client, InferenceError

    latencies, stop = [], threading.Event()

    def made_up(k: int) -> None:
        with Client(url, retry_seconds=0) as client:
            i = 0
            while not stop.wait(1 / 1.2):
                try:
                    client.infer(f"nosuch-{k}-{i}", text)
                except InferenceError:
                    i += 1

    threads = [threading.Thread(target=made_up, args=(k,), daemon=True) for k in range(noise)]
    for t in threads:
        t.start()
    try:
        with Client(url) as client:
            for _ in range(requests):
                start = time.perf_counter()
                client.infer("real", text)
                latencies.append((time.perf_counter() - start) * 1e3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return {"p50_ms": percentile(latencies, 0.5), "p99_ms": percentile(latencies, 0.99)}


def _unknown(server, repo: Path, requests: int, text: str) -> dict:
    from aot.client.client import Client, TaskNotFound
    from aot.serving.task_registry import TaskRegistry

    latencies = []
    with Client(server.grpc_url) as client:
        for i in range(requests):
            start = time.perf_counter()
            try:
                client.infer(f"nosuch{i}", text)
            except TaskNotFound:
                latencies.append((time.perf_counter() - start) * 1e3)
    registry = TaskRegistry(read_repository(repo).store_root, parts="meta")
    costs = []
    for i in range(requests):
        start = time.perf_counter()
        registry.unknown(f"nosuch{i}", None)
        costs.append((time.perf_counter() - start) * 1e3)
    return {"request_p50_ms": percentile(latencies, 0.5), "request_p99_ms": percentile(latencies, 0.99),
            "registry_ms": round(statistics.median(costs), 3)}


def _many_tasks(scratch: Path, model: str, task: str, config: HardeningBenchConfig, text: str, progress) -> dict:
    from aot.exporter.backbone_export import export_backbone
    from aot.exporter.task_export import export_task
    from aot.local.server import LocalServer
    from aot.serving.store.log import Change, ChangeLog
    from aot.serving.store.shards import shard_key, shard_of

    repo = scratch / "file-repo"
    export_backbone(model, repo)
    export_task(task, repo, "real", "factored", progress=False)
    store = TaskStore.of(read_repository(repo))
    record: dict = {}
    count = 0
    for n in sorted(config.counts):
        store.log.commit(lambda state, n=n, count=count: Change(tasks=_entries(store, "real", count, n - count)))
        count = n
        with LocalServer(repo) as server:
            record[f"unknown_{n}"] = _unknown(server, repo, config.unknown_requests, text)
            progress(1)
            if n == max(config.counts):
                record["side_alone"] = _side(server.grpc_url, text, config.side_requests, 0)
                record["side_beside_made_up_names"] = _side(server.grpc_url, text, config.side_requests, 2)
                record.update(_large_change(server, store, count, text))
                begin = time.perf_counter()
                export_task(task, repo, "real2", "factored", progress=False)
                record["change_next_publish_s"] = round(time.perf_counter() - begin, 2)
            progress(1)
    log = ChangeLog(store.backend)
    files = log.shard_files(log.indexes()[-1])
    shard = shard_of("u000001")
    record["damaged_intact_ready_s"], _ = _ready_seconds(repo)
    path = store.root / shard_key(files[shard], shard)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    record["damaged_ready_s"], ready = _ready_seconds(repo)
    record["damaged_ready_warning"] = (ready.get("warnings") or [None])[0]
    return record


def _large_change(server, store: TaskStore, count: int, text: str) -> dict:
    """`count` more entries in one change while a client loops on `real`: its latency until every step holds it."""
    from aot.client.client import Client
    from aot.serving.store.log import Change, log_key

    before = _stub_rss_mb(server)
    with Client(server.grpc_url) as lister, Loop(server.grpc_url, "real", text) as loop:
        time.sleep(3)
        start = time.monotonic()
        state, _ = store.log.commit(lambda state: Change(tasks=_entries(store, "real", count, count)))
        parts = len(json.loads((store.root / log_key(state.generation)).read_text()).get("parts", []))
        last = f"u{2 * count - 1:06d}"  # listed, or named damaged by the audit (its folder does not exist)
        while time.monotonic() - start < 600:
            listing = lister.tasks(match=last)
            if listing["total"] or last in listing["errors"]:
                break
            time.sleep(0.5)
        applied = time.monotonic() - start
        time.sleep(2)  # the aot steps apply it too, each from its own thread
        during = loop.between(start, time.monotonic())
    return {"change_entries": count, "change_parts": parts, "change_applied_s": round(applied, 1),
            "change_requests": len(during), "change_p99_ms": percentile([o[1] for o in during], 0.99),
            "change_max_ms": round(max((o[1] for o in during), default=0.0), 1),
            "change_failed": sum(o[3] is not None for o in during),
            "change_stub_rss_before_mb": before, "change_stub_rss_after_mb": _stub_rss_mb(server)}


def _ready_seconds(repo: Path) -> tuple[float, dict]:
    """Seconds from a server's start until /ready says 200, and what it says then."""
    from aot.local.server import LocalServer

    begin = time.monotonic()
    with LocalServer(repo) as server:
        while (answer := server.readiness())[0] != 200:
            time.sleep(0.05)
        return round(time.monotonic() - begin, 2), answer[1]


def run_hardening_bench(config: HardeningBenchConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from aot.training.artifact import read_task

    out = Path(config.out)
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-hardening-"))
    saved = dict(os.environ)
    try:
        model = read_task(config.task).backbone["model"]
        text = _texts(1)[0]
        bar = tqdm(total=2 * len(config.counts) + 1, desc="hardening bench", disable=not progress)
        record = {"load_before": os.getloadavg()}
        record.update(_hung_store(scratch, model, config.task, config, text))
        bar.update(1)
        record.update(_many_tasks(scratch, model, config.task, config, text, bar.update))
        record["load_after"] = os.getloadavg()
        bar.close()
        write_json(out / "hardening.json", {"record": record, "config": asdict(config)})
        rows = [{"what": k, "value": json.dumps(v) if isinstance(v, (dict, list)) else v} for k, v in record.items()]
        write_text(out / "hardening.md", markdown_table(rows, ["what", "value"]) + "\n")
        return {"out": str(out), "config": asdict(config)}
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(scratch, ignore_errors=True)
