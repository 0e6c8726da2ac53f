"""A trained task in the served format: its version's task.json and its head's arrays. One source for what export
writes (aot.exporter.task_export) and for the task the CPU engine serves in process before any export
(aot.exporter.cpu_engine.task_from_model), so both read a task alike, whatever its kind."""

from __future__ import annotations

import numpy as np

from aot.training.artifact import TaskArtifact
from aot.training.model import TaskModel


def head_arrays(model: TaskModel) -> dict[str, np.ndarray]:
    """The head in the served format: names as in ClassificationHead or TokenHead, fp32 (an embedding task's has
    none)."""
    return {k: v.detach().float().numpy().copy() for k, v in model.head.state_dict().items()}


def answer_meta(artifact: TaskArtifact) -> dict:
    """What a task's consumers depend on (its kind, labels, pair-ness) and its dev score, as task.json holds them:
    what a publish compares with the current version (aot.serving.store.compatibility)."""
    spec = artifact.spec
    return {"kind": spec.kind, "labels": None if spec.labels is None else list(spec.labels), "metric": spec.metric,
            "has_pair": spec.has_pair, "dev": artifact.metrics().get("dev")}


def task_record(artifact: TaskArtifact, name: str, storage: str, shape: tuple[int, int, int],
                fingerprint: str) -> dict:
    """task.json of a version (docs/formats.md): what every served step reads of the task, by its kind; `shape`
    is (L, d, V)."""
    spec = artifact.spec
    L, d, V = shape
    meta = {"name": name, **answer_meta(artifact), "max_length": artifact.max_length, "pooling": artifact.pooling}
    if "activation" in artifact.head:  # a classification head's (tokens and embedding have no activation)
        meta["head_activation"] = artifact.head["activation"]
    meta |= {key: getattr(spec, key) for key in spec.kind_spec.record}  # a multi-label threshold, normalize
    return meta | {"storage": storage, "method": artifact.config["method"], "num_layers": L, "hidden_size": d,
                   "vocab_size": V, "backbone_fingerprint": fingerprint}
