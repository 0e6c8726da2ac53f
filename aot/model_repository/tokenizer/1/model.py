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
from aot.serving.errors import RequestError
from aot.serving.items import Item
from aot.serving.stages import TextInputs, TextRequest
from aot.serving.steps import RequestContext, Step


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "tokenizer")
        buckets = tuple(int(b) for b in self.step.parameters.get("buckets", "").split(",") if b)
        self.text = TextInputs(self.step, buckets)
        self.outputs = protocol.token_inputs(self.step.repo.uses_token_type_ids)
        # a native backbone taking ragged rows adds one row offset per request: one item each (configs parameter)
        self.one_per_request = self.step.parameters.get("one_text_per_request") == "true"

    def _prepare(self, item: Item, ctx: RequestContext) -> TextRequest:
        if self.one_per_request and item.count > 1:
            raise RequestError(f"this repository's GPU ensemble takes one text per request (its backbone's bias "
                               f"interface, rows, adds one row offset per request), got {item.count}: send them "
                               "one per request, or re-export the backbone with --bias-interface dense or --format "
                               "torch for many texts per request")
        return self.text.prepare(item, ctx)

    def _run(self, batch: list[TextRequest]):
        return [(r.task.version, text) for r, text in zip(batch, self.text.encode(batch))]

    def _outputs(self, encoded, ks):
        """The request's items' token tensors padded to its longest (a padded token is masked out; its word index
        is -1), their task versions, and a token task's words."""
        mine = [encoded[k] for k in ks]
        none = np.full(1, -1, dtype=protocol.INDEX_DTYPE)
        return [self.step.stacked(n, [text.tokens[n] for _, text in mine]) for n in self.outputs] + [
            self.step.bytes_output(protocol.TASK_VERSION, [version for version, _ in mine]),
            self.step.stacked(protocol.WORD_INDEX, [none if t.first is None else t.first for _, t in mine], fill=-1),
            self.step.bytes_output(protocol.WORD_TEXT, ["" if t.words is None else t.words.text for _, t in mine])]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._prepare, self._run, self._outputs)

    def finalize(self):
        self.step.close()
