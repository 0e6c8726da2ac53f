"""Triton python model: the AoT lookup of the GPU ensemble. TASK_VERSION, token ids -> the rows of P for the
request's distinct tokens (+ each token's row). Fused tables are memory-mapped, so only the rows a request needs are
read; factored tasks compute them."""

import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.steps import Step
from serving.tasks import token_index


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "aot_lookup", tasks="rows")

    def _prepare(self, request, ctx):
        task = self.step.task_version(request, ctx)
        tokens = self.step.tokens(request)
        unique, index = token_index(tokens[protocol.INPUT_IDS], tokens[protocol.ATTENTION_MASK])
        return task, unique, index

    def _run(self, batch):
        """The batch's rows in one pool call: its misses are filled together."""
        return self.step.tasks.rows_many([(task, unique) for task, unique, _ in batch]), [i for _, _, i in batch]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(
            requests, self._prepare, self._run,
            lambda out, k: [self.step.output(protocol.AOT_ROWS, out[0][k].reshape(1, -1)),
                            self.step.output(protocol.AOT_INDEX, out[1][k][None, :])])
