"""The deployment folder: a Triton model repository, the task store, and a record; configs from one source.

    REPO/aot_repository.json    format `aot-repository` v1: backbone identity, protocol version, buckets, engine
    REPO/tasks/                 the task store (exporter.task_store), outside Triton's view
    REPO/models/                the Triton model repository (--model-repository=REPO/models):
    REPO/models/tokenizer/             python: TEXT (+ TEXT_PAIR), TASK -> token ids (the backbone's tokenizer in 1/tokenizer)
    REPO/models/aot_lookup/     python: TASK, token ids -> aot_rows, aot_index (reads REPO/tasks; GPU ensemble:
                                the CPU backbone step does this lookup in its own process, one step fewer)
    REPO/models/backbone/       the AoT graph: onnxruntime_onnx or tensorrt_plan (GPU), python + ONNX Runtime (CPU)
    REPO/models/backbone_vanilla/ the same encoder without bias inputs (comparisons, plain models)
    REPO/models/head/           python: TASK, cls_hidden -> LOGITS, LABEL (each request its own task's head)
    REPO/models/aot/, vanilla/  the ensembles clients call

Each model folder has `config.pbtxt` (GPU, NGC image) and `configs/cpu.pbtxt` (local CPU server, selected with
--model-config-name=cpu). Both come from `model_configs()`, so they cannot drift apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format

from exporter import interface as io

REPO_FORMAT = "aot-repository"
REPO_VERSION = 1
RECORD = "aot_repository.json"
STORE_DIR = "tasks"
MODELS_DIR = "models"
STORE_FROM_MODEL = f"../../{STORE_DIR}"  # the store, relative to a model folder
TEMPLATES = Path(__file__).resolve().parent.parent / "model_repository"
PYTHON_MODELS = {"tokenizer": "tokenizer", "aot_lookup": "aot_lookup", "backbone": "backbone",
                 "backbone_vanilla": "backbone", "head": "head"}  # model -> template folder holding 1/model.py
ENSEMBLES = ("aot", "vanilla")
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)


class RepositoryError(ValueError):
    pass


@dataclass
class ServingOptions:
    """Knobs of the generated configs (documented in docs/serving.md)."""

    max_batch_size: int = 32
    backbone_queue_delay_us: int = 500
    cpu_threads: int = 0  # ONNX Runtime intra-op threads in the CPU backbone; 0 = all cores
    buckets: tuple[int, ...] = DEFAULT_BUCKETS  # GPU: token tensors are padded to these lengths to batch together
    engine: str = "onnx"  # GPU backbone: "onnx" (onnxruntime_onnx) or "tensorrt" (tensorrt_plan)

    def to_json(self) -> dict:
        return {"max_batch_size": self.max_batch_size, "backbone_queue_delay_us": self.backbone_queue_delay_us,
                "cpu_threads": self.cpu_threads, "buckets": list(self.buckets), "engine": self.engine}


@dataclass
class RepositoryInfo:
    """The parsed aot_repository.json of a repository."""

    path: Path
    record: dict = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.record["backbone"]["model"]

    @property
    def fingerprint(self) -> str:
        return self.record["backbone"]["fingerprint"]

    @property
    def uses_token_type_ids(self) -> bool:
        return bool(self.record["uses_token_type_ids"])

    @property
    def tokenizer_dir(self) -> Path:
        return self.models / "tokenizer" / "1" / "tokenizer"

    @property
    def backbone_onnx(self) -> Path:
        return self.models / "backbone" / "1" / "model.onnx"

    @property
    def models(self) -> Path:
        return self.path / MODELS_DIR

    @property
    def store_root(self) -> Path:
        return self.path / STORE_DIR

    @property
    def options(self) -> ServingOptions:
        o = self.record["serving"]
        return ServingOptions(o["max_batch_size"], o["backbone_queue_delay_us"], o["cpu_threads"],
                              tuple(o["buckets"]), o["engine"])


def read_repository(path: str | Path) -> RepositoryInfo:
    path = Path(path)
    record_path = path / RECORD
    if not record_path.is_file():
        raise RepositoryError(f"{path}: not an AoT model repository (no {RECORD}); run `aot export backbone` first")
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RepositoryError(f"{record_path}: invalid JSON ({exc.msg})") from None
    if record.get("format") != REPO_FORMAT or record.get("format_version") != REPO_VERSION:
        raise RepositoryError(f"{record_path}: not an {REPO_FORMAT} v{REPO_VERSION} record")
    if record.get("protocol_version") != io.PROTOCOL_VERSION:
        raise RepositoryError(f"{record_path}: protocol version {record.get('protocol_version')} is not "
                              f"{io.PROTOCOL_VERSION}; re-export the backbone")
    for key in ("backbone", "uses_token_type_ids", "serving", "num_layers", "hidden_size"):
        if key not in record:
            raise RepositoryError(f"{record_path}: missing key {key!r}")
    return RepositoryInfo(path, record)


# --- config generation: the one source of every config.pbtxt --------------------------------------------------

def _pb():
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def _tensor(kind, name: str, dtype: str, dims: list[int], ragged: bool = False, optional: bool = False):
    pb = _pb()
    t = kind(name=name, data_type=getattr(pb, f"TYPE_{dtype}"), dims=dims)
    if ragged:
        t.allow_ragged_batch = True
    if optional:
        t.optional = True
    return t


def _python_model(name: str, options: ServingOptions, params: dict[str, str], queue_delay_us: int = 0):
    pb = _pb()
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=options.max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
    config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_CPU, count=1)
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


def _backbone(name: str, aot: bool, target: str, info: dict, options: ServingOptions):
    """The backbone step: python + ONNX Runtime on CPU; the native backend on GPU (ragged rows + batch input)."""
    pb = _pb()
    token_names = io.token_inputs(info["uses_token_type_ids"])
    cpu = target == "cpu"
    if cpu:
        params = {"onnx_file": "model.onnx", "threads": str(options.cpu_threads)}
        if aot:  # on CPU the lookup runs inside this step: no extra python step, no rows between processes
            params["store"] = STORE_FROM_MODEL
        config = _python_model(name, options, params, options.backbone_queue_delay_us)
    else:
        platform = "tensorrt_plan" if options.engine == "tensorrt" else "onnxruntime_onnx"
        config = pb.ModelConfig(name=name, platform=platform, max_batch_size=options.max_batch_size,
                                default_model_filename="model.plan" if options.engine == "tensorrt" else "model.onnx")
        config.dynamic_batching.max_queue_delay_microseconds = options.backbone_queue_delay_us
        config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_GPU, count=1)
    # On CPU every input is ragged (the python step pads the batch itself); on GPU token tensors are bucketed.
    if cpu and aot:
        config.input.append(_tensor(pb.ModelInput, io.TASK, "STRING", [1]))
    for n in token_names:
        config.input.append(_tensor(pb.ModelInput, n, "INT64", [-1], ragged=cpu))
    if aot and not cpu:
        config.input.append(_tensor(pb.ModelInput, io.AOT_ROWS, "FP16", [-1], ragged=True))
        config.input.append(_tensor(pb.ModelInput, io.AOT_INDEX, "INT32", [-1]))
        config.batch_input.add(kind=pb.BatchInput.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO,
                               target_name=[io.AOT_ROW_OFFSETS], data_type=pb.TYPE_INT32,
                               source_input=[io.AOT_ROWS])
    config.output.append(_tensor(pb.ModelOutput, io.CLS_HIDDEN, "FP32", [info["hidden_size"]]))
    return config


def _ensemble(name: str, backbone: str, info: dict, options: ServingOptions, target: str):
    pb = _pb()
    config = pb.ModelConfig(name=name, platform="ensemble", max_batch_size=options.max_batch_size)
    config.input.append(_tensor(pb.ModelInput, io.TEXT, "STRING", [1]))
    config.input.append(_tensor(pb.ModelInput, io.TEXT_PAIR, "STRING", [1], optional=True))
    config.input.append(_tensor(pb.ModelInput, io.TASK, "STRING", [1]))
    config.output.append(_tensor(pb.ModelOutput, io.LOGITS, "FP32", [-1]))
    config.output.append(_tensor(pb.ModelOutput, io.LABEL, "STRING", [1]))
    tokens = io.token_inputs(info["uses_token_type_ids"])
    steps = config.ensemble_scheduling.step
    tok = steps.add(model_name="tokenizer", model_version=-1)
    tok.input_map.update({io.TEXT: io.TEXT, io.TEXT_PAIR: io.TEXT_PAIR, io.TASK: io.TASK})
    tok.output_map.update({n: f"_{n}" for n in tokens})
    bb_inputs = {n: f"_{n}" for n in tokens}
    if backbone == "backbone" and target == "cpu":
        bb_inputs[io.TASK] = io.TASK  # the CPU backbone step looks the rows up itself
    elif backbone == "backbone":
        look = steps.add(model_name="aot_lookup", model_version=-1)
        look.input_map.update({io.TASK: io.TASK, io.INPUT_IDS: f"_{io.INPUT_IDS}",
                               io.ATTENTION_MASK: f"_{io.ATTENTION_MASK}"})
        look.output_map.update({io.AOT_ROWS: f"_{io.AOT_ROWS}", io.AOT_INDEX: f"_{io.AOT_INDEX}"})
        bb_inputs.update({io.AOT_ROWS: f"_{io.AOT_ROWS}", io.AOT_INDEX: f"_{io.AOT_INDEX}"})
    bb = steps.add(model_name=backbone, model_version=-1)
    bb.input_map.update(bb_inputs)
    bb.output_map.update({io.CLS_HIDDEN: f"_{io.CLS_HIDDEN}"})
    head = steps.add(model_name="head", model_version=-1)
    head.input_map.update({io.TASK: io.TASK, io.CLS_HIDDEN: f"_{io.CLS_HIDDEN}"})
    head.output_map.update({io.LOGITS: io.LOGITS, io.LABEL: io.LABEL})
    return config


def model_configs(info: dict, options: ServingOptions, target: str) -> dict:
    """Every model's config for `target` "cpu" (local server) or "gpu" (NGC image)."""
    pb = _pb()
    tokens = io.token_inputs(info["uses_token_type_ids"])
    buckets = "" if target == "cpu" else ",".join(str(b) for b in options.buckets)
    tok = _python_model("tokenizer", options, {"buckets": buckets, "store": STORE_FROM_MODEL})
    tok.input.extend([_tensor(pb.ModelInput, io.TEXT, "STRING", [1]),
                      _tensor(pb.ModelInput, io.TEXT_PAIR, "STRING", [1], optional=True),
                      _tensor(pb.ModelInput, io.TASK, "STRING", [1])])
    tok.output.extend([_tensor(pb.ModelOutput, n, "INT64", [-1]) for n in tokens])

    look = _python_model("aot_lookup", options, {"store": STORE_FROM_MODEL})
    look.input.extend([_tensor(pb.ModelInput, io.TASK, "STRING", [1]),
                       _tensor(pb.ModelInput, io.INPUT_IDS, "INT64", [-1], ragged=True),
                       _tensor(pb.ModelInput, io.ATTENTION_MASK, "INT64", [-1], ragged=True)])
    look.output.extend([_tensor(pb.ModelOutput, io.AOT_ROWS, "FP16", [-1]),
                        _tensor(pb.ModelOutput, io.AOT_INDEX, "INT32", [-1])])

    head = _python_model("head", options, {"store": STORE_FROM_MODEL})
    head.input.extend([_tensor(pb.ModelInput, io.TASK, "STRING", [1]),
                       _tensor(pb.ModelInput, io.CLS_HIDDEN, "FP32", [info["hidden_size"]])])
    head.output.extend([_tensor(pb.ModelOutput, io.LOGITS, "FP32", [-1]),
                        _tensor(pb.ModelOutput, io.LABEL, "STRING", [1])])
    return {"tokenizer": tok, "aot_lookup": look, "head": head,
            "backbone": _backbone("backbone", True, target, info, options),
            "backbone_vanilla": _backbone("backbone_vanilla", False, target, info, options),
            "aot": _ensemble("aot", "backbone", info, options, target),
            "vanilla": _ensemble("vanilla", "backbone_vanilla", info, options, target)}


def to_pbtxt(config) -> str:
    return text_format.MessageToString(config)


def parse_pbtxt(text: str):
    return text_format.Parse(text, _pb().ModelConfig())


def write_configs(models: Path, info: dict, options: ServingOptions) -> None:
    """config.pbtxt (GPU) and configs/cpu.pbtxt (CPU) for every model, under REPO/models."""
    gpu, cpu = model_configs(info, options, "gpu"), model_configs(info, options, "cpu")
    for name in gpu:
        folder = models / name
        (folder / "configs").mkdir(parents=True, exist_ok=True)
        (folder / "config.pbtxt").write_text(to_pbtxt(gpu[name]))
        (folder / "configs" / "cpu.pbtxt").write_text(to_pbtxt(cpu[name]))
        (folder / "1").mkdir(exist_ok=True)
