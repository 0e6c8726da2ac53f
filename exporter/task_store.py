"""Writing the task store (format `aot-task-store` v1; serving.store reads it, docs/formats.md).

Publishing a version: write `.tmp-<pid>.<host>-<name>@<id>/` and fsync it (no lock held), then, under an exclusive lock on
`tasks/.lock`: rename it into place, point the manifest at it (atomic replace), retire the version it replaces, and
collect garbage. Everything that reads or changes the set of folders happens under that lock, so two exports at
once can never delete each other's folders.

A retired version stays on disk for RETIRED_GRACE seconds: a request that the first served step pinned to it a
moment before the re-export is still served by it. Garbage: retired versions past their grace, folders the manifest
does not know, and `.tmp-*` debris of writers that died (a live writer's folder is left alone; one of another host
is left for an hour).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from serving.atomic import fsync_dir, fsync_tree, pid_alive, plain_permissions, write_atomic, write_json
from serving.digests import folder_digests
from serving.store import (EMBEDDINGS, MANIFEST, RETIRED_GRACE, STORAGES, STORE_FORMAT, STORE_VERSION, StoreError,
                           StoreReader, TaskEntry, check_task_name, task_of)


FOREIGN_DEBRIS_AGE = 3600.0  # seconds before another host's unfinished export folder counts as debris
# this host, in the names of export folders (pids are per host: a fleet's exports share one volume)
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


class TaskStore(StoreReader):
    """Reads and writes REPO/tasks."""

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def create(self, backbone: dict, embeddings: np.ndarray) -> None:
        """A new, empty store for a backbone (keeps an existing one whose backbone is the same)."""
        with self.locked():
            if self.manifest_path.exists():
                current = self.manifest_data()
                if current["backbone"].get("fingerprint") == backbone["fingerprint"]:
                    return
                raise StoreError(f"{self.root} holds tasks for backbone {current['backbone'].get('fingerprint')}, "
                                 f"not {backbone['fingerprint']}")
            buffer = _npy_bytes(embeddings.astype(np.float32))
            write_atomic(self.root / EMBEDDINGS, buffer)
            write_json(self.manifest_path, {"format": STORE_FORMAT, "format_version": STORE_VERSION,
                                            "backbone": backbone, "tasks": {}, "retired": {}})

    def new_version_folder(self, name: str) -> Path:
        """An empty folder to write a task version into (not yet visible to readers)."""
        check_task_name(name)
        folder = self.root / f".tmp-{os.getpid()}.{HOST}-{name}@{uuid.uuid4().hex[:12]}"
        folder.mkdir(parents=True)
        return folder

    @staticmethod
    def version_name(folder: Path) -> str:
        """The version a folder from new_version_folder becomes: `.tmp-<pid>.<host>-<name>@<id>` -> `<name>@<id>`."""
        return folder.name.split("-", 2)[2]

    def publish(self, name: str, folder: Path, storage: str) -> TaskEntry:
        """Rename a finished version folder into place and point the manifest at it, atomically."""
        if storage not in STORAGES:
            raise StoreError(f"unknown storage {storage!r}: expected one of {', '.join(STORAGES)}")
        plain_permissions(folder)  # safetensors writes 0600: a server running as another user could not read it
        fsync_tree(folder)
        digests = folder_digests(folder)
        final = self.root / self.version_name(folder)
        with self.locked():
            data = self.manifest_data()
            folder.rename(final)
            fsync_dir(self.root)
            old = data["tasks"].get(name)
            data["tasks"][name] = {"folder": final.name, "storage": storage, "digests": digests}
            self._retire(data, old)
            self._commit(data)
        return TaskEntry(name, final.name, storage, digests)

    def remove(self, name: str) -> None:
        with self.locked():
            data = self.manifest_data()
            if name not in data["tasks"]:
                known = ", ".join(sorted(data["tasks"])) or "(none)"
                raise StoreError(f"unknown task {name!r}; known tasks: {known}")
            self._retire(data, data["tasks"].pop(name))
            self._commit(data)

    @staticmethod
    def _retire(data: dict, entry) -> None:
        """Keep a replaced or removed version (and its digests) for requests pinned to it."""
        retired = data.setdefault("retired", {})
        if isinstance(entry, dict) and isinstance(entry.get("folder"), str):
            retired[entry["folder"]] = time.time()
            if isinstance(entry.get("digests"), dict):
                data.setdefault("retired_digests", {})[entry["folder"]] = entry["digests"]

    def clean(self) -> list[str]:
        """Remove the `.tmp-<pid>-*` folders of writers that died (a killed `aot export task` leaves one, up to the
        size of a fused table); a live writer's folder is left alone. Returns the names removed."""
        removed = []
        with self.locked():
            for path in self.root.iterdir():
                if path.is_dir() and path.name.startswith(".tmp-") and not _writer_alive(path):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path.name)
        return sorted(removed)

    def verify(self) -> dict[str, str | None]:
        """Check every current task version offline: each file against the digest the manifest publishes, and the
        whole version loadable as the server loads it. Task name -> what is wrong (None: sound)."""
        from serving.digests import DigestError, verify_file
        from serving.tasks import load_task_version

        manifest = self.manifest()
        found: dict[str, str | None] = dict(manifest.errors)
        for name, entry in sorted(manifest.entries.items()):
            folder = self.version_folder(entry.folder)
            try:
                if entry.digests is None:
                    raise DigestError(f"{entry.folder}: published without digests (exported by an older aot): "
                                      "re-export it to have it verified")
                on_disk = {p.name for p in folder.iterdir() if p.is_file()}
                if on_disk != set(entry.digests):
                    raise DigestError(f"{entry.folder}: files {sorted(on_disk)} differ from the published "
                                      f"{sorted(entry.digests)}")
                for file in sorted(entry.digests):
                    verify_file(folder / file, entry.digests, entry.folder)
                load_task_version(folder, entry.folder, self.root, "all", entry.digests).check_table()
                found[name] = None
            except (OSError, ValueError) as exc:
                found[name] = str(exc).replace(str(self.root) + "/", "")
        return found

    def _commit(self, data: dict) -> None:
        """Under the lock: write the manifest, then remove what nothing may read any more."""
        now = time.time()
        live = {e["folder"] for e in data["tasks"].values() if isinstance(e, dict)}
        retired = {v: t for v, t in data.get("retired", {}).items() if v not in live}
        data["retired"] = {v: t for v, t in retired.items() if now - t < RETIRED_GRACE}
        data["retired_digests"] = {v: d for v, d in data.get("retired_digests", {}).items() if v in data["retired"]}
        write_json(self.manifest_path, data)
        keep = live | set(data["retired"])
        for path in self.root.iterdir():
            if not path.is_dir() or path.name in keep:
                continue
            if path.name.startswith(".tmp-"):
                if not _writer_alive(path):
                    shutil.rmtree(path, ignore_errors=True)
            elif "@" in path.name and task_of(path.name):
                shutil.rmtree(path, ignore_errors=True)


def _writer_alive(debris: Path) -> bool:
    """`.tmp-<pid>.<host>-<version>`: is the process that writes it still running? A writer on another host (the
    store is a shared volume of a fleet) cannot be asked: its folder counts as alive until it is FOREIGN_DEBRIS_AGE
    seconds old. (`.tmp-<pid>-<version>`: a folder of a writer from before hosts were recorded.)"""
    try:
        writer = debris.name.split("-", 2)[1]
        pid, _, host = writer.partition(".")
        if host and host != HOST:
            return time.time() - debris.stat().st_mtime < FOREIGN_DEBRIS_AGE
        return pid_alive(int(pid))
    except (IndexError, ValueError, OSError):
        return False


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


__all__ = ["EMBEDDINGS", "MANIFEST", "STORAGES", "StoreError", "TaskEntry", "TaskStore", "check_task_name"]
