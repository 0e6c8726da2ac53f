"""Triton python model: each request's own task head (the version the tokenizer pinned) by its task's kind, so a
batch may mix tasks and kinds (aot.serving.heads.head_answers): a pooled kind's head on its task's pooling, a token
task's on every token's state (token_hidden) with the words the tokenizer found (word_index, word_text). Requests
are checked one by one; then each task version's requests of the batch go through its head in one call, not one
matmul per request."""

import numpy as np
import triton_python_backend_utils as pb_utils

from aot.serving import protocol
from aot.serving.answers import READS_TOKENS
from aot.serving.errors import RequestError
from aot.serving.heads import HeadInput, head_answers
from aot.serving.steps import RequestContext, Step
from aot.serving.words import split_words


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "head", parts="head")

    def _prepare(self, request, ctx: RequestContext):
        task = self.step.task_version(request, ctx)
        pooled = self.step.tensor(request, protocol.POOLED_HIDDEN)
        expected = (1, len(protocol.POOLINGS), task.hidden_size)
        # Only the row this task reads must be finite: another pooling's overflow is not this request's failure.
        if pooled.shape != expected or not np.isfinite(pooled[0, protocol.pooling_row(task.pooling)]).all():
            raise RequestError(f"{protocol.POOLED_HIDDEN} must be {expected[1]} x {expected[2]} values with a finite "
                               f"{task.pooling!r} row (the one this task reads), got shape {list(pooled.shape)}")
        if task.kind not in READS_TOKENS:
            return task, HeadInput(pooled[0])
        return task, self._token_input(request, task, pooled[0])

    def _token_input(self, request, task, pooled) -> HeadInput:
        """A token task's states, its text's words and each token's word, checked against each other."""
        states = self.step.tensor(request, protocol.TOKEN_HIDDEN)
        first = self.step.sequence(request, protocol.WORD_INDEX)
        words = split_words(self.step.text(request, protocol.WORD_TEXT))
        if states.ndim != 3 or states.shape[0] != 1 or states.shape[2] != task.hidden_size:
            raise RequestError(f"{protocol.TOKEN_HIDDEN} must be [1, S, {task.hidden_size}], got {list(states.shape)}")
        if len(first) != states.shape[1] or first.max(initial=-1) >= len(words.spans) or first.min(initial=0) < -1:
            raise RequestError(f"{protocol.WORD_INDEX} must give each of the {states.shape[1]} tokens a word of "
                               f"{protocol.WORD_TEXT} ({len(words.spans)} words) or -1")
        return HeadInput(pooled, states[0], words, first)

    @staticmethod
    def _run(batch):
        return head_answers([task for task, _ in batch], [inputs for _, inputs in batch])

    def _outputs(self, result, k):
        answer = result[k]
        return [self.step.output(protocol.LOGITS, answer.values[None, :]),
                self.step.bytes_output(protocol.LABEL, answer.label),
                self.step.bytes_output(protocol.ANSWER, answer.json)]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._prepare, self._run, self._outputs)

    def finalize(self):
        self.step.close()
