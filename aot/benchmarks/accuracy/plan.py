"""What a sweep of `aot bench accuracy` runs: its configuration, the grids (the paper's Table 2 values), the runs and
their ids, the fields of a run's record, and the task data each process loads once. The protocol, the grids and the
outputs are described in accuracy/sweep.py."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from aot.serving.protocol import pooling_row
from aot.training.data import BUILTIN, load_task_data
from aot.training.data.task import TaskData
from aot.training.methods import make_config, method_spec
from aot.training.trainer import TrainConfig

GRIDS = ("small", "paper", "defaults")

# Table 2, left (RoBERTa, all tasks except RTE).
PAPER_LRS = (1e-4, 5e-4, 1e-3, 5e-3)
PAPER_FULL_LRS = (1e-5, 5e-5, 1e-4, 5e-4, 5e-3)
PAPER_BATCH_SIZES = (16, 64)
PAPER_RANKS = {"fc": (32, 64, 128, 256, 512), "kron": (5, 10, 25, 30, 50), "lora": (2, 4, 16, 32, 64),
               "adapter": (16, 32, 64, 128, 256), "prefix": (5, 10, 20, 50, 100), "prompt": (5, 10, 20, 50, 100)}
# The small grid: the values of the paper grid that suit a few epochs on a train subset.
SMALL_LRS = (1e-3, 5e-3)
SMALL_FULL_LRS = (5e-5, 1e-4)
SMALL_BATCH_SIZES = (16,)
SMALL_RANKS = {"fc": (64,), "kron": (10,), "lora": (16,), "adapter": (64,), "prefix": (20,), "prompt": (20,)}

BUDGETS = ("epochs", "steps")

# Every record in runs/ and accuracy.json has exactly these keys (null where a value does not apply).
RECORD_FIELDS = ("run_id", "dataset", "task", "method", "lr", "batch_size", "rank_field", "rank", "seed", "phase",
                 "status", "reason", "note", "metric", "dev", "test", "split", "score", "trainable_parameters",
                 "train_seconds", "steps", "stopped", "settings", "history")


@dataclass
class SweepConfig:
    """What `aot bench accuracy` sweeps; aot/benchmarks/accuracy/sweep.py describes the protocol."""

    model: str
    datasets: list[str]
    methods: list[str]
    seeds: int = 3
    grid: str = "small"
    out: str = "bench-accuracy"
    max_train_samples: int | None = None
    max_length: int = 128
    epochs: int = 3
    patience: int = 3
    eval_every: int = 0
    budget: str = "epochs"  # "epochs": up to `epochs`, early stopping; "steps": exactly `steps` for every method
    steps: int = 100
    pooling: str | None = None  # None: the backbone's declared pooling (as `aot train`)
    workers: int = 1
    progress: bool = True

    def validate(self) -> None:
        """Fail before any training, naming the bad value."""
        if self.grid not in GRIDS:
            raise ValueError(f"unknown grid {self.grid!r}: expected one of {', '.join(GRIDS)}")
        if not self.datasets:
            raise ValueError("no datasets given")
        if not self.methods:
            raise ValueError("no methods given")
        for name, value in (("seeds", self.seeds), ("workers", self.workers), ("epochs", self.epochs),
                            ("patience", self.patience), ("max_length", self.max_length)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(f"max_train_samples must be a positive integer, got {self.max_train_samples}")
        if self.budget not in BUDGETS:
            raise ValueError(f"unknown budget {self.budget!r}: expected one of {', '.join(BUDGETS)}")
        if self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps}")
        if self.pooling is not None:
            pooling_row(self.pooling)
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        for method in self.methods:
            method_spec(method)  # raises MethodError naming the unknown method

    def train_settings(self) -> dict:
        """What, besides the dataset, method, hyperparameters and seed, changes a run's result (part of its id)."""
        settings = {"model": _canonical(self.model), "max_train_samples": self.max_train_samples,
                    "max_length": self.max_length, "epochs": self.epochs, "patience": self.patience,
                    "eval_every": self.eval_every}
        if self.budget == "steps":  # (runs of the epochs budget keep the ids they always had)
            settings = {**settings, "epochs": None, "patience": None, "budget": "steps", "steps": self.steps,
                        "eval_every": self.curve_every()}
        # Since issue 13 (pooling, schedule), runs from before have other ids and are not reused.
        return {**settings, "pooling": self.pooling or "model", "warmup": TrainConfig.warmup,
                "decay": TrainConfig.decay}

    def curve_every(self) -> int:
        """Steps between dev evaluations: as asked, or, under the steps budget, 10 points on each curve."""
        if self.budget == "steps" and not self.eval_every:
            return max(1, self.steps // 10)
        return self.eval_every

    def train_budget(self) -> dict:
        """train_task's stopping arguments. Steps: the same number of optimizer steps for every method (no early
        stopping; epochs only bound the loop); epochs: up to `epochs`, stopping after `patience` evaluations."""
        if self.budget == "steps":
            return {"epochs": 10 ** 6, "patience": 10 ** 9, "max_steps": self.steps, "eval_every": self.curve_every()}
        return {"epochs": self.epochs, "patience": self.patience, "eval_every": self.eval_every}


@dataclass(frozen=True)
class GridPoint:
    lr: float
    batch_size: int
    rank: int | None  # the method's rank-like value (rank, bottleneck or prompt length); None: it has none


@dataclass(frozen=True)
class Run:
    dataset: str
    method: str
    point: GridPoint
    seed: int
    phase: str  # "grid" or "seeds"


def grid_points(grid: str, method: str) -> list[GridPoint]:
    """The grid points of `method`, in a fixed order (ties on dev go to the earlier point)."""
    if grid not in GRIDS:
        raise ValueError(f"unknown grid {grid!r}: expected one of {', '.join(GRIDS)}")
    field = method_spec(method).config_cls.rank_field
    default_rank = None if field is None else getattr(make_config(method), field)
    paper = grid == "paper"
    if grid == "defaults":
        lrs, batch_sizes, ranks = (method_spec(method).default_lr,), (16,), (default_rank,)
    else:
        lrs = (PAPER_FULL_LRS if paper else SMALL_FULL_LRS) if method == "full" else (PAPER_LRS if paper else SMALL_LRS)
        batch_sizes = PAPER_BATCH_SIZES if paper else SMALL_BATCH_SIZES
        table = PAPER_RANKS if paper else SMALL_RANKS
        ranks = table.get(method, (default_rank,)) if field is not None else (default_rank,)
    return [GridPoint(lr, bs, rank) for rank in ranks for bs in batch_sizes for lr in lrs]


def _canonical(path_or_name: str) -> str:
    """Folders by absolute path (so `./data` and `data` are the same run), names as given."""
    return str(Path(path_or_name).resolve()) if os.path.isdir(path_or_name) else path_or_name


def run_id(config: SweepConfig, run: Run) -> str:
    """Readable and stable: equal ids mean the same training, whatever the phase or output folder."""
    key = {"dataset": _canonical(run.dataset), "method": run.method, **asdict(run.point), "seed": run.seed,
           **config.train_settings()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    name = run.dataset if run.dataset in BUILTIN else Path(run.dataset).name
    rank = "" if run.point.rank is None else f"-r{run.point.rank}"
    slug = f"{name}-{run.method}-lr{run.point.lr:g}-bs{run.point.batch_size}{rank}-s{run.seed}"
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', slug)}-{digest}"


@functools.cache
def task_data(dataset: str) -> TaskData:
    """Loaded once per process (built-in datasets parse a compressed corpus)."""
    return load_task_data(dataset)

