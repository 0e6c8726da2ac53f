"""What a new user meets in the first hour (issue 26): each bad input is one line naming it, exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

from aot.cli import main


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# --- 1. devices --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,message", [
    ("gpu", "aot: error: --device 'gpu': expected cpu, cuda (cuda:N) or auto"),
    ("cpu:1", "aot: error: --device 'cpu:1': expected cpu, cuda (cuda:N) or auto"),
    pytest.param("cuda", f"aot: error: --device 'cuda': CUDA is not available (this PyTorch {torch.__version__} "
                         "sees no CUDA device); use --device cpu or auto",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this PyTorch sees a GPU")),
])
def test_train_device_is_checked_first(tmp_path, capsys, device, message):
    """Refused before the (missing) data and model are looked at."""
    out = tmp_path / "t"
    assert main(["train", "--model", "/no/model", "--data", "/no/data", "--method", "fc", "--out", str(out),
                 "--device", device]) == 2
    assert _one_line_error(capsys) == message
    assert not out.exists()


# --- 2. CSV files as people write them -----------------------------------------------------------------------------

def _folder(root, files: dict[str, str | bytes]):
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (root / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def _train(data, out, *extra) -> list[str]:
    return ["train", "--model", "/no/model", "--data", str(data), "--method", "fc", "--out", str(out), *extra]


DEV = "text,label\nc,x\n"


@pytest.mark.parametrize("case,files,message", [
    ("semicolons", {"train.csv": "text;label\na;x\nb;y\n", "dev.csv": DEV},
     "train.csv: header: found one column 'text;label': is the delimiter ';'? (.csv files are read with ',', "
     ".tsv files with tabs)"),
    ("wrong column names", {"train.csv": "sentence,label\na,x\nb,y\n", "dev.csv": DEV},
     "train.csv: header: no column 'text' (columns found: 'sentence', 'label'; expected text, label)"),
    ("header only", {"train.csv": "text,label\n", "dev.csv": DEV}, "train.csv has no data rows"),
    ("empty", {"train.csv": "text,label\na,x\nb,y\n", "dev.csv": ""}, "dev.csv has no data rows"),
    ("empty jsonl", {"train.csv": "text,label\na,x\nb,y\n", "dev.jsonl": "\n"}, "dev.jsonl has no data rows"),
])
def test_csv_mistakes_are_named(tmp_path, capsys, case, files, message):
    """Checked before the (missing) model loads: a header problem is reported as one, not as line 2."""
    data = _folder(tmp_path / "data", files)
    assert main(_train(data, tmp_path / "t")) == 2
    assert _one_line_error(capsys) == f"aot: error: {data}/{message}"


def test_byte_order_mark_is_skipped(tmp_path):
    from training.data import load_task_data

    bom = "\ufeff".encode()
    data = _folder(tmp_path, {"train.csv": bom + b"text,label\na,x\nb,y\n", "dev.jsonl": bom + b'{"text": "c", '
                              b'"label": "x"}\n', "task.json": bom + b'{"metric": "f1"}'})
    task = load_task_data(str(data))
    assert [e.text for e in task.train] == ["a", "b"] and task.dev[0].label == "x" and task.spec.metric == "f1"


# --- 3. regression -------------------------------------------------------------------------------------------------

SCORES = {"train.csv": "text,label\na,1\nb,2.5\nc,4\n", "dev.csv": "text,label\nd,4\n"}


@pytest.mark.parametrize("task_json,message", [
    ({"metrc": "f1"}, "unknown key 'metrc' (did you mean 'metric'?): expected one of name, labels, metric, problem"),
    ({"problem": "regresion"}, "problem 'regresion': expected one of classification, regression"),
    ({"labels": "a,b"}, "labels 'a,b': expected a list of strings"),
    ({"metric": "auc"}, "metric 'auc': expected one of accuracy, f1, acc_f1, mcc, pearson_spearman"),
])
def test_task_json_is_checked(tmp_path, capsys, task_json, message):
    data = _folder(tmp_path / "data", {**SCORES, "task.json": json.dumps(task_json)})
    assert main(_train(data, tmp_path / "t")) == 2
    assert _one_line_error(capsys) == f"aot: error: {data}/task.json: {message}"


def test_problem_is_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_train(tmp_path, tmp_path / "t", "--problem", "score"))
    assert exit_info.value.code == 2
    assert "argument --problem: invalid choice: 'score'" in capsys.readouterr().err


def test_numeric_labels_warn_and_problem_decides(tmp_path, recwarn):
    from training.data import DataWarning, load_task_data

    data = _folder(tmp_path, SCORES)
    assert load_task_data(str(data)).spec.labels == ("1", "2.5", "4")
    [warning] = [w for w in recwarn if w.category is DataWarning]
    assert str(warning.message) == (
        f"{data}/train.csv: every label is a number (1, 2.5, 4): training a 3-class classification; --problem "
        'regression (or "problem": "regression" in task.json) predicts a score instead, --problem classification '
        "silences this")
    recwarn.clear()
    assert load_task_data(str(data), problem="regression").spec.is_regression
    assert load_task_data(str(data), problem="classification").spec.num_outputs == 3
    assert not [w for w in recwarn if w.category is DataWarning]


def test_numeric_labels_warning_is_one_line(tmp_path, capsys):
    data = _folder(tmp_path / "data", SCORES)
    assert main(_train(data, tmp_path / "t")) == 2  # the model does not exist: the data was read first
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith(f"aot: warning: {data}/train.csv: every label is a number (1, 2.5, 4): ")
    assert error.startswith("aot: error: model '/no/model'")


def test_builtin_data_keeps_its_problem(capsys):
    assert main(["train", "--model", "/no/model", "--data", "rotten_tomatoes", "--method", "fc", "--out", "/no/out",
                 "--problem", "regression"]) == 2
    assert _one_line_error(capsys) == "aot: error: --problem regression: rotten_tomatoes is a classification task"


# --- 3. and 6. answers: scores, probabilities, batch scoring, evaluation -------------------------------------------

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


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.server
def test_regression_answers_a_score_everywhere(tasks, server, capsys):
    from aot.client import Client

    assert main(["predict", "--task", str(tasks["score"]), "good w1", "w2 awful"]) == 0
    predicted = _json_lines(capsys.readouterr().out)
    assert [list(a) for a in predicted] == [["task", "score"], ["task", "score"]]  # predict names the task
    assert predicted[0]["score"] > predicted[1]["score"]
    assert main(["infer", "--url", server.grpc_url, "--task", "score", "good w1", "w2 awful"]) == 0
    inferred = _json_lines(capsys.readouterr().out)
    with Client(server.grpc_url) as client:
        answers = [client.infer("score", "good w1"), *client.infer_many([{"task": "score", "text": "w2 awful"}])]
    for p, i, c in zip(predicted, inferred, answers):
        assert list(i) == list(c) == ["score", "version"] and abs(p["score"] - i["score"]) < 1e-3
        # two served answers of one text agree to float noise (one may have been batched with others), one version
        assert i["version"] == c["version"] and abs(i["score"] - c["score"]) < 1e-5


@pytest.mark.server
def test_classification_answers_probabilities(tasks, server, capsys):
    from aot.client import Client

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
    """A line without a task takes --task; each answer echoes the line's id and task; a failed line is counted on
    stderr and fails the run only with --strict (or when every line failed)."""
    import io

    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    argv = ["infer", "--url", server.grpc_url, "--task", "sentiment", "--no-progress", "--input"]
    assert main([*argv, str(path)]) == 0
    captured = capsys.readouterr()
    answers = _json_lines(captured.out)
    assert [(a.get("id"), a["task"]) for a in answers] == [(7, "sentiment"), ("b", "nope"), (None, "score")]
    assert answers[0]["label"] == "positive" and "score" in answers[2] and "unknown task 'nope'" in answers[1]["error"]
    warning = captured.err.strip()
    assert len(warning.splitlines()) == 1
    assert warning.startswith("aot: warning: 1 of 3 requests failed, answered {\"error\": ...} (first: line 2: ")
    assert warning.endswith("); --strict makes that exit 2")
    assert main([*argv, str(path), "--strict"]) == 2
    assert _one_line_error(capsys).startswith("aot: error: 1 of 3 requests failed (first: line 2: ")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'{"task": "nope", "text": "w1"}\n\n{"task": '
                                                                 b'"nope", "text": "w2"}\n')))
    assert main([*argv, "-"]) == 2
    assert _one_line_error(capsys) == ("aot: error: 2 of 2 requests failed (first: line 1: unknown task 'nope'; known "
                                       "tasks: score, sentiment)")


def test_infer_input_needs_a_task(tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"text": "good"}\n')
    assert main(["infer", "--input", str(path)]) == 2
    assert _one_line_error(capsys) == (f'aot: error: {path}:1: expected {{"task": "...", "text": "..."}} (or --task '
                                       "for lines without one)")


def test_evaluate_scores_a_labelled_file(tasks, sentiment_dir, tmp_path, capsys):
    """On the dev split, the score training reported for the weights it kept."""
    dev = sentiment_dir / "dev.jsonl"
    assert main(["evaluate", "--task", str(tasks["sentiment"]), str(dev)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert captured.err == f"aot: sentiment: accuracy {report['score']:.4f} on 100 examples of {dev}\n"
    metrics = json.loads((tasks["sentiment"] / "metrics.json").read_text())
    assert report == {"task": "sentiment", "metric": "accuracy", "score": metrics["dev"], "examples": 100,
                      "data": str(dev)}
    assert main(["evaluate", "--task", str(tasks["score"]), str(tasks["score"].parent / "scores" / "dev.jsonl")]) == 0
    assert json.loads(capsys.readouterr().out)["metric"] == "pearson_spearman"
    bad = tmp_path / "test.csv"
    bad.write_text("text,label\ngood w1,positive\nw2,neutral\n")
    assert main(["evaluate", "--task", str(tasks["sentiment"]), str(bad)]) == 2
    assert _one_line_error(capsys) == (f"aot: error: {bad}:3: label 'neutral' is not one of the task's labels "
                                       "['negative', 'positive']")


# --- 4. model names ------------------------------------------------------------------------------------------------

def test_packaged_model_name_ignores_case():
    from training.backbone import canonical_model, resolve_model_path

    assert canonical_model("MiniLM") == "minilm" and resolve_model_path("MiniLM") == resolve_model_path("minilm")


@pytest.mark.parametrize("model,message", [
    ("minlm", "model 'minlm' is not a folder: did you mean 'minilm' (the packaged all-MiniLM-L6-v2)?"),
    ("someone/no-such-model", "hub model 'someone/no-such-model' is not in the local Hugging Face cache and the hub "
                              "cannot be reached (HF_HUB_OFFLINE is set): pass a local model folder or 'minilm'"),
])
def test_model_typo_or_offline_hub_fails_at_once(tmp_path, capsys, model, message):
    import time

    data = _folder(tmp_path / "data", {"train.csv": "text,label\na,x\nb,y\n", "dev.csv": DEV})
    start = time.perf_counter()
    assert main(["train", "--model", model, "--data", str(data), "--method", "fc", "--out", str(tmp_path / "t")]) == 2
    assert time.perf_counter() - start < 5  # no download retries
    assert _one_line_error(capsys) == f"aot: error: {message}"


@pytest.mark.server
def test_client_spellings_and_address_from_the_environment(server, capsys, monkeypatch):
    """`text_pair` (as in infer_many and the data) and the older `pair=` send the same request; AOT_URL is the
    address of aot tasks, aot infer and Client() when none is given."""
    from aot.client import Client

    from aot.client import InferenceError

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


def test_train_does_not_replace_an_artifact_unasked(tmp_path, capsys):
    out = tmp_path / "task"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(_train(tmp_path / "data", out)) == 2
    assert _one_line_error(capsys) == f"aot: error: --out {out} already exists; pass --overwrite to replace it"
    assert (out / "config.json").read_text() == "{}"


# --- 7. help and conventions -----------------------------------------------------------------------------------------

def _parsers(parser=None, path="aot"):
    """Every (command path, parser) of `aot`, subcommands of subcommands included."""
    import argparse

    from aot.cli import build_parser

    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_flag_and_argument_has_help_and_one_right_default():
    import argparse

    for path, parser in _parsers():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help, f"{path} {name} has no help"
            shown = parser._get_formatter()._get_help_string(action).lower()
            # once, where there is a value to say (None and switches may say theirs in words: "default: the method's")
            said = {0, 1} if action.default is None or action.nargs == 0 else {1}
            assert shown.count("default:") in (said if action.option_strings else {0}), f"{path} {name}: {shown}"
            assert "(default: none)" not in shown, f"{path} {name}: {shown}"
    train = dict(_parsers())["aot train"].format_help()
    assert "(default: 10)" in " ".join(train.split()).split("--epochs EPOCHS")[-1].split("--")[0]


def test_version(capsys):
    from aot import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"aot {__version__}\n"


def test_infer_calls_an_ensemble_and_keeps_the_old_flag():
    from aot.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["infer", "--ensemble", "vanilla", "x"]).ensemble == "vanilla"
    assert parser.parse_args(["infer", "--model", "vanilla", "x"]).ensemble == "vanilla"
    assert parser.parse_args(["infer", "x"]).ensemble == "aot"
    assert "--model" not in dict(_parsers(parser))["aot infer"].format_help()


def test_artifact_files_share_one_mode(tasks):
    import stat

    modes = {stat.S_IMODE(path.stat().st_mode) for path in tasks["sentiment"].iterdir()}
    assert len(modes) == 1 and modes.pop() & 0o444 == 0o444 & ~_umask()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_local_server_removes_its_temporary_folder_unless_it_failed(tmp_path):
    from aot.server import LocalServer

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


# --- 8. output: JSON on stdout for scripts, a summary and the next step on stderr for people ------------------------

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


@pytest.mark.parametrize("method,hint", [
    ("fc", "; aot export task --task {out} --repo REPO --name NAME"),
    ("bitfit", " (a bitfit task runs in PyTorch only: aot export task takes fc and kron)"),
])
def test_train_says_where_to_go_next(tmp_path, tiny_models, sentiment_dir, capsys, method, hint):
    out = tmp_path / "t"
    assert main(["train", "--model", str(tiny_models["bert"]), "--data", str(sentiment_dir), "--method", method,
                 "--out", str(out), "--epochs", "1", "--max-train-samples", "32", "--max-length", "16",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    summary, after = captured.err.splitlines()[-2:]
    assert summary == (f"aot: trained sentiment ({method}) into {out}: dev accuracy {result['dev']:.4f} after 2 steps, "
                       f"{result['train_seconds']:.0f} s")
    assert after == f'aot: next: aot predict --task {out} "some text"; aot evaluate --task {out} FILE' + \
        hint.format(out=out)
