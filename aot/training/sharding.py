"""A job's tasks shared out among processes and machines: each trains its shard, the artifacts land in one folder.

Under `torchrun` (its RANK and WORLD_SIZE), the ranks form a gloo process group: every rank reads and checks the whole
manifest alike, takes its shard, trains it, and rank 0 gathers every rank's results at the end. An explicit shard
(`--shard INDEX/COUNT`: a Kubernetes Job's completion index, docs/training.md) needs no group: each process trains its
shard and reports it. Tasks never talk to each other, so ranks exchange nothing while they train: gloo serves on CPUs
and GPUs alike.

Shards are balanced by each task's planned work (its steps times its tokens per example), the longest first, each to
the least loaded shard (ties to the lowest index): the same on every rank, whatever order the ranks start in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1
    group: bool = False  # a torchrun process group this job started (results gathered to rank 0)

    @property
    def reports(self) -> bool:
        """Whether this process prints the job's results: rank 0 of a group prints every rank's."""
        return not self.group or self.index == 0


def parse_shard(text: str) -> tuple[int, int]:
    """`INDEX/COUNT` (0 <= INDEX < COUNT)."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise ValueError(f"shard {text!r}: expected INDEX/COUNT, e.g. 0/4") from None
    if not sep or n < 1 or not 0 <= i < n:
        raise ValueError(f"shard {text!r}: expected INDEX/COUNT with 0 <= INDEX < COUNT")
    return i, n


def current_shard(shard: tuple[int, int] | None = None) -> Shard:
    """`shard`, else torchrun's rank among WORLD_SIZE (a gloo group joined), else the whole job."""
    if shard is not None:
        return Shard(*shard)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Shard()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return Shard(dist.get_rank(), dist.get_world_size(), True)


def assign(costs: list[float], count: int) -> list[int]:
    """The shard of each task: the longest first, each to the least loaded shard."""
    loads = [0.0] * count
    shards = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        target = min(range(count), key=lambda s: (loads[s], s))
        shards[k] = target
        loads[target] += costs[k]
    return shards


def barrier() -> None:
    dist.barrier()


def gather(items: list, shard: Shard) -> list:
    """Every rank's `items` on rank 0 (in rank order), a rank's own elsewhere; then the group is left."""
    if not shard.group:
        return items
    gathered: list | None = [None] * shard.count if shard.index == 0 else None
    dist.gather_object(items, gathered, dst=0)
    dist.barrier()
    dist.destroy_process_group()
    return [item for part in gathered for item in part] if gathered is not None else items
