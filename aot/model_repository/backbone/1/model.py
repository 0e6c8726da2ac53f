"""Triton python model: the backbone of the GPU ensembles' torch engine, and of any ensemble served by the local
tritonserver, which has no native backends: aot.serving.stages.Encoder.

- `engine: onnx` (an ONNX/TensorRT repository): ONNX Runtime, each batch split into runs of similar length.
- `engine: torch` (`aot export backbone --format torch`, CPU or CUDA by the `device` parameter): PyTorch
  (aot.serving_torch.engine.TorchBackbone, imported here: importing it registers the engine) with the task pool on the
  same device; the bias gather runs inside the encoder's forward (on CUDA: inside a captured CUDA graph per bucket).

The AoT variant also does the lookup (TASK_VERSION + token ids -> rows of P) here, in this process: a separate
lookup step would only add an IPC hop and a stub's CPU time per request (docs/benchmarks.md, "Figures
behind the serving code"). Each request is checked on its own and fails alone. Beside pooled_hidden, token_hidden:
every token's state of a request that holds a token task's item (any request of the vanilla backbone, which knows
no task), one row of zeros for the others.
"""

from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from aot.serving import protocol
from aot.serving.columns import RequestInputs, TaskColumn
from aot.serving.engine import EncoderBatch, EncoderOutput
from aot.serving.stages import Encoder, pool_storage
from aot.serving.steps import Step, model_parameters


@dataclass
class Sequences:
    """A request's token tensors [N, S], checked, and its items' task versions (AoT)."""

    tokens: dict[str, np.ndarray]
    tasks: TaskColumn

    @property
    def count(self) -> int:
        return len(self.tokens[protocol.INPUT_IDS])

    @property
    def width(self) -> int:
        return self.tokens[protocol.INPUT_IDS].shape[1]


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        if params.get("engine") == "torch":
            from aot.serving_torch.engine import bind_instance_device  # importing it registers the torch engine

            bind_instance_device(args, params)

        aot = args["model_name"] == "backbone"
        self.step = Step(args, pb_utils, args["model_name"], parts="rows" if aot else "none",
                         pool_storage=pool_storage(params))
        self.encoder = Encoder(self.step, aot, log=pb_utils.Logger.log_info, heads=False)

    def _read(self, inputs: RequestInputs, column: TaskColumn) -> Sequences:
        if self.encoder.aot:  # first: metrics
            column.tasks, column.index = self.step.pinned(inputs)
        return Sequences(inputs.tokens(self.step.repo), column)

    def _run(self, parts: list[Sequences]) -> tuple[EncoderOutput, list[Sequences]]:
        batch = EncoderBatch.joined([p.tokens for p in parts])
        tasks = TaskColumn.joined([p.tasks for p in parts]) if self.encoder.aot else None
        batch.want_states = tasks.of("reads_tokens", bool) if tasks is not None else \
            np.ones(batch.size, bool)
        return self.encoder.run(batch, tasks), parts

    def _outputs(self, result, k: int, rows: range, request):
        """The items' pooled states, and their token states as long as the request's token ids (one row of zeros
        when no item of the request wants them)."""
        encoded, parts = result
        cut = slice(rows.start, rows.stop)
        wants = parts[k].tasks.tasks == [] or any(t.spec.reads_tokens for t in parts[k].tasks.tasks)
        if encoded.states is None or not wants:
            states = np.zeros((len(rows), 1, encoded.pooled.shape[-1]), dtype=protocol.HIDDEN_DTYPE)
        else:
            states = encoded.states[cut, : parts[k].width]
        return [self.step.output(protocol.POOLED_HIDDEN, encoded.pooled[cut]),
                self.step.output(protocol.TOKEN_HIDDEN, np.ascontiguousarray(states))]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._read, self._run, self._outputs)

    def finalize(self):
        self.step.close()
