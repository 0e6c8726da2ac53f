"""`aot infer`: call a served task over gRPC, one JSON line per input (aot.Client). With --input, a batch job: the
answers streamed in input order as they come (aot.cli.answer_file: whole lines, --resume), what a retry may cure
sent again within one window for the whole run, paced to the server (aot.client.batch), a progress bar of answered
lines and a one-line summary (aot.cli.batch_report)."""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass

from aot.cli.answer_file import AnswerSink, Key, describe, line_key, read_answered
from aot.cli.arguments import non_negative_float, positive_float, positive_int
from aot.cli.batch_report import Tally, TopK
from aot.cli.serve import add_connection_arguments, connect
from aot.serving.formats import json_lines

WAITING_NOTICE = 1.0  # seconds without the server before `aot infer` says it is waiting for it
BATCH_RETRY_SECONDS = 60.0  # --input's retry window: 10 s did not cover a server replacing an instance under load

DESCRIPTION = (
    'Prints the answer of the task\'s kind per TEXT, like `aot predict` plus the task version that answered: '
    '{"label", "logits", "probabilities", "version"} (regression: {"score", ...}; multilabel: {"labels", "scores", '
    '...}; tokens: {"entities": [{"text", "label", "start", "end", "score"}], ...}; embedding: {"embedding", ...}). '
    'With --input, a batch job over JSON lines {"task", "text", "text_pair"?, "id"?} mixing tasks of any kind, '
    "packed into requests (--pack, --concurrency): each answer is written as soon as it and those before it are in, "
    "in input order and whole lines only (a run that dies keeps every line written so far; --resume goes on from "
    'there), echoing the line\'s id and task (a line without an id: its number, "line"). What a retry may cure is '
    "sent again, paced to the server (smaller packs, fewer in flight, after the wait it asks for), within one retry "
    "window for the whole run (--retry-seconds): no server or a restarting one, a stopping server, CANCELLED, "
    "UNAVAILABLE, a rate limit, a missed deadline (--timeout). A line that fails for good (bad input, an unknown "
    'task, or the window is over) is answered {"error", "error_type", "status", "retryable"} where it stands. On '
    'stderr: a progress bar of answered lines, "waiting for the server at ..." when it has not answered for a '
    "second, and a summary line: lines answered, failed by reason, retried, time, lines/s. Exit code 2 when any "
    "line failed (with --partial-ok, only when every line did), else 0.")


def add_infer(sub) -> None:
    p = sub.add_parser("infer", help="call a served task over gRPC; one JSON line per input (--input: batch jobs)",
                       description=DESCRIPTION)
    add_connection_arguments(p)
    p.add_argument("--task", default=None,
                   help="task id (its latest version), or TASK@VERSION to pin a version the store still holds: for "
                        "TEXT arguments, and for --input lines without one")
    p.add_argument("--pair", default=None, help="second text for every TEXT (a task trained on text pairs)")
    p.add_argument("--input", default=None, metavar="FILE",
                   help="JSONL requests (mixed tasks allowed), or - for standard input")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="write the answers here, each line as soon as it is in (default: standard output); the file "
                        "is replaced unless --resume")
    p.add_argument("--resume", action="store_true",
                   help="with --input and --output: keep the answered lines of --output and send only the --input "
                        "lines it does not answer yet (by id and task, or by line number for lines without an id); "
                        "its lines answered with an error are dropped and sent again")
    p.add_argument("--partial-ok", action="store_true",
                   help="exit 0 when some --input lines failed, 2 only when every line did (default: 2 when any did)")
    p.add_argument("--strict", action="store_true", help=argparse.SUPPRESS)  # the old spelling of the default
    p.add_argument("--concurrency", type=positive_int, default=16,
                   help="requests in flight at most (fewer while the server refuses or misses deadlines)")
    p.add_argument("--pack", type=positive_int, default=None,
                   help="lines sent in one request at most (default: aot.Client's, 32; a request carries many texts, "
                        "each with its own task; fewer while the server refuses); a request refused for one of its "
                        "lines is sent again line by line, so a bad line fails alone; one larger than the server's "
                        "max batch size is split to it")
    p.add_argument("--timeout", type=positive_float, default=60.0, metavar="SECONDS",
                   help="deadline of each request, from when it is sent (lines waiting in this client's queue do not "
                        "spend it); an --input request that misses it is sent again with fewer in flight, within the "
                        "retry window")
    p.add_argument("--retry-seconds", type=non_negative_float, default=None, metavar="SECONDS",
                   help="the retry window: how long the run goes on sending again what a retry may cure while the "
                        "server answers nothing (one window for the whole run; then every line left fails, named as "
                        "given up), and how long one line may keep failing so while others are answered (default: "
                        f"{BATCH_RETRY_SECONDS:g} with --input, so that a nightly job rides through a restart or an "
                        "instance replaced under load; else aot.Client's, 10; 0: never send again)")
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
    """One non-blank line of `aot infer --input`: the request it holds, or the answer it gets for being bad, and the
    key its answer is found by (aot.cli.answer_file)."""

    number: int
    request: dict | None
    key: Key
    answer: dict | None = None


def read_requests(path: str, task: str | None) -> list[InputLine]:
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
        key = line_key(line.number, record)
        if record is not None and all(isinstance(record.get(k), str) for k in ("task", "text")):
            lines.append(InputLine(line.number, record, key))
            continue
        reason = line.error or ('expected {"task": "...", "text": "..."}' + ("" if task else
                                                                             " (or --task for lines without one)"))
        echo = {k: record[k] for k in ("id", "task") if k in record} if record is not None else {}
        error = InvalidInput(f"line {line.number}: {reason}", task=echo.get("task"), id=echo.get("id"))
        lines.append(InputLine(line.number, None, key, error.answer()))
    if not lines:
        raise ValueError(f"{name}: no requests")
    return lines


def _check_unique(lines: list[InputLine]) -> None:
    """--resume finds a line's answer by its key: two lines with one key could not be told apart."""
    seen: dict[Key, int] = {}
    for line in lines:
        if line.key in seen:
            raise ValueError(f"--resume: {describe(line.key)} is on lines {seen[line.key]} and {line.number}: "
                             "resuming needs each id once per task (or lines without ids, resumed by line number)")
        seen[line.key] = line.number


def _connected(args):
    window = args.retry_seconds if args.retry_seconds is not None else BATCH_RETRY_SECONDS if args.input else None
    return connect(args, model=args.ensemble, timeout=args.timeout,
                   **({} if window is None else {"retry_seconds": window}))


def _wait_for_server(client, say) -> None:
    """check_ready, saying after WAITING_NOTICE that it waits for the server (it retries for the retry window)."""
    timer = threading.Timer(WAITING_NOTICE, say, args=(f"waiting for the server at {client.url} (trying for up to "
                                                       f"{client.retry_seconds:g} s)",))
    timer.daemon = True
    timer.start()
    try:
        client.check_ready()
    finally:
        timer.cancel()


def _say(text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"aot: {text}", file=sys.stderr)


def _pair_hint(message: str) -> str:
    """The server names its tensor (TEXT_PAIR); `aot infer` users give it with --pair."""
    return message.replace("send TEXT_PAIR too", "send TEXT_PAIR too (aot infer --pair TEXT2)").replace(
        "send no TEXT_PAIR", "send no TEXT_PAIR (drop --pair)")


def run_infer(args) -> int:
    if args.input and args.texts:
        raise ValueError("give either TEXT arguments or --input, not both")
    if args.resume and not (args.input and args.output):
        raise ValueError("--resume needs --input and --output FILE (the answers so far are read from it)")
    if args.input:
        return _run_batch(args)
    if not args.texts or not args.task:
        raise ValueError("give --task and at least one TEXT (or --input FILE.jsonl)")
    return _run_texts(args, [{"task": args.task, "text": t, "text_pair": args.pair} for t in args.texts])


def _run_texts(args, items: list[dict]) -> int:
    """TEXT arguments: one request (a failure is the command's error), or several, packed."""
    from aot.client.client import PACK, InferenceError

    with _connected(args) as client:
        _wait_for_server(client, _say)
        if len(items) == 1:
            try:
                answers = [client.infer(items[0]["task"], items[0]["text"], items[0].get("text_pair"))]
            except InferenceError as exc:
                raise ValueError(_pair_hint(str(exc))) from None
        else:
            answers = client.infer_many(items, args.concurrency, pack=args.pack or PACK)
        ranker = TopK(client.tasks(), args.top_k) if args.top_k is not None else None
    sink = AnswerSink(args.output)
    try:
        for answer in answers:
            sink.write(ranker.rank(answer) if ranker else answer)
    finally:
        sink.close()
    if ranker:
        ranker.notes()
    failed = [a for a in answers if "error" in a]
    if failed:
        print(f"aot: error: {_pair_hint(failed[0]['error'])}", file=sys.stderr)
        return 2
    return 0


def _run_batch(args) -> int:
    """--input: the lines not answered yet (--resume) sent, their answers written in input order as they come."""
    from tqdm.auto import tqdm

    from aot.client.client import PACK

    lines = read_requests(args.input, args.task)
    resumed = None
    if args.resume:
        _check_unique(lines)
        resumed = read_answered(args.output)
    todo = [line for line in lines if resumed is None or line.key not in resumed.answered]
    items = [line.request for line in todo if line.request is not None]
    tally = Tally(len(lines), len(lines) - len(todo), resumed)
    sink = AnswerSink(args.output, append=args.resume)
    run = None
    try:
        with _connected(args) as client:
            if items:  # every line bad, or answered before: nothing to send, no server needed
                _wait_for_server(client, _say)
            ranker = TopK(client.tasks(), args.top_k) if args.top_k is not None and items else None
            bar = tqdm(total=len(todo), disable=args.no_progress or not items, unit="line", desc="infer", file=sys.stderr)
            run = client.infer_stream(items, args.concurrency, on_done=lambda i, a: bar.update(1),
                                      pack=args.pack or PACK, on_notice=_say)
            sent = iter(run)
            for line in todo:
                answer = line.answer or next(sent)
                if line.answer is not None:
                    bar.update(1)
                if "id" not in answer:
                    answer = {"line": line.number, **answer}
                sink.write(ranker.rank(answer) if ranker else answer)
                tally.count(line.number, answer)
            bar.close()
            if ranker:
                ranker.notes()
    except BaseException:
        tally.interrupted = True
        raise
    finally:
        sink.close()
        code = tally.exit_code(args.partial_ok)
        if run is not None:  # not when the server could not be reached at all: the error says so alone
            print(tally.summary(run.stats.retried, code, args.output), file=sys.stderr)
    return code
