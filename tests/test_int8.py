"""int8 CPU backbones: the quantized graphs served through a real tritonserver, the accuracy gate at publish, the
PyTorch emulation re-fitting trains against, and fp32 repositories left as they were.

The tiny encoder here is built to need care in int8: every LayerNorm's bias carries an outlier in one channel, so
each layer's input has a wide range and the per-tensor activation scale is coarse (as real encoders' outlier
channels do, only more so). Its task loses several points of dev accuracy through the int8 graph."""

import collections
import json

import numpy as np
import pytest
import torch

from aot.cli.main import main
from aot.client.client import Client
from aot.exporter.accuracy_gate import AccuracyDropError, SmallSampleError, SmallSampleWarning
from aot.exporter.backbone_export import export_backbone
from aot.exporter.cpu_engine import CpuEngine, predict_lines_through
from aot.exporter.onnx_export import ExportableBackbone, example_inputs
from aot.exporter.task_export import export_task
from aot.serving import protocol
from aot.serving.engine import CPU_DISABLED_FUSIONS, BackboneRunner, cpu_session, cpu_session_options
from aot.serving.repository import INT8_GRAPH, read_repository
from aot.serving.store.digests import file_digest
from aot.serving.store.writer import STAGING, TaskStore
from aot.serving.tasks import load_task_version
from aot.training.backbone import load_backbone
from aot.training.quantized import emulate_int8
from aot.training.refit import fit_task
from aot.training.trainer import TrainConfig
from tests.helpers import one_line_error, serve_for_tests, train_tiny_task
from tests.tiny import save_outlier_model

OUTLIER = 30.0  # added to channel 3 of every LayerNorm's bias
TEXTS = ["good w1 w2", "w3 awful w4 w5", "the movie was superb", "dull plot", "w7", " ".join(["w9 great"] * 40)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_outlier_model(tmp_path_factory.mktemp("outlier-model"), OUTLIER)


@pytest.fixture(scope="module")
def task(tmp_path_factory, model_dir, sentiment_dir):
    return train_tiny_task(model_dir, sentiment_dir, tmp_path_factory.mktemp("int8-task") / "task")


@pytest.fixture(scope="module")
def repo(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("int8-repo") / "repo"
    export_backbone(str(model_dir), path, cpu_precision="int8")
    return path


@pytest.fixture(scope="module")
def refused(repo, task):
    """The unfitted task's publish, refused by the gate: the error, and the store's tasks right after."""
    with pytest.raises(AccuracyDropError) as caught:
        export_task(task, repo, "plain", progress=False)
    return caught.value, set(TaskStore(read_repository(repo).store_root).entries())


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, repo, task):
    config = TrainConfig(lr=3e-3, batch_size=16, max_steps=100, eval_every=25)
    out = tmp_path_factory.mktemp("fitted") / "task"
    return out, fit_task(task, repo, out, config, progress=False)


@pytest.fixture(scope="module")
def published(repo, task, fitted, refused):
    """The unfitted task with the drop allowed, and the fitted one under the default threshold."""
    return {"plain": export_task(task, repo, "plain", progress=False, allowed_drop=50),
            "fitted": export_task(fitted[0], repo, "fitted", progress=False)}


@pytest.fixture(scope="module")
def server(request, repo, published):
    yield from serve_for_tests(request, repo)


def test_int8_repository_records_and_runs_int8_graphs(repo):
    info = read_repository(repo)
    assert info.record.cpu_precision == "int8" and info.record.quantization["ops"] == ["MatMul", "Attention"]
    for folder in ("backbone", "backbone_vanilla"):
        graph = info.models / folder / "1" / INT8_GRAPH
        assert graph.stat().st_size < (info.models / folder / "1" / "model.onnx").stat().st_size
        cpu = (info.models / ("aot" if folder == "backbone" else "vanilla") / "configs" / "cpu.pbtxt").read_text()
        assert f"{folder}/1/{INT8_GRAPH}" in cpu and "per_request" in cpu
        gpu = (info.models / folder / "config.pbtxt").read_text()
        assert "int8" not in gpu  # the GPU configs keep their fp16 / fp32 graph
    assert 0 < info.record.parity_max_abs_diff["backbone-int8"] < 1.0


def test_int8_graphs_unfuse_skip_layer_norms_and_keep_the_answers(repo, model_dir, tmp_path):
    """The int8 twins run ONNX's LayerNormalization where the fp32 graph runs ONNX Runtime's SkipLayerNormalization
    (several times slower on CPU), and the rewrite alone changes no answer beyond rounding."""
    import onnx

    from aot.exporter.quantize import unfuse_skip_layer_norms

    backbone = load_backbone(str(model_dir))
    for folder, aot in (("backbone", True), ("backbone_vanilla", False)):
        graphs = repo / "models" / folder / "1"
        ops = collections.Counter(n.op_type for n in onnx.load(str(graphs / INT8_GRAPH)).graph.node)
        assert ops["SkipLayerNormalization"] == 0 and ops["LayerNormalization"] == 2 * backbone.num_layers
        unfused = onnx.load(str(graphs / "model.onnx"))
        assert unfuse_skip_layer_norms(unfused) == 2 * backbone.num_layers
        assert not [n for n in unfused.graph.node if n.op_type == "SkipLayerNormalization"]
        onnx.save_model(unfused, str(tmp_path / f"{folder}.onnx"))
        before, after = cpu_session(graphs / "model.onnx"), cpu_session(tmp_path / f"{folder}.onnx")
        names = {i.name for i in before.get_inputs()}
        for seq in (5, 17):
            feeds = {n: v.numpy() for n, v in example_inputs(backbone, aot, 2, seq, seed=seq).items() if n in names}
            for want, got in zip(before.run(None, feeds), after.run(None, feeds), strict=True):
                assert np.abs(want - got).max() < 1e-5


# name: (bias input, beta input, sum output read, mean output read, ONNX opset) of one SkipLayerNormalization
SKIP_LAYER_NORMS = {
    "bias and beta": (True, True, False, False, 17),
    "no bias": (False, True, False, False, 17),
    "no beta": (True, False, False, False, 17),
    "its sum read too": (True, True, True, False, 17),
    "its mean read: left fused": (True, True, False, True, 17),
    "opset 16, before LayerNormalization: left fused": (True, True, False, False, 16),
}


@pytest.mark.parametrize("case", SKIP_LAYER_NORMS)
def test_unfuse_skip_layer_norms_cases(case, tmp_path):
    """One SkipLayerNormalization with non-zero gamma, beta and bias and an epsilon not LayerNormalization's default:
    rewritten, it answers as the fused node (every output read); where it cannot be, it is left as it was."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from aot.exporter.quantize import unfuse_skip_layer_norms

    bias, beta, sum_read, mean_read, opset = SKIP_LAYER_NORMS[case]
    hidden, epsilon, rng = 16, 0.25, np.random.default_rng(3)
    used = ["gamma"] + (["beta"] if beta else []) + (["bias"] if bias else [])
    weights = [numpy_helper.from_array((1 + rng.normal(size=hidden)).astype(np.float32), name) for name in used]
    outputs = ["y", "mean" if mean_read else "", "", "sum" if sum_read else ""]
    node = helper.make_node("SkipLayerNormalization",
                            ["x", "skip", "gamma", "beta" if beta else "", "bias" if bias else ""],
                            outputs, domain="com.microsoft", epsilon=epsilon, name="sln")
    tensor = [1, 5, hidden]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, tensor)
                                           for n in ("x", "skip")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs if n],
                              weights)
    fused = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)])
    unfused = onnx.ModelProto.FromString(fused.SerializeToString())
    left = mean_read or opset < 17
    assert unfuse_skip_layer_norms(unfused) == (0 if left else 1)
    if left:
        assert unfused == fused
        return
    [norm] = [n for n in unfused.graph.node if n.op_type == "LayerNormalization"]
    assert {a.name: helper.get_attribute_value(a) for a in norm.attribute} == {"axis": -1, "epsilon": epsilon}
    assert not [n for n in unfused.graph.node if n.op_type == "SkipLayerNormalization"]
    feeds = {n: rng.normal(size=tensor).astype(np.float32) for n in ("x", "skip")}
    answers = []
    for name, model in (("fused", fused), ("unfused", unfused)):
        onnx.save_model(model, str(tmp_path / f"{name}.onnx"))
        answers.append(cpu_session(tmp_path / f"{name}.onnx").run(None, feeds))
    for want, got in zip(*answers, strict=True):
        assert np.abs(want - got).max() < 1e-5


def test_cpu_sessions_do_not_fuse_the_layer_norms_back(repo, tmp_path):
    """ONNX Runtime would fuse the int8 vanilla graph's Add + Add + LayerNormalization back into its slow
    SkipLayerNormalization when a session starts; the options every CPU session takes keep it out."""
    import onnx
    import onnxruntime as ort

    graph = repo / "models" / "backbone_vanilla" / "1" / INT8_GRAPH
    fused = {}
    for name, options in (("default", ort.SessionOptions()), ("cpu", cpu_session_options(threads=1))):
        options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        nodes = onnx.load(str(tmp_path / f"{name}.onnx"), load_external_data=False).graph.node
        fused[name] = sum(n.op_type == "SkipLayerNormalization" for n in nodes)
    assert fused["default"] > 0 and fused["cpu"] == 0
    runner = BackboneRunner(graph)  # what the served step, the gate and aot predict run
    config = runner.session.get_session_options().get_session_config_entry
    assert config("optimization.disable_specified_optimizers") == ",".join(CPU_DISABLED_FUSIONS)


def test_emulation_equals_the_int8_graph(repo, model_dir):
    """What re-fitting trains against is what the int8 graph computes (and not what fp32 computes)."""
    backbone = load_backbone(str(model_dir))
    for folder, aot in (("backbone", True), ("backbone_vanilla", False)):
        module = ExportableBackbone(backbone, aot).eval()
        graph, fp32 = (cpu_session(repo / "models" / folder / "1" / name) for name in (INT8_GRAPH, "model.onnx"))
        names = {i.name for i in graph.get_inputs()}
        try:
            for seq in (5, 17):
                feeds = example_inputs(backbone, aot, 1, seq, seed=seq)
                numpy_feeds = {n: v.numpy() for n, v in feeds.items() if n in names}
                served = graph.run([protocol.POOLED_HIDDEN], numpy_feeds)[0]
                with torch.no_grad(), emulate_int8(backbone.encoder):
                    emulated = module(**feeds)[0].numpy()  # the pooled states (then the token states)
                assert np.abs(emulated - served).max() < 1e-4
                assert np.abs(fp32.run([protocol.POOLED_HIDDEN], numpy_feeds)[0] - served).max() > 1e-2
        finally:
            module.close()
    assert all(type(m).__name__ != "Int8Linear" for m in backbone.encoder.modules())  # restored after the block


def test_gate_refuses_a_drop_with_both_figures_and_the_ways_out(repo, refused):
    error, tasks_after = refused
    message = str(error)
    assert "dev accuracy through the int8 engine is" in message and "below its fp32" in message
    assert f"aot train --fit-to {repo}" in message and "--allow-accuracy-drop" in message
    assert "plain" not in tasks_after  # nothing published, nothing left behind
    assert not list((read_repository(repo).store_root / STAGING).glob("*"))


def test_gate_accepts_with_override_and_records_both_scores(repo, published):
    plain = published["plain"].served_dev
    assert plain["precision"] == "int8" and plain["reference"] == "fp32 task"
    assert plain["fp32"] - plain["score"] > 0.005  # the drop the gate refused
    store = TaskStore(read_repository(repo).store_root)
    meta = json.loads((store.root / store.entries()["plain"].folder / "task.json").read_text())
    assert meta["served_dev"]["score"] == plain["score"] and meta["served_dev"]["allowed_drop"] == 50


def test_gate_needs_a_sample_and_the_listing_shows_it(repo, task, published, tmp_path, capsys):
    """Issue 46.4: a one- or two-example --dev-data no longer slips a task past the gate: under 50 examples it is
    refused unless --allow-small-dev-sample says so (recorded), under 300 a warning says how far one example moves
    the score, and `aot export list` shows each version's examples, drop and accepted drop."""
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"text": t, "label": lab}) + "\n"
                           for t, lab in (("good w1", "positive"), ("w2 awful", "negative")) * 3))
    with pytest.raises(SmallSampleError, match=r"the int8 gate scores 6 dev example\(s\): one flipped example moves "
                                               r"its score 17 points .* fewer than 50"):
        export_task(task, repo, "tiny-dev", progress=False, dev_data=dev, allowed_drop=50)
    assert "tiny-dev" not in TaskStore(read_repository(repo).store_root).entries()
    with pytest.warns(SmallSampleWarning, match="accepted: --allow-small-dev-sample"):
        accepted = export_task(task, repo, "tiny-dev", progress=False, dev_data=dev, allowed_drop=50,
                               accept_small_dev=True).served_dev
    assert accepted["examples"] == 6 and accepted["small_sample_accepted"] is True
    with pytest.warns(SmallSampleWarning, match=r"scores 100 dev example\(s\): one flipped example moves its score 1 "
                                                r"points \(allowed drop: 50\); 300 or more"):
        export_task(task, repo, "hundred", progress=False, allowed_drop=50)
    assert main(["export", "list", "--repo", str(repo)]) == 0
    listed = {e["name"]: e for e in map(json.loads, capsys.readouterr().out.splitlines())}
    assert listed["tiny-dev"]["int8_gate"] == {"examples": 6, "drop": accepted["drop"], "allowed_drop": 50,
                                               "small_sample_accepted": True}
    assert listed["plain"]["int8_gate"]["examples"] == published["plain"].served_dev["examples"] == 100
    assert listed["plain"]["int8_gate"]["small_sample_accepted"] is False
    assert main(["export", "task", "--task", str(task), "--repo", str(repo), "--name", "cli-dev", "--dev-data",
                 str(dev), "--allow-accuracy-drop", "50", "--no-progress"]) == 2
    assert "fewer than 50" in one_line_error(capsys)
    for name in ("tiny-dev", "hundred"):
        TaskStore.of(read_repository(repo)).remove(name)


def test_refit_raises_the_int8_dev_score(fitted, published):
    _, result = fitted
    assert result["int8_dev"] > result["int8_dev_before_fit"]
    served = published["fitted"].served_dev
    assert served["reference"].startswith("fitted from") and served["fp32"] == result["fp32_dev_before_fit"]
    assert served["fp32"] - served["score"] <= 0.005  # within the default threshold: published without override
    assert served["score"] > published["plain"].served_dev["score"]


def test_served_int8_answers_equal_the_in_process_engine(server, repo, task, fitted):
    tasks = {"plain": task, "fitted": fitted[0]}
    lines = [(k, {"text": text, "text_pair": None, "task": name}) for k, (name, text) in
             enumerate((name, text) for name in tasks for text in TEXTS)]
    expected = predict_lines_through(repo, tasks, lines)
    with Client(server.grpc_url) as client:
        answers = client.infer_many([{"task": item["task"], "text": item["text"]} for _, item in lines])
        listing = {t["name"]: t for t in client.tasks()["tasks"]}
    for (k, _), answer in zip(lines, answers, strict=True):
        assert np.abs(np.array(answer["logits"]) - np.array(expected[k]["logits"])).max() < 1e-4
    assert listing["fitted"]["served_dev"]["precision"] == "int8"
    assert listing["plain"]["dev"] is not None and listing["plain"]["served_dev"]["allowed_drop"] == 50


def test_int8_answers_do_not_depend_on_the_batch(repo, published):
    """The activation scale is per tensor: the int8 graph runs each request alone, so a text's answer is the same
    alone and among others."""
    info = read_repository(repo)
    store = TaskStore(info.store_root)
    folder = store.root / store.entries()["plain"].folder
    served = load_task_version(folder, folder.name, info.store_root)
    engine = CpuEngine(info)
    together = [a.values for a in engine.answers(served, [(t, None) for t in TEXTS])]
    for k, text in enumerate(TEXTS):
        assert np.abs(engine.answers(served, [(text, None)])[0].values - together[k]).max() < 1e-6  # batched: ~1e-1


def test_fp32_repository_unchanged(tmp_path, model_dir, task):
    path = tmp_path / "repo"
    export_backbone(str(model_dir), path)
    info = read_repository(path)
    assert info.record.cpu_precision == "fp32" and info.record.quantization is None
    assert not list(info.models.rglob(INT8_GRAPH))
    cpu = (info.models / "aot" / "configs" / "cpu.pbtxt").read_text()
    assert "backbone/1/model.onnx" in cpu and "per_request" not in cpu
    assert export_task(task, path, "plain", progress=False).served_dev is None  # no gate: fp32 serves the fp32 task


def test_cli_refusals(tmp_path, capsys, model_dir, task, repo):
    assert main(["export", "backbone", "--model", str(model_dir), "--repo", str(tmp_path / "torch"), "--precision",
                 "int8", "--format", "torch"]) == 2
    assert "int8 applies to the ONNX graphs" in one_line_error(capsys)
    assert main(["train", "--fit-to", str(repo), "--out", str(tmp_path / "x")]) == 2
    assert "--fit-to REPO and --task DIR go together" in one_line_error(capsys)
    assert main(["train", "--fit-to", str(repo), "--task", str(task), "--method", "fc", "--out",
                 str(tmp_path / "x")]) == 2
    assert "drop --method" in one_line_error(capsys)
    with pytest.raises(SystemExit):  # argparse refuses it with the usage
        main(["export", "task", "--task", str(task), "--repo", str(repo), "--name", "x", "--allow-accuracy-drop", "-1"])
    assert "expected a finite number >= 0, got -1.0" in capsys.readouterr().err


def test_int8_accuracy_benchmark(tmp_path, repo, task, published):
    """The benchmark publishes the task as a user would, measures its drop, and re-fits it where the drop is past
    the threshold; its report holds both figures."""
    from aot.benchmarks.accuracy.int8 import main as bench

    assert bench(["--repo", str(repo), "--tasks", f"bench={task}", "--out", str(tmp_path), "--refit-steps", "100",
                  "--refit-lr", "3e-3"]) == 0
    [row] = json.loads((tmp_path / "int8_accuracy.json").read_text())
    assert row["task"] == "bench" and row["examples"] > 0 and row["drop"] > 0.5
    assert row["drop"] == pytest.approx((row["fp32"] - row["int8"]) * 100, abs=1e-3)
    assert row["refit_steps"] == 100 and row["refit_drop"] < row["drop"]
    assert {"bench", "bench-refit"} <= set(TaskStore(read_repository(repo).store_root).entries())
    assert "re-fitted int8" in (tmp_path / "int8_accuracy.md").read_text()


def test_int8_re_export_keeps_tasks_only_onto_the_graph_that_scored_them(tmp_path, model_dir, task):
    """--overwrite keeps the store's tasks: onto the same int8 graph they stay as scored; onto another one (here the
    dense bias interface's), or onto int8 from fp32, the export is refused and the repository left as it was."""
    from aot.serving.repository import RepositoryError, ServingOptions

    path = tmp_path / "repo"
    export_backbone(str(model_dir), path, cpu_precision="int8")
    scored = export_task(task, path, "plain", progress=False, allowed_drop=100).served_dev
    graph = path / "models" / "backbone" / "1" / INT8_GRAPH
    assert scored["graph"] == file_digest(graph)
    export_backbone(str(model_dir), path, cpu_precision="int8", overwrite=True)  # the same graph: kept
    assert set(TaskStore(read_repository(path).store_root).entries()) == {"plain"}
    with pytest.raises(RepositoryError, match=r"scored on another int8 graph than this export writes \(plain\)"):
        export_backbone(str(model_dir), path, ServingOptions(bias_interface="dense"), cpu_precision="int8",
                        overwrite=True)
    assert file_digest(graph) == scored["graph"] and read_repository(path).record.serving.bias_interface == "rows"
    fp32 = tmp_path / "fp32"
    export_backbone(str(model_dir), fp32)
    export_task(task, fp32, "plain", progress=False)
    with pytest.raises(RepositoryError, match=r"never scored through an int8 engine \(plain\)"):
        export_backbone(str(model_dir), fp32, cpu_precision="int8", overwrite=True)
