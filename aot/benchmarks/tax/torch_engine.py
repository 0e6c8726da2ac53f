"""`aot bench tax --engine torch`: the CPU the GPU configs' request path costs the server, measured on a CPU.

The torch engine's GPU configs serve `aot` from one fused python step (tokenize, look up, encode, answer a whole
batch; aot/model_repository/fused) in several instances, the same code its CPU configs run with `device: cpu`. Served
here through the local tritonserver, with by default an encoder whose compute is negligible (aot.benchmarks.encoders
NEGLIGIBLE: 1 layer, hidden 64, random weights, MiniLM's vocabulary and tokenizer; an FC task trained on it for a
few steps and published 8 times), so that what a request costs is the path itself, not a difference of large
figures: tritonserver's gRPC and batching, the python backend's messages, the tokenizer, the task lookup, the heads,
the answers and the metrics. `--task` serves that task's encoder instead (the encoder's CPU is then most of it).

For each kind of client (text: TEXT + TASK; ids: the client tokenizes and sends token ids; mixed: both at once, half
the requests in flight each), each request size and each concurrency, a pass of `texts` texts, or of `min_requests`
requests where that is more (AoT, 8 tasks mixed text by text) through aot.Client.infer_many in this process, on the same cores. Per pass, from /proc (every thread's
run time): the CPU of tritonserver, of each instance of the fused step, and of the rest of the server (the task list
and its store audit), per text and per request; the engines' own CPU (`aot_engine_cpu_us_total`, each step's clock
around its engine call); "outside the engine": the request path's CPU (tritonserver and the step's instances) less
the engines' and less what that path spends idle over as long (liveness probes, the metrics threads: measured just
before the pass). The load generator's CPU and the load average are recorded beside them (the cores are shared).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from aot.benchmarks.tax.onnx_engine import cpu_seconds, own_cpu_seconds, server_processes

PUBLISH_WAIT = 1.3  # seconds: longer than a step's metrics interval (StepMetrics.FLUSH_SECONDS) and a bit
IDLE_SECONDS = 3.0  # the idle window before each pass (with PUBLISH_WAIT): probes and the metrics thread
# the processes a request crosses: tritonserver and the fused step's instances (the task list, with the store's
# background audit, is not on the path: reported as "rest", not counted)
REQUEST_PATH = ("tritonserver", "aot")
CLIENTS = ("text", "ids", "mixed")
TASK_TRAINING = dict(epochs=1, max_length=128, max_train_samples=64)  # a task to serve: accuracy does not matter


@dataclass
class TorchTaxConfig:
    out: str
    task: str | None = None  # None: the negligible encoder (aot.benchmarks.encoders.NEGLIGIBLE) and a task on it
    repo: str | None = None
    texts_per_request: tuple[int, ...] = (1, 64)
    concurrency: tuple[int, ...] = (8, 32)
    texts: int = 2048  # per pass
    min_requests: int = 128  # per pass: a pass of large requests grows to this many, so that it lasts a while
    clients: tuple[str, ...] = ("text", "ids")
    probes: bool = True  # the supervisor and its liveness probes run (as under `aot serve`)
    mixed_tasks: int = 8
    max_batch_size: int = 128  # the GPU configs' batches: two 64-text requests batch together
    tokenizer_from: str = "minilm"  # the negligible encoder's vocabulary and tokenizer
    data: str = "rotten_tomatoes"  # what its task trains on for a few steps


def engine_cpu_us(metrics_url: str) -> float:
    """aot_engine_cpu_us_total summed over the server's step instances, once every instance has published."""
    time.sleep(PUBLISH_WAIT)
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^aot_engine_cpu_us_total\{[^}]*\} (\S+)", text, re.M))


def negligible_task(scratch: Path, config: TorchTaxConfig) -> Path:
    """The negligible encoder (MiniLM's tokenizer, 1 layer, hidden 64, random weights) and an FC task trained on it
    in seconds: what the default pass serves."""
    from aot.benchmarks.encoders import NEGLIGIBLE, random_encoder
    from aot.training.api import train_task

    encoder = random_encoder(config.tokenizer_from, scratch / "negligible-encoder", NEGLIGIBLE)
    task = scratch / "negligible-task"
    train_task(model=str(encoder), data=config.data, method="fc", out=str(task), progress=False, **TASK_TRAINING)
    return task


def send(server, items: list[dict], pack: int, concurrency: int, clients: str, tokenizer: Path) -> list[dict]:
    """`items` through the server `pack` texts to a request, `concurrency` requests in flight, from `clients`: text
    clients, token-id clients, or both at once (each half the items and half the requests in flight)."""
    from aot.client.client import Client

    def run(part: list[dict], ids: bool, inflight: int, answers: list) -> None:
        with Client(server.grpc_url, tokenizer=tokenizer if ids else None) as client:
            answers.extend(client.infer_many(part, concurrency=inflight, pack=pack))

    if clients != "mixed":
        answers: list[dict] = []
        run(items, clients == "ids", concurrency, answers)
        return answers
    half = len(items) // 2 // pack * pack  # whole requests each
    parts = [(items[:half], False), (items[half:], True)]
    results: list[list[dict]] = [[], []]
    threads = [threading.Thread(target=run, args=(part, ids, max(1, concurrency // 2), results[k]))
               for k, (part, ids) in enumerate(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results[0] + results[1]


def one_pass(server, items: list[dict], pack: int, concurrency: int, clients: str, pids: dict[str, int],
             tokenizer: Path) -> dict:
    """One pass: the server's CPU by process, its engines' and the load generator's over it."""
    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    path = {name: pid for name, pid in pids.items() if name.split("#")[0] in REQUEST_PATH}
    idle0, idle_start = cpu_seconds(path), time.perf_counter()
    time.sleep(IDLE_SECONDS)
    engine0 = engine_cpu_us(metrics)  # waits for every instance to have published: part of the idle window
    before, own0, load0 = cpu_seconds(pids), own_cpu_seconds(), os.getloadavg()[0]
    idle_us_per_s = sum(before[p] - idle0[p] for p in idle0 if p in before) * 1e6 / (time.perf_counter() - idle_start)
    start = time.perf_counter()
    answers = send(server, items, pack, concurrency, clients, tokenizer)
    wall = time.perf_counter() - start
    after, own = cpu_seconds(pids), own_cpu_seconds() - own0
    engine = engine_cpu_us(metrics) - engine0
    failed = [a["error"] for a in answers if "error" in a]
    if failed or len(answers) != len(items):
        raise RuntimeError(f"{len(failed)} of {len(items)} texts failed ({len(answers)} answered); the first: "
                           f"{failed[0] if failed else 'none'}")
    texts, requests = len(items), -(-len(items) // pack)
    used = {p: (after[p] - before[p]) * 1e6 for p in after if p in before}
    by_process = {p: us for p, us in used.items() if p.split("#")[0] in REQUEST_PATH}
    by_process["rest"] = sum(us for p, us in used.items() if p not in by_process)
    server_us = sum(us for p, us in by_process.items() if p != "rest")
    outside = server_us - engine - idle_us_per_s * wall

    def per(total: float, n: int) -> float:
        return round(total / n, 1)

    return {"clients": clients, "texts_per_request": pack, "concurrency": concurrency, "texts": texts,
            "requests": requests, "seconds": round(wall, 2), "texts_per_s": round(texts / wall, 1),
            "server_cpu_us_per_text": per(server_us, texts), "server_cpu_us_per_request": per(server_us, requests),
            "engine_cpu_us_per_text": per(engine, texts),
            "outside_engine_us_per_text": per(outside, texts), "outside_engine_us_per_request": per(outside, requests),
            "idle_cpu_us_per_s": round(idle_us_per_s, 1),
            "by_process_us_per_text": {p: per(us, texts) for p, us in by_process.items()},
            "by_process_us_per_request": {p: per(us, requests) for p, us in by_process.items()},
            "client_cpu_us_per_text": per(own * 1e6, texts),
            "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def build_repository(config: TorchTaxConfig, task: Path, scratch: Path) -> tuple[Path, list[str]]:
    """The torch-engine repository (its GPU configs' batches) with the task published `mixed_tasks` times."""
    from aot.benchmarks.served.serve import ServeBenchConfig, Store, _build
    from aot.exporter.backbone_export import export_backbone
    from aot.serving.repository import ServingOptions
    from aot.training.artifact import read_task

    repo = Path(config.repo) if config.repo else scratch / "repo-torch"
    if not (repo / "aot_repository.json").is_file():
        export_backbone(read_task(str(task)).backbone["model"], repo,
                        ServingOptions(engine="torch", max_batch_size=config.max_batch_size))
    serve = ServeBenchConfig(str(task), config.out, str(repo), storages=("fused",), engine="torch")
    repo, masters, _ = _build(serve, scratch, "fp32")
    return repo, Store(repo, masters).set("fused", config.mixed_tasks)


def check(config: TorchTaxConfig) -> None:
    bad = [c for c in config.clients if c not in CLIENTS]
    if bad or not config.clients:
        raise ValueError(f"clients {', '.join(bad) or 'none'}: expected some of {', '.join(CLIENTS)}")
    large = [n for n in config.texts_per_request if n > config.max_batch_size]
    if large:
        raise ValueError(f"--texts-per-request {large} exceeds the served max batch size {config.max_batch_size}")


def run_torch_tax(config: TorchTaxConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from aot.benchmarks.served.serve import _texts
    from aot.benchmarks.tax.torch_report import write_reports
    from aot.local.server import LocalServer
    from aot.serving.repository import read_repository

    check(config)
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-tax-torch-"))
    try:
        task = Path(config.task) if config.task else negligible_task(scratch, config)
        repo, names = build_repository(config, task, scratch)
        most = max(config.texts, config.min_requests * max(config.texts_per_request))
        items = [{"task": names[i % len(names)], "text": t} for i, t in enumerate(_texts(most))]
        tokenizer = read_repository(repo).tokenizer_dir
        records: list[dict] = []
        bar = tqdm(total=len(config.clients) * len(config.texts_per_request) * len(config.concurrency),
                   desc="tax bench (torch)", disable=not progress)
        with LocalServer(repo, supervise=config.probes) as server:
            pids = server_processes(server.process.pid)
            for clients in ("text", "ids"):  # warm every task and instance, both input sets
                send(server, items[: 8 * len(names)], 1, 8, clients, tokenizer)
            for clients in config.clients:
                for pack in config.texts_per_request:
                    for concurrency in config.concurrency:
                        texts = max(config.texts, config.min_requests * pack)
                        records.append(one_pass(server, items[:texts], pack, concurrency, clients, pids, tokenizer))
                        bar.update(1)
        bar.close()
        write_reports(records, Path(config.out), config, describe_encoder(task, config))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"out": config.out, "records": len(records), "config": asdict(config)}


def describe_encoder(task: Path, config: TorchTaxConfig) -> str:
    """The served encoder in a line: the negligible one's shape, or the --task's folder."""
    import json

    from aot.training.artifact import read_task

    folder = Path(read_task(str(task)).backbone["model"])
    if config.task:
        return f"the encoder of --task {config.task} ({folder})"
    c = json.loads((folder / "config.json").read_text())
    return (f"a random-weight BERT of {c['num_hidden_layers']} layer, hidden {c['hidden_size']}, "
            f"{c['num_attention_heads']} heads, FFN {c['intermediate_size']} with {config.tokenizer_from}'s "
            f"vocabulary ({c['vocab_size']}) and tokenizer: its compute is negligible")
