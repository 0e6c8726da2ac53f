"""What the `aot` CLI accepts and refuses: each bad input (a device, a data file as people write it, task.json, a
model name, an --out that exists) is refused in one line that names it, with exit code 2, before anything slow runs."""

from __future__ import annotations

import json
import re

import pytest
import torch

from aot.cli.main import main
from tests.helpers import one_line_error

# --- devices --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,message", [
    pytest.param("gpu", "aot: error: --device 'gpu': expected cpu, cuda (cuda:N) or auto", id="unknown device"),
    pytest.param("cpu:1", "aot: error: --device 'cpu:1': expected cpu, cuda (cuda:N) or auto", id="cpu with an index"),
    pytest.param("cuda", f"aot: error: --device 'cuda': CUDA is not available (this PyTorch {torch.__version__} "
                         "sees no CUDA device); use --device cpu or auto", id="cuda without a GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this PyTorch sees a GPU")),
])
def test_train_device_is_checked_first(tmp_path, capsys, device, message):
    """Refused before the (missing) data and model are looked at."""
    out = tmp_path / "t"
    assert main(["train", "--model", "/no/model", "--data", "/no/data", "--method", "fc", "--out", str(out),
                 "--device", device]) == 2
    assert one_line_error(capsys) == message
    assert not out.exists()


# --- data files as people write them --------------------------------------------------------------------------------

def _folder(root, files: dict[str, str | bytes]):
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (root / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def _train(data, out, *extra) -> list[str]:
    return ["train", "--model", "/no/model", "--data", str(data), "--method", "fc", "--out", str(out), *extra]


DEV = "text,label\nc,x\n"


@pytest.mark.parametrize("files,message", [
    pytest.param({"train.csv": "text;label\na;x\nb;y\n", "dev.csv": DEV},
                 "train.csv: header: found one column 'text;label': is the delimiter ';'? (.csv files are read with "
                 "',', .tsv files with tabs)", id="semicolons"),
    pytest.param({"train.csv": "sentence,label\na,x\nb,y\n", "dev.csv": DEV},
                 "train.csv: header: no column 'text' (columns found: 'sentence', 'label'; expected text, label)",
                 id="wrong column names"),
    pytest.param({"train.csv": "text,label\n", "dev.csv": DEV}, "train.csv has no data rows", id="header only"),
    pytest.param({"train.csv": "text,label\na,x\nb,y\n", "dev.csv": ""}, "dev.csv has no data rows", id="empty"),
    pytest.param({"train.csv": "text,label\na,x\nb,y\n", "dev.jsonl": "\n"}, "dev.jsonl has no data rows",
                 id="empty jsonl"),
])
def test_csv_mistakes_are_named(tmp_path, capsys, files, message):
    """Checked before the (missing) model loads: a header problem is reported as one, not as line 2."""
    data = _folder(tmp_path / "data", files)
    assert main(_train(data, tmp_path / "t")) == 2
    assert one_line_error(capsys) == f"aot: error: {data}/{message}"


def test_extra_csv_fields_are_refused_with_their_line(tmp_path, capsys):
    """Issue 47.1: an unquoted comma made a second field the label (`aot predict` then answered " merci !"); every
    such row is refused with its line, before the (missing) model loads, and nothing is written."""
    rows = ["Très bon service, merci !,positif", '"Refund, please",billing,extra', "Très bon,positif", "Nul,négatif"]
    data = _folder(tmp_path / "data", {"train.csv": "text,label\n" + "\n".join(rows) + "\n",
                                       "dev.csv": "text,label\nBon,positif\n"})
    out = tmp_path / "t"
    assert main(_train(data, out)) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"aot: {data}/train.csv:2: 3 fields where the header names 2 (text, label): an unquoted comma inside a text? "
        '(quote it: "a, b")',
        f"aot: {data}/train.csv:3: 3 fields where the header names 2 (text, label): an unquoted comma inside a text? "
        '(quote it: "a, b")',
        f"aot: error: {data}: 2 bad rows; nothing was read"]
    assert not out.exists()


def test_every_bad_row_is_listed_with_its_cause(tmp_path, capsys):
    """Issue 47.4: the whole data is checked before the model loads, and every bad row is named with its own cause
    (the first 20, then a count): an empty text is not "missing column 'text'", a quote never closed is not
    "missing column 'label'"."""
    good = [f"good text {i},{'pos' if i % 2 else 'neg'}" for i in range(10)]
    empties = [",pos"] * 22  # lines 12-33 of train.csv: empty texts
    train = "text,label\n" + "\n".join(good + empties + ["nice one,pos", '"never closed,neg', "after,pos"]) + "\n"
    dev = '{"text": "fine", "label": "pos"}\n{"text": "", "label": "pos"}\n{"text": "x", "label": "maybe"}\n{oops\n'
    data = _folder(tmp_path / "data", {"train.csv": train, "dev.jsonl": dev})
    assert main(_train(data, tmp_path / "t")) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == f"aot: error: {data}: 26 bad rows (the first 20 listed); nothing was read"
    assert lines[:-1] == [f"aot: {data}/train.csv:{12 + i}: column 'text' is empty" for i in range(20)]
    assert "missing column" not in "\n".join(lines)
    from aot.training.data import DataError, load_task_data

    with pytest.raises(DataError) as caught:
        load_task_data(str(data))
    assert caught.value.total == 26 and caught.value.problems == [line[5:] for line in lines[:-1]]
    few = _folder(tmp_path / "few", {"train.csv": "text,label\na,pos\n,neg\nb,neg\n\"never closed,neg\nc,pos\n",
                                     "dev.jsonl": dev})
    with pytest.raises(DataError) as caught:
        load_task_data(str(few))
    assert caught.value.problems == [
        f"{few}/train.csv:3: column 'text' is empty",
        f"{few}/train.csv:5: a quoted field opened on this line is never closed (it runs to the end of the file, line "
        '6): close its quote, or double each quote inside it ("")',
        f"{few}/dev.jsonl:2: column 'text' is empty",
        f"{few}/dev.jsonl:4: invalid JSON (Expecting property name enclosed in double quotes)",
        f"{few}/dev.jsonl:3: dev label 'maybe' never occurs in train ('neg', 'pos')"]


def test_a_label_seen_once_or_twice_in_a_large_set_is_named(tmp_path, recwarn):
    from aot.training.data import DataWarning, load_task_data

    rows = [f"text {i},{'pos' if i % 2 else 'neg'}" for i in range(120)] + ["text x,neutre"]
    rows[7], rows[9] = "text 7,posit", "text 9,posit"  # lines 9 and 11
    data = _folder(tmp_path, {"train.csv": "text,label\n" + "\n".join(rows) + "\n", "dev.csv": "text,label\nd,pos\n"})
    assert load_task_data(str(data)).spec.labels == ("neg", "neutre", "pos", "posit")
    [warning] = [str(w.message) for w in recwarn if w.category is DataWarning]
    assert warning.startswith(f"2 label(s) of 4 seen at most 2 times in 121 train rows: 'neutre' once "
                              f"({data}/train.csv:122); 'posit' twice ({data}/train.csv:9). A typo")


def test_byte_order_mark_is_skipped(tmp_path):
    from aot.training.data import load_task_data

    bom = "\ufeff".encode()
    data = _folder(tmp_path, {"train.csv": bom + b"text,label\na,x\nb,y\n", "dev.jsonl": bom + b'{"text": "c", '
                              b'"label": "x"}\n', "task.json": bom + b'{"metric": "f1"}'})
    task = load_task_data(str(data))
    assert [e.text for e in task.train] == ["a", "b"] and task.dev[0].label == "x" and task.spec.metric == "f1"


# --- task.json and --problem: classification or regression ----------------------------------------------------------

SCORES = {"train.csv": "text,label\na,1\nb,2.5\nc,4\n", "dev.csv": "text,label\nd,4\n"}


@pytest.mark.parametrize("task_json,message", [
    pytest.param({"metrc": "f1"}, "unknown key 'metrc' (did you mean 'metric'?): expected one of name, labels, metric, "
                 "problem, label_separator", id="misspelt key"),
    pytest.param({"problem": "regresion"}, "problem 'regresion': expected one of classification, regression, "
                 "multilabel, tokens, embedding", id="misspelt problem"),
    pytest.param({"labels": "a,b"}, "labels 'a,b': expected a list of strings", id="labels not a list"),
    pytest.param({"metric": "auc"}, "metric 'auc': expected one of accuracy, f1, acc_f1, mcc, pearson_spearman, "
                 "entity_f1, micro_f1, macro_f1, spearman, recall@1, recall@5, recall@10", id="unknown metric"),
])
def test_task_json_is_checked(tmp_path, capsys, task_json, message):
    data = _folder(tmp_path / "data", {**SCORES, "task.json": json.dumps(task_json)})
    assert main(_train(data, tmp_path / "t")) == 2
    assert one_line_error(capsys) == f"aot: error: {data}/task.json: {message}"


def test_problem_is_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_train(tmp_path, tmp_path / "t", "--problem", "score"))
    assert exit_info.value.code == 2
    assert "argument --problem: invalid choice: 'score'" in capsys.readouterr().err


def test_numeric_labels_warn_and_problem_decides(tmp_path, recwarn):
    from aot.training.data import DataWarning, load_task_data

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
    assert one_line_error(capsys) == "aot: error: --problem regression: rotten_tomatoes is a classification task"


# --- model names ----------------------------------------------------------------------------------------------------

def test_packaged_model_name_ignores_case():
    from aot.training.backbone import canonical_model, resolve_model_path

    assert canonical_model("MiniLM") == "minilm" and resolve_model_path("MiniLM") == resolve_model_path("minilm")


@pytest.mark.parametrize("model,message", [
    pytest.param("minlm", "model 'minlm' is not a folder: did you mean 'minilm' (the packaged all-MiniLM-L6-v2)?",
                 id="typo of the packaged name"),
    pytest.param("someone/no-such-model", "hub model 'someone/no-such-model' is not in the local Hugging Face cache "
                 "and the hub cannot be reached (HF_HUB_OFFLINE is set): pass a local model folder or 'minilm'",
                 id="hub model offline"),
])
def test_model_typo_or_offline_hub_fails_at_once(tmp_path, capsys, model, message):
    import time

    data = _folder(tmp_path / "data", {"train.csv": "text,label\na,x\nb,y\n", "dev.csv": DEV})
    start = time.perf_counter()
    assert main(["train", "--model", model, "--data", str(data), "--method", "fc", "--out", str(tmp_path / "t")]) == 2
    assert time.perf_counter() - start < 5  # no download retries
    assert one_line_error(capsys) == f"aot: error: {message}"


# --- what is there already, what is missing -------------------------------------------------------------------------

def test_train_does_not_replace_an_artifact_unasked(tmp_path, capsys):
    out = tmp_path / "task"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(_train(tmp_path / "data", out)) == 2
    assert one_line_error(capsys) == f"aot: error: --out {out} already exists; pass --overwrite to replace it"
    assert (out / "config.json").read_text() == "{}"


def test_infer_input_needs_a_task(tmp_path, capsys):
    """A line without a task is answered with its error in place (nothing is sent when no line is good)."""
    path = tmp_path / "requests.jsonl"
    path.write_text('{"id": 3, "text": "good"}\n')
    assert main(["infer", "--input", str(path)]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"id": 3, "error": 'line 1: expected {"task": "...", "text": "..."} (or --task '
                                        "for lines without one)", "error_type": "InvalidInput", "status": None,
                                        "retryable": False}
    assert re.fullmatch(r'aot: error: 0 of 1 lines answered, 1 failed \(1 InvalidInput, first line 1: expected '
                        r'\{"task": "\.\.\.", "text": "\.\.\."\} \(or --task for lines without one\)\), 0 retried, '
                        r'[0-9.]+ s, 0 lines/s\n', captured.err), captured.err
