"""Keeping a tritonserver and its python-backend stubs honest.

Triton 2.51 never restarts a python-backend stub that died (kill -9, SIGBUS from a bad memory map, OOM): every
later request of that model fails ("Stub process 'backbone_0_0' is not healthy") while the model and the server
still report ready. The supervisor watches the stubs of one server (their command line names the instance, the
model file and the server's pid) and repairs a model whose stub is gone: unload, then load, through the repository
API (the server runs with --model-control-mode=explicit). While the repair runs Triton itself reports the model and
/v2/health/ready as not ready, so health checks see the truth; each repair is logged with its downtime.

When the server dies, its stubs may outlive it (they ignore SIGTERM by design and check their parent only every
300 ms, and a zombie parent still looks alive): `reap` kills them and removes their shared-memory regions.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

STUB = "triton_python_backend_stub"
MAX_ATTEMPTS = 3  # failed repairs in a row before a model is given up (and its owner told: Supervisor.failed)
REQUEST_TIMEOUT = 30.0  # seconds for one repository API call (a load of the backbone takes ~1 s)
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Stub:
    pid: int
    instance: str  # e.g. backbone_0_0
    model: str  # the model folder's name
    shm_region: str


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stubs_of(server_pid: int) -> dict[str, Stub]:
    """The live stubs a server started (argv: stub, model.py, shm region, sizes, parent pid, ..., instance)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _cmdline(int(entry.name))
        if len(argv) > 8 and argv[0].endswith(STUB) and argv[5] == str(server_pid) and _alive(int(entry.name)):
            found[argv[8]] = Stub(int(entry.name), argv[8], Path(argv[1]).parents[1].name, argv[2])
    return found


def remove_regions(regions) -> None:
    for region in regions:
        (SHM / region.lstrip("/")).unlink(missing_ok=True)


def reap(server_pid: int, regions=()) -> None:
    """After the server exited: SIGKILL its stubs and remove their (and `regions`') shared memory."""
    stubs = stubs_of(server_pid)
    for stub in stubs.values():
        try:
            os.kill(stub.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while any(_alive(s.pid) for s in stubs.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    remove_regions({s.shm_region for s in stubs.values()} | set(regions))


@dataclass
class Repair:
    model: str
    instance: str
    detected: float  # time.time()
    seconds: float | None = None  # until the model served again (None: the repair failed)
    error: str | None = None


@dataclass
class Supervisor:
    """Watches the stubs of a running server every `interval` seconds and repairs a model whose stub died."""

    server_pid: int
    http_url: str  # host:port
    interval: float = 0.5
    log: Callable[[str], None] = print
    repairs: list[Repair] = field(default_factory=list)
    regions: set[str] = field(default_factory=set)  # every shm region seen (removed by reap)

    def __post_init__(self):
        self.expected: dict[str, str] = {}  # instance -> model
        self._failures: dict[str, int] = {}  # model -> failed repairs in a row
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aot-supervisor", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> "Supervisor":
        stubs = stubs_of(self.server_pid)
        self.expected = {s.instance: s.model for s in stubs.values()}
        self.regions |= {s.shm_region for s in stubs.values()}
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not _alive(self.server_pid):
                return
            self.check()

    def check(self) -> list[str]:
        """Repair every model whose stub is gone (models given up are not tried again); returns the dead ones."""
        with self._lock:
            stubs = stubs_of(self.server_pid)
            self.regions |= {s.shm_region for s in stubs.values()}
            dead = sorted({model for instance, model in self.expected.items() if instance not in stubs})
            for model in dead:
                if self._failures.get(model, 0) >= MAX_ATTEMPTS:
                    continue
                self._repair(model, [i for i, m in self.expected.items() if m == model and i not in stubs])
            return dead

    @property
    def failed(self) -> list[str]:
        """Models that could not be repaired MAX_ATTEMPTS times in a row: the server cannot serve them; the
        process that owns it should stop it (aot serve exits non-zero)."""
        return sorted(m for m, n in self._failures.items() if n >= MAX_ATTEMPTS)

    def _post(self, path: str) -> None:
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            response.read()

    def model_ready(self, model: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{model}/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _dependents(self) -> list[str]:
        """Models that were loaded and are not ready now (the ensembles an unload took down with it); models never
        loaded (no state, e.g. `aot_lookup` on CPU) stay unloaded."""
        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            index = json.loads(response.read())
        return [m["name"] for m in index if m.get("state") and m["state"] != "READY"]

    def _repair(self, model: str, instances: list[str]) -> None:
        repair = Repair(model, ",".join(instances), time.time())
        self.repairs.append(repair)
        self.log(f"supervisor: the stub of {repair.instance} died; reloading model {model!r}")
        start = time.monotonic()
        try:
            self._post(f"/v2/repository/models/{model}/unload")
            deadline = time.monotonic() + 60
            while self.model_ready(model) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._post(f"/v2/repository/models/{model}/load")
            for other in self._dependents():  # ensembles unloaded with their step come back with it
                self._post(f"/v2/repository/models/{other}/load")
        except (urllib.error.URLError, OSError) as exc:
            repair.error = f"{type(exc).__name__}: {exc}"
            self._failures[model] = self._failures.get(model, 0) + 1
            self.log(f"supervisor: reloading {model!r} failed ({self._failures[model]} of {MAX_ATTEMPTS}): "
                     f"{repair.error}")
            return
        self._failures.pop(model, None)
        stubs = stubs_of(self.server_pid)
        self.regions |= {s.shm_region for s in stubs.values()}
        repair.seconds = round(time.monotonic() - start, 3)
        self.log(f"supervisor: model {model!r} serves again after {repair.seconds:.2f} s")


def main(argv: list[str] | None = None) -> int:
    """`python3 -m serving.supervisor tritonserver ARGS...`: run the server under a supervisor (the container's
    entry point). Adds explicit model control, forwards SIGTERM/SIGINT, and reaps the stubs when the server exits."""
    import subprocess
    import sys

    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python3 -m serving.supervisor tritonserver [ARGS...]", file=sys.stderr)
        return 2
    if not any(a.startswith("--model-control-mode") for a in command):
        command += ["--model-control-mode=explicit", "--load-model=*"]
    port = next((a.split("=", 1)[1] for a in command if a.startswith("--http-port=")), "8000")
    server = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _: server.send_signal(s))
    supervisor = None
    while server.poll() is None:
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
                        supervisor = Supervisor(server.pid, f"127.0.0.1:{port}",
                                                log=lambda m: print(m, file=sys.stderr, flush=True)).start()
            except OSError:
                pass
        time.sleep(0.5)
    if supervisor is not None:
        supervisor.stop()
    reap(server.pid, supervisor.regions if supervisor else ())
    return 1 if supervisor is not None and supervisor.failed else server.returncode


if __name__ == "__main__":
    raise SystemExit(main())
