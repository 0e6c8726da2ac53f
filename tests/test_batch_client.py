"""infer_many's run (aot.client.batch, aot.client.pacing, aot.client.retry) against a fake transport, no server:
what is sent again (CANCELLED, a rate limit with its hint, a missed deadline, no server) within one retry window for
the whole call, answers yielded in input order as they arrive, paced down by refusals. The same through a real
server and `aot infer`: tests/test_batch_scoring.py."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from aot.client.client import Client
from aot.serving import protocol


class Refusal(Exception):
    """A gRPC error as tritonclient raises it: a status and a message."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self._status, self._message = status, message

    def status(self) -> str:
        return f"StatusCode.{self._status}"

    def message(self) -> str:
        return self._message


class Result:
    """A request's answer as tritonclient gives it: ANSWER and TASK_VERSION, [N, 1]."""

    def __init__(self, entries: list[dict]):
        self.rows = [json.dumps({"label": e[protocol.TEXT]}).encode() for e in entries]
        self.versions = [f"{e[protocol.TASK]}@v1".encode() for e in entries]

    def as_numpy(self, name: str) -> np.ndarray:
        values = self.rows if name == protocol.ANSWER else self.versions
        return np.array(values, dtype=np.object_).reshape(-1, 1)


class FakeServer:
    """Stands in for the transport of a Client: `decide(entries, in_flight)` returns None (answer), or a Refusal;
    answers come from another thread, as gRPC's do. Records every request: (time sent, texts, refusal or None, requests
    in flight with it)."""

    def __init__(self, client: Client, decide, delay: float = 0.0):
        self.decide, self.delay = decide, delay
        self.sent: list[tuple[float, list[str], Exception | None, int]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._lock = threading.Lock()
        client._pack_inputs = lambda entries: entries  # the fake reads the entries themselves
        client._send_async = self.send

    def send(self, entries, callback, timeout) -> None:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            refusal = self.decide(entries, self.in_flight)
            self.sent.append((time.monotonic(), [e[protocol.TEXT] for e in entries], refusal, self.in_flight))

        def answer():
            with self._lock:
                self.in_flight -= 1
            callback(None, refusal) if refusal is not None else callback(Result(entries), None)

        threading.Timer(self.delay, answer).start()


def _items(n: int) -> list[dict]:
    return [{"task": "alpha", "text": f"t{k}", "id": k} for k in range(n)]


def _run(client: Client, items: list[dict], **kwargs) -> list[dict]:
    """infer_many in a thread, so that a run that never ends fails the test instead of hanging it."""
    done: list = []
    call = threading.Thread(target=lambda: done.append(client.infer_many(items, **kwargs)), daemon=True)
    call.start()
    call.join(timeout=120)
    assert done, "infer_many did not return"
    return done[0]


def _answered_once_in_order(answers: list[dict], items: list[dict]) -> None:
    assert len(answers) == len(items)
    assert [a["id"] for a in answers] == [i["id"] for i in items]
    assert [a.get("label") for a in answers] == [i["text"] for i in items], [a for a in answers if "error" in a][:3]


def test_cancelled_and_a_stopping_server_are_sent_again():
    """Issue 54.1: the requests a stopping server cancels (CANCELLED) or refuses ("Server is stopping") are sent
    again, not answered with an error."""
    client = Client("127.0.0.1:1", retry_seconds=30)
    refusals = iter([Refusal("CANCELLED", "Locally cancelled by application!"),
                     Refusal("UNAVAILABLE", "Server is stopping"), Refusal("CANCELLED", "CANCELLED")])
    server = FakeServer(client, lambda entries, _: next(refusals, None))
    items = _items(200)
    answers = _run(client, items, pack=8)
    _answered_once_in_order(answers, items)
    assert sum(r is not None for _, _, r, _ in server.sent) == 3


def test_a_rate_limit_is_honoured_and_paces_the_call_down():
    """Issue 54.4: a refusal with a retry hint (`retry in 0.2 s`) is sent again no sooner than the hint says, with
    fewer requests in flight and fewer texts per request than before it; every line is answered once."""
    client = Client("127.0.0.1:1", retry_seconds=30)
    budget = [40]  # texts the server admits before it refuses once

    def decide(entries, in_flight):
        if budget[0] <= 0:
            budget[0] = 40
            return Refusal("UNAVAILABLE", "rate limit: requests without a tenant key send at most 100 texts per "
                                          "second to this server; retry in 0.20 s")
        budget[0] -= len(entries)
        return None

    server = FakeServer(client, decide, delay=0.01)
    items = _items(300)
    answers = _run(client, items, pack=16, concurrency=8)
    _answered_once_in_order(answers, items)
    refused = [k for k, (_, _, r, _) in enumerate(server.sent) if r is not None]
    assert refused
    for k in refused:
        at, texts, _, _ = server.sent[k]
        later = [(t, sent, flight) for t, sent, _, flight in server.sent[k + 1:] if set(sent) & set(texts)]
        assert later and later[0][0] >= at + 0.2, (k, later[:1])  # not before the server said
        assert len(later[0][1]) <= len(texts)
        if k == refused[0]:  # the first cut: half the texts a request, half the requests in flight
            assert len(later[0][1]) <= 8 and later[0][2] <= 4, later[0]


def test_missed_deadlines_behind_the_calls_own_requests_are_sent_again_with_fewer_in_flight():
    """Issue 54.5: a server that misses the deadline of requests queued behind more than 2 others of the call: the
    call sends them again with fewer in flight, and every line is answered (before, most failed DEADLINE_EXCEEDED)."""
    client = Client("127.0.0.1:1", retry_seconds=30, timeout=0.05)
    server = FakeServer(client, lambda entries, in_flight: Refusal("DEADLINE_EXCEEDED", "Deadline Exceeded")
                        if in_flight > 2 else None, delay=0.005)
    items = _items(400)
    _answered_once_in_order(_run(client, items, pack=8, concurrency=16), items)
    assert any(r is not None for _, _, r, _ in server.sent)


def test_a_server_gone_for_good_fails_what_is_left_after_one_window_for_the_whole_call():
    """No server at all: every line fails once the window (0.5 s) is over, with the transport's reason and that it
    was given up; the stats count them by reason; the call ends, not 0.5 s per request."""
    client = Client("127.0.0.1:1", retry_seconds=0.5)
    FakeServer(client, lambda entries, _: Refusal("UNAVAILABLE", "failed to connect to all addresses; last error: "
                                                                 "Connection refused"))
    items = _items(3000)
    run = client.infer_stream(items, pack=4, concurrency=16)
    started = time.monotonic()
    answers = list(run)
    assert time.monotonic() - started < 60  # one window, not one per request (750 requests x 0.5 s)
    assert len(answers) == 3000 and all(a["error_type"] == "Unavailable" and a["retryable"] for a in answers)
    assert "failed to connect" in answers[-1]["error"]
    assert answers[-1]["error"].endswith("(given up: no answer within the retry window of 0.5 s)")
    assert run.stats.answered == 0 and run.stats.failed == {"Unavailable": 3000} and run.stats.retried > 0


def test_a_line_that_keeps_failing_while_others_are_answered_fails_alone_after_the_window():
    """A task whose store does not answer (a retryable refusal naming it, with a hint) while the other task is
    answered: its line fails after the window, every other line is answered."""
    client = Client("127.0.0.1:1", retry_seconds=0.5)
    FakeServer(client, lambda entries, _: Refusal(
        "UNAVAILABLE", "item 1 of 1: task 'beta' cannot be fetched from the task store now; retry in 0.05 s")
        if any(e[protocol.TASK] == "beta" for e in entries) else None)
    items = _items(50)
    items[7]["task"] = "beta"
    answers = _run(client, items, pack=4)
    assert [k for k, a in enumerate(answers) if "error" in a] == [7]
    assert answers[7]["error_type"] == "Unavailable" and "given up" in answers[7]["error"]
    assert all(a.get("label") == items[k]["text"] for k, a in enumerate(answers) if k != 7)


def test_answers_are_yielded_in_order_as_they_arrive():
    """Issue 54.3 and 54.6: the first lines are yielded (and on_done told) while later requests are still
    unanswered; never out of order."""
    client = Client("127.0.0.1:1")
    first_seen = threading.Event()
    FakeServer(client, lambda entries, _: None)
    real_send = client._send_async

    def send(entries, callback, timeout):  # requests after the first wait until the caller saw its answers
        if entries[0]["TEXT"] == "t0":
            return real_send(entries, callback, timeout)
        threading.Thread(target=lambda: (first_seen.wait(30), real_send(entries, callback, timeout))).start()

    client._send_async = send
    done: list[int] = []
    run = client.infer_stream(_items(64), pack=8, on_done=lambda i, a: done.append(i))
    seen = []
    for answer in run:
        seen.append(answer["id"])
        if len(seen) == 8:
            assert sorted(done) == list(range(8))  # the other packs are held until now
            first_seen.set()
    assert seen == list(range(64)) and sorted(done) == list(range(64))


def test_the_pacer_halves_on_refusals_and_grows_back_on_answers():
    """One cut per event: the refusals and answers of requests sent before the last cut do not move the pacer."""
    from aot.client.pacing import Pacer

    pacer = Pacer(concurrency=16, pack=32)
    for _ in range(3):
        before = time.monotonic()
        pacer.refused(before, 0.0)
        pacer.refused(before - 1, 0.0)  # in flight at the cut: the same event
        pacer.answered(before - 1)
    assert (pacer.in_flight_allowed(), pacer.pack) == (2, 4)
    pacer.refused(time.monotonic(), 0.0)
    pacer.refused(time.monotonic(), 0.0)
    assert (pacer.in_flight_allowed(), pacer.pack) == (1, 1)
    for _ in range(5):
        pacer.answered(time.monotonic())
    assert (pacer.in_flight_allowed(), pacer.pack) == (6, 32)
    pacer.cap_pack(8)
    for _ in range(20):
        pacer.answered(time.monotonic())
    assert (pacer.in_flight_allowed(), pacer.pack) == (16, 8)
    pacer.refused(time.monotonic(), 5.0)
    assert not pacer.can_send(0, time.monotonic()) and 4 < pacer.hold() <= 5


@pytest.mark.parametrize("status,message,again", [
    ("CANCELLED", "CANCELLED", True),
    ("UNAVAILABLE", "rate limit: tenant 'acme' sends at most 5 texts per second to this server; retry in 0.20 s",
     True),
    ("UNAVAILABLE", "Server is stopping", True),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", True),
    ("UNAVAILABLE", "task 'alpha' cannot be served: its table is damaged", False),
    ("INVALID_ARGUMENT", "text of 70000 bytes: at most 65536", False),
    ("NOT_FOUND", "unknown task 'nope'", False),
])
def test_what_is_sent_again(status, message, again):
    from aot.client.retry import worth_sending_again

    assert worth_sending_again(Refusal(status, message), ("alpha",)) is again
    single = worth_sending_again(Refusal(status, message), ("alpha",), deadlines=False)
    assert single is (again and status != "DEADLINE_EXCEEDED")  # a single call's deadline is its caller's bound
