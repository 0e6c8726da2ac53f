"""One infer_many call, run by the thread that iterates it: items packed into requests, answers in input order as
they arrive, every failure a retry may cure sent again within one retry window, paced to what the server says.

    run = client.infer_stream(items, concurrency=16, pack=32, on_done=..., on_notice=...)
    for answer in run: ...    # in input order, each as soon as it and every one before it is answered
    run.stats                 # lines answered, failed by reason, retried, seconds

Sent again (aot.client.retry.worth_sending_again): a request that found no server, a stopping server's refusals,
CANCELLED, UNAVAILABLE that names no task of the request, a rate limit or any refusal with a retry hint, a missed
deadline. Each is sent again after the wait the server asked for (its retry hint), else after a backoff that grows
with the outage, with fewer requests in flight and fewer texts per request (aot.client.pacing), first of what is
still to send, so that the answers keep flowing in order.

The retry window (Client.retry_seconds): one for the whole call. It opens at the first refusal after an answer and
closes at the next answer; when it has been open that long (no request of the call answered meanwhile), every line
still unanswered fails with the last refusal, named as given up. A line that keeps failing alone while others are
answered (its task's store does not answer, say) fails after the same time. Each request's deadline
(Client.timeout) runs from when it is sent: lines waiting in this client's queue never spend it, and a request that
misses it, behind the call's own requests at the server, is sent again with fewer in flight.

Everything runs in the iterating thread: gRPC's callbacks only queue what they got, so an answer that cannot be read
fails its lines instead of being lost in a callback, and no lock is needed.
"""

from __future__ import annotations

import queue
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from aot.client.errors import InferenceError, InvalidInput, one_line
from aot.client.pacing import Pacer
from aot.client.retry import Outage, classified, worth_sending_again

NOTICE_AFTER = 1.0  # seconds of an outage before on_notice says that the call is waiting for the server


@dataclass
class RunStats:
    """What a call did so far: its lines, those answered, those failed by reason (the error's class), the first
    failed line of each reason, how many lines were sent again, and since when it runs."""

    lines: int
    answered: int = 0
    failed: Counter = field(default_factory=Counter)
    first_failure: dict[str, dict] = field(default_factory=dict)
    retried: int = 0
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def count(self, answer: dict) -> None:
        if "error" not in answer:
            self.answered += 1
            return
        reason = answer.get("error_type") or "InferenceError"
        self.failed[reason] += 1
        self.first_failure.setdefault(reason, answer)


def _echo(item) -> dict:
    """What an item's answer repeats of it: its id (when given) and task."""
    return {key: item[key] for key in ("id", "task") if key in item} if isinstance(item, dict) else {}


class BatchRun:
    """An iterable of the answers of `items` in input order (module docstring). `on_done(index, answer)`: each
    answer as it arrives, in any order (progress); `on_notice(text)`: what a person may want to know meanwhile
    (waiting for the server, paced by it)."""

    def __init__(self, client, items: Iterable[dict], concurrency: int, pack: int,
                 on_done: Callable[[int, dict], None] | None = None, on_notice: Callable[[str], None] | None = None):
        if pack < 1:
            raise ValueError(f"pack {pack!r}: expected a positive number of texts per request")
        if concurrency < 1:
            raise ValueError(f"concurrency {concurrency!r}: expected a positive number of requests in flight")
        self.client, self.items = client, list(items)
        self.on_done, self.on_notice = on_done, on_notice
        self.stats = RunStats(len(self.items))
        self._results: list[dict | None] = [None] * len(self.items)
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (indexes, sent, result, error): gRPC's callbacks
        self._outage = Outage(client.retry_seconds)
        self._pacer = Pacer(concurrency, pack)
        if client._pack_limit is not None:
            self._pacer.cap_pack(client._pack_limit)
        self._entries: dict[int, dict] = {}
        self._pending: deque[int] = deque()  # what is to be sent, in the order it will be
        self._alone: set[int] = set()  # items sent one a request (their pack was refused for one of its items)
        self._failing_since: dict[int, float] = {}
        self._in_flight = 0
        self._last_refusal = None
        self._waiting_said = self._hint_said = False

    def __iter__(self) -> Iterator[dict]:
        self._prepare()
        out = 0
        while True:
            while out < len(self._results) and self._results[out] is not None:
                answer, self._results[out] = self._results[out], None
                out += 1
                yield answer
            if out == len(self._results):
                break
            self._give_up_when_the_window_is_over()
            self._send_what_fits()
            self._wait()
        self.stats.ended = time.monotonic()

    def _prepare(self) -> None:
        """Each item checked and made ready to send (aot.client.client.Client._entry); a bad one answered at once."""
        for i, item in enumerate(self.items):
            try:
                self._entries[i] = self.client._entry(item["task"], item["text"], item.get("text_pair"))
            except (KeyError, AttributeError, TypeError) as exc:
                echo = _echo(item)
                self._finish(i, InvalidInput(f"item {i + 1}: expected {{\"task\": \"...\", \"text\": \"...\"}}, "
                                             f"missing or wrong {exc}", task=echo.get("task"),
                                             id=echo.get("id")).answer())
                continue
            except InferenceError as exc:
                exc.task, exc.id = exc.task or item.get("task"), item.get("id")
                self._finish(i, exc.answer())
                continue
            self._pending.append(i)

    def _finish(self, i: int, answer: dict) -> None:
        self._results[i] = _echo(self.items[i]) | answer
        self._failing_since.pop(i, None)
        self.stats.count(self._results[i])
        if self.on_done is not None:
            self.on_done(i, self._results[i])

    def _error_of(self, i: int, error) -> InferenceError:
        """The InferenceError item i gets for `error` (tritonclient's, or one of ours)."""
        task, id = self.items[i].get("task"), self.items[i].get("id")
        failure = classified(error, (task,))[0]
        return type(failure)(str(failure), failure.status, task=task, id=id)

    def _given_up(self, i: int, error, hint: float | None = None) -> dict:
        """Item i's answer when the retry window is over (`hint`: the server asked to wait longer than it)."""
        failure, window = self._error_of(i, error), self.client.retry_seconds
        why = (f"the server asks to wait {hint:g} s, longer than the retry window of {window:g} s"
               if hint is not None and hint >= window else f"no answer within the retry window of {window:g} s")
        return type(failure)(f"{failure} (given up: {why})", failure.status, task=failure.task,
                             id=failure.id).answer()

    # --- sending ----------------------------------------------------------------------------------------------------

    def _send_what_fits(self) -> None:
        now = time.monotonic()
        while self._pending and self._pacer.can_send(self._in_flight, now):
            self._send(self._take())

    def _take(self) -> list[int]:
        """The next request's items: the first waiting, and those after it that send the same inputs (texts, or
        token ids), up to the pack size now; an item sent alone goes alone."""
        first = self._pending.popleft()
        group = [first]
        if first in self._alone:
            return group
        ids = "ids" in self._entries[first]
        while self._pending and len(group) < self._pacer.pack:
            i = self._pending[0]
            if i in self._alone or ("ids" in self._entries[i]) != ids:
                break
            group.append(self._pending.popleft())
        return group

    def _send(self, group: list[int]) -> None:
        self._in_flight += 1
        sent = time.monotonic()
        try:
            inputs = self.client._pack_inputs([self._entries[i] for i in group])
            self.client._send_async(inputs, lambda result, error: self._events.put((group, sent, result, error)),
                                    self.client.timeout)
        except Exception as exc:  # noqa: BLE001 - a request that cannot be sent fails (or retries) its items
            self._events.put((group, sent, None, exc))

    def _requeue(self, group: list[int]) -> None:
        """Sent again before anything else, in input order, so that the answers keep flowing in order."""
        self._pending.extendleft(reversed(group))

    # --- answers ----------------------------------------------------------------------------------------------------

    def _wait(self) -> None:
        """Handle what gRPC answered: wait for it at most until a held send may go, or a notice is due."""
        timeout = 0.5
        if self._pending and self._in_flight < self._pacer.in_flight_allowed():
            timeout = min(timeout, self._pacer.hold())
        if self._outage.since is not None and not self._waiting_said:
            timeout = min(timeout, self._outage.since + NOTICE_AFTER - time.monotonic())
        try:
            event = self._events.get(timeout=max(timeout, 0.001))
        except queue.Empty:
            self._say_waiting()
            return
        while True:
            self._handle(*event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
        self._say_waiting()

    def _handle(self, group: list[int], sent: float, result, error) -> None:
        self._in_flight -= 1
        if error is None:
            self._answered(group, sent, result)
            return
        limit = _batch_limit(error)
        if len(group) > 1 and limit is not None and limit < len(group):
            self.client._pack_limit = limit
            self._pacer.cap_pack(limit)
            self._requeue(group)
        elif len(group) > 1 and _an_items_fault(error):  # each alone, to find the item it was
            self._alone.update(group)
            self._requeue(group)
        elif worth_sending_again(error, tuple({self.items[i].get("task") for i in group})):
            self._retry(group, sent, error)
        else:
            for i in group:
                self._finish(i, self._error_of(i, error).answer())

    def _answered(self, group: list[int], sent: float, result) -> None:
        try:
            rows = self.client._decode_rows(result)
            if len(rows) != len(group):
                raise ValueError(f"{len(rows)} answers for {len(group)} texts")
        except Exception as exc:  # noqa: BLE001 - an answer that cannot be read fails its items, not the call
            for i in group:
                self._finish(i, self._error_of(i, InferenceError(f"the answer could not be read: "
                                                                 f"{type(exc).__name__}: {exc}")).answer())
            return
        if self._waiting_said and self._outage.since is not None and self.on_notice is not None:
            self.on_notice(f"the server at {self.client.url} answers again after "
                           f"{time.monotonic() - self._outage.since:.1f} s")
        self._waiting_said = False
        self._outage.answered()
        self._pacer.answered(sent)
        for i, row in zip(group, rows, strict=True):
            self._finish(i, row)

    def _retry(self, group: list[int], sent: float, error) -> None:
        """Sent again after the server's hint or the backoff, paced down; given up when the call's window is over,
        or the line's own."""
        now = time.monotonic()
        self._last_refusal = error
        hint = classified(error)[0].retry_after
        wait = self._outage.next_wait(hint)
        again = []
        for i in group:
            since = self._failing_since.setdefault(i, now)
            if wait is None or now - since >= self.client.retry_seconds:
                self._finish(i, self._given_up(i, error, hint))
            else:
                again.append(i)
        if not again:
            return
        self._pacer.refused(sent, wait)
        self.stats.retried += len(again)
        self._requeue(again)
        if hint is not None and not self._hint_said and self.on_notice is not None:
            self._hint_said = True
            self.on_notice(f"the server at {self.client.url} asks to send later ({one_line(error)}): paced to it, "
                           "lines sent again when it says")

    def _give_up_when_the_window_is_over(self) -> None:
        """No request answered for the whole window: what is still to send fails now, with the last refusal."""
        if self._pending and self._outage.expired():
            while self._pending:
                i = self._pending.popleft()
                self._finish(i, self._given_up(i, self._last_refusal))

    def _say_waiting(self) -> None:
        since = self._outage.since
        if since is None or self._waiting_said or time.monotonic() - since < NOTICE_AFTER:
            return
        self._waiting_said = True
        if self.on_notice is not None:
            self.on_notice(f"waiting for the server at {self.client.url}: {one_line(self._last_refusal)} (sending "
                           f"again for up to {self.client.retry_seconds:g} s)")


def _an_items_fault(error) -> bool:
    """Whether the server refused a pack for one of its items (its message begins "item K of N: ", aot.serving.steps):
    sent again one by one, the other items are answered. A refusal of the whole request (a rate limit, a stopping or
    overloaded server, a deadline) names no item, and is retried or every item's answer: sent again text by text it
    would only cost more."""
    return re.search(r"\bitem \d+ of \d+: ", one_line(error)) is not None


def _batch_limit(error) -> int | None:
    """The server's max batch size when it refused a request for carrying more items (Triton: "inference request
    batch-size must be <= N"), else None."""
    match = re.search(r"batch-size must be <= (\d+)", str(error))
    return int(match.group(1)) if match else None
