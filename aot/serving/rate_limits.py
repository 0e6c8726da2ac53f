"""Per-caller request rates: one client's flood must not take the others' share of a server's CPU.

A caller is the tenant whose key a request carries (aot.serving.store.tenants), else a keyless client. Each tenant
has a token bucket of its own: RATE_LIMIT texts per second (a request of N texts takes N), RATE_BURST_SECONDS of it
at once; a request larger than the bucket passes once it is full and leaves the tenant alone in debt, so its rate
holds on average and no request is too large to pass.

Keyless callers share ANONYMOUS_RATE_LIMIT fairly. Triton 2.51 gives a python step no client address (server
src/grpc, src/http_server.cc: only request headers matching --grpc-header-forward-pattern / --http-header-forward-
pattern reach a step, as request parameters, after the request's own parameters), and a header a client sets itself
is no identity. So a keyless client is told apart by the header AOT_CLIENT_ADDRESS_HEADER names, set by a proxy in
front that overwrites what the client sent (the fleet's HAProxy sets it from the connection's source address): the
last value of that parameter is the proxy's; an IPv6 address counts by its /64, a host's usual allocation. Without
that setting every keyless request is one caller. Each keyless caller seen in the last ACTIVE_SECONDS gets an equal
share of the rate (a bucket of its own refilled at rate / callers); a caller that has used its share may still use
what the others leave: the anonymous rate's spare bucket, from which every admitted text is taken too, admits it
while more than half of the spare remains, the rest kept for callers within their share. A new address's bucket
starts empty, its first text taken from the spare when it holds one: changing addresses wins nothing the spare does
not hold. A keyless bucket never goes into debt: a request larger than it waits until it holds the request (the
bucket grows to the largest request), so one request never locks out other callers. A refused request is refused before
its task is resolved, 503 UNAVAILABLE with a retry hint (aot.serving.errors: the python backend has no
RESOURCE_EXHAUSTED; the client takes the hint as retryable). Each instance of the first step keeps its own buckets at
its share of the rates (Triton sends each batch to a free instance, so a caller's requests spread over them).

A request that names a tenant's task with a key that does not open it is counted for that tenant (only tenants the
store holds: the label is bounded by the store, never by what clients send), so that a caller guessing keys is seen
in the metrics (aot.serving.step_metrics: aot_tenant_key_refusals_total) before it is lucky. A stopping server admits
no new request (aot.serving.watch).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aot import settings
from aot.serving.errors import RequestError, retry_hint
from aot.serving.store.tenants import key_digest, tenant_of
from aot.serving.watch import server_stopping

ANONYMOUS = ""  # the caller of every keyless request without a client address (and their metric label)
KNOWN_KEYS = 1024  # key digests whose tenant is remembered (a new one costs one comparison per tenant)
ACTIVE_SECONDS = 10.0  # a keyless caller with a request this recent counts among those sharing the rate
MAX_CALLERS = 10_000  # keyless callers tracked at most (the least recently seen go first)
ADDRESS_CHARS = 100  # a client address longer than this is cut (it is a proxy's, but bounded all the same)
STOPPING_RETRY_SECONDS = 1.0  # a stopping server's refusal asks this wait (another server answers meanwhile)


@dataclass(frozen=True)
class RateLimits:
    """Texts per second per tenant and for keyless callers together (0: no limit), the burst in seconds, and the
    header that carries a keyless client's address (None: keyless callers are one)."""

    tenant: float = 0.0
    anonymous: float = 0.0
    burst_seconds: float = 1.0
    address_header: str | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> RateLimits:
        tenant = settings.RATE_LIMIT.read(environ)
        anonymous = settings.ANONYMOUS_RATE_LIMIT.read(environ)
        return cls(tenant, tenant if anonymous is None else anonymous, settings.RATE_BURST_SECONDS.read(environ),
                   settings.CLIENT_ADDRESS_HEADER.read(environ))

    def __bool__(self) -> bool:
        return self.tenant > 0 or self.anonymous > 0


@dataclass
class TokenBucket:
    rate: float  # tokens per second
    burst_seconds: float  # of the rate it holds at most (at least one token)
    owes: bool = True  # a request larger than the bucket passes once it is full and owes the rest; False: it waits
    # until the bucket holds it (the bucket grows to the largest request)
    tokens: float | None = None  # None: full, at its first request
    last: float = 0.0
    largest: int = 0  # the largest request (owes False)

    @property
    def depth(self) -> float:
        return max(1.0, self.rate * self.burst_seconds, 0 if self.owes else self.largest)

    def refill(self, now: float) -> float:
        if self.tokens is None:
            self.tokens, self.last = self.depth, now
        self.tokens = min(self.depth, self.tokens + (now - self.last) * self.rate)
        self.last = now
        return self.tokens

    def take(self, now: float, count: int = 1) -> float:
        """0 when `count` tokens were taken; else the seconds until the bucket holds them."""
        self.refill(now)
        if not self.owes:
            self.largest = max(self.largest, count)
        needed = min(float(count), self.depth)
        if self.tokens >= needed:
            self.tokens -= count
            return 0.0
        return (needed - self.tokens) / self.rate

    def drain(self, now: float, count: int) -> None:
        """Take up to `count` tokens, never below none."""
        self.tokens = max(0.0, self.refill(now) - count)


class KeylessCallers:
    """Equal shares of one rate among the callers seen in the last ACTIVE_SECONDS, and the spare of it (module
    docstring). An address's own bucket starts empty: its first text comes from the spare when the spare holds one,
    else it waits for its share like the others, so that a new address is never a windfall."""

    def __init__(self, rate: float, burst_seconds: float):
        self.rate, self.burst_seconds = rate, burst_seconds
        self.spare = TokenBucket(rate, burst_seconds, owes=False)  # every admitted text is taken from it too
        self._seen: OrderedDict[str, float] = OrderedDict()  # caller -> its last request, oldest first
        self._buckets: dict[str, TokenBucket] = {}

    def share(self) -> float:
        return self.rate / max(1, len(self._seen))

    def take(self, caller: str, now: float, count: int) -> float:
        """0 when `caller`'s request of `count` texts is admitted; else the seconds until its share holds them."""
        self._see(caller, now)
        bucket = self._buckets.get(caller)
        if bucket is None:  # full for the one caller without an address: no one can change that identity
            first = None if caller == ANONYMOUS else 1.0 if self.spare.refill(now) >= 1 else 0.0
            bucket = self._buckets[caller] = TokenBucket(self.share(), self.burst_seconds, False, first, now)
        bucket.refill(now)  # at the share it had since its last request
        bucket.rate = self.share()
        wait = bucket.take(now, count)
        if wait == 0 or count <= self.spare.refill(now) - self.spare.depth / 2:  # its share, or what others leave
            self.spare.drain(now, count)
            return 0.0
        return wait

    def _see(self, caller: str, now: float) -> None:
        self._seen.pop(caller, None)
        self._seen[caller] = now
        while self._seen:
            oldest, seen = next(iter(self._seen.items()))
            if now - seen <= ACTIVE_SECONDS and len(self._seen) <= MAX_CALLERS:
                break
            del self._seen[oldest]
            self._buckets.pop(oldest, None)

def client_address(value: str) -> str:
    """The caller a proxy's address header names: the address (a port dropped; the last of a comma-separated list,
    the one the nearest proxy added), an IPv6 one as its /64; a value that is no address, as it is (bounded)."""
    value = value.rsplit(",", 1)[-1].strip()[:ADDRESS_CHARS]
    host = value
    if value.startswith("["):  # [IPv6]:port
        host = value[1:].split("]", 1)[0]
    elif value.count(":") == 1:  # IPv4:port
        host = value.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return value
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class RequestGate:
    """Admits one step instance's requests by their caller's rate (its share: the limits over `instances`), and
    counts refused tenant keys. `refused_key(tenant)` and `limited(caller)` are told of each (the step's metrics;
    keyless callers all as ANONYMOUS)."""

    def __init__(self, limits: RateLimits, instances: int = 1, refused_key: Callable[[str], None] | None = None,
                 limited: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 stopping: Callable[[], bool] = server_stopping):
        self.limits, self.instances = limits, max(instances, 1)
        self.refused_key, self.limited, self.clock, self.stopping = refused_key, limited, clock, stopping
        self._buckets: dict[str, TokenBucket] = {}
        self._keyless = KeylessCallers(limits.anonymous / self.instances, limits.burst_seconds)
        self._callers: OrderedDict[str, str] = OrderedDict()  # key digest -> its tenant (ANONYMOUS: none)
        self._tenants: Mapping[str, str] | None = None  # the tenants _callers was found in

    def address_of(self, parameters: str | None) -> str | None:
        """The keyless client's address among a request's parameters (a JSON object, as the python backend gives
        them): the last value of the address header's parameter, the one tritonserver forwarded from the proxy's
        header after the request's own parameters; None when there is none or no header is trusted."""
        header = self.limits.address_header
        if not header or not parameters:
            return None
        try:
            pairs = json.loads(parameters, object_pairs_hook=list)  # in order, each duplicate kept
        except ValueError:
            return None
        values = [v for pair in pairs if isinstance(pair, tuple) for k, v in [pair]
                  if k.lower() == header and isinstance(v, str)] if isinstance(pairs, list) else []
        return client_address(values[-1]) if values else None

    def admit(self, name: str, key: str | None, tenants: Mapping[str, str], texts: int = 1,
              address: str | None = None) -> None:
        """Count a refused key (a tenant's task `name` with a key that does not open it), then take `texts` tokens
        from the caller's bucket: RequestError("rate_limited") with a retry hint when it does not hold them.
        `tenants`: the store's tenant -> key digest; `address`: a keyless client's (address_of; None: unknown). A
        step asks once per request, on its first item, with the request's texts (the others check their key alone:
        `texts` 0). A server that stops (aot.serving.watch) admits no new request: RequestError("stopping") with a
        retry hint."""
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
        if caller == ANONYMOUS:
            wait = self._keyless.take(address or ANONYMOUS, self.clock(), texts)
        else:
            bucket = self._buckets.get(caller)
            if bucket is None:
                bucket = self._buckets[caller] = TokenBucket(limit / self.instances, self.limits.burst_seconds)
            wait = bucket.take(self.clock(), texts)
        if wait > 0:
            if self.limited is not None:
                self.limited(caller)
            raise RequestError(f"rate limit: {self._who(caller, limit)}; {retry_hint(wait)}", "rate_limited")

    def _who(self, caller: str, limit: float) -> str:
        if caller != ANONYMOUS:
            return f"tenant {caller!r} sends at most {limit:g} texts per second to this server"
        if not self.limits.address_header:
            return f"requests without a tenant key send at most {limit:g} texts per second to this server"
        return (f"requests without a tenant key send at most {limit:g} texts per second to this server, an equal "
                f"share for each of their clients ({self._keyless.share() * self.instances:g} each now), more only "
                "while the others leave some unused")

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
