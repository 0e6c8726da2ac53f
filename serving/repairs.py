"""The Supervisor: keeps a running tritonserver's python-backend stubs and models honest.

Triton 2.51 never restarts a python-backend stub that died (kill -9, SIGBUS from a bad memory map, OOM): every
later request of that model fails ("Stub process 'backbone_0_0' is not healthy") while the model and the server
still report ready. Nor does it notice a stub that stopped answering (SIGSTOP, a deadlock, a call that never
returns): a stopped process counts as alive. The supervisor watches the stubs of one server (serving.procfs) and the
models the repository needs, and repairs:
- a model whose stub is gone: unload, then load, through the repository API (--model-control-mode=explicit);
- a model whose stub is stopped (process state T), answered no liveness probe for `hung_seconds`, or has an
  instance stuck in one batch (serving.watch: probes go to whichever instance is free, so with several instances
  the others keep answering them): its stubs are killed first (a stopped stub must never resume: its stale IPC
  state aborted tritonserver), then it is reloaded;
- a model that is not loaded or not ready (an unloaded ensemble included): loaded again.
Each probe is a real inference request to the step with the parameter protocol.PROBE_PARAMETER (serving.steps answers
it at once, uncounted), so it proves the step's process runs its `execute`, not only that it exists.

Readiness that tells the truth: Triton's /v2/health/ready stays 200 while a model is unloaded or a stub hangs, so
`health()` says ready only when every model the repository needs is loaded, ready and answering, and no repair
runs (served as /ready by serving.health). The repository API is restricted (serving.admin_key): the supervisor
sends the deployment's admin key with its calls, and never logs it.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from serving import protocol
from serving.admin_key import ADMIN_HEADER
from serving.procfs import Stub, alive, stubs_of
from serving.shm import make_private
from serving.watch import busy_since

MAX_ATTEMPTS = 3  # failed repairs in a row before a model is given up (and its owner told: Supervisor.failed)
UNLOAD_TIMEOUT = 10.0  # seconds for an unload (its stub is killed first when it hangs)
LOAD_TIMEOUT = 20.0  # seconds for a load (the backbone's takes ~1 s)
PROBE_SECONDS = 1.0  # between two liveness probes of one step
HUNG_SECONDS = 6.0  # a step that answered no probe for this long, and used no CPU meanwhile, is hung
BUSY_HUNG_SECONDS = 60.0  # one still using CPU (working through a long queue, the probe waiting behind it) is hung
#                            only after this long without an answer
BUSY_CPU_SECONDS = 0.01  # CPU a step uses between two checks (0.5 s) to count as working, not stuck
# What a call to the server's HTTP API raises when the server cannot answer it right now (a busy or restarting
# server: refused, timed out, a connection dropped mid-answer)
_UNREACHABLE = (urllib.error.URLError, OSError, http.client.HTTPException)


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
    regions: set[str] = field(default_factory=set)  # every shm region seen (serving.lifecycle.reap removes them)

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
        """Remember every stub's region (serving.lifecycle.reap removes them) and make each new one private
        (serving.shm)."""
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
            if not alive(self.server_pid):
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
            value = "" if spec["datatype"] == protocol.BYTES else 0
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
            stubs = stubs_of(self.server_pid)  # each with its state and CPU, read once for every check below
            self._see_regions(stubs)
            broken: dict[str, str] = {}
            stopped = set()
            for instance, model in self.expected.items():
                stub = stubs.get(instance)
                if stub is None or stub.started < self._watched.get(instance, 0):
                    broken.setdefault(model, "died")
                    continue
                self._watched[instance] = stub.started  # a newer process (a reload by an operator) is watched now
                if stub.stat.stopped:
                    stopped.add(stub.pid)
                    if stub.pid in self._stopped_seen:  # stopped at two checks in a row: not a passing ptrace stop
                        broken.setdefault(model, "hung")
            self._stopped_seen = stopped
            for model in self._answered:
                if model not in broken and self._silent_and_idle(model, stubs):
                    broken[model] = "hung"
            for instance, model in self.expected.items():  # one instance stuck while another answers the probes
                if model not in broken and instance in stubs and self._stuck_in_batch(stubs[instance]):
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

    def _silent_and_idle(self, model: str, stubs: dict[str, Stub]) -> bool:
        """Hung: no probe answered for hung_seconds while its stubs used no CPU (deadlocked, asleep, stuck in a
        wait); or none answered for BUSY_HUNG_SECONDS at all. A step that works through a long queue keeps using
        CPU while its probe waits in that queue: it is busy, not hung, and killing it would fail the whole queue."""
        now = time.monotonic()
        cpu = sum(s.stat.cpu_seconds for s in stubs.values() if s.model == model)
        last_cpu, grew = self._working.get(model, (cpu, now))
        if cpu - last_cpu > BUSY_CPU_SECONDS or cpu < last_cpu:  # less: a new stub (a repair) starts afresh
            grew = now
        self._working[model] = (cpu, grew)
        silent = self.silent_for(model)
        idle = now - grew
        return silent > BUSY_HUNG_SECONDS or (silent > self.hung_seconds and idle > self.hung_seconds)

    def _stuck_in_batch(self, stub: Stub) -> bool:
        """Hung: in one `execute` (serving.watch) for hung_seconds while its process used no CPU, or for
        BUSY_HUNG_SECONDS at all."""
        now = time.monotonic()
        since = busy_since(self.server_pid, stub.instance)
        cpu = stub.stat.cpu_seconds
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
        if not alive(self.server_pid):
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
