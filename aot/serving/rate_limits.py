"""Per-caller request rates: one client's flood must not take the others' share of a server's CPU.

A caller is the tenant whose key a request carries (aot.serving.store.tenants); every request without a valid key
is one caller, "anonymous" (Triton gives a step no client address). Each caller has a token bucket: RATE_LIMIT
texts per second (a request of N texts takes N; ANONYMOUS_RATE_LIMIT for the anonymous one), RATE_BURST_SECONDS of it
at once. A request over its caller's rate is refused before its task is resolved, 503 UNAVAILABLE with a retry hint (aot.serving.errors: the
python backend has no RESOURCE_EXHAUSTED; the client takes the hint as retryable). Each instance of the first step
keeps its own buckets at its share of the rate (Triton sends each batch to a free instance, so a caller's requests
spread over them).

A request that names a tenant's task with a key that does not open it is counted for that tenant (only tenants the
store holds: the label is bounded by the store, never by what clients send), so that a caller guessing keys is seen
in the metrics (aot.serving.step_metrics: aot_tenant_key_refusals_total) before it is lucky.
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aot import settings
from aot.serving.errors import RequestError, retry_hint
from aot.serving.store.tenants import key_digest, tenant_of
from aot.serving.watch import server_stopping

ANONYMOUS = ""  # the caller of every request without a valid tenant key
STOPPING_RETRY_SECONDS = 1.0  # a stopping server's refusal asks this wait (another server answers meanwhile)
KNOWN_KEYS = 1024  # key digests whose tenant is remembered (a new one costs one comparison per tenant)


@dataclass(frozen=True)
class RateLimits:
    """Requests per second per tenant and for the anonymous caller (0: no limit), and the burst in seconds."""

    tenant: float = 0.0
    anonymous: float = 0.0
    burst_seconds: float = 1.0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> RateLimits:
        tenant = settings.RATE_LIMIT.read(environ)
        anonymous = settings.ANONYMOUS_RATE_LIMIT.read(environ)
        return cls(tenant, tenant if anonymous is None else anonymous, settings.RATE_BURST_SECONDS.read(environ))

    def __bool__(self) -> bool:
        return self.tenant > 0 or self.anonymous > 0


@dataclass
class TokenBucket:
    rate: float  # tokens per second
    depth: float  # tokens it holds at most
    tokens: float | None = None  # None: full, at its first request
    last: float = 0.0

    def take(self, now: float, count: int = 1) -> float:
        """0 when `count` tokens were taken; else the seconds until the bucket holds them. A request of more than the
        bucket holds is admitted once it is full and leaves it in debt for the rest: the rate holds on average, and
        no request is too large to pass."""
        if self.tokens is None:
            self.tokens, self.last = self.depth, now
        self.tokens = min(self.depth, self.tokens + (now - self.last) * self.rate)
        self.last = now
        needed = min(float(count), self.depth)
        if self.tokens >= needed:
            self.tokens -= count
            return 0.0
        return (needed - self.tokens) / self.rate


class RequestGate:
    """Admits one step instance's requests by their caller's rate (its share: the limits over `instances`), and
    counts refused tenant keys. `refused_key(tenant)` and `limited(caller)` are told of each (the step's metrics)."""

    def __init__(self, limits: RateLimits, instances: int = 1, refused_key: Callable[[str], None] | None = None,
                 limited: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 stopping: Callable[[], bool] = server_stopping):
        self.limits, self.instances = limits, max(instances, 1)
        self.refused_key, self.limited, self.clock, self.stopping = refused_key, limited, clock, stopping
        self._buckets: dict[str, TokenBucket] = {}
        self._callers: OrderedDict[str, str] = OrderedDict()  # key digest -> its tenant (ANONYMOUS: none)
        self._tenants: Mapping[str, str] | None = None  # the tenants _callers was found in

    def admit(self, name: str, key: str | None, tenants: Mapping[str, str], texts: int = 1) -> None:
        """Count a refused key (a tenant's task `name` with a key that does not open it), then take `texts` tokens
        from the caller's bucket: RequestError("rate_limited") with a retry hint when it does not hold them.
        `tenants`: the store's tenant -> key digest. A step asks once per request, on its first item, with the
        request's texts (the others check their key alone: `texts` 0). A server that stops (aot.serving.watch)
        admits no new request: RequestError("stopping") with a retry hint."""
        if texts and self.stopping():
            raise RequestError("this server is stopping and takes no new request: send it again (another server "
                               f"answers it); {retry_hint(STOPPING_RETRY_SECONDS)}", "stopping")
        digest = key_digest(key) if key else None
        owner = tenant_of(name.split("@", 1)[0])
        if digest is not None and owner is not None and owner in tenants \
                and not hmac.compare_digest(digest, tenants[owner]) and self.refused_key is not None:
            self.refused_key(owner)
        if not self.limits or texts == 0:
            return
        caller = self._caller(digest, owner, tenants)
        limit = self.limits.anonymous if caller == ANONYMOUS else self.limits.tenant
        if limit <= 0:
            return
        rate = limit / self.instances
        bucket = self._buckets.get(caller)
        if bucket is None:
            bucket = self._buckets[caller] = TokenBucket(rate, max(1.0, rate * self.limits.burst_seconds))
        wait = bucket.take(self.clock(), texts)
        if wait > 0:
            if self.limited is not None:
                self.limited(caller)
            who = f"tenant {caller!r} sends" if caller != ANONYMOUS else "requests without a tenant key send"
            raise RequestError(f"rate limit: {who} at most {limit:g} texts per second to this server; {retry_hint(wait)}",
                               "rate_limited")

    def _caller(self, digest: str | None, owner: str | None, tenants: Mapping[str, str]) -> str:
        """The tenant whose key `digest` is (ANONYMOUS: no valid key): the named task's tenant checked first (one
        comparison), else every tenant, in constant time each, remembered for KNOWN_KEYS digests."""
        if digest is None:
            return ANONYMOUS
        if tenants is not self._tenants:  # the index changed: a tenant created, rotated or deleted since
            self._callers.clear()
            self._tenants = tenants
        if owner is not None and owner in tenants and hmac.compare_digest(digest, tenants[owner]):
            return owner
        known = self._callers.get(digest)
        if known is not None and (known == ANONYMOUS or known in tenants
                                  and hmac.compare_digest(digest, tenants[known])):
            self._callers.move_to_end(digest)
            return known
        found = ANONYMOUS
        for tenant, stored in tenants.items():
            if hmac.compare_digest(digest, stored):
                found = tenant
        self._callers[digest] = found
        while len(self._callers) > KNOWN_KEYS:
            self._callers.popitem(last=False)
        return found
