"""`aot bench accuracy`: the paper's accuracy protocol (section 4) on our datasets, resumable run by run.

Phase 1 ("grid") trains every grid point of every (dataset, method) with seed 0 and scores it on dev. Phase 2
("seeds") retrains each (dataset, method)'s best grid point on dev with seeds 1..seeds-1 (seed 0 is the phase-1
run) and the final score is the median ± std (numpy, ddof 0) of the test scores over the seeds. A dataset
without a test split reports its dev score instead, and says so (`split: "dev"`): then the final score is
optimistic, because the grid point was chosen on the same split.

Grids, drawn from Table 2 of the paper (left part: RoBERTa, all tasks except RTE). Table 2 lists one learning-rate
range for the block that holds P-Tuning v1/v2, AoT, LoRA and adapters; BitFit is not in the table and gets the
same range. Fine-tuning (`full`) has its own range.

    paper  learning rate 1e-4, 5e-4, 1e-3, 5e-3 (full: 1e-5, 5e-5, 1e-4, 5e-4, 5e-3); batch size 16, 64;
           rank-like value: fc r 32, 64, 128, 256, 512; kron r 5, 10, 25, 30, 50; lora r 2, 4, 16, 32, 64;
           adapter r 16, 32, 64, 128, 256; prefix/prompt p 5, 10, 20, 50, 100; bitfit/full have none.
           (40 points per rank-like method, 8 for bitfit, 10 for full.)
    small  learning rate 1e-3, 5e-3 (full: 5e-5, 1e-4); batch size 16; one rank-like value from the same
           ranges: fc 64, kron 10, lora 16, adapter 64, prefix/prompt 20. (2 points per method.)
    defaults  what `aot train --method M` runs with no hyperparameter flags: the method's default learning rate
           and rank-like value, batch size 16 (1 point per method).

A method registered later without a Table 2 range uses its config's default rank-like value.

Outputs under OUT: runs/<run-id>.json (one record per run, written atomically when the run ends; see RECORD_FIELDS),
accuracy.json (config, records, per (dataset, method) summary), accuracy.md (the paper's kind of table) and
accuracy.png (final score against trainable parameters). The run id is a readable slug plus a hash of (model,
dataset, method, hyperparameters, seed, train settings), so a rerun with the same settings reads finished runs
instead of training them again. Task artifacts go to a scratch folder that is deleted once the record is written.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

import numpy as np

from aot.benchmarks.accuracy.plan import RECORD_FIELDS, GridPoint, Run, SweepConfig, grid_points, run_id, task_data
from aot.benchmarks.accuracy.report import cell, markdown, plot, plot_curves
from aot.benchmarks.report import write_json, write_text
from aot.training.methods import MethodError, method_spec


def _execute(config: SweepConfig, run: Run, runs_dir: Path) -> dict:
    """Train one run in a scratch folder and write its record; unsupported methods are recorded as skipped."""
    from aot.training.api import train_task

    data = task_data(run.dataset)
    record = dict.fromkeys(RECORD_FIELDS)
    record.update(run_id=run_id(config, run), dataset=run.dataset, task=data.spec.name, method=run.method,
                  lr=run.point.lr, batch_size=run.point.batch_size,
                  rank_field=method_spec(run.method).config_cls.rank_field, rank=run.point.rank, seed=run.seed,
                  phase=run.phase, metric=data.spec.metric, settings=config.train_settings())
    with tempfile.TemporaryDirectory(prefix="aot-accuracy-") as scratch:
        try:
            result = train_task(model=config.model, data=run.dataset, method=run.method,
                                out=str(Path(scratch) / "task"), rank=run.point.rank, lr=run.point.lr,
                                batch_size=run.point.batch_size, **config.train_budget(),
                                max_length=config.max_length,
                                max_train_samples=config.max_train_samples, pooling=config.pooling,
                                seed=run.seed, progress=False,
                                task_data=data)
        except MethodError as err:
            record.update(status="skipped", reason=str(err))
        else:
            if data.test:
                record.update(split="test", score=result["test"])
            else:
                record.update(split="dev", score=result["dev"], note="no test split: score is the dev score")
            record.update(status="ok", dev=result["dev"], test=result.get("test"),
                          trainable_parameters=result["trainable_parameters"],
                          train_seconds=result["train_seconds"], steps=result["steps"], stopped=result["stopped"],
                          history=[{"step": h["step"], "dev": h["dev"]}
                                   for h in json.loads((Path(scratch) / "task" / "metrics.json").read_text())
                                   .get("history", [])])
    write_json(runs_dir / f"{record['run_id']}.json", record)
    return record


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _run_all(config: SweepConfig, runs: list[Run], runs_dir: Path, desc: str,
             counts: dict[str, int]) -> dict[Run, dict]:
    """Records for `runs`: read from runs/ when finished before, else trained (in parallel with workers > 1)."""
    from tqdm.auto import tqdm

    records: dict[Run, dict] = {}
    todo: list[Run] = []
    for run in runs:
        path = runs_dir / f"{run_id(config, run)}.json"
        if path.is_file():
            records[run] = json.loads(path.read_text(encoding="utf-8"))
            counts["skipped_existing"] += 1
        else:
            todo.append(run)
    bar = tqdm(total=len(runs), initial=len(records), desc=f"accuracy {desc}", unit="run", disable=not config.progress,
               dynamic_ncols=True)

    def finished(run: Run, record: dict) -> None:
        records[run] = record
        counts["trained"] += 1
        bar.update(1)
        bar.set_postfix_str(f"{record['task']} {run.method} dev={record['dev']}", refresh=False)

    try:
        workers = min(config.workers, len(todo))
        if workers <= 1:
            for run in todo:
                finished(run, _execute(config, run, runs_dir))
        else:
            threads = max(1, (os.cpu_count() or 1) // workers)
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_init_worker, initargs=(threads,))
            try:
                futures = {pool.submit(_execute, config, run, runs_dir): run for run in todo}
                for future in as_completed(futures):
                    finished(futures[future], future.result())
            finally:
                pool.shutdown(cancel_futures=True)
    finally:
        bar.close()
    return {run: records[run] for run in runs}


def _best(points: list[GridPoint], records: list[dict]) -> GridPoint | None:
    """The grid point with the highest dev score (the first on ties); None when every point was skipped."""
    best, best_dev = None, -float("inf")
    for point, record in zip(points, records, strict=True):
        if record["status"] == "ok" and record["dev"] > best_dev:
            best, best_dev = point, record["dev"]
    return best


def _summarize(dataset: str, method: str, grid_records: list[dict], seed_records: list[dict]) -> dict:
    entry = {"dataset": dataset, "method": method}
    if not seed_records:
        reasons = sorted({r["reason"] for r in grid_records})
        return entry | {"status": "skipped", "reason": "; ".join(reasons)}
    best = seed_records[0]
    scores = [r["score"] for r in seed_records]
    return entry | {
        "status": "ok", "task": best["task"], "metric": best["metric"], "rank_field": best["rank_field"],
        "best": {"lr": best["lr"], "batch_size": best["batch_size"], "rank": best["rank"]}, "best_dev": best["dev"],
        "grid_points": len(grid_records), "seeds": [r["seed"] for r in seed_records], "split": best["split"],
        "scores": scores, "median": float(np.median(scores)), "std": float(np.std(scores)),
        "dev_median": float(np.median([r["dev"] for r in seed_records])),
        "trainable_parameters": best["trainable_parameters"],
        "run_ids": [r["run_id"] for r in seed_records]}


def run_sweep(config: SweepConfig) -> dict:
    """Run (or resume) the sweep and write accuracy.json/.md/.png; returns a short summary."""
    config.validate()
    methods = list(dict.fromkeys(config.methods))
    datasets = list(dict.fromkeys(config.datasets))
    for dataset in datasets:
        task_data(dataset)  # raises DataError naming an unknown dataset before any training
    out = Path(config.out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    counts = {"trained": 0, "skipped_existing": 0}
    grids = {method: grid_points(config.grid, method) for method in methods}

    phase1 = [Run(d, m, p, 0, "grid") for d in datasets for m in methods for p in grids[m]]
    grid_records = _run_all(config, phase1, runs_dir, "grid", counts)
    best = {(d, m): _best(grids[m], [grid_records[Run(d, m, p, 0, "grid")] for p in grids[m]])
            for d in datasets for m in methods}

    phase2 = [Run(d, m, point, seed, "seeds") for (d, m), point in best.items() if point is not None
              for seed in range(1, config.seeds)]
    seed_records = _run_all(config, phase2, runs_dir, "seeds", counts)

    summary = []
    for d in datasets:
        for m in methods:
            point = best[(d, m)]
            runs = [] if point is None else [grid_records[Run(d, m, point, 0, "grid")]] + [
                seed_records[Run(d, m, point, s, "seeds")] for s in range(1, config.seeds)]
            summary.append(_summarize(d, m, [grid_records[Run(d, m, p, 0, "grid")] for p in grids[m]],
                                      [r for r in runs if r["status"] == "ok"]))

    records = list(grid_records.values()) + list(seed_records.values())
    settings = {**asdict(config), "methods": methods, "datasets": datasets, "train_settings": config.train_settings(),
                "grid_points": {m: [asdict(p) for p in grids[m]] for m in methods}}
    write_json(out / "accuracy.json", {"config": settings, "summary": summary, "records": records})
    write_text(out / "accuracy.md", markdown(config, datasets, methods, summary))
    plot(datasets, methods, summary, out / "accuracy.png")
    plot_curves(datasets, methods, summary, records, out / "accuracy-curves.png")
    return {"out": str(out), "runs": len(records), "trained": counts["trained"],
            "skipped_existing": counts["skipped_existing"],
            "unsupported": sum(r["status"] == "skipped" for r in records),
            "summary": {d: {e["method"]: cell(e) for e in summary if e["dataset"] == d} for d in datasets}}

