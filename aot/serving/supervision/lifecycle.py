"""One tritonserver under a supervisor, from start to reaped: what both the container's entry point
(`python3 -m aot.serving`) and `aot serve` (aot.local.server.LocalServer) run.

- start: tritonserver with the control API restricted to the admin key (aot.serving.supervision.admin_key), the
  client-address header forwarded to the steps when one is trusted (aot.serving.rate_limits), and the open-file limit
  raised to its hard limit (each client connection takes a descriptor: at a common soft limit of 1,024,
  2,000 idle connections left tritonserver unable to accept any more);
- wait_ready: until Triton's own readiness says 200 (enough while it starts), then the Supervisor
  (aot.serving.supervision.supervisor) watches its stubs and models;
- forward: a stop signal reaches the server after the supervisor has stopped repairing (the models a stopping
  server unloads are not dead steps to reload); stop_gracefully first refuses new requests, finishes the accepted
  ones and closes the HTTP connections that would hold Triton's stop (aot.serving.supervision.quiesce);
- watch: until the server exits; a server whose supervisor gave a model up (`failed`) is stopped, and its owner
  starts a new one (the container's restart policy, or LocalServer);
- stop: gracefully (stop_gracefully's SIGTERM), then SIGKILL to the server alone (its stubs then remove their
  shared memory), then `reap`: the stubs may outlive the server (they ignore SIGTERM by design and check their
  parent only every 300 ms, a zombie parent still looks alive, and an `aot` stub's own exit can deadlock), so they
  are killed and their shared-memory regions and watch files removed (aot.serving.supervision.sweeper, whose
  sweeper process does it when the owner of a server in a group of its own was killed before it could).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aot import settings
from aot.serving.limits import RequestBounds
from aot.serving.supervision.admin_key import restriction_args
from aot.serving.supervision.quiesce import CLOSE_SECONDS, close_http, finish_accepted
from aot.serving.supervision.supervisor import Supervisor
from aot.serving.supervision.sweeper import reap, start_sweeper, stop_sweeper

_PR_SET_PDEATHSIG = 1
WATCH_SECONDS = 0.05  # how often a watched server's exit is checked (a restart begins that much after a crash)
# The gRPC front end (Triton 2.51's flags; its HTTP front end has none, and none is an idle timeout): the server pings
# each connection every 30 s, idle or not, and closes one whose peer has not answered within 10 s (a client host that
# vanished); every connection is closed after 10 minutes (GOAWAY: clients reconnect at once, calls in flight get 30 s
# to finish), so an idle one holds its descriptor that long at most (times in ms). No request objects are kept for
# reuse: a kept one keeps the largest message it ever held (an oversized request's hundreds of MB, measured).
FRONT_END_FLAGS = {"--grpc-keepalive-time": 30_000, "--grpc-keepalive-timeout": 10_000,
                   "--grpc-keepalive-permit-without-calls": 1, "--grpc-http2-max-pings-without-data": 0,
                   "--grpc-max-connection-age": 600_000, "--grpc-max-connection-age-grace": 30_000,
                   "--grpc-infer-allocation-pool-size": 0}


class ServerError(RuntimeError):
    pass


class ServerExited(ServerError):
    """tritonserver exited by itself before it was ready."""


def compile_steps(models: Path, python: str | Path = "python3") -> None:
    """Each step's model.py compiled by the Python its stub runs, before tritonserver starts. Else the stub's first
    import writes `__pycache__` into the model's version folder while Triton loads it, Triton takes the model for
    modified since, and the supervisor's in-place replacement of one instance (aot.serving.supervision.instance_groups)
    becomes a reload of the whole model. A read-only repository is left alone (its stubs cannot write there either)."""
    try:
        subprocess.run([str(python), "-m", "compileall", "-q", str(models)], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pass


def front_end_args(command: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """FRONT_END_FLAGS that `command` does not set itself, and the forwarding of the client-address header to the
    steps when `environ` (the server's) names one (AOT_CLIENT_ADDRESS_HEADER: aot.serving.rate_limits)."""
    flags = dict(FRONT_END_FLAGS)
    header = settings.CLIENT_ADDRESS_HEADER.read(environ)
    if header is not None:  # gRPC metadata keys are lower-case; HTTP header names keep the case a client sent
        flags |= {"--grpc-header-forward-pattern": f"^{header}$", "--http-header-forward-pattern": f"(?i)^{header}$"}
    given = {a.split("=", 1)[0] for a in command}
    return [f"{flag}={value}" for flag, value in flags.items() if flag not in given]


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux prctl)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        pass


def raise_open_file_limit() -> int:
    """This process's soft limit of open files raised to its hard limit (children inherit it; an unlimited hard
    limit means the kernel's fs.nr_open); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            return soft
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def http_ok(url: str, timeout: float) -> bool:
    """GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class ServerLifecycle:
    """tritonserver processes one after the other (LocalServer starts a new one when one died): `process` is the
    latest, `supervisor` the one that watches it once it was ready (the previous one until then)."""

    http_url: str  # host:port of the server's HTTP API: its readiness, the supervisor's calls
    admin_key: str = field(repr=False)  # the control API's key (never in a repr or a log)
    supervise: bool = True
    log: Callable[[str], None] = _to_stderr
    log_path: Path | None = None  # the server's output (None: this process's own, as in the container)
    own_group: bool = False  # a process group of its own that dies with the thread that started it, and a sweeper
    # that reaps its stubs if this process is killed (LocalServer)
    stop_timeout: float | None = 15.0  # SIGTERM to SIGKILL when a failed server is stopped (None: wait)
    region_bytes: RequestBounds | None = None  # a stub's shared memory past its bound is replaced (aot.serving.limits)
    store_check: Callable | None = None  # what /ready checks beside the steps (Supervisor.store_check)
    process: subprocess.Popen | None = None
    supervisor: Supervisor | None = None
    ready_seconds: float | None = None
    sweeper: subprocess.Popen | None = None  # aot.serving.supervision.sweeper, with own_group

    def __post_init__(self):
        self._stopping = threading.Event()  # a stop signal was forwarded: no supervisor starts, none repairs
        self._started = 0.0
        self._command: list[str] = []

    def start(self, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """tritonserver `command` (its binary and flags), the API restrictions and the front end's flags added. Its
        output goes to log_path, overwritten by the first process and appended to by the next ones."""
        raise_open_file_limit()
        command = command + front_end_args(command, env)
        self._started = time.monotonic()
        options = {}
        if self.own_group:
            options = {"stdin": subprocess.DEVNULL, "start_new_session": True, "preexec_fn": die_with_parent}
        command = command + restriction_args(self.admin_key)
        self._command = command
        with open(self.log_path or os.devnull, "w" if self.process is None else "a") as log:
            output = {} if self.log_path is None else {"stdout": log, "stderr": subprocess.STDOUT}
            self.process = subprocess.Popen(command, env=env, **output, **options)
            if self.own_group:
                self.sweeper = start_sweeper(self.process, log)
        return self.process

    def triton_ready(self) -> bool:
        """Triton's own readiness: enough while it starts (the supervisor begins after it)."""
        return http_ok(f"http://{self.http_url}/v2/health/ready", 1)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until the server is ready (`ready_seconds` after start), then start its supervisor. ServerExited when it
        exits first (after a forwarded stop too); ServerError when it is not ready within `timeout` seconds (it is
        stopped then)."""
        while timeout is None or time.monotonic() - self._started < timeout:
            if self.process.poll() is not None:
                raise ServerExited(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                   + self._tail())
            if not self._stopping.is_set() and self.triton_ready():
                self.ready_seconds = time.monotonic() - self._started
                if self.supervise:
                    self.supervisor = Supervisor(self.process.pid, self.http_url, self.admin_key, log=self.log,
                                                 region_bytes=self.region_bytes, store_check=self.store_check).start()
                return
            time.sleep(0.05)
        self.stop(self.stop_timeout)
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s{self._tail()}")

    def _tail(self) -> str:
        return "" if self.log_path is None else f":\n{log_tail(self.log_path)}"

    def current_supervisor(self) -> Supervisor | None:
        """The supervisor of the running tritonserver (None while it starts or restarts): what /ready asks."""
        process, supervisor = self.process, self.supervisor
        if process is None or process.poll() is not None or supervisor is None:
            return None
        return supervisor if supervisor.server_pid == process.pid else None

    @property
    def failed(self) -> list[str]:
        """The models the supervisor gave up: the server cannot serve them."""
        return [] if self.supervisor is None else self.supervisor.failed

    def forward(self, sig: int, _frame=None) -> None:
        """A stop signal (a signal handler): the supervisor stops first, then the server gets the signal at once."""
        self._stopping.set()
        if self.supervisor is not None:
            self.supervisor.stop_watching()
        self._signal(sig)

    def stop_gracefully(self, sig: int = signal.SIGTERM) -> None:
        """The end of a graceful stop (not from a signal handler: it waits): the supervisor stops repairing, the
        steps refuse new requests and finish the accepted ones, the server's HTTP connections are closed, and the
        server gets `sig` (aot.serving.supervision.quiesce). Returns once it was signalled."""
        self._stopping.set()
        if self.supervisor is not None:
            self.supervisor.stop_watching()
        if self.process is None or self.process.poll() is not None:
            return
        pid, port = self.process.pid, int(self.http_url.rsplit(":", 1)[1])
        if not finish_accepted(pid, self._command, self.log):
            self.log("supervisor: requests were still in flight at the exit timeout; stopping tritonserver anyway")
        close_http(pid, port, self.log)
        self._signal(sig)
        close_http(pid, port, self.log, CLOSE_SECONDS)  # any that opened before it stopped accepting

    def _signal(self, sig: int) -> None:
        if self.process.poll() is not None:
            return
        if self.own_group:  # start_new_session: the server leads its own group
            os.killpg(self.process.pid, sig)
        else:
            self.process.send_signal(sig)

    def watch(self, until: threading.Event | None = None) -> int | None:
        """Until the server exits (its exit code) or `until` is set (None). A server with a model its supervisor
        gave up is stopped: only a new server serves that model again."""
        until = until or threading.Event()
        while not until.wait(WATCH_SECONDS):
            if self.process.poll() is not None:
                return self.process.returncode
            if self.failed and not self._stopping.is_set():
                self.log(f"supervisor: {', '.join(self.failed)} could not be reloaded; stopping tritonserver")
                self.stop(self.stop_timeout)
        return None

    def stop(self, timeout: float | None = 15) -> int | None:
        """Stop the supervisor and the server (stop_gracefully; `timeout` seconds after its SIGTERM, SIGKILL to the
        server alone, so that its stubs still remove their shared memory), then reap; safe to call again, and after
        the server exited."""
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.stop_gracefully()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)  # alone first: the stubs then clean their shared memory
                self.process.wait()
                time.sleep(2)
        reap(self.process.pid, self.supervisor.regions if self.supervisor else ())
        if self.own_group:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            stop_sweeper(self.sweeper)
        return self.process.returncode
