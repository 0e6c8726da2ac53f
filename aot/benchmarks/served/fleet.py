"""The local fleet's figures (docs/deploy-fleet.md): a fleet of 2 tritonservers behind HAProxy (aot/local/fleet.py).

    python -m aot.benchmarks.served.fleet --repo REPO --task ARTIFACT --name TASK --out docs/results/cpu-fleet-minilm

REPO is a model repository where ARTIFACT is published as TASK. Measured, on this machine (clients, HAProxy and
both replicas share its cores, so throughput cannot scale with replicas here: these are correctness and overhead
figures):
    balancer    the ensemble at concurrency 1 and 8, one replica direct against the fleet through HAProxy,
                alternated: req/s, p50, p99, errors
    proxy       what HAProxy alone adds (a liveness call, direct and through it), and the ensemble at concurrency
                1 sent round-robin to both replicas by the client, without HAProxy: the cost of alternating
                replicas that share two cores, apart from the proxy's
    equal       answers through the fleet against `aot predict` (PyTorch) on the same texts: max |logit difference|
    publish     publishing a new task, and replacing one: seconds from the publish's return until every replica
                answers with the new version (each replica asked directly, every 10 ms)
    kill        kill -9 of replica 1's tritonserver under load at concurrency 8 through HAProxy: failed requests,
                seconds until it is restarted and ready, and until HAProxy sends it traffic again
    store       for the paper estimate of 100 replicas x 10,000 tasks: the bytes of one task's files and of its
                manifest entry, and the time to stat and to parse a manifest of 10,000 such entries
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from aot.benchmarks.report import markdown_table, write_json, write_text
from aot.benchmarks.served.serve import _closed_loop, _texts
from aot.client.client import Client, InferenceError
from aot.exporter.task_export import export_task
from aot.local.fleet import Fleet
from aot.serving.repository import read_repository
from aot.serving.store.writer import TaskStore


def _version(repo: Path, name: str) -> str | None:
    entry = TaskStore(read_repository(repo).store_root).entries().get(name)
    return None if entry is None else entry.folder


def _serving(url: str, name: str, version: str, text: str) -> bool:
    try:
        with Client(url) as c:
            return c.infer(name, text)["version"] == version
    except InferenceError:
        return False



def measure_balancer(fleet: Fleet, name: str, texts: list[str], requests: int, rounds: int) -> list[dict]:
    items = [(name, texts[i % len(texts)]) for i in range(requests)]
    records = []
    for concurrency in (1, 8):
        for r in range(rounds):
            for path, url in (("one replica direct", fleet.servers[0].grpc_url), ("fleet of 2 via HAProxy",
                                                                                  fleet.grpc_url)):
                records.append({"path": path, "concurrency": concurrency, "round": r,
                                **_closed_loop(url, "aot", items, concurrency)})
    return records


def measure_proxy(fleet: Fleet, name: str, texts: list[str], calls: int = 300) -> list[dict]:
    """p50/p99 ms of a gRPC liveness call and of one inference at concurrency 1, by path."""
    paths = {"one replica direct": [fleet.servers[0].grpc_url], "fleet of 2 via HAProxy": [fleet.grpc_url],
             "client round-robin over both, no HAProxy": [s.grpc_url for s in fleet.servers]}
    records = []
    for path, urls in paths.items():
        clients = [Client(url) for url in urls]
        try:
            for call, run in (("liveness", lambda c, i: c._client.is_server_live()),
                              ("inference", lambda c, i: c.infer(name, texts[i % len(texts)]))):
                ms = []
                for i in range(calls):
                    start = time.perf_counter()
                    run(clients[i % len(clients)], i)
                    ms.append((time.perf_counter() - start) * 1e3)
                records.append({"path": path, "call": call, "p50_ms": round(float(np.percentile(ms, 50)), 2),
                                "p99_ms": round(float(np.percentile(ms, 99)), 2)})
        finally:
            for c in clients:
                c.close()
    return records


def measure_equal(fleet: Fleet, artifact: Path, name: str, texts: list[str]) -> dict:
    from aot.training.predict import Predictor

    expected = Predictor.load(artifact).logits(texts).numpy()
    with Client(fleet.grpc_url) as c:
        answers = c.infer_many([{"task": name, "text": t} for t in texts], concurrency=8)
    diff = max(float(np.abs(np.array(a["logits"]) - e).max()) for a, e in zip(answers, expected, strict=True))
    labels = sum(int(np.argmax(a["logits"]) == np.argmax(e)) for a, e in zip(answers, expected, strict=True))
    return {"texts": len(texts), "max_abs_logit_diff": diff, "same_label": labels}


def measure_publish(fleet: Fleet, artifact: Path, name: str, text: str, times: int) -> list[dict]:
    """New tasks `name-k`, then replacements of `name-0` (fused, then factored storage alternately)."""
    records = []
    for kind, task, storage in ([("new task", f"{name}-{k}", "fused") for k in range(times)]
                                + [("replace", f"{name}-0", ("factored", "fused")[k % 2]) for k in range(times)]):
        export_task(artifact, fleet.repo, task, storage, progress=False)
        published, version = time.monotonic(), _version(fleet.repo, task)
        pending, seconds = set(range(len(fleet.servers))), []
        while pending:
            for i in sorted(pending):
                if _serving(fleet.servers[i].grpc_url, task, version, text):
                    pending.discard(i)
                    seconds.append(time.monotonic() - published)
            if time.monotonic() - published > 120:
                raise RuntimeError(f"{task} not served by replicas {sorted(pending)} 120 s after its publish")
            time.sleep(0.01)
        records.append({"kind": kind, "storage": storage, "every_replica_s": round(max(seconds), 3)})
    for k in range(times):
        TaskStore(read_repository(fleet.repo).store_root).remove(f"{name}-{k}")
    return records


def measure_kill(fleet: Fleet, name: str, texts: list[str], seconds: float = 40) -> dict:
    """Closed-loop load at concurrency 8 through HAProxy; replica 1 killed after 3 s."""
    stop, lock = threading.Event(), threading.Lock()
    counts, failures = {"answers": 0}, []

    def worker(k: int) -> None:
        with Client(fleet.grpc_url) as c:
            i = k
            while not stop.is_set():
                try:
                    c.infer(name, texts[i % len(texts)])
                    with lock:
                        counts["answers"] += 1
                except InferenceError as exc:
                    failures.append(str(exc))
                i += 8

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    victim = fleet.servers[1]
    try:
        time.sleep(3)
        old, killed = victim.process.pid, time.monotonic()
        os.kill(old, signal.SIGKILL)
        while not (victim.process.pid != old and victim.serves()):
            time.sleep(0.02)
        ready = time.monotonic() - killed
        while fleet.states()["r1"] != "UP":
            time.sleep(0.02)
        up = time.monotonic() - killed
        time.sleep(max(0.0, seconds - (time.monotonic() - killed)))
    finally:
        stop.set()
        for t in threads:
            t.join()
    return {"answers": counts["answers"], "failed": len(failures), "first_failure": failures[:1],
            "restarted_and_ready_s": round(ready, 2), "back_in_haproxy_s": round(up, 2)}


def measure_store(repo: Path, name: str, tasks: int = 10000) -> dict:
    """One published task's file sizes, and an index of `tasks` copies of its entry (aot.serving.store.log): its bytes,
    the check every step does before a batch (a stat of the generation hint), the read of the whole index a step does
    at start, and the bytes a step reads for one more publish."""
    import tempfile

    from aot.serving.store.log import Change
    from aot.serving.store.shards import SHARDS
    from aot.serving.store.view import StoreView
    from aot.serving.store.writer import TaskStore

    store = TaskStore(read_repository(repo).store_root)
    entry = store.state().tasks[name]
    files = {p.name: p.stat().st_size for p in (store.root / entry["folder"]).iterdir()}
    with tempfile.TemporaryDirectory() as scratch:
        copy = TaskStore(scratch)
        copy._write_identity(store.identity()["backbone"])
        suffix = entry["folder"].rsplit("@", 1)[1]
        copy.log.commit(lambda _: Change(tasks={f"task-{k:05d}": {**entry, "folder": f"task-{k:05d}@{suffix}"}
                                                for k in range(tasks)}))
        copy.log.compact(copy.state())
        view = StoreView(TaskStore(scratch))
        start = time.perf_counter()
        view.refresh()
        read_s = time.perf_counter() - start
        assert len(view.index.entries) == tasks
        start = time.perf_counter()
        for _ in range(1000):
            view.refresh()
        check_us = (time.perf_counter() - start) * 1e3
        before = view.reader.backend.bytes_read
        copy.log.commit(lambda _: Change(tasks={"task-00000": {**entry, "folder": f"task-00000@{'0' * 12}"}}))
        view.reader.log._probed = 0.0
        view.refresh()
        publish_bytes = view.reader.backend.bytes_read - before
        index_bytes = sum(p.stat().st_size for d in ("index", SHARDS) for p in (Path(scratch) / d).iterdir())
    return {"task_files_bytes": files, "entry_bytes": len(json.dumps({name: entry})), "tasks": tasks,
            "index_bytes": index_bytes, "check_us": round(check_us, 2), "read_index_s": round(read_s, 3),
            "bytes_read_per_publish": publish_bytes}


def _summary(balancer: list[dict]) -> list[dict]:
    """Per path and concurrency: the median over rounds."""
    rows = []
    for concurrency in (1, 8):
        for path in ("one replica direct", "fleet of 2 via HAProxy"):
            runs = [r for r in balancer if r["path"] == path and r["concurrency"] == concurrency]
            rows.append({"path": path, "concurrency": concurrency,
                         **{k: round(float(np.median([r[k] for r in runs])), 2)
                            for k in ("throughput_rps", "p50_ms", "p99_ms")},
                         "errors": sum(r["errors"] for r in runs)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo", required=True)
    p.add_argument("--task", required=True, help="the artifact published in --repo as --name")
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--publishes", type=int, default=3)
    args = p.parse_args(argv)
    out, artifact, texts = Path(args.out), Path(args.task), _texts(64)
    with Fleet(Path(args.repo), replicas=2) as fleet:
        balancer = measure_balancer(fleet, args.name, texts, args.requests, args.rounds)
        result = {"balancer": _summary(balancer), "balancer_runs": balancer,
                  "proxy": measure_proxy(fleet, args.name, texts),
                  "equal": measure_equal(fleet, artifact, args.name, texts),
                  "publish": measure_publish(fleet, artifact, f"{args.name}-pub", texts[0], args.publishes),
                  "kill": measure_kill(fleet, args.name, texts), "cores": os.cpu_count(),
                  "store": measure_store(Path(args.repo), args.name)}
    write_json(out / "fleet.json", result)
    kill, equal = result["kill"], result["equal"]
    store_text = json.dumps(result["store"], indent=1)
    text = (f"# A local fleet of 2 behind HAProxy ({result['cores']} cores shared by clients, HAProxy and both "
            "replicas: throughput cannot scale here)\n\n## HAProxy's cost against one replica direct (median of "
            f"{args.rounds} alternated rounds of {args.requests} requests)\n\n"
            + markdown_table(result["balancer"], ["path", "concurrency", "throughput_rps", "p50_ms", "p99_ms",
                                                  "errors"],
                             ["path", "concurrency", "req/s", "p50 ms", "p99 ms", "errors"])
            + "\n\n## What HAProxy alone adds, and what alternating replicas costs (concurrency 1)\n\n"
            + markdown_table(result["proxy"], ["path", "call", "p50_ms", "p99_ms"],
                             ["path", "call", "p50 ms", "p99 ms"])
            + f"\n\n## Answers against aot predict\n\n{equal['texts']} texts: max |logit difference| "
            f"{equal['max_abs_logit_diff']:.2e}, same label {equal['same_label']}/{equal['texts']}\n\n"
            "## Publish to every replica serving\n\n"
            + markdown_table(result["publish"], ["kind", "storage", "every_replica_s"],
                             ["publish", "storage", "s until both replicas answer with the new version"])
            + f"\n\n## kill -9 of replica 1 under load (concurrency 8 through HAProxy)\n\n{kill['answers']} answers, "
            f"{kill['failed']} failed; restarted and ready after {kill['restarted_and_ready_s']} s, back in "
            f"HAProxy after {kill['back_in_haproxy_s']} s\n"
            f"\n## The store at scale (measured pieces of the paper estimate)\n\n```\n{store_text}\n```\n")
    write_text(out / "fleet.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
