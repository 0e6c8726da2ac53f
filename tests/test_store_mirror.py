"""What a host keeps of a remote store's index (aot.serving.store.mirror) and a view that starts from it while the
store does not answer (aot.serving.store.view). The "remote" here is a folder store behind a switch that makes it
fail like an unreachable bucket; the real partition (SeaweedFS stopped) is in tests/test_s3_store.py."""

from __future__ import annotations

import pytest

import aot.serving.store.log as store_log
from aot.serving.store.backend import BackendError, FileBackend
from aot.serving.store.layout import INDEX, LOG, SHARDS
from aot.serving.store.log import ChangeLog
from aot.serving.store.mirror import MirroredBackend
from aot.serving.store.reader import StoreReader
from aot.serving.store.view import StoreView
from tests.test_store_view import make_store, publish


class Switchable(FileBackend):
    """A folder store that answers until `down` is set, then fails every call as an unreachable store does."""

    down = False

    def _check(self):
        if self.down:
            raise BackendError(f"{self!r}: cannot read: connection timed out")

    def read(self, key):
        self._check()
        return super().read(key)

    def read_if_changed(self, key, tag):
        self._check()
        return super().read_if_changed(key, tag)

    def list(self, prefix):
        self._check()
        return super().list(prefix)


def _reader(root, mirror_dir) -> tuple[StoreReader, Switchable]:
    """A StoreReader of the folder store `root` as a server reads a remote one: through a mirror on this host."""
    remote = Switchable(root)
    reader = StoreReader(root)
    reader.mirror = MirroredBackend(remote, mirror_dir)
    reader.backend = reader.mirror
    reader.log = ChangeLog(reader.mirror, on_read=reader.mirror.remember)
    return reader, remote


def test_the_copy_reads_back_as_the_store_and_holds_one_index(tmp_path, monkeypatch):
    """Every object a reader fetched is kept; an index only once the state it begins was read whole; a later whole
    read lets the older index, its logs and the shards only it named go."""
    monkeypatch.setattr(store_log, "COMPACT_EVERY", 4)
    store = make_store(tmp_path / "tasks")
    for name in "abcde":  # index 4, then one log after it
        publish(store, name)
    reader, _ = _reader(store.root, tmp_path / "mirror")
    state = reader.state()
    copy = reader.last_read_state()
    assert copy.generation == state.generation == 5 and dict(copy.tasks) == dict(state.tasks)
    publish(store, "f")
    reader.log.follow(state)  # a running reader follows: the new log is kept as it is read
    assert reader.last_read_state().generation == 6 and "f" in reader.last_read_state().tasks
    for name in "ghij":  # a compaction at 8, logs after it
        publish(store, name)
    reader.state()
    local = reader.mirror.local
    assert [k.rsplit("/", 1)[1] for k in local.list(INDEX)] == [f"{8:016d}.json"]
    logs = list(local.list(LOG))
    assert logs and all(store_log.generation_of(k) > 8 for k in logs), logs
    named = ChangeLog(local).shard_files(8)
    assert sorted(local.list(SHARDS)) == sorted(f"{SHARDS}/{g:016d}-{s}.json" for s, g in named.items())
    assert dict(reader.last_read_state().tasks) == dict(reader.state().tasks)


def test_a_new_view_starts_from_its_hosts_copy_and_follows_the_store_from_there(tmp_path):
    """A view started while the store does not answer serves the index its host read before (offline: a name it
    lacks is not known to be absent); once the store answers, the view follows the logs since that copy and is the
    store's again. A host with no copy has no index: everything is stale."""
    store = make_store(tmp_path / "tasks")
    publish(store, "a")
    publish(store, "b")
    reader, remote = _reader(store.root, tmp_path / "mirror")
    assert StoreView(reader).refresh() is None  # a first server on this host: reads the store, keeps a copy
    remote.down = True
    view = StoreView(_reader(store.root, tmp_path / "mirror")[0])
    view.reader.mirror.remote.down = True
    assert view.refresh() is None and view.offline and view.loaded
    assert set(view.index.entries) == {"a", "b"} and view.stale is not None
    assert view.refresh() == set() and view.error is not None and set(view.index.entries) == {"a", "b"}
    publish(store, "c")
    view.reader.mirror.remote.down = False
    view._retry_at = 0.0  # the retry window (tests/test_store_view.py times it) is not what this test is about
    assert view.refresh() is None and not view.offline and view.stale is None
    assert set(view.index.entries) == {"a", "b", "c"}
    alone = StoreView(_reader(store.root, tmp_path / "elsewhere")[0])
    alone.reader.mirror.remote.down = True
    assert alone.refresh() == set() and not alone.loaded and alone.stale is not None


def test_no_copy_for_a_folder_store(tmp_path):
    from aot.serving.store.reader import StoreError

    store = make_store(tmp_path / "tasks")
    with pytest.raises(StoreError, match="keeps no copy"):
        StoreReader(store.root).last_read_state()
