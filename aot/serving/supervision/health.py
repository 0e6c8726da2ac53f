"""The supervisor's health port: readiness that tells the truth.

Triton's /v2/health/ready stays 200 while a model is unloaded or a stub hangs; the compose healthcheck, Kubernetes'
probes and the fleet's HAProxy ask this server's /ready instead (Supervisor.health), and /live."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from aot.serving.supervision.procfs import alive
from aot.serving.supervision.supervisor import Supervisor


class HealthServer:
    """GET /ready: 200 {"ready": true} when Supervisor.health() says so (and "warnings": what it serves without,
    an empty list when nothing: Supervisor.warnings; "instances": what each step instance holds, its task pool's
    bytes, its CUDA graphs' and device heads' memory: Supervisor.instances), else 503 with the reasons; GET /live: 200
    while the supervisor's server process runs (a stopped or crashed one is repaired or restarted by its owner,
    so liveness fails only when that owner is gone). Plain HTTP, no secrets: it says nothing a client could use.
    A server that drains (a graceful stop: drain()) is not ready from then on, whatever its steps say, so that load
    balancers send it nothing new while it still answers what reaches it."""

    def __init__(self, supervisor: Callable[[], Supervisor | None], host: str, port: int):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # http.server's name
                code, body = owner.answer(self.path)
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                try:
                    self.end_headers()
                    self.wfile.write(data)
                except ConnectionError:  # a load balancer's check may hang up once it has read the status line
                    pass

            timeout = 5  # seconds a connection may idle: a client cannot pile up handler threads

            def log_message(self, *args):  # probes every few seconds would flood the log
                pass

        self.supervisor = supervisor
        self.draining: str | None = None  # why /ready says 503 whatever the steps say (drain())
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="aot-health", daemon=True)

    def answer(self, path: str) -> tuple[int, dict]:
        supervisor = self.supervisor()
        if path.split("?")[0] == "/live":
            live = supervisor is not None and alive(supervisor.server_pid)
            return (200 if live else 503), {"live": live}
        if path.split("?")[0] == "/ready":
            if self.draining is not None:
                return 503, {"ready": False, "reasons": [self.draining]}
            if supervisor is None:
                return 503, {"ready": False, "reasons": ["tritonserver is starting"]}
            ready, reasons = supervisor.health()
            return (200 if ready else 503), {"ready": ready, "reasons": reasons, "warnings": supervisor.warnings(),
                                             "instances": supervisor.instances()}
        return 404, {"error": "GET /ready or /live"}

    def drain(self, reason: str) -> None:
        """Not ready from now on (503 with `reason`): the first step of a graceful stop."""
        self.draining = reason

    def start(self) -> "HealthServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

