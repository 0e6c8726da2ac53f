"""`aot export task --repo REPO --batch FILE`: many tasks in one change of the store's index, or none of them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aot.exporter.batch_export import export_batch
from aot.serving.repository import read_repository
from aot.serving.store.layout import STAGING
from aot.serving.store.reader import StoreError
from aot.serving.store.writer import TaskStore
from aot.serving.task_registry import TaskRegistry
from tests.helpers import make_repository, train_tiny_task

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_models, sentiment_dir):
    root = tmp_path_factory.mktemp("batch-artifacts")
    return [train_tiny_task(tiny_models["bert"], sentiment_dir, root / m, m, seed=s)
            for s, m in enumerate(("fc", "kron"))]


def _batch(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _state(repo: Path):
    store = TaskStore(read_repository(repo).store_root)
    return store.state(), sorted(p.name for p in store.root.iterdir() if "@" in p.name and p.name[0] != ".")


def test_a_batch_is_one_change_and_serves(tmp_path, tiny_models, artifacts):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"old": (artifacts[0], "factored")})
    before = TaskStore(read_repository(repo).store_root).index().generation
    batch = _batch(tmp_path / "batch.jsonl", [{"task": str(artifacts[i % 2]), "name": f"n{i}"} for i in range(4)]
                   + [{"task": str(artifacts[1]), "name": "old"}])  # a re-export among them
    result = export_batch(repo, batch, "factored", progress=False)
    assert [r.name for r in result.tasks] == ["n0", "n1", "n2", "n3", "old"]
    index = TaskStore(read_repository(repo).store_root).index()
    assert index.generation == before + 1 and set(index.entries) == {"n0", "n1", "n2", "n3", "old"}
    assert index.entries["old"].meta["method"] == "kron" and len(index.entries["old"].kept) == 1  # the replaced one
    registry = TaskRegistry(read_repository(repo).store_root)
    assert all(registry.resolve(n).storage == "factored" for n in index.entries)


def test_bad_lines_are_named_before_anything_is_written(tmp_path, tiny_models, artifacts):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {})
    before = _state(repo)
    batch = _batch(tmp_path / "b.jsonl", [
        {"task": str(artifacts[0]), "name": "fine"},
        "{not json",
        {"task": str(artifacts[0])},
        {"task": str(artifacts[1]), "name": "fine"},
        {"task": str(tmp_path / "nowhere"), "name": "x"},
        {"task": str(artifacts[0]), "name": "bad name"},
        ["a", "list"],
    ])
    with pytest.raises(StoreError) as err:
        export_batch(repo, batch, progress=False)
    message = str(err.value)
    for line, why in ((2, "invalid JSON"), (3, "missing key 'name'"), (4, "already published by line 1"),
                      (5, "does not exist"), (7, "expected a JSON object, got list")):
        assert f"b.jsonl:{line}: " in message and why in message, (line, why, message)
    assert "6 bad line(s)" in message or "5 bad line(s)" in message
    assert _state(repo) == before


def test_a_task_failing_midway_publishes_nothing(tmp_path, tiny_models, artifacts):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"keep": (artifacts[0], "factored")})
    broken = tmp_path / "broken"
    shutil.copytree(artifacts[1], broken)
    (broken / "weights.safetensors").write_bytes(b"\x00" * 64)  # the artifact reads; its weights do not load
    before = _state(repo)
    batch = _batch(tmp_path / "b.jsonl", [{"task": str(artifacts[0]), "name": "a"},
                                          {"task": str(artifacts[1]), "name": "keep"},
                                          {"task": str(broken), "name": "c"}])
    with pytest.raises(StoreError, match=r"b.jsonl:3: .*nothing of the batch was published"):
        export_batch(repo, batch, "factored", progress=False)
    assert _state(repo) == before
    store = TaskStore(read_repository(repo).store_root)
    assert [p.name for p in store.staging.glob("*")] == []


def test_validation_in_passes_names_the_line_whose_served_outputs_differ(tmp_path, tiny_models, artifacts,
                                                                         monkeypatch):
    """Tasks are validated several at once (one PyTorch pass and one engine run): a written head that does not match
    its task is caught in its pass, named by its line, and the versions of the passes before it are removed."""
    import aot.exporter.batch_export as batch_export
    import aot.exporter.task_export as task_export

    monkeypatch.setattr(batch_export, "VALIDATED_TOGETHER", 2)
    written_heads = []
    real = task_export.head_arrays

    def head_arrays(model):
        arrays = real(model)
        written_heads.append(1)
        if len(written_heads) == 4:  # the fourth task's head is written wrong: the second pass's second task
            arrays["out.bias"] = arrays["out.bias"] + 0.5
        return arrays

    monkeypatch.setattr(task_export, "head_arrays", head_arrays)
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"keep": (artifacts[0], "factored")})
    written_heads.clear()
    before = _state(repo)
    batch = _batch(tmp_path / "b.jsonl", [{"task": str(artifacts[i % 2]), "name": f"v{i}"} for i in range(5)])
    with pytest.raises(StoreError, match=r"b.jsonl:4: task 'v3': served logits differ from PyTorch by 0.5 "
                                         r".*nothing of the batch was published"):
        export_batch(repo, batch, "factored", progress=False)
    assert _state(repo) == before and len(written_heads) == 4  # the fifth was never written


def test_a_killed_batch_leaves_every_task_as_it_was(tmp_path, tiny_models, artifacts):
    """SIGKILL while the batch writes its tasks: the index is unchanged (every task old, none half), and the next
    export removes the debris."""
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"t0": (artifacts[0], "factored")})
    before = _state(repo)
    batch = _batch(tmp_path / "b.jsonl", [{"task": str(artifacts[i % 2]), "name": f"t{i}"} for i in range(80)])
    proc = subprocess.Popen([sys.executable, "-m", "aot", "export", "task", "--repo", str(repo), "--batch",
                             str(batch), "--storage", "factored", "--no-progress"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    store_root = read_repository(repo).store_root
    deadline = time.monotonic() + 300
    # killed once its second task is being written: mid-batch however fast the machine (80 tasks to go)
    while len(list((store_root / STAGING).glob("*"))) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    after_state, after_folders = _state(repo)
    assert after_state == before[0] and after_folders == before[1]
    assert TaskStore(store_root).clean()  # the killed writer's folders
    assert [p.name for p in (store_root / STAGING).glob("*")] == []


def test_the_command(tmp_path, tiny_models, artifacts):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {})
    batch = _batch(tmp_path / "b.jsonl", [{"task": str(artifacts[0]), "name": "a"},
                                          {"task": str(artifacts[1]), "name": "b"}])
    run = subprocess.run([sys.executable, "-m", "aot", "export", "task", "--repo", str(repo), "--batch", str(batch),
                          "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert [json.loads(line)["name"] for line in run.stdout.splitlines()] == ["a", "b"]
    assert "published 2 task(s) in one change" in run.stderr
    both = subprocess.run([sys.executable, "-m", "aot", "export", "task", "--repo", str(repo), "--batch", str(batch),
                           "--name", "x"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and both.stderr.strip().splitlines() == [
        "aot: error: --batch FILE names the tasks and their names: give it without --task and --name"]
