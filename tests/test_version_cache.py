"""The local cache of versions fetched from a remote store (aot.serving.store.version_cache), over a folder backend."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from aot.serving.store import version_cache
from aot.serving.store.backend import FileBackend
from aot.serving.store.digests import DigestError, folder_digests
from aot.serving.store.version_cache import COMPLETE, VersionCache


def _remote(tmp_path, versions: dict[str, int]) -> tuple[FileBackend, dict[str, dict]]:
    """A 'remote' store folder with version folders of the given sizes; their digests."""
    remote = tmp_path / "remote"
    digests = {}
    for version, size in versions.items():
        folder = remote / version
        folder.mkdir(parents=True)
        (folder / "task.json").write_text(json.dumps({"v": version}))
        (folder / "table.npy").write_bytes(os.urandom(size))
        digests[version] = folder_digests(folder)
    return FileBackend(remote), digests


def test_fetched_once_verified_and_kept_across_restarts(tmp_path):
    backend, digests = _remote(tmp_path, {"a@000000000001": 1000})
    cache = VersionCache(backend, tmp_path / "cache", max_bytes=10_000)
    folder = cache.folder("a@000000000001", digests["a@000000000001"])
    assert (folder / "table.npy").read_bytes() == (tmp_path / "remote/a@000000000001/table.npy").read_bytes()
    read = backend.bytes_read
    again = VersionCache(backend, tmp_path / "cache", max_bytes=10_000)  # a restart
    assert again.folder("a@000000000001", digests["a@000000000001"]) == folder
    assert backend.bytes_read == read and again.downloads == 0


def test_a_damaged_object_is_refused_and_nothing_is_kept(tmp_path):
    backend, digests = _remote(tmp_path, {"a@000000000001": 1000})
    (tmp_path / "remote/a@000000000001/table.npy").write_bytes(b"x" * 1000)
    cache = VersionCache(backend, tmp_path / "cache", max_bytes=10_000)
    with pytest.raises(DigestError, match="table.npy as downloaded from .* is damaged"):
        cache.folder("a@000000000001", digests["a@000000000001"])
    assert cache.versions() == [] and not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp")]


def test_least_recently_used_versions_leave_first(tmp_path, monkeypatch):
    monkeypatch.setattr(version_cache, "KEEP_RECENT", 0.0)
    sizes = {f"t{i}@00000000000{i}": 4000 for i in range(1, 5)}
    backend, digests = _remote(tmp_path, sizes)
    cache = VersionCache(backend, tmp_path / "cache", max_bytes=9000)  # two versions and their task.json fit
    for i, version in enumerate(sizes):
        cache.folder(version, digests[version])
        os.utime(tmp_path / "cache" / version / COMPLETE, (time.time() - 100 + i, time.time() - 100 + i))
        if i == 1:  # t1 used again after t2: t2 is the least recently used now
            cache.touch("t1@000000000001", force=True)
    # t3's fetch evicted t2 (t1 was used after it); t4's evicted t3; t4's own time was then set back
    assert [v.version for v in cache.versions()] == ["t4@000000000004", "t1@000000000001"]
    assert sum(v.bytes for v in cache.versions()) <= 9000


def test_recently_used_versions_are_not_removed_under_a_reader(tmp_path):
    sizes = {f"t{i}@00000000000{i}": 4000 for i in range(1, 4)}
    backend, digests = _remote(tmp_path, sizes)
    cache = VersionCache(backend, tmp_path / "cache", max_bytes=5000)
    for version in sizes:
        cache.folder(version, digests[version])
    assert len(cache.versions()) == 3  # over the bound while all three are recent


def test_concurrent_first_requests_download_once(tmp_path):
    backend, digests = _remote(tmp_path, {"a@000000000001": 200_000})
    caches = [VersionCache(backend, tmp_path / "cache", max_bytes=10**7) for _ in range(6)]
    barrier = threading.Barrier(6)

    def fetch(cache):
        barrier.wait()
        cache.folder("a@000000000001", digests["a@000000000001"])

    threads = [threading.Thread(target=fetch, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(c.downloads for c in caches) == 1


def test_debris_of_a_dead_download_is_removed(tmp_path):
    backend, _ = _remote(tmp_path, {})
    debris = tmp_path / "cache" / ".tmp-999999-deadbeef"
    debris.mkdir(parents=True)
    VersionCache(backend, tmp_path / "cache", max_bytes=1000)
    assert not debris.exists()
