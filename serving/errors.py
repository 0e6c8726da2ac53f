"""Errors a served step returns to one request's client."""


class RequestError(ValueError):
    """Bad input in one request, or a task it cannot be served with: the message goes back to that request's
    client alone (no server path, no traceback); the other requests of the batch are served."""
