"""What a task is: examples, a label set (or a regression target) and a metric."""

from __future__ import annotations

from dataclasses import dataclass, field

from training.metrics import METRICS


class DataError(ValueError):
    """Bad training data; the message names the file, the line and the problem."""


class DataWarning(UserWarning):
    """Data that loads but may not mean what was assumed (`aot` prints it as `aot: warning: ...`)."""


PROBLEMS = ("classification", "regression")


@dataclass(frozen=True)
class Example:
    text: str
    label: str | float
    text_pair: str | None = None


@dataclass(frozen=True)
class TaskSpec:
    """The label space and metric of a task. `labels is None` means regression (one float target)."""

    name: str
    labels: tuple[str, ...] | None
    metric: str
    has_pair: bool = False

    def __post_init__(self):
        if self.metric not in METRICS:
            raise DataError(f"unknown metric {self.metric!r}: expected one of {', '.join(METRICS)}")
        if self.labels is not None and len(self.labels) < 2:
            raise DataError(f"task {self.name!r} needs at least 2 labels, got {list(self.labels)}")

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_outputs(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    def to_json(self) -> dict:
        return {"name": self.name, "labels": None if self.labels is None else list(self.labels),
                "metric": self.metric, "has_pair": self.has_pair}

    @classmethod
    def from_json(cls, data: dict) -> "TaskSpec":
        labels = data["labels"]
        return cls(data["name"], None if labels is None else tuple(labels), data["metric"], bool(data["has_pair"]))


@dataclass
class TaskData:
    """A task and its splits. `train` and `dev` are required; `test` is optional."""

    spec: TaskSpec
    splits: dict[str, list[Example]] = field(default_factory=dict)
    source: str = ""

    @property
    def train(self) -> list[Example]:
        return self.splits["train"]

    @property
    def dev(self) -> list[Example]:
        return self.splits["dev"]

    @property
    def test(self) -> list[Example] | None:
        return self.splits.get("test")
