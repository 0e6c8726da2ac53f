"""The task store of a model repository: format `aot-task-store`, version 1 (docs/formats.md).

    REPO/tasks/manifest.json       the only source of truth: backbone identity and {task name -> version folder}
    REPO/tasks/embeddings.npy      the backbone's embedding matrix E [V, d] fp32 (factored FC tasks use it)
    REPO/tasks/<name>@<id>/        one immutable version of a task:
        task.json                  labels, metric, max length, storage, method config
        head.safetensors           dense.weight/bias, out.weight/bias
        table.npy                  storage "fused": P for every token and layer, [V, L, d], token-major
        factors.safetensors        storage "factored": the method's factors; rows are computed per request

Writers build a version folder under a temporary name, rename it into place, then replace the manifest with
os.replace under a lock: a reader sees a task complete or not at all, and an interrupted export leaves only an
unreferenced folder that nothing loads (and that the next export removes).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STORE_FORMAT = "aot-task-store"
STORE_VERSION = 1
MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.npy"
STORAGES = ("fused", "factored")
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class StoreError(ValueError):
    """A bad task name, a corrupt store or task, or a backbone mismatch."""


def check_task_name(name: str) -> str:
    if not name or not set(name) <= _NAME_OK or name.startswith(".") or len(name) > 128:
        raise StoreError(f"invalid task name {name!r}: use 1-128 letters, digits, '_', '-' or '.', not starting with '.'")
    return name


@dataclass(frozen=True)
class TaskEntry:
    name: str
    folder: str
    storage: str


class TaskStore:
    """Reads and writes REPO/tasks."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    # --- reading ---------------------------------------------------------------------------------------------

    def manifest(self) -> dict:
        try:
            data = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StoreError(f"{self.root}: no task store here ({MANIFEST} missing); run `aot export backbone`") from None
        except json.JSONDecodeError as exc:
            raise StoreError(f"{self.manifest_path}: invalid JSON ({exc.msg})") from None
        if data.get("format") != STORE_FORMAT or data.get("format_version") != STORE_VERSION:
            raise StoreError(f"{self.manifest_path}: not an {STORE_FORMAT} v{STORE_VERSION} manifest")
        if not isinstance(data.get("tasks"), dict) or not isinstance(data.get("backbone"), dict):
            raise StoreError(f"{self.manifest_path}: missing 'tasks' or 'backbone'")
        return data

    def entries(self) -> dict[str, TaskEntry]:
        return {name: TaskEntry(name, e["folder"], e["storage"]) for name, e in self.manifest()["tasks"].items()}

    def manifest_stamp(self) -> tuple[int, int, int]:
        """Changes whenever the manifest is replaced: a cheap check before each batch."""
        st = os.stat(self.manifest_path)
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    # --- writing ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_manifest(self, data: dict) -> None:
        tmp = self.root / f".{MANIFEST}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.manifest_path)

    def create(self, backbone: dict, embeddings: np.ndarray) -> None:
        """A new, empty store for a backbone (keeps an existing one whose backbone is the same)."""
        with self._locked():
            if self.manifest_path.exists():
                current = self.manifest()
                if current["backbone"]["fingerprint"] == backbone["fingerprint"]:
                    return
                raise StoreError(f"{self.root} holds tasks for backbone {current['backbone']['fingerprint']}, "
                                 f"not {backbone['fingerprint']}")
            tmp = self.root / f".{EMBEDDINGS}.tmp-{os.getpid()}.npy"
            np.save(tmp, embeddings.astype(np.float32))
            os.replace(tmp, self.root / EMBEDDINGS)
            self._write_manifest({"format": STORE_FORMAT, "format_version": STORE_VERSION, "backbone": backbone,
                                  "tasks": {}})

    def new_version_folder(self, name: str) -> Path:
        """An empty folder to write a task version into (not yet visible to readers)."""
        check_task_name(name)
        folder = self.root / f".tmp-{name}@{uuid.uuid4().hex[:12]}"
        folder.mkdir(parents=True)
        return folder

    def publish(self, name: str, folder: Path, storage: str) -> TaskEntry:
        """Rename a finished version folder into place and point the manifest at it, atomically."""
        final = self.root / folder.name.removeprefix(".tmp-")
        for path in folder.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        os.rename(folder, final)
        with self._locked():
            data = self.manifest()
            data["tasks"][name] = {"folder": final.name, "storage": storage}
            self._write_manifest(data)
        self._collect_garbage(keep={e["folder"] for e in data["tasks"].values()})
        return TaskEntry(name, final.name, storage)

    def remove(self, name: str) -> None:
        with self._locked():
            data = self.manifest()
            if name not in data["tasks"]:
                raise StoreError(f"unknown task {name!r}; known tasks: {', '.join(sorted(data['tasks'])) or '(none)'}")
            del data["tasks"][name]
            self._write_manifest(data)
        self._collect_garbage(keep={e["folder"] for e in data["tasks"].values()})

    def _collect_garbage(self, keep: set[str]) -> None:
        """Remove version folders the manifest no longer names, and debris of dead writers.

        A server that already opened a removed table keeps reading it (an open memory map outlives the unlink);
        one that has not yet opened it re-reads the manifest and finds the new version.
        """
        for path in self.root.iterdir():
            if not path.is_dir() or path.name in keep:
                continue
            if path.name.startswith(".tmp-"):
                if not _written_recently(path):
                    shutil.rmtree(path, ignore_errors=True)
            elif "@" in path.name:
                shutil.rmtree(path, ignore_errors=True)


def _written_recently(path: Path, seconds: float = 3600) -> bool:
    import time

    return time.time() - path.stat().st_mtime < seconds
