"""Triton's dynamic batcher must not spin (issue 52). The `aot` model's inputs are all optional, so Triton batches
only requests of one input set; with its default prefetching, a batch readied for a busy instance with a request of
another set queued behind it made tritonserver's BatcherThread loop without waiting until an instance was free: the
supervisor's liveness probe (it sent every declared input) and token-id clients beside text clients did it
(docs/benchmarks.md, "The batcher's spin"). Checked here: the probe sends what a text client sends, the steps that
take the clients' inputs batch only when an instance is free (both fail on the code before the fix), and a real
server with its probes running answers text and token-id clients side by side, tritonserver's CPU per request (CPU
time, not wall time) under a generous bound."""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.request

import pytest

from aot.exporter.configs import model_configs
from aot.exporter.tensorrt import Profile
from aot.serving.repository import BackboneRecord, ServingOptions
from aot.serving.supervision.probes import probe_body
from tests.helpers import make_repository, train_tiny_task

# the steps that take the clients' request as it comes (the fused step, the GPU ensemble's first step)
CLIENT_FACING = {"aot", "vanilla", "tokenizer"}
TEXTS, MAX_BATCH = 64, 128  # two requests of one input set fill a batch; a batch of one has room for another
REQUESTS, CONCURRENCY = 48, 8
# tritonserver's own CPU per 64-text request here: 0.4-2 ms on the loaded 2-core machine. Spinning, it burns a core
# while a batch waits for a busy instance: with MiniLM on CPU, seconds a request (docs/benchmarks.md). The tiny
# model's batches are too short for a spin to be told from that noise, so this bound catches only a gross one: the
# checks above are what catch the cause returning, and `aot bench tax --engine torch --clients mixed` measures it.
BOUND_US_PER_REQUEST = 15_000


def _record(engine: str) -> BackboneRecord:
    """A tiny repository's record (what the configs are generated from), its encoder served by `engine`."""
    profile = dataclasses.asdict(Profile(max_batch=32, max_seq=64)) if engine == "tensorrt" else None
    return BackboneRecord(backbone={"model": "tiny", "fingerprint": "tiny"}, uses_token_type_ids=True, num_layers=2,
                          hidden_size=8, vocab_size=50, type_vocab_size=2, max_positions=64, store="tasks",
                          tokenizer="models/tokenizer/1/tokenizer", serving=ServingOptions(engine=engine),
                          tensorrt_profile=profile)


@pytest.mark.parametrize("engine", ["onnx", "tensorrt", "torch"])
@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_the_steps_that_take_the_clients_inputs_batch_only_when_an_instance_is_free(engine, target):
    """A queue policy that allows a request's timeout override turns Triton's prefetching off (PriorityQueue's
    support_prefetching_); steps fed by other steps keep it, and no step refuses a request for its queue."""
    configs = model_configs(_record(engine), target)
    for name, config in configs.items():
        if not config.HasField("dynamic_batching"):
            assert name not in CLIENT_FACING or config.platform == "ensemble", name
            continue
        policy = config.dynamic_batching.default_queue_policy
        assert policy.allow_timeout_override is (name in CLIENT_FACING), name
        assert (policy.max_queue_size, policy.default_timeout_microseconds) == (0, 0), name
    assert CLIENT_FACING & {n for n, c in configs.items() if c.HasField("dynamic_batching")}


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, tiny_models, sentiment_dir):
    """A server of the CPU configs with a max batch of MAX_BATCH and its supervisor (so its probes) running."""
    from aot.local.server import LocalServer

    root = tmp_path_factory.mktemp("spin")
    task = train_tiny_task(tiny_models["bert"], sentiment_dir, root / "task", "fc", epochs=1)
    repo = make_repository(tiny_models["bert"], root / "repo", {"sentiment": (task, "fused")},
                           max_batch_size=MAX_BATCH)
    with LocalServer(repo) as running:
        assert running.supervisor is not None and running.supervisor.probes.threads
        yield running


def test_the_probe_sends_what_a_text_client_sends(server):
    """What the supervisor sends `aot` (from the metadata the server publishes) has the input set aot.Client sends
    for a text: the two batch together."""
    from aot.client.client import Client

    metadata = json.loads(urllib.request.urlopen(f"http://{server.http_url}/v2/models/aot", timeout=10).read())
    probe = {i["name"] for i in json.loads(probe_body(metadata))["inputs"]}
    with Client(server.grpc_url) as client:
        sent = {t.name() for t in client._pack_inputs([client._entry("sentiment", "A fine film.", None)])}
    assert probe == sent == {"TEXT", "TASK"}


def test_text_and_token_id_clients_beside_the_probes_do_not_make_tritonserver_spin(server):
    """Requests of TEXTS texts from a text client and a token-id client at once, CONCURRENCY in flight: every answer
    comes back (a batch never mixes the two input sets), and tritonserver's CPU stays far from a spinning core's."""
    from aot.benchmarks.tax.onnx_engine import cpu_seconds
    from aot.client.client import Client
    from aot.serving.repository import read_repository

    tokenizer = read_repository(server.repo).tokenizer_dir
    items = [{"task": "sentiment", "text": f"review number {k}: a fine, long and thoughtful film"} for k in range(TEXTS)]
    answers, lock = [], threading.Lock()

    def client(ids: bool) -> None:
        with Client(server.grpc_url, tokenizer=tokenizer if ids else None) as c:
            got = c.infer_many(items * (REQUESTS // 2), concurrency=CONCURRENCY // 2, pack=TEXTS)
        with lock:
            answers.extend(got)

    before = cpu_seconds({"tritonserver": server.process.pid})["tritonserver"]
    threads = [threading.Thread(target=client, args=(ids,)) for ids in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    used_us = (cpu_seconds({"tritonserver": server.process.pid})["tritonserver"] - before) * 1e6
    assert len(answers) == REQUESTS * TEXTS and not [a for a in answers if "error" in a]
    assert 0 < used_us / REQUESTS < BOUND_US_PER_REQUEST, f"tritonserver used {used_us / REQUESTS:,.0f} us a request"
