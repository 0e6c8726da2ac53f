"""Every kind of task on a repository's CPU engine in process (aot.exporter.cpu_engine): `aot predict --repo` answers a
tagger, a multi-label task and an embedding as the served step does (fp32: as PyTorch; int8: as a real
tritonserver), and the int8 accuracy gate scores each kind with its own dev metric on what the int8 engine serves,
not only classifiers. The int8 outlier model and the classifier's gate: tests/test_int8.py."""

import json

import numpy as np
import pytest

from aot.cli.main import main
from aot.client.client import Client
from aot.exporter.accuracy_gate import AccuracyDropError, dev_examples
from aot.exporter.backbone_export import export_backbone
from aot.exporter.cpu_engine import predict_lines_through
from aot.exporter.task_export import export_task
from aot.serving.words import entity_spans, split_words
from aot.training.artifact import read_task
from aot.training.data import recorded_task_data
from aot.training.data.task import DataError
from aot.training.metrics import compute_metric
from aot.training.predict import Predictor, predict_lines, task_folders
from aot.training.refit import fit_task
from aot.training.trainer import TrainConfig
from tests.helpers import make_repository, serve_for_tests, train_tiny_task
from tests.tiny import save_outlier_model, write_kind_folder

KINDS = ("cls", "ner", "tags", "search")  # classification, tokens, multilabel, embedding (conftest.kind_artifacts)
TEXTS = ["good w1 bad movie", "😀 café  w3 superb! w4", "w5 Zoë-Ann awful plot 🎬 great", "w6", "lovely"]


@pytest.fixture(scope="module")
def tasks(kind_artifacts) -> dict:
    return task_folders([f"{n}={kind_artifacts[n]}" for n in KINDS])


@pytest.fixture(scope="module")
def int8_repo(tmp_path_factory, tiny_models, tasks):
    """An int8 repository with a task of every kind, each published through the gate (its drop allowed: what is
    checked here is what the gate measures, tests/test_int8.py checks its refusal)."""
    path = tmp_path_factory.mktemp("int8-kinds") / "repo"
    export_backbone(str(tiny_models["bert"]), path, cpu_precision="int8")
    reports = {name: export_task(folder, path, name, "fused", progress=False, allowed_drop=100)
               for name, folder in tasks.items()}
    return path, reports


@pytest.fixture(scope="module")
def fp32_repo(tmp_path_factory, tiny_models, tasks):
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("fp32-kinds") / "repo",
                           {n: (folder, "fused") for n, folder in tasks.items()})


def _lines(names, texts) -> list[tuple[int, dict]]:
    return [(k, {"text": t, "text_pair": None, "task": n}) for k, (n, t) in
            enumerate((n, t) for n in names for t in texts)]


def _same(got: dict, want: dict, atol: float) -> None:
    """Two answers of one task (served or printed): the same keys, labels and entities; numbers within `atol`."""
    got, want = ({k: v for k, v in a.items() if k not in ("task", "version")} for a in (got, want))
    assert set(got) == set(want), (got, want)
    if "embedding" in want:
        np.testing.assert_allclose(got["embedding"], want["embedding"], atol=atol)
    elif "entities" in want:
        assert [{**e, "score": 0} for e in got["entities"]] == [{**e, "score": 0} for e in want["entities"]]
        np.testing.assert_allclose([e["score"] for e in got["entities"]], [e["score"] for e in want["entities"]],
                                   atol=atol)
    elif "labels" in want:
        assert got["labels"] == want["labels"]
        np.testing.assert_allclose(list(got["scores"].values()), list(want["scores"].values()), atol=atol)
    else:
        assert got["label"] == want["label"]
        np.testing.assert_allclose(got["logits"], want["logits"], atol=atol)


def test_predict_through_an_fp32_repo_answers_every_kind_as_pytorch(fp32_repo, tasks):
    lines = _lines(KINDS, TEXTS)
    through, predicted = predict_lines_through(fp32_repo, tasks, lines), predict_lines(tasks, lines, None)
    for k, item in lines:
        assert through[k]["task"] == item["task"]
        _same(through[k], predicted[k], atol=1e-4)


def test_aot_predict_repo_prints_entities_and_vectors(fp32_repo, tasks, tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": k, "task": n, "text": TEXTS[1]}) + "\n"
                            for k, n in enumerate(("ner", "search"))))
    assert main(["predict", "--repo", str(fp32_repo), *[f"--task={n}={tasks[n]}" for n in ("ner", "search")],
                 "--input", str(path), "--no-progress"]) == 0
    ner, search = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert ner["id"] == 0 and ner["task"] == "ner" and {"entities"} == set(ner) - {"id", "task"}
    assert search["id"] == 1 and {"embedding"} == set(search) - {"id", "task"}
    assert abs(np.linalg.norm(search["embedding"]) - 1) < 1e-5


@pytest.fixture(scope="module")
def int8_server(request, int8_repo):
    yield from serve_for_tests(request, int8_repo[0])


@pytest.mark.server
def test_predict_through_an_int8_repo_answers_every_kind_as_served(int8_server, int8_repo, tasks):
    repo, _ = int8_repo
    lines = _lines(KINDS, TEXTS)
    through = predict_lines_through(repo, tasks, lines)
    predicted = predict_lines(tasks, lines, None)
    vectors = [(np.array(through[k]["embedding"]), np.array(predicted[k]["embedding"])) for k, item in lines
               if item["task"] == "search"]
    assert max(np.abs(a - b).max() for a, b in vectors) > 1e-4  # it ran the int8 graph, not fp32
    with Client(int8_server.grpc_url) as client:
        served = client.infer_many([{"task": item["task"], "text": item["text"]} for _, item in lines])
    for (k, item), answer in zip(lines, served, strict=True):
        assert "error" not in answer, answer
        assert answer["version"].startswith(item["task"] + "@")
        _same(answer, through[k], atol=1e-4)


def _tags(answer: dict, text: str) -> list[str]:
    """The BIO tags per word of `text` that a token task's answered entities stand for."""
    spans = split_words(text).spans
    tags = ["O"] * len(spans)
    for entity in answer["entities"]:
        inside = [w for w, (s, e) in enumerate(spans) if s >= entity["start"] and e <= entity["end"]]
        for k, w in enumerate(inside):
            tags[w] = ("B-" if k == 0 else "I-") + entity["label"]
    return tags


def _score_of_answers(spec, examples, answer) -> float:
    """The task's dev metric computed from `aot predict --repo`'s answers (`answer(texts)`), as a user would."""
    if spec.kind == "embedding":
        anchors, positives = (np.array([a["embedding"] for a in answer(texts)]) for texts in
                              ([e.text for e in examples], [e.text_pair for e in examples]))
        return compute_metric(spec.metric, anchors @ positives.T, None, 0)
    answers = answer([e.text for e in examples])
    labels = list(spec.labels)
    if spec.kind == "tokens":
        tags = [_tags(a, e.text) for a, e in zip(answers, examples, strict=True)]
        assert any(entity_spans(t) for t in tags)
        return compute_metric(spec.metric, tags, [e.label for e in examples], len(labels))
    if spec.kind == "multilabel":
        def indicators(names):
            return [[int(label in row) for label in labels] for row in names]

        return compute_metric(spec.metric, indicators([a["labels"] for a in answers]),
                              indicators([e.label for e in examples]), len(labels))
    return compute_metric(spec.metric, [labels.index(a["label"]) for a in answers],
                          [labels.index(e.label) for e in examples], len(labels))


def test_gate_scores_every_kind_with_its_own_metric_on_what_int8_serves(int8_repo, tasks):
    """The gate's int8 score of each kind is the kind's dev metric of what the int8 engine answers (recomputed here
    from `aot predict --repo`'s answers), and its fp32 reference is the score training recorded."""
    repo, reports = int8_repo
    for name, folder in tasks.items():
        artifact = read_task(folder)
        spec = artifact.spec
        gate = reports[name].served_dev
        assert gate["precision"] == "int8" and gate["metric"] == spec.metric, name
        examples = recorded_task_data(artifact.config["training"]["data"], spec).dev
        assert gate["examples"] == len(examples)
        assert gate["fp32"] == pytest.approx(artifact.metrics()["dev"], abs=1e-6), name

        def answer(texts, name=name):
            got = predict_lines_through(repo, {name: folder}, _lines([name], texts))
            return [got[k] for k in range(len(texts))]

        assert gate["score"] == pytest.approx(_score_of_answers(spec, examples, answer), abs=1e-6), name


def test_gate_refuses_an_embedding_that_loses_recall_and_it_can_be_refitted(tmp_path):
    """On the encoder built to need care in int8 (tests/test_int8.py), an embedding task loses recall@1 through the
    int8 engine: the gate refuses it (not only a classifier), scores it alike on its dev file given as --dev-data,
    and re-fitting it to the int8 backbone, the way out the refusal names, runs for an embedding."""
    model = save_outlier_model(tmp_path / "model")
    data = write_kind_folder(tmp_path / "data", "embedding")
    task = train_tiny_task(model, data, tmp_path / "search", problem="embedding", epochs=6)
    repo = tmp_path / "repo"
    export_backbone(str(model), repo, cpu_precision="int8")
    with pytest.raises(AccuracyDropError, match=r"dev recall@1 through the int8 engine is [\d.]+, [\d.]+ points below"):
        export_task(task, repo, "search", progress=False)
    recorded = export_task(task, repo, "search", progress=False, allowed_drop=100).served_dev
    given = export_task(task, repo, "search", progress=False, allowed_drop=100, dev_data=data / "dev.jsonl").served_dev
    assert recorded["metric"] == "recall@1" and recorded["drop"] > 0.5
    same = ("score", "fp32", "examples")
    assert {k: given[k] for k in same} == {k: recorded[k] for k in same}
    result = fit_task(task, repo, tmp_path / "fitted", TrainConfig(lr=3e-3, batch_size=16, max_steps=20, eval_every=10),
                      progress=False)
    assert result["metric"] == "recall@1" and result["int8_dev_before_fit"] < result["fp32_dev_before_fit"]
    assert result["int8_dev"] >= result["int8_dev_before_fit"]


def test_gate_dev_data_with_a_label_the_task_does_not_know_names_the_row(tasks, tmp_path):
    """--dev-data is read as `aot evaluate` reads a labelled file: a label outside the task's is named with its row,
    not a KeyError from the scorer."""
    data = tmp_path / "dev.jsonl"
    data.write_text('{"text": "good w1", "label": "positive"}\n{"text": "w2", "label": "sideways"}\n')
    with pytest.raises(DataError, match=r"dev.jsonl:2: label 'sideways' is not one of the task's labels"):
        dev_examples(Predictor.load(tasks["cls"]), data)
