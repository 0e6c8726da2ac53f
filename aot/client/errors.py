"""What a failed request tells its caller: an InferenceError of the class of its cause, with the status the server
(or the transport) answered and whether a retry can help.

    InferenceError              any failure; `status` (gRPC status name), `retryable`, `task` and `id` (infer_many)
      TaskNotFound              NOT_FOUND: no such task, or a TASK@VERSION the store no longer holds
      InvalidInput              INVALID_ARGUMENT: the request itself is wrong (an empty or oversized text, a bad name)
      TaskUnavailable           UNAVAILABLE from a step: the task exists but cannot be served (damaged) until it is
                                exported again; a retry does not help
      Unavailable               the server cannot be reached or cannot answer now (refused or dropped connection,
                                deadline, overload, a server restarting or stopping, a rate limit, a task store that
                                does not answer): retryable; `retry_after`, the seconds the server asked to wait, if
                                it did
      PermissionDenied          an API restricted to the admin key, or a credential the server refuses

A caller retries `retryable` errors (with a backoff) and reports the others. The classes are told apart by the
status, and for UNAVAILABLE by who answered: a step's answer about a task names the task, quoted (aot.serving.errors), a
transport's never does; Triton answers a restricted API with UNAVAILABLE too, saying it is restricted. A stopping
server answers first "Server is stopping" (UNAVAILABLE), then, while it unloads its models, "Request for unknown model:
'aot' has no available versions" (NOT_FOUND): the model is going away, no task is missing, so both are Unavailable
(a model the server never loaded is "... is not found", which stays NOT_FOUND). A step's refusal that a retry cures
ends with a retry hint (`retry in 0.25 s`: a rate limit, a task store that does not answer now): Unavailable, whatever
it names, with `retry_after`. (Triton's python backend cannot answer RESOURCE_EXHAUSTED; a proxy's
RESOURCE_EXHAUSTED or 429 is Unavailable too.)
"""

from __future__ import annotations

import re

from aot.serving.errors import retry_after

RESTRICTED = "is restricted, expecting header"  # Triton's answer to a restricted API without the key


class InferenceError(RuntimeError):
    """A request the server refused or failed; the message is the server's (or the transport's), on one line.
    `status`: the gRPC status name (None when the client refused it before sending); `retryable`: whether sending it
    again may succeed; `task` and `id`: the request's, where the caller gave them."""

    retryable = False

    def __init__(self, message: str, status: str | None = None, *, task: str | None = None, id=None):
        super().__init__(message)
        self.status, self.task, self.id = status, task, id
        self.retry_after: float | None = retry_after(message)  # seconds the server asked to wait (None: it did not)

    def answer(self) -> dict:
        """The error as an answer line (infer_many, `aot infer --input`): the item's id and task, the message, the
        status and whether a retry can help."""
        echo = {k: v for k, v in (("id", self.id), ("task", self.task)) if v is not None}
        return echo | {"error": str(self), "error_type": type(self).__name__, "status": self.status,
                       "retryable": self.retryable}


class TaskNotFound(InferenceError):
    """The server holds no task (or task version) of that name."""


class InvalidInput(InferenceError):
    """The request is wrong as sent; the message says what to change."""


class TaskUnavailable(InferenceError):
    """The task exists but cannot be served (its files are damaged, its manifest entry is bad) until an operator
    exports it again."""


class Unavailable(InferenceError):
    """The server cannot be reached or cannot answer now: sending again, later or to another replica, may succeed."""

    retryable = True


class PermissionDenied(InferenceError):
    """The server refuses this caller: an API restricted to the admin key, or a refused credential."""


# gRPC status names (and the HTTP statuses of the same meaning) -> class
_BY_STATUS = {"NOT_FOUND": TaskNotFound, "404": TaskNotFound,
              "INVALID_ARGUMENT": InvalidInput, "400": InvalidInput, "OUT_OF_RANGE": InvalidInput,
              "PERMISSION_DENIED": PermissionDenied, "403": PermissionDenied,
              "UNAUTHENTICATED": PermissionDenied, "401": PermissionDenied,
              "UNAVAILABLE": Unavailable, "503": Unavailable, "DEADLINE_EXCEEDED": Unavailable, "504": Unavailable,
              "RESOURCE_EXHAUSTED": Unavailable, "429": Unavailable, "ABORTED": Unavailable,
              "CANCELLED": Unavailable}


def status_name(exc) -> str | None:
    """The status of a tritonclient InferenceServerException as a name: "NOT_FOUND" for gRPC's
    "StatusCode.NOT_FOUND", the HTTP status as digits ("404")."""
    status = exc.status() if callable(getattr(exc, "status", None)) else None
    if status is None:
        return None
    return str(status).rpartition(".")[2]


def task_name(spec: str) -> str:
    """The task of a TASK or TASK@VERSION."""
    return spec.split("@", 1)[0]


def one_line(exc) -> str:
    text = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    return " ".join(str(text).split())


# a GPU ensemble puts "in ensemble 'aot', " before its step's message
_DEAD_INSTANCE = re.compile(r"(?:^|, )Stub process '[^']+' is not healthy\.$")


def reached_a_dead_instance(message: str) -> bool:
    """Triton's INTERNAL answer of a step instance whose process died (the fused CPU step's, or a GPU ensemble's
    step's): the supervisor is replacing that instance while its sibling serves, so the same request sent again is
    answered."""
    return _DEAD_INSTANCE.search(message) is not None


# Triton's answers while it stops (or a step is unloaded to be reloaded): the model goes away, then comes back with the
# server or on another replica (module docstring)
_MODEL_GOING = re.compile(r"Server is stopping|Request for unknown model: '[^']*' has no available versions")


def server_is_stopping(message: str) -> bool:
    """A stopping server's answer (or one unloading the model to reload it): the same request sent again, after the
    restart or to another replica, is answered."""
    return _MODEL_GOING.search(message) is not None


def from_triton(exc, *, task: str | None = None, id=None) -> InferenceError:
    """The InferenceError of the class its status and message say (module docstring)."""
    message, status = one_line(exc), status_name(exc)
    kind = _BY_STATUS.get(status or "", InferenceError)
    if RESTRICTED in message:
        kind = PermissionDenied
    elif reached_a_dead_instance(message) or server_is_stopping(message):
        kind = Unavailable
    elif kind is Unavailable and status in ("UNAVAILABLE", "503") and task and repr(task_name(task)) in message \
            and retry_after(message) is None:
        kind = TaskUnavailable
    return kind(message, status, task=task, id=id)
