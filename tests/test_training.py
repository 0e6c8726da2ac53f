"""Training end to end on tiny models: learning, artifacts, fingerprints, the CLI contract."""

import json

import numpy as np
import pytest
import torch

from aot.cli.main import main
from aot.serving_torch.encoder import pool_states
from aot.training.api import train_task
from aot.training.artifact import ArtifactError, FingerprintMismatch, read_task
from aot.training.backbone import load_backbone
from aot.training.factory import load_task
from aot.training.predict import Predictor
from tests.tiny import tiny_backbone

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
    assert artifact.config["format"] == "aot-task" and artifact.config["format_version"] == 2
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
    from aot.training.data import load_task_data

    data = load_task_data(str(data_dir))
    pred = Predictor.load(task).predict([e.text for e in data.dev])
    return sum(p["label"] == e.label for p, e in zip(pred, data.dev, strict=True)) / len(data.dev)


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
    from aot.training.backbone import backbone_fingerprint

    assert backbone_fingerprint(backbone.encoder, backbone.tokenizer) == backbone.fingerprint


def test_failed_write_keeps_old_artifact(tmp_path, sentiment_dir, tiny_models, monkeypatch):
    out = tmp_path / "task"
    train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="fc", out=str(out),
               **{**FAST, "epochs": 1})
    before = (out / "weights.safetensors").read_bytes()
    import aot.training.artifact as artifact_module

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
    ({"task": None}, "'task' must be object, got NoneType"),
    ({"pooling": "max"}, "unknown pooling 'max': expected one of cls, mean"),
    ({"head": {"activation": "swish"}}, "head {'activation': 'swish'}: expected"),
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


@pytest.mark.parametrize("flag,value,message", [("--rank", "0", "expected a positive integer, got 0"),
                                                ("--warmup", "1.5", "expected a fraction in [0, 1), got 1.5"),
                                                ("--head-lr", "-1", "expected a positive number, got -1.0"),
                                                ("--pooling", "max", "invalid choice: 'max'")])
def test_cli_rejects_bad_numbers(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "m", "--data", "d", "--method", "fc", "--out", "o", flag, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_method_options_are_trained_with_and_recorded(tmp_path, sentiment_dir, tiny_models, capsys):
    out = tmp_path / "gelu"
    assert main(["train", "--model", str(tiny_models["bert"]), "--data", str(sentiment_dir), "--method", "fc",
                 "--out", str(out), "--option", "activation=gelu", "--option", "dropout=0", "--epochs", "1",
                 "--max-length", "32", "--no-progress"]) == 0
    config = read_task(out).method_config
    assert (config.activation, config.dropout, config.rank) == ("gelu", 0.0, 64)
    _, model, _ = load_task(out, load_backbone(str(tiny_models["bert"])))
    assert isinstance(model.body.aot.act, torch.nn.GELU) and model.body.aot.dropout.p == 0.0


@pytest.mark.parametrize("method,option,message", [
    ("fc", "act=gelu", "fc: unknown option 'act': expected one of: activation, dropout"),
    ("fc", "rank=8", "unknown option 'rank' (set it with --rank)"),
    ("fc", "dropout=high", "fc: option dropout='high': expected float"),
    ("fc", "activation=swish", "unknown activation 'swish'"),
    ("adapter", "train_layer_norms=maybe", "expected bool"),
    ("bitfit", "dropout=0", "bitfit: unknown option 'dropout': expected one of: none"),
    ("lora", "alpha", "option 'alpha': expected NAME=VALUE"),
])
def test_bad_method_option_is_one_line(tmp_path, capsys, method, option, message):
    """Refused before any data or model is read (the paths do not exist), naming the option and what was expected."""
    out = tmp_path / "t"
    assert main(["train", "--model", "/no/model", "--data", "/no/data", "--method", method, "--out", str(out),
                 "--option", option]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aot: error: ") and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_training_guide_lists_every_method_option():
    from pathlib import Path

    from aot.training.method_registry import METHODS, option_types

    guide = Path(__file__).resolve().parents[1].joinpath("docs", "training.md").read_text(encoding="utf-8")
    table = guide[guide.index("Method options:"):].split("\n\n")[1]  # the table after that paragraph
    rows = {line.split("|")[1].strip(" `"): line for line in table.splitlines() if line.startswith("| `")}
    for name in METHODS:
        for option in option_types(name):
            assert f"`{option}`" in rows.get(name, ""), f"docs/training.md's method options table lacks {name} {option}"


def test_the_last_step_is_evaluated(tmp_path, sentiment_dir, tiny_models):
    """Evaluations every 7 steps of a run whose planned steps are not a multiple of 7: the last step is scored too
    (under a decaying rate its weights are often the best)."""
    summary = train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="bitfit",
                         out=str(tmp_path / "t"), **{**FAST, "epochs": 1, "patience": 100}, eval_every=7)
    steps = [h["step"] for h in json.loads((tmp_path / "t" / "metrics.json").read_text())["history"]]
    assert summary["steps"] % 7 != 0, "pick settings whose planned steps are not a multiple of 7"
    assert steps == [*range(7, summary["steps"], 7), summary["steps"]]


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config

    from aot.training.backbone import BackboneError, encoder_from_config

    with pytest.raises(BackboneError, match="unsupported model_type 'gpt2'"):
        encoder_from_config(GPT2Config(n_layer=1, n_embd=8, n_head=2))


def test_same_seed_same_model_whatever_ran_before(tmp_path, sentiment_dir, tiny_models):
    """The method's random init is seeded: the same run gives the same weights after unrelated random draws."""
    kw = dict(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="kron", **{**FAST, "epochs": 1})
    train_task(out=str(tmp_path / "a"), **kw)
    torch.randn(1000)  # unrelated use of the global generator
    train_task(out=str(tmp_path / "b"), **kw)
    from aot.training.artifact import read_task

    a, b = read_task(tmp_path / "a").weights(), read_task(tmp_path / "b").weights()
    assert a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("labels,logits,expected", [
    (("negative", "positive"), [0.2, 1.5], "positive"),
    (("a", "b", "c"), [3.0, -1.0, 2.0], "a"),
    (None, [0.123456789], "0.123457"),  # regression: the score as text, as the served head returns it
])
def test_one_label_rule_for_predict_and_serving(labels, logits, expected):
    import numpy as np

    from aot.serving.answers import label_for
    from aot.serving.tasks import ServedTask

    assert label_for(labels, logits) == expected
    names = None if labels is None else list(labels)
    served = ServedTask(name="t", version="t@1", labels=names, max_length=8, storage="fused", num_layers=1,
                        hidden_size=1, vocab_size=1, head={}, meta={"labels": names})
    assert served.spec.label(served, np.array([logits], dtype=np.float32)).tolist() == [expected.encode()]


def test_infer_input_without_a_server_is_one_error_line(tmp_path, capsys):
    """Bad lines are answered in place by a running server (tests/test_cli_output.py); with none, the stream is
    one clear error, not a line each."""
    bad = tmp_path / "requests.jsonl"
    bad.write_text('{"task": "t", "text": "fine"}\n{"task": "t"}\n')
    assert main(["infer", "--input", str(bad), "--url", "127.0.0.1:9", "--retry-seconds", "2"]) == 2
    waiting, err = capsys.readouterr().err.splitlines()  # said after a second, then the one error
    assert waiting == "aot: waiting for the server at 127.0.0.1:9 (trying for up to 2 s)"
    assert err.startswith("aot: error: cannot reach the server at 127.0.0.1:9")


# --- backbone length limit, damaged artifacts, offline loading -----------------------------------------------------

@pytest.mark.parametrize("arch,expected", [("bert", 72), ("roberta", 70), ("deberta-v2", None)])
def test_max_positions_is_the_real_limit(arch, expected):
    """The tiny configs have max_position_embeddings 72: BERT takes 72, RoBERTa 72 - 2, DeBERTa-v3 style any length."""
    backbone = tiny_backbone(arch)
    assert backbone.max_positions == expected

    def run(n: int) -> None:
        ids = torch.full((1, n), 7)
        backbone.encoder(input_ids=ids, attention_mask=torch.ones_like(ids))

    if expected is None:
        run(200)
        return
    run(expected)
    with pytest.raises((IndexError, RuntimeError)):
        run(expected + 1)


def test_max_positions_of_known_configs():
    from transformers import AutoConfig, XLMRobertaConfig

    from aot.training.backbone import architecture_for, resolve_model_path
    from tests.tiny import tiny_config

    def limit(config):
        return architecture_for(config).max_positions(config)

    assert limit(AutoConfig.from_pretrained(resolve_model_path("minilm"), local_files_only=True)) == 512
    assert limit(XLMRobertaConfig(max_position_embeddings=514, pad_token_id=1)) == 512
    deberta = tiny_config("deberta-v2", vocab_size=100)
    deberta.position_biased_input = True  # DeBERTa (v1-style) absolute positions: a hard limit again
    assert limit(deberta) == 72


@pytest.mark.parametrize("model,max_length,limit", [("roberta", 71, 70), ("minilm", 1024, 512)])
def test_train_refuses_max_length_beyond_backbone(tmp_path, sentiment_dir, tiny_models, capsys, model, max_length,
                                                 limit):
    from pathlib import Path

    path = str(Path(tiny_models[model]).resolve()) if model in tiny_models else model
    out = tmp_path / "task"
    assert main(["train", "--model", path, "--data", str(sentiment_dir), "--method", "fc", "--out", str(out),
                 "--max-length", str(max_length), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (f"aot: error: --max-length {max_length} exceeds what backbone {path} "
                                               f"accepts ({limit} tokens)")
    assert not out.exists()


def test_prompt_methods_use_the_real_position_limit():
    from aot.training.data.task import TaskSpec
    from aot.training.factory import build_task_model
    from aot.training.methods import make_config

    model = build_task_model(tiny_backbone("roberta"), make_config("prompt", rank=4), TaskSpec("t", ("a", "b"), "accuracy"))
    assert model.body.max_input_length == 70 - 4


@pytest.fixture(scope="module")
def trained_task(tmp_path_factory, sentiment_dir, tiny_models):
    out = tmp_path_factory.mktemp("trained") / "task"
    train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="fc", out=str(out),
               **{**FAST, "epochs": 1})
    return out


def _copy_task(task, tmp_path):
    import shutil

    return shutil.copytree(task, tmp_path / "task")


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b[:5], lambda b: b"not safetensors" * 9],
                         ids=["truncated", "header-cut", "garbage"])
def test_damaged_weights_are_one_artifact_error(tmp_path, trained_task, damage):
    task = _copy_task(trained_task, tmp_path)
    weights = task / "weights.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ArtifactError, match="corrupt or truncated weights file") as err:
        load_task(task)
    assert str(err.value).startswith(f"{weights}: ")


def test_cli_damaged_weights_is_one_line(tmp_path, trained_task):
    import os
    import subprocess
    import sys
    from pathlib import Path

    task = _copy_task(trained_task, tmp_path)
    weights = task / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "aot", "predict", "--task", str(task), "good w1"], cwd=root,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aot: error: "), proc.stderr
    assert f"{weights}: corrupt or truncated weights file" in lines[0]
    assert proc.stdout == ""


@pytest.fixture
def no_network(monkeypatch) -> list:
    """Offline mode off (so only our code can keep loading local) and every connection attempt recorded, refused."""
    import socket

    import huggingface_hub.constants

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def _record_backbone(task, model: str) -> None:
    config = json.loads((task / "config.json").read_text())
    config["backbone"]["model"] = model
    (task / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("recorded", ["aot-tests/no-such-model-cached", "/no/such/model/folder"])
def test_recorded_backbone_missing_locally_names_model_option(tmp_path, trained_task, tiny_models, no_network, capsys,
                                                              recorded):
    """A hub id recorded in the artifact is never fetched, even with offline mode off; --model is the way out."""
    task = _copy_task(trained_task, tmp_path)
    _record_backbone(task, recorded)
    with pytest.raises(ArtifactError) as err:
        load_task(task)
    assert str(err.value) == (f"the backbone recorded in task {task}, {recorded!r}, is not available locally "
                              f"(loading a task never downloads); pass --model PATH (the model folder, or a hub id "
                              f"to download it)")
    # the remedy the message names works
    assert main(["predict", "--task", str(task), "--model", str(tiny_models["bert"]), "good w1"]) == 0
    assert json.loads(capsys.readouterr().out)["label"] in ("positive", "negative")
    assert no_network == []


def test_recorded_hub_id_loads_from_the_local_cache(tmp_path, trained_task, tiny_models, no_network, monkeypatch):
    """A cached hub id loads from its snapshot folder, without a request (local_files_only alone still makes one)."""
    import shutil

    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--aot-tests--tiny-bert" / "snapshots" / "abc123"
    shutil.copytree(tiny_models["bert"], snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    task = _copy_task(trained_task, tmp_path)
    _record_backbone(task, "aot-tests/tiny-bert")
    _, _, backbone = load_task(task)
    assert backbone.name == "aot-tests/tiny-bert"
    assert no_network == []


def test_pool_states_mean_ignores_padding():
    from aot.serving_torch.encoder import pool_states

    hidden = torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pooled = pool_states(hidden, mask)
    assert pooled.shape == (2, 2, 4)
    torch.testing.assert_close(pooled[:, 0], hidden[:, 0])  # cls
    torch.testing.assert_close(pooled[0, 1], hidden[0, :3].mean(0))  # the padded positions are left out
    torch.testing.assert_close(pooled[1, 1], hidden[1].mean(0))
    torch.testing.assert_close(pool_states(hidden, None)[:, 1], hidden.mean(1))
    # fp16 states whose sum overflows fp16 (max 65504) while their mean does not: the sum runs in fp32
    large = torch.full((1, 4, 2), 60000.0, dtype=torch.float16)
    pooled = pool_states(large, torch.ones(1, 4, dtype=torch.long))
    assert pooled.dtype == torch.float16 and torch.isfinite(pooled).all() and float(pooled[0, 1, 0]) == 60000.0


def test_pool_states_mean_stays_finite_in_an_fp16_onnx_graph(tmp_path):
    """The exporter's fp16 twin (export_fp16_graph) runs every op in fp16, the mean's sum included: 512 states of
    200 sum to 102,400, past fp16's 65,504, but their mean is 200 and must come out so. ONNX's reference evaluator
    sums fp16 in fp16, as a GPU kernel may (ONNX Runtime's CPU kernel accumulates wider and would hide it)."""
    import onnx
    from onnx.reference import ReferenceEvaluator
    from onnxruntime.transformers.onnx_model import OnnxModel

    from aot.serving_torch.encoder import pool_states

    class Pool(torch.nn.Module):
        def forward(self, hidden, mask):
            return pool_states(hidden, mask)

    path = tmp_path / "pool.onnx"
    hidden, mask = torch.randn(1, 8, 4), torch.ones(1, 8, dtype=torch.long)
    torch.onnx.export(Pool(), (hidden, mask), str(path), input_names=["hidden", "mask"], output_names=["pooled"],
                      dynamic_axes={"hidden": {1: "s"}, "mask": {1: "s"}}, dynamo=False)
    model = OnnxModel(onnx.load(str(path)))
    model.convert_float_to_float16(keep_io_types=True)
    model.save_model_to_file(str(path))
    mask = np.ones((1, 512), dtype=np.int64)
    mask[0, 500:] = 0  # padding left out of the mean
    (pooled,) = ReferenceEvaluator(onnx.load(str(path))).run(
        None, {"hidden": np.full((1, 512, 4), 200.0, dtype=np.float32), "mask": mask})
    # finite, and near 200 (an fp16 running sum of 500 terms of 0.4 rounds by a few per cent; the old sum was inf)
    assert np.isfinite(pooled).all() and np.allclose(pooled[0, 1], 200.0, rtol=5e-2)


@pytest.mark.parametrize("declared,expected", [(None, "cls"), ({"pooling_mode_mean_tokens": True}, "mean"),
                                               ({"pooling_mode_cls_token": True}, "cls"),
                                               ({"pooling_mode_max_tokens": True}, "cls"), ("not json", "cls")])
def test_default_pooling_is_what_the_model_folder_declares(tmp_path, tiny_models, sentiment_dir, declared, expected):
    """A sentence-transformers folder declares its pooling in 1_Pooling/config.json; training takes it unless told,
    records it, and predict reads the same pooled state."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_models["bert"], model)
    if declared is not None:
        (model / "1_Pooling").mkdir()
        text = declared if isinstance(declared, str) else json.dumps(declared)
        (model / "1_Pooling" / "config.json").write_text(text)
    assert load_backbone(str(model)).pooling == expected
    out = tmp_path / "task"
    summary = train_task(model=str(model), data=str(sentiment_dir), method="fc", out=str(out),
                         **{**FAST, "epochs": 1})
    assert summary["pooling"] == expected and read_task(out).pooling == expected
    other = "cls" if expected == "mean" else "mean"
    train_task(model=str(model), data=str(sentiment_dir), method="fc", out=str(tmp_path / "other"), pooling=other,
               **{**FAST, "epochs": 1})
    assert read_task(tmp_path / "other").pooling == other
    _, task_model, _ = load_task(out)
    assert task_model.pooling == expected
    ids, mask = torch.tensor([[2, 7, 9, 3, 0]]), torch.tensor([[1, 1, 1, 1, 0]])
    with torch.no_grad():
        pooled = pool_states(task_model.body(ids, mask), mask)  # the body gives every token's state
        torch.testing.assert_close(task_model.logits(ids, mask), task_model.head(pooled[:, ("cls", "mean").index(expected)]))


def test_artifact_without_pooling_reads_the_first_token(tmp_path, sentiment_dir, tiny_models):
    """Artifacts written before pooling was recorded were trained on the first token."""
    out = tmp_path / "task"
    train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="fc", out=str(out), pooling="cls",
               **{**FAST, "epochs": 1})
    config = json.loads((out / "config.json").read_text())
    before = Predictor.load(out).logits(["good w1"])
    del config["pooling"]
    (out / "config.json").write_text(json.dumps(config))
    assert read_task(out).pooling == "cls"
    torch.testing.assert_close(Predictor.load(out).logits(["good w1"]), before)


@pytest.mark.parametrize("warmup,decay,expected", [
    (0.0, "constant", [1.0] * 10),
    (0.0, "linear", [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]),
    (0.2, "constant", [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    (0.2, "linear", [1 / 3, 2 / 3, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8]),
    # a warm-up that would round to every step still leaves the last one at the full rate
    (0.96, "linear", [k / 10 for k in range(1, 10)] + [1.0]),
])
def test_learning_rate_schedule(warmup, decay, expected):
    from aot.training.trainer import schedule

    assert [schedule(k, 10, warmup, decay) for k in range(10)] == pytest.approx(expected)


def test_head_gets_its_own_learning_rate():
    from aot.training.data.task import TaskSpec
    from aot.training.factory import build_task_model
    from aot.training.methods import make_config
    from aot.training.trainer import TrainConfig, make_optimizer

    model = build_task_model(tiny_backbone("bert"), make_config("fc"), TaskSpec("t", ("a", "b"), "accuracy"))
    groups = make_optimizer(model, TrainConfig(lr=1e-3, head_lr=5e-3)).param_groups
    head = {id(p) for p in model.head.parameters()}
    assert [g["lr"] for g in groups] == [1e-3, 5e-3]
    assert {id(p) for p in groups[1]["params"]} == head
    assert not head & {id(p) for p in groups[0]["params"]}
    assert make_optimizer(model, TrainConfig(lr=1e-3)).param_groups[1]["lr"] == 1e-3


@pytest.mark.parametrize("kw,message", [({"warmup": 1.0}, "warmup must be a fraction"),
                                        ({"decay": "cosine"}, "unknown decay 'cosine'")])
def test_bad_schedule_is_refused(tmp_path, sentiment_dir, tiny_models, kw, message):
    with pytest.raises(ValueError, match=message):
        train_task(model=str(tiny_models["bert"]), data=str(sentiment_dir), method="fc", out=str(tmp_path / "t"),
                   **{**FAST, "epochs": 1}, **kw)
    assert not (tmp_path / "t").exists()
