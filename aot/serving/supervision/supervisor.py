"""The Supervisor: keeps a running tritonserver's python-backend stubs and models honest.

Triton 2.51 never restarts a python-backend stub that died (kill -9, SIGBUS from a bad memory map, OOM): every
later request that reaches it fails ("Stub process 'backbone_0_0' is not healthy") while the model and the server
still report ready. Nor does it notice a stub that stopped answering (SIGSTOP, a deadlock, a call that never
returns): a stopped process counts as alive. The supervisor watches the stubs of one server
(aot.serving.supervision.procfs) and the models the repository needs, and repairs (aot.serving.supervision.reloads,
through the repository API with the admin key):
- an instance whose stub died, is stopped (process state T at two checks in a row), is stuck in one batch
  (aot.serving.watch: probes go to whichever instance is free, so with several instances the others keep answering
  them), or whose shared-memory region grew past `region_bytes` (an oversized request reached it: the region never
  shrinks, aot.serving.limits): that instance alone is replaced while the others serve, its stub killed first when it
  hangs (a stopped stub must never resume: its stale IPC state aborted tritonserver);
- a model none of whose instances answers its liveness probe (aot.serving.supervision.probes): all its instances
replaced;
- where instances cannot be replaced alone (one group of several instances) or an update fails: unload + load;
- a model that is not loaded or not ready (an unloaded ensemble included): loaded again.
Stubs of instances that left the server (replaced, or a reload's lingering old process) are reaped once idle.
A front end that answers nothing (saturated with connections, or tritonserver stopped) is not a hung step: no stub is
killed for it, and /ready says so.

Readiness that tells the truth: Triton's /v2/health/ready stays 200 while a model is unloaded or a stub hangs, so
`health()` says ready only when every model the repository needs is loaded, ready and answering, and no repair
runs, and the task store can serve a task (aot.serving.store.check; served as /ready by aot.serving.supervision.health).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from aot.serving.limits import RequestBounds
from aot.serving.shm import allocated_bytes, make_private, remove_regions
from aot.serving.supervision.instance_groups import instance_names
from aot.serving.supervision.probes import BUSY_CPU_SECONDS, BUSY_HUNG_SECONDS, HUNG_SECONDS, Probes
from aot.serving.supervision.procfs import Stub, alive, proc_stat, stub_processes, stubs_of
from aot.serving.supervision.reloads import Reloads
from aot.serving.supervision.triton_api import FRONT_END_TIMEOUT, UNREACHABLE, TritonApi
from aot.serving.watch import busy_since, notes, remove_watch

MAX_ATTEMPTS = 3  # failed repairs in a row before a model is given up (and its owner told: Supervisor.failed)
STALE_SECONDS = 5.0  # a stub of an instance that left the server is reaped this long after, once idle
_CAUSES = ("died", "hung", "grown")  # what broke an instance, most urgent first


@dataclass
class Repair:
    model: str
    instance: str  # the instances repaired, comma-separated
    detected: float  # time.time()
    cause: str = "died"  # died, hung, grown, not ready
    seconds: float | None = None  # until the model served again (None: the repair failed)
    error: str | None = None
    how: str = "reload"  # replace (those instances alone, the model loaded throughout), reload or load



class ReadinessCheck(Protocol):
    """What else /ready waits for (the task store: aot.serving.store.check.StoreCheck): `problem` says why nothing
    can be served (None: nothing wrong) and `warning` what the server serves without (/ready stays 200 and says it),
    without I/O; `refresh()`, called by the supervisor's loop, reads again and never blocks it."""

    problem: str | None
    warning: str | None

    def refresh(self) -> None: ...


@dataclass
class Broken:
    cause: str
    instances: set[str] = field(default_factory=set)


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
    region_bytes: RequestBounds | None = None  # a stub's shared memory beyond its model's bound (region_of) is
    # replaced (aot.serving.limits; None: no bound)
    # what /ready checks beside the steps: the task store (aot.serving.store.check, given by the entry point that
    # composes the rooms: this one imports no store), built with this supervisor's log; None: nothing
    store_check: Callable[[Callable[[str], None]], ReadinessCheck] | None = None
    repairs: list[Repair] = field(default_factory=list)
    regions: set[str] = field(default_factory=set)  # every shm region seen (sweeper.reap removes them)

    def __post_init__(self):
        self.api = TritonApi(self.http_url, self.admin_key)
        self.reloads = Reloads(self.api)
        self.store = None if self.store_check is None else self.store_check(self.log)
        self.expected: dict[str, str] = {}  # instance -> model
        # instance -> start time of the process watched: an older process of that name left behind by a reload is
        # not the instance (a killed new stub beside a lingering unloaded one is dead, not alive)
        self._watched: dict[str, int] = {}
        self.models: set[str] = set()  # every model the server had loaded at start (ensembles too)
        self.repairing: str | None = None
        self._instance_cpu: dict[str, tuple[float, float]] = {}  # instance -> (its CPU seconds, when it last grew)
        self._stopped_seen: set[int] = set()  # stub pids seen stopped at the last check
        self._stale: dict[int, float] = {}  # pid of a stub no instance owns -> when it was first seen so
        self._reaped: dict[int, Stub] = {}  # stale stubs killed, until they are gone
        self._warned: set[str] = set()
        self._failures: dict[str, int] = {}  # model -> failed repairs in a row
        self._stop = threading.Event()
        self.probes = Probes(self.api, self._stop, lambda: self.hung_seconds)
        self._thread = threading.Thread(target=self._run, name="aot-supervisor", daemon=True)
        self._lock = threading.Lock()

    def _see_regions(self, stubs: dict[str, Stub]) -> None:
        """Remember every stub's region (aot.serving.supervision.sweeper.reap removes them) and make each new one
        private (aot.serving.shm)."""
        new = {s.shm_region for s in stubs.values()} - self.regions
        make_private(new)
        self.regions |= new

    def start(self, probe: bool = True) -> "Supervisor":
        stubs = stubs_of(self.server_pid)
        self.expected = {s.instance: s.model for s in stubs.values()}
        self._watched = {s.instance: s.started for s in stubs.values()}
        self._see_regions(stubs)
        try:
            self.models = {m["name"] for m in self.api.index() if m.get("state") == "READY"}
        except (*UNREACHABLE, ValueError) as exc:
            self.log(f"supervisor: could not read the repository index ({exc}); watching the stubs only")
        if probe:
            self.probes.start(set(self.expected.values()))
        self._check_store()  # a store that cannot be read is said at start, not at the first /ready
        self._thread.start()
        return self

    def stop_watching(self) -> None:
        """No more checks or repairs from now on (a signal handler's part of stop(): it joins nothing)."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        for thread in [self._thread, *self.probes.threads]:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not alive(self.server_pid):
                return
            try:
                self.check()
                self._check_store()
            except Exception as exc:  # noqa: BLE001 - the watch must go on: one failed check is tried again
                self.log(f"supervisor: a check failed ({type(exc).__name__}: {exc}); checking again")

    def _check_store(self) -> None:
        """Whether the task store can serve (aot.serving.store.check), read again when due."""
        if self.store is not None:
            self.store.refresh()

    def silent_for(self, model: str) -> float:
        """Seconds since the step last answered a probe (0 for a model that is not probed)."""
        return self.probes.silent_for(model)

    # --- checks and repairs -------------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Repair every model with an instance that died, hangs or grew, and load every needed model that is not
        loaded (models given up are not tried again); reap stubs no instance owns. Returns the broken models."""
        with self._lock:
            stubs = stubs_of(self.server_pid)  # each with its state and CPU, read once for every check below
            self._see_regions(stubs)
            broken = self._broken(stubs)
            for model, what in sorted(broken.items()):
                if self._failures.get(model, 0) >= MAX_ATTEMPTS:
                    continue
                if what.cause == "hung":
                    self._kill([stubs[i] for i in what.instances if i in stubs])
                self._repair(model, what)
            for model in self.unready(exclude=set(broken)) or []:  # None: the index could not be read; next time
                if self._failures.get(model, 0) < MAX_ATTEMPTS:
                    self._repair(model, Broken("not ready"))
                    broken[model] = Broken("not ready")
            self._reap_stale()
            return sorted(broken)

    def _broken(self, stubs: dict[str, Stub]) -> dict[str, Broken]:
        found: dict[str, Broken] = {}

        def mark(model: str, instance: str, cause: str) -> None:
            what = found.setdefault(model, Broken(cause))
            what.cause = min(what.cause, cause, key=_CAUSES.index)
            what.instances.add(instance)

        stopped = set()
        for instance, model in self.expected.items():
            stub = stubs.get(instance)
            if stub is None or stub.started < self._watched.get(instance, 0):
                mark(model, instance, "died")
                continue
            self._watched[instance] = stub.started  # a newer process (a reload by an operator) is watched now
            if stub.stat.stopped:
                stopped.add(stub.pid)
                if stub.pid in self._stopped_seen:  # stopped at two checks in a row: not a passing ptrace stop
                    mark(model, instance, "hung")
        self._stopped_seen = stopped
        server = proc_stat(self.server_pid)
        if server is None or not server.stopped:  # a stopped tritonserver answers nothing: not its steps' fault
            for model in self.probes.answered:
                cpu = sum(s.stat.cpu_seconds for s in stubs.values() if s.model == model)
                if self.probes.hung(model, cpu):
                    for instance in (i for i, m in self.expected.items() if m == model):
                        mark(model, instance, "hung")
            for instance, model in self.expected.items():  # one instance stuck while another answers the probes
                if instance in stubs and self._stuck_in_batch(stubs[instance]):
                    mark(model, instance, "hung")
        if self.region_bytes is not None:
            for instance, model in self.expected.items():
                if instance in stubs and allocated_bytes(stubs[instance].shm_region) > self.region_bytes.region_of(model):
                    mark(model, instance, "grown")
        return found

    def _stuck_in_batch(self, stub: Stub) -> bool:
        """Hung: in one `execute` (aot.serving.watch) for hung_seconds while its process used no CPU, or for
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

    def unready(self, exclude: set[str] = frozenset(), timeout: float = 10.0) -> list[str] | None:
        """The needed models that are not loaded and ready now (one repository-index call for all of them); None
        when the index cannot be read (a busy server is no reason to reload every model)."""
        needed = sorted(self.models - set(exclude))
        if not needed:
            return []
        try:
            states = {m["name"]: m.get("state") for m in self.api.index(timeout)}
        except (*UNREACHABLE, ValueError):
            return None
        return [m for m in needed if states.get(m) != "READY"]

    @staticmethod
    def _kill(stubs: list[Stub]) -> None:
        """SIGKILL hung stubs (a stopped process dies too), so that no repair waits on them."""
        for stub in stubs:
            try:
                os.kill(stub.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    @property
    def failed(self) -> list[str]:
        """Models that could not be repaired MAX_ATTEMPTS times in a row: the server cannot serve them; the
        process that owns it should stop it (aot serve exits non-zero)."""
        return sorted(m for m, n in self._failures.items() if n >= MAX_ATTEMPTS)

    def _repair(self, model: str, what: Broken) -> None:
        instances = ",".join(sorted(what.instances)) or model
        repair = Repair(model, instances, time.time(), what.cause)
        said = {"died": f"the stub of {instances} died", "hung": f"{instances} stopped answering (killed)",
                "grown": f"the shared memory of {instances} grew past "
                         f"{self.region_bytes.region_of(model) if self.region_bytes else 0} bytes",
                "not ready": f"model {model!r} is not loaded or not ready"}[what.cause]
        start = time.monotonic()
        try:
            if what.cause != "not ready" and self.reloads.can_replace(model, what.instances):
                repair.how = "replace"
            elif what.cause == "grown":  # no outage for memory: the whole model's reload would be one
                self._warn_once(model, f"supervisor: {said}; instances of {model!r} share one group, so it cannot "
                                       "be replaced alone (re-export the backbone)")
                return
            self.repairs.append(repair)
            self.repairing = model
            self.log(f"supervisor: {said}; " + {"replace": f"replacing {instances} while model {model!r} serves",
                                                "reload": f"reloading model {model!r}"}.get(repair.how, ""))
            if repair.how == "replace":
                self.reloads.replace(model, what.instances)
            elif what.cause == "not ready":
                repair.how = "load"
                self.reloads.load(model)
            else:
                self.reloads.reload(model)
        except (*UNREACHABLE, ValueError) as exc:
            self.probes.restart(model)  # a slow load is not a hang: judge its stub afresh
            repair.error = f"{type(exc).__name__}: {exc}"
            if repair not in self.repairs:
                self.repairs.append(repair)
            self._failures[model] = self._failures.get(model, 0) + 1
            self.log(f"supervisor: repairing {model!r} failed ({self._failures[model]} of {MAX_ATTEMPTS}): "
                     f"{repair.error}")
            return
        finally:
            self.repairing = None
        self._failures.pop(model, None)
        self._adopt(model, what.instances if repair.how == "replace" else set())
        self.probes.restart(model)  # its new stubs get a full hung_seconds to answer
        repair.seconds = round(time.monotonic() - start, 3)
        self.log(f"supervisor: model {model!r} serves again after {repair.seconds:.2f} s")

    def _warn_once(self, model: str, message: str) -> None:
        if model not in self._warned:
            self._warned.add(model)
            self.log(message)

    def _adopt(self, model: str, gone: set[str]) -> None:
        """After a repair: the instances that left are no longer watched, the model's new stubs are."""
        for instance in gone:
            self.expected.pop(instance, None)
            self._watched.pop(instance, None)
            self._instance_cpu.pop(instance, None)
        stubs = stubs_of(self.server_pid)
        current = {s.instance: s for s in stubs.values() if s.instance not in gone}
        self.expected.update({i: s.model for i, s in current.items()})
        self._watched.update({i: s.started for i, s in current.items()})
        self._see_regions(stubs)

    def _reap_stale(self) -> None:
        """Stubs of instances the server no longer has (a replaced instance, the old process of a reloaded model)
        are killed STALE_SECONDS after they were first seen so, once not in a batch, and their shared memory removed
        once they are gone; instances the server has and the supervisor did not know (an operator's load) are
        watched from now on."""
        now = time.monotonic()
        newest = {s.pid for s in stubs_of(self.server_pid).values()}
        candidates = [s for s in stub_processes(self.server_pid)
                      if s.pid not in newest or s.instance not in self.expected]
        loaded: dict[str, set[str] | None] = {}  # model -> its instances now, from its loaded config
        stale = set()
        for stub in candidates:
            if stub.model not in loaded:
                try:
                    loaded[stub.model] = {i for g in self.api.config(stub.model)["instance_group"]
                                          for i in instance_names(g)}
                except (*UNREACHABLE, ValueError, KeyError, TypeError):
                    loaded[stub.model] = None  # unloaded, or not answering: next time
            instances = loaded[stub.model]
            if instances is None:
                continue
            if stub.pid in newest and stub.instance in instances:
                self.expected[stub.instance], self._watched[stub.instance] = stub.model, stub.started
                continue
            stale.add(stub.pid)
            first = self._stale.setdefault(stub.pid, now)
            busy = stub.instance not in instances and busy_since(self.server_pid, stub.instance) is not None
            if now - first > STALE_SECONDS and (not busy or now - first > BUSY_HUNG_SECONDS):
                self.log(f"supervisor: a stub of {stub.instance} (pid {stub.pid}) outlived its instance; reaping it")
                self._kill([stub])
                self._reaped[stub.pid] = stub
        self._stale = {pid: first for pid, first in self._stale.items() if pid in stale}
        for pid, stub in list(self._reaped.items()):
            if not alive(pid):
                del self._reaped[pid]
                remove_regions([stub.shm_region])
                if stub.instance not in self.expected:
                    remove_watch(self.server_pid, stub.instance)

    # --- health -------------------------------------------------------------------------------------------------

    def warnings(self) -> list[str]:
        """What the server serves without while it is ready, for /ready to say: a CUDA graph a step could not capture
        (its batches run eagerly), a task store that does not answer, a damaged shard."""
        warning = None if self.store is None else self.store.warning
        return ([warning] if warning else []) + notes(self.server_pid)

    def health(self) -> tuple[bool, list[str]]:
        """(ready, reasons it is not): ready when the server runs and its front end answers, every model it needs
        is loaded and ready, every python step answered a probe within hung_seconds, and no repair runs."""
        if not alive(self.server_pid):
            return False, ["tritonserver is not running"]
        if not self.api.front_end_answers():
            server = proc_stat(self.server_pid)
            why = "it is stopped" if server is not None and server.stopped else "saturated with connections, or busy"
            return False, [f"tritonserver's front end answers nothing within {FRONT_END_TIMEOUT:.0f} s ({why})"]
        problem = None if self.store is None else self.store.problem  # read by the loop: no I/O here
        reasons = [problem] if problem else []
        reasons += [f"model {m!r} could not be repaired" for m in self.failed]
        if self.repairing:
            reasons.append(f"model {self.repairing!r} is being repaired")
        unready = self.unready(exclude={self.repairing} if self.repairing else set(), timeout=FRONT_END_TIMEOUT)
        if unready is None:
            reasons.append("the server's model index cannot be read")
        reasons += [f"model {m!r} is not loaded or not ready" for m in unready or []]
        reasons += [f"model {m!r} answered no probe for {self.silent_for(m):.1f} s"
                    for m in sorted(self.probes.answered) if self.silent_for(m) > self.hung_seconds]
        return not reasons, reasons
