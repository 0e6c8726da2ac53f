"""The backbone engines a served step runs: the registry that finds one by name, the request data every engine
takes (Prepared), and the ground floor's own engine, ONNX Runtime (`onnx`), batched exactly as Triton's native
backend batches single-sequence requests.

A step's model config names its engine (parameter `engine`; aot.serving.stages.Encoder). An engine that needs more than
this package registers itself when its package is imported: the torch engine (aot.serving_torch.engine) registers
`torch`, and the model files that run it import it first. So this package never imports an engine's package.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from aot.serving import protocol
from aot.serving.pool import RowStorage
from aot.serving.tasks import ServedTask, token_index, token_indexes


@dataclass
class Prepared:
    """One request as an engine takes it: its token tensors (1-D, protocol.token_inputs) and, for AoT, what its bias
    is made of: its task version, its sorted distinct tokens (`unique`) and each token's row among them (`index`,
    padding: row 0); then either the pool slots that hold those rows (`slots`: an engine that gathers from the pool
    on its own device) or the rows themselves (`rows`, [U, L, d] fp16). `want_states`: the engine also sets
    `states`, every token's final state [S, d] fp32 (a token task's head reads them)."""

    tokens: dict[str, np.ndarray]
    task: ServedTask | None = None
    unique: np.ndarray | None = None
    index: np.ndarray | None = None
    slots: np.ndarray | None = None
    rows: np.ndarray | None = None
    want_states: bool = False
    states: np.ndarray | None = None

    @classmethod
    def for_task(cls, tokens: dict[str, np.ndarray], task: ServedTask) -> Prepared:
        """An AoT request of `task`: its distinct tokens and each token's row among them, its rows still to come."""
        unique, index = token_index(tokens[protocol.INPUT_IDS], tokens[protocol.ATTENTION_MASK])
        return cls(tokens, task, unique, index)

    @classmethod
    def for_tasks(cls, tokens: list[dict[str, np.ndarray]], tasks: list[ServedTask]) -> list[Prepared]:
        """for_task of a whole batch, its distinct tokens found in one pass (aot.serving.tasks.token_indexes)."""
        indexes = token_indexes([(t[protocol.INPUT_IDS], t[protocol.ATTENTION_MASK]) for t in tokens])
        return [cls(t, task, unique, index) for t, task, (unique, index) in zip(tokens, tasks, indexes, strict=True)]


class Backbone(Protocol):
    """What an engine builds for a step: the encoder on a batch of prepared requests."""

    def run(self, requests: list[Prepared]) -> np.ndarray:
        """The pooled states [B, P, d] (fp32) of the batch, in its order; each request that wants them gets its
        token states (Prepared.states)."""
        ...


@dataclass(frozen=True)
class Engine:
    """A backbone engine a step can run.

    `build(step, aot, threads, log)`: the backbone of a served step (aot.serving.steps.Step: its repository, parameters
    and task pool), with `threads` CPU threads; `log` reports what start-up did. `storage(device)`: where the step's
    task pool keeps its rows for this engine (None: host memory). `gathers_slots`: the backbone reads each request's
    rows from the pool's slots itself (Prepared.slots); otherwise the step hands it the rows (Prepared.rows)."""

    name: str
    build: Callable[..., Backbone]
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
    """Token tensors padded to the longest sequence of each length group (length_groups), and the AoT bias in the
    graph's interface: ragged rows concatenated with the accumulated row offsets, or each request's dense bias
    rows[index] (zero past its end)."""

    def __init__(self, onnx_path: str | Path, threads: int = 0, max_padding: float | None = 0.125,
                 per_request: bool = False):
        """`max_padding`: see length_groups; None pads the whole batch to its longest sequence, as Triton's native
        backends do. `per_request`: run each request alone (an int8 graph, whose activation scale is taken over the
        whole batch: batched, a request's answer would depend on its neighbours; aot.exporter.quantize)."""
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

    def run(self, requests: list[Prepared]) -> np.ndarray:
        """Each request: 1-D token tensors (and for AoT its rows and index). Returns the pooled states [B, P, d] in
        the requests' order; a request that wants them gets its token states (`states`, [S, d])."""
        if self.per_request and len(requests) > 1:
            return np.concatenate([self._run([r]) for r in requests])
        if self.max_padding is None or len(requests) == 1:
            return self._run(requests)
        groups = length_groups([len(r.tokens[protocol.INPUT_IDS]) for r in requests], self.max_padding)
        if len(groups) == 1:
            return self._run(requests)
        pooled = None
        for group in groups:
            out = self._run([requests[k] for k in group])
            if pooled is None:
                pooled = np.empty((len(requests), *out.shape[1:]), out.dtype)
            pooled[group] = out
        return pooled

    def _run(self, requests: list[Prepared]) -> np.ndarray:
        longest = max(len(r.tokens[protocol.INPUT_IDS]) for r in requests)
        feeds = {name: padded([r.tokens[name] for r in requests], longest)
                 for name in protocol.token_inputs(protocol.TOKEN_TYPE_IDS in self.inputs)}
        if self.dense:
            bias = np.zeros((len(requests), longest, *self.row_shape), protocol.ROWS_DTYPE)
            for b, r in enumerate(requests):
                bias[b, :len(r.index)] = protocol.dense_bias(r.rows.reshape(-1, *self.row_shape), r.index)
            feeds[protocol.AOT_BIAS] = bias
        elif self.aot:
            feeds[protocol.AOT_INDEX] = padded([r.index for r in requests], longest, protocol.INDEX_DTYPE)
            rows = [r.rows.reshape(-1) for r in requests]
            feeds[protocol.AOT_ROWS] = (rows[0] if len(rows) == 1 else np.concatenate(rows)).astype(
                protocol.ROWS_DTYPE, copy=False)
            feeds[protocol.AOT_ROW_OFFSETS] = np.array([0, *itertools.accumulate(len(x) for x in rows)],
                                                       protocol.INDEX_DTYPE)
        if not any(r.want_states for r in requests):  # the graph's token states are then never copied out
            return self.session.run([protocol.POOLED_HIDDEN], feeds)[0]
        pooled, states = self.session.run([protocol.POOLED_HIDDEN, protocol.TOKEN_HIDDEN], feeds)
        for b, r in enumerate(requests):
            if r.want_states:
                r.states = states[b, : len(r.tokens[protocol.INPUT_IDS])]
        return pooled


def padded(arrays: list[np.ndarray], length: int, dtype: np.dtype | None = None) -> np.ndarray:
    """[len(arrays), length]: each 1-D array from the start of its row, zeros past its end. One request of the full
    length is a view, not a copy. The int8 configs build these for every request (each runs alone), where np.pad and
    np.stack per input cost far more (docs/benchmarks.md, "int8 on CPU")."""
    dtype = np.dtype(dtype or arrays[0].dtype)
    if len(arrays) == 1 and len(arrays[0]) == length:
        return np.ascontiguousarray(arrays[0][None], dtype)
    out = np.zeros((len(arrays), length), dtype)
    for b, a in enumerate(arrays):
        out[b, :len(a)] = a
    return out


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


def _onnx_backbone(step, aot: bool, threads: int, log: Callable[[str], None] | None = None) -> BackboneRunner:
    """A step's ONNX Runtime backbone: the graph its parameter `onnx_file` names under the models folder."""
    return BackboneRunner(Path(step.repo.models) / step.parameters["onnx_file"], threads=threads,
                          per_request=step.parameters.get("per_request") == "true")


register_engine(Engine("onnx", _onnx_backbone))
