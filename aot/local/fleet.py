"""A local fleet: N tritonservers (LocalServer) on one model repository behind HAProxy (`aot serve --replicas N`).

Why this holds together: a task is data in the shared store, resolved per request (the tokenizer stats the
manifest before each batch), never a Triton model load, so every replica serves a publish, a replacement or a
removal on its next batch, and a replica that starts late serves every published task with no extra step.

The load balancer is HAProxy (Debian's package, installed by scripts/setup.sh), generated from one template:
- gRPC (HTTP/2, balanced per request, not per connection) and HTTP on the usual ports; the replicas listen on
  loopback ports of their own, their metrics on --metrics-port + 2*i and their /ready, /live on --health-port + 2*i
  (replica 0 keeps today's ports);
- active health checks on each replica's supervisor `/ready` (aot.serving.supervision.health: 200 only when every model
  is loaded and answering and no repair runs), so a replica that starts, restarts or repairs a step gets no traffic;
  a connection error marks a replica down at once (observe layer4), before its next check;
- L7 retries on another replica (`retry-on` + `option redispatch`): inference is idempotent, so a request that a
  killed replica never answered is sent again, and the client sees no failure;
- each request carries the client's address (aot-client-address, set by HAProxy over whatever the client sent), so
  that keyless clients share the replicas' anonymous rate fairly (aot.serving.rate_limits);
- bounded requests and connections: a body larger than any client needs (aot.serving.limits) is refused before a
  replica reads it, idle and slow connections are closed within seconds, maxconn follows the open-file limit.
Each replica restarts its own dead tritonserver (LocalServer), and the fleet restarts a dead HAProxy within a fraction
of a second, the replicas untouched; one replica failing for good leaves the others serving (`failed` says so only
when none is left, or HAProxy died MAX_BALANCER_RESTARTS times in a minute).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from aot import settings
from aot.local.processes import stop_process_group
from aot.local.server import Endpoints, LocalServer, ServerError, free_ports, port_is_free, write_key_file
from aot.serving.limits import request_bounds
from aot.serving.repository import read_repository
from aot.serving.supervision.admin_key import resolve_admin_key
from aot.serving.supervision.lifecycle import WATCH_SECONDS, die_with_parent, raise_open_file_limit

PORT_STRIDE = 2  # replica i: metrics on --metrics-port + 2*i, health on --health-port + 2*i (8002/8003, 8004/8005, ...)
CHECK_INTERVAL_MS = 500  # HAProxy's /ready checks: a replica is down after 2 failed ones, up after 2 good ones
RETRIES = 3  # HAProxy's retries of a request a replica did not answer, each on another replica
HEADER_BYTES = 16 * 1024  # request headers HAProxy accepts (a gRPC call sends a few hundred bytes)
MAXREWRITE = 1024  # HAProxy's reserve in each buffer for rewriting headers
# Connections (seconds): a client connection idle this long is closed, one that never sent a byte too (gRPC clients
# reconnect on their next call), so idle connections cannot fill maxconn for long; a request's headers and body must
# arrive within REQUEST_SECONDS once it began (slowloris); a replica may take SERVER_SECONDS to answer (the client's
# own timeout is 60 s).
CLIENT_IDLE_SECONDS, REQUEST_SECONDS, SERVER_SECONDS = 30, 10, 120
FD_RESERVE = 256  # descriptors HAProxy keeps for itself (listeners, health checks, its log)
MAX_BALANCER_RESTARTS = 3  # HAProxy deaths in RESTART_WINDOW seconds before the fleet gives up
CLIENT_ADDRESS_HEADER = "aot-client-address"  # set by HAProxy to the client's address; the replicas trust it
RESTART_WINDOW = 60.0


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/sbin/haproxy") if os.path.isfile(p)),
                                            None)
    if found is None:
        raise ServerError("--replicas needs HAProxy, the fleet's load balancer: run scripts/setup.sh "
                          "(apt-get install haproxy)")
    return found


def max_connections(open_files: int) -> int:
    """HAProxy's maxconn from its open-file limit: a proxied connection may hold two descriptors (the client's and,
    for HTTP/1, one to a replica)."""
    return max(256, (open_files - FD_RESERVE) // 2)


def haproxy_config(host: str, grpc_port: int, http_port: int, replicas: list[LocalServer], socket_path: Path,
                   body_bytes: int, maxconn: int) -> str:
    """The fleet's HAProxy configuration: both frontends and their backends generated from the replica list. A
    request body larger than `body_bytes` (aot.serving.limits: what a client needs at most) is refused before any
    replica reads it: HTTP 413 (with a JSON message over HTTP)."""
    grpc_servers = "\n".join(
        f"    server r{i} {r.host}:{r.grpc_port} proto h2 check port {r.health_port} check-proto h1 "
        f"inter {CHECK_INTERVAL_MS} fall 2 rise 2 observe layer4 error-limit 1 on-error mark-down"
        for i, r in enumerate(replicas))
    http_servers = "\n".join(f"    server r{i} {r.host}:{r.http_port} track grpc/r{i}" for i, r in enumerate(replicas))
    too_large = f"request body larger than {body_bytes} bytes (the limit of this deployment)"
    headers = f"request headers larger than {HEADER_BYTES} bytes"
    return f"""# generated by aot serve --replicas {len(replicas)} (aot/local/fleet.py)
global
    log stderr format raw local0 notice
    stats socket {socket_path} mode 600 level operator
    maxconn {maxconn}
    # a request is read whole before it is sent on (refused when larger than {body_bytes} bytes, and retried on
    # another replica when one fails): the buffer holds the largest one, its headers and HAProxy's reserve
    tune.bufsize {body_bytes + HEADER_BYTES + MAXREWRITE + 1024}
    tune.maxrewrite {MAXREWRITE}

defaults
    mode http
    log global
    option httplog
    option dontlog-normal  # the log keeps failed, retried and redispatched requests, not every answer
    timeout connect 2s
    timeout client {CLIENT_IDLE_SECONDS}s
    timeout http-request {REQUEST_SECONDS}s
    timeout http-keep-alive {CLIENT_IDLE_SECONDS}s
    timeout server {SERVER_SECONDS}s
    # a slow /ready is a busy replica, not a broken one (a dead one is refused at once): taking it out would pile
    # its load onto the others
    timeout check 5s
    # inference is idempotent: a request a replica did not answer is sent again, to another replica
    retries {RETRIES}
    option redispatch 1
    retry-on conn-failure empty-response 502 504
    option httpchk GET /ready
    http-check expect status 200
    option http-buffer-request

frontend grpc
    bind {host}:{grpc_port} proto h2
    # the client's address, for the replicas' fair shares of the keyless rate (aot.serving.rate_limits): whatever
    # a client sent under that name is replaced
    http-request set-header {CLIENT_ADDRESS_HEADER} %[src]
    acl large_headers req.hdrs,length gt {HEADER_BYTES}
    acl large_body req.body_len gt {body_bytes}
    # a gRPC client reports these as "Received http2 header with status: 413" (a status carried in a trailer
    # would be lost: HAProxy resets a stream whose body it did not read)
    http-request deny deny_status 413 if large_headers || large_body
    default_backend grpc

frontend http
    bind {host}:{http_port}
    http-request set-header {CLIENT_ADDRESS_HEADER} %[src]
    acl large_headers req.hdrs,length gt {HEADER_BYTES}
    acl large_body req.body_len gt {body_bytes}
    http-request return status 431 content-type application/json string '{{"error":"{headers}"}}' if large_headers
    http-request return status 413 content-type application/json string '{{"error":"{too_large}"}}' if large_body
    default_backend http

backend grpc
    balance leastconn
{grpc_servers}

backend http
    balance leastconn
{http_servers}
"""


@dataclass
class Fleet(Endpoints):
    """`replicas` LocalServers on `repo` behind HAProxy on host:grpc_port and host:http_port. Use as a context
    manager or call start()/stop(). `server_options` go to every LocalServer (pool_bytes, device, ...)."""

    repo: Path
    replicas: int = 2
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0  # replica i: metrics_port + 2*i (0: free ports)
    health_port: int = 0  # replica i: health_port + 2*i (0: free ports)
    admin_key: str | None = field(default=None, repr=False)  # shared by every replica (AOT_ADMIN_KEY... if None)
    server_options: dict = field(default_factory=dict)
    servers: list[LocalServer] = field(default_factory=list)
    balancer: subprocess.Popen | None = None
    balancer_restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart of HAProxy
    _reported: set = field(default_factory=set, init=False, repr=False)  # replicas already reported failed

    def __post_init__(self):
        if self.replicas < 2:
            raise ServerError(f"a fleet has at least 2 replicas, got {self.replicas} (--replicas 1: one server, no "
                              "load balancer)")
        self.repo = Path(self.repo).resolve()
        self.haproxy = haproxy_binary()
        # every port chosen at once, so that no two collide: the LB's two, and four per replica (loopback)
        spare = iter(free_ports(2, self.host) + free_ports(4 * self.replicas))
        self.grpc_port, self.http_port = self.grpc_port or next(spare), self.http_port or next(spare)
        self.admin_key = resolve_admin_key(self.admin_key)
        self._workdir = Path(tempfile.mkdtemp(prefix="aot-fleet-"))
        self.log_path = self._workdir / "haproxy.log"
        self.socket_path = self._workdir / "haproxy.sock"
        self.config_path = self._workdir / "haproxy.cfg"
        self.admin_key_path = write_key_file(self._workdir, self.admin_key)  # the fleet's: a replica's goes at restarts
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._balancer_failed: str | None = None
        steps = self.server_options.get("step_environment", {})  # the replicas trust HAProxy's address header
        self.server_options = self.server_options | {
            "step_environment": steps | {settings.CLIENT_ADDRESS_HEADER.name: CLIENT_ADDRESS_HEADER}}
        self.servers = [LocalServer(self.repo, "127.0.0.1", next(spare), next(spare),
                                    self._port(self.metrics_port, i, spare), self._port(self.health_port, i, spare),
                                    admin_key=self.admin_key, **self.server_options) for i in range(self.replicas)]

    @staticmethod
    def _port(base: int, i: int, spare) -> int:
        """Replica i's port for a flag's `base` (0: a free one)."""
        chosen = next(spare)
        return base + PORT_STRIDE * i if base else chosen


    def check_ports(self) -> None:
        ports = [("--grpc-port", self.grpc_port), ("--http-port", self.http_port)]
        ports += [(f"replica {i} {flag}", port) for i, s in enumerate(self.servers)
                  for flag, port in (("metrics port", s.metrics_port), ("health port", s.health_port))]
        seen: dict[int, str] = {}
        for what, port in ports:
            if port in seen:
                raise ServerError(f"{seen[port]} and {what} are both {port}: replica i takes --metrics-port + "
                                  f"{PORT_STRIDE}*i and --health-port + {PORT_STRIDE}*i; choose ports further apart")
            seen[port] = what
        for what, port in ports[:2]:
            if not port_is_free(self.host, port):
                raise ServerError(f"port {self.host}:{port} ({what}) is already in use; choose another {what}")

    def start(self, timeout: float = 180) -> "Fleet":
        """Start every replica, then HAProxy; wait until HAProxy sees every replica up, and watch it from then on
        (restarted when it dies). The replicas start one after the other from this thread: a server dies with the
        thread that started it (PR_SET_PDEATHSIG is per thread), so none may be started from a pool's short-lived
        worker."""
        self.check_ports()
        try:
            for server in self.servers:
                server.start(timeout)
            self.config_path.write_text(haproxy_config(
                self.host, self.grpc_port, self.http_port, self.servers, self.socket_path,
                request_bounds(read_repository(self.repo)).body_bytes, max_connections(raise_open_file_limit())))
            check = subprocess.run([self.haproxy, "-c", "-q", "-f", str(self.config_path)], capture_output=True,
                                   text=True)
            if check.returncode != 0:
                raise ServerError(f"haproxy refused its configuration {self.config_path}: "
                                  f"{(check.stderr or check.stdout).strip()}")
            self._start_balancer("w")
            self.wait_all_up(timeout=30)
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch_balancer, name="aot-fleet-balancer", daemon=True)
        self._watcher.start()
        return self

    def _start_balancer(self, mode: str = "a") -> None:
        with open(self.log_path, mode) as log:
            self.balancer = subprocess.Popen([self.haproxy, "-db", "-f", str(self.config_path)], stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, preexec_fn=die_with_parent)

    def _watch_balancer(self) -> None:
        """Start HAProxy again when it dies (the replicas serve on, untouched; clients retry the connections it
        refused meanwhile): at most MAX_BALANCER_RESTARTS times in RESTART_WINDOW seconds, then `failed` says why."""
        while not self._stopping.wait(WATCH_SECONDS):
            code = self.balancer.poll()
            if code is None:
                continue
            now = time.monotonic()
            self.balancer_restarts = [t for t in self.balancer_restarts if now - t < RESTART_WINDOW] + [now]
            if len(self.balancer_restarts) > MAX_BALANCER_RESTARTS:
                self._balancer_failed = (f"haproxy died {len(self.balancer_restarts)} times in "
                                         f"{RESTART_WINDOW:.0f} s (last exit code {code}; log: {self.log_path})")
                return
            print(f"aot: haproxy exited with code {code}; restarting it", file=sys.stderr, flush=True)
            self._start_balancer()

    def _stats(self) -> list[list[str]]:
        """HAProxy's stats socket's `show stat`: one row per frontend, backend and server (pxname, svname, qcur,
        qmax, scur, ..., status at 17)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(str(self.socket_path))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return [line.split(",") for line in data.decode().splitlines() if line and not line.startswith("#")]

    def states(self) -> dict[str, str]:
        """HAProxy's view of each replica: {"r0": "UP", "r1": "DOWN", ...}."""
        return {row[1]: row[17].split(" ")[0] for row in self._stats() if row[0] == "grpc" and row[1].startswith("r")}

    def in_flight(self, replica: str) -> int:
        """Requests HAProxy has sent to `replica` (r0, r1, ...) and not yet answered, or queued for it: gRPC and HTTP."""
        return sum(int(row[2] or 0) + int(row[4] or 0) for row in self._stats()
                   if row[0] in ("grpc", "http") and row[1] == replica)

    def _wait_for(self, what: str, done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise ServerError(f"{what} within {timeout:.0f} s (haproxy sees {self.states()})")
            time.sleep(0.05)

    def restart_replica(self, i: int, timeout: float = 180) -> None:
        """One step of a rolling restart, losing no request: replica i drains (its /ready answers 503) until HAProxy
        has taken it out of rotation and holds no request of it, then stops (tritonserver finishes what it
        accepted), starts again on the same ports, and is back in rotation once HAProxy sees it up. The other
        replicas serve meanwhile; a request HAProxy sent before it saw the drain is answered by the draining one."""
        old, name = self.servers[i], f"r{i}"
        old.drain()
        self._wait_for(f"haproxy did not take {name} out of rotation", lambda: self.states().get(name) != "UP", 30)
        self._wait_for(f"{name} kept requests in flight", lambda: self.in_flight(name) == 0, SERVER_SECONDS)
        old.stop()
        new = self.servers[i] = LocalServer(self.repo, old.host, old.http_port, old.grpc_port, old.metrics_port,
                                            old.health_port, admin_key=self.admin_key, **self.server_options)
        new.start(timeout)
        self._wait_for(f"haproxy did not see the restarted {name} up", lambda: self.states().get(name) == "UP", 30)

    def rolling_restart(self, until: threading.Event | None = None) -> None:
        """Restart every replica, one after the other (restart_replica), from the thread that started the fleet (a
        server dies with the thread that started it); stop between two replicas when `until` is set."""
        for i in range(len(self.servers)):
            if until is not None and until.is_set():
                return
            print(f"aot: rolling restart: replica {i} of {len(self.servers)} drains, restarts and rejoins",
                  file=sys.stderr, flush=True)
            self.restart_replica(i)
        print(f"aot: rolling restart done: {len(self.servers)} replicas restarted", file=sys.stderr, flush=True)

    def wait_all_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.balancer.poll() is not None:
                raise ServerError(f"haproxy exited with code {self.balancer.returncode}: {self.log_tail()}")
            try:
                states = self.states()
                if len(states) == len(self.servers) and all(v == "UP" for v in states.values()):
                    return
            except OSError:
                states = {}
            if time.monotonic() > deadline:
                raise ServerError(f"haproxy did not see every replica up within {timeout:.0f} s: {states}")
            time.sleep(0.1)

    @property
    def failed(self) -> str | None:
        """Why the fleet cannot serve (HAProxy died too often, or every replica failed for good); None while one
        serves. A replica that fails alone is reported once on stderr, and the others go on."""
        if self._balancer_failed:
            return self._balancer_failed
        for i, server in enumerate(self.servers):
            if server.failed and i not in self._reported:
                self._reported.add(i)
                print(f"aot: warning: replica {i} is down for good: {server.failed} (log: {server.log_path}); the "
                      "other replicas serve", file=sys.stderr, flush=True)
        if all(s.failed for s in self.servers):
            return f"every replica failed (last: {self.servers[-1].failed})"
        return None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop HAProxy, then every replica; safe to call again. The work folder is kept when something failed."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=10)
        self.admin_key_path.unlink(missing_ok=True)  # a secret outlives no fleet
        if self.balancer is not None:
            stop_process_group(self.balancer, grace=10)
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda s: s.stop(), self.servers))
        if not any(s.failed for s in self.servers):
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
