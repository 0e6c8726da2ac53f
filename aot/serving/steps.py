"""What every served Triton python step shares: its configuration, input checks, one response per request, and
per-task metrics. The model files in aot/model_repository/ are thin adapters over these functions and aot.serving.tasks.

Rules every step follows (a client must never be able to hurt another client's requests):
- each request is checked on its own (shapes, dtypes, ranges, one sequence per request) and fails alone, with a
  message that names the problem and no server internals (tracebacks go to the server log only);
- every response gets its own TritonError object: one error object shared between responses is freed once per
  response by the python backend, which corrupts the server's memory (a crash seen with batches of 2+);
- a batch that fails as a whole is retried request by request, so one request cannot fail the others;
- the work is per batch and per request, in columns (aot.serving.columns), never per text where it can be helped: a
  request's inputs are read as whole arrays, its task names resolved once each, its metrics counted once;
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
from pathlib import Path

import numpy as np

from aot.serving import protocol
from aot.serving.bytes_tensors import use_array_bytes_tensors
from aot.serving.columns import RequestInputs, TaskColumn
from aot.serving.errors import STATUS, TRITON_CODES, RequestError
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
from aot.serving.tasks import ServedTask
from aot.serving.watch import ExecuteWatch, add_facts, add_note

__all__ = ["RequestError", "Step", "StepMetrics"]


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of a Triton python model's config, as strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def instance_count(args: dict) -> int:
    """How many instances of this model its config asks for (the sum of its instance groups' counts; a KIND_GPU
    group's count is per GPU, and our GPU steps run one GPU each)."""
    config = json.loads(args["model_config"])
    return max(sum(int(g.get("count", 1)) for g in config.get("instance_group", [])), 1)


class Step:
    """What a served python step's model file is built around: the repository record, the task registry, the rate
    gate, the metrics, and one response per request (respond_batch, respond_each)."""

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
        use_array_bytes_tensors(pb_utils)
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
        self.facts(step=name, pool_bytes=self.pool.budget_bytes if self.pool is not None else 0)
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

    def facts(self, **facts) -> None:
        """What this instance holds, for the supervisor's /ready (aot.serving.watch: written at start)."""
        add_facts(self.instance, facts)

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

    # --- resolving a request's tasks ---------------------------------------------------------------------------

    def resolve(self, inputs: RequestInputs) -> tuple[list[ServedTask], np.ndarray]:
        """The task versions the request's items name (TASK), for the caller its tenant key says
        (aot.serving.task_registry), once its caller's rate admits the request (aot.serving.rate_limits: its texts
        at once): each distinct name resolved once, except a routed task's, whose items each draw their version.
        Returns the distinct versions and each item's index among them."""
        names, index = inputs.task_names(self.options.max_text_bytes)
        key, tenants = inputs.tenant_key, self.tasks.view.index.tenants
        address = self.gate.address_of(inputs.request.parameters())  # a keyless client's, once per request
        for k, name in enumerate(names):
            self.gate.admit(name, key, tenants, inputs.count if k == 0 else 0, address if k == 0 else None)
        if len(names) == 1 and not self.tasks.routed(names[0]):  # the common request: one task, one version
            return [self._resolved(names[0], key, index, 0)], index
        found: dict[str, int] = {}
        tasks: list[ServedTask] = []
        where = np.empty(inputs.count, np.int64)
        for k, name in enumerate(names):
            mine = np.flatnonzero(index == k)
            draws = [self._resolved(name, key, index, k) for _ in mine] if self.tasks.routed(name) else \
                [self._resolved(name, key, index, k)] * len(mine)
            for row, task in zip(mine.tolist(), draws, strict=True):
                where[row] = found.setdefault(task.version, len(tasks))
                if where[row] == len(tasks):
                    tasks.append(task)
        return tasks, where

    def _resolved(self, name: str, key: str | None, index: np.ndarray, k: int) -> ServedTask:
        """Task `name`'s version for the caller; a refusal names the first item that names it (the k-th name)."""
        try:
            return self.tasks.resolve(name, key)
        except RequestError as exc:
            exc.item = int(np.argmax(index == k))
            raise

    def pinned(self, inputs: RequestInputs) -> tuple[list[ServedTask], np.ndarray]:
        """The task versions the first step pinned for the request's items (TASK_VERSION), loaded: each distinct
        version once (fails the request if one is gone, or if its tenant key does not open it: a step called
        directly). Only a version the store holds becomes an item's metric label: a client calling a step directly
        with made-up versions must not grow the metrics without bound."""
        found: dict[str, int] = {}
        index = np.fromiter((found.setdefault(v, len(found)) for v in inputs.texts(
            protocol.TASK_VERSION, self.options.max_text_bytes)), np.int64, inputs.count)
        tasks = []
        for k, version in enumerate(found):
            try:
                tasks.append(self.tasks.version(version, inputs.tenant_key))
            except RequestError as exc:
                exc.item = int(np.argmax(index == k))
                raise
        return tasks, index

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
            answers = iter(respond([r for r, probe in zip(requests, probes, strict=True) if not probe]))
            return [self.pb.InferenceResponse([]) if probe else next(answers) for probe in probes]

    def respond_each(self, requests, handle: Callable) -> list:
        """`handle(request) -> output tensors`, one request at a time (a step that serves no task's items)."""
        return self._with_probes(requests, lambda real: [self._respond_one(r, handle) for r in real])

    def _respond_one(self, request, handle: Callable):
        start, status = time.perf_counter(), "internal"
        try:
            response, status = self.pb.InferenceResponse(handle(request)), "ok"
        except RequestError as exc:
            response, status = self.request_error(exc), exc.reason
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the batch down
            response = self.internal_error(exc)
        self._account([request], [TaskColumn()], [1], [status], time.perf_counter() - start)
        return response

    def respond_batch(self, requests, read: Callable, run: Callable, outputs: Callable) -> list:
        """A batched step over the requests' items (aot.serving.columns: a request carries N >= 1 texts or
        sequences): `read(inputs, column)` checks one request (its RequestInputs) and returns what the batch needs of
        it (a part, with `count` items), naming its items' task versions in `column` (a TaskColumn) as soon as it
        knows them; `run(parts)` computes the batch's items at once; `outputs(result, k, rows, request)` is the
        tensors of request k, whose items are `rows` (a range) of the result. A request refused fails alone,
        naming its item at fault; a failing batch is retried request by request."""
        return self._with_probes(requests, lambda real: self._respond_batch(real, read, run, outputs))

    def _respond_batch(self, requests, read: Callable, run: Callable, outputs: Callable) -> list:
        start = time.perf_counter()
        self.gate.begin_batch()
        responses = [None] * len(requests)
        columns = [TaskColumn() for _ in requests]
        counts = [1] * len(requests)
        statuses: list[str] = ["internal"] * len(requests)  # until answered
        ready: list[tuple[int, object]] = []  # (request, its part), requests that passed their checks
        for i, request in enumerate(requests):
            inputs = RequestInputs(self.pb, request)
            try:
                counts[i] = inputs.read_count(self.ITEM_INPUTS)
                ready.append((i, read(inputs, columns[i])))
            except RequestError as exc:
                responses[i], statuses[i] = self.request_error(exc.named(counts[i])), exc.reason
            except Exception as exc:  # noqa: BLE001 - one request's failure must not take the batch down
                responses[i] = self.internal_error(exc)
        groups = [ready] if ready else []
        while groups:
            group = groups.pop()
            try:
                result = run([part for _, part in group])
                done, at = [], 0
                for k, (i, part) in enumerate(group):
                    done.append((i, outputs(result, k, range(at, at + part.count), requests[i])))
                    at += part.count
            except Exception as exc:  # noqa: BLE001
                if len(group) > 1:
                    groups.extend([entry] for entry in group)  # isolate the request that fails
                elif isinstance(exc, DamagedTable):  # its task refused as the batch read it: the item named
                    i = group[0][0]
                    refused = exc.at_item(columns[i]).named(counts[i])
                    responses[i], statuses[i] = self.request_error(refused), refused.reason
                else:
                    responses[group[0][0]] = self.internal_error(exc)
                continue
            for i, tensors in done:
                responses[i], statuses[i] = self.pb.InferenceResponse(tensors), "ok"
        self._account(requests, columns, counts, statuses, time.perf_counter() - start)
        return responses

    def _account(self, requests, columns: list[TaskColumn], counts: list[int], statuses: list[str],
                 latency: float) -> None:
        """Count each request in the metrics once per task version it holds (its texts of that version, their share
        of the step's time, the request's latency: every item of the batch waited for all of it) and write its
        sampled items to the request log."""
        share = latency / max(sum(counts), 1)
        for column, count, status in zip(columns, counts, statuses, strict=True):
            if not column.tasks:  # refused before its tasks were known
                self.metrics.request("", status, count, share * count, latency)
                continue
            held = np.bincount(column.index, minlength=len(column.tasks))
            for task, texts in zip(column.tasks, held.tolist(), strict=True):
                if texts:
                    self.metrics.request(task.version, status, texts, share * texts, latency)
        if self.request_log is not None:
            self.request_log.write([
                self._logged(request, column, row, status, latency)
                for request, column, count, status in zip(requests, columns, counts, statuses, strict=True)
                for row in range(count) if self.request_log.sampled()])

    def _logged(self, request, column: TaskColumn, row: int, status: str, latency: float) -> LoggedRequest:
        """An item as the log writes it: the task the client named when the store holds none of that name, its
        texts only when the log asks for them (read here, raw: they may be what failed the request)."""
        version = column.tasks[column.index[row]].version if column.tasks else ""
        texts = {}
        if self.request_log.settings.text:
            texts = {key: self._raw_text(request, name, row) for key, name in (("text", protocol.TEXT),
                                                                                ("text_pair", protocol.TEXT_PAIR))}
        task = task_of(version) if version else self._raw_text(request, protocol.TASK, row)
        return LoggedRequest(task, version or None, latency, STATUS[status], **texts)

    def _raw_text(self, request, name: str, row: int) -> str | None:
        tensor = self.pb.get_input_tensor_by_name(request, name)
        array = None if tensor is None else tensor.as_numpy()
        if array is None or array.ndim == 0 or array.shape[0] <= row or array[row].size == 0:
            return None
        value = array[row].reshape(-1)[0]
        return bytes(value).decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

    def output(self, name: str, array: np.ndarray):
        return self.pb.Tensor(name, array)

    @staticmethod
    def requested(request) -> set[str] | None:
        """The outputs a request asks for (None: every output, a backend that does not say)."""
        names = getattr(request, "requested_output_names", None)
        return None if names is None else set(names())

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
