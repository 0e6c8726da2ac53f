"""The smaller promises of the CLI, each to its exact message or output: `aot train` trains fc without --method,
`aot predict` has --device, --no-progress and --top-k, labels print as they are written (not escaped), `--storage
auto` says when it stores a task factored, `aot serve`'s start-up line counts the tasks the pool holds, and the plain
encoder (`vanilla`) is loaded only when asked."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from aot.cli.main import build_parser, main
from tests.helpers import make_repository
from tests.tiny import sentiment_examples

LABELS = {"positive": "positif 👍", "negative": "négatif"}


@pytest.fixture(scope="module")
def french(tmp_path_factory, tiny_models):
    """A task whose labels are not ASCII, trained without --method."""
    root = tmp_path_factory.mktemp("french")
    data = root / "data"
    data.mkdir()
    for split, n, seed in (("train", 200, 1), ("dev", 50, 2)):
        rows = [{"text": r["text"], "label": LABELS[r["label"]]} for r in sentiment_examples(n, seed)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                             encoding="utf-8")
    out = root / "task"
    assert main(["train", "--model", str(tiny_models["bert"]), "--data", str(data), "--out", str(out),
                 "--epochs", "2", "--max-length", "16", "--no-progress"]) == 0
    return out


def test_train_defaults_to_fc(french):
    assert json.loads((french / "config.json").read_text())["method"]["method"] == "fc"
    parser = build_parser()  # None until the command runs: `--fit-to` tells a given --method from the default
    assert parser.parse_args(["train", "--model", "m", "--data", "d", "--out", "o"]).method is None
    train_help = next(a for a in parser._subparsers._group_actions[0].choices["train"]._actions if a.dest == "method")
    assert train_help.help.startswith("default fc; ") and "fc: AoT P-Tuning, FC reparametrization" in train_help.help


def test_labels_print_as_written_and_top_k_names_them(french, capsys):
    assert main(["predict", "--task", str(french), "--device", "cpu", "good w1", "bad w2"]) == 0
    out = capsys.readouterr().out
    assert "positif 👍" in out and "\\u" not in out
    full = [json.loads(line) for line in out.splitlines()]
    assert main(["predict", "--task", str(french), "--top-k", "1", "good w1", "bad w2"]) == 0
    top = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for answer, whole in zip(top, full, strict=True):
        assert list(answer) == ["task", "label", "top"]
        assert answer["top"] == [{"label": whole["label"], "probability": max(whole["probabilities"])}]
    assert main(["predict", "--task", str(french), "--top-k", "5", "good w1"]) == 0
    [both] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["label"] for t in both["top"]] == sorted(LABELS.values(), key=lambda label: label != both["label"])


def test_utf8_whatever_the_locale(french, monkeypatch):
    """JSON lines are UTF-8: a latin-1 standard output still gets the labels as written, in UTF-8."""
    import io

    raw = io.BytesIO()
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(raw, encoding="latin-1"))
    assert main(["predict", "--task", str(french), "good w1"]) == 0
    sys.stdout.flush()
    assert json.loads(raw.getvalue().decode("utf-8"))["label"] in LABELS.values()


def test_predict_progress_on_stderr_unless_hidden(french, tmp_path, capsys):
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "text": f"good w{i}"}) + "\n" for i in range(5)))
    assert main(["predict", "--task", str(french), "--input", str(lines), "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 5 and "predict: 100%" in captured.err and "5/5" in captured.err
    assert main(["predict", "--task", str(french), "--input", str(lines), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["predict", "--task", str(french), "--device", "tpu", "x"]) == 2
    assert capsys.readouterr().err == "aot: error: --device 'tpu': expected cpu, cuda (cuda:N) or auto\n"


TABLE = 101 * 2 * 32 * 2  # a task's table on the tiny BERT: vocabulary x layers x hidden size x fp16


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, french):
    """Two tasks, and a task pool with room for two tables."""
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("small-pool") / "repo",
                           {"one": (french, "auto"), "two": (french, "auto")}, pool_bytes=2 * TABLE)


def test_storage_auto_says_what_it_picked_and_why_at_every_publish(repo, french, capsys):
    """Issue 47.5: a pool with room for two tables: the third task is stored factored, and every publish with
    --storage auto says which storage it picked and why (the first two were fused)."""
    assert main(["export", "task", "--task", str(french), "--repo", str(repo), "--name", "three",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["storage"] == "factored"
    factored = result["storage_advice"]["factored_bytes"] / 2**10
    assert captured.err.splitlines()[-2] == (  # the summary's last line before the next step
        f"aot: --storage auto stored three factored ({factored:.1f} KiB factored, 12.6 KiB fused: the store holds 3 "
        "tasks and the task pool (25.2 KiB) keeps 2 fused tables resident; tasks exported before keep their storage); "
        "--storage fused stores it fused (docs/serving.md, the task pool)")
    assert main(["export", "task", "--task", str(french), "--repo", str(repo), "--name", "one",
                 "--no-progress"]) == 0  # a new version of a task the store holds: still 3 tasks
    assert "--storage auto stored one factored" in capsys.readouterr().err.splitlines()[-2]
    assert main(["export", "task", "--task", str(french), "--repo", str(repo), "--name", "four", "--storage",
                 "factored", "--no-progress"]) == 0
    assert "--storage auto" not in capsys.readouterr().err  # asked for: nothing to say


MINILM = SimpleNamespace(num_layers=6, hidden_size=384, vocab_size=30522)  # a table is 140.6 MB


@pytest.mark.parametrize("instances,pool,storages,said", [
    pytest.param(1, 1 << 30, {"a": "fused", "b": "factored"}, "task pool 1024 MiB: all 2 task(s) fully resident",
                 id="all fit"),
    pytest.param(1, 1 << 30, {f"t{i}": "factored" for i in range(20)},
                 "task pool 1024 MiB: 7 of 20 task(s) fully resident, the others' rows cached as they are used",
                 id="20 tasks, room for 7"),
    pytest.param(2, 1 << 30, {"a": "fused", "b": "fused", "c": "factored"},
                 "task pool 512 MiB in each of 2 instances: all 1 factored task(s) fully resident; 2 fused table(s) "
                 "read through their memory maps", id="default CPU layout"),
    pytest.param(2, 1 << 30, {"a": "fused"}, "task pool 512 MiB in each of 2 instances: room for 3 factored task(s) "
                 "fully resident, none served; 1 fused table(s) read through their memory maps", id="fused only"),
    pytest.param(2, 0, {"a": "fused"}, "no task pool (fused tables read through their memory maps, factored rows "
                 "computed per request)", id="no pool"),
])
def test_start_up_line_counts_the_tasks_the_pool_holds(instances, pool, storages, said):
    from aot.cli.serve import pool_summary

    repo = SimpleNamespace(**vars(MINILM), options=SimpleNamespace(cpu_instances=instances))
    assert pool_summary(repo, pool, "cpu", storages) == said


def test_vanilla_is_loaded_only_when_asked(repo, monkeypatch):
    """`aot serve` loads the fused `aot` step and the task list; the plain encoder only with --vanilla, and the
    container (aot.serving.supervision.main) what the GPU configs serve: the native ensembles and their steps, the plain
    encoder only with AOT_LOAD_VANILLA=1; a folder that is not an AoT repository, everything."""
    from aot.local.server import LocalServer
    from aot.serving.supervision.main import load_flags

    assert LocalServer(repo).models() == ["aot", "task_list"]
    assert LocalServer(repo, vanilla=True).models() == ["aot", "task_list", "vanilla"]
    gpu = LocalServer(repo, device="cuda").models()  # an ONNX repository: the native ensemble and its steps
    assert "vanilla" not in gpu and "backbone_vanilla" not in gpu and {"aot", "aot_lookup", "backbone", "head"} <= set(gpu)
    assert {"vanilla", "backbone_vanilla"} <= set(LocalServer(repo, device="cuda", vanilla=True).models())
    command = ["tritonserver", f"--model-repository={repo / 'models'}"]
    monkeypatch.delenv("AOT_LOAD_VANILLA", raising=False)
    flags = load_flags(command)
    assert "--load-model=aot" in flags and "--load-model=aot_lookup" in flags
    assert not {"--load-model=vanilla", "--load-model=backbone_vanilla"} & set(flags)
    monkeypatch.setenv("AOT_LOAD_VANILLA", "1")
    assert {"--load-model=vanilla", "--load-model=backbone_vanilla", "--load-model=aot"} <= set(load_flags(command))
    assert load_flags(["tritonserver", f"--model-repository={repo}"]) == ["--load-model=*"]  # not an AoT repository
    parser = build_parser()
    assert parser.parse_args(["serve", "--repo", "r"]).vanilla is False
    assert parser.parse_args(["serve", "--repo", "r", "--vanilla"]).vanilla is True
