"""`aot bench tasks`: how serving scales with the number of tasks, through the real local tritonserver.

From one trained AoT task it derives N tasks with independently perturbed factors (every factor multiplied by
1 + 0.05 * N(0, 1), seeded per task, so their rows differ), publishes them, and measures three ways of serving them
side by side, each on a fresh server, for every task count and popularity:

    fused-mmap   fused tables read through their memory maps (no pool): today's design; one table per task on disk
    factored     factors only, rows computed per request (no pool)
    pool         factors, rows kept in the task pool (aot.serving.pool) with a fixed budget

Requests pick a task by popularity (zipf: task k with probability ~ 1/k; uniform), texts from Rotten Tomatoes (dev).
A warm-up pass of the same distribution precedes the measured pass (the pool's steady state); the hit rate is the
measured pass's. Records: tasks, mode, popularity, throughput_rps, p50_ms, p99_ms, rss_mb (server and stubs),
hit_rate (pool only), ready_seconds, errors. Fused tables that would not fit on the disk are skipped and said so.

The served runs are too short to fill the pool (1,000 tasks x ~25 new rows a request fill 8 tables' budget only
after ~10,000 requests), so the eviction policies are compared by replaying a longer trace of the same kind
(Rotten Tomatoes train texts, the same popularity, the largest task count) through the pool itself, in this
process, with the bench's budget and with 1/8 of it: records `policies`, each with the hit rate of the trace's
second half (steady state) and the pool's bookkeeping time per request.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from aot.benchmarks.report import markdown_table, new_figure, save_figure, write_json, write_text
from aot.benchmarks.served.serve import _closed_loop, _published_counters, _server_rss_mb, _texts
from aot.serving import protocol
from aot.serving.pool import POLICIES, RowPool
from aot.serving.repository import RepositoryInfo, read_repository
from aot.serving.store.layout import FACTORS, HEAD, TABLE, TASK_JSON
from aot.serving.store.writer import TaskStore
from aot.serving.tasks import load_task_version, token_index
from aot.serving.tokenization import Tokenization

MODES = ("fused-mmap", "factored", "pool")
POPULARITIES = ("zipf", "uniform")


@dataclass
class TasksBenchConfig:
    task: str
    out: str
    counts: tuple[int, ...] = (1, 10, 100, 1000)
    popularity: tuple[str, ...] = POPULARITIES
    pool_bytes: int | None = None  # default: what 8 fused tables take
    concurrency: int = 8
    requests: int = 400
    modes: tuple[str, ...] = MODES
    disk_fraction: float = 0.5  # fused tables may use at most this share of the free disk
    policy_requests: int = 20000  # requests replayed per eviction policy (0: no replay)
    repeats: int = 1  # runs of each configuration (fresh server each), interleaved; records keep the median


def _perturbed(factors: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (v * (1 + 0.05 * rng.standard_normal(v.shape))).astype(v.dtype) for k, v in factors.items()}


class DerivedTasks:
    """Publishes N derived tasks of one storage into a repository's store (replacing what it held)."""

    def __init__(self, repo: Path, master: Path):
        from safetensors.numpy import load_file

        self.store = TaskStore(read_repository(repo).store_root)
        self.master = master
        self.factors = load_file(master / FACTORS)

    def publish(self, storage: str, n: int) -> list[str]:
        import json

        from safetensors.numpy import save_file

        for name in list(self.store.entries()):
            self.store.remove(name)
        names = [f"t{i:04d}" for i in range(n)]
        for i, name in enumerate(names):
            folder = self.store.new_version_folder(name)
            for file in (TASK_JSON, HEAD):
                shutil.copy2(self.master / file, folder / file)
            factors = _perturbed(self.factors, seed=i)
            save_file(factors, folder / FACTORS)
            if storage == "fused":
                task = load_task_version(folder, TaskStore.version_name(folder), self.store.root)
                table = np.lib.format.open_memmap(folder / TABLE, mode="w+", dtype=protocol.ROWS_DTYPE,
                                                  shape=(task.vocab_size, task.num_layers, task.hidden_size))
                for start in range(0, task.vocab_size, 4096):
                    ids = np.arange(start, min(start + 4096, task.vocab_size))
                    table[ids] = task.rows(ids)
                table.flush()
                del table
                (folder / FACTORS).unlink()
                meta = json.loads((folder / TASK_JSON).read_text())
                (folder / TASK_JSON).write_text(json.dumps({**meta, "storage": "fused"}))
            self.store.publish(name, folder, storage)
        return names


def _picks(popularity: str, tasks: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if popularity == "uniform":
        return rng.integers(0, tasks, n)
    weights = 1.0 / np.arange(1, tasks + 1)
    return rng.choice(tasks, size=n, p=weights / weights.sum())


def replay_policies(info: RepositoryInfo, tasks: int, popularity: str, pool_bytes: int, requests: int,
                    batch: int = 8, max_length: int = 64) -> list[dict]:
    """One trace (task by popularity, a real text's distinct tokens per request) through a pool of each policy."""
    from aot.training.data import load_task_data

    tokens = Tokenization(info.tokenizer_dir, info.uses_token_type_ids)
    texts = [e.text for e in load_task_data("rotten_tomatoes").train]
    ids = []
    for text in texts[:requests]:
        enc = tokens.encode(text, None, max_length)
        ids.append(token_index(enc[protocol.INPUT_IDS], enc[protocol.ATTENTION_MASK])[0])
    picks = _picks(popularity, tasks, requests, seed=tasks + 1)
    trace = [(f"t{k:04d}@{k:012x}", ids[i % len(ids)]) for i, k in enumerate(picks)]
    zeros = np.zeros((batch * max_length, info.num_layers, info.hidden_size), protocol.ROWS_DTYPE)
    records = []
    for policy in POLICIES:
        pool = RowPool(pool_bytes, info.num_layers, info.hidden_size, info.vocab_size, policy)
        for k in range(tasks):
            pool.attach(f"t{k:04d}@{k:012x}", lambda u: zeros[:len(u)])
        half = len(trace) // 2
        bypassed = 0  # rows of batches larger than the whole pool: served from storage (as the registry does)
        start = counted = time.perf_counter()
        for i in range(0, len(trace), batch):
            if i >= half and counted == start:
                counted = time.perf_counter()
                hits0 = sum(st.hits for st in pool.stats.values())
                misses0 = sum(st.misses for st in pool.stats.values()) + bypassed
            try:
                pool.rows_many(trace[i:i + batch])
            except MemoryError:
                bypassed += sum(len(u) for _, u in trace[i:i + batch])
        seconds = time.perf_counter() - counted
        hits = sum(st.hits for st in pool.stats.values()) - hits0
        misses = sum(st.misses for st in pool.stats.values()) + bypassed - misses0
        records.append({"policy": policy, "tasks": tasks, "popularity": popularity, "requests": len(trace),
                        "pool_rows": pool.slots, "resident": pool.resident,
                        "hit_rate": round(hits / max(1, hits + misses), 4),
                        "evictions": sum(st.evictions for st in pool.stats.values()),
                        "us_per_request": round(seconds / (len(trace) - half) * 1e6, 1)})
    return records


def _served_run(repo: Path, names: list[str], texts: list[str], n: int, mode: str, popularity: str, pool_bytes: int,
                config: TasksBenchConfig) -> dict:
    """One fresh server: warm-up pass, measured pass; throughput, latency, RSS, hit rate, start-up."""
    from aot.local.server import LocalServer

    picks = _picks(popularity, n, 2 * config.requests, seed=n)
    items = [(names[k], texts[i]) for i, k in enumerate(picks)]
    with LocalServer(repo, pool_bytes=pool_bytes if mode == "pool" else 0) as server:
        metrics = f"http://{server.host}:{server.metrics_port}/metrics"
        warm = _closed_loop(server.grpc_url, "aot", items[:config.requests], config.concurrency)
        hits0, misses0 = _published_counters(server.grpc_url, metrics, names[0], texts[0])
        result = _closed_loop(server.grpc_url, "aot", items[config.requests:], config.concurrency)
        hits, misses = _published_counters(server.grpc_url, metrics, names[0], texts[0])
        rss = _server_rss_mb(server.process)
        ready = server.ready_seconds
    lookups = (hits - hits0) + (misses - misses0)
    return {**result, "errors": result["errors"] + warm["errors"], "rss_mb": round(rss, 1),
            "hit_rate": round((hits - hits0) / lookups, 4) if mode == "pool" and lookups else None,
            "ready_seconds": round(ready, 2)}


def run_tasks_bench(config: TasksBenchConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from aot.exporter.backbone_export import export_backbone
    from aot.exporter.task_export import export_task
    from aot.training.artifact import read_task

    out = Path(config.out)
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-tasks-"))
    repo = scratch / "repo"
    export_backbone(read_task(config.task).backbone["model"], repo)
    info = read_repository(repo)
    report = export_task(config.task, repo, "master", "factored", progress=False)
    master = scratch / "master"
    shutil.copytree(info.store_root / report.folder, master)
    TaskStore(info.store_root).remove("master")
    derived = DerivedTasks(repo, master)
    table_bytes = info.vocab_size * info.num_layers * info.hidden_size * protocol.ROWS_DTYPE.itemsize
    pool_bytes = config.pool_bytes if config.pool_bytes is not None else 8 * table_bytes
    factor_bytes = sum(a.nbytes for a in derived.factors.values())
    texts = _texts(2 * config.requests)
    records, notes = [], []
    runs = [(n, m, p) for n in config.counts for m in config.modes for p in config.popularity]
    bar = tqdm(total=len(runs) * config.repeats, desc="tasks bench", disable=not progress)
    for n in config.counts:
        for storage in ("fused", "factored"):
            group = [(m, p) for m in config.modes for p in config.popularity
                     if ("fused" if m == "fused-mmap" else "factored") == storage]
            if not group:
                continue
            if storage == "fused" and n * table_bytes > config.disk_fraction * shutil.disk_usage(scratch).free:
                notes.append(f"fused-mmap with {n} tasks skipped: {n} tables of {table_bytes / 2**20:.0f} MiB "
                             f"exceed {config.disk_fraction:.0%} of the free disk")
                bar.update(len(group) * config.repeats)
                continue
            names = derived.publish(storage, n)
            measured: dict[tuple[str, str], list[dict]] = {c: [] for c in group}
            for _ in range(config.repeats):  # interleaved: a slow minute of the machine hits every configuration
                for mode, popularity in group:
                    measured[(mode, popularity)].append(_served_run(repo, names, texts, n, mode, popularity,
                                                                    pool_bytes, config))
                    bar.update(1)
            for (mode, popularity), results in measured.items():
                median = sorted(results, key=lambda r: r["throughput_rps"])[len(results) // 2]
                records.append({"tasks": n, "mode": mode, "popularity": popularity, **median,
                                "throughput_runs": [r["throughput_rps"] for r in results],
                                "errors": sum(r["errors"] for r in results), "requests": config.requests,
                                "concurrency": config.concurrency, "pool_bytes": pool_bytes if mode == "pool" else 0,
                                "factor_bytes_per_task": factor_bytes, "table_bytes_per_task": table_bytes})
            write_reports(records, notes, out)
    bar.close()
    policies = []
    if config.policy_requests and "pool" in config.modes:
        runs = [(p, b) for p in config.popularity for b in (pool_bytes, pool_bytes // 8)]
        for popularity, budget in tqdm(runs, desc="eviction policies", disable=not progress):
            policies += replay_policies(info, max(config.counts), popularity, budget, config.policy_requests,
                                        config.concurrency)
    write_reports(records, notes, out, policies)
    shutil.rmtree(scratch, ignore_errors=True)
    return {"out": str(out), "records": len(records), "notes": notes, "config": asdict(config)}


def write_reports(records: list[dict], notes: list[str], out: Path, policies: list[dict] = ()) -> None:
    write_json(out / "tasks.json", {"records": records, "notes": notes, "policies": list(policies)})
    for r in records:
        base = [b for b in records if b["tasks"] == 1 and b["mode"] == r["mode"] and b["popularity"] == r["popularity"]]
        r["vs_1_task"] = round(r["throughput_rps"] / base[0]["throughput_rps"], 3) if base else None
    text = "# Tasks scaling through the local tritonserver (CPU)\n\n"
    for r in records:
        r["runs"] = " / ".join(f"{x:.1f}" for x in r.get("throughput_runs", [r["throughput_rps"]]))
    text += markdown_table(records, ["tasks", "mode", "popularity", "throughput_rps", "vs_1_task", "runs", "p50_ms",
                                     "p99_ms", "rss_mb", "hit_rate", "ready_seconds", "errors"],
                           ["tasks", "mode", "popularity", "req/s (median)", "× 1 task", "req/s of each run",
                            "p50 ms", "p99 ms", "RSS MB", "pool hit rate", "start (s)", "errors"])
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    if policies:
        text += ("\n## Eviction policies: one trace replayed through the pool (in-process, hit rate of its second "
                 "half)\n\n")
        text += markdown_table(list(policies), ["tasks", "popularity", "policy", "requests", "pool_rows", "hit_rate",
                                                "evictions", "us_per_request"],
                               ["tasks", "popularity", "policy", "requests", "pool rows", "hit rate", "evictions",
                                "pool µs / request"])
    write_text(out / "tasks.md", text)
    if records:
        fig, (left, right) = new_figure(11, 4.5, ncols=2)
        for mode in MODES:
            for popularity in POPULARITIES:
                rows = sorted((r for r in records if r["mode"] == mode and r["popularity"] == popularity),
                              key=lambda r: r["tasks"])
                if rows:
                    label = f"{mode}, {popularity}"
                    left.plot([r["tasks"] for r in rows], [r["throughput_rps"] for r in rows], marker="o", label=label)
                    right.plot([r["tasks"] for r in rows], [r["rss_mb"] for r in rows], marker="o", label=label)
        for ax, ylabel in ((left, "requests / s"), (right, "server RSS (MB)")):
            ax.set_xscale("log")
            ax.set_xlabel("tasks served")
            ax.set_ylabel(ylabel)
        left.legend(fontsize=7)
        fig.suptitle("Serving many tasks on one backbone (CPU)")
        save_figure(fig, out / "tasks.png")
