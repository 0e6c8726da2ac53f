"""A hostile client and an unlucky operator against a real local tritonserver, started exactly as `aot serve` starts
it and as the compose file's command starts it (the supervisor entry point): no mocks.

Every request a client does not need (loading a model with a file override, replacing a step, unloading, the
repository index, model configs, statistics, logging, trace, shared memory) is refused without the admin key, no
code runs (a marker file) and the answers stay exactly what `aot predict` gives. Then the server heals what an
operator's accident breaks: an unloaded ensemble, a stopped or silent step, a damaged or truncated task table.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from aot.client.client import Client, InferenceError
from aot.exporter.task_export import export_task
from aot.local.server import LocalServer, free_port
from aot.local.triton_setup import backends_folder, step_python
from aot.serving.repository import read_repository
from aot.serving.store.writer import TaskStore
from aot.serving.supervision.admin_key import ADMIN_HEADER, GRPC_ADMIN_HEADER, RESTRICTED_APIS
from aot.serving.supervision.procfs import stub_processes, stubs_of
from aot.training.predict import Predictor
from tests.helpers import WITH_STEPS, make_repository, serve_for_tests, train_tiny_tasks

pytestmark = [pytest.mark.server]

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["good w1 w2", "w3 awful w4 w5", "the movie was superb", "dull plot"]
ATOL = 1e-3


# --- fixtures ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_models, sentiment_dir):
    return train_tiny_tasks(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("security-artifacts"), 2)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, artifacts):
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("security") / "repo",
                           {"alpha": (artifacts["alpha"], "fused"), "beta": (artifacts["beta"], "factored")})


@pytest.fixture(scope="module")
def expected(artifacts):
    return {name: Predictor.load(path).logits(TEXTS).numpy() for name, path in artifacts.items()}


class Served:
    """What a hostile test needs of a running server: its endpoints, and its admin key for the checks."""

    def __init__(self, http: str, grpc: str, health: str, key: str, log: Path, pid: int):
        self.http, self.grpc, self.health, self.key, self.log = http, grpc, health, key, log
        self.pid = pid  # the launching process (`aot serve`, or the supervisor of the compose command)


def _wait_ready(health: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _get(health, "/ready")[0] == 200:
            return
        time.sleep(0.2)
    raise AssertionError(f"{health}/ready never said 200")


@pytest.fixture(scope="module", params=["aot serve", "compose command"])
def served(request, repo, tmp_path_factory):
    """The server as `aot serve` runs it (the command itself), or as docker-compose.yml's command runs it in the
    container (python3 -m aot.serving tritonserver ..., the key from a secret file), on this machine's CPU."""
    work = tmp_path_factory.mktemp("served")
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "health")}
    env = dict(os.environ)
    if request.param == "aot serve":
        env.pop("AOT_ADMIN_KEY", None)
        command = [sys.executable, "-m", "aot", "serve", "--repo", str(repo), "--log", str(work / "log"),
                   *(f"--{name}-port={port}" for name, port in ports.items())]
    else:
        secret = work / "aot_admin_key"
        shutil.copy(repo / "admin-key", secret)
        env.update(AOT_ADMIN_KEY_FILE=str(secret), AOT_HEALTH_PORT=str(ports["health"]),
                   AOT_HEALTH_ADDRESS="127.0.0.1")
        compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["triton"]
        assert compose["environment"]["AOT_ADMIN_KEY_FILE"] == "/run/secrets/aot_admin_key"
        python = step_python()
        args = [a.replace("/repo/models", str(repo / "models")) for a in compose["command"]
                if "memory-pool" not in a]  # the GPU pools: this binary has no CUDA
        command = [*args, f"--backend-directory={backends_folder(work, python.version)}",
                   "--model-config-name=cpu", "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0",
                   *(f"--{n}-address=127.0.0.1" for n in ("http", "grpc", "metrics")),
                   *(f"--{n}-port={ports[n]}" for n in ("http", "grpc", "metrics"))]
        assert command[:3] == ["python3", "-m", "aot.serving"]
        command[0] = sys.executable
        env["PATH"] = f"{python.bin_dir}{os.pathsep}{env['PATH']}"
        env["LD_LIBRARY_PATH"] = python.libdir
        from aot.local.triton_setup import triton_home

        command[3] = str(triton_home() / "bin" / "tritonserver")
    log = open(work / "stdout", "w")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # a common default soft limit: the server raises its own
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               cwd=ROOT, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    health = f"127.0.0.1:{ports['health']}"
    try:
        _wait_ready(health)
        if request.param == "aot serve":
            info = json.loads((work / "stdout").read_text().splitlines()[0])
            key_file = Path(info["admin_key_file"])
            assert oct(key_file.stat().st_mode & 0o777) == "0o600"
            key = key_file.read_text().strip()
        else:
            key = (repo / "admin-key").read_text().strip()
        yield Served(f"127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['grpc']}", health, key, work, process.pid)
    finally:
        _stop_group(process)
        log.close()


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group a launcher leads, SIGKILL after 30 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# --- private files ----------------------------------------------------------------------------------------------

def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_repository_key_is_private_and_task_files_share_one_mode(tmp_path, tiny_models, artifacts):
    """REPO/admin-key (compose's secret, the Kubernetes Secret's source) stays 0600 through the first export, a
    task's publish and a backbone re-export; every file of a task version has the one mode the rest of the
    repository has (safetensors writes 0600: a server running as another user could not read the head)."""
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"alpha": (artifacts["alpha"], "fused"),
                                                                     "beta": (artifacts["beta"], "factored")})
    plain = 0o666 & ~_umask()
    key = (repo / "admin-key").read_text()
    assert _mode(repo / "admin-key") == 0o600
    assert _mode(repo / "aot_repository.json") == plain
    store = read_repository(repo).store_root
    for name in ("alpha", "beta"):
        folder = store / TaskStore(store).entries()[name].folder
        assert {path.name: _mode(path) for path in folder.iterdir()} == {path.name: plain for path in folder.iterdir()}
    assert "head.safetensors" in {p.name for p in (store / TaskStore(store).entries()["beta"].folder).iterdir()}

    from aot.exporter.backbone_export import export_backbone

    export_backbone(str(tiny_models["bert"]), repo, overwrite=True)
    assert _mode(repo / "admin-key") == 0o600 and (repo / "admin-key").read_text() == key
    (repo / "admin-key").chmod(0o644)  # as an export before this fix left it
    export_task(artifacts["alpha"], repo, "alpha", "factored", progress=False)
    assert _mode(repo / "admin-key") == 0o600 and (repo / "admin-key").read_text() == key


def _stubs_started_by(pid: int) -> list:
    """The python stubs of the tritonserver that process `pid` started (its child, or itself)."""
    children = {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    return [stub for server in children | {pid} for stub in stub_processes(server)]


def test_shared_memory_regions_are_private(served, expected):
    """The stubs' /dev/shm regions carry requests' texts and tensors: only the server's user may open them."""
    _answers_unchanged(served.grpc, expected)
    stubs = _stubs_started_by(served.pid)
    assert stubs, "no stub of this server found"
    regions = {Path("/dev/shm") / stub.shm_region.lstrip("/") for stub in stubs}
    assert {region.name: _mode(region) for region in regions} == {region.name: 0o600 for region in regions}


# --- helpers ----------------------------------------------------------------------------------------------------

def _request(url: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{url}{path}", data=body, headers=headers or {},
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _get(url: str, path: str) -> tuple[int, bytes]:
    try:
        return _request(url, path)
    except OSError:
        return 0, b""


def _answers_unchanged(grpc: str, expected) -> None:
    with Client(grpc, timeout=30) as client:
        for name in ("alpha", "beta"):
            for i, text in enumerate(TEXTS):
                np.testing.assert_allclose(client.infer(name, text)["logits"], expected[name][i], atol=ATOL)


def _evil_model(marker: Path) -> tuple[dict, str]:
    """A python model whose initialize writes `marker`: proof that a client ran code on the server."""
    config = {"name": "evil", "backend": "python", "max_batch_size": 0,
              "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
              "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}]}
    code = (f"class TritonPythonModel:\n    def initialize(self, args):\n"
            f"        open({str(marker)!r}, 'w').write('ran')\n    def execute(self, requests):\n        return []\n")
    return config, code


# --- 1. the control API is closed ---------------------------------------------------------------------------------

def test_load_with_file_override_runs_no_code(served, tmp_path, expected):
    """The remote-code-execution finding: a load with a config and a base64 model.py, over HTTP and gRPC."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    marker = tmp_path / "pwned"
    config, code = _evil_model(marker)
    body = json.dumps({"parameters": {"config": json.dumps(config),
                                      "file:1/model.py": base64.b64encode(code.encode()).decode()}}).encode()
    status, answer = _request(served.http, "/v2/repository/models/evil/load", body)
    assert status == 403 and f"expecting header '{ADMIN_HEADER}'" in answer.decode()
    client = grpcclient.InferenceServerClient(served.grpc)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.load_model("evil", config=json.dumps(config), files={"file:1/model.py": code.encode()})
        with pytest.raises(InferenceServerException, match="restricted"):  # a wrong key is no key
            client.load_model("evil", config=json.dumps(config), files={"file:1/model.py": code.encode()},
                              headers={GRPC_ADMIN_HEADER: "not-the-key-0123456789"})
    finally:
        client.close()
    time.sleep(0.5)
    assert not marker.exists(), "a client ran code on the server"
    _answers_unchanged(served.grpc, expected)


def test_no_step_can_be_replaced_or_unloaded(served, tmp_path, expected):
    """The head override that made every task answer what the attacker chose (the GPU ensemble's head step, and
    the CPU configs' fused step that holds the head), and an unload of every model."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    for model, template in (("head", "head"), ("aot", "fused")):
        code = (ROOT / "aot" / "model_repository" / template / "1" / "model.py").read_text()
        assert "head_outputs(" in code
        evil = code + ("\n\ndef head_outputs(*args, **kwargs):  # every task answers what the attacker chose\n"
                       "    raise SystemExit('the attacker chose')\n")
        config = {"name": model, "backend": "python", "max_batch_size": 64,
                  "parameters": {"evil": {"string_value": "1"}}}
        body = json.dumps({"parameters": {"config": json.dumps(config),
                                          "file:1/model.py": base64.b64encode(evil.encode()).decode()}}).encode()
        assert _request(served.http, f"/v2/repository/models/{model}/load", body)[0] == 403
    models = ["aot", "tokenizer", "backbone", "head", "task_list", "vanilla", "backbone_vanilla"]
    client = grpcclient.InferenceServerClient(served.grpc)
    try:
        for model in models:
            assert _request(served.http, f"/v2/repository/models/{model}/unload", b"{}")[0] == 403
            with pytest.raises(InferenceServerException, match="restricted"):
                client.unload_model(model)
    finally:
        client.close()
    assert _get(served.health, "/ready")[0] == 200
    _answers_unchanged(served.grpc, expected)


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v2/repository/index", b"{}"),
    ("GET", "/v2/models/aot/config", None),
    ("GET", "/v2/models/stats", None),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/logging", b'{"log_verbose_level": 1, "log_file": "/tmp/aot-evil.log"}'),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/trace/setting", b'{"trace_level": ["TIMESTAMPS"], "trace_file": "/tmp/aot-evil.json"}'),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("POST", "/v2/systemsharedmemory/region/evil/register", b'{"key": "/evil", "offset": 0, "byte_size": 64}'),
])
def test_every_control_api_needs_the_key_over_http(served, method, path, body):
    status, answer = _request(served.http, path, body)
    assert status == 403, (path, status, answer[:200])
    status, answer = _request(served.http, path, body, {ADMIN_HEADER: served.key})
    assert status != 403, (path, "the admin key must open what it restricts")


def test_every_control_api_needs_the_key_over_grpc(served):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(served.grpc)
    calls = {"model-repository": lambda **kw: client.get_model_repository_index(**kw),
             "model-config": lambda **kw: client.get_model_config("aot", **kw),
             "statistics": lambda **kw: client.get_inference_statistics("aot", **kw),
             "logging": lambda **kw: client.get_log_settings(**kw),
             "trace": lambda **kw: client.get_trace_settings(**kw),
             "shared-memory": lambda **kw: client.get_system_shared_memory_status(**kw)}
    assert set(calls) == set(RESTRICTED_APIS)
    try:
        for api, call in calls.items():
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
            call(headers={GRPC_ADMIN_HEADER: served.key})  # the key opens it
        # what clients need stays public
        assert client.is_server_ready() and client.is_model_ready("aot")
        assert client.get_model_metadata("aot").name == "aot"
    finally:
        client.close()


def test_the_key_is_never_logged(served):
    logs = [served.log / name for name in ("stdout", "log") if (served.log / name).is_file()]
    text = "".join(p.read_text(errors="replace") for p in logs)  # the server's log and what it printed
    assert text.strip(), "nothing was logged: the check below would prove nothing"
    assert served.key not in text


# --- 1b. connections ------------------------------------------------------------------------------------------------

def _tritonserver_of(launcher: int) -> int:
    """The tritonserver process a launcher (`aot serve`, the container's supervisor) started."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "tritonserver" and \
                    int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher:
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no tritonserver started by {launcher}")


def _open_files_limit(pid: int) -> tuple[int, int]:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def test_idle_connections_leave_room_for_clients(served, expected):
    """Started from a shell whose soft open-file limit is 1,024 (a common default), tritonserver runs at its hard
    limit; 2,000 idle TCP connections to the gRPC port (they held every descriptor at 1,024) leave a new client
    served and /ready 200, and no step is repaired for it."""
    import socket

    triton = _tritonserver_of(served.pid)
    soft, hard = _open_files_limit(triton)
    assert soft == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[1], (soft, hard)
    stubs = {s.instance: s.pid for s in stubs_of(triton).values()}
    host, port = served.grpc.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(2000)]
    try:
        start = time.monotonic()
        _answers_unchanged(served.grpc, expected)
        answered = time.monotonic() - start
        assert _get(served.health, "/ready")[0] == 200
    finally:
        for s in idle:
            s.close()
    assert {s.instance: s.pid for s in stubs_of(triton).values()} == stubs
    assert "supervisor:" not in (served.log / "stdout").read_text()
    print(f"\n2,000 idle gRPC connections at an open-file limit of {soft:,}: a new client's answers took "
          f"{answered:.2f} s, /ready 200, no stub repaired")


@pytest.fixture
def saturated(tmp_path, repo):
    """`aot serve` whose hard open-file limit is 1,024 (it cannot raise it): the `aot serve` process and its
    tritonserver pid."""
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "health")}
    log = open(tmp_path / "stdout", "w")
    process = subprocess.Popen([sys.executable, "-m", "aot", "serve", "--repo", str(repo),
                                *(f"--{name}-port={port}" for name, port in ports.items())],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
    try:
        _wait_ready(f"127.0.0.1:{ports['health']}")
        yield process, _tritonserver_of(process.pid), ports, tmp_path / "stdout"
    finally:
        _stop_group(process)
        log.close()


def test_a_saturated_front_end_is_no_hung_step(saturated, expected):
    """Idle connections take every descriptor tritonserver has: no client gets in, and no probe either. /ready
    says 503 and why within seconds (it never goes silent), and no stub is killed however long it lasts (the
    supervisor used to kill the healthy steps); once the connections close, the same stubs serve again."""
    import socket

    process, triton, ports, log = saturated
    health = f"127.0.0.1:{ports['health']}"
    stubs = {s.instance: s.pid for s in stubs_of(triton).values()}
    idle = []
    try:
        for _ in range(1100):
            idle.append(socket.create_connection(("127.0.0.1", ports["grpc"]), timeout=5))
            idle.append(socket.create_connection(("127.0.0.1", ports["http"]), timeout=5))
        start = time.monotonic()
        status, body = _get(health, "/ready")
        answered = time.monotonic() - start
        assert status == 503 and b"front end answers nothing" in body, (status, body)
        assert answered < 10, answered
        time.sleep(12)  # twice the time a silent step is given
        assert {s.instance: s.pid for s in stubs_of(triton).values()} == stubs
    finally:
        for s in idle:
            s.close()
    closed = time.monotonic()
    assert _wait(lambda: _get(health, "/ready")[0] == 200, 60)
    print(f"\n2,200 idle connections at a hard open-file limit of 1,024: /ready 503 in {answered:.2f} s, no stub "
          f"killed in 12 s; /ready 200 again {time.monotonic() - closed:.2f} s after they closed")
    assert {s.instance: s.pid for s in stubs_of(triton).values()} == stubs
    assert "stopped answering" not in log.read_text() and process.poll() is None
    with Client(f"127.0.0.1:{ports['grpc']}", timeout=30) as client:
        np.testing.assert_allclose(client.infer("alpha", TEXTS[0])["logits"], expected["alpha"][0], atol=ATOL)


def test_a_frozen_tritonserver_is_no_hung_step(scratch, expected):
    """tritonserver stopped (SIGSTOP) for longer than a step may stay silent: its steps answer no probe, as nothing
    reaches them, but none is killed; once it continues, the same stubs serve."""
    scratch.supervisor.hung_seconds = 3.0
    stubs = {s.instance: s.pid for s in stubs_of(scratch.process.pid).values()}
    repairs = len(scratch.supervisor.repairs)
    os.kill(scratch.process.pid, signal.SIGSTOP)
    try:
        status, body = _get(scratch.health_url, "/ready")
        assert status == 503 and b"it is stopped" in body, (status, body)
        time.sleep(8)
    finally:
        os.kill(scratch.process.pid, signal.SIGCONT)
    assert _wait(lambda: _get(scratch.health_url, "/ready")[0] == 200, 30)
    assert scratch.supervisor.repairs[repairs:] == [] and scratch.restarts == []
    assert {s.instance: s.pid for s in stubs_of(scratch.process.pid).values()} == stubs
    _answers_unchanged(scratch.grpc_url, expected)


# --- 2. readiness tells the truth, and a broken model is repaired --------------------------------------------------

@pytest.fixture
def scratch(request, tmp_path, repo):
    """A LocalServer of its own on a copy of the repository (the cases below break it on purpose), the GPU
    ensembles' separate steps loaded too."""
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    yield from serve_for_tests(request, copy, load=WITH_STEPS)


def _wait(condition, timeout: float, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(step)
    return None


def test_unloaded_ensemble_is_reported_and_reloaded(scratch, expected):
    """Unloading the ensemble (with the key: an operator's mistake) was a permanent outage behind a 200."""
    status, _ = _request(scratch.http_url, "/v2/repository/models/aot/unload", b"{}", {ADMIN_HEADER: scratch.admin_key})
    assert status == 200
    repair = _wait(lambda: [r for r in scratch.supervisor.repairs if r.model == "aot" and r.seconds], 10)
    assert repair and repair[0].cause == "not ready"
    assert _get(scratch.health_url, "/ready")[0] == 200
    _answers_unchanged(scratch.grpc_url, expected)


def test_stopped_step_is_detected_killed_and_reloaded_without_crashing_the_server(scratch, expected):
    """kill -STOP of the stub that serves clients (the fused `aot` step): /ready says 503 at once, the stub is killed
    (never resumed: a resumed stub aborted tritonserver), the model reloaded, and the same tritonserver answers
    exactly again."""
    server_pid = scratch.process.pid
    stub = next(s for s in stubs_of(server_pid).values() if s.model == "aot")
    start = time.monotonic()
    os.kill(stub.pid, signal.SIGSTOP)
    unready = _wait(lambda: _get(scratch.health_url, "/ready")[0] == 503, 10, 0.02)
    detected = time.monotonic() - start
    assert unready, "/ready still said 200 with a stopped step"
    repaired = _wait(lambda: [r for r in scratch.supervisor.repairs if r.cause == "hung" and r.seconds], 30)
    assert repaired and repaired[0].model == "aot"
    assert _wait(lambda: _get(scratch.health_url, "/ready")[0] == 200, 30)
    print(f"stopped step: unready after {detected:.2f} s, reloaded in {repaired[0].seconds:.2f} s")
    assert scratch.process.poll() is None and scratch.process.pid == server_pid, "tritonserver did not survive"
    _answers_unchanged(scratch.grpc_url, expected)


def test_silent_step_is_found_by_its_probe(request, tmp_path, repo, expected):
    """A step stuck in a long call (not stopped, so the process table shows nothing): its liveness probe goes
    unanswered, and after hung_seconds it is killed and reloaded. The stuck call is injected into a copy of the
    fused step's model file: a batch that arrives while the file `hang` exists never returns."""
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    flag = tmp_path / "hang"
    model = copy / "models" / "aot" / "1" / "model.py"
    model.write_text(model.read_text() + f"""

_execute = TritonPythonModel.execute


def _stuck(self, requests):
    import os, time
    while os.path.exists({str(flag)!r}):
        time.sleep(0.1)
    return _execute(self, requests)


TritonPythonModel.execute = _stuck
""")
    for server in serve_for_tests(request, copy):
        server.supervisor.hung_seconds = 3.0
        start = time.monotonic()
        flag.write_text("")
        assert _wait(lambda: _get(server.health_url, "/ready")[0] == 503, 15, 0.05), "a silent step stayed ready"
        detected = time.monotonic() - start
        repaired = _wait(lambda: [r for r in server.supervisor.repairs if r.cause == "hung" and r.seconds], 30)
        flag.unlink()  # only now: a stub let go earlier would answer, and there would be nothing to repair
        assert repaired and repaired[0].model == "aot", server.supervisor.repairs
        assert _wait(lambda: _get(server.health_url, "/ready")[0] == 200, 30)
        print(f"silent step: unready after {detected:.2f} s (hung_seconds 3)")
        _answers_unchanged(server.grpc_url, expected)


def test_one_instance_stuck_in_a_batch_is_found_while_the_other_answers_the_probes(request, tmp_path, repo,
                                                                                     expected):
    """The fused step runs 2 instances; probes go to whichever is free, so a deadlocked one would hold its batch
    forever behind the other's answers. Each instance records when its running `execute` began (aot.serving.watch):
    one stuck for hung_seconds without using CPU is killed and replaced alone: the other instance keeps its stub and
    serves meanwhile. The stuck call is injected into the second instance's batch computation, after the watch
    began."""
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    flag = tmp_path / "hang"
    model = copy / "models" / "aot" / "1" / "model.py"
    model.write_text(model.read_text() + f"""

_initialize, _run = TritonPythonModel.initialize, TritonPythonModel._run


def _init(self, args):
    self.instance_name = args["model_instance_name"]
    _initialize(self, args)


def _stuck(self, batch):
    import os, time
    while os.path.exists({str(flag)!r}) and self.instance_name == "aot_1_0":
        time.sleep(0.1)
    return _run(self, batch)


TritonPythonModel.initialize, TritonPythonModel._run = _init, _stuck
""")
    for server in serve_for_tests(request, copy):
        before = {s.instance: s.pid for s in stubs_of(server.process.pid).values() if s.model == "aot"}
        assert sorted(before) == ["aot_0_0", "aot_1_0"]
        server.supervisor.hung_seconds = 3.0
        flag.write_text("")
        start, began = time.monotonic(), time.time()
        with Client(server.grpc_url, timeout=60) as client:  # traffic, so that the second instance takes a batch
            answers = client.infer_many([{"task": "alpha", "text": TEXTS[i % len(TEXTS)]} for i in range(40)],
                                        concurrency=4)
        took = time.monotonic() - start
        repaired = _wait(lambda: [r for r in server.supervisor.repairs if r.cause == "hung" and r.seconds], 30)
        flag.unlink()
        assert repaired and repaired[0].model == "aot", server.supervisor.repairs
        assert (repaired[0].instance, repaired[0].how) == ("aot_1_0", "replace"), repaired
        after = {s.instance: s.pid for s in stubs_of(server.process.pid).values() if s.model == "aot"}
        assert after == {"aot_0_0": before["aot_0_0"], "aot_1_r1_0": after.get("aot_1_r1_0")}, (before, after)
        assert any("error" not in a for a in answers) and took < 30, (took, answers[:3])
        assert _wait(lambda: _get(server.health_url, "/ready")[0] == 200, 30)
        print(f"one stuck instance: found {repaired[0].detected - began:.2f} s after the hang began (hung_seconds "
              f"3), replaced in {repaired[0].seconds:.2f} s; {sum('error' in a for a in answers)} of 40 requests "
              "failed")
        _answers_unchanged(server.grpc_url, expected)


# --- 3. a damaged task fails alone, with a clear error, and is reported ---------------------------------------------

def _table(repo: Path, name: str) -> Path:
    store = TaskStore(read_repository(repo).store_root)
    return store.version_folder(store.entries()[name].folder) / "table.npy"


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_table_is_refused_for_that_task_only(request, tmp_path, repo, expected, damage):
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    table = _table(copy, "alpha")
    server = LocalServer(copy, pool_bytes=0)  # every request reads the table: the hardest case
    with server:
        with Client(server.grpc_url, timeout=30) as client:
            assert client.infer("alpha", TEXTS[0])["label"]  # mapped and verified
            step = next(s for s in stubs_of(server.process.pid).values() if s.model == "aot")
            with open(table, "r+b") as f:
                if damage == "flip":
                    f.seek(table.stat().st_size - 4096)
                    f.write(bytes(random.Random(0).randrange(256) for _ in range(2048)))
                else:
                    f.truncate(table.stat().st_size // 2)
            answers = client.infer_many([{"task": name, "text": text} for name in ("alpha", "beta")
                                         for text in TEXTS * 3], concurrency=8)
            alpha, beta = answers[:len(TEXTS) * 3], answers[len(TEXTS) * 3:]
            assert len(alpha) == len(beta) == len(TEXTS) * 3, len(answers)
            # an answer read only intact rows (each hashed as it was read), or is refused naming the table
            assert any("error" in a for a in alpha), alpha[:2]
            for i, a in enumerate(alpha):
                if "error" in a:
                    assert "table.npy is damaged" in a["error"] and a["status"] == "UNAVAILABLE", a
                else:
                    np.testing.assert_allclose(a["logits"], expected["alpha"][i % len(TEXTS)], atol=ATOL)
            assert all("error" not in a for a in beta), beta[:2]
            listing = _wait(lambda: client.tasks() if "alpha" in client.tasks()["errors"] else None, 15, 0.5)
            assert listing and "table.npy" in listing["errors"]["alpha"]
            assert [t["name"] for t in listing["tasks"]] == ["beta"]
        assert step.pid in {s.pid for s in stubs_of(server.process.pid).values()}, "the aot stub died"
        metrics = urllib.request.urlopen(f"http://{server.host}:{server.metrics_port}/metrics").read().decode()
        assert re.search(r'aot_task_errors_total\{[^}]*step="aot"[^}]*task="alpha"', metrics)
        _answers_unchanged_beta(server.grpc_url, expected)
    result = subprocess.run([sys.executable, "-m", "aot", "export", "verify", "--repo", str(copy)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["name"], r["ok"]) for r in lines] == [("alpha", False), ("beta", True)]
    assert "table.npy" in lines[0]["error"]


def _answers_unchanged_beta(grpc: str, expected) -> None:
    with Client(grpc, timeout=30) as client:
        for i, text in enumerate(TEXTS):
            np.testing.assert_allclose(client.infer("beta", text)["logits"], expected["beta"][i], atol=ATOL)


# --- 4. a client cannot grow the server ----------------------------------------------------------------------------

def test_made_up_task_versions_add_no_metric_series(scratch):
    """Random task versions, as TASK to `aot` (TASK@VERSION) and as TASK_VERSION in direct calls to the GPU
    ensemble's head step: each is refused (404 or 400) and none becomes a metric label (before: one series per
    value, 77,512 series and +110 MB per process)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    def page() -> str:
        return urllib.request.urlopen(f"http://{scratch.host}:{scratch.metrics_port}/metrics").read().decode()

    client = grpcclient.InferenceServerClient(scratch.grpc_url)
    rng = random.Random(0)
    try:
        for i in range(300):
            version = f"t{rng.getrandbits(40):x}@{rng.getrandbits(48):012x}" if i % 2 else f"x{i}" * 5
            head = i % 4 < 2
            version_input = grpcclient.InferInput("TASK_VERSION" if head else "TASK", [1, 1], "BYTES")
            version_input.set_data_from_numpy(np.array([[version.encode()]], dtype=np.object_))
            if head:
                second = grpcclient.InferInput("pooled_hidden", [1, 2, 32], "FP32")
                second.set_data_from_numpy(np.zeros((1, 2, 32), dtype=np.float32))
            else:
                second = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
                second.set_data_from_numpy(np.array([[b"good"]], dtype=np.object_))
            with pytest.raises(InferenceServerException) as info:
                client.infer("head" if head else "aot", [version_input, second])
            assert info.value.status() in ("StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT")
    finally:
        client.close()
    served = _served_versions(scratch)

    def versions() -> set[str]:  # of the aot_ series (Triton's own say version="1")
        return set(re.findall(r'^aot_[^{]*\{[^}]*version="([^"]*)"', page(), re.M))

    with Client(scratch.grpc_url) as c:  # a request after the flush interval (1 s) makes the head publish
        assert _wait(lambda: c.infer("alpha", TEXTS[0]) and versions() & served, 20, 0.5), "no aot_ series published"
    from aot.serving.metric_labels import PLACEHOLDERS  # <unknown>, <none>, <other>: no task name can take them

    assert versions() <= {*served, *PLACEHOLDERS}, sorted(versions())[:5]


def _served_versions(server) -> set[str]:
    store = TaskStore(read_repository(server.repo).store_root)
    return {e.folder for e in store.entries().values()}


def _held_memory(server_pid: int) -> int:
    """Bytes tritonserver and its stubs hold: their anonymous memory and their shared-memory regions' pages."""
    from aot.serving.shm import allocated_bytes

    def anonymous(pid: int) -> int:
        try:
            return int(re.search(r"RssAnon:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())[1]) * 1024
        except (OSError, TypeError):
            return 0

    stubs = stub_processes(server_pid)
    return anonymous(server_pid) + sum(anonymous(s.pid) + allocated_bytes(s.shm_region) for s in stubs)


MEMORY_BOUND = 200 << 20  # what oversized requests may leave behind, in all


@pytest.mark.parametrize("n", [25_000_000, 4_000_000], ids=["25M ids", "4M ids"])
def test_oversized_requests_leave_memory_at_its_baseline(request, tmp_path, repo, expected, n):
    """The issue's case: INT64 [1, 25,000,000] ids and mask (400 MB) to `aot` and `vanilla`, twice each. Triton
    2.51 takes them whole (no size limit on gRPC, HTTP or a variable dimension) and copies each into a step's shared
    memory before the step refuses it, which grew the regions by 600-700 MB for good. Now each is refused (400), the
    supervisor replaces every instance whose region grew past its bound while the others serve, and tritonserver
    keeps no request buffers: within 60 s the server holds at most MEMORY_BOUND more than before. Issue 46: [1,
    4,000,000] (64 MB) stayed under the old bound (64 MiB plus a batch's tensors between steps) and left +290 MB; a
    step that takes clients' requests alone is bound by those now (aot.serving.limits.CLIENT_STEPS, 30 MiB here)."""
    import tritonclient.grpc as grpcclient

    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    for server in serve_for_tests(request, copy, load=("aot", "task_list", "vanilla")):  # `vanilla` too
        pid = server.process.pid
        _answers_unchanged(server.grpc_url, expected)
        baseline = _held_memory(pid)
        tensors = []
        for name in ("input_ids", "attention_mask"):
            tensors.append(grpcclient.InferInput(name, [1, n], "INT64"))
            tensors[-1].set_data_from_numpy(np.ones((1, n), np.int64))
        peak = baseline
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            for model in ("aot", "vanilla", "aot", "vanilla"):
                with pytest.raises(Exception, match="INVALID_ARGUMENT"):
                    client.infer(model, tensors, client_timeout=120)
                peak = max(peak, _held_memory(pid))
        del tensors
        from aot.serving.shm import allocated_bytes

        bounds = server.supervisor.region_bytes

        def settled() -> bool:  # every region under its bound again, no repair running, and memory back
            stubs = list(stub_processes(pid))
            regions = bool(stubs) and all(allocated_bytes(s.shm_region) <= bounds.region_of(s.model) for s in stubs)
            return regions and not server.supervisor.repairing and _held_memory(pid) <= baseline + MEMORY_BOUND

        back = _wait(settled, 60, 0.5)
        after = _held_memory(pid)
        grown = [r for r in server.supervisor.repairs if r.cause == "grown"]
        print(f"4 oversized requests of [1, {n:,}] ids and mask: held memory {baseline >> 20} MB before, "
              f"{peak >> 20} MB at most between them, {after >> 20} MB after; {len(grown)} instances replaced")
        assert back, (baseline >> 20, after >> 20, server.supervisor.repairs)
        assert grown and all(r.how == "replace" and r.error is None for r in grown), server.supervisor.repairs
        assert server.process.pid == pid and server.restarts == []
        _answers_unchanged(server.grpc_url, expected)


# --- 5. client mistakes get the status codes clients expect ------------------------------------------------------

@pytest.mark.parametrize("task,text,status,message", [
    ("nosuch", "good", 404, "unknown task 'nosuch'"),
    ("alpha", "", 400, "TEXT is empty"),
    ("alpha", "\u0000\u200b\u200d\ufeff \t", 400, "TEXT is empty"),  # NUL and zero-width only: empty
    ("bad name!", "good", 400, "invalid task name"),
])
def test_client_mistakes_answer_4xx(served, task, text, status, message):
    body = json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]},
                                  {"name": "TASK", "shape": [1, 1], "datatype": "BYTES", "data": [task]}]}).encode()
    code, answer = _request(served.http, "/v2/models/aot/infer", body)
    assert code == status and message in answer.decode(), (code, answer)


# --- 6. an export killed mid-way leaves nothing behind for long ----------------------------------------------------

def test_killed_export_debris_is_removed_by_export_list(tmp_path, repo, artifacts):
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    export = subprocess.Popen([sys.executable, "-m", "aot", "export", "task", "--task", str(artifacts["alpha"]),
                               "--repo", str(copy), "--name", "gamma", "--no-progress"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = TaskStore(copy / "tasks")
    debris = _wait(lambda: list(store.staging.glob("*")), 120, 0.01)
    export.kill()
    export.wait()
    assert debris, "the export never wrote its temporary folder"
    result = subprocess.run([sys.executable, "-m", "aot", "export", "list", "--repo", str(copy)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "left by killed exports" in result.stderr
    assert not list(store.staging.glob("*"))
    assert [json.loads(line)["name"] for line in result.stdout.splitlines()] == ["alpha", "beta"]


# --- 7. TLS ---------------------------------------------------------------------------------------------------------

def _certificates(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=aot-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                            ("client", "extendedKeyUsage=clientAuth")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=aot-test-{name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr")
        (folder / f"{name}.ext").write_text(extension + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return {p.stem + p.suffix.replace(".", "_"): p for p in folder.iterdir()}


def test_grpc_over_mutual_tls(tmp_path, repo, expected):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test's certificates")
    certs = _certificates(tmp_path)
    server = LocalServer(repo, tls_cert=str(certs["server_pem"]), tls_key=str(certs["server_key"]),
                         tls_ca=str(certs["ca_pem"]))
    with server:
        with Client(server.grpc_url, ca=str(certs["ca_pem"]), cert=str(certs["client_pem"]),
                    key=str(certs["client_key"]), timeout=30) as client:
            np.testing.assert_allclose(client.infer("alpha", TEXTS[0])["logits"], expected["alpha"][0], atol=ATOL)
        result = subprocess.run([sys.executable, "-m", "aot", "tasks", "--url", server.grpc_url,
                                 "--ca", str(certs["ca_pem"]), "--cert", str(certs["client_pem"]),
                                 "--key", str(certs["client_key"])], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0 and "alpha" in result.stdout, result.stderr
        for kwargs in ({}, {"ca": str(certs["ca_pem"])}):  # in the clear, or TLS without a client certificate
            with Client(server.grpc_url, timeout=10, **kwargs) as client, pytest.raises(InferenceError):
                client.infer("alpha", TEXTS[0])
