"""Triton python model: TEXT (+ TEXT_PAIR), TASK -> token ids (truncated to the task's max length) and the
TASK_VERSION every later step serves (the only step that resolves a task name): aot.serving.stages.TextInputs, the
first stage of the GPU ensembles. For the head: a token task's text (word_text) and the word each token starts
(word_index); -1 and an empty text for the other kinds.

A client that tokenized on its own side (aot.Client(tokenizer=...)) sends input_ids, attention_mask (and
token_type_ids) instead of TEXT: they are checked (the backbone's ranges, at most the task's max length) and passed
on. Each request is checked on its own; the texts of a batch are then tokenized in one call per max length."""

import numpy as np
import triton_python_backend_utils as pb_utils

from aot.serving import protocol
from aot.serving.stages import TextInputs, TextRequest
from aot.serving.steps import Step


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "tokenizer")
        buckets = tuple(int(b) for b in self.step.parameters.get("buckets", "").split(",") if b)
        self.text = TextInputs(self.step, buckets)
        self.outputs = protocol.token_inputs(self.step.repo.uses_token_type_ids)

    def _run(self, batch: list[TextRequest]):
        return [(r.task.version, text) for r, text in zip(batch, self.text.encode(batch))]

    def _outputs(self, encoded, k):
        version, text = encoded[k]
        first = text.first if text.first is not None else np.full(1, -1, dtype=protocol.INDEX_DTYPE)
        return [self.step.output(n, text.tokens[n][None, :]) for n in self.outputs] + [
            self.step.bytes_output(protocol.TASK_VERSION, version),
            self.step.output(protocol.WORD_INDEX, first[None, :]),
            self.step.bytes_output(protocol.WORD_TEXT, "" if text.words is None else text.words.text)]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self.text.prepare, self._run, self._outputs)

    def finalize(self):
        self.step.close()
