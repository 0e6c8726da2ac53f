"""The torch engine's device heads: the served tasks' pooled heads (classification, regression, multi-label) in the
engine's device memory, computed for a whole batch in one grouped op inside its forward (inside the captured CUDA
graph on a GPU), so that a batch's answers leave the device as [B, n] logits, not as pooled states for numpy heads.

The heads live in preallocated slots, as the task pool keeps rows: each slot holds one version's head, padded to
the widest head a slot takes (the dense layer's width up to the encoder's hidden size d, at most MAX_LABELS outputs);
a version gets a slot at its first batch and keeps it until a batch needs the slot for another version (least
recently used first). Each item's slot picks its weights (a gather), then two batched matmuls and the activation of
its head (tanh or gelu: both are computed and one is kept, the cost of a [B, d] elementwise op): the arithmetic of
aot.serving.heads.pooled_logits, in torch. A head wider than a slot, a kind without such a head (embedding, tokens),
or more versions in one batch than slots answer through aot.serving.heads on the host (slot -1).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

from aot.serving import protocol
from aot.serving.kinds import DENSE
from aot.serving.tasks import ServedTask

MAX_LABELS = 64  # the outputs a slot holds: a task of more labels answers through the host's heads


class DeviceHeads:
    """`slots` heads of width up to `hidden` x MAX_LABELS on `device`, in `dtype` (the engine's)."""

    def __init__(self, slots: int, hidden: int, device: torch.device, dtype: torch.dtype):
        self.capacity, self.hidden, self.device = slots, hidden, device
        zeros = lambda *shape, kind=dtype: torch.zeros(shape, dtype=kind, device=device)  # noqa: E731
        self.dense_w, self.dense_b = zeros(slots, hidden, hidden), zeros(slots, hidden)
        self.out_w, self.out_b = zeros(slots, MAX_LABELS, hidden), zeros(slots, MAX_LABELS)
        self.pooling = zeros(slots, kind=torch.int64)
        self.gelu = zeros(slots, kind=torch.bool)
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # version -> its slot, least recently used first

    @property
    def bytes(self) -> int:
        """The device memory the slots take."""
        return sum(t.numel() * t.element_size() for t in (self.dense_w, self.dense_b, self.out_w, self.out_b,
                                                           self.pooling, self.gelu))

    @staticmethod
    def fits(task: ServedTask, hidden: int) -> bool:
        """Whether a version's head can live in a slot."""
        if task.spec.head != DENSE or "dense.weight" not in task.head:  # out(f(dense(pooled)))
            return False
        width, inner = task.head["out.weight"].shape
        return width <= MAX_LABELS and inner <= hidden and task.head["dense.weight"].shape[1] == hidden

    def slots(self, tasks: list[ServedTask]) -> np.ndarray:
        """Each task version's slot (-1: answered on the host), its head written into a free or the least recently
        used slot if it has none: the batch's own versions are never evicted for each other."""
        out = np.full(len(tasks), -1, dtype=np.int64)
        wanted = [k for k, task in enumerate(tasks) if self.fits(task, self.hidden)]
        for k in wanted:
            slot = self._slot_of.get(tasks[k].version)
            if slot is not None:
                self._slot_of.move_to_end(tasks[k].version)
                out[k] = slot
        kept = {int(s) for s in out if s >= 0}
        for k in wanted:
            if out[k] >= 0:
                continue
            slot = self._free_slot(kept)
            if slot is None:
                break
            self._write(slot, tasks[k])
            self._slot_of[tasks[k].version] = out[k] = slot
            kept.add(slot)
        return out

    def _free_slot(self, kept: set[int]) -> int | None:
        if len(self._slot_of) < self.capacity:
            return len(self._slot_of)
        for version, slot in self._slot_of.items():  # least recently used first
            if slot not in kept:
                del self._slot_of[version]
                return slot
        return None

    def _write(self, slot: int, task: ServedTask) -> None:
        """A version's head into `slot`, zero past its widths (a zero row of `dense` gives tanh(0) = gelu(0) = 0, and
        a zero row of `out` an output no one reads)."""
        head = {name: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, self.dense_w.dtype)
                for name, a in task.head.items()}
        width, inner = head["out.weight"].shape
        for tensor in (self.dense_w, self.dense_b, self.out_w, self.out_b):
            tensor[slot].zero_()
        self.dense_w[slot, :inner] = head["dense.weight"]
        self.dense_b[slot, :inner] = head["dense.bias"]
        self.out_w[slot, :width, :inner] = head["out.weight"]
        self.out_b[slot, :width] = head["out.bias"]
        self.pooling[slot] = protocol.pooling_row(task.pooling)
        self.gelu[slot] = task.meta.get("head_activation", "tanh") == "gelu"

    def forward(self, pooled: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The heads of a batch: pooled [B, P, d], each item's slot [B] (an item answered on the host takes any slot:
        its outputs are not read) -> [B, MAX_LABELS] fp32, padded past each head's width. On the device alone,
        nothing read back to the host (what a CUDA graph captures)."""
        chosen = pooled[torch.arange(pooled.shape[0], device=pooled.device), self.pooling[slots]]
        h = torch.baddbmm(self.dense_b[slots, :, None], self.dense_w[slots], chosen[:, :, None].to(self.dense_w.dtype))
        h = torch.where(self.gelu[slots, None, None], F.gelu(h), torch.tanh(h))
        return torch.baddbmm(self.out_b[slots, :, None], self.out_w[slots], h)[:, :, 0].float()
