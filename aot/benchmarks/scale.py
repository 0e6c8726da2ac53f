"""`aot bench tasks --scale`: one server and ever more tasks, as `aot serve` runs them by default.

From one trained AoT task it derives N tasks with perturbed factors (factored storage, each factor times
1 + 0.05 * N(0, 1), seeded per task) and publishes them into one store in batches of one change each; at each count
of --counts (the store grows from one to the next), on a fresh server with the repository's default options:

    publish_one_s, publish_bytes_read   one more task published by itself into the store of N (the median of
    publish_writer_bytes                PUBLISHES), what a serving process (the StoreView the steps run) reads to
                                        apply it, and what the publisher read of the store's index
    ready_s, rss_ready_mb, rss_after_mb start to ready; every server process's RSS at ready and after the traffic
    cold_p50_ms, cold_p99_ms            first requests of tasks no request touched yet, one at a time, after one
                                        request of task 0 (the engine's own first run)
    busy_cold_p50_ms, busy_cold_p99_ms  the same for as many other untouched tasks while `concurrency` - 1 clients
    busy_warm_p50_ms, busy_cold_vs_warm keep task 0 busy: the hot requests' p50 meanwhile, and the cold p99 over it
    steady_rps, steady_vs_hot           steady state, what a busy service lives in: after `warmup` requests of tasks
                                        drawn by Zipf, the same draws again (the first `requests` of them)
    zipf_rps, hot_rps, zipf_vs_hot      the cold protocol: `requests` new Zipf draws after the warm-up (a share of them
                                        name tasks no request touched yet), then all to one hot task, warmed alike;
                                        all at `concurrency`, on the same server
    publish_to_served_s                 a task published while serving, until its first answer
    index_bytes                         the index's files in the store (compactions, shards and change logs it keeps)
    wrong                               sampled tasks (hot, cold, and again after the traffic evicted them) against
                                        PyTorch (the master task's model with the derived task's factors, as
                                        `aot predict` computes it), tolerance 1e-3
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from aot.benchmarks.report import markdown_table, new_figure, percentile, save_figure, write_json, write_text
from aot.benchmarks.serve import _closed_loop, _texts
from aot.serving.repository import read_repository
from aot.serving.shm import STUB
from aot.serving.store.layout import FACTORS, HEAD, TASK_JSON
from aot.serving.store.reader import StoreReader
from aot.serving.store.shards import SHARDS
from aot.serving.store.view import StoreView
from aot.serving.store.writer import Publication, TaskStore

ATOL = 1e-3
PUBLISHES = 3  # single publishes timed at each count


@dataclass
class ScaleBenchConfig:
    task: str
    out: str
    counts: tuple[int, ...] = (1, 100, 1000, 10000)
    requests: int = 800
    warmup: int = 800
    concurrency: int = 8
    cold: int = 30  # first requests of untouched tasks measured at each count
    batch: int = 1000  # tasks per change while the store grows
    sample: int = 8  # tasks checked against PyTorch at each count


def _perturbed(factors: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (v * (1 + 0.05 * rng.standard_normal(v.shape))).astype(v.dtype) for k, v in factors.items()}


def _name(i: int) -> str:
    return f"s{i:06d}"


class DerivedStore:
    """Grows a store with derived tasks of one master version (its task.json and head, perturbed factors)."""

    def __init__(self, store: TaskStore, master: Path):
        from safetensors.numpy import load_file

        self.store, self.master = store, master
        self.factors = load_file(master / FACTORS)
        self.count = 0

    def folder(self, i: int) -> Path:
        from safetensors.numpy import save_file

        folder = self.store.new_version_folder(_name(i))
        for file in (TASK_JSON, HEAD):
            shutil.copy2(self.master / file, folder / file)
        save_file(_perturbed(self.factors, seed=i), folder / FACTORS)
        return folder

    def grow(self, n: int, batch: int, progress) -> None:
        while self.count < n:
            chunk = range(self.count, min(n, self.count + batch))
            self.store.publish_many([Publication(_name(i), self.folder(i), "factored") for i in chunk])
            self.count = chunk.stop
            progress(len(chunk))


class Reference:
    """PyTorch logits of derived tasks: the master task's model with the derived factors (aot predict's path)."""

    def __init__(self, master_task: Path, factors: dict[str, np.ndarray]):
        import torch

        from aot.training.predict import Predictor

        self.torch = torch
        self.predictor = Predictor.load(master_task)
        self.factors = factors

    def logits(self, i: int, texts: list[str]) -> np.ndarray:
        body = self.predictor.model.body.aot
        body.load_state_dict({k: self.torch.from_numpy(v) for k, v in _perturbed(self.factors, seed=i).items()})
        return self.predictor.logits(texts).numpy()


def _rss_by_process(process) -> dict[str, float]:
    import psutil

    root = psutil.Process(process.pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd = p.cmdline()
            stub = len(cmd) > 8 and cmd[0].endswith(STUB)  # argv[8]: the instance (aot.serving.supervision.procfs)
            name = cmd[8] if stub else p.name()
            out[name] = out.get(name, 0.0) + p.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return {k: round(v, 1) for k, v in sorted(out.items())}


def _publish_cost(store: TaskStore, derived: DerivedStore, publishes: int) -> dict:
    """Tasks published one by one into the store as it is: the median seconds, and for the last, the bytes a
    following reader reads and the bytes the publisher read of the index."""
    view = StoreView(StoreReader(store.root))
    view.refresh()
    seconds = []
    for _ in range(publishes):
        i, folder = derived.count, derived.folder(derived.count)
        writer_before = store.backend.bytes_read
        start = time.perf_counter()
        store.publish(_name(i), folder, "factored")
        seconds.append(time.perf_counter() - start)
        derived.count += 1
        writer_bytes = store.backend.bytes_read - writer_before
        before = view.reader.backend.bytes_read
        view.reader.log._probed = 0.0  # look now, as a step does before its next batch once the hint moved
        view.refresh()
        assert _name(i) in view.index.entries
    return {"publish_one_s": round(statistics.median(seconds), 4),
            "publish_bytes_read": view.reader.backend.bytes_read - before, "publish_writer_bytes": writer_bytes}


def _wrong(client, reference: Reference, picks: list[int], texts: list[str]) -> int:
    wrong = 0
    for i in picks:
        expected = reference.logits(i, texts)
        for text, want in zip(texts, expected, strict=True):
            got = np.asarray(client.infer(_name(i), text)["logits"])
            wrong += int(not np.allclose(got, want, atol=ATOL))
    return wrong


def _cold_under_load(url: str, hot_task: str, texts: list[str], cold_tasks: list[str], concurrency: int) -> dict:
    """First requests of `cold_tasks`, one at a time, while `concurrency` - 1 clients keep `hot_task` busy from
    before the first to after the last; the hot requests' p50 meanwhile."""
    from aot.client.client import Client

    stop, started, lock = threading.Event(), threading.Event(), threading.Lock()
    warm: list[float] = []
    errors = [0]

    def load() -> None:
        with Client(url) as client:
            k = 0
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    client.infer(hot_task, texts[k % len(texts)])
                except Exception:  # noqa: BLE001 - counted: the record's errors
                    with lock:
                        errors[0] += 1
                else:
                    with lock:
                        warm.append((time.perf_counter() - start) * 1e3)
                started.set()
                k += 1

    loaders = [threading.Thread(target=load, daemon=True) for _ in range(max(concurrency - 1, 1))]
    for thread in loaders:
        thread.start()
    cold = []
    try:
        if cold_tasks and not started.wait(timeout=60):
            raise RuntimeError(f"the load on {hot_task} answered nothing within 60 s ({errors[0]} errors)")
        with Client(url) as client:
            for task in cold_tasks:
                start = time.perf_counter()
                client.infer(task, texts[0])
                cold.append((time.perf_counter() - start) * 1e3)
    finally:
        stop.set()
        for thread in loaders:
            thread.join()
    p99, warm_p50 = percentile(cold, 0.99), percentile(warm, 0.5)
    return {"busy_cold_requests": len(cold), "busy_cold_p50_ms": percentile(cold, 0.5), "busy_cold_p99_ms": p99,
            "busy_warm_p50_ms": warm_p50, "busy_errors": errors[0],
            "busy_cold_vs_warm": round(p99 / warm_p50, 2) if p99 is not None and warm_p50 else None}


def _measure(repo: Path, store: TaskStore, derived: DerivedStore, reference: Reference, n: int,
             config: ScaleBenchConfig, texts: list[str]) -> dict:
    from aot.client.client import Client
    from aot.local.server import LocalServer

    rng = np.random.default_rng(n)
    publish = _publish_cost(store, derived, min(PUBLISHES, n))
    total = derived.count
    weights = 1.0 / np.arange(1, total + 1)
    zipf = rng.choice(total, size=config.warmup + config.requests, p=weights / weights.sum())
    with LocalServer(repo) as server:
        rss_ready = _rss_by_process(server.process)
        # untouched tasks from the store's tail: the first half asked one at a time on an idle server, the second
        # under load (both before any Zipf pass touches them)
        tail = rng.permutation(np.arange(total // 2, total))
        picks = min(config.cold, max(len(tail) // 2, 1))
        cold_picks, busy_picks = tail[:picks], tail[picks: 2 * picks]
        cold = []
        with Client(server.grpc_url) as client:
            client.infer(_name(0), texts[0])  # the engine's first run is a warm-up, not a task's first request
            for i in cold_picks:
                start = time.perf_counter()
                client.infer(_name(int(i)), texts[0])
                cold.append((time.perf_counter() - start) * 1e3)
            sample = [0, *[int(i) for i in cold_picks[: config.sample - 1]]]
            wrong = _wrong(client, reference, sample, texts[:2])
        busy = _cold_under_load(server.grpc_url, _name(0), texts, [_name(int(i)) for i in busy_picks],
                                config.concurrency)
        busy_errors = busy.pop("busy_errors")
        items = [(_name(int(k)), texts[j % len(texts)]) for j, k in enumerate(zipf)]
        _closed_loop(server.grpc_url, "aot", items[: config.warmup], config.concurrency)
        steady_run = _closed_loop(server.grpc_url, "aot", items[: min(config.warmup, config.requests)],
                                  config.concurrency)  # the warm-up's draws again: every task seen once
        zipf_run = _closed_loop(server.grpc_url, "aot", items[config.warmup:], config.concurrency)
        hot = [(_name(0), texts[j % len(texts)]) for j in range(config.warmup + config.requests)]
        _closed_loop(server.grpc_url, "aot", hot[: config.warmup], config.concurrency)
        hot_run = _closed_loop(server.grpc_url, "aot", hot[config.warmup:], config.concurrency)
        rss_after = _rss_by_process(server.process)
        with Client(server.grpc_url) as client:
            wrong += _wrong(client, reference, sample, texts[:2])  # again, after the traffic's evictions
            folder = derived.folder(derived.count)
            start = time.perf_counter()
            store.publish(_name(derived.count), folder, "factored")
            while True:
                try:
                    client.infer(_name(derived.count), texts[0])
                    break
                except Exception:  # noqa: BLE001 - not served yet
                    time.sleep(0.01)
            publish_to_served = time.perf_counter() - start
            derived.count += 1
        ready = server.ready_seconds
    return {"tasks": total, **publish,
            "ready_s": round(ready, 2), "rss_ready_mb": rss_ready, "rss_after_mb": rss_after,
            "rss_ready_total_mb": round(sum(rss_ready.values()), 1),
            "rss_after_total_mb": round(sum(rss_after.values()), 1),
            "cold_p50_ms": round(statistics.median(cold), 1),
            "cold_p99_ms": percentile(cold, 0.99), **busy,
            "steady_rps": steady_run["throughput_rps"],
            "steady_vs_hot": round(steady_run["throughput_rps"] / hot_run["throughput_rps"], 3),
            "steady_tasks": len({k for k, _ in items[: min(config.warmup, config.requests)]}),
            "zipf_rps": zipf_run["throughput_rps"], "hot_rps": hot_run["throughput_rps"],
            "zipf_vs_hot": round(zipf_run["throughput_rps"] / hot_run["throughput_rps"], 3),
            "errors": zipf_run["errors"] + hot_run["errors"] + steady_run["errors"] + busy_errors,
            "publish_to_served_s": round(publish_to_served, 3),
            "wrong": wrong,
            "index_bytes": sum(p.stat().st_size for d in ("index", "log", SHARDS)
                               for p in (store.root / d).glob("*.json"))}


def run_scale_bench(config: ScaleBenchConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from aot.exporter.backbone_export import export_backbone
    from aot.exporter.task_export import export_task
    from aot.training.artifact import read_task

    out = Path(config.out)
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-scale-"))
    try:
        repo = scratch / "repo"
        export_backbone(read_task(config.task).backbone["model"], repo)
        store = TaskStore.of(read_repository(repo))
        report = export_task(config.task, repo, "master", "factored", progress=False)
        master = scratch / "master"
        shutil.copytree(store.root / report.folder, master)
        store.remove("master")
        derived = DerivedStore(store, master)
        reference = Reference(Path(config.task), derived.factors)
        texts = _texts(64)
        records = []
        bar = tqdm(total=max(config.counts) + len(config.counts) + 1, desc="scale bench", unit="task",
                   disable=not progress)
        for n in sorted(config.counts):
            derived.grow(max(n - min(PUBLISHES, n), derived.count), config.batch, bar.update)  # _measure: the rest
            records.append(_measure(repo, store, derived, reference, n, config, texts))
            bar.update(min(PUBLISHES, n) + 1)
            write_scale_reports(records, out, config)
        bar.close()
        return {"out": str(out), "records": len(records), "config": asdict(config)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_scale_reports(records: list[dict], out: Path, config: ScaleBenchConfig) -> None:
    write_json(out / "scale.json", {"records": records, "config": asdict(config)})
    first = records[0]
    rows = [{**r, "ready_vs_first": round(r["ready_s"] / first["ready_s"], 2),
             "rss_after_vs_first_mb": round(r["rss_after_total_mb"] - first["rss_after_total_mb"], 1),
             "publish_vs_first": round(r["publish_one_s"] / first["publish_one_s"], 2)} for r in records]
    text = "# One server, many tasks (CPU, `aot serve` defaults)\n\n" + markdown_table(
        rows, ["tasks", "ready_s", "ready_vs_first", "rss_ready_total_mb", "rss_after_total_mb",
               "rss_after_vs_first_mb", "cold_p50_ms", "cold_p99_ms", "busy_cold_requests", "busy_cold_p50_ms",
               "busy_cold_p99_ms", "busy_warm_p50_ms", "busy_cold_vs_warm", "steady_tasks", "steady_rps", "steady_vs_hot",
               "zipf_rps", "hot_rps", "zipf_vs_hot",
               "publish_one_s", "publish_vs_first", "publish_writer_bytes", "publish_bytes_read", "publish_to_served_s",
               "errors", "wrong"],
        ["tasks", "ready (s)", "× first", "RSS at ready (MB)", "RSS after traffic (MB)", "+MB vs first",
         "cold p50 ms", "cold p99 ms", "cold under load (requests)", "cold under load p50 ms",
         "cold under load p99 ms", "warm p50 ms of that load", "cold p99 under load × warm p50", "tasks in the steady pass", "steady Zipf req/s", "steady × hot",
         "cold-protocol Zipf req/s", "hot req/s", "cold-protocol Zipf × hot", "publish one (s)", "× first",
         "bytes the publisher reads", "bytes a reader reads per publish", "publish → served (s)", "errors",
         "wrong answers"])
    text += "\n## RSS of each server process after the traffic (MB)\n\n"
    for r in records:
        text += f"- {r['tasks']} tasks: " + ", ".join(f"{k} {v}" for k, v in r["rss_after_mb"].items()) + "\n"
    write_text(out / "scale.md", text)
    fig, (left, right) = new_figure(11, 4.5, ncols=2)
    xs = [r["tasks"] for r in records]
    left.plot(xs, [r["ready_s"] for r in records], marker="o", label="ready (s)")
    left.plot(xs, [r["rss_after_total_mb"] / 1024 for r in records], marker="o", label="RSS after traffic (GB)")
    right.plot(xs, [r["steady_vs_hot"] for r in records], marker="o", label="steady Zipf req/s × one hot task")
    right.plot(xs, [r["zipf_vs_hot"] for r in records], marker="o", label="cold-protocol Zipf req/s × one hot task")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("tasks in the store")
        ax.legend(fontsize=7)
    fig.suptitle("One server, many tasks (CPU)")
    save_figure(fig, out / "scale.png")
