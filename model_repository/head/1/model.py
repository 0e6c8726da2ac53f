"""Triton python model: each request's own task head (the version the tokenizer pinned), so a batch may mix
tasks."""

import numpy as np
import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.errors import RequestError
from serving.steps import Step


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "head", tasks="head")

    def _one(self, request, ctx):
        task = self.step.task_version(request, ctx)
        hidden = self.step.sequence(request, protocol.CLS_HIDDEN).astype(np.float32)
        if hidden.shape != (task.hidden_size,) or not np.isfinite(hidden).all():
            raise RequestError(f"{protocol.CLS_HIDDEN} must be {task.hidden_size} finite values, got "
                               f"{hidden.shape[0]} values")
        logits = task.logits(hidden[None, :])[0]
        return [self.step.output(protocol.LOGITS, logits[None, :]),
                self.step.bytes_output(protocol.LABEL, task.label(logits))]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_each(requests, self._one)
