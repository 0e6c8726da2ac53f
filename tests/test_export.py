"""Exporter on tiny BERT / RoBERTa / DeBERTa-v2: parity, fusions, storage, atomicity, configs."""

import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import aot.serving.store.entry_history
from aot.exporter.backbone_export import export_backbone
from aot.exporter.configs import instance_count, model_configs, parse_pbtxt, to_pbtxt
from aot.exporter.onnx_export import export_backbone_graph
from aot.exporter.task_export import export_task
from aot.exporter.tensorrt import Profile, build_plan, build_script, trtexec_command
from aot.exporter.version_check import loads_as_served
from aot.serving import protocol
from aot.serving.errors import RequestError
from aot.serving.repository import GPU_STEP_INSTANCES, BackboneRecord, RepositoryError, ServingOptions, read_repository
from aot.serving.store.layout import STAGING
from aot.serving.store.reader import STORE_VERSION
from aot.serving.store.writer import StoreError, TaskStore
from aot.serving.task_registry import TaskRegistry
from aot.training.artifact import FingerprintMismatch
from tests.helpers import make_repository, train_tiny_task
from tests.tiny import ARCHS, save_tiny_model, tiny_backbone


@pytest.mark.parametrize("arch", ARCHS)
def test_backbone_parity_and_fusions(tmp_path, arch):
    backbone = tiny_backbone(arch)
    aot = export_backbone_graph(backbone, tmp_path / "aot", aot=True)
    vanilla = export_backbone_graph(backbone, tmp_path / "vanilla", aot=False)
    assert aot.max_abs_diff < 1e-4 and vanilla.max_abs_diff < 1e-4
    # exporting leaves the caller's encoder as it was: no AoT hooks remain attached
    assert not any(layer._forward_pre_hooks for layer in backbone.architecture.layers(backbone.encoder))
    # the bias inputs cost no fusion: same fused operators, same counts
    assert aot.fused_ops == vanilla.fused_ops
    layers = backbone.num_layers
    assert aot.fused_ops["SkipLayerNormalization"] == 2 * layers
    assert aot.fused_ops.get("BiasGelu", 0) + aot.fused_ops.get("Gelu", 0) + aot.fused_ops.get("FastGelu", 0) == layers
    if arch == "bert":
        assert aot.fused_ops["Attention"] == layers and aot.fused_ops["EmbedLayerNormalization"] == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_bias_graph_equals_the_rows_graph(tmp_path, arch):
    """The dense bias interface (aot_bias = rows[index], one input) computes what the rows interface computes, keeps
    the same fusions, and has the shapes a bucketed TensorRT profile needs: [batch, sequence, L, d]."""
    import onnx

    from aot.exporter.onnx_export import example_inputs
    from aot.serving.engine import cpu_session

    backbone = tiny_backbone(arch)
    rows = export_backbone_graph(backbone, tmp_path / "rows", aot=True)
    dense = export_backbone_graph(backbone, tmp_path / "dense", aot=True, interface="dense")
    assert dense.max_abs_diff < 1e-4 and dense.fused_ops == rows.fused_ops
    graph = onnx.load(str(dense.optimized)).graph
    bias = next(i for i in graph.input if i.name == protocol.AOT_BIAS)
    dims = [d.dim_param or d.dim_value for d in bias.type.tensor_type.shape.dim]
    assert dims == ["batch", "sequence", backbone.num_layers, backbone.hidden_size]
    assert {i.name for i in graph.input} == set(protocol.token_inputs(backbone.uses_token_type_ids)) | {protocol.AOT_BIAS}
    outputs = {}
    for interface, g in (("rows", rows), ("dense", dense)):
        feeds = example_inputs(backbone, True, 3, 11, seed=9, interface=interface)
        outputs[interface] = cpu_session(g.optimized).run(None, {k: v.numpy() for k, v in feeds.items()})[0]
    assert np.abs(outputs["rows"] - outputs["dense"]).max() < 1e-4
    assert np.abs(outputs["rows"]).max() > 0.1


def test_aot_graph_uses_the_biases(tmp_path):
    """Random non-zero rows move the output: the parity check is not comparing two unbiased graphs."""
    import torch

    from aot.exporter.onnx_export import ExportableBackbone, example_inputs
    from aot.serving.engine import cpu_session

    backbone = tiny_backbone("bert")
    graph = export_backbone_graph(backbone, tmp_path, aot=True)
    feeds = example_inputs(backbone, True, 2, 9, seed=5)
    sess = cpu_session(graph.optimized)
    with_bias = sess.run(None, {k: v.numpy() for k, v in feeds.items()})[0]
    feeds[protocol.AOT_ROWS] = torch.zeros_like(feeds[protocol.AOT_ROWS])
    without = sess.run(None, {k: v.numpy() for k, v in feeds.items()})[0]
    assert np.abs(with_bias - without).max() > 0.1
    plain = ExportableBackbone(backbone, aot=False)
    with torch.no_grad():
        pooled, _ = plain(feeds[protocol.INPUT_IDS], feeds[protocol.ATTENTION_MASK], feeds.get(protocol.TOKEN_TYPE_IDS))
    expected = pooled.numpy()  # the graph's first output: the pooled states (the second: the token states)
    assert np.abs(without - expected).max() < 1e-4


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, tiny_models, sentiment_dir):
    root = tmp_path_factory.mktemp("tasks")
    return {(arch, method): train_tiny_task(tiny_models[arch], sentiment_dir, root / f"{arch}-{method}", method)
            for arch in ARCHS for method in ("fc", "kron")}


@pytest.mark.parametrize("arch", ARCHS)
def test_task_parity_fused_and_factored(tmp_path, tiny_models, tasks, arch):
    repo = make_repository(tiny_models[arch], tmp_path / "repo", {})
    for method in ("fc", "kron"):
        for storage in ("fused", "factored"):
            report = export_task(tasks[(arch, method)], repo, f"{method}-{storage}", storage, progress=False)
            assert report.max_abs_logit_diff <= 1e-3, report
    export_task(tasks[(arch, "fc")], repo, "fc-factored-2", "factored", progress=False)
    registry = TaskRegistry(read_repository(repo).store_root)
    # factored FC tasks share one copy of the embedding matrix, whatever their number
    assert registry.resolve("fc-factored").compute_rows.embeddings is registry.resolve("fc-factored-2").compute_rows.embeddings
    vocab = tiny_backbone(arch).embeddings.shape[0]
    ids = np.arange(vocab)
    for method in ("fc", "kron"):
        fused = registry.resolve(f"{method}-fused").rows(ids).astype(np.float32)
        factored = registry.resolve(f"{method}-factored").rows(ids).astype(np.float32)
        assert fused.shape == (vocab, 2, 32)
        np.testing.assert_allclose(factored, fused, rtol=1e-3, atol=1e-3)
        assert np.abs(fused).max() > 0  # trained rows, not zeros


def test_dense_rows_gathered_from_the_pool_slots_equal_rows_by_index(tmp_path, tiny_models, tasks):
    """TaskRegistry.rows_many with indexes (the dense lookup step): each token's row, gathered straight from the
    pool's slots (resident and cache mode) or from storage without a pool, is rows[index], fused and factored."""
    from aot.serving.pool import RowPool

    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"f": (tasks[("bert", "fc")], "fused"),
                                                                    "k": (tasks[("bert", "kron")], "factored")})
    info = read_repository(repo)
    L, d, V = info.num_layers, info.hidden_size, info.vocab_size
    rng = np.random.default_rng(0)
    ids = [np.sort(rng.choice(V, 7, replace=False)) for _ in range(2)]
    indexes = [rng.integers(0, 7, 12).astype(protocol.INDEX_DTYPE) for _ in range(2)]
    for pool in (None, RowPool(2 * V * L * d * 2, L, d, V), RowPool(20 * L * d * 2, L, d, V)):
        registry = TaskRegistry(info.store_root, pool=pool)
        wanted = [(registry.resolve("f"), ids[0]), (registry.resolve("k"), ids[1])]
        for (task, unique), index, bias in zip(wanted, indexes, registry.rows_many(wanted, indexes=indexes), strict=True):
            assert bias.shape == (12, L, d)
            np.testing.assert_allclose(bias, task.rows(unique)[index], atol=1e-3)
        if pool is not None:
            assert all(pool.holds(task.version) for task, _ in wanted)


def test_factored_storage_is_small(tmp_path, sentiment_dir):
    """With a realistic vocabulary the factors are a sliver of the fused table (< 2 %)."""
    import torch

    from aot.training.backbone import encoder_from_config
    from tests.tiny import tiny_config, tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer("bert")
    encoder = encoder_from_config(tiny_config("bert", vocab_size=30522, hidden=64))
    encoder.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    task = train_tiny_task(tmp_path / "model", sentiment_dir, tmp_path / "task", "fc", epochs=1, rank=8)
    repo = make_repository(tmp_path / "model", tmp_path / "repo", {})
    fused = export_task(task, repo, "f", "fused", progress=False)
    factored = export_task(task, repo, "g", "factored", progress=False)
    assert fused.fused_bytes == 30522 * 2 * 64 * 2
    factors = (read_repository(repo).store_root / factored.folder / "factors.safetensors").stat().st_size
    assert factors < 0.02 * fused.fused_bytes
    assert factored.max_abs_logit_diff <= 1e-3


def test_fingerprint_mismatch_refused(tmp_path, tiny_models, sentiment_dir, tasks):
    other = save_tiny_model("bert", tmp_path / "other", seed=7)
    repo = make_repository(other, tmp_path / "repo", {})
    with pytest.raises(FingerprintMismatch) as err:
        export_task(tasks[("bert", "fc")], repo, "x", progress=False)
    message = str(err.value)
    assert read_repository(repo).fingerprint in message
    assert json.loads((tasks[("bert", "fc")] / "config.json").read_text())["backbone"]["fingerprint"] in message
    assert TaskStore(read_repository(repo).store_root).entries() == {}


def test_only_aot_tasks_are_exported(tmp_path, tiny_models, sentiment_dir):
    lora = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path / "lora", "lora", epochs=1)
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {})
    with pytest.raises(StoreError, match="method 'lora'"):
        export_task(lora, repo, "x", progress=False)


@pytest.mark.parametrize("name", ["", "../evil", ".hidden", "a b", "x" * 200])
def test_bad_task_names(tmp_path, tiny_models, tasks, name):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {})
    with pytest.raises(StoreError, match="invalid task name"):
        export_task(tasks[("bert", "fc")], repo, name, progress=False)


def test_reexport_swaps_and_remove(tmp_path, tiny_models, tasks, monkeypatch):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"t": (tasks[("bert", "fc")], "fused")})
    store = TaskStore(read_repository(repo).store_root)
    first = store.entries()["t"].folder
    export_task(tasks[("bert", "kron")], repo, "t", "factored", progress=False, keep=1)  # no version kept
    second = store.entries()["t"]
    assert second.folder != first and second.storage == "factored"
    # the superseded version stays a while for requests already pinned to it, then goes
    assert (store.root / first).is_dir() and first in store.index().retired
    monkeypatch.setattr(aot.serving.store.entry_history, "RETIRED_GRACE", 0.0)
    store.remove("t")
    assert store.entries() == {} and not (store.root / first).exists() and not (store.root / second.folder).exists()
    assert store.index().retired == {}
    with pytest.raises(StoreError, match="unknown task 't'"):
        store.remove("t")


def test_killed_export_leaves_store_loadable(tmp_path, tiny_models, tasks):
    """SIGKILL an export while it writes the fused table: the store still loads, with the old tasks only."""
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"keep": (tasks[("bert", "fc")], "fused")})
    script = textwrap.dedent(f"""
        import time, numpy as np
        import aot.exporter.task_export as te
        real = te._write_fused
        def slow(*a, **k):
            real(*a, **k)
            print("WRITTEN", flush=True)
            time.sleep(60)
        te._write_fused = slow
        te.export_task({str(tasks[("bert", "kron")])!r}, {str(repo)!r}, "new", progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert proc.stdout.readline().strip() == "WRITTEN"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store_root = read_repository(repo).store_root
    registry = TaskRegistry(store_root)
    assert registry.names() == ["keep"] and not registry.errors()
    assert any(p.name.startswith(f"{proc.pid}.") and "-new@" in p.name for p in (store_root / STAGING).iterdir())
    export_task(tasks[("bert", "kron")], repo, "new", progress=False)
    registry.refresh()
    assert registry.names() == ["keep", "new"]
    assert not any((store_root / STAGING).iterdir())  # a dead writer's debris is removed


def test_corrupt_task_does_not_hide_the_others(tmp_path, tiny_models, tasks):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"good": (tasks[("bert", "fc")], "fused"),
                                                                     "bad": (tasks[("bert", "kron")], "fused")})
    store = TaskStore(read_repository(repo).store_root)
    (store.root / store.entries()["bad"].folder / "table.npy").write_bytes(b"garbage")
    registry = TaskRegistry(store.root)
    assert registry.resolve("good").rows(np.array([1, 2])).shape == (2, 2, 32)
    assert registry.errors() == {}  # a version is read when a request first needs it
    with pytest.raises(RequestError, match="task 'bad' .* is corrupt") as err:
        registry.resolve("bad")
    assert "bad" in registry.errors()
    assert str(store.root) not in str(err.value)  # no server paths in what clients read
    with pytest.raises(RequestError, match=r"unknown task 'zzz'; known tasks: good"):
        registry.resolve("zzz")


def _as_v3_with_a_v1_store(repo: Path) -> dict:
    """Turn a repository back into what the previous release wrote: record v3, a task store of format v1 (one
    manifest.json naming every task). Returns its entries."""
    store = TaskStore(read_repository(repo).store_root)
    state = store.state()
    tasks = {name: {k: v for k, v in entry.items() if k != "meta"} for name, entry in state.tasks.items()}
    manifest = {"format": "aot-task-store", "format_version": 1, "backbone": store.identity()["backbone"],
                "tasks": tasks, "retired": {v: i["time"] for v, i in state.retired.items()},
                "retired_digests": {v: i["digests"] for v, i in state.retired.items() if "digests" in i}}
    for name in ("log", "index"):
        shutil.rmtree(store.root / name, ignore_errors=True)
    for name in ("generation", "store.json"):
        (store.root / name).unlink(missing_ok=True)
    (store.root / "manifest.json").write_text(json.dumps(manifest))
    record = json.loads((repo / "aot_repository.json").read_text())
    (repo / "aot_repository.json").write_text(json.dumps({**record, "format_version": 3}))
    return tasks


def test_previous_release_repository_is_upgraded_with_its_tasks(tmp_path, tiny_models, tasks):
    """A v3 repository with a v1 store (one manifest.json): refused with the way out, then `aot export backbone
    --overwrite` turns its manifest into the change log's first change, every task and digest kept, and serves."""
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"t": (tasks[("bert", "fc")], "fused"),
                                                                     "u": (tasks[("bert", "kron")], "factored")})
    export_task(tasks[("bert", "fc")], repo, "t", "factored", progress=False, keep=1)  # one retired version too
    old = _as_v3_with_a_v1_store(repo)
    with pytest.raises(RepositoryError, match=r"not an aot-repository v4 file .* --overwrite`: it keeps the tasks"):
        read_repository(repo)
    from aot.exporter.backbone_export import export_backbone

    export_backbone(str(tiny_models["bert"]), repo, overwrite=True)
    store = TaskStore(read_repository(repo).store_root)
    assert not (store.root / "manifest.json").exists() and store.identity()["format_version"] == STORE_VERSION
    entries = store.entries()
    assert {n: (e.folder, e.storage, e.digests) for n, e in entries.items()} == \
        {n: (e["folder"], e["storage"], e["digests"]) for n, e in old.items()}
    assert entries["u"].meta["method"] == "kron" and len(store.index().retired) == 1
    registry = TaskRegistry(store.root)
    assert registry.errors() == {} and registry.resolve("t").storage == "factored"
    assert store.verify(loads_as_served) == {"t": None, "u": None}


def test_existing_repository_needs_overwrite(tmp_path, tiny_models, tasks):
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"t": (tasks[("bert", "fc")], "fused")})
    from aot.exporter.backbone_export import export_backbone

    with pytest.raises(RepositoryError, match="already exists"):
        export_backbone(str(tiny_models["bert"]), repo)
    export_backbone(str(tiny_models["bert"]), repo, overwrite=True)  # same backbone: tasks are kept
    assert list(TaskStore(read_repository(repo).store_root).entries()) == ["t"]
    record = json.loads((repo / "aot_repository.json").read_text())  # a repository of the previous format
    (repo / "aot_repository.json").write_text(json.dumps({**record, "format_version": 2}))
    with pytest.raises(RepositoryError, match=r"not an aot-repository v4 file .* --overwrite`: it keeps the tasks"):
        read_repository(repo)
    export_backbone(str(tiny_models["bert"]), repo, overwrite=True)  # upgraded, its tasks kept
    assert json.loads((repo / "aot_repository.json").read_text())["format_version"] == 4
    assert list(TaskStore(read_repository(repo).store_root).entries()) == ["t"]
    with pytest.raises(RepositoryError, match="holds tasks for backbone"):
        export_backbone(str(tiny_models["roberta"]), repo, overwrite=True)



def test_repository_of_the_previous_protocol_is_upgraded_with_its_tasks(tmp_path, tiny_models, tasks):
    """A repository exported before the one top-level package (protocol 6: its model files import `serving`) is
    refused with the command that upgrades it; that command rewrites the model files and keeps the tasks."""
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"t": (tasks[("bert", "fc")], "fused")})
    record = json.loads((repo / "aot_repository.json").read_text())
    (repo / "aot_repository.json").write_text(json.dumps({**record, "protocol_version": 6}))
    model_file = repo / "models" / "aot" / "1" / "model.py"
    model_file.write_text(model_file.read_text().replace("from aot.serving", "from serving"))
    with pytest.raises(RepositoryError, match=r"protocol version 6 is not 7 .* --overwrite` keeps its tasks"):
        read_repository(repo)
    from aot.exporter.backbone_export import export_backbone

    export_backbone(str(tiny_models["bert"]), repo, overwrite=True)
    assert read_repository(repo).record.protocol_version == 7
    assert "from serving" not in model_file.read_text() and "from aot.serving" in model_file.read_text()
    assert list(TaskStore(read_repository(repo).store_root).entries()) == ["t"]

# --- the generated configs: one table of repositories, each concern checked on every row it applies to ---------

@dataclass(frozen=True)
class ConfigCase:
    """A repository the configs are generated for: its engine, bias interface and token types (a BERT-like encoder
    takes token_type_ids, a RoBERTa-like one does not)."""

    engine: str
    interface: str
    uses_tt: bool

    def __str__(self) -> str:
        return f"{self.engine}-{self.interface}-{'bert' if self.uses_tt else 'roberta'}"

    @property
    def tokens(self) -> list[str]:
        return protocol.token_inputs(self.uses_tt)

    @property
    def requests(self) -> list[str]:
        """What a client sends: TEXT (+ TEXT_PAIR) or the token ids it tokenized, with TASK."""
        return [protocol.TEXT, protocol.TEXT_PAIR, protocol.TASK, *self.tokens]

    def configs(self, target: str) -> dict:
        options = ServingOptions(engine=self.engine, bias_interface=self.interface, buckets=(16, 128, 512),
                                 max_batch_size=8)
        return model_configs(_config_record(options, self.uses_tt), target)


def _config_record(options: ServingOptions, uses_tt: bool = True, max_seq: int = 256) -> BackboneRecord:
    """The record of a tiny repository (L=3, d=48; TensorRT's profile up to `max_seq` tokens) served with
    `options`: what the configs are generated from."""
    profile = dataclasses.asdict(Profile(max_batch=options.max_batch_size, max_seq=max_seq))
    return BackboneRecord(backbone={"model": "tiny", "fingerprint": "tiny"}, uses_token_type_ids=uses_tt, num_layers=3,
                          hidden_size=48, vocab_size=100, type_vocab_size=2 if uses_tt else 0, max_positions=512,
                          store="tasks", tokenizer="models/tokenizer/1/tokenizer", serving=options,
                          tensorrt_profile=profile if options.engine == "tensorrt" else None)


CONFIG_CASES = [ConfigCase(engine, interface, uses_tt) for engine in ("onnx", "tensorrt")
                for interface in protocol.BIAS_INTERFACES for uses_tt in (True, False)]
TARGETS = ("cpu", "gpu")
MODELS = {"tokenizer", "aot_lookup", "backbone", "backbone_vanilla", "head", "task_list", "aot", "vanilla"}
# What aot and vanilla answer, on either target
ANSWER = [(protocol.ANSWER, [1]), (protocol.LOGITS, [-1]), (protocol.LABEL, [1]), (protocol.TASK_VERSION, [1])]
# Tokenizer and head run one thread per instance, so a GPU host runs several; one lookup (its own device pool)
LIGHT_STEP_INSTANCES = {"cpu": 1, "gpu": GPU_STEP_INSTANCES}
# The bias the GPU lookup step sends and the native backbone takes, per interface (dims after the batch axis):
# ragged rows and an index (Triton adds the row offsets as a batch input), or one dense bias per token, [S, L, d]
GPU_BIAS = {"rows": {protocol.AOT_ROWS: [-1], protocol.AOT_INDEX: [-1]}, "dense": {protocol.AOT_BIAS: [-1, 3, 48]}}
GPU_RAGGED = {"rows": {protocol.AOT_ROWS}, "dense": set()}
GPU_BATCH_INPUTS = {"rows": [protocol.AOT_ROW_OFFSETS], "dense": []}
GPU_PLATFORMS = {"onnx": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}
# TensorRT's graph specs, (batch, lower bound, bucket): every bucket within the profile (16 and 128 of 16, 128, 512;
# max_seq 256) x graph_batch_sizes(8), each spec taking the batches above the previous one
GRAPH_SPECS = [(b, lo, seq) for seq in (16, 128) for lo, b in ((1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (7, 8))]


def _check_cuda_graphs(config, captured: bool) -> None:
    """`captured`: CUDA graphs on, one spec per GRAPH_SPECS, each input (and its lower bound) in the bucket's shape;
    else no graphs and no specs."""
    cuda = config.optimization.cuda
    assert cuda.graphs == captured
    specs = [(g.batch_size, g.graph_lower_bound.batch_size, g.input[protocol.INPUT_IDS].dim[0])
             for g in cuda.graph_spec]
    assert specs == (GRAPH_SPECS if captured else [])
    for g in cuda.graph_spec:
        seq = g.input[protocol.INPUT_IDS].dim[0]
        shapes = {i.name: [seq if n == -1 else n for n in i.dims] for i in config.input}
        assert {name: list(s.dim) for name, s in g.input.items()} == shapes
        assert {name: list(s.dim) for name, s in g.graph_lower_bound.input.items()} == shapes
        if protocol.AOT_BIAS in shapes:
            assert shapes[protocol.AOT_BIAS] == [seq, 3, 48]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_every_config_round_trips_through_triton_protobuf(case, target):
    configs = case.configs(target)
    assert set(configs) == MODELS
    for name, config in configs.items():
        parsed = parse_pbtxt(to_pbtxt(config))  # round trip through Triton's own ModelConfig protobuf
        assert parsed == config and parsed.name == name


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_clients_send_optional_inputs_and_get_the_answer(case, target):
    """Every input optional (the first stage refuses what is missing), token ids of any length batched together in
    the tokenizer step; aot and vanilla answer the JSON answer, logits, label and the task version."""
    configs = case.configs(target)
    for model in ("aot", "vanilla", "tokenizer"):
        assert [(i.name, i.optional) for i in configs[model].input] == [(n, True) for n in case.requests]
    tok = {i.name: i for i in configs["tokenizer"].input}
    assert all(tok[n].allow_ragged_batch and list(tok[n].dims) == [-1] for n in case.tokens)
    for model in ("aot", "vanilla"):
        assert [(o.name, list(o.dims)) for o in configs[model].output] == ANSWER


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_light_steps_instances(case, target):
    configs = case.configs(target)
    instances = LIGHT_STEP_INSTANCES[target]
    assert [instance_count(configs[m]) for m in ("tokenizer", "head", "aot_lookup")] == [instances, instances, 1]


def test_step_instances_sets_both_targets():
    assert [instance_count(model_configs(_config_record(ServingOptions(step_instances=3)), t)["head"])
            for t in TARGETS] == [3, 3]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_gpu_lookup_sends_the_bias_the_backbone_takes(case):
    configs = case.configs("gpu")
    backbone = configs["backbone"]
    inputs = {i.name: i for i in backbone.input}
    bias = GPU_BIAS[case.interface]
    assert set(inputs) == set(case.tokens) | set(bias)
    assert {n: list(inputs[n].dims) for n in bias} == bias
    assert {n for n, i in inputs.items() if i.allow_ragged_batch} == GPU_RAGGED[case.interface]
    assert [b.target_name[0] for b in backbone.batch_input] == GPU_BATCH_INPUTS[case.interface]
    assert {o.name: list(o.dims) for o in configs["aot_lookup"].output} == bias


@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_gpu_ensembles_chain_the_steps(case):
    configs = case.configs("gpu")
    aot = configs["aot"].ensemble_scheduling.step
    assert [s.model_name for s in aot] == ["tokenizer", "aot_lookup", "backbone", "head"]
    assert [s.model_name for s in configs["vanilla"].ensemble_scheduling.step] == ["tokenizer", "backbone_vanilla",
                                                                                   "head"]
    assert set(aot[0].input_map.items()) == {(n, n) for n in case.requests}
    lookup = {o.name for o in configs["aot_lookup"].output}
    assert set(aot[1].output_map) == lookup == set(aot[2].input_map) - set(case.tokens)


@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_gpu_backbones_run_on_the_native_backend(case):
    configs = case.configs("gpu")
    for name in ("backbone", "backbone_vanilla"):
        assert configs[name].platform == GPU_PLATFORMS[case.engine]
        assert configs[name].instance_group[0].kind == configs[name].instance_group[0].KIND_GPU


@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_gpu_cuda_graphs_where_shapes_are_fixed_per_bucket(case):
    """TensorRT: CUDA graphs for the graphs whose shapes are fixed per bucket (vanilla, dense); none for ragged rows
    (a padded replay reads stale indices), none for ONNX Runtime."""
    configs = case.configs("gpu")
    tensorrt = case.engine == "tensorrt"
    _check_cuda_graphs(configs["backbone"], captured=tensorrt and case.interface == "dense")
    _check_cuda_graphs(configs["backbone_vanilla"], captured=tensorrt)


@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_cpu_aot_and_vanilla_are_one_fused_step_each(case):
    """Tokenizer, lookup, encoder and head in one python step per name, on the graph of its backbone."""
    configs = case.configs("cpu")
    for model, graph in (("aot", "backbone"), ("vanilla", "backbone_vanilla")):
        fused = configs[model]
        assert fused.backend == "python" and not fused.ensemble_scheduling.step
        assert fused.parameters["aot"].string_value == str(model == "aot").lower()
        assert fused.parameters["onnx_file"].string_value == f"{graph}/1/model.onnx"
        assert instance_count(fused) == ServingOptions().cpu_instances


@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_cpu_backbone_looks_rows_up_itself(case):
    """The separate python backbone (loaded only when asked) takes the task version, not a bias."""
    backbone = case.configs("cpu")["backbone"]
    assert {i.name for i in backbone.input} == set(case.tokens) | {protocol.TASK_VERSION}
    assert backbone.backend == "python" and not backbone.batch_input


def test_written_repository_configs_parse(tmp_path, tiny_models):
    repo = make_repository(tiny_models["roberta"], tmp_path / "repo", {})
    files = sorted((repo / "models").glob("*/config.pbtxt")) + sorted((repo / "models").glob("*/configs/cpu.pbtxt"))
    assert len(files) == 16
    for path in files:
        parse_pbtxt(path.read_text())
    for model in ("tokenizer", "aot_lookup", "backbone", "backbone_vanilla", "head", "task_list", "aot", "vanilla"):
        assert (repo / "models" / model / "1" / "model.py").is_file()
    assert (repo / "models" / "backbone" / "1" / "model.onnx").is_file()


def test_tensorrt_profiles_and_commands(tmp_path):
    profile = Profile(opt_batch=4, max_batch=16, opt_seq=64, max_seq=256)
    names = protocol.token_inputs(True) + [protocol.AOT_ROWS, protocol.AOT_INDEX, protocol.AOT_ROW_OFFSETS]
    shapes = profile.shapes(names, num_layers=6, hidden=384)
    assert shapes[protocol.INPUT_IDS] == ((1, 1), (4, 64), (16, 256))
    assert shapes[protocol.AOT_ROWS] == ((6 * 384,), (4 * 64 * 6 * 384,), (16 * 256 * 6 * 384,))
    assert shapes[protocol.AOT_ROW_OFFSETS] == ((2,), (5,), (17,))
    cmd = trtexec_command("a.onnx", "a.plan", shapes, fp16=True)
    assert "--minShapes=input_ids:1x1,attention_mask:1x1" in cmd and "aot_row_offsets:17" in cmd and "--fp16" in cmd
    script = build_script({"backbone": {"shapes": shapes}}, fp16=False)
    assert "if [ ! -s models/backbone/1/model.plan ]" in script and "--fp16" not in script
    script_path = tmp_path / "b.sh"
    script_path.write_text(script)
    assert subprocess.run(["sh", "-n", str(script_path)]).returncode == 0  # valid shell
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="tensorrt is not installed"):
            build_plan(tmp_path / "m.onnx", tmp_path / "m.plan", shapes, fp16=False)


def test_lookup_bytes_against_dense():
    # MiniLM: L=6, d=384; a 128-token sequence with 70 distinct tokens
    assert protocol.lookup_bytes(70, 128, 6, 384) == 70 * 6 * 384 * 2 + 128 * 4
    assert protocol.dense_bias_bytes(128, 6, 384) == 128 * 6 * 384 * 2  # fp16, like the rows
    assert protocol.lookup_bytes(70, 128, 6, 384) < protocol.dense_bias_bytes(128, 6, 384) * 0.6


def test_auto_storage_follows_the_pool_budget(tmp_path, tiny_models, tasks):
    """auto: fused while every task fits resident in the repository's pool, then factored; both costs reported."""
    info = {"bert": tiny_backbone("bert")}["bert"]
    table = int(info.embeddings.shape[0]) * info.num_layers * info.hidden_size * 2
    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {}, pool_bytes=2 * table)
    reports = [export_task(tasks[("bert", "fc")], repo, f"t{i}", progress=False) for i in range(3)]
    assert [r.storage for r in reports] == ["fused", "fused", "factored"]
    first = reports[0].storage_advice["auto_reason"]
    assert "the store's 1 task(s) fit the task pool" in first and first.endswith("from task 3 on, auto stores tasks "
                                                                                  "factored")
    advice = reports[2].storage_advice
    assert advice["fused_bytes"] == table and advice["tasks_resident_in_pool"] == 2 and advice["tasks_in_store"] == 3
    assert advice["factored_bytes"] > 0  # (tiny vocabulary: here the factors are larger than the table)
    assert reports[0].max_abs_logit_diff <= 1e-3 and reports[2].max_abs_logit_diff <= 1e-3


def test_tensorrt_repository_saves_parity_data_that_polygraphy_checks(tmp_path, tiny_models):
    """A --format tensorrt repository: CUDA graphs on where shapes are fixed per bucket (the vanilla backbone; the
    AoT one in the default rows interface has none: ragged rows match no graph), and per backbone the inputs and
    ONNX Runtime outputs that
    build_engines.sh checks each plan against with Polygraphy. Checked here with Polygraphy's ONNX Runtime runner
    (TensorRT is absent): the files load, agree, and a wrong output fails the check."""
    import shlex

    from aot.exporter.tensorrt import PARITY_OUTPUTS, parity_command

    repo = tmp_path / "repo"
    export_backbone(str(tiny_models["bert"]), repo, ServingOptions(engine="tensorrt"))
    config = parse_pbtxt((repo / "models" / "backbone" / "config.pbtxt").read_text())
    assert config.platform == "tensorrt_plan" and not config.optimization.cuda.graphs
    vanilla = parse_pbtxt((repo / "models" / "backbone_vanilla" / "config.pbtxt").read_text())
    assert vanilla.optimization.cuda.graphs and len(vanilla.optimization.cuda.graph_spec) > 0
    script = (repo / "build_engines.sh").read_text()
    polygraphy = str(Path(sys.executable).with_name("polygraphy"))
    for name in ("backbone", "backbone_vanilla"):
        folder = f"models/{name}/1"
        assert parity_command(folder, fp16=False, plan=f"{folder}/model.plan") in script
        ok = subprocess.run(shlex.split(parity_command(folder, fp16=False, polygraphy=polygraphy)), cwd=repo,
                            capture_output=True, text=True)
        assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    outputs = repo / "models" / "backbone" / "1" / PARITY_OUTPUTS
    from polygraphy.comparator import RunResults

    results = RunResults.load(str(outputs))
    for _, iterations in results:
        for iteration in iterations:
            for key in iteration.keys():
                iteration[key] = iteration[key] + 0.5
    results.save(str(outputs))
    bad = subprocess.run(shlex.split(parity_command("models/backbone/1", fp16=False, polygraphy=polygraphy)),
                         cwd=repo, capture_output=True, text=True)
    assert bad.returncode != 0
    assert 'rm -f models/backbone/1/model.plan' in script and "Triton will not start on it" in script


def test_config_checks_find_what_triton_would_refuse(tmp_path, tiny_models):
    """Both config sets of a written repository pass; each broken copy is named by its problem."""
    from aot.exporter.config_checks import check_configs

    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {})
    models = repo / "models"
    assert check_configs(models) == [] and check_configs(models, "configs/cpu.pbtxt") == []
    text = {m: (models / m / "config.pbtxt").read_text() for m in ("backbone", "aot")}
    cases = [
        ("backbone", 'name: "aot_rows"\n  data_type: TYPE_FP16\n  dims: -1',
         'name: "aot_rows"\n  data_type: TYPE_FP16\n  dims: -1\n  dims: 4', "ragged input aot_rows has dims [-1, 4]"),
        ("backbone", "data_type: TYPE_FP16", "data_type: TYPE_FP32", "'aot_rows' is TYPE_FP32 of rank 1 in the config"),
        ("backbone", "source_input: \"aot_rows\"", "source_input: \"aot_index\"", "which is not a ragged input"),
    ]
    for model, old, new, message in cases:
        assert old in text[model], (model, old)
        (models / model / "config.pbtxt").write_text(text[model].replace(old, new, 1))
        problems = check_configs(models)
        assert any(message in p for p in problems), (message, problems)
        (models / model / "config.pbtxt").write_text(text[model])

    def broken_ensemble(edit, message):
        config = parse_pbtxt(text["aot"])
        edit({s.model_name: s for s in config.ensemble_scheduling.step})
        (models / "aot" / "config.pbtxt").write_text(to_pbtxt(config))
        problems = check_configs(models)
        assert any(message in p for p in problems), (message, problems)
        (models / "aot" / "config.pbtxt").write_text(text["aot"])

    broken_ensemble(lambda steps: setattr(steps["head"], "model_name", "heads"), "step 'heads' is not a model")
    broken_ensemble(lambda steps: steps["backbone"].input_map.update({protocol.AOT_INDEX: "_aot_idx"}),
                    "reads '_aot_idx', which nothing before it writes")
    broken_ensemble(lambda steps: steps["backbone"].input_map.update({protocol.AOT_ROWS: "_input_ids"}),
                    "backbone.aot_rows is TYPE_FP16 but '_input_ids' is TYPE_INT64")
    broken_ensemble(lambda steps: steps["backbone"].input_map.pop(protocol.AOT_INDEX),
                    "backbone.aot_index is required and not mapped")


def test_dense_tensorrt_repository_and_its_cuda_graph_specs(tmp_path, tiny_models):
    """--format tensorrt --bias-interface dense: the plan is built from a graph taking aot_bias in the profile's
    shapes, its configs pass the checks, and graph specs Triton's TensorRT backend would refuse (or never capture)
    are named. The torch engine has no lookup step: the option is refused there."""
    from aot.exporter.config_checks import check_configs

    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {}, engine="tensorrt", bias_interface="dense",
                           buckets=(8, 16), max_batch_size=4)
    models = repo / "models"
    assert check_configs(models) == [] and check_configs(models, "configs/cpu.pbtxt") == []
    info = read_repository(repo)
    L, d = info.num_layers, info.hidden_size
    script = (repo / "build_engines.sh").read_text()
    assert f"aot_bias:1x1x{L}x{d}" in script and f"aot_bias:4x16x{L}x{d}" in script and "aot_rows" not in script
    assert info.options.bias_interface == "dense"
    config = parse_pbtxt((models / "backbone" / "config.pbtxt").read_text())
    assert [(g.batch_size, g.input[protocol.AOT_BIAS].dim[0]) for g in config.optimization.cuda.graph_spec] == [
        (b, s) for s in (8, 16) for b in (1, 2, 3, 4)]
    text = (models / "backbone" / "config.pbtxt").read_text()

    def broken(edit, message):
        bad = parse_pbtxt(text)
        edit(bad.optimization.cuda.graph_spec)
        (models / "backbone" / "config.pbtxt").write_text(to_pbtxt(bad))
        problems = check_configs(models)
        assert any(message in p for p in problems), (message, problems)
        (models / "backbone" / "config.pbtxt").write_text(text)

    broken(lambda specs: specs[0].input.pop(protocol.AOT_BIAS), "expected every input")
    broken(lambda specs: setattr(specs[3], "batch_size", 5), "<= max_batch_size 4")
    broken(lambda specs: specs[1].input[protocol.AOT_BIAS].dim.append(1), "does not fit its dims")
    broken(lambda specs: specs[1].input[protocol.INPUT_IDS].dim.__setitem__(0, -1), "below 0")
    broken(lambda specs: specs[2].graph_lower_bound.input[protocol.INPUT_IDS].dim.__setitem__(0, 99), "needs a lower bound")
    with pytest.raises(RepositoryError, match="--bias-interface dense applies to --format onnx and tensorrt"):
        export_backbone(str(tiny_models["bert"]), tmp_path / "t", ServingOptions(engine="torch", bias_interface="dense"))
    with pytest.raises(RepositoryError, match="bias interface 'sparse': expected one of rows, dense"):
        ServingOptions(bias_interface="sparse")


def test_export_backbone_flags_come_from_the_serving_options():
    """`aot export backbone`'s serving flags are generated from ServingOptions' fields: the same defaults, the
    option's limits as one-line usage errors, values landing in the options."""
    from aot.cli.arguments import dataclass_from_arguments
    from aot.cli.main import build_parser

    def options(*flags):
        args = build_parser().parse_args(["export", "backbone", "--model", "m", "--repo", "r", *flags])
        return dataclass_from_arguments(ServingOptions, args)

    assert options() == ServingOptions()
    assert options("--queue-delay-us", "0", "--buckets", "64,16", "--format", "torch", "--pool-bytes", "0") == \
        ServingOptions(backbone_queue_delay_us=0, buckets=(16, 64), engine="torch", pool_bytes=0)
    for flag, value in (("--max-batch-size", "0"), ("--cpu-threads", "-1"), ("--bias-interface", "sparse"),
                        ("--buckets", "16,x")):
        with pytest.raises(SystemExit):
            options(flag, value)


def test_graph_batch_sizes_bound_the_padding():
    """A batch replays the graph of the next size up: steps of at most 1.5x above 4 (Triton's own default list jumps
    from 16 to max_batch_size, so at 32 a batch of 17 would compute 32 sequences)."""
    from aot.exporter.configs import graph_batch_sizes

    assert graph_batch_sizes(32) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert graph_batch_sizes(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert graph_batch_sizes(5) == [1, 2, 3, 4, 5] and graph_batch_sizes(1) == [1]
    for top in range(1, 130):
        sizes = graph_batch_sizes(top)
        assert sizes[0] == 1 and sizes[-1] == top
        assert all(b / a <= 1.5 for a, b in itertools.pairwise(sizes) if a >= 4)


def test_graph_spec_checks_follow_the_tensorrt_backend():
    """The spec checks accept what tensorrt_backend accepts (a spec without a lower bound; a ragged input's 1-D
    shape, with the batch input's) and name what it refuses or never captures."""
    from aot.exporter.config_checks import _check_graph_specs

    options = ServingOptions(engine="tensorrt", bias_interface="rows", buckets=(16, 128), max_batch_size=8)
    rows = model_configs(_config_record(options, uses_tt=False, max_seq=128), "gpu")["backbone"]
    assert not rows.optimization.cuda.graph_spec and _check_graph_specs("backbone", rows) == []
    spec = rows.optimization.cuda.graph_spec.add(batch_size=4)  # no lower bound: the spec is its own
    shapes = {protocol.INPUT_IDS: [16], protocol.ATTENTION_MASK: [16], protocol.AOT_INDEX: [16], protocol.AOT_ROWS: [4 * 16 * 3 * 48],
              protocol.AOT_ROW_OFFSETS: [5]}
    for tensor, dims in shapes.items():
        spec.input[tensor].dim.extend(dims)
    assert _check_graph_specs("backbone", rows) == []

    def problems(edit) -> list[str]:
        bad = type(rows)()
        bad.CopyFrom(rows)
        edit(bad.optimization.cuda.graph_spec[0])
        return _check_graph_specs("backbone", bad)

    assert "expected every input" in problems(lambda g: g.input.pop(protocol.AOT_ROW_OFFSETS))[0]
    assert "needs one dimension" in problems(lambda g: g.input[protocol.AOT_ROWS].dim.append(1))[0]
    assert "below 0" in problems(lambda g: g.input[protocol.AOT_INDEX].dim.__setitem__(0, -2))[0]
    assert "<= max_batch_size 8" in problems(lambda g: setattr(g, "batch_size", 9))[0]

    def lower(g, batch, rows_dim):
        g.graph_lower_bound.batch_size = batch
        for tensor, dims in shapes.items():
            g.graph_lower_bound.input[tensor].dim.extend(dims)
        g.graph_lower_bound.input[protocol.AOT_ROWS].dim[0] = rows_dim

    assert problems(lambda g: lower(g, 3, 0)) == []
    assert "below 0" in problems(lambda g: lower(g, 3, -1))[0]  # the backend refuses a negative lower bound too
    assert "lower bound batch 5 <= batch" in problems(lambda g: lower(g, 5, 0))[0]
    assert "needs a lower bound" in problems(lambda g: lower(g, 3, 10**6))[0]


def test_onnx_gpu_config_runs_the_fp16_graph_where_parity_allows(tmp_path, tiny_models):
    """Default --format onnx: an fp16 twin of each graph, checked against PyTorch, for ONNX Runtime on the GPU; the
    CPU configs keep the fp32 graph. --precision fp32 keeps fp32 everywhere; a twin beyond the tolerance is not kept."""
    from aot.exporter.onnx_export import FP16_FILE, FP16_TOLERANCE, export_fp16_graph
    from tests.tiny import tiny_backbone

    report = export_backbone(str(tiny_models["bert"]), tmp_path / "a")
    models = tmp_path / "a" / "models"
    for name in ("backbone", "backbone_vanilla"):
        assert 0 < report.max_abs_diff[f"{name}-fp16"] <= FP16_TOLERANCE
        assert (models / name / "1" / FP16_FILE).is_file()
        assert parse_pbtxt((models / name / "config.pbtxt").read_text()).default_model_filename == FP16_FILE
        cpu = parse_pbtxt((models / name / "configs" / "cpu.pbtxt").read_text())
        assert cpu.parameters["onnx_file"].string_value == f"{name}/1/model.onnx"
    for name, graph in (("aot", "backbone"), ("vanilla", "backbone_vanilla")):  # the CPU configs' fused steps
        cpu = parse_pbtxt((models / name / "configs" / "cpu.pbtxt").read_text())
        assert cpu.parameters["onnx_file"].string_value == f"{graph}/1/model.onnx"
    assert read_repository(tmp_path / "a").record.precision == "fp16"

    export_backbone(str(tiny_models["bert"]), tmp_path / "b", precision="fp32")
    assert not list((tmp_path / "b" / "models").rglob(FP16_FILE))
    config = parse_pbtxt((tmp_path / "b" / "models" / "backbone" / "config.pbtxt").read_text())
    assert config.default_model_filename == "model.onnx"
    with pytest.raises(RepositoryError, match="--precision applies to --format onnx and tensorrt"):
        export_backbone(str(tiny_models["bert"]), tmp_path / "c", ServingOptions(engine="torch"), precision="fp16")

    graph = models / "backbone" / "1" / "model.onnx"
    path, diff = export_fp16_graph(tiny_backbone("bert"), graph, aot=True, tolerance=1e-9)
    assert path is None and diff > 1e-9 and not (graph.parent / FP16_FILE).exists()
