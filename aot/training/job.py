"""Many tasks trained in one job on one frozen encoder (`aot train --tasks MANIFEST --out DIR`, `train_tasks`).

The job checks every task first (aot.training.job_prepare: a bad one is refused with its reason, alone), loads the
encoder once, then trains up to `tasks_per_step` tasks at a time: each step takes the next batch of every active task
and runs them in shared passes of the encoder (aot.training.mixed_step). Each task keeps its own everything: its P
and head, Adam state, learning-rate schedule, batch order and epochs, dev evaluations, early stopping and best
weights (aot.training.trainer.TaskRun, what a run alone uses) and its own random stream (aot.training.task_random),
so that it learns what it learns alone. When a task stops, its artifact is written to DIR/NAME exactly as a solo
`aot train` writes it, and the next waiting task takes its place.

A task whose loss is not finite stops alone (failed: diverged) and its batch is left out of the step; a task that
raises fails alone. Each running task is checkpointed at its evaluations and every `checkpoint_seconds`
(aot.training.job_state), so that a killed job run again with `resume` keeps its trained tasks and continues every
other from its last checkpoint: from there it trains on exactly as it would have. Under torchrun, or with `shard`,
each process trains its share of the tasks (aot.training.sharding) into the same DIR.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from aot.serving_torch.encoder import BiasedEncoder
from aot.training.api import build_model, save_trained
from aot.training.artifact import read_task
from aot.training.backbone import load_backbone
from aot.training.job_prepare import Preparation, Prepared, entries, job_model, planned_steps
from aot.training.job_spec import TASK_OPTIONS
from aot.training.job_state import JobFolder
from aot.training.kinds.base import autocast
from aot.training.mixed_step import Member, step_losses
from aot.training.sharding import assign, barrier, current_shard, gather
from aot.training.task_random import SitePlan, TaskStream
from aot.training.trainer import TaskRun, check_device, resolve_device

TASKS_PER_STEP = 4  # tasks whose batches share each step (memory grows with it: docs/benchmarks.md)
PASS_TOKENS = {"cpu": 1024, "cuda": 16384}  # tokens (padding included) of one pass of the encoder
CHECKPOINT_SECONDS = 300.0


class JobError(ValueError):
    """A job that cannot start: no model, an out folder holding another job, a bad device."""


class _Active:
    """A task being trained: its prepared spec, run and random stream."""

    def __init__(self, task: Prepared, run: TaskRun, stream: TaskStream):
        self.task, self.run, self.stream = task, run, stream

    def checkpoint(self) -> dict:
        return {"fingerprint": self.task.fingerprint, "run": self.run.state_dict(),
                "stream": self.stream.state_dict()}


def train_tasks(tasks: list, out: str | Path, model: str | None = None, *, resume: bool = False,
                overwrite: bool = False, tasks_per_step: int = TASKS_PER_STEP, device: str = "auto",
                progress: bool = True, shard: tuple[int, int] | None = None,
                checkpoint_seconds: float = CHECKPOINT_SECONDS, **defaults) -> list[dict]:
    """Train every task of `tasks` (dicts: `name`, `data` and any of train_task's arguments, laid over `defaults`)
    into `out`/NAME on the encoder `model`; returns one result per task, in order: {"name", "where" (the task's
    line, or `task K`), "shard" (INDEX/COUNT, when sharded), "status": "trained"
    (with train_task's summary), "kept" (trained by an earlier run of a resumed job), "failed" or "refused" (with
    "reason")}. `resume`: continue the job recorded in `out` (or start it). `overwrite`: start again, replacing
    the tasks' artifacts. `shard`: (index, count) of the tasks this process trains (default: torchrun's rank, else
    all). Under torchrun, rank 0 returns every rank's results, the other ranks none."""
    if tasks_per_step < 1:
        raise JobError(f"tasks_per_step {tasks_per_step}: expected a positive integer")
    unknown = sorted(set(defaults) - set(TASK_OPTIONS))
    if unknown:
        raise JobError(f"unknown default {unknown[0]!r}: expected some of {', '.join(TASK_OPTIONS)}")
    check_device(device)
    folder = JobFolder(out)
    if folder.exists() and not (resume or overwrite):
        raise JobError(f"{folder.out} holds a job ({folder.root}): pass --resume to continue it or --overwrite to "
                       "start it again")
    model = job_model(model, entries(tasks))
    where = current_shard(shard)
    if overwrite and where.count == 1:
        folder.reset()
    elif overwrite and where.group:  # rank 0 forgets the job, the others wait for it
        if where.index == 0:
            folder.reset()
        barrier()
    prep = Preparation(tasks, defaults, model, folder, resume and not overwrite, overwrite, device)
    backbone = load_backbone(model)
    prep.check_backbone(backbone)
    shards = assign([task.cost for task in prep.prepared], where.count)
    mine = [task for task, s in zip(prep.prepared, shards, strict=True) if s == where.index]
    results = list(prep.refused) if where.index == 0 else []
    results += [{"index": t.index, "name": t.name, "status": "kept", "where": t.spec.where, **_summary(folder.out / t.name)}
                for t in mine if t.kept is not None]
    job = _Job(folder, backbone, resolve_device(device), tasks_per_step, progress, checkpoint_seconds,
               f"{where.index}/{where.count}" if where.count > 1 else None)
    results += job.run([t for t in mine if t.kept is None], prep.refused if where.index == 0 else [],
                       resume and not overwrite)
    if mine or where.index == 0:
        folder.write_export()
    results = gather(results, where)
    if not where.reports:
        return []
    return [{k: v for k, v in r.items() if k != "index"} for r in sorted(results, key=lambda r: r["index"])]


class _Job:
    def __init__(self, folder: JobFolder, backbone, device: torch.device, tasks_per_step: int, progress: bool,
                 checkpoint_seconds: float, shard: str | None):
        self.folder, self.backbone, self.device, self.shard = folder, backbone, device, shard
        self.tasks_per_step, self.checkpoint_seconds = tasks_per_step, checkpoint_seconds
        self.mixer = BiasedEncoder(backbone.encoder, backbone.uses_token_type_ids)
        self.pass_tokens = PASS_TOKENS.get(device.type, PASS_TOKENS["cpu"])
        self.plan: SitePlan | None = None
        self.progress = progress
        self.results: list[dict] = []

    def run(self, tasks: list[Prepared], refused: list[dict], resume: bool) -> list[dict]:
        for r in refused:
            self._say(f"{r['name'] or r['where']}: refused: {r['reason']}")
        # a resumed job's tasks that have a checkpoint of their spec go first: they continue at once
        checkpoints = {t.name: c for t in tasks if resume and (c := self.folder.checkpoint(t.name)) is not None
                       and c.get("fingerprint") == t.fingerprint}
        pending = sorted(tasks, key=lambda t: t.name not in checkpoints)
        active: list[_Active] = []
        self.bar = tqdm(total=sum(planned_steps(t.plan) for t in tasks), disable=not self.progress, unit="step",
                        desc=f"train {len(tasks)} task{'s' * (len(tasks) != 1)}", dynamic_ncols=True)
        done = failed = 0
        last_checkpoint = time.monotonic()
        try:
            while pending or active:
                while pending and len(active) < self.tasks_per_step:
                    task = pending.pop(0)
                    started = self._start(task, checkpoints.pop(task.name, None))
                    if started is not None:
                        active.append(started)
                    else:
                        failed += 1
                for finished in self._step(active):
                    active.remove(finished)
                    if self.results[-1]["status"] == "trained":
                        done += 1
                    else:
                        failed += 1
                if time.monotonic() - last_checkpoint > self.checkpoint_seconds:
                    for a in active:
                        self.folder.save_checkpoint(a.task.name, a.checkpoint())
                    last_checkpoint = time.monotonic()
                self.bar.set_postfix_str(f"training {', '.join(a.task.name for a in active) or '-'}; {done} trained"
                                         + (f", {failed} failed" if failed else ""), refresh=False)
        finally:
            self.bar.close()
        return self.results

    def _say(self, line: str) -> None:
        if self.progress:
            tqdm.write(f"aot: {line}", file=sys.stderr)

    def _start(self, task: Prepared, checkpoint: dict | None) -> _Active | None:
        try:
            model = build_model(task.plan, self.backbone, copy_encoder=False)
            run = TaskRun(model, task.plan.data, self.backbone.tokenizer, task.plan.train_config)
            stream = TaskStream(task.plan.train_config.seed, self.device)
            if checkpoint is not None:
                run.load_state_dict(checkpoint["run"])
                stream.load_state_dict(checkpoint["stream"])
                self.bar.update(run.step)
                self._say(f"{task.name}: resumed at step {run.step} of {run.total}")
            return _Active(task, run, stream)
        except Exception as exc:  # noqa: BLE001 - the task's own failure: the others go on
            self._fail(task, None, f"could not start: {exc}")
            return None

    def _step(self, active: list[_Active]) -> list[_Active]:
        """One step of every active task; the tasks that stopped (trained or failed)."""
        self.mixer.encoder.train()  # a task that finished left the shared encoder in eval mode
        members = [Member(a.run, a.stream, a.run.next_rows()) for a in active]
        if len(members) > 1 and self.plan is None:
            with autocast(self.device):
                self.plan = SitePlan.learn(self.mixer.plain_states, self.device)
        losses = step_losses(self.mixer, members, self.plan, self.pass_tokens)
        stopped, kept = [], []
        for a, loss in zip(active, losses, strict=True):
            if isinstance(loss, Exception):
                self._fail(a.task, a, f"{type(loss).__name__}: {loss}")
            elif not torch.isfinite(loss.detach()).all():
                self._fail(a.task, a, f"diverged: loss {loss.item()} at step {a.run.step + 1}; a lower --lr may help")
            else:
                kept.append((a, loss))
                continue
            stopped.append(a)
        for a, _ in kept:
            a.run.optimizer.zero_grad(set_to_none=True)
        if kept:
            torch.stack([loss.float() for _, loss in kept]).sum().backward()
        for a, loss in kept:
            try:
                evaluated = a.run.after_step(loss.item())
            except Exception as exc:  # noqa: BLE001 - the task's own failure: the others go on
                self._fail(a.task, a, f"{type(exc).__name__}: {exc}")
                stopped.append(a)
                continue
            self.bar.update(1)
            if a.run.done:
                self._finish(a)
                stopped.append(a)
            elif evaluated:
                self.folder.save_checkpoint(a.task.name, a.checkpoint())
        return stopped

    def _finish(self, a: _Active) -> None:
        """The best weights, the test score and the artifact (recorded trained first: a job killed before the
        artifact is whole trains the task again from its checkpoint)."""
        task, run = a.task, a.run
        self.bar.total -= run.total - run.step  # stopped early: its planned steps that will not run
        try:
            result = run.finish()
            self.folder.write_record(task.name, {"status": "trained", "fingerprint": task.fingerprint})
            summary = save_trained(task.plan, run.model, result, self.backbone, self.folder.out / task.name,
                                   to_cpu=False)
        except Exception as exc:  # noqa: BLE001 - the task's own failure: the others go on
            self._fail(task, a, f"{type(exc).__name__}: {exc}", remaining=0)
            return
        run.model.body.biased.remove_hooks()
        self.folder.drop_checkpoint(task.name)
        self.results.append({"index": task.index, "name": task.name, "status": "trained",
                             "where": task.spec.where, **({"shard": self.shard} if self.shard else {}), **summary})
        self._say(f"{task.name}: trained: dev {summary['metric']} {summary['dev']:.4f} (best at step "
                  f"{summary['best_step']} of {summary['steps']}, stopped: {summary['stopped']})")

    def _fail(self, task: Prepared, a: _Active | None, reason: str, remaining: int | None = None) -> None:
        """The task stops alone: recorded failed with `reason`; `remaining`: its planned steps left (default: all
        it had not run)."""
        step = a.run.step if a is not None else 0
        if a is not None:
            a.run.model.body.biased.remove_hooks()
        self.bar.total -= (a.run.total - step if a is not None else planned_steps(task.plan)) \
            if remaining is None else remaining
        self.folder.write_record(task.name, {"status": "failed", "fingerprint": task.fingerprint, "reason": reason,
                                             "step": step})
        self.folder.drop_checkpoint(task.name)
        self.results.append({"index": task.index, "name": task.name, "status": "failed",
                             "where": task.spec.where, "reason": reason})
        self._say(f"{task.name}: failed: {reason}")


def _summary(out: Path) -> dict:
    """A trained artifact's summary, as train_task returns it: its metrics.json without the history."""
    metrics = read_task(out).metrics()
    return {k: v for k, v in metrics.items() if k != "history"} | {"out": str(out)}
