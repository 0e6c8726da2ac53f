"""`aot bench gpu-perf`: the perf stage of scripts/gpu-check.sh, sized for one call of the lent GPU machine.

For each model shape (an AoT task trained on a random encoder of that shape), in order:

    engine alone  `aot bench overhead` at the served max batch (CUDA graphs on a GPU): vanilla's and AoT's seq/s
    served        the repository `aot export backbone --format torch --max-batch-size N` writes, 8 copies of the
                  task published (aot-0 ... aot-7), `aot serve --device D --vanilla` on it; then windows of
                  vanilla, AoT with 1 task and AoT with the 8 mixed, at each concurrency, with 1-text and N-text
                  requests (load: perf_analyzer, or the rehearsal's stand-in; a window of long requests
                  measured over a longer interval), the GPU's utilisation sampled through each; on the first shape,
                  py-spy of one instance of the step through one window (step_profile)
    afterwards    aot_engine_eager_batches_total from /metrics (before and after the windows), /ready's warnings,
                  served answers against `aot predict` on a few texts

Served texts are Rotten Tomatoes reviews that pad to the same bucket as the engine alone's sequence (--seq), so
that served texts/s and the engine's seq/s count the same work. Windows run most important first (what issue 52's
targets read), and an earlier shape's less important ones only while they leave the later shapes' target windows
their time; with a --deadline, a window or a shape that would not end before it is skipped and named in the report. Results: gpu.report (perf.json, perf.md under --out, rewritten after every window).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from aot.benchmarks.gpu.load import (
    MAX_TRIALS,
    PERF_ANALYZER,
    RATE_GUESS,
    STAND_IN,
    LoadError,
    UtilisationSampler,
    Window,
    interval_ms,
    perf_analyzer_command,
    run_perf_analyzer,
    run_stand_in,
    write_input_data,
)
from aot.benchmarks.gpu.report import P50_SHAPES, RATIO_CONCURRENCIES, write_reports
from aot.benchmarks.gpu.server import Served, metric_sum
from aot.benchmarks.gpu.shape import TASKS, bucket_texts, build_repository, describe, pool_bytes
from aot.benchmarks.gpu.step_profile import PROFILE_WINDOW, StepProfile

MODELS = ("vanilla", "aot-1", "aot-8")
PARITY_TEXTS = 8
WARM_UP, WARM_UP_CONCURRENCY = 16, 8  # requests of 8 texts (one per task) before the windows
SET_UP_PARTS = ("engine alone", "export", "serve start", "warm-up")  # a shape's time before its windows
RESERVE_S = 25.0  # after a shape's last window: metrics, parity, stopping the server, the reports
WINDOW_TIMEOUT_S = 120.0
PUBLISH_WAIT_S = 1.3  # longer than a step's metrics interval (StepMetrics.FLUSH_SECONDS)


@dataclass
class GpuPerfConfig:
    shapes: list[tuple[str, str]]  # (name, task artifact trained on the shape's encoder), measured in order
    out: str
    device: str = "cuda"
    perf_analyzer: str | None = None  # None: the stand-in load (the CPU rehearsal)
    concurrency: tuple[int, ...] = (1, 32, 256)
    texts_per_request: tuple[int, ...] = (1, 64)
    max_batch_size: int = 128
    seq: int = 64
    interval_ms: int = 1500
    stand_in_requests: int = 8
    engine_batch: int | None = None  # None: max_batch_size
    engine_repeats: int = 20
    deadline: float | None = None  # Unix time
    notes: list[str] = field(default_factory=list)
    work: str | None = None  # the repositories (GBs: never among the results); None: a temporary folder
    gpu_instances: int | None = None  # the served step's instances on the GPU; None: the export's default
    py_spy: str | None = None  # py-spy's binary: one instance of the step profiled through profile_window
    profile_window: str = PROFILE_WINDOW  # on the first shape


def priority(window: Window, shape: str) -> int:
    """0: what a target reads (vanilla and AoT 8 mixed at c=32 and 256; at c=1 with single texts where the p50
    target applies); 1: AoT with one task there; 2: the rest (c=1 rows no target reads)."""
    at_target = window.concurrency in RATIO_CONCURRENCIES or (
        window.concurrency == 1 and window.texts == 1 and shape in P50_SHAPES)
    if not at_target:
        return 2
    return 1 if window.model == "aot-1" else 0


def windows_in_order(shape: str, concurrency: tuple[int, ...], texts: tuple[int, ...]) -> list[Window]:
    """Every window, most important first; within a priority the three models side by side."""
    every = [Window(m, t, c) for t in texts for c in concurrency for m in MODELS]
    return sorted(every, key=lambda w: (priority(w, shape), w.texts, w.concurrency, MODELS.index(w.model)))


class Budget:
    """The deadline and what windows have taken so far, in seconds per second of perf_analyzer's window (per
    request size: a 64-text window drains longer), so that a longer window is foreseen as longer."""

    def __init__(self, deadline: float | None, first_guess: float, interval_ms: int):
        self.deadline, self.first_guess, self.interval_ms = deadline, first_guess, interval_ms
        self.taken: dict[int, float] = {}  # texts a request -> seconds taken per second of window

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def estimate(self, window: Window, interval: int | None = None) -> float:
        guess = self.first_guess * 1000 / self.interval_ms
        return self.taken.get(window.texts, max(self.taken.values(), default=guess)) * (
            interval or self.interval_ms) / 1000

    def record(self, window: Window, seconds: float, interval: int | None = None) -> None:
        per = seconds * 1000 / (interval or self.interval_ms)
        self.taken[window.texts] = max(per, self.taken.get(window.texts, 0.0))

    def fits(self, seconds: float) -> bool:
        return seconds + RESERVE_S <= self.left()


def kept_for_later(later: list[str], set_up_s: float, budget: Budget, concurrency: tuple[int, ...],
                   texts: tuple[int, ...], interval_of) -> float:
    """What the `later` shapes' target windows need, their set-up included (guessed at twice `set_up_s`, the
    current shape's: the later ones are the larger): the current shape's less important windows leave it to them.
    `interval_of(window)`: the window's length in ms before anything of its shape was measured."""
    return sum(2 * set_up_s + RESERVE_S + sum(budget.estimate(w, interval_of(w))
                                              for w in windows_in_order(name, concurrency, texts)
                                              if priority(w, name) == 0)
               for name in later)


def _log(message: str) -> None:
    print(f"== gpu-perf: {message}", file=sys.stderr, flush=True)


def engine_alone(model_dir: Path, config: GpuPerfConfig, out: Path) -> dict:
    """`aot bench overhead` in this process at the served max batch: vanilla's and AoT's (fused table resident)
    median time per batch and the sequences/s it makes."""
    from aot.benchmarks.overhead.cases import OverheadConfig
    from aot.benchmarks.overhead.comparison import run_overhead

    batch, graphs = config.engine_batch or config.max_batch_size, config.device == "cuda"
    run_overhead(OverheadConfig(models=[str(model_dir)], batches=[batch], seqs=[config.seq],
                                methods=["vanilla", "aot-fused"], device=config.device, cuda_graphs=graphs,
                                repeats=config.engine_repeats, out=str(out)), progress=False)
    records = {r["method"]: r for r in json.loads((out / "overhead.json").read_text())}
    if graphs:
        import torch

        torch.cuda.empty_cache()
    result = {"batch": batch, "seq": config.seq, "cuda_graphs": graphs}
    for key, method in (("vanilla", "vanilla"), ("aot", "aot-fused")):
        ms = records.get(method, {}).get("median_ms")
        result[f"{key}_ms"] = ms
        result[f"{key}_seq_per_s"] = round(batch / ms * 1000, 1) if ms else None
    result["aot_over_vanilla"] = records.get("aot-fused", {}).get("ratio_to_vanilla")
    return result


class ShapeRun:
    """One shape: its engine alone, its server, its windows, what the server says after them."""

    def __init__(self, name: str, task: Path, config: GpuPerfConfig, budget: Budget, result: dict, work: Path,
                 later: list[str], profile: bool = False):
        from aot.training.artifact import read_task

        self.name, self.task, self.config, self.budget, self.result = name, task, config, budget, result
        self.later, self.profile = later, profile  # the shapes measured after this one; py-spy on this one
        self.rates: dict[tuple[str, int], float] = {}  # (model, texts a request) -> the best texts/s measured
        self.model_dir = Path(read_task(task).backbone["model"])
        self.folder, self.repo = Path(config.out) / name, work / f"repo-{name}"
        self.record = {"name": name, "task": str(task), "model": str(self.model_dir),
                       "description": describe(self.model_dir), "engine_alone": None, "windows": [],
                       "eager_batches": None, "ready_warnings": None, "parity": None, "elapsed_s": {}, "skipped": [],
                       "profile": None}
        result["shapes"].append(self.record)

    def part(self, name: str, job):
        """Run `job` as the part `name` of this shape, its time logged and recorded."""
        start = time.monotonic()
        value = job()
        self.record["elapsed_s"][name] = round(time.monotonic() - start, 1)
        _log(f"{self.name}: {name} {self.record['elapsed_s'][name]:.0f} s")
        return value

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.time() - self.result["started_unix"], 1)
        write_reports(self.result, Path(self.config.out))

    def run(self, sampler: UtilisationSampler) -> None:
        from aot.serving.repository import read_repository

        config, repo = self.config, self.repo
        shutil.rmtree(repo, ignore_errors=True)  # a repository a run cut short left
        self.record["engine_alone"] = self.part("engine alone", lambda: engine_alone(
            self.model_dir, config, self.folder / "engine"))
        self.save()
        self.part("export", lambda: build_repository(self.task, repo, config.max_batch_size, config.gpu_instances))
        options = read_repository(repo).options
        self.record["gpu_instances"] = options.gpu_instances
        texts = bucket_texts(self.model_dir, config.seq, options.buckets)
        self.record["texts_note"] = (f"{len(texts)} Rotten Tomatoes reviews that pad to the {config.seq}-token bucket "
                                     "(the engine alone's sequence length)")
        data = {m: write_input_data(self.folder / f"input-{m}.json", texts, list(TASKS[:8 if m == "aot-8" else 1]))
                for m in MODELS}
        server = self.part("serve start", lambda: Served(repo, config.device, pool_bytes(repo, config.device),
                                                         self.folder))
        try:
            self.record["ready_seconds"] = server.info.get("ready_seconds")  # tritonserver's start to ready
            self.part("warm-up", lambda: self.warm_up(server, texts))
            before = self.eager(server)
            self.part("windows", lambda: self.windows(server, sampler, data, texts))
            after = self.eager(server)
            self.record["eager_batches"] = {"measured": None if after is None else int(after - (before or 0)),
                                            "since_start": None if after is None else int(after)}
            self.record["ready_warnings"] = server.ready().get("warnings", [])
            self.record["parity"] = self.part("parity", lambda: self.parity(server, texts[:PARITY_TEXTS]))
        finally:
            self.part("serve stop", server.stop)
            self.save()

    def warm_up(self, server: Served, texts: list[str]) -> None:
        """Every task into each instance's pool before a window counts: requests that each mix all 8, WARM_UP of
        them WARM_UP_CONCURRENCY at a time, so that an instance busy filling its pool leaves the next ones to
        another; and vanilla's instances."""
        from aot.client.client import Client

        mixed = [{"task": TASKS[k % len(TASKS)], "text": texts[k % len(texts)]} for k in range(WARM_UP * len(TASKS))]
        for model, items in (("aot", mixed), ("vanilla", mixed[:len(mixed) // 2])):
            with Client(server.grpc_url, model=model) as client:
                answers = client.infer_many(items, concurrency=WARM_UP_CONCURRENCY, pack=len(TASKS))
                failed = [a["error"] for a in answers if "error" in a]
            if failed:
                raise RuntimeError(f"the warm-up's requests to {model} failed: {failed[0]}")

    def eager(self, server: Served) -> float | None:
        time.sleep(PUBLISH_WAIT_S)
        return metric_sum(server.metrics(), "aot_engine_eager_batches_total")

    def set_up_seconds(self) -> float:
        return sum(self.record["elapsed_s"].get(p, 0.0) for p in SET_UP_PARTS)

    def interval(self, window: Window, rates: dict | None = None) -> int:
        """perf_analyzer's window for `window`, from the best rate measured at its request size on this shape (its
        own model's first), else RATE_GUESS; the stand-in's load ignores it."""
        rates = self.rates if rates is None else rates
        if self.config.perf_analyzer is None:
            return self.config.interval_ms
        same = [r for (model, texts), r in rates.items() if texts == window.texts]
        rate = rates.get((window.model, window.texts)) or max(same, default=RATE_GUESS)
        return interval_ms(window, rate, self.config.interval_ms)

    def windows(self, server: Served, sampler: UtilisationSampler, data: dict[str, Path], texts: list[str]) -> None:
        config = self.config
        for window in windows_in_order(self.name, config.concurrency, config.texts_per_request):
            row = {"model": window.model, "texts": window.texts, "concurrency": window.concurrency,
                   "generator": PERF_ANALYZER if config.perf_analyzer else STAND_IN}
            self.record["windows"].append(row)
            interval = self.interval(window)
            estimate = self.budget.estimate(window, interval)
            kept = 0.0 if priority(window, self.name) == 0 else kept_for_later(
                self.later, self.set_up_seconds(), self.budget, config.concurrency, config.texts_per_request,
                lambda w: self.interval(w, {}))
            if not self.budget.fits(estimate + kept):
                row["skipped"] = (f"~{estimate:.0f} s would pass the deadline ({self.budget.left():.0f} s left)"
                                  if not self.budget.fits(estimate) else
                                  f"~{estimate:.0f} s: {self.budget.left():.0f} s left, ~{kept:.0f} s kept for the "
                                  f"target windows of {', '.join(self.later)}")
                self.record["skipped"].append(f"{window.name} ({row['skipped']})")
                continue
            if config.perf_analyzer:
                row["interval_ms"] = interval
            profile = None
            if self.profile and config.py_spy and window.name == config.profile_window:
                profile = StepProfile(config.py_spy, server.process.pid, self.folder / "py-spy.txt").start()
            start = time.monotonic()
            try:
                row.update(self.measure(server, window, data[window.model], texts, interval))
                key = (window.model, window.texts)
                self.rates[key] = max(row["texts_per_s"], self.rates.get(key, 0.0))
            except LoadError as exc:
                row["error"] = str(exc)[:300]
            end = time.monotonic()
            if profile is not None:
                self.record["profile"] = {"window": window.name, **profile.result()}
            row["seconds"] = round(end - start, 1)
            self.budget.record(window, end - start, interval)
            row.update(sampler.between(start + min(1.0, (end - start) / 4), end))
            util = "-" if row["gpu_util_mean"] is None else f"{row['gpu_util_mean']:.0f} %"
            _log(f"{self.name} {window.name}: " + (f"{row['texts_per_s']:,.0f} texts/s, p50 {row['p50_ms']} ms"
                                                   if "texts_per_s" in row else f"failed: {row['error']}")
                 + f", GPU {util} ({row['seconds']:.0f} s)")
            self.save()

    def measure(self, server: Served, window: Window, data: Path, texts: list[str], interval: int) -> dict:
        config = self.config
        if config.perf_analyzer is None:
            tasks = TASKS[:window.tasks]
            items = [{"task": tasks[k % len(tasks)], "text": t} for k, t in enumerate(texts)]
            return run_stand_in(server.grpc_url, window, items, config.stand_in_requests)
        runs = self.folder / "windows"
        runs.mkdir(parents=True, exist_ok=True)
        command = perf_analyzer_command(config.perf_analyzer, window, server.grpc_url, server.admin_key, data,
                                        runs / f"{window.name}.csv", interval)
        return run_perf_analyzer(command, runs / f"{window.name}.csv", runs / f"{window.name}.log", window.texts,
                                 WINDOW_TIMEOUT_S)

    def parity(self, server: Served, texts: list[str]) -> dict:
        """Served logits of aot-0 against `aot predict`'s (PyTorch, fp32, in this process)."""
        import numpy as np

        from aot.client.client import Client
        from aot.training.predict import Predictor

        with Client(server.grpc_url) as client:
            served = client.infer_many([{"task": TASKS[0], "text": t} for t in texts], pack=len(texts))
        failed = [a["error"] for a in served if "error" in a]
        if failed:
            raise RuntimeError(f"parity: the served requests failed: {failed[0]}")
        got = np.array([a["logits"] for a in served], dtype=np.float64)
        expected = Predictor.load(self.task, device=self.config.device).logits(texts).float().cpu().numpy()
        same = int((got.argmax(-1) == expected.argmax(-1)).sum())
        return {"texts": len(texts), "max_abs_logit_diff": float(np.abs(got - expected).max()),
                "same_label": f"{same}/{len(texts)}"}


def device_name(device: str) -> str:
    if device == "cpu":
        return "CPU rehearsal (no GPU; figures exercise the plumbing, they measure nothing of the targets)"
    import torch

    return f"{torch.cuda.get_device_name(0)} (PyTorch {torch.__version__}, CUDA {torch.version.cuda})"


def run_gpu_perf(config: GpuPerfConfig) -> dict:
    """Every shape in turn under the deadline; the result gpu.report wrote, with its failures."""
    if config.device != "cpu" and config.perf_analyzer is None:
        raise ValueError(f"--device {config.device} measures with perf_analyzer: give --perf-analyzer (the stand-in "
                         "load is for the CPU rehearsal)")
    if config.perf_analyzer is not None and not os.access(config.perf_analyzer, os.X_OK):
        raise ValueError(f"--perf-analyzer {config.perf_analyzer}: not an executable file")
    if config.py_spy is not None and not os.access(config.py_spy, os.X_OK):
        raise ValueError(f"--py-spy {config.py_spy}: not an executable file")
    names = [w.name for w in windows_in_order("", config.concurrency, config.texts_per_request)]
    if config.py_spy is not None and config.profile_window not in names:
        raise ValueError(f"--profile-window {config.profile_window}: not one of the windows ({', '.join(names)})")
    too_large = [t for t in config.texts_per_request if t > config.max_batch_size]
    if too_large:
        raise ValueError(f"--texts-per-request {too_large} exceeds --max-batch-size {config.max_batch_size}")
    generator = PERF_ANALYZER if config.perf_analyzer else STAND_IN
    notes = list(config.notes)
    if config.perf_analyzer is None:
        notes.append(f"{STAND_IN}: {config.stand_in_requests} requests a window, at most that many in flight")
    else:
        notes.append(f"perf_analyzer windows of {config.interval_ms} ms, longer where a request's latency is long "
                     "(each window's interval_ms), synchronous, -b texts a request (each a copy of one entry of the "
                     "input file: one text and one task repeated)")
    result = {"device": config.device, "device_name": device_name(config.device), "generator": generator,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "started_unix": time.time(),
              "elapsed_s": 0.0, "notes": notes, "config": {k: v for k, v in vars(config).items() if k != "notes"},
              "shapes": [], "targets": [], "failures": []}
    first_guess = MAX_TRIALS * config.interval_ms / 1000 + 4 if config.perf_analyzer else 10.0
    budget = Budget(config.deadline, first_guess, config.interval_ms)
    setup_taken: float | None = None
    work = Path(config.work) if config.work else Path(tempfile.mkdtemp(prefix="aot-gpu-perf-"))
    with UtilisationSampler() as sampler:
        for k, (name, task) in enumerate(config.shapes):
            run = ShapeRun(name, Path(task), config, budget, result, work, [n for n, _ in config.shapes[k + 1:]],
                           profile=k == 0)
            needed = 2 * setup_taken + budget.first_guess if setup_taken is not None else 0.0
            if not budget.fits(needed):
                run.record["skipped"].append(f"the whole shape: {budget.left():.0f} s left, ~{needed:.0f} s needed "
                                             "for its set-up and a first window")
                run.save()
                continue
            try:
                run.run(sampler)
            except Exception as exc:  # noqa: BLE001 - a shape that failed is reported; the next one still runs
                run.record["error"] = f"{type(exc).__name__}: {exc}"
                run.save()
            finally:
                shutil.rmtree(run.repo, ignore_errors=True)
            if setup_taken is None:
                setup_taken = run.set_up_seconds()
    if not config.work:
        shutil.rmtree(work, ignore_errors=True)
    return result
