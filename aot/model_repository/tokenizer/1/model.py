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
from aot.serving.columns import RequestInputs, TaskColumn
from aot.serving.errors import RequestError
from aot.serving.stages import TextBatch, TextInputs, TextPart
from aot.serving.steps import Step
from aot.serving.tokenization import bucket_length


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "tokenizer")
        buckets = tuple(int(b) for b in self.step.parameters.get("buckets", "").split(",") if b)
        self.text = TextInputs(self.step, buckets)
        self.outputs = protocol.token_inputs(self.step.repo.uses_token_type_ids)
        # a native backbone taking ragged rows adds one row offset per request: one item each (configs parameter)
        self.one_per_request = self.step.parameters.get("one_text_per_request") == "true"

    def _read(self, inputs: RequestInputs, column: TaskColumn) -> TextPart:
        if self.one_per_request and inputs.count > 1:
            raise RequestError(f"this repository's GPU ensemble takes one text per request (its backbone's bias "
                               f"interface, rows, adds one row offset per request), got {inputs.count}: send them "
                               "one per request, or re-export the backbone with --bias-interface dense or --format "
                               "torch for many texts per request")
        return self.text.read(inputs, column)

    def _outputs(self, batch: TextBatch, k: int, rows: range, request):
        """The request's items' token tensors padded to its longest (then its bucket; a padded token is masked out,
        its word index -1), their task versions, and a token task's words."""
        cut = slice(rows.start, rows.stop)
        width = bucket_length(int(batch.encoder.lengths[cut].max()), self.text.tokens.buckets)
        versions = np.array([t.version.encode() for t in batch.tasks.tasks], dtype=np.object_)[batch.tasks.index]
        words = [b"" if w is None else w.text.encode() for w in batch.words[cut]]
        first = (np.full((len(rows), 1), -1, protocol.INDEX_DTYPE) if batch.first is None
                 else batch.first[cut, :width])
        return [self.step.output(n, batch.encoder.tokens[n][cut, :width]) for n in self.outputs] + [
            self.step.output(protocol.TASK_VERSION, versions[cut, None]),
            self.step.output(protocol.WORD_INDEX, np.ascontiguousarray(first)),
            self.step.output(protocol.WORD_TEXT, np.array(words, dtype=np.object_)[:, None])]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._read, self.text.encode, self._outputs)

    def finalize(self):
        self.step.close()
