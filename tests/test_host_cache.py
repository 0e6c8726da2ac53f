"""One version cache per host (aot.serving.store.host_cache): the step processes of a host share the sealed copies of
the task versions they load (aot.serving.store.sealed), bounded for the host, scan-resistant (W-TinyLFU,
aot.serving.store.admission), safe under concurrent loads, evictions and restarts; and the bytes a request reads are
bytes hashed after they were last written (a fused table read by verified blocks: aot.serving.store.table_blocks),
so that a table changed through a shared writable mapping (which moves no timestamp) never answers, and a restored
version serves again (aot.serving.store.rechecks)."""

from __future__ import annotations

import fcntl
import gc
import json
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from aot.serving.columns import TaskColumn
from aot.serving.engine import BackboneRunner, EncoderBatch
from aot.serving.errors import RequestError
from aot.serving.heads import pooled_logits
from aot.serving.repository import read_repository
from aot.serving.stages import find_rows
from aot.serving.store import rechecks
from aot.serving.store.admission import Lru, TinyLfu, make_policy, replay
from aot.serving.store.host_cache import ENTRY, HostCache
from aot.serving.store.reader import StoreError
from aot.serving.store.sealed import digest_of, seal_files
from aot.serving.store.writer import TaskStore
from aot.serving.task_registry import TaskRegistry
from aot.serving.tokenization import Tokenization
from aot.training.predict import Predictor
from tests.helpers import make_repository, train_tiny_task, wait_until

TEXTS = ["good w1 w2", "w3 awful w4 w5", "the movie was superb"]
BOUND = 1 << 30


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_models, sentiment_dir):
    return train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("host-cache") / "fc", "fc")


@pytest.fixture(scope="module")
def expected(artifact):
    return Predictor.load(artifact).logits(TEXTS).numpy()


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, artifact):
    names = {f"t{i}": (artifact, "factored") for i in range(4)} | {"f": (artifact, "fused")}
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("host-cache-repo") / "repo", names)


def _served(registry: TaskRegistry, repo, name: str, task=None) -> np.ndarray:
    """Logits as the served path computes them: the registry's rows (a task already resolved, if given)."""
    info = read_repository(repo)
    task = task or registry.resolve(name)
    tokens = Tokenization(info.tokenizer_dir, info.uses_token_type_ids)
    batch = EncoderBatch.joined([tokens.encode_batch(TEXTS, None, task.max_length)])
    find_rows(batch, TaskColumn([task], np.zeros(batch.size, np.int64)), info.vocab_size, registry.pool, registry)
    return pooled_logits(task, BackboneRunner(info.backbone_onnx).run(batch).pooled)


_HOLD = """
import json, sys
from pathlib import Path
from aot.serving.store.host_cache import HostCache
from aot.serving.task_registry import TaskRegistry
task = TaskRegistry(Path(sys.argv[1]), host=HostCache(Path(sys.argv[2]), 1 << 30)).resolve(sys.argv[3])
print(json.dumps({"ino": task.copy.ino, "shared": task.copy.shared}), flush=True)
sys.stdin.readline()
"""


def _holder(repo, folder, name: str) -> tuple[subprocess.Popen, dict]:
    """Another process that loads `name` through the host cache in `folder`, and holds it until told to end."""
    process = subprocess.Popen([sys.executable, "-c", _HOLD, str(read_repository(repo).store_root), str(folder), name],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    assert line, "the holding process printed nothing"
    return process, json.loads(line)


def test_two_processes_share_one_loaded_version(repo, expected, tmp_path, monkeypatch):
    """A version another process loaded is served here from its copy (the same memory: one inode): this process
    neither reads the store's files of it nor hashes them."""
    import aot.serving.store.host_cache as host_cache

    other, loaded = _holder(repo, tmp_path / "host", "t1")
    try:
        assert loaded["shared"]
        monkeypatch.setattr(host_cache, "seal_files", lambda *a: pytest.fail("the store's files were read"))
        host = HostCache(tmp_path / "host", BOUND)
        registry = TaskRegistry(read_repository(repo).store_root, host=host)
        task = registry.resolve("t1")
        assert task.copy.ino == loaded["ino"] and host.opened == 1 and host.listed == 0
        np.testing.assert_allclose(_served(registry, repo, "t1"), expected, atol=1e-3)
        assert [e["holders"] for e in host.entries()] == [2] and registry.resident_bytes == 0
    finally:
        other.communicate("\n", timeout=60)
    host.close()


def test_a_dead_holder_leaves_nothing_that_blocks(repo, expected, tmp_path):
    """A process killed while it held a copy: its entry is struck off by the next process that looks, which loads
    the version itself."""
    other, _ = _holder(repo, tmp_path / "host", "t2")
    other.kill()
    other.wait(timeout=60)
    host = HostCache(tmp_path / "host", BOUND)  # its start looks for entries no live process holds
    assert host.entries() == []
    registry = TaskRegistry(read_repository(repo).store_root, host=host)
    np.testing.assert_allclose(_served(registry, repo, "t2"), expected, atol=1e-3)
    assert host.listed == 1 and host.opened == 0 and [e["holders"] for e in host.entries()] == [1]
    host.close()


def test_a_version_evicted_while_a_request_reads_it_is_served_whole(repo, expected, tmp_path):
    """A request holds its version; the host evicts the version's copy and the process lets go of it (its next
    batch): the request still reads the whole copy, and answers exactly."""
    store_root = read_repository(repo).store_root
    size = TaskRegistry(store_root, host=HostCache(None, 0)).resolve("t0").copy.size
    host = HostCache(tmp_path / "host", size + size // 2)  # one version
    registry = TaskRegistry(store_root, host=host)
    reading = registry.resolve("t0")  # a request pinned to t0, reading it below
    registry.resolve("t1")
    registry.refresh()  # the next batch: t0's copy is let go
    assert reading.copy.evicted and reading.copy.fd is None and "t0" not in registry.loaded()
    assert [e["size"] for e in host.entries()] == [size]
    gc.collect()
    np.testing.assert_allclose(_served(registry, repo, "t0", task=reading), expected, atol=1e-3)
    host.close()


def _list_entry(host: HostCache, key_of_version: tuple[str, dict], fd: int, size: int) -> None:
    """An entry written into the host's index by hand, naming `fd` of this process as its holder."""
    from aot.serving.store.host_cache import start_time, version_key

    entry = np.zeros(1, ENTRY)[0]
    entry["key"] = np.frombuffer(version_key(*key_of_version), "<u8")
    entry["size"], entry["segment"], entry["ino"] = size, 2, os.fstat(fd).st_ino
    entry["holders"][0] = (os.getpid(), fd, start_time(os.getpid()))
    with host._locked():
        host._table[0] = entry


@pytest.mark.parametrize("flaw", ["unsealed", "another size", "another version"])
def test_a_half_written_or_foreign_entry_is_never_served(repo, expected, tmp_path, flaw):
    """An entry whose copy is still writable (listed before its writer sealed it, half-written), of another size, or
    holding another version is not taken: the process loads the version itself and answers exactly."""
    store_root = read_repository(repo).store_root
    entry = TaskStore(store_root).entries()["t3"]
    writer = HostCache(tmp_path / "host", BOUND)
    if flaw == "another version":
        other = TaskStore(store_root).entries()["t0"]
        copy = seal_files(entry.folder, {n: store_root / other.folder / n for n in other.digests}, None)
        fd, size = copy.fd, copy.size
    else:
        fd = os.memfd_create("aot:half", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 8192)
        os.pwrite(fd, json.dumps({"version": entry.folder, "files": {}}).encode() + b"\n", 0)
        size = 8192 if flaw == "unsealed" else 4096
        if flaw != "unsealed":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
    _list_entry(writer, (entry.folder, entry.digests), fd, size)
    reader = HostCache(tmp_path / "host", BOUND)
    registry = TaskRegistry(store_root, host=reader)
    np.testing.assert_allclose(_served(registry, repo, "t3"), expected, atol=1e-3)
    assert reader.opened == 0 and reader.listed == 1
    os.close(fd)
    reader.close()


def test_a_sealed_copy_cannot_be_written(repo):
    """Not by a write, a writable mapping or a truncation, through any descriptor: the kernel refuses each."""
    store_root = read_repository(repo).store_root
    entry = TaskStore(store_root).entries()["t0"]
    copy = seal_files(entry.folder, {n: store_root / entry.folder / n for n in entry.digests}, entry.digests)
    fd = os.open(f"/proc/self/fd/{copy.fd}", os.O_RDWR)
    try:
        for attempt in (lambda: os.pwrite(fd, b"x", 0), lambda: os.ftruncate(fd, 10),
                        lambda: mmap.mmap(fd, copy.size, flags=mmap.MAP_SHARED)):
            with pytest.raises(PermissionError):
                attempt()
    finally:
        os.close(fd)


@pytest.mark.parametrize("flaw", ["another owner", "open to others", "a link", "index a link"])
def test_a_cache_folder_not_this_users_alone_is_not_used(repo, expected, tmp_path, flaw):
    """The hostile cases of /dev/shm: a folder created by someone else, one others may write, a symbolic link, an
    index that is a link. None is used (`problem` says why); each process keeps its own checked copies."""
    folder = tmp_path / "host"
    if flaw == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
    else:
        folder.mkdir(mode=0o700)
    if flaw == "another owner":
        os.chown(folder, 65534, 65534)
    if flaw == "open to others":
        folder.chmod(0o777)
    if flaw == "index a link":
        (folder / "index-v1").symlink_to(tmp_path / "planted")
    host = HostCache(folder, BOUND)
    assert not host.shared and host.problem and "not trusted" in host.problem
    registry = TaskRegistry(read_repository(repo).store_root, host=host)
    np.testing.assert_allclose(_served(registry, repo, "t0"), expected, atol=1e-3)
    assert registry.resident_bytes > 0  # its own copy, counted against its own budget
    assert not (tmp_path / "planted").exists()


def test_a_cyclic_working_set_larger_than_the_cache_keeps_hits(tmp_path):
    """22 versions asked in turn, 30 times, on a host cache that holds 20: least recently used eviction would miss
    every request (each version leaves just before it is asked for again); the host's policy keeps most of them."""
    host = HostCache(tmp_path / "host", 0)
    blob = b"x" * 1000
    versions = [(f"v{i}@{i:012x}", {"blob": digest_of(blob + bytes([i]))}) for i in range(22)]
    size = seal_files("v@000000000000", {"blob": blob + b"\0"}, None).size
    host.max_bytes = host.policy.max_bytes = 20 * size
    requests = 0
    for _ in range(30):
        for i, (version, digests) in enumerate(versions):
            copy = host.get(version, digests, lambda i=i: {"blob": blob + bytes([i])})
            host.record(copy)
            host.refresh()
            requests += 1
    hit_rate = 1 - host.listed / requests
    assert hit_rate > 0.6 and sum(e["size"] for e in host.entries()) <= 20 * size
    names = [v for _ in range(30) for v, _ in versions]
    assert replay(make_policy("lru", 64, 20 * size), names, size)["hit_rate"] == 0.0
    assert replay(make_policy("tinylfu", 64, 20 * size), names, size)["hit_rate"] > 0.6
    assert isinstance(host.policy, TinyLfu) and not isinstance(host.policy, Lru)
    host.close()


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
def test_versions_of_mixed_sizes_stay_within_the_bound_each_evicted_once(policy):
    """Versions of 1-4 units under Zipf then a cycle: each eviction frees a slot once (a window spilling two
    candidates must not count one victim's bytes twice), and what the policy holds never passes its bound."""
    rng = np.random.default_rng(1)
    sizes = {f"v{i}": int(rng.integers(1, 5)) * 100 for i in range(1200)}
    trace = [f"v{int(k) % 1200}" for k in rng.zipf(1.3, size=6000)] + [f"v{i}" for _ in range(5) for i in range(441)]
    bound = 400 * 250
    chosen = make_policy(policy, 4 * 1200 + 16, bound)
    held_most, place = 0, chosen.place

    def checked_place(slot: int) -> list[int]:
        nonlocal held_most
        evicted = place(slot)
        assert len(evicted) == len(set(evicted)), evicted
        kept = (chosen.segment != 0) & ~np.isin(np.arange(len(chosen.segment)), evicted)
        held_most = max(held_most, int(chosen.size[kept].sum()))
        return evicted

    chosen.place = checked_place
    result = replay(chosen, trace, sizes)
    assert result["hits"] + result["misses"] == len(trace) and result["hits"] > 0
    assert bound - 400 < held_most <= bound, held_most  # full, never over


def _flip(table: mmap.mmap, at: int, length: int) -> None:
    table[at:at + length] = bytes(b ^ 0xFF for b in table[at:at + length])


def test_a_table_changed_through_a_dirty_shared_mapping_is_never_served(repo, expected, tmp_path, monkeypatch):
    """Issue 57's attack: a served table.npy mapped MAP_SHARED read-write, a row flipped and restored, then flipped
    again through the same mapping (its page stays dirty: no timestamp moves). No request answers from the flipped
    bytes: the first that reads them is refused, and the version with it; once the row is restored, a re-check in the
    background finds the table whole and it serves again."""
    monkeypatch.setattr(rechecks, "RECHECK_FIRST", 0.05)
    store_root = read_repository(repo).store_root
    registry = TaskRegistry(store_root, host=HostCache(tmp_path / "host", BOUND))
    np.testing.assert_allclose(_served(registry, repo, "f"), expected, atol=1e-3)
    task = registry.resolve("f")
    info = read_repository(repo)
    token = int(Tokenization(info.tokenizer_dir, info.uses_token_type_ids).encode(TEXTS[0], None, 16)
                ["input_ids"][1])
    table_path = store_root / task.version / "table.npy"
    with open(table_path, "r+b") as f:
        table = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)
    row = task.table.blocks.row_bytes
    at = task.table.blocks.data_offset + token * row
    _flip(table, at, row)
    _flip(table, at, row)  # restored
    registry.refresh()
    np.testing.assert_allclose(_served(registry, repo, "f"), expected, atol=1e-3)
    _flip(table, at, row)  # again, through the same mapping: its page still dirty, no timestamp moves
    answered = []
    for _ in range(3):
        registry.refresh()
        try:
            answered.append(_served(registry, repo, "f"))
        except (StoreError, RequestError) as exc:
            assert "table.npy is damaged" in str(exc)
    assert len(answered) < 3
    for logits in answered:  # none from the flipped bytes
        np.testing.assert_allclose(logits, expected, atol=1e-3)
    with pytest.raises(RequestError, match="table.npy is damaged"):
        registry.resolve("f")
    _flip(table, at, row)  # restored in place, through the mapping
    table.close()

    def serves() -> bool:
        registry.refresh()
        try:
            return bool(np.allclose(_served(registry, repo, "f"), expected, atol=1e-3))
        except RequestError:
            return False

    wait_until(serves, 60, "the restored table serving again")
    assert registry.held.rechecks.checks >= 1


def test_a_factor_file_changed_after_its_load_changes_nothing_served(repo, expected, tmp_path):
    """The served factors are a sealed copy checked at load: bytes flipped in the store's file afterwards, through a
    shared mapping, reach no answer."""
    store_root = read_repository(repo).store_root
    registry = TaskRegistry(store_root, host=HostCache(tmp_path / "host", BOUND))
    task = registry.resolve("t0")
    with open(store_root / task.version / "factors.safetensors", "r+b") as f:
        factors = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)
    _flip(factors, len(factors) - 4096, 4096)
    np.testing.assert_allclose(_served(registry, repo, "t0"), expected, atol=1e-3)
    _flip(factors, len(factors) - 4096, 4096)
    factors.close()


def test_a_version_restored_by_rename_serves_again_without_a_restart(tmp_path, tiny_models, artifact, expected,
                                                                    monkeypatch):
    """A factored version damaged before its first load is refused; its file restored from a backup (by rename),
    the re-check after its backoff finds it whole, and it serves."""
    monkeypatch.setattr(rechecks, "RECHECK_FIRST", 0.05)
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"t": (artifact, "factored")})
    store_root = read_repository(repo).store_root
    factors = store_root / TaskStore(store_root).entries()["t"].folder / "factors.safetensors"
    backup = factors.read_bytes()
    factors.write_bytes(backup[:-8] + bytes(b ^ 0xFF for b in backup[-8:]))
    registry = TaskRegistry(store_root, host=HostCache(tmp_path / "host", BOUND))
    with pytest.raises(RequestError, match="factors.safetensors is damaged"):
        registry.resolve("t")
    (factors.parent / "restored").write_bytes(backup)
    os.replace(factors.parent / "restored", factors)

    def serves() -> bool:
        try:
            return bool(np.allclose(_served(registry, repo, "t"), expected, atol=1e-3))
        except RequestError:
            return False

    wait_until(serves, 60, "the restored version serving again")


def test_refused_versions_are_checked_again_backed_off():
    """Not before they are due; each failed check doubles the wait (up to RECHECK_MAX); a check that passes forgets
    the refusal and says so."""
    results, passed = ["still damaged", "still damaged", None], []

    def check(version):
        if results.pop(0):
            raise StoreError("still damaged")

    checks = rechecks.Rechecks(check, passed.append)
    checks.refused("v")
    checks.asked("v")
    assert checks.checks == 0  # not due yet
    for failures in (1, 2):
        checks._refused["v"].due = 0.0
        checks.asked("v")
        wait_until(lambda: not checks._running and checks.checks == failures, 30, "a check")
        assert checks._refused["v"].delay == min(rechecks.RECHECK_FIRST * 2 ** failures, rechecks.RECHECK_MAX)
    checks._refused["v"].due = 0.0
    checks.asked("v")
    wait_until(lambda: passed == ["v"], 30, "the passing check")
    assert "v" not in checks._refused
