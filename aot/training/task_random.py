"""Each task's random numbers its own in a job of many tasks: a task draws what it would draw trained alone.

A task trained alone (aot.training.trainer.train) draws from torch's default generator, seeded with its seed: its
P's dropout, the frozen encoder's dropout (training keeps the encoder in train mode: after the embeddings, on the
attention probabilities, after each sublayer) and its head's, in that order, one mask per dropout of the shape of
its batch ([B, S, d], [B, H, S, S]). In a job, batches of several tasks share passes of the encoder
(aot.training.mixed_step); were a pass to draw one mask for all its rows, a task's masks would depend on the tasks
it shared the pass with, and the same manifest would train other tasks on one machine than sharded on two. So:

- TaskStream: the generator state of each task, swapped into torch's default generator(s) while the task's own
  random operations run (its P's rows, its head), and kept between them;
- SitePlan: where the encoder draws (every call of torch.nn.functional.dropout in one forward, in order) and the
  shape of each draw, learnt once per encoder from three small forwards; `draw` makes, from the task's stream, the
  masks its batch would draw alone, before the passes;
- PassDropout: in a pass, each dropout multiplies each row by its own row of its task's mask (cut or padded to the
  pass's length: the part beyond a row's tokens is padding, which attention never reads), torch.nn.functional.dropout
  replaced for the pass (every dropout of the encoder calls it).

A task of a job thus draws exactly the random numbers it draws alone, whatever it is mixed with and however the job
is sharded. A dropout whose tensor is not per row (DeBERTa-v2's, on its relative position embeddings) is shared by a
pass: it draws from torch's own generator, and its tasks then depend on their company (docs/training.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROWS, TOKENS = "rows", "tokens"  # the dimensions of a drawn tensor that follow the batch's rows and its length


class TaskStream:
    """The state of torch's default generators that a task trained alone would have: `torch.manual_seed(seed)`'s at
    first, then what its own draws leave (`active` swaps it in and out)."""

    def __init__(self, seed: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = cuda_index(device)
        with forked(device):
            torch.manual_seed(seed)
            self.state = self._get()

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None

    def _set(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state(state[1], self.device)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Torch's default generators draw from this stream inside the block; outside, as they did before it."""
        saved = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(saved)

    def state_dict(self) -> dict:
        return {"cpu": self.state[0], "cuda": self.state[1]}

    def load_state_dict(self, state: dict) -> None:
        self.state = (state["cpu"], state["cuda"])


def cuda_index(device: torch.device) -> int:
    """The CUDA device's index (`cuda` alone: the current one); 0 for the CPU."""
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()


def forked(device: torch.device):
    """Torch's generators (the CPU's, and `device`'s if CUDA) as they were once the block ends."""
    return torch.random.fork_rng(devices=[cuda_index(device)] if device.type == "cuda" else [])


def _dropout_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, float, bool, bool]:
    """F.dropout's arguments (input, p=0.5, training=True, inplace=False), however they were passed."""
    names = ("input", "p", "training", "inplace")
    values = dict(zip(names, (None, 0.5, True, False), strict=True))
    values.update(zip(names, args, strict=False))  # the arguments given by position: the first of them
    values.update(kwargs)
    return values["input"], float(values["p"]), bool(values["training"]), bool(values["inplace"])


@dataclass(frozen=True)
class Site:
    """One dropout of the encoder: its rate, and per dimension of its tensor ROWS, TOKENS or a fixed size (dims None:
    not one tensor per row, shared by a pass)."""

    p: float
    dims: tuple | None
    dtype: torch.dtype

    @property
    def per_row(self) -> bool:
        return self.p > 0 and self.dims is not None

    def shape(self, rows: int, tokens: int) -> tuple[int, ...]:
        return tuple(rows if d == ROWS else tokens if d == TOKENS else d for d in self.dims)


class _Dropout:
    """Inside the block, torch.nn.functional.dropout is `call(original, input, p, training, inplace)`: every dropout
    of the encoder goes through it (nn.Dropout's and the attention functions' look it up when they run). Nothing
    else changes, so the pass runs at its own speed (a TorchFunctionMode would see every operation). The job trains
    in one thread."""

    def __init__(self, call: Callable):
        self.call = call

    def __enter__(self):
        original = self.original = F.dropout

        def dropout(*args, **kwargs):
            return self.call(original, *_dropout_args(args, kwargs))

        F.dropout = dropout
        return self

    def __exit__(self, *exc) -> bool:
        F.dropout = self.original
        return False


class _Recorder(_Dropout):
    def __init__(self):
        super().__init__(self._record)
        self.calls: list[tuple[float, tuple[int, ...], torch.dtype]] = []

    def _record(self, original, x, p, training, inplace):
        self.calls.append((p if training else 0.0, tuple(x.shape), x.dtype))
        return original(x, p, training, inplace)


class SitePlan:
    """Every dropout one forward of the encoder runs, in order (`learn`)."""

    PROBES = ((2, 3), (3, 3), (2, 5))  # (rows, tokens): the second grows the rows, the third the length

    def __init__(self, sites: list[Site]):
        self.sites = sites

    @property
    def draws(self) -> bool:
        return any(site.per_row for site in self.sites)

    @classmethod
    def learn(cls, forward: Callable[[torch.Tensor, torch.Tensor], object], device: torch.device) -> "SitePlan":
        """Run `forward(input_ids, attention_mask)` (the encoder, in train mode) on the PROBES, torch's generators
        left as they were, and read each dropout's dimensions from how its tensor's shape followed theirs."""
        runs = []
        for rows, tokens in cls.PROBES:
            ids = torch.ones((rows, tokens), dtype=torch.long, device=device)
            with forked(device), torch.no_grad(), _Recorder() as recorder:
                forward(ids, torch.ones_like(ids))
            runs.append(recorder.calls)
        if len({len(calls) for calls in runs}) != 1:
            raise RuntimeError("the encoder runs a different number of dropouts on inputs of other shapes")
        return cls([cls._site(*calls) for calls in zip(*runs, strict=False)])  # the dropouts every run called

    @classmethod
    def _site(cls, base, more_rows, longer) -> Site:
        (rows, tokens), (rows_2, _), (_, tokens_2) = cls.PROBES
        p, shape, dtype = base
        dims: list | None = []
        if not (len(shape) == len(more_rows[1]) == len(longer[1])):
            dims = None
        else:
            for size, grown, long in zip(shape, more_rows[1], longer[1], strict=True):
                if (size, grown) == (rows, rows_2) and long == size:
                    dims.append(ROWS)
                elif (size, long) == (tokens, tokens_2) and grown == size:
                    dims.append(TOKENS)
                elif size == grown == long:
                    dims.append(size)
                else:
                    dims = None
                    break
        if dims is not None and (not dims or dims[0] != ROWS or dims.count(ROWS) != 1):
            dims = None  # not one tensor per row (shared by a pass)
        return Site(p, tuple(dims) if dims is not None else None, dtype)

    def draw(self, rows: int, tokens: int, device: torch.device) -> list[torch.Tensor | None]:
        """The noise of each per-row dropout as a batch of `rows` x `tokens` draws it alone from torch's default
        generator (F.dropout's own draw: each value 0 or 1 / (1 - p)), in order; None where it draws nothing."""
        return [F.dropout(torch.ones(site.shape(rows, tokens), dtype=site.dtype, device=device), site.p, True)
                if site.per_row else None for site in self.sites]


@dataclass
class PassPart:
    """The rows of one batch in a pass, which sit together in it, in order: their noise (SitePlan.draw of the whole
    batch) and which of its rows they are."""

    noise: list[torch.Tensor | None]
    rows: torch.Tensor


class PassDropout(_Dropout):
    """Inside the block, the encoder's k-th dropout multiplies each row of the pass by its own row of its batch's
    k-th noise, the dimensions of its length cut or padded (with zeros) to the pass's."""

    def __init__(self, plan: SitePlan, parts: list[PassPart]):
        super().__init__(self._apply)
        self.plan, self.parts, self.calls = plan, parts, 0

    def _apply(self, original, x, p, training, inplace):
        if self.calls >= len(self.plan.sites):
            raise RuntimeError(f"the encoder ran more dropouts than the {len(self.plan.sites)} it ran when learnt")
        site = self.plan.sites[self.calls]
        self.calls += 1
        if not (training and site.per_row):
            return original(x, p, training, inplace)
        noise = torch.cat([_fit(part.noise[self.calls - 1].index_select(0, part.rows), site, x.shape)
                           for part in self.parts])
        return x.mul_(noise) if inplace else x * noise


def _fit(noise: torch.Tensor, site: Site, shape: torch.Size) -> torch.Tensor:
    """`noise` with the dimensions of its length cut or padded with zeros to those of `shape`."""
    for dim, kind in enumerate(site.dims):
        if kind == TOKENS and noise.shape[dim] != shape[dim]:
            if noise.shape[dim] > shape[dim]:
                noise = noise.narrow(dim, 0, shape[dim])
            else:
                pad = [0, 0] * (noise.dim() - 1 - dim) + [0, shape[dim] - noise.shape[dim]]
                noise = F.pad(noise, pad)
    return noise
