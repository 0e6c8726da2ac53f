"""The task commands of `aot`: train (and re-fit), predict, evaluate and inspect, each a thin layer over the
training library (imported when a command runs: a client-only install still lists them and says what to install)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aot.cli.arguments import fraction as _fraction
from aot.cli.arguments import positive_float as _positive_float
from aot.cli.arguments import positive_int as _positive_int
from aot.cli.output import example_texts, report
from aot.cli.train_many import add_job_arguments, check_job_arguments, run_train_many
from aot.serving.protocol import POOLINGS

# --- train --------------------------------------------------------------------------------------------------------

def add_train(sub) -> None:
    """`aot train`: its arguments name the registered methods and their options, which imports every method (torch):
    they are added when `aot train` itself is parsed (aot.cli.arguments.Parser's populate), so that no other command
    pays for it. A client-only install is told what to install (main's ImportError)."""
    sub.add_parser("train", help="train a task on a frozen encoder and write a task artifact",
                   description="Train one task with AoT P-Tuning (fc, kron) or a baseline and write the task "
                               "artifact (config.json, weights.safetensors, metrics.json) atomically to --out; or, "
                               "with --tasks MANIFEST, many AoT tasks in one job on one frozen encoder, their batches "
                               "sharing passes of it, each task's artifact in --out/NAME.",
                   populate=_train_arguments)


def _train_arguments(p) -> None:
    from aot.training.data import PROBLEMS
    from aot.training.method_registry import METHODS, option_types

    p.add_argument("--model", default=None,
                   help="local Hugging Face model folder, 'minilm' (the packaged all-MiniLM-L6-v2), or a hub id")
    p.add_argument("--data", default=None,
                   help="built-in dataset (rotten_tomatoes, bbc_news; wnut16: tokens; bbc_multilabel; bbc_retrieval: "
                        "embedding) or a folder: train/dev[/test] .jsonl/.csv/.tsv with columns text[, text_pair], "
                        "label (labels: multilabel; text_pair[, score]: embedding), or CoNLL .conll/.txt/.tsv "
                        "(word<TAB>tag) or .jsonl {tokens, tags} (tokens); or a GLUE (TSV) / SuperGLUE (JSONL) task "
                        "folder")
    p.add_argument("--method", default=None, choices=list(METHODS),
                   help="default fc; " + "; ".join(f"{n}: {s.description}" for n, s in METHODS.items()))
    p.add_argument("--out", required=True,
                   help="artifact folder to write (atomically); with --tasks, the folder of every task's (--out/NAME)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it already holds something; with --tasks, start the job again, replacing "
                        "its tasks' artifacts")
    p.add_argument("--rank", type=_positive_int, default=None,
                   help="fc/kron/lora rank, adapter bottleneck, or prefix/prompt length p (default: the method's)")
    p.add_argument("--option", action="append", default=None, metavar="NAME=VALUE",
                   help="set one of the method's hyperparameters (repeatable); "
                        + "; ".join(f"{n}: {', '.join(option_types(n))}" for n in METHODS if option_types(n))
                        + " (docs/training.md, 'Methods')")
    p.add_argument("--lr", type=_positive_float, default=None, help="learning rate (default: the method's)")
    p.add_argument("--head-lr", type=_positive_float, default=None,
                   help="the task head's learning rate (default: --lr)")
    p.add_argument("--warmup", type=_fraction, default=0.1,
                   help="fraction of the planned steps over which the rate rises linearly from 0")
    p.add_argument("--decay", choices=["linear", "constant"], default="linear",
                   help="linear: down towards 0 over the planned steps (--max-steps, else --epochs); constant: "
                        "the paper's schedule (with --warmup 0)")
    p.add_argument("--batch-size", type=_positive_int, default=16, help="examples per optimizer step")
    p.add_argument("--epochs", type=_positive_int, default=10, help="passes over the train split at most")
    p.add_argument("--patience", type=_positive_int, default=3,
                   help="stop after this many evaluations without a better dev score")
    p.add_argument("--eval-every", type=int, default=0, help="steps between dev evaluations (0: once per epoch)")
    p.add_argument("--max-length", type=_positive_int, default=128, help="tokens per input (longer ones are truncated)")
    p.add_argument("--max-train-samples", type=_positive_int, default=None, help="train on a seeded random subset")
    p.add_argument("--time-budget", type=_positive_float, default=None,
                   help="seconds; stop at the first evaluation after this much training")
    p.add_argument("--max-steps", type=_positive_int, default=None,
                   help="stop after this many optimizer steps (evaluated there), whatever --epochs allows")
    p.add_argument("--pooling", choices=POOLINGS, default=None,
                   help="what the head reads: the first token's state (cls) or the mean over the tokens (mean); "
                        "default: what a local model folder declares (a sentence-transformers folder's 1_Pooling, "
                        "e.g. mean for minilm), cls otherwise (hub ids included)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialization, dropout and batch order")
    p.add_argument("--labels", default=None, help="comma-separated label set (plain folders without task.json)")
    p.add_argument("--metric", default=None,
                   help="accuracy, f1, acc_f1, mcc or pearson_spearman; micro_f1 or macro_f1 (multilabel); "
                        "entity_f1 (tokens); recall@1, recall@5, recall@10 or spearman (embedding); default: the "
                        "problem's first (spearman for scored pairs)")
    p.add_argument("--problem", choices=PROBLEMS, default=None,
                   help="regression: one score per input (labels are numbers); multilabel: several labels per text "
                        "(sigmoids, a threshold tuned on dev); tokens: BIO tags per word, answered as entities; "
                        "embedding: a vector per text, trained on pairs (in-batch negatives, or a cosine loss on "
                        "scored pairs); default: what task.json declares, else classification")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="embedding: answer unit vectors (the cosine is then a dot product)")
    p.add_argument("--device", default="auto", help="cpu, cuda (cuda:N), or auto: CUDA where PyTorch sees it")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--fit-to", default=None, metavar="REPO",
                   help="re-fit the task --task to REPO's int8 backbone (aot export backbone --precision int8): "
                        "continue its training (its own model, data and method; --model, --data and --method are not "
                        "given) with the encoder computing as the int8 graph does, then export it as usual; "
                        f"default {FIT_STEPS} steps (--max-steps), evaluated every {FIT_EVAL_EVERY} (--eval-every)")
    p.add_argument("--task", default=None, metavar="DIR", help="with --fit-to: the trained task artifact to re-fit")
    add_job_arguments(p)
    p.set_defaults(run=run_train)


FIT_STEPS, FIT_EVAL_EVERY = 300, 50  # re-fitting: a few hundred steps of P against the int8 backbone


def run_train(args) -> int:
    from aot.training.api import train_task
    from aot.training.artifact import read_task
    from aot.training.method_registry import method_spec, parse_options

    check_job_arguments(args)
    if args.tasks is not None:
        return run_train_many(args)
    out = Path(args.out)
    if not args.overwrite and (out.is_file() or (out.is_dir() and any(out.iterdir()))):
        raise ValueError(f"--out {out} already exists; pass --overwrite to replace it")
    if args.fit_to or args.task:
        return run_fit(args)
    args.method = args.method or "fc"
    missing = [flag for flag in ("model", "data") if getattr(args, flag) is None]
    if missing:
        raise ValueError(f"the following arguments are required: {', '.join('--' + m for m in missing)} (or "
                         "--fit-to REPO --task DIR to re-fit a trained task)")
    result = train_task(model=args.model, data=args.data, method=args.method, out=args.out, rank=args.rank,
                        options=parse_options(args.method, args.option or []),
                        lr=args.lr, head_lr=args.head_lr, warmup=args.warmup, decay=args.decay,
                        batch_size=args.batch_size, epochs=args.epochs, patience=args.patience,
                        eval_every=args.eval_every, max_length=args.max_length,
                        max_train_samples=args.max_train_samples, time_budget=args.time_budget,
                        max_steps=args.max_steps, pooling=args.pooling, seed=args.seed,
                        labels=args.labels.split(",") if args.labels else None, metric=args.metric,
                        device=args.device, progress=not args.no_progress, problem=args.problem,
                        normalize=args.normalize)
    served = method_spec(args.method).shared_backbone
    texts = example_texts(read_task(out).spec.has_pair)
    report(result, f"trained {result['task']} ({args.method}) into {out}: dev {result['metric']} "
                   f"{result['dev']:.4f} after {result['steps']} steps, {result['train_seconds']:.0f} s",
           f'next: aot predict --task {out} {texts}; aot evaluate --task {out} FILE'
           + (f"; aot export task --task {out} --repo REPO --name NAME" if served else
              f" (a {args.method} task runs in PyTorch only: aot export task takes fc and kron)"))
    return 0


def run_fit(args) -> int:
    from aot.training.refit import fit_task
    from aot.training.trainer import TrainConfig

    if not (args.fit_to and args.task):
        raise ValueError("--fit-to REPO and --task DIR go together: the task to re-fit and the int8 repository")
    given = [flag for flag in ("model", "data", "method", "rank", "option", "pooling", "labels", "metric", "problem")
             if getattr(args, flag) is not None]
    if given:
        raise ValueError("--fit-to continues the task with its own settings: drop "
                         f"{', '.join('--' + g for g in given)}")
    config = TrainConfig(lr=args.lr or 1e-3, head_lr=args.head_lr, warmup=args.warmup, decay=args.decay,
                         batch_size=args.batch_size, epochs=args.epochs, patience=args.patience,
                         seed=args.seed, eval_every=args.eval_every or FIT_EVAL_EVERY,
                         max_train_samples=args.max_train_samples, time_budget=args.time_budget,
                         max_steps=args.max_steps or FIT_STEPS, device=args.device)
    result = fit_task(args.task, args.fit_to, args.out, config, progress=not args.no_progress)
    report(result, f"fitted {result['task']} to the int8 backbone of {args.fit_to} into {args.out}: dev "
                   f"{result['metric']} through int8 (emulated) {result['int8_dev_before_fit']:.4f} -> "
                   f"{result['int8_dev']:.4f} (fp32 task {result['fp32_dev_before_fit']:.4f})",
           f"next: aot export task --task {args.out} --repo {args.fit_to} --name NAME")
    return 0


# --- predict / inspect ----------------------------------------------------------------------------------------------

PREDICT_DESCRIPTION = """\
Prints one JSON line per input, in order: the task and the answer of its kind: {"task", "label", "logits",
"probabilities"} (softmax of the logits) for classification, {"task", "score"} for regression, {"task", "labels",
"scores"} for multilabel, {"task", "entities": [{"text", "label", "start", "end", "score"}]} for tokens (character
offsets into the text, split into words on whitespace), {"task", "embedding"} for an embedding. With --top-k K, a
classification answers {"task", "label", "top": [{"label", "probability"}, ...]}: the K most probable labels, named,
in place of the logits and probabilities. TEXT arguments run on the one --task. --input FILE (or - for standard
input) reads JSON lines {"text", "text_pair" (optional), "task" (optional when one --task is given), "id"
(optional, echoed)}: each line runs on its own task, and lines of different AoT tasks share batches on one encoder
whatever their kinds (MultiTaskModel). A bad line fails alone: "aot: line N: ..." on stderr, the others are
answered; a count of the failed lines ends stderr, and the exit status is 2 only when every line failed."""


def add_predict(sub) -> None:
    p = sub.add_parser("predict", help="run trained tasks in PyTorch; one JSON line per input",
                       description=PREDICT_DESCRIPTION)
    p.add_argument("--task", action="append", required=True, metavar="[NAME=]DIR",
                   help="task artifact folder (repeatable); --input lines name it NAME (default: the folder's name)")
    p.add_argument("--input", default=None, metavar="FILE",
                   help="JSON lines to score ('-': standard input) instead of TEXT arguments")
    p.add_argument("--pair", default=None, help="second text, paired with every TEXT (pair tasks)")
    p.add_argument("--model", default=None, help="backbone location, if it moved since training")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="inputs per forward pass")
    p.add_argument("--repo", default=None, metavar="REPO",
                   help="answer through REPO's CPU engine in this process instead of PyTorch: its graph (int8 in a "
                        "repository exported with --precision int8, as served), the task's rows and head (AoT tasks)")
    p.add_argument("--top-k", type=_positive_int, default=None, metavar="K",
                   help="answer the K most probable labels by name ({\"top\": [{\"label\", \"probability\"}, "
                        "...]}) instead of every logit and probability")
    p.add_argument("--device", default="auto", help="cpu, cuda (cuda:N), or auto: CUDA where PyTorch sees it")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar of --input")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to answer with the one --task, one JSON line each")
    p.set_defaults(run=run_predict)


def run_predict(args) -> int:
    from tqdm.auto import tqdm

    from aot.training.predict import predict_lines, read_input_lines, task_folders, text_lines
    from aot.training.trainer import check_device, resolve_device

    check_device(args.device)
    tasks = task_folders(args.task)
    if bool(args.texts) == bool(args.input):
        raise ValueError("give TEXT arguments or --input FILE (one of them)")
    if args.texts:
        if len(tasks) != 1:
            raise ValueError(f"TEXT arguments run on one --task, got {len(tasks)}: use --input for several")
        parsed, errors = text_lines(args.texts, args.pair, tasks)
    else:
        if args.pair is not None:
            raise ValueError("--pair applies to TEXT arguments; in --input lines, give text_pair")
        parsed, errors = read_input_lines(args.input, tasks)
    bar = tqdm(total=len(parsed), disable=args.no_progress or not args.input, unit="line", desc="predict")
    if args.repo is None:
        answers = predict_lines(tasks, parsed, args.model, args.batch_size, str(resolve_device(args.device)),
                                bar.update)
    else:
        from aot.exporter.cpu_engine import predict_lines_through

        answers = predict_lines_through(args.repo, tasks, parsed)
        bar.update(len(parsed))
    bar.close()
    if args.top_k is not None:
        answers = _top_k(answers, tasks, args.top_k)
    for _, answer in sorted(answers.items()):
        print(json.dumps(answer, ensure_ascii=False))
    for number, message in sorted(errors):
        print(f"aot: line {number}: {message}", file=sys.stderr)
    total = len(answers) + len(errors)
    if errors:
        print(f"aot: {len(errors)} of {total} lines failed", file=sys.stderr)
    if not answers:
        raise ValueError(f"every input line failed ({total})" if total else "no input lines")
    return 0


def _top_k(answers: dict[int, dict], tasks: dict[str, Path], k: int) -> dict[int, dict]:
    """Each classification answer with its k most probable labels, named, each multi-label one with its k highest
    scores (aot.cli.ranking); the others as they are, counted in a warning."""
    from aot.cli.ranking import top_labels, unranked_note
    from aot.training.artifact import read_task

    labels = {name: read_task(folder).spec.labels for name, folder in tasks.items()}
    ranked = {n: top_labels(a, labels[a["task"]], k) if labels[a["task"]] else a for n, a in answers.items()}
    unranked_note(ranked.values(), k)
    return ranked


def add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="score a trained task on a labelled file with the task's metric (PyTorch)",
                       description="Predicts every row of a labelled file in the format training reads for the "
                                   "task's kind (JSONL, CSV or TSV: text, optional text_pair, label; labels for "
                                   "multilabel; text_pair and an optional score for embedding; CoNLL or JSONL "
                                   "tokens and tags for tokens) in PyTorch, offline, and prints "
                                   '{"task", "metric", "score", "examples", "data", "unknown_labels", "per_class"}: '
                                   "the task's metric on the rows whose labels it knows; the rows with a label it "
                                   "does not know are left out and counted by label (unknown_labels); per_class: "
                                   "precision, recall, F1 and support of each label (classification, multilabel) or "
                                   "entity type (tokens), null for regression and embedding.")
    p.add_argument("--task", required=True, help="task artifact folder")
    p.add_argument("--model", default=None, help="backbone location, if it moved since training")
    p.add_argument("--predictions", default=None, metavar="OUT",
                   help='write each scored row\'s prediction to OUT, JSON lines in file order: {"task", "text", '
                        '"text_pair"?, "expected", ...the answer aot predict gives}')
    p.add_argument("data", metavar="FILE", help="labelled .jsonl, .csv or .tsv file (tokens: also .conll, .txt)")
    p.set_defaults(run=run_evaluate)


PER_CLASS_SHOWN = 8  # classes the summary line names (the lowest F1 first)


def run_evaluate(args) -> int:
    from aot.training.backbone import load_backbone
    from aot.training.evaluate import evaluate_file

    result = evaluate_file(args.task, args.data, load_backbone(args.model) if args.model else None,
                           args.predictions)
    summary = [f"{result['task']}: {result['metric']} {result['score']:.4f} on {result['examples']} examples of "
               f"{result['data']}"]
    if result["per_class"]:
        worst = sorted(result["per_class"].items(), key=lambda item: item[1]["f1"])
        shown = ", ".join(f"{name} {row['f1']:.3f} ({row['support']})" for name, row in worst[:PER_CLASS_SHOWN])
        more = len(worst) - PER_CLASS_SHOWN
        summary.append(f"F1 per class, lowest first (support): {shown}" + (f", {more} more" if more > 0 else ""))
    if result["unknown_labels"]:
        rows = ", ".join(f"{name!r}: {n}" for name, n in result["unknown_labels"].items())
        summary.append(f"warning: rows left out of the score for labels the task does not know (by label): {rows}")
    if args.predictions:
        summary.append(f"predictions: {args.predictions}")
    report(result, *summary)
    return 0


def add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="tokens with the largest ||P_x|| per layer (AoT tasks)",
                       description="Paper section 4.3: per layer, the tokens whose AoT bias rows have the largest "
                                   "L2 norm.")
    p.add_argument("--task", required=True, help="task artifact folder (method fc or kron)")
    p.add_argument("--top", type=_positive_int, default=20, help="tokens per layer")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--model", default=None, help="backbone location, if it moved since training")
    p.set_defaults(run=run_inspect)


def run_inspect(args) -> int:
    from aot.training.backbone import load_backbone
    from aot.training.factory import load_task
    from aot.training.inspect import top_tokens

    backbone = load_backbone(args.model) if args.model else None
    _, model, backbone = load_task(args.task, backbone)
    table = top_tokens(model, backbone.tokenizer, args.top)
    if args.json:
        print(json.dumps([{"layer": i, "tokens": [{"token": t, "norm": n} for t, n in rows]}
                          for i, rows in enumerate(table)], ensure_ascii=False))
        return 0
    for i, rows in enumerate(table):
        print(f"layer {i}: " + "  ".join(f"{t} ({n:.3f})" for t, n in rows))
    return 0
