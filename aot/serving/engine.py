"""The backbone engines a served step runs: the registry that finds one by name, the batch every engine takes
(EncoderBatch, in columns) and what it gives back (EncoderOutput), and the ground floor's own engine, ONNX Runtime
(`onnx`).

A step's model config names its engine (parameter `engine`; aot.serving.stages.Encoder). An engine that needs more than
this package registers itself when its package is imported: the torch engine (aot.serving_torch.engine) registers
`torch`, and the model files that run it import it first. So this package never imports an engine's package.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from aot.serving import protocol
from aot.serving.pool import RowStorage


@dataclass
class EncoderBatch:
    """A batch as an engine takes it, in columns: its token tensors [B, S] right-padded to its longest sequence
    (protocol.token_inputs), each sequence's length, and which sequences want every token's final state (a token
    task's head reads them). For AoT, each token's row of P: `index` [B, S] into the task pool's buffer (`rows`
    None: pool slots, which an engine that keeps the pool on its own device gathers itself) or into the batch's own
    rows (`rows` [N, L, d]: gathered from a host pool, or read or computed from storage). A padded position takes
    its sequence's first row: a row that holds numbers (an unfilled slot may hold NaN, which the attention scores
    would carry to every position, masked or not). `head_slots` [B]: each sequence's task head among an engine's
    device heads (aot.serving.heads: -1, none; None, the engine computes no heads)."""

    tokens: dict[str, np.ndarray]
    lengths: np.ndarray
    want_states: np.ndarray
    index: np.ndarray | None = None
    rows: object = None
    head_slots: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.tokens[protocol.INPUT_IDS].shape[1]

    @classmethod
    def of(cls, sequences: list[dict[str, np.ndarray]], want_states: bool = False) -> EncoderBatch:
        """A batch of 1-D token tensors (one dict per sequence, right-padded or not), padded to the longest."""
        return cls.joined([{name: a[None] for name, a in s.items()} for s in sequences], want_states)

    @classmethod
    def joined(cls, parts: list[dict[str, np.ndarray]], want_states: bool = False) -> EncoderBatch:
        """A batch of token tensors [n_i, S_i] (right-padded), one after the other, padded to the longest."""
        width = max(p[protocol.INPUT_IDS].shape[1] for p in parts)
        tokens = {}
        for name in parts[0]:
            if len(parts) == 1 and parts[0][name].shape[1] == width:
                tokens[name] = np.ascontiguousarray(parts[0][name], protocol.TOKEN_DTYPE)
                continue
            tokens[name] = np.zeros((sum(len(p[name]) for p in parts), width), protocol.TOKEN_DTYPE)
            at = 0
            for p in parts:
                tokens[name][at:at + len(p[name]), :p[name].shape[1]] = p[name]
                at += len(p[name])
        lengths = tokens[protocol.ATTENTION_MASK].sum(1)
        return cls(tokens, lengths, np.full(len(lengths), want_states))

    def take(self, rows: np.ndarray | list[int]) -> EncoderBatch:
        """The sequences `rows` of this batch, trimmed to their longest (their bias rows stay where they are)."""
        rows = np.asarray(rows)
        width = int(self.lengths[rows].max())
        return EncoderBatch({n: t[rows, :width] for n, t in self.tokens.items()}, self.lengths[rows],
                            self.want_states[rows], None if self.index is None else self.index[rows, :width],
                            self.rows, None if self.head_slots is None else self.head_slots[rows])


@dataclass
class EncoderOutput:
    """What an engine gives back for a batch, on the host: the pooled states [B, K, d] fp32 (every pooling,
    protocol.POOLINGS), every token's final state [B, S, d] fp32 of the sequences that want them (None when none
    does; the others' rows hold whatever the engine computed), and, for an engine with device heads, each
    sequence's head outputs [B, n] fp32 (aot.serving.heads: padded past its task's width)."""

    pooled: np.ndarray
    states: np.ndarray | None = None
    logits: np.ndarray | None = None


class EncoderRunner(Protocol):
    """What an engine builds for a step: the encoder on a batch."""

    def run(self, batch: EncoderBatch) -> EncoderOutput:
        ...


@dataclass(frozen=True)
class Engine:
    """A backbone engine a step can run.

    `build(step, aot, threads, log, heads)`: the backbone of a served step (aot.serving.steps.Step: its repository, parameters
    and task pool), with `threads` CPU threads; `log` reports what start-up did. `storage(device)`: where the step's
    task pool keeps its rows for this engine (None: host memory). `gathers_slots`: the backbone reads each request's
    rows from the pool's slots itself (EncoderBatch.index as slots); otherwise the step hands it the rows (EncoderBatch.rows)."""

    name: str
    build: Callable[..., EncoderRunner]
    storage: Callable[[str], RowStorage] | None = None
    gathers_slots: bool = False


_ENGINES: dict[str, Engine] = {}
# Engines that are not part of this package, and what provides each: named when one is asked for unregistered.
PLUGINS = {"torch": "the torch engine (package serving_torch, the [serve-torch] extra): install it, and have the step "
                    "load aot.serving_torch.engine before it builds its backbone (the backbone and fused model files do "
                    "when their parameter `engine` is torch)"}


def register_engine(engine: Engine) -> None:
    """Make `engine` available to every step of this process under its name (a package registers its own on import)."""
    _ENGINES[engine.name] = engine


def find_engine(name: str) -> Engine:
    """The engine registered under `name`; an unregistered one fails naming it and what provides it."""
    engine = _ENGINES.get(name)
    if engine is not None:
        return engine
    if name in PLUGINS:
        raise LookupError(f"engine {name!r} is not registered in this process: it is {PLUGINS[name]}")
    raise LookupError(f"unknown engine {name!r}: expected one of {', '.join(sorted({*_ENGINES, *PLUGINS}))}")


def length_groups(lengths: list[int], max_padding: float) -> list[list[int]]:
    """The batch's indexes split into runs of similar length, longest first: a run takes the next longest sequence
    while padding every one to the run's longest adds at most `max_padding` of its real tokens (0: equal lengths
    only). On a CPU padded tokens cost as much as real ones, so one batch of mixed lengths is slower than a few of
    similar lengths (measured in `aot bench tax`)."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    groups: list[list[int]] = []
    real = 0
    for k in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= (1 + max_padding) * (real + lengths[k]):
            groups[-1].append(k)
            real += lengths[k]
        else:
            groups.append([k])
            real = lengths[k]
    return groups


class BackboneRunner:
    """An exported graph on ONNX Runtime for batches (EncoderBatch): split into runs of similar length
    (length_groups), each padded to its longest, and the AoT bias in the graph's interface: the batch's rows with
    each token's row among them (the rows interface; one row offset of zero per sequence, so an index is global), or
    each token's row gathered (dense)."""

    def __init__(self, onnx_path: str | Path, threads: int = 0, max_padding: float | None = 0.125,
                 per_request: bool = False):
        """`max_padding`: see length_groups; None pads the whole batch to its longest sequence, as Triton's native
        backends do. `per_request`: run each sequence alone (an int8 graph, whose activation scale is taken over the
        whole batch: batched, a text's answer would depend on its neighbours; aot.exporter.quantize)."""
        # Idle intra-op threads sleep instead of spinning: the served backbone shares its cores with tritonserver, the
        # other steps and often the clients, and spinning threads burned the CPU the backbone itself needed
        # (docs/benchmarks.md, "Figures behind the serving code").
        self.session = cpu_session(onnx_path, threads, spinning=False)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.dense = protocol.AOT_BIAS in self.inputs
        self.aot = self.dense or protocol.AOT_ROWS in self.inputs
        if self.dense:  # [batch, sequence, L, d]: the row shape is fixed in the graph
            shape = next(i.shape for i in self.session.get_inputs() if i.name == protocol.AOT_BIAS)
            self.row_shape = tuple(int(n) for n in shape[2:])
        self.max_padding = max_padding
        self.per_request = per_request

    def run(self, batch: EncoderBatch) -> EncoderOutput:
        """The batch's pooled states [B, K, d] in its order (and the token states [B, S, d], when a sequence wants
        them). `batch.rows` holds its rows (a host engine gathers none from a pool)."""
        if isinstance(batch.rows, list):  # one block per task version: one array for the graph
            batch = replace(batch, rows=np.concatenate(batch.rows) if len(batch.rows) > 1 else batch.rows[0])
        if self.per_request and batch.size > 1:
            groups = [[k] for k in range(batch.size)]
        elif self.max_padding is None or batch.size == 1:
            groups = [list(range(batch.size))]
        else:
            groups = length_groups(batch.lengths.tolist(), self.max_padding)
        if len(groups) == 1:
            return EncoderOutput(*self._run(batch))
        pooled = states = None
        for group in groups:
            part_pooled, part_states = self._run(batch.take(group))
            if pooled is None:
                pooled = np.empty((batch.size, *part_pooled.shape[1:]), part_pooled.dtype)
            pooled[group] = part_pooled
            if part_states is not None:  # a group of only pooled sequences has none: the first that has sets the shape
                if states is None:
                    states = np.zeros((batch.size, batch.width, part_states.shape[-1]), part_states.dtype)
                states[group, :part_states.shape[1]] = part_states
        return EncoderOutput(pooled, states)

    def _run(self, batch: EncoderBatch) -> tuple[np.ndarray, np.ndarray | None]:
        feeds = {name: batch.tokens[name] for name in protocol.token_inputs(protocol.TOKEN_TYPE_IDS in self.inputs)}
        if self.dense:
            rows = batch.rows.reshape(-1, *self.row_shape)
            feeds[protocol.AOT_BIAS] = rows[batch.index]
        elif self.aot:
            feeds[protocol.AOT_INDEX] = batch.index.astype(protocol.INDEX_DTYPE, copy=False)
            feeds[protocol.AOT_ROWS] = batch.rows.astype(protocol.ROWS_DTYPE, copy=False).reshape(-1)
            feeds[protocol.AOT_ROW_OFFSETS] = np.zeros(batch.size + 1, protocol.INDEX_DTYPE)
        if not batch.want_states.any():  # the graph's token states are then never copied out
            return self.session.run([protocol.POOLED_HIDDEN], feeds)[0], None
        pooled, states = self.session.run([protocol.POOLED_HIDDEN, protocol.TOKEN_HIDDEN], feeds)
        return pooled, states


# ONNX Runtime's session-time fusion of Add + Add + LayerNormalization into its SkipLayerNormalization kernel, several
# times slower on CPU than the three it replaces (docs/benchmarks.md, "int8 on CPU"). The int8 twins are written without
# that kernel (aot.exporter.quantize); no CPU session puts it back.
CPU_DISABLED_FUSIONS = ("SkipLayerNormFusion",)


def cpu_session_options(threads: int = 0, spinning: bool = True):
    """ONNX Runtime's options for a graph on CPU: `threads` intra-op threads (0: ONNX Runtime's default), one inter-op
    thread, idle threads spinning or asleep, none of CPU_DISABLED_FUSIONS."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("optimization.disable_specified_optimizers", ",".join(CPU_DISABLED_FUSIONS))
    return options


def cpu_session(onnx_path: str | Path, threads: int = 0, spinning: bool = True):
    """An ONNX Runtime session of the graph at `onnx_path` on CPU, with cpu_session_options."""
    import onnxruntime as ort

    return ort.InferenceSession(str(onnx_path), cpu_session_options(threads, spinning),
                                providers=["CPUExecutionProvider"])


def instance_threads(instances: int) -> int:
    """The engine threads of one of a step's `instances` when its model config names none: this host's cores shared
    among them (at least one)."""
    return max(len(os.sched_getaffinity(0)) // instances, 1)


def _onnx_backbone(step, aot: bool, threads: int, log: Callable[[str], None] | None = None,
                   heads: bool = False) -> BackboneRunner:
    """A step's ONNX Runtime backbone: the graph its parameter `onnx_file` names under the models folder (its heads
    run on the host: `heads` does not apply)."""
    return BackboneRunner(Path(step.repo.models) / step.parameters["onnx_file"], threads=threads,
                          per_request=step.parameters.get("per_request") == "true")


register_engine(Engine("onnx", _onnx_backbone))
