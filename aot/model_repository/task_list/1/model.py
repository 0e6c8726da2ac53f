"""Triton python model: the tasks this server serves (`aot tasks`, Client.tasks()), read from the task store's index
the steps serve, not from a client's disk and without opening any task version. The request's parameters may narrow
the listing: `match` (a substring of the name) and `limit` (at most this many tasks, by name). Only the tasks the
request's tenant key opens are listed (aot.serving.store.tenants); with tenants in the store, the audit's counts over
every task are left out. A background thread
audits the store: every current version's files against their published digests, at the serving option
audit_bytes_per_second (aot.serving.store.audit), so a damaged task is listed as such before a request meets it."""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from aot.serving import protocol
from aot.serving.errors import RequestError
from aot.serving.steps import Step

AUDIT_SECONDS = 5.0


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "task_list")
        self._stop = threading.Event()
        self._auditor = threading.Thread(target=self._audit, name="aot-audit", daemon=True)
        self._auditor.start()

    def _audit(self):
        reported = set()
        budget = int(self.step.options.audit_bytes_per_second * AUDIT_SECONDS)
        while budget and not self._stop.wait(AUDIT_SECONDS):
            self.step.refresh()  # the index as of now, with or without traffic (the registry holds its lock)
            self.step.tasks.audit.run(budget)
            for name, damage in self.step.tasks.audit.damaged().items():
                if damage not in reported:
                    pb_utils.Logger.log_error(f"task_list: {damage}")
                    reported.add(damage)

    def _one(self, request):
        limit, match = _narrowing(request.parameters())
        tasks = self.step.tasks
        visible = set(tasks.visible(tasks.caller(self.step.tenant_key(request))))
        errors = {n: why for n, why in tasks.errors().items() if n in visible}
        names = [n for n in sorted(visible) if n not in errors and match in n]
        entries = tasks.entries()
        audit = vars(tasks.audit.progress)
        if tasks.view.index.tenants:
            audit = {k: audit[k] for k in ("passes", "last_pass_seconds")}
        listing = {"tasks": [entries[n].listing() for n in names[:limit]], "errors": errors,
                   "total": len(names), "audit": audit}
        if tasks.index_problem:  # what a client may read: the details are in the server log
            listing["index_error"] = tasks.index_problem
        return [pb_utils.Tensor(protocol.TASKS, np.array([json.dumps(listing).encode()], dtype=np.object_))]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_each(requests, self._one)

    def finalize(self):
        self._stop.set()
        self._auditor.join(timeout=AUDIT_SECONDS)
        self.step.close()


def _narrowing(parameters: str) -> tuple[int | None, str]:
    """The request's `limit` (a positive integer) and `match` (a string) parameters."""
    values = json.loads(parameters) if parameters else {}
    limit, match = values.get("limit"), values.get("match", "")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise RequestError(f"limit {limit!r}: expected a positive integer")
    if not isinstance(match, str):
        raise RequestError(f"match {match!r}: expected a string")
    return limit, match
