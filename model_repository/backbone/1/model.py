"""Triton python model: the backbone on CPU, through ONNX Runtime (the local server has no native onnxruntime
backend). Requests are batched exactly as Triton's native backend batches them (exporter.runtime.BackboneRunner):
the same ONNX file serves the GPU config and this one.

The AoT variant also does the lookup (TASK + token ids -> rows of P) here, in this process: on CPU a separate lookup
step would only add an IPC hop and a stub's CPU time per request (measured: 0.87x of the vanilla ensemble's
throughput with it). A request with an unknown task fails alone; the rest of the batch runs.
"""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from exporter import interface as io
from exporter.runtime import BackboneRunner, RequestError, TaskRegistry, decode_text, lookup, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = model_parameters(args)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.runner = BackboneRunner(version_dir / params["onnx_file"], threads=int(params.get("threads", "0")))
        self.inputs = [i["name"] for i in config["input"] if i["name"] != io.TASK]
        self.tasks = None
        if "store" in params:
            self.tasks = TaskRegistry((Path(args["model_repository"]) / params["store"]).resolve(), serving=True)

    def _prepare(self, request) -> dict:
        tensors = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)
                   for name in self.inputs}
        if self.tasks is not None:
            raw = pb_utils.get_input_tensor_by_name(request, io.TASK).as_numpy().reshape(-1)[0]
            task = self.tasks.get(decode_text(raw, io.TASK))
            tensors[io.AOT_ROWS], tensors[io.AOT_INDEX] = lookup(task, tensors[io.INPUT_IDS],
                                                                 tensors[io.ATTENTION_MASK])
        return tensors

    def execute(self, requests):
        if self.tasks is not None:
            self.tasks.refresh()
        responses, batch = [None] * len(requests), []
        for i, request in enumerate(requests):
            try:
                batch.append((i, self._prepare(request)))
            except RequestError as exc:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
        if batch:
            try:
                hidden = self.runner.run([tensors for _, tensors in batch])
            except Exception as exc:  # noqa: BLE001 - report to every request of the batch, keep serving
                error = pb_utils.TritonError(f"backbone: {type(exc).__name__}: {exc}")
                for i, _ in batch:
                    responses[i] = pb_utils.InferenceResponse(error=error)
            else:
                for k, (i, _) in enumerate(batch):
                    responses[i] = pb_utils.InferenceResponse([pb_utils.Tensor(io.CLS_HIDDEN, hidden[k:k + 1])])
        return responses
