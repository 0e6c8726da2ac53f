"""`aot bench overhead | serve | accuracy`."""

from __future__ import annotations

import argparse
import json

from aot.cli import _positive_int, command


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


@command
def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: inference overhead, serving, accuracy sweep")
    kinds = p.add_subparsers(dest="bench_command", required=True, metavar="WHAT")

    a = kinds.add_parser("accuracy", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         help="sweep methods over a small grid from the paper's Table 2, then retrain over seeds",
                         description="For each dataset and method: train every grid point (seed 0), pick the best on "
                                     "dev, retrain it with --seeds seeds, report test median ± std. Results are "
                                     "written per run (atomically); a rerun skips finished runs.")
    a.add_argument("--model", required=True, help="local model folder or 'minilm'")
    a.add_argument("--data", required=True, type=_names, help="comma-separated datasets (built-in names or folders)")
    a.add_argument("--methods", type=_names, default=_names("fc,kron,bitfit,lora,prefix,prompt,adapter,full"))
    a.add_argument("--seeds", type=_positive_int, default=3, help="seeds for the best setting of each method")
    a.add_argument("--grid", choices=["small", "paper"], default="small", help="hyperparameter grid")
    a.add_argument("--out", required=True, help="output folder (accuracy.json, accuracy.md, accuracy.png, runs/)")
    a.add_argument("--max-train-samples", type=_positive_int, default=None, help="seeded train subset per dataset")
    a.add_argument("--max-length", type=_positive_int, default=128)
    a.add_argument("--epochs", type=_positive_int, default=3)
    a.add_argument("--patience", type=_positive_int, default=3)
    a.add_argument("--eval-every", type=int, default=0)
    a.add_argument("--workers", type=_positive_int, default=1, help="parallel training processes")
    a.add_argument("--no-progress", action="store_true")
    a.set_defaults(run=run_accuracy)


def run_accuracy(args) -> int:
    from benchmarks.accuracy import SweepConfig, run_sweep

    config = SweepConfig(model=args.model, datasets=args.data, methods=args.methods, seeds=args.seeds,
                         grid=args.grid, out=args.out, max_train_samples=args.max_train_samples,
                         max_length=args.max_length, epochs=args.epochs, patience=args.patience,
                         eval_every=args.eval_every, workers=args.workers, progress=not args.no_progress)
    print(json.dumps(run_sweep(config)))
    return 0
