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


def test_builtin_data_keeps_its_problem(capsys):
    assert main(["train", "--model", "/no/model", "--data", "rotten_tomatoes", "--method", "fc", "--out", "/no/out",
                 "--problem", "regression"]) == 2
    assert _one_line_error(capsys) == "aot: error: --problem regression: rotten_tomatoes is a classification task"
