"""The change-log index of a task store (serving.store_log) over a folder (serving.store_backend)."""

from __future__ import annotations

import os
import threading

import pytest

from serving import store_log
from serving.formats import FormatError
from serving.store_backend import BackendError, FileBackend
from serving.store_log import Change, ChangeLog, index_key, log_key


def _entry(i: int) -> dict:
    return {"folder": f"t{i}@{i:012x}", "storage": "factored", "digests": {"task.json": "sha256:" + "0" * 64}}


def _set(name: str, entry: dict | None):
    return lambda state: Change(tasks={name: entry})


def test_a_reader_applies_one_changed_entry_of_a_thousand_without_reading_the_others(tmp_path):
    writer = ChangeLog(FileBackend(tmp_path))
    writer.commit(lambda state: Change(tasks={f"t{i}": _entry(i) for i in range(1000)}))
    reader_backend = FileBackend(tmp_path)
    reader = ChangeLog(reader_backend)
    state = reader.read_state()
    assert len(state.tasks) == 1000 and state.generation == 1
    start_bytes = reader_backend.bytes_read
    writer.commit(_set("t7", _entry(7000)))
    assert reader.changed()
    assert reader.follow(state) == {"t7"}
    read = reader_backend.bytes_read - start_bytes
    change_bytes = len((tmp_path / log_key(2)).read_bytes())
    assert read <= change_bytes + 32  # the change and the generation hint, nothing of the other 999
    assert state.tasks["t7"] == _entry(7000) and state.tasks["t8"] == _entry(8) and state.generation == 2
    assert reader.follow(state) == set()  # nothing new


def test_removal_and_retired_versions_apply_in_order(tmp_path):
    log = ChangeLog(FileBackend(tmp_path))
    log.commit(_set("a", _entry(1)))
    log.commit(lambda s: Change(tasks={"a": None}, retired={"a@000000000001": {"time": 1.0}}))
    state = ChangeLog(FileBackend(tmp_path)).read_state()
    assert state.tasks == {} and state.retired == {"a@000000000001": {"time": 1.0}} and state.generation == 2
    log.commit(lambda s: Change(retired={"a@000000000001": None}))
    assert ChangeLog(FileBackend(tmp_path)).read_state().retired == {}


def test_an_empty_change_appends_nothing(tmp_path):
    log = ChangeLog(FileBackend(tmp_path))
    state, change = log.commit(lambda s: Change())
    assert not change and state.generation == 0 and not (tmp_path / "log").exists()


def test_racing_writers_never_lose_a_change(tmp_path):
    """Eight writers append 20 changes each at once: every change lands, each in its own generation."""
    errors = []

    def writer(w: int) -> None:
        log = ChangeLog(FileBackend(tmp_path))
        try:
            for k in range(20):
                log.commit(_set(f"w{w}-{k}", _entry(w * 100 + k)), attempts=200)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    state = ChangeLog(FileBackend(tmp_path)).read_state()
    assert state.generation == 160 and len(state.tasks) == 160


def test_compaction_keeps_new_readers_short_and_old_readers_right(tmp_path, monkeypatch):
    monkeypatch.setattr(store_log, "COMPACT_EVERY", 4)
    log = ChangeLog(FileBackend(tmp_path))
    behind_backend = FileBackend(tmp_path)
    behind = ChangeLog(behind_backend)
    log.commit(_set("t0", _entry(0)))
    old = behind.read_state()  # generation 1
    for i in range(1, 11):
        log.commit(_set(f"t{i}", _entry(i)))
    # indexes at 4 and 8 (4 deleted once 8 exists? no: the previous index is kept), logs after the previous index
    assert sorted(os.listdir(tmp_path / "index")) == ["0000000000000004.json", "0000000000000008.json"]
    assert sorted(os.listdir(tmp_path / "log"))[0] == "0000000000000005.json"
    fresh_backend = FileBackend(tmp_path)
    fresh = ChangeLog(fresh_backend).read_state()
    assert fresh.generation == 11 and set(fresh.tasks) == {f"t{i}" for i in range(11)}
    assert fresh_backend.bytes_read < sum(p.stat().st_size for p in (tmp_path / "log").iterdir()) + 4096
    assert behind.follow(old) is None  # its next log (2) was deleted: it read the index again
    assert old.generation == 11 and old.tasks == fresh.tasks


def test_damaged_log_is_named(tmp_path):
    log = ChangeLog(FileBackend(tmp_path))
    log.commit(_set("a", _entry(1)))
    (tmp_path / log_key(1)).write_text("{not json")
    with pytest.raises(FormatError, match=r"log/0000000000000001.json: not JSON"):
        ChangeLog(FileBackend(tmp_path)).read_state()
    (tmp_path / log_key(1)).write_text('{"generation": 3, "tasks": {}}')
    with pytest.raises(FormatError, match="holds generation 3, expected 1"):
        ChangeLog(FileBackend(tmp_path)).read_state()


@pytest.mark.parametrize("plant", ["symlink", "fifo", "directory"])
def test_only_regular_files_are_read(tmp_path, plant):
    log = ChangeLog(FileBackend(tmp_path))
    log.commit(_set("a", _entry(1)))
    target = tmp_path / log_key(1)
    target.unlink()
    if plant == "symlink":
        target.symlink_to("/dev/zero")
    elif plant == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    with pytest.raises((BackendError, IsADirectoryError)):
        ChangeLog(FileBackend(tmp_path)).read_state()


def test_index_key_names():
    assert index_key(12) == "index/0000000000000012.json" and log_key(1) == "log/0000000000000001.json"
