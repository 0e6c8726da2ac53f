"""Triton python model: the whole request in one step, the `aot` and `vanilla` models of the CPU configs: TEXT
(+ TEXT_PAIR) or token ids, TASK -> ANSWER, LOGITS, LABEL, TASK_VERSION. The three stages of the GPU ensembles'
steps (aot.serving.stages: TextInputs, Encoder; aot.serving.heads: head_answers) run here in one process, so a request
crosses the server once, not three times: on a CPU each crossing costs a python stub and tritonserver CPU time of
their own (`aot bench tax`, docs/benchmarks.md, "The serving tax"). A batch may mix tasks of every kind: one engine
call.

Parameter `aot`: "true" looks each request's rows of P up and runs the AoT graph; "false" runs the plain encoder
with the task's head. Parameter `engine: torch` runs the torch engine (aot.serving_torch.engine, imported here:
importing it registers the engine). Each request is checked on its own and fails alone; its task version is resolved
once and serves every stage.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from aot.serving import protocol
from aot.serving.heads import HeadInput, head_answers
from aot.serving.stages import Encoder, TextInputs, TextRequest, pool_storage
from aot.serving.steps import Step, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        if params.get("engine") == "torch":
            from aot.serving_torch.engine import bind_instance_device  # importing it registers the torch engine

            bind_instance_device(args, params)

        aot = params.get("aot") == "true"
        self.step = Step(args, pb_utils, args["model_name"], parts="all" if aot else "head",
                         pool_storage=pool_storage(params) if aot else None)
        self.text = TextInputs(self.step)
        self.encoder = Encoder(self.step, aot, log=pb_utils.Logger.log_info)

    def _run(self, batch: list[TextRequest]):
        tasks = [r.task for r in batch]
        texts = self.text.encode(batch)
        prepared = self.encoder.prepare_many(tasks, [t.tokens for t in texts])
        pooled = self.encoder.run(prepared)
        inputs = [HeadInput(pooled[k], p.states, t.words, t.first) for k, (p, t) in enumerate(zip(prepared, texts))]
        return [(task.version, answer) for task, answer in zip(tasks, head_answers(tasks, inputs))]

    def _outputs(self, answers, ks):
        mine = [answers[k] for k in ks]
        return [self.step.stacked(protocol.LOGITS, [a.values for _, a in mine], fill=np.nan),
                self.step.bytes_output(protocol.LABEL, [a.label for _, a in mine]),
                self.step.bytes_output(protocol.ANSWER, [a.json for _, a in mine]),
                self.step.bytes_output(protocol.TASK_VERSION, [version for version, _ in mine])]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self.text.prepare, self._run, self._outputs)

    def finalize(self):
        self.step.close()
