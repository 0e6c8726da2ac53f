"""One call from data to a saved task artifact (used by `aot train` and the accuracy sweep), and its three parts
(plan_task, build_model, save_trained), which a job of many tasks (aot.training.job) calls for each of its tasks."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from aot.training.artifact import backbone_identity, save_task
from aot.training.backbone import Backbone, BackboneError, load_backbone
from aot.training.data import load_task_data
from aot.training.data.task import TaskData
from aot.training.factory import build_task_model
from aot.training.method_registry import MethodConfig, make_config, method_spec
from aot.training.methods.aot_ptuning.peft_model import AotModel
from aot.training.model import TaskModel, trainable_parameter_count
from aot.training.trainer import (
    TrainConfig,
    TrainResult,
    encode,
    evaluate,
    resolve_device,
    seed_everything,
    train,
)


@dataclass
class TaskPlan:
    """A task checked and ready to train: its method's config, its training config and its data (plan_task)."""

    method: str
    config: MethodConfig
    train_config: TrainConfig
    data: TaskData
    source: str  # the `data` argument, recorded when the data names no source of its own
    pooling: str | None = None


def plan_task(data: str, method: str, rank: int | None = None, options: dict | None = None, lr: float | None = None,
              batch_size: int = 16, epochs: int = 10, patience: int = 3, eval_every: int = 0, max_length: int = 128,
              max_train_samples: int | None = None, time_budget: float | None = None, max_steps: int | None = None,
              pooling: str | None = None, head_lr: float | None = None, warmup: float = TrainConfig.warmup,
              decay: str = TrainConfig.decay, seed: int = 0, labels: list[str] | None = None,
              metric: str | None = None, device: str = "auto", problem: str | None = None,
              task_data: TaskData | None = None, normalize: bool = True) -> TaskPlan:
    """Everything train_task checks before the backbone loads (the method, the schedule, the device), then the data
    (a bad value or a bad row is refused here, before anything trains)."""
    spec_method = method_spec(method)
    config = make_config(method, rank=rank, **(options or {}))
    # Checked before the data and the backbone load: a bad schedule fails at once.
    train_config = TrainConfig(lr=lr or spec_method.default_lr, head_lr=head_lr, warmup=warmup, decay=decay,
                               batch_size=batch_size, epochs=epochs,
                               patience=patience, max_length=max_length, seed=seed, eval_every=eval_every,
                               max_train_samples=max_train_samples, time_budget=time_budget, max_steps=max_steps,
                               device=device)
    task_data = task_data or load_task_data(data, labels=labels, metric=metric, problem=problem)
    if "normalize" in task_data.spec.kind_spec.record:
        task_data = dataclasses.replace(task_data, spec=dataclasses.replace(task_data.spec, normalize=normalize))
    return TaskPlan(method, config, train_config, task_data, data, pooling)


def build_model(plan: TaskPlan, backbone: Backbone, copy_encoder: bool = True) -> TaskModel:
    """The task's model on `backbone`, initialized from its seed alone (whatever ran before)."""
    check_max_length(backbone, plan.train_config.max_length)
    seed_everything(plan.train_config.seed)
    return build_task_model(backbone, plan.config, plan.data.spec, plan.pooling, plan.train_config.max_length,
                            copy_encoder=copy_encoder)


def save_trained(plan: TaskPlan, task_model: TaskModel, result: TrainResult, backbone: Backbone,
                 out: str | Path, to_cpu: bool = True) -> dict:
    """Score the trained model on the test split (if any) and write its artifact to `out`; returns the summary
    that metrics.json holds (without the history). `to_cpu`: move the model off its device (not a model sharing the
    encoder with others that train on)."""
    spec, max_length = result.spec, plan.train_config.max_length
    metrics = {"task": spec.name, "kind": spec.kind, "method": plan.method, "pooling": task_model.pooling,
               "metric": spec.metric, "dev": result.dev_score,
               **({"threshold": spec.threshold} if "threshold" in spec.kind_spec.record else {}),
               "best_step": result.best_step, "steps": result.steps, "stopped": result.stopped,
               "train_seconds": round(result.train_seconds, 2),
               "trainable_parameters": trainable_parameter_count(task_model), "history": result.history}
    if plan.data.test:
        encoded = encode(backbone.tokenizer, plan.data.test, spec, max_length)
        pad = backbone.tokenizer.pad_token_id or 0
        metrics["test"] = evaluate(task_model, encoded, spec, pad, resolve_device(plan.train_config.device))
    if to_cpu:
        task_model.to("cpu")
    training = {**plan.train_config.to_json(), "data": plan.data.source or plan.source, "started": time.time()}
    if isinstance(task_model, AotModel):  # built by get_aot_model's constructor: saved as get_aot_model's are
        task_model.spec = spec
        task_model.save_pretrained(out, metrics, training)
    else:
        save_task(out, task_model, backbone_identity(backbone), plan.config, spec, max_length, training, metrics)
    return {k: v for k, v in metrics.items() if k != "history"} | {"out": str(out)}


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
    plan = plan_task(data, method, rank, options, lr, batch_size, epochs, patience, eval_every, max_length,
                     max_train_samples, time_budget, max_steps, pooling, head_lr, warmup, decay, seed, labels, metric,
                     device, problem, task_data, normalize)
    backbone = backbone or load_backbone(model)
    task_model = build_model(plan, backbone)
    result = train(task_model, plan.data, backbone.tokenizer, plan.train_config, progress=progress)
    return save_trained(plan, task_model, result, backbone, out)


def check_max_length(backbone: Backbone, max_length: int) -> None:
    """Refuse a max length the encoder cannot run on, before training rather than at the first long batch."""
    limit = backbone.max_positions
    if limit is not None and max_length > limit:
        raise BackboneError(f"--max-length {max_length} exceeds what backbone {backbone.name} accepts "
                            f"({limit} tokens)")
