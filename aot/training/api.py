"""One call from data to a saved task artifact (used by `aot train` and the accuracy sweep)."""

from __future__ import annotations

import dataclasses
import time

from aot.training.artifact import backbone_identity, save_task
from aot.training.backbone import Backbone, BackboneError, load_backbone
from aot.training.data import load_task_data
from aot.training.data.task import TaskData
from aot.training.factory import build_task_model
from aot.training.method_registry import make_config, method_spec
from aot.training.methods.aot_ptuning.peft_model import AotModel
from aot.training.model import trainable_parameter_count
from aot.training.trainer import TrainConfig, encode, evaluate, resolve_device, seed_everything, train


def train_task(model: str, data: str, method: str, out: str, rank: int | None = None, options: dict | None = None,
               lr: float | None = None,
               batch_size: int = 16, epochs: int = 10, patience: int = 3, eval_every: int = 0,
               max_length: int = 128, max_train_samples: int | None = None, time_budget: float | None = None,
               max_steps: int | None = None, pooling: str | None = None, head_lr: float | None = None,
               warmup: float = TrainConfig.warmup, decay: str = TrainConfig.decay,
               seed: int = 0, labels: list[str] | None = None, metric: str | None = None, device: str = "auto",
               progress: bool = True, problem: str | None = None, backbone: Backbone | None = None,
               task_data: TaskData | None = None, normalize: bool = True) -> dict:
    """Train and save; returns the summary that metrics.json holds. `options`: the method's config fields to set
    (aot.training.method_registry.option_types). `pooling` None: the backbone's own. `problem`: the task's kind,
    aot.training.data.PROBLEMS (None: what the data declares, classification for a plain folder without task.json).
    `normalize`: an embedding task answers unit vectors."""
    spec_method = method_spec(method)
    config = make_config(method, rank=rank, **(options or {}))
    # Checked before the data and the backbone load: a bad schedule fails at once.
    train_config = TrainConfig(lr=lr or spec_method.default_lr, head_lr=head_lr, warmup=warmup, decay=decay,
                               batch_size=batch_size, epochs=epochs,
                               patience=patience, max_length=max_length, seed=seed, eval_every=eval_every,
                               max_train_samples=max_train_samples, time_budget=time_budget, max_steps=max_steps,
                               device=device)
    task_data = task_data or load_task_data(data, labels=labels, metric=metric, problem=problem)
    if task_data.spec.kind == "embedding":
        task_data = dataclasses.replace(task_data, spec=dataclasses.replace(task_data.spec, normalize=normalize))
    backbone = backbone or load_backbone(model)
    check_max_length(backbone, max_length)
    seed_everything(seed)  # the method's random init must depend on the seed alone, not on what ran before
    task_model = build_task_model(backbone, config, task_data.spec, pooling, max_length)
    result = train(task_model, task_data, backbone.tokenizer, train_config, progress=progress)
    spec = result.spec
    metrics = {"task": spec.name, "kind": spec.kind, "method": method, "pooling": task_model.pooling,
               "metric": spec.metric, "dev": result.dev_score,
               **({"threshold": spec.threshold} if spec.kind == "multilabel" else {}),
               "best_step": result.best_step, "steps": result.steps, "stopped": result.stopped,
               "train_seconds": round(result.train_seconds, 2),
               "trainable_parameters": trainable_parameter_count(task_model), "history": result.history}
    if task_data.test:
        encoded = encode(backbone.tokenizer, task_data.test, spec, max_length)
        pad = backbone.tokenizer.pad_token_id or 0
        metrics["test"] = evaluate(task_model, encoded, spec, pad, resolve_device(device))
    task_model.to("cpu")
    training = {**train_config.to_json(), "data": task_data.source or data, "started": time.time()}
    if isinstance(task_model, AotModel):  # built by get_aot_model's constructor: saved as get_aot_model's are
        task_model.spec = spec
        task_model.save_pretrained(out, metrics, training)
    else:
        save_task(out, task_model, backbone_identity(backbone), config, spec, max_length, training, metrics)
    return {k: v for k, v in metrics.items() if k != "history"} | {"out": str(out)}


def check_max_length(backbone: Backbone, max_length: int) -> None:
    """Refuse a max length the encoder cannot run on, before training rather than at the first long batch."""
    limit = backbone.max_positions
    if limit is not None and max_length > limit:
        raise BackboneError(f"--max-length {max_length} exceeds what backbone {backbone.name} accepts "
                            f"({limit} tokens)")
