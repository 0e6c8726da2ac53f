"""`aot bench`: the measurements behind docs/benchmarks.md, each side by side in one run (a plugin of `aot`).

In rooms by what they measure, top to bottom (each imports only those below it: pyproject.toml
[tool.importlinter], tests/test_imports.py):

    cli         the `aot bench` subcommands (their parsers); runs: what each runs (each bench imported when run)
    gpu         the GPU check's perf stage (scripts/gpu-check.sh perf) against issue 52's targets
    tax         the serving tax: CPU per request beyond the engine's, with the ONNX engine and with the torch one
    tasks       serving against the number of tasks: three ways of serving them, ever more tasks as `aot serve`
                runs them, the task store in object storage, a store's failures (issue 46's hardening)
    served      end to end through the real local tritonserver (`aot bench serve` and its closed loop), tasks of
                mixed kinds, `aot serve` against Infinity, the local fleet
    overhead    the paper's inference-overhead comparison: the methods' engines alone, no server
    accuracy    the paper's accuracy protocol, and what an int8 backbone costs each task
    train       one job of many tasks (`aot train --tasks`) against one `aot train` per task
    report      JSON records, Markdown tables and plots (every room writes its reports through it)
    encoders    random-weight encoders of a chosen shape with a real tokenizer (the negligible one, base)

    python_api  figures of the Python API, run by hand (`python -m aot.benchmarks.python_api`), beside the rest
"""
