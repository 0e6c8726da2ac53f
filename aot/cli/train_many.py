"""`aot train --tasks MANIFEST --out DIR`: many tasks trained in one job on one frozen encoder (aot.training.job).

The manifest holds JSON lines, one task each: `name` (its artifact's folder under --out), `data`, and any option of
`aot train` by its long name (`max_length` or `max-length`, `option`: ["NAME=VALUE"] or {NAME: VALUE}, `labels`: a
list or "a,b"). The options given on the command line are every task's defaults.
"""

from __future__ import annotations

from pathlib import Path

from aot.cli.arguments import positive_float as _positive_float
from aot.cli.arguments import positive_int as _positive_int
from aot.cli.output import report

# aot train's options that a task may set (aot.training.job_spec.TASK_OPTIONS), by the name of their argument
TASK_DEFAULTS = ("data", "method", "rank", "lr", "head_lr", "warmup", "decay", "batch_size", "epochs", "patience",
                 "eval_every", "max_length", "max_train_samples", "time_budget", "max_steps", "pooling", "seed",
                 "labels", "metric", "problem", "normalize")


def add_job_arguments(p) -> None:
    """The train command's options of a job of many tasks."""
    p.add_argument("--tasks", default=None, metavar="MANIFEST",
                   help="train many tasks in one job on one frozen encoder: a JSON-lines file ('-': standard input), "
                        "one task a line: {\"name\": NAME, \"data\": ..., and any option of aot train by its long name "
                        "(\"max_length\": 64, \"method\": \"kron\", \"option\": [\"activation=gelu\"], ...)}; the options "
                        "given here are every task's defaults. Each task's artifact is written to --out/NAME as aot "
                        "train writes it; a bad task is refused alone (docs/training.md, 'Many tasks in one job')")
    p.add_argument("--resume", action="store_true",
                   help="with --tasks: continue the job recorded in --out (its trained tasks kept, the others from "
                        "their last checkpoint), or start it")
    p.add_argument("--tasks-per-step", type=_positive_int, default=None, metavar="N",
                   help="with --tasks: tasks whose batches share each step of the encoder (default: 4; memory grows "
                        "with it)")
    p.add_argument("--shard", default=None, metavar="INDEX/COUNT",
                   help="with --tasks: train only this share of the tasks (a Kubernetes indexed Job's "
                        "$(JOB_COMPLETION_INDEX)/COUNT); under torchrun the ranks share them out by themselves")
    p.add_argument("--checkpoint-every", type=_positive_float, default=None, metavar="SECONDS",
                   help="with --tasks: checkpoint every running task this often, besides at its evaluations "
                        "(default: 300)")
    p.add_argument("--strict", action="store_true",
                   help="with --tasks: exit 2 when any task was refused or failed (default: only when none trained)")


def check_job_arguments(args) -> None:
    """Refuse the job's options without --tasks, and the re-fitting options with it."""
    if args.tasks is None:
        given = [f for f in ("resume", "tasks_per_step", "shard", "checkpoint_every", "strict") if getattr(args, f)]
        if given:
            raise ValueError(f"{', '.join('--' + g.replace('_', '-') for g in given)} go with --tasks MANIFEST")
    elif args.fit_to or args.task:
        raise ValueError("--tasks trains new tasks; --fit-to and --task re-fit one: give one or the other")


def run_train_many(args) -> int:
    import time

    from aot.serving.formats import json_lines
    from aot.training.job import CHECKPOINT_SECONDS, TASKS_PER_STEP, train_tasks
    from aot.training.job_state import JobFolder
    from aot.training.sharding import parse_shard

    shard = parse_shard(args.shard) if args.shard else None
    try:
        lines = list(json_lines(args.tasks))
    except OSError as exc:
        raise ValueError(f"cannot read the manifest {args.tasks}: {exc.strerror}") from None
    if not lines:
        raise ValueError(f"the manifest {args.tasks} holds no task (expected JSON lines {{\"name\", \"data\", ...}})")
    defaults = {name: getattr(args, name) for name in TASK_DEFAULTS}
    defaults["options"] = args.option
    start = time.perf_counter()
    results = train_tasks(lines, args.out, args.model, resume=args.resume, overwrite=args.overwrite,
                          tasks_per_step=args.tasks_per_step or TASKS_PER_STEP, device=args.device,
                          progress=not args.no_progress, shard=shard,
                          checkpoint_seconds=args.checkpoint_every or CHECKPOINT_SECONDS, **defaults)
    if not results:  # a rank of torchrun other than 0: rank 0 reports the job
        return 0
    counts = {status: sum(r["status"] == status for r in results) for status in ("trained", "kept", "failed",
                                                                                 "refused")}
    good = counts["trained"] + counts["kept"]
    bad = [f"{r['name'] or r['where']} ({r['status']})" for r in results if r["status"] in ("failed", "refused")]
    export = JobFolder(args.out).root / "export.jsonl"
    summary = [f"trained {counts['trained']} of {len(results)} task(s) into {Path(args.out)} in "
               f"{time.perf_counter() - start:.0f} s"
               + (f"; {counts['kept']} kept from an earlier run" if counts["kept"] else "")
               + (f"; not trained: {', '.join(bad)} (their reasons: the JSON lines above)" if bad else "")]
    if good:
        summary.append(f"next: aot export task --repo REPO --batch {export} (every trained task at once)")
    elif bad:
        summary.append("no task trained: fix the reasons above and run again (--resume keeps what trained)")
    report(results, *summary)
    return 2 if not good or (args.strict and bad) else 0
