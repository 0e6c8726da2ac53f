"""Calling a served repository over gRPC with a task id.

    from aot import Client
    with Client() as client:   # $AOT_URL, else 127.0.0.1:8001
        client.infer("sentiment", "A fine film.")   # {"label", "logits", "probabilities", "version": "sentiment@<id>"}
        client.infer("sentiment@3f2a9c41d0e7", "A fine film.")   # exactly that version, while the store holds it
        client.infer_many([{"task": "sentiment", "text": "...", "text_pair": None}, ...])   # packed, in order
        client.infer("ner", "Ana flew to Lisboa")   # {"entities": [{"text", "label", "start", "end", "score"}], ...}
        client.embed("search", ["a query", "a document"])   # [2, d] float32
    with Client(tenant_key=KEY) as client:   # $AOT_TENANT_KEY: a tenant's tasks, TENANT/TASK
    (aot.serving.store.tenants)
        client.infer("acme/intent", "Where is my parcel?")

Each answer is its task's kind's (aot.serving.answers): classification {label, logits, probabilities}, regression
{score}, multilabel {labels, scores}, tokens {entities}, embedding {embedding}, and the `version` that answered.
infer sends one text a request; infer_many packs up to `pack` texts (32) into each request (a request carries many
texts, each with its own task: aot.serving.columns) and keeps up to `concurrency` requests in flight (Triton batches
them, across tasks, on the server), sending again what a retry may cure, paced to what the server says
(aot.client.batch); infer_stream yields the same answers in order as they come. With
`Client(tokenizer=REPO/models/tokenizer/1/tokenizer)` the client tokenizes (truncating to each task's max length,
as the server does) and sends token ids: the server's first stage then only checks them, which saves its CPU.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable

import numpy as np

from aot import settings
from aot.client.batch import BatchRun
from aot.client.errors import (
    InferenceError,
    InvalidInput,
    PermissionDenied,
    TaskNotFound,
    TaskUnavailable,
    Unavailable,
    from_triton,
)
from aot.client.retry import UNAVAILABLE_RETRY_SECONDS, Backoff, channel_options, classified, worth_sending_again
from aot.serving import protocol
from aot.serving.kinds import KINDS, kind_spec
from aot.serving.store.reader import MAX_NAME_LENGTH
from aot.serving.store.tenants import TENANT_KEY_PARAMETER

__all__ = ["Client", "InferenceError", "InvalidInput", "PermissionDenied", "TaskNotFound", "TaskUnavailable",
           "Unavailable", "server_url"]

_ERRORS = {e.__name__: e for e in (InferenceError, InvalidInput, PermissionDenied, TaskNotFound, TaskUnavailable,
                                   Unavailable)}


PACK = 32  # texts per request infer_many sends (split further to the server's max batch size when it refuses more)


def server_url(url: str | None = None) -> str:
    """The server's gRPC address: `url`, else the environment variable AOT_URL, else the local default (what
    `aot serve` binds), so a non-default address is said once."""
    return url or settings.URL.read()


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class Client:
    def __init__(self, url: str | None = None, model: str = "aot", timeout: float = 60.0, *,
                 tls: bool = False, ca: str | None = None, cert: str | None = None, key: str | None = None,
                 tokenizer: str | os.PathLike | None = None, tenant_key: str | None = None,
                 retry_seconds: float = UNAVAILABLE_RETRY_SECONDS):
        """`url`: see server_url. `tls`: gRPC over TLS, trusting the system's CAs or the PEM file `ca`; `cert` +
        `key`: this client's certificate for a server that asks for one (mutual TLS). `ca` or `cert` imply `tls`.
        `tokenizer`: the served repository's tokenizer folder (REPO/models/tokenizer/1/tokenizer): tokenize here
        and send token ids (each task's max length is read from tasks() once per task name). `tenant_key`: the key
        of a tenant (`aot export tenant create`), sent with every request as the parameter aot-tenant-key (default:
        the environment variable AOT_TENANT_KEY): its tasks TENANT/TASK answer, and tasks() lists them.
        `timeout`: seconds one request may take from when it is sent (infer: the call; infer_many: each of its
        requests, sent again when it misses it: aot.client.batch). `retry_seconds`: the retry window: how long a
        call refused for a reason a retry may cure (no server, a stopping server, a rate limit: aot.client.retry) is
        sent again, after the server's retry hint or a short backoff (0: never); infer_many has one window for the
        whole call."""
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.url, self.model, self.timeout = server_url(url), model, timeout
        self.retry_seconds = retry_seconds
        if (cert is None) != (key is None):
            raise ValueError("a client certificate needs its key: give cert and key together")
        for what, path in (("ca", ca), ("cert", cert), ("key", key)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{what} {path}: no such file")
        tls = tls or ca is not None or cert is not None
        self._client = grpcclient.InferenceServerClient(self.url, ssl=tls, root_certificates=ca, private_key=key,
                                                        certificate_chain=cert, channel_args=channel_options())
        if tokenizer is not None and not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
            raise ValueError(f"tokenizer {tokenizer}: no tokenizer.json (expected a repository's tokenizer folder)")
        self._tokenizer_dir = tokenizer
        self._tokens = None  # aot.serving.tokenization.Tokenization, made on first use
        self._listed: dict[str, dict] = {}  # task name -> its tasks() entry (kind, max length), read on first use
        self._pack_limit: int | None = None  # the server's max batch size, once it refused a larger request
        key = tenant_key if tenant_key is not None else settings.TENANT_KEY.read()
        self._parameters = {TENANT_KEY_PARAMETER: key} if key else None
        # answers the server builds only where its tensors do not carry them (protocol.ANSWERS_PARAMETER)
        self._infer_parameters = (self._parameters or {}) | {protocol.ANSWERS_PARAMETER: protocol.COMPACT_ANSWERS}

    def close(self) -> None:
        self._client.close()

    def _call(self, method: Callable, *args, task: str | None = None, **kwargs):
        """`method` of the gRPC client, sent again for retry_seconds while it fails for a reason a retry may cure
        (aot.client.retry.worth_sending_again; a missed deadline is the caller's bound, not retried), after the
        server's retry hint or a short backoff. `task`: the call's, which a refusal naming it is about."""
        backoff = Backoff(self.retry_seconds)
        while True:
            try:
                return method(*args, **kwargs)
            except Exception as exc:  # tritonclient's errors, imported lazily; others re-raised
                again = worth_sending_again(exc, (task,), deadlines=False)
                wait = backoff.next_wait(classified(exc)[0].retry_after) if again else None
                if wait is None:
                    raise
                time.sleep(wait)

    def _send_async(self, inputs, callback: Callable, timeout: float) -> None:
        """async_infer whose answer (or error) goes to `callback(result, error)`, in gRPC's thread (aot.client.batch
        sends again what a retry may cure)."""
        self._client.async_infer(self.model, inputs, outputs=self._outputs(), client_timeout=timeout,
                                 parameters=self._infer_parameters, callback=callback)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _inputs(self, task: str, text: str, pair: str | None):
        """One item's request tensors (a request of one text)."""
        return self._pack_inputs([self._entry(task, text, pair)])

    def _entry(self, task: str, text: str, pair: str | None) -> dict:
        """One item as it will be sent, checked here: its task, and its text (+ pair) or, with a client tokenizer,
        its token ids (a token task's text stays text: its entities are found in it)."""
        if not isinstance(task, str) or not isinstance(text, str) or not isinstance(pair, (str, type(None))):
            raise InvalidInput(f"expected a task name, a text and an optional pair as strings, got "
                               f"{type(task).__name__}, {type(text).__name__} and {type(pair).__name__}", task=None)
        if len(task) > MAX_NAME_LENGTH:  # checked here: a huge name would fail as a gRPC transport error
            raise InvalidInput(f"task name of {len(task)} characters: task names have at most {MAX_NAME_LENGTH}",
                               task=task[:MAX_NAME_LENGTH])
        if self._tokenizer_dir is not None and not self._reads_words(task):
            return {protocol.TASK: task, "ids": self._token_ids(task, text, pair)}
        return {protocol.TASK: task, protocol.TEXT: text, protocol.TEXT_PAIR: pair}

    def _pack_inputs(self, entries: list[dict]):
        """The request tensors of several items (all texts, or all token ids: a request sends one or the other),
        one row each: BYTES [N, 1], token ids [N, S] right-padded to the longest with a mask of 0s."""
        n = len(entries)

        def column(name: str, values: list[str]):
            t = self._grpc.InferInput(name, [n, 1], "BYTES")
            t.set_data_from_numpy(np.array([[v.encode("utf-8")] for v in values], dtype=np.object_))
            return t

        tensors = [column(protocol.TASK, [e[protocol.TASK] for e in entries])]
        if "ids" in entries[0]:
            longest = max(len(e["ids"][protocol.INPUT_IDS]) for e in entries)
            for name in entries[0]["ids"]:
                array = np.zeros((n, longest), dtype=np.int64)
                for k, e in enumerate(entries):
                    array[k, : len(e["ids"][name])] = e["ids"][name]
                t = self._grpc.InferInput(name, list(array.shape), "INT64")
                t.set_data_from_numpy(array)
                tensors.append(t)
            return tensors
        tensors.append(column(protocol.TEXT, [e[protocol.TEXT] for e in entries]))
        if any(e[protocol.TEXT_PAIR] is not None for e in entries):  # "" is no pair (a blank pair is none)
            tensors.append(column(protocol.TEXT_PAIR, [e[protocol.TEXT_PAIR] or "" for e in entries]))
        return tensors

    def _reads_words(self, task: str) -> bool:
        """A token task takes TEXT even from a client that tokenizes: its entities are found in the text."""
        listed = self._listing(task)
        return listed is not None and listed.get("kind") in KINDS and KINDS[listed["kind"]].reads_tokens

    def _listing(self, task: str) -> dict | None:
        """The task's entry in tasks() (TASK@VERSION: its current version's), read again once for a task not seen
        yet; None for a task the server does not serve."""
        name = task.split("@", 1)[0]
        if name not in self._listed:
            self._listed.update({t["name"]: t for t in self.tasks()["tasks"]})
        return self._listed.get(name)

    def _token_ids(self, task: str, text: str, pair: str | None) -> dict[str, np.ndarray]:
        """The ids the server's first stage would make: truncated to the task's max length (from tasks(), read
        again for a task not seen yet); token_type_ids where the served model takes them."""
        from aot.serving.errors import RequestError
        from aot.serving.tokenization import Tokenization

        if self._tokens is None:
            from tritonclient.utils import InferenceServerException

            try:
                metadata = self._call(self._client.get_model_metadata, self.model)
            except InferenceServerException as exc:
                raise from_triton(exc, task=task) from None
            types = any(i.name == protocol.TOKEN_TYPE_IDS for i in metadata.inputs)
            self._tokens = Tokenization(self._tokenizer_dir, types)
        listed = self._listing(task)  # TASK@VERSION: the current version's max length (the server checks the pinned)
        if listed is None:
            raise TaskNotFound(f"unknown task {task!r}: the server does not serve it", task=task)
        try:
            return self._tokens.encode(text, pair, listed["max_length"])
        except RequestError as exc:
            raise InvalidInput(str(exc), task=task) from None

    def _outputs(self):
        names = (protocol.ANSWER, protocol.LOGITS, protocol.LOGITS_WIDTH, protocol.LABEL, protocol.TASK_VERSION)
        return [self._grpc.InferRequestedOutput(n) for n in names]

    @staticmethod
    def _decode(result) -> dict:
        """The answer of the task's kind (aot.serving.answers) and the version that answered."""
        return Client._decode_rows(result)[0]

    @staticmethod
    def _decode_rows(result) -> list[dict]:
        """Each item's answer of a request, in order (the outputs are [N, ...]): ANSWER's JSON, or, where the server
        wrote only the kind's name (compact answers: protocol.ANSWERS_PARAMETER), the answer its LOGITS and LABEL
        carry, by the server's own rule (aot.serving.kinds.KindSpec.carried)."""
        versions = result.as_numpy(protocol.TASK_VERSION).reshape(-1)
        answers, labels = result.as_numpy(protocol.ANSWER).reshape(-1), result.as_numpy(protocol.LABEL).reshape(-1)
        logits, widths = result.as_numpy(protocol.LOGITS), result.as_numpy(protocol.LOGITS_WIDTH).reshape(-1)
        out = []
        for k, (answer, version) in enumerate(zip(answers, versions, strict=True)):
            body = json.loads(_text(answer))
            if isinstance(body, str):
                body = kind_spec(body).carried(_text(labels[k]), logits[k, : widths[k]])
            out.append(body | {"version": _text(version)})
        return out

    def check_ready(self) -> None:
        from tritonclient.utils import InferenceServerException

        try:
            ready = self._call(self._client.is_model_ready, self.model)
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

        parameters = {k: v for k, v in (("limit", limit), ("match", match)) if v} | (self._parameters or {})
        try:
            result = self._call(self._client.infer, "task_list", [],
                                outputs=[self._grpc.InferRequestedOutput(protocol.TASKS)], client_timeout=self.timeout,
                                parameters=parameters or None)
        except InferenceServerException as exc:
            raise from_triton(exc) from None
        return json.loads(result.as_numpy(protocol.TASKS).reshape(-1)[0])

    def infer(self, task: str, text: str, text_pair: str | None = None, *, pair: str | None = None) -> dict:
        """One answer of the task's kind (aot.serving.answers), with the version that answered. `text_pair` is named as
        in infer_many's items and training data; `pair=` is its older spelling. A failure raises the InferenceError
        of its cause (aot.client.errors: TaskNotFound, InvalidInput, TaskUnavailable, Unavailable, which is `retryable`,
        PermissionDenied)."""
        from tritonclient.utils import InferenceServerException

        try:
            inputs = self._inputs(task, text, text_pair if pair is None else pair)
            result = self._call(self._client.infer, self.model, inputs, outputs=self._outputs(),
                                client_timeout=self.timeout, parameters=self._infer_parameters, task=task)
        except InferenceServerException as exc:
            raise from_triton(exc, task=task) from None
        return self._decode(result)

    def embed(self, task: str, texts: Iterable[str], concurrency: int = 16) -> np.ndarray:
        """An embedding task's vectors of `texts`, one row each, [N, d] float32, packed into requests (as infer_many).
        A text that fails raises the InferenceError of its cause (as infer), naming the text's index; a task of
        another kind is refused (InvalidInput)."""
        texts = list(texts)
        answers = self.infer_many([{"task": task, "text": t} for t in texts], concurrency)
        rows = []
        for k, item in enumerate(answers):
            if "error" in item:
                error = _ERRORS.get(item["error_type"], InferenceError)
                raise error(f"text {k}: {item['error']}", item["status"], task=task)
            if "embedding" not in item:
                raise InvalidInput(f"task {task!r} is not an embedding task (it answers {sorted(item)})", task=task)
            rows.append(item["embedding"])
        return np.asarray(rows, dtype=np.float32).reshape(len(texts), -1)

    def infer_many(self, items: Iterable[dict], concurrency: int = 16,
                   on_done: Callable[[int, dict], None] | None = None, pack: int = PACK) -> list[dict]:
        """Items `{"task", "text", "text_pair"?, "id"?}`; answers in input order, each echoing its item's `task`
        (and `id`, if it has one). Items go up to `pack` to a request (a request carries many texts, each with its
        own task: aot.serving.columns), up to `concurrency` requests in flight; `on_done(index, answer)` as each
        arrives. A failed item's answer is InferenceError.answer(): `{"id"?, "task", "error": message, "error_type",
        "status", "retryable"}`; the others still complete: a request refused for one of its items is sent again
        item by item, one larger than the server's max batch size is split to it, and one refused for a reason a
        retry may cure (no server, a stopping server, CANCELLED, a rate limit, a missed deadline) is sent again,
        paced, within one retry window for the whole call (`retry_seconds`; aot.client.batch)."""
        return list(self.infer_stream(items, concurrency, on_done, pack))

    def infer_stream(self, items: Iterable[dict], concurrency: int = 16,
                     on_done: Callable[[int, dict], None] | None = None, pack: int = PACK,
                     on_notice: Callable[[str], None] | None = None) -> BatchRun:
        """infer_many as an iterable: each answer in input order as soon as it and those before it are answered
        (a batch job writes them as they come), with `stats` (answered, failed by reason, retried, seconds);
        `on_notice(text)`: what a person may want to know meanwhile (waiting for the server, paced by it)."""
        return BatchRun(self, items, concurrency, pack, on_done, on_notice)
