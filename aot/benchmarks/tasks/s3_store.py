"""`aot bench s3`: the task store in S3-compatible object storage (a SeaweedFS started here, aot.local.s3_server)
against the store on the file system, on tasks derived from one trained task
(aot.benchmarks.tasks.scale.DerivedStore), as
`aot serve` runs them by default. Measured in one run:

    cached_rps_file, cached_rps_s3, cached_ratio   closed loops over `hot` tasks, every one cached, on a server of
                                                   each store, interleaved `repeats` times (medians)
    ready_one_s, ready_many_s, ready_ratio         a replica's start with 1 task in the bucket (after one start not
                                                   measured: the page cache), then with `tasks`
    fetched_at_start                               task versions in the replica's cache once it is ready (0: it
                                                   read the index and no task)
    cold_p50_ms, cold_p99_ms                       first requests of tasks not yet cached, one at a time
    busy_cold_*, busy_warm_p50_ms                  as many others while `concurrency` - 1 clients keep a cached
                                                   task busy, and the cached requests' p50 meanwhile
    paused_*                                       the store stopped (SIGSTOP) `pause_s` seconds under load on cached
                                                   tasks: answers and failures; a cold task's answer meanwhile; the
                                                   seconds until it serves once the store is back
    publish_to_every_replica_s                     a fleet of 2 replicas (`aot serve --replicas 2`): one task
                                                   published, until each replica answers it (`publishes` times)
"""

from __future__ import annotations

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
from aot.benchmarks.served.serve import _closed_loop, _texts
from aot.benchmarks.tasks.scale import DerivedStore, _name
from aot.benchmarks.tasks.scale_cold import cold_under_load
from aot.serving.repository import read_repository
from aot.serving.store.writer import TaskStore

BUCKET = "aot-bench"


@dataclass
class S3BenchConfig:
    task: str
    out: str
    tasks: int = 10000
    hot: int = 8
    requests: int = 800
    concurrency: int = 8
    repeats: int = 2
    cold: int = 50
    pause_s: float = 30.0
    publishes: int = 5
    batch: int = 500


def _cached_rps(repos: dict[str, Path], config: S3BenchConfig, texts: list[str]) -> dict:
    """Closed loops over the `hot` tasks on a server of each store, interleaved; the first loop of each server
    fetches and loads every task (not measured)."""
    from aot.local.server import LocalServer

    items = [(_name(j % config.hot), texts[j % len(texts)]) for j in range(config.requests)]
    runs: dict[str, list[float]] = {kind: [] for kind in repos}
    errors = 0
    for _ in range(config.repeats):
        for kind, repo in repos.items():
            with LocalServer(repo) as server:
                _closed_loop(server.grpc_url, "aot", items, config.concurrency)
                run = _closed_loop(server.grpc_url, "aot", items, config.concurrency)
                runs[kind].append(run["throughput_rps"])
                errors += run["errors"]
    file_rps, s3_rps = statistics.median(runs["file"]), statistics.median(runs["s3"])
    return {"cached_rps_file": round(file_rps, 1), "cached_rps_s3": round(s3_rps, 1),
            "cached_ratio": round(s3_rps / file_rps, 3), "cached_runs": runs, "cached_errors": errors}


def _ready(repo: Path, cache: Path) -> dict:
    """One replica's start on an empty cache: seconds to ready, and the versions it fetched meanwhile."""
    from aot.local.server import LocalServer

    shutil.rmtree(cache, ignore_errors=True)
    with LocalServer(repo) as server:
        fetched = len([p for p in cache.glob("*@*")]) if cache.is_dir() else 0
        return {"ready_s": round(server.ready_seconds, 2), "fetched": fetched}


def _under_pause(server, s3, config: S3BenchConfig, texts: list[str], cold_task: str) -> dict:
    """Load on the cached tasks while the store is stopped; a cold task asked meanwhile and after."""
    from aot.client.client import Client, InferenceError

    answers, failures, stop = [], [], threading.Event()  # list.append is atomic

    def load(k: int) -> None:
        with Client(server.grpc_url) as client:
            j = k
            while not stop.is_set():
                try:
                    client.infer(_name(j % config.hot), texts[j % len(texts)])
                    answers.append(j)
                except Exception as exc:  # noqa: BLE001 - every failure counts, whatever its kind
                    failures.append(f"{type(exc).__name__}: {exc}")
                j += config.concurrency

    threads = [threading.Thread(target=load, args=(k,)) for k in range(config.concurrency)]
    with Client(server.grpc_url) as client:
        for t in threads:
            t.start()
        cold_error = None
        try:
            time.sleep(1)
            s3.pause()
            paused = time.monotonic()
            try:
                time.sleep(1)
                try:
                    client.infer(cold_task, texts[0])
                except InferenceError as exc:
                    cold_error = f"{type(exc).__name__}: {exc}"
                time.sleep(max(0.0, config.pause_s - (time.monotonic() - paused)))
            finally:
                s3.resume()
            resumed = time.monotonic()
            while True:
                try:
                    client.infer(cold_task, texts[0])
                    break
                except InferenceError:
                    if time.monotonic() - resumed > 120:
                        raise RuntimeError(f"{cold_task} did not serve within 120 s of the store's return") from None
                    time.sleep(0.1)
            recovered = time.monotonic() - resumed
        finally:
            stop.set()
            for t in threads:
                t.join()
    return {"paused_s": config.pause_s, "paused_answers_cached": len(answers), "paused_failures_cached": len(failures),
            "paused_failure_examples": sorted(set(failures))[:3], "paused_cold_error": cold_error,
            "paused_cold_recovered_s": round(recovered, 2)}


def _cold_and_pause(repo: Path, s3, total: int, config: S3BenchConfig, texts: list[str]) -> dict:
    """On one replica of the store of `total` tasks: first requests of untouched tasks, idle and while clients keep a
    cached task busy (aot.benchmarks.tasks.scale_cold), then the store paused."""
    from aot.client.client import Client
    from aot.local.server import LocalServer

    rng = np.random.default_rng(0)
    picks = rng.choice(np.arange(config.hot, total), size=min(2 * config.cold + 1, total - config.hot), replace=False)
    busy = [_name(int(i)) for i in picks[config.cold:-1]]
    with LocalServer(repo) as server:
        latencies = []
        with Client(server.grpc_url) as client:
            _closed_loop(server.grpc_url, "aot", [(_name(j % config.hot), texts[0]) for j in range(64)], 4)  # cached
            for i in picks[:min(config.cold, len(picks) - 1)]:
                start = time.perf_counter()
                client.infer(_name(int(i)), texts[0])
                latencies.append((time.perf_counter() - start) * 1e3)
        loaded = cold_under_load(server.grpc_url, _name(0), texts, {"": busy}, config.concurrency)
        paused = _under_pause(server, s3, config, texts, _name(int(picks[-1])))
    return {"cold_p50_ms": percentile(latencies, 0.5), "cold_p99_ms": percentile(latencies, 0.99), **loaded, **paused}


def _publish_to_fleet(repo: Path, derived: DerivedStore, config: S3BenchConfig, texts: list[str]) -> dict:
    """A fleet of 2 on the bucket: each publish timed until every replica answers the new task."""
    from aot.client.client import Client, InferenceError
    from aot.local.fleet import Fleet

    seconds = []
    with Fleet(repo, replicas=2) as fleet:
        fleet.wait_all_up(timeout=60)
        clients = [Client(s.grpc_url) for s in fleet.servers]
        try:
            for _ in range(config.publishes):
                name = _name(derived.count)
                folder = derived.folder(derived.count)
                start = time.perf_counter()
                derived.store.publish(name, folder, "factored")
                derived.count += 1
                waiting = set(range(len(clients)))
                while waiting:
                    for k in sorted(waiting):
                        try:
                            clients[k].infer(name, texts[0])
                            waiting.discard(k)
                        except InferenceError:
                            pass
                    if time.perf_counter() - start > 60:
                        raise RuntimeError(f"{name} was not served by every replica within 60 s")
                    time.sleep(0.01)
                seconds.append(time.perf_counter() - start)
        finally:
            for client in clients:
                client.close()
    return {"publish_to_every_replica_s": [round(s, 2) for s in seconds],
            "publish_to_every_replica_p50_s": round(statistics.median(seconds), 2),
            "publish_to_every_replica_max_s": round(max(seconds), 2)}


def run_s3_bench(config: S3BenchConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from aot.exporter.backbone_export import export_backbone
    from aot.exporter.task_export import export_task
    from aot.local.s3_server import LocalS3
    from aot.training.artifact import read_task

    out = Path(config.out)
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-s3-"))
    saved = dict(os.environ)
    try:
        with LocalS3(scratch / "seaweedfs") as s3:
            s3.create_bucket(BUCKET)
            cache = scratch / "cache"
            os.environ.update({**s3.environment(), settings.TASK_CACHE_DIR.name: str(cache)})  # this process and the servers
            model = read_task(config.task).backbone["model"]
            repos = {"file": scratch / "file-repo", "s3": scratch / "s3-repo"}
            export_backbone(model, repos["file"])
            export_backbone(model, repos["s3"], store=f"s3://{BUCKET}/tasks")
            stores = {kind: TaskStore.of(read_repository(repo)) for kind, repo in repos.items()}
            report = export_task(config.task, repos["file"], "master", "factored", progress=False)
            master = scratch / "master"
            shutil.copytree(stores["file"].root / report.folder, master)
            stores["file"].remove("master")
            derived = {kind: DerivedStore(store, master) for kind, store in stores.items()}
            texts = _texts(64)
            record: dict = {"tasks": config.tasks}
            derived["s3"].grow(1, 1, lambda n: None)
            _ready(repos["s3"], cache)  # the first start warms the page cache and imports: not measured
            one = _ready(repos["s3"], cache)
            for d in derived.values():
                d.grow(config.hot, config.batch, lambda n: None)
            record.update(_cached_rps(repos, config, texts))
            bar = tqdm(total=config.tasks, initial=config.hot, desc="tasks into the bucket", unit="task",
                       disable=not progress)
            derived["s3"].grow(config.tasks, config.batch, bar.update)
            bar.close()
            many = _ready(repos["s3"], cache)
            record.update({"ready_one_s": one["ready_s"], "ready_many_s": many["ready_s"],
                           "ready_ratio": round(many["ready_s"] / one["ready_s"], 2),
                           "fetched_at_start": one["fetched"] + many["fetched"]})
            record.update(_cold_and_pause(repos["s3"], s3, config.tasks, config, texts))
            record.update(_publish_to_fleet(repos["s3"], derived["s3"], config, texts))
            write_s3_reports(record, out, config)
        return {"out": str(out), "config": asdict(config)}
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(scratch, ignore_errors=True)


def write_s3_reports(record: dict, out: Path, config: S3BenchConfig) -> None:
    write_json(out / "s3.json", {"record": record, "config": asdict(config)})
    rows = [{"what": what, "value": record.get(key)} for what, key in (
        ("cached req/s, file store", "cached_rps_file"), ("cached req/s, S3 store", "cached_rps_s3"),
        ("S3 × file", "cached_ratio"), ("ready, 1 task in the bucket (s)", "ready_one_s"),
        (f"ready, {record['tasks']} tasks in the bucket (s)", "ready_many_s"), ("ready × 1 task", "ready_ratio"),
        ("versions fetched at start", "fetched_at_start"), ("cold first request p50 (ms)", "cold_p50_ms"),
        ("cold first request p99 (ms)", "cold_p99_ms"),
        ("cold first request under load p50 (ms)", "busy_cold_p50_ms"),
        ("cold first request under load p99 (ms)", "busy_cold_p99_ms"),
        ("warm p50 of that load (ms)", "busy_warm_p50_ms"), ("cold p99 under load × warm p50", "busy_cold_vs_warm"),
        ("errors of that load", "busy_errors"),
        (f"answers, cached tasks, store stopped {config.pause_s:.0f} s", "paused_answers_cached"),
        ("failures, cached tasks, store stopped", "paused_failures_cached"),
        ("a cold task while stopped", "paused_cold_error"),
        ("the cold task serves again after (s)", "paused_cold_recovered_s"),
        ("publish → every replica of 2 (p50 s)", "publish_to_every_replica_p50_s"),
        ("publish → every replica of 2 (max s)", "publish_to_every_replica_max_s"))]
    write_text(out / "s3.md", "# The task store on S3 (SeaweedFS, this machine)\n\n"
               + markdown_table(rows, ["what", "value"], ["", "measured"]))
