"""What an int8 backbone costs each task, and what re-fitting wins back (docs/benchmarks.md, "int8 on CPU").

Every task is published into one int8 repository as a user would (aot.exporter.task_export: the accuracy gate scores its
dev examples through the int8 engine against its fp32 score; here with the threshold lifted, since a benchmark
measures, it does not refuse); a task more than `allowed_drop` points below is re-fitted to the int8 backbone
(aot.training.refit) and published again, and its served score is held against the fp32 task's.

    python -m aot.benchmarks.accuracy.int8 --repo REPO --tasks rt=runs/rt,bbc=runs/bbc --out DIR [--refit-steps N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aot.benchmarks.report import markdown_table, write_json, write_text
from aot.training.trainer import TrainConfig

NO_LIMIT = 100.0  # points: publish whatever the drop, to measure it


@dataclass
class TaskAccuracy:
    """One task's dev score in fp32 and through the served int8 engine, before and after re-fitting."""

    task: str
    metric: str
    examples: int
    fp32: float
    int8: float
    drop: float  # points below fp32
    refit_int8: float | None = None  # the re-fitted task's served score (None: not re-fitted)
    refit_drop: float | None = None  # points below the fp32 task's score
    refit_steps: int | None = None
    refit_seconds: float | None = None


def measure(repo: Path, tasks: dict[str, Path], allowed_drop: float, refit: TrainConfig, scratch: Path,
            on_task=lambda rows: None) -> list[TaskAccuracy]:
    """`refit`: the re-fitting's settings (max_steps 0: measure only)."""
    from aot.exporter.task_export import export_task
    from aot.training.refit import fit_task

    rows = []
    for label, folder in tasks.items():
        served = export_task(folder, repo, label, "factored", progress=False, allowed_drop=NO_LIMIT).served_dev
        if served is None:
            raise ValueError(f"{repo} serves fp32 on CPU: export it with --precision int8")
        row = TaskAccuracy(label, served["metric"], served["examples"], served["fp32"], served["score"],
                           served["drop"])
        if row.drop > allowed_drop and refit.max_steps:
            start = time.perf_counter()
            fitted = fit_task(folder, repo, scratch / label, refit, progress=False)
            again = export_task(scratch / label, repo, f"{label}-refit", "factored", progress=False,
                                allowed_drop=NO_LIMIT).served_dev
            row.refit_int8, row.refit_drop = again["score"], again["drop"]
            row.refit_steps, row.refit_seconds = fitted["steps"], round(time.perf_counter() - start, 1)
        rows.append(row)
        on_task(rows)
    return rows


def write_reports(rows: list[TaskAccuracy], out: Path, repo: Path) -> None:
    records = [vars(r) for r in rows]
    write_json(out / "int8_accuracy.json", records)
    table = [{**r, **{k: "" if r[k] is None else f"{r[k] * 100:.2f}" for k in ("fp32", "int8", "refit_int8")},
              **{k: "" if r[k] is None else f"{r[k]:+.2f}" for k in ("drop", "refit_drop")}} for r in records]
    text = (f"# Dev scores in fp32 and through the int8 engine ({repo})\n\n"
            f"Load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}\n\n")
    text += markdown_table(table, ["task", "metric", "examples", "fp32", "int8", "drop", "refit_int8", "refit_drop",
                                   "refit_steps", "refit_seconds"],
                           ["task", "metric", "dev examples", "fp32 ×100", "int8 ×100", "points below fp32",
                            "re-fitted int8 ×100", "re-fitted: points below fp32", "re-fit steps", "re-fit s"])
    write_text(out / "int8_accuracy.md", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aot.benchmarks.accuracy.int8",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, help="an int8 repository (aot export backbone --precision int8)")
    parser.add_argument("--tasks", required=True, help="LABEL=TASK_DIR,... the trained tasks to publish")
    parser.add_argument("--out", required=True, help="folder for int8_accuracy.json and .md")
    parser.add_argument("--allowed-drop", type=float, default=0.5, help="points below fp32 that call for re-fitting")
    parser.add_argument("--refit-steps", type=int, default=300, help="re-fitting steps (0: measure only)")
    parser.add_argument("--refit-lr", type=float, default=1e-3, help="re-fitting learning rate")
    args = parser.parse_args(argv)
    tasks = dict(item.split("=", 1) for item in args.tasks.split(","))
    out, repo, scratch = Path(args.out), Path(args.repo), Path(tempfile.mkdtemp(prefix="aot-int8-accuracy-"))
    try:
        refit = TrainConfig(lr=args.refit_lr, max_steps=args.refit_steps, eval_every=max(args.refit_steps // 2, 1))
        measure(repo, {k: Path(v) for k, v in tasks.items()}, args.allowed_drop, refit, scratch,
                on_task=lambda rows: write_reports(rows, out, repo))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
