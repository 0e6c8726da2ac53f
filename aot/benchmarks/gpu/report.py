"""The results of `aot bench gpu-perf`: each window against the engine alone and against vanilla, issue 52's targets
evaluated on them, the py-spy profile of one step instance, what fails the check, and perf.json / perf.md (rewritten
after every window, so that a run cut short keeps what it measured).

A target is met (True), missed (False) or not measured (None: its window was skipped or failed, or the figure does
not exist here, such as the GPU's utilisation on a CPU rehearsal). What fails the check itself: a measured batch that ran
eagerly where CUDA graphs are on (the issue's "0 eager batches"; on a GPU, no count at all too), served answers that
differ from `aot predict` by more than the precision explains, and a shape that could not be served.
"""

from __future__ import annotations

from itertools import zip_longest
from pathlib import Path

from aot.benchmarks.report import markdown_table, write_json, write_text

# issue 52's targets: vanilla's share of the engine alone's sequences/s at c=256 by shape (a shape of another name is
# held to the base-size shape's)
SINGLE_SHARE = {"minilm": 0.15, "base": 1 / 3}  # 1-text requests
PACKED_SHARE = {"minilm": 0.5, "base": 0.8}  # 64-text requests
MIXED_OVER_VANILLA = 0.95  # AoT, 8 tasks mixed, against vanilla at the same request size and concurrency: every one
RATIO_CONCURRENCIES = (32, 256)  # the windows measured first (perf.priority)
P50_MS = 3.0  # c=1, 1-text requests, the MiniLM shape
P50_SHAPES = ("minilm",)
GPU_UTIL = 60.0  # percent, 64-text requests at c=256
TOP_CONCURRENCY = 256
PARITY_TOLERANCE = {"cuda": 5e-2, "cpu": 1e-3}  # fp16 on a GPU (~1e-2 expected) against aot predict's fp32


def _window(shape: dict, model: str, texts: int, concurrency: int) -> dict | None:
    """The measured window, or None (never run, skipped, failed)."""
    for w in shape["windows"]:
        if (w["model"], w["texts"], w["concurrency"]) == (model, texts, concurrency) and w.get("texts_per_s"):
            return w
    return None


def engine_rate(shape: dict, model: str) -> float | None:
    """The engine alone's sequences/s for a window's model: vanilla's, or AoT's for either AoT load."""
    engine = shape.get("engine_alone") or {}
    return engine.get("vanilla_seq_per_s" if model == "vanilla" else "aot_seq_per_s")


def derived(shape: dict) -> list[dict]:
    """Each window with its share of the engine alone and its ratio to vanilla at the same size and concurrency."""
    rows = []
    for w in shape["windows"]:
        row = dict(w)
        rate, vanilla = engine_rate(shape, w["model"]), _window(shape, "vanilla", w["texts"], w["concurrency"])
        measured = bool(w.get("texts_per_s"))
        row["of_engine"] = round(w["texts_per_s"] / rate, 3) if measured and rate else None
        row["x_vanilla"] = round(w["texts_per_s"] / vanilla["texts_per_s"], 3) if measured and vanilla else None
        rows.append(row)
    return rows


def _check(target: str, shape: str, value, threshold: float, at_least: bool, note: str = "") -> dict:
    met = None if value is None else (value >= threshold if at_least else value <= threshold)
    return {"target": target, "shape": shape, "value": value, "threshold": ("≥ " if at_least else "≤ ")
            + format(threshold, ".3g"), "met": met, "note": note}


def evaluate_targets(shapes: list[dict]) -> list[dict]:
    """Issue 52's targets on each shape's windows (ratios within this run)."""
    checks = []
    for shape in shapes:
        name, rows = shape["name"], {(r["model"], r["texts"], r["concurrency"]): r for r in derived(shape)}

        def value(model, texts, concurrency, field, rows=rows):
            return (rows.get((model, texts, concurrency)) or {}).get(field)

        checks.append(_check(f"vanilla, 1-text requests, c={TOP_CONCURRENCY}: served / engine alone", name,
                             value("vanilla", 1, TOP_CONCURRENCY, "of_engine"),
                             SINGLE_SHARE.get(name, SINGLE_SHARE["base"]), True))
        checks.append(_check(f"vanilla, 64-text requests, c={TOP_CONCURRENCY}: served / engine alone", name,
                             value("vanilla", 64, TOP_CONCURRENCY, "of_engine"),
                             PACKED_SHARE.get(name, PACKED_SHARE["base"]), True))
        concurrencies = sorted({w["concurrency"] for w in shape["windows"]} | set(RATIO_CONCURRENCIES))
        for texts in (1, 64):
            for c in concurrencies:
                checks.append(_check(f"AoT 8 mixed / vanilla, {texts}-text requests, c={c}", name,
                                     value("aot-8", texts, c, "x_vanilla"), MIXED_OVER_VANILLA, True))
        if name in P50_SHAPES:
            for model in ("vanilla", "aot-1", "aot-8"):
                checks.append(_check(f"{model}, 1-text requests, c=1: p50 ms", name, value(model, 1, 1, "p50_ms"),
                                     P50_MS, False))
        eager = (shape.get("eager_batches") or {}).get("measured")
        checks.append(_check("batches run eagerly in the measured windows", name, eager, 0, False,
                             "" if eager is not None else "no CUDA graphs (cpu) or no metric"))
        for model in ("vanilla", "aot-1", "aot-8"):
            checks.append(_check(f"{model}, 64-text requests, c={TOP_CONCURRENCY}: GPU utilisation %", name,
                                 value(model, 64, TOP_CONCURRENCY, "gpu_util_mean"), GPU_UTIL, True))
    return checks


def failures(shapes: list[dict], device: str) -> list[str]:
    """What fails the check: an eager batch in a measured window (or, on a GPU, no count at all), served answers
    off `aot predict`."""
    found = []
    for shape in shapes:
        if shape.get("error"):
            found.append(f"{shape['name']}: {shape['error']}")
        eager = shape.get("eager_batches")
        if eager is None:
            continue  # the shape never served (skipped): said in its skipped list
        if eager.get("measured"):
            found.append(f"{shape['name']}: {eager['measured']} batch(es) ran eagerly in the measured windows "
                         "(aot_engine_eager_batches_total): the served step did not replay its CUDA graphs")
        elif device == "cuda" and eager.get("measured") is None:
            found.append(f"{shape['name']}: the server published no aot_engine_eager_batches_total on cuda, so "
                         "nothing shows that its CUDA graphs replayed")
        parity = shape.get("parity") or {}
        tolerance = PARITY_TOLERANCE.get(device, PARITY_TOLERANCE["cuda"])
        if parity.get("max_abs_logit_diff") is not None and parity["max_abs_logit_diff"] > tolerance:
            found.append(f"{shape['name']}: served logits differ from aot predict's by "
                         f"{parity['max_abs_logit_diff']:.3g} (more than {tolerance:g})")
    return found


def _met(value) -> str:
    return {True: "yes", False: "**no**", None: "not measured"}[value]


def markdown(result: dict) -> str:
    text = (f"# GPU perf check: {result['device_name']}\n\n"
            f"Load generator: **{result['generator']}**. Started {result['started']}; {result['elapsed_s']:.0f} s.\n\n")
    text += "".join(f"- {note}\n" for note in result["notes"]) + "\n"
    if result["failures"]:
        text += "**The check FAILED:**\n\n" + "".join(f"- {f}\n" for f in result["failures"]) + "\n"
    text += "## Targets (issue 52; ratios within this run)\n\n"
    if result["device"] == "cpu":
        text += "A rehearsal on CPU: the targets are evaluated to exercise the report, not met or missed.\n\n"
    text += markdown_table([{**t, "met": _met(t["met"])} for t in result["targets"]],
                           ["target", "shape", "value", "threshold", "met", "note"])
    for shape in result["shapes"]:
        text += f"\n## {shape['name']}: {shape['description']}\n\n"
        engine = shape.get("engine_alone")
        if engine:
            text += (f"The engine alone (`aot bench overhead`{', CUDA graphs' if engine['cuda_graphs'] else ''}, "
                     f"batch {engine['batch']} x {engine['seq']} tokens): vanilla {engine['vanilla_ms']:.3f} ms = "
                     f"**{engine['vanilla_seq_per_s']:,.0f} seq/s**, AoT {engine['aot_ms']:.3f} ms = "
                     f"**{engine['aot_seq_per_s']:,.0f} seq/s** ({engine['aot_over_vanilla']:.3f}x vanilla's time).\n\n")
        if shape.get("texts_note"):
            text += (f"Served texts: {shape['texts_note']}. The served step in {shape.get('gpu_instances')} "
                     f"instance(s) on the GPU; server ready in {shape.get('ready_seconds')} s.\n\n")
        rows = [{**r, "note": r.get("error") or (f"skipped: {r['skipped']}" if r.get("skipped") else "")}
                for r in derived(shape)]
        if rows:
            text += markdown_table(rows, ["model", "texts", "concurrency", "texts_per_s", "requests_per_s", "p50_ms",
                                          "p99_ms", "of_engine", "x_vanilla", "gpu_util_mean", "gpu_util_max",
                                          "seconds", "note"],
                                   ["model", "texts / request", "c", "texts/s", "requests/s", "p50 ms", "p99 ms",
                                    "× engine alone", "× vanilla", "GPU util % (mean)", "GPU util % (max)",
                                    "window s", "note"])
        eager = shape.get("eager_batches") or {}
        if eager.get("since_start") is None:
            text += "\n- Batches run eagerly: not counted (no aot_engine_eager_batches_total: no CUDA graphs)\n"
        else:
            text += (f"\n- Batches run eagerly: {eager['measured']} in the measured windows, {eager['since_start']} "
                     "since the server started (aot_engine_eager_batches_total)\n")
        text += f"- /ready warnings: {shape.get('ready_warnings') or 'none'}\n"
        parity = shape.get("parity")
        if parity:
            text += (f"- Parity with `aot predict` ({parity['texts']} texts, task aot-0): max |logit diff| "
                     f"{parity['max_abs_logit_diff']:.3g}, same label {parity['same_label']}\n")
        text += profile_markdown(shape.get("profile"))
        text += "- Elapsed: " + ", ".join(f"{k} {v:.0f} s" for k, v in shape.get("elapsed_s", {}).items()) + "\n"
        if shape.get("skipped"):
            text += "- **Skipped**: " + "; ".join(shape["skipped"]) + "\n"
    return text


def profile_markdown(profile: dict | None) -> str:
    """py-spy's summary of one step instance (step_profile), as lines of the shape's list."""
    if not profile:
        return ""
    if profile.get("error"):
        return f"- py-spy through {profile['window']}: failed ({profile['error']})\n"
    text = (f"- py-spy of one instance of the step (pid {profile['pid']}) through {profile['window']}: "
            f"{profile['samples']} samples of {profile['expected_samples']} ({profile['busy_share']:.0%} of the time "
            f"busy in Python; raw stacks: {profile['raw']}). The most samples, as the leaf (own time) and anywhere "
            "in the stack:\n\n")
    rows = [{"leaf": a.get("frame"), "leaf %": round(100 * a["share_of_samples"], 1) if a else None,
             "inclusive": b.get("frame"), "inclusive %": round(100 * b["share_of_samples"], 1) if b else None}
            for a, b in zip_longest(profile["leaf"], profile["inclusive"], fillvalue={})]
    return text + markdown_table(rows, ["leaf", "leaf %", "inclusive", "inclusive %"]) + "\n"


def write_reports(result: dict, out: Path) -> None:
    """perf.json and perf.md from `result` with its targets and failures evaluated now."""
    result["targets"] = evaluate_targets(result["shapes"])
    result["failures"] = failures(result["shapes"], result["device"])
    write_json(out / "perf.json", result)
    write_text(out / "perf.md", markdown(result))
