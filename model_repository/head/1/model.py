"""Triton python model: each request's own task head (the version the tokenizer pinned) on its task's pooling, so
a batch may mix tasks (serving.stages.head_answers). Requests are checked one by one; then each task version's
requests of the batch go through its head in one call, not one matmul per request."""

import numpy as np
import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.errors import RequestError
from serving.stages import head_answers
from serving.steps import RequestContext, Step


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "head", parts="head")

    def _prepare(self, request, ctx: RequestContext):
        task = self.step.task_version(request, ctx)
        pooled = self.step.tensor(request, protocol.POOLED_HIDDEN)
        expected = (1, len(protocol.POOLINGS), task.hidden_size)
        # Only the row this task reads must be finite: another pooling's overflow is not this request's failure.
        if pooled.shape != expected or not np.isfinite(pooled[0, protocol.pooling_row(task.pooling)]).all():
            raise RequestError(f"{protocol.POOLED_HIDDEN} must be {expected[1]} x {expected[2]} values with a finite "
                               f"{task.pooling!r} row (the one this task reads), got shape {list(pooled.shape)}")
        return task, pooled

    @staticmethod
    def _run(batch):
        return head_answers([task for task, _ in batch], [pooled for _, pooled in batch])

    def _outputs(self, result, k):
        logits, label = result[k]
        return [self.step.output(protocol.LOGITS, logits), self.step.bytes_output(protocol.LABEL, label)]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._prepare, self._run, self._outputs)
