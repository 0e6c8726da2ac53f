"""`aot bench gpu-perf`: the GPU check's perf stage (scripts/gpu-check.sh perf): per model shape, the engine alone and
served under perf_analyzer, against issue 52's targets.

    perf          the run: the shapes and their windows, most important first, under a deadline
    shape         what a shape serves: its repository, its task pool, its texts
    server        `aot serve` as a user starts it, its metrics and /ready
    load          perf_analyzer (or its stand-in), its windows, GPU utilisation
    step_profile  py-spy of one step instance through a window
    report        targets, failures, perf.json / perf.md
"""
