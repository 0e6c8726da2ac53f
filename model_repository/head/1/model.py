"""Triton python model: each request's own task head, so one batch may mix tasks."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from exporter import interface as io
from exporter.runtime import RequestError, TaskRegistry, decode_text, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.tasks = TaskRegistry((Path(args["model_repository"]) / params["store"]).resolve(), with_rows=False)

    def execute(self, requests):
        self.tasks.refresh()
        names, hidden, responses = [], [], [None] * len(requests)
        for i, request in enumerate(requests):
            try:
                name = decode_text(pb_utils.get_input_tensor_by_name(request, io.TASK).as_numpy().reshape(-1)[0], io.TASK)
                self.tasks.get(name)
                names.append((i, name))
                hidden.append(pb_utils.get_input_tensor_by_name(request, io.CLS_HIDDEN).as_numpy().reshape(-1))
            except RequestError as exc:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
        for (i, name), h in zip(names, hidden):
            task = self.tasks.get(name)
            logits = task.logits(h[None, :])[0].astype(np.float32)
            label = np.array([[task.label(logits).encode()]], dtype=np.object_)
            responses[i] = pb_utils.InferenceResponse([pb_utils.Tensor(io.LOGITS, logits[None, :]),
                                                       pb_utils.Tensor(io.LABEL, label)])
        return responses
