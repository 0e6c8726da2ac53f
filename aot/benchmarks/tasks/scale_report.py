"""The reports of `aot bench tasks --scale` (aot.benchmarks.tasks.scale): scale.json (every record, each run's figures),
scale.md (medians, with the spread of the runs: min-max), scale.png."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from aot.benchmarks.report import markdown_table, new_figure, save_figure, write_json, write_text

# the figures whose every run a record keeps (`<figure>_runs`), and scale.md shows as median (min-max)
SPREAD = ("ready_s", "pss_after_total_mb", "cold_p50_ms", "cold_p99_ms", "busy_cold_p99_ms", "busy_warm_p50_ms",
          "busy_cold_vs_warm", "fused_cold_p50_ms", "fused_cold_p99_ms", "fused_busy_cold_p99_ms",
          "fused_busy_warm_p50_ms", "fused_busy_cold_vs_warm", "steady_vs_hot", "zipf_vs_hot", "hot_rps")
COLUMNS = [
    ("tasks", "tasks"), ("ready_s", "ready (s)"), ("ready_vs_first", "× first"),
    ("pss_after_total_mb", "PSS after traffic (MB)"), ("pss_vs_first_mb", "+MB vs first (PSS)"),
    ("rss_after_total_mb", "RSS after (MB)"), ("host_cache_mb", "host cache (MB)"),
    ("cold_p50_ms", "cold p50 ms"), ("cold_p99_ms", "cold p99 ms"), ("busy_cold_p99_ms", "cold p99 under load ms"),
    ("busy_warm_p50_ms", "warm p50 ms of that load"), ("busy_cold_vs_warm", "cold p99 under load × warm p50"),
    ("fused_cold_p50_ms", "fused cold p50 ms"), ("fused_cold_p99_ms", "fused cold p99 ms"),
    ("fused_busy_cold_p99_ms", "fused cold p99 under load ms"),
    ("fused_busy_cold_vs_warm", "fused cold p99 under load × warm p50"),
    ("steady_tasks", "tasks in the steady pass"), ("steady_vs_hot", "steady × hot"),
    ("zipf_vs_hot", "cold-protocol Zipf × hot"), ("hot_rps", "hot req/s"),
    ("publish_one_s", "publish one (s)"), ("publish_vs_first", "× first"),
    ("publish_writer_bytes", "bytes the publisher reads"), ("publish_bytes_read", "bytes a reader reads per publish"),
    ("publish_to_served_s", "publish → served (s)"), ("errors", "errors"), ("wrong", "wrong answers"),
]


def _shown(record: dict, key: str):
    """A figure as scale.md shows it: the median, and the runs' min-max when there were several."""
    runs = [v for v in record.get(f"{key}_runs", []) if v is not None]
    value = record.get(key)
    if len(runs) > 1 and value is not None:
        return f"{value:g} ({min(runs):g}-{max(runs):g})"
    return value


def write_scale_reports(records: list[dict], out: Path, config, policies: list[dict] = ()) -> None:
    write_json(out / "scale.json", {"records": records, "config": asdict(config), "policies": list(policies)})
    first = records[0]
    rows = []
    for r in records:
        row = {key: _shown(r, key) for key, _ in COLUMNS if key in r}
        row["host_cache_mb"] = round(r["host_cache_bytes"] / 2**20, 2)
        row.update({"ready_vs_first": round(r["ready_s"] / first["ready_s"], 2),
                    "pss_vs_first_mb": round(r["pss_after_total_mb"] - first["pss_after_total_mb"], 1),
                    "publish_vs_first": round(r["publish_one_s"] / first["publish_one_s"], 2)})
        rows.append(row)
    runs = f", median of {records[0].get('repeats', 1)} runs (min-max)" if records[0].get("repeats", 1) > 1 else ""
    text = f"# One server, many tasks (CPU, `aot serve` defaults{runs})\n\n" + markdown_table(
        rows, [k for k, _ in COLUMNS], [h for _, h in COLUMNS])
    text += "\n## Memory of each server process after the traffic (PSS, MB; the first run)\n\n"
    for r in records:
        text += f"- {r['tasks']} tasks: " + ", ".join(f"{k} {v}" for k, v in r["pss_after_mb"].items()) + "\n"
    for r in records:
        if "instances_pss_mb" in r:
            text += (f"\n## The same working set by instances of the fused step ({r['tasks']} tasks: PSS after the "
                     "warm-up and steady pass, MB)\n\n" + ", ".join(f"{k} instances: {v}" for k, v in
                                                                    r["instances_pss_mb"].items()) + "\n")
    if policies:
        text += ("\n## The host's version cache policy against LRU (replayed in process, this bench's version size and "
                 "the default bound)\n\n" + markdown_table(list(policies), ["trace", "policy", "requests", "capacity",
                                                                             "hit_rate"],
                                                           ["trace", "policy", "requests", "versions the cache holds",
                                                            "hit rate"]))
    write_text(out / "scale.md", text)
    fig, (left, right) = new_figure(11, 4.5, ncols=2)
    xs = [r["tasks"] for r in records]
    left.plot(xs, [r["ready_s"] for r in records], marker="o", label="ready (s)")
    left.plot(xs, [r["pss_after_total_mb"] / 1024 for r in records], marker="o", label="PSS after traffic (GB)")
    right.plot(xs, [r["steady_vs_hot"] for r in records], marker="o", label="steady Zipf req/s × one hot task")
    right.plot(xs, [r["zipf_vs_hot"] for r in records], marker="o", label="cold-protocol Zipf req/s × one hot task")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("tasks in the store")
        ax.legend(fontsize=7)
    fig.suptitle("One server, many tasks (CPU)")
    save_figure(fig, out / "scale.png")
