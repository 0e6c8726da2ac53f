"""Loaders and every bad-input case: the error names the file, the line and the problem."""

import json

import pytest

from aot.training.data import DataError, load_task_data
from aot.training.metrics import compute_metric


def _write(folder, name, text):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "tsv"])
def test_plain_folder_formats(tmp_path, fmt):
    from tests.tiny import write_sentiment_folder

    data = load_task_data(str(write_sentiment_folder(tmp_path / fmt, 20, 10, fmt)))
    assert data.spec.labels == ("negative", "positive")
    assert len(data.train) == 20 and len(data.dev) == 10 and data.test is None
    assert data.train[0].text and data.train[0].label in data.spec.labels


def test_pairs_and_declared_labels(tmp_path):
    rows = [{"text": "a", "text_pair": "b", "label": 1}, {"text": "c", "text_pair": "d", "label": 0}]
    _write(tmp_path, "train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    _write(tmp_path, "dev.jsonl", json.dumps(rows[0]) + "\n")
    _write(tmp_path, "task.json", json.dumps({"labels": ["0", "1", "2"], "metric": "f1"}))
    data = load_task_data(str(tmp_path))
    assert data.spec.has_pair and data.spec.labels == ("0", "1", "2") and data.spec.metric == "f1"
    assert data.train[0].text_pair == "b" and data.train[0].label == "1"


def test_regression_folder(tmp_path):
    _write(tmp_path, "train.csv", "text,label\na,0.5\nb,1.5\n")
    _write(tmp_path, "dev.csv", "text,label\nc,2.0\n")
    _write(tmp_path, "task.json", json.dumps({"problem": "regression"}))
    data = load_task_data(str(tmp_path))
    assert data.spec.is_regression and data.spec.metric == "pearson_spearman"
    assert data.dev[0].label == 2.0


BAD = [
    ("missing column", {"train.jsonl": '{"text": "a", "label": "x"}\n{"text": "b"}\n', "dev.jsonl": '{"text": "a", "label": "x"}\n'},
     r"train.jsonl:2: missing column 'label'"),
    ("missing text", {"train.csv": "text,label\na,x\n,y\n", "dev.csv": "text,label\na,x\n"},
     r"train.csv:3: column 'text' is empty"),
    ("empty split", {"train.jsonl": '{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n', "dev.jsonl": "\n"},
     r"dev.jsonl has no data rows"),
    ("no dev file", {"train.jsonl": '{"text": "a", "label": "x"}\n'}, r"no dev.jsonl, dev.csv or dev.tsv"),
    ("unseen dev label", {"train.jsonl": '{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n',
                          "dev.jsonl": '{"text": "a", "label": "x"}\n{"text": "a", "label": "z"}\n'},
     r"dev.jsonl:2: dev label 'z' never occurs in train"),
    ("label outside declared set", {"train.jsonl": '{"text": "a", "label": "x"}\n{"text": "b", "label": "q"}\n',
                                    "dev.jsonl": '{"text": "a", "label": "x"}\n',
                                    "task.json": '{"labels": ["x", "y"]}'},
     r"train.jsonl:2: train label 'q' is not in the declared label set"),
    ("invalid json", {"train.jsonl": '{"text": "a", "label": "x"}\n{oops\n', "dev.jsonl": '{"text": "a", "label": "x"}\n'},
     r"train.jsonl:2: invalid JSON"),
    ("single label", {"train.jsonl": '{"text": "a", "label": "x"}\n', "dev.jsonl": '{"text": "a", "label": "x"}\n'},
     r"at least 2 labels"),
    ("regression label not a number", {"train.csv": "text,label\na,1.0\nb,high\n", "dev.csv": "text,label\nc,2\n",
                                       "task.json": '{"problem": "regression"}'},
     r"train.csv:3: label 'high' is not a number"),
    ("two train files", {"train.csv": "text,label\na,x\n", "train.jsonl": "", "dev.csv": "text,label\na,x\n"},
     r"several files for split 'train'"),
]


@pytest.mark.parametrize("case,files,message", BAD, ids=[c[0] for c in BAD])
def test_bad_data(tmp_path, case, files, message):
    for name, text in files.items():
        _write(tmp_path, name, text)
    with pytest.raises(DataError, match=message):
        load_task_data(str(tmp_path))


def test_unknown_dataset():
    with pytest.raises(DataError, match="neither a folder nor a built-in dataset"):
        load_task_data("no_such_dataset")


def test_glue_tsv_folder(tmp_path):
    folder = tmp_path / "MRPC"
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    _write(folder, "train.tsv", header + "1\t1\t2\tHe said \"yes\".\tHe agreed.\n0\t3\t4\tIt rains.\tThe cat sat.\n")
    _write(folder, "dev.tsv", header + "1\t5\t6\tA b.\tA b c.\n")
    data = load_task_data(str(folder))
    assert data.spec.metric == "acc_f1" and data.spec.has_pair
    assert data.train[0].text == 'He said "yes".' and data.train[0].text_pair == "He agreed."


def test_glue_cola_has_no_header(tmp_path):
    folder = tmp_path / "CoLA"
    _write(folder, "train.tsv", "gj04\t1\t\tThe dog barked.\ngj04\t0\t*\tDog the barked.\n")
    _write(folder, "dev.tsv", "gj04\t1\t\tA cat.\n")
    data = load_task_data(str(folder))
    assert data.spec.metric == "mcc" and [e.label for e in data.train] == ["1", "0"]


def test_superglue_jsonl_folder(tmp_path):
    folder = tmp_path / "CB"
    rows = [{"premise": "p", "hypothesis": "h", "label": lab, "idx": i}
            for i, lab in enumerate(["entailment", "neutral", "contradiction"])]
    _write(folder, "train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    _write(folder, "val.jsonl", json.dumps(rows[0]) + "\n")
    data = load_task_data(str(folder))
    assert data.spec.metric == "acc_f1" and data.spec.labels == ("contradiction", "entailment", "neutral")


def test_superglue_boolq_boolean_labels(tmp_path):
    folder = tmp_path / "BoolQ"
    rows = [{"question": "q", "passage": "p", "label": True}, {"question": "q2", "passage": "p2", "label": False}]
    _write(folder, "train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    _write(folder, "val.jsonl", json.dumps(rows[0]) + "\n")
    assert [e.label for e in load_task_data(str(folder)).train] == ["true", "false"]


def test_rotten_tomatoes_split_is_fixed():
    a, b = load_task_data("rotten_tomatoes"), load_task_data("rotten_tomatoes")
    assert {k: len(v) for k, v in a.splits.items()} == {"train": 10200, "dev": 1276, "test": 1276}
    assert [e.text for e in a.dev[:5]] == [e.text for e in b.dev[:5]]
    texts = [e.text for s in a.splits.values() for e in s]
    assert len(set(texts)) == len(texts)  # no duplicates, no leakage between splits
    positive = sum(e.label == "positive" for e in a.dev) / len(a.dev)
    assert abs(positive - sum(e.label == "positive" for e in a.train) / len(a.train)) < 0.01  # stratified


@pytest.mark.parametrize("metric,pred,gold,n,expected", [
    ("accuracy", [0, 1, 1, 0], [0, 1, 0, 0], 2, 0.75),
    ("f1", [0, 1, 1, 0], [0, 1, 0, 0], 2, 2 / 3),
    ("acc_f1", [0, 1, 1, 0], [0, 1, 0, 0], 2, (0.75 + 2 / 3) / 2),
    ("mcc", [0, 1, 1, 0], [0, 1, 1, 0], 2, 1.0),
    ("pearson_spearman", [1.0, 2.0, 3.0], [2.0, 4.0, 6.0], 1, 1.0),
    ("f1", [0, 1, 2, 2], [0, 1, 2, 1], 3, (1 + 2 / 3 + 2 / 3) / 3),
])
def test_metrics(metric, pred, gold, n, expected):
    assert compute_metric(metric, pred, gold, n) == pytest.approx(expected)
