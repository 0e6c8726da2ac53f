"""`aot bench tax --engine torch`: what the GPU configs' path costs the server beside the encoder, measured on a CPU.

The torch engine's GPU configs serve `aot` from one fused python step (tokenize, look up, encode, answer a whole
batch; aot/model_repository/fused) in `gpu_instances` instances, the same code its CPU configs run with `device: cpu`.
So the server's CPU outside the encoder (tritonserver's gRPC and scheduling, the python backend's messages, the
tokenizer, the pool lookup, the heads, the outputs and the metrics) is measured here, before any GPU is lent: the
CPU time of the processes a request crosses (tritonserver and the step's instances; /proc, every thread) over a pass, less the CPU the steps' engines spent encoding
(`aot_engine_cpu_us_total`, each step's own clock around its engine call) and less what the server spends idle over
as long (liveness probes, the metrics thread: measured just before the pass), per request and per text, for single-text requests and for requests of many texts (aot.serving.columns), AoT with 8 tasks mixed text
by text. On this CPU the engine is slow (eager fp32), so a pass lasts long and the idle CPU matters.

The load generator is aot.Client's infer_many (one pack of texts per request) in this process, on the same cores;
its CPU is reported beside the server's.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from aot.benchmarks.report import markdown_table, write_json, write_text
from aot.benchmarks.serve import ServeBenchConfig, Store, _build, _texts
from aot.benchmarks.tax import cpu_seconds, own_cpu_seconds, server_processes

PUBLISH_WAIT = 1.3  # seconds: longer than a step's metrics interval (StepMetrics.FLUSH_SECONDS) and a bit
IDLE_SECONDS = 3.0  # the idle window before each pass (with PUBLISH_WAIT): probes and the metrics thread
# the processes a request crosses: tritonserver and the fused step's instances (the task list, with the store's
# background audit, is not on the path: reported, not counted)
REQUEST_PATH = ("tritonserver", "aot")


@dataclass
class TorchTaxConfig:
    task: str
    out: str
    repo: str | None = None
    texts_per_request: tuple[int, ...] = (1, 64)
    concurrency: tuple[int, ...] = (8, 32)
    texts: int = 1024  # per pass
    token_ids: tuple[bool, ...] = (False, True)  # clients sending text, and clients that tokenize (Client(tokenizer))
    mixed_tasks: int = 8
    max_batch_size: int = 128  # the GPU configs' batches: two 64-text requests batch together


def engine_cpu_us(metrics_url: str) -> float:
    """aot_engine_cpu_us_total summed over the server's step instances, once every instance has published."""
    time.sleep(PUBLISH_WAIT)
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^aot_engine_cpu_us_total\{[^}]*\} (\S+)", text, re.M))


def one_pass(server, items: list[dict], pack: int, concurrency: int, pids: dict[str, int],
             tokenizer: Path | None = None) -> dict:
    """`items` through the server `pack` texts to a request, `concurrency` requests in flight (`tokenizer`: the
    clients tokenize and send token ids); the server's CPU time and its engines' over the pass."""
    from aot.client.client import Client

    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    path = {name: pid for name, pid in pids.items() if name.split("#")[0] in REQUEST_PATH}
    idle0, idle_start = cpu_seconds(path), time.perf_counter()
    time.sleep(IDLE_SECONDS)
    engine0 = engine_cpu_us(metrics)  # waits for every instance to have published: part of the idle window
    before, own0, load0 = cpu_seconds(pids), own_cpu_seconds(), os.getloadavg()[0]
    idle_us_per_s = sum(before[p] - idle0[p] for p in idle0 if p in before) * 1e6 / (time.perf_counter() - idle_start)
    start = time.perf_counter()
    with Client(server.grpc_url, tokenizer=tokenizer) as client:
        answers = client.infer_many(items, concurrency=concurrency, pack=pack)
    wall = time.perf_counter() - start
    after, own = cpu_seconds(pids), own_cpu_seconds() - own0
    engine = engine_cpu_us(metrics) - engine0
    failed = sum("error" in a for a in answers)
    if failed:
        raise RuntimeError(f"{failed} of {len(items)} texts failed; the first: "
                           f"{next(a['error'] for a in answers if 'error' in a)}")
    server_us = sum((after[p] - before[p]) * 1e6 for p in path if p in before and p in after)
    texts, requests = len(items), -(-len(items) // pack)
    outside = server_us - engine - idle_us_per_s * wall
    return {"texts_per_request": pack, "concurrency": concurrency, "token_ids": tokenizer is not None,
            "texts": texts, "requests": requests,
            "texts_per_s": round(texts / wall, 1), "server_cpu_us_per_text": round(server_us / texts, 1),
            "engine_cpu_us_per_text": round(engine / texts, 1),
            "outside_engine_us_per_text": round(outside / texts, 1),
            "outside_engine_us_per_request": round(outside / requests, 1),
            "idle_cpu_us_per_s": round(idle_us_per_s, 1), "seconds": round(wall, 2),
            "by_process_us_per_text": {p: round((after[p] - before[p]) * 1e6 / texts, 1) for p in after if p in before},
            "client_cpu_us_per_text": round(own * 1e6 / texts, 1),
            "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def run_torch_tax(config: TorchTaxConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from aot.exporter.backbone_export import export_backbone
    from aot.local.server import LocalServer
    from aot.serving.repository import ServingOptions
    from aot.training.artifact import read_task

    out = Path(config.out)
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-tax-torch-"))
    repo = Path(config.repo) if config.repo else scratch / "repo-torch"
    if not (repo / "aot_repository.json").is_file():
        export_backbone(read_task(config.task).backbone["model"], repo,
                        ServingOptions(engine="torch", max_batch_size=config.max_batch_size))
    serve = ServeBenchConfig(config.task, config.out, str(repo), storages=("fused",), engine="torch")
    repo, masters, _ = _build(serve, scratch, "fp32")
    names = Store(repo, masters).set("fused", config.mixed_tasks)
    texts = _texts(config.texts)
    items = [{"task": names[i % len(names)], "text": t} for i, t in enumerate(texts)]
    records: list[dict] = []
    bar = tqdm(total=len(config.texts_per_request) * len(config.concurrency) * len(config.token_ids),
               desc="tax bench (torch)", disable=not progress)
    from aot.serving.repository import read_repository

    tokenizer = read_repository(repo).tokenizer_dir
    with LocalServer(repo) as server:
        pids = server_processes(server.process.pid)
        from aot.client.client import Client

        with Client(server.grpc_url) as client:  # warm every task and instance
            client.infer_many(items[: 8 * len(names)], concurrency=8, pack=1)
        for ids in config.token_ids:
            for pack in config.texts_per_request:
                for concurrency in config.concurrency:
                    records.append(one_pass(server, items, pack, concurrency, pids, tokenizer if ids else None))
                    bar.update(1)
    bar.close()
    write_reports(records, out, config)
    shutil.rmtree(scratch, ignore_errors=True)
    return {"out": str(out), "records": len(records), "config": asdict(config)}


def write_reports(records: list[dict], out: Path, config: TorchTaxConfig) -> None:
    write_json(out / "tax-torch.json", records)
    loads = [r["loadavg"] for r in records]
    text = (f"# The GPU configs' path on this CPU: the torch engine's fused step ({os.cpu_count()} cores; load "
            f"average {loads[0][0]:.2f} at the start, {loads[-1][1]:.2f} at the end)\n\n"
            f"AoT with {config.mixed_tasks} tasks mixed text by text, {config.texts} texts a pass, max batch "
            f"{config.max_batch_size}. Outside the engine: every server process's CPU less the engines' own "
            "(aot_engine_cpu_us_total) and less its idle CPU over the pass's time (measured just before it); the "
            "processes a request crosses: tritonserver and the fused step's instances (the task list and its "
            "background audit of the store's files are shown below, not counted).\n\n")
    text += markdown_table(records, ["token_ids", "texts_per_request", "concurrency", "texts_per_s",
                                     "server_cpu_us_per_text",
                                     "engine_cpu_us_per_text", "idle_cpu_us_per_s", "seconds",
                                     "outside_engine_us_per_text", "outside_engine_us_per_request",
                                     "client_cpu_us_per_text", "loadavg"],
                           ["token ids", "texts / request", "conc.", "texts/s", "server CPU us/text",
                            "engine CPU us/text",
                            "idle server CPU us/s", "pass s", "outside the engine us/text",
                            "outside the engine us/request", "load generator us/text", "load average (before, after)"])
    processes = sorted({p for r in records for p in r["by_process_us_per_text"]})
    for r in records:
        for p in processes:
            r[f"us:{p}"] = r["by_process_us_per_text"].get(p)
    text += "\n## Server CPU microseconds per text by process\n\n"
    text += markdown_table(records, ["token_ids", "texts_per_request", "concurrency", *(f"us:{p}" for p in processes)],
                           ["token ids", "texts / request", "conc.", *processes])
    for r in records:
        for p in processes:
            r.pop(f"us:{p}")
    write_text(out / "tax-torch.md", text)
