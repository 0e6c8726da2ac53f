"""Triton python model: each request's own task head (the version the tokenizer pinned) on its task's pooling, so
a batch may mix tasks."""

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
        pooled = self.step.tensor(request, protocol.POOLED_HIDDEN).astype(np.float32)
        expected = (1, len(protocol.POOLINGS), task.hidden_size)
        # Only the row this task reads must be finite: another pooling's overflow is not this request's failure.
        if pooled.shape != expected or not np.isfinite(pooled[0, protocol.pooling_row(task.pooling)]).all():
            raise RequestError(f"{protocol.POOLED_HIDDEN} must be {expected[1]} x {expected[2]} values with a finite "
                               f"{task.pooling!r} row (the one this task reads), got shape {list(pooled.shape)}")
        logits = task.logits(pooled)[0]
        return [self.step.output(protocol.LOGITS, logits[None, :]),
                self.step.bytes_output(protocol.LABEL, task.label(logits))]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_each(requests, self._one)
