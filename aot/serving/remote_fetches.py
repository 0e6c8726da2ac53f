"""When a step asks a remote task store (object storage) for a version, and how long a request waits for it: what
keeps a store that stopped answering (a network partition, SIGSTOP) away from every request that does not need it
(aot.serving.task_registry).

A version not on this host is fetched by a thread of its own (FETCHES_AT_ONCE at a time); its request waits while the
store answers: the step's poll of the store's generation hint (every second, by its own thread) has not failed and
none has been under way for STALL_SECONDS. When it does not, the request fails at once, 503 with a retry hint; the
fetch goes on, and its version serves once it lands. A fetch that failed because the store did not answer pauses
every fetch RETRY_FETCH_SECONDS; one whose object failed its digest pauses that version alone. What a client reads
names its task and never the store's address (FetchError.client); the details go to the step's log.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from aot.serving.errors import RequestError, retry_hint
from aot.serving.store.backend import BackendError
from aot.serving.store.reader import task_of

STALL_SECONDS = 1.0  # a poll of the object store unanswered this long: the store does not answer now
RETRY_FETCH_SECONDS = 2.0  # a version that could not be fetched fails its requests at once this long, then is retried
FETCHES_AT_ONCE = 2  # versions fetched from an object store at the same time, each by a thread of its own
WAIT_STEP = 0.05  # seconds between two looks at whether the store still answers, while a request waits on a fetch
STORE = ""  # the key of a pause of every fetch: the store did not answer


class FetchError(OSError):
    """A version could not be fetched from a remote store: unreachable (every fetch pauses), or one object failed its
    digest (that version pauses). str() is the detail for the server's log; `client` what its requests' clients
    read."""

    def __init__(self, detail: str, client: str, unreachable: bool):
        super().__init__(detail)
        self.client, self.unreachable = client, unreachable


def cannot_fetch(version: str) -> str:
    """What the client of a version that cannot be fetched now reads: the task, never the store's address."""
    return (f"task {task_of(version)!r} ({version}) cannot be fetched from the task store now (it does not answer); "
            f"{retry_hint(RETRY_FETCH_SECONDS)}")


def fetch_error(version: str, location: str, exc: Exception) -> FetchError:
    """A failed fetch of `version` from the store at `location`: the store unreachable (a BackendError), or an object
    damaged on its way (its digest differs)."""
    unreachable = isinstance(exc, BackendError)
    detail = f"task {task_of(version)!r} ({version}) cannot be fetched from the task store {location}: {exc}"
    client = cannot_fetch(version) if unreachable else (
        f"task {task_of(version)!r} ({version}): a file fetched from the task store is damaged (its sha256 differs "
        f"from the one published); {retry_hint(RETRY_FETCH_SECONDS)}")
    return FetchError(detail, client, unreachable)


class RemoteFetches:
    """The fetch policy of one step's registry on a remote store. `errored()`: whether the step's last read of the
    store's index failed (its view's error)."""

    def __init__(self, errored: Callable[[], bool]):
        self.errored = errored
        self._pool = ThreadPoolExecutor(FETCHES_AT_ONCE, "aot-fetch")
        self._paused: dict[str, tuple[float, str]] = {}  # version (or STORE) -> (until when, what its client reads)
        self._polling_since: float | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @contextlib.contextmanager
    def polling(self) -> Iterator[None]:
        """Around a poll of the store: while it is under way, its age says whether the store answers."""
        self._polling_since = time.monotonic()
        try:
            yield
        finally:
            self._polling_since = None

    def answers(self) -> bool:
        """Whether the store answered the last poll, and none has waited past STALL_SECONDS."""
        since = self._polling_since
        return not self.errored() and (since is None or time.monotonic() - since < STALL_SECONDS)

    def refusal(self, version: str) -> str | None:
        """Why a fetch of `version` is not tried now (what its client reads), or None."""
        paused = self._paused.get(version) or self._paused.get(STORE)
        if paused is not None and time.monotonic() < paused[0]:
            return paused[1] if version in self._paused else cannot_fetch(version)
        return None if self.answers() else cannot_fetch(version)

    def submit(self, fetch: Callable, *args) -> None:
        self._pool.submit(fetch, *args)

    def wait(self, version: str, pending: Future):
        """The result of `pending` (the fetch and load of `version`), waited for while the store answers; else, or
        when the fetch failed, a RequestError its client reads."""
        while True:
            try:
                return pending.result(timeout=WAIT_STEP)
            except FetchError as exc:
                raise RequestError(exc.client, "unavailable") from None
            except TimeoutError:
                if not self.answers():  # the fetch goes on; its version serves once it lands
                    raise RequestError(cannot_fetch(version), "unavailable") from None

    def failed(self, version: str, exc: FetchError) -> None:
        self._paused[STORE if exc.unreachable else version] = (time.monotonic() + RETRY_FETCH_SECONDS, exc.client)

    def fetched(self, version: str) -> None:
        self._paused.pop(version, None)
        self._paused.pop(STORE, None)
