"""The batcher's spin, measured (issue 52, item 4): tritonserver's CPU per text with 64-text requests at c=8 (text
clients, and text beside token-id clients), for each liveness probe (as before: every declared input; as now: TEXT +
TASK; none) and each batching of the fused step (Triton's prefetching, its default; batch_when_free: prefetching off).

    python spin-matrix.py TASK REPO OUT   (TASK: an AoT task on a real-size encoder, so that a batch takes long; REPO: a
                                           scratch torch-engine repository exported for it, max batch 128)
"""
import json, sys, re
from pathlib import Path

import aot.serving.supervision.probes as probes
from aot.benchmarks.tax_torch import TorchTaxConfig, build_repository, one_pass, send
from aot.benchmarks.serve import _texts
from aot.benchmarks.tax import server_processes
from aot.local.server import LocalServer
from aot.serving.repository import read_repository

task, repo, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
config = TorchTaxConfig(out=str(out), task=str(task), repo=str(repo))
scratch = out / "scratch"
repo, names = build_repository(config, task, scratch)
cpu = repo / "models" / "aot" / "configs" / "cpu.pbtxt"
when_free = cpu.read_text()
assert "allow_timeout_override: true" in when_free, "export the repository with this checkout's exporter"
prefetch = re.sub(r"\n  default_queue_policy \{\n    allow_timeout_override: true\n  \}", "", when_free)
items = [{"task": names[i % len(names)], "text": t} for i, t in enumerate(_texts(int(sys.argv[4]) if len(sys.argv) > 4 else 1024))]
tokenizer = read_repository(repo).tokenizer_dir
every = probes.CLIENT_INPUTS
rows = []
for batching, text in (("prefetch (Triton's default)", prefetch), ("batch_when_free", when_free)):
    cpu.write_text(text)
    for probe in ("every input (before)", "TEXT + TASK (now)", "off"):
        probes.CLIENT_INPUTS = ("TEXT", "TEXT_PAIR", "TASK", "input_ids", "attention_mask", "token_type_ids") \
            if probe.startswith("every") else every
        with LocalServer(repo, supervise=probe != "off") as server:
            pids = server_processes(server.process.pid)
            for clients in ("text", "ids"):
                send(server, items[:64], 1, 8, clients, tokenizer)
            for clients in ("text", "mixed"):
                try:
                    r = one_pass(server, items, 64, 8, clients, pids, tokenizer)
                except RuntimeError as exc:
                    rows.append({"batching": batching, "probe": probe, "clients": clients, "error": str(exc)[:300]})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                row = {"batching": batching, "probe": probe, "clients": clients, "texts_per_s": r["texts_per_s"],
                       "tritonserver_us_per_text": r["by_process_us_per_text"]["tritonserver"],
                       "idle_path_cpu_us_per_s": r["idle_cpu_us_per_s"], "seconds": r["seconds"], "loadavg": r["loadavg"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
cpu.write_text(when_free)
(out / "spin-matrix.json").write_text(json.dumps(rows, indent=1))
