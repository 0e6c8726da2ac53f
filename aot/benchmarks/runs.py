"""What each `aot bench` command runs: its parsed arguments turned into its bench's config, the bench run, its
summary printed as one JSON line (aot.benchmarks.cli holds the parsers). Each bench is imported when its command
runs."""

from __future__ import annotations

import json
import sys


def run_tasks(args) -> int:
    if args.scale:
        from aot.benchmarks.tasks.scale import ScaleBenchConfig, run_scale_bench

        config = ScaleBenchConfig(args.task, args.out, tuple(args.counts), args.requests,
                                  args.warmup or args.requests, args.concurrency, repeats=args.repeats)
        print(json.dumps(run_scale_bench(config, progress=not args.no_progress)))
        return 0
    from aot.benchmarks.tasks.modes import MODES, POPULARITIES, TasksBenchConfig, run_tasks_bench

    for value, known, flag in ((args.popularity, POPULARITIES, "--popularity"), (args.modes, MODES, "--modes")):
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"{flag}: unknown {unknown}; expected some of {', '.join(known)}")
    config = TasksBenchConfig(args.task, args.out, tuple(args.counts), tuple(args.popularity), args.pool_bytes,
                              args.concurrency, args.requests, tuple(args.modes),
                              policy_requests=args.policy_requests, repeats=args.repeats)
    print(json.dumps(run_tasks_bench(config, progress=not args.no_progress)))
    return 0


def run_kinds(args) -> int:
    from aot.benchmarks.served.kinds import KindsBenchConfig, run_kinds_bench

    config = KindsBenchConfig(out=args.out, model=args.model, requests=args.requests, concurrency=args.concurrency,
                              repeats=args.repeats, max_length=args.max_length, check=args.check)
    print(json.dumps(run_kinds_bench(config, progress=not args.no_progress)))
    return 0


def run_tax(args) -> int:
    if args.engine == "torch":
        from aot.benchmarks.tax.torch_engine import TorchTaxConfig, run_torch_tax

        config = TorchTaxConfig(out=args.out, task=args.task, repo=args.repo,
                                texts_per_request=tuple(args.texts_per_request),
                                concurrency=tuple(args.concurrency or (8, 32)), texts=args.texts,
                                min_requests=args.min_requests,
                                clients=tuple(args.clients),
                                probes=not args.no_probes)
        print(json.dumps(run_torch_tax(config, progress=not args.no_progress)))
        return 0
    from aot.benchmarks.tax.onnx_engine import TaxBenchConfig, run_tax_bench

    if args.task is None:
        raise ValueError("--task is required with --engine onnx: the AoT task whose encoder the repository serves")
    config = TaxBenchConfig(task=args.task, out=args.out, repo=args.repo,
                            concurrency=tuple(args.concurrency or (1, 8, 32)),
                            requests=args.requests, batches=tuple(args.batch), cores=args.cores,
                            cpu_instances=tuple(args.cpu_instances), precision=args.precision)
    print(json.dumps(run_tax_bench(config, progress=not args.no_progress)))
    return 0


def run_gpu_perf(args) -> int:
    from aot.benchmarks.gpu.perf import GpuPerfConfig
    from aot.benchmarks.gpu.perf import run_gpu_perf as run

    shapes = []
    for shape in args.shape:
        name, sep, task = shape.partition("=")
        if not (sep and name and task):
            raise ValueError(f"--shape {shape!r}: expected NAME=TASK (a name and an AoT task folder)")
        shapes.append((name, task))
    config = GpuPerfConfig(shapes=shapes, out=args.out, device=args.device, perf_analyzer=args.perf_analyzer,
                           concurrency=tuple(args.concurrency), texts_per_request=tuple(args.texts_per_request),
                           max_batch_size=args.max_batch_size, seq=args.seq, interval_ms=args.measurement_interval,
                           stand_in_requests=args.stand_in_requests, engine_batch=args.engine_batch,
                           engine_repeats=args.engine_repeats, deadline=args.deadline, notes=args.note,
                           work=args.work, gpu_instances=args.gpu_instances, py_spy=args.py_spy,
                           profile_window=args.profile_window)
    result = run(config)
    print(json.dumps({"out": args.out, "failures": result["failures"],
                      "targets_met": sum(t["met"] is True for t in result["targets"]),
                      "targets_missed": sum(t["met"] is False for t in result["targets"]),
                      "targets_not_measured": sum(t["met"] is None for t in result["targets"])}))
    for failure in result["failures"]:
        print(f"aot: gpu-perf FAILED: {failure}", file=sys.stderr)
    return 1 if result["failures"] else 0


def run_overhead(args) -> int:
    from aot.benchmarks.overhead.comparison import METHODS, OverheadConfig
    from aot.benchmarks.overhead.comparison import run_overhead as run

    config = OverheadConfig(models=args.models, batches=args.batch, seqs=args.seq,
                            methods=args.methods or list(METHODS), engine=args.engine, device=args.device,
                            cuda_graphs=args.cuda_graphs, rank=args.rank, adapter_rank=args.adapter_rank,
                            prompt_length=args.prompt_length, warmup=args.warmup, repeats=args.repeats,
                            out=args.out, dtype=args.dtype, precision=args.precision,
                            threads=args.threads)
    print(json.dumps(run(config, progress=not args.no_progress)))
    return 0


def run_serve(args) -> int:
    from aot.benchmarks.served.serve import ServeBenchConfig, run_serve_bench

    config = ServeBenchConfig(task=args.task, out=args.out, repo=args.repo, task_counts=tuple(args.tasks),
                              concurrency=tuple(args.concurrency), storages=tuple(args.storage),
                              requests=args.requests, engine=args.engine, device=args.device,
                              pool_bytes=args.pool_bytes, precisions=tuple(args.precision),
                              rounds=args.rounds)
    print(json.dumps(run_serve_bench(config, progress=not args.no_progress)))
    return 0


def run_accuracy(args) -> int:
    from aot.benchmarks.accuracy.sweep import SweepConfig, run_sweep

    config = SweepConfig(model=args.model, datasets=args.data, methods=args.methods, seeds=args.seeds,
                         grid=args.grid, out=args.out, max_train_samples=args.max_train_samples,
                         max_length=args.max_length, epochs=args.epochs, patience=args.patience,
                         eval_every=args.eval_every, budget=args.budget, steps=args.steps, pooling=args.pooling,
                         workers=args.workers,
                         progress=not args.no_progress)
    print(json.dumps(run_sweep(config)))
    return 0


def run_infinity(args) -> int:
    from aot.benchmarks.served.infinity import InfinityBenchConfig, run_infinity_bench

    config = InfinityBenchConfig(args.task, args.out, args.infinity, tuple(args.precision), tuple(args.concurrency),
                                 args.requests)
    print(json.dumps(run_infinity_bench(config, progress=not args.no_progress)))
    return 0


def run_hardening(args) -> int:
    from aot.benchmarks.tasks.hardening import HardeningBenchConfig, run_hardening_bench

    config = HardeningBenchConfig(task=args.task, out=args.out, counts=tuple(args.counts), pause_s=args.pause_s)
    print(json.dumps(run_hardening_bench(config, progress=not args.no_progress)))
    return 0


def run_s3(args) -> int:
    from aot.benchmarks.tasks.s3_store import S3BenchConfig, run_s3_bench

    if args.tasks < 100:
        raise ValueError(f"--tasks {args.tasks}: expected at least 100 (the cold requests draw from the tasks beyond "
                         "the 8 hot ones)")
    config = S3BenchConfig(args.task, args.out, tasks=args.tasks, requests=args.requests,
                           concurrency=args.concurrency, pause_s=args.pause)
    print(json.dumps(run_s3_bench(config, progress=not args.no_progress)))
    return 0
