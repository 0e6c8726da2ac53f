"""`aot bench infinity`: `aot serve` against Infinity (michaelfeil/infinity), the server a CPU user would pick for
the same encoder, in one run on the same texts.

Infinity runs from a Python environment of its own (`--infinity`: its `infinity_emb` executable; it pins numpy < 2),
with its ONNX Runtime engine (`--engine optimum`, mean pooling) on the same MiniLM: per precision a model folder of
its own, the encoder exported to `model.onnx` by optimum and, for int8, `model_quantized.onnx` quantized by
optimum's ORTQuantizer as sentence-transformers recommends for CPUs (dynamic, per channel, AVX-512 VNNI), which
Infinity prefers on a CPU. Each is served alone and driven by the same closed loop
(aot.benchmarks.served.serve.closed_loop) as
`aot serve`, over its own protocol (HTTP `/embeddings` for Infinity, gRPC for `aot serve`), one text per request, at
each concurrency. `aot serve` is measured by `aot bench serve` in the same run (the AoT task, 8 tasks mixed, and the
vanilla ensemble; fp32 and int8 repositories).

    infinity.json, infinity.md     requests/s, p50 and p99 latency of every server and precision at each concurrency
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from aot.benchmarks.report import markdown_table, write_json, write_text
from aot.benchmarks.served.serve import ServeBenchConfig, _texts, closed_loop, run_serve_bench
from aot.local.processes import stop_process_group
from aot.local.server import free_port

START_TIMEOUT = 600.0  # seconds for Infinity to optimize and load its model

# run in Infinity's environment: the encoder to ONNX (and its int8 twin) as Infinity's optimum engine reads it
EXPORT = """
import sys
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig
source, folder, precision = sys.argv[1:]
ORTModelForFeatureExtraction.from_pretrained(source, export=True).save_pretrained(folder)
if precision == "int8":
    config = AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=True)
    ORTQuantizer.from_pretrained(folder).quantize(save_dir=folder, quantization_config=config)
"""


@dataclass
class InfinityBenchConfig:
    task: str
    out: str
    infinity: str  # the infinity_emb executable of Infinity's own environment
    precisions: tuple[str, ...] = ("fp32", "int8")
    concurrency: tuple[int, ...] = (1, 8, 32)
    requests: int = 1000


def model_folder(model: str, python: str, folder: Path, precision: str) -> Path:
    """The encoder's files and its ONNX export(s) for Infinity: tokenizer, config and pooling as packaged."""
    from aot.training.backbone import resolve_model_path

    shutil.copytree(resolve_model_path(model), folder)
    subprocess.run([python, "-c", EXPORT, str(folder), str(folder), precision], check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return folder


@contextlib.contextmanager
def infinity_server(executable: str, folder: Path, log: Path):
    """Infinity serving `folder` on a free port: yields the port once /health answers."""
    port = free_port()
    # Infinity names the ONNX file by its path under the model id, which optimum compares with the files' bare names:
    # so the files lie at the folder's top, the folder is the working directory and the id "."; its optimized graph
    # goes to a cache of this folder's own
    command = [executable, "v2", "--model-id", ".", "--engine", "optimum", "--device", "cpu",
               "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "minilm", "--pooling-method", "mean"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(folder / ".cache"),
                                        "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"})
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"Infinity exited with {process.returncode} before it served: see {log}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Infinity did not answer /health within {START_TIMEOUT:.0f} s: see {log}")
            time.sleep(0.5)
        yield port
    finally:
        stop_process_group(process, grace=30)


def http_sender(port: int):
    """A closed_loop sender: one keep-alive HTTP connection, one text per POST /embeddings."""

    @contextlib.contextmanager
    def sender():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def send(text: str) -> None:
            body = json.dumps({"model": "minilm", "input": [text]})
            connection.request("POST", "/embeddings", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")

        try:
            yield send
        finally:
            connection.close()

    return sender


def run_infinity_bench(config: InfinityBenchConfig, progress: bool = True) -> dict:
    from aot.training.artifact import read_task

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    python = str(Path(config.infinity).with_name("python"))
    texts = _texts(config.requests)
    records: list[dict] = []
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-infinity-"))
    try:
        model = read_task(config.task).backbone["model"]
        for precision in config.precisions:
            folder = model_folder(model, python, scratch / f"minilm-{precision}", precision)
            with infinity_server(config.infinity, folder, out / f"infinity-{precision}.log") as port:
                closed_loop(http_sender(port), texts[:64], 4)  # warm-up: every batch shape the loop makes
                for concurrency in config.concurrency:
                    result = closed_loop(http_sender(port), texts, concurrency)
                    records.append({"server": "infinity", "model": "embeddings", "precision": precision,
                                    "concurrency": concurrency, **result})
                    write_infinity_reports(records, out)
        serve = ServeBenchConfig(config.task, str(out / "aot-serve"), task_counts=(1,),
                                 concurrency=config.concurrency, storages=("factored",), requests=config.requests,
                                 precisions=config.precisions, rounds=1)  # one pass, as Infinity's
        run_serve_bench(serve, progress=progress)
        for r in json.loads((out / "aot-serve" / "serve.json").read_text()):
            if r["kind"] == "latency":
                name = r["model"] if r["model"] == "vanilla" else f"aot, {r['tasks_in_flight']} task(s)"
                records.append({"server": "aot serve", "model": name, "precision": r["precision"],
                                "concurrency": r["concurrency"],
                                **{k: r[k] for k in ("throughput_rps", "p50_ms", "p99_ms", "errors", "mean_ms")}})
        write_infinity_reports(records, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"out": str(out), "records": len(records), "config": asdict(config)}


def write_infinity_reports(records: list[dict], out: Path) -> None:
    write_json(out / "infinity.json", records)
    rows = []
    for r in records:
        peer = next((p for p in records if p["server"] == "infinity" and p["precision"] == r["precision"]
                     and p["concurrency"] == r["concurrency"]), None)
        rows.append({**r, "vs_infinity": round(r["throughput_rps"] / peer["throughput_rps"], 2) if peer else None})
    text = "# `aot serve` against Infinity (CPU, MiniLM, one text per request)\n\n" + markdown_table(
        rows, ["server", "model", "precision", "concurrency", "throughput_rps", "vs_infinity", "p50_ms", "p99_ms",
               "errors"],
        ["server", "what", "precision", "concurrency", "req/s", "× Infinity", "p50 ms", "p99 ms", "errors"])
    write_text(out / "infinity.md", text)
