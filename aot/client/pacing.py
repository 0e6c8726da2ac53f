"""How hard infer_many presses a server: requests in flight, texts per request, and when it may send next.

A refusal that a retry may cure (a rate limit, a stopping or overloaded server, a missed deadline) halves both the
requests in flight and the texts per request, down to one of each, and holds every send until the wait the server
asked for (its retry hint) or the backoff chose; each answer gives one more request in flight and doubles the texts
per request, back up to what the caller asked. Only requests sent after the last cut move them: the refusals and
answers of requests already in flight then are of the load that was too much, and count as one event. So a client told to slow down sends one small request when the
server said it would be admitted, instead of every queued pack at once, and a server that is back gets the whole
load again after a few answers (TCP's congestion control, with the server's hint for a clock).
"""

from __future__ import annotations

import time


class Pacer:
    """`concurrency` requests in flight and `pack` texts per request at most; lowered by refusals, raised by answers.
    Used by the one thread that runs the call (aot.client.batch)."""

    def __init__(self, concurrency: int, pack: int):
        self.concurrency, self.pack_limit = concurrency, pack
        self.flight = float(concurrency)  # requests that may be in flight now (fractional: grows by whole answers)
        self.pack = pack  # texts per request now
        self.not_before = 0.0  # time.monotonic() before which nothing is sent
        self.cut_at = float("-inf")  # time.monotonic() of the last cut

    def in_flight_allowed(self) -> int:
        return max(1, int(self.flight))

    def can_send(self, in_flight: int, now: float) -> bool:
        return in_flight < self.in_flight_allowed() and now >= self.not_before

    def hold(self) -> float:
        """Seconds until a send is allowed again (0: now)."""
        return max(0.0, self.not_before - time.monotonic())

    def cap_pack(self, limit: int) -> None:
        """The server's most texts per request (its max batch size): never more from now on."""
        self.pack_limit = min(self.pack_limit, limit)
        self.pack = min(self.pack, self.pack_limit)

    def refused(self, sent: float, wait: float) -> None:
        """A request sent at `sent` (time.monotonic()) refused for a reason a retry may cure: nothing is sent for
        `wait`; fewer in flight and smaller packs, unless it was sent before the last cut."""
        now = time.monotonic()
        self.not_before = max(self.not_before, now + wait)
        if sent > self.cut_at:
            self.flight = max(1.0, self.flight / 2)
            self.pack = max(1, self.pack // 2)
            self.cut_at = now

    def answered(self, sent: float) -> None:
        """A request sent at `sent` answered: more in flight and larger packs, unless it was sent before the last cut."""
        if sent > self.cut_at:
            self.flight = min(float(self.concurrency), self.flight + 1)
            self.pack = min(self.pack_limit, self.pack * 2)
