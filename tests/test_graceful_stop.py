"""The operator's commands through a real `aot serve`, in processes where torch and transformers cannot be imported:
they start without them (issue 47.3), and a graceful stop of that server (SIGTERM) drains: it keeps answering while
/ready says 503, finishes what it accepted, and every request it refuses is a retryable Unavailable, never "task not
found" (issue 47.2). The fleet's rolling restart: tests/test_fleet.py."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from aot.client.client import Client, InferenceError
from aot.exporter.task_export import export_task
from aot.local.server import free_ports
from tests.helpers import make_repository, train_tiny_task

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parent.parent
TEXT = "good w1 w2"
# `aot` with torch, transformers and their kin unimportable: an import of one fails as on a client-only install, and
# is reported on stderr at exit (a command that catches the ImportError must not hide that it tried)
POISONED = """
import atexit, importlib.abc, sys
tried = []
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "peft", "sklearn", "scipy"):
            tried.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
atexit.register(lambda: tried and print("IMPORTED", sorted(set(tried)), file=sys.stderr))
from aot.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _aot(*argv: str, **kw) -> subprocess.CompletedProcess:
    """`aot ARGV...` in a poisoned process: it must succeed without touching torch."""
    done = subprocess.run([sys.executable, "-c", POISONED, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, **kw)
    assert done.returncode == 0 and "IMPORTED" not in done.stderr, (argv, done.stderr)
    return done


def _lines(done: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in done.stdout.splitlines()]


def _ready(health: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{health}/ready", timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, sentiment_dir):
    artifact = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("graceful") / "task")
    repo = make_repository(tiny_models["bert"], tmp_path_factory.mktemp("graceful") / "repo",
                           {"sent": (artifact, "factored")})
    export_task(artifact, repo, "sent", "factored", progress=False)  # a second version: rollback and route
    return repo


@pytest.fixture(scope="module")
def served(repo, tmp_path_factory):
    """A poisoned `aot serve` that drains for 10 minutes on SIGTERM (the test ends the drain with a second one):
    the process, its JSON line and its log."""
    log = tmp_path_factory.mktemp("graceful-log") / "tritonserver.log"
    ports = dict(zip(("http", "grpc", "metrics", "health"), free_ports(4), strict=True))
    process = subprocess.Popen([sys.executable, "-c", POISONED, "serve", "--repo", str(repo), "--log", str(log),
                                "--drain-seconds", "600", *(f"--{name}-port={port}" for name, port in ports.items())],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               start_new_session=True)
    try:
        line = process.stdout.readline()
        assert line, process.stderr.read()
        yield process, json.loads(line), log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def test_client_and_operator_commands_import_no_torch(served, repo):
    """`aot --version`, tasks, infer, export tenant (create several, list), versions, route, rollback, verify and
    list, and the `aot serve` serving them, all in processes that cannot import torch or transformers."""
    _, info, _ = served
    assert _aot("--version").stdout.startswith("aot ")
    assert [t["name"] for t in _lines(_aot("tasks", "--url", info["grpc"]))] == ["sent"]
    [answer] = _lines(_aot("infer", "--url", info["grpc"], "--task", "sent", TEXT))
    assert answer["version"].startswith("sent@")
    made = _lines(_aot("export", "tenant", "create", "acme", "bahn", "--repo", str(repo)))
    assert [m["tenant"] for m in made] == ["acme", "bahn"]
    assert [t["tenant"] for t in _lines(_aot("export", "tenant", "list", "--repo", str(repo)))] == ["acme", "bahn"]
    versions = [v["version"] for v in _lines(_aot("export", "versions", "sent", "--repo", str(repo)))]
    assert len(versions) == 2
    _aot("export", "route", "sent", f"{versions[0]}=90", f"{versions[1]}=10", "--repo", str(repo))
    _aot("export", "rollback", "sent", versions[1], "--repo", str(repo))
    assert _lines(_aot("export", "verify", "--repo", str(repo))) == [{"name": "sent", "ok": True}]
    assert [e["name"] for e in _lines(_aot("export", "list", "--repo", str(repo)))] == ["sent"]


def test_a_graceful_stop_drains_and_refuses_as_unavailable(served):
    """SIGTERM: /ready answers 503 ("draining") while requests are still answered; a second SIGTERM stops the server,
    which finishes the requests it accepted (its log: every in-flight request done before it unloads); clients that
    never retry (retry_seconds=0) sending all along get answers, or Unavailable with retryable true: no TaskNotFound,
    no other error. `aot serve` exits 0 and never imported torch."""
    process, info, log = served
    outcomes: Counter = Counter()
    sending = threading.Event()
    stop = threading.Event()

    def send() -> None:
        with Client(info["grpc"], retry_seconds=0) as client:
            while not stop.is_set():
                try:
                    client.infer("sent", TEXT)
                    outcomes["answered"] += 1
                except InferenceError as exc:
                    outcomes[(type(exc).__name__, exc.retryable, str(exc)[:60])] += 1
                sending.set()

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        assert sending.wait(60)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while (status := _ready(info["health"]))[0] != 503:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status[1]["reasons"][0].startswith("draining")
        answered = outcomes["answered"]
        with Client(info["grpc"], retry_seconds=0) as client:  # still answered while draining
            assert client.infer("sent", TEXT)["version"].startswith("sent@")
        while outcomes["answered"] < answered + 50:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)  # the second: stop now
        assert process.wait(60) == 0
        time.sleep(0.5)  # the clients meet the stopped server
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    errors = {k: n for k, n in outcomes.items() if k != "answered"}
    assert errors and all(kind == "Unavailable" and retryable for kind, retryable, _ in errors), errors
    stderr = process.stderr.read()
    assert "IMPORTED" not in stderr and "aot: draining: /ready answers 503" in stderr, stderr
    text = log.read_text()
    assert "Waiting for in-flight requests to complete" in text
    assert "All models are stopped, unloading models" in text  # logged only once no request was in flight
    print(f"\ngraceful stop under load: {outcomes['answered']} answered, "
          f"{sum(errors.values())} refused as Unavailable (retryable) once stopping: "
          + "; ".join(f"{n} x {message}" for (_, _, message), n in errors.items()))


# --- the stop's end, after the drain (issue 57.3) ------------------------------------------------------------------

def _http_infer(http_url: str, text: str = TEXT) -> tuple[int, str]:
    """One inference over HTTP/JSON: its status and body."""
    body = json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]},
                                  {"name": "TASK", "shape": [1, 1], "datatype": "BYTES", "data": ["sent"]}]})
    request = urllib.request.Request(f"http://{http_url}/v2/models/aot/infer", body.encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_stopping_server_refuses_new_requests_on_both_protocols(repo):
    """Once a server stops (its supervisor marks it: aot.serving.watch.mark_stopping), its first step refuses every
    new request, over gRPC and over HTTP alike, with a retryable refusal and a retry hint (aot.Client: Unavailable,
    retry_after); the mark gone, it answers again. Before, gRPC went on answering through Triton's HTTP wait."""
    from aot.local.server import LocalServer
    from aot.serving.watch import mark_stopping, stopping_path

    with LocalServer(repo) as server:
        pid = server.process.pid
        with Client(server.grpc_url, retry_seconds=0) as client:
            assert client.infer("sent", TEXT)["version"].startswith("sent@")
            assert _http_infer(server.http_url)[0] == 200
            mark_stopping(pid)
            try:
                with pytest.raises(InferenceError) as refused:
                    client.infer("sent", TEXT)
                status, body = _http_infer(server.http_url)
            finally:
                stopping_path(pid).unlink()
            assert type(refused.value).__name__ == "Unavailable" and refused.value.retryable, refused.value
            assert "this server is stopping" in str(refused.value) and refused.value.retry_after == 1.0
            assert status == 503 and "this server is stopping" in body, (status, body)
            assert client.infer("sent", TEXT)["version"].startswith("sent@")


def test_a_stray_http_connection_does_not_make_the_stop_abrupt(repo, tmp_path):
    """A socket that sent POST headers and 10 bytes of body, then nothing, and an idle keep-alive one, open while
    clients send over gRPC: SIGTERM to `aot serve` stops tritonserver gracefully all the same (its log: every
    model unloaded, no "Exit timeout expired. Exiting immediately", which cut off what it had accepted), both
    sockets are closed by the server, every request is answered or refused as retryable (never cut off), and
    `aot serve` exits 0. Before, Triton's HTTP front end waited for the stray socket through the whole exit timeout."""
    log = tmp_path / "tritonserver.log"
    ports = dict(zip(("http", "grpc", "metrics", "health"), free_ports(4), strict=True))
    process = subprocess.Popen([sys.executable, "-m", "aot", "serve", "--repo", str(repo), "--log", str(log),
                                "--drain-seconds", "0", *(f"--{name}-port={port}" for name, port in ports.items())],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               start_new_session=True)
    outcomes: Counter = Counter()
    stop = threading.Event()

    def send() -> None:
        with Client(f"127.0.0.1:{ports['grpc']}", retry_seconds=0) as client:
            while not stop.is_set():
                try:
                    client.infer("sent", TEXT)
                    outcomes["answered"] += 1
                except InferenceError as exc:
                    outcomes[(type(exc).__name__, exc.retryable)] += 1

    threads = [threading.Thread(target=send) for _ in range(3)]
    stray = idle = None
    try:
        assert process.stdout.readline(), process.stderr.read()
        stray = socket.create_connection(("127.0.0.1", ports["http"]))
        stray.sendall(b"POST /v2/models/aot/infer HTTP/1.1\r\nHost: aot\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n" + b'{"inputs":')
        idle = socket.create_connection(("127.0.0.1", ports["http"]))
        idle.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: aot\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")  # answered; the connection stays open (keep-alive)
        for t in threads:
            t.start()
        while outcomes["answered"] < 20:
            assert process.poll() is None
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0, process.stderr.read()
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join(60)
        if process.poll() is None:
            process.kill()
    for connection in (stray, idle):
        connection.settimeout(30)
        try:
            assert connection.recv(4096) == b""  # closed by the server (a reset is a close too)
        except ConnectionResetError:
            pass
        connection.close()
    text = log.read_text()
    assert "Exit timeout expired" not in text and "failed to stop server" not in text, text[-3000:]
    assert "All models are stopped, unloading models" in text and "successfully unloaded 'aot'" in text
    errors = {k: n for k, n in outcomes.items() if k != "answered"}
    assert outcomes["answered"] >= 20 and all(kind == "Unavailable" and retryable for kind, retryable in errors), \
        outcomes
    print(f"\nstop with a stray and an idle HTTP connection open: {outcomes['answered']} answered, "
          f"{sum(errors.values())} refused as retryable")
