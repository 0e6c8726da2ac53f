"""Which tasks get metric series of their own: the K busiest, the rest under one label.

With 10,000 tasks, series per task would be 10,000 x (steps x instances x families) series per replica: more than a
Prometheus server wants to scrape from every replica. So each step instance names at most K tasks (the busiest,
by requests with a decaying weight) and counts every other task under OTHER; requests that name no task the store
holds are counted under UNKNOWN, and those refused before a task was named (or of a step that serves no task, such
as task_list) under NONE. No task name can take these values (task names are letters, digits, '_', '-' and '.').

A task that stops being among the busiest leaves its place to a busier one only when the newcomer's weight is more
than HYSTERESIS times its own: a task on the edge does not flap in and out. Its series are then removed (the caller
does it: aot.serving.step_metrics), and its later requests count under OTHER.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from aot import settings

OTHER = "<other>"
UNKNOWN = "<unknown>"
NONE = "<none>"
PLACEHOLDERS = (OTHER, UNKNOWN, NONE)

HALF_LIFE_SECONDS = 600.0  # a request 10 minutes ago weighs half as much as one now
HYSTERESIS = 2.0
# Forward decay: a request at time t weighs 2**((t - landmark) / half-life), so weights are compared without
# decaying every task's; the landmark moves (and every weight shrinks with it) before the exponent grows large.
_MAX_EXPONENT = 500.0


def metrics_tasks(environ: dict | None = None) -> int:
    """K from the environment (AOT_METRICS_TASKS, which `aot serve --metrics-tasks` sets), else the default."""
    return settings.METRICS_TASKS.read(environ)


@dataclass
class LabelChange:
    """What one update decided: tasks that got series of their own, and tasks whose series must go."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


class TaskLabels:
    """The K busiest tasks of one step instance, by decayed request counts.

    `update(counts)` (once per metrics flush) adds the counts of the last interval and returns the LabelChange;
    `label(task)` is the task's own name while it has series of its own, else OTHER. Weights are kept for at most
    `tracked` tasks (the lightest dropped first), so memory stays bounded with 100,000 tasks."""

    def __init__(self, limit: int, half_life: float = HALF_LIFE_SECONDS, clock=time.monotonic):
        if limit < 0:
            raise ValueError(f"limit {limit}: expected a non-negative number of tasks")
        self.limit, self.half_life, self.clock = limit, half_life, clock
        self.tracked = max(10 * limit, 1000)
        self.labelled: set[str] = set()
        self._weights: dict[str, float] = {}
        self._landmark = clock()

    def label(self, task: str) -> str:
        return task if task in self.labelled else OTHER

    def weight(self, task: str) -> float:
        """The task's decayed request count, in requests as of now."""
        return self._weights.get(task, 0.0) * 2.0 ** (-(self.clock() - self._landmark) / self.half_life)

    def update(self, counts: dict[str, int]) -> LabelChange:
        now = self.clock()
        exponent = (now - self._landmark) / self.half_life
        if exponent > _MAX_EXPONENT:
            self._rebase(now)
            exponent = 0.0
        scale = 2.0 ** exponent
        for task, n in counts.items():
            self._weights[task] = self._weights.get(task, 0.0) + n * scale
        change = self._promote([t for t in counts if t not in self.labelled])
        if len(self._weights) > self.tracked:
            self._forget()
        return change

    def _promote(self, candidates: Iterable[str]) -> LabelChange:
        """Free places go to the heaviest candidates; then a candidate takes the lightest labelled task's place
        while it weighs more than HYSTERESIS times as much."""
        change = LabelChange()
        if self.limit == 0:
            return change
        for task in sorted(candidates, key=self._weights.__getitem__, reverse=True):
            if len(self.labelled) < self.limit:
                self.labelled.add(task)
                change.added.append(task)
                continue
            lightest = min(self.labelled, key=self._weights.__getitem__)
            if self._weights[task] <= HYSTERESIS * self._weights[lightest]:
                break  # candidates come heaviest first: no later one beats it either
            self.labelled.discard(lightest)
            self.labelled.add(task)
            change.removed.append(lightest)
            change.added.append(task)
        return change

    def _rebase(self, now: float) -> None:
        factor = 2.0 ** (-(now - self._landmark) / self.half_life)
        self._weights = {t: w * factor for t, w in self._weights.items() if w * factor > 0 or t in self.labelled}
        self._landmark = now

    def _forget(self) -> None:
        """Drop the lightest half of the tasks without series of their own (a task with a place keeps its weight)."""
        others = sorted((t for t in self._weights if t not in self.labelled), key=self._weights.__getitem__)
        for task in others[: max(len(self._weights) - self.tracked // 2, 0)]:
            del self._weights[task]
