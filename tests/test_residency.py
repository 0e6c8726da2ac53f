"""Lazy, bounded residency of task versions (aot.serving.task_registry) and the change-log index behind it: a step reads
the index at start and nothing per task, loads a version on its first request, keeps the loaded ones under a byte
budget, and follows a publish by reading what changed. Answers are checked against `aot predict` (PyTorch) through
the served path: the tokenizer, the registry's rows, the ONNX AoT graph and the head."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest

from aot.exporter.task_export import TaskExporter, export_task
from aot.serving.columns import TaskColumn
from aot.serving.engine import BackboneRunner, EncoderBatch
from aot.serving.errors import RequestError
from aot.serving.heads import pooled_logits
from aot.serving.pool import RowPool
from aot.serving.repository import read_repository
from aot.serving.stages import find_rows
from aot.serving.store.host_cache import HostCache
from aot.serving.store.writer import TaskStore
from aot.serving.task_registry import TaskRegistry
from aot.serving.tokenization import Tokenization
from aot.training.predict import Predictor
from tests.helpers import make_repository, train_tiny_task

TEXTS = ["good w1 w2", "w3 awful w4 w5", "the movie was superb"]
NAMES = [f"t{i}" for i in range(5)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_models, sentiment_dir):
    root = tmp_path_factory.mktemp("residency-artifacts")
    return [train_tiny_task(tiny_models["bert"], sentiment_dir, root / m, m, seed=s)
            for s, m in enumerate(("fc", "kron"))]


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, artifacts):
    """Five tasks, factored (so each holds factors and a head in memory), alternating the two artifacts."""
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("residency") / "repo",
                           {name: (artifacts[i % 2], "factored") for i, name in enumerate(NAMES)})


@pytest.fixture(scope="module")
def expected(artifacts):
    return [Predictor.load(a).logits(TEXTS).numpy() for a in artifacts]


def _served_logits(registry: TaskRegistry, repo, name: str) -> np.ndarray:
    info = read_repository(repo)
    task = registry.resolve(name)
    tokens = Tokenization(info.tokenizer_dir, info.uses_token_type_ids)
    batch = EncoderBatch.joined([tokens.encode_batch(TEXTS, None, task.max_length)])
    find_rows(batch, TaskColumn([task], np.zeros(batch.size, np.int64)), info.vocab_size, registry.pool, registry)
    return pooled_logits(task, BackboneRunner(info.backbone_onnx).run(batch).pooled)


def test_start_reads_the_index_and_no_task(repo):
    registry = TaskRegistry(read_repository(repo).store_root)
    assert registry.view.index.parsed.parsed() == 0  # not even an entry is parsed before a request names it
    registry.resolve("t3")
    assert registry.view.index.parsed.parsed() == 1 and registry.loads == 1
    assert registry.names() == NAMES and registry.view.index.parsed.parsed() == len(NAMES)  # a listing parses all
    registry = TaskRegistry(read_repository(repo).store_root)
    assert registry.names() == NAMES and registry.loads == 0 and registry.resident_bytes == 0
    assert registry.entries()["t1"].listing()["method"] == "kron"  # what `aot tasks` lists, from the index


def test_eviction_under_a_host_budget_of_two_tasks(repo, expected, tmp_path):
    """Five tasks served in turn, twice, on a host cache that holds two: the host keeps at most its bytes, the
    process holds what the host lists (it lets go of an evicted copy at its next batch) and nothing of its own, and
    every answer is exact."""
    store_root = read_repository(repo).store_root
    size = TaskRegistry(store_root, host=HostCache(None, 0)).resolve("t0").copy.size
    host = HostCache(tmp_path / "host", 2 * size + size // 2)
    registry = TaskRegistry(store_root, host=host)
    for _ in range(2):
        for i, name in enumerate(NAMES):
            registry.refresh()  # a batch
            np.testing.assert_allclose(_served_logits(registry, repo, name), expected[i % 2], atol=1e-3)
            assert sum(e["size"] for e in host.entries()) <= host.max_bytes and registry.resident_bytes == 0
    registry.refresh()
    assert len(host.entries()) == 2 and len(registry.loaded()) == 2
    assert registry.loads > len(NAMES)  # evicted versions were loaded again


def test_eviction_of_copies_a_process_holds_alone(repo, expected):
    """Without a host cache it trusts, a process keeps its own copies under its budget, least recently used first:
    each request of a task not among the two most recent loads it again."""
    store_root = read_repository(repo).store_root
    one = TaskRegistry(store_root, host=HostCache(None, 0))
    one.resolve("t0")
    budget = 2 * max(one.resident_bytes, 1) + one.resident_bytes // 2
    registry = TaskRegistry(store_root, cache_bytes=budget, host=HostCache(None, 0))
    for round_ in range(2):
        for i, name in enumerate(NAMES):
            np.testing.assert_allclose(_served_logits(registry, repo, name), expected[i % 2], atol=1e-3)
            assert registry.resident_bytes <= budget
            assert len(registry.loaded()) <= 2
    assert registry.loads == 10  # every request of the second round found its task evicted
    for name in ("t3", "t4"):  # the two most recent stay: no load
        registry.resolve(name)
    assert registry.loads == 10


def test_a_version_loaded_again_finds_its_rows_still_pooled(repo, expected):
    """Dropped from the loaded set, a version's pooled rows stay: loaded again, it computes none of them again (the
    pool's misses do not grow) and answers exactly."""
    store_root = read_repository(repo).store_root
    one = TaskRegistry(store_root, host=HostCache(None, 0))
    task = one.resolve("t0")
    pool = RowPool(4 * task.vocab_size * task.num_layers * task.hidden_size * 2, task.num_layers, task.hidden_size,
                   task.vocab_size)
    registry = TaskRegistry(store_root, cache_bytes=one.resident_bytes + one.resident_bytes // 2, pool=pool,
                            host=HostCache(None, 0))
    first = _served_logits(registry, repo, "t0")
    version = registry.resolve("t0").version
    misses = pool.stats[version].misses
    _served_logits(registry, repo, "t1")  # the budget holds one version: t0 is dropped
    assert version not in registry.loaded() and pool.holds(version)
    np.testing.assert_allclose(_served_logits(registry, repo, "t0"), first, atol=1e-6)
    np.testing.assert_allclose(first, expected[0], atol=1e-3)
    assert registry.loads == 3 and pool.stats[version].misses == misses and pool.stats[version].hits > 0


def test_concurrent_first_requests_load_once(repo):
    registry = TaskRegistry(read_repository(repo).store_root)
    barrier = threading.Barrier(8)
    found = []

    def first_request():
        barrier.wait()
        found.append(registry.resolve("t2"))

    threads = [threading.Thread(target=first_request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert registry.loads == 1 and len({id(t) for t in found}) == 1


def test_a_publish_reaches_a_reader_as_one_small_change(tmp_path, tiny_models, artifacts, expected):
    """A reader following the index of 5 tasks reads only the change of a publish, applies it, and serves the new
    version; the replaced one still answers a request pinned to it."""
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {n: (artifacts[0], "factored") for n in NAMES})
    registry = TaskRegistry(read_repository(repo).store_root)
    old = registry.resolve("t3").version
    backend = registry.store.backend
    before = backend.bytes_read
    export_task(artifacts[1], repo, "t3", "factored", progress=False)
    registry.view.reader.log._probed = 0.0
    registry.refresh()
    read = backend.bytes_read - before
    change = (registry.store.root / "log" / f"{registry.view.index.generation:016d}.json").stat().st_size
    assert read <= change + 32, (read, change)
    np.testing.assert_allclose(_served_logits(registry, repo, "t3"), expected[1], atol=1e-3)
    assert registry.version(old).version == old  # pinned requests finish on the version they started with


def test_a_damaged_cold_task_fails_alone(tmp_path, tiny_models, artifacts):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"good": (artifacts[0], "factored"),
                                                                     "bad": (artifacts[1], "factored")})
    store = TaskStore(read_repository(repo).store_root)
    with open(store.root / store.entries()["bad"].folder / "factors.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\xff" * 8)
    registry = TaskRegistry(store.root)
    assert registry.errors() == {}  # nothing read at start
    with pytest.raises(RequestError, match=r"task 'bad' .* is corrupt: .*factors.safetensors is damaged"):
        registry.resolve("bad")
    assert "bad" in registry.errors()
    registry.resolve("good")


@pytest.mark.parametrize("plant", ["symlink to /dev/zero", "fifo"])
def test_only_regular_files_are_read(tmp_path, tiny_models, artifacts, plant):
    """A task file replaced by a link to /dev/zero or by a FIFO is refused at once, for its task alone (it used
    to spin the audit at 100 % CPU, or block open() for good)."""
    import os

    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"good": (artifacts[0], "factored"),
                                                                     "bad": (artifacts[1], "fused")})
    store = TaskStore(read_repository(repo).store_root)
    planted = store.root / store.entries()["bad"].folder / "head.safetensors"
    planted.unlink()
    if plant == "fifo":
        os.mkfifo(planted)
    else:
        planted.symlink_to("/dev/zero")
    registry = TaskRegistry(store.root)
    with pytest.raises(RequestError, match="head.safetensors: .*(symbolic link|not a regular file), refused"):
        registry.resolve("bad")
    registry.resolve("good")
    registry.audit.run(10 << 20)
    assert "refused" in registry.audit.damaged()["bad"] and "good" not in registry.audit.damaged()
    assert store.verify()["bad"] is not None


def test_a_restored_modification_time_does_not_hide_a_change(tmp_path, tiny_models, artifacts):
    """The audit compares inode, size, mtime and ctime: bytes changed with the mtime set back are still hashed again;
    and a request that reads them finds its block's digest differs: refused."""
    import os

    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"t": (artifacts[0], "fused")})
    store = TaskStore(read_repository(repo).store_root)
    registry = TaskRegistry(store.root, pool=None)
    task = registry.resolve("t")
    registry.audit.run(1 << 30)
    assert registry.audit.damaged() == {} and registry.audit.progress.verified == 1
    table = store.root / task.version / "table.npy"
    st = os.stat(table)
    with open(table, "r+b") as f:
        f.seek(st.st_size - 64)
        f.write(b"\x11" * 64)
    os.utime(table, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(table).st_mtime_ns == st.st_mtime_ns
    registry.audit.run(1 << 30)
    assert "table.npy is damaged" in registry.audit.damaged()["t"]
    last = np.array([task.vocab_size - 1], dtype=np.int64)  # the rows written: read by their block, hashed
    with pytest.raises(RequestError, match="table.npy is damaged"):
        task.rows(last)
    registry.refresh()  # the next batch: the version is refused
    with pytest.raises(RequestError, match="table.npy is damaged"):
        registry.resolve("t")


def test_the_audit_is_bounded_per_run(repo):
    registry = TaskRegistry(read_repository(repo).store_root)
    registry.audit.run(1)  # one file started is finished, then the budget is spent
    assert registry.audit.progress.verified == 1 and registry.audit.progress.passes == 0
    for _ in range(10):
        registry.audit.run(1 << 30)
    assert registry.audit.progress.verified == len(NAMES) and registry.audit.progress.passes >= 1


def test_batch_write_validates_each_task_with_one_backbone(tmp_path, tiny_models, artifacts):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {})
    exporter = TaskExporter(repo, progress=False)
    written = [exporter.write(artifacts[i % 2], f"b{i}", "factored") for i in range(3)]
    assert TaskStore(read_repository(repo).store_root).entries() == {}  # written, not published
    generation = TaskStore(read_repository(repo).store_root).index().generation
    exporter.publish(written)
    index = TaskStore(read_repository(repo).store_root).index()
    assert set(index.entries) == {"b0", "b1", "b2"} and index.generation == generation + 1  # one change


def test_arrays_are_read_only_views_of_one_copy(tmp_path, tiny_models, artifacts):
    """A version's head and factors are arrays over its sealed copy (no second copy in the process, and nothing can
    write them); the store's shared E (a factored FC task's) is a plain array over its file's memory map (np.memmap's
    indexing would run Python code on every lookup); a fused table's rows are the file's."""
    from aot.serving.tasks import load_task_version

    repo = make_repository(tiny_models["bert"], tmp_path / "repo",
                           {"fused": (artifacts[0], "fused"), "factored": (artifacts[0], "factored")})
    store = TaskStore(read_repository(repo).store_root)
    entries = store.entries()
    fused, factored = (load_task_version(store.root / entries[n].folder, entries[n].folder, store.root, "all",
                                         entries[n].digests) for n in ("fused", "factored"))
    ids = np.array([0, 5, 17], dtype=np.int64)
    arrays = [*factored.head.values(), *factored.compute_rows.feeds.values(), *fused.head.values()]
    assert len(arrays) >= 6
    for array in arrays:
        assert not array.flags.owndata and not array.flags.writeable
        base = array
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, memoryview) and base.readonly and isinstance(base.obj, mmap.mmap)
    embeddings = factored.compute_rows.embeddings
    assert type(embeddings) is np.ndarray and isinstance(embeddings.base, np.memmap)
    np.testing.assert_array_equal(embeddings[ids], np.load(factored.compute_rows.embeddings_path)[ids])
    np.testing.assert_array_equal(fused.rows(ids), np.load(store.root / fused.version / "table.npy")[ids])


def test_an_unknown_task_costs_the_same_whatever_the_number_of_tasks(tmp_path):
    """Issue 46: a 404 built its suggestions from every task (294 ms at 100,000). Now it reads the sorted names of
    the groups the caller may call (aot.serving.store.names) and parses only the entries it suggests: the same work at
    300 tasks as at 5,000, the count of the others still exact, and never a name of another tenant."""
    from aot.serving.store.log import Change
    from aot.serving.store.tenants import key_digest
    from aot.serving.task_registry import KNOWN_IN_MESSAGE
    from tests.test_store_view import make_store

    def entry(name: str, i: int) -> dict:
        return {"folder": f"{name}@{i:012x}", "storage": "factored", "digests": {"task.json": "sha256:" + "0" * 64}}

    costs = []
    for count in (300, 5000):
        store = make_store(tmp_path / str(count) / "tasks")
        tasks = {f"x{i:05d}": entry(f"x{i:05d}", i) for i in range(count)}
        tasks |= {f"acme/y{i}": entry(f"acme/y{i}", i) for i in range(3)}
        tenants = {"acme": {"key_sha256": key_digest("aotk_acme"), "time": 0.0}}
        store.log.commit(lambda state, tasks=tasks, tenants=tenants: Change(tasks=tasks, tenants=tenants))
        registry = TaskRegistry(store.root, parts="meta")
        before = registry.view.index.parsed.parsed()
        anonymous = str(registry.unknown("nosuch", None))
        costs.append(registry.view.index.parsed.parsed() - before)
        first = ", ".join(f"x{i:05d}" for i in range(KNOWN_IN_MESSAGE))
        assert anonymous == (f"unknown task 'nosuch'; known tasks: {first}, ... ({count - KNOWN_IN_MESSAGE} more: "
                             "aot tasks lists them)")
        tenant = str(registry.unknown("nosuch", "aotk_acme"))
        assert tenant.startswith("unknown task 'nosuch'; known tasks: acme/y0, acme/y1, acme/y2, x00000")
        assert tenant.endswith(f"({count + 3 - KNOWN_IN_MESSAGE} more: aot tasks lists them)")
        forbidden, missing = (str(_resolve_error(registry, n, "aotk_wrong")) for n in ("acme/y1", "acme/y9"))
        assert forbidden.replace("acme/y1", "N") == missing.replace("acme/y9", "N")  # a task that exists, or not
        suggested = str(registry.unknown("nosuch", "aotk_bahn")).split("known tasks: ", 1)[1]
        assert "acme/" not in suggested and f"({count - KNOWN_IN_MESSAGE} more" in suggested  # nor its count
    assert costs[0] == costs[1] <= KNOWN_IN_MESSAGE + 3, costs


def _resolve_error(registry: TaskRegistry, name: str, key: str | None) -> RequestError:
    with pytest.raises(RequestError) as refused:
        registry.resolve(name, key)
    return refused.value


def test_a_large_change_is_applied_off_the_request_path(tmp_path, monkeypatch):
    """Issue 46: a 100,000-entry change was one 43 MB log that a batch parsed (a 3.6 s stall). Now it is written in
    parts, and a step's refresh before a batch leaves it to a thread of its own: the batch serves the index as it
    was, and the thread applies the change whole. (The thread is held here, so the order is the test's, not the
    machine's.)"""
    import aot.serving.store.log as store_log
    import aot.serving.task_registry as task_registry
    from aot.serving.store.log import Change
    from tests.test_store_view import make_store, publish

    monkeypatch.setattr(store_log, "MAX_CHANGE_BYTES", 16 << 10)
    store = make_store(tmp_path / "tasks")
    publish(store, "a")
    registry = TaskRegistry(store.root, parts="meta")
    started = []

    class HeldThread:
        def __init__(self, target, name, daemon):
            self.target, self.name, self.ran = target, name, False
            started.append(self)

        def start(self):
            pass

        def run(self):
            self.target()
            self.ran = True

        def is_alive(self):
            return not self.ran

    entries = {f"x{i}": {"folder": f"x{i}@{i:012x}", "storage": "factored", "digests": {"task.json": "sha256:" +
                                                                                          "0" * 64}}
               for i in range(500)}
    store.log.commit(lambda state: Change(tasks=entries))
    assert len(list((store.root / "parts").iterdir())) > 3
    monkeypatch.setattr(task_registry.threading, "Thread", HeldThread)
    registry.refresh()  # what runs before a batch
    assert registry.view.pending and set(registry.view.index.entries) == {"a"}  # the batch: the old index, whole
    assert [t.name for t in started] == ["aot-store-apply"]
    registry.refresh()  # the next batch while the apply waits: it does not start another
    assert registry.view.pending and set(registry.view.index.entries) == {"a"} and len(started) == 1
    started[0].run()  # the thread's work
    assert not registry.view.pending and len(registry.view.index.entries) == 501
