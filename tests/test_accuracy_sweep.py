"""The accuracy sweep on tiny models: its files and fields, resume without retraining, parallel workers, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from aot.benchmarks.accuracy.plan import RECORD_FIELDS, SweepConfig, grid_points
from aot.benchmarks.accuracy.report import curves
from aot.benchmarks.accuracy.sweep import run_sweep
from aot.training.data import DataError
from aot.training.methods import MethodError

TINY = dict(seeds=2, grid="small", max_train_samples=48, max_length=24, epochs=1, patience=1, eval_every=0,
            progress=False)


@pytest.fixture(scope="module")
def with_test_dir(sentiment_dir, tmp_path_factory) -> Path:
    """The synthetic task with a test split (its dev file, copied), next to `sentiment_dir` that has none."""
    folder = tmp_path_factory.mktemp("data") / "sentiment_test"
    folder.mkdir()
    shutil.copy(sentiment_dir / "train.jsonl", folder / "train.jsonl")
    shutil.copy(sentiment_dir / "dev.jsonl", folder / "dev.jsonl")
    shutil.copy(sentiment_dir / "dev.jsonl", folder / "test.jsonl")
    return folder


@pytest.fixture(scope="module")
def sweep(tiny_models, sentiment_dir, with_test_dir, tmp_path_factory) -> tuple[SweepConfig, dict]:
    config = SweepConfig(model=str(tiny_models["bert"]), datasets=[str(with_test_dir), str(sentiment_dir)],
                         methods=["fc", "bitfit"], out=str(tmp_path_factory.mktemp("sweep")), workers=1, **TINY)
    return config, run_sweep(config)


def _run_files(out: str) -> dict[str, float]:
    return {p.stem: p.stat().st_mtime_ns for p in (Path(out) / "runs").glob("*.json")}


def test_sweep_writes_documented_outputs(sweep, with_test_dir, sentiment_dir):
    config, result = sweep
    out = Path(config.out)
    points = len(grid_points("small", "fc")) + len(grid_points("small", "bitfit"))
    expected_runs = 2 * points + 2 * 2 * (config.seeds - 1)  # phase 1 on 2 datasets + the extra seeds
    assert result["runs"] == result["trained"] == expected_runs and result["skipped_existing"] == 0
    assert len(_run_files(config.out)) == expected_runs

    report = json.loads((out / "accuracy.json").read_text())
    assert len(report["records"]) == expected_runs
    for record in report["records"]:
        assert set(record) == set(RECORD_FIELDS)
        assert record["status"] == "ok" and 0 <= record["dev"] <= 1 and record["trainable_parameters"] > 0
        assert record["phase"] in ("grid", "seeds") and record["train_seconds"] > 0
        assert record == json.loads((out / "runs" / f"{record['run_id']}.json").read_text())
    by_dataset = {r["dataset"]: r for r in report["records"]}
    assert by_dataset[str(with_test_dir)]["split"] == "test" and by_dataset[str(with_test_dir)]["test"] is not None
    no_test = by_dataset[str(sentiment_dir)]
    assert no_test["split"] == "dev" and no_test["test"] is None and no_test["score"] == no_test["dev"]
    assert "no test split" in no_test["note"]

    assert len(report["summary"]) == 4
    for entry in report["summary"]:
        assert entry["status"] == "ok" and entry["seeds"] == [0, 1] and len(entry["scores"]) == 2
        assert set(entry["best"]) == {"lr", "batch_size", "rank"} and entry["trainable_parameters"] > 0
        assert min(entry["scores"]) <= entry["median"] <= max(entry["scores"]) and entry["std"] >= 0
    fc = next(e for e in report["summary"] if e["method"] == "fc")
    assert fc["rank_field"] == "rank" and fc["best"]["rank"] == 64

    table = (out / "accuracy.md").read_text()
    assert "| Method | sentiment_test | sentiment | Macro |" in table and "(dev)" in table and "±" in table
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_skips_finished_runs(sweep):
    config, first = sweep
    before = _run_files(config.out)
    again = run_sweep(config)
    assert again["trained"] == 0 and again["skipped_existing"] == again["runs"] == first["runs"]
    assert again["summary"] == first["summary"]
    assert _run_files(config.out) == before  # no record was rewritten


def test_parallel_workers_make_the_same_runs(sweep, tmp_path):
    config, first = sweep
    parallel = SweepConfig(**{**vars(config), "out": str(tmp_path / "parallel"), "workers": 2})
    result = run_sweep(parallel)
    assert result["trained"] == first["runs"]
    assert set(_run_files(parallel.out)) == set(_run_files(config.out))
    # each run seeds before building its model, so a fresh worker trains what the sequential sweep trained
    assert result["summary"] == first["summary"]


def test_unsupported_method_is_recorded_as_skipped(tiny_models, with_test_dir, tmp_path):
    config = SweepConfig(model=str(tiny_models["deberta-v2"]), datasets=[str(with_test_dir)], methods=["prefix"],
                         out=str(tmp_path / "out"), **{**TINY, "seeds": 1})
    result = run_sweep(config)
    assert result["unsupported"] == result["runs"] == len(grid_points("small", "prefix"))
    assert result["summary"] == {str(with_test_dir): {"prefix": "n/a"}}
    entry = json.loads((tmp_path / "out" / "accuracy.json").read_text())["summary"][0]
    assert entry["status"] == "skipped" and "deberta-v2" in entry["reason"]
    assert "n/a: prefix on sentiment_test" in (tmp_path / "out" / "accuracy.md").read_text()


@pytest.mark.parametrize("change, error, match", [
    ({"methods": ["fc", "nope"]}, MethodError, "unknown method 'nope'"),
    ({"datasets": ["no_such_dataset"]}, DataError, "no_such_dataset"),
    ({"grid": "huge"}, ValueError, "unknown grid 'huge'"),
    ({"seeds": 0}, ValueError, "seeds must be a positive integer, got 0"),
    ({"budget": "minutes"}, ValueError, "unknown budget 'minutes': expected one of epochs, steps"),
    ({"pooling": "max"}, ValueError, "unknown pooling 'max': expected one of cls, mean"),
])
def test_bad_values_are_named_before_training(tiny_models, with_test_dir, tmp_path, change, error, match):
    config = SweepConfig(**{"model": str(tiny_models["bert"]), "datasets": [str(with_test_dir)], "methods": ["fc"],
                            "out": str(tmp_path / "out"), **TINY, **change})
    with pytest.raises(error, match=match):
        run_sweep(config)
    assert not (tmp_path / "out").exists()


def test_steps_budget_trains_every_method_the_same_steps_and_plots_curves(tiny_models, with_test_dir, tmp_path):
    """--budget steps: exactly `steps` optimizer steps for every method (no early stopping, whatever the epochs),
    dev evaluated every steps/10, the curve of each method's chosen point in accuracy.json and accuracy-curves.png."""
    config = SweepConfig(model=str(tiny_models["bert"]), datasets=[str(with_test_dir)], methods=["fc", "bitfit"],
                         out=str(tmp_path / "out"), **{**TINY, "budget": "steps", "steps": 7, "epochs": 1,
                                                       "patience": 1})
    run_sweep(config)
    report = json.loads((tmp_path / "out" / "accuracy.json").read_text())
    for record in report["records"]:
        # 48 examples at batch 16 are 3 steps an epoch: 7 steps need a third epoch, and --patience 1 is not applied
        assert record["steps"] == 7 and record["stopped"] == "max_steps"
        assert [h["step"] for h in record["history"]] == [1, 2, 3, 4, 5, 6, 7]
        assert record["dev"] == max(h["dev"] for h in record["history"])
    lines = curves(report["summary"], report["records"])
    assert set(lines) == {(str(with_test_dir), "fc"), (str(with_test_dir), "bitfit")}
    for steps, dev in lines.values():
        assert steps == [1, 2, 3, 4, 5, 6, 7] and len(dev) == 7 and all(0 <= v <= 1 for v in dev)
    assert (tmp_path / "out" / "accuracy-curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "exactly 7 optimizer steps for every method" in (tmp_path / "out" / "accuracy.md").read_text()


def test_defaults_grid_is_what_aot_train_runs_without_flags():
    from aot.training.methods import make_config, method_spec

    for method in ("fc", "lora", "bitfit", "adapter", "kron"):
        (point,) = grid_points("defaults", method)
        field = method_spec(method).config_cls.rank_field
        assert point.lr == method_spec(method).default_lr and point.batch_size == 16
        assert point.rank == (None if field is None else getattr(make_config(method), field))


def test_run_ids_change_with_pooling(tiny_models, with_test_dir, tmp_path):
    from aot.benchmarks.accuracy.plan import Run, run_id

    base = SweepConfig(model=str(tiny_models["bert"]), datasets=[str(with_test_dir)], methods=["fc"],
                       out=str(tmp_path / "out"), **TINY)
    run = Run(str(with_test_dir), "fc", grid_points("defaults", "fc")[0], 0, "grid")
    ids = {run_id(SweepConfig(**{**base.__dict__, "pooling": pooling}), run) for pooling in (None, "cls", "mean")}
    assert len(ids) == 3
