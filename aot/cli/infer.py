"""`aot infer`: call a served task over gRPC, one JSON line per input (aot.Client, packed)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from aot.cli.arguments import positive_int
from aot.cli.serve import add_connection_arguments, connect
from aot.serving.formats import json_lines


def add_infer(sub) -> None:
    p = sub.add_parser("infer", help="call a served task over gRPC; one JSON line per input",
                       description='Prints the answer of the task\'s kind per TEXT, like `aot predict` plus the '
                                   'task version that answered: {"label", "logits", "probabilities", "version"} '
                                   '(regression: {"score", ...}; multilabel: {"labels", "scores", ...}; tokens: '
                                   '{"entities": [{"text", "label", "start", "end", "score"}], ...}; embedding: '
                                   '{"embedding", ...}); or, with --input, answers JSON lines mixing tasks of any kind '
                                   '{"task", "text", "text_pair"?, "id"?} packed into requests (--pack), in input order, each answer '
                                   "echoing the line's task and id. Lines whose request fails are answered "
                                   '{"error": ...} and counted on stderr; the exit code is 2 when every line failed, '
                                   "or any with --strict, else 0.")
    add_connection_arguments(p)
    p.add_argument("--task", default=None,
                   help="task id (its latest version), or TASK@VERSION to pin a version the store still holds: for "
                        "TEXT arguments, and for --input lines without one")
    p.add_argument("--pair", default=None, help="second text for every TEXT")
    p.add_argument("--input", default=None, metavar="FILE",
                   help="JSONL requests (mixed tasks allowed), or - for standard input")
    p.add_argument("--output", default=None, help="write answers here instead of stdout")
    p.add_argument("--strict", action="store_true", help="exit 2 if any --input line fails (default: only if all do)")
    p.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight")
    p.add_argument("--pack", type=positive_int, default=None,
                   help="lines sent in one request (default: aot.Client's, 32; a request carries many texts, each with "
                        "its own task); a request "
                        "refused for one of its lines is sent again line by line, so a bad line fails alone; one "
                        "larger than the server's max batch size is split to it")
    p.add_argument("--ensemble", default="aot", help="ensemble to call (aot, or vanilla for comparisons)")
    p.add_argument("--model", dest="ensemble", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # its old name
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar of --input")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="answer the K most probable labels by name ({\"top\": [{\"label\", \"probability\"}, "
                        "...]}, the names from the server's task list) instead of every logit and probability")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts for --task, one JSON line each")
    p.set_defaults(run=run_infer)


@dataclass
class InputLine:
    """One non-blank line of `aot infer --input`: the request it holds, or the answer it gets for being bad."""

    number: int
    request: dict | None
    answer: dict | None = None


def _read_requests(path: str, task: str | None) -> list[InputLine]:
    """JSONL requests (`-`: standard input), a line without a task taking `task`. A bad line (not UTF-8, not a JSON
    object, no string task and text) is answered in place with its error and its line number; the others are sent.
    A file that cannot be opened, or holds no line, is an error."""
    from aot.client.errors import InvalidInput

    name = "<stdin>" if path == "-" else path
    lines = []
    for line in json_lines(path):
        record = line.item
        if record is not None and task is not None:
            record.setdefault("task", task)
        if record is not None and all(isinstance(record.get(k), str) for k in ("task", "text")):
            lines.append(InputLine(line.number, record))
            continue
        reason = line.error or ('expected {"task": "...", "text": "..."}' + ("" if task else
                                                                             " (or --task for lines without one)"))
        echo = {k: record[k] for k in ("id", "task") if k in record} if record is not None else {}
        error = InvalidInput(f"line {line.number}: {reason}", task=echo.get("task"), id=echo.get("id"))
        lines.append(InputLine(line.number, None, error.answer()))
    if not lines:
        raise ValueError(f"{name}: no requests")
    return lines


def _top_k(answers: list[dict], listing: dict, k: int) -> list[dict]:
    """Each classification answer with its k most probable labels, named from the server's task listing, and each
    multi-label answer with its k highest scores (aot.cli.ranking); an answer whose version's names the listing cannot
    give keeps its logits and probabilities, with a warning, as does one of a kind with no labels to rank."""
    from aot.cli.ranking import ServedLabels, top_labels, top_scores, unranked_note

    labels, unnamed = ServedLabels(listing), set()
    out = []
    for answer in answers:
        if isinstance(answer.get("scores"), dict):
            out.append(top_scores(answer, k))
            continue
        names = labels.of(answer) if "probabilities" in answer else None
        if names is None and "probabilities" in answer:
            unnamed.add(answer.get("version", "?"))
        out.append(answer if names is None else top_labels(answer, names, k))
    unranked_note(out, k)
    if unnamed:
        print(f"aot: warning: --top-k: no label names for {', '.join(sorted(unnamed))} (a version the server no "
              "longer lists, whose labels changed since): those answers keep their logits and probabilities",
              file=sys.stderr)
    return out


def _send(args, items: list[dict]) -> list[dict]:
    """The answers of `items`, in order: one request (a failure is the command's error), or many, packed (infer_many)."""
    from tqdm.auto import tqdm

    from aot.client.client import PACK, InferenceError

    with connect(args, model=args.ensemble) as client:
        client.check_ready()
        if len(items) == 1 and not args.input:
            try:
                answers = [client.infer(items[0]["task"], items[0]["text"], items[0].get("text_pair"))]
            except InferenceError as exc:
                raise ValueError(str(exc)) from None
        else:
            bar = tqdm(total=len(items), disable=args.no_progress or not args.input, unit="req", desc="infer")
            answers = client.infer_many(items, args.concurrency, on_done=lambda i, r: bar.update(1),
                                         pack=args.pack or PACK)
            bar.close()
        if args.top_k is not None:
            answers = _top_k(answers, client.tasks(), args.top_k)
    return answers


def run_infer(args) -> int:
    if args.input and args.texts:
        raise ValueError("give either TEXT arguments or --input, not both")
    if args.input:
        lines = _read_requests(args.input, args.task)
        items = [line.request for line in lines if line.request is not None]
    else:
        if not args.texts or not args.task:
            raise ValueError("give --task and at least one TEXT (or --input FILE.jsonl)")
        items = [{"task": args.task, "text": t, "text_pair": args.pair} for t in args.texts]
    answers = _send(args, items) if items else []  # every --input line bad: nothing to send
    if args.input:  # each answer echoes its line's id and task (infer_many); bad lines are answered where they stood
        sent = iter(answers)
        answers = [line.answer or next(sent) for line in lines]
    text = "".join(json.dumps(a, ensure_ascii=False) + "\n" for a in answers)
    if args.output:
        from aot.serving.store.atomic import write_atomic

        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    failed = [i for i, a in enumerate(answers) if "error" in a]
    if not failed:
        return 0
    if not args.input:
        print(f"aot: error: {answers[failed[0]]['error']}", file=sys.stderr)
        return 2
    error = answers[failed[0]]["error"]
    first = error if lines[failed[0]].answer else f"line {lines[failed[0]].number}: {error}"
    if len(failed) == len(answers) or args.strict:
        print(f"aot: error: {len(failed)} of {len(answers)} requests failed (first: {first})", file=sys.stderr)
        return 2
    print(f"aot: warning: {len(failed)} of {len(answers)} requests failed, answered {{\"error\": ...}} "
          f"(first: {first}); --strict makes that exit 2", file=sys.stderr)
    return 0
