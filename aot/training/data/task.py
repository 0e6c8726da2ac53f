"""What a task is: its kind, examples, a label set (or a regression target) and a metric."""

from __future__ import annotations

from dataclasses import dataclass, field

from aot.serving.kinds import DENSE, KINDS, KindSpec, kind_of
from aot.training.metrics import METRICS


class DataError(ValueError):
    """Bad training data; the message names the file, the line and the problem."""


class DataWarning(UserWarning):
    """Data that loads but may not mean what was assumed (`aot` prints it as `aot: warning: ...`)."""


MAX_LISTED = 20  # bad rows a DataErrors lists; it counts the others


class DataErrors(DataError):
    """Every bad row of a data set, found in one pass over its files before any model is loaded: `problems` holds
    the first MAX_LISTED (each `FILE:LINE: cause`), `total` counts them all. One bad row is its own message; several
    are a `summary` line and the `details`, one line per listed row (`aot` prints the details, then the summary as
    its error)."""

    def __init__(self, source: str, problems: list[str], total: int):
        self.problems, self.total = problems, total
        listed = f" (the first {len(problems)} listed)" if total > len(problems) else ""
        self.summary = problems[0] if total == 1 else f"{source}: {total} bad rows{listed}; nothing was read"
        self.details = [] if total == 1 else problems
        super().__init__("\n".join([self.summary, *self.details]))


class Problems:
    """The bad rows met while reading a data set: each row's DataError is added here and the reading goes on, so that
    one run names every bad row (MAX_LISTED of them, and how many) instead of the first."""

    def __init__(self):
        self.listed: list[str] = []
        self.total = 0

    def add(self, error: DataError | str) -> None:
        self.total += 1
        if len(self.listed) < MAX_LISTED:
            self.listed.append(str(error))

    def check(self, source: str) -> None:
        """DataErrors when any row was bad."""
        if self.total:
            raise DataErrors(source, self.listed, self.total)


PROBLEMS = tuple(KINDS)  # `--problem`: the task's kind (aot.serving.kinds)


@dataclass(frozen=True)
class Example:
    """One example. `label` by kind: a label name (classification), a number (regression), a tuple of label names
    (multilabel), a tuple of BIO tags, one per word of `text`, whose words are joined by single spaces (tokens), the
    pair's score or None (embedding: `text_pair` is the positive)."""

    text: str
    label: str | float | tuple[str, ...] | None
    text_pair: str | None = None


@dataclass(frozen=True)
class TaskSpec:
    """The kind, label space and metric of a task. `kind` "" is a classification, or a regression when `labels` is
    None (what a record without a kind means). `labels`: the classes (classification, multilabel) or the BIO tags
    (tokens); None for regression and embedding. `threshold`: a multi-label task's, tuned on dev after training.
    `normalize`: an embedding task answers unit vectors."""

    name: str
    labels: tuple[str, ...] | None
    metric: str
    has_pair: bool = False
    kind: str = ""
    threshold: float | None = None
    normalize: bool = True

    def __post_init__(self):
        kind = self.kind or kind_of({"labels": self.labels})
        object.__setattr__(self, "kind", kind)
        if kind not in KINDS:
            raise DataError(f"unknown problem {kind!r}: expected one of {', '.join(KINDS)}")
        if self.metric not in METRICS:
            raise DataError(f"unknown metric {self.metric!r}: expected one of {', '.join(METRICS)}")
        spec = KINDS[kind]
        if self.metric not in spec.metrics:
            raise DataError(f"metric {self.metric!r} does not score a {kind} task: expected one of "
                            f"{', '.join(spec.metrics)}")
        if (self.labels is not None) != spec.labelled:
            raise DataError(f"a {kind} task " + ("has no label set" if self.labels is not None else "needs labels"))
        least = spec.least_labels
        if self.labels is not None and len(self.labels) < least:
            raise DataError(f"task {self.name!r} needs at least {least} labels, got {list(self.labels)}")

    @property
    def is_regression(self) -> bool:
        """A score per text, read from a label column as a number (aot.training.data.files.read_examples)."""
        return self.kind_spec.head == DENSE and not self.kind_spec.labelled

    @property
    def kind_spec(self) -> KindSpec:
        """Its kind's spec (aot.serving.kinds)."""
        return KINDS[self.kind]

    @property
    def num_outputs(self) -> int:
        """The head's outputs: one per label (or tag), 1 for regression, 0 for an embedding (no head)."""
        return len(self.labels) if self.labels is not None else self.kind_spec.unlabelled_outputs

    def to_json(self) -> dict:
        data = {"name": self.name, "labels": None if self.labels is None else list(self.labels),
                "metric": self.metric, "has_pair": self.has_pair, "kind": self.kind}
        return data | {key: getattr(self, key) for key in self.kind_spec.record}  # a threshold, normalize

    @classmethod
    def from_json(cls, data: dict) -> "TaskSpec":
        labels = data["labels"]
        return cls(data["name"], None if labels is None else tuple(labels), data["metric"], bool(data["has_pair"]),
                   kind_of(data), data.get("threshold"), bool(data.get("normalize", True)))


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
