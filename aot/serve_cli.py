"""`aot serve` (a local Triton server, no Docker) and `aot infer` (the gRPC client)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from aot.arguments import non_negative_int, positive_int
from aot.output import report
from serving.formats import read_json_lines


def pool_summary(repo, pool_bytes: int, device: str) -> str:
    """What the task pool holds, as `aot serve` says it at start-up: on CPU each instance of the fused step holds an
    equal share, and with several instances fused tables are read through their memory maps instead."""
    tables = repo.num_layers * repo.hidden_size * 2 * repo.vocab_size
    instances = repo.options.cpu_instances if device == "cpu" else 1
    share = pool_bytes // instances
    if instances == 1:
        return f"task pool {pool_bytes / 2**20:.0f} MiB ({pool_bytes // tables} tasks fully resident)"
    return (f"task pool {share / 2**20:.0f} MiB in each of {instances} instances ({share // tables} factored tasks "
            "fully resident each; fused tables read through their memory maps)")

def add_serve(sub) -> None:
    p = sub.add_parser("serve",
                       help="serve a model repository with a local tritonserver on CPU or CUDA (no Docker)",
                       description="Start tritonserver (from the nvidia-pytriton wheel) on the repository's CPU "
                                   "configs (--device cpu) or, for a repository exported with --format torch, on "
                                   "its GPU configs with memory pools sized from the repository (--device cuda), "
                                   "wait until it is ready, print the endpoints, and stop it cleanly on Ctrl-C or "
                                   "SIGTERM. Its python steps run the Python running aot, which needs numpy<2 (the "
                                   "Triton 2.51 stub's ABI), or the one the environment variable AOT_STEP_PYTHON "
                                   "names; it is checked before the server starts. The model-control, "
                                   "config, shared-memory, statistics, trace and logging APIs answer only requests "
                                   "with the header aot-admin-key: the key of AOT_ADMIN_KEY, or of the file "
                                   "AOT_ADMIN_KEY_FILE names, else one generated for this server and written to "
                                   "the 0600 file printed at start-up (README: Security model).")
    p.add_argument("--repo", required=True, help="model repository (from `aot export backbone`)")
    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP and gRPC ports")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the metrics and health ports (they name every task: loopback unless a scraper "
                        "elsewhere needs them)")
    p.add_argument("--grpc-port", type=positive_int, default=8001, help="gRPC port (aot infer, aot.Client)")
    p.add_argument("--http-port", type=positive_int, default=8000,
                   help="HTTP port (health, inference; the control API needs the admin key)")
    p.add_argument("--metrics-port", type=positive_int, default=8002,
                   help="Prometheus metrics port (per-task series name every task: keep it off public interfaces)")
    p.add_argument("--health-port", type=positive_int, default=8003,
                   help="GET /ready (200 only when every model is loaded and answering) and /live")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC over TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None,
                   help="PEM CA: require client certificates signed by it (mutual TLS; with --tls-cert)")
    p.add_argument("--log", default=None,
                   help="server log file (default: a temporary file, removed when aot serve stops unless it failed)")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda (cuda:N): the torch engine on a GPU, fp16 with CUDA graphs (a repository "
                        "exported with --format torch; the local tritonserver has no native GPU backends)")
    p.add_argument("--replicas", type=positive_int, default=1,
                   help="tritonservers on this repository behind HAProxy (a local fleet, docs/deploy-fleet.md): "
                        "HAProxy takes --grpc-port and --http-port, checks each replica's /ready and retries a "
                        "request a dead replica did not answer on another; replica i serves metrics on "
                        "--metrics-port + 2*i and /ready on --health-port + 2*i. 1: one server, no load balancer")
    p.add_argument("--pool-bytes", type=non_negative_int, default=None,
                   help="memory of the task pool (rows of P kept in RAM; 0: none) instead of the repository's "
                        "serving option (printed at start-up)")
    p.set_defaults(run=run_serve)


def run_serve(args) -> int:
    from aot.server import LocalServer
    from serving.repository import memory_pool_bytes, read_repository
    from serving.task_registry import TaskRegistry

    repo = read_repository(args.repo)
    _check_device(args.device, repo.options.engine)
    registry = TaskRegistry(repo.store_root, parts="meta")
    if registry.manifest_error:
        print(f"aot: warning: {registry.manifest_error} (no task serves until it is fixed)", file=sys.stderr)
    errors = registry.check()
    for error in errors.values():
        print(f"aot: warning: {error} (its requests will fail; the other tasks serve)", file=sys.stderr)
    pool_bytes = repo.options.pool_bytes if args.pool_bytes is None else args.pool_bytes
    if args.replicas > 1:
        single = [flag for flag, value in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                                           ("--tls-ca", args.tls_ca), ("--log", args.log)) if value]
        if single:
            raise ValueError(f"--replicas {args.replicas}: {single[0]} is for one server (each replica keeps its own "
                             "log; terminate TLS in front of the fleet)")
        from aot.fleet import Fleet

        server = Fleet(repo.path, args.replicas, args.host, args.http_port, args.grpc_port, args.metrics_port,
                       args.health_port, server_options={"pool_bytes": pool_bytes, "device": args.device})
    else:
        server = LocalServer(repo.path, args.host, args.http_port, args.grpc_port, args.metrics_port,
                             health_port=args.health_port, metrics_host=args.metrics_host, log_path=args.log,
                             pool_bytes=pool_bytes, device=args.device, tls_cert=args.tls_cert, tls_key=args.tls_key,
                             tls_ca=args.tls_ca)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    try:
        tasks = sorted(set(registry.served()) - set(errors))
        replicas = getattr(server, "servers", [server])
        endpoints = [{"metrics": f"{r.metrics_host}:{r.metrics_port}", "health": r.health_url, "log": str(r.log_path),
                      "ready_seconds": round(r.ready_seconds, 2)} for r in replicas]
        print(json.dumps({"grpc": server.grpc_url, "http": server.http_url, "device": args.device,
                          **(endpoints[0] if args.replicas == 1 else {"replicas": endpoints,
                                                                      "balancer_log": str(server.log_path)}),
                          "tls": args.tls_cert is not None, "admin_key_file": str(server.admin_key_path),
                          "tasks": tasks, "pool_bytes": pool_bytes,
                          "memory_pools": None if args.device == "cpu" else memory_pool_bytes(repo)}), flush=True)
        print(f"serving {repo.path} on {args.device}"
              + (f" with {args.replicas} replicas behind HAProxy" if args.replicas > 1 else "")
              + f", grpc {server.grpc_url}; {pool_summary(repo, pool_bytes, args.device)} (Ctrl-C stops)",
              file=sys.stderr, flush=True)
        print(f'aot: next: aot infer --url {server.grpc_url} --task {tasks[0] if tasks else "NAME"} "some text"',
              file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            if server.failed:
                print(f"aot: error: {server.failed}" + ("" if args.replicas > 1 else f" (log: {server.log_path})"),
                      file=sys.stderr)
                return 1
    finally:
        server.stop()
    print(f"aot: stopped serving {repo.path}" + (f" (log: {args.log})" if args.log else ""), file=sys.stderr)
    return 0


def _check_device(device: str, engine: str) -> None:
    """`cpu` serves any repository; `cuda` a torch-engine one, on a machine whose PyTorch sees CUDA (the torch
    engine's own check, serving_torch.engine.check_device)."""
    if device == "cpu":
        return
    from serving_torch.engine import check_device

    try:
        check_device(device, present=False)
        if engine != "torch":
            raise ValueError(f"device {device!r}: this repository's backbone engine is {engine!r}; the local "
                             "tritonserver has only the python backend, so GPU serving here needs a repository "
                             "exported with `aot export backbone --format torch` (serve onnx and tensorrt ones with "
                             "docker compose on the NGC image)")
        check_device(device)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    """How `aot tasks` and `aot infer` reach the server: its gRPC address (aot.client.server_url) and, for a TLS
    server, the CA and a client certificate (aot.Client's tls, ca, cert, key)."""
    p.add_argument("--url", default=None,
                   help="gRPC address of the server (default: the environment variable AOT_URL, else 127.0.0.1:8001)")
    p.add_argument("--tls", action="store_true", help="gRPC over TLS, trusting the system's CAs (or --ca)")
    p.add_argument("--ca", default=None, help="PEM CA that signed the server's certificate (implies --tls)")
    p.add_argument("--cert", default=None, help="PEM client certificate, for a server that asks for one")
    p.add_argument("--key", default=None, help="PEM private key of --cert")


def connect(args, **kwargs):
    from aot.client import Client

    return Client(args.url, tls=args.tls, ca=args.ca, cert=args.cert, key=args.key, **kwargs)


def add_tasks(sub) -> None:
    p = sub.add_parser("tasks", help="list the tasks a running server serves (read from the server)",
                       description="One JSON line per served task: name, version, storage, labels, max length, "
                                   "method, metric, dev score (fp32, as trained), served_dev (on an int8 backbone: "
                                   "the dev score through the int8 engine, beside its fp32 reference, measured when "
                                   "it was published; null on fp32) and source artifact; then one line per task "
                                   "whose requests fail, with the reason.")
    add_connection_arguments(p)
    p.set_defaults(run=run_tasks)


def run_tasks(args) -> int:
    from aot.client import InferenceError

    with connect(args) as client:
        try:
            client.check_ready()
            listing = client.tasks()
        except InferenceError as exc:
            raise ValueError(str(exc)) from None
    failing = [{"name": name, "error": error} for name, error in listing["errors"].items()]
    report(listing["tasks"] + failing, f"{len(listing['tasks'])} task(s) served at {client.url}"
           + (f"; {len(failing)} failing (the lines with an error say why)" if failing else ""))
    return 0


def add_infer(sub) -> None:
    p = sub.add_parser("infer", help="call a served task over gRPC; one JSON line per input",
                       description='Prints {"label", "logits", "probabilities", "version"} (a regression task: '
                                   '{"score", "version"}) per TEXT, like `aot predict` plus the task version that '
                                   "answered; or, with --input, answers JSON lines "
                                   '{"task", "text", "text_pair"?, "id"?} concurrently, in input order, each answer '
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
    p.add_argument("--ensemble", default="aot", help="ensemble to call (aot, or vanilla for comparisons)")
    p.add_argument("--model", dest="ensemble", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # its old name
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar of --input")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts for --task, one JSON line each")
    p.set_defaults(run=run_infer)


def _read_requests(path: str, task: str | None) -> tuple[list[dict], list[int]]:
    """JSONL requests (`-`: standard input) and their line numbers; a line without a task takes `task`. An error
    names the file and line, before anything is sent."""
    name = "<stdin>" if path == "-" else path
    items, lines = [], []
    for line in read_json_lines(path):
        record = line.item
        if task is not None:
            record.setdefault("task", task)
        if not all(isinstance(record.get(k), str) for k in ("task", "text")):
            raise ValueError(f'{line.where}: expected {{"task": "...", "text": "..."}}'
                             + ("" if task else " (or --task for lines without one)"))
        items.append(record)
        lines.append(line.number)
    if not items:
        raise ValueError(f"{name}: no requests")
    return items, lines


def run_infer(args) -> int:
    from tqdm.auto import tqdm

    from aot.client import InferenceError

    if args.input and args.texts:
        raise ValueError("give either TEXT arguments or --input, not both")
    if args.input:
        items, lines = _read_requests(args.input, args.task)
    else:
        if not args.texts or not args.task:
            raise ValueError("give --task and at least one TEXT (or --input FILE.jsonl)")
        items = [{"task": args.task, "text": t, "text_pair": args.pair} for t in args.texts]
    with connect(args, model=args.ensemble) as client:
        client.check_ready()
        if len(items) == 1 and not args.input:
            try:
                answers = [client.infer(items[0]["task"], items[0]["text"], items[0].get("text_pair"))]
            except InferenceError as exc:
                raise ValueError(str(exc)) from None
        else:
            bar = tqdm(total=len(items), disable=args.no_progress or not args.input, unit="req", desc="infer")
            answers = client.infer_many(items, args.concurrency, on_done=lambda i, r: bar.update(1))
            bar.close()
    if args.input:  # each answer says which line it answers
        answers = [{k: item[k] for k in ("id", "task") if k in item} | a for item, a in zip(items, answers)]
    text = "".join(json.dumps(a) + "\n" for a in answers)
    if args.output:
        from serving.atomic import write_atomic

        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    failed = [i for i, a in enumerate(answers) if "error" in a]
    if not failed:
        return 0
    if not args.input:
        print(f"aot: error: {answers[failed[0]]['error']}", file=sys.stderr)
        return 2
    first = f"line {lines[failed[0]]}: {answers[failed[0]]['error']}"
    if len(failed) == len(answers) or args.strict:
        print(f"aot: error: {len(failed)} of {len(answers)} requests failed (first: {first})", file=sys.stderr)
        return 2
    print(f"aot: warning: {len(failed)} of {len(answers)} requests failed, answered {{\"error\": ...}} "
          f"(first: {first}); --strict makes that exit 2", file=sys.stderr)
    return 0
