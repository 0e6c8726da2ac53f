"""Keeping a tritonserver and its python-backend stubs honest, and its control API closed to clients.

Triton 2.51 never restarts a python-backend stub that died (kill -9, SIGBUS from a bad memory map, OOM): every
later request of that model fails ("Stub process 'backbone_0_0' is not healthy") while the model and the server
still report ready. Nor does it notice a stub that stopped answering (SIGSTOP, a deadlock, a call that never
returns): a stopped process counts as alive. The supervisor watches the stubs of one server (their command line
names the instance, the model file and the server's pid) and the models the repository needs, and repairs:
- a model whose stub is gone: unload, then load, through the repository API (--model-control-mode=explicit);
- a model whose stub is stopped (process state T), answered no liveness probe for `hung_seconds`, or has an
  instance stuck in one batch (serving.watch: probes go to whichever instance is free, so with several instances
  the others keep answering them): its stubs are killed first (a stopped stub must never resume: its stale IPC
  state aborted tritonserver), then it is reloaded;
- a model that is not loaded or not ready (an unloaded ensemble included): loaded again.
Each probe is a real inference request to the step with the parameter `aot_probe` (serving.steps answers it at
once, uncounted), so it proves the step's process runs its `execute`, not only that it exists.

Readiness that tells the truth: Triton's /v2/health/ready stays 200 while a model is unloaded or a stub hangs, so
the supervisor serves its own `/ready` (200 only when every model the repository needs is loaded, ready and
answering, and no repair runs) and `/live` on a health port (HealthServer): the compose healthcheck and Kubernetes'
probes use these.

The control API is closed to clients: tritonserver runs with --http-restricted-api / --grpc-restricted-protocol
on every API a client does not need (restriction_args), and the supervisor authenticates its own calls with the
deployment's admin key (header ADMIN_HEADER), never logged.

When the server dies, its stubs may outlive it (they ignore SIGTERM by design and check their parent only every
300 ms, and a zombie parent still looks alive): `reap` kills them and removes their shared-memory regions.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from serving import protocol
from serving.shm import STUB, make_private, region_path
from serving.watch import busy_since, remove_watches

MAX_ATTEMPTS = 3  # failed repairs in a row before a model is given up (and its owner told: Supervisor.failed)
UNLOAD_TIMEOUT = 10.0  # seconds for an unload (its stub is killed first when it hangs)
LOAD_TIMEOUT = 20.0  # seconds for a load (the backbone's takes ~1 s)
PROBE_SECONDS = 1.0  # between two liveness probes of one step
HUNG_SECONDS = 6.0  # a step that answered no probe for this long, and used no CPU meanwhile, is hung
BUSY_HUNG_SECONDS = 60.0  # one still using CPU (working through a long queue, the probe waiting behind it) is hung
#                            only after this long without an answer
BUSY_CPU_SECONDS = 0.01  # CPU a step uses between two checks (0.5 s) to count as working, not stuck
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# What a call to the server's HTTP API raises when the server cannot answer it right now (a busy or restarting
# server: refused, timed out, a connection dropped mid-answer)
_UNREACHABLE = (urllib.error.URLError, OSError, http.client.HTTPException)

# The control API: every API a client does not need is restricted to the admin key. Public: health, metadata
# and inference. shared-memory is restricted too: registering a region by name lets a client make the server
# read or write any /dev/shm region it can open, the python stubs' own included (a crash or a leak), and clients
# on other hosts cannot use shared memory anyway.
ADMIN_HEADER = "aot-admin-key"  # the HTTP header; gRPC metadata carries it as GRPC_ADMIN_HEADER (Triton's prefix)
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
ADMIN_KEY_ENV = "AOT_ADMIN_KEY"
ADMIN_KEY_FILE_ENV = "AOT_ADMIN_KEY_FILE"
RESTRICTED_APIS = ("model-repository", "model-config", "shared-memory", "statistics", "trace", "logging")
PUBLIC_APIS = ("health", "metadata", "inference")
_ADMIN_KEY = re.compile(r"[A-Za-z0-9_-]{16,256}")
RESTRICTION_FLAGS = ("--http-restricted-api", "--grpc-restricted-protocol")


class AdminKeyError(ValueError):
    pass


def check_admin_key(key: str, where: str) -> str:
    key = key.strip()
    if not _ADMIN_KEY.fullmatch(key):
        raise AdminKeyError(f"{where}: the admin key must be 16-256 letters, digits, '_' or '-' "
                            f"(got {len(key)} characters); e.g. python3 -c 'import secrets; "
                            "print(secrets.token_urlsafe(32))'")
    return key


def admin_key_from_environment(environ=None) -> str | None:
    """The deployment's admin key: AOT_ADMIN_KEY, or the file AOT_ADMIN_KEY_FILE names (a Docker or Kubernetes
    secret); None when neither is set."""
    environ = os.environ if environ is None else environ
    if environ.get(ADMIN_KEY_ENV):
        return check_admin_key(environ[ADMIN_KEY_ENV], ADMIN_KEY_ENV)
    if environ.get(ADMIN_KEY_FILE_ENV):
        path = Path(environ[ADMIN_KEY_FILE_ENV])
        try:
            return check_admin_key(path.read_text(), str(path))
        except OSError as exc:
            raise AdminKeyError(f"{ADMIN_KEY_FILE_ENV}={path}: cannot read it: {exc.strerror}") from None
    return None


def generate_admin_key() -> str:
    return secrets.token_urlsafe(32)


def restriction_args(key: str) -> list[str]:
    """tritonserver flags that restrict RESTRICTED_APIS over HTTP and gRPC to requests carrying the key."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"{flag}={apis}:{ADMIN_HEADER}={key}" for flag in RESTRICTION_FLAGS]


@dataclass(frozen=True)
class Stub:
    pid: int
    instance: str  # e.g. backbone_0_0
    model: str  # the model folder's name
    shm_region: str
    started: int = 0  # clock ticks after boot (/proc/<pid>/stat): which of two processes of one instance is newer


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _state(pid: int) -> str:
    """The process state letter of /proc/PID/stat ('' when gone): R, S, D, T (stopped), t (traced), Z (zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    """Running and not a zombie."""
    return _state(pid) not in ("", "Z")


def _stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP). Not `t`: a debugger or py-spy pauses a process that way while it samples."""
    return _state(pid) == "T"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _started(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def stub_processes(server_pid: int) -> list[Stub]:
    """Every live stub process a server started (argv: stub, model.py, shm region, sizes, parent pid, ...,
    instance). Two may carry one instance's name for a few seconds after a reload: the unloaded one on its way out,
    and the new one."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        argv = _cmdline(pid)
        if len(argv) > 8 and argv[0].endswith(STUB) and argv[5] == str(server_pid) and _alive(pid):
            found.append(Stub(pid, argv[8], Path(argv[1]).parents[1].name, argv[2], _started(pid)))
    return found


def stubs_of(server_pid: int) -> dict[str, Stub]:
    """The live stub of each instance: the newest process of that name (an unloaded one may linger a few seconds)."""
    found: dict[str, Stub] = {}
    for stub in sorted(stub_processes(server_pid), key=lambda s: (s.started, s.pid)):
        found[stub.instance] = stub
    return found


def remove_regions(regions) -> None:
    for region in regions:
        region_path(region).unlink(missing_ok=True)


def reap(server_pid: int, regions=()) -> None:
    """After the server exited: SIGKILL its stubs and remove their (and `regions`') shared memory."""
    stubs = {s.pid: s for s in stub_processes(server_pid)}
    for stub in stubs.values():
        try:
            os.kill(stub.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while any(_alive(s.pid) for s in stubs.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    remove_regions({s.shm_region for s in stubs.values()} | set(regions))
    remove_watches(server_pid)


@dataclass
class Repair:
    model: str
    instance: str
    detected: float  # time.time()
    cause: str = "died"  # died, hung, not ready
    seconds: float | None = None  # until the model served again (None: the repair failed)
    error: str | None = None


@dataclass
class Supervisor:
    """Watches the stubs and models of a running server every `interval` seconds and repairs what is broken;
    `health()` says whether the server can answer right now."""

    server_pid: int
    http_url: str  # host:port
    admin_key: str | None = field(default=None, repr=False)  # sent with every repository API call
    interval: float = 0.5
    log: Callable[[str], None] = print
    hung_seconds: float = HUNG_SECONDS
    repairs: list[Repair] = field(default_factory=list)
    regions: set[str] = field(default_factory=set)  # every shm region seen (removed by reap)

    def __post_init__(self):
        self.expected: dict[str, str] = {}  # instance -> model
        # instance -> start time of the process watched: an older process of that name left behind by a reload is
        # not the instance (a killed new stub beside a lingering unloaded one is dead, not alive)
        self._watched: dict[str, int] = {}
        self.models: set[str] = set()  # every model the server had loaded at start (ensembles too)
        self.repairing: str | None = None
        self._answered: dict[str, float] = {}  # python model -> time.monotonic() of its last probe answer
        self._working: dict[str, tuple[float, float]] = {}  # model -> (its stubs' CPU seconds, when it last grew)
        self._instance_cpu: dict[str, tuple[float, float]] = {}  # instance -> (its CPU seconds, when it last grew)
        self._stopped_seen: set[int] = set()  # stub pids seen stopped at the last check
        self._failures: dict[str, int] = {}  # model -> failed repairs in a row
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aot-supervisor", daemon=True)
        self._lock = threading.Lock()
        self._probers: list[threading.Thread] = []

    def _see_regions(self, stubs: dict[str, Stub]) -> None:
        """Remember every stub's region (reap removes them) and make each new one private (serving.shm)."""
        new = {s.shm_region for s in stubs.values()} - self.regions
        make_private(new)
        self.regions |= new

    def start(self, probe: bool = True) -> "Supervisor":
        stubs = stubs_of(self.server_pid)
        self.expected = {s.instance: s.model for s in stubs.values()}
        self._watched = {s.instance: s.started for s in stubs.values()}
        self._see_regions(stubs)
        try:
            self.models = {m["name"] for m in self._index() if m.get("state") == "READY"}
        except (*_UNREACHABLE, ValueError) as exc:
            self.log(f"supervisor: could not read the repository index ({exc}); watching the stubs only")
        if probe:
            now = time.monotonic()
            for model in sorted(set(self.expected.values())):
                self._answered[model] = now
                thread = threading.Thread(target=self._prober, args=(model,), name=f"aot-probe-{model}", daemon=True)
                self._probers.append(thread)
                thread.start()
        self._thread.start()
        return self

    def stop_watching(self) -> None:
        """No more checks or repairs from now on (a signal handler's part of stop(): it joins nothing)."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        for thread in [self._thread, *self._probers]:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not _alive(self.server_pid):
                return
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the watch must go on: one failed check is tried again
                self.log(f"supervisor: a check failed ({type(exc).__name__}: {exc}); checking again")

    # --- the server's HTTP API, authenticated -------------------------------------------------------------------

    def _request(self, path: str, body: bytes | None = None, timeout: float = 5.0, admin: bool = False):
        headers = {"Content-Type": "application/json"}
        if admin and self.admin_key:
            headers[ADMIN_HEADER] = self.admin_key
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=body, headers=headers,
                                         method="GET" if body is None else "POST")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()

    def _post(self, path: str, timeout: float) -> None:
        self._request(path, b"{}", timeout, admin=True)

    def _index(self) -> list[dict]:
        return json.loads(self._request("/v2/repository/index", b"{}", 10, admin=True))

    def model_ready(self, model: str) -> bool:
        try:
            self._request(f"/v2/models/{model}/ready", timeout=2)
            return True
        except _UNREACHABLE:
            return False

    # --- liveness probes ----------------------------------------------------------------------------------------

    def _probe_body(self, model: str) -> bytes:
        """A request the step's config accepts (its inputs from the public metadata, one element each), marked as a
        probe: the step answers it before reading any input."""
        metadata = json.loads(self._request(f"/v2/models/{model}", timeout=2))
        inputs = []
        for spec in metadata.get("inputs", []):
            shape = [1 if d < 0 else d for d in spec["shape"]]
            count = 1
            for d in shape:
                count *= d
            value = "" if spec["datatype"] == "BYTES" else 0
            inputs.append({"name": spec["name"], "shape": shape, "datatype": spec["datatype"], "data": [value] * count})
        return json.dumps({"inputs": inputs, "parameters": {protocol.PROBE_PARAMETER: True}}).encode()

    def _prober(self, model: str) -> None:
        body = None
        while not self._stop.wait(PROBE_SECONDS):
            try:
                body = body or self._probe_body(model)
                self._request(f"/v2/models/{model}/infer", body, timeout=self.hung_seconds)
                self._answered[model] = time.monotonic()
            except (*_UNREACHABLE, ValueError, KeyError):
                continue  # unanswered: check() decides when that means hung

    def silent_for(self, model: str) -> float:
        """Seconds since the step last answered a probe (0 for a model that is not probed)."""
        last = self._answered.get(model)
        return 0.0 if last is None else time.monotonic() - last

    # --- checks and repairs -------------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Repair every model whose stub is gone, stopped or silent, and load every needed model that is not loaded
        (models given up are not tried again); returns the broken ones."""
        with self._lock:
            stubs = stubs_of(self.server_pid)
            self._see_regions(stubs)
            broken: dict[str, str] = {}
            stopped = set()
            for instance, model in self.expected.items():
                stub = stubs.get(instance)
                if stub is None or stub.started < self._watched.get(instance, 0):
                    broken.setdefault(model, "died")
                    continue
                self._watched[instance] = stub.started  # a newer process (a reload by an operator) is watched now
                if _stopped(stub.pid):
                    stopped.add(stub.pid)
                    if stub.pid in self._stopped_seen:  # stopped at two checks in a row: not a passing ptrace stop
                        broken.setdefault(model, "hung")
            self._stopped_seen = stopped
            cpu = {s.pid: _cpu_seconds(s.pid) for s in stubs.values()}  # read once, for both hang checks
            for model in self._answered:
                if model not in broken and self._silent_and_idle(model, stubs, cpu):
                    broken[model] = "hung"
            for instance, model in self.expected.items():  # one instance stuck while another answers the probes
                if model not in broken and instance in stubs and self._stuck_in_batch(stubs[instance], cpu):
                    broken[model] = "hung"
            for model, cause in sorted(broken.items()):
                if self._failures.get(model, 0) >= MAX_ATTEMPTS:
                    continue
                if cause == "hung":
                    self._kill(model, stubs)
                self._repair(model, cause)
            for model in self.unready(exclude=set(broken)) or []:  # None: the index could not be read; next time
                if self._failures.get(model, 0) < MAX_ATTEMPTS:
                    self._repair(model, "not ready", unload=False)
                    broken[model] = "not ready"
            return sorted(broken)

    def _silent_and_idle(self, model: str, stubs: dict[str, Stub], cpu_of: dict[int, float]) -> bool:
        """Hung: no probe answered for hung_seconds while its stubs used no CPU (deadlocked, asleep, stuck in a
        wait); or none answered for BUSY_HUNG_SECONDS at all. A step that works through a long queue keeps using
        CPU while its probe waits in that queue: it is busy, not hung, and killing it would fail the whole queue."""
        now = time.monotonic()
        cpu = sum(cpu_of[s.pid] for s in stubs.values() if s.model == model)
        last_cpu, grew = self._working.get(model, (cpu, now))
        if cpu - last_cpu > BUSY_CPU_SECONDS or cpu < last_cpu:  # less: a new stub (a repair) starts afresh
            grew = now
        self._working[model] = (cpu, grew)
        silent = self.silent_for(model)
        idle = now - grew
        return silent > BUSY_HUNG_SECONDS or (silent > self.hung_seconds and idle > self.hung_seconds)

    def _stuck_in_batch(self, stub: Stub, cpu_of: dict[int, float]) -> bool:
        """Hung: in one `execute` (serving.watch) for hung_seconds while its process used no CPU, or for
        BUSY_HUNG_SECONDS at all."""
        now = time.monotonic()
        since = busy_since(self.server_pid, stub.instance)
        cpu = cpu_of[stub.pid]
        last_cpu, grew = self._instance_cpu.get(stub.instance, (cpu, now))
        if cpu - last_cpu > BUSY_CPU_SECONDS or cpu < last_cpu or since is None:
            grew = now
        self._instance_cpu[stub.instance] = (cpu, grew)
        if since is None:
            return False
        in_batch, idle = now - since, now - max(grew, since)
        return in_batch > BUSY_HUNG_SECONDS or (in_batch > self.hung_seconds and idle > self.hung_seconds)

    def unready(self, exclude: set[str] = frozenset()) -> list[str] | None:
        """The needed models that are not loaded and ready now (one repository-index call for all of them); None
        when the index cannot be read (a busy server is no reason to reload every model)."""
        needed = sorted(self.models - set(exclude))
        if not needed:
            return []
        try:
            states = {m["name"]: m.get("state") for m in self._index()}
        except (*_UNREACHABLE, ValueError):
            return None
        return [m for m in needed if states.get(m) != "READY"]

    def _kill(self, model: str, stubs: dict[str, Stub]) -> None:
        """SIGKILL a hung model's stubs (a stopped process dies too), so the reload never waits on them."""
        for instance, owner in self.expected.items():
            if owner == model and instance in stubs:
                try:
                    os.kill(stubs[instance].pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    @property
    def failed(self) -> list[str]:
        """Models that could not be repaired MAX_ATTEMPTS times in a row: the server cannot serve them; the
        process that owns it should stop it (aot serve exits non-zero)."""
        return sorted(m for m, n in self._failures.items() if n >= MAX_ATTEMPTS)

    def _dependents(self) -> list[str]:
        """Models that were loaded and are not ready now (the ensembles an unload took down with it); models never
        loaded (no state, e.g. `aot_lookup` on CPU) stay unloaded."""
        return [m["name"] for m in self._index() if m.get("state") and m["state"] != "READY"]

    def _repair(self, model: str, cause: str, unload: bool = True) -> None:
        instances = ",".join(i for i, m in self.expected.items() if m == model) or model
        repair = Repair(model, instances, time.time(), cause)
        self.repairs.append(repair)
        self.repairing = model
        what = {"died": f"the stub of {instances} died", "hung": f"{instances} stopped answering (killed)",
                "not ready": f"model {model!r} is not loaded or not ready"}[cause]
        self.log(f"supervisor: {what}; reloading model {model!r}")
        start = time.monotonic()
        try:
            if unload:
                self._post(f"/v2/repository/models/{model}/unload", UNLOAD_TIMEOUT)
                deadline = time.monotonic() + UNLOAD_TIMEOUT
                while self.model_ready(model) and time.monotonic() < deadline:
                    time.sleep(0.05)
            self._post(f"/v2/repository/models/{model}/load", LOAD_TIMEOUT)
            for other in self._dependents():  # ensembles unloaded with their step come back with it
                self._post(f"/v2/repository/models/{other}/load", LOAD_TIMEOUT)
        except (*_UNREACHABLE, ValueError) as exc:
            if model in self._answered:
                self._answered[model] = time.monotonic()  # a slow load is not a hang: judge its stub afresh
            repair.error = f"{type(exc).__name__}: {exc}"
            self._failures[model] = self._failures.get(model, 0) + 1
            self.log(f"supervisor: reloading {model!r} failed ({self._failures[model]} of {MAX_ATTEMPTS}): "
                     f"{repair.error}")
            return
        finally:
            self.repairing = None
        self._failures.pop(model, None)
        stubs = stubs_of(self.server_pid)
        self.expected.update({s.instance: s.model for s in stubs.values()})
        self._watched.update({s.instance: s.started for s in stubs.values()})
        self._see_regions(stubs)
        if model in self._answered:
            self._answered[model] = time.monotonic()  # its new stub gets a full hung_seconds to answer
        repair.seconds = round(time.monotonic() - start, 3)
        self.log(f"supervisor: model {model!r} serves again after {repair.seconds:.2f} s")

    # --- health -------------------------------------------------------------------------------------------------

    def health(self) -> tuple[bool, list[str]]:
        """(ready, reasons it is not): ready when the server runs, every model it needs is loaded and ready, every
        python step answered a probe within hung_seconds, and no repair runs."""
        if not _alive(self.server_pid):
            return False, ["tritonserver is not running"]
        reasons = [f"model {m!r} could not be repaired" for m in self.failed]
        if self.repairing:
            reasons.append(f"model {self.repairing!r} is being repaired")
        unready = self.unready(exclude={self.repairing} if self.repairing else set())  # asked now
        if unready is None:
            reasons.append("the server's model index cannot be read")
        reasons += [f"model {m!r} is not loaded or not ready" for m in unready or []]
        reasons += [f"model {m!r} answered no probe for {self.silent_for(m):.1f} s" for m in sorted(self._answered)
                    if self.silent_for(m) > self.hung_seconds]
        return not reasons, reasons


class HealthServer:
    """GET /ready: 200 {"ready": true} when Supervisor.health() says so, else 503 with the reasons; GET /live: 200
    while the supervisor's server process runs (a stopped or crashed one is repaired or restarted by its owner,
    so liveness fails only when that owner is gone). Plain HTTP, no secrets: it says nothing a client could use."""

    def __init__(self, supervisor: Callable[[], Supervisor | None], host: str, port: int):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
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
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="aot-health", daemon=True)

    def answer(self, path: str) -> tuple[int, dict]:
        supervisor = self.supervisor()
        if path.split("?")[0] == "/live":
            alive = supervisor is not None and _alive(supervisor.server_pid)
            return (200 if alive else 503), {"live": alive}
        if path.split("?")[0] == "/ready":
            if supervisor is None:
                return 503, {"ready": False, "reasons": ["tritonserver is starting"]}
            ready, reasons = supervisor.health()
            return (200 if ready else 503), {"ready": ready, "reasons": reasons}
        return 404, {"error": "GET /ready or /live"}

    def start(self) -> "HealthServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> int:
    """`python3 -m serving.supervisor tritonserver ARGS...`: run the server under a supervisor (the container's
    entry point). Adds explicit model control and the API restrictions (the admin key from AOT_ADMIN_KEY or
    AOT_ADMIN_KEY_FILE, else one generated for this run and known to the supervisor alone), serves /ready and /live
    on AOT_HEALTH_PORT (default 8003), forwards SIGTERM/SIGINT, and reaps the stubs when the server exits."""
    import subprocess
    import sys

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
        command += ["--model-control-mode=explicit", "--load-model=*"]
    port = next((a.split("=", 1)[1] for a in command if a.startswith("--http-port=")), "8000")
    server = subprocess.Popen(command + restriction_args(key))
    supervisor = None
    stopping = threading.Event()

    def forward(sig, _frame) -> None:
        """A stop: the supervisor stops first (the models the server unloads are not dead steps to reload)."""
        stopping.set()
        if supervisor is not None:
            supervisor.stop_watching()
        server.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    health = HealthServer(lambda: supervisor, os.environ.get("AOT_HEALTH_ADDRESS", "0.0.0.0"), health_port).start()
    while server.poll() is None:
        if stopping.is_set():
            time.sleep(0.5)
            continue
        if supervisor is not None and supervisor.failed:  # exit: the container's restart policy starts anew
            print(f"supervisor: {', '.join(supervisor.failed)} could not be reloaded; stopping tritonserver",
                  file=sys.stderr, flush=True)
            server.terminate()
            server.wait()
            break
        if supervisor is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        supervisor = Supervisor(server.pid, f"127.0.0.1:{port}", key,
                                                log=lambda m: print(m, file=sys.stderr, flush=True)).start()
            except OSError:
                pass
        time.sleep(0.5)
    health.stop()
    if supervisor is not None:
        supervisor.stop()
    reap(server.pid, supervisor.regions if supervisor else ())
    return 1 if supervisor is not None and supervisor.failed else server.returncode


if __name__ == "__main__":
    raise SystemExit(main())
