"""Triton python model: the tasks this server serves now (`aot tasks`, Client.tasks()), read from the task store
the steps serve, not from a client's disk."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.steps import Step


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "task_list")

    def _one(self, request, ctx):
        tasks = self.step.tasks
        listing = {"tasks": [t.describe() for _, t in sorted(tasks.served().items())], "errors": tasks.errors()}
        if tasks.manifest_error:
            listing["manifest_error"] = tasks.manifest_error
        return [pb_utils.Tensor(protocol.TASKS, np.array([json.dumps(listing).encode()], dtype=np.object_))]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_each(requests, self._one)
