"""The task store of a model repository, as readers see it: format `aot-task-store`, version 1 (docs/formats.md).

    REPO/tasks/manifest.json       the only source of truth: backbone identity, {task name -> version folder}, and
                                   the versions retired recently (kept on disk a while for requests in flight)
    REPO/tasks/embeddings.npy      the backbone's embedding matrix E [V, d] fp32 (factored FC tasks use it)
    REPO/tasks/rows/<formula>.onnx the rows graphs factored tasks are computed with (fc-<activation>, kron)
    REPO/tasks/<name>@<id>/        one immutable version of a task (see serving.tasks)

A manifest entry {"folder", "storage", "digests"} carries the sha256 of every file of its version (serving.digests);
`retired_digests` keeps them for retired versions while requests pinned to them may still load them. Entries
written before digests existed have none and are served unverified.

The writer is exporter.task_store. A reader validates each manifest entry on its own: a bad entry fails only its
task; a manifest that cannot be read at all is reported and the last good one stays in use (serving.tasks).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from serving.digests import DigestError, check_digests
from serving.formats import FormatError, check_keys, read_versioned_json

STORE_FORMAT = "aot-task-store"
STORE_VERSION = 1
MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.npy"
ROWS_DIR = "rows"
STORAGES = ("fused", "factored")
MAX_NAME_LENGTH = 128
RETIRED_GRACE = 300.0  # seconds a replaced or removed version is still served to requests pinned to it
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_VERSION = re.compile(r"(?P<name>[A-Za-z0-9_-][A-Za-z0-9_.-]*)@(?P<id>[0-9a-f]{12})")


def rows_graph_name(method: dict) -> str:
    """The rows graph a factored task's method config is computed with: `fc-<activation>` or `kron`."""
    if method.get("method") == "fc":
        return f"fc-{method.get('activation', 'tanh')}"
    return str(method.get("method"))


class StoreError(ValueError):
    """A bad task name, a corrupt store or task, or a backbone mismatch."""


def check_task_name(name: str) -> str:
    """1-128 letters, digits, '_', '-' or '.', not starting with '.': safe as a folder name and a metric label."""
    if len(name) > MAX_NAME_LENGTH:
        raise StoreError(f"invalid task name ({len(name)} characters): at most {MAX_NAME_LENGTH}")
    if not _NAME.fullmatch(name):
        raise StoreError(f"invalid task name {name!r}: use 1-{MAX_NAME_LENGTH} letters, digits, '_', '-' or '.', "
                         "not starting with '.'")
    return name


def check_version(version: str) -> str:
    """A task version is its folder's name `<name>@<12 hex digits>`: a plain child of the store, never a path."""
    match = _VERSION.fullmatch(version)
    if match is None or len(match["name"]) > MAX_NAME_LENGTH:
        raise StoreError(f"invalid task version {version[:80]!r}: expected <task name>@<12 hex digits>")
    return version


def check_task_spec(spec: str) -> str:
    """What a client sends as TASK: a task name (its latest published version) or `TASK@VERSION`, a version folder's
    name as answers report it (that version, while the store still holds it: a caller stays on it during a rollout,
    or canaries a new one)."""
    return check_version(spec) if "@" in spec else check_task_name(spec)


def task_of(version: str) -> str:
    return version.rsplit("@", 1)[0]


@dataclass(frozen=True)
class TaskEntry:
    name: str
    folder: str
    storage: str
    digests: dict[str, str] | None = field(default=None, compare=False)  # file name -> sha256 (None: unverified)


@dataclass
class Manifest:
    """A parsed manifest: the valid entries, and an error per invalid one (that task fails alone)."""

    backbone: dict
    entries: dict[str, TaskEntry]
    errors: dict[str, str] = field(default_factory=dict)
    retired: dict[str, float] = field(default_factory=dict)
    retired_digests: dict[str, dict[str, str]] = field(default_factory=dict)

    def digests(self, version: str) -> dict[str, str] | None:
        """The published digests of a current or retired version (None: exported before digests existed)."""
        for entry in self.entries.values():
            if entry.folder == version:
                return entry.digests
        return self.retired_digests.get(version)


def parse_entry(name: str, entry, where: str) -> TaskEntry:
    try:
        check_task_name(name)
        if not isinstance(entry, dict):
            raise FormatError(f"entry must be an object, got {type(entry).__name__}")
        check_keys(entry, {"folder": str, "storage": str}, f"task {name!r}")
        check_version(entry["folder"])
        if task_of(entry["folder"]) != name:
            raise StoreError(f"folder {entry['folder']!r} belongs to task {task_of(entry['folder'])!r}")
        if entry["storage"] not in STORAGES:
            raise StoreError(f"unknown storage {entry['storage']!r}: expected one of {', '.join(STORAGES)}")
        digests = check_digests(entry["digests"], "entry") if "digests" in entry else None
    except (ValueError, DigestError) as exc:
        raise StoreError(f"{where}: bad entry for task {name[:80]!r}: {exc}") from None
    return TaskEntry(name, entry["folder"], entry["storage"], digests)


class StoreReader:
    """Reads REPO/tasks."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    @property
    def embeddings_path(self) -> Path:
        return self.root / EMBEDDINGS

    def manifest_data(self) -> dict:
        """The raw manifest, format-checked (raises StoreError)."""
        if not self.manifest_path.is_file():
            raise StoreError(f"{self.root}: no task store here ({MANIFEST} missing); run `aot export backbone`")
        try:
            return read_versioned_json(self.manifest_path, STORE_FORMAT, STORE_VERSION,
                                       {"backbone": dict, "tasks": dict})
        except FormatError as exc:
            raise StoreError(str(exc)) from None

    def manifest(self) -> Manifest:
        data = self.manifest_data()
        entries, errors = {}, {}
        for name, entry in data["tasks"].items():
            try:
                entries[name] = parse_entry(name, entry, MANIFEST)  # no server path: clients read this
            except StoreError as exc:
                errors[name] = str(exc)
        retired = {v: float(t) for v, t in data.get("retired", {}).items()
                   if isinstance(t, (int, float)) and _VERSION.fullmatch(v)}
        retired_digests = {}
        for version, digests in data.get("retired_digests", {}).items():
            try:
                retired_digests[version] = check_digests(digests, f"{MANIFEST} retired {version[:80]!r}")
            except DigestError:
                retired_digests[version] = {}  # no file of it matches: the version is refused, not read unverified
        return Manifest(data["backbone"], entries, errors, retired, retired_digests)

    def entries(self) -> dict[str, TaskEntry]:
        return self.manifest().entries

    def manifest_stamp(self) -> tuple[int, int, int] | None:
        """Changes whenever the manifest is replaced: a cheap check before each batch (None: no manifest)."""
        try:
            st = os.stat(self.manifest_path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def version_folder(self, version: str) -> Path:
        return self.root / check_version(version)
