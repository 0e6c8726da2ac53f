"""A task store in S3-compatible object storage, against a real SeaweedFS started here (aot.local.s3_server): export
into a bucket and serve from it, publish while serving, the store paused under load, a corrupted object, racing
publishers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from aot.client.client import Client, InferenceError
from aot.exporter.backbone_export import export_backbone
from aot.exporter.task_export import export_task
from aot.exporter.task_store import TaskStore
from aot.local.s3_server import LocalS3
from aot.serving.repository import read_repository
from aot.serving.task_registry import REMOTE_POLL_SECONDS
from aot.training.predict import Predictor
from tests.helpers import serve_for_tests, train_tiny_tasks

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


def test_the_store_paused_under_load(repo, server, artifacts, expected, s3):
    """While the object store does not answer: cached tasks keep serving (no failure), a task not cached fails
    with a 503 that names the store, and both serve again once it is back, by themselves."""
    export_task(artifacts["beta"], repo, "delta", "factored", progress=False)  # published, never requested
    failures, answered, stop = [], [0], threading.Event()

    def load():
        with Client(server.grpc_url) as client:
            while not stop.is_set():
                try:
                    np.testing.assert_allclose(client.infer("alpha", TEXTS[0])["logits"], expected["alpha"][0],
                                               atol=ATOL)
                    answered[0] += 1
                except (InferenceError, AssertionError) as exc:
                    failures.append(str(exc))

    with Client(server.grpc_url) as client:
        _check(client, expected)  # both cached
        _wait_known(client, "delta")  # known, never fetched
        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            s3.pause()
            try:
                time.sleep(1)
                with pytest.raises(InferenceError, match=r"task 'delta' .*cannot be fetched from the task store "
                                                         r"s3://aot-tasks/fleet"):
                    client.infer("delta", TEXTS[0])
                time.sleep(4)
            finally:
                s3.resume()
            deadline = time.monotonic() + 30
            while True:
                try:
                    np.testing.assert_allclose(client.infer("delta", TEXTS[0])["logits"], expected["beta"][0],
                                               atol=ATOL)
                    break
                except InferenceError:
                    assert time.monotonic() < deadline, "the cold task did not serve again once the store was back"
                    time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join()
    assert failures == [] and answered[0] > 0, failures[:3]


def test_a_corrupted_object_is_refused_then_retried(repo, server, artifacts, expected, s3):
    from aot.serving.store.s3 import S3Backend

    export_task(artifacts["alpha"], repo, "eps", "factored", progress=False)
    store = TaskStore.of(read_repository(repo))
    version = store.entries()["eps"].folder
    bucket = S3Backend("s3://aot-tasks/fleet")
    key = f"{version}/factors.safetensors"
    good = bucket.read(key)
    bucket.write(key, good[:-8] + b"\x00" * 8)
    with Client(server.grpc_url) as client:
        _wait_known(client, "eps")
        with pytest.raises(InferenceError, match=r"factors.safetensors as downloaded from s3://aot-tasks/fleet is "
                                                 r"damaged"):
            client.infer("eps", TEXTS[0])
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
    import aot.exporter.task_store as task_store
    import aot.serving.store.log as store_log
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
