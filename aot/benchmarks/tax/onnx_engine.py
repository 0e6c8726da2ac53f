"""`aot bench tax`: the serving tax, the CPU every server process spends per request beyond what the engine alone
spends per sequence, measured through the real local tritonserver.

In one run, on the same texts (Rotten Tomatoes dev reviews, tokenized to the task's max length):

    engine      the exported graphs alone in this process (aot.serving.engine.BackboneRunner, the served step's own
                code), no server: the vanilla graph, and the AoT graph with one task's rows of P; sequences/s, p50
                per call and CPU microseconds per sequence at each batch size. The vanilla graph's best batch size
                is the limit the server is measured against (the AoT graph's: what the server adds to the method).
    served      `vanilla`, `aot` with 1 task and with 8 tasks mixed request by request (and each again with token ids
                tokenized on the client) at each concurrency, for each --cpu-instances layout of the fused step on
                a server of its own: req/s, p50/p99, and the CPU microseconds per request of tritonserver and of
                each python step's stub, read from /proc (the run time of every thread, /proc/<pid>/task/*/
                schedstat) before and after the pass.

The tax of a pass is the sum over server processes less the engine's CPU per sequence at its best batch size. A
python step that does not run the engine runs its `execute` on one thread: its ceiling is instances x 1e6 / (its
us per request) requests/s, on any number of cores; tritonserver's own threads spread over the host's cores
(cores x 1e6 / us). The load generator is this process's Python threads (aot.client.client.Client, one gRPC channel
each) on the same cores: its own CPU per request is measured and reported beside the server's.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from aot.benchmarks.report import markdown_table, new_figure, save_figure, write_json, write_text
from aot.benchmarks.served.serve import ServeBenchConfig, Store, _build, _closed_loop, _texts
from aot.exporter import configs
from aot.exporter.configs import CPU_CONFIG, parse_pbtxt, to_pbtxt
from aot.serving.repository import read_repository

STEP_NAMES = ("aot", "vanilla", "tokenizer", "backbone", "backbone_vanilla", "head", "aot_lookup", "task_list")
# the processes that run the encoder: the CPU configs' fused steps, or the GPU ensembles' backbone steps
ENGINE_STEPS = ("aot", "vanilla", "backbone", "backbone_vanilla")


@dataclass
class TaxBenchConfig:
    task: str
    out: str
    repo: str | None = None
    concurrency: tuple[int, ...] = (1, 8, 32)
    requests: int = 600
    batches: tuple[int, ...] = (1, 8, 32)  # the engine alone
    mixed_tasks: int = 8
    cores: int = 16  # the host the ceilings are stated for
    cpu_instances: tuple[int, ...] = (1, 2)  # instances of the fused step, each layout on a server of its own
    precision: str = "fp32"  # the CPU graphs served and timed alone: fp32, or int8 (one request at a time)


def server_processes(pid: int) -> dict[str, int]:
    """tritonserver and each python step's stub by the model it serves (the stub's command line names the model's
    folder: .../models/<model>/1/model.py; instances beyond the first get #2, #3, ...)."""
    import psutil

    found = {"tritonserver": pid}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        model = next((m for m in STEP_NAMES if f"/models/{m}/" in command), None)
        if model is None:
            continue
        name, k = model, 1
        while name in found:
            k += 1
            name = f"{model}#{k}"
        found[name] = child.pid
    return found


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each process's threads have run, to the nanosecond (the sum of /proc/<pid>/task/*/schedstat;
    /proc/<pid>/stat counts 10 ms ticks, too coarse for a few hundred requests). A process gone is left out."""
    out = {}
    for name, pid in pids.items():
        total = 0
        try:
            for thread in Path(f"/proc/{pid}/task").iterdir():
                try:
                    total += int((thread / "schedstat").read_text().split()[0])
                except (OSError, IndexError, ValueError):
                    continue  # a thread that ended meanwhile
        except OSError:
            continue
        out[name] = total / 1e9
    return out


def own_cpu_seconds() -> float:
    """This process's CPU seconds, the threads that ended included (the clients' threads end with each pass)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def engine_alone(repo: Path, sequences: list[dict[str, np.ndarray]], batches: tuple[int, ...], task: str,
                 graph: str = "vanilla") -> list[dict]:
    """A graph on the served step's code, no server: each batch size over every sequence, in order; batches split
    by length as the served step splits them (aot.serving.engine.length_groups), and (vanilla) padded whole to their
    longest sequence as Triton's native backends pad them. `graph` "aot": the AoT graph, each sequence with its
    rows of P from task `task` (the limit of the AoT passes: the bias is the method's cost, not the server's). The
    graphs are the ones the repository's CPU configs run (aot.serving.repository.RepositoryInfo.cpu_graph): an int8
    repository's int8 twins, one sequence at a time whatever the batch, as its steps run them."""
    from aot.serving.columns import TaskColumn
    from aot.serving.engine import BackboneRunner, EncoderBatch
    from aot.serving.stages import find_rows
    from aot.serving.task_registry import TaskRegistry

    info = read_repository(repo)
    records = []
    onnx = info.cpu_graph("backbone" if graph == "aot" else "backbone_vanilla")
    per_request = info.record.cpu_per_request
    threads = info.options.cpu_threads
    runners = {"by length": BackboneRunner(onnx, threads=threads, per_request=per_request)}
    served = None
    if graph == "vanilla":
        if not per_request:  # one request at a time: nothing is padded
            runners["padded"] = BackboneRunner(onnx, threads=threads, max_padding=None)
    else:
        served = TaskRegistry(info.store_root, parts="rows").resolve(task)

    def batches_of(size: int) -> list[EncoderBatch]:
        """The sequences in batches of `size`, each with its rows of P (AoT), built before the timing."""
        out = []
        for i in range(0, len(sequences), size):
            batch = EncoderBatch.of(sequences[i:i + size])
            if served is not None:
                find_rows(batch, TaskColumn([served], np.zeros(batch.size, np.int64)), served.vocab_size)
            out.append(batch)
        return out

    for (grouping, runner), batch in ((r, b) for b in batches for r in runners.items()):
        if batch == 1 and runner is not next(iter(runners.values())):
            continue  # one sequence: nothing to split
        ready = batches_of(batch)
        runner.run(ready[0])  # warm
        calls, cpu0, start = [], own_cpu_seconds(), time.perf_counter()
        for one in ready:
            t = time.perf_counter()
            runner.run(one)
            calls.append((time.perf_counter() - t) * 1e3)
        wall, cpu = time.perf_counter() - start, own_cpu_seconds() - cpu0
        records.append({"kind": "engine", "graph": graph, "graph_file": str(onnx.relative_to(info.models)),
                        "per_request": per_request,
                        "batch": batch, "grouping": grouping,
                        "sequences": len(sequences),
                        "throughput_rps": round(len(sequences) / wall, 1),
                        "p50_ms": round(float(np.percentile(calls, 50)), 2),
                        "cpu_us_per_sequence": round(cpu * 1e6 / len(sequences), 1)})
    return records


def _tokenized(repo: Path, texts: list[str], max_length: int) -> list[dict[str, np.ndarray]]:
    from aot.serving.tokenization import Tokenization

    info = read_repository(repo)
    tokens = Tokenization(info.tokenizer_dir, info.uses_token_type_ids)
    return [tokens.encode(t, None, max_length) for t in texts]


def set_cpu_instances(repo: Path, instances: int) -> None:
    """The fused steps' instance count in the scratch repository's CPU configs (what `aot export backbone
    --cpu-instances` writes), so that layouts are compared on one export."""
    for model in ("aot", "vanilla"):
        path = repo / "models" / model / CPU_CONFIG
        config = parse_pbtxt(path.read_text())
        configs.set_cpu_instances(config, instances)
        path.write_text(to_pbtxt(config))


def ceiling(process: str, us: float, cores: int) -> float | None:
    """Requests/s a process allows on a host of `cores` cores: one instance of a python step runs its `execute` on
    one thread (n instances: n times this); tritonserver's threads spread over every core."""
    if us <= 0:
        return None
    return round((cores if process == "tritonserver" else 1) * 1e6 / us)


def run_tax_bench(config: TaxBenchConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from aot.training.artifact import read_task

    out = Path(config.out)
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-tax-"))
    repo, masters, _ = _build(ServeBenchConfig(config.task, config.out, config.repo, storages=("fused",)), scratch,
                              config.precision)
    names = Store(repo, masters).set("fused", max(config.mixed_tasks, 1))
    max_length = read_task(config.task).max_length
    texts = _texts(config.requests)
    sequences = _tokenized(repo, texts, max_length)
    records: list[dict] = [{"kind": "load", "loadavg": list(os.getloadavg()), "when": "start"}]
    records += engine_alone(repo, sequences, config.batches, names[0])
    records += engine_alone(repo, sequences, config.batches, names[0], graph="aot")
    passes = [(m, mix, ids) for m, mix in (("vanilla", 1), ("aot", 1), ("aot", config.mixed_tasks))
              for ids in (False, True)]
    bar = tqdm(total=len(config.cpu_instances) * len(config.concurrency) * len(passes), desc="tax bench",
               disable=not progress)
    tokenizer = read_repository(repo).tokenizer_dir
    configs = {p: p.read_text() for p in (repo / "models" / m / CPU_CONFIG for m in ("aot", "vanilla"))}
    try:
        for instances in config.cpu_instances:
            set_cpu_instances(repo, instances)
            records += served_passes(repo, names, texts, tokenizer, passes, config, instances, bar)
    finally:  # a --repo given is left with its own configs
        for path, text in configs.items():
            path.write_text(text)
    bar.close()
    records.append({"kind": "load", "loadavg": list(os.getloadavg()), "when": "end"})
    summarize(records, config.cores)
    write_reports(records, out, config)
    shutil.rmtree(scratch, ignore_errors=True)
    return {"out": str(out), "records": len(records), "config": asdict(config)}


def served_passes(repo: Path, names: list[str], texts: list[str], tokenizer: Path, passes: list, config: TaxBenchConfig,
                  instances: int, bar) -> list[dict]:
    """Every pass at every concurrency on one server whose fused steps run `instances` instances."""
    from aot.local.server import LocalServer

    records = []
    with LocalServer(repo, vanilla=True) as server:
        pids = server_processes(server.process.pid)
        for model in ("vanilla", "aot"):  # warm every step and task (every instance: one request each at a time)
            for tok in (None, tokenizer):
                _closed_loop(server.grpc_url, model, [(n, t) for n in names for t in texts[:4]], 1, tokenizer=tok)
        for concurrency in config.concurrency:
            for model, mix, ids in passes:
                items = [(names[i % mix], text) for i, text in enumerate(texts)]
                load0, before, own0 = os.getloadavg()[0], cpu_seconds(pids), own_cpu_seconds()
                result = _closed_loop(server.grpc_url, model, items, concurrency, tokenizer=tokenizer if ids else None)
                after, own = cpu_seconds(pids), own_cpu_seconds() - own0
                done = max(len(items) - result["errors"], 1)
                cpu_us = {p: round((after[p] - before[p]) * 1e6 / done, 1) for p in after if p in before}
                records.append({"kind": "served", "precision": config.precision, "model": model,
                                "tasks_in_flight": mix, "token_ids": ids, "cpu_instances": instances,
                                "concurrency": concurrency, "requests": len(items), **result,
                                "cpu_us_per_request": cpu_us,
                                "server_cpu_us_per_request": round(sum(cpu_us.values()), 1),
                                "client_cpu_us_per_request": round(own * 1e6 / done, 1),
                                "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]})
                bar.update(1)
    return records


def summarize(records: list[dict], cores: int) -> None:
    """The tax and ratios of each served pass against the engine alone at its best batch size; each process's
    ceiling on a `cores`-core host."""
    engine = [r for r in records if r["kind"] == "engine" and r["graph"] == "vanilla"]
    best = max(engine, key=lambda r: r["throughput_rps"])
    single = next((r for r in engine if r["batch"] == 1), best)
    aot_engine = [r for r in records if r["kind"] == "engine" and r["graph"] == "aot"]
    best_aot = max(aot_engine, key=lambda r: r["throughput_rps"]) if aot_engine else best
    vanilla = {(r["cpu_instances"], r["concurrency"], r["token_ids"]): r for r in records
               if r["kind"] == "served" and r["model"] == "vanilla"}
    for r in records:
        if r["kind"] != "served":
            continue
        engine_us = best["cpu_us_per_sequence"]
        r["tax_us_per_request"] = round(r["server_cpu_us_per_request"] - engine_us, 1)
        # against the engine alone on the served graph: what the server adds to the AoT graph's own cost
        same = best_aot if r["model"] == "aot" else best
        r["tax_same_graph_us"] = round(r["server_cpu_us_per_request"] - same["cpu_us_per_sequence"], 1)
        # the two parts of the tax: the step that runs the encoder beyond the engine alone (the python backend's
        # machinery, tokenizer and head in the fused step, batching, lookup), and every other process (tritonserver:
        # gRPC and the hops), which the engine's own noise does not blur
        engine_step = sum(us for p, us in r["cpu_us_per_request"].items() if p.split("#")[0] in ENGINE_STEPS)
        r["engine_step_over_engine_us"] = round(engine_step - engine_us, 1)
        r["outside_engine_step_us"] = round(r["server_cpu_us_per_request"] - engine_step, 1)
        r["x_engine"] = round(r["throughput_rps"] / best["throughput_rps"], 3)
        r["p50_over_engine_ms"] = round(r["p50_ms"] - single["p50_ms"], 2)
        base = vanilla.get((r["cpu_instances"], r["concurrency"], r["token_ids"]))
        r["x_vanilla"] = round(r["throughput_rps"] / base["throughput_rps"], 3) if base else None
        r["ceilings_rps"] = {p: ceiling(p.split("#")[0], us, cores) for p, us in r["cpu_us_per_request"].items()
                             if p.split("#")[0] not in ENGINE_STEPS and p != "task_list"}


def _label(record: dict) -> str:
    """`aot x8 (2 inst.)`: the model, the tasks mixed in its pass, the fused step's instances."""
    mix = f" x{record['tasks_in_flight']}" if record["tasks_in_flight"] > 1 else ""
    return f"{record['model']}{mix} ({record['cpu_instances']} inst.)"


def write_reports(records: list[dict], out: Path, config: TaxBenchConfig) -> None:
    write_json(out / "tax.json", records)
    engine = [r for r in records if r["kind"] == "engine"]
    served = [r for r in records if r["kind"] == "served"]
    loads = [r["loadavg"][0] for r in records if r["kind"] == "load"]
    text = (f"# The serving tax (CPU, {config.precision} graphs, {os.cpu_count()} cores; load average "
            f"{loads[0]:.2f} at the start, {loads[-1]:.2f} at the end)\n\n## The engine alone (the vanilla graph, "
            "and the AoT graph with one task's rows; no server)\n\n")
    text += markdown_table(engine, ["graph", "batch", "grouping", "sequences", "throughput_rps", "p50_ms",
                                    "cpu_us_per_sequence"],
                           ["graph", "batch", "batch split", "sequences", "seq/s", "p50 ms per call",
                            "CPU us / sequence"])
    steps = sorted({p for r in served for p in r["cpu_us_per_request"]},
                   key=lambda p: (p != "tritonserver", STEP_NAMES.index(p.split("#")[0]) if p != "tritonserver"
                                  else 0, p))
    for r in served:
        r["ensemble"] = _label(r) + (", ids" if r["token_ids"] else "")
        for p in steps:
            r[f"us:{p}"] = r["cpu_us_per_request"].get(p)
            r[f"ceiling:{p}"] = r["ceilings_rps"].get(p)
    text += "\n## Served (closed loop, clients on the same cores)\n\n"
    text += markdown_table(served, ["ensemble", "cpu_instances", "concurrency", "throughput_rps", "x_engine",
                                    "x_vanilla", "p50_ms", "p99_ms", "p50_over_engine_ms", "errors",
                                    "server_cpu_us_per_request", "tax_us_per_request", "tax_same_graph_us",
                                    "engine_step_over_engine_us", "outside_engine_step_us",
                                    "client_cpu_us_per_request", "loadavg"],
                           ["model", "instances", "conc.", "req/s", "x engine (best batch)", "x vanilla", "p50 ms",
                            "p99 ms", "p50 - engine's (ms)", "errors", "server CPU us/req", "tax us/req",
                            "tax vs the same graph alone",
                            "of which the engine's step - engine", "of which outside the engine's step",
                            "load generator CPU us/req", "load average (before, after)"])
    text += "\n## CPU microseconds per request by process\n\n"
    text += markdown_table(served, ["ensemble", "cpu_instances", "concurrency", *(f"us:{p}" for p in steps)],
                           ["model", "instances", "conc.", *steps])
    ceilinged = [p for p in steps if any(r[f"ceiling:{p}"] for r in served)]
    text += (f"\n## Ceiling each process puts on a {config.cores}-core host (req/s; tritonserver on every core; the "
             "fused steps run the engine, bounded by it, not by one thread)\n\n")
    text += markdown_table(served, ["ensemble", "cpu_instances", "concurrency", *(f"ceiling:{p}" for p in ceilinged)],
                           ["model", "instances", "conc.", *ceilinged])
    for r in served:
        for p in steps:
            r.pop(f"us:{p}"), r.pop(f"ceiling:{p}")
        r.pop("ensemble")
    write_text(out / "tax.md", text)
    fig, (left, right) = new_figure(11, 4.5, ncols=2)
    for key in sorted({(r["model"], r["tasks_in_flight"], r["cpu_instances"]) for r in served}):
        rows = [r for r in served
                if (r["model"], r["tasks_in_flight"], r["cpu_instances"]) == key and not r["token_ids"]]
        if rows:
            x = [r["concurrency"] for r in rows]
            style = dict(marker="o", linestyle="-" if key[2] == 1 else "--", label=_label(rows[0]))
            left.plot(x, [r["throughput_rps"] for r in rows], **style)
            right.plot(x, [r["tax_us_per_request"] for r in rows], **style)
    best = max(e["throughput_rps"] for e in engine if e["graph"] == "vanilla")
    left.axhline(best, color="k", linewidth=0.8, label="engine alone (vanilla graph), best batch")
    for ax, title, unit in ((left, "Throughput", "requests / s"), (right, "Serving tax", "CPU us / request")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=7)
    save_figure(fig, out / "tax.png")
