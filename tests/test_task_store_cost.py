"""What a publish costs the publisher (aot.serving.store.writer): it reads the index and the one shard of its task, not
the store, and lists only the staging folder (the store's own folder, one entry per version, at compactions only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from aot.serving.store import log as store_log
from aot.serving.store.layout import SHARDS, STORE_FILE
from aot.serving.store.log import index_key
from aot.serving.store.shards import shard_key, shard_of
from aot.serving.store.writer import HOST, Publication, TaskStore


def _store(root: Path) -> TaskStore:
    store = TaskStore(root)
    store.create({"fingerprint": "test"}, np.zeros((4, 2), np.float32))
    return store


def _folder(store: TaskStore, name: str) -> Path:
    folder = store.new_version_folder(name)
    (folder / "task.json").write_text(json.dumps({"labels": ["a", "b"], "metric": "accuracy", "dev": 0.5,
                                                  "method": {"method": "fc"}}))
    (folder / "factors.safetensors").write_bytes(b"factors")
    return folder


def _grow(store: TaskStore, count: int) -> None:
    for start in range(0, count, 500):
        store.publish_many([Publication(f"t{i}", _folder(store, f"t{i}"), "factored")
                            for i in range(start, min(count, start + 500))])


def test_a_publish_reads_the_index_and_its_own_shard_of_a_store_of_2000(tmp_path):
    store = _store(tmp_path / "tasks")
    _grow(store, 2000)
    state = store.log.read_state(every_shard=False)
    store.log.compact(state)
    head = (store.root / index_key(state.generation)).stat().st_size
    own = (store.root / shard_key(state.generation, shard_of("t7"))).stat().st_size
    everything = sum(p.stat().st_size for p in (store.root / SHARDS).iterdir())
    folder = _folder(store, "t7")
    before = store.backend.bytes_read
    store.publish("t7", folder, "factored")
    read = store.backend.bytes_read - before
    identity = (store.root / STORE_FILE).stat().st_size
    assert read <= head + own + identity + 64 and read < everything / 50, (read, head, own, everything)
    entries = store.entries()
    assert len(entries) == 2000 and entries["t7"].folder == TaskStore.version_name(folder)
    assert len(entries["t7"].kept) == 1 and entries["t1999"].folder.startswith("t1999@")


def test_a_publish_lists_the_staging_folder_and_the_store_only_at_compactions(tmp_path, monkeypatch):
    monkeypatch.setattr(store_log, "COMPACT_EVERY", 3)
    store = _store(tmp_path / "tasks")
    listed: list[Path] = []
    iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: listed.append(self) or iterdir(self))
    old = store.root / f".tmp-999999999.{HOST}-x@000000000000"  # a dead writer's debris from before .staging/
    old.mkdir()
    dead = store.staging / f"999999999.{HOST}-y@000000000000"  # a dead writer's
    dead.mkdir(parents=True)
    for k in range(1, 4):
        listed.clear()
        store.publish(f"t{k}", _folder(store, f"t{k}"), "factored")
        roots = [p for p in listed if p == store.root]
        generation = store.log.read_state(every_shard=False).generation
        assert bool(roots) == (generation % 3 == 0), (generation, listed)
        assert store.staging in listed and not dead.exists()
        assert old.exists() == (generation < 3)
    assert os.listdir(store.staging) == []
