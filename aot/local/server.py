"""A real local Triton server (the `tritonserver` binary of the nvidia-pytriton wheel), no Docker.

Set-up that the binary needs (its folder, the steps' Python, the backends folder): aot.local.triton_setup; the steps'
Python's bin/ first on PATH and LD_LIBRARY_PATH with its libpython, here.

Security (README "Security model"): every API a client does not need (model repository, model config, shared
memory, statistics, trace, logging) is restricted to the deployment's admin key: AOT_ADMIN_KEY or the file
AOT_ADMIN_KEY_FILE names, else a key generated per server and written to a 0600 file in its work folder
(`admin_key_path`); the supervisor authenticates its reloads with it; it is never logged. Readiness that tells the
truth is the supervisor's `/ready` on the health port (`health_url`), not Triton's /v2/health/ready.

Lifetime (aot.serving.supervision.lifecycle, which the container's entry point runs too): the server runs in its own
process group and dies with the process that started it (parent-death signal), so `kill -9` of `aot serve` leaves no
server behind, and a sweeper process then reaps its stubs (aot.serving.supervision.sweeper). A supervisor
(aot.serving.supervision.supervisor) repairs a step whose stub died; when tritonserver itself dies (Triton 2.51's
python backend can abort when a stub is killed under load), its stubs and shared memory are removed and it is started
again, at most 3 times a minute. Stopping is graceful (aot.serving.supervision.quiesce: new requests refused, the
accepted finished, open HTTP connections closed, then SIGTERM to the group), then SIGKILL to the server alone (its
stubs then remove their shared memory), then SIGKILL to the group and removes what stubs left in /dev/shm: also when
the server had already exited (crashed) by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from aot import settings
from aot.local.triton_setup import SERVER_MALLOC, StepPython, backends_folder, step_python, triton_home
from aot.serving.limits import region_bound_of
from aot.serving.repository import memory_pool_bytes, models_to_load, read_repository
from aot.serving.store.check import store_check_of
from aot.serving.supervision.admin_key import resolve_admin_key
from aot.serving.supervision.health import HealthServer
from aot.serving.supervision.lifecycle import (
    ServerError,
    ServerExited,
    ServerLifecycle,
    compile_steps,
    http_ok,
    log_tail,
)
from aot.serving.supervision.supervisor import Supervisor

MAX_RESTARTS = 3
# numpy's BLAS computes factored rows in the steps: a few small matmuls per batch. Its default thread pool spins on
# every core against ONNX Runtime's threads, and factored serving lost much of its throughput to it (measured:
# docs/benchmarks.md, "Many tasks on one engine").
SINGLE_THREADED_BLAS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
RESTART_WINDOW = 60.0


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports: all held open while they are chosen (one at a time, the kernel may hand the
    same port out twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_key_file(folder: Path, key: str) -> Path:
    """The admin key in a new 0600 file `folder/admin-key`: what an operator sends as the aot-admin-key header."""
    path = folder / "admin-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path


class Endpoints:
    """What clients reach, a server's or a fleet's load balancer's: gRPC and HTTP on `host` (the class sets host,
    grpc_port and http_port)."""

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"


@dataclass
class LocalServer(Endpoints):
    """tritonserver on REPO/models with the CPU configs (`device` "cpu"), or with the GPU configs of a torch-engine
    repository (`device` "cuda": the local binary has only the python backend) and memory pools sized from the
    repository. Use as a context manager or call start()/stop()."""

    repo: Path
    host: str = "127.0.0.1"  # HTTP and gRPC: the ports clients use
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    health_port: int = 0  # the supervisor's /ready and /live (0: a free port)
    metrics_host: str = "127.0.0.1"  # metrics (they name every task) and health: loopback unless asked
    # None: AOT_ADMIN_KEY / AOT_ADMIN_KEY_FILE, else generated for this server; never in a repr or a log
    admin_key: str | None = field(default=None, repr=False)
    tls_cert: str | None = None  # PEM files: gRPC over TLS (cert + key), mutual when tls_ca is given
    tls_key: str | None = None
    tls_ca: str | None = None
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    supervise: bool = True
    restart: bool = True  # start tritonserver again when it dies (aot.serving.supervision.supervisor repairs single steps)
    pool_bytes: int | None = None  # overrides the repository's task pool budget (AOT_POOL_BYTES)
    device: str = "cpu"
    # the models loaded (None: the ones the device's configs serve clients, `models()`); the GPU ensembles' separate
    # steps have CPU configs too, so that a test can load them on this machine
    load: tuple[str, ...] | None = None
    vanilla: bool = False  # also load `vanilla`, the plain encoder (comparisons only: more processes and memory)
    # what the server and its steps read (AOT_* settings of the steps: aot serve's flags), over this process's
    # environment, which is left as it is
    step_environment: dict[str, str] = field(default_factory=dict)
    failed: str | None = None  # why the server is down for good (restarts exhausted)
    restarts: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.repo = Path(self.repo).resolve()
        spare = iter(free_ports(4, self.host))
        self.http_port = self.http_port or next(spare)
        self.grpc_port = self.grpc_port or next(spare)
        self.metrics_port = self.metrics_port or next(spare)
        self.health_port = self.health_port or next(spare)
        self._check_tls()
        self.admin_key = resolve_admin_key(self.admin_key)
        self._workdir = Path(tempfile.mkdtemp(prefix="aot-triton-"))
        self.admin_key_path = write_key_file(self._workdir, self.admin_key)
        self._health: HealthServer | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.log_path = Path(self.log_path or self._workdir / "tritonserver.log")
        self._python: StepPython | None = None
        self._server = ServerLifecycle(self.http_url, self.admin_key, self.supervise, log=self._log,
                                       log_path=self.log_path, own_group=True,
                                       region_bytes=region_bound_of(self.repo / "models"),
                                       store_check=store_check_of(self.repo / "models"))

    def _check_tls(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ServerError("--tls-cert and --tls-key go together: give both, or neither")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ServerError("--tls-ca (client certificates) needs --tls-cert and --tls-key")
        for flag, value in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if value is not None:
                if not Path(value).is_file():
                    raise ServerError(f"{flag} {value}: no such file")
                setattr(self, flag[2:].replace("-", "_"), str(Path(value).resolve()))

    def tls_args(self) -> list[str]:
        """gRPC over TLS (Triton serves HTTP in the clear: put HTTPS in a proxy in front of it)."""
        if self.tls_cert is None:
            return []
        args = ["--grpc-use-ssl=true", f"--grpc-server-cert={self.tls_cert}", f"--grpc-server-key={self.tls_key}"]
        if self.tls_ca is not None:
            args += [f"--grpc-root-cert={self.tls_ca}", "--grpc-use-ssl-mutual=true"]
        return args

    @property
    def python(self) -> StepPython:
        """The steps' Python (step_python), probed once per server."""
        if self._python is None:
            self._python = step_python()
        return self._python

    @property
    def process(self) -> subprocess.Popen | None:
        """The tritonserver process: the running one, or the last."""
        return self._server.process

    @property
    def supervisor(self) -> Supervisor | None:
        """The supervisor of the last tritonserver that became ready."""
        return self._server.supervisor

    @property
    def ready_seconds(self) -> float | None:
        """How long the last tritonserver took from its start to ready."""
        return self._server.ready_seconds

    @property
    def health_url(self) -> str:
        return f"{self.metrics_host}:{self.health_port}"

    def command(self) -> list[str]:
        """tritonserver and its flags (the lifecycle adds the API restrictions: the control API takes the admin key
        only)."""
        return [str(triton_home() / "bin" / "tritonserver"), f"--model-repository={self.repo / 'models'}",
                f"--backend-directory={backends_folder(self._workdir, self.python.version)}", *self.device_args(),
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.metrics_host}", f"--metrics-port={self.metrics_port}", "--exit-timeout-secs=5",
                "--disable-auto-complete-config", "--log-info=true",
                "--model-control-mode=explicit",  # the supervisor reloads what died
                *(f"--load-model={m}" for m in self.models()),
                *self.tls_args(),
                *self.extra_args]

    def device_args(self) -> list[str]:
        """CPU: the configs/cpu.pbtxt configs, no pinned pool, no GPU metrics. CUDA: the GPU configs (config.pbtxt)
        and the CUDA and pinned memory pools the repository's largest batch needs (aot.serving.repository)."""
        if self.device == "cpu":
            return ["--model-config-name=cpu", "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0"]
        pools = memory_pool_bytes(read_repository(self.repo))
        # cuda:N: the server sees GPU N alone (CUDA_VISIBLE_DEVICES, environment()), as its device 0
        return [f"--cuda-memory-pool-byte-size=0:{pools['cuda']}",
                f"--pinned-memory-pool-byte-size={pools['pinned']}"]

    def models(self) -> list[str]:
        """The models to load (aot.serving.repository.models_to_load: the fused `aot` step and the task list on CPU and
        for the torch engine on a GPU; the plain encoder only with `vanilla`), or those `load` names."""
        if self.load is not None:
            return sorted(self.load)
        return models_to_load(read_repository(self.repo), "cpu" if self.device == "cpu" else "gpu", self.vanilla)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ) | self.step_environment
        env["PATH"] = f"{self.python.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (self.python.libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        env.setdefault("GLIBC_TUNABLES", SERVER_MALLOC)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        for key, value in SINGLE_THREADED_BLAS.items():  # a value the user set explicitly wins
            env.setdefault(key, value)
        if self.pool_bytes is not None:
            env[settings.POOL_BYTES.name] = str(self.pool_bytes)
        if self.device.startswith("cuda:"):  # the steps' "cuda" is then GPU N, and so is the server's pool
            env["CUDA_VISIBLE_DEVICES"] = self.device.partition(":")[2]
        return env

    def check_ports(self) -> None:
        ports = (("--http-port", self.http_port), ("--grpc-port", self.grpc_port), ("--metrics-port", self.metrics_port),
                 ("--health-port", self.health_port))
        for i, (flag, port) in enumerate(ports):
            for other, same in ports[:i]:
                if same == port:
                    raise ServerError(f"{other} and {flag} are both {port}: each endpoint needs its own port")
        for flag, port in ports:
            host = self.metrics_host if flag in ("--metrics-port", "--health-port") else self.host
            if not port_is_free(host, port):
                raise ServerError(f"port {host}:{port} ({flag}) is already in use; choose another {flag}")

    def is_ready(self) -> bool:
        """Triton's own readiness: enough while it starts (the supervisor begins after it)."""
        return self._server.triton_ready()

    def serves(self) -> bool:
        """The supervisor's /ready: every model loaded, ready and answering its probe (what a balancer asks)."""
        return http_ok(f"http://{self.health_url}/ready", 2)

    def readiness(self) -> tuple[int, dict]:
        """The supervisor's /ready in full: its HTTP status and its body (ready, reasons, warnings)."""
        try:
            with urllib.request.urlopen(f"http://{self.health_url}/ready", timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def start(self, timeout: float = 120) -> "LocalServer":
        if not (self.repo / "models").is_dir():
            raise ServerError(f"{self.repo} has no models/ folder: not a model repository from `aot export backbone`")
        self.check_ports()
        self._health = HealthServer(self._server.current_supervisor, self.metrics_host, self.health_port).start()
        try:
            self._launch(timeout)
        except BaseException:
            self._health.stop()
            self._health = None
            raise
        if self.restart:
            self._watcher = threading.Thread(target=self._watch, name="aot-server-watch", daemon=True)
            self._watcher.start()
        return self

    def _launch(self, timeout: float) -> None:
        command, env = self.command(), self.environment()  # the steps' Python probed before, not timed
        compile_steps(self.repo / "models", self.python.bin_dir / "python3")
        self._server.start(command, env)
        self._server.wait_ready(timeout)

    def _watch(self) -> None:
        """Start tritonserver again when it died (a crash, or a step the supervisor could not reload: the lifecycle
        stops it): at most MAX_RESTARTS times in RESTART_WINDOW seconds, then give up (`failed` says why; `aot serve`
        exits). A restart that dies before it is ready is one more death, counted on the next pass, not the end: it
        may have died just as it became ready, of the same cause as the others."""
        while (code := self._server.watch(until=self._stopping)) is not None:
            self._server.stop()  # reaps the stubs and their shared memory
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW] + [now]
            if len(self.restarts) > MAX_RESTARTS:
                self.failed = f"tritonserver died {len(self.restarts)} times in {RESTART_WINDOW:.0f} s (last exit code {code})"
                return
            self._log(f"tritonserver exited with code {code}; restarting it")
            try:
                self._launch(120)
            except ServerExited:
                continue
            except ServerError as exc:
                self.failed = f"tritonserver could not be restarted: {exc}"
                return

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def _log(self, message: str) -> None:
        print(f"aot: {message}", file=sys.stderr, flush=True)

    def drain(self) -> None:
        """The first step of a graceful stop: /ready answers 503 ("draining") from now on, so that a load balancer
        sends this server nothing new, while it answers every request that still reaches it. stop() then ends it
        (aot.serving.supervision.quiesce)."""
        if self._health is not None:
            self._health.drain("draining: this server is stopping (a graceful stop); send requests elsewhere")

    def stop(self, timeout: float = 15) -> int | None:
        """Stop the server and everything it started, and remove its temporary folder (kept when the server failed:
        it holds the log that the failure names); safe to call again, and after the server crashed. The stop is
        graceful (aot.serving.supervision.quiesce): new requests are refused on both protocols ("this server is
        stopping ... retry in 1.00 s"; aot.client: Unavailable, retried), those the steps began are finished, the
        HTTP connections that would hold tritonserver are closed, and tritonserver unloads its models ("Server is
        stopping" to what still arrives)."""
        self._stopping.set()
        if self.supervisor is not None:  # first: a server the watcher restarted dies with the watcher's thread
            self.supervisor.stop()       # (parent-death signal), and its supervisor must not try to repair that
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=150)
        if self._health is not None:
            self._health.stop()
            self._health = None
        code = self._server.stop(timeout)
        self.admin_key_path.unlink(missing_ok=True)  # a secret outlives no server, failed or not
        if not self.failed:
            shutil.rmtree(self._workdir, ignore_errors=True)
        return code

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
