"""`aot bench tasks --scale`'s cold first requests: tasks no request touched yet (their versions in no process of the
server, its host cache empty of them), asked one at a time on an idle server, and while clients keep one hot task
busy; and the fused tasks derived for them (a fused task's first request reads its table's blocks and hashes them).

    cold_p50_ms, cold_p99_ms                    factored tasks, one at a time, once the server's traffic ended
                                                (the scale bench's Zipf and hot passes: its caches full)
    busy_cold_p50_ms, busy_cold_p99_ms          as many others while `concurrency` - 1 clients keep task 0 busy:
    busy_warm_p50_ms, busy_cold_vs_warm         the hot requests' p50 meanwhile, and the cold p99 over it
    fused_cold_*, fused_busy_cold_*             the same for fused tasks (derived like the factored ones, their
                                                [V, L, d] table computed from the perturbed factors, as export fuses)
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from aot.benchmarks.report import percentile
from aot.serving import protocol

FUSED_PREFIX = "f"


def fused_name(i: int) -> str:
    return f"{FUSED_PREFIX}{i:06d}"


def fused_folder(store, master: Path, factors: dict[str, np.ndarray], name: str) -> Path:
    """A fused version folder of `factors` (the master task's task.json and head): its table the rows the factors
    give for every token, fp16, as `aot export task --storage fused` writes it."""
    import json
    import shutil

    from safetensors.numpy import save_file

    from aot.serving.tasks import load_task_version

    folder = store.new_version_folder(name)
    for file in ("task.json", "head.safetensors"):
        shutil.copy2(master / file, folder / file)
    save_file(factors, folder / "factors.safetensors")
    task = load_task_version(folder, store.version_name(folder), store.root)
    table = np.lib.format.open_memmap(folder / "table.npy", mode="w+", dtype=protocol.ROWS_DTYPE,
                                      shape=(task.vocab_size, task.num_layers, task.hidden_size))
    for start in range(0, task.vocab_size, 4096):
        ids = np.arange(start, min(start + 4096, task.vocab_size))
        table[ids] = task.rows(ids)
    table.flush()
    del table, task
    (folder / "factors.safetensors").unlink()
    meta = json.loads((folder / "task.json").read_text())
    (folder / "task.json").write_text(json.dumps({**meta, "storage": "fused"}))
    return folder


def cold_idle(url: str, tasks: list[str], text: str) -> list[float]:
    """First requests of `tasks`, one at a time (ms)."""
    from aot.client.client import Client

    out = []
    with Client(url) as client:
        for task in tasks:
            start = time.perf_counter()
            client.infer(task, text)
            out.append((time.perf_counter() - start) * 1e3)
    return out


def cold_under_load(url: str, hot_task: str, texts: list[str], cold: dict[str, list[str]], concurrency: int) -> dict:
    """First requests of each list of `cold` (prefix -> tasks), one at a time, while `concurrency` - 1 clients keep
    `hot_task` busy from before the first to after the last; the hot requests' p50 meanwhile, and `busy_errors`."""
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
    try:
        if not started.wait(timeout=60):
            raise RuntimeError(f"the load on {hot_task} answered nothing within 60 s ({errors[0]} errors)")
        latencies = {prefix: cold_idle(url, tasks, texts[0]) for prefix, tasks in cold.items()}
    finally:
        stop.set()
        for thread in loaders:
            thread.join()
    warm_p50, out = percentile(warm, 0.5), {"busy_errors": errors[0]}
    for prefix, values in latencies.items():
        p99 = percentile(values, 0.99)
        out.update({f"{prefix}busy_cold_requests": len(values), f"{prefix}busy_cold_p50_ms": percentile(values, 0.5),
                    f"{prefix}busy_cold_p99_ms": p99, f"{prefix}busy_warm_p50_ms": warm_p50,
                    f"{prefix}busy_cold_vs_warm": round(p99 / warm_p50, 2) if p99 and warm_p50 else None})
    return out
