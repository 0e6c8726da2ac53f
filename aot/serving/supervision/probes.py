"""Liveness probes of the python steps, and the verdict "hung".

Each probe is a real inference request to a step with the parameter protocol.PROBE_PARAMETER (aot.serving.steps answers
it at once, uncounted), sent once a second by a thread per step, so it proves the step's process runs its
`execute`, not only that it exists. A probe travels through tritonserver's front end: when that front end answers
nothing (saturated with connections, or the process stopped), every probe goes unanswered while every stub is fine.
So a step is hung only when its probes went unanswered for `hung_seconds` while the front end kept answering other
calls without a pause (aot.serving.supervision.triton_api), and its stubs used no CPU meanwhile (a step working through
a long queue keeps using CPU while its probe waits in that queue: it is busy, not hung, and is judged hung only after
BUSY_HUNG_SECONDS)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable

from aot.serving import protocol
from aot.serving.supervision.triton_api import UNREACHABLE, TritonApi

PROBE_SECONDS = 1.0  # between two liveness probes of one step
HUNG_SECONDS = 6.0  # a step that answered no probe for this long, and used no CPU meanwhile, is hung
BUSY_HUNG_SECONDS = 60.0  # one still using CPU is hung only after this long without an answer
BUSY_CPU_SECONDS = 0.01  # CPU a step uses between two checks (0.5 s) to count as working, not stuck
CLIENT_INPUTS = (protocol.TEXT, protocol.TASK)  # what aot.Client sends for a text without a pair


def probe_body(metadata: dict) -> bytes:
    """A request the step's config accepts (its inputs from the public metadata, one element each), marked as a
    probe: the step answers it before reading any input. A step that takes the clients' request (TEXT and TASK among
    its inputs: the fused `aot` / `vanilla`, the GPU ensemble's tokenizer) gets the inputs a text client sends,
    CLIENT_INPUTS, not every optional one: Triton's dynamic batcher batches only requests of one input set, and a
    probe of another set queued behind a batch that waited for a busy instance made its thread spin until that
    instance was free (docs/benchmarks.md, "The batcher's spin")."""
    specs = metadata.get("inputs", [])
    if set(CLIENT_INPUTS) <= {spec["name"] for spec in specs}:
        specs = [spec for spec in specs if spec["name"] in CLIENT_INPUTS]
    inputs = []
    for spec in specs:
        shape = [1 if d < 0 else d for d in spec["shape"]]
        count = 1
        for d in shape:
            count *= d
        value = "" if spec["datatype"] == protocol.BYTES else 0
        inputs.append({"name": spec["name"], "shape": shape, "datatype": spec["datatype"], "data": [value] * count})
    return json.dumps({"inputs": inputs, "parameters": {protocol.PROBE_PARAMETER: True}}).encode()


class Probes:
    """One prober thread per model; `hung(model, cpu_seconds)` is the verdict."""

    def __init__(self, api: TritonApi, stop: threading.Event, hung_seconds: Callable[[], float]):
        self.api, self._stop, self._hung_seconds = api, stop, hung_seconds
        self.answered: dict[str, float] = {}  # model -> time.monotonic() of its last probe answer
        self._working: dict[str, tuple[float, float]] = {}  # model -> (its stubs' CPU seconds, when it last grew)
        self.threads: list[threading.Thread] = []

    def start(self, models: Iterable[str]) -> None:
        now = time.monotonic()
        for model in sorted(models):
            self.answered[model] = now
            thread = threading.Thread(target=self._prober, args=(model,), name=f"aot-probe-{model}", daemon=True)
            self.threads.append(thread)
            thread.start()

    def _prober(self, model: str) -> None:
        body = None
        while not self._stop.wait(PROBE_SECONDS):
            try:
                body = body or probe_body(json.loads(self.api.request(f"/v2/models/{model}", timeout=2)))
                self.api.request(f"/v2/models/{model}/infer", body, timeout=self._hung_seconds())
                self.answered[model] = time.monotonic()
            except (*UNREACHABLE, ValueError, KeyError):
                self.api.front_end_answers()  # whose silence was it: the step's, or the whole server's?

    def restart(self, model: str) -> None:
        """A model repaired or reloaded: its new stubs get a full hung_seconds to answer."""
        if model in self.answered:
            self.answered[model] = time.monotonic()

    def silent_for(self, model: str) -> float:
        """Seconds since the step last answered a probe (0 for a model that is not probed)."""
        last = self.answered.get(model)
        return 0.0 if last is None else time.monotonic() - last

    def silent_while_answering(self, model: str) -> float:
        """Seconds the step has answered no probe while the front end answered without a pause
        (aot.serving.supervision.triton_api: its silence does not count, nor the time before it)."""
        last, since = self.answered.get(model), self.api.answering_since
        return 0.0 if last is None or since is None else max(0.0, self.api.answered - max(last, since))

    def hung(self, model: str, cpu_seconds: float) -> bool:
        """No probe answered for hung_seconds while the front end answered and the stubs (`cpu_seconds`: their
        CPU time now) used no CPU; or none for BUSY_HUNG_SECONDS while the front end answered."""
        now = time.monotonic()
        last_cpu, grew = self._working.get(model, (cpu_seconds, now))
        if cpu_seconds - last_cpu > BUSY_CPU_SECONDS or cpu_seconds < last_cpu:  # less: a new stub starts afresh
            grew = now
        self._working[model] = (cpu_seconds, grew)
        silent, idle, limit = self.silent_while_answering(model), now - grew, self._hung_seconds()
        return silent > max(BUSY_HUNG_SECONDS, limit) or (silent > limit and idle > limit)
