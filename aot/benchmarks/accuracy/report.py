"""The reports of `aot bench accuracy`: accuracy.md (the paper's kind of table), accuracy.png (final score against
trainable parameters) and accuracy-curves.png (dev learning curves)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from aot.benchmarks.accuracy.plan import SweepConfig, task_data
from aot.benchmarks.report import markdown_table, new_figure, save_figure
from aot.training.data import BUILTIN
from aot.training.trainer import TrainConfig


def cell(entry: dict) -> str:
    if entry["status"] != "ok":
        return "n/a"
    mark = "" if entry["split"] == "test" else " (dev)"
    return f"{100 * entry['median']:.1f} ± {100 * entry['std']:.1f}{mark}"


def _columns(datasets: Iterable[str]) -> dict[str, str]:
    """Column titles: the task name, or the dataset as given where two datasets share a task name."""
    names = {d: task_data(d).spec.name for d in datasets}
    clash = len(set(names.values())) < len(names)
    return {d: d if clash else name for d, name in names.items()}


def markdown(config: SweepConfig, datasets: list[str], methods: list[str], summary: list[dict]) -> str:
    columns = _columns(datasets)
    by_key = {(e["dataset"], e["method"]): e for e in summary}
    rows, hparam_rows = [], []
    for m in methods:
        entries = [by_key[(d, m)] for d in datasets]
        row = {"method": m, **{columns[d]: cell(e) for d, e in zip(datasets, entries, strict=True)}}
        ok = [e for e in entries if e["status"] == "ok"]
        row["Macro"] = f"{100 * np.mean([e['median'] for e in ok]):.1f}" if len(ok) == len(entries) else "-"
        rows.append(row)
        hparam_rows.append({"method": m, **{columns[d]: _hparams(e) for d, e in zip(datasets, entries, strict=True)}})
    titles = [columns[d] for d in datasets]
    subset = (f"a seeded random subset of {config.max_train_samples} training examples per run (drawn with the "
              "run's seed)" if config.max_train_samples else "the full train split")
    builtin = [columns[d] for d in datasets if d in BUILTIN]
    no_test = [columns[d] for d in datasets if not task_data(d).test]
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
        notes.append(f"{', '.join(builtin)}: our split (80/10/10, seed 13; stratified by label where a task has one "
                     "label per text: docs/training.md), not official numbers.")
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


def plot(datasets: list[str], methods: list[str], summary: list[dict], path: Path) -> None:
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
                       label=columns[d] if task_data(d).test else f"{columns[d]} (dev: no test split)")
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


def plot_curves(datasets: list[str], methods: list[str], summary: list[dict], records: list[dict],
                 path: Path) -> None:
    """Dev score against training step, one line per method, one panel per dataset."""
    columns = _columns(datasets)
    lines = curves(summary, records)
    fig, axes = new_figure(width=5 * len(datasets), height=4, ncols=len(datasets))
    axes = np.atleast_1d(axes)
    for ax, dataset in zip(axes, datasets, strict=False):  # the grid may hold more axes than data sets
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
