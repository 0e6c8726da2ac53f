"""Triton python model: the backbone of the GPU ensembles' torch engine, and of any ensemble served by the local
tritonserver, which has no native backends: aot.serving.stages.Encoder.

- `engine: onnx` (an ONNX/TensorRT repository): ONNX Runtime, each batch split into runs of similar length.
- `engine: torch` (`aot export backbone --format torch`, CPU or CUDA by the `device` parameter): PyTorch
  (aot.serving_torch.engine.TorchBackbone, imported here: importing it registers the engine) with the task pool on the
  same device; the bias gather runs inside the encoder's forward (on CUDA: inside a captured CUDA graph per bucket).

The AoT variant also does the lookup (TASK_VERSION + token ids -> rows of P) here, in this process: a separate
lookup step would only add an IPC hop and a stub's CPU time per request (docs/benchmarks.md, "Figures
behind the serving code"). Each request is checked on its own and fails alone. Beside pooled_hidden, token_hidden:
every token's state for a token task's request (any request of the vanilla backbone, which knows no task), one
row of zeros for the others.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from aot.serving import protocol
from aot.serving.engine import Prepared
from aot.serving.items import Item
from aot.serving.stages import Encoder, pool_storage
from aot.serving.steps import RequestContext, Step, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        if params.get("engine") == "torch":
            from aot.serving_torch.engine import bind_instance_device  # importing it registers the torch engine

            bind_instance_device(args, params)

        aot = args["model_name"] == "backbone"
        self.step = Step(args, pb_utils, args["model_name"], parts="rows" if aot else "none",
                         pool_storage=pool_storage(params))
        self.encoder = Encoder(self.step, aot, log=pb_utils.Logger.log_info)

    def _prepare(self, item: Item, ctx: RequestContext) -> Prepared:
        task = self.step.task_version(item, ctx) if self.encoder.aot else None  # first: metrics
        return self.encoder.prepare(task, self.step.tokens(item))

    def _run(self, batch: list[Prepared]):
        return self.encoder.run(batch), batch

    def _outputs(self, result, ks):
        """The items' pooled states, and their token states (one row of zeros for an item that wants none),
        padded to the request's longest."""
        pooled, batch = result
        none = np.zeros((1, pooled.shape[-1]), dtype=protocol.HIDDEN_DTYPE)
        return [self.step.output(protocol.POOLED_HIDDEN, pooled[ks[0]:ks[-1] + 1]),
                self.step.stacked(protocol.TOKEN_HIDDEN, [none if batch[k].states is None else batch[k].states
                                                         for k in ks])]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._prepare, self._run, self._outputs)

    def finalize(self):
        self.step.close()
