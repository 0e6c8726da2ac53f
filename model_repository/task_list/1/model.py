"""Triton python model: the tasks this server serves now (`aot tasks`, Client.tasks()), read from the task store
the steps serve, not from a client's disk. A background thread checks every current version's files against the
digests the manifest publishes (again only when a file changes), so a damaged task is listed as such before a
request meets it."""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.steps import RequestContext, Step

AUDIT_SECONDS = 5.0


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "task_list")
        self._stop = threading.Event()
        self._auditor = threading.Thread(target=self._audit, name="aot-audit", daemon=True)
        self._auditor.start()

    def _audit(self):
        reported = set()
        while True:
            self.step.refresh()
            for name, damage in self.step.tasks.audit().items():
                if damage not in reported:
                    pb_utils.Logger.log_error(f"task_list: {damage}")
                    reported.add(damage)
            if self._stop.wait(AUDIT_SECONDS):
                return

    def _one(self, request, ctx: RequestContext):
        tasks = self.step.tasks
        errors = tasks.errors()
        listing = {"tasks": [t.describe() for n, t in sorted(tasks.served().items()) if n not in errors],
                   "errors": errors}
        if tasks.manifest_error:
            listing["manifest_error"] = tasks.manifest_error
        return [pb_utils.Tensor(protocol.TASKS, np.array([json.dumps(listing).encode()], dtype=np.object_))]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_each(requests, self._one)

    def finalize(self):
        self._stop.set()
