"""Triton python model: the backbone on CPU, through ONNX Runtime (the local server has no native onnxruntime
backend). Requests are batched exactly as Triton's native backend batches them (serving.engine.BackboneRunner):
the same ONNX file serves the GPU config and this one.

The AoT variant also does the lookup (TASK_VERSION + token ids -> rows of P) here, in this process: on CPU a
separate lookup step would only add an IPC hop and a stub's CPU time per request (measured: 0.87x of the vanilla
ensemble's throughput with it). Each request is checked on its own and fails alone.
"""

import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.engine import BackboneRunner
from serving.steps import Step
from serving.tasks import token_index


class TritonPythonModel:
    def initialize(self, args):
        aot = args["model_name"] == "backbone"
        self.step = Step(args, pb_utils, args["model_name"], tasks="rows" if aot else "none")
        onnx = self.step.model_dir / args["model_version"] / self.step.parameters["onnx_file"]
        self.runner = BackboneRunner(onnx, threads=int(self.step.parameters.get("threads", "0")))

    def _prepare(self, request, ctx) -> dict:
        task = self.step.task_version(request, ctx) if self.step.tasks is not None else None  # first: metrics
        tensors = self.step.tokens(request)
        if task is not None:
            tensors["task"] = task
            tensors["unique"], tensors[protocol.AOT_INDEX] = token_index(tensors[protocol.INPUT_IDS],
                                                                         tensors[protocol.ATTENTION_MASK])
        return tensors

    def _run(self, batch: list[dict]):
        """The batch's rows in one pool call (its misses filled together), then the graph."""
        if self.step.tasks is not None:
            rows = self.step.tasks.rows_many([(r["task"], r["unique"]) for r in batch])
            for r, rows_of in zip(batch, rows):
                r[protocol.AOT_ROWS] = rows_of.reshape(-1)
        return self.runner.run(batch)

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(
            requests, self._prepare, self._run,
            lambda hidden, k: [self.step.output(protocol.CLS_HIDDEN, hidden[k:k + 1])])
