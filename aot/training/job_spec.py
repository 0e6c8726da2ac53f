"""The tasks of a job as they are given: one spec per task (a manifest's line, or a dict in Python), each checked
alone, so that a bad one is refused with its reason and the others train.

A spec names the task (`name`: its artifact's folder under the job's out), its `data`, and any option of `aot train`
by its long name (`max_length` or `max-length`; `option`: ["NAME=VALUE", ...] or {NAME: VALUE}; `labels`: a list or
"a,b"), each set over the job's defaults (the command line's). The encoder (`model`) and where and how the job runs
(`device`, `out`, ...) are the job's: a spec may repeat the job's model, not name another.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from aot.serving.protocol import POOLINGS
from aot.training.data import PROBLEMS
from aot.training.method_registry import METHODS, parse_options
from aot.training.metrics import METRICS
from aot.training.trainer import DECAYS

NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")  # a served task name's rule (one segment, no tenant)


def _int(low: int) -> tuple[Callable, str]:
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low,
            "a positive integer" if low else "a non-negative integer")


_POSITIVE = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a positive number")
_STRINGS = (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
            "a list of strings or a comma-separated string")

# What a spec may set: key (train_task's argument) -> (check, what it must be).
TASK_OPTIONS: dict[str, tuple[Callable, str]] = {
    "data": (lambda v: isinstance(v, str) and v != "", "a built-in dataset or a folder"),
    "method": (lambda v: v in METHODS, f"one of {', '.join(METHODS)}"),
    "rank": _int(1),
    "options": (lambda v: isinstance(v, dict) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
                "{NAME: VALUE} or a list of \"NAME=VALUE\""),
    "lr": _POSITIVE, "head_lr": _POSITIVE, "time_budget": _POSITIVE,
    "warmup": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1, "a fraction in [0, 1)"),
    "decay": (lambda v: v in DECAYS, f"one of {', '.join(DECAYS)}"),
    "batch_size": _int(1), "epochs": _int(1), "patience": _int(1), "max_length": _int(1),
    "max_train_samples": _int(1), "max_steps": _int(1), "eval_every": _int(0),
    "pooling": (lambda v: v in POOLINGS, f"one of {', '.join(POOLINGS)}"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "labels": _STRINGS,
    "metric": (lambda v: v in METRICS, f"one of {', '.join(METRICS)}"),
    "problem": (lambda v: v in PROBLEMS, f"one of {', '.join(PROBLEMS)}"),
    "normalize": (lambda v: isinstance(v, bool), "true or false"),
}
ALIASES = {"option": "options"}  # the command line's name of a key
JOB_KEYS = ("device", "out", "overwrite", "progress", "no_progress", "resume", "shard", "tasks", "tasks_per_step",
            "fit_to", "task")


class SpecError(ValueError):
    """A task's spec that cannot train: the message says which key and what it must be."""


@dataclass
class TaskSpec:
    """A checked spec: the task's name and train_task's arguments (the defaults overlaid with its own)."""

    name: str
    arguments: dict
    where: str  # how messages name it: `FILE:LINE` or `task K`

    def fingerprint(self, model: str) -> str:
        """What identifies the task's training (its encoder and arguments): a job resumed with another spec for it
        does not continue its checkpoint."""
        text = json.dumps({"model": model, **self.arguments}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SpecError(f"name {name!r}: expected 1-128 letters, digits, '_', '-' or '.', not starting with '.' (the "
                        "folder of its artifact)")
    return name


def normalize(spec: dict) -> dict:
    """The spec's keys as train_task names them (`max-length` -> `max_length`, `option` -> `options`)."""
    out = {}
    for key, value in spec.items():
        name = ALIASES.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name in out:
            raise SpecError(f"{key!r} is given twice")
        out[name] = value
    return out


def resolve(spec: dict, defaults: dict, model: str | None, where: str) -> TaskSpec:
    """The spec checked and laid over `defaults` (train_task's arguments the job was given). SpecError names the
    first bad key."""
    spec = normalize(spec)
    name = check_name(spec.pop("name", None))
    named_model = spec.pop("model", None)
    if named_model is not None and named_model != model:
        raise SpecError(f"model {named_model!r}: the job trains on {model!r} (one frozen encoder per job); train "
                        "this task in a job of its own")
    for key in spec:
        if key in JOB_KEYS:
            raise SpecError(f"{key!r} is the job's, not a task's: give it on the command line")
        if key not in TASK_OPTIONS:
            close = difflib.get_close_matches(key, TASK_OPTIONS, n=1)
            raise SpecError(f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                            + f": expected name, model or one of {', '.join(TASK_OPTIONS)}")
        check, expected = TASK_OPTIONS[key]
        if spec[key] is not None and not check(spec[key]):
            raise SpecError(f"{key} {spec[key]!r}: expected {expected}")
    arguments = {**defaults, **spec}
    arguments["method"] = arguments.get("method") or "fc"
    if not arguments.get("data"):
        raise SpecError("no data: give \"data\" (or --data for every task)")
    if isinstance(arguments.get("labels"), str):
        arguments["labels"] = [label.strip() for label in arguments["labels"].split(",") if label.strip()]
    arguments["options"] = _options(arguments["method"], arguments.get("options"))
    return TaskSpec(name, arguments, where)


def _options(method: str, options) -> dict:
    """The method's options, each value converted to its type as `--option NAME=VALUE` converts it."""
    if not options:
        return {}
    if isinstance(options, dict):
        options = [f"{key}={_text(value)}" for key, value in options.items()]
    return parse_options(method, options)


def _text(value) -> str:
    """A JSON value as the command line would give it."""
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
