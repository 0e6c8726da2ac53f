"""`aot bench kinds`: the served speed of tasks of mixed kinds against classifiers, side by side on one server.

Sixteen AoT tasks on one encoder (MiniLM by default), each made with get_aot_model on the encoder and seeded random
factors and head (the speed of a task does not depend on what it learned), saved as artifacts and exported:

    classification  8 classifiers
    mixed           3 classifiers, 2 token taggers (WNUT-16's tags), 2 embeddings, 1 multi-label (BBC's topics)

One repository and one server serve all sixteen (factored storage and the task pool for every task, so neither set
is favoured by where its rows come from). After a warm-up pass of each set, the sets are measured alternately,
`repeats` times each (the first set of each repeat alternating), on the same texts (Rotten Tomatoes dev reviews):
`requests` requests naming the set's tasks in turn, from `concurrency` clients in a closed loop. The result is the
ratio of the sets' median throughputs. Before measuring, the served answers to `check` texts of every task are
compared with `aot predict`'s (aot.training.predict.predict_lines): records `check` hold the largest difference of
each task's numbers and whether its labels and entities are the same.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from aot.benchmarks.report import markdown_table, write_json, write_text
from aot.benchmarks.served.serve import _closed_loop, _texts

SETS = {"classification": ["classification"] * 8,
        "mixed": ["classification"] * 3 + ["tokens"] * 2 + ["embedding"] * 2 + ["multilabel"]}


@dataclass
class KindsBenchConfig:
    out: str
    model: str = "minilm"
    requests: int = 400
    concurrency: int = 8
    repeats: int = 3
    max_length: int = 64
    check: int = 8  # texts per task whose served answers are compared with aot predict's
    seed: int = 0


def _labels(kind: str) -> list[str] | None:
    from aot.training.data import load_task_data

    if kind == "tokens":
        return list(load_task_data("wnut16").spec.labels)
    if kind == "multilabel":
        return ["business", "entertainment", "politics", "sports", "tech"]
    return None if kind == "embedding" else ["negative", "positive"]


def make_tasks(config: KindsBenchConfig, folder: Path) -> dict[str, Path]:
    """The sixteen artifacts: name -> folder. Factors and heads drawn with a seed per task."""
    import torch
    from transformers import AutoModel

    from aot import AotConfig, get_aot_model, model_path

    path = model_path(config.model) if config.model == "minilm" else config.model
    tasks = {}
    for set_name, kinds in SETS.items():
        for k, kind in enumerate(kinds):
            name = f"{set_name[:3]}-{k}-{kind}"
            torch.manual_seed(config.seed * 1000 + len(tasks))
            aot = AotConfig(problem=kind, labels=_labels(kind), max_length=config.max_length, task_name=name,
                            base_model_name_or_path=config.model)
            model = get_aot_model(AutoModel.from_pretrained(path), aot)
            with torch.no_grad():
                for param in (p for p in model.parameters() if p.requires_grad):
                    param.add_(0.02 * torch.randn_like(param))
            tasks[name] = model.save_pretrained(folder / name)
    return tasks


def _difference(got: dict, want: dict) -> tuple[float, bool]:
    """(largest difference of the answers' numbers, whether their labels / entities are the same)."""
    if "entities" in want:
        same = [{**e, "score": 0} for e in got.get("entities", [])] == [{**e, "score": 0} for e in want["entities"]]
        numbers = [[e["score"] for e in got.get("entities", [])], [e["score"] for e in want["entities"]]]
    elif "labels" in want:
        same = got.get("labels") == want["labels"]
        numbers = [list(got.get("scores", {}).values()), list(want["scores"].values())]
    else:
        key = "embedding" if "embedding" in want else "logits"
        same = got.get("label") == want.get("label")
        numbers = [got.get(key, []), want[key]]
    if len(numbers[0]) != len(numbers[1]):
        return float("inf"), False
    return float(np.abs(np.subtract(*numbers)).max(initial=0.0)), same


def check_answers(url: str, tasks: dict[str, Path], texts: list[str]) -> list[dict]:
    """Served answers against `aot predict`'s, per task."""
    from aot.client.client import Client
    from aot.training.predict import predict_lines, task_folders

    items = [{"task": name, "text": text} for name in tasks for text in texts]
    expected = predict_lines(task_folders([f"{n}={p}" for n, p in tasks.items()]),
                             [(k, {"text_pair": None, **item}) for k, item in enumerate(items)], None)
    with Client(url) as client:
        served = client.infer_many(items)
    out = []
    for name in tasks:
        pairs = [(served[k], expected[k]) for k, item in enumerate(items) if item["task"] == name]
        diffs = [_difference(got, want) for got, want in pairs]
        out.append({"task": name, "max_abs_diff": max(d for d, _ in diffs), "same": all(s for _, s in diffs),
                    "errors": sum("error" in got for got, _ in pairs)})
    return out


def run_kinds_bench(config: KindsBenchConfig, progress: bool = True) -> dict:
    from aot.exporter.backbone_export import export_backbone
    from aot.exporter.task_export import export_task
    from aot.local.server import LocalServer

    out = Path(config.out)
    texts = _texts(config.requests)
    with tempfile.TemporaryDirectory(prefix="aot-bench-kinds-") as scratch:
        tasks = make_tasks(config, Path(scratch) / "tasks")
        repo = Path(scratch) / "repo"
        export_backbone(config.model, repo)
        for name, folder in tasks.items():
            export_task(folder, repo, name, "factored", progress=False)
        names = {s: [n for n in tasks if n.startswith(s[:3])] for s in SETS}
        records = []
        with LocalServer(repo) as server:
            check = check_answers(server.grpc_url, tasks, texts[: config.check])
            plans = {s: [(names[s][k % len(names[s])], t) for k, t in enumerate(texts)] for s in SETS}
            for s in SETS:  # warm-up: the pool's rows, the steps' first batches
                _closed_loop(server.grpc_url, "aot", plans[s], config.concurrency)
            for repeat in range(config.repeats):
                order = list(SETS) if repeat % 2 == 0 else list(SETS)[::-1]
                for s in order:
                    result = _closed_loop(server.grpc_url, "aot", plans[s], config.concurrency)
                    records.append({"set": s, "repeat": repeat, **result})
                    if progress:
                        print(f"kinds: {s} repeat {repeat}: {result['throughput_rps']} req/s", flush=True)
    median = {s: statistics.median(r["throughput_rps"] for r in records if r["set"] == s) for s in SETS}
    summary = {"median_rps": median, "ratio": round(median["mixed"] / median["classification"], 3),
               "all_answers_equal_predict": all(c["same"] and not c["errors"] for c in check),
               "max_abs_diff": max(c["max_abs_diff"] for c in check)}
    write_json(out / "kinds.json", {"config": asdict(config), "sets": SETS, "summary": summary, "records": records,
                                    "check": check})
    write_text(out / "kinds.md", _markdown(config, records, summary, check))
    return {"out": str(out), **summary}


def _markdown(config: KindsBenchConfig, records: list[dict], summary: dict, check: list[dict]) -> str:
    rows = markdown_table(records, ["set", "repeat", "throughput_rps", "p50_ms", "p99_ms", "errors"],
                          ["set", "repeat", "req/s", "p50 ms", "p99 ms", "errors"])
    checks = markdown_table(check, ["task", "max_abs_diff", "same", "errors"],
                            ["task", "largest |served - predict|", "same labels / entities", "errors"],
                            {"max_abs_diff": ".2e"})
    return (f"# Served speed: 8 tasks of mixed kinds against 8 classifiers\n\nModel `{config.model}`, "
            f"{config.requests} requests per pass, {config.concurrency} clients, max length {config.max_length}, "
            f"{config.repeats} passes per set, alternating. Mixed: {', '.join(SETS['mixed'])}.\n\n"
            f"**mixed / classification: {summary['ratio']}x** (median req/s "
            f"{summary['median_rps']['mixed']} against {summary['median_rps']['classification']}).\n\n{rows}\n"
            f"Served answers against `aot predict` ({config.check} texts per task):\n\n{checks}")
