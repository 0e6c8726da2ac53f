"""A job's tasks checked before anything trains: each spec resolved, its data read and checked, its artifact's
folder free; a task that cannot train is refused with its reason, alone. On a resumed job, a task trained by an
earlier run of the same spec is kept.

Every process of a sharded job prepares every task alike (the same refusals, the same plans), then takes its shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aot.serving.formats import JsonLine
from aot.training.api import TaskPlan, check_max_length, plan_task
from aot.training.backbone import Backbone, BackboneError
from aot.training.data import DataError, load_task_data
from aot.training.data.task import TaskData
from aot.training.job_spec import SpecError, TaskSpec, resolve
from aot.training.job_state import JobFolder
from aot.training.method_registry import MethodError, method_spec

REFUSED = (SpecError, DataError, MethodError, BackboneError, ValueError, OSError)  # a task's own bad input


@dataclass
class Prepared:
    """A task that trains (or was trained by an earlier run of the job: `kept`)."""

    index: int  # its position in the job's list
    spec: TaskSpec
    plan: TaskPlan | None
    fingerprint: str
    kept: dict | None = None  # the record of an earlier run that trained it
    cost: float = field(default=0.0)

    @property
    def name(self) -> str:
        return self.spec.name


def refusal(index: int, where: str, reason: str, name: str | None = None) -> dict:
    return {"index": index, "name": name, "status": "refused", "where": where, "reason": reason}


def entries(tasks: list) -> list[tuple[dict | None, str, str | None]]:
    """(spec, where, why there is none) of each task: a dict, or a manifest's line (aot.serving.formats.JsonLine)."""
    out = []
    for k, task in enumerate(tasks, 1):
        if isinstance(task, JsonLine):
            out.append((task.item, task.where, task.error))
        elif isinstance(task, dict):
            out.append((task, f"task {k}", None))
        else:
            out.append((None, f"task {k}", f"expected a dict, got {type(task).__name__}"))
    return out


def job_model(model: str | None, specs: list[tuple[dict | None, str, str | None]]) -> str:
    """The job's encoder: `model`, else the one the first spec names."""
    model = model or next((s.get("model") for s, _, _ in specs if isinstance(s, dict) and s.get("model")), None)
    if not isinstance(model, str) or not model:
        raise ValueError("no model: give --model (every task's encoder), or \"model\" in the tasks")
    return model


class Preparation:
    """The job's tasks sorted into those that train, those kept from an earlier run and those refused."""

    def __init__(self, tasks: list, defaults: dict, model: str, folder: JobFolder, resume: bool, overwrite: bool,
                 device: str):
        self.prepared: list[Prepared] = []
        self.refused: list[dict] = []
        self._data: dict[tuple, TaskData] = {}
        seen: dict[str, str] = {}
        for index, (spec, where, error) in enumerate(entries(tasks)):
            name = spec.get("name") if isinstance(spec, dict) and isinstance(spec.get("name"), str) else None
            if error is not None:
                self.refused.append(refusal(index, where, error, name))
                continue
            if name in seen:
                self.refused.append(refusal(index, where, f"name {name!r} is taken by {seen[name]}", name))
                continue
            try:
                task = resolve(spec, defaults, model, where)
                seen[task.name] = where
                self.prepared.append(self._prepare(index, task, model, folder, resume, overwrite, device))
            except REFUSED as exc:
                self.refused.append(refusal(index, where, str(exc), name))

    def _prepare(self, index: int, spec: TaskSpec, model: str, folder: JobFolder, resume: bool, overwrite: bool,
                 device: str) -> Prepared:
        fingerprint = spec.fingerprint(model)
        record = folder.record(spec.name) if resume else None
        out = folder.out / spec.name
        if record is not None and record.get("fingerprint") == fingerprint:
            if record.get("status") == "trained" and out.is_dir():
                return Prepared(index, spec, None, fingerprint, kept=record)
        elif _holds_something(out) and not overwrite:
            raise ValueError(f"{out} already exists; pass --overwrite to replace it")
        arguments = dict(spec.arguments)
        if not method_spec(arguments["method"]).shared_backbone:
            raise MethodError(f"method {arguments['method']!r} changes the encoder: a job trains AoT tasks (fc, kron) "
                              f"on one frozen encoder; train this task alone (aot train --method {arguments['method']})")
        key = (arguments["data"], tuple(arguments.get("labels") or ()) or None, arguments.get("metric"),
               arguments.get("problem"))
        if key not in self._data:
            self._data[key] = load_task_data(arguments["data"], labels=arguments.get("labels"),
                                             metric=arguments.get("metric"), problem=arguments.get("problem"))
        plan = plan_task(**arguments, device=device, task_data=self._data[key])
        return Prepared(index, spec, plan, fingerprint, cost=_cost(plan))

    def check_backbone(self, backbone: Backbone) -> None:
        """Refuse the tasks the encoder cannot train: a max length beyond its positions, tokens without a fast
        tokenizer."""
        kept = []
        for task in self.prepared:
            try:
                if task.plan is not None:
                    check_max_length(backbone, task.plan.train_config.max_length)
                    if task.plan.data.spec.kind_spec.reads_tokens and not getattr(backbone.tokenizer, "is_fast", False):
                        raise DataError("token tasks need a fast tokenizer (character offsets): this model's is not")
                kept.append(task)
            except REFUSED as exc:
                self.refused.append(refusal(task.index, task.spec.where, str(exc), task.name))
        self.prepared = kept
        self._data.clear()


def _holds_something(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def planned_steps(plan: TaskPlan) -> int:
    """The steps the task runs unless it stops early."""
    config = plan.train_config
    examples = len(plan.data.train)
    if config.max_train_samples is not None:
        examples = min(examples, config.max_train_samples)
    steps = -(-examples // config.batch_size) * config.epochs
    return steps if config.max_steps is None else min(steps, config.max_steps)


def _cost(plan: TaskPlan) -> float:
    """The task's planned work: its steps times the tokens of each (both texts of a pair task's)."""
    config = plan.train_config
    pairs = 2 if plan.data.spec.kind_spec.pair_examples else 1
    return float(planned_steps(plan) * config.batch_size * config.max_length * pairs)
