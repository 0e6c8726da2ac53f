"""Calling a served repository over gRPC with a task id.

    from aot import Client
    with Client() as client:   # $AOT_URL, else 127.0.0.1:8001
        client.infer("sentiment", "A fine film.")   # {"label", "logits", "probabilities", "version": "sentiment@<id>"}
        client.infer("sentiment@3f2a9c41d0e7", "A fine film.")   # exactly that version, while the store holds it
        client.infer_many([{"task": "sentiment", "text": "...", "text_pair": None}, ...])   # concurrent, in order

One request per text, sent concurrently (Triton batches them, across tasks, on the server). With
`Client(tokenizer=REPO/models/tokenizer/1/tokenizer)` the client tokenizes (truncating to each task's max length,
as the server does) and sends token ids: the server's first stage then only checks them, which saves its CPU.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable, Iterable

import numpy as np

from aot.errors import (InferenceError, InvalidInput, PermissionDenied, TaskNotFound, TaskUnavailable, Unavailable,
                        from_triton)
from serving import protocol
from serving.labels import answer
from serving.store import MAX_NAME_LENGTH

__all__ = ["Client", "InferenceError", "InvalidInput", "PermissionDenied", "TaskNotFound", "TaskUnavailable",
           "Unavailable", "server_url"]


DEFAULT_URL = "127.0.0.1:8001"


def server_url(url: str | None = None) -> str:
    """The server's gRPC address: `url`, else the environment variable AOT_URL, else the local default (what
    `aot serve` binds), so a non-default address is said once."""
    return url or os.environ.get("AOT_URL") or DEFAULT_URL


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class Client:
    def __init__(self, url: str | None = None, model: str = "aot", timeout: float = 60.0, *,
                 tls: bool = False, ca: str | None = None, cert: str | None = None, key: str | None = None,
                 tokenizer: str | os.PathLike | None = None):
        """`url`: see server_url. `tls`: gRPC over TLS, trusting the system's CAs or the PEM file `ca`; `cert` +
        `key`: this client's certificate for a server that asks for one (mutual TLS). `ca` or `cert` imply `tls`.
        `tokenizer`: the served repository's tokenizer folder (REPO/models/tokenizer/1/tokenizer): tokenize here
        and send token ids (each task's max length is read from tasks() once per task name)."""
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.url, self.model, self.timeout = server_url(url), model, timeout
        if (cert is None) != (key is None):
            raise ValueError("a client certificate needs its key: give cert and key together")
        for what, path in (("ca", ca), ("cert", cert), ("key", key)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{what} {path}: no such file")
        tls = tls or ca is not None or cert is not None
        self._client = grpcclient.InferenceServerClient(self.url, ssl=tls, root_certificates=ca, private_key=key,
                                                        certificate_chain=cert)
        if tokenizer is not None and not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
            raise ValueError(f"tokenizer {tokenizer}: no tokenizer.json (expected a repository's tokenizer folder)")
        self._tokenizer_dir = tokenizer
        self._tokens = None  # serving.tokenization.Tokenization, made on first use
        self._max_lengths: dict[str, int] = {}

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _inputs(self, task: str, text: str, pair: str | None):
        if len(task) > MAX_NAME_LENGTH:  # checked here: a huge name would fail as a gRPC transport error
            raise InvalidInput(f"task name of {len(task)} characters: task names have at most {MAX_NAME_LENGTH}",
                               task=task[:MAX_NAME_LENGTH])
        tensors = []
        if self._tokenizer_dir is not None:
            for name, array in self._token_ids(task, text, pair).items():
                t = self._grpc.InferInput(name, [1, len(array)], "INT64")
                t.set_data_from_numpy(array[None, :])
                tensors.append(t)
            text = pair = None
        for name, value in ((protocol.TEXT, text), (protocol.TASK, task), (protocol.TEXT_PAIR, pair)):
            if value is None:
                continue
            t = self._grpc.InferInput(name, [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[value.encode("utf-8")]], dtype=np.object_))
            tensors.append(t)
        return tensors

    def _token_ids(self, task: str, text: str, pair: str | None) -> dict[str, np.ndarray]:
        """The ids the server's first stage would make: truncated to the task's max length (from tasks(), read
        again for a task not seen yet); token_type_ids where the served model takes them."""
        from serving.errors import RequestError
        from serving.tokenization import Tokenization

        if self._tokens is None:
            from tritonclient.utils import InferenceServerException

            try:
                metadata = self._client.get_model_metadata(self.model)
            except InferenceServerException as exc:
                raise from_triton(exc, task=task) from None
            types = any(i.name == protocol.TOKEN_TYPE_IDS for i in metadata.inputs)
            self._tokens = Tokenization(self._tokenizer_dir, types)
        name = task.split("@", 1)[0]  # TASK@VERSION: the current version's max length (the server checks the pinned)
        if name not in self._max_lengths:
            self._max_lengths.update({t["name"]: t["max_length"] for t in self.tasks()["tasks"]})
        max_length = self._max_lengths.get(name)
        if max_length is None:
            raise TaskNotFound(f"unknown task {task!r}: the server does not serve it", task=task)
        try:
            return self._tokens.encode(text, pair, max_length)
        except RequestError as exc:
            raise InvalidInput(str(exc), task=task) from None

    def _outputs(self):
        return [self._grpc.InferRequestedOutput(n) for n in (protocol.LOGITS, protocol.LABEL, protocol.TASK_VERSION)]

    @staticmethod
    def _decode(result) -> dict:
        logits = result.as_numpy(protocol.LOGITS).reshape(-1)
        label, version = (_text(result.as_numpy(n).reshape(-1)[0]) for n in (protocol.LABEL, protocol.TASK_VERSION))
        return answer(label, logits, version)

    def check_ready(self) -> None:
        from tritonclient.utils import InferenceServerException

        try:
            ready = self._client.is_model_ready(self.model)
        except InferenceServerException as exc:
            error = from_triton(exc)
            raise type(error)(f"cannot reach the server at {self.url}: {error}", error.status) from None
        if not ready:
            raise Unavailable(f"model {self.model!r} is not ready on {self.url}")

    def tasks(self, limit: int | None = None, match: str = "") -> dict:
        """What the server serves now, from its store's index: {"tasks": [{name, version, storage, labels,
        max_length, method, metric, dev, verified}], "total": how many match, "errors": {name: why its requests
        fail}, "audit": the background check's progress}. `match`: only names holding this substring; `limit`: at
        most this many tasks (by name)."""
        from tritonclient.utils import InferenceServerException

        parameters = {k: v for k, v in (("limit", limit), ("match", match)) if v}
        try:
            result = self._client.infer("task_list", [], outputs=[self._grpc.InferRequestedOutput(protocol.TASKS)],
                                        client_timeout=self.timeout, parameters=parameters or None)
        except InferenceServerException as exc:
            raise from_triton(exc) from None
        return json.loads(result.as_numpy(protocol.TASKS).reshape(-1)[0])

    def infer(self, task: str, text: str, text_pair: str | None = None, *, pair: str | None = None) -> dict:
        """One answer (serving.labels.answer). `text_pair` is named as in infer_many's items and training data;
        `pair=` is its older spelling. A failure raises the InferenceError of its cause (aot.errors: TaskNotFound,
        InvalidInput, TaskUnavailable, Unavailable, which is `retryable`, PermissionDenied)."""
        from tritonclient.utils import InferenceServerException

        try:
            result = self._client.infer(self.model, self._inputs(task, text, text_pair if pair is None else pair),
                                        outputs=self._outputs(), client_timeout=self.timeout)
        except InferenceServerException as exc:
            raise from_triton(exc, task=task) from None
        return self._decode(result)

    def infer_many(self, items: Iterable[dict], concurrency: int = 16,
                   on_done: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Items `{"task", "text", "text_pair"?, "id"?}`; answers in input order. A failed item's answer is
        InferenceError.answer(): `{"id"?, "task", "error": message, "error_type", "status", "retryable"}`; the
        others still complete."""
        items = list(items)
        results: list[dict | None] = [None] * len(items)
        slots = threading.Semaphore(concurrency)
        done = queue.Queue()

        def callback(index, result=None, error=None):
            if error is not None and not isinstance(error, InferenceError):
                item = items[index]
                error = from_triton(error, task=item.get("task"), id=item.get("id"))
            results[index] = error.answer() if error is not None else self._decode(result)
            slots.release()
            done.put(index)

        for i, item in enumerate(items):
            slots.acquire()
            try:
                inputs = self._inputs(item["task"], item["text"], item.get("text_pair"))
            except (KeyError, AttributeError, TypeError) as exc:
                echo = item if isinstance(item, dict) else {}
                callback(i, error=InvalidInput(f"item {i + 1}: expected {{\"task\": \"...\", \"text\": \"...\"}}, "
                                               f"missing or wrong {exc}", task=echo.get("task"), id=echo.get("id")))
                continue
            except InferenceError as exc:
                exc.task, exc.id = exc.task or item.get("task"), item.get("id")
                callback(i, error=exc)
                continue
            self._client.async_infer(self.model, inputs, outputs=self._outputs(), client_timeout=self.timeout,
                                     callback=lambda result, error, i=i: callback(i, result, error))
        for _ in range(len(items)):
            index = done.get()
            if on_done is not None:
                on_done(index, results[index])
        return results  # type: ignore[return-value]
