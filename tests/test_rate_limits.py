"""Per-caller request rates (aot.serving.rate_limits): token buckets per tenant and for requests without a valid
key, refused keys counted per tenant the store holds: unit tests on a fake clock, then a real server's answers and
metrics."""

from __future__ import annotations

import time
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


def _gate(tenant: float, anonymous: float, instances: int = 1, burst: float = 1.0):
    refused, limited, clock = [], [], Clock()
    gate = RequestGate(RateLimits(tenant, anonymous, burst), instances, refused.append, limited.append, clock)
    return gate, refused, limited, clock


def _admitted(gate: RequestGate, name: str, key: str | None, count: int) -> int:
    admitted = 0
    for _ in range(count):
        try:
            gate.admit(name, key, TENANTS)
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
                                        "AOT_RATE_BURST_SECONDS": "0.5"})
    assert both == RateLimits(50.0, 5.0, 0.5)
    from aot.settings import SettingError

    with pytest.raises(SettingError, match="AOT_RATE_LIMIT='-1': expected a number of texts per second"):
        RateLimits.from_environment({"AOT_RATE_LIMIT": "-1"})


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
