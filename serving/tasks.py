"""A served task version and the registry each served step keeps, without torch.

A version folder `REPO/tasks/<name>@<id>/` is immutable:
    task.json               labels, metric, max length, pooling, head_activation, storage, method config, L, d, V,
                            source, dev
    head.safetensors        dense.weight [k, d], dense.bias, out.weight [n, k], out.bias (k: d, or the head's own
                            width); logits = out(f(dense(h))), f task.json's head_activation (tanh if absent)
    table.npy               fused: P for every token and layer, [V, L, d] fp16, token-major (memory-mapped)
    factors.safetensors     factored: FC w1 [L, d, r], b1 [L, r], w2 [L, r, d], b2 [L, d];
                            Kron w_left [L, a, r], w_mid [L, b, r], w_right [L, r*r, d]

Factored rows are computed by the store's rows graphs: training's own formulas (training.methods.aot_ptuning.layer, eval
mode: no dropout) exported to ONNX and run with ONNX Runtime; export checks served logits against PyTorch before
a task is published.
"""

from __future__ import annotations

import functools
import heapq
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from serving import protocol
from serving.digests import DigestError, verify_file
from serving.errors import RequestError
from serving.formats import FormatError, check_keys, read_json
from serving.labels import label_for
from serving.pool import RowPool
from serving.store import (EMBEDDINGS, RETIRED_GRACE, ROWS_DIR, STORAGES, Manifest, StoreError, StoreReader,
                           check_version, rows_graph_name, task_of)

_TASK_KEYS = {"labels": (list, type(None)), "max_length": int, "storage": str, "method": dict, "num_layers": int,
              "hidden_size": int, "vocab_size": int}


_erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has no erf; a head's dense output is small
# The activations a served head applies (training.model.HEAD_ACTIVATIONS, the same functions in torch).
HEAD_ACTIVATIONS = {"tanh": np.tanh, "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))}


@functools.lru_cache(maxsize=4)
def shared_embeddings(path: Path, stamp: tuple[int, int]) -> np.ndarray:
    """The store's E, memory-mapped once per process and shared by every factored FC task."""
    return np.load(path, mmap_mode="r")


@functools.lru_cache(maxsize=16)
def rows_session(path: Path, stamp: tuple[int, int]):
    """One ONNX Runtime session per rows graph and process, shared by every task of that formula. One thread: a
    batch's rows are small GEMMs, and the backbone's session owns the cores."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class FactoredRows:
    """A factored task's rows, computed by the store's rows graph for its formula (exporter.rows_export: training's
    own formula exported to ONNX) from its factors: sorted token ids -> [U, L, d] fp16, one session run."""

    def __init__(self, store_root: Path, method: dict, factors: dict[str, np.ndarray]):
        graph = Path(store_root) / ROWS_DIR / f"{rows_graph_name(method)}.onnx"
        if not graph.is_file():
            raise StoreError(f"the task store has no rows graph {ROWS_DIR}/{graph.name} for method "
                             f"{method.get('method')!r}: re-export the backbone (aot export backbone) to write it")
        st = graph.stat()
        self.session = rows_session(graph, (st.st_ino, st.st_mtime_ns))
        names = [i.name for i in self.session.get_inputs()]
        missing = [n for n in names if n not in factors and n not in ("e", "token_ids")]
        if missing:
            raise StoreError(f"factors.safetensors lacks {', '.join(missing)} (formula {rows_graph_name(method)})")
        self.feeds = {n: np.ascontiguousarray(factors[n], dtype=np.float32) for n in names if n in factors}
        self.embeddings = None
        if "e" in names:
            self.embeddings_path = Path(store_root) / EMBEDDINGS
            st = self.embeddings_path.stat()
            self.embeddings = shared_embeddings(self.embeddings_path, (st.st_ino, st.st_mtime_ns))
            self.embeddings_bytes = st.st_size

    def __call__(self, token_ids: np.ndarray) -> np.ndarray:
        feeds = dict(self.feeds)
        if self.embeddings is not None:
            guard_mapped(self.embeddings_path, self.embeddings_bytes, EMBEDDINGS)
            feeds["e"] = np.asarray(self.embeddings[token_ids], dtype=np.float32)
        else:
            feeds["token_ids"] = np.asarray(token_ids, dtype=np.int64)
        return self.session.run(None, feeds)[0]


def guard_mapped(path: Path, size: int, what: str) -> None:
    """Before touching a memory map: a file truncated under it would kill the process with SIGBUS (every task of
    the step failing), so a file shorter than when it was mapped is refused first (one stat, ~2 us)."""
    try:
        now = os.stat(path).st_size
    except OSError:
        now = -1
    if now < size:
        raise StoreError(f"{what} is {max(now, 0)} bytes, {size} when it was mapped: truncated or removed under the "
                         "server")


@dataclass
class ServedTask:
    name: str
    version: str  # the version folder `<name>@<id>`
    labels: list[str] | None
    max_length: int
    storage: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    head: dict[str, np.ndarray]
    meta: dict = field(default_factory=dict)  # task.json: source, metric, dev score, method, ...
    table: np.ndarray | None = None  # fused: memory-mapped [V, L, d]
    compute_rows: Callable[[np.ndarray], np.ndarray] | None = None  # factored
    digests: dict[str, str] | None = None  # published digests (None: exported before digests, unverified)
    table_path: Path | None = None
    table_bytes: int = 0
    table_stamp: tuple | None = None  # (inode, size, mtime) of table.npy when it last matched its digest

    def rows(self, token_ids: np.ndarray) -> np.ndarray:
        """Rows of P for sorted distinct token ids, [U, L, d] fp16, from the task's own storage (no pool).
        Fused: only these rows are read from disk; factored: computed in one matmul per layer stack."""
        if self.table is not None:
            guard_mapped(self.table_path, self.table_bytes, f"{self.version}/table.npy")
            return np.ascontiguousarray(self.table[token_ids], dtype=protocol.ROWS_DTYPE)
        return self.compute_rows(token_ids)

    def check_table(self) -> None:
        """Before a request reads the fused table: it is the file that was published. The digest is computed on
        the first request and again only when the file changes on disk (a stat per request otherwise)."""
        if self.table is None:
            return
        try:
            st = os.stat(self.table_path)
        except OSError:
            raise StoreError(f"{self.version}: table.npy is missing") from None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self.table_stamp:
            return
        if st.st_size != self.table_bytes:
            raise StoreError(f"{self.version}: table.npy is {st.st_size} bytes, expected {self.table_bytes} "
                             "(truncated or replaced)")
        try:
            verify_file(self.table_path, self.digests, self.version)
        except DigestError as exc:
            raise StoreError(str(exc)) from None
        self.table_stamp = stamp

    @property
    def pooling(self) -> str:
        """Which pooled state the head reads (versions exported before pooling was recorded read the first token)."""
        return self.meta.get("pooling", protocol.POOLING_BEFORE_V3)

    def logits(self, pooled: np.ndarray) -> np.ndarray:
        """The task head (training.model.ClassificationHead in eval mode) on the task's pooling: pooled [B, P, d]
        (every pooling, protocol.POOLINGS) -> out(f(dense(h))) [B, n], f the task's head_activation."""
        chosen = pooled[:, protocol.pooling_row(self.pooling)].astype(np.float32)
        activation = HEAD_ACTIVATIONS[self.meta.get("head_activation", "tanh")]
        h = activation(chosen @ self.head["dense.weight"].T + self.head["dense.bias"]).astype(np.float32)
        return (h @ self.head["out.weight"].T + self.head["out.bias"]).astype(protocol.LOGITS_DTYPE)

    def label(self, logits: np.ndarray) -> str:
        return label_for(self.labels, logits)

    def describe(self) -> dict:
        """What `aot tasks` shows of a served task."""
        method = self.meta.get("method", {})
        return {"name": self.name, "version": self.version, "storage": self.storage, "labels": self.labels,
                "max_length": self.max_length, "method": method.get("method"), "metric": self.meta.get("metric"),
                "dev": self.meta.get("dev"), "source": self.meta.get("source"),
                "verified": self.digests is not None}


PARTS = ("meta", "head", "rows", "all")
KNOWN_IN_MESSAGE = 10  # task names an unknown task's 404 suggests


def load_task_version(folder: Path, version: str, store_root: Path, parts: str = "all",
                      digests: dict[str, str] | None = None) -> ServedTask:
    """Load a version folder (`folder` may still be an export's temporary; `version` is the name it will have).
    `parts`: what a step needs: "meta" (the tokenizer, task_list), "head" (the head step), "rows" (the lookup: the
    table or factors, not the head), "all". With 1,000 tasks a head is 0.6 MB (MiniLM) a step need not hold.
    `digests` (the manifest's): every file read is checked against them; the fused table on its first use
    (ServedTask.check_table), so that loading many tasks does not hash every table at once."""
    def verified(name: str) -> Path:
        try:
            verify_file(folder / name, digests, version)
        except DigestError as exc:
            raise StoreError(str(exc)) from None
        return folder / name

    try:
        meta = check_keys(read_json(verified("task.json")), _TASK_KEYS, f"{version}/task.json")
    except FormatError as exc:
        raise StoreError(str(exc).replace(str(folder), version)) from None
    if meta["storage"] not in STORAGES:
        raise StoreError(f"{version}: unknown storage {meta['storage']!r}")
    try:
        protocol.pooling_row(meta.get("pooling", protocol.POOLING_BEFORE_V3))
    except ValueError as exc:
        raise StoreError(f"{version}: {exc}") from None
    if meta.get("head_activation", "tanh") not in HEAD_ACTIVATIONS:
        raise StoreError(f"{version}: unknown head_activation {meta['head_activation']!r}: expected one of "
                         f"{', '.join(HEAD_ACTIVATIONS)}")
    head = load_file(verified("head.safetensors")) if parts in ("head", "all") else {}
    task = ServedTask(task_of(version), version, meta["labels"], meta["max_length"], meta["storage"],
                      meta["num_layers"], meta["hidden_size"], meta["vocab_size"], head, meta, digests=digests)
    if parts not in ("rows", "all"):
        return task
    shape = (task.vocab_size, task.num_layers, task.hidden_size)
    if task.storage == "fused":
        task.table_path = folder / "table.npy"
        task.table = np.load(task.table_path, mmap_mode="r")  # refuses a file shorter than its header says
        if task.table.shape != shape or task.table.dtype != protocol.ROWS_DTYPE:
            raise StoreError(f"{version}: table.npy is {task.table.dtype} {task.table.shape}, expected fp16 {shape}")
        task.table_bytes = task.table_path.stat().st_size
    else:
        method = meta["method"]
        if method.get("method") not in ("fc", "kron"):
            raise StoreError(f"{version}: method {method.get('method')!r} cannot be served from factors")
        task.compute_rows = FactoredRows(store_root, method, load_file(verified("factors.safetensors")))
        probe = task.compute_rows(np.array([0], dtype=np.int64))
        if probe.shape != (1,) + shape[1:]:
            raise StoreError(f"{version}: factors give rows of shape {probe.shape[1:]}, expected {shape[1:]}")
    return task


class TaskRegistry:
    """The tasks of a store as one served step sees them.

    Names resolve through the last good manifest (re-read when it changes: a stat per batch, no restart); a manifest
    that cannot be read is reported (`on_manifest_error`) and the last good one stays in use. Versions load on
    demand and stay while the manifest names them or they served a request in the last `grace` seconds, so a
    request pinned to a version by the first step is served by that version even after a re-export.
    A version that fails to load is kept as its error: its requests fail with that message, the others serve.
    """

    def __init__(self, store_root: str | Path, parts: str = "all", grace: float = 120.0,
                 on_manifest_error: Callable[[str], None] | None = None, pool: RowPool | None = None,
                 on_task_error: Callable[[str, str], None] | None = None, pool_fused: bool = True):
        """`pool`: keep the rows of the current versions in this pool (serving.pool); versions that leave the
        manifest are detached from it at once (a request still pinned to one reads its storage directly).
        `pool_fused` False: only factored versions' rows go in the pool, fused tables are read through their memory
        maps (a step of several instances on CPU: the page cache shares one copy of each table between them, where
        each instance's pool, holding its share of the budget, would hold a copy of its own).
        `on_task_error(version, message)`: a version failed to load or was found damaged (log it, count it)."""
        self.store = StoreReader(store_root)
        self.pool, self.pool_fused = pool, pool_fused
        if parts not in PARTS:
            raise ValueError(f"parts={parts!r}: expected one of {', '.join(PARTS)}")
        self.parts, self.grace = parts, grace
        self.on_manifest_error = on_manifest_error
        self.on_task_error = on_task_error
        self.manifest_error: str | None = None
        self._stamp = None
        self._manifest = Manifest({}, {})
        self._current: set[str] = set()
        self._entries: dict = {}
        self._entry_errors: dict[str, str] = {}
        self._audit: dict[str, tuple[tuple, str | None]] = {}  # version -> (files' stamps, damage found by audit())
        self._versions: dict[str, ServedTask | StoreError] = {}
        self._last_used: dict[str, float] = {}
        self._lock = threading.RLock()
        self.refresh()

    def refresh(self) -> None:
        stamp = self.store.manifest_stamp()
        if stamp == self._stamp:
            return
        with self._lock:
            try:
                manifest = self.store.manifest()
            except StoreError as exc:
                self._stamp = stamp
                self.manifest_error = str(exc)
                if self.on_manifest_error is not None:
                    self.on_manifest_error(self.manifest_error)
                return
            self._entries, self._entry_errors, self._stamp = manifest.entries, manifest.errors, stamp
            self._manifest = manifest
            self._current = {e.folder for e in self._entries.values()}
            self.manifest_error = None
            current = {e.folder for e in self._entries.values()}
            now = time.monotonic()
            for version in list(self._versions):
                if version in current:
                    continue
                if self.pool is not None:
                    self.pool.detach(version)
                if now - self._last_used.get(version, 0.0) > self.grace:
                    del self._versions[version]
                    self._last_used.pop(version, None)
            for version in current - set(self._versions):
                self._load(version)
            if self.pool is not None:
                for version in current:
                    task = self._versions.get(version)
                    if isinstance(task, ServedTask) and (self.pool_fused or task.storage != "fused"):
                        self.pool.attach(version, task.rows)

    def check(self) -> dict[str, str]:
        """Load every current version whole (table or factors, head) without keeping it: task name -> why its
        requests will fail. What `aot serve` reports at start-up, in constant memory whatever the task count."""
        errors = dict(self._entry_errors)
        for name, entry in self._entries.items():
            loaded = self._load(entry.folder, "all", keep=False)
            if isinstance(loaded, StoreError):
                errors[name] = str(loaded)
        return errors

    def _load(self, version: str, parts: str | None = None, keep: bool = True) -> ServedTask | StoreError:
        try:
            task: ServedTask | StoreError = load_task_version(self.store.version_folder(version), version,
                                                              self.store.root, parts or self.parts,
                                                              self._manifest.digests(version))
        except Exception as exc:  # noqa: BLE001 - a corrupt task must not take the others down
            task = self._damaged(version, exc)
        if keep:
            self._versions[version] = task
        return task

    def _damaged(self, version: str, exc: BaseException) -> StoreError:
        detail = str(exc).replace(str(self.store.root) + "/", "")
        error = StoreError(f"task {task_of(version)!r} ({version}) is corrupt: {type(exc).__name__}: {detail}")
        if self.on_task_error is not None:
            self.on_task_error(version, str(error))
        return error

    def known(self, version: str) -> bool:
        """A version the manifest names as current, or retired less than RETIRED_GRACE ago (a request may be pinned
        to it): after that it is gone, even before the next export deletes its folder."""
        if version in self._current:
            return True
        retired = self._manifest.retired.get(version)
        return retired is not None and time.time() - retired < RETIRED_GRACE

    def audit(self) -> dict[str, str]:
        """Check every current version's task.json against its digest, and any of its files once it changes on disk
        (stats otherwise; the other files are checked by the steps that load them): the task_list step runs it in
        the background, so `aot tasks` names a task damaged under the server before a request meets it. Returns
        task name -> damage."""
        found = {}
        for name, entry in list(self._entries.items()):
            folder = self.store.version_folder(entry.folder)
            try:
                stamps = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()))
            except OSError as exc:
                stamps = (str(exc),)
            seen = self._audit.get(entry.folder)
            if seen is None or seen[0] != stamps:
                # First sighting: task.json only, what this step reads. The head, factors and table are hashed by
                # the steps that load them (the fused step, or the head and backbone steps, when they load or first
                # map them); hashing them here too read every head twice at each start (0.57 MB a task: 5.7 GB for
                # 10,000 tasks). Any file that changes afterwards is hashed again here, whichever it is.
                changed = set(entry.digests or ()) if seen is not None else {"task.json"} & set(entry.digests or ())
                damage = None
                try:
                    for file in sorted(changed):
                        verify_file(folder / file, entry.digests, entry.folder)
                except (DigestError, OSError) as exc:
                    damage = f"task {name!r} ({entry.folder}) is corrupt: {exc}"
                seen = (stamps, damage)
                self._audit[entry.folder] = seen
            if seen[1]:
                found[name] = seen[1]
        return found

    def names(self) -> list[str]:
        """Every task the manifest names, loadable or not."""
        return sorted(set(self._entries) | set(self._entry_errors))

    def errors(self) -> dict[str, str]:
        """Task name -> why its requests fail (a bad manifest entry, a version that does not load, or a file that
        audit() found damaged)."""
        errors = dict(self._entry_errors)
        for name, entry in self._entries.items():
            loaded = self._versions.get(entry.folder)
            if isinstance(loaded, StoreError):
                errors[name] = str(loaded)
            elif entry.folder in self._audit and self._audit[entry.folder][1]:
                errors[name] = self._audit[entry.folder][1]
        return errors

    def served(self) -> dict[str, ServedTask]:
        """The tasks that serve now, by name."""
        return {n: t for n, e in self._entries.items() if isinstance(t := self._versions.get(e.folder), ServedTask)}

    def resolve(self, name: str) -> ServedTask:
        """The current version of task `name`, or exactly the version `name@<id>` names (serving.store
        check_task_spec) if the manifest still holds it: the first step pins it for the request."""
        if "@" in name:
            return self.version(name)
        entry = self._entries.get(name)
        if entry is None:
            if name in self._entry_errors:
                raise RequestError(self._entry_errors[name], "unavailable")
            served = self.served()
            first = heapq.nsmallest(KNOWN_IN_MESSAGE, served)  # bounded: an answer to a typo, not a listing
            known = ", ".join(first) or "(none)"
            if len(served) > KNOWN_IN_MESSAGE:
                known += f", ... ({len(served) - KNOWN_IN_MESSAGE} more: aot tasks lists them)"
            raise RequestError(f"unknown task {name[:200]!r}; known tasks: {known}", "not_found")
        return self.version(entry.folder)

    def version(self, version: str) -> ServedTask:
        """Exactly this task version (loaded on demand: version folders are immutable)."""
        try:
            check_version(version)
        except StoreError as exc:
            raise RequestError(str(exc)) from None
        with self._lock:
            task = self._versions.get(version)
            if not self.known(version) or task is None and not self.store.version_folder(version).is_dir():
                raise RequestError(f"task version {version!r} is not in the store (removed, or never exported)",
                                   "not_found")
            if task is None:
                task = self._load(version)
            if isinstance(task, ServedTask) and task.table is not None:
                try:
                    task.check_table()
                except StoreError as exc:  # damaged under the server: refused from now on, its pool rows dropped
                    task = self._versions[version] = self._damaged(version, exc)
                    if self.pool is not None:
                        self.pool.detach(version)
            self._last_used[version] = time.monotonic()
        if isinstance(task, StoreError):
            raise RequestError(str(task), "unavailable")
        return task


    def pool_slots(self, requests: list[tuple[ServedTask, np.ndarray]]) -> list[np.ndarray | None]:
        """Pool slots for a batch's (task, sorted distinct token ids), its misses filled together; None for a
        request the pool does not hold (a version that left the manifest, no pool, or a batch that needs more rows
        than the whole pool): its rows come from storage (`task.rows`)."""
        if self.pool is None:
            return [None] * len(requests)
        with self._lock:
            pooled = [i for i, (task, _) in enumerate(requests) if self.pool.holds(task.version)]
            try:
                slots = self.pool.slots_many([(requests[i][0].version, requests[i][1]) for i in pooled])
            except MemoryError:
                pooled, slots = [], []
        out: list[np.ndarray | None] = [None] * len(requests)
        for i, s in zip(pooled, slots):
            out[i] = s
        return out

    def rows_many(self, requests: list[tuple[ServedTask, np.ndarray]],
                  indexes: list[np.ndarray] | None = None) -> list:
        """Rows for a batch's (task, sorted distinct token ids), [U, L, d] fp16 each: gathered where the pool keeps
        them (a numpy array, or a tensor on the pool's device), or read or computed from storage (numpy). With
        `indexes` (each request's token_index), each token's row instead, [S, L, d]: the dense bias, gathered from
        the pool's slots in one step."""
        with self._lock:
            slots = self.pool_slots(requests)
            out = []
            for s, (task, ids), index in zip(slots, requests, indexes or [None] * len(requests)):
                if s is not None:
                    out.append(self.pool.gather(s if index is None else s[index]))
                else:
                    rows = task.rows(ids)
                    out.append(rows if index is None else protocol.dense_bias(rows, index))
            return out


def token_index(input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct tokens of one sequence (sorted) and, for each token, its row among them (padding: row 0)."""
    valid = attention_mask.astype(bool)
    unique, inverse = np.unique(input_ids[valid], return_inverse=True)
    index = np.zeros(input_ids.shape[0], dtype=protocol.INDEX_DTYPE)
    index[valid] = inverse
    return unique, index


def lookup(task: ServedTask, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The AoT lookup for one sequence from the task's storage: distinct tokens' rows (flat fp16), row numbers."""
    unique, index = token_index(input_ids, attention_mask)
    return task.rows(unique).reshape(-1), index
