"""Triton python model: the whole request in one step, the `aot` and `vanilla` models of the CPU configs and of the
torch engine's GPU configs: TEXT (+ TEXT_PAIR) or token ids, TASK -> LOGITS, LABEL, TASK_VERSION (+ ANSWER when
asked for). The stages of the native GPU ensembles' steps (aot.serving.stages: TextInputs, Encoder; aot.serving.heads)
run here in one process, so a request crosses the server once, not three times: each crossing costs a python stub
and tritonserver CPU time of their own (`aot bench tax`, docs/benchmarks.md, "The serving tax"). A batch may mix
tasks of every kind: one tokenizer call per max length, one engine call, one head call per task version, its answers
built in columns (aot.serving.outputs).

Parameter `aot`: "true" looks each text's rows of P up and runs the AoT graph; "false" runs the plain encoder with the
task's head. Parameter `engine: torch` runs the torch engine (aot.serving_torch.engine, imported here: importing it
registers the engine). Each request is checked on its own and fails alone; its task versions are resolved once and
serve every stage.
"""

import triton_python_backend_utils as pb_utils

from aot.serving.heads import head_outputs
from aot.serving.outputs import BatchAnswers
from aot.serving.stages import Encoder, TextBatch, TextInputs, TextPart, pool_storage
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

    def _run(self, parts: list[TextPart]) -> tuple[BatchAnswers, list[TextPart]]:
        batch: TextBatch = self.text.encode(parts)
        encoded = self.encoder.run(batch.encoder, batch.tasks)
        slots = batch.encoder.head_slots
        heads = head_outputs(batch.tasks.groups(), encoded, batch.encoder.lengths, batch.words, batch.first,
                             on_device=None if slots is None else slots >= 0)
        return BatchAnswers(batch.tasks, heads), parts

    def _outputs(self, result, k: int, rows: range, request):
        answers, parts = result
        return answers.tensors(self.step, rows, self.step.requested(request), compact=parts[k].compact)

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self.text.read, self._run, self._outputs)

    def finalize(self):
        self.step.close()
