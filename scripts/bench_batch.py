"""Batch scoring with `aot infer --input` through a real `aot serve` (issue 54), this checkout against an old one,
side by side in one run: docs/benchmarks.md, "Batch scoring".

    git archive ce6c3f6 aot | tar -x -C /tmp/old        # the old client (any tree holding an `aot` package)
    .venv/bin/python scripts/bench_batch.py --repo REPO --task NAME --old /tmp/old --out docs/results/batch-scoring

Cases (each `aot infer` a process of its own, the server the same `aot serve` of this checkout):
  throughput   the same --throughput-lines, old and new alternating, --runs each: lines/s from the wall time, the
               ratio of each pair of runs (the machine's load drifts: a pair shares it), and the client's CPU time
               per 1,000 lines (its own cost, whatever the load)
  restart      --lines lines, SIGTERM of the server --stop-after seconds in (it drains first, `aot serve`'s default),
               started again once it exited: lines lost, duplicated, wrong (against a clean run), exit status
  gone         the same, never started again
  rate         600 lines against `aot serve --rate-limit 100`: time, lines answered, refusals
  resume       (new only) a client killed when half the lines are written, then --resume: every line once
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PORTS = {"http": 18100, "grpc": 18101, "metrics": 18102, "health": 18103}


def texts(count: int) -> list[str]:
    from aot.training.data import load_task_data

    data = load_task_data("rotten_tomatoes")
    pool = [ex.text for ex in data.train + data.dev]
    return [pool[k % len(pool)] for k in range(count)]


def write_requests(path: Path, task: str, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": k, "task": task, "text": t}) + "\n" for k, t in enumerate(texts(count))))
    return path


def serve(repo: str, *extra: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "aot", "serve", "--repo", repo,
                                *(f"--{name}-port={port}" for name, port in PORTS.items()), *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                               start_new_session=True)
    if not process.stdout.readline():
        raise RuntimeError("aot serve did not start")
    return process


def stop(server: subprocess.Popen) -> None:
    while server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            continue


def infer(tree: Path | None, requests: Path, out: Path, *extra: str) -> subprocess.Popen:
    """`aot infer --input` of this checkout (tree None) or of the old tree."""
    env = dict(os.environ) | ({"PYTHONPATH": str(tree)} if tree else {})
    return subprocess.Popen([sys.executable, "-m", "aot", "infer", "--url", f"127.0.0.1:{PORTS['grpc']}", "--input",
                             str(requests), "--output", str(out), "--no-progress", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tree or ROOT, env=env)


def finish(client: subprocess.Popen, started: float) -> dict:
    """The client's exit status, wall time, CPU time (user + system: its own cost, whatever the machine's load) and
    the last lines it said."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    _, err = client.communicate(timeout=3600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"rc": client.returncode, "seconds": round(time.monotonic() - started, 2), "cpu_seconds": round(cpu, 2),
            "stderr": [line for line in err.splitlines() if line.startswith("aot:")][-3:]}


def check(out: Path, reference: dict[int, dict], lines: int) -> dict:
    """Lines lost, duplicated, wrong (label or logits off the clean run's by more than 1e-4), failed."""
    answers = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    ids = [a.get("id") for a in answers]
    good = [a for a in answers if "error" not in a]
    wrong = sum(1 for a in good if a["label"] != reference[a["id"]]["label"]
                or not np.allclose(a["logits"], reference[a["id"]]["logits"], atol=1e-4))
    return {"written": len(answers), "lost": len(set(range(lines)) - {a["id"] for a in good}),
            "duplicated": len(ids) - len(set(ids)), "wrong": wrong, "failed": len(answers) - len(good)}


def written(out: Path) -> int:
    """Lines in `out` so far (the old client writes its file at the end)."""
    return out.read_bytes().count(b"\n") if out.exists() else 0


def stop_mid_run(repo: str, tree: Path | None, requests: Path, out: Path, lines: int, after: float, restart: bool,
                 reference: dict) -> dict:
    server = serve(repo)
    started = time.monotonic()
    client = infer(tree, requests, out)
    time.sleep(after)
    at_sigterm = written(out)
    stop(server)
    stopped = time.monotonic() - started
    ready = None
    if restart:
        server = serve(repo)
        ready = round(time.monotonic() - started, 2)
    result = finish(client, started)
    stop(server)
    return result | check(out, reference, lines) | {"written_at_sigterm": at_sigterm, "server_gone_at": round(stopped, 2),
                                                     "serving_again_at": ready}


def metric(name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORTS['metrics']}/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--old", required=True, type=Path, help="a tree holding the old `aot` package")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--lines", type=int, default=9000)
    parser.add_argument("--throughput-lines", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--stop-after", type=float, default=10.0)
    parser.add_argument("--cases", default="throughput,restart,gone,rate,resume")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    trees = {"old": args.old, "new": None}
    results: dict = {"load_average_start": os.getloadavg()}
    cases = args.cases.split(",")
    big = write_requests(work / "lines.jsonl", args.task, args.lines)

    server = serve(args.repo)
    try:
        started = time.monotonic()
        results["reference"] = finish(infer(None, big, work / "reference.jsonl"), started)
        reference = {a["id"]: a for a in map(json.loads, (work / "reference.jsonl").read_text().splitlines())}
        if "throughput" in cases:
            small = write_requests(work / "throughput.jsonl", args.task, args.throughput_lines)
            runs: dict[str, list[float]] = {"old": [], "new": []}
            cpu: dict[str, list[float]] = {"old": [], "new": []}  # client CPU ms per 1,000 lines
            failed = {"old": 0, "new": 0}
            for k in range(args.runs):  # alternating, the first of each pair swapped every run
                for name in (("old", "new") if k % 2 == 0 else ("new", "old")):
                    out = work / f"throughput-{name}.jsonl"
                    started = time.monotonic()
                    done = finish(infer(trees[name], small, out), started)
                    assert done["rc"] == 0, done
                    failed[name] += check(out, reference, args.throughput_lines)["failed"]
                    runs[name].append(args.throughput_lines / done["seconds"])
                    cpu[name].append(1e6 * done["cpu_seconds"] / args.throughput_lines)
            ratios = [n / o for n, o in zip(runs["new"], runs["old"], strict=True)]
            results["throughput"] = {name: {"lines_per_s": [round(r, 1) for r in values],
                                            "median": round(statistics.median(values), 1), "failed": failed[name],
                                            "client_cpu_ms_per_1000_lines": round(statistics.median(cpu[name]), 1)}
                                     for name, values in runs.items()}
            results["throughput"]["new_over_old"] = {"paired": [round(r, 3) for r in ratios],
                                                     "median": round(statistics.median(ratios), 3)}
    finally:
        stop(server)
    for case, restart in (("restart", True), ("gone", False)):
        if case in cases:
            results[case] = {name: stop_mid_run(args.repo, tree, big, work / f"{case}-{name}.jsonl", args.lines,
                                                args.stop_after, restart, reference) for name, tree in trees.items()}
    if "rate" in cases:
        rated = write_requests(work / "rate.jsonl", args.task, 600)
        results["rate"] = {}
        for name, tree in trees.items():
            server = serve(args.repo, "--rate-limit", "100")
            try:
                time.sleep(1.5)  # the bucket full, as after a quiet second
                started = time.monotonic()
                done = finish(infer(tree, rated, work / f"rate-{name}.jsonl"), started)
                time.sleep(1.5)
                refused = metric("aot_rate_limited_total")
            finally:
                stop(server)
            results["rate"][name] = done | check(work / f"rate-{name}.jsonl", reference, 600) | {
                "refused_requests": refused}
    if "resume" in cases:
        server = serve(args.repo)
        try:
            out = work / "resume.jsonl"
            started = time.monotonic()
            client = infer(None, big, out)
            while written(out) < args.lines // 2:
                time.sleep(0.05)
            client.kill()
            client.wait()
            killed_at = written(out)
            resumed = time.monotonic()
            done = finish(infer(None, big, out, "--resume"), resumed)
            results["resume"] = done | check(out, reference, args.lines) | {
                "written_when_killed": killed_at, "first_run_seconds": round(time.monotonic() - started, 2)}
        finally:
            stop(server)
    results["load_average_end"] = os.getloadavg()
    (args.out / "batch-scoring.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
