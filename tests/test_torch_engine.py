"""The torch engine (`aot export backbone --format torch`): export checks, the engine in-process (pool slots, rows,
mixed batches), and serving through the real local tritonserver on CPU, equal to `aot predict`. The CUDA path
(fp16, CUDA graphs) needs a GPU: docs/benchmarks.md names the command that runs it there."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from aot.client.client import Client
from aot.exporter.configs import parse_pbtxt
from aot.serving import protocol
from aot.serving.engine import EncoderBatch
from aot.serving.pool import RowPool
from aot.serving.repository import (
    BackboneRecord,
    ServingOptions,
    largest_batch_bytes,
    memory_pool_bytes,
    read_repository,
)
from aot.serving.supervision.admin_key import GRPC_ADMIN_HEADER
from aot.serving_torch.engine import DeviceRows, TorchBackbone
from aot.training.predict import Predictor
from tests.helpers import make_repository, train_tiny_task

TEXTS = ["good w1 w2", "w3 awful w4 w5 the movie", "superb plot w7 w8 w9", "dull w10", " ".join(["w9 great"] * 40)]


@pytest.mark.parametrize("arch", ["bert", "roberta", "deberta-v2"])
def test_export_writes_the_encoder_checked_through_the_engine(tmp_path, tiny_models, arch):
    from aot.exporter.backbone_export import export_backbone

    report = export_backbone(str(tiny_models[arch]), tmp_path / "repo", ServingOptions(engine="torch"))
    assert 0 <= report.max_abs_diff["torch"] <= 1e-4
    repo = read_repository(tmp_path / "repo")
    assert (repo.encoder_dir / "model.safetensors").is_file() and "encoder/model.safetensors" in report.sizes
    assert not list(repo.models.rglob("*.onnx")), "the torch engine needs no backbone graph"
    assert not (repo.models / "aot_lookup").exists(), "its backbone step looks rows up itself"
    for name, device in (("configs/cpu.pbtxt", "cpu"), ("config.pbtxt", "cuda")):
        config = parse_pbtxt((repo.models / "backbone" / name).read_text())
        assert config.backend == "python"
        assert config.parameters["engine"].string_value == "torch"
        assert config.parameters["device"].string_value == device
        assert protocol.TASK_VERSION in [i.name for i in config.input]
    for name, device in (("config.pbtxt", "cuda"), ("configs/cpu.pbtxt", "cpu")):  # one step, the torch engine
        fused = parse_pbtxt((repo.models / "aot" / name).read_text())
        assert fused.backend == "python" and fused.parameters["engine"].string_value == "torch"
        assert fused.parameters["device"].string_value == device and fused.parameters["aot"].string_value == "true"
    gpu = parse_pbtxt((repo.models / "aot" / "config.pbtxt").read_text())  # sized for a GPU: four instances on it
    assert [(g.kind, g.count) for g in gpu.instance_group] == [(gpu.instance_group[0].KIND_GPU, 1)] * 4
    assert gpu.dynamic_batching.max_queue_delay_microseconds == ServingOptions().backbone_queue_delay_us > 0


def _engine_batch(repo, names, lengths, seed=0) -> tuple[EncoderBatch, list[np.ndarray]]:
    """A batch of random tokens, and each sequence's distinct ids (its index into them set as batch.index)."""
    g = np.random.default_rng(seed)
    sequences, uniques, indexes = [], [], []
    for n in lengths:
        ids = g.integers(5, repo.vocab_size, n)
        tokens = {protocol.INPUT_IDS: ids, protocol.ATTENTION_MASK: np.ones(n, dtype=np.int64)}
        if protocol.TOKEN_TYPE_IDS in names:
            tokens[protocol.TOKEN_TYPE_IDS] = np.zeros(n, dtype=np.int64)
        unique, index = np.unique(ids, return_inverse=True)
        sequences.append(tokens)
        uniques.append(unique)
        indexes.append(index)
    batch = EncoderBatch.of(sequences)
    batch.index = np.zeros(batch.tokens[protocol.INPUT_IDS].shape, np.int64)
    for b, index in enumerate(indexes):
        batch.index[b, :len(index)] = index
    return batch, uniques


def _with_rows(batch: EncoderBatch, uniques, rows_of, slots=None) -> EncoderBatch:
    """The batch with each sequence's rows: its own block (rows_of(unique)) or, where `slots[b]` is given, the pool's
    slots (every sequence pooled: slots as the index; else those rows gathered into the batch's own)."""
    offsets = np.cumsum([0] + [len(u) for u in uniques])
    mask = batch.tokens[protocol.ATTENTION_MASK].astype(bool)
    if slots is not None and all(s is not None for s in slots):
        index = np.stack([np.asarray(s)[np.where(m, i, i[0])] for s, i, m in zip(slots, batch.index, mask,
                                                                                   strict=True)])
        return replace(batch, index=index, rows=None)
    blocks = [rows_of(u) if slots is None or slots[b] is None else slots[b] for b, u in enumerate(uniques)]
    index = np.where(mask, batch.index + offsets[:-1, None], offsets[:-1, None])
    return replace(batch, index=index, rows=blocks)


def test_engine_pool_slots_rows_and_mixed_batches_agree(tmp_path, tiny_models):
    """The same batch through pool slots (resident and cached), through rows, and mixed, gives the same states."""
    from aot.exporter.backbone_export import export_backbone

    export_backbone(str(tiny_models["bert"]), tmp_path / "repo", ServingOptions(engine="torch"))
    repo = read_repository(tmp_path / "repo")
    L, d, V = repo.num_layers, repo.hidden_size, repo.vocab_size
    table = (np.random.default_rng(1).standard_normal((V, L, d)) * 0.3).astype(np.float16)
    engine = TorchBackbone(repo.encoder_dir, repo.uses_token_type_ids, aot=True)
    names = protocol.token_inputs(repo.uses_token_type_ids)
    batch, uniques = _engine_batch(repo, names, [7, 3, 12])
    expected = engine.run(_with_rows(batch, uniques, lambda u: table[u])).pooled
    for budget_rows in (2 * V, 30):  # resident, then a cache smaller than one table
        pool = RowPool(budget_rows * L * d * 2, L, d, V, storage=DeviceRows("cpu"))
        pool.buffer.fill_(float("nan"))  # an unfilled slot read anywhere (padding included) turns states into NaN
        pool.attach("t@1", lambda ids: table[ids])
        engine.pool_rows = pool.buffer
        slots = pool.slots_many([("t@1", u) for u in uniques])
        assert pool.resident == (budget_rows == 2 * V)
        np.testing.assert_allclose(engine.run(_with_rows(batch, uniques, None, slots)).pooled, expected, atol=1e-5)
        gathered = [pool.gather(s) for s in slots]
        gathered[1] = None  # one sequence brings its own rows: the others' are gathered from the pool
        mixed = _with_rows(batch, uniques, lambda u: table[u], gathered)
        np.testing.assert_allclose(engine.run(mixed).pooled, expected, atol=1e-5)
    # The CUDA path pads each batch to a (batch, sequence) bucket and replays a graph captured at that shape. The
    # same padding, run eagerly here, must not change any sequence's states (padded rows and positions read filled
    # slots and are masked out).
    engine.graphs, engine.seq_buckets, engine.batch_buckets = True, (4, 16, 64), (1, 2, 4, 8)
    shapes = []
    engine._try_capture = lambda shape: True
    engine._replay = lambda shape, feeds: shapes.append(shape) or engine._forward(feeds, engine.pool_rows)
    np.testing.assert_allclose(engine.run(_with_rows(batch, uniques, None, slots)).pooled, expected, atol=1e-5)
    assert shapes == [(4, 16)]  # 3 sequences of at most 12 tokens
    engine.graphs = False
    vanilla = TorchBackbone(repo.encoder_dir, repo.uses_token_type_ids, aot=False)
    plain = vanilla.run(batch).pooled
    assert np.abs(plain - expected).max() > 1e-3, "the rows must change the states"


def test_device_heads_equal_the_host_heads(kind_artifacts, tiny_models, tmp_path):
    """The torch engine's device heads (aot.serving_torch.heads, run inside its forward) give what the numpy heads
    give from the pooled states, for every pooled kind, in a batch mixing them and bucket padding; a batch with more
    versions than slots answers the rest on the host (slot -1), never with another version's head."""
    from aot.serving.heads import head_width, pooled_logits
    from aot.serving.task_registry import TaskRegistry

    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {
        n: (kind_artifacts[n], "factored") for n in ("cls", "tags")}, engine="torch")
    info = read_repository(repo)
    registry = TaskRegistry(info.store_root, parts="head")
    tasks = [registry.resolve(name) for name in ("cls", "tags")]
    assert {t.kind for t in tasks} == {"classification", "multilabel"}
    engine = TorchBackbone(info.encoder_dir, info.uses_token_type_ids, aot=False, head_slots=1)
    names = protocol.token_inputs(info.uses_token_type_ids)
    batch, _ = _engine_batch(info, names, [5, 9, 3, 7], seed=3)
    item_task = np.array([0, 1, 1, 0])
    for k, task in enumerate(tasks):
        engine.heads._slot_of.clear()
        slots = engine.heads.slots([task])
        assert slots.tolist() == [0]
        batch.head_slots = np.array([0, 0, 0, -1])  # one item on the host: the pooled states come back too
        out = engine.run(batch)
        np.testing.assert_allclose(out.logits[:3, :head_width(task)], pooled_logits(task, out.pooled[:3]), atol=1e-5)
    slots = engine.heads.slots(tasks)  # one slot, two versions: the second answers on the host
    assert sorted(slots.tolist()) == [-1, 0]
    batch.head_slots = slots[item_task]
    engine.graphs, engine.seq_buckets, engine.batch_buckets = True, (16,), (8,)  # bucket padding, run eagerly
    engine._try_capture = lambda shape: True
    engine._replay = lambda shape, feeds: engine._forward({k: v for k, v in feeds.items()}, engine.pool_rows)
    out = engine.run(batch)
    on_device = np.flatnonzero(batch.head_slots >= 0)
    task = tasks[int(np.flatnonzero(slots >= 0)[0])]
    np.testing.assert_allclose(out.logits[on_device, :head_width(task)], pooled_logits(task, out.pooled[on_device]),
                               atol=1e-5)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_models, sentiment_dir):
    root = tmp_path_factory.mktemp("torch-artifacts")
    return {n: train_tiny_task(tiny_models["bert"], sentiment_dir, root / n, m, seed=s, epochs=1, pooling=pool)
            for n, m, s, pool in (("a", "fc", 0, "cls"), ("b", "kron", 1, "mean"), ("c", "fc", 2, "mean"))}


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, artifacts):
    return make_repository(tiny_models["bert"], tmp_path_factory.mktemp("torch") / "repo",
                           {"a": (artifacts["a"], "fused"), "b": (artifacts["b"], "factored"),
                            "c": (artifacts["c"], "factored")}, engine="torch", max_batch_size=16,
                           cpu_queue_delay_us=2000)


@pytest.fixture(scope="module")
def expected(artifacts):
    return {n: Predictor.load(a).logits(TEXTS).numpy() for n, a in artifacts.items()}


@pytest.mark.server
def test_served_torch_engine_equals_predict_with_and_without_a_pool(request, repo, expected):
    """Concurrent mixed tasks (fused, FC and Kron factored), long texts; then with no pool (rows brought per
    request, the eager path)."""
    from aot.local.server import LocalServer

    for pool_bytes in (None, 0):
        with LocalServer(repo, pool_bytes=pool_bytes) as server, Client(server.grpc_url) as client:
            items = [{"task": "abc"[k % 3], "text": TEXTS[k % len(TEXTS)]} for k in range(45)]
            answers = client.infer_many(items, concurrency=12)
            for item, k, answer in zip(items, range(45), answers, strict=True):
                assert "error" not in answer, answer
                np.testing.assert_allclose(answer["logits"], expected[item["task"]][k % len(TEXTS)], atol=1e-3)
            stats = client._client.get_inference_statistics(
                "aot", headers={GRPC_ADMIN_HEADER: server.admin_key}).model_stats[0]
            assert stats.execution_count < stats.inference_count, "requests of mixed tasks must batch together"
            held = {name: f for name, f in server.readiness()[1]["instances"].items() if f.get("step") == "aot"}
            assert len(held) == 2, held  # /ready says what each instance holds (issue 52.5)
            for instance in held.values():
                assert (instance["pool_bytes"] > 0) == (pool_bytes != 0)
                assert instance["device"] == "cpu" and instance["cuda_graphs"] == instance["graph_bytes"] == 0
                assert instance["device_head_slots"] == 0 and instance["tokenizer_threads"] == 1


def test_serve_device_is_checked_before_a_server_starts(tmp_path, repo, tiny_models):
    aot = [sys.executable, "-m", "aot"]
    out = subprocess.run(aot + ["serve", "--repo", str(repo), "--device", "tpu"], capture_output=True, text=True)
    assert out.returncode == 2 and "--device 'tpu': expected cpu, cuda or cuda:N" in out.stderr
    if not torch.cuda.is_available():
        out = subprocess.run(aot + ["serve", "--repo", str(repo), "--device", "cuda"], capture_output=True, text=True)
        assert out.returncode == 2 and "sees no CUDA device" in out.stderr
    onnx = make_repository(tiny_models["bert"], tmp_path / "onnx", {})
    out = subprocess.run(aot + ["serve", "--repo", str(onnx), "--device", "cuda"], capture_output=True, text=True)
    assert out.returncode == 2 and "engine is 'onnx'" in out.stderr and "--format torch" in out.stderr


def test_cuda_server_flags_come_from_the_repository(repo):
    """--device cuda: the GPU configs and memory pools of twice the largest batch (never below Triton's defaults)."""
    from aot.local.server import LocalServer

    info = read_repository(repo)
    args = LocalServer(repo, device="cuda").device_args()
    pools = memory_pool_bytes(info)
    assert args == [f"--cuda-memory-pool-byte-size=0:{pools['cuda']}", f"--pinned-memory-pool-byte-size={pools['pinned']}"]
    assert "--model-config-name=cpu" in LocalServer(repo).device_args()
    second = LocalServer(repo, device="cuda:1")  # the server sees GPU 1 alone, as its device 0
    assert second.environment()["CUDA_VISIBLE_DEVICES"] == "1" and second.device_args() == args
    assert "CUDA_VISIBLE_DEVICES" not in LocalServer(repo).environment() or "CUDA_VISIBLE_DEVICES" in os.environ
    # a RoBERTa-base-sized ONNX repository: the rows between lookup and backbone outgrow the 64 MiB default
    big = json.loads(json.dumps(info.record.to_json()))
    big.update(num_layers=12, hidden_size=768, max_positions=512)
    big["serving"] = {**big["serving"], "engine": "onnx", "max_batch_size": 32, "buckets": [128, 512]}
    sized = memory_pool_bytes(type(info)(info.path, BackboneRecord.from_json(big)))
    assert sized["cuda"] >= 2 * 32 * 512 * 12 * 768 * 2 and sized["cuda"] % (1 << 20) == 0
    big["serving"]["bias_interface"] = "dense"  # the same bias bytes per token, no index
    dense = largest_batch_bytes(type(info)(info.path, BackboneRecord.from_json(big)))
    big["serving"]["bias_interface"] = "rows"
    assert largest_batch_bytes(type(info)(info.path, BackboneRecord.from_json(big))) - dense == 32 * 512 * 4


@pytest.mark.server
@pytest.mark.parametrize("interface", protocol.BIAS_INTERFACES)
def test_lookup_step_serves_the_bias_from_a_host_or_a_torch_pool(tmp_path, tiny_models, artifacts, expected, interface):
    """The native GPU ensemble's aot_lookup step, through the real server: with its pool in host memory (the CPU
    config), then in torch memory with the bias handed out through DLPack (the GPU config's path, on the CPU device:
    DLPack tensors exist there too). Rows and index (or, dense, each token's row) equal the task's own, for fused
    and factored tasks, on bucket-padded tokens. The repository's AoT graph takes the same interface, and its ensemble
    answers as predict."""
    import tritonclient.grpc as grpcclient
    from google.protobuf.json_format import MessageToJson

    from aot.local.server import LocalServer
    from aot.serving.engine import BackboneRunner
    from aot.serving.task_registry import TaskRegistry
    from aot.serving.tasks import token_index
    from aot.serving.tokenization import Tokenization

    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {"a": (artifacts["a"], "fused"),
                                                                    "b": (artifacts["b"], "factored")},
                           bias_interface=interface)
    info = read_repository(repo)
    assert BackboneRunner(info.backbone_onnx).dense == (interface == "dense")
    registry = TaskRegistry(info.store_root, parts="all")
    served = {name: registry.resolve(name) for name in registry.entries()}
    # token tensors padded to buckets, as the GPU tokenizer step sends them: padding takes row 0
    tokens = Tokenization(info.tokenizer_dir, info.uses_token_type_ids, buckets=info.options.buckets)
    gpu = parse_pbtxt((repo / "models" / "aot_lookup" / "config.pbtxt").read_text())
    assert gpu.parameters["pool_storage"].string_value == "torch" and gpu.instance_group[0].kind == gpu.instance_group[0].KIND_GPU
    with LocalServer(repo, extra_args=["--load-model=aot_lookup"]) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        for storage in ("host", "torch"):
            if storage == "torch":
                config = parse_pbtxt((repo / "models" / "aot_lookup" / "configs" / "cpu.pbtxt").read_text())
                config.parameters["pool_storage"].string_value = "torch"
                admin = {GRPC_ADMIN_HEADER: server.admin_key}
                client.load_model("aot_lookup", config=MessageToJson(config, preserving_proto_field_name=True),
                                  headers=admin)
                loaded = client.get_model_config("aot_lookup", headers=admin).config
                assert loaded.parameters["pool_storage"].string_value == "torch"
            for name, task in served.items():
                for text in TEXTS[:3]:
                    enc = tokens.encode(text, None, task.max_length)
                    inputs = [grpcclient.InferInput(protocol.TASK_VERSION, [1, 1], "BYTES")]
                    inputs[0].set_data_from_numpy(np.array([[task.version.encode()]], dtype=np.object_))
                    for n in protocol.token_inputs(info.uses_token_type_ids):
                        t = grpcclient.InferInput(n, [1, len(enc[n])], "INT64")
                        t.set_data_from_numpy(enc[n][None, :].astype(np.int64))
                        inputs.append(t)
                    result = client.infer("aot_lookup", inputs)
                    unique, index = token_index(enc[protocol.INPUT_IDS], enc[protocol.ATTENTION_MASK])
                    assert not enc[protocol.ATTENTION_MASK].all() and not index[~enc[protocol.ATTENTION_MASK].astype(bool)].any()
                    if interface == "dense":
                        np.testing.assert_array_equal(result.as_numpy(protocol.AOT_BIAS), task.rows(unique)[index][None])
                        assert result.get_output(protocol.AOT_INDEX) is None
                    else:
                        np.testing.assert_array_equal(result.as_numpy(protocol.AOT_ROWS), task.rows(unique).reshape(1, -1))
                        np.testing.assert_array_equal(result.as_numpy(protocol.AOT_INDEX), index[None, :])
        client.close()
        with Client(server.grpc_url) as aot_client:  # the repository's AoT graph, in this interface
            for name in "ab":
                answers = aot_client.infer_many([{"task": name, "text": t} for t in TEXTS], concurrency=4)
                np.testing.assert_allclose([a["logits"] for a in answers], expected[name], atol=1e-3)
        log = server.log_path.read_text()
    assert "aot_lookup: task pool rows in host memory" in log
    assert "aot_lookup: task pool rows in torch memory on cpu, out through DLPack" in log


class HostGuard(torch.overrides.TorchFunctionMode):
    """Records every call that makes a host tensor, reads one back or branches on a tensor's value in Python: what a
    CUDA graph capture forbids ("Cannot copy between CPU and CUDA tensors during CUDA graph capture", "operation not
    permitted when stream is capturing"). On a CPU nothing fails, so the guard is how a test sees them here."""

    HOST = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.Tensor.item, torch.Tensor.tolist,
            torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
            torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.HOST:
            self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_the_captured_forward_touches_nothing_on_the_host(tiny_models, arch):
    """What a CUDA graph captures (TorchBackbone._forward: embeddings, the bias gather and add before every layer,
    attention, pooling) makes no host tensor, reads nothing back and branches on no value, whatever transformers'
    own mask helpers do (the engine passes its own additive mask); and the states equal the encoder's with its own
    2D mask, padding included."""
    bb = TorchBackbone(tiny_models[arch], arch == "bert", aot=True)
    g = torch.Generator().manual_seed(0)
    feeds = {n: torch.randint(1, 50, (3, 7), generator=g) for n in bb.names}
    if protocol.TOKEN_TYPE_IDS in feeds:
        feeds[protocol.TOKEN_TYPE_IDS].zero_()
    mask = feeds[protocol.ATTENTION_MASK]
    mask.fill_(1)
    mask[1, 4:], mask[2, 2:] = 0, 0
    feeds["index"] = torch.randint(0, 3, (3, 7), generator=g)
    rows = torch.randn((3, bb.biased.num_layers, bb.biased.hidden_size), generator=g)
    with torch.inference_mode():
        with HostGuard() as guard:
            pooled, states, _ = bb._forward(feeds, rows)
        assert guard.calls == []
        with HostGuard() as planted:  # the guard itself: a read-back is seen
            (states.sum() > 0).item()
        assert planted.calls == ["item"]
        reference = bb.biased.states(feeds[protocol.INPUT_IDS], mask, feeds.get(protocol.TOKEN_TYPE_IDS), rows,
                                     feeds["index"])
    read = mask.bool()
    assert states.shape == (3, 7, bb.biased.hidden_size) and pooled.shape[:2] == (3, len(protocol.POOLINGS))
    torch.testing.assert_close(states[read], reference[read], rtol=0, atol=1e-6)


def test_batches_that_miss_their_graph_are_counted(tiny_models):
    """Where graphs are on, a batch that runs eagerly (its bucket's capture failed) counts in eager_batches, which the
    step publishes as aot_engine_eager_batches_total; an engine without graphs counts none (None)."""
    bb = TorchBackbone(tiny_models["bert"], True, aot=False)
    assert bb.graphs is False and bb.eager_batches is None
    bb.graphs, bb.eager_batches, bb.seq_buckets = True, 0, (8,)  # as on a GPU whose every capture failed
    bb._uncapturable = set(bb.graph_shapes())
    tokens = {n: np.ones(5, dtype=np.int64) for n in bb.names}
    for count in (1, 2):
        bb.run(EncoderBatch.of([dict(tokens) for _ in range(count)]))
    assert bb.eager_batches == 2
