"""`aot bench`: the measurements behind docs/benchmarks.md, each side by side in one run (a plugin of `aot`).

    cli                 the `aot bench` subcommands (their parsers); runs: what each runs
    overhead            the paper's inference-overhead comparison; overhead_cases (shared), overhead_torch and
                        overhead_onnxruntime (its two engines)
    serve               end to end through the real local tritonserver
    tax                 the serving tax: CPU per request beyond the engine's; tax_torch: the GPU configs' path
                        (the torch engine's fused step) on this CPU
    gpu_perf            the GPU check's perf stage (scripts/gpu-check.sh perf): per model shape, the engine alone and
                        served under perf_analyzer against issue 45's targets; gpu_perf_load (perf_analyzer, its
                        stand-in, GPU utilisation), gpu_perf_report (targets, failures, perf.json / perf.md),
                        gpu_perf_server (`aot serve` as a user starts it, its metrics and /ready)
    tasks               serving against the number of tasks; scale: ever more tasks, as `aot serve` runs them
                        (scale_cold: its cold first requests; scale_report: its reports; version_policies: the
                        host's version cache policy against LRU, replayed)
    kinds               tasks of mixed kinds against classifiers
    accuracy            the paper's accuracy protocol; accuracy_plan (its grids and runs), accuracy_report
    int8_accuracy       what int8 costs each task; int8_data (its data sets)
    infinity            `aot serve` against Infinity
    s3_store            the task store in object storage against the file system
    hardening           issue 46's figures: a hung store, unknown tasks, a damaged shard, a large change
    fleet               the local fleet's figures
    python_api          figures of the Python API
    report              JSON records, Markdown tables and plots
"""
