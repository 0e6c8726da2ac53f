"""Tasks of every kind served on one engine through the real tritonserver: the table of kinds (every kind the
registry holds, aot.serving.kinds.KINDS, trained, exported, served and answered as `aot predict` answers; entity
offsets exact in accented and emoji text, embeddings within 1e-5), a batch mixing every kind
answers each request with its own kind in one execution, a bad request of one kind fails alone, the GPU ensemble's
steps chained by hand answer as the fused step, and the client and CLI speak every kind."""

import json

import numpy as np
import pytest

from aot.cli.main import main
from aot.client.client import Client
from aot.serving.kinds import KINDS
from aot.serving.supervision.admin_key import GRPC_ADMIN_HEADER
from aot.training.predict import predict_lines, task_folders
from tests.helpers import make_repository, serve_for_tests
from tests.tiny import KIND_TASKS

pytestmark = pytest.mark.server

TEXTS = ["good w1 bad movie", "😀 café  w3 superb! w4", "w5 Zoë-Ann awful plot 🎬 great", "w6", "lovely"]
KEYS = {"cls": {"label", "logits", "probabilities"}, "score": {"score"}, "ner": {"entities"},
        "tags": {"labels", "scores"}, "search": {"embedding"}}
TOLERANCE = {"search": 1e-5}  # of an answer's numbers; 1e-4 for the others'(a softmax's, a sigmoid's)


# each kind once more, in the other storage: 8 tasks of every kind for the requests that mix them
TWINS = {"cls2": ("cls", "factored"), "ner2": ("ner", "factored"), "tags2": ("tags", "fused"),
         "search2": ("search", "factored")}


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, kind_artifacts):
    storages = {"cls": "fused", "score": "factored", "ner": "fused", "tags": "factored", "search": "fused"}
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("kinds") / "repo",
                           {n: (kind_artifacts[n], storages[n]) for n in storages}
                           | {n: (kind_artifacts[kind], storage) for n, (kind, storage) in TWINS.items()},
                           max_batch_size=64, cpu_queue_delay_us=20000)


@pytest.fixture(scope="module")
def server(request, repo):
    yield from serve_for_tests(request, repo, load=("aot", "task_list", "tokenizer", "backbone", "head"))


@pytest.fixture(scope="module")
def expected(kind_artifacts):
    """`aot predict`'s answers (one MultiTaskModel batch mixing the kinds), by (task, text)."""
    lines = [(k, {"text": t, "text_pair": None, "task": n}) for k, (n, t) in
             enumerate((n, t) for n in KEYS for t in TEXTS)]
    answers = predict_lines(task_folders([f"{n}={kind_artifacts[n]}" for n in KEYS]), lines, None)
    return {(item["task"], item["text"]): answers[k] for k, item in lines}


@pytest.fixture
def client(server):
    with Client(server.grpc_url) as c:
        yield c


def _executions(client, server) -> int:
    """The fused step's executions so far (Triton's statistics: the admin key's)."""
    stats = client._client.get_inference_statistics("aot", headers={GRPC_ADMIN_HEADER: server.admin_key})
    return stats.model_stats[0].execution_count


def _same(got: dict, want: dict, task: str) -> None:
    """A served answer against `aot predict`'s (which adds P in fp16 as the store does), whatever its kind: the same
    keys, texts and integers (labels, entity offsets) equal, numbers within TOLERANCE; infer_many's echoes the
    task."""
    assert got.get("task", task) == task and got["version"].startswith(task + "@")
    assert set(got) - {"task"} == KEYS[task] | {"version"}
    echoes = ("id", "task", "version")
    _close({k: v for k, v in got.items() if k not in echoes}, {k: v for k, v in want.items() if k not in echoes},
           TOLERANCE.get(task, 1e-4), task)


def _close(got, want, atol: float, where: str) -> None:
    assert type(got) is type(want), f"{where}: {got!r} != {want!r}"
    if isinstance(got, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in got:
            _close(got[key], want[key], atol, f"{where}.{key}")
    elif isinstance(got, list):
        assert len(got) == len(want), f"{where}: {len(got)} items != {len(want)}"
        for k, (a, b) in enumerate(zip(got, want, strict=True)):
            _close(a, b, atol, f"{where}[{k}]")
    elif isinstance(got, float):
        assert abs(got - want) <= atol, f"{where}: {got} != {want} (atol {atol})"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_registered_kind_end_to_end(kind, client, expected):
    """The table of kinds: each kind the registry holds (aot.serving.kinds.KINDS; a new kind adds its tiny rows and
    task, tests.tiny.KIND_TASKS) has a tiny task trained (conftest.kind_artifacts), exported and served through the
    real server, whose answers equal `aot predict`'s: the client's (compact: the answer rebuilt from LOGITS and LABEL
    where its kind's carry it, KindSpec.carried), the server's own ANSWER JSON, and the kind the store lists."""
    names = [name for name, of in KIND_TASKS.items() if of == kind]
    assert len(names) == 1, f"kind {kind!r} needs one tiny task in tests.tiny.KIND_TASKS, has {names}"
    name = names[0]
    answers = client.infer_many([{"task": name, "text": t} for t in TEXTS])
    full = _raw(client, TEXTS, [name] * len(TEXTS), ("ANSWER", "TASK_VERSION"))
    assert len(answers) == len(TEXTS) == full.as_numpy("ANSWER").shape[0]
    for k, (text, answer) in enumerate(zip(TEXTS, answers, strict=True)):
        _same(answer, expected[(name, text)], name)
        own = json.loads(full.as_numpy("ANSWER")[k, 0]) | {"version": full.as_numpy("TASK_VERSION")[k, 0].decode()}
        _same(own, expected[(name, text)], name)
    assert {t["name"]: t["kind"] for t in client.tasks()["tasks"]}[name] == kind


def test_every_kind_answers_as_predict_in_one_mixed_batch(server, client, expected):
    """All kinds sent at once: fewer executions than requests (batches mix kinds: one engine call each), and every
    answer is its own task's kind's, equal to `aot predict`'s; entities point into the caller's text in characters
    (code points: 😀 is one), whatever the spacing."""
    before = _executions(client, server)
    items = [{"task": n, "text": t} for t in TEXTS for n in KEYS] * 3
    answers = client.infer_many(items, concurrency=len(items))
    for item, answer in zip(items, answers, strict=True):
        _same(answer, expected[(item["task"], item["text"])], item["task"])
    executions = _executions(client, server) - before  # the supervisor's probes add one a second at most
    assert executions < len(items) / 2, f"{executions} executions for {len(items)} requests of 5 kinds"
    found = {e["text"]: (e["label"], e["start"], e["end"]) for a in answers if "entities" in a for e in a["entities"]}
    start = TEXTS[1].index("superb!")  # 11: 😀 is one character (two in UTF-16, four in UTF-8)
    assert found["superb!"] == ("pos", start, start + 7)
    start = TEXTS[2].index("awful plot")
    assert found["awful plot"] == ("neg", start, start + 10)


def test_embed_returns_a_matrix_and_tasks_show_kinds(client, expected):
    matrix = client.embed("search", TEXTS)
    assert matrix.shape == (len(TEXTS), 32) and matrix.dtype == np.float32
    np.testing.assert_allclose(matrix, [expected[("search", t)]["embedding"] for t in TEXTS], atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(matrix, axis=1), 1, atol=1e-5)
    with pytest.raises(Exception, match="not an embedding task"):
        client.embed("ner", TEXTS[:1])
    assert {t["name"]: t["kind"] for t in client.tasks()["tasks"]} == KIND_TASKS | {
        twin: KIND_TASKS[kind] for twin, (kind, _) in TWINS.items()}


def test_a_bad_request_of_one_kind_fails_alone(server, client, expected, repo):
    """A pair for an embedding task (trained on single texts), a blank text for a token task, token ids for a token
    task (its entities are found in the text): each fails with 400 and a message, the rest of the batch answers."""
    items = [{"task": "search", "text": TEXTS[0], "text_pair": "w1"}, {"task": "ner", "text": " \u200b "},
             *[{"task": n, "text": TEXTS[0]} for n in KEYS]]
    answers = client.infer_many(items)
    assert answers[0]["error"].endswith("task 'search' was trained on single texts: send no TEXT_PAIR")
    assert "TEXT is empty" in answers[1]["error"]
    for item, answer in zip(items[2:], answers[2:], strict=True):
        _same(answer, expected[(item["task"], item["text"])], item["task"])
    tokenizing = Client(server.grpc_url, tokenizer=str(repo / "models" / "tokenizer" / "1" / "tokenizer"))
    with tokenizing:  # it sends a token task TEXT all the same, and ids for the others
        for name in KEYS:
            _same(tokenizing.infer(name, TEXTS[1]), expected[(name, TEXTS[1])], name)
    import tritonclient.grpc as grpcclient

    ids = grpcclient.InferInput("input_ids", [1, 3], "INT64")
    ids.set_data_from_numpy(np.array([[2, 7, 3]], dtype=np.int64))
    task = grpcclient.InferInput("TASK", [1, 1], "BYTES")
    task.set_data_from_numpy(np.array([[b"ner"]], dtype=np.object_))
    mask = grpcclient.InferInput("attention_mask", [1, 3], "INT64")
    mask.set_data_from_numpy(np.ones((1, 3), dtype=np.int64))
    with pytest.raises(Exception, match="task 'ner' tags tokens: send TEXT"):
        client._client.infer("aot", [ids, mask, task])


def _raw(client, texts: list[str], tasks: list[str], outputs: tuple[str, ...]):
    """One request of many texts, straight through tritonclient, asking for `outputs`."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, values in (("TEXT", texts), ("TASK", tasks)):
        tensor = grpcclient.InferInput(name, [len(values), 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[v.encode()] for v in values], dtype=np.object_))
        inputs.append(tensor)
    return client._client.infer("aot", inputs, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])


def test_a_request_mixing_9_tasks_of_every_kind_answers_as_single_requests(client):
    """Issue 52: a request of 64 texts over 9 tasks of the 5 kinds (one batch, in columns) answers each item
    exactly as a request of that text alone does: LOGITS to fp tolerance (the row zero past the item's own width,
    LOGITS_WIDTH), LABEL and TASK_VERSION equal; ANSWER only when the request asks for it, equal then too."""
    names = [*KEYS, *TWINS]
    tasks = [names[k % len(names)] for k in range(64)]
    texts = [TEXTS[(k // len(names) + k) % len(TEXTS)] for k in range(64)]
    lean = _raw(client, texts, tasks, ("LOGITS", "LOGITS_WIDTH", "LABEL", "TASK_VERSION"))
    assert lean.as_numpy("ANSWER") is None, "ANSWER was not asked for"
    full = _raw(client, texts, tasks, ("LOGITS", "LABEL", "TASK_VERSION", "ANSWER"))
    logits, labels, widths = lean.as_numpy("LOGITS"), lean.as_numpy("LABEL"), lean.as_numpy("LOGITS_WIDTH")
    assert logits.shape[0] == labels.shape[0] == widths.shape[0] == 64 and widths.dtype == np.int32
    np.testing.assert_array_equal(full.as_numpy("LOGITS"), logits)
    seen = set()
    for k, (text, task) in enumerate(zip(texts, tasks, strict=True)):
        alone = _raw(client, [text], [task], ("LOGITS", "LOGITS_WIDTH", "LABEL", "TASK_VERSION", "ANSWER"))
        own = alone.as_numpy("LOGITS")[0]
        assert widths[k, 0] == alone.as_numpy("LOGITS_WIDTH")[0, 0] == len(own)
        seen.add(len(own))
        np.testing.assert_allclose(logits[k, :len(own)], own, atol=1e-5)
        assert (logits[k, len(own):] == 0).all()
        assert labels[k, 0] == alone.as_numpy("LABEL")[0, 0]
        assert lean.as_numpy("TASK_VERSION")[k, 0] == alone.as_numpy("TASK_VERSION")[0, 0]
        assert lean.as_numpy("TASK_VERSION")[k, 0].decode().startswith(task + "@")
        mixed, single = json.loads(full.as_numpy("ANSWER")[k, 0]), json.loads(alone.as_numpy("ANSWER")[0, 0])
        kind = TWINS.get(task, (task,))[0]
        _same(mixed | {"version": kind + "@"}, single, kind)
    assert len(seen) >= 4, "the kinds' outputs differ in width"


def test_a_bad_item_fails_its_request_alone_naming_it(client):
    """One blank text among 64: its request fails naming that item; a request beside it in the batch answers."""
    texts = [TEXTS[k % len(TEXTS)] for k in range(64)]
    texts[17] = "  \t "
    tasks = [[*KEYS][k % len(KEYS)] for k in range(64)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(_raw, client, texts, tasks, ("LABEL",))
        good = pool.submit(_raw, client, texts[:17] + texts[18:], tasks[:17] + tasks[18:], ("LABEL",))
        with pytest.raises(Exception, match=r"item 18 of 64: TEXT is empty"):
            bad.result()
        assert good.result().as_numpy("LABEL").shape == (63, 1)


def test_answers_echo_their_items_and_top_k_ranks_what_has_labels(server, client, expected, tmp_path, capsys):
    """Issue 47.6: every infer_many answer echoes its item's id and task (not only the failed ones); `aot infer
    --top-k 2` answers a multi-label task's 2 highest scores (its labels kept) as it does a classifier's 2 most
    probable labels, and says which answers had no labels to rank (never silently ignored)."""
    items = [{"task": n, "text": TEXTS[0], "id": k} for k, n in enumerate(KEYS)]
    answers = client.infer_many(items)
    assert [(a["id"], a["task"]) for a in answers] == [(k, n) for k, n in enumerate(KEYS)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(item) + "\n" for item in items))
    assert main(["infer", "--url", server.grpc_url, "--input", str(requests), "--top-k", "2", "--no-progress"]) == 0
    captured = capsys.readouterr()
    ranked = {a["task"]: a for a in map(json.loads, captured.out.splitlines())}
    tags = expected[("tags", TEXTS[0])]
    highest = sorted(tags["scores"], key=lambda n: -tags["scores"][n])[:2]
    assert [t["label"] for t in ranked["tags"]["top"]] == highest and ranked["tags"]["labels"] == tags["labels"]
    assert "scores" not in ranked["tags"] and ranked["tags"]["top"][0]["score"] >= ranked["tags"]["top"][1]["score"]
    assert len(ranked["cls"]["top"]) == 2 and "probabilities" not in ranked["cls"]
    assert "entities" in ranked["ner"] and "embedding" in ranked["search"]
    assert captured.err.splitlines()[-1].startswith(f"aot: {len(KEYS)} of {len(KEYS)} lines answered")  # the summary
    assert captured.err.splitlines()[-2] == ("aot: warning: --top-k 2 ranks classification and multi-label answers; "
                                             "3 answer(s) have no labels to rank and are as usual (1 embedding, 1 "
                                             "regression, 1 tokens)")


def test_gpu_steps_chained_by_hand_answer_as_the_fused_step(server, client):
    """tokenizer -> backbone -> head, the GPU ensemble's steps with its tensors (a token task's words and states
    included), answer every kind as the fused step does."""
    import tritonclient.grpc as grpcclient

    def call(model, inputs):
        tensors = []
        for name, array in inputs.items():
            dtype = "BYTES" if array.dtype == np.object_ else array.dtype.name.upper().replace("FLOAT", "FP")
            t = grpcclient.InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            tensors.append(t)
        return client._client.infer(model, tensors)

    for name in KEYS:
        for text in TEXTS[:3]:
            tokens = call("tokenizer", {"TEXT": np.array([[text.encode()]], dtype=np.object_),
                                        "TASK": np.array([[name.encode()]], dtype=np.object_)})
            take = ("input_ids", "attention_mask", "token_type_ids", "TASK_VERSION")
            states = call("backbone", {n: tokens.as_numpy(n) for n in take})
            head = call("head", {"TASK_VERSION": tokens.as_numpy("TASK_VERSION"),
                                 "word_index": tokens.as_numpy("word_index"),
                                 "word_text": tokens.as_numpy("word_text"),
                                 **{n: states.as_numpy(n) for n in ("pooled_hidden", "token_hidden")}})
            want = client.infer(name, text)
            _same(json.loads(head.as_numpy("ANSWER")[0, 0]) | {"version": want["version"]}, want, name)


def test_infer_and_predict_commands_stream_every_kind(server, kind_artifacts, tmp_path, capsys, expected):
    lines = [{"id": k, "task": n, "text": t} for k, (n, t) in enumerate((n, t) for t in TEXTS[:2] for n in KEYS)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["infer", "--url", server.grpc_url, "--input", str(path), "--no-progress"]) == 0
    served = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert main(["predict", *[f"--task={n}={kind_artifacts[n]}" for n in KEYS], "--input", str(path)]) == 0
    predicted = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    for line, got, want in zip(lines, served, predicted, strict=True):
        assert got["id"] == want["id"] == line["id"] and got["task"] == want["task"] == line["task"]
        _same({k: v for k, v in got.items() if k not in ("id", "task")}, want, line["task"])
    assert main(["tasks", "--url", server.grpc_url]) == 0
    assert {json.loads(x)["kind"] for x in capsys.readouterr().out.splitlines()} == set(KINDS)
