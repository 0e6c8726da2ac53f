"""`aot bench serve`: end to end through the real local tritonserver.

From one task artifact it builds a repository (or reuses --repo), publishes N copies of the task (fused and/or
factored storage) and measures, each on a fresh server:

    memory      start-to-ready seconds and RSS of tritonserver and its python stubs with N tasks in the store,
                after one request to every task (fused tables are memory-mapped: only touched rows count)
    latency     the AoT ensemble (1 task, or 8 tasks mixed request by request) against the vanilla ensemble (same
                tokenizer and head steps, backbone without bias inputs, 1 task) at each concurrency: throughput,
                p50/p99 latency, errors (after one untimed pass of each; --rounds passes in rotating order,
                their medians), the task pool's hit rate (its counters on the metrics port; each AoT pass
                costs a second's wait and one request to publish them), and the bytes the lookup moves to the
                backbone per request (and the dense per-token bias it replaces)

Clients are closed-loop threads on the same machine as the server (they share its cores).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from aot.benchmarks.report import markdown_table, new_figure, save_figure, write_json, write_text
from aot.serving import protocol
from aot.serving.repository import ServingOptions, read_repository
from aot.serving.store.writer import TaskStore


@dataclass
class ServeBenchConfig:
    task: str
    out: str
    repo: str | None = None
    task_counts: tuple[int, ...] = (1, 8, 32)
    concurrency: tuple[int, ...] = (1, 8, 32)
    storages: tuple[str, ...] = ("fused", "factored")
    requests: int = 200
    mixed_tasks: int = 8
    engine: str = "onnx"  # the backbone engine of a repository the bench exports (aot.serving.repository.ENGINES)
    device: str = "cpu"  # aot serve --device: cuda needs engine torch
    pool_bytes: int | None = None  # aot serve --pool-bytes (None: the repository's)
    precisions: tuple[str, ...] = ("fp32",)  # the CPU graphs of the repositories the bench exports, side by side
    rounds: int = 3  # passes of each (model, concurrency), in rotating order; the records hold their medians


def _texts(n: int) -> list[str]:
    """Real review texts (Rotten Tomatoes dev split), cycled."""
    from aot.training.data import load_task_data

    dev = [e.text for e in load_task_data("rotten_tomatoes").dev]
    return [dev[i % len(dev)] for i in range(n)]


def _server_rss_mb(process) -> float:
    import psutil

    root = psutil.Process(process.pid)
    procs = [root, *root.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20


class Store:
    """Publishes exactly N copies of a master task version into the repository's store."""

    def __init__(self, repo: Path, masters: dict[str, Path]):
        self.store = TaskStore(read_repository(repo).store_root)
        self.masters = masters

    def set(self, storage: str, n: int) -> list[str]:
        for name in list(self.store.entries()):
            self.store.remove(name)
        names = [f"bench-{storage}-{i}" for i in range(n)]
        for name in names:
            folder = self.store.new_version_folder(name)
            folder.rmdir()
            shutil.copytree(self.masters[storage], folder)
            self.store.publish(name, folder, storage)
        return names


def _build(config: ServeBenchConfig, scratch: Path, precision: str) -> tuple[Path, dict[str, Path], dict | None]:
    """The repository of `precision` (or --repo) and the master copy of the task in each storage; on an int8
    repository also the task's dev score through the int8 engine against its fp32 score (aot.exporter.accuracy_gate,
    recorded whatever the drop: a benchmark measures, it does not refuse)."""
    from aot.exporter.backbone_export import export_backbone
    from aot.exporter.task_export import export_task
    from aot.training.artifact import read_task

    repo = Path(config.repo) if config.repo else scratch / f"repo-{precision}"
    if not (repo / "aot_repository.json").is_file():
        export_backbone(read_task(config.task).backbone["model"], repo, ServingOptions(engine=config.engine),
                        cpu_precision=precision)
    if read_repository(repo).record.cpu_precision != precision:
        raise ValueError(f"--repo {repo} runs {read_repository(repo).record.cpu_precision} graphs on CPU, not "
                         f"--precision {precision}")
    engine = read_repository(repo).options.engine
    if config.device != "cpu" and engine != "torch":
        raise ValueError(f"--device {config.device} serves a torch-engine repository; {repo} is {engine!r}")
    store = TaskStore(read_repository(repo).store_root)
    foreign = [n for n in store.entries() if not n.startswith("bench-")]
    if foreign:
        raise ValueError(f"{repo} holds tasks of its own ({', '.join(foreign)}); the serving benchmark replaces the "
                         "store's tasks: give it a scratch --repo, or none")
    masters, accuracy = {}, None
    for storage in config.storages:
        report = export_task(config.task, repo, f"master-{storage}", storage, progress=False, allowed_drop=100.0)
        accuracy = accuracy or report.served_dev
        masters[storage] = scratch / f"master-{storage}-{precision}"
        shutil.copytree(store.root / report.folder, masters[storage])
        store.remove(f"master-{storage}")
    return repo, masters, accuracy


def closed_loop(open_sender, items: list, concurrency: int) -> dict:
    """`concurrency` threads, each sending its share of `items` one after another through its own sender
    (`open_sender()`: a context manager giving a function that sends one item and raises on a failed request);
    per-request latency. Every server a benchmark compares is driven by this one loop."""
    latencies, errors, lock = [], [], threading.Lock()
    position = [0]

    def worker():
        with open_sender() as send:
            while True:
                with lock:
                    if position[0] >= len(items):
                        return
                    item = items[position[0]]
                    position[0] += 1
                start = time.perf_counter()
                try:
                    send(item)
                except Exception as exc:  # noqa: BLE001 - a failed request is counted, the loop goes on
                    errors.append(str(exc))
                    continue
                latencies.append((time.perf_counter() - start) * 1e3)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if not latencies:
        raise RuntimeError(f"every request failed; the first: {errors[:1]}")
    return {"throughput_rps": round(len(latencies) / wall, 2), "p50_ms": round(float(np.percentile(latencies, 50)), 2),
            "p99_ms": round(float(np.percentile(latencies, 99)), 2), "errors": len(errors),
            "mean_ms": round(statistics.fmean(latencies), 2)}


def _closed_loop(url: str, model: str, items: list[tuple[str, str]], concurrency: int,
                 tokenizer: Path | None = None) -> dict:
    """closed_loop over aot.Client: (task, text) items to `model` at `url`. `tokenizer`: the clients tokenize and
    send token ids (aot.Client(tokenizer=...))."""
    from aot.client.client import Client

    @contextlib.contextmanager
    def sender():
        with Client(url, model=model, tokenizer=tokenizer) as client:
            yield lambda item: client.infer(*item)

    return closed_loop(sender, items, concurrency)


class PoolCounters(NamedTuple):
    """The task pool's counters summed over the server's steps: rows found in the pool, rows it had to fill."""

    hits: float
    misses: float

    @property
    def lookups(self) -> float:
        return self.hits + self.misses


def _pool_counters(metrics_url: str) -> PoolCounters:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()

    def total(name):
        return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)", text, re.M))

    return PoolCounters(total("aot_pool_hits_total"), total("aot_pool_misses_total"))


def _published_counters(url: str, metrics_url: str, task: str, text: str) -> PoolCounters:
    """The pool counters once the steps have published them: they publish at most once a second, after a batch,
    so wait that long and send one request (it is counted too: one request in a measured pass of hundreds)."""
    from aot.client.client import Client
    from aot.serving.steps import StepMetrics

    time.sleep(StepMetrics.FLUSH_SECONDS + 0.2)
    with Client(url) as client:
        client.infer(task, text)
    return _pool_counters(metrics_url)


def _lookup_bytes(repo: Path, texts: list[str], max_length: int) -> tuple[float, float]:
    """Mean bytes per request from lookup to backbone on a GPU in each bias interface: rows of the distinct tokens +
    index, and the dense fp16 bias of the bucketed sequence."""
    from transformers import AutoTokenizer

    from aot.serving.tokenization import bucket_length

    info = read_repository(repo)
    tokenizer = AutoTokenizer.from_pretrained(str(info.tokenizer_dir))
    L, d, buckets = info.num_layers, info.hidden_size, info.options.buckets
    ours, dense = [], []
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        padded = bucket_length(len(ids), buckets)  # a GPU tokenizer step pads to the bucket: index and bias alike
        ours.append(protocol.lookup_bytes(len(set(ids)), padded, L, d))
        dense.append(protocol.dense_bias_bytes(padded, L, d))
    return statistics.fmean(ours), statistics.fmean(dense)


def _memory_fallbacks(log: Path) -> int:
    """tritonserver's warnings that a tensor between steps fell back from its CUDA or pinned memory pool to plain
    host memory (on a GPU, 0 is what sized pools must give; the CPU server runs with no pinned pool at all)."""
    try:
        return sum("falling back to" in line for line in log.read_text(errors="replace").splitlines())
    except OSError:
        return 0


def _expected_logits(config: ServeBenchConfig, repo: Path, precision: str, sample: list[str]) -> np.ndarray:
    """What the served answers must equal: `aot predict` (PyTorch), or on an int8 repository `aot predict --repo`
    (the int8 engine in process)."""
    if precision == "fp32":
        from aot.training.predict import Predictor

        return Predictor.load(config.task).logits(sample).numpy()
    from aot.exporter.cpu_engine import predict_lines_through

    lines = [(k, {"text": text, "text_pair": None, "task": "task"}) for k, text in enumerate(sample)]
    answers = predict_lines_through(repo, {"task": Path(config.task)}, lines)
    return np.array([answers[k]["logits"] for k in range(len(sample))])


def run_serve_bench(config: ServeBenchConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    if config.repo and len(config.precisions) > 1:
        raise ValueError("--repo serves one precision (its own): give one --precision, or no --repo")
    out = Path(config.out)
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-serve-"))
    texts = _texts(config.requests)
    records: list[dict] = []
    bar = tqdm(total=len(config.precisions) * len(config.storages) * (len(config.task_counts) + 1),
               desc="serve bench", disable=not progress)
    for precision in config.precisions:
        repo, masters, accuracy = _build(config, scratch, precision)
        if accuracy is not None:
            records.append({"kind": "accuracy", "precision": precision, **accuracy})
        _bench_repository(config, repo, Store(repo, masters), precision, texts, records, bar)
    bar.close()
    shutil.rmtree(scratch, ignore_errors=True)
    return {"out": str(out), "records": len(records), "config": asdict(config)}


def _bench_repository(config: ServeBenchConfig, repo: Path, store: Store, precision: str, texts: list[str],
                      records: list[dict], bar) -> None:
    """Every measurement of one repository: memory per task count, parity, latency and throughput."""
    from aot.client.client import Client
    from aot.local.server import LocalServer
    from aot.training.artifact import read_task

    out = Path(config.out)
    max_length = read_task(config.task).max_length
    sample = texts[:32]
    expected = _expected_logits(config, repo, precision, sample)  # once for every storage

    def save():
        write_reports(records, out, f"{config.device}, {read_repository(repo).options.engine} engine")

    pool_bytes = read_repository(repo).options.pool_bytes if config.pool_bytes is None else config.pool_bytes
    for storage in config.storages:
        for n in config.task_counts:
            names = store.set(storage, n)
            with LocalServer(repo, device=config.device, pool_bytes=config.pool_bytes, vanilla=True) as server:
                with Client(server.grpc_url) as client:
                    for name in names:
                        client.infer(name, texts[0])
                records.append({"kind": "memory", "precision": precision, "storage": storage, "tasks": n,
                                "ready_seconds": round(server.ready_seconds, 2),
                                "rss_mb": round(_server_rss_mb(server.process), 1)})
            save()
            bar.update(1)
        names = store.set(storage, max(config.mixed_tasks, 1))
        ours, dense = _lookup_bytes(repo, texts, max_length)
        with LocalServer(repo, device=config.device, pool_bytes=config.pool_bytes, vanilla=True) as server:
            with Client(server.grpc_url) as client:  # warm every step once
                for name in names:
                    client.infer(name, texts[0])
                # every copy is the master task: the served logits against `aot predict` (fp16 rows; fp16 encoder on
                # CUDA), or the int8 engine in process
                served = np.array([client.infer(names[i % len(names)], t)["logits"] for i, t in enumerate(sample)])
                records.append({"kind": "parity", "precision": precision, "storage": storage, "texts": len(sample),
                                "max_abs_logit_diff": float(np.abs(served - expected).max()),
                                "same_label": float(np.mean(served.argmax(1) == expected.argmax(1)))})
                client.model = "vanilla"
                client.infer(names[0], texts[0])
            metrics = f"http://{server.host}:{server.metrics_port}/metrics"
            passes = (("vanilla", 1), ("aot", 1), ("aot", config.mixed_tasks))
            for model, mix in passes:  # untimed: every pass's first requests (steps, rows, the OS's caches)
                _closed_loop(server.grpc_url, model, _items(names, mix, texts[:max(1, len(texts) // 4)]),
                             config.concurrency[0])
            counters = _published_counters(server.grpc_url, metrics, names[0], texts[0]) if pool_bytes else None
            for concurrency in config.concurrency:
                tallies = {key: PassTally() for key in passes}
                for round_ in range(config.rounds):  # each round in another order: no pass always runs first
                    for model, mix in passes[round_ % len(passes):] + passes[:round_ % len(passes)]:
                        tally = tallies[model, mix]
                        before = _memory_fallbacks(server.log_path)
                        tally.runs.append(_closed_loop(server.grpc_url, model, _items(names, mix, texts), concurrency))
                        tally.fallbacks += _memory_fallbacks(server.log_path) - before
                        if model == "aot" and pool_bytes:
                            now = _published_counters(server.grpc_url, metrics, names[0], texts[0])
                            tally.found += now.hits - counters.hits
                            tally.looked_up += now.lookups - counters.lookups
                            counters = now
                for (model, mix), tally in tallies.items():
                    records.append({"kind": "latency", "precision": precision, "model": model, "storage": storage,
                                    "tasks_in_flight": mix, "concurrency": concurrency, "requests": len(texts),
                                    "rounds": len(tally.runs), "pool_bytes": pool_bytes,
                                    "pool_hit_rate": tally.hit_rate(), **_median_pass(tally.runs),
                                    "memory_fallbacks": tally.fallbacks,
                                    "lookup_bytes_per_request": None if model == "vanilla" else round(ours),
                                    "dense_bias_bytes_per_request": None if model == "vanilla" else round(dense)})
                save()
        bar.update(1)


@dataclass
class PassTally:
    """One pass's rounds at one concurrency: each round's closed-loop result, the memory-pool fallbacks the server
    logged during them, and of the rows they looked up, those the task pool held."""

    runs: list[dict] = field(default_factory=list)
    fallbacks: int = 0
    found: float = 0.0
    looked_up: float = 0.0

    def hit_rate(self) -> float | None:
        return round(self.found / self.looked_up, 4) if self.looked_up else None


def _items(names: list[str], mix: int, texts: list[str]) -> list[tuple[str, str]]:
    """A pass's requests: the texts in order, sent to `mix` tasks in turn."""
    return [(names[i % mix], text) for i, text in enumerate(texts)]


def _median_pass(runs: list[dict]) -> dict:
    """The rounds of one pass as one result: each figure's median over the rounds, every round's req/s beside it, and
    the errors of all of them."""
    figures = {key: round(float(np.median([r[key] for r in runs])), 2)
               for key in ("throughput_rps", "p50_ms", "p99_ms", "mean_ms")}
    return {**figures, "throughput_rps_rounds": [r["throughput_rps"] for r in runs],
            "errors": sum(r["errors"] for r in runs)}


def write_reports(records: list[dict], out: Path, device: str = "CPU") -> None:
    write_json(out / "serve.json", records)
    memory = [r for r in records if r["kind"] == "memory"]
    latency = [r for r in records if r["kind"] == "latency"]
    parity = [r for r in records if r["kind"] == "parity"]
    text = f"# Serving through the local tritonserver ({device})\n\n## Start-up and memory\n\n"
    text += markdown_table(memory, ["precision", "storage", "tasks", "ready_seconds", "rss_mb"],
                           ["precision", "storage", "tasks in store", "start to ready (s)", "RSS server + stubs (MB)"])
    if parity:
        text += "\n## Served answers against `aot predict`\n\n"
        text += markdown_table(parity, ["precision", "storage", "texts", "max_abs_logit_diff", "same_label"],
                               ["precision", "storage", "texts", "max |logit difference| (int8: against the int8 "
                                "engine in process)", "same label (fraction)"])
    accuracy = [r for r in records if r["kind"] == "accuracy"]
    if accuracy:
        text += "\n## The task's dev score through the served engine\n\n"
        text += markdown_table(accuracy, ["precision", "metric", "score", "fp32", "drop", "examples"],
                               ["precision", "metric", "served", "fp32", "points below fp32", "dev examples"])
    text += "\n## Latency and throughput\n\n"
    for r in latency:
        r.setdefault("precision", "fp32")
        same = [v for v in latency if v["storage"] == r["storage"] and v["concurrency"] == r["concurrency"]]
        base = [v for v in same if v["model"] == "vanilla" and v.get("precision", "fp32") == r["precision"]]
        r["ratio"] = f"{r['throughput_rps'] / base[0]['throughput_rps']:.3f}" if base and r["model"] == "aot" else ""
        fp32 = [v for v in same if v.get("precision", "fp32") == "fp32" and v["model"] == r["model"]
                and v["tasks_in_flight"] == r["tasks_in_flight"]]
        r["rounds_rps"] = " / ".join(f"{x:.0f}" for x in r.get("throughput_rps_rounds", []))
        r["vs_fp32"] = f"{r['throughput_rps'] / fp32[0]['throughput_rps']:.2f}" if fp32 and r["precision"] != "fp32" \
            else ""
    text += markdown_table(latency, ["precision", "storage", "model", "tasks_in_flight", "concurrency",
                                     "throughput_rps", "rounds_rps", "ratio", "vs_fp32", "p50_ms", "p99_ms", "errors",
                                     "pool_hit_rate", "memory_fallbacks", "lookup_bytes_per_request",
                                     "dense_bias_bytes_per_request"],
                           ["precision", "storage", "ensemble", "tasks", "concurrency", "req/s (median)", "each round",
                            "× vanilla (1 task, same precision)", "× fp32", "p50 ms", "p99 ms", "errors",
                            "task pool hit rate", "memory pool fallbacks (log)", "lookup→backbone bytes/req",
                            "dense bias bytes/req"])
    write_text(out / "serve.md", text)
    if latency:
        fig, ax = new_figure()
        for storage in sorted({r["storage"] for r in latency}):
            for model, mix in (("vanilla", 1), ("aot", 1), ("aot", 8)):
                rows = [r for r in latency if r["storage"] == storage and r["model"] == model
                        and r["tasks_in_flight"] == mix]
                if rows:
                    ax.plot([r["concurrency"] for r in rows], [r["throughput_rps"] for r in rows], marker="o",
                            label=f"{model}, {mix} task{'s' if mix > 1 else ''}, {storage}")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("requests / s")
        ax.set_xscale("log", base=2)
        ax.set_title("Throughput through Triton (CPU)")
        ax.legend(fontsize=7)
        save_figure(fig, out / "serve.png")
