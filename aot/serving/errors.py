"""Errors a served step returns to one request's client, with the status a client expects."""

# RequestError.reason -> the TritonError code (HTTP status / gRPC status) a step answers with
TRITON_CODES = {"invalid": "INVALID_ARG",  # 400 / INVALID_ARGUMENT: the request itself is wrong
         "not_found": "NOT_FOUND",  # 404 / NOT_FOUND: an unknown task or task version
         "unavailable": "UNAVAILABLE"}  # 503 / UNAVAILABLE: the task exists but cannot be served (damaged)
# An "unavailable" message names its task, quoted as Python's repr quotes it ('sentiment'): that tells a client
# (aot.client.errors) a task that cannot be served, which a retry does not cure, from a server it cannot reach now,
# which a retry may.

# A request's outcome in a step ("ok", a RequestError reason, or "internal": a fault of the server) -> the gRPC status
# name its client sees (the request log writes it)
STATUS = {"ok": "OK", "invalid": "INVALID_ARGUMENT", "not_found": "NOT_FOUND", "unavailable": "UNAVAILABLE",
          "internal": "INTERNAL"}


class RequestError(ValueError):
    """Bad input in one request, or a task it cannot be served with: the message goes back to that request's
    client alone (no server path, no traceback); the other requests of the batch are served. `reason`
    (TRITON_CODES) chooses the status the client sees."""

    def __init__(self, message: str, reason: str = "invalid"):
        if reason not in TRITON_CODES:
            raise ValueError(f"unknown RequestError reason {reason!r}: expected one of {', '.join(TRITON_CODES)}")
        super().__init__(message)
        self.reason = reason
