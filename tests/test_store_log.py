"""The change-log index of a task store (aot.serving.store.log) over a folder (aot.serving.store.backend)."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest

from aot.serving.formats import FormatError
from aot.serving.store import log as store_log
from aot.serving.store.backend import BackendError, FileBackend
from aot.serving.store.layout import SHARDS
from aot.serving.store.log import Change, ChangeLog, index_key, log_key
from aot.serving.store.shards import DamagedShard, shard_key, shard_of


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
    """A reader stops before a log it cannot parse and names it; a writer refuses to append after it, naming the
    repair (what that log changed is unknown)."""
    log = ChangeLog(FileBackend(tmp_path))
    log.commit(_set("a", _entry(1)))
    log.commit(_set("b", _entry(2)))
    (tmp_path / log_key(2)).write_text("{not json")
    state = ChangeLog(FileBackend(tmp_path)).read_state()
    assert state.generation == 1 and set(state.tasks) == {"a"}
    assert state.damaged_log[0] == 2 and "log/0000000000000002.json: not JSON" in state.damaged_log[1]
    with pytest.raises(FormatError, match=r"damaged at generation 2 .*aot export repair"):
        ChangeLog(FileBackend(tmp_path)).commit(_set("c", _entry(3)))
    (tmp_path / log_key(2)).write_text('{"generation": 3, "tasks": {}}')
    state = ChangeLog(FileBackend(tmp_path)).read_state()
    assert state.damaged_log[0] == 2 and "holds generation 3, expected 2" in state.damaged_log[1]


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


def _grown(tmp_path, tasks: int) -> ChangeLog:
    """A store of `tasks` entries, compacted: its index names 256 shards at most."""
    log = ChangeLog(FileBackend(tmp_path))
    state, _ = log.commit(lambda state: Change(tasks={f"t{i}": _entry(i) for i in range(tasks)}))
    if state.index_generation != state.generation:
        log.compact(state)
    return log


@pytest.mark.parametrize("tasks", [10, 1000])
def test_a_writer_reads_the_index_and_the_shard_of_the_task_it_changes_only(tmp_path, tasks):
    _grown(tmp_path, tasks)
    backend = FileBackend(tmp_path)
    writer = ChangeLog(backend)
    state, _ = writer.commit(lambda state: Change(tasks={"t7": {**state.tasks["t7"], "storage": "fused"}}))
    head = len((tmp_path / index_key(1)).read_bytes())
    shard = len((tmp_path / shard_key(1, shard_of("t7"))).read_bytes())
    assert backend.bytes_read <= head + shard + 64  # and the generation hint: none of the other shards
    fresh = ChangeLog(FileBackend(tmp_path)).read_state()
    assert len(fresh.tasks) == tasks and fresh.tasks["t7"]["storage"] == "fused" and fresh.tasks["t8"] == _entry(8)


def test_a_compaction_writes_only_the_shards_changed_since_the_last(tmp_path):
    log = _grown(tmp_path, 1000)
    before = set(os.listdir(tmp_path / SHARDS))
    assert len(before) == len({shard_of(f"t{i}") for i in range(1000)}) > 200
    state, _ = log.commit(_set("t3", _entry(3000)))
    log.commit(lambda s: Change(tasks={"t4": None}))
    log.compact(ChangeLog(FileBackend(tmp_path)).read_state(every_shard=False))
    new = set(os.listdir(tmp_path / SHARDS)) - before
    assert new == {shard_key(3, shard_of(n)).split("/")[1] for n in ("t3", "t4")}
    fresh = ChangeLog(FileBackend(tmp_path)).read_state()
    assert fresh.generation == 3 and len(fresh.tasks) == 999 and fresh.tasks["t3"] == _entry(3000)
    assert "t4" not in fresh.tasks and fresh.tasks["t999"] == _entry(999)


def test_an_inline_index_of_format_3_is_read_and_sharded_at_the_next_compaction(tmp_path):
    (tmp_path / "index").mkdir()
    inline = {"generation": 1, "tasks": {f"t{i}": _entry(i) for i in range(20)}, "retired": {}, "tenants": {}}
    (tmp_path / index_key(1)).write_text(json.dumps(inline))
    log = ChangeLog(FileBackend(tmp_path))
    assert dict(log.read_state().tasks) == inline["tasks"]
    state, _ = log.commit(_set("t0", _entry(100)))
    log.compact(state)
    assert json.loads((tmp_path / index_key(2)).read_text())["shards"]
    assert dict(ChangeLog(FileBackend(tmp_path)).read_state().tasks) == {**inline["tasks"], "t0": _entry(100)}


def test_a_shard_compacted_away_under_a_reader_or_a_writer_means_reading_the_new_index(tmp_path, monkeypatch):
    """Every change touches task `a`, so each compaction writes its shard anew and the second one after an index
    deletes the shard that index named."""
    monkeypatch.setattr(store_log, "COMPACT_EVERY", 4)
    other, written = ChangeLog(FileBackend(tmp_path)), []

    def another_change():
        other.commit(_set("a", _entry(len(written))))
        written.append(len(written))

    for _ in range(4):
        another_change()

    class Racing(FileBackend):
        raced = False

        def read(self, key):
            if key.startswith(SHARDS) and not Racing.raced:
                Racing.raced = True
                for _ in range(8):  # two compactions: the second deletes the shard file this reader was about to read
                    another_change()
            return super().read(key)

    state = ChangeLog(Racing(tmp_path)).read_state()
    assert state.generation == 12 and state.tasks["a"] == _entry(11)
    Racing.raced = False
    writer = ChangeLog(Racing(tmp_path))
    calls = []

    def change(state):
        calls.append(state.generation)
        return Change(tasks={"a": {**state.tasks["a"], "storage": "fused"}})

    state, _ = writer.commit(change)
    assert calls == [12, 20] and state.generation == 21 and state.tasks["a"] == {**_entry(19), "storage": "fused"}


def test_a_shard_holding_another_shards_task_is_refused(tmp_path):
    _grown(tmp_path, 20)
    key = shard_key(1, shard_of("t0"))
    record = json.loads((tmp_path / key).read_text())
    stray = next(f"x{i}" for i in range(1000) if shard_of(f"x{i}") != shard_of("t0"))
    record["tasks"][stray] = _entry(99)
    (tmp_path / key).write_text(json.dumps(record))
    state = ChangeLog(FileBackend(tmp_path)).read_state()
    assert re.search(rf"holds 1 task\(s\) of other shards, e.g. '{stray}'", state.tasks.damaged[shard_of("t0")])
    with pytest.raises(DamagedShard):
        state.tasks["t0"]
    assert state.tasks.get("t0") is None  # a KeyError: a reader's lookup answers "not here", and asks why
    others = [f"t{i}" for i in range(20) if shard_of(f"t{i}") != shard_of("t0")]
    assert others and all(state.tasks[name] for name in others)  # the other shards serve


def test_a_compaction_that_finds_a_shard_compacted_away_leaves_the_change_appended(tmp_path, monkeypatch):
    """The writer's change touches a shard it never read; when its compaction reads it, another writer has compacted
    it away twice: the change stays appended, and the store reads whole."""
    monkeypatch.setattr(store_log, "COMPACT_EVERY", 4)
    other = ChangeLog(FileBackend(tmp_path))
    for i in range(4):
        other.commit(_set("a", _entry(i)))  # index 4 names the shard of a

    class Racing(FileBackend):
        raced = False

        def read(self, key):
            if key.startswith(SHARDS) and not Racing.raced:
                Racing.raced = True
                for i in range(4, 12):  # compactions at 8 and 12: the shard file of index 4 is deleted
                    other.commit(_set("a", _entry(i)))
            return super().read(key)

    writer = ChangeLog(Racing(tmp_path))
    writer.commit(_set("z", _entry(99)))  # generations 5-7, none reads a shard
    writer.commit(_set("z", _entry(98)))
    writer.commit(_set("z", _entry(97)))
    state, _ = writer.commit(lambda s: Change(tasks={"a": None}))  # generation 8: compacts, reads a's shard: races
    assert Racing.raced
    fresh = ChangeLog(FileBackend(tmp_path)).read_state()
    assert fresh.tasks["z"] == _entry(97) and state.generation == 8


# --- large change sets in parts (aot.serving.store.parts) ---------------------------------------------------------


def _many(count: int, tag: int = 0):
    return lambda state: Change(tasks={f"t{i}": {**_entry(i), "meta": {"tag": tag, "pad": "x" * 200}}
                                       for i in range(count)})


def test_a_large_change_is_written_in_bounded_parts_and_read_whole(tmp_path, monkeypatch):
    """No object of the log is larger than about MAX_CHANGE_BYTES, whatever one change holds; a reader sees all of
    the change or none of it, and a reader that defers it (a step's request path) applies it on its next refresh."""
    monkeypatch.setattr(store_log, "MAX_CHANGE_BYTES", 64 << 10)
    monkeypatch.setattr(store_log, "COMPACT_LOG_BYTES", 1 << 30)  # no compaction: the parts stay to be read
    log = ChangeLog(FileBackend(tmp_path))
    log.commit(_set("a", _entry(1)))
    reader = ChangeLog(FileBackend(tmp_path))
    state = reader.read_state()
    log.commit(_many(2000))
    record = json.loads((tmp_path / log_key(2)).read_text())
    parts = sorted((tmp_path / "parts").iterdir())
    assert record["parts"] == [f"parts/{p.name}" for p in parts] and len(parts) >= 6
    assert all(p.stat().st_size <= (64 << 10) + 4096 for p in parts)
    assert reader.follow(state, defer_parts=True) == set() and state.pending_parts == 2 and state.generation == 1
    assert reader.follow(state) == {f"t{i}" for i in range(2000)} and state.pending_parts is None
    assert state.generation == 2 and len(state.tasks) == 2001
    assert dict(ChangeLog(FileBackend(tmp_path)).read_state().tasks) == dict(state.tasks)


def test_a_missing_part_is_a_damaged_log(tmp_path, monkeypatch):
    monkeypatch.setattr(store_log, "MAX_CHANGE_BYTES", 64 << 10)
    monkeypatch.setattr(store_log, "COMPACT_LOG_BYTES", 1 << 30)
    log = ChangeLog(FileBackend(tmp_path))
    log.commit(_set("a", _entry(1)))
    log.commit(_many(2000))
    sorted((tmp_path / "parts").iterdir())[1].unlink()
    state = ChangeLog(FileBackend(tmp_path)).read_state()
    assert state.generation == 1 and set(state.tasks) == {"a"}  # none of the change: not a part of it
    assert state.damaged_log[0] == 2 and "is missing" in state.damaged_log[1]


def test_a_compaction_deletes_the_parts_of_the_logs_it_deletes(tmp_path, monkeypatch):
    monkeypatch.setattr(store_log, "MAX_CHANGE_BYTES", 64 << 10)
    log = ChangeLog(FileBackend(tmp_path))
    log.commit(_many(2000))  # compacted at once (the logs' bytes passed the bound): index 1
    first = set((tmp_path / "parts").iterdir())
    assert first
    log.commit(_many(2000, tag=1))  # index 2: the logs index 1 holds go, with their parts
    left = set((tmp_path / "parts").iterdir())
    assert left and not left & first
    state = ChangeLog(FileBackend(tmp_path)).read_state()
    assert state.generation == 2 and state.tasks["t5"]["meta"]["tag"] == 1


def test_a_writer_that_loses_the_race_deletes_its_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(store_log, "MAX_CHANGE_BYTES", 64 << 10)
    monkeypatch.setattr(store_log, "COMPACT_LOG_BYTES", 1 << 30)
    slow, fast = ChangeLog(FileBackend(tmp_path)), ChangeLog(FileBackend(tmp_path))
    first = [True]

    def change(state):
        if first[0]:  # the other writer takes this generation while this one prepares its change
            first[0] = False
            fast.commit(_set("a", _entry(1)))
        return _many(500)(state)

    state, _ = slow.commit(change)
    assert state.generation == 2
    named = json.loads((tmp_path / log_key(2)).read_text())["parts"]
    assert sorted(f"parts/{p.name}" for p in (tmp_path / "parts").iterdir()) == sorted(named)
