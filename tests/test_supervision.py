"""The supervision room (aot.serving.supervision) against fakes: no tritonserver, no racing threads, no sleeps.

Time is a fake clock put in place of the module's `time` (only that module sees it), so every verdict that depends on
seconds is decided by the numbers the test sets. The real-server behaviour of the same code: tests/test_faults.py and
tests/test_server.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from aot.serving import protocol
from aot.serving.supervision import lifecycle, probes, reloads, triton_api
from aot.serving.supervision.admin_key import ADMIN_HEADER, RESTRICTION_FLAGS
from aot.serving.supervision.health import HealthServer
from aot.serving.supervision.instance_groups import replacement
from aot.serving.supervision.lifecycle import FRONT_END_FLAGS, ServerExited, ServerLifecycle, front_end_args
from aot.serving.supervision.probes import BUSY_HUNG_SECONDS, Probes, probe_body
from aot.serving.supervision.reloads import LOAD_TIMEOUT, UNLOAD_TIMEOUT, Reloads
from aot.serving.supervision.triton_api import TritonApi

ADMIN_KEY = "k" * 24  # a valid admin key (16-256 letters)


class Clock:
    """A fake time.monotonic (and time.sleep, which advances it): the module under test sees only this."""

    def __init__(self, now: float = 1000.0):
        self.now = now
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def fake_clock(monkeypatch: pytest.MonkeyPatch, module, now: float = 1000.0) -> Clock:
    """Replace `module.time` with a fake clock: other modules (and pytest) keep the real one."""
    clock = Clock(now)
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    return clock


def free_port() -> int:
    """A port nothing listens on (bound then closed: connecting to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- health -----------------------------------------------------------------------------------------------------------


@dataclass
class FakeSupervisor:
    """What HealthServer asks of a Supervisor: its server's pid, health() and warnings()."""

    server_pid: int
    ready: bool = True
    reasons: list[str] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)
    asked: int = 0

    warned: list[str] = field(default_factory=list)

    def health(self) -> tuple[bool, list[str]]:
        self.asked += 1
        return self.ready, list(self.reasons)

    def warnings(self) -> list[str]:
        return list(self.warned)


def _gone_pid() -> int:
    """A pid no process can have (above the kernel's pid_max): /proc has no entry for it."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


@pytest.fixture
def health_server() -> Iterator[tuple[HealthServer, list[FakeSupervisor | None]]]:
    """A HealthServer not started (answer() is called directly) whose supervisor the test sets in `current[0]`."""
    current: list[FakeSupervisor | None] = [None]
    server = HealthServer(lambda: current[0], "127.0.0.1", 0)
    try:
        yield server, current
    finally:
        server.server.server_close()


def test_ready_says_starting_while_there_is_no_supervisor(health_server):
    """Before the first server was ready (or between restarts) /ready is 503 and says why; /live is 503 too."""
    server, _ = health_server
    assert server.answer("/ready") == (503, {"ready": False, "reasons": ["tritonserver is starting"]})
    assert server.answer("/live") == (503, {"live": False})


def test_ready_is_the_supervisors_health_with_its_reasons(health_server):
    """200 only when health() says ready; 503 carries health()'s reasons verbatim; a query string is ignored."""
    server, current = health_server
    supervisor = FakeSupervisor(server_pid=_gone_pid())
    current[0] = supervisor
    assert server.answer("/ready") == (200, {"ready": True, "reasons": [], "warnings": []})
    supervisor.ready, supervisor.reasons = False, ["model aot is not ready", "the task store cannot be read"]
    assert server.answer("/ready?verbose=1") == (503, {"ready": False, "reasons": supervisor.reasons,
                                                       "warnings": []})
    assert supervisor.asked == 2


def test_ready_carries_the_steps_warnings_and_stays_200(health_server):
    """A warning a step's start left (a CUDA graph that could not be captured) is a line of /ready, not a 503."""
    server, current = health_server
    current[0] = FakeSupervisor(server_pid=_gone_pid(), warned=["aot: CUDA graphs failed for (8, 64): eager"])
    assert server.answer("/ready") == (200, {"ready": True, "reasons": [],
                                             "warnings": ["aot: CUDA graphs failed for (8, 64): eager"]})


def test_step_notes_reach_the_supervisor_once_each_and_go_with_the_server(monkeypatch, tmp_path):
    """A step instance's notes (aot.serving.watch) are read by the supervisor of its server, each line once, and
    removed with the instance or the server."""
    from aot.serving import watch

    monkeypatch.setattr(watch, "SHM", tmp_path)
    monkeypatch.setattr(watch.os, "getppid", lambda: 4242)
    watch.add_note("aot_0", "aot: capture failed for (1, 64)")
    watch.add_note("aot_0", "aot: capture failed for (1, 64)")
    watch.add_note("aot_1", "aot:   capture\nfailed for (2, 64)")  # one line, whitespace collapsed
    assert watch.notes(4242) == ["aot: capture failed for (1, 64)", "aot: capture failed for (2, 64)"]
    assert watch.notes(4243) == []
    watch.remove_watch(4242, "aot_0")
    assert watch.notes(4242) == ["aot: capture failed for (2, 64)"]
    watch.remove_watches(4242)
    assert watch.notes(4242) == [] and not list(tmp_path.iterdir())


def test_ready_lists_what_the_server_serves_without(health_server):
    """A task store that stopped answering (or a damaged shard) leaves the server ready, and /ready says it: every
    replica of a fleet shares the store, and taking them all out would stop the tasks they still serve."""
    server, current = health_server
    current[0] = FakeSupervisor(server_pid=_gone_pid(), warned=["the task store has not answered since 12:00:00"])
    assert server.answer("/ready") == (200, {"ready": True, "reasons": [],
                                             "warnings": ["the task store has not answered since 12:00:00"]})


def test_live_follows_the_server_process(health_server):
    """/live is 200 while the supervised pid runs (this process), 503 once it is gone; it never asks health()."""
    server, current = health_server
    current[0] = FakeSupervisor(server_pid=_gone_pid())
    assert server.answer("/live") == (503, {"live": False})
    current[0] = FakeSupervisor(server_pid=os.getpid())
    assert server.answer("/live?x") == (200, {"live": True})
    assert current[0].asked == 0


def test_a_draining_server_is_not_ready_but_live(health_server):
    """A graceful stop's first step: /ready is 503 with the reason whatever the steps say; /live still follows the
    process (the orchestrator must not kill a server that finishes its requests)."""
    server, current = health_server
    current[0] = FakeSupervisor(server_pid=os.getpid())
    server.drain("draining: stopping")
    assert server.answer("/ready") == (503, {"ready": False, "reasons": ["draining: stopping"]})
    assert server.answer("/live") == (200, {"live": True}) and current[0].asked == 0


def test_the_first_sigterm_drains_then_reaches_the_server(health_server):
    """The container's stop handler (aot.serving.supervision.main.graceful_stop): the first SIGTERM makes /ready say
    503 and schedules the graceful stop (new requests refused, the accepted finished, then the signal) drain_seconds
    later, with no drain at once but on a thread of its own too; a second SIGTERM, or SIGINT, reaches the server at
    once."""
    from aot.serving.supervision.main import graceful_stop

    server, current = health_server
    current[0] = FakeSupervisor(server_pid=os.getpid())
    forwarded, graceful, scheduled = [], [], []
    lifecycle_ = SimpleNamespace(forward=forwarded.append, stop_gracefully=graceful.append)
    stop = graceful_stop(lifecycle_, server, 600, later=lambda seconds, call: scheduled.append((seconds, call)))
    stop(signal.SIGTERM)
    assert forwarded == graceful == [] and [s for s, _ in scheduled] == [600] and server.answer("/ready")[0] == 503
    stop(signal.SIGTERM)
    assert forwarded == [signal.SIGTERM] and graceful == []
    scheduled[0][1]()  # the drain's end
    assert forwarded == [signal.SIGTERM] and graceful == [signal.SIGTERM] and len(scheduled) == 1
    fresh = HealthServer(lambda: None, "127.0.0.1", 0)
    try:
        graceful_stop(lifecycle_, fresh, 600, later=lambda *a: scheduled.append(a))(signal.SIGINT)
        assert forwarded[1:] == [signal.SIGINT] and len(scheduled) == 1 and fresh.draining is None
        graceful_stop(lifecycle_, fresh, 0, later=lambda *a: scheduled.append(a))(signal.SIGTERM)
    finally:
        fresh.server.server_close()
    assert forwarded[1:] == [signal.SIGINT] and scheduled[1][0] == 0 and fresh.draining is not None
    scheduled[1][1]()
    assert graceful == [signal.SIGTERM, signal.SIGTERM]


@pytest.mark.parametrize("path", ["/", "/readyz", "/v2/health/ready", "/ready/extra"])
def test_other_paths_are_404(health_server, path):
    server, current = health_server
    current[0] = FakeSupervisor(server_pid=0)
    assert server.answer(path) == (404, {"error": "GET /ready or /live"})


def test_health_server_answers_over_http():
    """One real GET per answer through the started server on an ephemeral port: status, JSON body and header."""
    supervisor = FakeSupervisor(server_pid=0, ready=False, reasons=["repairing backbone"])
    server = HealthServer(lambda: supervisor, "127.0.0.1", 0).start()
    try:
        assert server.port > 0
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/ready", timeout=5)
        assert caught.value.code == 503
        assert caught.value.headers["Content-Type"] == "application/json"
        assert json.loads(caught.value.read()) == {"ready": False, "reasons": ["repairing backbone"], "warnings": []}
        supervisor.ready, supervisor.reasons = True, []
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/ready", timeout=5) as response:
            assert response.status == 200 and json.loads(response.read()) == {"ready": True, "reasons": [],
                                                                               "warnings": []}
    finally:
        server.stop()
    assert supervisor.asked == 2


# --- triton_api -------------------------------------------------------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    admin_key: str | None
    body: bytes


class FakeTriton:
    """A tiny HTTP server in a thread that answers Triton's paths the way the supervisor needs: `routes` maps a path to
    (status, JSON body); every request is recorded with the admin key it carried."""

    def __init__(self, routes: dict[str, tuple[int, object]]):
        self.routes = routes
        self.seen: list[Seen] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                owner.seen.append(Seen(self.command, self.path, self.headers.get(ADMIN_HEADER), body))
                status, value = owner.routes.get(self.path, (404, {"error": "not found"}))
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer  # http.server's names

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


INDEX = [{"name": "aot", "version": "1", "state": "READY"}, {"name": "vanilla"}]
CONFIG = {"name": "aot", "instance_group": [{"name": "aot_0", "count": 1, "kind": "KIND_CPU"}]}


@pytest.fixture
def fake_triton() -> Iterator[FakeTriton]:
    server = FakeTriton({
        "/v2/repository/index": (200, INDEX),
        "/v2/models/aot/config": (200, CONFIG),
        "/v2/repository/models/aot/load": (200, {}),
        "/v2/repository/models/aot/unload": (200, {}),
        "/v2/repository/models/broken/load": (400, {"error": "failed to load 'broken'"}),
        "/v2/models/aot/ready": (200, {}),
        "/v2/models/gone/ready": (400, {"error": "model 'gone' is not ready"}),
        "/v2/health/live": (200, {}),
    })
    try:
        yield server
    finally:
        server.close()


def test_the_admin_key_goes_with_admin_calls_only(fake_triton):
    """Repository and config calls carry the key; readiness, liveness and plain requests never do."""
    api = TritonApi(fake_triton.url, ADMIN_KEY)
    assert api.index() == INDEX
    assert api.config("aot") == CONFIG
    api.load("aot", 5.0, config={"instance_group": []})
    api.unload("aot", 5.0)
    assert api.model_ready("aot") is True
    assert api.front_end_answers() is True
    assert json.loads(api.request("/v2/models/aot/config")) == CONFIG  # a request that is not marked admin
    keys = [(s.method, s.path, s.admin_key) for s in fake_triton.seen]
    assert keys == [
        ("POST", "/v2/repository/index", ADMIN_KEY),
        ("GET", "/v2/models/aot/config", ADMIN_KEY),
        ("POST", "/v2/repository/models/aot/load", ADMIN_KEY),
        ("POST", "/v2/repository/models/aot/unload", ADMIN_KEY),
        ("GET", "/v2/models/aot/ready", None),
        ("GET", "/v2/health/live", None),
        ("GET", "/v2/models/aot/config", None),
    ]
    load_body = json.loads(fake_triton.seen[2].body)
    assert json.loads(load_body["parameters"]["config"]) == {"instance_group": []}
    assert json.loads(fake_triton.seen[3].body) == {}


def test_no_key_no_header(fake_triton):
    """A TritonApi without a key sends admin calls without the header (a server with an open control API)."""
    api = TritonApi(fake_triton.url)
    api.unload("aot", 5.0)
    assert [s.admin_key for s in fake_triton.seen] == [None]
    assert ADMIN_KEY not in repr(TritonApi(fake_triton.url, ADMIN_KEY))  # never in a repr or a log


def test_an_error_status_is_an_answer(fake_triton, monkeypatch):
    """A 400 raises HTTPError, yet the front end answered: `answered` moves and answering_since starts again."""
    clock = fake_clock(monkeypatch, triton_api, now=75.0)
    api = TritonApi(fake_triton.url, ADMIN_KEY, answered=50.0, answering_since=None)
    with pytest.raises(urllib.error.HTTPError) as caught:
        api.load("broken", 5.0)
    assert caught.value.code == 400
    assert (api.answered, api.answering_since) == (75.0, 75.0)
    clock.now = 80.0
    assert api.model_ready("gone") is False  # its 400 is an answer too
    assert (api.answered, api.answering_since) == (80.0, 75.0)  # answering without a pause since 75


def test_an_http_error_from_the_index_keeps_answering_since(monkeypatch):
    """The index answered with an error status: the front end works, so answering_since is kept."""
    server = FakeTriton({"/v2/repository/index": (500, {"error": "internal"})})
    try:
        fake_clock(monkeypatch, triton_api, now=30.0)
        api = TritonApi(server.url, ADMIN_KEY, answered=10.0, answering_since=10.0)
        with pytest.raises(urllib.error.HTTPError):
            api.index()
        assert (api.answered, api.answering_since) == (30.0, 10.0)
        assert len(server.seen) == 1
    finally:
        server.close()


def test_an_unreachable_front_end_resets_answering_since(monkeypatch):
    """Nothing listens: index() raises and front_end_answers() says False, each setting answering_since to None;
    `answered` stays when the server last answered; model_ready is False."""
    fake_clock(monkeypatch, triton_api, now=99.0)
    api = TritonApi(f"127.0.0.1:{free_port()}", ADMIN_KEY, answered=20.0, answering_since=20.0)
    with pytest.raises(triton_api.UNREACHABLE) as caught:
        api.index(timeout=2)
    assert not isinstance(caught.value, urllib.error.HTTPError)
    assert api.answering_since is None and api.answered == 20.0
    api.answering_since = 20.0
    assert api.front_end_answers() is False
    assert api.answering_since is None and api.answered == 20.0
    assert api.model_ready("aot") is False


# --- reloads ----------------------------------------------------------------------------------------------------------


def _group(name: str) -> dict:
    return {"name": name, "count": 1, "kind": "KIND_CPU", "host_policy": name}


@dataclass
class FakeApi:
    """What Reloads calls on a TritonApi, recorded in order; model_ready answers from `ready` (then False)."""

    config_of: dict = field(default_factory=dict)
    index_entries: list[dict] = field(default_factory=list)
    ready: list[bool] = field(default_factory=list)
    calls: list[tuple] = field(default_factory=list)

    def config(self, model: str, timeout: float = 5.0) -> dict:
        self.calls.append(("config", model))
        return json.loads(json.dumps(self.config_of))  # a fresh copy, as the server sends

    def load(self, model: str, timeout: float, config: dict | None = None) -> None:
        self.calls.append(("load", model, timeout, config))

    def unload(self, model: str, timeout: float) -> None:
        self.calls.append(("unload", model, timeout))

    def model_ready(self, model: str) -> bool:
        self.calls.append(("ready", model))
        return self.ready.pop(0) if self.ready else False

    def index(self, timeout: float = 10.0) -> list[dict]:
        self.calls.append(("index",))
        return self.index_entries


TWO_GROUPS = {"name": "tokenizer", "backend": "python", "instance_group": [_group("tokenizer_0"), _group("tokenizer_1")]}


def test_replace_loads_the_leave_config_then_the_join_config():
    """The broken instance leaves first (its sibling serves alone), then a fresh group joins: two in-place loads."""
    api = FakeApi(config_of=TWO_GROUPS)
    Reloads(api).replace("tokenizer", {"tokenizer_1_0"})
    leave, join = replacement(TWO_GROUPS, {"tokenizer_1_0"})
    assert leave is not None
    assert api.calls == [("config", "tokenizer"), ("load", "tokenizer", LOAD_TIMEOUT, leave),
                         ("load", "tokenizer", LOAD_TIMEOUT, join)]
    assert [g["name"] for g in leave["instance_group"]] == ["tokenizer_0"]
    assert [g["name"] for g in join["instance_group"]] == ["tokenizer_0", "tokenizer_1_r1"]
    assert join["instance_group"][1]["host_policy"] == "tokenizer_1_r1"
    assert join["backend"] == "python"  # everything but the groups unchanged: Triton updates in place


def test_replace_of_the_only_instance_is_one_load():
    """A model keeps at least one instance: with no sibling there is no "leave" config, only the join."""
    api = FakeApi(config_of={"name": "head", "instance_group": [_group("head_0")]})
    Reloads(api).replace("head", {"head_0_0"})
    assert [c[0] for c in api.calls] == ["config", "load"]
    assert [g["name"] for g in api.calls[1][3]["instance_group"]] == ["head_0_r1"]


@pytest.mark.parametrize(("config", "instances", "expected"), [
    (TWO_GROUPS, {"tokenizer_0_0"}, True),
    (TWO_GROUPS, {"tokenizer_0_0", "tokenizer_1_0"}, True),
    (TWO_GROUPS, {"tokenizer_2_0"}, False),  # not an instance of the loaded config
    ({"instance_group": [{"name": "tokenizer", "count": 2, "kind": "KIND_CPU"}]}, {"tokenizer_0"}, False),  # shared
    ({"instance_group": [{"name": "a", "count": 1}, {"name": "b", "count": 1}]}, {"a_0"}, False),  # alike
    ({"name": "x"}, {"x_0"}, False),  # no groups at all
])
def test_can_replace(config, instances, expected):
    """Only instances with a group of their own, in a config whose groups Triton can tell apart."""
    api = FakeApi(config_of=config)
    assert Reloads(api).can_replace("m", instances) is expected
    assert api.calls == [("config", "m")]


def test_reload_unloads_waits_loads_then_loads_what_is_not_ready(monkeypatch):
    """unload; wait while the model still says ready; load; then load every indexed model whose state is not READY
    (an ensemble the unload took down), never one without a state (never loaded)."""
    clock = fake_clock(monkeypatch, reloads)
    index = [{"name": "backbone", "version": "1", "state": "READY"},
             {"name": "aot", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
             {"name": "aot_lookup"},  # never loaded (CPU): stays unloaded
             {"name": "vanilla", "version": "1", "state": "UNAVAILABLE"}]
    api = FakeApi(index_entries=index, ready=[True, True, False])
    Reloads(api).reload("backbone")
    assert api.calls == [
        ("unload", "backbone", UNLOAD_TIMEOUT),
        ("ready", "backbone"), ("ready", "backbone"), ("ready", "backbone"),
        ("load", "backbone", LOAD_TIMEOUT, None),
        ("index",),
        ("load", "aot", LOAD_TIMEOUT, None),
        ("load", "vanilla", LOAD_TIMEOUT, None),
    ]
    assert clock.slept == [0.05, 0.05]


def test_reload_stops_waiting_at_the_unload_timeout(monkeypatch):
    """A model that keeps saying ready is loaded anyway once UNLOAD_TIMEOUT has passed (on the fake clock)."""
    clock = fake_clock(monkeypatch, reloads)
    start = clock.now
    api = FakeApi(ready=[True] * 10_000)
    Reloads(api).reload("backbone")
    waited = clock.now - start
    assert UNLOAD_TIMEOUT <= waited < UNLOAD_TIMEOUT + 0.1
    assert len(clock.slept) == pytest.approx(UNLOAD_TIMEOUT / 0.05, abs=1)
    assert api.calls[-2:] == [("load", "backbone", LOAD_TIMEOUT, None), ("index",)]


# --- probes -----------------------------------------------------------------------------------------------------------


def test_probe_body_fills_every_input_with_one_element_per_free_dimension():
    """-1 dimensions become 1; BYTES inputs get "", others 0; the probe parameter marks it."""
    metadata = {"name": "tokenizer", "inputs": [
        {"name": "TEXT", "datatype": protocol.BYTES, "shape": [-1, 1]},
        {"name": "IDS", "datatype": "INT64", "shape": [2, -1, 3]},
        {"name": "SCALE", "datatype": "FP32", "shape": [1]},
    ]}
    body = json.loads(probe_body(metadata))
    assert body["parameters"] == {protocol.PROBE_PARAMETER: True}
    assert body["inputs"] == [
        {"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [""]},
        {"name": "IDS", "shape": [2, 1, 3], "datatype": "INT64", "data": [0] * 6},
        {"name": "SCALE", "shape": [1], "datatype": "FP32", "data": [0]},
    ]


def test_probe_body_of_a_model_without_inputs():
    assert json.loads(probe_body({"name": "task_list"})) == {"inputs": [], "parameters": {protocol.PROBE_PARAMETER: True}}


HUNG = 6.0  # the hung_seconds the tests' Probes use


@pytest.fixture
def probing(monkeypatch) -> tuple[Probes, SimpleNamespace, Clock]:
    """Probes of model "m" (no prober thread) over a fake api; its last probe answer and the front end's answers both
    at t=0 on the fake clock."""
    clock = fake_clock(monkeypatch, probes, now=0.0)
    api = SimpleNamespace(answered=0.0, answering_since=0.0)
    checker = Probes(api, threading.Event(), lambda: HUNG)
    checker.answered["m"] = 0.0
    return checker, api, clock


def _at(probing: tuple[Probes, SimpleNamespace, Clock], t: float, cpu: float) -> bool:
    """The verdict at time t, the front end having answered at t, the stubs at `cpu` CPU seconds."""
    checker, api, clock = probing
    clock.now = api.answered = t
    return checker.hung("m", cpu)


def test_silent_and_idle_past_hung_seconds_is_hung(probing):
    assert _at(probing, 0.0, 1.0) is False
    assert _at(probing, HUNG - 1, 1.0) is False
    assert _at(probing, HUNG + 1, 1.0) is True
    checker, _, _ = probing
    assert checker.silent_while_answering("m") == HUNG + 1


def test_silent_but_busy_is_hung_only_after_busy_hung_seconds(probing):
    """Stubs whose CPU keeps growing work through a queue: silent for 30 s is not hung; past BUSY_HUNG_SECONDS it is."""
    cpu = 1.0
    for t in (0.0, 10.0, 30.0, BUSY_HUNG_SECONDS - 1):
        cpu += 0.5
        assert _at(probing, t, cpu) is False, t
    assert _at(probing, BUSY_HUNG_SECONDS + 1, cpu + 0.5) is True


def test_a_hung_seconds_above_the_busy_limit_is_honoured(monkeypatch):
    """An operator's hung_seconds past BUSY_HUNG_SECONDS: an idle step silent for BUSY_HUNG_SECONDS + 1 is not hung
    yet (the busy rule never judges sooner than hung_seconds)."""
    clock = fake_clock(monkeypatch, probes, now=0.0)
    api = SimpleNamespace(answered=0.0, answering_since=0.0)
    patient = BUSY_HUNG_SECONDS * 2
    checker = Probes(api, threading.Event(), lambda: patient)
    checker.answered["m"] = 0.0
    for t, hung in ((0.0, False), (BUSY_HUNG_SECONDS + 1, False), (patient + 1, True)):
        clock.now = api.answered = t
        assert checker.hung("m", 1.0) is hung, t


def test_a_new_stub_counts_as_working(probing):
    """CPU seconds that went down belong to a new stub: idle counts again from now."""
    assert _at(probing, 0.0, 5.0) is False
    assert _at(probing, HUNG + 1, 0.2) is False  # a fresh stub (less CPU): not idle yet
    assert _at(probing, 2 * HUNG + 2, 0.2) is True


def test_an_answered_probe_is_not_hung(probing):
    checker = probing[0]
    assert _at(probing, 0.0, 1.0) is False
    checker.answered["m"] = HUNG  # its probe answered at t=HUNG
    assert _at(probing, HUNG + 5, 1.0) is False
    assert checker.silent_while_answering("m") == 5


def test_a_silent_front_end_does_not_count(probing):
    """While the front end answers nothing (answering_since None) no step is hung; once it answers again, the silence
    counts only from then."""
    checker, api, clock = probing
    assert _at(probing, 0.0, 1.0) is False
    api.answering_since = None
    clock.now, api.answered = 100.0, 0.0  # nothing answered since t=0
    assert checker.hung("m", 1.0) is False
    assert checker.silent_while_answering("m") == 0.0
    api.answering_since = 100.0  # the front end answers again from t=100
    assert _at(probing, 100.0 + HUNG - 1, 1.0) is False
    assert checker.silent_while_answering("m") == HUNG - 1
    assert _at(probing, 100.0 + HUNG + 1, 1.0) is True


def test_restart_and_silent_for(probing):
    """A repaired model gets a full hung_seconds again; a model that is not probed is never silent."""
    checker, _, clock = probing
    clock.now = 9.0
    assert checker.silent_for("m") == 9.0 and checker.silent_for("other") == 0.0
    checker.restart("m")
    checker.restart("other")  # not probed: stays unprobed
    assert checker.answered == {"m": 9.0}
    assert checker.silent_while_answering("other") == 0.0


# --- lifecycle --------------------------------------------------------------------------------------------------------

# A fake tritonserver: serves GET /v2/health/ready 200 on --http-port=, prints its argv first; any other flag is ignored
READY_SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
print(json.dumps(sys.argv[1:]), flush=True)
port = int(next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--http-port=")))
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""
EXITING_SERVER = 'import sys; print("fake tritonserver: unknown flag", flush=True); sys.exit(3)'


@pytest.fixture
def no_rlimit_change(monkeypatch) -> list[int]:
    """start() raises the open-file limit: recorded instead, so the test process keeps its own."""
    calls: list[int] = []
    monkeypatch.setattr(lifecycle, "raise_open_file_limit", lambda: calls.append(1) or 1024)
    return calls


def test_a_server_that_exits_before_it_is_ready_is_named_with_its_code_and_log(tmp_path, no_rlimit_change):
    log_path = tmp_path / "server.log"
    life = ServerLifecycle(f"127.0.0.1:{free_port()}", ADMIN_KEY, supervise=False, log_path=log_path)
    life.start([sys.executable, "-c", EXITING_SERVER])
    with pytest.raises(ServerExited, match=r"tritonserver exited with code 3 before it was ready") as caught:
        life.wait_ready(timeout=30)
    assert "fake tritonserver: unknown flag" in str(caught.value)  # the log's tail
    assert life.ready_seconds is None and life.supervisor is None and life.current_supervisor() is None
    assert no_rlimit_change == [1]
    assert life.stop() == 3  # after the server exited: nothing to signal, its code


def test_a_ready_server_is_waited_for_then_stopped(tmp_path, no_rlimit_change):
    """wait_ready returns once /v2/health/ready says 200 (ready_seconds set, no supervisor when supervise=False); the
    command got the front end's flags and the API restrictions with the key; stop() ends it with SIGTERM."""
    port = free_port()
    log_path = tmp_path / "server.log"
    life = ServerLifecycle(f"127.0.0.1:{port}", ADMIN_KEY, supervise=False, log_path=log_path)
    process = life.start([sys.executable, "-c", READY_SERVER, f"--http-port={port}", "--grpc-keepalive-time=5"])
    try:
        life.wait_ready(timeout=30)
        assert life.ready_seconds is not None and 0 < life.ready_seconds < 30
        assert life.supervisor is None and life.current_supervisor() is None
        assert life.process is process and process.poll() is None
    finally:
        code = life.stop(timeout=10)
    assert code == -signal.SIGTERM and process.returncode == -signal.SIGTERM
    argv = json.loads(log_path.read_text().splitlines()[0])
    assert argv[0] == f"--http-port={port}"
    assert argv.count("--grpc-keepalive-time=5") == 1 and "--grpc-keepalive-time=30000" not in argv  # the command's
    assert "--grpc-max-connection-age=600000" in argv  # a front-end flag the command lacks
    restrictions = [a for a in argv if a.split("=", 1)[0] in RESTRICTION_FLAGS]
    assert len(restrictions) == 2 and all(a.endswith(f":{ADMIN_HEADER}={ADMIN_KEY}") for a in restrictions)
    assert ADMIN_KEY not in repr(life)


def test_front_end_args_add_only_the_flags_the_command_lacks():
    added = front_end_args(["tritonserver", "--grpc-max-connection-age=1000", "--model-repository=/m"])
    assert len(added) == len(FRONT_END_FLAGS) - 1
    assert "--grpc-max-connection-age=600000" not in added and "--grpc-keepalive-time=30000" in added
    assert front_end_args([f"{flag}=1" for flag in FRONT_END_FLAGS]) == []


# --- the end of a graceful stop (quiesce, connections, the steps' stop mark) -----------------------------------------

def test_quiesce_reads_the_servers_flags_or_tritons_defaults():
    from aot.serving.supervision import quiesce

    command = ["tritonserver", "--exit-timeout-secs=7", "--metrics-address=0.0.0.0", "--metrics-port=9102"]
    assert quiesce.flag(command, "--metrics-port") == "9102" and quiesce.flag(command, "--http-port") is None
    assert quiesce.exit_timeout(command) == 7 and quiesce.exit_timeout([]) == quiesce.TRITON_EXIT_TIMEOUT
    assert quiesce.metrics_url(command) == "http://127.0.0.1:9102/metrics"
    assert quiesce.metrics_url([]) == f"http://127.0.0.1:{quiesce.TRITON_METRICS_PORT}/metrics"
    assert quiesce.metrics_url(["--allow-metrics=false"]) is None


def test_pending_requests_sum_tritons_gauges_and_none_without_metrics():
    from aot.serving.supervision.quiesce import pending_requests

    text = ("# HELP nv_inference_pending_request_count Instantaneous number of pending requests\n"
            'nv_inference_pending_request_count{model="aot",version="1"} 3\n'
            'nv_inference_pending_request_count{model="task_list",version="1"} 0\n'
            'nv_inference_queue_duration_us{model="aot",version="1"} 12\n').encode()

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert pending_requests(f"http://127.0.0.1:{server.server_address[1]}/metrics") == 3
    finally:
        server.shutdown()
        server.server_close()
    assert pending_requests(None) is None and pending_requests(f"http://127.0.0.1:{free_port()}/metrics") is None


def test_a_servers_connections_on_its_port_are_found_and_shut_down():
    """This process as the server: the connection it accepted on its listening port is found among its descriptors
    (not the listening socket, nor a connection on another port) and shut down through a copy of its descriptor
    (pidfd_getfd): the client reads the end of the stream, as a stray client of a stopping tritonserver does."""
    from aot.serving.supervision.connections import close_connections, connections

    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_server(("127.0.0.1", 0)) as other:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        bystander = socket.create_connection(("127.0.0.1", other.getsockname()[1]))
        accepted, _ = listener.accept()
        kept, _ = other.accept()
        with client, bystander, accepted, kept:
            assert connections(os.getpid(), port) == [accepted.fileno()]
            assert close_connections(os.getpid(), port) == 1
            client.settimeout(10)
            assert client.recv(10) == b""  # the server's side was shut down
            bystander.sendall(b"x")
            assert kept.recv(1) == b"x"  # a connection on another port is left alone
            assert close_connections(os.getpid(), free_port()) == 0


def test_the_stop_mark_is_the_servers_and_goes_with_its_watches():
    """mark_stopping (the supervisor) is what server_stopping (a step, whose parent is the server) sees; the server's
    watches removed, it is gone."""
    from aot.serving.watch import mark_stopping, remove_watches, server_stopping, stopping_path

    parent = os.getppid()  # this test process plays the step; its parent the server
    assert not stopping_path(parent).exists() and not server_stopping()
    mark_stopping(parent)
    try:
        assert server_stopping() and stopping_path(parent).stat().st_mode & 0o777 == 0o600
    finally:
        remove_watches(parent)
    assert not server_stopping()
