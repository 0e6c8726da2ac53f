"""`aot serve` (a local Triton server, no Docker) and `aot tasks`; the connection arguments `aot infer` shares."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from aot import settings
from aot.cli.arguments import non_negative_float, non_negative_int, positive_int
from aot.cli.output import example_texts, report


def pool_summary(repo, pool_bytes: int, device: str, storages: dict[str, str]) -> str:
    """What the task pool will hold of the served tasks (`storages`: name -> fused or factored), as `aot serve` says
    it at start-up: on CPU each instance of the fused step holds an equal share of the budget, and with several
    instances fused tables are read through their memory maps (one copy in the page cache), not the pool."""
    table = repo.num_layers * repo.hidden_size * 2 * repo.vocab_size  # one task's V rows, fp16
    instances = repo.options.cpu_instances if device == "cpu" else 1
    share = pool_bytes // instances
    fused = sum(1 for s in storages.values() if s == "fused")
    pooled = len(storages) - fused if instances > 1 else len(storages)
    if pool_bytes == 0:
        return "no task pool (fused tables read through their memory maps, factored rows computed per request)"
    room = share // table
    kind = "factored task(s)" if instances > 1 else "task(s)"
    if pooled == 0:
        held = f"room for {room} {kind} fully resident, none served"
    elif room >= pooled:
        held = f"all {pooled} {kind} fully resident"
    else:
        held = f"{room} of {pooled} {kind} fully resident, the others' rows cached as they are used"
    if instances == 1:
        return f"task pool {pool_bytes / 2**20:.0f} MiB: {held}"
    return (f"task pool {share / 2**20:.0f} MiB in each of {instances} instances: {held}; {fused} fused table(s) read "
            "through their memory maps")


def _share(text: str) -> float:
    """A share of requests, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share of requests in (0, 1], got {text!r}")
    return value


def _header(text: str) -> str:
    """A request header's name (aot.settings: lower-cased)."""
    try:
        return settings.CLIENT_ADDRESS_HEADER.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a header name (letters, digits and '-'), got {text!r}") from None


def add_serve(sub) -> None:
    p = sub.add_parser("serve",
                       help="serve a model repository with a local tritonserver on CPU or CUDA (no Docker)",
                       description="Start tritonserver (from the nvidia-pytriton wheel) on the repository's CPU "
                                   "configs (--device cpu) or, for a repository exported with --format torch, on "
                                   "its GPU configs with memory pools sized from the repository (--device cuda), "
                                   "wait until it is ready, print the endpoints, and stop it cleanly on Ctrl-C; "
                                   "SIGTERM stops it gracefully (it drains first: --drain-seconds). Its python steps run the Python running aot, which needs numpy<2 (the "
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
    p.add_argument("--grpc-port", type=positive_int, default=settings.GRPC_PORT.default,
                   help="gRPC port (aot infer, aot.Client)")
    p.add_argument("--http-port", type=positive_int, default=settings.HTTP_PORT.default,
                   help="HTTP port (health, inference; the control API needs the admin key)")
    p.add_argument("--metrics-port", type=positive_int, default=settings.METRICS_PORT.default,
                   help="Prometheus metrics port (per-task series name every task: keep it off public interfaces)")
    p.add_argument("--health-port", type=positive_int, default=settings.HEALTH_PORT.default,
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
                        "--metrics-port + 2*i and /ready on --health-port + 2*i; SIGHUP restarts the replicas one "
                        "after the other, each drained first (a rolling restart, no request lost). 1: one server, no "
                        "load balancer")
    p.add_argument("--drain-seconds", type=non_negative_float, default=None, metavar="SECONDS",
                   help="one server: on SIGTERM, /ready answers 503 for this long while requests are still answered "
                        "(a load balancer in front takes the server out), then the server stops: new requests are "
                        "refused (retryable) on gRPC and HTTP, those begun are finished, open HTTP connections are "
                        "closed; a second SIGTERM or Ctrl-C stops at once (default: AOT_DRAIN_SECONDS, else "
                        f"{settings.DRAIN_SECONDS.default:g})")
    p.add_argument("--pool-bytes", type=non_negative_int, default=None,
                   help="memory of the task pool (rows of P kept in RAM; 0: none) instead of the repository's "
                        "serving option (printed at start-up)")
    p.add_argument("--vanilla", action="store_true",
                   help="also serve `vanilla`, the plain encoder without tasks' biases (comparisons, `aot infer "
                        "--ensemble vanilla`): one more engine and step processes; off by default")
    p.add_argument("--metrics-tasks", type=non_negative_int, default=None, metavar="K",
                   help="tasks with metric series of their own in each step instance: the K busiest (decayed request "
                        f"counts); the others count under task=\"<other>\" (default {settings.METRICS_TASKS.default}; "
                        "environment AOT_METRICS_TASKS)")
    p.add_argument("--request-log", default=None, metavar="FILE",
                   help="append one JSON line per request and step to FILE (time, step, task, version, latency_ms, "
                        "status; no text unless --request-log-text), created 0600")
    p.add_argument("--request-log-sample", type=_share, default=1.0, metavar="SHARE",
                   help="the share of texts the request log writes, drawn per text of a request (default 1: all)")
    p.add_argument("--require-tenant-keys", action="store_true",
                   help="tasks without a tenant answer only requests that carry a valid tenant key (default: they "
                        "are public; a tenant's tasks TENANT/TASK always need its key)")
    p.add_argument("--rate-limit", type=non_negative_float, default=None, metavar="R",
                   help="texts per second each tenant (a valid tenant key) may send (a request of N texts counts N); more are refused (503 with a "
                        "retry hint, client error Unavailable with retry_after); 0: none (default: AOT_RATE_LIMIT, "
                        "else none)")
    p.add_argument("--anonymous-rate-limit", type=non_negative_float, default=None, metavar="R",
                   help="texts per second all requests without a valid tenant key may send together, an equal share "
                        "for each client address when the address is known (--client-address-header, --replicas), "
                        "more while the others leave some unused (default: --rate-limit)")
    p.add_argument("--client-address-header", type=_header, default=None, metavar="NAME",
                   help="the request header that a proxy in front of this server sets to each client's address, "
                        "overwriting what the client sent: requests without a tenant key then share "
                        "--anonymous-rate-limit equally by address. Trust it only when clients cannot reach the "
                        "server but through that proxy (default: AOT_CLIENT_ADDRESS_HEADER, else none: they share "
                        "it as one caller; --replicas: its HAProxy sets aot-client-address)")
    p.add_argument("--request-log-text", action="store_true",
                   help="write each logged request's text and text pair too (they are the callers' data)")
    p.set_defaults(run=run_serve)


def run_serve(args) -> int:
    from aot.local.server import LocalServer
    from aot.serving.repository import memory_pool_bytes, read_repository
    from aot.serving.task_registry import TaskRegistry

    repo = read_repository(args.repo)
    _check_device(args.device, repo.options.engine)
    registry = TaskRegistry(repo.store_root, parts="meta", url=repo.store_url)  # the index only: no task version is read at start
    if registry.index_error:
        print(f"aot: warning: {registry.index_error} (no task serves until it is fixed)",
              file=sys.stderr)
    errors = registry.errors()
    for error in errors.values():
        print(f"aot: warning: {error} (its requests will fail; the other tasks serve)", file=sys.stderr)
    if not registry.index_error and not registry.entries() and not errors:
        print(f"aot: warning: {repo.path} has no task yet: the server answers no task until one is published "
              f"(aot export task --repo {repo.path} ...; a running server picks it up)", file=sys.stderr)
    pool_bytes = repo.options.pool_bytes if args.pool_bytes is None else args.pool_bytes
    steps = _step_environment(args)  # what the steps of every server started below read, over this environment
    if args.replicas > 1:
        single = [flag for flag, value in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                                           ("--tls-ca", args.tls_ca), ("--log", args.log),
                                           ("--client-address-header", args.client_address_header)) if value]
        if single:
            raise ValueError(f"--replicas {args.replicas}: {single[0]} is for one server (each replica keeps its own "
                             "log; terminate TLS in front of the fleet; its HAProxy sets the client's address)")
        from aot.local.fleet import Fleet

        server = Fleet(repo.path, args.replicas, args.host, args.http_port, args.grpc_port, args.metrics_port,
                       args.health_port, server_options={"pool_bytes": pool_bytes, "device": args.device,
                                                         "vanilla": args.vanilla, "step_environment": steps})
    else:
        server = LocalServer(repo.path, args.host, args.http_port, args.grpc_port, args.metrics_port,
                             health_port=args.health_port, metrics_host=args.metrics_host, log_path=args.log,
                             pool_bytes=pool_bytes, device=args.device, tls_cert=args.tls_cert, tls_key=args.tls_key,
                             tls_ca=args.tls_ca, vanilla=args.vanilla, step_environment=steps)
    stop, drain, restart = threading.Event(), threading.Event(), threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # one server drains on SIGTERM (a second one stops it); a fleet stops, its replicas restart one by one on SIGHUP
    signal.signal(signal.SIGTERM, lambda *_: stop.set() if drain.is_set() or args.replicas > 1 else drain.set())
    if args.replicas > 1:
        signal.signal(signal.SIGHUP, lambda *_: restart.set())
    drain_seconds = settings.DRAIN_SECONDS.read() if args.drain_seconds is None else args.drain_seconds
    server.start()
    try:
        served = {name: entry for name, entry in registry.entries().items() if name not in errors}
        tasks = sorted(served)
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
              + f", grpc {server.grpc_url}: {len(tasks)} task(s); "
              + pool_summary(repo, pool_bytes, args.device, {n: t.storage for n, t in served.items()})
              + (f"; request log {args.request_log}" if args.request_log else "") + " (Ctrl-C stops)",
              file=sys.stderr, flush=True)
        first = served[tasks[0]].meta.get("has_pair") if tasks else None
        print(f'aot: next: aot infer --url {server.grpc_url} --task {tasks[0] if tasks else "NAME"} '
              f"{example_texts(first)}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            if drain.is_set():
                server.drain()
                print(f"aot: draining: /ready answers 503, requests are answered for {drain_seconds:g} s more, then "
                      "new ones are refused (retryable) and the server stops once those begun are finished (SIGTERM "
                      "again or Ctrl-C: stop now)",
                      file=sys.stderr, flush=True)
                stop.wait(drain_seconds)
                break
            if restart.is_set():
                restart.clear()
                server.rolling_restart(until=stop)
            if server.failed:
                print(f"aot: error: {server.failed}" + ("" if args.replicas > 1 else f" (log: {server.log_path})"),
                      file=sys.stderr)
                return 1
    finally:
        server.stop()
    print(f"aot: stopped serving {repo.path}" + (f" (log: {args.log})" if args.log else ""), file=sys.stderr)
    return 0


def _step_environment(args) -> dict[str, str]:
    """What the served steps read from their environment, over aot serve's own (LocalServer's step_environment; an
    empty value reads as unset): K of the metrics (aot.serving.metric_labels), the tenant keys and rates, and the
    request log (aot.serving.request_log), whose file is created here so that a bad path fails before the server
    starts."""
    from aot.serving.request_log import RequestLog, RequestLogSettings

    env = {} if args.metrics_tasks is None else {settings.METRICS_TASKS.name: str(args.metrics_tasks)}
    env[settings.REQUIRE_TENANT_KEYS.name] = "1" if args.require_tenant_keys else ""
    for setting, value in ((settings.RATE_LIMIT, args.rate_limit),
                           (settings.ANONYMOUS_RATE_LIMIT, args.anonymous_rate_limit),
                           (settings.CLIENT_ADDRESS_HEADER, args.client_address_header)):
        if value is not None:
            env[setting.name] = str(value)
    if args.request_log is None:
        return env | {settings.REQUEST_LOG.name: ""}  # --request-log alone turns it on
    log = RequestLogSettings(os.path.abspath(args.request_log), args.request_log_sample, args.request_log_text)
    RequestLog(log, "aot serve").close()  # --request-log FILE: cannot be opened for appending (...)
    return env | log.as_environment()


def _check_device(device: str, engine: str) -> None:
    """`cpu` serves any repository; `cuda` a torch-engine one, on a machine whose PyTorch sees CUDA (the torch
    engine's own check, aot.serving_torch.engine.check_device)."""
    if device == "cpu":
        return
    from aot.serving_torch.engine import check_device

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
    """How `aot tasks` and `aot infer` reach the server: its gRPC address (aot.client.client.server_url) and, for a TLS
    server, the CA and a client certificate (aot.Client's tls, ca, cert, key)."""
    p.add_argument("--url", default=None,
                   help="gRPC address of the server (default: the environment variable AOT_URL, else "
                        f"{settings.URL.default})")
    p.add_argument("--tls", action="store_true", help="gRPC over TLS, trusting the system's CAs (or --ca)")
    p.add_argument("--ca", default=None, help="PEM CA that signed the server's certificate (implies --tls)")
    p.add_argument("--cert", default=None, help="PEM client certificate, for a server that asks for one")
    p.add_argument("--key", default=None, help="PEM private key of --cert")
    p.add_argument("--tenant-key", default=None,
                   help="a tenant's key (aot export tenant create): its tasks TENANT/TASK answer (default: the "
                        "environment variable AOT_TENANT_KEY)")


def connect(args, **kwargs):
    from aot.client.client import Client

    return Client(args.url, tls=args.tls, ca=args.ca, cert=args.cert, key=args.key, tenant_key=args.tenant_key,
                  **kwargs)


def add_tasks(sub) -> None:
    p = sub.add_parser("tasks", help="list the tasks a running server serves (read from the server)",
                       description="One JSON line per served task, from the server's store index: name, version, "
                                   "kind (classification, regression, multilabel, tokens, embedding), storage, "
                                   "labels, max length, method, metric, dev score (fp32, as trained), served_dev (on "
                                   "an int8 backbone: the dev score through the int8 engine, beside its fp32 "
                                   "reference, measured when it was published; null on fp32), whether its files "
                                   "carry digests; then one line per task whose requests fail, with the reason. The "
                                   "summary says how many match and how far the background audit got.")
    add_connection_arguments(p)
    p.add_argument("--limit", type=positive_int, default=None, help="list at most this many tasks (by name)")
    p.add_argument("--match", default="", help="only tasks whose name holds this text")
    p.set_defaults(run=run_tasks)


def run_tasks(args) -> int:
    from aot.client.client import InferenceError

    with connect(args) as client:
        try:
            client.check_ready()
            listing = client.tasks(args.limit, args.match)
        except InferenceError as exc:
            raise ValueError(str(exc)) from None
    failing = [{"name": name, "error": error} for name, error in listing["errors"].items() if args.match in name]
    audit = listing.get("audit") or {}
    shown = len(listing["tasks"])
    report(listing["tasks"] + failing, f"{shown} task(s) served at {client.url}"
           + (f" (of {listing['total']} matching)" if listing.get("total", shown) > shown else "")
           + (f"; {len(failing)} failing (the lines with an error say why)" if failing else "")
           + (f"; audit: {audit['verified']} of {audit['versions']} versions checked against their digests"
              if audit.get("versions") else ""))
    return 0
