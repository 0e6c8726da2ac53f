"""Issue 55: many tasks trained in one job on one frozen encoder (`aot train --tasks MANIFEST --out DIR`,
aot.training.job.train_tasks): a task of a job learns exactly what it learns alone, whatever it shares its passes
with (its own random stream, the encoder's dropout drawn as it would alone); every kind shares a job and is exported
and served as a solo artifact is; a bad task is refused alone and a diverging one stops alone; a killed job resumes;
two torchrun ranks share a manifest out."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from aot.training.api import train_task
from aot.training.job import _Job, train_tasks
from aot.training.job_state import STATE_DIR
from tests.helpers import make_repository, run_cli, serve_for_tests
from tests.tiny import FILLER, POSITIVE, tiny_config, tiny_tokenizer, write_kind_folder

QUICK = dict(batch_size=16, max_length=32, lr=3e-3)
ROOT = Path(__file__).resolve().parent.parent


def _write(folder: Path, rows: dict[str, list[dict]], task: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, items in rows.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    if task:
        (folder / "task.json").write_text(json.dumps(task))
    return folder


def _scores(n: int, seed: int, scale: float = 1.0) -> list[dict]:
    """Regression rows: the score is how many positive words the text holds (0 to 3)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words, k = rng.sample(FILLER, rng.randint(3, 6)), rng.randint(0, 3)
        for word in rng.sample(POSITIVE, k):
            words.insert(rng.randint(0, len(words)), word)
        rows.append({"text": " ".join(words), "label": scale * k})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory, sentiment_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("many-data")
    return {"classification": sentiment_dir,
            "regression": _write(root / "scores", {"train": _scores(320, 1), "dev": _scores(80, 2)},
                                 {"problem": "regression"}),
            **{kind: write_kind_folder(root / kind, kind) for kind in ("multilabel", "tokens", "embedding")}}


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory) -> Path:
    """A tiny BERT whose encoder drops out (0.1) as real ones do: a task's masks must be its own in a shared pass."""
    from aot.training.backbone import encoder_from_config

    folder = tmp_path_factory.mktemp("dropout-bert")
    tokenizer = tiny_tokenizer("bert")
    config = tiny_config("bert", len(tokenizer))
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.1
    torch.manual_seed(0)
    encoder_from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _spec(name: str, kind: str, data: dict, method: str = "fc", seed: int = 0, **kw) -> dict:
    return {"name": name, "data": str(data[kind]), "method": method, "seed": seed,
            **({} if kind == "classification" else {"problem": kind}), **kw}


def _solo(model: Path, spec: dict, out: Path, **common) -> Path:
    options = {k: v for k, v in spec.items() if k != "name"}
    train_task(str(model), out=str(out), progress=False, **{**common, **options})
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "weights.safetensors")


def _same_training(job: Path, solo: Path, exact: bool) -> None:
    """The same artifact but for the clocks: weights (bit for bit, or within float rounding), config, metrics."""
    a, b = _weights(job), _weights(solo)
    assert a.keys() == b.keys() and a
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], atol=2e-5, rtol=1e-4)
    configs = [json.loads((p / "config.json").read_text()) for p in (job, solo)]
    for config in configs:
        del config["training"]["started"]
    assert configs[0] == configs[1]
    metrics = [json.loads((p / "metrics.json").read_text()) for p in (job, solo)]
    for m in metrics:
        m.pop("train_seconds")
        for h in m["history"]:
            h.pop("seconds")
            h.pop("loss")
    if exact:
        assert metrics[0] == metrics[1]
    else:
        assert metrics[0]["dev"] == pytest.approx(metrics[1]["dev"], abs=1e-3)
        assert [h["step"] for h in metrics[0]["history"]] == [h["step"] for h in metrics[1]["history"]]


def test_a_manifest_of_one_task_trains_exactly_as_alone(tmp_path, dropout_model, data):
    """The command's defaults and the line's options laid over them: bit for bit the solo run's artifact, the
    encoder's dropout included."""
    manifest = tmp_path / "tasks.jsonl"
    manifest.write_text(json.dumps({"name": "sent", "data": str(data["classification"]), "seed": 3,
                                    "max-length": 32, "option": ["activation=gelu"]}) + "\n")
    lines, err = run_cli("train", "--tasks", str(manifest), "--out", str(tmp_path / "job"), "--model",
                         str(dropout_model), "--epochs", "2", "--eval-every", "7", "--lr", "3e-3", "--no-progress")
    assert [(r["name"], r["status"]) for r in lines] == [("sent", "trained")]
    assert "trained 1 of 1 task(s)" in err and f"--batch {tmp_path / 'job' / STATE_DIR / 'export.jsonl'}" in err
    solo = _solo(dropout_model, {"data": str(data["classification"]), "method": "fc", "seed": 3,
                                 "options": {"activation": "gelu"}},
                 tmp_path / "solo", epochs=2, eval_every=7, **QUICK)
    _same_training(tmp_path / "job" / "sent", solo, exact=True)


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory, tiny_models, data) -> dict:
    """One job of a task of each kind (FC and Kron), four sharing each step, and each task trained alone."""
    root = tmp_path_factory.mktemp("every-kind")
    specs = [_spec(kind, kind, data, method, seed) for seed, (kind, method) in enumerate(
        (("classification", "fc"), ("regression", "kron"), ("multilabel", "fc"), ("tokens", "fc"),
         ("embedding", "kron")))]
    common = dict(epochs=4, eval_every=10, **QUICK)
    results = train_tasks(specs, root / "job", str(tiny_models["bert"]), progress=False, **common)
    return {"specs": specs, "results": results, "job": root / "job",
            "solo": {s["name"]: _solo(tiny_models["bert"], s, root / "solo" / s["name"], **common) for s in specs}}


def test_every_kind_shares_a_job_and_learns_as_alone(every_kind):
    results = {r["name"]: r for r in every_kind["results"]}
    assert [r["status"] for r in every_kind["results"]] == ["trained"] * 5
    floors = {"classification": 0.9, "regression": 0.7, "multilabel": 0.65, "tokens": 0.8, "embedding": 0.3}
    for name, floor in floors.items():
        assert results[name]["dev"] > floor, (name, results[name]["dev"])
        _same_training(every_kind["job"] / name, every_kind["solo"][name], exact=False)
    export = [json.loads(line) for line in (every_kind["job"] / STATE_DIR / "export.jsonl").read_text().splitlines()]
    assert sorted(e["name"] for e in export) == sorted(floors)


@pytest.fixture(scope="module")
def served(request, tmp_path_factory, tiny_models, every_kind):
    """The job's tasks published at once (`aot export task --batch` of the job's export.jsonl) and served."""
    repo = make_repository(tiny_models["bert"], tmp_path_factory.mktemp("many-repo") / "repo", {})
    run_cli("export", "task", "--repo", str(repo), "--batch", str(every_kind["job"] / STATE_DIR / "export.jsonl"),
            "--no-progress")
    yield from serve_for_tests(request, repo)


@pytest.mark.server
def test_a_job_s_tasks_export_and_serve_as_solo_artifacts(served, every_kind):
    """The server answers each of the job's tasks as `aot predict` does with its artifact."""
    from aot.client.client import Client

    texts = ["good w1 bad movie", "w3 superb! w4"]
    with Client(served.grpc_url) as client:
        for spec in every_kind["specs"]:
            name = spec["name"]
            want, _ = run_cli("predict", "--task", str(every_kind["job"] / name), *texts)
            for text, expected in zip(texts, want, strict=True):
                got = client.infer(name, text)
                assert set(got) - {"version"} == set(expected) - {"task"}, name
                for key in set(expected) - {"task"}:
                    value, wanted = got[key], expected[key]
                    if key == "entities":
                        assert [(e["text"], e["label"]) for e in value] == [(e["text"], e["label"]) for e in wanted]
                    elif isinstance(wanted, dict):  # a multi-label task's scores by label
                        assert value.keys() == wanted.keys(), name
                        np.testing.assert_allclose(list(value.values()), list(wanted.values()), atol=2e-3)
                    elif isinstance(wanted, str) or (isinstance(wanted, list) and wanted
                                                     and isinstance(wanted[0], str)):
                        assert value == wanted, (name, key)
                    else:
                        np.testing.assert_allclose(value, wanted, atol=2e-3, err_msg=f"{name} {key}")


def test_a_bad_task_is_refused_alone_and_a_diverging_one_stops_alone(tmp_path, dropout_model, data, sentiment_dir):
    """Refused before training with their reasons: data that is not there, a typo, a bad value, a name taken, a
    method that changes the encoder, another encoder, a line that is not JSON. A regression whose scores overflow
    the loss stops alone (diverged); the good task trains as alone (the encoder's dropout masks its own), its
    batches in passes beside the diverging one's."""
    huge = _write(tmp_path / "huge", {"train": _scores(64, 1, 1e30), "dev": _scores(16, 2, 1e30)},
                  {"problem": "regression"})
    good = _spec("good", "classification", data)
    lines = [good, {"name": "gone", "data": str(tmp_path / "nowhere")},
             {"name": "typo", "data": str(sentiment_dir), "epoch": 2},
             {"name": "neg", "data": str(sentiment_dir), "max_length": -1},
             {"name": "good", "data": str(sentiment_dir)},
             {"name": "lora", "data": str(sentiment_dir), "method": "lora"},
             {"name": "other", "data": str(sentiment_dir), "model": "minilm"},
             {"name": "../up", "data": str(sentiment_dir)},
             {"name": "boom", "data": str(huge), "problem": "regression"}]
    manifest = tmp_path / "tasks.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{not json\n")
    out, err = run_cli("train", "--tasks", str(manifest), "--out", str(tmp_path / "job"), "--model",
                       str(dropout_model), "--epochs", "2", "--max-length", "32", "--lr", "3e-3",
                       "--no-progress")
    assert [r["where"] for r in out] == [f"{manifest}:{k}" for k in range(1, 11)]
    status = [r["status"] for r in out]
    assert status == ["trained"] + ["refused"] * 7 + ["failed", "refused"]
    reasons = [r.get("reason", "") for r in out]
    assert "neither a folder nor a built-in dataset" in reasons[1]
    assert "unknown key 'epoch' (did you mean 'epochs'?)" in reasons[2]
    assert "max_length -1: expected a positive integer" in reasons[3]
    assert f"name 'good' is taken by {manifest}:1" in reasons[4]
    assert "changes the encoder" in reasons[5]
    assert "the job trains on" in reasons[6]
    assert "name '../up'" in reasons[7]
    assert "diverged" in reasons[8]
    assert reasons[9].startswith("invalid JSON")
    assert not (tmp_path / "job" / "boom").exists()
    assert "trained 1 of 10 task(s)" in err and "boom (failed)" in err
    solo = _solo(dropout_model, good, tmp_path / "solo", epochs=2, **QUICK)
    _same_training(tmp_path / "job" / "good", solo, exact=False)
    assert run_cli("train", "--tasks", str(manifest), "--out", str(tmp_path / "job2"), "--model",
                   str(dropout_model), "--epochs", "1", "--strict", "--no-progress", exit_code=2)[0]


def test_a_job_killed_after_its_first_task_resumes_and_finishes(tmp_path, dropout_model, data, monkeypatch):
    """Killed once its first task is written: run again with --resume, the trained task is kept as it is, the
    others continue from their checkpoints, and every artifact is what an uninterrupted job writes."""
    specs = [_spec("short", "classification", data, epochs=1), _spec("long", "tokens", data, seed=1, epochs=2),
             _spec("later", "multilabel", data, seed=2, epochs=1)]
    common = dict(model=str(dropout_model), progress=False, tasks_per_step=2, eval_every=5, patience=20, **QUICK)
    finish = _Job._finish

    def killed(self, active):
        finish(self, active)
        raise KeyboardInterrupt  # the job dies here, its first task written

    monkeypatch.setattr(_Job, "_finish", killed)
    with pytest.raises(KeyboardInterrupt):
        train_tasks(specs, tmp_path / "job", **common)
    monkeypatch.setattr(_Job, "_finish", finish)
    job = tmp_path / "job"
    assert (job / "short").is_dir() and not (job / "long").exists()
    assert (job / STATE_DIR / "checkpoints" / "long.pt").is_file()
    written = (job / "short" / "weights.safetensors").stat().st_mtime_ns
    with pytest.raises(ValueError, match="pass --resume to continue it or --overwrite"):
        train_tasks(specs, job, **common)
    results = train_tasks(specs, job, resume=True, **common)
    assert [(r["name"], r["status"]) for r in results] == [("short", "kept"), ("long", "trained"),
                                                           ("later", "trained")]
    assert (job / "short" / "weights.safetensors").stat().st_mtime_ns == written
    assert not list((job / STATE_DIR / "checkpoints").glob("*.pt"))
    whole = train_tasks(specs, tmp_path / "whole", **common)
    assert [r["status"] for r in whole] == ["trained"] * 3
    for spec in specs:
        _same_training(job / spec["name"], tmp_path / "whole" / spec["name"], exact=False)


def test_two_gloo_ranks_share_a_manifest(tmp_path, tiny_models, data):
    """torchrun with two CPU ranks: each trains its share into the one DIR, rank 0 reports every task, and the
    artifacts are those one process writes."""
    specs = [_spec(f"t{k}", kind, data, method, seed=k, epochs=1) for k, (kind, method) in enumerate(
        (("classification", "fc"), ("tokens", "kron"), ("multilabel", "fc"), ("classification", "kron")))]
    manifest = tmp_path / "tasks.jsonl"
    manifest.write_text("".join(json.dumps(s) + "\n" for s in specs))
    argv = ["train", "--tasks", str(manifest), "--model", str(tiny_models["bert"]), "--max-length", "32",
            "--lr", "3e-3", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "aot", *argv, "--out",
                           str(tmp_path / "ranks")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reported = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(r["name"] for r in reported) == ["t0", "t1", "t2", "t3"]
    assert {r["status"] for r in reported} == {"trained"} and {r["shard"] for r in reported} == {"0/2", "1/2"}
    one, _ = run_cli(*argv, "--out", str(tmp_path / "one"))
    for r, alone in zip(sorted(reported, key=lambda r: r["name"]), one, strict=True):
        assert r["name"] == alone["name"]
        _same_training(tmp_path / "ranks" / r["name"], tmp_path / "one" / r["name"], exact=False)


def test_the_bench_compares_a_job_with_solo_runs(tmp_path, tiny_models):
    """`aot bench train-many` on two tiny tasks of the packaged data: solo runs and the job as fresh processes,
    their dev scores side by side (equal here: the job trains each task as alone), times, memory, load."""
    summary, _ = run_cli("bench", "train-many", "--model", str(tiny_models["bert"]), "--tasks", "2",
                         "--train-examples", "24", "--dev-examples", "12", "--max-length", "16", "--ranks", "0",
                         "--out", str(tmp_path), "--no-progress")
    [summary] = summary
    assert summary["tasks"] == summary["trained_in_job"] == 2 and summary["job_seconds"] > 0
    assert summary["speedup"] == pytest.approx(summary["solo_seconds"] / summary["job_seconds"], rel=0.01)
    report = json.loads((tmp_path / "train_many.json").read_text())
    assert [(r["task"], r["source"], r["status"]) for r in report["tasks"]] == [
        ("t00-classification", "rotten_tomatoes", "trained"), ("t01-regression", "bbc_multilabel", "trained")]
    for row in report["tasks"]:
        assert row["job_dev"] == pytest.approx(row["solo_dev"], abs=0.1)
    assert summary["memory_budget_mb"] > summary["solo_peak_mb"] > 0 and len(summary["load_average_after"]) == 3
    assert "| t01-regression | bbc_multilabel |" in (tmp_path / "train_many.md").read_text()


def test_the_kubernetes_job_shards_the_manifest_by_completion_index():
    """deploy/kubernetes/train: an indexed Job, each pod `aot train --tasks ... --shard INDEX/COUNT --resume` on the
    fleet's claim (read-write), a pod that dies started again with its index, COUNT the Job's completions."""
    import shutil

    import kubernetes_validate
    import yaml

    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl renders deploy/kubernetes (kubectl kustomize)"
    done = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / "kubernetes" / "train")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    objects = {doc["kind"]: doc for doc in yaml.safe_load_all(done.stdout)}
    assert set(objects) == {"ConfigMap", "Job"}
    for doc in objects.values():
        kubernetes_validate.validate(doc, "1.32.0", strict=True)
    spec = objects["Job"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["backoffLimitPerIndex"] > 0
    assert int(objects["ConfigMap"]["data"]["TRAIN_SHARDS"]) == spec["completions"]
    [container] = spec["template"]["spec"]["containers"]
    assert container["command"] == ["aot", "train"]
    assert {"--shard=$(JOB_COMPLETION_INDEX)/$(TRAIN_SHARDS)", "--resume", "--tasks=/mnt/aot/$(TRAIN_MANIFEST)",
            "--out=/mnt/aot/$(TRAIN_OUT)"} <= set(container["args"])
    [volume] = spec["template"]["spec"]["volumes"][:1]
    assert volume["persistentVolumeClaim"] == {"claimName": "aot-repository"}
