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

import functools
import hashlib
import json
import multiprocessing
import os
import re
import tempfile
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.report import markdown_table, new_figure, save_figure, write_json, write_text
from serving.protocol import pooling_row
from training.data import BUILTIN, load_task_data
from training.data.task import TaskData
from training.methods import MethodError, make_config, method_spec
from training.trainer import TrainConfig

GRIDS = ("small", "paper", "defaults")

# Table 2, left (RoBERTa, all tasks except RTE).
PAPER_LRS = (1e-4, 5e-4, 1e-3, 5e-3)
PAPER_FULL_LRS = (1e-5, 5e-5, 1e-4, 5e-4, 5e-3)
PAPER_BATCH_SIZES = (16, 64)
PAPER_RANKS = {"fc": (32, 64, 128, 256, 512), "kron": (5, 10, 25, 30, 50), "lora": (2, 4, 16, 32, 64),
               "adapter": (16, 32, 64, 128, 256), "prefix": (5, 10, 20, 50, 100), "prompt": (5, 10, 20, 50, 100)}
# The small grid: the values of the paper grid that suit a few epochs on a train subset.
SMALL_LRS = (1e-3, 5e-3)
SMALL_FULL_LRS = (5e-5, 1e-4)
SMALL_BATCH_SIZES = (16,)
SMALL_RANKS = {"fc": (64,), "kron": (10,), "lora": (16,), "adapter": (64,), "prefix": (20,), "prompt": (20,)}

BUDGETS = ("epochs", "steps")

# Every record in runs/ and accuracy.json has exactly these keys (null where a value does not apply).
RECORD_FIELDS = ("run_id", "dataset", "task", "method", "lr", "batch_size", "rank_field", "rank", "seed", "phase",
                 "status", "reason", "note", "metric", "dev", "test", "split", "score", "trainable_parameters",
                 "train_seconds", "steps", "stopped", "settings", "history")


@dataclass
class SweepConfig:
    """What `aot bench accuracy` sweeps; see the module docstring for the protocol."""

    model: str
    datasets: list[str]
    methods: list[str]
    seeds: int = 3
    grid: str = "small"
    out: str = "bench-accuracy"
    max_train_samples: int | None = None
    max_length: int = 128
    epochs: int = 3
    patience: int = 3
    eval_every: int = 0
    budget: str = "epochs"  # "epochs": up to `epochs`, early stopping; "steps": exactly `steps` for every method
    steps: int = 100
    pooling: str | None = None  # None: the backbone's declared pooling (as `aot train`)
    workers: int = 1
    progress: bool = True

    def validate(self) -> None:
        """Fail before any training, naming the bad value."""
        if self.grid not in GRIDS:
            raise ValueError(f"unknown grid {self.grid!r}: expected one of {', '.join(GRIDS)}")
        if not self.datasets:
            raise ValueError("no datasets given")
        if not self.methods:
            raise ValueError("no methods given")
        for name, value in (("seeds", self.seeds), ("workers", self.workers), ("epochs", self.epochs),
                            ("patience", self.patience), ("max_length", self.max_length)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(f"max_train_samples must be a positive integer, got {self.max_train_samples}")
        if self.budget not in BUDGETS:
            raise ValueError(f"unknown budget {self.budget!r}: expected one of {', '.join(BUDGETS)}")
        if self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps}")
        if self.pooling is not None:
            pooling_row(self.pooling)
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        for method in self.methods:
            method_spec(method)  # raises MethodError naming the unknown method

    def train_settings(self) -> dict:
        """What, besides the dataset, method, hyperparameters and seed, changes a run's result (part of its id)."""
        settings = {"model": _canonical(self.model), "max_train_samples": self.max_train_samples,
                    "max_length": self.max_length, "epochs": self.epochs, "patience": self.patience,
                    "eval_every": self.eval_every}
        if self.budget == "steps":  # (runs of the epochs budget keep the ids they always had)
            settings = {**settings, "epochs": None, "patience": None, "budget": "steps", "steps": self.steps,
                        "eval_every": self.curve_every()}
        # Since issue 13 (pooling, schedule), runs from before have other ids and are not reused.
        return {**settings, "pooling": self.pooling or "model", "warmup": TrainConfig.warmup,
                "decay": TrainConfig.decay}

    def curve_every(self) -> int:
        """Steps between dev evaluations: as asked, or, under the steps budget, 10 points on each curve."""
        if self.budget == "steps" and not self.eval_every:
            return max(1, self.steps // 10)
        return self.eval_every

    def train_budget(self) -> dict:
        """train_task's stopping arguments. Steps: the same number of optimizer steps for every method (no early
        stopping; epochs only bound the loop); epochs: up to `epochs`, stopping after `patience` evaluations."""
        if self.budget == "steps":
            return {"epochs": 10 ** 6, "patience": 10 ** 9, "max_steps": self.steps, "eval_every": self.curve_every()}
        return {"epochs": self.epochs, "patience": self.patience, "eval_every": self.eval_every}


@dataclass(frozen=True)
class GridPoint:
    lr: float
    batch_size: int
    rank: int | None  # the method's rank-like value (rank, bottleneck or prompt length); None: it has none


@dataclass(frozen=True)
class Run:
    dataset: str
    method: str
    point: GridPoint
    seed: int
    phase: str  # "grid" or "seeds"


def grid_points(grid: str, method: str) -> list[GridPoint]:
    """The grid points of `method`, in a fixed order (ties on dev go to the earlier point)."""
    if grid not in GRIDS:
        raise ValueError(f"unknown grid {grid!r}: expected one of {', '.join(GRIDS)}")
    field = method_spec(method).config_cls.rank_field
    default_rank = None if field is None else getattr(make_config(method), field)
    paper = grid == "paper"
    if grid == "defaults":
        lrs, batch_sizes, ranks = (method_spec(method).default_lr,), (16,), (default_rank,)
    else:
        lrs = (PAPER_FULL_LRS if paper else SMALL_FULL_LRS) if method == "full" else (PAPER_LRS if paper else SMALL_LRS)
        batch_sizes = PAPER_BATCH_SIZES if paper else SMALL_BATCH_SIZES
        table = PAPER_RANKS if paper else SMALL_RANKS
        ranks = table.get(method, (default_rank,)) if field is not None else (default_rank,)
    return [GridPoint(lr, bs, rank) for rank in ranks for bs in batch_sizes for lr in lrs]


def _canonical(path_or_name: str) -> str:
    """Folders by absolute path (so `./data` and `data` are the same run), names as given."""
    return str(Path(path_or_name).resolve()) if os.path.isdir(path_or_name) else path_or_name


def run_id(config: SweepConfig, run: Run) -> str:
    """Readable and stable: equal ids mean the same training, whatever the phase or output folder."""
    key = {"dataset": _canonical(run.dataset), "method": run.method, **asdict(run.point), "seed": run.seed,
           **config.train_settings()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    name = run.dataset if run.dataset in BUILTIN else Path(run.dataset).name
    rank = "" if run.point.rank is None else f"-r{run.point.rank}"
    slug = f"{name}-{run.method}-lr{run.point.lr:g}-bs{run.point.batch_size}{rank}-s{run.seed}"
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', slug)}-{digest}"


@functools.cache
def _task_data(dataset: str) -> TaskData:
    """Loaded once per process (built-in datasets parse a compressed corpus)."""
    return load_task_data(dataset)


def _execute(config: SweepConfig, run: Run, runs_dir: Path) -> dict:
    """Train one run in a scratch folder and write its record; unsupported methods are recorded as skipped."""
    from training.api import train_task

    data = _task_data(run.dataset)
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
    for point, record in zip(points, records):
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
        _task_data(dataset)  # raises DataError naming an unknown dataset before any training
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
    write_text(out / "accuracy.md", _markdown(config, datasets, methods, summary))
    _plot(datasets, methods, summary, out / "accuracy.png")
    _plot_curves(datasets, methods, summary, records, out / "accuracy-curves.png")
    return {"out": str(out), "runs": len(records), "trained": counts["trained"],
            "skipped_existing": counts["skipped_existing"],
            "unsupported": sum(r["status"] == "skipped" for r in records),
            "summary": {d: {e["method"]: _cell(e) for e in summary if e["dataset"] == d} for d in datasets}}


def _cell(entry: dict) -> str:
    if entry["status"] != "ok":
        return "n/a"
    mark = "" if entry["split"] == "test" else " (dev)"
    return f"{100 * entry['median']:.1f} ± {100 * entry['std']:.1f}{mark}"


def _columns(datasets: Iterable[str]) -> dict[str, str]:
    """Column titles: the task name, or the dataset as given where two datasets share a task name."""
    names = {d: _task_data(d).spec.name for d in datasets}
    clash = len(set(names.values())) < len(names)
    return {d: d if clash else name for d, name in names.items()}


def _markdown(config: SweepConfig, datasets: list[str], methods: list[str], summary: list[dict]) -> str:
    columns = _columns(datasets)
    by_key = {(e["dataset"], e["method"]): e for e in summary}
    rows, hparam_rows = [], []
    for m in methods:
        entries = [by_key[(d, m)] for d in datasets]
        row = {"method": m, **{columns[d]: _cell(e) for d, e in zip(datasets, entries)}}
        ok = [e for e in entries if e["status"] == "ok"]
        row["Macro"] = f"{100 * np.mean([e['median'] for e in ok]):.1f}" if len(ok) == len(entries) else "-"
        rows.append(row)
        hparam_rows.append({"method": m, **{columns[d]: _hparams(e) for d, e in zip(datasets, entries)}})
    titles = [columns[d] for d in datasets]
    subset = (f"a seeded random subset of {config.max_train_samples} training examples per run (drawn with the "
              "run's seed)" if config.max_train_samples else "the full train split")
    builtin = [columns[d] for d in datasets if d in BUILTIN]
    no_test = [columns[d] for d in datasets if not _task_data(d).test]
    grid = ("each method's default learning rate and rank-like value, as `aot train` sets them with no flags"
            if config.grid == "defaults" else "from the paper's Table 2")
    notes = [f"Model: `{config.model}`. Grid: `{config.grid}` ({grid}). Seeds: {config.seeds}. "
             f"Training: {subset}; "
             + (f"exactly {config.steps} optimizer steps for every method (no early stopping; dev every "
                f"{config.curve_every()} steps, the best evaluation kept)" if config.budget == "steps" else
                f"{config.epochs} epochs max, patience {config.patience}")
             + f", max length {config.max_length}, pooling {config.pooling or 'as the model declares'}, learning "
             f"rate warm-up {TrainConfig.warmup:g} of the steps and {TrainConfig.decay} decay. Learning curves: "
             "`accuracy-curves.png`.",
             "Cells: median ± std over seeds of the test score ×100 (metric per task), for the grid point with the "
             "best seed-0 dev score. Macro: mean of the medians over datasets."]
    if builtin:
        notes.append(f"{', '.join(builtin)}: our split (80/10/10 stratified, seed 13), not official numbers.")
    if no_test:
        notes.append(f"{', '.join(no_test)}: no test split; the cell (marked `(dev)`) is the dev score of the grid "
                     "point chosen on dev, so it is optimistic.")
    if any(e["status"] != "ok" for e in summary):
        notes.append("n/a: " + "; ".join(f"{e['method']} on {columns[e['dataset']]}: {e['reason']}"
                                          for e in summary if e["status"] != "ok"))
    return ("# Accuracy\n\n" + "\n\n".join(notes) + "\n\n"
            + markdown_table(rows, ["method", *titles, "Macro"], ["Method", *titles, "Macro"])
            + "\n## Best hyperparameters (chosen on dev, seed 0)\n\n"
            + markdown_table(hparam_rows, ["method", *titles], ["Method", *titles]))


def _hparams(entry: dict) -> str:
    if entry["status"] != "ok":
        return "n/a"
    best = entry["best"]
    rank = "" if best["rank"] is None else f", {entry['rank_field']} {best['rank']}"
    return f"lr {best['lr']:g}, bs {best['batch_size']}{rank}"


def _plot(datasets: list[str], methods: list[str], summary: list[dict], path: Path) -> None:
    """Final score against trainable parameters: marker = method, colour = dataset, bars = std over seeds."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator

    columns = _columns(datasets)
    markers = "osD^vP*Xh<>p"
    fig, ax = new_figure()
    ok = [e for e in summary if e["status"] == "ok"]
    for e in ok:
        ax.errorbar(e["trainable_parameters"], 100 * e["median"], yerr=100 * e["std"], linestyle="none",
                    marker=markers[methods.index(e["method"]) % len(markers)],
                    color=f"C{datasets.index(e['dataset']) % 10}", markersize=7, capsize=3)
    if ok:
        ax.set_xscale("log")
        # the methods often sit within one decade, where a log axis has no major tick: label 2x and 5x as well
        count = FuncFormatter(lambda v, _: f"{v / 1e6:g}M" if v >= 1e6 else f"{v / 1e3:g}k")
        ax.xaxis.set_major_formatter(count)
        ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.xaxis.set_minor_formatter(count)
    else:
        ax.text(0.5, 0.5, "no finished runs", ha="center", va="center", transform=ax.transAxes)
    handles = [Line2D([], [], linestyle="none", marker=markers[i % len(markers)], color="0.3", label=m)
               for i, m in enumerate(methods)]
    handles += [Line2D([], [], linestyle="none", marker="s", color=f"C{i % 10}",
                       label=columns[d] if _task_data(d).test else f"{columns[d]} (dev: no test split)")
                for i, d in enumerate(datasets)]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.set_xlabel("trainable parameters (log)")
    ax.set_ylabel("test score ×100 (median ± std)")
    ax.set_title("Accuracy against trainable parameters")
    ax.grid(True, alpha=0.3)
    save_figure(fig, path)


def curves(summary: list[dict], records: list[dict]) -> dict[tuple[str, str], tuple[list[int], list[float]]]:
    """(dataset, method) -> the dev learning curve of its chosen grid point: steps and, at each, the median dev score
    over the seeds whose evaluations fell on those steps (the steps budget: all of them)."""
    by_id = {r["run_id"]: r for r in records}
    out = {}
    for entry in summary:
        if entry["status"] != "ok":
            continue
        histories = [by_id[i].get("history") or [] for i in entry["run_ids"] if i in by_id]
        histories = [h for h in histories if h]
        if not histories:
            continue
        steps = [h["step"] for h in histories[0]]
        same = [h for h in histories if [p["step"] for p in h] == steps]
        out[(entry["dataset"], entry["method"])] = (steps, [float(np.median([h[k]["dev"] for h in same]))
                                                           for k in range(len(steps))])
    return out


def _plot_curves(datasets: list[str], methods: list[str], summary: list[dict], records: list[dict],
                 path: Path) -> None:
    """Dev score against training step, one line per method, one panel per dataset."""
    columns = _columns(datasets)
    lines = curves(summary, records)
    fig, axes = new_figure(width=5 * len(datasets), height=4, ncols=len(datasets))
    axes = np.atleast_1d(axes)
    for ax, dataset in zip(axes, datasets):
        for i, method in enumerate(methods):
            if (dataset, method) in lines:
                steps, dev = lines[(dataset, method)]
                ax.plot(steps, [100 * v for v in dev], marker="o", markersize=3, color=f"C{i % 10}", label=method)
        ax.set_title(columns[dataset])
        ax.set_xlabel("training step")
        ax.set_ylabel("dev score ×100 (median over seeds)")
        ax.grid(True, alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "no evaluation history", ha="center", va="center", transform=ax.transAxes)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[-1].legend(handles, labels, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    save_figure(fig, path)
