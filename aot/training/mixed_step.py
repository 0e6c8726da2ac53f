"""One step of several tasks on one frozen encoder: their batches share passes of the encoder.

Each task of the step brings its batch as its kind's inputs (Kind.inputs: one segment of rows; an embedding task's
anchors, then its positives). From the task's own random stream (aot.training.task_random), each segment's rows of P
are computed for its distinct tokens and the encoder's dropout masks drawn as the batch alone would draw them. The
rows of every segment, sorted by length, are then cut into passes of at most `pass_tokens` tokens (padding
included), so that a pass's rows are of similar length and little of it is padding, whatever their tasks. Each pass
runs the encoder once, each row with its own task's bias (aot.serving_torch.encoder.BiasedEncoder: one table of the
pass's rows of P, an index per token) and its own task's masks (PassDropout). Each segment's final states are then
gathered back in its own order and length, its task's head reads them (TaskModel.head_logits) from the task's stream,
and its kind's loss_from gives the task's loss.

A pass's rows never mix: attention, layer norms and dropout work within a row, each task's rows of P are its own,
and the encoder's weights are frozen (no gradient sums over rows). So the gradient of the sum of the step's losses
is, for each task, the gradient of its own loss, and a task's NaN stays in its own rows. A step of one task runs its
batch as a run alone does (TaskRun.loss), the same operations on the same tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aot.serving_torch.encoder import BiasedEncoder
from aot.training.kinds.base import autocast
from aot.training.task_random import PassDropout, PassPart, SitePlan, TaskStream
from aot.training.trainer import TaskRun


@dataclass
class Member:
    """One task's part of a step: its run, its random stream and the rows of its next batch."""

    run: TaskRun
    stream: TaskStream
    rows: list[int]


@dataclass
class _Segment:
    member: int
    batch: dict[str, torch.Tensor]
    table: torch.Tensor  # the task's rows of P for the segment's distinct tokens [U, L, d]
    inverse: torch.Tensor  # each token's row in `table` [B, S]
    noise: list[torch.Tensor | None]  # the segment's dropout noise per site of the encoder (SitePlan.draw)
    lengths: list[int]


def step_losses(mixer: BiasedEncoder, members: list[Member], plan: SitePlan,
                pass_tokens: int) -> list[torch.Tensor | Exception]:
    """Each member's loss on its batch, or what it raised (a task's failure is its own). `mixer`: a BiasedEncoder
    on the shared encoder, in train mode."""
    if len(members) == 1:  # as alone: the same passes
        member = members[0]
        try:
            with member.stream.active():
                return [member.run.loss(member.rows)]
        except Exception as exc:  # noqa: BLE001 - the task's own failure, reported with it
            return [exc]
    inputs = [m.run.kind.inputs(m.run.train_enc, m.rows, m.run.pad_id, m.run.device) for m in members]
    device = members[0].run.device
    segments = []
    with autocast(device):
        for k, (member, batches) in enumerate(zip(members, inputs, strict=True)):
            with member.stream.active():
                for batch in batches:
                    ids = batch["input_ids"]
                    unique, inverse = torch.unique(ids, return_inverse=True)
                    table = member.run.model.body.rows(unique)
                    noise = plan.draw(ids.shape[0], ids.shape[1], device) if plan.draws else []
                    segments.append(_Segment(k, batch, table, inverse, noise,
                                             batch["attention_mask"].sum(1).tolist()))
        states = _segment_states(mixer, segments, plan, pass_tokens, members[0].run.pad_id)
    losses: list[torch.Tensor | Exception] = []
    for k, (member, batches) in enumerate(zip(members, inputs, strict=True)):
        own = [s for s, segment in zip(states, segments, strict=True) if segment.member == k]
        run = member.run
        try:
            with member.stream.active(), autocast(device):
                outputs = [run.model.head_logits(s, b["attention_mask"]) for s, b in zip(own, batches, strict=True)]
                losses.append(run.kind.loss_from(outputs, batches, run.train_enc, member.rows, run.spec))
        except Exception as exc:  # noqa: BLE001 - the task's own failure, reported with it
            losses.append(exc)
    return losses


def cut_passes(lengths: list[tuple[int, int, int]], pass_tokens: int) -> list[list[tuple[int, int, int]]]:
    """(length, segment, row) items sorted by length and cut into passes whose rows x longest length stay within
    `pass_tokens` (a pass holds one row at least)."""
    passes: list[list[tuple[int, int, int]]] = []
    for item in sorted(lengths):
        if passes and (len(passes[-1]) + 1) * item[0] <= pass_tokens:
            passes[-1].append(item)
        else:
            passes.append([item])
    return passes


def _segment_states(mixer: BiasedEncoder, segments: list[_Segment], plan: SitePlan, pass_tokens: int,
                    pad_id: int) -> list[torch.Tensor]:
    """Each segment's final states [B, S, d] (its own rows' order and padded length), from shared passes."""
    items = [(length, s, r) for s, segment in enumerate(segments) for r, length in enumerate(segment.lengths)]
    gathered: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in segments]
    for chunk in cut_passes(items, pass_tokens):
        chunk.sort(key=lambda item: item[1:])  # each segment's rows together, in order (PassPart)
        length = max(item[0] for item in chunk)
        sample = segments[chunk[0][1]].batch["input_ids"]
        ids = torch.full((len(chunk), length), pad_id, dtype=sample.dtype, device=sample.device)
        mask, types, index = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros_like(ids)
        tables, parts, places, offset, start = [], [], [], 0, 0
        for s in dict.fromkeys(item[1] for item in chunk):
            segment = segments[s]
            rows = torch.tensor([item[2] for item in chunk if item[1] == s], device=ids.device)
            at = slice(start, start + len(rows))
            width = min(length, segment.batch["input_ids"].shape[1])
            for name, target in (("input_ids", ids), ("attention_mask", mask), ("token_type_ids", types)):
                target[at, :width] = segment.batch[name][rows, :width]
            index[at] = offset
            index[at, :width] = segment.inverse[rows, :width] + offset
            tables.append(segment.table)
            parts.append(PassPart(segment.noise, rows))
            places.append((s, rows, at))
            offset, start = offset + segment.table.shape[0], at.stop
        with PassDropout(plan, parts) if plan.draws else contextlib.nullcontext():
            states = mixer.states(ids, mask, types, torch.cat(tables), index)
        for s, rows, at in places:
            full = segments[s].batch["input_ids"].shape[1]
            own = states[at, :min(length, full)]
            gathered[s].append((rows, F.pad(own, (0, 0, 0, full - own.shape[1]))))
    out = []
    for pieces in gathered:
        rows = torch.cat([r for r, _ in pieces])
        out.append(torch.cat([t for _, t in pieces])[torch.argsort(rows)])
    return out

