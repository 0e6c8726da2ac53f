"""Triton python model: the backbone on CPU, through ONNX Runtime (the local server has no native onnxruntime
backend). Requests are batched exactly as Triton's native backend batches them (exporter.runtime.BackboneRunner):
the same ONNX file serves the GPU config and this one."""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from exporter import interface as io
from exporter.runtime import BackboneRunner, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = model_parameters(args)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.runner = BackboneRunner(version_dir / params["onnx_file"], threads=int(params.get("threads", "0")))
        self.inputs = [i["name"] for i in config["input"]]

    def execute(self, requests):
        batch = [{name: pb_utils.get_input_tensor_by_name(r, name).as_numpy().reshape(-1) for name in self.inputs}
                 for r in requests]
        try:
            hidden = self.runner.run(batch)
        except Exception as exc:  # noqa: BLE001 - report to every request of the batch, keep serving
            error = pb_utils.TritonError(f"backbone: {type(exc).__name__}: {exc}")
            return [pb_utils.InferenceResponse(error=error) for _ in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor(io.CLS_HIDDEN, hidden[i:i + 1])])
                for i in range(len(requests))]
