"""Versions a task keeps, through the real server: a kept version serves by pin past the old grace, `aot export
versions` lists them, a rollback makes the bare name answer a kept version, and a 90/10 route splits 1,000 requests
within 5 points; a store of format v2 is still read."""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import pytest

from aot.client.client import Client, TaskNotFound
from aot.exporter.task_export import TaskExporter, export_task
from aot.serving.repository import read_repository
from aot.serving.store.log import Change
from aot.serving.store.reader import RETIRED_GRACE, STORE_VERSION, StoreError
from aot.serving.store.writer import TaskStore
from tests.helpers import make_repository, run_cli, serve_for_tests, train_tiny_task

pytestmark = pytest.mark.server

TEXT = "good w1 w2"


def _cli(*argv: str) -> list[dict]:
    return run_cli(*argv)[0]


def _cli_error(*argv: str) -> str:
    """`aot ...`, which must fail (exit 2): its one-line error."""
    return run_cli(*argv, exit_code=2)[1]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_models, sentiment_dir):
    return train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("versions-artifact") / "fc")


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, artifact):
    """Task `sent` published three times (versions v1, v2, v3: kept, default --keep 5); `short` twice with
    --keep 1 (its first version retired)."""
    repo = make_repository(tiny_models["bert"], tmp_path_factory.mktemp("versions") / "repo", {})
    for _ in range(3):
        export_task(artifact, repo, "sent", "factored", progress=False)
    for _ in range(2):
        export_task(artifact, repo, "short", "factored", progress=False, keep=1)
    return repo


@pytest.fixture(scope="module")
def versions(repo) -> list[str]:
    """sent's versions, oldest first."""
    return [v["version"] for v in reversed(_cli("export", "versions", "sent", "--repo", str(repo)))]


@pytest.fixture(scope="module")
def server(request, repo, versions):
    yield from serve_for_tests(request, repo, load=("aot", "task_list"))


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_url) as c:
        yield c


def _store(repo) -> TaskStore:
    return TaskStore.of(read_repository(repo))


def _until(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.1)


def test_versions_lists_current_and_kept(repo, versions):
    listed = _cli("export", "versions", "sent", "--repo", str(repo))
    assert [v["status"] for v in listed] == ["current", "kept", "kept"] and len(set(versions)) == 3
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", v["since"]) for v in listed), listed  # UTC
    assert listed[0]["version"] == versions[-1] and listed[0]["since"] >= listed[1]["since"] >= listed[2]["since"]
    short = _cli("export", "versions", "short", "--repo", str(repo))
    assert [v["status"] for v in short] == ["current", "retired"]
    assert 0 < short[1]["expires_in_seconds"] <= RETIRED_GRACE


def test_keep_retires_what_falls_beyond_it(repo, artifact, tmp_path):
    store = _store(repo)
    assert store.entries()["short"].keep == 1 and store.entries()["short"].kept == ()
    assert store.entries()["sent"].keep == 5 and len(store.entries()["sent"].kept) == 2


def test_a_kept_pin_outlives_the_old_grace(repo, versions, client):
    """Backdate every kept and retired time by twice the grace: the kept v1 still serves by pin, the retired
    version of `short` (--keep 1) is gone."""
    retired = _cli("export", "versions", "short", "--repo", str(repo))[1]["version"]
    past = time.time() - 2 * RETIRED_GRACE

    def backdate(state):
        entry = dict(state.tasks["sent"])
        entry["kept"] = [{**k, "time": past} for k in entry["kept"]]
        return Change(tasks={"sent": entry}, retired={retired: {**state.retired[retired], "time": past}})

    _store(repo).commit(backdate)
    assert client.infer(versions[0], TEXT)["version"] == versions[0]
    with pytest.raises(TaskNotFound, match="is not in the store"):
        client.infer(retired, TEXT)


def test_rollback_answers_the_kept_version_from_the_next_batch(repo, versions, client):
    [done] = _cli("export", "rollback", "sent", versions[1], "--repo", str(repo))
    assert done == {"name": "sent", "current": versions[1], "replaced": versions[2]}
    assert client.infer("sent", TEXT)["version"] == versions[1]
    assert client.infer(versions[2], TEXT)["version"] == versions[2]  # the replaced version is kept
    assert _cli_error("export", "rollback", "sent", versions[1], "--repo", str(repo)) == \
        f"aot: error: {versions[1]} is already the current version of 'sent'"
    assert "sent@000000000000 is not a version 'sent' keeps" in \
        _cli_error("export", "rollback", "sent", "sent@000000000000", "--repo", str(repo))


def test_a_90_10_route_splits_1000_requests(repo, versions, client):
    current = _store(repo).entries()["sent"].folder
    canary = next(v for v in versions if v != current)
    [routed] = _cli("export", "route", "sent", f"{current}=90", f"{canary}=10", "--repo", str(repo))
    assert routed["route"] == {current: 0.9, canary: 0.1}
    answers = client.infer_many([{"task": "sent", "text": TEXT}] * 1000, concurrency=32)
    counts = Counter(a["version"] for a in answers)
    assert set(counts) == {current, canary}
    assert abs(counts[canary] / 1000 - 0.10) <= 0.05, counts
    print(f"\n90/10 route over 1,000 requests: current {counts[current]}, canary {counts[canary]}")
    listed = {v["version"]: v["route_share"] for v in _cli("export", "versions", "sent", "--repo", str(repo))}
    assert listed[current] == 0.9 and listed[canary] == 0.1
    [cleared] = _cli("export", "route", "sent", f"{current}=1", "--repo", str(repo))
    assert cleared["route"] is None
    assert {a["version"] for a in client.infer_many([{"task": "sent", "text": TEXT}] * 50)} == {current}


def test_route_refuses_what_the_task_does_not_keep(repo, versions):
    for pairs, message in (([f"{versions[0]}=0"], "finite positive number"), (["sent@000000000000=1"], "not a version"),
                           ([f"{versions[0]}"], "expected VERSION=WEIGHT"), (["other@000000000000=1"], "not of 'sent'"),
                           ([f"{versions[0]}=nan"], "finite positive number"),
                           ([f"{versions[0]}=inf"], "finite positive number"),
                           ([f"{versions[0]}=1e308", f"{versions[1]}=1e308"], "route weights add up to inf"),
                           ([f"{versions[0]}=999999", f"{versions[1]}=2"], "add up to 1e+06: expected a total of at most")):
        assert message in _cli_error("export", "route", "sent", *pairs, "--repo", str(repo))
    route = _store(repo).entries()["sent"].route
    assert route is None or sum(route.values()) == pytest.approx(1.0)  # nothing refused was written


def test_a_stored_route_of_huge_weights_still_serves(repo, versions, client):
    """A route written before the writer checked its total (1e308 + 1e308 overflows): the server answers both
    versions instead of failing every bare-name request, and any draw picks a version without raising."""
    current = _store(repo).entries()["sent"].folder
    canary = next(v for v in versions if v != current)

    def huge(state):
        return Change(tasks={"sent": {**state.tasks["sent"], "route": {current: 1e308, canary: 1e308}}})

    _store(repo).commit(huge)
    entry = _store(repo).entries()["sent"]
    assert entry.route == {current: 0.5, canary: 0.5}
    assert [entry.routed(d) for d in (0.0, 0.4999, 0.5, 0.9999999999999999)] == [current, current, canary, canary]
    answers = client.infer_many([{"task": "sent", "text": TEXT}] * 200, concurrency=16)
    assert len(answers) == 200 and all("error" not in a for a in answers), next(a for a in answers if "error" in a)
    assert {a["version"] for a in answers} == {current, canary}  # 200 draws of 1/2: both, but for 2**-199
    [cleared] = _cli("export", "route", "sent", f"{current}=1", "--repo", str(repo))
    assert cleared["route"] is None


def test_a_store_of_format_v2_is_read_and_upgraded(tmp_path_factory, tiny_models, artifact):
    repo = make_repository(tiny_models["bert"], tmp_path_factory.mktemp("v2") / "repo", {"old": (artifact, "factored")})
    identity = repo / "tasks" / "store.json"
    data = json.loads(identity.read_text())
    identity.write_text(json.dumps({**data, "format_version": 2}))
    assert _store(repo).entries()["old"].keep == 5  # an entry without retention reads as the default
    export_task(artifact, repo, "old", "factored", progress=False)
    assert json.loads(identity.read_text())["format_version"] == STORE_VERSION
    assert len(_store(repo).entries()["old"].kept) == 1


def test_route_names_the_current_version_current(repo, versions):
    """`aot export route NAME CURRENT=1`, as --help, docs/serving.md and the README write it, clears a route; CURRENT
    beside a kept version canaries it; the current version named twice is refused."""
    current = _store(repo).entries()["sent"].folder
    canary = next(v for v in versions if v != current)
    [routed] = _cli("export", "route", "sent", "CURRENT=90", f"{canary}=10", "--repo", str(repo))
    assert routed["route"] == {current: 0.9, canary: 0.1}
    [cleared] = _cli("export", "route", "sent", "CURRENT=1", "--repo", str(repo))
    assert cleared["route"] is None and _store(repo).entries()["sent"].route is None
    assert "give it once" in _cli_error("export", "route", "sent", "CURRENT=1", f"{current}=1", "--repo", str(repo))


@pytest.fixture(scope="module")
def relabelled(tmp_path_factory, tiny_models, sentiment_dir):
    """The same task, its labels in the other order: every logit index means the other class."""
    return train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("relabelled") / "fc",
                           labels=["positive", "negative"])


def test_a_label_change_is_refused_unless_allowed(repo, artifact, relabelled):
    """Publishing a version whose labels differ (here their order) over the current one is refused with both lists
    named, nothing written; --allow-label-change publishes it; rolling back or routing to the old labels is refused
    the same way unless allowed."""
    export_task(artifact, repo, "tickets", "factored", progress=False)
    old = _store(repo).entries()["tickets"].folder
    error = _cli_error("export", "task", "--task", str(relabelled), "--repo", str(repo), "--name", "tickets",
                       "--storage", "factored", "--no-progress")
    assert "2 label(s) [negative, positive] to 2 label(s) [positive, negative]" in error, error
    assert old in error and "--allow-label-change" in error
    assert _store(repo).entries()["tickets"].folder == old and not list((repo / "tasks" / ".staging").glob("*"))
    exporter = TaskExporter(repo, progress=False, allow_label_change=True)  # past the export's own check ...
    written = exporter.write(relabelled, "tickets", "factored")
    exporter.allow_label_change = False  # ... the publish checks again, in the change: nothing is published
    with pytest.raises(StoreError, match=r"would change its labels from 2 label\(s\) \[negative, positive\]"):
        exporter.publish([written])
    assert _store(repo).entries()["tickets"].folder == old and not written.folder.exists()
    [published], said = run_cli("export", "task", "--task", str(relabelled), "--repo", str(repo), "--name", "tickets",
                                "--storage", "factored", "--no-progress", "--allow-label-change")
    new = published["folder"]
    assert _store(repo).entries()["tickets"].meta["labels"] == ["positive", "negative"]
    for argv in (("rollback", "tickets", old), ("route", "tickets", "CURRENT=50", f"{old}=50")):
        error = _cli_error("export", *argv, "--repo", str(repo))
        assert "[positive, negative] to 2 label(s) [negative, positive]" in error and new in error, error
        assert _store(repo).entries()["tickets"].folder == new and _store(repo).entries()["tickets"].route is None
    [routed], _ = run_cli("export", "route", "tickets", "CURRENT=50", f"{old}=50", "--repo", str(repo),
                          "--allow-label-change")
    assert routed["route"] == {new: 0.5, old: 0.5}
    [rolled], _ = run_cli("export", "rollback", "tickets", old, "--repo", str(repo), "--allow-label-change")
    assert rolled["current"] == old and _store(repo).entries()["tickets"].meta["labels"] == ["negative", "positive"]


def test_a_lower_dev_score_is_said(repo, artifact):
    """A publish, a rollback and a route to a version that scores lower on the dev set than the current one are
    done, and said: the scores and both versions named."""
    export_task(artifact, repo, "scored", "factored", progress=False)
    first = _store(repo).entries()["scored"].folder

    def better(state):  # the current version as if it had scored 2.0 (above any real score)
        entry = state.tasks["scored"]
        return Change(tasks={"scored": {**entry, "meta": {**entry["meta"], "dev": 2.0}}})

    _store(repo).commit(better)
    [published], said = run_cli("export", "task", "--task", str(artifact), "--repo", str(repo), "--name", "scored",
                                "--storage", "factored", "--no-progress")
    assert f"warning: scored: {published['folder']} scores dev" in said and f"below the 2 of {first}" in said, said
    _store(repo).commit(lambda state: Change(tasks={"scored": {**state.tasks["scored"], "meta": {
        **state.tasks["scored"]["meta"], "dev": 3.0}}}))
    _, said = run_cli("export", "route", "scored", "CURRENT=1", f"{first}=1", "--repo", str(repo))
    assert f"warning: scored: {first} scores dev" in said and "below the 3 of" in said, said
    _, said = run_cli("export", "rollback", "scored", first, "--repo", str(repo))
    assert f"warning: scored: {first} scores dev" in said and "below the 3 of" in said, said
