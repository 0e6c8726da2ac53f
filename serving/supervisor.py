"""`python3 -m serving.supervisor tritonserver ARGS...`: the container's entry point (docker-compose.yml,
deploy/kubernetes): tritonserver under a supervisor, its control API closed to clients.

The rooms it puts together: serving.admin_key (the key and the API restrictions), serving.lifecycle (one server
from start to reaped), serving.repairs (the Supervisor: dead, stopped or silent steps repaired), serving.health
(/ready and /live on the health port), serving.procfs (the stubs, from /proc), serving.shm and serving.watch.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from serving.admin_key import (ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, RESTRICTED_APIS, RESTRICTION_FLAGS, AdminKeyError,
                               admin_key_from_environment, generate_admin_key)
from serving.health import HealthServer
from serving.lifecycle import ServerExited, ServerLifecycle, compile_steps
from serving.limits import region_bound_of
from serving.repository import VANILLA_MODELS
from serving.store_check import store_root_of

LOAD_VANILLA_ENV = "AOT_LOAD_VANILLA"


def load_flags(command: list[str]) -> list[str]:
    """What the server loads when the command does not say: every model of its repository but the plain encoder
    (serving.repository.VANILLA_MODELS: comparisons only, one more engine on the GPU), which AOT_LOAD_VANILLA=1 adds."""
    repo = next((a.split("=", 1)[1] for a in command if a.startswith("--model-repository=")), None)
    if repo is None or os.environ.get(LOAD_VANILLA_ENV) == "1" or not os.path.isdir(repo):
        return ["--load-model=*"]
    return [f"--load-model={p.name}" for p in sorted(Path(repo).iterdir())
            if (p / "config.pbtxt").is_file() and p.name not in VANILLA_MODELS]


def main(argv: list[str] | None = None) -> int:
    """Run the server under a supervisor. Adds explicit model control and the API restrictions (the admin key from
    AOT_ADMIN_KEY or AOT_ADMIN_KEY_FILE, else one generated for this run and known to the supervisor alone), serves
    /ready and /live on AOT_HEALTH_PORT (default 8003), forwards SIGTERM/SIGINT, and reaps the stubs when the server
    exits; a server with a model that could not be reloaded is stopped, and the exit code is 1 (the container's
    restart policy starts anew)."""
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python3 -m serving.supervisor tritonserver [ARGS...]", file=sys.stderr)
        return 2
    if any(a.split("=", 1)[0] in RESTRICTION_FLAGS for a in command):
        print(f"supervisor: do not pass {' or '.join(RESTRICTION_FLAGS)}: the supervisor restricts "
              f"{', '.join(RESTRICTED_APIS)} itself; give the key through {ADMIN_KEY_ENV} or {ADMIN_KEY_FILE_ENV}",
              file=sys.stderr)
        return 2
    try:
        key = admin_key_from_environment() or generate_admin_key()
        health_port = int(os.environ.get("AOT_HEALTH_PORT", "8003"))
    except (AdminKeyError, ValueError) as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return 2
    if not any(a.startswith("--model-control-mode") for a in command):
        command += ["--model-control-mode=explicit", *load_flags(command)]
    port = next((a.split("=", 1)[1] for a in command if a.startswith("--http-port=")), "8000")
    models = next((a.split("=", 1)[1] for a in command if a.startswith(("--model-repository=", "--model-store="))),
                  None)
    server = ServerLifecycle(f"127.0.0.1:{port}", key, stop_timeout=None,  # the container's runtime kills
                             region_bytes=region_bound_of(models) if models else None,
                             store_root=store_root_of(models) if models else None)
    if models:
        compile_steps(Path(models))  # the stubs run the `python3` on PATH
    server.start(command)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.forward)
    health = HealthServer(server.current_supervisor, os.environ.get("AOT_HEALTH_ADDRESS", "0.0.0.0"),
                          health_port).start()
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
