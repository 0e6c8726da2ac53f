"""Per-task metrics of a served step on Triton's metrics port (pb_utils.MetricFamily), bounded in the number of
tasks.

Series (labels step, instance, task; the counters and pool series add version; the request series add tenant, the
task's tenant or "" for a public task: aot.serving.store.tenants):
    aot_task_texts_total, aot_task_failures_total (texts), aot_task_duration_us_total   per task version
    aot_task_requests_total      requests that held the task version's texts (a request of 64 texts counts once for
                                 each version it holds)                                    per task version
    aot_task_latency_seconds     a histogram (_bucket{le}, _sum, _count) of those requests' latency   per task
    aot_pool_hits_total, _misses_total, _evictions_total, _fill_us_total, aot_pool_resident_bytes   per task version
    aot_pool_budget_bytes                                                          per instance with a pool
    aot_task_errors_total (step, task, version), aot_store_manifest_errors_total (step)
    aot_engine_eager_batches_total (step, instance)   batches run eagerly by an engine that replays CUDA graphs
    aot_engine_cpu_us_total (step, instance)          CPU time spent in the engine (the rest is serving's own)
    aot_store_fetch_errors_total (step): fetches from an object store that failed (what failed: the server's log)
    aot_tenant_key_refusals_total (step, tenant): requests for a tenant's task with a key that does not open it
    aot_rate_limited_total (step, tenant): requests refused over their caller's rate ("" : without a tenant key)

Only the K busiest tasks of an instance have series of their own (aot.serving.metric_labels.TaskLabels); the others
count under task="<other>", requests for a task the store does not hold under "<unknown>", and requests refused
before they named a task under "<none>". Each instance labels its series with `instance`: the series of a task
that leaves the K busiest are removed, and Triton shares one series between instances that create the same labels
(removing it under one instance would leave the other writing to a freed series).

Removing a series: the python backend keeps every Metric alive in its MetricFamily object until that object is
deleted, so each task gets MetricFamily objects of its own (TaskSeries): deleting them removes exactly its series.

Every Metric call is a round trip to the server process, so counts are summed here (`request()`: a few dict updates
under a lock, once per request and task version) and a thread of their own publishes them every FLUSH_SECONDS, off
the request path (publishing per request and per pool version cost much of the throughput with many tasks:
docs/benchmarks.md, "Figures behind the serving code"; published after each batch, it still took 5-6 % of a GPU
step's time). The latency histogram too is counted here, by bucket, and published as the three series of a
Prometheus histogram, each a counter (the python backend's histogram takes one round trip per observation: its
observations took 7 % of a GPU step's time): a flush costs a round trip per bucket that changed, whatever the
number of requests. A scrape therefore lags by at most that interval. Counters of microseconds follow Triton's own convention
(nv_inference_request_duration_us): rate() of the duration over rate() of the requests is the mean time a task's
requests spend in a step.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from aot.serving.metric_labels import NONE, OTHER, PLACEHOLDERS, UNKNOWN, TaskLabels, metrics_tasks
from aot.serving.pool import RowPool
from aot.serving.store.reader import task_of
from aot.serving.store.tenants import tenant_of

# A request's latency in a step (seconds): from the start of its batch's execute to its answer.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_LATENCY = ("Latency of the requests holding a task's texts in a step, from the start of their batch to their "
            "answer, seconds (one observation per request and task; a histogram counted in the step)")
# name -> (Prometheus name, help, kind)
FAMILIES = {
    "requests": ("aot_task_requests_total", "Requests that held a task version's texts, per step (a request counts "
                                            "once for each version it holds)", "counter"),
    "texts": ("aot_task_texts_total", "Texts per task version and step", "counter"),
    "failures": ("aot_task_failures_total", "Texts of a task version whose request failed, per step", "counter"),
    "duration": ("aot_task_duration_us_total", "Time the texts of a task version spent in a step, microseconds",
                 "counter"),
    "latency_bucket": ("aot_task_latency_seconds_bucket", _LATENCY + ": observations up to `le`", "counter"),
    "latency_sum": ("aot_task_latency_seconds_sum", _LATENCY + ": their sum", "counter"),
    "latency_count": ("aot_task_latency_seconds_count", _LATENCY + ": their count", "counter"),
    "pool_hits": ("aot_pool_hits_total", "Rows found in the task pool", "counter"),
    "pool_misses": ("aot_pool_misses_total", "Rows read or computed into the task pool", "counter"),
    "pool_evictions": ("aot_pool_evictions_total", "Rows evicted from the task pool", "counter"),
    "pool_fill_us": ("aot_pool_fill_us_total", "Time spent filling the task pool, microseconds", "counter"),
    "pool_resident_bytes": ("aot_pool_resident_bytes", "Bytes of a task version's rows held in the pool", "gauge"),
    "pool_budget_bytes": ("aot_pool_budget_bytes", "Bytes of this instance's task pool", "gauge"),
    "task_errors": ("aot_task_errors_total", "Task versions found damaged or failing to load (refused until "
                                             "re-exported)", "counter"),
    "manifest_errors": ("aot_store_manifest_errors_total", "Task store manifests that could not be read (the last "
                                                           "good one stays in use)", "counter"),
    "engine_cpu_us": ("aot_engine_cpu_us_total", "CPU time the step's engine spent encoding batches (every thread "
                                                 "of the step's process), microseconds: the server's CPU less this "
                                                 "is what serving costs beside the encoder", "counter"),
    "eager_batches": ("aot_engine_eager_batches_total", "Batches an engine that replays CUDA graphs ran eagerly (a "
                                                        "capture that failed, a shape no graph covers)", "counter"),
    "fetch_errors": ("aot_store_fetch_errors_total", "Task versions that could not be fetched from the object store "
                                                     "(the server log says why)", "counter"),
    "key_refusals": ("aot_tenant_key_refusals_total", "Requests for a tenant's task with a key that does not open it, "
                                                      "per tenant the store holds", "counter"),
    "rate_limited": ("aot_rate_limited_total", "Requests refused over their caller's rate, per tenant (\"\": "
                                               "requests without a valid tenant key)", "counter"),
}
POOL_COUNTERS = ("pool_hits", "pool_misses", "pool_evictions", "pool_fill_us")


class TaskSeries:
    """The Metric objects of one task label in one step instance, in MetricFamily objects of their own: close()
    deletes them, which removes exactly these series from the metrics port."""

    def __init__(self, pb_utils, base_labels: dict[str, str]):
        self.pb, self.base = pb_utils, base_labels
        self._families: dict[str, object] = {}
        self._metrics: dict[tuple, object] = {}

    def metric(self, family: str, **labels: str):
        key = (family, *sorted(labels.items()))
        if key not in self._metrics:
            if family not in self._families:
                name, description, kind = FAMILIES[family]
                kinds = {"counter": self.pb.MetricFamily.COUNTER, "gauge": self.pb.MetricFamily.GAUGE}
                self._families[family] = self.pb.MetricFamily(name, description, kinds[kind])
            self._metrics[key] = self._families[family].Metric(labels={**self.base, **labels})
        return self._metrics[key]

    def close(self) -> None:
        """Metrics first, then their families (the backend refuses a family deleted before its metrics)."""
        self._metrics.clear()
        self._families.clear()


@dataclass
class _Counts:
    """What one task version's requests added since the last flush; `latency`: observations per bucket of
    LATENCY_BUCKETS (the last: above them all)."""

    requests: int = 0
    texts: int = 0
    failures: int = 0
    duration_us: float = 0.0
    latency: np.ndarray = field(default_factory=lambda: np.zeros(len(LATENCY_BUCKETS) + 1, np.int64))
    latency_sum: float = 0.0


class StepMetrics:
    """Per-task metrics of one step instance (module docstring): `request()` per request and task version served,
    published by a thread of their own every FLUSH_SECONDS (`start()`), and at `close()`."""

    FLUSH_SECONDS = 1.0

    def __init__(self, pb_utils, step: str, pool: RowPool | None = None, instance: str = "",
                 task_limit: int | None = None):
        """`instance`: the step instance (Triton's model instance name); `task_limit`: K, the tasks with series of
        their own (default: AOT_METRICS_TASKS, aot.settings)."""
        self.pb, self.step, self.pool, self.instance = pb_utils, step, pool, instance
        self.labels = TaskLabels(metrics_tasks() if task_limit is None else task_limit)
        base = {"step": step, "instance": instance}
        self._series: dict[str, TaskSeries] = {label: TaskSeries(pb_utils, base) for label in PLACEHOLDERS}
        self._base = base
        self._errors = TaskSeries(pb_utils, {"step": step})  # damaged versions and manifests: few, never removed
        self._pending: dict[str, _Counts] = defaultdict(_Counts)  # by version, or by placeholder
        self._refusals: dict[tuple[str, str], int] = defaultdict(int)  # (family, tenant) -> count since the flush
        self._pool_last: dict[str, tuple] = {}
        self._lock = threading.Lock()  # _pending, _refusals: the request thread fills them, the publisher takes them
        self._engine_us = 0.0  # engine CPU time not published yet (under _lock too)
        self._stop = threading.Event()
        self._publisher: threading.Thread | None = None
        if pool is not None:  # the pool's series exist from the start, whatever the layout puts in it
            self._series[OTHER].metric("pool_budget_bytes").set(pool.budget_bytes)
            for family in (*POOL_COUNTERS, "pool_resident_bytes"):
                self._series[OTHER].metric(family, task=OTHER, version=OTHER)

    def start(self) -> "StepMetrics":
        """Publish from a thread of its own every FLUSH_SECONDS (a step starts it; tests call flush() instead)."""
        self._publisher = threading.Thread(target=self._publish_loop, name="aot-metrics", daemon=True)
        self._publisher.start()
        return self

    def _publish_loop(self) -> None:
        while not self._stop.wait(self.FLUSH_SECONDS):
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - the next interval publishes again; a request never fails
                self.pb.Logger.log_error(f"{self.step}: metrics not published ({type(exc).__name__}: {exc})")

    def request(self, version: str, status: str, texts: int, seconds: float, latency: float) -> None:
        """A request served, for the `texts` of it that task version `version` held ("" if they named none the store
        holds): its status ("ok" or an aot.serving.errors reason, "internal" for a fault of the server), those texts'
        share of the step's time and the request's latency (seconds)."""
        key = version or (UNKNOWN if status == "not_found" else NONE)
        bucket = bisect.bisect_left(LATENCY_BUCKETS, latency)
        with self._lock:
            counts = self._pending[key]
            counts.requests += 1
            counts.texts += texts
            counts.failures += texts if status != "ok" else 0
            counts.duration_us += seconds * 1e6
            counts.latency[bucket] += 1
            counts.latency_sum += latency

    def engine_time(self, cpu_seconds: float) -> None:
        """CPU time one batch spent in the step's engine (published with the other counts)."""
        with self._lock:
            self._engine_us += cpu_seconds * 1e6

    def eager_batches(self, count: int) -> None:
        """Batches the step's engine ran eagerly where it replays CUDA graphs (0: the series exists from start)."""
        self._errors.metric("eager_batches", instance=self.instance).increment(count)

    def task_error(self, version: str) -> None:
        self._errors.metric("task_errors", task=task_of(version), version=version).increment(1)

    def manifest_error(self) -> None:
        self._errors.metric("manifest_errors").increment(1)

    def fetch_error(self) -> None:
        self._errors.metric("fetch_errors").increment(1)

    def refused_key(self, tenant: str) -> None:
        """A request named a task of `tenant` (a tenant the store holds) with a key that does not open it."""
        with self._lock:
            self._refusals["key_refusals", tenant] += 1

    def rate_limited(self, tenant: str) -> None:
        """A request of `tenant` ("": without a valid key) was refused over its rate."""
        with self._lock:
            self._refusals["rate_limited", tenant] += 1

    def flush(self) -> None:
        """Publish what was counted since the last flush (the publisher's thread, every FLUSH_SECONDS; close)."""
        with self._lock:
            pending, self._pending = self._pending, defaultdict(_Counts)
            engine_us, self._engine_us = self._engine_us, 0.0
            refusals, self._refusals = self._refusals, defaultdict(int)
        if engine_us:
            self._errors.metric("engine_cpu_us", instance=self.instance).increment(engine_us)
        for (family, tenant), count in refusals.items():  # tenants the store holds: a bounded set of series
            self._errors.metric(family, tenant=tenant).increment(count)
        busy: dict[str, int] = defaultdict(int)
        for key, counts in pending.items():
            if key not in PLACEHOLDERS:
                busy[task_of(key)] += counts.texts
        change = self.labels.update(busy)
        for task in change.removed:
            if task in self._series:
                self._series.pop(task).close()
        for key, counts in pending.items():
            self._publish(key, counts)
        if self.pool is not None:
            self._pool_counts()

    def close(self) -> None:
        """The step unloads (its `finalize`): the publishing thread stops, what was counted since the last flush is
        published, then the series are removed from the metrics port."""
        self._stop.set()
        if self._publisher is not None:
            self._publisher.join(timeout=5 * self.FLUSH_SECONDS)
        self.flush()
        for series in [*self._series.values(), self._errors]:
            series.close()
        self._series.clear()

    def _where(self, version: str) -> tuple[TaskSeries, dict[str, str]]:
        """The series and labels a version's counts go to: its own while its task is among the busiest, else
        OTHER's (a placeholder goes to its own)."""
        if version in PLACEHOLDERS:
            return self._series[version], {"task": version, "version": version}
        label = self.labels.label(task_of(version))
        if label == OTHER:
            return self._series[OTHER], {"task": OTHER, "version": OTHER}
        if label not in self._series:
            self._series[label] = TaskSeries(self.pb, self._base)
        return self._series[label], {"task": label, "version": version}

    def _publish(self, version: str, counts: _Counts) -> None:
        series, labels = self._where(version)
        # a tenant's requests also carry its name (aot.serving.store.tenants), under <other> too: series per tenant,
        # bounded by the store's tenants, never by what clients send; "" for public tasks and placeholders
        tenant = "" if version in PLACEHOLDERS else tenant_of(version) or ""
        labels = {**labels, "tenant": tenant}
        series.metric("requests", **labels).increment(counts.requests)
        series.metric("texts", **labels).increment(counts.texts)
        if counts.failures:
            series.metric("failures", **labels).increment(counts.failures)
        series.metric("duration", **labels).increment(counts.duration_us)
        task = {"task": labels["task"], "tenant": tenant}
        cumulative = np.cumsum(counts.latency)
        for le, amount in zip((*(f"{b:g}" for b in LATENCY_BUCKETS), "+Inf"), cumulative.tolist(), strict=True):
            bucket = series.metric("latency_bucket", le=le, **task)  # every bucket exists, from the first flush
            if amount:
                bucket.increment(amount)
        series.metric("latency_sum", **task).increment(counts.latency_sum)
        series.metric("latency_count", **task).increment(int(cumulative[-1]))

    def _pool_counts(self) -> None:
        """The pool's counters of the versions touched since the last flush, as increments; the resident bytes of
        the tasks without series of their own, summed under OTHER. Read from one snapshot the pool takes under its
        lock: the request thread keeps changing them."""
        touched, stats = self.pool.snapshot()
        other_resident = sum(s.resident_rows for version, s in stats.items()
                             if self.labels.label(task_of(version)) == OTHER) * self.pool.row_bytes
        for version in touched:
            series, labels = self._where(version)
            counts = stats.get(version)
            if counts is None:  # detached: its rows are gone
                if labels["task"] != OTHER:
                    series.metric("pool_resident_bytes", **labels).set(0)
                self._pool_last.pop(version, None)
                continue
            last = self._pool_last.get(version, (0, 0, 0, 0.0))
            now = (counts.hits, counts.misses, counts.evictions, counts.fill_seconds)
            for family, new, old in zip(POOL_COUNTERS, now, last, strict=True):
                amount = (new - old) * (1e6 if family == "pool_fill_us" else 1)
                if amount > 0:
                    series.metric(family, **labels).increment(amount)
            if labels["task"] != OTHER:
                series.metric("pool_resident_bytes", **labels).set(counts.resident_rows * self.pool.row_bytes)
            self._pool_last[version] = now
        self._series[OTHER].metric("pool_resident_bytes", task=OTHER, version=OTHER).set(other_resident)
