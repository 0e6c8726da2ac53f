"""The end of a graceful stop, after the drain: no new work on either protocol, the accepted work finished, and no
open connection that can turn the stop into an abrupt one.

What Triton 2.51 does alone on SIGTERM (server src/main.cc): its HTTP front end stops accepting connections and waits
for every open one to close, with no timeout of its own; gRPC meanwhile keeps accepting and answering; then the core
refuses new requests ("Server is stopping"), waits for those in flight and unloads the models, in what is left of
--exit-timeout-secs. A stray HTTP connection (POST headers and 10 bytes of body, then silence) spent all of it: gRPC
answered 5 s more, then "Exit timeout expired. Exiting immediately" cut off what the server had accepted (issue 57.3).

So before the signal (the lifecycle runs these, for `aot serve` and the container alike):
1. refuse: the steps are told that the server stops (aot.serving.watch.mark_stopping) and the first step refuses every
   new request from then on, on gRPC and HTTP alike, UNAVAILABLE with a retry hint (aot.serving.rate_limits);
2. finish: wait until nothing is in flight (no step instance in a batch, Triton's pending-request gauges at 0, twice in
   a row), at most the server's exit timeout;
3. close: the server's open HTTP connections are shut down (aot.serving.supervision.connections), then again just after
   the signal, until the server takes no new one: Triton's own wait ends at once, and the exit timeout is left whole
   for unloading. Where closing is refused, that wait is bounded by --exit-timeout-secs, with nothing accepted left.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from aot.serving.supervision.connections import close_connections, connections
from aot.serving.supervision.procfs import alive, stub_processes
from aot.serving.watch import busy_since, mark_stopping

# tritonserver's own defaults, for a command that does not set the flag
TRITON_EXIT_TIMEOUT, TRITON_HTTP_PORT, TRITON_METRICS_PORT = 30, "8000", "8002"
CHECK_SECONDS = 0.05
CLOSE_SECONDS = 2.0  # after the signal, connections are closed this long (the server stops accepting at once)
_PENDING = "nv_inference_pending_request_count{"


def flag(command: list[str], name: str) -> str | None:
    """The value of `name=value` in a tritonserver command (None when absent)."""
    return next((a.split("=", 1)[1] for a in command if a.startswith(f"{name}=")), None)


def exit_timeout(command: list[str]) -> float:
    value = flag(command, "--exit-timeout-secs")
    return float(value) if value is not None and value.isdigit() else TRITON_EXIT_TIMEOUT


def metrics_url(command: list[str]) -> str | None:
    """Where the server's Prometheus metrics are (None when it serves none)."""
    if (flag(command, "--allow-metrics") or "true").lower() in ("false", "0"):
        return None
    host = flag(command, "--metrics-address") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{flag(command, '--metrics-port') or TRITON_METRICS_PORT}/metrics"


def pending_requests(url: str | None) -> int | None:
    """Requests the server has accepted and not yet handed to a step instance (the sum of its pending-request
    gauges); None when its metrics cannot be read."""
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            text = answer.read().decode("utf-8", "replace")
    except OSError:
        return None
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(_PENDING))


def idle(server_pid: int, metrics: str | None) -> bool:
    """No step instance of the server in a batch and, where its metrics say, no request waiting for one."""
    if any(busy_since(server_pid, s.instance) is not None for s in stub_processes(server_pid)):
        return False
    return not pending_requests(metrics)


def finish_accepted(server_pid: int, command: list[str], log: Callable[[str], None],
                    timeout: float | None = None) -> bool:
    """Steps 1 and 2: refuse new requests, then wait until the accepted ones are answered (idle twice in a row, at
    most `timeout` seconds: the server's exit timeout). Whether they all were."""
    try:
        mark_stopping(server_pid)
    except OSError as exc:  # another user's file of that name (/dev/shm is shared): the steps would not trust it
        log(f"supervisor: the steps cannot be told that the server stops ({exc}); they answer until it does")
    metrics = metrics_url(command)
    deadline = time.monotonic() + (exit_timeout(command) if timeout is None else timeout)
    quiet = False
    while alive(server_pid) and time.monotonic() < deadline:
        now_quiet = idle(server_pid, metrics)
        if now_quiet and quiet:
            return True
        quiet = now_quiet
        time.sleep(CHECK_SECONDS)
    return not alive(server_pid)


def close_http(server_pid: int, port: int, log: Callable[[str], None], seconds: float = 0.0) -> int:
    """Step 3: shut down the server's HTTP connections, again and again for `seconds` (0: once); how many. Where that
    is refused, say what holds the stop and for how long at most."""
    closed = 0
    deadline = time.monotonic() + seconds
    while alive(server_pid):
        try:
            closed += close_connections(server_pid, port)
        except OSError as exc:
            if connections(server_pid, port):
                log(f"supervisor: open HTTP connections hold tritonserver's stop up to its --exit-timeout-secs "
                    f"(they cannot be closed here: {exc}); every request it accepted was answered before")
            return closed
        if time.monotonic() >= deadline:
            return closed
        time.sleep(CHECK_SECONDS * 2)
    return closed
