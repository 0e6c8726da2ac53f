"""Tenants through the real server, over gRPC and HTTP: a tenant's task answers only its key; without it, or with
another tenant's, the answer is byte for byte the unknown-task answer, suggestions and `aot tasks` name only what the
caller may call, and the store keeps only the key's sha256."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from aot.client.client import Client, InferenceError, TaskNotFound
from aot.exporter.task_export import export_task
from aot.serving.repository import read_repository
from aot.serving.store.reader import STORE_VERSION, StoreError, folder_name
from aot.serving.store.tenants import TENANT_KEY_PARAMETER, key_digest
from aot.serving.store.writer import TaskStore
from aot.serving.task_registry import TaskRegistry
from tests.helpers import make_repository, run_cli, serve_for_tests, train_tiny_task

pytestmark = pytest.mark.server

TEXT = "good w1 w2"


def _cli(*argv: str) -> list[dict]:
    return run_cli(*argv)[0]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_models, sentiment_dir):
    return train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("tenant-artifact") / "fc")


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, artifact):
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("tenants") / "repo",
                           {"public": (artifact, "factored")})


@pytest.fixture(scope="module")
def keys(repo, artifact):
    """Tenants acme and bahn, each with a task `intent` (the same artifact as `public`), made with the CLI."""
    made = {}
    for tenant in ("acme", "bahn"):
        [printed] = _cli("export", "tenant", "create", tenant, "--repo", str(repo))
        assert set(printed) == {"tenant", "key"} and printed["tenant"] == tenant
        made[tenant] = printed["key"]
        export_task(artifact, repo, f"{tenant}/intent", "factored", progress=False)
    return made


@pytest.fixture(scope="module")
def server(request, repo, keys):
    yield from serve_for_tests(request, repo, load=("aot", "task_list"))


def _error(client: Client, task: str) -> InferenceError:
    with pytest.raises(InferenceError) as caught:
        client.infer(task, TEXT)
    return caught.value


def _http(server, task: str, key: str | None) -> tuple[int, dict]:
    body = {"inputs": [{"name": n, "shape": [1, 1], "datatype": "BYTES", "data": [v]}
                       for n, v in (("TEXT", TEXT), ("TASK", task))],
            **({"parameters": {TENANT_KEY_PARAMETER: key}} if key else {})}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/aot/infer", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_store_keeps_only_the_keys_hash(repo, keys):
    stored = b"".join(p.read_bytes() for p in (repo / "tasks").rglob("*.json"))
    for key in keys.values():
        assert key.encode() not in stored and key_digest(key).encode() in stored
    assert json.loads((repo / "tasks" / "store.json").read_text())["format_version"] == STORE_VERSION
    version = TaskStore.of(read_repository(repo)).entries()["acme/intent"].folder
    assert (repo / "tasks" / folder_name(version)).is_dir() and folder_name(version).startswith("acme~intent@")


def test_right_key_answers_the_tenants_task(server, keys):
    with Client(server.grpc_url, tenant_key=keys["acme"]) as client:
        mine, public = client.infer("acme/intent", TEXT), client.infer("public", TEXT)
    assert mine["version"].startswith("acme/intent@")
    np.testing.assert_allclose(mine["logits"], public["logits"], atol=1e-5)  # the same artifact


def test_no_key_and_a_wrong_key_get_exactly_the_unknown_task_answer(server, keys):
    with Client(server.grpc_url) as anonymous, Client(server.grpc_url, tenant_key=keys["bahn"]) as bahn:
        for client in (anonymous, bahn):
            hidden, missing = _error(client, "acme/intent"), _error(client, "acme/nosuch")
            assert type(hidden) is type(missing) is TaskNotFound
            assert hidden.status == missing.status
            assert str(hidden) == str(missing).replace("acme/nosuch", "acme/intent")
        # a pin to the tenant's real version reads as one never exported
        with Client(server.grpc_url, tenant_key=keys["acme"]) as acme:
            version = acme.infer("acme/intent", TEXT)["version"]
        real, fake = _error(anonymous, version), _error(anonymous, "acme/intent@000000000000")
        assert str(real) == str(fake).replace("acme/intent@000000000000", version)
        # suggestions name only what the caller may call
        assert str(_error(anonymous, "nosuch")).endswith("known tasks: public")
        assert str(_error(bahn, "nosuch")).endswith("known tasks: bahn/intent, public")


def test_http_answers_alike(server, keys):
    status, answer = _http(server, "acme/intent", keys["acme"])
    assert status == 200
    assert {o["name"]: o["data"] for o in answer["outputs"]}["TASK_VERSION"][0].startswith("acme/intent@")
    for key in (None, keys["bahn"]):
        code, body = _http(server, "acme/intent", key)
        missing = _http(server, "acme/nosuch", key)
        assert missing[0] == 404 and "unknown task 'acme/nosuch'" in missing[1]["error"]
        assert (code, json.dumps(body)) == (missing[0], json.dumps(missing[1]).replace("acme/nosuch", "acme/intent"))


def test_aot_tasks_lists_what_the_caller_may_call_and_no_path(server, keys, repo):
    listings = {}
    for who, key in (("anonymous", None), ("acme", keys["acme"]), ("wrong", "aotk_not-a-key")):
        with Client(server.grpc_url, tenant_key=key) as client:
            listings[who] = client.tasks()
    assert [t["name"] for t in listings["anonymous"]["tasks"]] == ["public"] == \
        [t["name"] for t in listings["wrong"]["tasks"]]
    assert [t["name"] for t in listings["acme"]["tasks"]] == ["acme/intent", "public"]
    assert listings["acme"]["total"] == 2 and "versions" not in listings["acme"]["audit"]
    text = json.dumps(listings)
    assert str(repo) not in text and "source" not in text and "bahn" not in text


def test_cli_sends_the_key_from_the_flag_and_the_environment(server, keys, monkeypatch):
    [answer] = _cli("infer", "--url", server.grpc_url, "--tenant-key", keys["acme"], "--task", "acme/intent", TEXT)
    assert answer["version"].startswith("acme/intent@")
    monkeypatch.setenv("AOT_TENANT_KEY", keys["bahn"])
    names = [line["name"] for line in _cli("tasks", "--url", server.grpc_url)]
    assert names == ["bahn/intent", "public"]


def test_keys_are_never_logged(server, keys):
    with Client(server.grpc_url, tenant_key=keys["acme"]) as client:
        client.infer("acme/intent", TEXT)
        _error(client, "bahn/intent")
    log = server.log_tail(100000)
    assert all(key not in log for key in keys.values())


def test_rotate_stops_the_old_key_and_delete_removes_the_tenants_tasks(server, repo, artifact):
    [made] = _cli("export", "tenant", "create", "cargo", "--repo", str(repo))
    export_task(artifact, repo, "cargo/intent", "factored", progress=False)
    with Client(server.grpc_url, tenant_key=made["key"]) as client:
        assert client.infer("cargo/intent", TEXT)["version"].startswith("cargo/intent@")
    [rotated] = _cli("export", "tenant", "rotate", "cargo", "--repo", str(repo))
    assert rotated["tenant"] == "cargo" and rotated["key"] != made["key"]
    with Client(server.grpc_url, tenant_key=made["key"]) as old, \
            Client(server.grpc_url, tenant_key=rotated["key"]) as new:
        assert isinstance(_error(old, "cargo/intent"), TaskNotFound)  # from the next batch on
        assert new.infer("cargo/intent", TEXT)["version"].startswith("cargo/intent@")
        [deleted] = _cli("export", "tenant", "delete", "cargo", "--repo", str(repo))
        assert deleted == {"tenant": "cargo", "key": None, "deleted": True, "removed_tasks": ["cargo/intent"]}
        assert isinstance(_error(new, "cargo/intent"), TaskNotFound)
    assert "cargo/intent" not in TaskStore.of(read_repository(repo)).entries()


def test_a_tenants_task_needs_the_tenant(repo, artifact):
    with pytest.raises(StoreError, match="no tenant 'nobody'.*aot export tenant create nobody"):
        export_task(artifact, repo, "nobody/intent", "factored", progress=False)


def test_require_tenant_keys_closes_the_public_tasks(repo, keys):
    registry = TaskRegistry(read_repository(repo).store_root, parts="meta", require_tenant_keys=True)
    with pytest.raises(Exception, match="unknown task 'public'; known tasks: [(]none[)]"):
        registry.resolve("public")
    assert registry.resolve("public", keys["acme"]).name == "public"
    assert registry.visible(registry.caller(keys["bahn"])) == ["bahn/intent", "public"]
    assert registry.visible(registry.caller("aotk_wrong")) == []


def test_a_tenants_requests_are_labelled_by_tenant(server, keys):
    with Client(server.grpc_url, tenant_key=keys["acme"]) as client:
        client.infer("acme/intent", TEXT)
        time.sleep(1.1)  # a step publishes its counts at most once a second, after a batch
        client.infer("acme/intent", TEXT)
    with urllib.request.urlopen(f"http://{server.host}:{server.metrics_port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    mine = [line for line in lines if line.startswith("aot_task_requests_total{") and 'task="acme/intent"' in line]
    assert mine and all('tenant="acme"' in line for line in mine)
    assert any(line.startswith("aot_task_latency_seconds_bucket{") and 'tenant="acme"' in line for line in lines)


def test_many_tenants_in_one_change_and_their_list(repo):
    store = TaskStore.of(read_repository(repo))
    before = store.state().generation
    made = _cli("export", "tenant", "create", "t1", "t2", "t3", "--repo", str(repo))
    assert [m["tenant"] for m in made] == ["t1", "t2", "t3"] and len({m["key"] for m in made}) == 3
    assert store.state().generation == before + 1  # one change of the index
    error = run_cli("export", "tenant", "create", "t4", "t1", "--repo", str(repo), exit_code=2)[1]
    assert "tenant(s) 't1' already exist" in error and "nothing was created" in error
    listed = {t["tenant"]: t for t in _cli("export", "tenant", "list", "--repo", str(repo))}
    assert {"t1", "t2", "t3", "acme", "bahn"} <= set(listed) and "t4" not in listed
    assert listed["acme"]["tasks"] == 1 and listed["t1"]["tasks"] == 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", listed["t1"]["key_since"])
    for tenant in ("t1", "t2", "t3"):
        _cli("export", "tenant", "delete", tenant, "--repo", str(repo))


def test_a_reused_tenant_name_answers_none_of_the_deleted_tenants_versions(server, repo, artifact):
    """Issue 46.5: after `tenant delete reuse` and `tenant create reuse`, the new key gets the unknown-task answer
    for the old tenant's pinned versions (current, kept and retired alike), whose folders are gone at once."""
    [old] = _cli("export", "tenant", "create", "reuse", "--repo", str(repo))
    for _ in range(3):
        export_task(artifact, repo, "reuse/intent", "factored", progress=False, keep=2)  # current, kept, retired
    store = TaskStore.of(read_repository(repo))
    entry = store.entries()["reuse/intent"]
    pinned = [entry.folder, *(k.version for k in entry.kept),
              *(v for v in store.state().retired if v.startswith("reuse/"))]
    assert len(pinned) == 3
    with Client(server.grpc_url, tenant_key=old["key"]) as client:
        assert [client.infer(v, TEXT)["version"] for v in pinned] == pinned
    _cli("export", "tenant", "delete", "reuse", "--repo", str(repo))
    [new] = _cli("export", "tenant", "create", "reuse", "--repo", str(repo))
    assert not any((repo / "tasks" / folder_name(v)).exists() for v in pinned)
    assert not any(v.startswith("reuse/") for v in TaskStore.of(read_repository(repo)).state().retired)
    with Client(server.grpc_url, tenant_key=new["key"]) as client:
        for version in pinned:
            assert isinstance(_error(client, version), TaskNotFound)
    _cli("export", "tenant", "delete", "reuse", "--repo", str(repo))
