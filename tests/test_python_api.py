"""The PEFT-shaped Python API (aot.AotConfig, get_aot_model, AotModel, MultiTaskModel) and `aot predict --input`.

One table of cases (architecture x model class x method) runs through shared checks, as PEFT's tests do.
"""

from __future__ import annotations

import io
import json
import re
import sys

import numpy as np
import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    GPT2Config,
    GPT2Model,
    Trainer,
    TrainingArguments,
)
from transformers.modeling_outputs import SequenceClassifierOutput

from aot import AotConfig, AotModel, MultiTaskModel, get_aot_model
from aot.cli.main import main
from aot.serving_torch.encoder import pool_states
from aot.training.artifact import read_task
from tests.tiny import ARCHS, sentiment_examples, tiny_tokenizer

CLASSES = {"auto": AutoModel, "seqcls": AutoModelForSequenceClassification}
CASES = [(arch, kind, method) for arch in ARCHS for kind in CLASSES for method in ("fc", "kron")]
IDS = [f"{arch}-{kind}-{method}" for arch, kind, method in CASES]
LABELS = ["negative", "positive"]


def load(folder, kind: str, seed: int = 0, **kwargs):
    """A tiny model from its folder as a user loads one (eager attention: what export and serving run)."""
    torch.manual_seed(seed)  # a sequence classifier's head is new: random
    return CLASSES[kind].from_pretrained(folder, attn_implementation="eager", **kwargs).eval()


def aot_model(tiny_models, arch, kind, method, seed=0, **config) -> tuple:
    base = load(tiny_models[arch], kind, seed, **({"num_labels": 2} if kind == "seqcls" else {}))
    config = AotConfig(method=method, rank=4, labels=LABELS, max_length=32, **config)
    return base, get_aot_model(base, config)


def batch(arch, texts=("good w1 w2", "w3 awful w4 w5 w6", "the movie", "superb")):
    out = tiny_tokenizer(arch)(list(texts), padding=True, return_tensors="pt")
    return dict(out)


def perturb(model: AotModel, seed: int = 1, scale: float = 0.3) -> AotModel:
    """Trained-looking factors (P is zero at init, which would hide a lost or misplaced row)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * scale)
    return model.eval()


@pytest.mark.parametrize("arch,kind,method", CASES, ids=IDS)
def test_untrained_equals_frozen_model(tiny_models, arch, kind, method):
    base, model = aot_model(tiny_models, arch, kind, method)
    inputs = batch(arch)
    out = model.eval()(**inputs)
    assert isinstance(out, SequenceClassifierOutput) and out.loss is None
    with torch.no_grad():
        if kind == "seqcls":  # its own head, served format: bit for bit what the model computes
            expected = base(**inputs).logits
        else:
            hidden = base(**inputs).last_hidden_state
            expected = model.head(pool_states(hidden, inputs["attention_mask"])[:, model.row])
    assert torch.equal(out.logits, expected)


@pytest.mark.parametrize("arch,kind,method", CASES, ids=IDS)
def test_only_factors_and_head_train(tiny_models, arch, kind, method, capsys):
    base, model = aot_model(tiny_models, arch, kind, method)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    prefix = {"fc": "body.aot.w", "kron": "body.aot.w_"}[method]
    assert trainable == {n for n in trainable if n.startswith(("body.aot.", "head."))}
    assert any(n.startswith(prefix) for n in trainable) and {"head.dense.weight", "head.out.weight"} <= trainable
    assert not any(p.requires_grad for p in model.base_model.parameters())
    count, total = model.get_nb_trainable_parameters()
    model.print_trainable_parameters()
    assert capsys.readouterr().out.strip() == (f"trainable params: {count:,d} || all params: {total:,d} || "
                                                f"trainable%: {100 * count / total:.4f}")
    assert count == sum(model.state_dict()[n].numel() for n in trainable)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, arch, n, seed):
        rows = sentiment_examples(n, seed)
        self.items = [dict(tiny_tokenizer(arch)(r["text"], truncation=True, max_length=32),
                           labels=LABELS.index(r["label"])) for r in rows]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _loss(model, arch, examples) -> float:
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tiny_tokenizer(arch))
    model.eval()
    with torch.no_grad():
        return float(model(**collate(examples.items)).loss)


@pytest.mark.parametrize("arch,kind,method", CASES, ids=IDS)
def test_trainer_steps_lower_the_loss_and_save_round_trips(tiny_models, tmp_path, arch, kind, method):
    from transformers import DataCollatorWithPadding

    _, model = aot_model(tiny_models, arch, kind, method)
    dev = _Rows(arch, 64, 2)
    before = _loss(model, arch, dev)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=100, per_device_train_batch_size=16,
                             learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             logging_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=_Rows(arch, 400, 1),
            data_collator=DataCollatorWithPadding(tiny_tokenizer(arch))).train()
    after = _loss(model, arch, dev)
    assert after < 0.95 * before, (before, after)  # the slowest case, DeBERTa-v2 + new head + FC: 0.937

    model.save_pretrained(tmp_path / "task")
    artifact = read_task(tmp_path / "task")
    assert artifact.spec.labels == tuple(LABELS) and artifact.max_length == 32
    assert artifact.head["activation"] == ("gelu" if arch == "deberta-v2" and kind == "seqcls" else "tanh")
    loaded = AotModel.from_pretrained(tmp_path / "task")
    inputs = batch(arch)
    torch.testing.assert_close(loaded(**inputs).logits, model.eval()(**inputs).logits, atol=1e-6, rtol=0)


def test_plain_loop_trains_and_labels_give_the_loss(tiny_models):
    _, model = aot_model(tiny_models, "bert", "auto", "fc")
    data = _Rows("bert", 64, 1)
    from transformers import DataCollatorWithPadding

    inputs = DataCollatorWithPadding(tiny_tokenizer("bert"))(data.items)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(20):
        loss = model(**inputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    logits = model.eval()(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    expected = torch.nn.functional.cross_entropy(logits, inputs["labels"])
    torch.testing.assert_close(model(**inputs).loss, expected)


def test_aot_train_builds_the_same_model(tiny_models, sentiment_dir, tmp_path):
    """aot train's artifact loads as an AotModel, its config as get_aot_model's would be."""
    from tests.helpers import train_tiny_task

    task = train_tiny_task(tiny_models["roberta"], sentiment_dir, tmp_path / "t", "kron", epochs=1)
    model = AotModel.from_pretrained(task)
    assert isinstance(model, AotModel) and model.aot_config.method == "kron" and model.aot_config.max_length == 32
    assert model.aot_config.a * model.aot_config.b >= model.body.embeddings.shape[0]


def test_version_1_artifacts_still_load(tiny_models, tmp_path):
    _, model = aot_model(tiny_models, "bert", "auto", "fc")
    perturb(model).save_pretrained(tmp_path / "v2")
    config = json.loads((tmp_path / "v2" / "config.json").read_text())
    del config["head"]
    config["format_version"] = 1
    (tmp_path / "v2" / "config.json").write_text(json.dumps(config))
    inputs = batch("bert")
    torch.testing.assert_close(AotModel.from_pretrained(tmp_path / "v2")(**inputs).logits, model(**inputs).logits,
                               atol=1e-6, rtol=0)


def test_every_config_field_carries_its_help():
    import dataclasses

    helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(AotConfig)}
    assert set(helps) >= {"method", "rank", "labels", "max_length", "base_model_name_or_path"}
    assert all(len(text) > 20 for text in helps.values()), helps


def _gpt2():
    return GPT2Model(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20))


@pytest.mark.parametrize("build,config,message", [
    ("seqcls", AotConfig(method="lora"), r"unknown method 'lora': expected one of fc, kron"),
    ("seqcls", AotConfig(rank=0), r"rank must be a positive integer, got 0"),
    ("seqcls", AotConfig(method="kron", activation="gelu"), r"activation='gelu' applies to fc only"),
    ("seqcls", AotConfig(a=10), r"a=10 applies to kron only"),
    ("seqcls", AotConfig(method="kron", a=2, b=2), r"a \* b = 2 \* 2 = 4 < vocabulary size"),
    ("seqcls", AotConfig(activation="swish"), r"unknown activation 'swish'"),
    ("seqcls", AotConfig(dropout=1.5), r"dropout must be in \[0, 1\), got 1.5"),
    ("seqcls", AotConfig(pooling="mean"), r"pooling='mean', but .*own head reads the first token"),
    ("auto", AotConfig(pooling="max"), r"unknown pooling 'max'"),
    ("seqcls", AotConfig(num_labels=3), r"num_labels=3, but the model's head has 2 outputs"),
    ("auto", AotConfig(labels=["a", "b", "c"], num_labels=2), r"3 labels .* for a head with 2 outputs"),
    ("auto", AotConfig(max_length=500), r"max_length 500 is outside what the encoder accepts \(1 to 72 tokens\)"),
    ("masked", AotConfig(), r"AutoModelForTokenClassification, got BertForMaskedLM"),
    ("linear", AotConfig(), r"takes a transformers model .* got Linear"),
    ("gpt2", AotConfig(), r"unsupported model_type 'gpt2'"),
])
def test_bad_configs_are_refused_with_one_line(tiny_models, build, config, message):
    folder = tiny_models["bert"]
    model = {"seqcls": lambda: load(folder, "seqcls"), "auto": lambda: load(folder, "auto"),
             "masked": lambda: AutoModelForMaskedLM.from_pretrained(folder), "linear": lambda: torch.nn.Linear(2, 2),
             "gpt2": _gpt2}[build]()
    with pytest.raises(ValueError) as info:
        get_aot_model(model, config)
    assert re.search(message, str(info.value)) and "\n" not in str(info.value)


def test_save_refuses_a_changed_encoder(tiny_models, tmp_path):
    base, model = aot_model(tiny_models, "bert", "auto", "fc")
    with torch.no_grad():
        base.encoder.layer[0].output.dense.bias.add_(1.0)
    with pytest.raises(ValueError, match=r"weight 'encoder.layer.0.output.dense.bias' differs from base model"):
        model.save_pretrained(tmp_path / "t")
    assert not (tmp_path / "t").exists()


# --- many tasks ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_tasks(tiny_models, tmp_path_factory):
    """Three BERT tasks of different methods, heads, poolings and label counts."""
    root = tmp_path_factory.mktemp("tasks")
    specs = {"sent": ("seqcls", "fc", {}), "topic": ("auto", "kron", {"labels": ["x", "y", "z"], "num_labels": 3}),
             "mean": ("auto", "fc", {"pooling": "mean"}), "score": ("auto", "fc", {"labels": None, "num_labels": 1})}
    out = {}
    for i, (name, (kind, method, extra)) in enumerate(specs.items()):
        base = load(tiny_models["bert"], kind, seed=i, **({"num_labels": 2} if kind == "seqcls" else {}))
        config = AotConfig(method=method, rank=4, max_length=32, task_name=name, **{"labels": LABELS, **extra})
        perturb(get_aot_model(base, config), seed=i).save_pretrained(root / name)
        out[name] = root / name
    return out


TEXTS = ["good w1 w2", "w3 awful w4 w5 w6", "the movie", "superb", "w9 " * 40, "dull plot w7"]


def test_multitask_mixed_batch_equals_each_task_alone(saved_tasks):
    multi = MultiTaskModel.from_pretrained(saved_tasks)
    names = list(saved_tasks)
    mixed_names = [names[i % len(names)] for i in range(len(TEXTS))]
    mixed = multi.predict(TEXTS, mixed_names)
    for name, path in saved_tasks.items():
        alone = AotModel.from_pretrained(path)
        rows = [i for i, n in enumerate(mixed_names) if n == name]
        single = multi.predict([TEXTS[i] for i in rows], [name] * len(rows))
        tokenizer = multi.backbone.tokenizer
        for k, i in enumerate(rows):
            inputs = tokenizer(TEXTS[i], truncation=True, max_length=32, return_tensors="pt")
            expected = alone(**inputs).logits[0]
            for answer in (mixed[i], single[k]):  # a regression task answers its score (aot.serving.answers.answer)
                assert answer["task"] == name
                got = [answer["score"]] if name == "score" else answer["logits"]
                # MultiTaskModel holds each task's rows in fp16, as the server does (its answers equal the served
                # ones: tests/test_kinds_served.py); the task alone computes them in fp32
                torch.testing.assert_close(torch.tensor(got), expected, atol=3e-3, rtol=0)
            assert ("probabilities" in mixed[i]) == (name != "score")
    logits = multi(**_padded(multi, TEXTS[:4]), task_names=["topic", "sent", "score", "topic"]).logits
    assert logits.shape == (4, 3) and torch.isinf(logits[1, 2]) and torch.isinf(logits[2, 1:]).all()
    multi.remove_task("topic")
    with pytest.raises(ValueError, match="unknown task 'topic'; loaded: sent, mean, score"):
        multi.predict(["good"], ["topic"])
    multi.add_task("topic2", saved_tasks["topic"])
    assert multi.task_names == ["sent", "mean", "score", "topic2"]
    with pytest.raises(ValueError, match="already loaded"):
        multi.add_task("sent", saved_tasks["sent"])


def _padded(multi, texts):
    out = multi.backbone.tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
    return dict(out)


def test_multitask_refuses_another_backbone(saved_tasks, tiny_models, tmp_path):
    _, other = aot_model(tiny_models, "roberta", "auto", "fc")
    other.save_pretrained(tmp_path / "roberta-task")
    multi = MultiTaskModel.from_pretrained({"sent": saved_tasks["sent"]})
    with pytest.raises(ValueError, match="was trained on backbone"):
        multi.add_task("r", tmp_path / "roberta-task")


# --- aot predict ----------------------------------------------------------------------------------------------------

def _predict(argv, capsys, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8"))))
    capsys.readouterr()  # what the test wrote before (a library's progress bar, when no main() silenced it yet)
    code = main(["predict", *argv, "--no-progress"])  # its bar: tests/test_cli_answers.py
    captured = capsys.readouterr()
    return code, [json.loads(line) for line in captured.out.splitlines()], captured.err.strip().splitlines()


def test_predict_jsonl_mixes_tasks(saved_tasks, tmp_path, capsys, monkeypatch):
    tasks = [f"{n}={p}" for n, p in saved_tasks.items()]
    lines = [{"text": t, "task": n, "id": i} for i, (t, n) in enumerate(zip(TEXTS, ["sent", "topic", "mean",
                                                                                      "score", "sent", "topic"], strict=True))]
    raw = [json.dumps(line) for line in lines]
    raw.insert(2, "{not json")
    raw.insert(4, json.dumps({"text": "good", "task": "nope"}))
    raw.insert(5, "")
    (tmp_path / "in.jsonl").write_text("\n".join(raw) + "\n")
    code, out, err = _predict([*sum((["--task", t] for t in tasks), []), "--input", str(tmp_path / "in.jsonl")],
                              capsys)
    assert code == 0 and [row["id"] for row in out] == list(range(len(lines)))
    expected = MultiTaskModel.from_pretrained(saved_tasks).predict(TEXTS, [line["task"] for line in lines])
    for row, want in zip(out, expected, strict=True):
        assert {k: v for k, v in row.items() if k != "id"}.keys() == want.keys()
        if "score" in want:  # the regression task
            assert row["score"] == pytest.approx(want["score"], abs=1e-6)
        else:
            assert row["label"] == want["label"] and row["logits"] == pytest.approx(want["logits"], abs=1e-6)
    assert "probabilities" not in out[3] and sum(out[1]["probabilities"]) == pytest.approx(1.0)
    assert err == ["aot: line 3: invalid JSON (Expecting property name enclosed in double quotes)",
                   "aot: line 5: unknown task 'nope': expected one of sent, topic, mean, score",
                   "aot: 2 of 8 lines failed"]


def test_predict_reads_stdin_with_a_default_task(saved_tasks, capsys, monkeypatch):
    stdin = json.dumps({"text": "good w1"}) + "\n" + json.dumps({"text": "awful w3"}) + "\n"
    code, out, err = _predict(["--task", str(saved_tasks["sent"]), "--input", "-"], capsys, stdin, monkeypatch)
    assert code == 0 and err == [] and [row["task"] for row in out] == ["sent", "sent"]
    code, positional, _ = _predict(["--task", str(saved_tasks["sent"]), "good w1"], capsys)
    assert positional[0]["label"] == out[0]["label"]
    assert positional[0]["logits"] == pytest.approx(out[0]["logits"], abs=1e-6)  # batched with a longer line


def test_predict_refuses_each_line_the_server_refuses(saved_tasks, tiny_models, tmp_path, capsys, monkeypatch):
    """A blank text, a pair sent to a task trained on single texts and a single text sent to a pair task
    (AotConfig.text_pairs, recorded as the artifact's has_pair, which the server checks) each fail alone, for the
    server's reasons; a blank pair counts as none, as served."""
    base = load(tiny_models["bert"], "auto", seed=7)
    config = AotConfig(method="fc", rank=4, max_length=32, task_name="nli", labels=LABELS, text_pairs=True)
    get_aot_model(base, config).save_pretrained(tmp_path / "nli")
    assert read_task(tmp_path / "nli").spec.has_pair and not read_task(saved_tasks["sent"]).spec.has_pair
    lines = [{"text": "good w1", "task": "sent", "text_pair": "w2"}, {"text": " \u200b\t", "task": "sent"},
             {"text": "good w1", "task": "nli"}, {"text": "good w1", "task": "nli", "text_pair": "w2"},
             {"text": "good w1", "task": "sent", "text_pair": " "}]
    stdin = "".join(json.dumps(line) + "\n" for line in lines)
    code, out, err = _predict(["--task", f"sent={saved_tasks['sent']}", "--task", f"nli={tmp_path / 'nli'}",
                               "--input", "-"], capsys, stdin, monkeypatch)
    assert code == 0 and [row["task"] for row in out] == ["nli", "sent"]
    assert err == ["aot: line 1: task 'sent' was trained on single texts: give no text_pair",
                   "aot: line 2: text is empty (or only whitespace, control or zero-width characters)",
                   "aot: line 3: task 'nli' was trained on text pairs: give text_pair too",
                   "aot: 3 of 5 lines failed"]
    code, positional, err = _predict(["--task", str(tmp_path / "nli"), "good w1", "--pair", "w2"], capsys)
    assert code == 0 and err == [] and positional[0]["logits"] == pytest.approx(out[0]["logits"], abs=1e-6)
    with pytest.raises(ValueError, match="text_pairs applies to classification, regression and multilabel"):
        get_aot_model(load(tiny_models["bert"], "auto"), AotConfig(problem="embedding", text_pairs=True))


@pytest.mark.parametrize("stdin,argv,message", [
    ('{"text": 3}\n[1]\n', ["--task", "TASK"], "aot: line 1: expected \"text\", a string"),
    ('{"text": "good"}\n', ["--task", "a=TASK", "--task", "b=TASK"], "aot: line 1: no \"task\""),
])
def test_predict_fails_only_when_every_line_failed(saved_tasks, capsys, monkeypatch, stdin, argv, message):
    argv = [a.replace("TASK", str(saved_tasks["sent"])) for a in argv]
    code, out, err = _predict([*argv, "--input", "-"], capsys, stdin, monkeypatch)
    assert code == 2 and out == [] and err[0].startswith(message)
    assert err[-1].startswith("aot: error: every input line failed")


# --- export and serve ---------------------------------------------------------------------------------------------

@pytest.mark.server
def test_saved_task_exports_and_serves_what_predict_answers(tiny_models, tmp_path, capsys):
    """A DeBERTa-v2 classifier's own head (gelu) trained through get_aot_model: served as `aot predict` answers."""
    from aot.client.client import Client
    from aot.local.server import LocalServer
    from tests.helpers import make_repository

    _, model = aot_model(tiny_models, "deberta-v2", "seqcls", "fc", seed=1)  # a head that answers both labels
    perturb(model, scale=0.1).save_pretrained(tmp_path / "task")  # fp16 rows: logits of a few units, as trained
    repo = make_repository(tiny_models["deberta-v2"], tmp_path / "repo",
                           {"fused": (tmp_path / "task", "fused"), "factored": (tmp_path / "task", "factored")})
    code, predicted, _ = _predict(["--task", str(tmp_path / "task"), *TEXTS], capsys)
    assert code == 0 and len({row["label"] for row in predicted}) == 2  # both labels occur: the check can fail
    server = LocalServer(repo).start()
    try:
        with Client(server.grpc_url) as client:
            for name in ("fused", "factored"):
                for text, row in zip(TEXTS, predicted, strict=True):
                    got = client.infer(name, text)
                    np.testing.assert_allclose(got["logits"], row["logits"], atol=1e-3)
                    assert got["label"] == row["label"]
    finally:
        server.stop()


def test_predict_runs_a_baseline_task_alone(tiny_models, sentiment_dir, saved_tasks, tmp_path, capsys, monkeypatch):
    from tests.helpers import train_tiny_task

    task = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path / "bitfit", "bitfit", epochs=1)
    capsys.readouterr()  # what training printed
    stdin = json.dumps({"text": "good w1", "id": "a"}) + "\n" + json.dumps({"text": "w2 w3"}) + "\n"
    code, out, err = _predict(["--task", str(task), "--input", "-"], capsys, stdin, monkeypatch)
    assert code == 0 and err == [] and out[0]["id"] == "a" and [row["task"] for row in out] == ["bitfit"] * 2
    code, out, err = _predict(["--task", str(task), "--task", str(saved_tasks["sent"]), "--input", "-"], capsys,
                              json.dumps({"text": "good", "task": "sent"}) + "\n", monkeypatch)
    assert code == 2 and err == ["aot: error: task 'bitfit' was trained with method 'bitfit', which changes the "
                                 "encoder: several tasks run together only if all are AoT (fc, kron); give it alone"]


@pytest.mark.parametrize("activation", [None, "tanh", "gelu", "swish"])
def test_served_head_computes_the_training_head(tmp_path, activation):
    """aot.serving.tasks (numpy) against aot.training.model.ClassificationHead (torch), with a head wider than d as
    DeBERTa-v2's pooler may be; an unknown activation fails that version alone, naming it."""
    from safetensors.numpy import save_file

    from aot.serving.heads import pooled_logits
    from aot.serving.store.reader import StoreError
    from aot.serving.tasks import load_task_version
    from aot.training.model import ClassificationHead

    torch.manual_seed(0)
    head = ClassificationHead(4, 3, activation=activation if activation in ("tanh", "gelu") else "tanh",
                              inner_size=6).eval()
    folder = tmp_path / "t@0123456789ab"
    folder.mkdir()
    meta = {"labels": ["a", "b", "c"], "max_length": 8, "storage": "fused", "method": {"method": "fc"},
            "num_layers": 1, "hidden_size": 4, "vocab_size": 5, "pooling": "mean",
            **({} if activation is None else {"head_activation": activation})}
    (folder / "task.json").write_text(json.dumps(meta))
    save_file({k: v.numpy() for k, v in head.state_dict().items()}, str(folder / "head.safetensors"))
    if activation == "swish":
        with pytest.raises(StoreError, match="unknown head_activation 'swish': expected one of tanh, gelu"):
            load_task_version(folder, folder.name, tmp_path, parts="head")
        return
    pooled = torch.randn(5, 2, 4) * 3
    served = pooled_logits(load_task_version(folder, folder.name, tmp_path, parts="head"), pooled.numpy())
    np.testing.assert_allclose(served, head(pooled[:, 1]).detach().numpy(), atol=1e-6)
