"""Errors a served step returns to one request's client, with the status a client expects."""

import re

# RequestError.reason -> the TritonError code (HTTP status / gRPC status) a step answers with
TRITON_CODES = {"invalid": "INVALID_ARG",  # 400 / INVALID_ARGUMENT: the request itself is wrong
         "not_found": "NOT_FOUND",  # 404 / NOT_FOUND: an unknown task or task version
         "unavailable": "UNAVAILABLE",  # 503 / UNAVAILABLE: the task exists but cannot be served (damaged)
         "rate_limited": "UNAVAILABLE",  # 503 / UNAVAILABLE: the caller sent more than its rate (serving.rate_limits)
         "stopping": "UNAVAILABLE"}  # 503 / UNAVAILABLE: the server stops and takes no new request (the same module)
WHOLE_REQUEST = ("rate_limited", "stopping")  # refusals of a whole request: they name no item of it
# An "unavailable" message names its task, quoted as Python's repr quotes it ('sentiment'): that tells a client
# (aot.client.errors) a task that cannot be served, which a retry does not cure, from a server it cannot reach now,
# which a retry may. A refusal that a retry cures (a task store that does not answer now, a rate limit) ends with a
# retry hint (retry_hint): the client takes it for a retryable error, whatever it names. The python backend of
# Triton 2.51 has no RESOURCE_EXHAUSTED (pb_utils.TritonError: UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE,
# UNSUPPORTED, ALREADY_EXISTS, CANCELLED), so a rate limit answers UNAVAILABLE with the hint.

# A request's outcome in a step ("ok", a RequestError reason, or "internal": a fault of the server) -> the gRPC status
# name its client sees (the request log writes it)
STATUS = {"ok": "OK", "invalid": "INVALID_ARGUMENT", "not_found": "NOT_FOUND", "unavailable": "UNAVAILABLE",
          "rate_limited": "UNAVAILABLE", "stopping": "UNAVAILABLE", "internal": "INTERNAL"}

_RETRY_HINT = re.compile(r"retry in ([0-9]+(?:\.[0-9]+)?) s\b")


def retry_hint(seconds: float) -> str:
    """The end of a refusal that a retry after `seconds` may cure: `retry in 0.25 s`."""
    return f"retry in {max(seconds, 0.01):.2f} s"


def retry_after(message: str) -> float | None:
    """The seconds a refusal's retry hint (retry_hint) asks a client to wait; None when it has none."""
    found = _RETRY_HINT.findall(message)
    return float(found[-1]) if found else None


class RequestError(ValueError):
    """Bad input in one request, or a task it cannot be served with: the message goes back to that request's
    client alone (no server path, no traceback); the other requests of the batch are served. `reason`
    (TRITON_CODES) chooses the status the client sees."""

    def __init__(self, message: str, reason: str = "invalid"):
        if reason not in TRITON_CODES:
            raise ValueError(f"unknown RequestError reason {reason!r}: expected one of {', '.join(TRITON_CODES)}")
        super().__init__(message)
        self.reason = reason
