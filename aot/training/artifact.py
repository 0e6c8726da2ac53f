"""The task artifact: what `aot train` writes and every later step reads.

Format `aot-task`, version 2, or 3 for the kinds a version-2 reader would misread (multilabel, tokens, embedding:
documented in docs/formats.md; version 1, without `head`, is still read):

    DIR/config.json         method, hyperparameters, task (labels, metric), max length, pooling, head, backbone identity
    DIR/weights.safetensors trainable parameters only (method factors + head), names as in TaskModel
    DIR/metrics.json        dev (and test) scores, train time, evaluation history

The folder is written atomically (aot.serving.store.atomic). Reading checks the schema; loading
(aot.training.factory.load_task, AotModel.from_pretrained) refuses a backbone whose fingerprint differs from the one the
task was trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from aot.serving.formats import check_keys
from aot.serving.kinds import DENSE, kind_of, kind_spec
from aot.serving.protocol import POOLING_BEFORE_V3, pooling_row
from aot.serving.store.atomic import atomic_directory
from aot.training.backbone import Backbone, BackboneError, load_backbone
from aot.training.data.task import TaskSpec
from aot.training.method_registry import MethodConfig, method_spec
from aot.training.model import HEAD_ACTIVATIONS, TaskModel, head_record

FORMAT = "aot-task"
FORMAT_VERSION = 2
# v3: a task of a kind a v2 reader knows nothing of (it would read a token task as a classifier: KindSpec
# .since_format); only those are written as v3, so that a classifier's artifact stays readable by a v2 reader
READ_VERSIONS = (1, 2, 3)  # v1 has no `head` record: its heads are tanh, d x d (what v2 defaults to)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
METRICS_FILE = "metrics.json"

_REQUIRED = {"format": str, "format_version": int, "method": dict, "task": dict, "max_length": int,
             "backbone": dict, "training": dict}
_BACKBONE_REQUIRED = {"model": str, "model_type": str, "fingerprint": str, "num_layers": int, "hidden_size": int,
                      "vocab_size": int}


class ArtifactError(ValueError):
    """An artifact that is missing, malformed, or does not fit the backbone."""


class FingerprintMismatch(ArtifactError):
    pass


@dataclass
class TaskArtifact:
    """The parsed config.json of a task."""

    path: Path
    config: dict

    @property
    def spec(self) -> TaskSpec:
        return TaskSpec.from_json(self.config["task"])

    @property
    def kind(self) -> str:
        return kind_of(self.config["task"])

    @property
    def method_config(self) -> MethodConfig:
        data = self.config["method"]
        return method_spec(data["method"]).config_cls.from_json(data)

    @property
    def max_length(self) -> int:
        return self.config["max_length"]

    @property
    def pooling(self) -> str:
        """Which pooled state the head reads; artifacts written before pooling was recorded read the first token."""
        return self.config.get("pooling", POOLING_BEFORE_V3)

    @property
    def head(self) -> dict:
        """{"activation": "tanh" | "gelu", "inner_size": int or absent (d)}; v1 artifacts: tanh."""
        return self.config.get("head", {"activation": "tanh"})

    @property
    def backbone(self) -> dict:
        return self.config["backbone"]

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainable tensors; a damaged file is one ArtifactError naming it, not a safetensors traceback."""
        path = self.path / WEIGHTS_FILE
        try:
            return load_file(path)
        except SafetensorError as exc:
            raise ArtifactError(f"{path}: corrupt or truncated weights file ({exc}); "
                                f"restore it or train the task again") from None

    def metrics(self) -> dict:
        path = self.path / METRICS_FILE
        return json.loads(path.read_text()) if path.is_file() else {}


def backbone_identity(backbone: Backbone) -> dict:
    return {"model": backbone.name, "model_type": backbone.encoder.config.model_type,
            "fingerprint": backbone.fingerprint, "num_layers": backbone.num_layers,
            "hidden_size": backbone.hidden_size, "vocab_size": int(backbone.embeddings.shape[0])}


def save_task(out: str | Path, model: TaskModel, backbone: dict, method: MethodConfig, spec: TaskSpec,
              max_length: int, training: dict, metrics: dict) -> Path:
    """`backbone`: its identity (backbone_identity)."""
    version = max(FORMAT_VERSION, spec.kind_spec.since_format)
    config = {"format": FORMAT, "format_version": version, "method": method.to_json(),
              "task": spec.to_json(), "max_length": max_length, "pooling": model.pooling,
              "head": head_record(model.head), "backbone": backbone, "training": training}
    out = Path(out)
    with atomic_directory(out) as tmp:
        save_file({k: v.contiguous() for k, v in model.trainable_state().items()}, tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    return out


def read_task(path: str | Path) -> TaskArtifact:
    """Parse and check an artifact's config.json (no weights, no backbone)."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ArtifactError(f"{path}: not a task artifact (no {CONFIG_FILE})")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{config_path}: invalid JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise ArtifactError(f"{config_path}: expected a JSON object")
    check_keys(config, _REQUIRED, str(config_path), ArtifactError)
    if config["format"] != FORMAT:
        raise ArtifactError(f"{config_path}: format {config['format']!r} is not {FORMAT!r}")
    if config["format_version"] not in READ_VERSIONS:
        raise ArtifactError(f"{config_path}: format_version {config['format_version']} is not supported "
                            f"(this version reads {', '.join(map(str, READ_VERSIONS))})")
    check_keys(config["backbone"], _BACKBONE_REQUIRED, f"{config_path} [backbone]", ArtifactError)
    try:
        pooling_row(config.get("pooling", POOLING_BEFORE_V3))
    except ValueError as exc:
        raise ArtifactError(f"{config_path}: {exc}") from None
    try:
        kind = kind_of(config["task"])
        TaskSpec.from_json(config["task"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{config_path}: task {config['task']!r}: {exc}") from None
    if config["format_version"] < kind_spec(kind).since_format:
        raise ArtifactError(f"{config_path}: a {kind} task needs format_version {kind_spec(kind).since_format}")
    head = config.get("head", {"activation": "tanh"})
    if kind_spec(kind).head != DENSE:  # a token head is one linear layer, an embedding task has none
        if head != {}:
            raise ArtifactError(f"{config_path}: head {head!r}: a {kind} task's head record is {{}}")
    elif (not isinstance(head, dict) or head.get("activation") not in HEAD_ACTIVATIONS
            or not isinstance(head.get("inner_size", 1), int)):
        raise ArtifactError(f"{config_path}: head {head!r}: expected {{\"activation\": one of "
                            f"{', '.join(HEAD_ACTIVATIONS)}, \"inner_size\": int}}")
    method_spec(config["method"].get("method", "?"))
    if not (path / WEIGHTS_FILE).is_file():
        raise ArtifactError(f"{path}: missing {WEIGHTS_FILE}")
    return TaskArtifact(path, config)


def task_backbone(artifact: TaskArtifact, backbone: Backbone | None = None) -> Backbone:
    """The backbone a task loads on: `backbone`, or the one the artifact records; refused (FingerprintMismatch) if
    it is not the one the task was trained on."""
    if backbone is None:
        backbone = load_recorded_backbone(artifact)
    check_fingerprint(artifact, backbone.fingerprint, backbone.name)
    return backbone


def check_fingerprint(artifact: TaskArtifact, fingerprint: str, backbone_name: str) -> None:
    expected = artifact.backbone["fingerprint"]
    if fingerprint != expected:
        raise FingerprintMismatch(
            f"task {artifact.path} was trained on backbone {artifact.backbone['model']!r} ({expected}), "
            f"but the backbone given is {backbone_name!r} ({fingerprint})")


def load_recorded_backbone(artifact: TaskArtifact) -> Backbone:
    """The backbone the artifact names (folder, 'minilm' or hub id), from local files only.

    Loading a task must not reach the network on its own: a hub id recorded at training time is read from the
    local cache or refused; only a --model the user passes may download.
    """
    name = artifact.backbone["model"]
    try:
        return load_backbone(name, local_only=True)
    except (OSError, BackboneError) as exc:
        raise ArtifactError(f"the backbone recorded in task {artifact.path}, {name!r}, is not available locally "
                            f"(loading a task never downloads); pass --model PATH (the model folder, or a hub id to "
                            f"download it)") from exc


def restore(artifact: TaskArtifact, model: TaskModel, weights: dict[str, torch.Tensor]) -> TaskModel:
    """`model`, built for the artifact's method and task, with its trained `weights` (artifact.weights()), in eval
    mode; weights of another shape are one ArtifactError naming the file."""
    try:
        model.load_trainable_state(weights)
    except ValueError as exc:
        raise ArtifactError(f"{artifact.path / WEIGHTS_FILE}: {exc}") from None
    return model.eval()
