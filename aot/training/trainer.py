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


def train(model: TaskModel, data: TaskData, tokenizer, config: TrainConfig, progress: bool = True) -> TrainResult:
    """Train `model` in place; on return it holds the best dev weights and is in eval mode."""
    seed_everything(config.seed)
    device = resolve_device(config.device)
    model.to(device)
    spec = data.spec
    train_examples = data.train
    if config.max_train_samples is not None and config.max_train_samples < len(train_examples):
        picker = random.Random(config.seed)
        train_examples = picker.sample(train_examples, config.max_train_samples)
    kind = kind_for(spec)
    train_enc = kind.encode(tokenizer, train_examples, spec, config.max_length)
    dev_enc = kind.encode(tokenizer, data.dev, spec, config.max_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    optimizer = make_optimizer(model, config)
    generator = torch.Generator().manual_seed(config.seed)
    n = len(train_enc)
    steps_per_epoch = -(-n // config.batch_size)
    eval_every = config.eval_every or steps_per_epoch
    total = steps_per_epoch * config.epochs if config.max_steps is None else min(config.max_steps,
                                                                                 steps_per_epoch * config.epochs)

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: schedule(k, total, config.warmup, config.decay))
    best = (-float("inf"), model.trainable_state(), 0)
    history: list[dict] = []
    bad_evals, step, stopped = 0, 0, "epochs"
    start = time.perf_counter()
    bar = tqdm(total=total, disable=not progress, desc=f"train {spec.name}", unit="step",
               dynamic_ncols=True)
    try:
        for epoch in range(config.epochs):
            model.train()
            order = torch.randperm(n, generator=generator).tolist()
            for b in range(steps_per_epoch):
                rows = order[b * config.batch_size:(b + 1) * config.batch_size]
                with autocast(device):
                    loss = kind.loss(model, train_enc, rows, pad_id, device, spec)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.4f}", dev=f"{best[0]:.4f}" if history else "-", refresh=False)
                if step % eval_every == 0 or step == total:  # the last step too: its weights may be the best
                    dev = evaluate(model, dev_enc, spec, pad_id, device)
                    model.train()
                    elapsed = time.perf_counter() - start
                    history.append({"step": step, "epoch": epoch + (b + 1) / steps_per_epoch,
                                    "loss": round(loss.item(), 6), "dev": dev, "seconds": round(elapsed, 2)})
                    if dev > best[0]:
                        best, bad_evals = (dev, model.trainable_state(), step), 0
                    else:
                        bad_evals += 1
                    bar.set_postfix(loss=f"{loss.item():.4f}", dev=f"{best[0]:.4f}")
                    if bad_evals >= config.patience:
                        stopped = "patience"
                        raise StopIteration
                    if config.time_budget is not None and elapsed > config.time_budget:
                        stopped = "time_budget"
                        raise StopIteration
                    if step == config.max_steps:
                        stopped = "max_steps"
                        raise StopIteration
    except StopIteration:
        pass
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    if not history:  # fewer steps than one evaluation period: evaluate what we have
        dev = evaluate(model, dev_enc, spec, pad_id, device)
        best = (dev, model.trainable_state(), step)
        history.append({"step": step, "epoch": config.epochs, "dev": dev, "seconds": round(seconds, 2)})
    model.load_trainable_state(best[1])
    model.eval()
    tuned = kind.calibrate(kind.predict(model, dev_enc, pad_id, device), dev_enc, spec) if kind.tunes else spec
    return TrainResult(best[0], best[2], step, seconds, history, stopped, tuned)
