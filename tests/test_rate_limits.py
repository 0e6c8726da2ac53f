"""Per-caller request rates (aot.serving.rate_limits): token buckets per tenant and for requests without a valid
key, refused keys counted per tenant the store holds: unit tests on a fake clock, then a real server's answers and
metrics."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from aot.exporter.task_export import export_task
from aot.serving.errors import RequestError, retry_after
from aot.serving.rate_limits import ANONYMOUS, RateLimits, RequestGate
from aot.serving.store.tenants import key_digest

TENANTS = {"acme": key_digest("aotk_acme"), "bahn": key_digest("aotk_bahn")}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _gate(tenant: float, anonymous: float, instances: int = 1, burst: float = 1.0, header: str | None = None):
    refused, limited, clock = [], [], Clock()
    gate = RequestGate(RateLimits(tenant, anonymous, burst, header), instances, refused.append, limited.append, clock,
                       stopping=lambda: False)
    return gate, refused, limited, clock


def _admitted(gate: RequestGate, name: str, key: str | None, count: int, texts: int = 1,
              address: str | None = None) -> int:
    admitted = 0
    for _ in range(count):
        try:
            gate.admit(name, key, TENANTS, texts, address)
            admitted += 1
        except RequestError as exc:
            assert exc.reason == "rate_limited" and retry_after(str(exc)) is not None
    return admitted


def test_each_tenant_has_its_own_bucket_and_anonymous_callers_share_one():
    gate, _, limited, clock = _gate(tenant=5, anonymous=2)
    assert _admitted(gate, "acme/intent", "aotk_acme", 20) == 5  # the burst: one second of its rate
    assert _admitted(gate, "public", "aotk_acme", 3) == 0  # a public task, the same caller: the same bucket
    assert _admitted(gate, "bahn/x", "aotk_bahn", 20) == 5  # another tenant is not slowed by acme's flood
    assert _admitted(gate, "public", None, 20) == 2  # no key
    assert _admitted(gate, "public", "aotk_guess", 5) == 0  # an invalid key: the anonymous caller too
    assert set(limited) == {"acme", "bahn", ANONYMOUS} and len(limited) == 15 + 3 + 15 + 18 + 5
    clock.now += 1.0  # a second later: a second of rate again, never more than the burst
    assert _admitted(gate, "acme/intent", "aotk_acme", 20) == 5 and _admitted(gate, "public", None, 20) == 2


def test_the_refusal_says_when_to_retry():
    gate, _, _, clock = _gate(tenant=4, anonymous=0)
    assert _admitted(gate, "acme/a", "aotk_acme", 4) == 4
    with pytest.raises(RequestError) as refused:
        gate.admit("acme/a", "aotk_acme", TENANTS)
    assert retry_after(str(refused.value)) == 0.25 and "tenant 'acme'" in str(refused.value)
    assert "at most 4 texts per second" in str(refused.value)
    clock.now += 0.25
    assert _admitted(gate, "acme/a", "aotk_acme", 2) == 1


def test_a_request_takes_a_token_per_text_and_none_is_too_large_to_pass():
    """A request of N texts takes N tokens at once (a step asks on its first item; the others check only their key,
    texts 0). One larger than the bucket passes once the bucket is full and leaves it in debt, so the rate holds on
    average: before, a request of more texts than the bucket held was refused at every retry."""
    gate, refused, limited, clock = _gate(tenant=4, anonymous=0)
    gate.admit("acme/a", "aotk_acme", TENANTS, texts=3)  # 4 -> 1 token
    with pytest.raises(RequestError) as over:
        gate.admit("acme/a", "aotk_acme", TENANTS, texts=2)
    assert retry_after(str(over.value)) == 0.25  # one token short at 4 a second
    gate.admit("acme/a", "aotk_guess", TENANTS, texts=0)  # an item's key check: counted, takes nothing
    assert refused == ["acme"] and limited == ["acme"]
    clock.now += 0.75  # full again (4 tokens)
    gate.admit("acme/a", "aotk_acme", TENANTS, texts=32)  # more than the bucket holds: admitted, 28 in debt
    with pytest.raises(RequestError) as debt:
        gate.admit("acme/a", "aotk_acme", TENANTS, texts=1)
    assert retry_after(str(debt.value)) == 7.25  # 29 tokens at 4 a second
    clock.now += 8.0
    gate.admit("acme/a", "aotk_acme", TENANTS, texts=32)  # and again once full: never refused for its size


def test_instances_share_the_rate_and_zero_means_no_limit():
    gate, _, _, _ = _gate(tenant=10, anonymous=0, instances=2)
    assert _admitted(gate, "acme/a", "aotk_acme", 50) == 5  # this instance's half
    assert _admitted(gate, "public", None, 500) == 500  # 0: no limit for requests without a key
    unlimited, _, limited, _ = _gate(tenant=0, anonymous=0)
    assert _admitted(unlimited, "acme/a", "aotk_acme", 500) == 500 and limited == []


def test_refused_keys_are_counted_per_tenant_the_store_holds():
    """A wrong key for a tenant's task counts for that tenant; a made-up tenant counts nowhere (labels stay bounded
    by the store's tenants); no key, or the right one, is not a refusal."""
    gate, refused, _, _ = _gate(tenant=0, anonymous=0)
    for name, key in (("acme/intent", "aotk_guess1"), ("acme/intent@0123456789ab", "aotk_bahn"),
                      ("acme/intent", None), ("acme/intent", "aotk_acme"), ("nosuch/x", "aotk_guess"),
                      ("public", "aotk_guess"), ("bahn/y", "aotk_guess2")):
        gate.admit(name, key, TENANTS)
    assert refused == ["acme", "acme", "bahn"]


def test_limits_from_the_environment():
    assert RateLimits.from_environment({}) == RateLimits(0.0, 0.0, 1.0) and not RateLimits.from_environment({})
    assert RateLimits.from_environment({"AOT_RATE_LIMIT": "50"}) == RateLimits(50.0, 50.0, 1.0)
    both = RateLimits.from_environment({"AOT_RATE_LIMIT": "50", "AOT_ANONYMOUS_RATE_LIMIT": "5",
                                        "AOT_RATE_BURST_SECONDS": "0.5", "AOT_CLIENT_ADDRESS_HEADER": "X-Real-IP"})
    assert both == RateLimits(50.0, 5.0, 0.5, "x-real-ip")
    from aot.settings import SettingError

    with pytest.raises(SettingError, match="AOT_RATE_LIMIT='-1': expected a number of texts per second"):
        RateLimits.from_environment({"AOT_RATE_LIMIT": "-1"})
    with pytest.raises(SettingError, match="AOT_CLIENT_ADDRESS_HEADER='x y': expected a header name"):
        RateLimits.from_environment({"AOT_CLIENT_ADDRESS_HEADER": "x y"})


# --- keyless callers: fair shares, no lock-out (issue 57.2) -----------------------------------------------------------

# seconds of the rate that keyless callers may take beyond it at their start: the spare's burst, and each caller's
# first share's (the first alone the rate's, the next ones less and less)
BURSTS = 3


def _polite_and_flooders(gate: RequestGate, clock: Clock, addresses: list[str | None], every: int = 20,
                         seconds: float = 20.0):
    """Three flooding threads send a text every 10 ms each (as fast as a refusal comes back: they are first whenever a
    token appears), a polite client a text
    every `every` * 10 ms, for `seconds` on the fake clock: (the polite one's admitted, sent), the flooders'
    admitted. `addresses`: the polite one's, then each flooding thread's (None: unknown)."""
    polite, flooders, sent = 0, 0, 0
    for step in range(int(seconds * 100)):
        clock.now += 0.01
        flooders += sum(_admitted(gate, "public", None, 1, address=a) for a in addresses[1:])  # always there first
        if step % every == 0:
            sent += 1
            polite += _admitted(gate, "public", None, 1, address=addresses[0])
    return polite, sent, flooders


def test_one_keyless_client_does_not_starve_the_others():
    """Issue 57.2: a keyless client flooding from three threads beside a polite one at 5 texts a second, 10 texts a
    second for all keyless callers. Told apart by their addresses, each has an equal share (5 a second): the polite
    one is admitted at every request, the flooder gets the rest, and together never more than the rate. As one
    caller (no address known: the only way before) the flooder took nearly everything."""
    gate, _, _, clock = _gate(tenant=0, anonymous=10, header="aot-client-address")
    polite, sent, flooder = _polite_and_flooders(gate, clock, ["10.0.0.1"] + ["10.0.0.9"] * 3)
    assert sent == 100 and polite == sent, (polite, sent)
    assert 10 * 20 - 10 <= polite + flooder <= 10 * (20 + BURSTS)  # the rate holds, and none of it is wasted

    one, _, _, clock = _gate(tenant=0, anonymous=10)
    polite_before, sent, flooder_before = _polite_and_flooders(one, clock, [None] * 4)
    assert polite_before <= 0.3 * sent and polite_before + flooder_before <= 10 * 20 + 10, polite_before
    print(f"\npolite keyless client at 5 texts/s beside a flooder (3 threads), 10 texts/s for all: {polite} of {sent} "
          f"admitted by address, {polite_before} of {sent} as one caller")


def test_keyless_callers_share_equally_and_leave_no_share_unused():
    """Three flooders from three addresses beside a polite client: one at 2 texts a second, within its equal share
    (2.5: one of 4), is admitted at every request; one at 5 a second gets at least its share. The flooders use what
    it leaves, and the rate holds."""
    for every, least in ((50, 1.0), (20, 0.5)):
        gate, _, _, clock = _gate(tenant=0, anonymous=10, header="aot-client-address")
        polite, sent, flooders = _polite_and_flooders(gate, clock, ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"],
                                                      every)
        assert polite >= least * sent, (every, polite, sent)
        assert 10 * 20 - 10 <= polite + flooders <= 10 * (20 + BURSTS), (polite, flooders)


def test_a_keyless_request_larger_than_the_bucket_locks_no_one_out():
    """A 32-text request at 2 texts a second: refused with the wait until its caller's bucket holds it (the bucket
    grows to hold it), then admitted; meanwhile other keyless callers are admitted, by address and as one caller
    alike, and after it they wait for one text of their own share at most. Before, it passed at once and left the
    shared bucket 30 texts in debt: 15 s of refusals for everyone."""
    for header, big, small in (("aot-client-address", "10.0.0.1", "10.0.0.2"), (None, None, None)):
        gate, _, _, clock = _gate(tenant=0, anonymous=2, header=header)
        with pytest.raises(RequestError) as waits:
            gate.admit("public", None, TENANTS, 32, big)
        # 31 texts more at 2 a second (an address has its first text, the one caller without its burst's 2): alone
        assert retry_after(str(waits.value)) == (15.5 if header else 15.0)
        assert _admitted(gate, "public", None, 1, address=small) == 1  # not locked out
        clock.now += 40.0
        gate.admit("public", None, TENANTS, 32, big)  # its bucket holds it now: admitted, never too large
        try:
            gate.admit("public", None, TENANTS, 1, small)
        except RequestError as exc:
            assert retry_after(str(exc)) <= 1.0, exc  # one text of its share (1 or 2 a second), no debt of others'


def test_new_addresses_get_a_share_not_a_windfall():
    """A client that changes its address at every request wins nothing the spare does not hold: 200 new addresses
    asking 32 texts each at once are all refused (a new address's bucket starts with one text, from the spare, and
    grows only by waiting), and 200 asking one text each over 2 s get at most the spare's burst and its refill."""
    gate, _, _, clock = _gate(tenant=0, anonymous=10, header="aot-client-address")
    assert sum(_admitted(gate, "public", None, 1, texts=32, address=f"10.1.0.{k}") for k in range(200)) == 0
    admitted = 0
    for k in range(200):
        clock.now += 0.01
        admitted += _admitted(gate, "public", None, 1, address=f"10.2.{k // 250}.{k % 250}")
    assert admitted <= 10 + 10 * 2, admitted  # the spare's burst (1 s of the rate) and 2 s of its refill


def test_the_client_address_is_the_proxys_header_and_nothing_else():
    """address_of: the last value of the trusted header's parameter, whatever its case (tritonserver forwards the
    proxy's header after the request's own parameters: a parameter a client sets in its body comes first); none
    without a trusted header; an IPv6 client by its /64, an IPv4-mapped one as IPv4, a port dropped."""
    gate, _, _, _ = _gate(tenant=0, anonymous=10, header="aot-client-address")
    spoofed = '{"aot-client-address": "10.0.0.1", "aot-tenant-key": "k", "Aot-Client-Address": "192.0.2.7"}'
    assert gate.address_of(spoofed) == "192.0.2.7"
    assert gate.address_of('{"aot-client-address": "[2001:db8:1:2::9]:443"}') == "2001:db8:1:2::/64"
    assert gate.address_of('{"aot-client-address": "::ffff:192.0.2.8"}') == "192.0.2.8"
    assert gate.address_of('{"aot-client-address": "198.51.100.1, 192.0.2.9:5000"}') == "192.0.2.9"
    assert gate.address_of('{"aot-tenant-key": "k"}') is None and gate.address_of("") is None
    assert gate.address_of("not json") is None and gate.address_of('{"aot-client-address": 7}') is None
    unheaded, _, _, _ = _gate(tenant=0, anonymous=10)
    assert unheaded.address_of(spoofed) is None


def test_a_stopping_server_admits_nothing_new():
    """Once the server stops (aot.serving.watch), a request is refused as "stopping" with a retry hint, whatever
    its caller's rate; a request's later items (texts 0) are not refused again."""
    gate = RequestGate(RateLimits(0.0, 0.0), stopping=lambda: True)
    with pytest.raises(RequestError) as refused:
        gate.admit("public", None, TENANTS, 4)
    assert refused.value.reason == "stopping" and retry_after(str(refused.value)) == 1.0
    assert "this server is stopping" in str(refused.value)
    gate.admit("public", None, TENANTS, 0)


# --- through the real server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(request, tmp_path_factory, tiny_models, sentiment_dir):
    """A server whose tenants may send 0.01 texts per second (each of the two `aot` instances admits one request
    per tenant, then refills one per 200 s: what a test sends after that is refused, however slow the machine), and
    whose requests without a key are not limited; tenants acme and bahn, each with a task `intent`."""
    from tests.helpers import make_repository, run_cli, serve_for_tests, train_tiny_task

    artifact = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("rate-artifact") / "fc")
    repo = make_repository(tiny_models["bert"], tmp_path_factory.mktemp("rate") / "repo", {"public": (artifact,
                                                                                                     "factored")})
    keys = {}
    for tenant in ("acme", "bahn"):
        keys[tenant] = run_cli("export", "tenant", "create", tenant, "--repo", str(repo))[0][0]["key"]
        export_task(artifact, repo, f"{tenant}/intent", "factored", progress=False)
    with pytest.MonkeyPatch.context() as env:  # the server's steps read them (aot serve --rate-limit sets the first)
        env.setenv("AOT_RATE_LIMIT", "0.01")
        env.setenv("AOT_ANONYMOUS_RATE_LIMIT", "0")
        for server in serve_for_tests(request, repo, load=("aot", "task_list")):
            yield server, keys


def _metric(server, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://{server.host}:{server.metrics_port}/metrics", timeout=10) as r:
        page = r.read().decode()
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.server
def test_a_tenant_over_its_rate_is_refused_with_a_retry_hint_and_others_are_not(limited):
    """acme floods: past its rate each request is refused at once, 503 UNAVAILABLE with a retry hint, which the
    client takes as retryable (Unavailable, retry_after); bahn's requests and those without a key still answer;
    the refusals and the keys that did not open acme's task are counted per tenant."""
    from aot.client.client import Client, InferenceError, TaskNotFound, Unavailable

    server, keys = limited
    outcomes = []
    with Client(server.grpc_url, tenant_key=keys["acme"]) as acme:
        for _ in range(10):
            try:
                outcomes.append(acme.infer("acme/intent", "good w1 w2"))
            except InferenceError as exc:
                outcomes.append(exc)
        # packs of 4 texts: a pack is refused whole (one refusal, never re-sent text by text) or answered whole;
        # each instance holds at most one token, so of 3 packs at least one is refused
        packs = [acme.infer_many([{"task": "acme/intent", "text": f"good w{k}"} for k in range(4)], pack=4)
                 for _ in range(3)]
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(refused) >= 7 and len(outcomes) - len(refused) >= 1, outcomes
    for exc in refused:
        assert type(exc) is Unavailable and exc.retryable and exc.status == "UNAVAILABLE", exc
        assert exc.retry_after is not None and exc.retry_after > 0 and "rate limit: tenant 'acme'" in str(exc), exc
    refused_packs = [p for p in packs if "error" in p[0]]
    assert refused_packs, packs
    for answers in packs:
        assert len(answers) == 4 and len({"error" in a for a in answers}) == 1, answers  # whole, either way
    for answers in refused_packs:
        assert all(a["error_type"] == "Unavailable" and "rate limit: tenant 'acme'" in a["error"] for a in answers)
    with Client(server.grpc_url, tenant_key=keys["bahn"]) as bahn:
        assert "label" in bahn.infer("bahn/intent", "good w1 w2")  # its own bucket: untouched by acme's flood
    with Client(server.grpc_url, tenant_key="") as anonymous:
        assert all("label" in anonymous.infer("public", "good w1 w2") for _ in range(10))  # no limit without a key
    with Client(server.grpc_url, tenant_key="aotk_guessed") as guesser:
        for _ in range(3):
            with pytest.raises(TaskNotFound):
                guesser.infer("acme/intent", "good w1 w2")
        deadline = time.monotonic() + 30  # counts are published after a batch, at most every second

        while _metric(server, "aot_tenant_key_refusals_total", tenant="acme") < 3 or \
                _metric(server, "aot_rate_limited_total", tenant="acme") < len(refused) + len(refused_packs):
            assert time.monotonic() < deadline, "the refusals were not counted"
            guesser.infer("public", "good w1 w2")
            time.sleep(0.5)
    assert _metric(server, "aot_tenant_key_refusals_total", tenant="acme") == 3
    assert _metric(server, "aot_rate_limited_total", tenant="acme") == len(refused) + len(refused_packs)
    assert _metric(server, "aot_tenant_key_refusals_total", tenant="bahn") == 0


# --- keyless clients told apart by a proxy's header, through a real server (issue 57.2) -----------------------------

ADDRESS = "aot-client-address"


@pytest.fixture(scope="module")
def keyless(request, tmp_path_factory, tiny_models, sentiment_dir):
    """A server of one `aot` instance that trusts the header aot-client-address (as behind the fleet's HAProxy)
    and admits 0.004 keyless texts a second with a burst of 2,000 s: its spare holds 8 texts, a new address starts
    with one text of it, a drained one refills one text per 250 s and more (whatever the machine's speed, a test
    sees no refill)."""
    from aot.local.server import LocalServer
    from tests.helpers import make_repository, train_tiny_task

    artifact = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path_factory.mktemp("keyless-artifact") / "fc")
    repo = make_repository(tiny_models["bert"], tmp_path_factory.mktemp("keyless") / "repo",
                           {"public": (artifact, "factored")}, cpu_instances=1)
    environment = {"AOT_RATE_LIMIT": "0", "AOT_ANONYMOUS_RATE_LIMIT": "0.004", "AOT_RATE_BURST_SECONDS": "2000",
                   "AOT_CLIENT_ADDRESS_HEADER": ADDRESS}
    failed_before = request.session.testsfailed
    server = LocalServer(repo, load=("aot", "task_list"), step_environment=environment).start()
    yield server
    if request.session.testsfailed > failed_before:
        print(f"\n--- tritonserver log ---\n{server.log_tail(60)}")
    server.stop()


def _grpc(server, address: str | None, texts: int = 1, body_address: str | None = None) -> str | None:
    """One keyless request of `texts` texts over gRPC, the header set as the proxy would (and a parameter of the
    same name in the request itself, as a client could): None when answered, else the server's refusal."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    tensors = []
    for name, value in (("TEXT", "good w1 w2"), ("TASK", "public")):
        tensor = grpcclient.InferInput(name, [texts, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[value.encode()]] * texts, dtype=object))
        tensors.append(tensor)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        try:
            client.infer("aot", tensors, headers={ADDRESS: address} if address else None,
                         parameters={ADDRESS: body_address} if body_address else None, client_timeout=60)
            return None
        except InferenceServerException as exc:
            return exc.message()


def _http(server, address: str) -> tuple[int, str]:
    body = json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["good w1 w2"]},
                                  {"name": "TASK", "shape": [1, 1], "datatype": "BYTES", "data": ["public"]}]})
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/aot/infer", body.encode(),
                                     {"Aot-Client-Address": address}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.server
def test_keyless_clients_are_told_apart_by_the_proxys_header_on_both_protocols(keyless):
    """Issue 57.2 through tritonserver, which forwards the header to the step on gRPC and HTTP (aot.serving.
    supervision.lifecycle adds the flags): a 32-text request is refused until its own bucket holds it and locks no
    one out (before, it passed and left the one shared bucket 24 texts in debt: every keyless request refused); a
    client that floods gets a few texts, then refusals, while a new client is answered at once (before: refused);
    and the identity is the header's, never a parameter a client put in its request (the header comes after it)."""
    big = _grpc(keyless, "10.0.0.3", texts=32)
    assert big is not None and "rate limit: requests without a tenant key" in big and retry_after(big) > 1000, big
    assert _http(keyless, "10.0.0.4")[0] == 200  # not locked out by the large request
    flood = [_grpc(keyless, "10.0.0.1") for _ in range(20)]
    answered = sum(r is None for r in flood)
    assert 1 <= answered <= 4 and all("rate limit" in r for r in flood if r is not None), flood
    assert _grpc(keyless, "10.0.0.2") is None  # another client: its first text, whatever the flood took
    status, body = _http(keyless, "10.0.0.1")
    assert status == 503 and "rate limit" in body, (status, body)  # the flooder, over HTTP too
    assert _grpc(keyless, "10.0.0.5", body_address="10.0.0.1") is None  # the header's address: a new client
    spoofed = _grpc(keyless, "10.0.0.1", body_address="10.0.0.6")
    assert spoofed is not None and "rate limit" in spoofed, spoofed  # the flooder, whatever its body says
