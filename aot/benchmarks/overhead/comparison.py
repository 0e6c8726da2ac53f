"""`aot bench overhead`: the paper's inference-overhead comparison (section 4.4, Figure 3), side by side in one run.

Every method is timed as the multi-task-capable computation a server would run, on one shared encoder:

    vanilla       the plain encoder (also the cost of BitFit and of fused LoRA)
    aot-fused     AoT with a fused table: host lookup of the batch's distinct tokens (memory-mapped table), rows
                  and index to the device, one gather + add per layer. The lookup is inside the timed region.
    aot-dense     (--engine onnxruntime) aot-fused in the dense bias interface: the exported graph takes each
                  token's row [B, S, L, d] instead of the distinct rows + index (serving option bias_interface)
    aot-factored  AoT computing its rows on the fly from the FC factors (rank --rank)
    lora          unfused LoRA on query/value with per-row adapters (batched low-rank matmuls, rank --rank)
    adapter       Houlsby adapters with per-row weights (bottleneck --adapter-rank)
    prompt        P-Tuning v1: p prompt vectors per row before the input (sequence S + p)
    prefix        P-Tuning v2: p key/value prefixes per row in every layer

Timing: warm-up, then rounds in which every method runs once, in a rotating order (A B C, B C A, ...); the ratio to
vanilla is taken round by round and its median reported, so that drift of the machine cancels out.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from aot.benchmarks.overhead.cases import METHODS, OverheadConfig
from aot.benchmarks.overhead.onnxruntime_engine import cpu_threads, run_onnxruntime
from aot.benchmarks.overhead.torch_engine import run_torch
from aot.benchmarks.report import markdown_table, new_figure, save_figure, write_json, write_text


def write_reports(records: list[dict], out: Path, title: str) -> None:
    write_json(out / "overhead.json", records)
    rows = []
    for r in records:
        rows.append({**r, "ratio": "-" if r["ratio_to_vanilla"] is None else f"{r['ratio_to_vanilla']:.3f}",
                     "spread": "" if r.get("ratio_p10") is None else f"{r['ratio_p10']:.3f}-{r['ratio_p90']:.3f}",
                     "ms": "-" if r["median_ms"] is None else f"{r['median_ms']:.3f}"})
    text = f"# {title}\n\n" + markdown_table(
        rows, ["model", "engine", "device", "batch", "seq", "method", "ms", "ratio", "spread"],
        ["model", "engine", "device", "batch", "seq", "method", "median ms", "× vanilla", "ratio p10-p90"])
    skipped = sorted({(r["method"], r["skipped"]) for r in records if r.get("skipped")})
    if skipped:
        text += "\nNot run: " + "; ".join(f"{m} ({why})" for m, why in skipped) + "\n"
    write_text(out / "overhead.md", text)
    _plot(records, out / "overhead.png", title)


def _plot(records: list[dict], path: Path, title: str) -> None:
    sizes = sorted({(r["model"], r["batch"], r["seq"]) for r in records})
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    fig, ax = new_figure(max(8, 0.6 * len(sizes) + 3), 4.5)
    width = 0.8 / max(1, len(methods))
    for k, method in enumerate(methods):
        values = []
        for size in sizes:
            match = [r for r in records if (r["model"], r["batch"], r["seq"]) == size and r["method"] == method]
            values.append(match[0]["ratio_to_vanilla"] if match and match[0]["ratio_to_vanilla"] else np.nan)
        ax.bar(np.arange(len(sizes)) + k * width, values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(sizes)) + width * (len(methods) - 1) / 2)
    ax.set_xticklabels([f"{m}\nb{b} s{s}" for m, b, s in sizes], fontsize=7)
    ax.set_ylabel("time / vanilla")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=min(4, len(methods)))
    save_figure(fig, path)


def run_overhead(config: OverheadConfig, progress: bool = True) -> dict:
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}: expected some of {', '.join(METHODS)}")
    if "vanilla" not in config.methods:
        config.methods = ["vanilla", *config.methods]
    if config.cuda_graphs and config.device != "cuda":
        raise ValueError("--cuda-graphs needs --device cuda")
    if config.cuda_graphs and config.engine != "torch":
        raise ValueError("--cuda-graphs applies to --engine torch")
    if config.dtype != "auto" and config.engine != "torch":
        raise ValueError(f"--dtype {config.dtype} applies to --engine torch; --engine onnxruntime runs the exported "
                         "graphs a server runs (fp16 twins on cuda where all keep parity, fp32 on cpu)")
    if config.precision not in ("fp32", "int8"):
        raise ValueError(f"--precision {config.precision!r}: expected fp32 or int8")
    if config.precision == "int8" and (config.engine != "onnxruntime" or config.device != "cpu"):
        raise ValueError("--precision int8 applies to --engine onnxruntime --device cpu (the CPU configs' int8 graphs)")
    if config.threads and (config.engine != "onnxruntime" or config.device != "cpu"):
        raise ValueError(f"--threads {config.threads} applies to --engine onnxruntime --device cpu (torch takes its "
                         "threads from torch.set_num_threads' default: the host's cores)")
    runner = run_torch if config.engine == "torch" else run_onnxruntime
    out = Path(config.out)
    graphs = " + CUDA graphs" if config.cuda_graphs else ""
    title = f"Inference overhead, {config.engine}{graphs} on {config.device}" + (
        ", int8 graphs" if config.precision == "int8" else "") + (
        f", {cpu_threads(config)} thread(s) per graph" if config.engine == "onnxruntime" and config.device == "cpu"
        else "")
    # reports are rewritten after every size: an interrupted run keeps what it measured
    records = runner(config, progress, on_size=lambda recs: write_reports(recs, out, title))
    return {"out": str(out), "records": len(records), "config": asdict(config)}
