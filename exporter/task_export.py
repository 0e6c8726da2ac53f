"""`aot export task`: fuse P (or keep its factors), write the head, validate, and publish atomically."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from exporter.accuracy_gate import check_served_accuracy
from exporter.compose_env import keep_admin_key_private
from exporter.task_store import TaskStore
from serving import protocol
from serving.engine import BackboneRunner, Prepared
from serving.repository import RepositoryInfo, read_repository
from serving.store import STORAGES, StoreError, check_task_name
from serving.tasks import load_task_version
from serving.tokenization import Tokenization
from training.artifact import check_fingerprint, read_task
from training.backbone import load_backbone
from training.methods.aot_ptuning.model import AotBody
from training.method_registry import method_spec
from training.model import TaskModel
from training.predict import Predictor

VALIDATION_TEXTS = (
    "A gripping, beautifully acted film.",
    "Dull, overlong and badly written; I left early.",
    "It is what it is.",
    "an utterly forgettable sequel that nonetheless has its moments of wit and charm " * 4,
)
LOGITS_TOLERANCE = 1e-3  # fp16 tables


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


def _head_arrays(model: TaskModel) -> dict[str, np.ndarray]:
    """The head in the served format: names as in ClassificationHead, fp32."""
    return {k: v.detach().float().numpy().copy() for k, v in model.head.state_dict().items()}


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


def validate_task(repo: RepositoryInfo, folder: Path, name: str, storage: str, predictor: Predictor,
                  texts=VALIDATION_TEXTS) -> float:
    """Served path (tokenizer, lookup, the repository's backbone engine, head) against the PyTorch task: max
    |logit difference|."""
    served = load_task_version(folder, TaskStore.version_name(folder), repo.store_root)
    tokens = Tokenization(repo.tokenizer_dir, repo.uses_token_type_ids)
    requests = [Prepared.for_task(tokens.encode(text, None, served.max_length), served) for text in texts]
    for r in requests:
        r.rows = served.rows(r.unique)
    if repo.options.engine == "torch":
        from serving_torch.engine import TorchBackbone

        hidden = TorchBackbone(repo.encoder_dir, repo.uses_token_type_ids, aot=True).run(requests)
    else:
        hidden = BackboneRunner(repo.backbone_onnx).run(requests)
    got = served.logits(hidden)
    expected = predictor.logits(list(texts)).numpy()
    return float(np.abs(got - expected).max())


def storage_advice(repo: RepositoryInfo, name: str, fused_bytes: int, factored_bytes: int) -> dict:
    """What a task costs in each storage and, with the repository's pool budget, how many such tasks stay fully
    resident. `auto` picks fused while every task of the store (this one included) fits resident, else factored:
    beyond the pool, fused tables only cost disk and page cache, while factors are 1-2 % of a table."""
    pool = repo.options.pool_bytes
    resident = pool // fused_bytes if fused_bytes else 0
    others = [n for n in TaskStore(repo.store_root).entries() if n != name]
    fits = len(others) + 1 <= resident
    return {"fused_bytes": fused_bytes, "factored_bytes": factored_bytes, "pool_bytes": pool,
            "tasks_resident_in_pool": int(resident), "tasks_in_store": len(others) + 1,
            "auto": "fused" if fits else "factored"}


def export_task(task_dir: str | Path, repo_dir: str | Path, name: str, storage: str = "auto",
                progress: bool = True, allowed_drop: float | None = None,
                dev_data: str | Path | None = None) -> TaskExportReport:
    """`storage`: fused, factored, or auto (see storage_advice). On an int8 repository the task must keep its dev
    score within `allowed_drop` points (0.5 by default) of its fp32 score, scored on `dev_data` (default: its
    training data's dev split): exporter.accuracy_gate."""
    start = time.perf_counter()
    check_task_name(name)
    if storage not in STORAGES + ("auto",):
        raise StoreError(f"unknown storage {storage!r}: expected auto, {', '.join(STORAGES)}")
    repo = read_repository(repo_dir)
    artifact = read_task(task_dir)
    method = artifact.config["method"]["method"]
    if not method_spec(method).shared_backbone:
        raise StoreError(f"task {task_dir} was trained with method {method!r}; only AoT tasks (fc, kron) run on the "
                         "shared backbone")
    check_fingerprint(artifact, repo.fingerprint, f"{repo.model} (repository {repo.path})")
    if artifact.max_length > repo.max_positions:
        raise StoreError(f"task {task_dir} has max length {artifact.max_length}; backbone {repo.model!r} accepts at "
                         f"most {repo.max_positions} tokens: retrain it with --max-length {repo.max_positions} or less")
    longest = max(repo.options.buckets)
    if repo.options.engine == "tensorrt" and artifact.max_length > longest:
        raise StoreError(f"task {task_dir} has max length {artifact.max_length}, beyond the TensorRT profile of "
                         f"{repo.path} (longest bucket {longest}): re-export the backbone with --buckets up to "
                         f"{artifact.max_length}, or retrain with --max-length {longest}")
    predictor = Predictor.load(task_dir, load_backbone(repo.model))  # checks the loaded backbone's fingerprint
    backbone = predictor.backbone
    artifact, model = predictor.artifact, predictor.model
    store = TaskStore(repo.store_root)
    L, d, V = backbone.num_layers, backbone.hidden_size, int(backbone.embeddings.shape[0])
    factors = {k: v.detach().float().numpy().copy() for k, v in model.body.aot.state_dict().items()}
    advice = storage_advice(repo, name, V * L * d * protocol.ROWS_DTYPE.itemsize,
                            sum(a.nbytes for a in factors.values()))
    storage = advice["auto"] if storage == "auto" else storage
    folder = store.new_version_folder(name)
    try:
        meta = {"name": name, "labels": None if artifact.spec.labels is None else list(artifact.spec.labels),
                "metric": artifact.spec.metric, "max_length": artifact.max_length, "pooling": artifact.pooling,
                "has_pair": artifact.spec.has_pair, "head_activation": artifact.head["activation"],
                "storage": storage,
                "method": artifact.config["method"], "num_layers": L, "hidden_size": d, "vocab_size": V,
                "source": str(Path(task_dir).resolve()), "backbone_fingerprint": repo.fingerprint,
                "dev": artifact.metrics().get("dev")}
        (folder / "task.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        save_file(_head_arrays(model), folder / "head.safetensors")
        body: AotBody = model.body
        if storage == "fused":
            _write_fused(body, folder / "table.npy", V, progress=progress)
        else:
            save_file(factors, folder / "factors.safetensors")
        diff = validate_task(repo, folder, name, storage, predictor)
        if not diff <= LOGITS_TOLERANCE:
            raise StoreError(f"task {name!r}: served logits differ from PyTorch by {diff:.3g} "
                             f"(> {LOGITS_TOLERANCE}); nothing was published")
        served_dev = check_served_accuracy(repo, folder, predictor, allowed_drop, dev_data)
        entry = store.publish(name, folder, storage)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    keep_admin_key_private(repo.path)
    size = sum(p.stat().st_size for p in (store.root / entry.folder).rglob("*") if p.is_file())
    return TaskExportReport(name, storage, entry.folder, size, V * L * d * 2, diff,
                            round(time.perf_counter() - start, 2), advice,
                            None if served_dev is None else asdict(served_dev))
