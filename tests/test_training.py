"""Training end to end on tiny models: learning, artifacts, fingerprints, the CLI contract."""

import json

import pytest
import torch

from aot.cli import main
from tests.tiny import tiny_backbone
from training.api import train_task
from training.artifact import ArtifactError, FingerprintMismatch, load_task, read_task
from training.backbone import load_backbone
from training.predict import Predictor

FAST = dict(batch_size=16, epochs=8, patience=8, max_length=32, progress=False)


@pytest.mark.parametrize("arch", ["bert", "roberta", "deberta-v2"])
@pytest.mark.parametrize("method", ["fc", "kron"])
def test_aot_learns_synthetic_task(tmp_path, sentiment_dir, tiny_models, method, arch):
    summary = train_task(model=str(tiny_models[arch]), data=str(sentiment_dir), method=method,
                         out=str(tmp_path / "task"), lr=1e-2, **FAST)
    assert summary["dev"] >= 0.9, summary


def test_artifact_round_trip_gives_identical_logits(tmp_path, sentiment_dir, tiny_models):
    out = tmp_path / "task"
    train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="fc", out=str(out), lr=1e-2,
               **{**FAST, "epochs": 2})
    artifact = read_task(out)
    assert artifact.config["format"] == "aot-task" and artifact.config["format_version"] == 1
    assert artifact.config["method"]["method"] == "fc" and artifact.spec.labels == ("negative", "positive")
    assert set(artifact.weights()) == {"body.aot.w1", "body.aot.b1", "body.aot.w2", "body.aot.b2", "head.dense.weight",
                                       "head.dense.bias", "head.out.weight", "head.out.bias"}
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["dev"] <= 1 and metrics["train_seconds"] > 0
    texts = ["good w1 w2", "awful film"]
    a = Predictor.load(out).logits(texts)
    b = Predictor.load(out).logits(texts)
    assert torch.equal(a, b)
    # the artifact reproduces what the in-memory model computed at the end of training
    assert abs(metrics["dev"] - _dev_accuracy(out, sentiment_dir)) < 1e-9


def _dev_accuracy(task, data_dir):
    from training.data import load_task_data

    data = load_task_data(str(data_dir))
    pred = Predictor.load(task).predict([e.text for e in data.dev])
    return sum(p["label"] == e.label for p, e in zip(pred, data.dev)) / len(data.dev)


def test_fingerprint_mismatch_is_refused(tmp_path, sentiment_dir, tiny_models):
    out = tmp_path / "task"
    train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="kron", out=str(out),
               **{**FAST, "epochs": 1})
    other = tiny_backbone("bert", seed=1)  # same shapes, other weights
    with pytest.raises(FingerprintMismatch, match="trained on backbone") as err:
        load_task(out, other)
    assert read_task(out).backbone["fingerprint"] in str(err.value) and other.fingerprint in str(err.value)


def test_fingerprint_ignores_tokenizer_call_state(tiny_models):
    backbone = load_backbone(str(tiny_models["bert"]))
    backbone.tokenizer(["good w1"] * 2, truncation=True, max_length=4, padding="max_length")
    from training.backbone import backbone_fingerprint

    assert backbone_fingerprint(backbone.encoder, backbone.tokenizer) == backbone.fingerprint


def test_failed_write_keeps_old_artifact(tmp_path, sentiment_dir, tiny_models, monkeypatch):
    out = tmp_path / "task"
    train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="fc", out=str(out),
               **{**FAST, "epochs": 1})
    before = (out / "weights.safetensors").read_bytes()
    import training.artifact as artifact_module

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(artifact_module, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="fc", out=str(out),
                   **{**FAST, "epochs": 1, "seed": 3})
    assert (out / "weights.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task"]  # no temporary debris


@pytest.mark.parametrize("broken,message", [
    ({"format": "other"}, "format 'other' is not 'aot-task'"),
    ({"format_version": 99}, "format_version 99 is not supported"),
    ({"task": None}, "key 'task' should be dict"),
])
def test_malformed_artifact(tmp_path, sentiment_dir, tiny_models, broken, message):
    out = tmp_path / "task"
    train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="fc", out=str(out),
               **{**FAST, "epochs": 1})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **broken}))
    with pytest.raises(ArtifactError, match=message):
        read_task(out)


def test_cli_train_predict_inspect(tmp_path, sentiment_dir, tiny_models, capsys):
    out = tmp_path / "cli-task"
    code = main(["train", "--model", str(tiny_models["roberta"]), "--data", str(sentiment_dir), "--method", "fc",
                 "--out", str(out), "--lr", "0.01", "--epochs", "6", "--patience", "6", "--max-length", "32",
                 "--no-progress"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["dev"] >= 0.9 and summary["out"] == str(out)
    assert main(["predict", "--task", str(out), "good w1 w2", "w3 awful w4"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [row["label"] for row in lines] == ["positive", "negative"]
    assert all(len(row["logits"]) == 2 for row in lines)
    assert main(["inspect", "--task", str(out), "--top", "5", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert len(table) == 2 and all(len(layer["tokens"]) == 5 for layer in table)
    # the task learned sentiment words: they dominate the largest rows of some layer
    top = {t["token"] for layer in table for t in layer["tokens"]}
    assert top & {"good", "great", "superb", "lovely", "fine", "bad", "awful", "poor", "dull", "boring"}


@pytest.mark.parametrize("argv,message", [
    (["train", "--model", "/no/such/model", "--data", "rotten_tomatoes", "--method", "fc", "--out", "x"],
     "does not exist|neither an existing folder"),
    (["train", "--model", "minilm", "--data", "/no/such/data", "--method", "fc", "--out", "x"],
     "neither a folder nor a built-in dataset"),
    (["predict", "--task", "/no/such/task", "hello"], "not a task artifact"),
])
def test_cli_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aot: error: ") and len(err.splitlines()) == 1
    import re

    assert re.search(message, err)


def test_cli_rejects_bad_numbers(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "m", "--data", "d", "--method", "fc", "--out", "o", "--rank", "0"])
    assert exit_info.value.code == 2
    assert "expected a positive integer, got 0" in capsys.readouterr().err


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config

    from training.backbone import BackboneError, encoder_from_config

    with pytest.raises(BackboneError, match="unsupported model_type 'gpt2'"):
        encoder_from_config(GPT2Config(n_layer=1, n_embd=8, n_head=2))


def test_same_seed_same_model_whatever_ran_before(tmp_path, sentiment_dir, tiny_models):
    """The method's random init is seeded: the same run gives the same weights after unrelated random draws."""
    kw = dict(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="kron", **{**FAST, "epochs": 1})
    train_task(out=str(tmp_path / "a"), **kw)
    torch.randn(1000)  # unrelated use of the global generator
    train_task(out=str(tmp_path / "b"), **kw)
    from training.artifact import read_task

    a, b = read_task(tmp_path / "a").weights(), read_task(tmp_path / "b").weights()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("labels,logits,expected", [
    (("negative", "positive"), [0.2, 1.5], "positive"),
    (("a", "b", "c"), [3.0, -1.0, 2.0], "a"),
    (None, [0.123456789], "0.123457"),  # regression: the score as text, as the served head returns it
])
def test_one_label_rule_for_predict_and_serving(labels, logits, expected):
    import numpy as np

    from exporter.runtime import ServedTask
    from training.data.task import label_for

    assert label_for(labels, logits) == expected
    served = ServedTask("t", None if labels is None else list(labels), 8, "fused", {})
    assert served.label(np.array(logits, dtype=np.float32)) == expected


def test_infer_input_errors_name_file_and_line(tmp_path, capsys):
    bad = tmp_path / "requests.jsonl"
    bad.write_text('{"task": "t", "text": "fine"}\n{"task": "t"}\n')
    assert main(["infer", "--input", str(bad)]) == 2
    assert f"{bad}:2: expected" in capsys.readouterr().err
