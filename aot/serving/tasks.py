"""A served task version, without torch: loading and verifying its folder, its rows and its head (the registry a
step keeps of the store's versions: aot.serving.task_registry).

A version folder `REPO/tasks/<name>@<id>/` is immutable:
    task.json               kind, labels, metric, max length, pooling, head_activation, storage, method config, L, d,
                            V, source, dev (+ threshold: multilabel; normalize: embedding). Without `kind` (exported
                            before kinds): a classifier, or a regressor if it has no labels
    head.safetensors        a pooled kind's: dense.weight [k, d], dense.bias, out.weight [n, k], out.bias (k: d, or
                            the head's own width); logits = out(f(dense(h))), f task.json's head_activation (tanh if
                            absent). A token task's: out.weight [n, d], out.bias, on every token's state. An
                            embedding task has none: its vector is its pooled state
    table.npy               fused: P for every token and layer, [V, L, d] fp16, token-major (read by verified
                            blocks: aot.serving.store.table_blocks)
    table.blocks            fused: the sha256 of each block of the table's rows (written at publish; derived on a
                            version's first load on the host if it was published without it)
    factors.safetensors     factored: FC w1 [L, d, r], b1 [L, r], w2 [L, r, d], b2 [L, d];
                            Kron w_left [L, a, r], w_mid [L, b, r], w_right [L, r*r, d]

A version's files but the table are read once, into a sealed copy checked against their published digests
(aot.serving.store.sealed) that the host's step processes share (aot.serving.store.host_cache): heads and factors are
arrays over that copy, and nothing a request reads can be changed after it was hashed.

Factored rows are computed by the store's rows graphs: training's own formulas (aot.training.methods.aot_ptuning.layer,
eval mode: no dropout) exported to ONNX and run with ONNX Runtime; export checks served logits against PyTorch before
a task is published.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aot.serving import protocol
from aot.serving.formats import FormatError, check_keys, parse_json
from aot.serving.kinds import DEFAULT_THRESHOLD, NONE, KindSpec, kind_of, kind_spec
from aot.serving.store.digests import DigestError
from aot.serving.store.host_cache import HostCache
from aot.serving.store.layout import EMBEDDINGS, FACTORS, HEAD, ROWS_DIR, TABLE, TABLE_BLOCKS, TASK_JSON
from aot.serving.store.reader import STORAGES, StoreError, rows_graph_name, task_of
from aot.serving.store.sealed import SealedVersion
from aot.serving.store.table_blocks import TableBlocks, VerifiedTable, block_list

_TASK_KEYS = {"labels": (list, type(None)), "max_length": int, "storage": str, "method": dict, "num_layers": int,
              "hidden_size": int, "vocab_size": int}


# The activations a served head may apply (aot.serving.heads computes them; aot.training.model.HEAD_ACTIVATIONS in
# torch)
HEAD_ACTIVATION_NAMES = ("tanh", "gelu")


def mapped_array(path: Path) -> np.ndarray:
    """A .npy file memory-mapped read-only, as a plain array over the map: np.memmap's indexing runs Python code on
    every lookup, and the served lookups index per request (docs/benchmarks.md, "int8 on CPU")."""
    return np.asarray(np.load(path, mmap_mode="r"))


@functools.lru_cache(maxsize=4)
def shared_embeddings(path: Path, stamp: tuple[int, int]) -> np.ndarray:
    """The store's E, memory-mapped once per process and shared by every factored FC task."""
    return mapped_array(path)


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
    """A factored task's rows, computed by the store's rows graph for its formula (aot.exporter.rows_export: training's
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
            raise StoreError(f"{FACTORS} lacks {', '.join(missing)} (formula {rows_graph_name(method)})")
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
    the step failing), so a file shorter than when it was mapped is refused first (one stat: cheap beside the read,
    docs/benchmarks.md, "Figures behind the serving code")."""
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
    table: VerifiedTable | None = None  # fused: [V, L, d], read by verified blocks
    compute_rows: Callable[[np.ndarray], np.ndarray] | None = None  # factored
    digests: dict[str, str] | None = None  # published digests (None: exported before digests, unverified)
    copy: SealedVersion | None = None  # the sealed copy of its files the head and factors are arrays over
    # told when a read finds the table damaged; returns the error the read raises (the registry's: the refusal)
    on_damage: Callable[[Exception], Exception] | None = None

    def rows(self, token_ids: np.ndarray) -> np.ndarray:
        """Rows of P for sorted distinct token ids, [U, L, d] fp16, from the task's own storage (no pool).
        Fused: only the blocks of the table that hold them are read, and hashed (damaged: StoreError, or what
        `on_damage` returns); factored: computed in one matmul per layer stack."""
        if self.table is None:
            return self.compute_rows(token_ids)
        try:
            return self.table.rows(token_ids)
        except (DigestError, OSError) as exc:
            raise (self.on_damage(exc) if self.on_damage is not None else StoreError(str(exc))) from None

    def check_table(self) -> None:
        """The whole fused table against its published digest and its block list (`aot export verify`, repair, a
        refused version's re-check): StoreError when it differs."""
        if self.table is None:
            return
        try:
            self.table.check(self.digests.get(TABLE) if self.digests else None)
        except (DigestError, OSError) as exc:
            raise StoreError(f"{self.version}: {exc}" if not str(exc).startswith(self.version) else str(exc)) from None

    @property
    def pooling(self) -> str:
        """Which pooled state the head reads (versions exported before pooling was recorded read the first token)."""
        return self.meta.get("pooling", protocol.POOLING_BEFORE_V3)

    @functools.cached_property
    def kind(self) -> str:
        """aot.serving.kinds.KINDS; a version exported before kinds is a classifier (a regressor without labels). Read
        on every request by several stages: derived once (meta does not change)."""
        return kind_of(self.meta)

    @functools.cached_property
    def spec(self) -> KindSpec:
        """Its kind's spec (aot.serving.kinds): its head, its answer and LABEL; read per item of a batch's answers,
        derived once as `kind` is."""
        return kind_spec(self.kind)

    @property
    def reads_tokens(self) -> bool:
        """Whether its head reads every token's final state (a pooled state otherwise)."""
        return self.spec.reads_tokens

    @property
    def has_pair(self) -> bool | None:
        """Whether the task was trained on text pairs (None: a version exported before it was recorded)."""
        return self.meta.get("has_pair")

    @property
    def threshold(self) -> float:
        """A multi-label task's: the sigmoid a label must reach to be answered."""
        value = self.meta.get("threshold")
        return DEFAULT_THRESHOLD if value is None else float(value)

    @functools.cached_property
    def label_bytes(self) -> np.ndarray:
        """The labels as UTF-8 bytes ([n] object): a batch's LABEL is this array indexed by its arg-maxes."""
        return np.array([label.encode() for label in self.labels or ()], dtype=np.object_)

    def resident_bytes(self) -> int:
        """The memory this version holds of its own: its sealed copy unless the host's cache holds it (then the host
        counts it, once for every process; a fused table's rows are read into the pool or per request)."""
        return 0 if self.copy is None or self.copy.shared else self.copy.size


PARTS = ("meta", "head", "rows", "all")


def load_task_version(folder: Path | Callable[[], Path], version: str, store_root: Path, parts: str = "all",
                      digests: dict[str, str] | None = None, cache: HostCache | None = None) -> ServedTask:
    """Load a version (`folder`, or a function that returns it: called only when its files must be read, and may
    fetch them; `folder` may still be an export's temporary, `version` is the name it will have).
    `parts`: what a step needs: "meta" (the tokenizer, task_list), "head" (the head step), "rows" (the lookup: the
    table or factors, not the head), "all".
    `digests` (the manifest's): the version's files are read once into a sealed copy and checked there against them
    (aot.serving.store.sealed); `cache`: the host's copies (aot.serving.store.host_cache), where another process may
    have made it already (no read, no hash) and where this one is shared; None: a copy of this process's own. A fused
    table's rows are read by verified blocks (aot.serving.store.table_blocks)."""
    def where() -> Path:
        return Path(folder() if callable(folder) else folder)

    def sources() -> dict[str, Path | bytes]:
        local = where()
        if digests is not None:
            found = {name: local / name for name in digests if name != TABLE}
            if TABLE in digests and TABLE_BLOCKS not in digests:  # published before block lists
                found[TABLE_BLOCKS] = _derived_blocks(local, digests[TABLE])
            return found
        found = {p.name: p for p in local.iterdir() if p.name != TABLE}
        if (local / TABLE).exists():
            found[TABLE_BLOCKS] = _derived_blocks(local, None)
        return found

    try:  # a fetch that fails (an OSError of the registry's) is not caught here: the store is retried
        copy = (cache or HostCache(None, 0)).get(version, digests, sources)
    except DigestError as exc:
        raise StoreError(f"{version}: {exc}" if not str(exc).startswith(version) else str(exc)) from None
    if TASK_JSON not in copy.files:
        raise StoreError(f"{version}: task.json is missing")
    try:
        meta = check_keys(parse_json(bytes(copy.view(TASK_JSON)), f"{version}/{TASK_JSON}"), _TASK_KEYS,
                          f"{version}/task.json")
    except FormatError as exc:
        raise StoreError(str(exc)) from None
    if meta["storage"] not in STORAGES:
        raise StoreError(f"{version}: unknown storage {meta['storage']!r}")
    try:
        protocol.pooling_row(meta.get("pooling", protocol.POOLING_BEFORE_V3))
    except ValueError as exc:
        raise StoreError(f"{version}: {exc}") from None
    if meta.get("head_activation", "tanh") not in HEAD_ACTIVATION_NAMES:
        raise StoreError(f"{version}: unknown head_activation {meta['head_activation']!r}: expected one of "
                         f"{', '.join(HEAD_ACTIVATION_NAMES)}")
    try:
        kind = kind_of(meta)
    except ValueError as exc:
        raise StoreError(f"{version}: {exc}") from None
    head = _tensors(copy, HEAD) if parts in ("head", "all") and kind_spec(kind).head != NONE else {}
    task = ServedTask(task_of(version), version, meta["labels"], meta["max_length"], meta["storage"],
                      meta["num_layers"], meta["hidden_size"], meta["vocab_size"], head, meta, digests=digests,
                      copy=copy)
    if parts not in ("rows", "all"):
        return task
    shape = (task.vocab_size, task.num_layers, task.hidden_size)
    if task.storage == "fused":
        if TABLE_BLOCKS not in copy.files:
            raise StoreError(f"{version}: {TABLE} is missing")
        try:
            task.table = VerifiedTable(where() / TABLE, TableBlocks.parse(copy.view(TABLE_BLOCKS), TABLE_BLOCKS),
                                       version)
        except FileNotFoundError:
            raise StoreError(f"{version}: {TABLE} is missing") from None
        except (DigestError, OSError) as exc:  # a link, device or FIFO in its place (BackendError), or damaged
            detail = str(exc).replace(str(where() / TABLE), TABLE)
            raise StoreError(detail if detail.startswith(version) else f"{version}: {detail}") from None
        if task.table.shape != shape or task.table.dtype != protocol.ROWS_DTYPE:
            raise StoreError(f"{version}: {TABLE} is {task.table.dtype} {task.table.shape}, expected fp16 {shape}")
    else:
        method = meta["method"]
        if method.get("method") not in ("fc", "kron"):
            raise StoreError(f"{version}: method {method.get('method')!r} cannot be served from factors")
        task.compute_rows = FactoredRows(store_root, method, _tensors(copy, FACTORS))
        probe = task.compute_rows(np.array([0], dtype=np.int64))
        if probe.shape != (1,) + shape[1:]:
            raise StoreError(f"{version}: factors give rows of shape {probe.shape[1:]}, expected {shape[1:]}")
    return task


def _derived_blocks(folder: Path, digest: str | None) -> bytes:
    """The block list of a table published without one (read whole, checked against `digest`)."""
    try:
        return block_list(folder / TABLE, digest)
    except FileNotFoundError:
        raise DigestError(f"{TABLE} is missing") from None
    except OSError as exc:  # a link, device or FIFO in its place (BackendError), or unreadable
        raise DigestError(f"{TABLE}: {exc}".replace(str(folder / TABLE), TABLE)) from None


def _tensors(copy: SealedVersion, name: str) -> dict[str, np.ndarray]:
    if name not in copy.files:
        raise StoreError(f"{copy.version}: {name} is missing")
    try:
        return copy.tensors(name)
    except ValueError as exc:
        raise StoreError(str(exc)) from None


def token_index(input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct tokens of one sequence (sorted) and, for each token, its row among them (padding: row 0)."""
    valid = attention_mask.astype(bool)
    unique, inverse = np.unique(input_ids[valid], return_inverse=True)
    index = np.zeros(input_ids.shape[0], dtype=protocol.INDEX_DTYPE)
    index[valid] = inverse
    return unique, index
