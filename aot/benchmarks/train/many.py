"""`aot bench train-many`: one job of many tasks (`aot train --tasks`) against the same tasks trained one `aot train`
at a time, side by side in one run (issue 55).

The tasks are built from the packaged data sets, five kinds in turn (`tasks` of them, FC and Kron alternating by
round), each `train_examples` examples sampled (seeded by its index) from its source's train split and `dev_examples`
from its dev split, written as plain folders:

    classification  Rotten Tomatoes and BBC News topics, alternately
    regression      BBC multi-label texts scored by their number of topics (1 to 3)
    multilabel      BBC multi-label texts (bbc_multilabel)
    tokens          WNUT-16 tweets' entities
    embedding       BBC titles retrieving their articles (bbc_retrieval, recall@1)

Every process is a fresh `python -m aot train` (what a user runs), timed from start to exit, its peak resident memory
read when it is reaped: the solo runs of the first half of the tasks, then the job, then the job on two torchrun ranks
(`ranks`), then the solo runs of the rest, so that a drift of the machine's load falls on both sides. Recorded: the
wall times and their ratio, each task's dev score alone and in the job (and on two ranks), their means, the worst
shortfall, the peaks of memory and the budget the issue sets them (1.5 x one solo run's peak, plus every task's
trainable parameters, gradients and Adam's two moments in fp32), and the load average before and after.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from aot.benchmarks.report import markdown_table, write_json, write_text

KINDS = ("classification", "regression", "multilabel", "tokens", "embedding")
SOURCES = {"classification": ("rotten_tomatoes", "bbc_news"), "regression": ("bbc_multilabel",),
           "multilabel": ("bbc_multilabel",), "tokens": ("wnut16",), "embedding": ("bbc_retrieval",)}


@dataclass
class TrainManyConfig:
    out: str
    model: str = "minilm"
    tasks: int = 50
    train_examples: int = 500
    dev_examples: int = 200
    max_length: int = 64
    epochs: int = 1
    tasks_per_step: int = 4
    ranks: int = 2  # torchrun ranks of the sharded run (0: none)


def add_train_many(kinds) -> None:
    """The command's parser (aot.benchmarks.cli registers it)."""
    from aot.cli.arguments import non_negative_int, positive_int

    p = kinds.add_parser("train-many", help="one job of many tasks against one aot train per task (issue 55)",
                         description="Builds TASKS tasks of five kinds from the packaged data sets, trains each with "
                                     "its own aot train and all of them in one aot train --tasks job (and on "
                                     "--ranks torchrun ranks), each a fresh process, and writes train_many.json and "
                                     "train_many.md: wall times, dev scores, memory peaks, load averages.")
    p.add_argument("--model", default="minilm", help="the encoder (a folder or minilm)")
    p.add_argument("--tasks", type=positive_int, default=50, help="tasks, the five kinds in turn")
    p.add_argument("--train-examples", type=positive_int, default=500, help="train examples of each task")
    p.add_argument("--dev-examples", type=positive_int, default=200, help="dev examples of each task")
    p.add_argument("--max-length", type=positive_int, default=64, help="tokens per input")
    p.add_argument("--epochs", type=positive_int, default=1, help="epochs of every task")
    p.add_argument("--tasks-per-step", type=positive_int, default=4, help="the job's --tasks-per-step")
    p.add_argument("--ranks", type=non_negative_int, default=2, help="torchrun ranks of the sharded run (0: none)")
    p.add_argument("--out", required=True, help="output folder (train_many.json, train_many.md, the data, the runs)")
    p.add_argument("--no-progress", action="store_true", help="say nothing while it runs")
    p.set_defaults(run=_run)


def _run(args) -> int:
    config = TrainManyConfig(args.out, args.model, args.tasks, args.train_examples, args.dev_examples,
                             args.max_length, args.epochs, args.tasks_per_step, args.ranks)
    print(json.dumps(run_train_many_bench(config, progress=not args.no_progress)))
    return 0


def _rows(kind: str, examples) -> list[dict]:
    if kind == "regression":
        return [{"text": ex.text, "label": float(len(ex.label))} for ex in examples]
    if kind == "multilabel":
        return [{"text": ex.text, "labels": list(ex.label)} for ex in examples]
    if kind == "tokens":
        return [{"tokens": ex.text.split(" "), "tags": list(ex.label)} for ex in examples]
    if kind == "embedding":
        return [{"text": ex.text, "text_pair": ex.text_pair} for ex in examples]
    return [{"text": ex.text, "label": ex.label} for ex in examples]


def build_tasks(config: TrainManyConfig, root: Path) -> list[dict]:
    """The tasks' data folders under `root`, and their manifest lines."""
    from aot.training.data import load_task_data

    sources: dict = {}
    specs = []
    for k in range(config.tasks):
        kind = KINDS[k % len(KINDS)]
        choices = SOURCES[kind]
        source = choices[(k // len(KINDS)) % len(choices)]
        data = sources.setdefault(source, load_task_data(source))
        rng = random.Random(k)
        splits = {"train": rng.sample(data.train, min(config.train_examples, len(data.train))),
                  "dev": rng.sample(data.dev, min(config.dev_examples, len(data.dev)))}
        name = f"t{k:02d}-{kind}"
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for split, examples in splits.items():
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                           for r in _rows(kind, examples)), encoding="utf-8")
        declared = {"name": name, "problem": kind}
        if kind != "regression" and data.spec.labels is not None:
            declared["labels"] = list(data.spec.labels)
        (folder / "task.json").write_text(json.dumps(declared))
        specs.append({"name": name, "data": str(folder), "method": ("fc", "kron")[(k // len(KINDS)) % 2],
                      "seed": k, "kind": kind, "source": source})
    return specs


def _timed(command: list[str], log: Path) -> tuple[float, int, str]:
    """Run `command` (its output to `log`): its wall seconds, its peak resident bytes, its standard output."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log.with_suffix(".out"), "w") as out, open(log, "w") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... exited {process.returncode}: {log.read_text()[-2000:]}")
    return seconds, usage.ru_maxrss * 1024, log.with_suffix(".out").read_text()


def run_train_many_bench(config: TrainManyConfig, progress: bool = True) -> dict:
    root = Path(config.out)
    say = (lambda line: print(f"aot: {line}", file=sys.stderr, flush=True)) if progress else (lambda line: None)
    load_before = os.getloadavg()
    specs = build_tasks(config, root / "data")
    manifest = root / "tasks.jsonl"
    manifest.write_text("".join(json.dumps({k: s[k] for k in ("name", "data", "method", "seed")}) + "\n"
                                for s in specs))
    common = ["--model", config.model, "--max-length", str(config.max_length), "--epochs", str(config.epochs),
              "--no-progress", "--overwrite"]
    aot = [sys.executable, "-m", "aot", "train"]
    solo: dict[str, dict] = {}

    def run_solo(batch: list[dict]) -> None:
        for s in batch:
            seconds, peak, out = _timed([*aot, "--data", s["data"], "--method", s["method"], "--seed", str(s["seed"]),
                                         "--out", str(root / "solo" / s["name"]), *common],
                                        root / "logs" / f"solo-{s['name']}.log")
            solo[s["name"]] = {"seconds": seconds, "peak": peak, **json.loads(out)}
            say(f"solo {s['name']}: {seconds:.1f} s, dev {solo[s['name']]['dev']:.4f}")

    half = len(specs) // 2
    run_solo(specs[:half])
    job_seconds, job_peak, job_out = _timed([*aot, "--tasks", str(manifest), "--out", str(root / "job"),
                                             "--tasks-per-step", str(config.tasks_per_step), *common],
                                            root / "logs" / "job.log")
    job = {r["name"]: r for r in map(json.loads, job_out.splitlines())}
    say(f"job: {job_seconds:.1f} s")
    ranks = None
    if config.ranks > 1:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        seconds, _, out = _timed([torchrun, "--standalone", "--nproc-per-node", str(config.ranks), "-m", "aot",
                                  "train", "--tasks", str(manifest), "--out", str(root / "ranks"), *common],
                                 root / "logs" / "ranks.log")
        ranks = {"seconds": seconds, "results": {r["name"]: r for r in map(json.loads, out.splitlines())}}
        say(f"{config.ranks} ranks: {seconds:.1f} s")
    run_solo(specs[half:])
    return _report(config, specs, solo, job, job_seconds, job_peak, ranks, load_before, os.getloadavg(), root)


def _report(config, specs, solo, job, job_seconds, job_peak, ranks, load_before, load_after, root: Path) -> dict:
    rows = []
    for s in specs:
        alone, mixed = solo[s["name"]], job[s["name"]]
        row = {"task": s["name"], "source": s["source"], "method": s["method"], "metric": alone["metric"],
               "solo_s": round(alone["seconds"], 1), "solo_dev": round(100 * alone["dev"], 2),
               "job_dev": round(100 * mixed["dev"], 2) if mixed["status"] == "trained" else None,
               "status": mixed["status"]}
        row["diff"] = None if row["job_dev"] is None else round(row["job_dev"] - row["solo_dev"], 2)
        if ranks is not None:
            shard = ranks["results"].get(s["name"], {})
            row["ranks_dev"] = round(100 * shard["dev"], 2) if shard.get("status") == "trained" else None
        rows.append(row)
    trained = [r for r in rows if r["job_dev"] is not None]
    solo_seconds = sum(v["seconds"] for v in solo.values())
    states = sum(16 * solo[s["name"]]["trainable_parameters"] for s in specs)  # fp32 weights, grads, 2 Adam moments
    solo_peak = max(v["peak"] for v in solo.values())
    summary = {
        "config": asdict(config), "tasks": len(specs), "trained_in_job": len(trained),
        "solo_seconds": round(solo_seconds, 1), "job_seconds": round(job_seconds, 1),
        "speedup": round(solo_seconds / job_seconds, 2),
        "solo_mean_dev": round(sum(r["solo_dev"] for r in rows) / len(rows), 2),
        "job_mean_dev": round(sum(r["job_dev"] for r in trained) / max(1, len(trained)), 2),
        "worst_shortfall": round(min((r["diff"] for r in trained), default=0.0), 2),
        "solo_peak_mb": round(solo_peak / 2**20), "job_peak_mb": round(job_peak / 2**20),
        "tasks_state_mb": round(states / 2**20, 1), "memory_budget_mb": round((1.5 * solo_peak + states) / 2**20),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(),
    }
    summary["mean_dev_diff"] = round(summary["job_mean_dev"] - summary["solo_mean_dev"], 2)
    if ranks is not None:
        pairs = [(r["ranks_dev"], r["job_dev"]) for r in rows if None not in (r["ranks_dev"], r["job_dev"])]
        summary.update(ranks=config.ranks, ranks_seconds=round(ranks["seconds"], 1), ranks_trained=len(pairs),
                       ranks_max_dev_diff=round(max((abs(a - b) for a, b in pairs), default=0.0), 4))
    write_json(root / "train_many.json", {"summary": summary, "tasks": rows})
    columns = ["task", "source", "method", "metric", "solo_s", "solo_dev", "job_dev", "diff"] + (
        ["ranks_dev"] if ranks is not None else [])
    lines = [f"# aot bench train-many: {len(specs)} tasks, {config.train_examples} examples, {config.max_length} "
             f"tokens, {config.epochs} epoch(s), {config.model}", "",
             markdown_table([summary], ["solo_seconds", "job_seconds", "speedup", "solo_mean_dev", "job_mean_dev",
                                        "worst_shortfall", "solo_peak_mb", "job_peak_mb", "memory_budget_mb"]),
             f"Load average before {summary['load_average_before']}, after {summary['load_average_after']} "
             f"({summary['cpus']} CPUs).", "", markdown_table(rows, columns)]
    write_text(root / "train_many.md", "\n".join(lines))
    return summary
