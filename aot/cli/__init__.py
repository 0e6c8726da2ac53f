"""The `aot` command (entry point aot.cli.main:main): one module per group of subcommands, each a thin layer over
the library below it.

    main        the parser, the subcommands and the plugins (`bench`, from aot.benchmarks), warnings and errors
    arguments   argument types shared by the subcommands: a bad value is named in argparse's one-line error
    output      results as JSON lines on standard output, summaries on standard error; the missing-extra hint
    task        train (and re-fit), predict, evaluate, inspect: over aot.training, imported when a command runs
    train_many  train --tasks: many tasks in one job (its arguments, their checks, the run)
    export      export backbone | task | remove | list | verify | tenant | versions | rollback | route
    serve       serve (a local tritonserver, or a fleet) and tasks; the connection arguments
    infer       infer (the gRPC client: packed requests, one answer line per input; --input: a batch job)
    answer_file where infer --input writes its answers as they come (whole lines), and what --resume reads back
    batch_report infer's one-line summary of a run and its exit code; --top-k on streamed answers
    ranking     --top-k of predict and infer: a classification answer's K most probable labels
"""
