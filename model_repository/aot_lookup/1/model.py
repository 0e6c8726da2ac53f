"""Triton python model: the AoT lookup of the GPU ensemble. TASK_VERSION, token ids -> the rows of P for the
request's distinct tokens (+ each token's row). Fused tables are memory-mapped, so only the rows a request needs are
read; factored tasks compute them."""

import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.steps import Step
from serving.tasks import lookup


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "aot_lookup", tasks="rows")

    def _one(self, request, ctx):
        task = self.step.task_version(request, ctx)
        tokens = self.step.tokens(request)
        rows, index = lookup(task, tokens[protocol.INPUT_IDS], tokens[protocol.ATTENTION_MASK])
        return [self.step.output(protocol.AOT_ROWS, rows[None, :]), self.step.output(protocol.AOT_INDEX, index[None, :])]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_each(requests, self._one)
