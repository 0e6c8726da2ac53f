"""What the served steps compute, independent of Triton.

The python-backend models in model_repository/ are thin adapters around these classes, and export validation runs
the very same code in-process, so what is validated is what is served.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from exporter import interface as io
from exporter.task_store import EMBEDDINGS, StoreError, TaskStore
from training.data.task import label_for


class RequestError(ValueError):
    """Bad input in one request; the message goes back to that request's client."""


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of a Triton python model's config, as strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def respond_each(requests, handle, pb_utils) -> list:
    """One response per request: `handle(request)`, or that request's error; the others are unaffected."""
    responses = []
    for request in requests:
        try:
            responses.append(handle(request))
        except RequestError as exc:
            responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
    return responses


# --- tokenizer step -----------------------------------------------------------------------------------------------

def decode_text(raw, field: str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{field} is not valid UTF-8 (byte {exc.start}: {bytes(raw)[exc.start:exc.start + 1]!r})") from None


def bucket_length(length: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if length <= b:
            return b
    return length


class Tokenization:
    """Text (+ pair) -> token ids, truncated to the task's max length (as in training and `aot predict`)."""

    def __init__(self, tokenizer_dir: str | Path, uses_token_type_ids: bool, buckets: tuple[int, ...] = ()):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        self.uses_token_type_ids = uses_token_type_ids
        self.buckets = tuple(sorted(buckets))
        self.pad_id = self.tokenizer.pad_token_id or 0

    def encode(self, text: str, pair: str | None, max_length: int) -> dict[str, np.ndarray]:
        if not text.strip():
            raise RequestError("TEXT is empty")
        enc = self.tokenizer(text, pair or None, truncation=True, max_length=max_length)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        n = len(ids)
        size = bucket_length(n, self.buckets)
        out = {io.INPUT_IDS: np.full(size, self.pad_id, dtype=np.int64), io.ATTENTION_MASK: np.zeros(size, np.int64)}
        out[io.INPUT_IDS][:n] = ids
        out[io.ATTENTION_MASK][:n] = 1
        if self.uses_token_type_ids:
            types = np.zeros(size, dtype=np.int64)
            types[:n] = enc.get("token_type_ids", [0] * n)
            out[io.TOKEN_TYPE_IDS] = types
        return out


# --- the task store, as the lookup and head steps see it -------------------------------------------------------

@dataclass
class ServedTask:
    name: str
    labels: list[str] | None
    max_length: int
    storage: str
    head: dict[str, np.ndarray]
    folder: str = ""  # the store's version folder this was loaded from (a re-export gives a new one)
    table: np.ndarray | None = None  # fused: memory-mapped [V, L, d]
    prompt: object = None  # factored: the training module that computes rows (training.methods.aot.layer)
    embeddings: object = None

    def rows(self, token_ids: np.ndarray) -> np.ndarray:
        """Rows of P for sorted distinct token ids, [U, L, d] fp16. Fused: only these rows are read from disk."""
        if self.table is not None:
            return np.ascontiguousarray(self.table[token_ids], dtype=np.float16)
        import torch

        with torch.no_grad():
            ids = torch.from_numpy(token_ids.astype(np.int64))
            return self.prompt.rows(ids, self.embeddings).to(torch.float16).numpy()

    def logits(self, cls_hidden: np.ndarray) -> np.ndarray:
        """The task head (training.model.ClassificationHead in eval mode): out(tanh(dense(h)))."""
        h = np.tanh(cls_hidden.astype(np.float32) @ self.head["dense.weight"].T + self.head["dense.bias"])
        return h @ self.head["out.weight"].T + self.head["out.bias"]

    def label(self, logits: np.ndarray) -> str:
        return label_for(self.labels, logits)


@functools.lru_cache(maxsize=4)
def shared_embeddings(path: Path, stamp: tuple[int, int]):
    """The store's E as one fp32 tensor shared by every factored FC task (one copy per process, not per task)."""
    import torch

    return torch.from_numpy(np.load(path).astype(np.float32, copy=False))


def load_served_task(folder: Path, name: str, storage: str, embeddings_path: Path,
                     with_rows: bool = True) -> ServedTask:
    """`with_rows=False` loads what the tokenizer and head steps need (metadata, head), not P."""
    meta = json.loads((folder / "task.json").read_text(encoding="utf-8"))
    head = load_file(folder / "head.safetensors")
    task = ServedTask(name, meta["labels"], int(meta["max_length"]), storage, head, folder.name)
    if not with_rows:
        return task
    if storage == "fused":
        task.table = np.load(folder / "table.npy", mmap_mode="r")
    elif storage == "factored":
        import torch

        from training.methods.base import method_spec

        method = meta["method"]
        config = method_spec(method["method"]).config_cls.from_json(method)
        factors = load_file(folder / "factors.safetensors")
        task.prompt = build_prompt(config, meta["num_layers"], meta["hidden_size"])
        task.prompt.load_state_dict({k: torch.from_numpy(v) for k, v in factors.items()})
        task.prompt.eval()
        if method["method"] == "fc":
            st = embeddings_path.stat()
            task.embeddings = shared_embeddings(embeddings_path, (st.st_ino, st.st_mtime_ns))
    else:
        raise StoreError(f"unknown storage {storage!r}")
    return task


def build_prompt(config, num_layers: int, hidden_size: int):
    """The training module for a method's factors (no initialization cost that matters: weights are loaded)."""
    from training.methods.aot.layer import FCPrompt, KronPrompt

    if config.method == "fc":
        return FCPrompt(config, num_layers, hidden_size, embedding_std=1.0)
    return KronPrompt(config, num_layers, hidden_size)


def single_threaded_torch() -> None:
    """In a serving step, factored rows are a few small matmuls per request: one PyTorch thread does them, more
    only contend with ONNX Runtime's threads (measured: factored throughput fell to 0.2-0.5x of vanilla)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


class TaskRegistry:
    """The tasks of a store, reloaded when its manifest changes (a stat per call, no restart needed).

    A task that fails to load is kept as its error: its requests fail with that message, the others serve.
    """

    def __init__(self, root: str | Path, with_rows: bool = True, serving: bool = False):
        """`serving`: this process is a server step; PyTorch (only imported for factored tasks) gets one thread."""
        self.store = TaskStore(root)
        self.with_rows = with_rows
        self.serving = serving
        self._stamp = None
        self._tasks: dict[str, ServedTask | Exception] = {}
        self._lock = threading.Lock()
        self.refresh()

    def refresh(self) -> None:
        try:
            stamp = self.store.manifest_stamp()
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        with self._lock:
            entries = self.store.entries()
            tasks: dict[str, ServedTask | Exception] = {}
            for name, entry in entries.items():
                current = self._tasks.get(name)
                if isinstance(current, ServedTask) and current.folder == entry.folder:
                    tasks[name] = current
                    continue
                try:
                    if self.serving and self.with_rows and entry.storage == "factored":
                        single_threaded_torch()
                    tasks[name] = load_served_task(self.store.root / entry.folder, name, entry.storage,
                                                   self.store.root / EMBEDDINGS, self.with_rows)
                except Exception as exc:  # noqa: BLE001 - a corrupt task must not take the others down
                    tasks[name] = StoreError(f"task {name!r} is corrupt: {type(exc).__name__}: {exc}")
            self._tasks, self._stamp = tasks, stamp

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def errors(self) -> dict[str, str]:
        return {n: str(t) for n, t in self._tasks.items() if isinstance(t, Exception)}

    def get(self, name: str) -> ServedTask:
        task = self._tasks.get(name)
        if task is None:
            known = ", ".join(n for n in self.names() if isinstance(self._tasks[n], ServedTask)) or "(none)"
            raise RequestError(f"unknown task {name!r}; known tasks: {known}")
        if isinstance(task, Exception):
            raise RequestError(str(task))
        return task


def lookup(task: ServedTask, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The AoT lookup step for one sequence: distinct tokens' rows (flat fp16) and each token's row number."""
    valid = attention_mask.astype(bool)
    unique, inverse = np.unique(input_ids[valid], return_inverse=True)
    index = np.zeros(input_ids.shape[0], dtype=np.int32)
    index[valid] = inverse
    return task.rows(unique).reshape(-1), index


# --- backbone step ----------------------------------------------------------------------------------------------

class BackboneRunner:
    """Runs the exported backbone on a batch of single-sequence requests, exactly as Triton would batch them:
    token tensors padded to the longest sequence, ragged rows concatenated, and the accumulated row offsets."""

    def __init__(self, onnx_path: str | Path, threads: int = 0, providers: list[str] | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(onnx_path), options,
                                            providers=providers or ["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.aot = io.AOT_ROWS in self.inputs

    def run(self, requests: list[dict[str, np.ndarray]]) -> np.ndarray:
        """Each request: 1-D token tensors (and aot_rows, aot_index for AoT). Returns [B, d]."""
        longest = max(len(r[io.INPUT_IDS]) for r in requests)
        feeds = {}
        for name in io.token_inputs(io.TOKEN_TYPE_IDS in self.inputs):
            feeds[name] = np.stack([np.pad(r[name], (0, longest - len(r[name]))) for r in requests])
        if self.aot:
            feeds[io.AOT_INDEX] = np.stack([np.pad(r[io.AOT_INDEX], (0, longest - len(r[io.AOT_INDEX])))
                                            for r in requests]).astype(np.int32)
            rows = [r[io.AOT_ROWS].reshape(-1) for r in requests]
            feeds[io.AOT_ROWS] = np.concatenate(rows).astype(np.float16, copy=False)
            feeds[io.AOT_ROW_OFFSETS] = np.concatenate([[0], np.cumsum([len(x) for x in rows])]).astype(np.int32)
        return self.session.run([io.CLS_HIDDEN], feeds)[0]

