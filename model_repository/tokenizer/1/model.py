"""Triton python model: TEXT (+ TEXT_PAIR), TASK -> token ids (truncated to the task's max length) and the
TASK_VERSION every later step serves (the only step that resolves a task name)."""

import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.errors import RequestError
from serving.steps import Step
from serving.tokenization import Tokenization, is_blank


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "tokenizer")
        buckets = tuple(int(b) for b in self.step.parameters.get("buckets", "").split(",") if b)
        self.tokens = Tokenization(self.step.repo.tokenizer_dir, self.step.repo.uses_token_type_ids, buckets)
        self.outputs = protocol.token_inputs(self.step.repo.uses_token_type_ids)

    def _one(self, request, ctx):
        step = self.step
        text = step.text(request, protocol.TEXT)
        pair = step.text(request, protocol.TEXT_PAIR, required=False)
        pair = None if pair is None or is_blank(pair) else pair
        task = step.tasks.resolve(step.task_name(request))
        ctx["version"] = task.version
        has_pair = task.meta.get("has_pair")  # None: exported before it was recorded
        if has_pair is False and pair is not None:
            raise RequestError(f"task {task.name!r} was trained on single texts: send no {protocol.TEXT_PAIR}")
        if has_pair and pair is None:
            raise RequestError(f"task {task.name!r} was trained on text pairs: send {protocol.TEXT_PAIR} too")
        encoded = self.tokens.encode(text, pair, task.max_length)
        return [step.output(n, encoded[n][None, :]) for n in self.outputs] + [
            step.bytes_output(protocol.TASK_VERSION, task.version)]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_each(requests, self._one)
