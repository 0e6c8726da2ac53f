"""The results of `aot bench tax --engine torch` (aot.benchmarks.tax.torch_engine): tax-torch.json (one record a pass)
and tax-torch.md: the passes, the server's CPU by process per text and per request, and issue 52's targets for this
machine evaluated on them (met / no / not measured)."""

from __future__ import annotations

import os
from pathlib import Path

from aot.benchmarks.report import markdown_table, write_json, write_text

# issue 52, on the development CPU with the negligible encoder: (what, texts per request, field, at most)
TARGETS = (("outside the engine, us a text", 64, "outside_engine_us_per_text", 30.0),
           ("tritonserver, us a text", 64, "tritonserver_us_per_text", 100.0),
           ("outside the engine, us a request", 1, "outside_engine_us_per_request", 300.0))
TARGET_CONCURRENCY = {64: (8, 32), 1: (32,)}
KEYS = ["clients", "texts_per_request", "concurrency"]
KEY_HEADERS = ["clients", "texts / request", "conc."]


def processes(records: list[dict]) -> list[str]:
    """tritonserver, the step's instances in order, then the rest."""
    names = {p for r in records for p in r["by_process_us_per_text"]}
    return sorted(names, key=lambda p: (p != "tritonserver", p == "rest", p))


def targets(records: list[dict]) -> list[dict]:
    """Each target on every pass it reads; one row "not measured" for a target no pass ran for."""
    rows = []
    for what, pack, field, limit in TARGETS:
        name, concurrencies = f"{what}, {pack}-text requests", TARGET_CONCURRENCY[pack]
        passes = [r for r in records if r["texts_per_request"] == pack and r["concurrency"] in concurrencies]
        for r in passes:
            value = (r["by_process_us_per_text"].get("tritonserver") if field == "tritonserver_us_per_text"
                     else r[field])
            rows.append({"target": name, "clients": r["clients"], "concurrency": r["concurrency"], "value": value,
                         "limit": f"≤ {limit:g}", "met": "met" if value is not None and value <= limit else "**no**"})
        if not passes:
            rows.append({"target": name, "clients": None, "concurrency": "/".join(map(str, concurrencies)),
                         "value": None, "limit": f"≤ {limit:g}", "met": "not measured"})
    return rows


def write_reports(records: list[dict], out: Path, config, encoder: str) -> None:
    write_json(out / "tax-torch.json", records)
    loads = [x for r in records for x in r["loadavg"]]
    text = (f"# The GPU configs' request path on this CPU: the torch engine's fused step ({os.cpu_count()} cores; "
            f"load average {loads[0]:.2f} at the start, {loads[-1]:.2f} at the end, at most {max(loads):.2f})\n\n"
            f"Served: {encoder}; AoT with {config.mixed_tasks} tasks mixed text by text, {config.texts} texts a "
            f"pass, max batch {config.max_batch_size}; liveness probes {'on' if config.probes else 'off'}. Clients "
            "(aot.Client.infer_many in the bench's process, on the same cores): text (TEXT + TASK), ids (the client "
            "tokenizes and sends token ids), mixed (both at once). The server's CPU from /proc over each pass; the "
            "request path is tritonserver and the fused step's instances (`rest`: the task list and its store "
            "audit, not counted); outside the engine: the path less the engines' own CPU (aot_engine_cpu_us_total) "
            "and less its idle CPU over the pass's time (measured just before it).\n\n")
    text += markdown_table(records, [*KEYS, "texts_per_s", "server_cpu_us_per_text", "server_cpu_us_per_request",
                                     "engine_cpu_us_per_text", "outside_engine_us_per_text",
                                     "outside_engine_us_per_request", "idle_cpu_us_per_s", "seconds",
                                     "client_cpu_us_per_text", "loadavg"],
                           [*KEY_HEADERS, "texts/s", "server CPU us/text", "server CPU us/request",
                            "engine CPU us/text", "outside the engine us/text", "outside the engine us/request",
                            "idle path CPU us/s", "pass s", "load generator us/text", "load average (before, after)"])
    names = processes(records)
    for unit in ("text", "request"):
        for r in records:
            r.update({f"us:{p}": r[f"by_process_us_per_{unit}"].get(p) for p in names})
        text += f"\n## Server CPU microseconds per {unit} by process\n\n"
        text += markdown_table(records, [*KEYS, *(f"us:{p}" for p in names)], [*KEY_HEADERS, *names])
        for r in records:
            for p in names:
                r.pop(f"us:{p}")
    text += "\n## Issue 52's targets on this machine (the negligible encoder; quiet machine assumed)\n\n"
    text += markdown_table(targets(records), ["target", "clients", "concurrency", "value", "limit", "met"],
                           ["target", "clients", "conc.", "measured", "target", ""])
    write_text(out / "tax-torch.md", text)
