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
texts, each with its own task: aot.serving.items) and keeps `concurrency` requests in flight (Triton batches them,
across tasks, on the server). With
`Client(tokenizer=REPO/models/tokenizer/1/tokenizer)` the client tokenizes (truncating to each task's max length,
as the server does) and sends token ids: the server's first stage then only checks them, which saves its CPU.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from aot import settings
from aot.client.errors import (
    InferenceError,
    InvalidInput,
    PermissionDenied,
    TaskNotFound,
    TaskUnavailable,
    Unavailable,
    from_triton,
    one_line,
)
from aot.client.retry import UNAVAILABLE_RETRY_SECONDS, Backoff, Outage, channel_options, found_no_server
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


def _echo(item: dict) -> dict:
    """What infer_many's answer of an item repeats of it: its id (when given) and task."""
    return {key: item[key] for key in ("id", "task") if key in item}


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
        `retry_seconds`: how long a call that found no server (refused, dropped, a restarting server) is sent again,
        with a short backoff (0 never)."""
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

    def _call(self, method: Callable, *args, **kwargs):
        """`method` of the gRPC client, sent again while it finds no server (found_no_server), for retry_seconds."""
        backoff = Backoff(self.retry_seconds)
        while True:
            try:
                return method(*args, **kwargs)
            except Exception as exc:  # tritonclient's errors, imported lazily; others re-raised
                wait = backoff.next_wait() if found_no_server(exc) else None
                if wait is None:
                    raise
                time.sleep(wait)

    def _send_async(self, inputs, callback: Callable, backoff: Backoff | Outage | None = None) -> None:
        """async_infer whose answer goes to `callback(result, error)`; a call that found no server is sent again
        after the backoff's wait (from a timer: a gRPC callback must not sleep): its own Backoff, or the Outage its
        infer_many shares."""
        backoff = backoff or Backoff(self.retry_seconds)

        def done(result, error):
            wait = backoff.next_wait() if error is not None and found_no_server(error) else None
            if wait is None:
                callback(result, error)
            else:
                threading.Timer(wait, self._send_async, args=(inputs, callback, backoff)).start()

        self._client.async_infer(self.model, inputs, outputs=self._outputs(), client_timeout=self.timeout,
                                 parameters=self._infer_parameters, callback=done)

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
                                client_timeout=self.timeout, parameters=self._infer_parameters)
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
        (and `id`, if it has one). Items go `pack` to a request (a request carries many texts, each with its own
        task: aot.serving.items), `concurrency` requests in flight. A failed item's answer is
        InferenceError.answer(): `{"id"?, "task", "error": message, "error_type", "status", "retryable"}`; the
        others still complete: a request refused for one of its items is sent again item by item, and one larger
        than the server's max batch size is split to it."""
        if pack < 1:
            raise ValueError(f"pack {pack!r}: expected a positive number of texts per request")
        items = list(items)
        results: list[dict | None] = [None] * len(items)
        events: queue.Queue = queue.Queue()  # ("send", [indexes]) or ("done", index), handled by this thread
        outage = Outage(self.retry_seconds)  # one retry window for every request of this call
        slots = threading.Semaphore(concurrency)
        entries: dict[int, dict] = {}

        def finish(i: int, answer: dict) -> None:
            results[i] = (_echo(items[i]) if isinstance(items[i], dict) else {}) | answer
            events.put(("done", i))

        def answered(indexes: list[int], result=None, error=None) -> None:
            """A gRPC callback: whatever fails here must still answer its items, or the call would wait forever."""
            slots.release()
            try:
                handle(indexes, result, error)
            except Exception as exc:  # noqa: BLE001 - an answer that cannot be read fails its items, not the call
                for i in indexes:
                    if results[i] is None:
                        finish(i, InferenceError(f"the answer could not be read: {type(exc).__name__}: {exc}").answer())

        def handle(indexes: list[int], result, error) -> None:
            if error is None:
                outage.answered()
                for i, answer in zip(indexes, self._decode_rows(result), strict=True):
                    finish(i, answer)
                return
            limit = _batch_limit(error)
            if len(indexes) > 1 and limit is not None and limit < len(indexes):
                self._pack_limit = limit
                for start in range(0, len(indexes), limit):
                    events.put(("send", indexes[start:start + limit]))
            elif len(indexes) > 1 and _an_items_fault(error):  # each alone, to find the item it was
                for i in indexes:
                    events.put(("send", [i]))
            else:
                for i in indexes:
                    failure = error if isinstance(error, InferenceError) else \
                        from_triton(error, task=items[i].get("task"), id=items[i].get("id"))
                    finish(i, failure.answer())

        for i, item in enumerate(items):
            try:
                entries[i] = self._entry(item["task"], item["text"], item.get("text_pair"))
            except (KeyError, AttributeError, TypeError) as exc:
                echo = item if isinstance(item, dict) else {}
                finish(i, InvalidInput(f"item {i + 1}: expected {{\"task\": \"...\", \"text\": \"...\"}}, "
                                       f"missing or wrong {exc}", task=echo.get("task"), id=echo.get("id")).answer())
            except InferenceError as exc:
                exc.task, exc.id = exc.task or item.get("task"), item.get("id")
                finish(i, exc.answer())
        size = pack if self._pack_limit is None else min(pack, self._pack_limit)
        for group in _packs([(i, "ids" in e) for i, e in entries.items()], size):
            events.put(("send", group))
        left = len(items)
        while left:
            kind, value = events.get()
            if kind == "done":
                left -= 1
                if on_done is not None:
                    on_done(value, results[value])
                continue
            slots.acquire()
            self._send_async(self._pack_inputs([entries[i] for i in value]),
                             lambda result, error, group=value: answered(group, result, error), outage)
        return results  # type: ignore[return-value]


def _packs(entries: list[tuple[int, bool]], size: int) -> list[list[int]]:
    """Items in input order, in groups of at most `size` that send the same inputs (texts, or token ids)."""
    groups: list[list[int]] = []
    last = None
    for i, ids in entries:
        if groups and ids == last and len(groups[-1]) < size:
            groups[-1].append(i)
        else:
            groups.append([i])
        last = ids
    return groups


def _an_items_fault(error) -> bool:
    """Whether the server refused a pack for one of its items (its message begins "item K of N: ", aot.serving.steps):
    sent again one by one, the other items are answered. A refusal of the whole request (a rate limit, a stopping or
    overloaded server, a deadline) names no item, and is every item's answer: sent again text by text it would only
    cost more."""
    return re.search(r"\bitem \d+ of \d+: ", one_line(error)) is not None


def _batch_limit(error) -> int | None:
    """The server's max batch size when it refused a request for carrying more items (Triton: "inference request
    batch-size must be <= N"), else None."""
    match = re.search(r"batch-size must be <= (\d+)", str(error))
    return int(match.group(1)) if match else None
