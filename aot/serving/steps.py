"""What every served Triton python step shares: its configuration, input checks, one response per request, and
per-task metrics. The model files in aot/model_repository/ are thin adapters over these functions and aot.serving.tasks.

Rules every step follows (a client must never be able to hurt another client's requests):
- each request is checked on its own (shapes, dtypes, ranges, one sequence per request) and fails alone, with a
  message that names the problem and no server internals (tracebacks go to the server log only);
- every response gets its own TritonError object: one error object shared between responses is freed once per
  response by the python backend, which corrupts the server's memory (a crash seen with batches of 2+);
- a batch that fails as a whole is retried request by request, so one request cannot fail the others;
- a client mistake answers 400 (gRPC INVALID_ARGUMENT), an unknown task or version 404 (NOT_FOUND), a task that
  cannot be served 503 (UNAVAILABLE), a fault of the server 500 (aot.serving.errors);
- metric labels come only from task versions the store holds (a client's string never becomes a label);
- a request with the parameter protocol.PROBE_PARAMETER is a liveness probe (aot.serving.supervision.supervisor):
  answered at once with no outputs, never counted in the metrics. It proves the step's process runs its `execute`; and
  each instance records when its running `execute` began (aot.serving.watch), so that one stuck instance is found while
  another answers the probes.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aot.serving import items, protocol
from aot.serving.errors import STATUS, TRITON_CODES, RequestError
from aot.serving.items import Item, RequestInputs
from aot.serving.loaded_versions import DamagedTable
from aot.serving.pool import RowPool
from aot.serving.rate_limits import RateLimits, RequestGate
from aot.serving.repository import RepositoryInfo, repository_of_model
from aot.serving.request_log import LoggedRequest, RequestLog, RequestLogSettings
from aot.serving.shm import make_own_region_private
from aot.serving.step_metrics import StepMetrics
from aot.serving.store.reader import task_of
from aot.serving.store.tenants import key_of_parameters, require_tenant_keys
from aot.serving.task_registry import TaskRegistry
from aot.serving.watch import ExecuteWatch, add_note

__all__ = ["RequestContext", "RequestError", "Step", "StepMetrics"]


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of a Triton python model's config, as strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def instance_count(args: dict) -> int:
    """How many instances of this model its config asks for (the sum of its instance groups' counts; a KIND_GPU
    group's count is per GPU, and our GPU steps run one GPU each)."""
    config = json.loads(args["model_config"])
    return max(sum(int(g.get("count", 1)) for g in config.get("instance_group", [])), 1)


@dataclass
class RequestContext:
    """What a step learns of one item while it serves it, for its metrics and the request log: the task version
    that serves it ("" until the item names one the store holds), and its row in the request."""

    version: str = ""
    row: int = 0


class Step:
    """Base of a served python step: the repository record, the task registry, checks and responses."""

    # inputs whose batch dimension says how many items a request carries (the first a step's request has)
    ITEM_INPUTS = (protocol.TEXT, protocol.INPUT_IDS, protocol.TASK, protocol.TASK_VERSION, protocol.POOLED_HIDDEN)

    def __init__(self, args: dict, pb_utils, name: str, parts: str = "meta", pool_storage=None):
        """`parts`: the parts of each task version this step needs (aot.serving.tasks.PARTS: meta, head, rows, all), or
        "none" (the vanilla backbone). `pool_storage`: where the task pool's rows live (host memory by default; the
        engine's storage, aot.serving.engine.Engine.storage, for an engine that keeps them on its device)."""
        self.name = name
        self.pb = pb_utils
        self.parameters = model_parameters(args)
        self.instances = instance_count(args)
        make_own_region_private()  # before any request reaches this stub (aot.serving.shm)
        self.instance = args["model_instance_name"]
        self.watch = ExecuteWatch(self.instance)  # the supervisor sees a batch this instance is stuck in
        self.model_dir = Path(args["model_repository"])
        self.repo: RepositoryInfo = repository_of_model(self.model_dir)
        self.options = self.repo.options
        self.tasks = None
        self.pool = None
        if parts in ("rows", "all") and self.options.pool_bytes > 0:
            # each instance of a step is its own process with its own pool: they share the budget
            self.pool = RowPool(self.options.pool_bytes // self.instances, self.repo.num_layers,
                                self.repo.hidden_size, self.repo.vocab_size, storage=pool_storage)
            self.pb.Logger.log_info(f"{name}: task pool of {self.pool.budget_bytes} bytes ({self.pool.slots} rows; "
                                    f"{self.pool.slots // self.repo.vocab_size} tasks fully resident)")
        self.metrics = StepMetrics(pb_utils, name, self.pool, self.instance).start()
        # per-caller rates, checked where a request's task is resolved (aot.serving.rate_limits)
        self.gate = RequestGate(RateLimits.from_environment(), self.instances, self.metrics.refused_key,
                                self.metrics.rate_limited)
        log = RequestLogSettings.from_environment()
        self.request_log = RequestLog(log, name) if log is not None else None
        if parts != "none":
            # several instances on the host: each fused table once, in the page cache, not in every pool
            pool_fused = self.instances == 1 or pool_storage is not None
            self.tasks = TaskRegistry(self.repo.store_root, parts=parts, on_index_error=self._index_error,
                                      url=self.repo.store_url,
                                      pool=self.pool, on_task_error=self._task_error, pool_fused=pool_fused,
                                      cache_bytes=self.options.task_cache_bytes,
                                      require_tenant_keys=require_tenant_keys(), on_store_error=self._store_error)
            self.pb.Logger.log_info(f"{name}: task versions loaded on first use, at most "
                                    f"{self.options.task_cache_bytes} bytes of them kept")

    def warn(self, message: str) -> None:
        """A warning of this step's start: the server log, and the supervisor's /ready (aot.serving.watch notes)."""
        self.pb.Logger.log_warn(f"{self.name}: warning: {message}")
        add_note(self.instance, f"{self.name}: {message}")

    def close(self) -> None:
        """The model's `finalize` (Triton unloads it): the store's watch thread stops, the metrics counted since the
        last flush are published, the request log is closed."""
        if self.tasks is not None:
            self.tasks.close()
        self.metrics.close()
        if self.request_log is not None:
            self.request_log.close()

    def refresh(self) -> None:
        """Before each batch: pick up what changed in the store's index (a stat when nothing changed)."""
        if self.tasks is not None:
            self.tasks.refresh()

    def _task_error(self, version: str, message: str) -> None:
        """A version that does not load or was found damaged: refused (its requests alone), logged, counted."""
        self.pb.Logger.log_error(f"{self.name}: {message}")
        self.metrics.task_error(version)

    def _store_error(self, message: str) -> None:
        """A version that could not be fetched from the object store: its clients read the task; this log, why."""
        self.pb.Logger.log_error(f"{self.name}: {message}")
        self.metrics.fetch_error()

    def _index_error(self, message: str) -> None:
        self.pb.Logger.log_error(f"{self.name}: {message}; serving the last good index")
        self.metrics.manifest_error()

    # --- reading one item's inputs (aot.serving.items) ---------------------------------------------------------

    def text(self, item: Item, name: str, required: bool = True) -> str | None:
        return items.text(item, name, self.options.max_text_bytes, required)

    def tokens(self, item: Item) -> dict[str, np.ndarray]:
        """The token tensors of one item, checked against the backbone's limits."""
        return items.tokens(item, self.repo)

    def resolve(self, item: Item):
        """The task version the item's TASK names, for the caller its request's tenant key says
        (aot.serving.task_registry), once its caller's rate admits the request (aot.serving.rate_limits: each text
        counts, all of a request's at once on its first item)."""
        name, key = items.task_name(item, self.options.max_text_bytes), item.inputs.tenant_key
        self.gate.admit(name, key, self.tasks.view.index.tenants, item.count if item.row == 0 else 0)
        return self.tasks.resolve(name, key)

    def task_version(self, item: Item, ctx: RequestContext):
        """The task version the first step pinned for this item, loaded (fails the request if it is gone, or if
        its tenant key does not open it: a step called directly). Only a version the store holds becomes the
        item's metric label: a client calling a step directly with made-up versions must not grow the metrics
        without bound."""
        task = self.tasks.version(self.text(item, protocol.TASK_VERSION), item.inputs.tenant_key)
        ctx.version = task.version
        return task

    @staticmethod
    def tenant_key(request) -> str | None:
        """A request's tenant key (aot.serving.store.tenants; Triton forwards an ensemble's parameters to its steps)."""
        return key_of_parameters(request.parameters())

    # --- responses ---------------------------------------------------------------------------------------------

    def error_response(self, message: str, reason: str | None = None):
        """A new error object per response; `reason` (aot.serving.errors.TRITON_CODES) a client's fault, None the
        server's."""
        code = getattr(self.pb.TritonError, TRITON_CODES[reason]) if reason else self.pb.TritonError.INTERNAL
        return self.pb.InferenceResponse(error=self.pb.TritonError(message, code))

    def request_error(self, exc: RequestError):
        return self.error_response(str(exc), exc.reason)

    def internal_error(self, exc: BaseException):
        self.pb.Logger.log_error(f"{self.name}: {''.join(traceback.format_exception(exc))}")
        return self.error_response(f"{self.name}: internal error ({type(exc).__name__}); the server log has the "
                                   "details")

    @staticmethod
    def is_probe(request) -> bool:
        """A liveness probe (protocol.PROBE_PARAMETER among the request's parameters, a JSON object)."""
        parameters = request.parameters()
        return protocol.PROBE_PARAMETER in parameters and protocol.PROBE_PARAMETER in json.loads(parameters)

    def _with_probes(self, requests, respond: Callable) -> list:
        """`respond` answers the real requests; each probe gets an empty response of its own. The whole `execute`
        runs under the instance's watch (aot.serving.watch)."""
        with self.watch:
            probes = [self.is_probe(r) for r in requests]
            if not any(probes):
                return respond(requests)
            answers = iter(respond([r for r, probe in zip(requests, probes) if not probe]))
            return [self.pb.InferenceResponse([]) if probe else next(answers) for probe in probes]

    def respond_each(self, requests, handle: Callable) -> list:
        """`handle(request, ctx) -> output tensors`, one request at a time; ctx (a RequestContext) names its task
        version."""
        return self._with_probes(requests, lambda real: self._respond_each(real, handle))

    def _respond_each(self, requests, handle: Callable) -> list:
        responses, contexts, statuses, seconds = [], [], [], []
        for request in requests:
            ctx = RequestContext()
            start = time.perf_counter()
            try:
                responses.append(self.pb.InferenceResponse(handle(request, ctx)))
                status = "ok"
            except RequestError as exc:
                responses.append(self.request_error(exc))
                status = exc.reason
            except Exception as exc:  # noqa: BLE001 - one request's failure must not take the batch down
                responses.append(self.internal_error(exc))
                status = "internal"
            contexts.append(ctx)
            statuses.append(status)
            seconds.append(time.perf_counter() - start)
        self._account(list(zip(requests, contexts, statuses, seconds, seconds, strict=True)))
        return responses

    def respond_batch(self, requests, prepare: Callable, run: Callable, outputs: Callable) -> list:
        """A batched step over the requests' items (aot.serving.items: a request carries N >= 1 texts or
        sequences): `prepare(item, ctx)` checks each item (ctx: its RequestContext); `run(prepared list)` computes
        the batch's items at once; `outputs(result, ks)` is the tensors of one request whose items are rows `ks` of
        the result. A request with a refused item fails as a whole, naming the item; a failing batch is retried
        request by request."""
        return self._with_probes(requests, lambda real: self._respond_batch(real, prepare, run, outputs))

    def _respond_batch(self, requests, prepare: Callable, run: Callable, outputs: Callable) -> list:
        start = time.perf_counter()
        responses = [None] * len(requests)
        ready: list[tuple[int, list]] = []  # (request, its items' prepared), requests whose every item passed
        contexts: list[list[RequestContext]] = []
        statuses: list[str] = ["internal"] * len(requests)  # until answered
        for i, request in enumerate(requests):
            mine: list[RequestContext] = []
            contexts.append(mine)
            try:
                prepared = self._prepare_items(request, prepare, mine)
            except RequestError as exc:
                responses[i], statuses[i] = self.request_error(exc), exc.reason
                continue
            except Exception as exc:  # noqa: BLE001 - one request's failure must not take the batch down
                responses[i] = self.internal_error(exc)
                continue
            ready.append((i, prepared))
        groups = [ready] if ready else []
        while groups:
            group = groups.pop()
            try:
                result = run([p for _, prepared in group for p in prepared])
                done, at = [], 0
                for i, prepared in group:
                    done.append((i, outputs(result, range(at, at + len(prepared)))))
                    at += len(prepared)
            except Exception as exc:  # noqa: BLE001
                if len(group) > 1:
                    groups.extend([entry] for entry in group)  # isolate the request that fails
                elif isinstance(exc, DamagedTable):  # its task refused as the batch read it: the item named
                    at, items = group[0][0], [ctx.version for ctx in contexts[group[0][0]]]
                    responses[at], statuses[at] = self.request_error(exc.naming_item(items)), exc.reason
                else:
                    responses[group[0][0]] = self.internal_error(exc)
                continue
            for i, tensors in done:
                responses[i], statuses[i] = self.pb.InferenceResponse(tensors), "ok"
        latency = time.perf_counter() - start  # every item of the batch waited for all of it
        count = sum(len(mine) for mine in contexts)
        share = latency / max(count, 1)
        self._account([(r, ctx, status, share, latency) for r, mine, status in zip(requests, contexts, statuses,
                                                                                    strict=True) for ctx in mine])
        return responses

    def _prepare_items(self, request, prepare: Callable, contexts: list[RequestContext]) -> list:
        """Each item of the request prepared (`contexts` gets one RequestContext per item read); the first item
        refused fails the request, its message naming the item when the request carries several."""
        inputs = RequestInputs(self.pb, request)
        try:
            count = inputs.count(self.ITEM_INPUTS)
        except RequestError:
            contexts.append(RequestContext())  # refused before its items were read: counted once, as a request
            raise
        prepared = []
        for row in range(count):
            ctx = RequestContext(row=row)
            contexts.append(ctx)
            try:
                prepared.append(prepare(Item(inputs, row, count), ctx))
            except RequestError as exc:
                if count == 1 or exc.reason == "rate_limited":  # a refusal of the whole request names no item
                    raise
                raise RequestError(f"item {row + 1} of {count}: {exc}", exc.reason) from None
        return prepared

    def _account(self, served: list[tuple]) -> None:
        """Count each item in the metrics (its share of the step's time; its request's latency) and write the sampled
        ones to the request log; `served`: (request, RequestContext, status, share, latency) per item."""
        observed = set()  # a request's items share its latency: one observation per request and task version
        for request, ctx, status, share, latency in served:
            first = (id(request), ctx.version) not in observed
            observed.add((id(request), ctx.version))
            self.metrics.request(ctx.version, status, share, latency if first else None)
        if self.request_log is not None:
            self.request_log.write([self._logged(r, ctx, status, latency) for r, ctx, status, _, latency in served
                                    if self.request_log.sampled()])

    def _logged(self, request, ctx: RequestContext, status: str, latency: float) -> LoggedRequest:
        """An item as the log writes it: the task the client named when the store holds none of that name, its
        texts only when the log asks for them (read here, raw: they may be what failed the request)."""
        texts = {}
        if self.request_log.settings.text:
            texts = {key: self._raw_text(request, name, ctx.row) for key, name in (("text", protocol.TEXT),
                                                                                   ("text_pair", protocol.TEXT_PAIR))}
        task = task_of(ctx.version) if ctx.version else self._raw_text(request, protocol.TASK, ctx.row)
        return LoggedRequest(task, ctx.version or None, latency, STATUS[status], **texts)

    def _raw_text(self, request, name: str, row: int) -> str | None:
        tensor = self.pb.get_input_tensor_by_name(request, name)
        array = None if tensor is None else tensor.as_numpy()
        if array is None or array.ndim == 0 or array.shape[0] <= row or array[row].size == 0:
            return None
        value = array[row].reshape(-1)[0]
        return bytes(value).decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

    def output(self, name: str, array: np.ndarray):
        return self.pb.Tensor(name, array)

    def stacked(self, name: str, rows: list[np.ndarray], fill=0) -> object:
        """One request's items' rows as one [N, ...] tensor, each padded with `fill` to the largest row's shape (the
        items of a request may differ in length or width)."""
        shape = tuple(max(sizes) for sizes in zip(*(r.shape for r in rows), strict=True))
        if all(r.shape == shape for r in rows):
            return self.pb.Tensor(name, np.stack(rows))
        out = np.full((len(rows), *shape), fill, dtype=rows[0].dtype)
        for k, r in enumerate(rows):
            out[(k, *(slice(0, n) for n in r.shape))] = r
        return self.pb.Tensor(name, out)

    def bytes_output(self, name: str, texts: list[str]):
        """One request's items' texts as a BYTES [N, 1] tensor."""
        return self.pb.Tensor(name, np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))
