"""Triton python model: the AoT lookup. TASK, token ids -> the rows of P for the request's distinct tokens.

Runs on the host: fused tables are memory-mapped, so only the rows a request needs are read. The task store is
re-read when its manifest changes, so tasks exported while the server runs are served at once.
"""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from exporter import interface as io
from exporter.runtime import RequestError, TaskRegistry, decode_text, lookup, model_parameters, respond_each


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.tasks = TaskRegistry((Path(args["model_repository"]) / params["store"]).resolve(), serving=True)
        for name, error in self.tasks.errors().items():
            pb_utils.Logger.log_warn(f"aot_lookup: {error}")

    def _one(self, request):
        if pb_utils.get_input_tensor_by_name(request, io.TASK).as_numpy().size != 1:
            raise RequestError("send one text per request (batch size 1); use concurrent requests for more")
        name = decode_text(pb_utils.get_input_tensor_by_name(request, io.TASK).as_numpy().reshape(-1)[0], io.TASK)
        task = self.tasks.get(name)
        ids = pb_utils.get_input_tensor_by_name(request, io.INPUT_IDS).as_numpy().reshape(-1)
        mask = pb_utils.get_input_tensor_by_name(request, io.ATTENTION_MASK).as_numpy().reshape(-1)
        rows, index = lookup(task, ids, mask)
        return pb_utils.InferenceResponse([pb_utils.Tensor(io.AOT_ROWS, rows[None, :]),
                                           pb_utils.Tensor(io.AOT_INDEX, index[None, :])])

    def execute(self, requests):
        self.tasks.refresh()
        return respond_each(requests, self._one, pb_utils)
