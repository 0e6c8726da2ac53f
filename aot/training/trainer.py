"""The training loop (paper section 4.1): Adam, early stopping on the dev metric.

The paper's schedule is a constant learning rate. The default here is a linear warm-up over the first 10 % of the
planned steps and a linear decay towards 0 over the rest (the last planned step runs at 1/(steps after warm-up) of
the rate, as in transformers' linear schedule; docs/benchmarks.md, "What closed the gap": at 100 steps it lifted FC on
Rotten Tomatoes from 76.3 to 78.6 and ended its swings); `warmup 0, decay constant` is the paper's. `head_lr`
gives the task head its own rate.

Evaluation happens every `eval_every` steps (or once per epoch) and at the last planned step; training stops after
`patience` evaluations without a better dev score, and the best trainable weights are restored at the end.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from aot.training.data.task import Example, TaskData, TaskSpec
from aot.training.kinds import Encoded, kind_for
from aot.training.kinds.base import autocast
from aot.training.model import TaskModel


@dataclass
class TrainConfig:
    lr: float = 1e-3
    head_lr: float | None = None  # the head's learning rate; None: lr
    warmup: float = 0.1  # fraction of the planned steps over which the rate rises linearly from 0
    decay: str = "linear"  # "linear" (towards 0 over the planned steps) or "constant"
    batch_size: int = 16
    epochs: int = 10
    patience: int = 3
    max_length: int = 128
    seed: int = 0
    eval_every: int = 0  # steps between dev evaluations; 0 = once per epoch
    max_train_samples: int | None = None
    time_budget: float | None = None  # seconds; training stops at the first evaluation past it
    max_steps: int | None = None  # optimizer steps; training stops there (evaluated at that step) whatever the epochs
    device: str = "auto"

    def __post_init__(self) -> None:
        check_schedule(self.warmup, self.decay)
        check_device(self.device)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class TrainResult:
    """`spec`: the task's, with what was tuned on dev after training (a multi-label threshold)."""

    dev_score: float
    best_step: int
    steps: int
    train_seconds: float
    history: list[dict] = field(default_factory=list)
    stopped: str = "epochs"
    spec: TaskSpec | None = None


def check_device(device: str) -> None:
    """`auto`, `cpu`, `cuda` or `cuda:N`, and a CUDA device only where this PyTorch sees one: refused in one line
    before any data or model is read, not as a traceback from the first tensor moved."""
    kind, _, number = device.partition(":")
    if device != "auto" and (kind not in ("cpu", "cuda") or (number and (kind == "cpu" or not number.isdigit()))):
        raise ValueError(f"--device {device!r}: expected cpu, cuda (cuda:N) or auto")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: CUDA is not available (this PyTorch {torch.__version__} sees no "
                         "CUDA device); use --device cpu or auto")
    if number and kind == "cuda" and int(number) >= torch.cuda.device_count():
        raise ValueError(f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


DECAYS = ("linear", "constant")


def check_schedule(warmup: float, decay: str) -> None:
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warmup must be a fraction of the steps in [0, 1), got {warmup}")
    if decay not in DECAYS:
        raise ValueError(f"unknown decay {decay!r}: expected one of {', '.join(DECAYS)}")


def schedule(step: int, total: int, warmup: float, decay: str) -> float:
    """The learning-rate multiplier before optimizer step `step` (0-based) of `total` planned steps."""
    warm = min(int(round(warmup * total)), max(total - 1, 0))  # at least one step at the full rate
    if step < warm:
        return (step + 1) / (warm + 1)
    if decay == "linear":
        return max(0.0, (total - step) / max(1, total - warm))
    return 1.0


def make_optimizer(model: TaskModel, config: TrainConfig) -> torch.optim.Optimizer:
    """Adam over the trainable parameters: the head in its own group when it has its own rate."""
    head = [p for p in model.head.parameters() if p.requires_grad]
    head_ids = {id(p) for p in head}
    body = [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids]
    groups = [{"params": body, "lr": config.lr}, {"params": head, "lr": config.head_lr or config.lr}]
    return torch.optim.Adam([g for g in groups if g["params"]])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def encode(tokenizer, examples: list[Example], spec: TaskSpec, max_length: int) -> Encoded:
    """A split as its kind trains on it (aot.training.kinds)."""
    return kind_for(spec).encode(tokenizer, examples, spec, max_length)


def evaluate(model: TaskModel, encoded: Encoded, spec: TaskSpec, pad_id: int, device: torch.device) -> float:
    """The task's metric on a labelled split."""
    return score(kind_for(spec).predict(model, encoded, pad_id, device), encoded, spec)


def score(predictions, encoded: Encoded, spec: TaskSpec) -> float:
    """The task's metric of its kind's predictions on a labelled split."""
    return kind_for(spec).score(predictions, encoded, spec)


def train_examples(data: TaskData, config: TrainConfig) -> list[Example]:
    """The examples a task trains on: its train split, or a seeded random subset of `max_train_samples`."""
    if config.max_train_samples is not None and config.max_train_samples < len(data.train):
        return random.Random(config.seed).sample(data.train, config.max_train_samples)
    return data.train


class TaskRun:
    """One task's training, a step at a time: the batches of each epoch in a seeded order, Adam under the learning
    rate schedule, the dev evaluations, early stopping and the best weights. `train` runs one; a job of many tasks
    (aot.training.job) runs one per task, their batches sharing passes of the encoder, so that a task learns there
    as it does alone. A step: `next_rows`, the loss of those rows (`loss`, or computed with other tasks'), the
    gradients zeroed and computed, then `after_step`. `state_dict` is everything a resumed run needs."""

    def __init__(self, model: TaskModel, data: TaskData, tokenizer, config: TrainConfig):
        self.model, self.config, self.spec = model, config, data.spec
        self.device = resolve_device(config.device)
        model.to(self.device)
        self.kind = kind_for(self.spec)
        self.train_enc = self.kind.encode(tokenizer, train_examples(data, config), self.spec, config.max_length)
        self.dev_enc = self.kind.encode(tokenizer, data.dev, self.spec, config.max_length)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.optimizer = make_optimizer(model, config)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.steps_per_epoch = -(-len(self.train_enc) // config.batch_size)
        self.eval_every = config.eval_every or self.steps_per_epoch
        planned = self.steps_per_epoch * config.epochs
        self.total = planned if config.max_steps is None else min(config.max_steps, planned)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: schedule(k, self.total, config.warmup, config.decay))
        self.best = (-float("inf"), model.trainable_state(), 0)
        self.history: list[dict] = []
        self.bad_evals = self.step = self.epoch = self.position = 0  # position: batches of this epoch done
        self.order: list[int] = []
        self.stopped: str | None = None  # why it stopped; None while it trains
        self.last_loss = float("nan")
        self._clock = time.perf_counter()
        self._seconds = 0.0  # trained before the clock started (a resumed run's)

    @property
    def done(self) -> bool:
        return self.stopped is not None

    @property
    def seconds(self) -> float:
        return self._seconds + time.perf_counter() - self._clock

    def next_rows(self) -> list[int]:
        """The rows of the next batch; an epoch begins in train mode with a new order."""
        if self.position == 0:
            self.model.train()
            self.order = torch.randperm(len(self.train_enc), generator=self.generator).tolist()
        size = self.config.batch_size
        return self.order[self.position * size:(self.position + 1) * size]

    def loss(self, rows: list[int]) -> torch.Tensor:
        """The loss of the batch `rows` computed by the model alone."""
        with autocast(self.device):
            return self.kind.loss(self.model, self.train_enc, rows, self.pad_id, self.device, self.spec)

    def after_step(self, loss: float) -> bool:
        """The optimizer's and the schedule's step after the gradients of a batch of loss `loss`, then the dev
        evaluation when one is due and the stopping rules; True when it evaluated."""
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.position += 1
        self.last_loss = loss
        evaluated = self.step % self.eval_every == 0 or self.step == self.total  # the last: its weights may be best
        if evaluated:
            self._evaluate()
        if self.stopped is None and self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            if self.epoch == self.config.epochs:
                self.stopped = "epochs"
        return evaluated

    def _evaluate(self) -> None:
        dev = evaluate(self.model, self.dev_enc, self.spec, self.pad_id, self.device)
        self.model.train()
        elapsed = self.seconds
        self.history.append({"step": self.step, "epoch": self.epoch + self.position / self.steps_per_epoch,
                             "loss": round(self.last_loss, 6), "dev": dev, "seconds": round(elapsed, 2)})
        if dev > self.best[0]:
            self.best, self.bad_evals = (dev, self.model.trainable_state(), self.step), 0
        else:
            self.bad_evals += 1
        if self.bad_evals >= self.config.patience:
            self.stopped = "patience"
        elif self.config.time_budget is not None and elapsed > self.config.time_budget:
            self.stopped = "time_budget"
        elif self.step == self.config.max_steps:
            self.stopped = "max_steps"

    def finish(self) -> TrainResult:
        """The best dev weights restored, in eval mode, and what was tuned on dev with them."""
        seconds = self.seconds
        if not self.history:  # fewer steps than one evaluation period: evaluate what we have
            dev = evaluate(self.model, self.dev_enc, self.spec, self.pad_id, self.device)
            self.best = (dev, self.model.trainable_state(), self.step)
            self.history.append({"step": self.step, "epoch": self.config.epochs, "dev": dev,
                                 "seconds": round(seconds, 2)})
        self.model.load_trainable_state(self.best[1])
        self.model.eval()
        spec = self.spec
        if self.kind.tunes:
            spec = self.kind.calibrate(self.kind.predict(self.model, self.dev_enc, self.pad_id, self.device),
                                       self.dev_enc, spec)
        return TrainResult(self.best[0], self.best[2], self.step, seconds, self.history, self.stopped or "epochs",
                           spec)

    def state_dict(self) -> dict:
        """Everything a resumed run continues from (torch.save-able)."""
        return {"weights": self.model.trainable_state(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "generator": self.generator.get_state(),
                "order": self.order, "best": self.best, "history": self.history, "bad_evals": self.bad_evals,
                "step": self.step, "epoch": self.epoch, "position": self.position, "stopped": self.stopped,
                "last_loss": self.last_loss, "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_trainable_state(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        for name in ("order", "best", "history", "bad_evals", "step", "epoch", "position", "stopped", "last_loss"):
            setattr(self, name, state[name])
        self._seconds, self._clock = state["seconds"], time.perf_counter()


def train(model: TaskModel, data: TaskData, tokenizer, config: TrainConfig, progress: bool = True) -> TrainResult:
    """Train `model` in place; on return it holds the best dev weights and is in eval mode."""
    seed_everything(config.seed)
    run = TaskRun(model, data, tokenizer, config)
    bar = tqdm(total=run.total, disable=not progress, desc=f"train {run.spec.name}", unit="step",
               dynamic_ncols=True)
    try:
        while not run.done:
            loss = run.loss(run.next_rows())
            run.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            run.after_step(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{run.last_loss:.4f}", dev=f"{run.best[0]:.4f}" if run.history else "-")
    finally:
        bar.close()
    return run.finish()
