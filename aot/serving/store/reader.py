"""The task store of a model repository, as readers see it: format `aot-task-store`, version 5 (docs/formats.md).

    REPO/tasks/store.json          the store's identity: format, version and the backbone its tasks were trained on
    REPO/tasks/log/, index/, shards/, generation   the index of tasks, an append-only change log (aot.serving.store.log)
                                   whose compactions keep the entries in shards by name (aot.serving.store.shards)
    REPO/tasks/embeddings.npy      the backbone's embedding matrix E [V, d] fp32 (factored FC tasks use it)
    REPO/tasks/rows/<formula>.onnx the rows graphs factored tasks are computed with (fc-<activation>, kron)
    REPO/tasks/<name>@<id>/        one immutable version of a task (see aot.serving.tasks); a tenant's task
                                   `TENANT/TASK` has the folder `TENANT~TASK@<id>` (folder_name)

A task's entry {"folder", "storage", "digests", "meta"} names its current version, the sha256 of each of its files
(aot.serving.store.digests) and what `aot tasks` lists of it (labels, metric, dev score, method, max length), so that a
reader learns every task from the index alone and reads a version's files only when a request first needs it. Format 3
adds to an entry its retention ("keep": how many versions are kept, the current one included), the versions kept besides
the current one ("kept": the same fields and "time", newest first: each servable by pin, and a rollback target) and an
optional weighted "route" {version: weight} for canaries; and tenants to the index (aot.serving.store.tenants). Format 4
keeps a compaction's entries in 256 shards by name instead of inline, so that a writer reads only the shards of the
tasks it changes. Format 5 writes a large change set in parts (aot.serving.store.parts). A retired version ({"time", "digests"}) stays servable RETIRED_GRACE seconds for requests pinned to
it.

A reader follows the log (aot.serving.store.view.StoreView): a publish costs it one small object, whatever the number of
tasks. Each entry is checked on its own: a bad entry fails only its task; a shard that cannot be parsed fails only the
names that fall in it (`StoreIndex.damaged_shards`); a log that cannot be parsed stops the reader before it
(`damaged_log`), and an object that cannot be read is reported while the last good state stays in use. A reader of a
store in object storage keeps a copy of what it read on its host (aot.serving.store.mirror): a step that starts while
the store cannot be reached serves the index its host last read. The writer is aot.serving.store.writer. A store of
format v1 (one manifest.json rewritten at every publish) is upgraded by `aot export backbone --overwrite`, which keeps
its tasks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aot import settings
from aot.serving.formats import FormatError, check_keys, check_versioned, parse_json
from aot.serving.kinds import kind_of
from aot.serving.store.backend import BackendError, FileBackend
from aot.serving.store.digests import DigestError, check_digests
from aot.serving.store.entries import EntryView, ParsedEntries
from aot.serving.store.layout import EMBEDDINGS, STORE_FILE, V1_MANIFEST
from aot.serving.store.log import ChangeLog, StoreState
from aot.serving.store.mirror import MIRROR_DIR, MirroredBackend
from aot.serving.store.names import TaskNames

STORE_FORMAT = "aot-task-store"
STORE_VERSION = 5
READABLE_VERSIONS = (2, 3, 4, 5)  # an older store is read as it is; its first write upgrades it
DEFAULT_KEEP = 5  # versions of a task kept (the current one included) unless `aot export task --keep N` says
FOLDER_SEPARATOR = "~"  # `TENANT/TASK@<id>` lives in the folder `TENANT~TASK@<id>`: a plain child of the store
STORAGES = ("fused", "factored")
MAX_NAME_LENGTH = 128
RETIRED_GRACE = 300.0  # seconds a replaced or removed version is still served to requests pinned to it
_SEGMENT = r"[A-Za-z0-9_-][A-Za-z0-9_.-]*"
_TENANT = re.compile(_SEGMENT)
_NAME = re.compile(rf"(?:{_SEGMENT}/)?{_SEGMENT}")
_VERSION = re.compile(rf"(?P<name>(?:{_SEGMENT}/)?{_SEGMENT})@(?P<id>[0-9a-f]{{12}})")


def rows_graph_name(method: dict) -> str:
    """The rows graph a factored task's method config is computed with: `fc-<activation>` or `kron`."""
    if method.get("method") == "fc":
        return f"fc-{method.get('activation', 'tanh')}"
    return str(method.get("method"))


class StoreError(ValueError):
    """A bad task name, a corrupt store or task, or a backbone mismatch."""


def check_task_name(name: str) -> str:
    """1-128 letters, digits, '_', '-' or '.', not starting with '.', optionally after `TENANT/` (a tenant's task,
    aot.serving.store.tenants): safe as a folder name (folder_name) and a metric label."""
    if len(name) > MAX_NAME_LENGTH:
        raise StoreError(f"invalid task name ({len(name)} characters): at most {MAX_NAME_LENGTH}")
    if not _NAME.fullmatch(name):
        raise StoreError(f"invalid task name {name!r}: use 1-{MAX_NAME_LENGTH} letters, digits, '_', '-' or '.', "
                         "not starting with '.', optionally after TENANT/ (a tenant's task)")
    return name


def check_tenant_name(tenant: str) -> str:
    """A tenant is named as a task is, without '/'; `TENANT/TASK` must still fit MAX_NAME_LENGTH."""
    if len(tenant) > MAX_NAME_LENGTH // 2 or not _TENANT.fullmatch(tenant):
        raise StoreError(f"invalid tenant name {tenant[:80]!r}: use 1-{MAX_NAME_LENGTH // 2} letters, digits, '_', "
                         "'-' or '.', not starting with '.'")
    return tenant


def folder_name(version: str) -> str:
    """The store's folder (or object prefix) of a version: `TENANT/TASK@<id>` -> `TENANT~TASK@<id>`."""
    return version.replace("/", FOLDER_SEPARATOR)


def version_of_folder(folder: str) -> str:
    return folder.replace(FOLDER_SEPARATOR, "/")


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
class KeptVersion:
    """A task's version kept besides its current one (retention): servable by pin, a rollback or route target."""

    version: str
    storage: str
    digests: dict[str, str] | None = field(default=None, compare=False)
    meta: dict = field(default_factory=dict, compare=False)
    time: float = 0.0  # when it stopped being the current version


@dataclass(frozen=True)
class TaskEntry:
    name: str
    folder: str
    storage: str
    digests: dict[str, str] | None = field(default=None, compare=False)  # file name -> sha256 (None: unverified)
    meta: dict = field(default_factory=dict, compare=False)  # what `aot tasks` lists without reading the version
    keep: int = DEFAULT_KEEP
    kept: tuple[KeptVersion, ...] = field(default=(), compare=False)  # newest first
    route: dict[str, float] | None = field(default=None, compare=False)  # version -> share, summing to 1 (None: the
    # current one answers alone)

    def held(self) -> dict[str, KeptVersion]:
        """Every version the entry holds (current and kept), by version."""
        current = KeptVersion(self.folder, self.storage, self.digests, self.meta)
        return {current.version: current, **{k.version: k for k in self.kept}}

    def routed(self, draw: float) -> str:
        """The version a bare-name request answers, for `draw` uniform in [0, 1): the current one, or the route's
        version whose cumulative share first exceeds the draw (the last one for a draw past a rounded total). It
        cannot raise, whatever the route stored."""
        if not self.route:
            return self.folder
        versions, cumulative = list(self.route), 0.0
        for version in versions[:-1]:
            cumulative += self.route[version]
            if draw < cumulative:
                return version
        return versions[-1]

    def kind(self) -> str | None:
        return meta_kind(self.meta)

    def listing(self) -> dict:
        """What `aot tasks` shows of the task, from the index alone (no server path)."""
        return {"name": self.name, "version": self.folder, "kind": self.kind(), "storage": self.storage,
                **{k: self.meta.get(k) for k in ("labels", "max_length", "method", "metric", "dev", "served_dev")},
                "verified": self.digests is not None}


def meta_kind(meta: dict) -> str | None:
    """A version's kind from the meta the index keeps (aot.serving.kinds.kind_of: a version exported before kinds is
    a classifier, or a regressor without labels); None for an entry without meta."""
    if "kind" in meta or "labels" not in meta:
        return meta.get("kind")
    return kind_of(meta)


def _parsed(name: str, raw: dict) -> TaskEntry | str:
    """An index entry parsed, or why it is bad (no server path: clients read this)."""
    try:
        return parse_entry(name, raw, "the store's index")
    except StoreError as exc:
        return str(exc)


@dataclass
class StoreIndex:
    """The store's tasks as of one generation: the valid entries, an error per invalid one (that task fails alone),
    and the versions retired recently. Entries are parsed on first use (aot.serving.store.entries): a step reads the
    whole index at start but parses only the tasks it is asked for."""

    parsed: ParsedEntries = field(default_factory=lambda: ParsedEntries({}, _parsed))
    retired: dict[str, float] = field(default_factory=dict)
    retired_digests: dict[str, dict[str, str]] = field(default_factory=dict)
    tenants: dict[str, str] = field(default_factory=dict)  # tenant -> the sha256 of its key (aot.serving.store.tenants)
    generation: int = 0
    damaged_shards: dict[str, str] = field(default_factory=dict)  # shard -> why it cannot be parsed: its names fail
    damaged_log: tuple[int, str] | None = None  # (generation, why) of a log not applied: changes from it on are unknown
    names: TaskNames = field(default_factory=TaskNames)  # every name, by tenant, sorted (aot.serving.store.names)

    @property
    def entries(self) -> Mapping[str, TaskEntry]:
        return EntryView(self.parsed, errors=False)

    @property
    def errors(self) -> Mapping[str, str]:
        return EntryView(self.parsed, errors=True)

    def digests(self, version: str) -> dict[str, str] | None:
        """The published digests of a current, kept or retired version (None: exported before digests existed)."""
        entry = self.entries.get(task_of(version))
        if entry is not None and (held := entry.held().get(version)) is not None:
            return held.digests
        return self.retired_digests.get(version)

    def is_current(self, version: str) -> bool:
        """Whether a bare task name may answer `version`: its task's current one or a target of its route (O(1):
        one entry parsed)."""
        entry = self.entries.get(task_of(version))
        return entry is not None and (version == entry.folder or version in (entry.route or ()))

    def update(self, state: StoreState, names: set[str] | None) -> None:
        """Take the entries of `names` from `state` (None: all of them; each parsed on first use) and its retired
        versions. New objects replace the old ones whole, so a thread reading the index meanwhile (the audit) sees
        one generation or the other."""
        if names is None:
            parsed = ParsedEntries(dict(state.tasks.items()), _parsed)
            sorted_names = TaskNames.of(parsed.raw)
        else:
            parsed = self.parsed.changed(state.tasks, names)
            sorted_names = self.names.changed(names, parsed.raw.__contains__)
        retired, retired_digests = {}, {}
        for version, info in state.retired.items():
            if not _VERSION.fullmatch(version) or not isinstance(info.get("time"), (int, float)):
                continue
            retired[version] = float(info["time"])
            try:
                retired_digests[version] = check_digests(info.get("digests"), f"retired {version[:80]!r}")
            except DigestError:
                retired_digests[version] = {}  # no file of it matches: refused, never read unverified
        tenants = {t: info["key_sha256"] for t, info in state.tenants.items()
                   if _TENANT.fullmatch(t) and isinstance(info.get("key_sha256"), str)}
        self.parsed, self.retired, self.retired_digests = parsed, retired, retired_digests
        self.tenants, self.names = tenants, sorted_names
        self.generation = state.generation
        self.damaged_shards, self.damaged_log = dict(state.tasks.damaged), state.damaged_log

    def damage(self) -> list[str]:
        """What of the index could not be read (its shards, a log), for an operator; empty when it read whole."""
        found = [f"shard {shard} of the index cannot be parsed ({why}): the tasks it holds fail until it is "
                 "repaired" for shard, why in sorted(self.damaged_shards.items())]
        if self.damaged_log is not None:
            found.append(f"the change log cannot be parsed at generation {self.damaged_log[0]} "
                         f"({self.damaged_log[1]}): changes from it on are not applied")
        return found


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
        meta = entry.get("meta", {})
        if not isinstance(meta, dict):
            raise FormatError(f"'meta' must be an object, got {type(meta).__name__}")
        keep = entry.get("keep", DEFAULT_KEEP)
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise FormatError(f"'keep' must be a positive integer, got {keep!r}")
        kept = tuple(_kept(name, item) for item in entry.get("kept", []))
        route = _route(name, entry.get("route"), {entry["folder"]} | {k.version for k in kept})
    except (ValueError, DigestError) as exc:
        raise StoreError(f"{where}: bad entry for task {name[:80]!r}: {exc}") from None
    return TaskEntry(name, entry["folder"], entry["storage"], digests, meta, keep, kept, route)


def _kept(name: str, item) -> KeptVersion:
    if not isinstance(item, dict):
        raise FormatError(f"a kept version must be an object, got {type(item).__name__}")
    check_keys(item, {"folder": str, "storage": str}, "kept version")
    if task_of(check_version(item["folder"])) != name or item["storage"] not in STORAGES:
        raise StoreError(f"kept version {item['folder']!r} ({item['storage']!r}) is not a version of {name!r}")
    digests = check_digests(item["digests"], "kept version") if "digests" in item else None
    meta = item.get("meta", {})
    when = item.get("time", 0.0)
    return KeptVersion(item["folder"], item["storage"], digests, meta if isinstance(meta, dict) else {},
                       float(when) if isinstance(when, (int, float)) else 0.0)


MAX_ROUTE_TOTAL = 1e6  # a route's weights add up to at most this (percentages, counts): beyond it a typo, not a plan


def check_route_weights(weights: dict[str, float]) -> None:
    """What a writer may store as a route: finite positive weights whose total is finite and at most MAX_ROUTE_TOTAL
    (`route sentiment V1=1e308 V2=1e308` would sum to infinity)."""
    for version, weight in weights.items():
        if not (isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
                and weight > 0):
            raise StoreError(f"weight {weight!r} of {version}: expected a finite positive number")
    total = sum(weights.values())  # inf past the largest float (math.fsum would raise)
    if not total <= MAX_ROUTE_TOTAL:
        raise StoreError(f"route weights add up to {total:g}: expected a total of at most {MAX_ROUTE_TOTAL:g} "
                         "(shares are weight / total: 90 and 10, or 0.9 and 0.1)")


def _route(name: str, route, held: set[str]) -> dict[str, float] | None:
    """A stored route as shares that add up to 1: weights are divided by the largest before they are summed, so any
    finite positive weights (those of a store written before MAX_ROUTE_TOTAL too) give finite shares."""
    if route is None:
        return None
    if not isinstance(route, dict) or not route:
        raise FormatError(f"'route' must be a non-empty object of version -> weight, got {route!r}")
    for version, weight in route.items():
        if version not in held:
            raise StoreError(f"route names {version!r}, which is not a version {name!r} keeps")
        if (not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight)
                or not weight > 0):
            raise FormatError(f"route weight of {version!r} must be a finite positive number, got {weight!r}")
    largest = max(route.values())
    scaled = {version: weight / largest for version, weight in route.items()}
    total = math.fsum(scaled.values())
    return {version: weight / total for version, weight in scaled.items()}


class StoreReader:
    """Reads a task store: its identity, its index, its version folders.

    `root` is the repository's local store folder (REPO/tasks): the embeddings and rows graphs of its backbone, and,
    for a store on the file system, everything. `url` (s3://BUCKET/PREFIX): the tasks live in object storage
    (aot.serving.store.s3), and a version's files are fetched on first use into a bounded local cache
    (aot.serving.store.version_cache; AOT_TASK_CACHE_DIR, AOT_TASK_CACHE_BYTES)."""

    REMOTE_TIMEOUT = 5.0  # seconds a request to the object store may take: a serving step waits no longer
    MIRROR = True  # keep a copy of the index read from a remote store on this host (a writer does not)

    def __init__(self, root: str | Path, url: str | None = None):
        self.root = Path(root)
        self.url = url
        self.cache = None
        self.mirror: MirroredBackend | None = None
        if url:
            from aot.serving.store.s3 import S3Backend  # obstore: only for a store in object storage
            from aot.serving.store.version_cache import VersionCache

            remote = S3Backend(url, timeout=self.REMOTE_TIMEOUT)
            try:
                self.cache = VersionCache.for_store(remote, url)
            except settings.SettingError as exc:
                raise StoreError(str(exc)) from None
            if self.MIRROR:
                self.mirror = MirroredBackend(remote, self.cache.root / MIRROR_DIR)
            self.backend = self.mirror or remote
        else:
            self.backend = FileBackend(self.root)
        self.log = ChangeLog(self.backend, on_read=self.mirror.remember if self.mirror else None)

    @classmethod
    def of(cls, repo):
        """The store of a repository (aot.serving.repository.RepositoryInfo)."""
        return cls(repo.store_root, repo.store_url)

    @property
    def location(self) -> str:
        return self.url or str(self.root)

    @property
    def remote(self) -> bool:
        return self.url is not None

    @property
    def embeddings_path(self) -> Path:
        return self.root / EMBEDDINGS

    def identity(self) -> dict:
        """store.json, format-checked: {"format", "format_version", "backbone"} (raises StoreError)."""
        try:
            data = self.backend.read(STORE_FILE)
        except (BackendError, OSError) as exc:
            raise StoreError(f"{self.location}: cannot read {STORE_FILE}: {exc}") from None
        if data is None:
            if not self.remote and (self.root / V1_MANIFEST).is_file():
                raise StoreError(f"{self.root} is a task store of format v1 (one manifest.json): re-export the "
                                 "backbone with `aot export backbone --overwrite` to upgrade it; it keeps the tasks")
            raise StoreError(f"{self.location}: no task store here ({STORE_FILE} missing); run `aot export backbone`")
        where = f"{self.location}/{STORE_FILE}"
        try:
            identity = parse_json(data, where)
            version = identity.get("format_version")
            return check_versioned(identity, where, STORE_FORMAT,
                                   version if version in READABLE_VERSIONS else STORE_VERSION, {"backbone": dict})
        except FormatError as exc:
            raise StoreError(str(exc)) from None

    def state(self) -> StoreState:
        """The raw index as of now (raises StoreError when it cannot be read)."""
        self.identity()
        try:
            return self.log.read_state()
        except (FormatError, BackendError, OSError) as exc:
            raise StoreError(f"{self.location}: the index cannot be read: {exc}") from None

    def last_read_state(self) -> StoreState:
        """The state of a remote store's index as this host last read it whole, and followed since
        (aot.serving.store.mirror); StoreError when it has no copy."""
        if self.mirror is None:
            raise StoreError(f"{self.location}: this host keeps no copy of the index")
        try:
            state = ChangeLog(self.mirror.local).read_state() if self.mirror.local.read(STORE_FILE) else None
        except (FormatError, BackendError, OSError) as exc:
            raise StoreError(f"{self.location}: this host's copy of the index cannot be read: {exc}") from None
        if state is None or state.generation == 0:
            raise StoreError(f"{self.location}: this host has not read the index before")
        return state

    def index(self) -> StoreIndex:
        index = StoreIndex()
        index.update(self.state(), None)
        return index

    def entries(self) -> Mapping[str, TaskEntry]:
        """Every task's entry, read-only (the index's EntryView: entries are parsed on first use)."""
        return self.index().entries

    def held_here(self, version: str, digests: dict[str, str] | None) -> bool:
        """Whether `version` can be read without a request to a remote store: a folder store's, or one this host's
        cache holds complete."""
        return self.cache is None or bool(digests) and self.cache.holds(folder_name(version), digests)

    def version_folder(self, version: str, digests: dict[str, str] | None = None) -> Path:
        """The local folder of a version: in the store's folder, or fetched from the remote store into the cache
        (every file checked against `digests`, which a remote version must have)."""
        check_version(version)
        if self.cache is None:
            return self.root / folder_name(version)
        if not digests:
            raise StoreError(f"{version}: a version in object storage is served only with its published digests")
        return self.cache.folder(folder_name(version), digests)
