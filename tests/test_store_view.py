"""A reader's view of the task store (aot.serving.store.view.StoreView), the supervisor's check that the store can
be read at all (aot.serving.store.check.StoreCheck) and what a repair says it discarded (aot.serving.store.repair), on
stores the real writer (aot.serving.store.writer.TaskStore) builds from tiny hand-made version folders: no training,
no server.

Time is a fake clock put in place of the module's `time` (the change log's own clock stays real), so a retry window is
decided by the numbers the test sets, never by how fast the machine is."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from aot.serving.repository import MODELS_DIR, RECORD, BackboneRecord, ServingOptions
from aot.serving.store import check, view
from aot.serving.store.check import StoreCheck, store_check_of
from aot.serving.store.layout import STORE_FILE
from aot.serving.store.log import log_key
from aot.serving.store.reader import StoreReader
from aot.serving.store.view import StoreView
from aot.serving.store.writer import TaskStore


class Clock:
    """A fake time.monotonic."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now


def fake_clock(monkeypatch: pytest.MonkeyPatch, module) -> Clock:
    """Replace `module.time` with a fake clock: the other modules (the change log's hint recheck, pytest) keep theirs."""
    clock = Clock()
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=clock.monotonic))
    return clock


def make_store(root: Path) -> TaskStore:
    """An empty store for a fake backbone (the way tests/test_task_store_cost.py builds one)."""
    store = TaskStore(root)
    store.create({"fingerprint": "test"}, np.zeros((4, 2), np.float32))
    return store


def publish(store: TaskStore, name: str, dev: float = 0.5) -> str:
    """Publish a version of `name` with a task.json and one weights file; its version (`name@<id>`)."""
    folder = store.new_version_folder(name)
    (folder / "task.json").write_text(json.dumps({"labels": ["a", "b"], "metric": "accuracy", "dev": dev,
                                                  "method": {"method": "fc"}}))
    (folder / "factors.safetensors").write_bytes(b"factors of " + name.encode())
    return store.publish(name, folder, "factored").folder


@pytest.fixture
def store(tmp_path) -> TaskStore:
    store = make_store(tmp_path / "tasks")
    publish(store, "a")
    return store


# --- StoreView --------------------------------------------------------------------------------------------------------


def test_first_refresh_reads_the_whole_index(store):
    """None means "read whole": the first refresh; then an empty set while nothing changed."""
    view_ = StoreView(StoreReader(store.root))
    assert view_.index.generation == 0 and len(view_.index.entries) == 0
    assert view_.refresh() is None
    assert set(view_.index.entries) == {"a"} and view_.index.generation == 1 and view_.error is None
    assert view_.refresh() == set()
    assert view_.refresh() == set()
    assert view_.index.generation == 1


def test_a_publish_is_followed_by_the_names_it_changed(store):
    """A new task and a re-export of an old one: each refresh returns exactly the names changed since the last."""
    view_ = StoreView(StoreReader(store.root))
    assert view_.refresh() is None
    first_a = view_.index.entries["a"].folder
    assert view_.refresh() == set()
    b = publish(store, "b")
    assert view_.refresh() == {"b"}
    assert view_.index.entries["b"].folder == b and view_.index.generation == 2
    assert view_.refresh() == set()
    second_a = publish(store, "a", dev=0.9)
    c = publish(store, "c")
    assert view_.refresh() == {"a", "c"}
    entry = view_.index.entries["a"]
    assert entry.folder == second_a != first_a and entry.meta["dev"] == 0.9
    assert [k.version for k in entry.kept] == [first_a]  # the old current version is kept for pins
    assert view_.index.entries["c"].folder == c and view_.index.generation == 4
    assert view_.refresh() == set()


def test_a_removed_task_leaves_the_view(store):
    view_ = StoreView(StoreReader(store.root))
    publish(store, "b")
    assert view_.refresh() is None and set(view_.index.entries) == {"a", "b"}
    store.remove("b")
    assert view_.refresh() == {"b"}
    assert set(view_.index.entries) == {"a"}
    assert any(v.startswith("b@") for v in view_.index.retired)  # servable a while to requests pinned to it


def _break(path: Path, how: str) -> bytes:
    """Make the log object at `path` unreadable (`how`); its good bytes, to put back."""
    good = path.read_bytes()
    path.unlink()
    if how == "not json":
        path.write_text("{not json")
    else:  # a symbolic link: the backend refuses it unread
        path.symlink_to("/dev/zero")
    return good


def _mend(path: Path, good: bytes) -> None:
    path.unlink()
    path.write_bytes(good)


def test_an_unreadable_log_keeps_the_last_good_index_until_a_retry_reads_it(store, monkeypatch):
    """The log of a publish cannot be read: `error` names it, the last good index stays (no half-applied change), and
    nothing is read again before INDEX_RETRY_SECONDS; the first refresh after them reads the whole index."""
    clock = fake_clock(monkeypatch, view)
    reader = StoreReader(store.root)
    view_ = StoreView(reader)
    assert view_.refresh() is None and view_.refresh() == set()
    publish(store, "b")
    broken = store.root / log_key(2)
    good = _break(broken, "symlink")

    assert view_.refresh() == set()
    assert view_.error is not None and log_key(2) in view_.error
    assert set(view_.index.entries) == {"a"} and view_.index.generation == 1  # the last good index
    assert view_.index.entries["a"].storage == "factored"

    _mend(broken, good)
    read_before = reader.backend.bytes_read
    clock.now += view_.INDEX_RETRY_SECONDS - 0.01
    assert view_.refresh() == set()  # inside the retry window: nothing read, the error still reported
    assert reader.backend.bytes_read == read_before and view_.error is not None
    assert set(view_.index.entries) == {"a"}

    clock.now += 0.02
    assert view_.refresh() is None  # read whole
    assert view_.error is None and set(view_.index.entries) == {"a", "b"} and view_.index.generation == 2
    assert reader.backend.bytes_read > read_before
    publish(store, "c")
    assert view_.refresh() == {"c"}  # following the log again


def test_a_log_that_does_not_parse_stops_the_view_before_it(store, monkeypatch):
    """A log that reads but does not parse: what it changed is unknown, so the view stops at the generation before
    it, says so (`stale`: a name it lacks may exist), and reads that log again at most every INDEX_RETRY_SECONDS;
    mended, it is applied and the view follows on."""
    clock = fake_clock(monkeypatch, view)
    reader = StoreReader(store.root)
    view_ = StoreView(reader)
    assert view_.refresh() is None
    publish(store, "b")
    publish(store, "c")
    broken = store.root / log_key(2)
    good = _break(broken, "not json")
    assert view_.refresh() == set() and view_.error is None
    assert view_.index.generation == 1 and view_.index.damaged_log[0] == 2 and set(view_.index.entries) == {"a"}
    assert view_.stale is not None and "cannot be parsed at generation 2" in view_.stale
    read_before = reader.backend.bytes_read
    assert view_.refresh() == set() and reader.backend.bytes_read == read_before  # inside the window: not read
    _mend(broken, good)
    clock.now += view_.INDEX_RETRY_SECONDS + 0.01
    assert view_.refresh() == {"b", "c"} and view_.stale is None and view_.index.damaged_log is None
    assert set(view_.index.entries) == {"a", "b", "c"}


def test_a_failed_retry_waits_another_interval(store, monkeypatch):
    """A whole read that fails too (the broken log is still there) reports it and starts a new retry window."""
    clock = fake_clock(monkeypatch, view)
    view_ = StoreView(StoreReader(store.root))
    assert view_.refresh() is None
    publish(store, "b")
    broken = store.root / log_key(2)
    good = _break(broken, "symlink")
    assert view_.refresh() == set() and view_.error is not None
    clock.now += view_.INDEX_RETRY_SECONDS + 0.01
    assert view_.refresh() == set()  # the whole read fails: StoreError from the reader
    assert view_.error is not None and "the index cannot be read" in view_.error and log_key(2) in view_.error
    _mend(broken, good)
    clock.now += view_.INDEX_RETRY_SECONDS / 2
    assert view_.refresh() == set() and view_.error is not None  # the new window is not over
    clock.now += view_.INDEX_RETRY_SECONDS
    assert view_.refresh() is None and view_.error is None and set(view_.index.entries) == {"a", "b"}


def test_a_view_of_no_store_reports_and_recovers(tmp_path, monkeypatch):
    """A view started before the store exists: an error, an empty index; once the store is there, a whole read."""
    clock = fake_clock(monkeypatch, view)
    view_ = StoreView(StoreReader(tmp_path / "tasks"))
    assert view_.refresh() == set()
    assert view_.error is not None and "store.json missing" in view_.error and len(view_.index.entries) == 0
    store = make_store(tmp_path / "tasks")
    publish(store, "a")
    clock.now += view_.INDEX_RETRY_SECONDS + 0.01
    assert view_.refresh() is None and view_.error is None and set(view_.index.entries) == {"a"}


# --- StoreCheck -------------------------------------------------------------------------------------------------------


def _check(root: Path) -> tuple[StoreCheck, list[str]]:
    logs: list[str] = []
    return StoreCheck(root, logs.append), logs


def test_a_store_without_store_json_is_a_problem_without_a_server_path(tmp_path, monkeypatch):
    """/ready's reason names what is wrong, relative to the repository: a client reads it."""
    fake_clock(monkeypatch, check)
    root = tmp_path / "repo" / "tasks"
    root.mkdir(parents=True)
    checker, logs = _check(root)
    assert checker.problem is None  # nothing read before the first refresh
    checker.refresh()
    problem = checker.problem
    assert problem is not None and problem.startswith("the task store cannot be read (tasks: no task store here")
    assert STORE_FILE in problem and problem.endswith("no task can be served")
    assert str(tmp_path) not in problem
    assert len(logs) == 1 and "/ready says 503" in logs[0] and problem in logs[0]
    checker.refresh()  # the same problem is not logged again (and, on the fake clock, not even read again)
    assert len(logs) == 1


def test_a_store_that_appears_is_served_after_the_retry_interval(tmp_path, monkeypatch):
    """Read again only after STORE_CHECK_RETRY_SECONDS; once read whole, never again (only its logs are watched): the
    steps keep the last good index whatever happens to the files later."""
    clock = fake_clock(monkeypatch, check)
    root = tmp_path / "repo" / "tasks"
    checker, logs = _check(root)
    checker.refresh()
    assert checker.problem is not None
    make_store(root)
    clock.now += check.STORE_CHECK_RETRY_SECONDS - 0.01
    checker.refresh()
    assert checker.problem is not None  # inside the interval: not read
    clock.now += 0.02
    checker.refresh()
    assert checker.problem is None
    assert logs[-1] == "supervisor: the task store can be read: its tasks serve" and len(logs) == 2
    (root / STORE_FILE).unlink()
    clock.now += 10 * check.STORE_CHECK_RETRY_SECONDS
    checker.refresh()
    assert checker.problem is None and len(logs) == 2


def test_a_store_with_an_unreadable_log_is_a_problem(tmp_path, monkeypatch):
    """A fresh server knows nothing of what changed from a log it cannot parse on: unready, the repair named."""
    fake_clock(monkeypatch, check)
    store = make_store(tmp_path / "repo" / "tasks")
    publish(store, "a")
    (store.root / log_key(1)).write_text("{not json")
    checker, _ = _check(store.root)
    checker.refresh()
    assert checker.problem is not None and "the change log cannot be parsed at generation 1" in checker.problem
    assert log_key(1) in checker.problem and str(tmp_path) not in checker.problem
    assert checker.problem.endswith("run `aot export repair`") and checker.warning is None


def test_a_store_with_a_damaged_shard_is_a_warning(tmp_path, monkeypatch):
    """A shard that does not parse fails only the tasks in it: the server is ready, and /ready says what is wrong."""
    import aot.serving.store.log as store_log
    from aot.serving.store.shards import shard_key, shard_of

    fake_clock(monkeypatch, check)
    monkeypatch.setattr(store_log, "COMPACT_EVERY", 2)
    store = make_store(tmp_path / "repo" / "tasks")
    publish(store, "a")
    publish(store, "b")  # compacted: index 2 and its shards
    shard = store.root / shard_key(2, shard_of("a"))
    shard.write_bytes(shard.read_bytes()[:20])
    checker, _ = _check(store.root)
    checker.refresh()
    assert checker.problem is None and checker.warning is not None
    assert f"shard {shard_of('a')} of the index cannot be parsed" in checker.warning
    assert str(tmp_path) not in checker.warning and checker.warning.endswith("run `aot export repair`")


def test_a_log_damaged_under_a_running_server_is_a_warning_until_repaired(tmp_path, monkeypatch):
    """Issue 57.6: a log cut short after the server read the index: /ready stays 200 (the steps serve what they
    applied) and warns from the next check on, naming the generation and the repair, no server path; a repair clears
    the warning."""
    from aot.serving.store.repair import repair_store

    clock = fake_clock(monkeypatch, check)
    store = make_store(tmp_path / "repo" / "tasks")
    publish(store, "a")
    publish(store, "a")
    checker, logs = _check(store.root)
    checker.refresh()
    assert checker.problem is None and checker.warning is None
    damaged = store.root / log_key(2)
    damaged.write_bytes(damaged.read_bytes()[:-20])
    clock.now += check.STORE_CHECK_RETRY_SECONDS
    checker.refresh()
    assert checker.problem is None and checker.warning is not None
    assert checker.warning.startswith("the change log cannot be parsed at generation 2") and str(tmp_path) not in \
        checker.warning and checker.warning.endswith("run `aot export repair`")
    assert logs[-1] == f"supervisor: warning: {checker.warning}"
    repair_store(store, lambda *version: None)
    clock.now += check.STORE_CHECK_RETRY_SECONDS
    checker.refresh()
    assert checker.problem is None and checker.warning is None


def test_a_repair_says_in_words_what_a_damaged_log_lost(tmp_path):
    """Issue 57.6: `aot export repair` named a damaged log by its generation alone. It now says what the log
    changed, as far as its bytes read: a route cut after its entry, a publish cut inside its entry, a log
    overwritten whole; each with when it was written."""
    from aot.serving.store.repair import repair_store
    from aot.serving.store.version_admin import route

    store = make_store(tmp_path / "tasks")
    first, second = publish(store, "t0"), publish(store, "t0")
    route(store, "t0", {first: 90, second: 10})  # generation 3
    third = publish(store, "t1")  # generation 4
    for generation, cut in ((3, len(',"retired":{}}')), (4, 120)):
        path = store.root / log_key(generation)
        path.write_bytes(path.read_bytes()[:-cut])
    (store.root / log_key(5)).write_bytes(b"\x00" * 40)  # a log overwritten whole (no writer appended it)
    store.log.backend.write("generation", b"5\n")
    found = repair_store(store, lambda *version: None, dry_run=True)
    lost = {int(words.split()[1]): words for words in found.discarded if words.startswith("log ")}
    assert sorted(lost) == [3, 4, 5], found.discarded
    assert f"lost the route of t0 ({first} 90 %, {second} 10 %)" in lost[3] and "written 20" in lost[3], lost[3]
    assert "lost a change of task t1" in lost[4] and "cut short" in lost[4], lost[4]
    assert lost[5] == "log 5 (its time unreadable) does not parse (truncated or not JSON) and was discarded: what it " \
        "changed cannot be read, and is lost"
    assert any(words.startswith(f"t1: given an entry for its newest folder, {third}") for words in found.discarded)
    assert found.damaged_logs == [3, 4, 5] and found.generation == 0  # a dry run: nothing written, nothing deleted
    assert all((store.root / log_key(g)).exists() for g in (3, 4, 5))


def _repository(path: Path, store_url: str | None = None) -> Path:
    """A folder with the record `aot export backbone` writes and an empty models/ folder: what store_check_of reads."""
    record = BackboneRecord(backbone={"model": "tiny", "fingerprint": "tiny"}, uses_token_type_ids=False,
                            num_layers=2, hidden_size=8, vocab_size=10, type_vocab_size=0, max_positions=64,
                            store="tasks", tokenizer="models/tokenizer/1/tokenizer", serving=ServingOptions(),
                            task_store_url=store_url)
    (path / MODELS_DIR).mkdir(parents=True)
    (path / RECORD).write_text(json.dumps(record.to_json()))
    return path / MODELS_DIR


def test_store_check_of_a_repository_checks_its_store(tmp_path):
    build: Callable | None = store_check_of(_repository(tmp_path / "repo"))
    assert build is not None
    logs: list[str] = []
    built = build(logs.append)
    assert isinstance(built, StoreCheck) and built.reader.root == tmp_path / "repo" / "tasks"
    built.refresh()
    assert built.problem is not None and logs  # no store exported there yet


def test_store_check_of_nothing_to_check(tmp_path):
    """Not an AoT repository (no record, or an unreadable one): None. A store in object storage is checked too (from
    a thread of its own: tests/test_s3_store.py)."""
    plain = tmp_path / "plain" / "models"
    plain.mkdir(parents=True)
    assert store_check_of(plain) is None
    assert store_check_of(tmp_path / "missing" / "models") is None
    broken = tmp_path / "broken"
    (broken / MODELS_DIR).mkdir(parents=True)
    (broken / RECORD).write_text("{not json")
    assert store_check_of(broken / MODELS_DIR) is None
    remote = store_check_of(_repository(tmp_path / "remote", "s3://bucket/tasks"))
    assert remote is not None and remote.keywords["url"] == "s3://bucket/tasks"


def test_task_names_stay_sorted_by_tenant_after_few_and_many_changes():
    """The index's names by tenant (aot.serving.store.names): a bisect per name for a few changes, a merge for
    many; each group sorted either way, an unchanged group shared, a removed name gone."""
    from aot.serving.store.names import MANY_CHANGES, TaskNames

    names = TaskNames.of(["b", "acme/y", "a", "acme/x"])
    assert list(names.visible("acme", True)[0]) == ["a", "acme/x", "acme/y", "b"]
    few = names.changed(["c", "a", "acme/z"], lambda n: n != "a")
    assert list(few.visible(None, True)[0]) == ["b", "c"] and list(few.visible("acme", False)[0]) == \
        ["acme/x", "acme/y", "acme/z"]
    many = [f"m{i:05d}" for i in range(MANY_CHANGES * 2, 0, -1)]
    after = few.changed([*many, "b"], lambda n: n != "b")
    assert list(after.visible(None, True)[0]) == ["c", *sorted(many)]
    assert after._groups["acme"] is few._groups["acme"]  # untouched: shared, not copied
    first, total = after.first("acme", True, 3, lambda n: n != "acme/x", scan=256)
    assert first == ["acme/y", "acme/z", "c"] and total == 3 + 1 + len(many)
