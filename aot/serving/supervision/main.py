"""The supervisor's main: tritonserver under a supervisor, its control API closed to clients. The container runs it
as `python3 -m aot.serving tritonserver ARGS...` (docker-compose.yml, deploy/kubernetes; aot/serving/__main__.py
gives it the task store's check).

What it puts together: admin_key (the key and the API restrictions), lifecycle (one server from start to reaped),
supervisor (the Supervisor: dead, stopped or silent steps repaired), health (/ready and /live on the health port),
procfs (the stubs, from /proc), and the request path's shm and watch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from aot import settings
from aot.serving.limits import region_bound_of
from aot.serving.repository import models_to_load, read_repository
from aot.serving.supervision.admin_key import (
    RESTRICTED_APIS,
    RESTRICTION_FLAGS,
    AdminKeyError,
    admin_key_from_environment,
    generate_admin_key,
)
from aot.serving.supervision.health import HealthServer
from aot.serving.supervision.lifecycle import ServerExited, ServerLifecycle, compile_steps
from aot.serving.supervision.quiesce import TRITON_HTTP_PORT, flag


def load_flags(command: list[str]) -> list[str]:
    """What the server loads when the command does not say: what its repository's GPU configs serve
    (aot.serving.repository.models_to_load: the torch engine's one fused step, or the native ensembles and their
    steps), the plain encoder only with AOT_LOAD_VANILLA=1; every model of a folder that is not an AoT repository."""
    repo = flag(command, "--model-repository")
    try:
        info = read_repository(Path(repo).parent) if repo is not None and os.path.isdir(repo) else None
    except (ValueError, OSError):
        info = None
    if info is None:
        return ["--load-model=*"]
    return [f"--load-model={m}" for m in models_to_load(info, "gpu", settings.LOAD_VANILLA.read())]


def _later(seconds: float, call: Callable[[], None]) -> None:
    timer = threading.Timer(seconds, call)
    timer.daemon = True  # a server that exits meanwhile ends the supervisor at once
    timer.start()


def graceful_stop(server: ServerLifecycle, health: HealthServer, drain_seconds: float,
                  later: Callable[[float, Callable[[], None]], None] = _later) -> Callable:
    """The supervisor's handler of stop signals. The first SIGTERM drains: /ready answers 503 at once (the
    orchestrator takes the server out of its endpoints) while requests are still answered, and `drain_seconds` later
    (`later` schedules it, on a thread of its own) the server stops gracefully: new requests refused on both
    protocols, the accepted ones finished, then the signal (ServerLifecycle.stop_gracefully). SIGINT, or a second
    SIGTERM: forwarded at once."""
    def stop(sig: int, _frame=None) -> None:
        if sig != signal.SIGTERM or health.draining is not None:
            server.forward(sig)
            return
        health.drain(f"draining: the server stops in {drain_seconds:g} s (SIGTERM); send requests elsewhere")
        print(f"supervisor: SIGTERM: draining for {drain_seconds:g} s, then stopping", file=sys.stderr, flush=True)
        later(drain_seconds, lambda: server.stop_gracefully(sig))

    return stop


def main(argv: list[str] | None = None, store_check_of: Callable[[str], Callable | None] | None = None) -> int:
    """Run the server under a supervisor. Adds explicit model control and the API restrictions (the admin key from
    AOT_ADMIN_KEY or AOT_ADMIN_KEY_FILE, else one generated for this run and known to the supervisor alone), serves
    /ready and /live on AOT_HEALTH_PORT (its default: aot.settings), stops gracefully on SIGTERM (a rolling update's
    stop: /ready answers 503 for AOT_DRAIN_SECONDS while requests are still answered, then new requests are refused,
    the accepted ones finished, and the signal reaches the server; a second signal, or SIGINT, is forwarded at once),
    and reaps the stubs when the server exits; a server with a model that could not be reloaded is stopped, and the
    exit code is 1 (the container's restart policy starts anew)."""
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python3 -m aot.serving tritonserver [ARGS...]", file=sys.stderr)
        return 2
    if any(a.split("=", 1)[0] in RESTRICTION_FLAGS for a in command):
        print(f"supervisor: do not pass {' or '.join(RESTRICTION_FLAGS)}: the supervisor restricts "
              f"{', '.join(RESTRICTED_APIS)} itself; give the key through {settings.ADMIN_KEY.name} or {settings.ADMIN_KEY_FILE.name}",
              file=sys.stderr)
        return 2
    try:
        key = admin_key_from_environment() or generate_admin_key()
        health_port = settings.HEALTH_PORT.read()
        health_address = settings.HEALTH_ADDRESS.read()
        drain_seconds = settings.DRAIN_SECONDS.read()
        settings.CLIENT_ADDRESS_HEADER.read()  # forwarded to the steps (ServerLifecycle.start): refused here if bad
    except (AdminKeyError, settings.SettingError) as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return 2
    if not any(a.startswith("--model-control-mode") for a in command):
        command += ["--model-control-mode=explicit", *load_flags(command)]
    port = flag(command, "--http-port") or TRITON_HTTP_PORT
    models = flag(command, "--model-repository") or flag(command, "--model-store")
    server = ServerLifecycle(f"127.0.0.1:{port}", key, stop_timeout=None,  # the container's runtime kills
                             region_bytes=region_bound_of(models) if models else None,
                             store_check=store_check_of(models) if models and store_check_of else None)
    if models:
        compile_steps(Path(models))  # the stubs run the `python3` on PATH
    server.start(command)
    health = HealthServer(server.current_supervisor, health_address,
                          health_port).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, graceful_stop(server, health, drain_seconds))
    try:
        server.wait_ready()
        server.watch()
    except ServerExited:  # before it was ready (a stop included): its exit code says why
        pass
    health.stop()
    code = server.stop(None)
    return 1 if server.failed else code


if __name__ == "__main__":
    raise SystemExit(main())
