"""The model factory: a method's task model built by name (aot.training.methods' registry), and a saved one loaded.

Above the methods: an AoT method's task model is the AotModel its folder builds (aot_task_model, the constructor
get_aot_model uses too); every other method's is its body under the head of the task's kind (aot.training.model).
"""

from __future__ import annotations

import copy
from pathlib import Path

from aot.training.artifact import TaskArtifact, read_task, restore, task_backbone
from aot.training.backbone import Backbone
from aot.training.data.task import TaskSpec
from aot.training.method_registry import MethodConfig, method_spec
from aot.training.methods.aot_ptuning.peft_model import aot_task_model
from aot.training.model import TaskModel, init_head_from_pooler, make_head


def build_task_model(backbone: Backbone, config: MethodConfig, spec: TaskSpec, pooling: str | None = None,
                     max_length: int | None = None, head: dict | None = None,
                     copy_encoder: bool = True) -> TaskModel:
    """Build on a private copy of the encoder: methods hook into it or unfreeze it, the caller's stays pristine.

    `pooling`: which pooled state the head reads; None takes the one the backbone declares (Backbone.pooling).
    AoT methods build an AotModel (what get_aot_model returns); `max_length` and `head` (an artifact's head record)
    are recorded there. `copy_encoder` False: AoT only, hook into the caller's encoder."""
    pooling = pooling or backbone.pooling
    if copy_encoder:
        backbone = Backbone(backbone.name, copy.deepcopy(backbone.encoder), backbone.tokenizer, backbone.fingerprint,
                            backbone.pooling)
    backbone.encoder.requires_grad_(False)
    if method_spec(config.method).shared_backbone:
        return aot_task_model(backbone, config, spec, pooling, max_length, head)
    if not copy_encoder:
        raise ValueError(f"method {config.method!r} changes the encoder: it cannot share the caller's")
    body = method_spec(config.method).build(backbone, config)
    head_config = head or {}
    head_module = make_head(spec, backbone.hidden_size, head_config.get("activation", "tanh"),
                            head_config.get("inner_size"))
    init_head_from_pooler(head_module, backbone.encoder)
    return TaskModel(body, head_module, pooling, spec.kind)


def load_task(path: str | Path, backbone: Backbone | None = None,
              copy_encoder: bool = True) -> tuple[TaskArtifact, TaskModel, Backbone]:
    """Rebuild a trained task model in eval mode on its backbone (loaded from the artifact's record if not given).
    `copy_encoder` False: an AoT task hooks into the backbone's encoder itself (aot.training.multitask)."""
    artifact = read_task(path)
    weights = artifact.weights()  # a damaged file is reported before the backbone is loaded
    backbone = task_backbone(artifact, backbone)
    model = build_task_model(backbone, artifact.method_config, artifact.spec, artifact.pooling, artifact.max_length,
                             artifact.head, copy_encoder)
    return artifact, restore(artifact, model, weights), backbone
