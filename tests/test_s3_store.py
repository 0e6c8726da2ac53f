"""A task store in S3-compatible object storage, against a real SeaweedFS started here (aot.local.s3_server): export
into a bucket and serve from it, publish while serving, the store paused (SIGSTOP: a network partition) under load and
beside a cold task in one batch, a corrupted object, racing publishers."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aot.client.client import Client, InferenceError, TaskNotFound, Unavailable
from aot.exporter.backbone_export import export_backbone
from aot.exporter.task_export import export_task
from aot.local.s3_server import LocalS3
from aot.serving.repository import read_repository
from aot.serving.store.writer import TaskStore
from aot.serving.supervision.admin_key import GRPC_ADMIN_HEADER
from aot.serving.supervision.procfs import stubs_of
from aot.serving.task_registry import REMOTE_POLL_SECONDS
from aot.training.predict import Predictor
from tests.helpers import Load, serve_for_tests, train_tiny_tasks, wait_until

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["good w1 w2", "w3 awful w4 w5", "the movie was superb"]
ATOL = 1e-3


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seaweedfs")
    saved = dict(os.environ)
    with LocalS3(folder) as server:
        server.create_bucket("aot-tasks")
        os.environ.update(server.environment())  # the tests, and the servers they start, reach it
        os.environ["AOT_TASK_CACHE_DIR"] = str(folder / "cache")
        yield server
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_models, sentiment_dir):
    return train_tiny_tasks(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("s3-artifacts"), 2)


@pytest.fixture(scope="module")
def expected(artifacts):
    return {name: Predictor.load(path).logits(TEXTS).numpy() for name, path in artifacts.items()}


@pytest.fixture(scope="module")
def repo(s3, tmp_path_factory, tiny_models, artifacts):
    repo = tmp_path_factory.mktemp("s3-repo") / "repo"
    export_backbone(str(tiny_models["bert"]), repo, store="s3://aot-tasks/fleet")
    export_task(artifacts["alpha"], repo, "alpha", "fused", progress=False)
    export_task(artifacts["beta"], repo, "beta", "factored", progress=False)
    return repo


@pytest.fixture(scope="module")
def server(request, repo):
    yield from serve_for_tests(request, repo)


def _check(client, expected, names=("alpha", "beta")):
    for name in names:
        for text, want in zip(TEXTS, expected[name], strict=True):
            np.testing.assert_allclose(client.infer(name, text)["logits"], want, atol=ATOL)


def _wait_known(client, name: str) -> None:
    """Until every step knows a published task, without requesting it (which would fetch it)."""
    deadline = time.monotonic() + 10
    while name not in {t["name"] for t in client.tasks()["tasks"]}:
        assert time.monotonic() < deadline, f"the published task {name} was not listed within 10 s"
        time.sleep(0.1)
    time.sleep(3 * REMOTE_POLL_SECONDS)  # each step follows the index from its own thread: the fused one too


def test_exported_into_a_bucket_and_served_from_it(repo, server, expected, s3):
    info = read_repository(repo)
    assert info.store_url == "s3://aot-tasks/fleet"
    assert not [p for p in info.store_root.iterdir() if "@" in p.name]  # no version in the repository
    with Client(server.grpc_url) as client:
        _check(client, expected)
        listing = client.tasks()
    assert sorted(t["name"] for t in listing["tasks"]) == ["alpha", "beta"] and listing["errors"] == {}
    cache = Path(os.environ["AOT_TASK_CACHE_DIR"])
    assert sorted(p.name.split("@")[0] for p in cache.iterdir() if "@" in p.name) == ["alpha", "beta"]
    assert TaskStore.of(info).verify() == {"alpha": None, "beta": None}


def test_a_task_published_while_serving_answers_within_seconds(repo, server, artifacts, expected):
    with Client(server.grpc_url) as client:
        start = time.monotonic()
        report = export_task(artifacts["alpha"], repo, "gamma", "auto", progress=False)
        published = time.monotonic()
        # auto in object storage: factored, whatever the pool could hold (each replica downloads what a task stores)
        assert report.storage == "factored" and report.storage_advice["tasks_in_store"] <= \
            report.storage_advice["tasks_resident_in_pool"]
        assert "the store is in object storage" in report.storage_advice["auto_reason"]
        while True:
            try:
                got = client.infer("gamma", TEXTS[0])
                break
            except InferenceError:
                assert time.monotonic() - published < 10, "the published task did not serve within 10 s"
                time.sleep(0.05)
        print(f"\npublish {published - start:.2f} s, then served after {time.monotonic() - published:.2f} s")
        np.testing.assert_allclose(got["logits"], expected["alpha"][0], atol=ATOL)


def _refused_now(url: str, name: str) -> InferenceError | None:
    """The error of one request for `name`, sent once (a client's retries would wait out a refusal), or None when it
    was answered."""
    with Client(url, retry_seconds=0) as once:
        try:
            once.infer(name, TEXTS[0])
        except InferenceError as exc:
            return exc
    return None


def _assert_no_store_internals(message: str, s3) -> None:
    """What a client reads names the task, never the bucket, its prefix or the store's endpoint (issue 46, item 8)."""
    host_port = s3.endpoint.split("//", 1)[1]
    for internal in ("aot-tasks", "s3://", host_port, str(s3.ports["s3"])):
        assert internal not in message, (internal, message)


def test_the_store_paused_under_load(repo, server, artifacts, expected, s3):
    """A network partition (SeaweedFS stopped by SIGSTOP) while serving: the cached tasks' requests never fail and
    never wait on the store; a task not fetched yet fails alone, 503 with a retry hint and no store address; a name
    the index lacks is 503 too, not "unknown" (the store might hold it); /ready stays 200 and says the store does not
    answer; instances replaced meanwhile serve the index and versions their host kept. Once it is back, all of it
    mends by itself."""
    export_task(artifacts["beta"], repo, "delta", "factored", progress=False)  # published, never requested
    with Client(server.grpc_url) as client:
        _check(client, expected)  # both cached
        _wait_known(client, "delta")  # known, never fetched
        pick = lambda k, j: (("alpha", "beta")[(k + j) % 2], (k + j) % len(TEXTS))  # noqa: E731
        s3.pause()
        try:
            with Load(server.grpc_url, TEXTS, 4, pick, timeout=60, retry_seconds=0) as load:
                load.wait_for(50)
                refused = wait_until(lambda: _refused_now(server.grpc_url, "delta"), 60,
                                     "the uncached task was not refused")
                status, ready = wait_until(lambda: (r := server.readiness())[1].get("warnings") and r, 60,
                                           "/ready did not report the store")
                cold = [_refused_now(server.grpc_url, "delta") for _ in range(10)]  # beside the load, alone
                unknown = _refused_now(server.grpc_url, "nosuch")
                listing = wait_until(lambda: (t := client.tasks()).get("index_error") and t, 60,
                                     "aot tasks did not say the index cannot be read")
                load.wait_for(len(load.outcomes) + 200)
            _replace_every_instance(server, "aot")  # new instances start while the store does not answer
            after = [client.infer(("alpha", "beta")[i % 2], TEXTS[i % len(TEXTS)]) for i in range(20)]
        finally:
            s3.resume()
        failed = [o for o in load.outcomes if o.error is not None]
        wrong = [o for o in load.outcomes if o.error is None and np.abs(o.logits - expected[o.task][o.text]).max()
                 > ATOL]
        latencies = sorted(o.end - o.start for o in load.outcomes)
        print(f"\nstore paused: {len(load.outcomes)} requests of cached tasks, {len(failed)} failed, {len(wrong)} "
              f"wrong, p99 {1000 * latencies[int(0.99 * (len(latencies) - 1))]:.0f} ms; /ready {status} {ready}")
        assert failed == [] and wrong == [], (failed[:3], wrong[:3])
        for exc in [refused, *cold]:
            assert isinstance(exc, Unavailable) and exc.retryable and exc.retry_after is not None, exc
            assert "task 'delta'" in str(exc) and "cannot be fetched from the task store now" in str(exc)
            _assert_no_store_internals(str(exc), s3)
        assert isinstance(unknown, Unavailable) and "not in the index this server holds" in str(unknown), unknown
        assert status == 200 and ready["ready"] is True and "task store" in ready["warnings"][0], ready
        _assert_no_store_internals(json.dumps(ready), s3)
        _assert_no_store_internals(json.dumps(listing), s3)
        for i, answer in enumerate(after):
            np.testing.assert_allclose(answer["logits"], expected[("alpha", "beta")[i % 2]][i % len(TEXTS)],
                                       atol=ATOL)
        # back: the cold task is fetched, /ready has nothing to say, an unknown name is unknown again
        wait_until(lambda: _refused_now(server.grpc_url, "delta") is None, 60, "the cold task did not serve again")
        np.testing.assert_allclose(client.infer("delta", TEXTS[0])["logits"], expected["beta"][0], atol=ATOL)
        wait_until(lambda: server.readiness()[1]["warnings"] == [], 60, "/ready still warned once the store was back")
        wait_until(lambda: all(isinstance(_refused_now(server.grpc_url, "nosuch"), TaskNotFound) for _ in range(8)),
                   60,
                   "an unknown name was not unknown again on every instance")
        with pytest.raises(TaskNotFound, match="unknown task 'nosuch'"):
            client.infer("nosuch", TEXTS[0])


def _replace_every_instance(server, model: str) -> None:
    """kill -9 each instance of `model` in turn and wait until the supervisor replaced it: every request after this
    is served by an instance that started now."""
    for instance in sorted(s.instance for s in stubs_of(server.process.pid).values() if s.model == model):
        repairs = len(server.supervisor.repairs)
        os.kill(stubs_of(server.process.pid)[instance].pid, signal.SIGKILL)
        wait_until(lambda: any(r.seconds is not None for r in server.supervisor.repairs[repairs:]), 60,
                   f"{instance} was not replaced")
        assert all(r.error is None for r in server.supervisor.repairs[repairs:]), server.supervisor.repairs[repairs:]


BATCH_DELAY_US = 3_000_000  # the batching server's queue delay: requests sent together always share a batch


@pytest.fixture
def batching_server(tmp_path, repo):
    """A server of its own on the same bucket whose fused step waits up to BATCH_DELAY_US to fill a batch, so that
    requests sent together share one however busy the machine is; unsupervised, so that no liveness probe joins or
    splits that batch."""
    from aot.local.server import LocalServer

    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    config = copy / "models" / "aot" / "configs" / "cpu.pbtxt"
    text, count = re.subn(r"dynamic_batching \{\n", f"dynamic_batching {{\n  max_queue_delay_microseconds: "
                                                     f"{BATCH_DELAY_US}\n", config.read_text())
    assert count == 1 and text.count("max_queue_delay_microseconds") == 1, config.read_text()
    config.write_text(text)
    with LocalServer(copy, supervise=False) as server:
        yield server


def test_a_cold_task_beside_cached_ones_in_one_batch_fails_alone(repo, batching_server, artifacts, expected, s3):
    """The issue's worst case: during a partition, one batch holds 7 requests of a cached task and 1 of a task never
    fetched. Only the cold one fails (503, its own task named); the 7 are answered right, in that same batch."""
    import tritonclient.grpc as grpcclient

    server = batching_server
    export_task(artifacts["beta"], repo, "omega", "factored", progress=False)
    with Client(server.grpc_url, timeout=60) as client:
        _wait_known(client, "omega")
        client.infer_many([{"task": "alpha", "text": t} for t in TEXTS] * 4, concurrency=12)  # both instances
        s3.pause()
        try:
            wait_until(lambda: _refused_now(server.grpc_url, "omega"), 60, "the uncached task was not refused")
            with grpcclient.InferenceServerClient(server.grpc_url) as c:
                before = c.get_inference_statistics("aot", headers={GRPC_ADMIN_HEADER: server.admin_key})
            items = [{"task": "alpha", "text": TEXTS[i % len(TEXTS)]} for i in range(7)]
            items.insert(3, {"task": "omega", "text": TEXTS[0]})
            # 8 requests, one batch; from a client that gives up at once: this one would send the cold task's
            # retryable refusal again (aot.client.batch), and the resend would be an execution of its own
            with Client(server.grpc_url, timeout=60, retry_seconds=0) as once:
                answers = once.infer_many(items, concurrency=len(items), pack=1)
            with grpcclient.InferenceServerClient(server.grpc_url) as c:
                after = c.get_inference_statistics("aot", headers={GRPC_ADMIN_HEADER: server.admin_key})
        finally:
            s3.resume()
    executions = after.model_stats[0].execution_count - before.model_stats[0].execution_count
    assert executions == 1, f"the 8 requests ran in {executions} executions, not one batch"
    for item, answer in zip(items, answers, strict=True):
        if item["task"] == "omega":
            assert answer["error_type"] == "Unavailable" and answer["retryable"], answer
            assert "task 'omega'" in answer["error"] and "cannot be fetched" in answer["error"], answer
            _assert_no_store_internals(answer["error"], s3)
        else:
            np.testing.assert_allclose(answer["logits"], expected["alpha"][TEXTS.index(item["text"])], atol=ATOL)


def test_a_corrupted_object_is_refused_then_retried(repo, server, artifacts, expected, s3):
    from aot.serving.store.s3 import S3Backend

    export_task(artifacts["alpha"], repo, "eps", "factored", progress=False)
    store = TaskStore.of(read_repository(repo))
    version = store.entries()["eps"].folder
    bucket = S3Backend("s3://aot-tasks/fleet")
    key = f"{version}/factors.safetensors"
    good = bucket.read(key)
    bucket.write(key, good[:-8] + b"\x00" * 8)
    with Client(server.grpc_url, retry_seconds=0) as client:  # the refusal once, not waited out
        _wait_known(client, "eps")
        with pytest.raises(Unavailable, match=r"task 'eps' \(eps@[0-9a-f]{12}\): a file fetched from the task store "
                                               r"is damaged") as refused:
            client.infer("eps", TEXTS[0])
        _assert_no_store_internals(str(refused.value), s3)
        bucket.write(key, good)
        deadline = time.monotonic() + 30
        while True:
            try:
                np.testing.assert_allclose(client.infer("eps", TEXTS[0])["logits"], expected["alpha"][0], atol=ATOL)
                break
            except InferenceError:
                assert time.monotonic() < deadline, "the mended object was not fetched again"
                time.sleep(0.5)


_PUBLISHER = r"""
import sys, time
from aot.exporter.task_export import export_task
repo, task, name, start = sys.argv[1:5]
while time.time() < float(start):
    time.sleep(0.001)
print(export_task(task, repo, name, "factored", progress=False).folder, flush=True)
"""


def test_two_publishers_racing_both_land(repo, artifacts):
    store = TaskStore.of(read_repository(repo))
    before = store.index().generation
    start = time.time() + 15.0  # both load their backbone first, then publish at the same moment
    procs = [subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(repo), str(artifacts[a]), name, str(start)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a, name in (("alpha", "racer-a"), ("beta", "racer-b"))]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    index = store.index()
    assert {"racer-a", "racer-b"} <= set(index.entries) and index.generation == before + 2


def test_a_publish_interrupted_halfway_leaves_the_old_version(repo, server, artifacts, expected, monkeypatch):
    """Objects uploaded, then the publisher dies before its change: readers never see the new version (the old one
    serves); the next publish lands, and the sweep that runs at compactions removes the orphaned objects once they
    are old enough (both thresholds lowered here)."""
    import aot.serving.store.log as store_log
    import aot.serving.store.writer as task_store
    from aot.exporter.task_export import TaskExporter
    from aot.serving.store.s3 import S3Backend

    exporter = TaskExporter(repo, progress=False)
    old = exporter.store.entries()["alpha"].folder

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed between the uploads and the change")

    written = exporter.write(artifacts["beta"], "alpha", "factored")
    monkeypatch.setattr(exporter.store.log, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        exporter.publish([written])
    bucket = S3Backend("s3://aot-tasks/fleet")
    orphans = [f for f in bucket.folders() if f.startswith("alpha@") and f != old]
    assert orphans, "the interrupted publish uploaded nothing"
    with Client(server.grpc_url) as client:
        time.sleep(3 * REMOTE_POLL_SECONDS)
        answer = client.infer("alpha", TEXTS[0])
        assert answer["version"] == old
        np.testing.assert_allclose(answer["logits"], expected["alpha"][0], atol=ATOL)
    monkeypatch.undo()
    monkeypatch.setattr(store_log, "COMPACT_EVERY", 1)
    monkeypatch.setattr(task_store, "FOREIGN_DEBRIS_AGE", 0.0)
    export_task(artifacts["alpha"], repo, "zeta", "factored", progress=False)
    left = set(bucket.folders())
    assert not left & set(orphans) and old in left
