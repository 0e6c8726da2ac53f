"""The client's transport: its gRPC channel options, which failures are sent again (inference is idempotent) and
how long to wait between tries.

What is sent again (worth_sending_again): a call that found no server (refused, a dropped stream, a restarting
server: found_no_server), a stopping server's answers, and every refusal a client reads as `Unavailable`
(aot.client.errors: UNAVAILABLE that names no task of the call, CANCELLED, ABORTED, RESOURCE_EXHAUSTED, a step's
refusal with a retry hint such as a rate limit, HTTP 429/503/504, and DEADLINE_EXCEEDED for infer_many's requests).
A wait honours the server's retry hint (`retry in 0.26 s`, its `retry_after`), else backs off (RETRY_BACKOFF). Never
sent again: a request the server refused for what it is (InvalidInput, TaskNotFound, TaskUnavailable,
PermissionDenied)."""

from __future__ import annotations

import time

from aot.client.errors import InferenceError, from_triton, one_line, reached_a_dead_instance, server_is_stopping

# Reconnecting: gRPC's default backoff between connection attempts starts at 1 s and grows 1.6x up to 120 s, so a
# client kept failing for seconds after a restarted server was back (docs/serving.md, "Restarts"). Milliseconds.
RECONNECT_BACKOFF_MS = {"grpc.initial_reconnect_backoff_ms": 100, "grpc.min_reconnect_backoff_ms": 100,
                        "grpc.max_reconnect_backoff_ms": 1000}
UNAVAILABLE_RETRY_SECONDS = 10.0  # how long a call that found no server (refused, dropped, restarting) is tried again
RETRY_BACKOFF = (0.05, 1.0)  # seconds: the first wait between two tries, doubled up to the second
# What gRPC (or a load balancer with no live replica) says when a call found no server to answer it: the call is
# sent again, as inference is idempotent. A server's own refusal (a bad request, a damaged task) is never retried.
_NO_SERVER = ("failed to connect to all addresses", "stream removed", "socket closed", "connection reset",
              "broken pipe", "connection refused", "goaway", "http2 header with status: 502",
              "http2 header with status: 503", "http2 header with status: 504")


def channel_options() -> list[tuple[str, int]]:
    """tritonclient's own channel defaults (unbounded message sizes, its keepalive settings) and a short reconnect
    backoff (RECONNECT_BACKOFF_MS)."""
    from tritonclient.grpc import KeepAliveOptions
    from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE

    keepalive = KeepAliveOptions()
    return [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(keepalive.keepalive_permit_without_calls)),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            *RECONNECT_BACKOFF_MS.items()]


def found_no_server(exc) -> bool:
    """A call that no server answered (refused, a dropped connection, a restarting server or replica), or that
    reached a step instance whose process had died (Triton's INTERNAL "Stub process ... is not healthy": the
    supervisor is replacing that instance while its sibling serves): worth sending again. `exc`: tritonclient's
    InferenceServerException, or any error. A stopping server's answers count (aot.client.errors.server_is_stopping):
    a restarted server, or another replica, answers the call sent again."""
    if reached_a_dead_instance(one_line(exc)) or server_is_stopping(one_line(exc)):
        return True
    text = one_line(exc).lower()
    status = exc.status() if hasattr(exc, "status") and callable(exc.status) else None
    if status is not None and "UNAVAILABLE" not in str(status) and "UNKNOWN" not in str(status):
        return False
    return any(phrase in text for phrase in _NO_SERVER)


DEADLINES = ("DEADLINE_EXCEEDED", "504")


def classified(exc, tasks: tuple[str | None, ...] = (None,)) -> list[InferenceError]:
    """`exc` as the InferenceError each of `tasks` would get (a refusal that names one of them is that task's own:
    aot.client.errors.from_triton)."""
    if isinstance(exc, InferenceError):
        return [exc]
    return [from_triton(exc, task=task) for task in tasks]


def worth_sending_again(exc, tasks: tuple[str | None, ...] = (None,), deadlines: bool = True) -> bool:
    """Whether a call of `tasks` that failed with `exc` may be answered when sent again (module docstring): a
    retryable error for every task it carried. `deadlines`: a missed deadline counts (infer_many: its own packs
    queued at the server; a single call's deadline is its caller's bound, not retried)."""
    if found_no_server(exc):
        return True
    errors = classified(exc, tasks)
    return all(e.retryable and (deadlines or e.status not in DEADLINES) for e in errors)


class Backoff:
    """The waits between tries of one call: RETRY_BACKOFF doubling, or the server's retry hint, for at most `seconds`
    in all."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.wait = RETRY_BACKOFF[0]

    def next_wait(self, hint: float | None = None) -> float | None:
        """Seconds to wait before the next try (`hint`: the server's retry_after, honoured); None when the time is up."""
        wait, self.wait = self.wait, min(self.wait * 2, RETRY_BACKOFF[1])
        wait = wait if hint is None else hint
        return wait if time.monotonic() + wait < self.deadline else None


class Outage:
    """One retry window shared by the requests of one infer_many call: it opens at the first request that fails for
    a reason a retry may cure and closes when one is answered, so an outage costs the call `seconds` in all, not
    `seconds` per request (3,000 lines against a server gone for good took 3,000 x 10 s / 16 requests in flight). A
    wait is the server's retry hint where it gave one, else grows with the outage's age, from RETRY_BACKOFF's first
    to its last. Used by the one thread that runs the call (aot.client.batch)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.since: float | None = None  # when the open outage began (time.monotonic()); None: none is open

    def next_wait(self, hint: float | None = None) -> float | None:
        """Seconds to wait before sending again (`hint`: the server's retry_after); None when the window is over."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        waited = now - self.since
        wait = min(max(RETRY_BACKOFF[0], waited / 2), RETRY_BACKOFF[1]) if hint is None else hint
        return wait if waited + wait < self.seconds else None

    def expired(self) -> bool:
        """Whether an open outage has lasted the whole window."""
        return self.since is not None and time.monotonic() - self.since >= self.seconds

    def answered(self) -> None:
        self.since = None
