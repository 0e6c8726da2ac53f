"""Per-task metrics stay bounded: the K busiest tasks of a step instance have series of their own, the rest count
under one label (aot.serving.metric_labels, aot.serving.step_metrics), and the request log's lines
(aot.serving.request_log).

StepMetrics publishes through Triton's python-backend metric API; here it publishes into a small registry with that
API's semantics as tests/test_observability.py shows them on the real server: a MetricFamily object owns its
series, and deleting it removes them from the metrics port."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from aot.serving.metric_labels import HYSTERESIS, NONE, OTHER, UNKNOWN, TaskLabels, metrics_tasks
from aot.serving.pool import RowPool
from aot.serving.request_log import LoggedRequest, RequestLog, RequestLogSettings
from aot.serving.step_metrics import LATENCY_BUCKETS, StepMetrics


class MetricsPort:
    """The series a server would expose: (name, labels) -> value, as MetricFamily objects create and remove them."""

    def __init__(self):
        self.series: dict[tuple[str, frozenset], float] = {}
        port = self

        class Metric:
            def __init__(self, name, labels):
                self.key = (name, frozenset(labels.items()))
                port.series.setdefault(self.key, 0.0)

            def increment(self, amount):
                assert amount >= 0, "a counter only grows"
                port.series[self.key] += amount

            def set(self, value):
                port.series[self.key] = value

        class MetricFamily:
            COUNTER, GAUGE = "counter", "gauge"

            def __init__(self, name, description, kind):
                self.name, self.kind, self.metrics = name, kind, []

            def Metric(self, labels):  # noqa: N802 - pb_utils' name
                metric = Metric(self.name, labels)
                self.metrics.append(metric)
                return metric

            def __del__(self):
                for metric in self.metrics:
                    port.series.pop(metric.key, None)

        self.MetricFamily = MetricFamily

    def tasks(self, name: str) -> set[str]:
        """The task label values of a metric's live series."""
        return {dict(labels)["task"] for n, labels in self.series if n == name}

    def value(self, name: str, **labels) -> float:
        return sum(v for (n, lab), v in self.series.items() if n == name and labels.items() <= dict(lab).items())


def _zipf_counts(tasks: list[str], total: int, seed: int) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(tasks) + 1)
    counts = rng.multinomial(total, weights / weights.sum())
    return {t: int(c) for t, c in zip(tasks, counts, strict=True) if c}


PER_TASK = ("aot_task_requests_total", "aot_task_texts_total", "aot_task_duration_us_total",
            "aot_task_latency_seconds_count", "aot_task_latency_seconds_bucket",
            "aot_pool_hits_total", "aot_pool_misses_total", "aot_pool_resident_bytes")


def test_series_stay_at_k_plus_one_under_5000_distinct_tasks():
    """5,000 tasks requested with Zipf popularity, then the popularity turned around: every per-task metric of the
    instance keeps K + 1 task labels (the K busiest and <other>), the busiest are the ones named, a task that
    leaves them has its series removed, and every request is counted somewhere."""
    port, k = MetricsPort(), 8
    pool = RowPool(64 * 2 * 4 * 2 * 50, num_layers=2, hidden_size=4, vocab_size=64)  # room for 50 tasks' rows
    metrics = StepMetrics(port, "aot", pool, "aot_0_0", task_limit=k)
    tasks = [f"t{i:04d}" for i in range(5000)]
    versions = {t: f"{t}@{i:012x}" for i, t in enumerate(tasks)}
    ids = np.arange(8)

    def serve(order: list[str], rounds: int, seed: int) -> dict[str, int]:
        sent: dict[str, int] = {}
        for r in range(rounds):
            counts = _zipf_counts(order, 2000, seed + r)
            for task, n in counts.items():
                if pool.holds(versions[task]) or len(pool.stats) < 40:
                    if not pool.holds(versions[task]):
                        pool.attach(versions[task], lambda wanted: np.ones((len(wanted), 2, 4), np.float16))
                    pool.slots_many([(versions[task], ids)])
                for _ in range(n):
                    metrics.request(versions[task], "ok", 1, 0.001, 0.004)
                sent[task] = sent.get(task, 0) + n
            metrics.flush()
            for name in PER_TASK:
                named = port.tasks(name) - {OTHER}
                assert len(named) <= k and OTHER in port.tasks(name), (name, sorted(port.tasks(name)))
            assert port.tasks("aot_task_requests_total") == metrics.labels.labelled | {OTHER}
        return sent

    def assert_busiest_named(sent: dict[str, int]) -> None:
        """The busiest half are named, and no task without a name is more than HYSTERESIS times as busy as the
        lightest named one."""
        named = metrics.labels.labelled
        assert set(sorted(sent, key=sent.get, reverse=True)[: k // 2]) <= named
        lightest = min(metrics.labels.weight(t) for t in named)
        assert all(metrics.labels.weight(t) <= HYSTERESIS * lightest for t in sent if t not in named)

    sent = serve(tasks, rounds=5, seed=0)
    assert_busiest_named(sent)
    first = set(metrics.labels.labelled)
    assert port.value("aot_task_requests_total") == sum(sent.values())  # nothing removed yet: all counted
    for task in first:
        assert port.value("aot_task_requests_total", task=task) == sent[task]
    assert port.value("aot_task_latency_seconds_count", task=OTHER) == \
        sum(n for t, n in sent.items() if t not in first)

    later = serve(tasks[::-1], rounds=30, seed=100)  # the coldest tasks become the busiest
    assert_busiest_named({t: sent.get(t, 0) + n for t, n in later.items()})
    gone = first - metrics.labels.labelled
    assert gone  # some of the first busiest left: no series carries their names any more
    assert not {dict(labels).get("task") for _, labels in port.series} & gone


def test_unknown_and_unnamed_requests_have_labels_of_their_own():
    port = MetricsPort()
    metrics = StepMetrics(port, "aot", None, "aot_0_0", task_limit=2)
    metrics.request("", "not_found", 1, 0.001, 0.001)  # a task the store does not hold
    metrics.request("", "invalid", 1, 0.001, 0.001)  # refused before it named a task
    metrics.request("alpha@000000000001", "invalid", 1, 0.001, 0.001)  # a known task's bad request
    metrics.flush()
    assert port.tasks("aot_task_requests_total") == {UNKNOWN, NONE, "alpha"}
    assert port.value("aot_task_failures_total", task=UNKNOWN) == 1
    assert port.value("aot_task_failures_total", task=NONE) == 1
    assert port.value("aot_task_failures_total", task="alpha", version="alpha@000000000001") == 1
    assert "" not in port.tasks("aot_task_requests_total")


def test_a_flush_publishes_every_count_once():
    """What was counted between two flushes is published by the second, exactly, and never again: a request counts
    once per task version it holds, with its texts of that version; its latency is one observation, in its
    cumulative buckets (every bucket's series exists from the first flush)."""
    port = MetricsPort()
    metrics = StepMetrics(port, "aot", None, "aot_0_0", task_limit=4)
    for _ in range(7):
        metrics.request("alpha@000000000001", "ok", 1, 0.002, 0.002)
    metrics.request("alpha@000000000001", "invalid", 1, 0.001, 0.001)
    metrics.request("alpha@000000000001", "ok", 64, 0.001, 0.5)  # a request of 64 texts of the task
    metrics.refused_key("acme")
    metrics.rate_limited("")
    metrics.rate_limited("")
    metrics.engine_time(0.25)
    metrics.flush()
    metrics.flush()
    assert port.value("aot_task_requests_total", task="alpha") == 9
    assert port.value("aot_task_texts_total", task="alpha") == 72
    assert port.value("aot_task_latency_seconds_count", task="alpha") == 9  # observations: one per request
    assert port.value("aot_task_latency_seconds_sum", task="alpha") == pytest.approx(7 * 0.002 + 0.001 + 0.5)
    buckets = {le: port.value("aot_task_latency_seconds_bucket", task="alpha", le=le)
               for le in (*(f"{b:g}" for b in LATENCY_BUCKETS), "+Inf")}
    assert buckets["0.001"] == 1 and buckets["0.0025"] == 8 and buckets["0.25"] == 8 and buckets["0.5"] == 9
    assert buckets["+Inf"] == 9 and list(buckets.values()) == sorted(buckets.values())  # cumulative
    assert port.value("aot_task_failures_total", task="alpha") == 1
    assert port.value("aot_task_duration_us_total", task="alpha") == pytest.approx(16000)
    assert port.value("aot_tenant_key_refusals_total", tenant="acme") == 1
    assert port.value("aot_rate_limited_total", tenant="") == 2
    assert port.value("aot_engine_cpu_us_total", instance="aot_0_0") == pytest.approx(250000)


def test_pool_series_exist_from_the_start():
    """Whatever the layout puts in the pool (fused tables of a multi-instance step go through memory maps), a step
    with a pool publishes its budget and the pool's series from the start."""
    port = MetricsPort()
    pool = RowPool(1 << 20, num_layers=2, hidden_size=4, vocab_size=64)
    metrics = StepMetrics(port, "aot", pool, "aot_0_1", task_limit=4)  # noqa: F841 - its families hold the series
    assert port.value("aot_pool_budget_bytes", instance="aot_0_1") == pool.budget_bytes
    for name in ("aot_pool_hits_total", "aot_pool_misses_total", "aot_pool_resident_bytes"):
        assert port.tasks(name) == {OTHER}


def test_a_task_takes_a_place_only_when_much_busier():
    """Places go to the first busy tasks while there is room; then a newcomer replaces the lightest named task only
    when it weighs more than HYSTERESIS times as much, so a task on the edge does not flap."""
    now = [0.0]
    labels = TaskLabels(2, half_life=100.0, clock=lambda: now[0])
    assert labels.update({"a": 10, "b": 5}).added == ["a", "b"]
    change = labels.update({"c": int(5 * HYSTERESIS)})  # as heavy as twice b: not more
    assert change.added == [] and labels.label("c") == OTHER
    change = labels.update({"c": 1})
    assert change.added == ["c"] and change.removed == ["b"] and labels.labelled == {"a", "c"}
    now[0] = 100.0  # one half-life later, what was counted weighs half
    assert labels.weight("a") == pytest.approx(5.0)
    assert TaskLabels(0).update({"a": 100}).added == []  # K = 0: every task under <other>


@pytest.mark.parametrize("value,expected", [(None, 100), ("", 100), ("0", 0), ("25", 25), ("-1", None), ("x", None)])
def test_metrics_tasks_from_the_environment(value, expected):
    environ = {} if value is None else {"AOT_METRICS_TASKS": value}
    if expected is None:
        with pytest.raises(ValueError, match="AOT_METRICS_TASKS=.*expected a non-negative integer"):
            metrics_tasks(environ)
    else:
        assert metrics_tasks(environ) == expected


def test_request_log_writes_sampled_requests_without_text_unless_asked(tmp_path):
    path = tmp_path / "requests.jsonl"
    draws = iter([0.1, 0.9, 0.2])
    log = RequestLog(RequestLogSettings(str(path), sample=0.5), "aot", chance=lambda: next(draws))
    requests = [LoggedRequest("sentiment", "sentiment@3f2a9c41d0e7", 0.0124, "OK", "Très bien 👍"),
                LoggedRequest("nosuch", None, 0.0001, "NOT_FOUND", "x")]
    log.write([r for r in requests if log.sampled()])
    log.write([r for r in requests[:1] if log.sampled()])
    log.close()
    assert os.stat(path).st_mode & 0o777 == 0o600
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [(r["task"], r["status"]) for r in lines] == [("sentiment", "OK"), ("sentiment", "OK")]
    assert set(lines[0]) == {"time", "step", "task", "tenant", "version", "latency_ms", "status"}
    assert lines[0]["latency_ms"] == 12.4 and lines[0]["time"].endswith("Z") and lines[0]["tenant"] == ""  # public
    with_text = RequestLog(RequestLogSettings(str(path), text=True), "tokenizer")
    with_text.write(requests[:1])
    with_text.close()
    last = path.read_text(encoding="utf-8").splitlines()[-1]
    assert "Très bien 👍" in last and json.loads(last)["text"] == "Très bien 👍"
    tenants = RequestLog(RequestLogSettings(str(path)), "aot")  # issue 47.7: the tenant of the version that served
    tenants.write([LoggedRequest("acme/intent", "acme/intent@3f2a9c41d0e7", 0.01, "OK"),
                   LoggedRequest("acme/nosuch", None, 0.0001, "NOT_FOUND")])
    tenants.close()
    served, unknown = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()[-2:])
    assert (served["task"], served["tenant"]) == ("acme/intent", "acme") and unknown["tenant"] is None


def test_request_log_settings_from_the_environment(tmp_path):
    assert RequestLogSettings.from_environment({}) is None
    settings = RequestLogSettings.from_environment({"AOT_REQUEST_LOG": "x.jsonl", "AOT_REQUEST_LOG_SAMPLE": "0.25",
                                                    "AOT_REQUEST_LOG_TEXT": "1"})
    assert settings == RequestLogSettings("x.jsonl", 0.25, True)
    assert RequestLogSettings.from_environment(settings.as_environment()) == settings
    with pytest.raises(ValueError, match="AOT_REQUEST_LOG_SAMPLE='lots': expected a share"):
        RequestLogSettings.from_environment({"AOT_REQUEST_LOG": "x", "AOT_REQUEST_LOG_SAMPLE": "lots"})
    with pytest.raises(ValueError, match=r"request log .*/missing/x.jsonl: cannot be opened for appending"):
        RequestLog(RequestLogSettings(str(tmp_path / "missing" / "x.jsonl")), "aot")
