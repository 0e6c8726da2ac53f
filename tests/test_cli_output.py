"""What the `aot` CLI answers, on tiny trained tasks and a real tritonserver: JSON on stdout for scripts (scores,
probabilities, batch answers, evaluations, the same from `aot predict`, `aot infer` and the Client), a summary and the
next step on stderr for people, and the files it leaves behind."""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter

import pytest
import torch

from aot.cli.main import main
from tests.helpers import one_line_error

# --- tiny tasks and a server ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tasks(tmp_path_factory, tiny_models, sentiment_dir):
    """A classification task and a regression one (1.0 for positive texts, 0.0 for negative), trained on tiny BERT."""
    from tests.helpers import train_tiny_task
    from tests.tiny import sentiment_examples

    root = tmp_path_factory.mktemp("tasks")
    scores = root / "scores"
    scores.mkdir()
    for split, n, seed in (("train", 200, 1), ("dev", 50, 2)):
        rows = [{"text": r["text"], "label": float(r["label"] == "positive")} for r in sentiment_examples(n, seed)]
        (scores / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"sentiment": train_tiny_task(tiny_models["bert"], sentiment_dir, root / "sentiment"),
            "score": train_tiny_task(tiny_models["bert"], scores, root / "score", problem="regression")}


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, tiny_models, tasks):
    from tests.helpers import make_repository, serve_for_tests

    repo = make_repository(tiny_models["bert"], tmp_path_factory.mktemp("served") / "repo",
                           {name: (path, "fused") for name, path in tasks.items()})
    yield from serve_for_tests(request, repo)


# --- answers on stdout: scores, probabilities, batch answers, evaluations -------------------------------------------

def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.server
def test_regression_answers_a_score_everywhere(tasks, server, capsys):
    from aot.client.client import Client

    assert main(["predict", "--task", str(tasks["score"]), "good w1", "w2 awful"]) == 0
    predicted = _json_lines(capsys.readouterr().out)
    assert [list(a) for a in predicted] == [["task", "score"], ["task", "score"]]  # predict names the task
    assert predicted[0]["score"] > predicted[1]["score"]
    assert main(["infer", "--url", server.grpc_url, "--task", "score", "good w1", "w2 awful"]) == 0
    inferred = _json_lines(capsys.readouterr().out)
    with Client(server.grpc_url) as client:
        answers = [client.infer("score", "good w1"), *client.infer_many([{"task": "score", "text": "w2 awful"}])]
    assert [list(a) for a in answers] == [["score", "version"], ["task", "score", "version"]]  # infer_many echoes
    for p, i, c in zip(predicted, inferred, answers, strict=True):
        assert list(i) == ["task", "score", "version"] and abs(p["score"] - i["score"]) < 1e-3
        # two served answers of one text agree to float noise (one may have been batched with others), one version
        assert i["version"] == c["version"] and abs(i["score"] - c["score"]) < 1e-5


@pytest.mark.server
def test_classification_answers_probabilities(tasks, server, capsys):
    from aot.client.client import Client

    assert main(["predict", "--task", str(tasks["sentiment"]), "good w1"]) == 0
    [predicted] = _json_lines(capsys.readouterr().out)
    with Client(server.grpc_url) as client:
        served = client.infer("sentiment", "good w1")
    assert predicted.pop("task") == tasks["sentiment"].name  # predict names the task (many may be given)
    assert served.pop("version").startswith("sentiment@")  # which task version answered; predict reads an artifact
    for answer in (predicted, served):
        assert list(answer) == ["label", "logits", "probabilities"] and answer["label"] == "positive"
        assert abs(sum(answer["probabilities"]) - 1) < 1e-6 and answer["probabilities"][1] > 0.5
        expected = torch.softmax(torch.tensor(answer["logits"], dtype=torch.float64), 0).tolist()
        assert answer["probabilities"] == pytest.approx(expected, abs=1e-9)


REQUESTS = [{"id": 7, "text": "good w1"}, {"id": "b", "task": "nope", "text": "w3"}, {"task": "score", "text": "w4"}]


@pytest.mark.server
def test_infer_input_answers_what_it_can(tmp_path, server, capsys, monkeypatch):
    """A line without a task takes --task; each answer echoes the line's id and task (a line without an id: its
    number, "line"); a failed line is counted in the one-line summary and fails the run (exit 2), unless
    --partial-ok, which fails it only when every line failed."""
    import io

    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    argv = ["infer", "--url", server.grpc_url, "--task", "sentiment", "--no-progress", "--input"]
    assert main([*argv, str(path)]) == 2
    captured = capsys.readouterr()
    answers = _json_lines(captured.out)
    assert [(a.get("id"), a.get("line"), a["task"]) for a in answers] == [(7, None, "sentiment"), ("b", None, "nope"),
                                                                          (None, 3, "score")]
    assert answers[0]["label"] == "positive" and "score" in answers[2] and "unknown task 'nope'" in answers[1]["error"]
    summary = captured.err.strip()
    assert len(summary.splitlines()) == 1
    assert re.fullmatch(r"aot: error: 2 of 3 lines answered, 1 failed \(1 TaskNotFound, first line 2: unknown task "
                        r"'nope'; .*\), 0 retried, [0-9.]+ s, [0-9]+ lines/s", summary), summary
    assert main([*argv, str(path), "--partial-ok"]) == 0
    assert one_line_error(capsys).startswith("aot: warning: 2 of 3 lines answered, 1 failed (1 TaskNotFound, ")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'{"task": "nope", "text": "w1"}\n\n{"task": '
                                                                 b'"nope", "text": "w2"}\n')))
    assert main([*argv, "-", "--partial-ok"]) == 2
    assert one_line_error(capsys).startswith("aot: error: 0 of 2 lines answered, 2 failed (2 TaskNotFound, first "
                                             "line 1: unknown task 'nope'; known tasks: score, sentiment), ")


def test_evaluate_scores_a_labelled_file(tasks, sentiment_dir, tmp_path, capsys):
    """On the dev split, the score training reported for the weights it kept, and per class figures that add up to
    it; a row whose label the task does not know is counted and left out (issue 54.7: the file used to be refused);
    --predictions writes each scored row's prediction."""
    dev = sentiment_dir / "dev.jsonl"
    assert main(["evaluate", "--task", str(tasks["sentiment"]), str(dev)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    err = captured.err.splitlines()
    assert err[0] == f"aot: sentiment: accuracy {report['score']:.4f} on 100 examples of {dev}"
    assert re.fullmatch(r"aot: F1 per class, lowest first \(support\): (negative|positive) [0-9.]+ \([0-9]+\), "
                        r"(negative|positive) [0-9.]+ \([0-9]+\)", err[1]), err
    metrics = json.loads((tasks["sentiment"] / "metrics.json").read_text())
    per_class = report.pop("per_class")
    assert report == {"task": "sentiment", "metric": "accuracy", "score": metrics["dev"], "examples": 100,
                      "data": str(dev), "unknown_labels": {}}
    assert set(per_class) == {"negative", "positive"} and sum(c["support"] for c in per_class.values()) == 100
    correct = sum(c["recall"] * c["support"] for c in per_class.values())
    assert correct == pytest.approx(report["score"] * 100)  # recall x support: the rows of each class it got right
    assert main(["evaluate", "--task", str(tasks["score"]), str(tasks["score"].parent / "scores" / "dev.jsonl")]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["metric"] == "pearson_spearman" and scored["per_class"] is None
    mixed = tmp_path / "test.csv"
    mixed.write_text("text,label\ngood w1,positive\nw2,neutral\nw3 awful,negative\nw4,neutral\n")
    predictions = tmp_path / "predictions.jsonl"
    assert main(["evaluate", "--task", str(tasks["sentiment"]), str(mixed), "--predictions", str(predictions)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["examples"] == 2 and report["unknown_labels"] == {"neutral": 2}
    assert ("aot: warning: rows left out of the score for labels the task does not know (by label): 'neutral': 2"
            in captured.err.splitlines())
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert [(r["text"], r["expected"]) for r in rows] == [("good w1", "positive"), ("w3 awful", "negative")]
    assert all(r["task"] == "sentiment" and r["label"] in ("negative", "positive") and len(r["logits"]) == 2
               for r in rows)
    assert report["score"] == sum(r["label"] == r["expected"] for r in rows) / 2
    strangers = tmp_path / "strangers.csv"
    strangers.write_text("text,label\nw2,neutral\n")
    assert main(["evaluate", "--task", str(tasks["sentiment"]), str(strangers)]) == 2
    assert one_line_error(capsys) == (f"aot: error: {strangers}: no row has a label of task 'sentiment' (['negative', "
                                      "'positive']); labels found: {'neutral': 1}")


def test_evaluate_reports_entity_types_and_labels_per_class(kind_artifacts, tmp_path, capsys):
    """A tagger's per-class report is per entity type (seqeval's), a multi-label task's per label, each support the
    gold entities or labels of that class."""
    from aot.training.artifact import read_task

    for name in ("ner", "tags"):
        dev = tmp_path / f"{name}.jsonl"
        dev.write_text(open(f"{read_task(kind_artifacts[name]).config['training']['data']}/dev.jsonl").read())
        assert main(["evaluate", "--task", str(kind_artifacts[name]), str(dev)]) == 0
        report = json.loads(capsys.readouterr().out)
        rows = [json.loads(line) for line in dev.read_text().splitlines()]
        if name == "tags":
            gold = Counter(label for row in rows for label in row["labels"])
        else:
            gold = Counter(tag[2:] for row in rows for tag in row["tags"] if tag.startswith("B-"))
        assert {k: c["support"] for k, c in report["per_class"].items() if c["support"]} == dict(gold), name
        assert all(0 <= c[m] <= 1 for c in report["per_class"].values() for m in ("precision", "recall", "f1"))


@pytest.mark.server
def test_client_spellings_and_address_from_the_environment(server, capsys, monkeypatch):
    """`text_pair` (as in infer_many and the data) and the older `pair=` send the same request; AOT_URL is the
    address of aot tasks, aot infer and Client() when none is given."""
    from aot.client.client import Client, InferenceError

    monkeypatch.setenv("AOT_URL", server.grpc_url)
    refused = "task 'sentiment' was trained on single texts: send no TEXT_PAIR"  # so each spelling sent the pair
    with Client() as client:
        for kwargs in ({"text_pair": "w2 w3"}, {"pair": "w2 w3"}):
            with pytest.raises(InferenceError, match=refused):
                client.infer("sentiment", "good w1", **kwargs)
        assert client.infer_many([{"task": "sentiment", "text": "good w1", "text_pair": "w2 w3"}])[0]["error"] \
            .endswith(refused)
        single = client.infer("sentiment", "good w1")
    assert main(["tasks"]) == 0
    assert sorted(t["name"] for t in _json_lines(capsys.readouterr().out)) == ["score", "sentiment"]
    assert main(["infer", "--task", "sentiment", "good w1"]) == 0
    assert _json_lines(capsys.readouterr().out) == [single]


# --- reports on stderr: what happened and what is next --------------------------------------------------------------

def test_reports_say_what_happened_and_what_is_next(tmp_path, tiny_models, tasks, capsys):
    repo = tmp_path / "repo"
    assert main(["export", "backbone", "--model", str(tiny_models["bert"]), "--repo", str(repo)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["repo"] == str(repo)
    assert captured.err.splitlines()[-1] == (f"aot: next: aot export task --task TASK --repo {repo} --name NAME, then "
                                             f"aot serve --repo {repo}")
    assert main(["export", "task", "--task", str(tasks["sentiment"]), "--repo", str(repo), "--name", "s",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    folder = json.loads(captured.out)["folder"]
    assert captured.err.splitlines()[-1] == f'aot: next: aot serve --repo {repo} (if none runs), then aot infer --task s "some text"'
    assert main(["export", "list", "--repo", str(repo)]) == 0
    captured = capsys.readouterr()
    assert [e["name"] for e in _json_lines(captured.out)] == ["s"] and captured.err == f"aot: 1 task(s) in {repo}\n"
    assert main(["export", "remove", "--repo", str(repo), "--name", "s"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"removed": "s", "folder": folder}
    assert captured.err == (f"aot: removed task s from {repo}: servers stop answering it from their next batch; its "
                            f"version folder {folder} stays on disk for 5 minutes (requests already pinned to it "
                            "finish), then the first aot export task or remove on this repository deletes it\n")
    assert (repo / "tasks" / folder).is_dir()


@pytest.mark.parametrize("method,pair,hint", [
    pytest.param("fc", False, "; aot export task --task {out} --repo REPO --name NAME", id="exportable"),
    pytest.param("bitfit", False, " (a bitfit task runs in PyTorch only: aot export task takes fc and kron)",
                 id="PyTorch only"),
    pytest.param("fc", True, "; aot export task --task {out} --repo REPO --name NAME", id="pairs"),
])
def test_train_says_where_to_go_next(tmp_path, tiny_models, sentiment_dir, capsys, method, pair, hint):
    """The hint is a call that works: a task trained on text pairs is called with --pair (issue 54.7)."""
    from tests.tiny import write_sentiment_folder

    out = tmp_path / "t"
    data = write_sentiment_folder(tmp_path / "pairs", pair=True) if pair else sentiment_dir
    assert main(["train", "--model", str(tiny_models["bert"]), "--data", str(data), "--method", method,
                 "--out", str(out), "--epochs", "1", "--max-train-samples", "32", "--max-length", "16",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    summary, after = captured.err.splitlines()[-2:]
    assert summary == (f"aot: trained {result['task']} ({method}) into {out}: dev accuracy {result['dev']:.4f} after "
                       f"2 steps, {result['train_seconds']:.0f} s")
    texts = '--pair "a second text" "some text"' if pair else '"some text"'
    assert after == f"aot: next: aot predict --task {out} {texts}; aot evaluate --task {out} FILE" + \
        hint.format(out=out)
    call = after.removeprefix("aot: next: aot ").split(";")[0]
    assert main(shlex.split(call)) == 0 and "label" in json.loads(capsys.readouterr().out)


# --- files left behind ----------------------------------------------------------------------------------------------

def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_artifact_files_share_one_mode(tasks):
    import stat

    modes = {stat.S_IMODE(path.stat().st_mode) for path in tasks["sentiment"].iterdir()}
    assert len(modes) == 1 and modes.pop() & 0o444 == 0o444 & ~_umask()


def test_local_server_removes_its_temporary_folder_unless_it_failed(tmp_path):
    from aot.local.server import LocalServer

    server = LocalServer(tmp_path)
    folder = server.log_path.parent
    assert folder.name.startswith("aot-triton-") and folder.is_dir()
    server.stop()
    assert not folder.exists()
    failed = LocalServer(tmp_path)
    failed.failed = "tritonserver died 4 times in 60 s"
    failed.stop()
    assert failed.log_path.parent.is_dir()
    failed.log_path.parent.rmdir()
