"""`aot export task`: fuse P (or keep its factors), write the head, validate, and publish atomically."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from aot.exporter.accuracy_gate import check_served_accuracy
from aot.exporter.compose_env import keep_admin_key_private
from aot.exporter.cpu_engine import CpuEngine
from aot.exporter.task_record import answer_meta, head_arrays, task_record
from aot.exporter.task_validation import LOGITS_TOLERANCE, ValidationError, validate_tasks, validation_engine
from aot.serving import protocol
from aot.serving.kinds import NONE
from aot.serving.repository import RepositoryInfo, read_repository
from aot.serving.store.compatibility import check_same_labels, current_version
from aot.serving.store.layout import FACTORS, HEAD, TABLE, TASK_JSON
from aot.serving.store.reader import STORAGES, StoreError, check_task_name
from aot.serving.store.tenants import tenant_of
from aot.serving.store.writer import Publication, StoreState, TaskStore
from aot.serving.tokenization import Tokenization
from aot.training.artifact import TaskArtifact, check_fingerprint, read_task
from aot.training.backbone import load_backbone
from aot.training.factory import load_task
from aot.training.method_registry import method_spec
from aot.training.methods.aot_ptuning.model import AotBody
from aot.training.methods.aot_ptuning.peft_model import AotModel
from aot.training.multitask import MultiTaskModel
from aot.training.predict import Predictor


@dataclass
class TaskExportReport:
    name: str
    storage: str
    folder: str
    bytes_on_disk: int
    fused_bytes: int
    max_abs_logit_diff: float
    seconds: float
    storage_advice: dict
    served_dev: dict | None = None  # int8 repositories: the dev score through the served engine (accuracy_gate)
    notes: list[str] = field(default_factory=list)  # what is said of the version (a dev score below the replaced one's)


@contextlib.contextmanager
def _writing(name: str, path: Path) -> Iterator[None]:
    """A failed write of `path` (a full disk) as one OSError naming the task and the file: safetensors raises an
    error of its own, which `aot` would print as a traceback."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise OSError(f"task {name!r}: cannot write {path.name} ({reason}); nothing was published") from None


def _write_fused(body: AotBody, path: Path, vocab: int, chunk: int = 2048, progress: bool = True) -> None:
    """P for the whole vocabulary, token-major [V, L, d] fp16, as a .npy written chunk by chunk.

    Plain writes, not a memory map of a sparse file: a full disk then fails a write with ENOSPC (a clear error,
    and the caller removes the folder) instead of killing the process with SIGBUS."""
    L, d = body.biased.num_layers, body.biased.hidden_size
    header = {"descr": np.lib.format.dtype_to_descr(protocol.ROWS_DTYPE), "fortran_order": False,
              "shape": (vocab, L, d)}
    with open(path, "wb") as f, torch.no_grad():
        np.lib.format.write_array_header_2_0(f, header)
        for start in tqdm(range(0, vocab, chunk), desc="fuse P", unit="chunk", disable=not progress):
            ids = torch.arange(start, min(start + chunk, vocab))
            f.write(body.rows(ids).float().numpy().astype(protocol.ROWS_DTYPE).tobytes())


def storage_advice(repo: RepositoryInfo, name: str, fused_bytes: int, factored_bytes: int,
                   tasks_in_store: int | None = None) -> dict:
    """What a task costs in each storage and, with the repository's pool budget, how many such tasks stay fully
    resident; what `auto` picks and why (`auto_reason`, said at every publish). In object storage: factored, always,
    since every replica downloads what a task stores and a fused table is ~80x its factors (MiniLM: 134.7 MiB against
    1.7 MiB); a factored task fully resident in the pool serves as fast as a fused one (docs/benchmarks.md, "Many
    tasks on one engine: the task pool"). In a folder: fused while every task of the store (this one included) fits
    resident, so at most the pool's worth of tables is ever stored fused, then factored: beyond the pool, fused
    tables only cost disk and page cache. `tasks_in_store`: the count with this task (default: the store's other tasks and this one)."""
    pool = repo.options.pool_bytes
    resident = pool // fused_bytes if fused_bytes else 0
    store = TaskStore.of(repo)
    if tasks_in_store is None:
        tasks_in_store = len([n for n in store.entries() if n != name]) + 1
    sizes = f"{_size(factored_bytes)} factored, {_size(fused_bytes)} fused"
    if store.remote:
        auto, reason = "factored", (f"{sizes}: the store is in object storage, where every replica downloads what a "
                                    "task stores")
    elif tasks_in_store <= resident:
        auto, reason = "fused", (f"{sizes}: the store's {tasks_in_store} task(s) fit the task pool ({_size(pool)} "
                                 f"keeps {resident} fused tables resident); from task {resident + 1} on, auto stores "
                                 "tasks factored")
    else:
        auto, reason = "factored", (f"{sizes}: the store holds {tasks_in_store} tasks and the task pool "
                                    f"({_size(pool)}) keeps {resident} fused tables resident; tasks exported before "
                                    "keep their storage")
    return {"fused_bytes": fused_bytes, "factored_bytes": factored_bytes, "pool_bytes": pool,
            "tasks_resident_in_pool": int(resident), "tasks_in_store": tasks_in_store, "auto": auto,
            "auto_reason": reason}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def export_task(task_dir: str | Path, repo_dir: str | Path, name: str, storage: str = "auto",
                progress: bool = True, keep: int | None = None, allowed_drop: float | None = None,
                dev_data: str | Path | None = None, accept_small_dev: bool = False,
                allow_label_change: bool = False) -> TaskExportReport:
    """Export one task and publish it. `storage`: fused, factored, or auto (see storage_advice). `keep`: versions
    of the task to keep, this one included (None: the task's policy, else aot.serving.store.reader.DEFAULT_KEEP). On an
    int8 repository the task must keep its dev score within `allowed_drop` points (0.5 by default) of its fp32 score,
    scored on `dev_data` (default: its training data's dev split), of at least the gate's minimum size unless
    `accept_small_dev`: aot.exporter.accuracy_gate. A task whose current version has other labels, another kind or
    pair-ness is refused unless `allow_label_change` (aot.serving.store.compatibility)."""
    exporter = TaskExporter(repo_dir, progress, allow_label_change)
    written = exporter.write(task_dir, name, storage, allowed_drop=allowed_drop, dev_data=dev_data,
                             accept_small_dev=accept_small_dev)
    return exporter.publish([written], keep)[0]


@dataclass
class WrittenTask:
    """A task version written and validated, not yet published."""

    name: str
    folder: Path
    storage: str
    fused_bytes: int
    max_abs_logit_diff: float
    seconds: float
    advice: dict
    bytes_on_disk: int
    served_dev: dict | None = None  # int8 repositories: aot.exporter.accuracy_gate's result
    model: AotModel | None = field(default=None, repr=False)  # the PyTorch task, until `validate` has checked it


class TaskExporter:
    """Exports tasks into one repository: the backbone, tokenizer and validation engine loaded once for all."""

    def __init__(self, repo_dir: str | Path, progress: bool = True, allow_label_change: bool = False):
        self.repo = read_repository(repo_dir)
        self.store = TaskStore.of(self.repo)
        self.store.identity()
        self.progress = progress
        self.allow_label_change = allow_label_change
        self._state: StoreState | None = None  # the store's index, read once by check() (the publish checks again)
        self._backbone = None
        self._engine = None
        self._tokens = None
        self._reference: MultiTaskModel | None = None  # the PyTorch tasks validate() checks against
        self._cpu_engine: CpuEngine | None = None  # an int8 repository's served engine, for the accuracy gate

    def check(self, task_dir: str | Path, name: str, storage: str) -> TaskArtifact:
        """Every refusal that needs no backbone: the name, the storage, the artifact against the repository."""
        repo = self.repo
        check_task_name(name)
        if self._state is None:
            self._state = self.store.state()
        if tenant_of(name) is not None:
            if tenant_of(name) not in self._state.tenants:
                raise StoreError(f"no tenant {tenant_of(name)!r} in the task store of {repo.path}: create it first "
                                 f"(aot export tenant create {tenant_of(name)} --repo {repo.path})")
        if storage not in STORAGES + ("auto",):
            raise StoreError(f"unknown storage {storage!r}: expected auto, {', '.join(STORAGES)}")
        artifact = read_task(task_dir)
        method = artifact.config["method"]["method"]
        if not method_spec(method).shared_backbone:
            raise StoreError(f"task {task_dir} was trained with method {method!r}; only AoT tasks (fc, kron) run on "
                             "the shared backbone")
        check_fingerprint(artifact, repo.fingerprint, f"{repo.model} (repository {repo.path})")
        check_same_labels(name, self._current(name), (f"task {task_dir} as {name!r}", answer_meta(artifact)),
                          self.allow_label_change, "publishing")
        if artifact.max_length > repo.max_positions:
            raise StoreError(f"task {task_dir} has max length {artifact.max_length}; backbone {repo.model!r} accepts "
                             f"at most {repo.max_positions} tokens: retrain it with --max-length {repo.max_positions} "
                             "or less")
        longest = max(repo.options.buckets)
        if repo.options.engine == "tensorrt" and artifact.max_length > longest:
            raise StoreError(f"task {task_dir} has max length {artifact.max_length}, beyond the TensorRT profile of "
                             f"{repo.path} (longest bucket {longest}): re-export the backbone with --buckets up to "
                             f"{artifact.max_length}, or retrain with --max-length {longest}")
        return artifact

    def _current(self, name: str) -> tuple[str, dict] | None:
        """The current version of `name` and its meta as the index read by check() holds them (None: a new task);
        read again once if a compaction replaced that index's shards since. The publish checks again."""
        try:
            return current_version(self._state.tasks.get(name))
        except LookupError:  # aot.serving.store.shards.StaleIndex
            self._state = self.store.state()
            return current_version(self._state.tasks.get(name))

    def write(self, task_dir: str | Path, name: str, storage: str = "auto",
              tasks_in_store: int | None = None, allowed_drop: float | None = None,
              dev_data: str | Path | None = None, accept_small_dev: bool = False) -> WrittenTask:
        """write_files, then validate: one task version written and checked, not yet published."""
        written = self.write_files(task_dir, name, storage, tasks_in_store, allowed_drop, dev_data, accept_small_dev)
        try:
            self.validate([written])
        except BaseException:
            self.discard(written)
            raise
        return written

    def write_files(self, task_dir: str | Path, name: str, storage: str = "auto",
                    tasks_in_store: int | None = None, allowed_drop: float | None = None,
                    dev_data: str | Path | None = None, accept_small_dev: bool = False) -> WrittenTask:
        """Fuse P (or keep its factors) and write the head into a new version folder of the store that no reader sees
        yet (on an int8 repository, after checking its dev score through the int8 engine: aot.exporter.accuracy_gate).
        Its served logits are checked by `validate`, which a batch runs for many versions at once.
        `tasks_in_store`: what `auto` counts (default: the store's tasks and this one)."""
        start = time.perf_counter()
        self.check(task_dir, name, storage)
        if self._backbone is None:
            self._backbone = load_backbone(self.repo.model)
            self._engine = validation_engine(self.repo)
            self._tokens = Tokenization(self.repo.tokenizer_dir, self.repo.uses_token_type_ids)
            self._reference = MultiTaskModel(self._backbone)
        # no copy of the encoder per task: the task's AoT hooks go into the shared one, and out again below
        predictor = Predictor(*load_task(task_dir, self._backbone, copy_encoder=False))
        try:
            return self._write(predictor, task_dir, name, storage, tasks_in_store, start, allowed_drop, dev_data,
                               accept_small_dev)
        finally:
            predictor.model.body.biased.remove_hooks()

    def validate(self, written: list[WrittenTask]) -> None:
        """Check the written versions' served outputs against their PyTorch tasks, all in one pass (validate_tasks):
        each gets its max |difference| and its share of the time; the first beyond LOGITS_TOLERANCE raises a
        ValidationError naming it (the caller discards what it wrote)."""
        start = time.perf_counter()
        for w in written:
            self._reference.add_model(w.name, w.model, fuse=False)
        try:
            diffs = validate_tasks(self.repo, [(w.name, w.folder) for w in written], self._reference,
                                   engine=self._engine, tokens=self._tokens)
        finally:
            for w in written:
                if w.name in self._reference.tasks:
                    self._reference.remove_task(w.name)
                w.model = None
        share = (time.perf_counter() - start) / max(len(written), 1)
        for w, diff in zip(written, diffs, strict=True):
            w.max_abs_logit_diff, w.seconds = diff, w.seconds + share
            if not diff <= LOGITS_TOLERANCE:
                raise ValidationError(w.name, f"task {w.name!r}: served logits differ from PyTorch by {diff:.3g} "
                                              f"(> {LOGITS_TOLERANCE})")

    def _write(self, predictor: Predictor, task_dir, name: str, storage: str, tasks_in_store: int | None,
               start: float, allowed_drop: float | None = None, dev_data: str | Path | None = None,
               accept_small_dev: bool = False) -> WrittenTask:
        artifact, model = predictor.artifact, predictor.model
        L, d = self._backbone.num_layers, self._backbone.hidden_size
        V = int(self._backbone.embeddings.shape[0])
        factors = {k: v.detach().float().numpy().copy() for k, v in model.body.aot.state_dict().items()}
        fused_bytes = V * L * d * protocol.ROWS_DTYPE.itemsize
        advice = storage_advice(self.repo, name, fused_bytes, sum(a.nbytes for a in factors.values()),
                                tasks_in_store)
        storage = advice["auto"] if storage == "auto" else storage
        folder = self.store.new_version_folder(name)
        try:
            meta = task_record(artifact, name, storage, (L, d, V), self.repo.fingerprint)
            with _writing(name, folder / TASK_JSON):
                (folder / TASK_JSON).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            with _writing(name, folder / HEAD):
                if artifact.spec.kind_spec.head != NONE:  # an embedding task's vector is its pooled state: no head
                    save_file(head_arrays(model), folder / HEAD)
            body: AotBody = model.body
            if storage == "fused":
                with _writing(name, folder / TABLE):
                    _write_fused(body, folder / TABLE, V, progress=self.progress)
            else:
                with _writing(name, folder / FACTORS):
                    save_file(factors, folder / FACTORS)
            if self._cpu_engine is None and self.repo.record.cpu_precision != "fp32":
                self._cpu_engine = CpuEngine(self.repo)  # the int8 graph's session, once for every task
            served_dev = check_served_accuracy(self.repo, folder, predictor, allowed_drop, dev_data,
                                               self._cpu_engine, accept_small_dev)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        return WrittenTask(name, folder, storage, fused_bytes, float("nan"), time.perf_counter() - start, advice,
                           size, None if served_dev is None else served_dev.to_json(), model)

    @staticmethod
    def discard(written: WrittenTask) -> None:
        """A written version that will not be published."""
        shutil.rmtree(written.folder, ignore_errors=True)

    def publish(self, written: list[WrittenTask], keep: int | None = None) -> list[TaskExportReport]:
        """Publish written versions in one change of the store's index (servers see all of them, or none); `keep`:
        see export_task."""
        start = time.perf_counter()
        notes: dict[str, str] = {}
        try:
            entries = self.store.publish_many([Publication(w.name, w.folder, w.storage, keep, self.allow_label_change)
                                               for w in written], notes)
        except BaseException:
            for w in written:
                self.discard(w)
            raise
        keep_admin_key_private(self.repo.path)
        share = (time.perf_counter() - start) / max(len(written), 1)
        reports = []
        for w, entry in zip(written, entries, strict=True):
            reports.append(TaskExportReport(w.name, w.storage, entry.folder, w.bytes_on_disk, w.fused_bytes,
                                            w.max_abs_logit_diff, round(w.seconds + share, 2), w.advice,
                                            w.served_dev, [notes[w.name]] if w.name in notes else []))
        return reports
