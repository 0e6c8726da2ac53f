"""A local fleet of 2 tritonservers behind the real HAProxy (aot/local/fleet.py): one fleet for the whole module."""

import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from aot.client.client import Client, InferenceError
from aot.exporter.task_export import export_task
from aot.local.fleet import Fleet
from aot.local.server import port_is_free
from aot.serving.repository import read_repository
from aot.serving.store.writer import TaskStore
from aot.training.predict import Predictor
from tests.helpers import make_repository, train_tiny_tasks

pytestmark = [pytest.mark.server, pytest.mark.faults]

TEXTS = ["good w1 w2", "w3 awful w4 w5", "the movie was superb", "dull plot", "w7"]
ATOL = 1e-3


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_models, sentiment_dir):
    return train_tiny_tasks(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("artifacts"), 3)


@pytest.fixture(scope="module")
def expected(artifacts):
    """aot predict's logits for every artifact and text."""
    return {name: Predictor.load(path).logits(TEXTS).numpy() for name, path in artifacts.items()}


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, artifacts):
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("fleet") / "repo",
                           {"alpha": (artifacts["alpha"], "fused"), "beta": (artifacts["beta"], "factored")},
                           max_batch_size=16, cpu_queue_delay_us=1000)


@pytest.fixture(scope="module")
def fleet(request, repo):
    failed_before = request.session.testsfailed
    with Fleet(repo, replicas=2) as fleet:
        yield fleet
        if request.session.testsfailed > failed_before:
            print(f"\n--- haproxy log ---\n{fleet.log_tail(40)}")
            for i, server in enumerate(fleet.servers):
                print(f"\n--- replica {i} log ---\n{server.log_tail(40)}")


def _ensemble_requests(server, outcome: str = "success") -> int:
    """Requests the `aot` ensemble of one replica answered (or failed: `outcome`; its Prometheus metrics; 0 after a
    restart)."""
    with urllib.request.urlopen(f"http://{server.host}:{server.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    match = re.search(rf'^nv_inference_request_{outcome}\{{model="aot",version="1"\}} (\d+)', text, re.M)
    return int(match[1]) if match else 0


def _versions(repo) -> dict[str, str]:
    return {n: e.folder for n, e in TaskStore(read_repository(repo).store_root).entries().items()}


def _check(answer: dict, logits: np.ndarray) -> bool:
    return "logits" in answer and np.abs(np.array(answer["logits"]) - logits).max() <= ATOL


class Load:
    """`threads` clients calling `items` through the fleet until stopped (at most 20,000 answers): `answers` holds
    (item index, answer), `failures` the messages of failed requests."""

    def __init__(self, url: str, items: list[dict], threads: int = 4, retry_seconds: float | None = None):
        self.url, self.items = url, items
        self.retry = {} if retry_seconds is None else {"retry_seconds": retry_seconds}  # 0: every failure is seen
        self.stop, self.answers, self.failures = threading.Event(), [], []
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(threads)]

    def _run(self, k: int) -> None:
        with Client(self.url, timeout=30, **self.retry) as c:
            while not self.stop.is_set() and len(self.answers) < 20000:
                i = (k + len(self.answers)) % len(self.items)
                try:
                    self.answers.append((i, c.infer(self.items[i]["task"], self.items[i]["text"])))
                except InferenceError as exc:
                    self.failures.append(str(exc))

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_fleet_answers_as_predict_and_balances(fleet, expected):
    """Through HAProxy: every answer equals aot predict's and names its version; both replicas serve."""
    fleet.wait_all_up(timeout=30)
    before = [_ensemble_requests(s) for s in fleet.servers]
    items = [{"task": name, "text": text} for name in ("alpha", "beta") for text in TEXTS] * 4
    with Client(fleet.grpc_url) as client:
        answers = client.infer_many(items, concurrency=8, pack=1)  # a request per text: HAProxy balances requests
    versions = _versions(fleet.repo)
    for item, answer in zip(items, answers, strict=True):
        np.testing.assert_allclose(answer["logits"], expected[item["task"]][TEXTS.index(item["text"])], atol=ATOL)
        assert answer["version"] == versions[item["task"]]
    deadline = time.monotonic() + 10  # Triton counts a request just after its answer is sent
    while sum(served := [_ensemble_requests(s) - b for s, b in zip(fleet.servers, before, strict=True)]) < len(items):
        assert time.monotonic() < deadline, served
        time.sleep(0.1)
    assert sum(served) >= len(items) and min(served) > 0, served  # more: the supervisors' probes (one a second)
    with urllib.request.urlopen(f"http://{fleet.http_url}/v2/health/ready", timeout=5) as r:  # HTTP through it too
        assert r.status == 200
    assert fleet.states() == {"r0": "UP", "r1": "UP"}
    assert [s.restarts for s in fleet.servers] == [[], []]


def test_task_published_after_start_is_served_by_every_replica(fleet, artifacts, expected):
    """No call to any replica: each serves the new task on its next request (the manifest is polled per batch)."""
    export_task(artifacts["gamma"], fleet.repo, "late", progress=False)
    published = time.monotonic()
    seconds = []
    for server in fleet.servers:
        with Client(server.grpc_url) as c:
            answer = c.infer("late", TEXTS[0])
        seconds.append(time.monotonic() - published)
        np.testing.assert_allclose(answer["logits"], expected["gamma"][0], atol=ATOL)
        assert answer["version"] == _versions(fleet.repo)["late"]
    with Client(fleet.grpc_url) as c:
        np.testing.assert_allclose(c.infer("late", TEXTS[1])["logits"], expected["gamma"][1], atol=ATOL)
    print(f"\npublish -> both replicas serving: {max(seconds) * 1000:.0f} ms (first request of each loads it)")


def test_reexport_and_removal_under_load_give_no_wrong_answer(fleet, artifacts, expected):
    """4 clients through HAProxy on task `swap` while it is re-exported 4 times and then removed: every answer is
    the aot predict output of the version it names; the only failures are `unknown task` after the removal.
    TASK@VERSION keeps a caller on the old version on every replica."""
    sources: dict[str, str] = {}  # version -> artifact

    def publish(source: str) -> str:
        export_task(artifacts[source], fleet.repo, "swap", "fused" if source == "alpha" else "factored",
                    progress=False)
        version = _versions(fleet.repo)["swap"]
        sources[version] = source
        return version

    first = publish("alpha")
    items = [{"task": "swap", "text": t} for t in TEXTS]

    with Load(fleet.grpc_url, items) as load:
        for source in ("beta", "alpha", "gamma", "alpha"):
            time.sleep(0.5)
            publish(source)
        time.sleep(0.5)
        removed_after = len(load.answers)
        TaskStore(read_repository(fleet.repo).store_root).remove("swap")
        time.sleep(0.5)
    assert [(i, a) for i, a in load.answers
            if a["version"] not in sources or not _check(a, expected[sources[a["version"]]][i])] == []
    assert all("unknown task 'swap'" in f for f in load.failures), set(load.failures)
    assert len(load.answers) >= removed_after > 0
    assert len({a["version"] for _, a in load.answers}) >= 3, {a["version"] for _, a in load.answers}
    for server in fleet.servers:  # retired, still held: pinned callers are served it by every replica
        with Client(server.grpc_url) as c:
            answer = c.infer(first, TEXTS[2])
        assert answer["version"] == first and _check(answer, expected["alpha"][2])
    print(f"\n{len(load.answers)} answers during 4 re-exports and a removal through the fleet: 0 wrong, "
          f"{len(load.failures)} 'unknown task' after the removal")


def test_kill9_of_a_replica_under_load_fails_no_request(fleet, expected):
    """kill -9 of replica 1's tritonserver while 4 clients call through HAProxy: no request fails (HAProxy retries
    what the dead replica did not answer on the other), the replica is restarted, gets no request before its
    /ready says 200, then serves again, including the task published while it ran (a late replica's view)."""
    items = [{"task": name, "text": text} for name in ("alpha", "beta") for text in TEXTS]

    victim = fleet.servers[1]
    with Load(fleet.grpc_url, items) as load:
        time.sleep(1)
        old_pid = victim.process.pid
        killed_at = len(load.answers)
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not (victim.process.pid != old_pid and victim.serves()):
            assert time.monotonic() < deadline, f"replica 1 not ready again: {victim.log_tail()}"
            time.sleep(0.05)
        before_up = _ensemble_requests(victim)  # the restarted server, ready, maybe not yet up in HAProxy
        while fleet.states()["r1"] != "UP" or _ensemble_requests(victim) == 0:
            assert time.monotonic() < deadline, f"replica 1 gets no traffic again: {fleet.states()}"
            time.sleep(0.05)
        restarted_at = len(load.answers)
        time.sleep(0.5)
    assert load.failures == []
    assert [a for i, a in load.answers if not _check(a, expected[items[i]["task"]][i % len(TEXTS)])] == []
    assert before_up == 0
    assert len(victim.restarts) == 1 and fleet.servers[0].restarts == []
    assert restarted_at > killed_at
    with Client(victim.grpc_url) as c:
        assert c.infer("late", TEXTS[0])["version"] == _versions(fleet.repo)["late"]
    print(f"\nkill -9 of a replica under load: {len(load.answers)} answers, 0 failed, 0 wrong; "
          f"{restarted_at - killed_at} served by the other replica while it restarted")


def _replica_pids(fleet) -> list[int]:
    return [s.process.pid for s in fleet.servers]


def test_killed_haproxy_is_restarted_and_no_request_fails(fleet, expected):
    """kill -9 of HAProxy while 4 clients call through it: the fleet starts it again within a second on the same
    ports, the replicas untouched (same tritonservers), and the clients retry the connections it refused or dropped
    meanwhile (a short, bounded backoff): no request fails, every answer is right."""
    items = [{"task": name, "text": text} for name in ("alpha", "beta") for text in TEXTS]
    replicas, restarts = _replica_pids(fleet), [len(s.restarts) for s in fleet.servers]
    with Load(fleet.grpc_url, items) as load:
        time.sleep(1)
        old, killed_at = fleet.balancer.pid, len(load.answers)
        killed = time.monotonic()
        os.kill(old, signal.SIGKILL)
        while fleet.balancer.pid == old or fleet.balancer.poll() is not None:
            assert time.monotonic() - killed < 10, "HAProxy was not restarted"
            time.sleep(0.01)
        restarted = time.monotonic() - killed
        fleet.wait_all_up(timeout=30)
        while len(load.answers) < killed_at + 200:
            assert time.monotonic() - killed < 60, "no answers through the restarted HAProxy"
            time.sleep(0.05)
    assert load.failures == [] and fleet.failed is None
    assert [a for i, a in load.answers if not _check(a, expected[items[i]["task"]][i % len(TEXTS)])] == []
    assert _replica_pids(fleet) == replicas and [len(s.restarts) for s in fleet.servers] == restarts
    print(f"\nkill -9 of HAProxy under load: restarted {restarted:.2f} s later; {len(load.answers)} answers, 0 failed")


def test_a_rolling_restart_of_one_replica_fails_no_request(fleet, expected):
    """Issue 47.2: replica 0 restarted as a rolling update does it (Fleet.restart_replica: it drains until HAProxy
    takes it out and holds none of its requests, stops, starts on the same ports, rejoins) while 4 clients that
    never retry (retry_seconds=0: every failure is seen) call through HAProxy: no request fails, every answer is
    right, and the restarted replica serves again."""
    items = [{"task": name, "text": text} for name in ("alpha", "beta") for text in TEXTS]
    fleet.wait_all_up(timeout=30)
    old = fleet.servers[0]
    with Load(fleet.grpc_url, items, retry_seconds=0) as load:
        while len(load.answers) < 50:
            assert not load.failures, load.failures[:3]
            time.sleep(0.05)
        started_at = len(load.answers)
        fleet.restart_replica(0)
        restarted_at = len(load.answers)
        new = fleet.servers[0]
        deadline = time.monotonic() + 60
        while _ensemble_requests(new) == 0 or len(load.answers) < restarted_at + 100:
            assert time.monotonic() < deadline, f"replica 0 gets no traffic again: {fleet.states()}"
            time.sleep(0.05)
    assert load.failures == [], load.failures[:5]
    assert [a for i, a in load.answers if not _check(a, expected[items[i]["task"]][i % len(TEXTS)])] == []
    assert new is not old and new.grpc_port == old.grpc_port and old.process.poll() is not None
    assert restarted_at > started_at and fleet.states() == {"r0": "UP", "r1": "UP"}
    print(f"\nrolling restart of replica 0 under load: {len(load.answers)} answers, 0 failed, 0 wrong; "
          f"{restarted_at - started_at} answered while it drained, stopped and started")


def test_oversized_requests_are_refused_before_any_replica(fleet):
    """The issue's case (INT64 [1, 25,000,000] ids, 400 MB) and a 2 MB text (past max_request_bytes, 1 MiB): HAProxy
    refuses them (413) before either replica reads a byte: no replica counts a failed request, none's shared memory
    grows."""
    import json

    import tritonclient.grpc as grpcclient

    from aot.serving.shm import allocated_bytes
    from aot.serving.supervision.procfs import stub_processes

    def replica_state():
        regions = [s.shm_region for r in fleet.servers for s in stub_processes(r.process.pid)]
        return [_ensemble_requests(s, "failure") for s in fleet.servers], sum(allocated_bytes(r) for r in regions)

    before = replica_state()
    ids = grpcclient.InferInput("input_ids", [1, 25_000_000], "INT64")
    ids.set_data_from_numpy(np.ones((1, 25_000_000), np.int64))
    with grpcclient.InferenceServerClient(fleet.grpc_url) as client:
        with pytest.raises(Exception, match="413"):
            client.infer("aot", [ids])
    body = json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["x" * 2_000_000]},
                                  {"name": "TASK", "shape": [1, 1], "datatype": "BYTES", "data": ["alpha"]}]})
    request = urllib.request.Request(f"http://{fleet.http_url}/v2/models/aot/infer", data=body.encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 413 and "request body larger than" in json.loads(refused.value.read())["error"]
    counts, shm = replica_state()
    assert counts == before[0] and shm <= before[1], (before, (counts, shm))
    with Client(fleet.grpc_url) as c:  # a text at the largest size a client needs still passes
        assert c.infer("alpha", "w1 " * 20_000)["version"].startswith("alpha@")


def test_idle_connections_are_closed_by_the_balancer(fleet):
    """2,000 TCP connections to HAProxy's gRPC port that never send a byte: a client is served meanwhile, and
    HAProxy closes them all within its idle timeout (they cannot hold its connection slots for long)."""
    import socket

    from aot.local.fleet import CLIENT_IDLE_SECONDS, REQUEST_SECONDS

    host, port = fleet.grpc_url.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(2000)]
    try:
        opened = time.monotonic()
        with Client(fleet.grpc_url) as c:
            assert c.infer("alpha", TEXTS[0])["version"].startswith("alpha@")
        limit = opened + max(CLIENT_IDLE_SECONDS, REQUEST_SECONDS) + 5
        for s in idle:
            s.settimeout(max(0.1, limit - time.monotonic()))
            try:
                while s.recv(1024):  # HAProxy may say why before it closes (an error, a GOAWAY)
                    pass
            except ConnectionResetError:
                pass
            except TimeoutError:
                raise AssertionError(f"an idle connection still open {time.monotonic() - opened:.0f} s after") from None
        closed = time.monotonic() - opened
    finally:
        for s in idle:
            s.close()
    print(f"\n2,000 idle connections to HAProxy: all closed {closed:.1f} s after they opened")


def test_serve_command_with_replicas(repo, tmp_path):
    """`aot serve --replicas 2`: HAProxy on the given ports, replica i's metrics and /ready on the flags' ports +
    2*i, the answer through it; SIGHUP restarts the replicas one after the other; SIGTERM stops everything (exit 0).
    A flag for one server alone is refused."""
    import json
    import subprocess
    import sys

    from aot.local.server import free_ports

    grpc, http, metrics, health = free_ports(4)
    if not all(port_is_free("127.0.0.1", p) for p in (metrics + 2, health + 2)):
        pytest.skip("the ports beside the chosen ones are taken")
    command = [sys.executable, "-m", "aot", "serve", "--repo", str(repo), "--replicas", "2", "--grpc-port",
               str(grpc), "--http-port", str(http), "--metrics-port", str(metrics), "--health-port", str(health)]
    refused = subprocess.run(command + ["--log", str(tmp_path / "log")], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--replicas 2: --log is for one server" in refused.stderr, refused.stderr
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["grpc"] == f"127.0.0.1:{grpc}"
        assert [r["metrics"] for r in info["replicas"]] == [f"127.0.0.1:{metrics}", f"127.0.0.1:{metrics + 2}"]
        for replica in info["replicas"]:
            with urllib.request.urlopen(f"http://{replica['health']}/ready", timeout=5) as r:
                assert json.load(r)["ready"] is True
        with Client(info["grpc"]) as c:
            assert c.infer("alpha", TEXTS[0])["version"].startswith("alpha@")
            proc.send_signal(signal.SIGHUP)  # a rolling restart: each replica drained, restarted, back in rotation
            said = [proc.stderr.readline() for _ in range(2)]
            while not said[-1].startswith("aot: rolling restart done"):
                said.append(proc.stderr.readline())
                assert said[-1], said
            assert sum("rolling restart: replica" in line for line in said) == 2, said
            assert c.infer("alpha", TEXTS[0])["version"].startswith("alpha@")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_balancer_replaces_the_client_address_a_client_sent(tmp_path, repo):
    """Issue 57.2: the replicas tell keyless clients apart by the header aot-client-address (aot.serving.rate_limits),
    which is an identity only because the fleet's HAProxy sets it from the connection's source address over
    whatever a client sent under that name, in either spelling: a fake replica behind the generated configuration
    sees the source address (127.0.0.2, the client's), never the client's own values; both frontends carry the rule,
    and the replicas are told to trust the header."""
    import http.client
    import subprocess
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from aot.local.fleet import CLIENT_ADDRESS_HEADER, haproxy_binary, haproxy_config
    from aot.local.server import free_ports

    seen = []

    class Replica(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # http.server's name: /ready, HAProxy's health check
            self._answer()

        def do_POST(self):  # http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(self.headers.get_all(CLIENT_ADDRESS_HEADER))
            self._answer()

        def _answer(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    backend = ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    port = backend.server_address[1]
    grpc, http_port = free_ports(2)
    config = haproxy_config("127.0.0.1", grpc, http_port, [SimpleNamespace(host="127.0.0.1", grpc_port=port,
                                                                            http_port=port, health_port=port)],
                            tmp_path / "haproxy.sock", 1 << 20, 256)
    assert config.count(f"http-request set-header {CLIENT_ADDRESS_HEADER} %[src]") == 2  # gRPC and HTTP
    (tmp_path / "haproxy.cfg").write_text(config)
    balancer = subprocess.Popen([haproxy_binary(), "-db", "-f", str(tmp_path / "haproxy.cfg")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # until HAProxy's checks see the replica up
            connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10,
                                                    source_address=("127.0.0.2", 0))
            try:
                connection.request("POST", "/v2/models/aot/infer", b"{}", {CLIENT_ADDRESS_HEADER: "10.6.6.6",
                                                                          "AOT-Client-Address": "10.7.7.7"})
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            finally:
                connection.close()
            assert time.monotonic() < deadline, "haproxy did not pass a request on"
            time.sleep(0.2)
    finally:
        os.killpg(balancer.pid, signal.SIGKILL)
        balancer.wait()
        backend.shutdown()
        backend.server_close()
    assert seen and seen[-1] == ["127.0.0.2"], seen
    fleet = Fleet(repo, replicas=2)
    try:
        assert all(s.step_environment["AOT_CLIENT_ADDRESS_HEADER"] == CLIENT_ADDRESS_HEADER for s in fleet.servers)
    finally:
        fleet.stop()
