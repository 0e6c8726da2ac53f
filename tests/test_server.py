"""Serving through a real local tritonserver (started here, stopped by process group): no mocks."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from aot.client.client import Client, InferenceError
from aot.exporter.task_export import export_task
from aot.serving.repository import read_repository
from aot.serving.store.writer import TaskStore
from aot.serving.supervision.admin_key import GRPC_ADMIN_HEADER
from aot.training.predict import Predictor
from tests.helpers import make_repository, serve_for_tests, train_tiny_task
from tests.tiny import write_sentiment_folder

pytestmark = pytest.mark.server

TEXTS = ["good w1 w2", "w3 awful w4 w5", "the movie was superb", "dull plot", "w7",
         " ".join(["w9 great"] * 40)]  # longer than max_length 32: truncated exactly as in training
PAIRS = ["w5 w6", "w7", "w1 w2 w3", "great", "awful w8", "w2 " * 30]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_models, sentiment_dir):
    root = tmp_path_factory.mktemp("artifacts")
    # Served tasks pool both ways (beta, gamma: mean), so one batch mixes poolings on the one backbone.
    tasks = {name: train_tiny_task(tiny_models["bert"], sentiment_dir, root / name, method, seed=seed, pooling=pooling)
             for name, method, seed, pooling in (("alpha", "fc", 0, "cls"), ("beta", "kron", 1, "mean"),
                                                 ("gamma", "fc", 2, "mean"), ("delta", "fc", 3, "cls"),
                                                 ("epsilon", "kron", 4, "cls"))}
    pairs = write_sentiment_folder(root / "pair-data", pair=True)
    tasks["zeta"] = train_tiny_task(tiny_models["bert"], pairs, root / "zeta", "fc", seed=5)  # a sentence-pair task
    return tasks


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, artifacts):
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("served") / "repo",
                           {"alpha": (artifacts["alpha"], "fused"), "beta": (artifacts["beta"], "fused"),
                            "gamma": (artifacts["gamma"], "factored"), "zeta": (artifacts["zeta"], "fused")},
                           max_batch_size=64, cpu_queue_delay_us=2000)


@pytest.fixture(scope="module")
def server(request, repo):
    yield from serve_for_tests(request, repo, load=("aot", "task_list", "vanilla"))  # vanilla: compared below


@pytest.fixture(scope="module")
def expected(artifacts):
    """PyTorch logits (aot predict) for every task and text."""
    out = {}
    for name in ("alpha", "beta", "gamma", "delta", "epsilon"):
        out[name] = Predictor.load(artifacts[name]).logits(TEXTS).numpy()
    out[("zeta", "pair")] = Predictor.load(artifacts["zeta"]).logits(TEXTS, PAIRS).numpy()
    return out


@pytest.fixture
def client(server):
    with Client(server.grpc_url) as c:
        yield c


def _stats(client, model, server):
    """Triton's statistics API: restricted to the admin key."""
    stats = client._client.get_inference_statistics(model, headers={GRPC_ADMIN_HEADER: server.admin_key}).model_stats[0]
    return stats.inference_count, stats.execution_count


def test_served_logits_equal_predict(client, expected):
    for name in ("alpha", "beta", "gamma"):
        for i, text in enumerate(TEXTS):
            got = client.infer(name, text)
            np.testing.assert_allclose(got["logits"], expected[name][i], atol=1e-3)
            assert got["label"] == ["negative", "positive"][int(np.argmax(expected[name][i]))]
    for i, (text, pair) in enumerate(zip(TEXTS, PAIRS, strict=True)):  # pairs truncated longest-first, as in training
        np.testing.assert_allclose(client.infer("zeta", text, pair)["logits"], expected[("zeta", "pair")][i], atol=1e-3)


def test_pair_mismatch_is_refused_per_request(client, expected):
    """A pair sent to a task trained on single texts (or none to a pair task) would silently change the answer:
    each such request is refused with 400 / INVALID_ARGUMENT, and the others in its batch are served."""
    items = [{"task": "alpha", "text": TEXTS[0], "text_pair": "w5 w6"}, {"task": "zeta", "text": TEXTS[0]},
             {"task": "alpha", "text": TEXTS[0]}, {"task": "zeta", "text": TEXTS[0], "text_pair": PAIRS[0]},
             {"task": "zeta", "text": TEXTS[0], "text_pair": "\u200b\x00"}]  # an invisible pair is no pair
    answers = client.infer_many(items)
    assert answers[0]["error"].endswith("task 'alpha' was trained on single texts: send no TEXT_PAIR")
    assert answers[1]["error"].endswith("task 'zeta' was trained on text pairs: send TEXT_PAIR too")
    assert answers[4]["error"].endswith("task 'zeta' was trained on text pairs: send TEXT_PAIR too")
    np.testing.assert_allclose(answers[2]["logits"], expected["alpha"][0], atol=1e-3)
    np.testing.assert_allclose(answers[3]["logits"], expected[("zeta", "pair")][0], atol=1e-3)


def test_mixed_tasks_batch_into_one_execution(server, client):
    """60 requests of 3 tasks at once take fewer executions than requests. Triton counts a request in its statistics
    after its answer is sent (so they are read until all 60 are in), and counts the supervisor's liveness probes too
    (one a second, each its own execution: they cannot make executions < requests true)."""
    before = _stats(client, "aot", server)
    start = time.monotonic()
    items = [{"task": ("alpha", "beta", "gamma")[i % 3], "text": TEXTS[i % len(TEXTS)]} for i in range(60)]
    answers = client.infer_many(items, concurrency=60)
    assert len(answers) == 60 and all("error" not in a for a in answers)
    deadline = time.monotonic() + 10
    while (after := _stats(client, "aot", server))[0] - before[0] < 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    requests, executions = after[0] - before[0], after[1] - before[1]
    probes = requests - 60
    assert 0 <= probes <= time.monotonic() - start + 2, f"{requests} requests counted for 60 sent"
    assert executions < requests, f"{executions} executions of the aot step for {requests} requests of 3 tasks"


def test_unknown_task_fails_alone(client, expected):
    items = [{"task": "alpha", "text": TEXTS[0]}, {"task": "nope", "text": TEXTS[0]}] * 8
    answers = client.infer_many(items, concurrency=16)
    for item, answer in zip(items, answers, strict=True):
        if item["task"] == "nope":
            assert "unknown task 'nope'" in answer["error"] and "alpha, beta, gamma" in answer["error"]
        else:
            np.testing.assert_allclose(answer["logits"], expected["alpha"][0], atol=1e-3)


def _raw(server, inputs):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensors = []
    for name, array, dtype in inputs:
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        tensors.append(t)
    return client.infer("aot", tensors)


def _bytes(value):
    return np.array([[value]], dtype=np.object_)


@pytest.mark.parametrize("case,inputs,message", [
    ("empty text", [("TEXT", _bytes(b"   "), "BYTES"), ("TASK", _bytes(b"alpha"), "BYTES")], "TEXT is empty"),
    ("invalid utf-8", [("TEXT", _bytes(b"\xff\xfegood"), "BYTES"), ("TASK", _bytes(b"alpha"), "BYTES")],
     "TEXT is not valid UTF-8"),
    ("wrong dtype", [("TEXT", np.array([[1]], dtype=np.int32), "INT32"), ("TASK", _bytes(b"alpha"), "BYTES")],
     "data-type is 'INT32', but model 'aot' expects 'BYTES'"),
    ("wrong shape", [("TEXT", np.array([[b"a", b"b"]], dtype=np.object_), "BYTES"), ("TASK", _bytes(b"alpha"), "BYTES")],
     "unexpected shape for input 'TEXT'"),
    ("missing task", [("TEXT", _bytes(b"good"), "BYTES")], "missing input TASK"),
])
def test_bad_input_is_refused_and_server_keeps_serving(server, client, expected, case, inputs, message):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as err:
        _raw(server, inputs)
    assert message in err.value.message()
    np.testing.assert_allclose(client.infer("alpha", TEXTS[0])["logits"], expected["alpha"][0], atol=1e-3)


def test_token_ids_client_gets_the_answers_of_a_text_client(server, repo, client, expected):
    """A client that tokenizes on its side (Client(tokenizer=REPO/tokenizer)) sends token ids, truncated to each
    task's max length: every answer equals the text client's (and `aot predict`'s), pairs included."""
    items = [{"task": n, "text": t} for n in ("alpha", "beta", "gamma") for t in TEXTS]
    items += [{"task": "zeta", "text": t, "text_pair": p} for t, p in zip(TEXTS, PAIRS, strict=True)]
    with Client(server.grpc_url, tokenizer=read_repository(repo).tokenizer_dir) as ids_client:
        by_ids = ids_client.infer_many(items)
        np.testing.assert_allclose(ids_client.infer("alpha", TEXTS[-1])["logits"], expected["alpha"][-1], atol=1e-3)
        with pytest.raises(InferenceError, match="TEXT is empty"):
            ids_client.infer("alpha", " ")
        with pytest.raises(InferenceError, match="unknown task 'nope'"):
            ids_client.infer("nope", TEXTS[0])
    for item, by_text, by_id in zip(items, client.infer_many(items), by_ids, strict=True):
        assert by_id["label"] == by_text["label"], item  # logits alike up to the float rounding of other batches
        np.testing.assert_allclose(by_id["logits"], by_text["logits"], atol=1e-5)
        want = expected[("zeta", "pair")] if item["task"] == "zeta" else expected[item["task"]]
        np.testing.assert_allclose(by_id["logits"], want[TEXTS.index(item["text"])], atol=1e-3)


def _ids(values, name="input_ids"):
    return (name, np.array([values], dtype=np.int64), "INT64")


@pytest.mark.parametrize("case,inputs,message", [
    ("text and ids", [("TEXT", _bytes(b"good"), "BYTES"), _ids([2, 5, 3]), _ids([1, 1, 1], "attention_mask"),
                      _ids([0, 0, 0], "token_type_ids")], "send either TEXT or input_ids"),
    ("neither", [], "send either TEXT or input_ids"),
    ("longer than the task reads", [_ids([2] * 40), _ids([1] * 40, "attention_mask"), _ids([0] * 40, "token_type_ids")],
     "input_ids has 40 tokens: task 'alpha' reads at most 32"),
    ("id out of range", [_ids([2, 99999, 3]), _ids([1, 1, 1], "attention_mask"), _ids([0, 0, 0], "token_type_ids")],
     "input_ids holds 99999"),
    ("mask missing", [_ids([2, 5, 3]), _ids([0, 0, 0], "token_type_ids")], "missing input attention_mask"),
    ("a pair to a single-text task", [_ids([2, 5, 3, 6]), _ids([1, 1, 1, 1], "attention_mask"),
                                      _ids([0, 0, 1, 1], "token_type_ids")], "these token ids hold a second segment"),
])
def test_bad_token_ids_are_refused_alone(server, client, expected, case, inputs, message):
    """Token ids are checked per request like texts (400), in a batch with good requests that are served."""
    from tritonclient.utils import InferenceServerException

    errors, answers = [], []

    def bad():
        try:
            _raw(server, [("TASK", _bytes(b"alpha"), "BYTES"), *inputs])
        except InferenceServerException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=bad)]
    threads[0].start()
    answers = client.infer_many([{"task": "alpha", "text": t} for t in TEXTS] * 4, concurrency=24)
    threads[0].join()
    assert len(errors) == 1 and message in errors[0].message() and errors[0].status() == "StatusCode.INVALID_ARGUMENT"
    assert len(answers) == len(TEXTS) * 4
    for i, answer in enumerate(answers):
        np.testing.assert_allclose(answer["logits"], expected["alpha"][i % len(TEXTS)], atol=1e-3)


def test_batched_steps_give_each_request_its_own_answer(server, client, expected):
    """The fused step runs each `execute` batch at once (one encode_batch per max length, the encoder split by
    length, one head call per task version): with mixed tasks, lengths, pairs and bad requests in the same batches,
    every request gets exactly its own answer and the bad ones fail alone. Batches of several requests did form."""
    items = []
    for i in range(96):
        name = ("alpha", "beta", "gamma", "zeta")[i % 4]
        text = TEXTS[(i * 5) % len(TEXTS)]
        items.append({"task": name, "text": text, "text_pair": PAIRS[TEXTS.index(text)] if name == "zeta" else None})
    bad = {7: {"task": "alpha", "text": "\u200b"}, 30: {"task": "nope", "text": TEXTS[0]},
           55: {"task": "zeta", "text": TEXTS[1]}, 81: {"task": "beta", "text": TEXTS[2], "text_pair": "w1"}}
    items = [bad.get(i, item) for i, item in enumerate(items)]
    before = {m: _stats(client, m, server) for m in ("aot",)}
    answers = client.infer_many(items, concurrency=96)
    for i, (item, answer) in enumerate(zip(items, answers, strict=True)):
        if i in bad:
            assert set(answer) == {"task", "error", "error_type", "status", "retryable"}, (i, answer)  # no answer
            assert answer["task"] == item["task"], (i, answer)
            continue
        want = expected[("zeta", "pair")] if item["task"] == "zeta" else expected[item["task"]]
        np.testing.assert_allclose(answer["logits"], want[TEXTS.index(item["text"])], atol=1e-3)
    assert "TEXT is empty" in answers[7]["error"] and "unknown task 'nope'" in answers[30]["error"]
    assert "send TEXT_PAIR too" in answers[55]["error"] and "send no TEXT_PAIR" in answers[81]["error"]
    for model, (requests0, executions0) in before.items():
        requests, executions = (a - b for a, b in zip(_stats(client, model, server), (requests0, executions0), strict=True))
        assert executions < requests, f"{model}: {executions} executions for {requests} requests"



def _many(server, tasks: list[str], texts: list[str], pairs: list[str] | None = None):
    """One request of N texts through plain tritonclient: TEXT, TASK (and TEXT_PAIR) [N, 1]."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, values in (("TEXT", texts), ("TASK", tasks), ("TEXT_PAIR", pairs)):
        if values is not None:
            tensor = grpcclient.InferInput(name, [len(values), 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[v.encode()] for v in values], dtype=np.object_))
            inputs.append(tensor)
    with grpcclient.InferenceServerClient(server.grpc_url) as raw:
        return raw.infer("aot", inputs)


def test_a_request_of_many_texts_is_answered_in_order(server, expected):
    """One request of 8 texts of 4 tasks, a pair task among them (its items carry a pair, the others ""): each row of
    ANSWER, LOGITS and TASK_VERSION answers its own item, as a request of one text would."""
    names = ["alpha", "zeta", "beta", "gamma", "alpha", "zeta", "gamma", "beta"]
    texts = [TEXTS[(3 * k) % len(TEXTS)] for k in range(len(names))]
    pairs = [PAIRS[TEXTS.index(t)] if n == "zeta" else "" for n, t in zip(names, texts, strict=True)]
    result = _many(server, names, texts, pairs)
    answers = [json.loads(a) for a in result.as_numpy("ANSWER").reshape(-1)]
    versions = [v.decode() for v in result.as_numpy("TASK_VERSION").reshape(-1)]
    logits = result.as_numpy("LOGITS")
    assert logits.shape == (8, 2) and len(answers) == len(versions) == 8
    for k, (name, text) in enumerate(zip(names, texts, strict=True)):
        want = expected[("zeta", "pair")] if name == "zeta" else expected[name]
        np.testing.assert_allclose(answers[k]["logits"], want[TEXTS.index(text)], atol=1e-3, err_msg=str(k))
        np.testing.assert_allclose(logits[k], answers[k]["logits"], rtol=1e-6)
        assert versions[k].startswith(f"{name}@"), versions[k]


def test_a_request_with_one_bad_item_is_refused_naming_it(server, client, expected):
    """Item 3 of 4 names no task the store holds: the request fails as a whole with a message naming the item (the
    status of its cause), and the server goes on answering."""
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        _many(server, ["alpha", "beta", "nope", "gamma"], TEXTS[:4])
    assert "item 3 of 4: unknown task 'nope'" in str(caught.value), caught.value
    assert "NOT_FOUND" in str(caught.value.status()), caught.value.status()
    np.testing.assert_allclose(client.infer("alpha", TEXTS[0])["logits"], expected["alpha"][0], atol=1e-3)


def test_infer_many_packs_lines_and_a_bad_line_fails_alone(server, client, expected):
    """40 lines, 16 to a request: 3 requests; the one holding two bad lines is refused and sent again line by line
    (16 requests), so each bad line fails alone, with its own cause, and the 38 others are answered, in order, each
    echoing its id and task."""
    items = [{"id": i, "task": ("alpha", "beta", "gamma")[i % 3], "text": TEXTS[i % len(TEXTS)]} for i in range(40)]
    items[3] = {"id": 3, "task": "nope", "text": TEXTS[0]}
    items[9] = {"id": 9, "task": "alpha", "text": " "}
    sent = []
    send = client._client.async_infer

    def counted(model, inputs, **kwargs):
        sent.append(inputs[0].shape()[0])  # TASK [N, 1]: the texts of the request
        return send(model, inputs, **kwargs)

    client._client.async_infer = counted
    try:
        answers = client.infer_many(items, pack=16)
    finally:
        client._client.async_infer = send
    for i, (item, answer) in enumerate(zip(items, answers, strict=True)):
        assert answer["id"] == i and answer["task"] == item["task"], answer
        if i in (3, 9):
            continue
        np.testing.assert_allclose(answer["logits"], expected[item["task"]][TEXTS.index(item["text"])], atol=1e-3)
    assert "unknown task 'nope'" in answers[3]["error"] and answers[3]["status"] == "NOT_FOUND"
    assert "TEXT is empty" in answers[9]["error"] and "item" not in answers[9]["error"]
    assert sent == [16, 16, 8] + [1] * 16, sent


def test_infer_many_splits_a_pack_larger_than_the_max_batch(server, client, expected):
    """pack=100 on a server whose max batch size is 64: the first request is refused by Triton, split to 64, and
    every line is answered; the client remembers the limit."""
    items = [{"task": "alpha", "text": TEXTS[i % len(TEXTS)]} for i in range(70)]
    with Client(server.grpc_url) as fresh:
        answers = fresh.infer_many(items, pack=100)
        assert fresh._pack_limit == 64
    assert len(answers) == len(items)
    for i, answer in enumerate(answers):
        np.testing.assert_allclose(answer["logits"], expected["alpha"][i % len(TEXTS)], atol=1e-3)

@pytest.fixture(scope="module")
def steps_server(request, repo):
    """The GPU ensembles' separate steps on their CPU configs (no ensemble chains them here)."""
    yield from serve_for_tests(request, repo, load=("tokenizer", "backbone", "backbone_vanilla", "head"))


def test_gpu_ensemble_steps_chained_by_hand_answer_as_the_fused_step(steps_server, server, expected):
    """The GPU ensembles run tokenizer -> backbone -> head as three steps; the CPU configs run the same stages
    (aot.serving.stages) in one. Chained by hand here, in the ensemble's order and tensors, they give the fused step's
    answers and `aot predict`'s, for the AoT and the vanilla backbone."""
    import tritonclient.grpc as grpcclient

    def call(c, model, inputs):
        tensors = []
        for name, array in inputs.items():
            dtype = "BYTES" if array.dtype == np.object_ else {"int64": "INT64", "float32": "FP32"}[array.dtype.name]
            t = grpcclient.InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            tensors.append(t)
        return c.infer(model, tensors)

    fused = {m: Client(server.grpc_url, model=m) for m in ("aot", "vanilla")}
    with grpcclient.InferenceServerClient(steps_server.grpc_url) as c:
        for name in ("alpha", "beta", "gamma"):
            for i, text in enumerate(TEXTS):
                tokens = call(c, "tokenizer", {"TEXT": _bytes(text.encode()), "TASK": _bytes(name.encode())})
                version = tokens.as_numpy("TASK_VERSION")
                ids = {n: tokens.as_numpy(n) for n in ("input_ids", "attention_mask", "token_type_ids")}
                for backbone, model in (("backbone", "aot"), ("backbone_vanilla", "vanilla")):
                    inputs = {**ids, **({"TASK_VERSION": version} if backbone == "backbone" else {})}
                    pooled = call(c, backbone, inputs).as_numpy("pooled_hidden")
                    logits = call(c, "head", {"TASK_VERSION": version, "pooled_hidden": pooled}).as_numpy("LOGITS")
                    want = fused[model].infer(name, text)
                    np.testing.assert_allclose(logits[0], want["logits"], atol=1e-5)
                    assert version[0, 0].decode() == want["version"]
                    if backbone == "backbone":
                        np.testing.assert_allclose(logits[0], expected[name][i], atol=1e-3)
    for c in fused.values():
        c.close()


def test_client_error_is_one_line(client):
    with pytest.raises(InferenceError) as err:
        client.infer("nope", "good")
    assert "\n" not in str(err.value) and "unknown task 'nope'" in str(err.value)


class _Refusal(Exception):
    """A gRPC error as tritonclient raises it: a status and a message."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self._status, self._message = status, message

    def status(self) -> str:
        return self._status

    def message(self) -> str:
        return self._message


@pytest.mark.parametrize("status,message,again", [
    ("StatusCode.UNAVAILABLE", "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: "
                               "Failed to connect to remote host: Connection refused", True),
    ("StatusCode.UNAVAILABLE", "Stream removed (Socket closed)", True),
    ("StatusCode.UNAVAILABLE", "Received http2 header with status: 503", True),  # a balancer with no replica up
    ("StatusCode.UNAVAILABLE", "task 'alpha' cannot be served: its table is damaged", False),  # the server's word
    ("StatusCode.INVALID_ARGUMENT", "text of 70000 bytes: at most 65536", False),
    ("StatusCode.UNKNOWN", "Received http2 header with status: 413", False),  # too large: refused for good
    ("StatusCode.INTERNAL", "Stub process 'aot_1_0' is not healthy.", True),  # a dead instance, being replaced
    ("StatusCode.INTERNAL", "in ensemble 'aot', Stub process 'head_0_1' is not healthy.", True),  # a GPU ensemble's
    ("StatusCode.INTERNAL", "Failed to process the request(s) for model 'aot_0_0', message: boom", False),
])
def test_client_sends_again_only_what_found_no_server(status, message, again):
    from aot.client.retry import found_no_server

    assert found_no_server(_Refusal(status, message)) is again


def test_a_dead_instance_is_a_retryable_error_and_other_internal_errors_are_not():
    from aot.client.errors import Unavailable, from_triton

    dead = from_triton(_Refusal("StatusCode.INTERNAL", "Stub process 'aot_1_0' is not healthy."), task="alpha")
    assert type(dead) is Unavailable and dead.retryable and dead.status == "INTERNAL"
    other = from_triton(_Refusal("StatusCode.INTERNAL", "Failed to process the request(s): boom"), task="alpha")
    assert not other.retryable


def test_one_outage_window_serves_every_request_of_an_infer_many(monkeypatch):
    """infer_many's requests share one retry window (aot.client.retry.Outage): it opens at the first request that
    found no server, every request's waits count against it, and an answered request closes it."""
    from aot.client import retry as client_module

    now = [100.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: now[0])
    outage = client_module.Outage(1.0)
    waits = []
    for t in (100.0, 100.2, 100.5, 100.9):  # four requests of the call finding no server, one after another
        now[0] = t
        waits.append(outage.next_wait())
    assert waits[:3] == pytest.approx([client_module.RETRY_BACKOFF[0], 0.1, 0.25]) and waits[3] is None  # 0.9 + 0.45 > 1
    outage.answered()
    now[0] = 200.0
    assert outage.next_wait() == client_module.RETRY_BACKOFF[0]  # a new outage, a new window


def test_a_refusal_with_a_retry_hint_is_retryable_whatever_it_names():
    """A step's 503 that names its task is TaskUnavailable (a retry does not cure it) unless it ends with a retry
    hint (aot.serving.errors.retry_hint: a task store that does not answer now, a rate limit): then Unavailable, with
    the seconds it asked for."""
    from aot.client.errors import TaskUnavailable, Unavailable, from_triton
    from aot.serving.errors import retry_hint

    later = from_triton(_Refusal("StatusCode.UNAVAILABLE", "task 'alpha' (alpha@0123456789ab) cannot be fetched from "
                                 f"the task store now (it does not answer); {retry_hint(2)}"), task="alpha")
    assert type(later) is Unavailable and later.retryable and later.retry_after == 2.0
    limited = from_triton(_Refusal("StatusCode.UNAVAILABLE", f"rate limit of tenant 'acme': {retry_hint(0.125)}"),
                          task="acme/intent")
    assert type(limited) is Unavailable and limited.retry_after == 0.12
    damaged = from_triton(_Refusal("StatusCode.UNAVAILABLE", "task 'alpha' cannot be served: damaged"), task="alpha")
    assert type(damaged) is TaskUnavailable and not damaged.retryable and damaged.retry_after is None
    proxy = from_triton(_Refusal("StatusCode.RESOURCE_EXHAUSTED", "too many requests"), task="alpha")
    assert type(proxy) is Unavailable and proxy.retryable


def test_client_retries_a_refused_connection_with_a_short_bounded_backoff(repo):
    """A call to a port where no server listens yet is sent again (0.05 s doubling to 1 s) until the server is
    there; with nothing there it fails after retry_seconds, with the reason."""
    from aot.local.server import LocalServer, free_port

    port = free_port()
    answers = []
    with Client(f"127.0.0.1:{port}", retry_seconds=60) as early:
        caller = threading.Thread(target=lambda: answers.append(early.infer("alpha", TEXTS[0])))
        caller.start()
        time.sleep(1)  # refused meanwhile
        with LocalServer(repo, grpc_port=port):
            caller.join(60)
        assert answers and answers[0]["version"].startswith("alpha@"), answers
    with Client(f"127.0.0.1:{port}", retry_seconds=1) as late:
        start = time.monotonic()
        with pytest.raises(InferenceError, match="failed to connect|Connection refused"):
            late.infer("alpha", TEXTS[0])
        assert 0.5 < time.monotonic() - start < 5


def test_load_eight_clients(server, expected):
    errors, mismatches = [], []
    names = ("alpha", "beta", "gamma")

    def worker(k):
        with Client(server.grpc_url) as c:
            for j in range(100):
                name, i = names[(k + j) % 3], (k * 7 + j) % len(TEXTS)
                try:
                    got = c.infer(name, TEXTS[i])
                except InferenceError as exc:
                    errors.append(str(exc))
                    continue
                if np.abs(np.array(got["logits"]) - expected[name][i]).max() > 1e-3:
                    mismatches.append((name, i, got["logits"]))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and mismatches == []


def test_add_swap_and_remove_tasks_while_serving(server, repo, artifacts, expected):
    """Other tasks' requests in flight all succeed; a new task serves within 5 s without a restart."""
    stop, failures, served = threading.Event(), [], [0]

    def traffic():
        with Client(server.grpc_url) as c:
            while not stop.is_set():
                try:
                    got = c.infer("alpha", TEXTS[1])
                    assert np.abs(np.array(got["logits"]) - expected["alpha"][1]).max() <= 1e-3
                    served[0] += 1
                except Exception as exc:  # noqa: BLE001
                    failures.append(repr(exc))

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        with Client(server.grpc_url) as c:
            export_task(artifacts["delta"], repo, "delta", progress=False)
            published = time.monotonic()
            while True:
                try:
                    got = c.infer("delta", TEXTS[0])
                    break
                except InferenceError:
                    assert time.monotonic() - published < 5, "new task not served within 5 s"
                    time.sleep(0.05)
            np.testing.assert_allclose(got["logits"], expected["delta"][0], atol=1e-3)
            # re-export under the same name: the new weights replace the old ones
            export_task(artifacts["epsilon"], repo, "delta", "factored", progress=False)
            np.testing.assert_allclose(c.infer("delta", TEXTS[0])["logits"], expected["epsilon"][0], atol=1e-3)
            TaskStore(read_repository(repo).store_root).remove("delta")
            with pytest.raises(InferenceError, match="unknown task 'delta'"):
                c.infer("delta", TEXTS[0])
            np.testing.assert_allclose(c.infer("beta", TEXTS[0])["logits"], expected["beta"][0], atol=1e-3)
    finally:
        stop.set()
        thread.join()
    assert failures == [] and served[0] > 0


def test_task_at_version_pins_a_version_the_store_holds(server, repo, artifacts, expected):
    """Every answer names the version that produced it; TASK@VERSION serves exactly that version while the store
    holds it (current or retired), the bare name the latest; a version the store does not hold is a 404 and a
    malformed one a 400, each failing alone."""
    with Client(server.grpc_url) as c:
        export_task(artifacts["delta"], repo, "eta", progress=False)
        first = c.infer("eta", TEXTS[0])
        export_task(artifacts["epsilon"], repo, "eta", "factored", progress=False)
        latest = c.infer("eta", TEXTS[0])
        assert first["version"].startswith("eta@") and latest["version"].startswith("eta@")
        assert first["version"] != latest["version"]
        np.testing.assert_allclose(latest["logits"], expected["epsilon"][0], atol=1e-3)
        pinned = c.infer(first["version"], TEXTS[0])
        assert pinned["version"] == first["version"]
        np.testing.assert_allclose(pinned["logits"], expected["delta"][0], atol=1e-3)
        TaskStore(read_repository(repo).store_root).remove("eta")
        with pytest.raises(InferenceError, match="unknown task 'eta'"):
            c.infer("eta", TEXTS[0])
        assert c.infer(latest["version"], TEXTS[0])["version"] == latest["version"]  # retired, still held
        answers = c.infer_many([{"task": "eta@000000000000", "text": TEXTS[0]}, {"task": "eta@v1", "text": TEXTS[0]},
                                {"task": "alpha", "text": TEXTS[0]}])
    assert answers[0]["error"].endswith("task version 'eta@000000000000' is not in the store (removed, or never "
                                        "exported)")
    assert "invalid task version 'eta@v1': expected <task name>@<12 hex digits>" in answers[1]["error"]
    np.testing.assert_allclose(answers[2]["logits"], expected["alpha"][0], atol=1e-3)


def test_reexport_under_load_serves_exactly_one_version_per_request(server, repo, artifacts, expected):
    """Re-export a task while 6 clients call it: every answer is the old version's or the new one's, none fails,
    none mixes one version's table with the other's head (the first step pins the version)."""
    from tests.helpers import Load

    with Load(server.grpc_url, TEXTS, 6, lambda k, j: ("alpha", k % len(TEXTS))) as load:
        for source in ("gamma", "alpha", "gamma", "alpha"):
            time.sleep(0.5)
            export_task(artifacts[source], repo, "alpha", "factored" if source == "gamma" else "fused",
                        progress=False)
        time.sleep(0.5)
    answers = [(o.text, o.logits) for o in load.outcomes if o.error is None]
    assert [o.error for o in load.outcomes if o.error is not None] == []
    versions = {"alpha": 0, "gamma": 0}
    for i, logits in answers:
        matches = [n for n in versions if np.abs(logits - expected[n][i]).max() <= 1e-3]
        assert matches, f"answer {logits} for text {i} is neither version's"
        versions[matches[0]] += 1
    assert versions["alpha"] > 0 and versions["gamma"] > 0, versions
    print(f"\n{len(answers)} answers during 4 re-exports: {versions}, 0 failed, 0 mixed")


def test_perf_analyzer_input_file_is_valid_for_the_ensemble(server, repo, artifacts):
    """docs/perf_analyzer_input.json (the README's perf_analyzer command) drives `aot` with mixed tasks: every entry
    is a valid request, sent here exactly as perf_analyzer sends it (shape [1] plus the batch dimension)."""
    from pathlib import Path

    data = json.loads((Path(__file__).parent.parent / "docs" / "perf_analyzer_input.json").read_text())["data"]
    tasks = {entry["TASK"]["content"][0] for entry in data}
    assert len(tasks) >= 2, "the file should mix tasks"
    for i, name in enumerate(sorted(tasks)):
        export_task(artifacts["alpha"], repo, name, ("fused", "factored")[i % 2], progress=False)
    try:
        for entry in data:
            inputs = [(name, np.array([[v.encode() for v in spec["content"]]], dtype=np.object_), "BYTES")
                      for name, spec in entry.items()]
            assert all(list(a.shape[1:]) == entry[n]["shape"] for n, a, _ in inputs)
            result = _raw(server, inputs)
            assert result.as_numpy("LOGITS").shape == (1, 2)
    finally:
        for name in tasks:
            TaskStore(read_repository(repo).store_root).remove(name)


# --- the `aot serve` command -----------------------------------------------------------------------------------

def _aot(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "aot", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **kw)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_command_corrupt_task_and_clean_stop(tmp_path, repo):
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    store = TaskStore(read_repository(copy).store_root)
    (store.root / store.entries()["beta"].folder / "table.npy").write_bytes(b"broken")
    ports = [str(_free_port()) for _ in range(3)]
    proc = _aot("serve", "--repo", str(copy), "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2])
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        info = json.loads(line)
        assert info["tasks"] == ["alpha", "beta", "gamma", "zeta"]  # from the index: start reads no task
        with Client(info["grpc"]) as c:
            assert c.infer("alpha", "good w1")["label"] in ("positive", "negative")
            with pytest.raises(InferenceError, match=r"task 'beta' \(beta@[0-9a-f]+\) is corrupt"):
                c.infer("beta", "good w1")
            deadline = time.monotonic() + 30  # the background audit names it too, with no request needed
            while "beta" not in c.tasks()["errors"]:
                assert time.monotonic() < deadline, c.tasks()
                time.sleep(0.5)
            assert "table.npy" in c.tasks()["errors"]["beta"]
        server_pids = subprocess.run(["pgrep", "-f", f"grpc-port={ports[1]}"], capture_output=True, text=True).stdout.split()
        assert server_pids
        stub_group = os.getpgid(int(server_pids[0]))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while _group_alive(stub_group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(stub_group), "tritonserver or its stubs outlived `aot serve`"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_command_port_taken_and_missing_repo(tmp_path, repo):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        proc = _aot("serve", "--repo", str(repo), "--grpc-port", port, "--http-port", str(_free_port()),
                    "--metrics-port", str(_free_port()))
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and f"127.0.0.1:{port} (--grpc-port) is already in use" in err
    proc = _aot("serve", "--repo", str(tmp_path / "nowhere"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "not an AoT model repository" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("probe,message", [
    ("printf '3.11\\n/usr/lib\\n2.1.0\\n'", "has numpy 2.1.0; the tritonserver python stub needs numpy<2"),
    ("echo \"ModuleNotFoundError: No module named 'aot'\" >&2; exit 1",
     "cannot import numpy and this project's aot.serving package: ModuleNotFoundError: No module named 'aot'"),
])
def test_serve_command_checks_the_python_the_steps_run(tmp_path, repo, probe, message):
    """AOT_STEP_PYTHON names the Python the stubs run (the `python3` in its folder); one they could not run the
    steps with is refused before tritonserver starts, in one line naming it and why."""
    python3 = tmp_path / "bin" / "python3"
    python3.parent.mkdir()
    python3.write_text(f"#!/bin/sh\n{probe}\n")
    python3.chmod(0o755)
    proc = _aot("serve", "--repo", str(repo), env={**os.environ, "AOT_STEP_PYTHON": str(python3)})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"aot: error: {python3} (the Python the steps run; AOT_STEP_PYTHON names another)" in err and message in err


def test_step_python_is_found_as_the_stub_finds_it(tmp_path, monkeypatch):
    """AOT_STEP_PYTHON relative to the current folder works (the server's PATH gets its absolute folder); one with
    no python3 beside it (what the stub runs) is refused naming it."""
    from aot.local.server import ServerError
    from aot.local.triton_setup import step_python

    monkeypatch.setenv("AOT_STEP_PYTHON", os.path.relpath(sys.executable))
    found = step_python()
    assert found.bin_dir.is_absolute() and (found.bin_dir / "python3").is_file()
    assert found.version == f"{sys.version_info[0]}.{sys.version_info[1]}"
    lonely = tmp_path / "bin" / "python"
    lonely.parent.mkdir()
    lonely.symlink_to(sys.executable)
    monkeypatch.setenv("AOT_STEP_PYTHON", str(lonely))
    with pytest.raises(ServerError, match="no python3 beside it"):
        step_python()


def test_tasks_command_lists_what_the_server_serves(server, repo):
    """`aot tasks` and Client.tasks() read the server (its task store view), not a disk the client has."""
    with Client(server.grpc_url) as c:
        listing = c.tasks()
    served = {t["name"]: t for t in listing["tasks"]}
    entries = TaskStore(read_repository(repo).store_root).entries()
    assert {"alpha", "beta", "gamma"} <= set(served)
    for name in ("alpha", "beta", "gamma"):
        assert served[name]["version"] == entries[name].folder and served[name]["storage"] == entries[name].storage
        assert served[name]["labels"] == ["negative", "positive"] and served[name]["max_length"] == 32
        assert served[name]["method"] in ("fc", "kron")
    proc = _aot("tasks", "--url", server.grpc_url)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert {line["name"] for line in lines} == set(served)


def test_infer_command_file_mixed_tasks(server, tmp_path, expected):
    requests = tmp_path / "requests.jsonl"
    items = [{"task": ("alpha", "beta", "gamma")[i % 3], "text": TEXTS[i % len(TEXTS)]} for i in range(12)]
    requests.write_text("".join(json.dumps(i) + "\n" for i in items))
    out = tmp_path / "answers.jsonl"
    proc = _aot("infer", "--url", server.grpc_url, "--input", str(requests), "--output", str(out), "--no-progress")
    assert proc.wait(120) == 0, proc.stderr.read()
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(answers) == 12
    for item, answer, i in zip(items, answers, range(12), strict=True):
        np.testing.assert_allclose(answer["logits"], expected[item["task"]][i % len(TEXTS)], atol=1e-3)


def test_an_answer_that_cannot_be_read_fails_its_items_and_the_call_returns(monkeypatch):
    """infer_many reads answers in gRPC's callback thread: an answer it cannot decode must still answer its items
    (with the error), or the call would wait for them forever. No server: the transport is replaced."""
    client = Client("127.0.0.1:1", retry_seconds=0)

    def send(inputs, callback, backoff=None):
        callback(object(), None)  # an "answer" with no outputs

    monkeypatch.setattr(client, "_send_async", send)
    done: list = []
    call = threading.Thread(target=lambda: done.append(client.infer_many(
        [{"task": "alpha", "text": f"w{k}", "id": k} for k in range(5)], pack=2)), daemon=True)
    call.start()
    call.join(timeout=30)
    assert done, "infer_many did not return"
    [answers] = done
    assert [a["id"] for a in answers] == list(range(5)) and all(a["task"] == "alpha" for a in answers)
    assert all(a["error_type"] == "InferenceError" and "could not be read" in a["error"] for a in answers), answers
