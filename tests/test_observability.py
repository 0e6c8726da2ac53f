"""What an operator and a caller learn from a real server: per-task latency histograms and counters bounded to the K
busiest tasks, unknown tasks counted as such, the pool's series, the request log, the typed errors of the client
(and of `aot infer --input`'s bad lines), and the documented curl call over HTTP/JSON."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from aot.client.client import Client
from aot.client.errors import InvalidInput, PermissionDenied, TaskNotFound, TaskUnavailable, Unavailable, from_triton
from aot.serving.metric_labels import NONE, OTHER, UNKNOWN
from aot.serving.step_metrics import LATENCY_BUCKETS, StepMetrics
from tests.helpers import make_repository, train_tiny_task

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
K = 2  # tasks with series of their own in each step instance (AOT_METRICS_TASKS)
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, sentiment_dir):
    """alpha, beta, delta (fused), gamma (factored) and broken, whose table is damaged on disk."""
    root = tmp_path_factory.mktemp("observed")
    first = train_tiny_task(tiny_models["bert"], sentiment_dir, root / "first", "fc", seed=0)
    second = train_tiny_task(tiny_models["bert"], sentiment_dir, root / "second", "fc", seed=1)
    repo = make_repository(tiny_models["bert"], root / "repo",
                           {"alpha": (first, "fused"), "beta": (second, "fused"), "gamma": (second, "factored"),
                            "delta": (first, "fused"), "broken": (first, "fused")})
    from aot.serving.repository import read_repository
    from aot.serving.store.writer import TaskStore

    store = TaskStore(read_repository(repo).store_root)
    table = store.version_folder(store.entries()["broken"].folder) / "table.npy"
    table.write_bytes(table.read_bytes()[: table.stat().st_size // 2])
    return repo


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("log") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(request, repo, log_path):
    from aot.local.server import LocalServer

    with pytest.MonkeyPatch.context() as env:  # what `aot serve --metrics-tasks 2 --request-log FILE` sets
        env.setenv("AOT_METRICS_TASKS", str(K))
        env.setenv("AOT_REQUEST_LOG", str(log_path))
        server = LocalServer(repo).start()
    yield server
    if request.session.testsfailed:
        print(f"\n--- tritonserver log ---\n{server.log_tail(60)}")
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_url, timeout=30) as c:
        yield c


def _samples(server) -> list[tuple[str, dict, float]]:
    with urllib.request.urlopen(f"http://{server.metrics_host}:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [(m["name"], dict(_LABEL.findall(m["labels"] or "")), float(m["value"]))
            for line in text.splitlines() if not line.startswith("#") and (m := _SAMPLE.match(line))]


def _value(samples, name: str, **labels) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items()))


def _published(server, client, name: str, task: str, count: int) -> list:
    """The metrics once the steps' instances published `count` of `task`'s requests under `name` (each instance
    publishes after a batch, at most once a second: requests for an unknown task make them publish)."""
    for _ in range(15):
        time.sleep(StepMetrics.FLUSH_SECONDS + 0.2)
        client.infer_many([{"task": "nosuch", "text": "w1"}] * 4, concurrency=4)
        samples = _samples(server)
        if _value(samples, name, step="aot", task=task) >= count:
            return samples
    return samples


def test_latency_histogram_per_task(server, client):
    """aot_task_latency_seconds: Prometheus _bucket series (cumulative, every bucket up to +Inf) per task and step
    instance, one observation per request and task it holds (6 requests of one text and one of 4 texts: 7), while
    aot_task_texts_total counts each text (10) and aot_task_requests_total each request (7); and the counters beside
    it."""
    single = client.infer_many([{"task": "alpha", "text": "good w1"}] * 6 + [{"task": "beta", "text": "w2"}] * 3,
                               pack=1)
    packed = client.infer_many([{"task": "alpha", "text": f"good w{k}"} for k in range(4)], pack=4)
    assert len(single) == 9 and len(packed) == 4
    assert all("error" not in a for a in single + packed), single + packed
    samples = _published(server, client, "aot_task_texts_total", "alpha", 10)
    assert _value(samples, "aot_task_texts_total", step="aot", task="alpha") == 10
    assert _value(samples, "aot_task_requests_total", step="aot", task="alpha") == 7
    assert _value(samples, "aot_task_latency_seconds_count", step="aot", task="alpha") == 7
    assert _value(samples, "aot_task_latency_seconds_bucket", step="aot", task="alpha", le="+Inf") == 7
    assert _value(samples, "aot_task_latency_seconds_sum", step="aot", task="alpha") > 0
    instances = {lab["instance"] for n, lab, _ in samples if n == "aot_task_latency_seconds_count"
                 and lab["task"] == "alpha"}
    assert instances
    for instance in instances:
        buckets = [_value(samples, "aot_task_latency_seconds_bucket", task="alpha", instance=instance,
                          le=f"{b:g}") for b in LATENCY_BUCKETS]
        assert buckets == sorted(buckets)  # cumulative
    assert _value(samples, "aot_task_failures_total", step="aot", task="alpha") == 0


def test_unknown_tasks_are_counted_as_such(server, client):
    sent = 3
    for _ in range(sent):
        with pytest.raises(TaskNotFound):
            client.infer("nosuch-at-all", "w1")
    samples = _published(server, client, "aot_task_requests_total", UNKNOWN, sent)
    assert _value(samples, "aot_task_failures_total", step="aot", task=UNKNOWN) >= sent
    assert not [lab for n, lab, _ in samples if n.startswith("aot_task_") and lab.get("task") in ("", None)
                and n != "aot_task_errors_total"]


def test_series_stay_bounded_to_the_k_busiest_tasks(server, client):
    """K = 2: with more tasks busy, each step instance names at most K of them and counts the rest under <other>;
    delta, much busier than the others, takes a place from them, whose series are removed."""
    for task, n in (("alpha", 4), ("beta", 4), ("gamma", 4)):
        client.infer_many([{"task": task, "text": "good w3"}] * n)
    client.infer_many([{"task": "delta", "text": "w4 great"}] * 60, concurrency=8)
    samples = _published(server, client, "aot_task_texts_total", "delta", 60)
    instances = {lab["instance"] for n, lab, _ in samples if n == "aot_task_texts_total" and lab["step"] == "aot"}
    for instance in instances:
        named = {lab["task"] for n, lab, _ in samples if n == "aot_task_texts_total"
                 and lab["instance"] == instance} - {OTHER, UNKNOWN, NONE}
        assert len(named) <= K, (instance, named)
        for name in ("aot_task_duration_us_total", "aot_task_latency_seconds_count"):
            tasks = {lab["task"] for n, lab, _ in samples if n == name and lab["instance"] == instance}
            assert tasks - {OTHER, UNKNOWN, NONE} <= named, (name, tasks)
    assert _value(samples, "aot_task_texts_total", step="aot", task="delta") > 0  # delta has its own series
    counted = sum(_value(samples, "aot_task_texts_total", step="aot", task=t) for t in ("delta", OTHER))
    assert counted >= 60  # delta's texts are all counted, under its name or, before it had one, under <other>


def test_pool_series_on_the_default_cpu_layout(server, client):
    """Two instances of the fused step (the default), whose fused tables are read through their memory maps: the
    pool's series are there all the same, per instance."""
    samples = _samples(server)
    budgets = {lab["instance"]: v for n, lab, v in samples if n == "aot_pool_budget_bytes"}
    assert set(budgets) == {"aot_0_0", "aot_1_0"} and all(v > 0 for v in budgets.values())
    for name in ("aot_pool_hits_total", "aot_pool_misses_total", "aot_pool_resident_bytes"):
        assert {lab["instance"] for n, lab, _ in samples if n == name and lab["task"] == OTHER} == set(budgets)


def test_request_log_has_one_line_per_request_without_text(server, client, log_path):
    before = len(log_path.read_text().splitlines()) if log_path.exists() else 0
    client.infer("gamma", "a secret text")
    with pytest.raises(TaskNotFound):
        client.infer("nosuch-logged", "another secret")
    lines = [json.loads(line) for line in log_path.read_text().splitlines()[before:]]
    mine = [r for r in lines if r["task"] in ("gamma", "nosuch-logged")]
    assert [(r["task"], r["status"], r["step"]) for r in mine] == [("gamma", "OK", "aot"),
                                                                    ("nosuch-logged", "NOT_FOUND", "aot")]
    assert mine[0]["version"].startswith("gamma@") and mine[1]["version"] is None
    assert mine[0]["tenant"] == "" and mine[1]["tenant"] is None  # a public task's; none for an unknown name
    assert all(set(r) == {"time", "step", "task", "tenant", "version", "latency_ms", "status"} for r in lines)
    assert "secret" not in log_path.read_text()
    assert (log_path.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("call,kind,status,retryable", [
    pytest.param(lambda c: c.infer("nosuch", "w1"), TaskNotFound, "NOT_FOUND", False, id="unknown task"),
    pytest.param(lambda c: c.infer("alpha@000000000000", "w1"), TaskNotFound, "NOT_FOUND", False,
                 id="a version the store does not hold"),
    pytest.param(lambda c: c.infer("alpha", " "), InvalidInput, "INVALID_ARGUMENT", False, id="empty text"),
    pytest.param(lambda c: c.infer("alpha", "w1 " * 30000), InvalidInput, "INVALID_ARGUMENT", False,
                 id="oversized text"),
    pytest.param(lambda c: c.infer("broken", "w1"), TaskUnavailable, "UNAVAILABLE", False, id="damaged task"),
])
def test_client_errors_are_typed(client, call, kind, status, retryable):
    with pytest.raises(kind) as caught:
        call(client)
    error = caught.value
    assert type(error) is kind and error.status == status and error.retryable is retryable
    assert error.task is not None and "\n" not in str(error)


def test_unreachable_server_is_retryable_and_restricted_api_is_permission(server):
    from tritonclient.grpc import InferenceServerClient
    from tritonclient.utils import InferenceServerException

    from aot.local.server import free_port

    with Client(f"127.0.0.1:{free_port()}", timeout=5, retry_seconds=0) as nobody:  # the retries: test_server.py
        with pytest.raises(Unavailable) as caught:
            nobody.infer("alpha", "w1")
    assert caught.value.retryable and caught.value.status == "UNAVAILABLE" and caught.value.task == "alpha"
    with pytest.raises(Unavailable, match="cannot reach the server"):
        Client(f"127.0.0.1:{free_port()}", timeout=5, retry_seconds=0).check_ready()
    raw = InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as restricted:
        raw.get_inference_statistics("aot")  # an API only the admin key opens
    raw.close()
    error = from_triton(restricted.value)
    assert isinstance(error, PermissionDenied) and not error.retryable


def test_infer_many_errors_echo_id_and_task(client):
    answers = client.infer_many([{"id": 1, "task": "alpha", "text": "good"}, {"id": "b", "task": "nosuch", "text": "x"},
                                 {"id": 3, "task": "alpha", "text": ""}, {"id": 4, "text": "no task"}])
    assert "label" in answers[0]
    assert answers[1] == {"id": "b", "task": "nosuch", "error": answers[1]["error"], "error_type": "TaskNotFound",
                          "status": "NOT_FOUND", "retryable": False}
    assert answers[2]["id"] == 3 and answers[2]["task"] == "alpha" and answers[2]["status"] == "INVALID_ARGUMENT"
    assert answers[3]["id"] == 4 and answers[3]["error_type"] == "InvalidInput" and "task" in answers[3]["error"]


def test_infer_input_answers_a_bad_line_in_place(server):
    """`aot infer --input -`: a line that is not JSON, one without a task and one for an unknown task are each
    answered {"error": ...} where they stand; the stream goes on."""
    stdin = '{"id": 1, "task": "alpha", "text": "good"}\nnot json\n{"id": 3, "text": "no task"}\n\n' \
            '{"id": 5, "task": "nosuch", "text": "x"}\n{"id": 6, "task": "beta", "text": "w1"}\n'
    run = subprocess.run([sys.executable, "-m", "aot", "infer", "--url", server.grpc_url, "--input", "-",
                          "--no-progress", "--partial-ok"], input=stdin, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    answers = [json.loads(line) for line in run.stdout.splitlines()]
    assert [a.get("id") for a in answers] == [1, None, 3, 5, 6]
    assert "label" in answers[0] and "label" in answers[4]
    assert answers[1]["error"].startswith("line 2: invalid JSON (")
    assert answers[2]["error"] == 'line 3: expected {"task": "...", "text": "..."} (or --task for lines without one)'
    assert answers[3]["error_type"] == "TaskNotFound" and answers[3]["task"] == "nosuch"
    assert run.stderr.startswith("aot: warning: 2 of 5 lines answered, 3 failed (2 InvalidInput, first line 2: "
                                 "invalid JSON (")


def test_curl_example_of_the_docs_answers(server, client):
    """docs/deploy-local.md's HTTP/JSON call, as written (the address and task put in), answers as the client."""
    if shutil.which("curl") is None:
        pytest.fail("curl is not installed: the documented HTTP/JSON example uses it")
    text = (ROOT / "docs" / "deploy-local.md").read_text()
    block = re.search(r"## Over HTTP/JSON.*?```bash\n(?P<code>.*?)```", text, re.S)["code"]
    command = block.replace("127.0.0.1:8000", server.http_url).replace('"sentiment"', '"alpha"')
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    outputs = {o["name"]: o["data"] for o in json.loads(run.stdout)["outputs"]}
    expected = client.infer("alpha", "A fine film.")
    assert outputs["LABEL"] == [expected["label"]] and outputs["TASK_VERSION"] == [expected["version"]]
    assert outputs["LOGITS"] == pytest.approx(expected["logits"], abs=1e-6)


def test_grafana_dashboard_queries_parse_and_read_served_series(server, client):
    """deploy/grafana/aot-tasks.json: per-task rate, errors, p50 and p99 over every replica; each query is valid
    PromQL (the dashboard's variables put in) and reads series this server publishes."""
    import promql_parser

    with pytest.raises(TaskNotFound):
        client.infer("nosuch", "w1")  # a failure, so that the failures series exists
    samples = _published(server, client, "aot_task_failures_total", UNKNOWN, 1)
    served = {n for n, _, _ in samples}
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "aot-tasks.json").read_text())
    queries = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("$__rate_interval", "5m").replace("$step", "aot").replace("$task", ".*")
                    .replace("$tenant", ".*"))
            promql_parser.parse(expr)  # raises on a syntax error
            names = set(re.findall(r"\b(aot_[a-z_]+)\b", expr))
            assert names and names <= served, (panel["title"], names - served)
            queries[panel["title"]] = expr
    read = " ".join(queries.values())
    assert "rate(aot_task_texts_total" in read and "rate(aot_task_failures_total" in read
    assert "histogram_quantile(0.5, sum by (le, task)" in read and "histogram_quantile(0.99, sum by (le, task)" in read
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "step", "tenant", "task"}  # issue 47.7: a tenant variable
    assert variables["tenant"]["definition"].endswith(", tenant)") and 'tenant=~"$tenant"' in variables["task"]["definition"]
    requests = [e for e in queries.values() if re.search(r"aot_task_(requests|failures|latency)", e)]
    assert requests and all('tenant=~".*"' in e for e in requests)  # every request panel filters by it
    assert all("tenant" in labels for name, labels, _ in samples if name == "aot_task_failures_total")


def test_infer_top_k_names_the_labels_from_the_server(server, client, capsys):
    from aot.cli.main import main

    assert main(["infer", "--url", server.grpc_url, "--task", "alpha", "--top-k", "1", "good w1"]) == 0
    answer = json.loads(capsys.readouterr().out)
    full = client.infer("alpha", "good w1")
    assert answer == {"label": full["label"], "top": [{"label": full["label"],
                                                       "probability": max(full["probabilities"])}],
                      "version": full["version"]}
