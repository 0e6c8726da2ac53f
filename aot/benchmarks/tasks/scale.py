"""`aot bench tasks --scale`: one server and ever more tasks, as `aot serve` runs them by default.

From one trained AoT task it derives N tasks with perturbed factors (factored storage, each factor times
1 + 0.05 * N(0, 1), seeded per task) and publishes them into one store in batches of one change each, and from 100
tasks on 2 x `cold` fused tasks derived alike (aot.benchmarks.tasks.scale_cold); at each count of --counts (the store grows
from one to the next), `repeats` times on a fresh server with the repository's default options (each figure below
is the median of the runs; `<figure>_runs` lists each run's, their spread):

    publish_one_s, publish_bytes_read   one more task published by itself into the store of N (the median of
    publish_writer_bytes                PUBLISHES), what a serving process (the StoreView the steps run) reads to
                                        apply it, and what the publisher read of the store's index
    ready_s                             start to ready
    rss_*_mb, pss_after_total_mb        every server process's RSS at ready and after the traffic, and the sum of
                                        their proportional set sizes after it (memory shared by several processes,
                                        the host's cache of task versions among it, counted once);
                                        host_cache_bytes: the versions the host's cache holds then
    cold_*, busy_cold_*, fused_*        first requests of untouched tasks, idle and under load (aot.benchmarks.
                                        scale_cold), factored and fused
    steady_rps, steady_vs_hot           steady state, what a busy service lives in: after `warmup` requests of tasks
                                        drawn by Zipf, the same draws again (the first `requests` of them)
    zipf_rps, hot_rps, zipf_vs_hot      the cold protocol: `requests` new Zipf draws after the warm-up (a share of them
                                        name tasks no request touched yet), then all to one hot task, warmed alike;
                                        all at `concurrency`, on the same server
    publish_to_served_s                 a task published while serving, until its first answer
    index_bytes                         the index's files in the store (compactions, shards and change logs it keeps)
    wrong                               sampled tasks (hot, cold factored and fused, and again after the traffic)
                                        against PyTorch (the master task's model with the derived task's factors, as
                                        `aot predict` computes it), tolerance 1e-3

At the largest count, the warm-up and steady pass run again on servers whose fused step has each of `instances`
instances: `instances_pss_mb`, the memory of the same working set by instance count. `policies`: the host cache's
policy against LRU, replayed in process on this bench's traffic (aot.benchmarks.tasks.version_policies).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from aot.benchmarks.report import percentile
from aot.benchmarks.served.serve import _closed_loop, _texts
from aot.benchmarks.tasks.scale_cold import cold_idle, cold_under_load, fused_folder, fused_name
from aot.benchmarks.tasks.scale_report import SPREAD, write_scale_reports
from aot.benchmarks.tasks.version_policies import replay_version_policies
from aot.serving.repository import read_repository
from aot.serving.shm import STUB
from aot.serving.store.host_cache import HostCache
from aot.serving.store.layout import FACTORS, HEAD, TASK_JSON
from aot.serving.store.reader import StoreReader
from aot.serving.store.shards import SHARDS
from aot.serving.store.view import StoreView
from aot.serving.store.writer import Publication, TaskStore

ATOL = 1e-3
PUBLISHES = 3  # single publishes timed at each count
FUSED_SEED = 10_000_000  # fused task i is derived with seed FUSED_SEED + i (factored task i: seed i)


@dataclass
class ScaleBenchConfig:
    task: str
    out: str
    counts: tuple[int, ...] = (1, 100, 1000, 10000)
    requests: int = 800
    warmup: int = 800
    concurrency: int = 8
    cold: int = 30  # first requests of untouched tasks measured at each count, idle and again under load
    batch: int = 1000  # tasks per change while the store grows
    sample: int = 8  # tasks checked against PyTorch at each count
    repeats: int = 1  # fresh servers at each count (medians reported, and each run's figures)
    instances: tuple[int, ...] = (2, 4)  # the fused step's instances of the memory check at the largest count


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


def _memory(process) -> dict[str, dict[str, float]]:
    """RSS and PSS (MB) of every server process, by instance (stubs) or name."""
    import psutil

    root = psutil.Process(process.pid)
    out: dict[str, dict[str, float]] = {"rss": {}, "pss": {}}
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd = p.cmdline()
            stub = len(cmd) > 8 and cmd[0].endswith(STUB)  # argv[8]: the instance (aot.serving.supervision.procfs)
            name = cmd[8] if stub else p.name()
            info = p.memory_full_info()
        except psutil.Error:
            continue
        for kind, value in (("rss", info.rss), ("pss", info.pss)):
            out[kind][name] = out[kind].get(name, 0.0) + value / 2**20
    return {kind: {k: round(v, 1) for k, v in sorted(values.items())} for kind, values in out.items()}


def _host_cache_bytes() -> int:
    """The bytes the host's version cache lists now (the servers' processes share it)."""
    return sum(e["size"] for e in HostCache.for_host(0).entries())


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
    """Answers of derived tasks (their seeds: `picks`) that differ from PyTorch's."""
    wrong = 0
    for seed in picks:
        name = _name(seed) if seed < FUSED_SEED else fused_name(seed - FUSED_SEED)
        expected = reference.logits(seed, texts)
        for text, want in zip(texts, expected, strict=True):
            got = np.asarray(client.infer(name, text)["logits"])
            wrong += int(not np.allclose(got, want, atol=ATOL))
    return wrong


def _served_run(repo: Path, config: ScaleBenchConfig, texts: list[str], plan: dict,
                reference: Reference) -> dict:
    """One fresh server: the Zipf passes and the hot one, then cold first requests idle and under load (after the
    steady pass: their first loads must not hold the host's cache while it is measured), memory, answers against
    PyTorch."""
    from aot.client.client import Client
    from aot.local.server import LocalServer

    items = plan["items"]
    with LocalServer(repo) as server:
        rss_ready = _memory(server.process)["rss"]
        with Client(server.grpc_url) as client:
            client.infer(_name(0), texts[0])  # the engine's first run is a warm-up, not a task's first request
        _closed_loop(server.grpc_url, "aot", items[: config.warmup], config.concurrency)
        steady_run = _closed_loop(server.grpc_url, "aot", items[: min(config.warmup, config.requests)],
                                  config.concurrency)  # the warm-up's draws again: every task seen once
        zipf_run = _closed_loop(server.grpc_url, "aot", items[config.warmup:], config.concurrency)
        hot = [(_name(0), texts[j % len(texts)]) for j in range(config.warmup + config.requests)]
        _closed_loop(server.grpc_url, "aot", hot[: config.warmup], config.concurrency)
        hot_run = _closed_loop(server.grpc_url, "aot", hot[config.warmup:], config.concurrency)
        cold = cold_idle(server.grpc_url, plan["cold"], texts[0])
        fused = cold_idle(server.grpc_url, plan["fused"], texts[0])
        with Client(server.grpc_url) as client:
            wrong = _wrong(client, reference, plan["sample"], texts[:2])
        busy = cold_under_load(server.grpc_url, _name(0), texts, {"": plan["busy"], "fused_": plan["busy_fused"]},
                               config.concurrency)
        memory = _memory(server.process)
        host_bytes = _host_cache_bytes()
        with Client(server.grpc_url) as client:
            wrong += _wrong(client, reference, plan["sample"], texts[:2])  # again, after the traffic's evictions
            publish_to_served = plan["publish_served"](client)
        ready = server.ready_seconds
    return {"ready_s": round(ready, 2), "rss_ready_mb": rss_ready, "rss_after_mb": memory["rss"],
            "pss_after_mb": memory["pss"], "rss_ready_total_mb": round(sum(rss_ready.values()), 1),
            "rss_after_total_mb": round(sum(memory["rss"].values()), 1),
            "pss_after_total_mb": round(sum(memory["pss"].values()), 1), "host_cache_bytes": host_bytes,
            "cold_p50_ms": percentile(cold, 0.5), "cold_p99_ms": percentile(cold, 0.99),
            "fused_cold_p50_ms": percentile(fused, 0.5), "fused_cold_p99_ms": percentile(fused, 0.99), **busy,
            "steady_rps": steady_run["throughput_rps"],
            "steady_vs_hot": round(steady_run["throughput_rps"] / hot_run["throughput_rps"], 3),
            "steady_tasks": len({k for k, _ in items[: min(config.warmup, config.requests)]}),
            "zipf_rps": zipf_run["throughput_rps"], "hot_rps": hot_run["throughput_rps"],
            "zipf_vs_hot": round(zipf_run["throughput_rps"] / hot_run["throughput_rps"], 3),
            "errors": zipf_run["errors"] + hot_run["errors"] + steady_run["errors"] + busy.pop("busy_errors"),
            "publish_to_served_s": round(publish_to_served, 3), "wrong": wrong}


def _instances_memory(repo: Path, config: ScaleBenchConfig, items: list) -> dict[int, float]:
    """PSS after the warm-up and steady pass on servers whose fused step has each of `config.instances` instances."""
    from aot.exporter.configs import parse_pbtxt, set_cpu_instances, to_pbtxt
    from aot.local.server import LocalServer

    path = repo / "models" / "aot" / "config.pbtxt"
    original = path.read_text()
    out = {}
    try:
        for count in config.instances:
            model = parse_pbtxt(original)
            set_cpu_instances(model, count)
            path.write_text(to_pbtxt(model))
            with LocalServer(repo) as server:
                _closed_loop(server.grpc_url, "aot", items[: config.warmup], config.concurrency)
                _closed_loop(server.grpc_url, "aot", items[: min(config.warmup, config.requests)], config.concurrency)
                out[count] = round(sum(_memory(server.process)["pss"].values()), 1)
    finally:
        path.write_text(original)
    return out


def _combined(runs: list[dict]) -> dict:
    """The runs' medians (numbers), the first run's other fields, and each SPREAD figure's runs."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and len(values) == len(runs):
            out[key] = statistics.median(values)
    out.update({f"{key}_runs": [r.get(key) for r in runs] for key in SPREAD})
    out["errors"], out["wrong"] = sum(r["errors"] for r in runs), sum(r["wrong"] for r in runs)
    return out


def _measure(repo: Path, store: TaskStore, derived: DerivedStore, reference: Reference, n: int,
             config: ScaleBenchConfig, texts: list[str], fused: int) -> dict:
    rng = np.random.default_rng(n)
    publish = _publish_cost(store, derived, min(PUBLISHES, n))
    total = derived.count
    weights = 1.0 / np.arange(1, total + 1)
    zipf = rng.choice(total, size=config.warmup + config.requests, p=weights / weights.sum())
    # untouched tasks from the store's tail (none the Zipf passes draw): the first half asked one at a time on an idle
    # server, the second under load (the same in every run: each starts with no version loaded)
    tail = rng.permutation(np.setdiff1d(np.arange(total // 2, total), zipf))
    picks = min(config.cold, max(len(tail) // 2, 1))
    half = fused // 2
    plan = {"cold": [_name(int(i)) for i in tail[:picks]], "busy": [_name(int(i)) for i in tail[picks: 2 * picks]],
            "fused": [fused_name(i) for i in range(half)], "busy_fused": [fused_name(i) for i in range(half, fused)],
            "sample": [0, *[int(i) for i in tail[: config.sample - 1]], *[FUSED_SEED + i for i in range(min(half, 2))]],
            "items": [(_name(int(k)), texts[j % len(texts)]) for j, k in enumerate(zipf)]}

    def publish_served(client) -> float:
        folder = derived.folder(derived.count)
        start = time.perf_counter()
        store.publish(_name(derived.count), folder, "factored")
        while True:
            try:
                client.infer(_name(derived.count), texts[0])
                break
            except Exception:  # noqa: BLE001 - not served yet
                time.sleep(0.01)
        derived.count += 1
        return time.perf_counter() - start

    plan["publish_served"] = publish_served
    runs = [_served_run(repo, config, texts, plan, reference) for _ in range(config.repeats)]
    record = {"tasks": total, "fused_tasks": fused, **publish, **_combined(runs), "repeats": config.repeats,
              "index_bytes": sum(p.stat().st_size for d in ("index", "log", SHARDS)
                                 for p in (store.root / d).glob("*.json"))}
    if n == max(config.counts) and config.instances:
        record["instances_pss_mb"] = _instances_memory(repo, config, plan["items"])
    return record


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
        records, fused = [], 0
        bar = tqdm(total=max(config.counts) + len(config.counts) + 1, desc="scale bench", unit="task",
                   disable=not progress)
        for n in sorted(config.counts):
            derived.grow(max(n - min(PUBLISHES, n), derived.count), config.batch, bar.update)  # _measure: the rest
            if not fused and n > 1:  # the fused tasks join the store after the 1-task baseline
                fused = 2 * min(config.cold, max(n // 4, 1))
                store.publish_many([Publication(fused_name(i), fused_folder(store, master, _perturbed(
                    derived.factors, seed=FUSED_SEED + i), fused_name(i)), "fused") for i in range(fused)])
            records.append(_measure(repo, store, derived, reference, n, config, texts, fused))
            bar.update(min(PUBLISHES, n) + 1)
            write_scale_reports(records, out, config)
        bar.close()
        files = [master / name for name in ("factors.safetensors", "head.safetensors", "task.json")]
        tasks = records[-1]["tasks"]  # the last count's Zipf draws, as _measure drew them
        weights = 1.0 / np.arange(1, tasks + 1)
        draws = np.random.default_rng(max(config.counts)).choice(tasks, size=config.warmup + config.requests,
                                                                 p=weights / weights.sum())[: config.warmup]
        policies = replay_version_policies(sum(p.stat().st_size for p in files) + 4096,
                                           read_repository(repo).options.task_cache_bytes, tasks, draws)
        write_scale_reports(records, out, config, policies)
        return {"out": str(out), "records": len(records), "config": asdict(config)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
