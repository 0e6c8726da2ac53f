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
from aot.serving.items import Item
from aot.serving.steps import RequestContext, Step
from aot.serving.words import split_words


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "head", parts="head")

    def _prepare(self, item: Item, ctx: RequestContext):
        task = self.step.task_version(item, ctx)
        pooled = item.array(protocol.POOLED_HIDDEN)
        expected = (len(protocol.POOLINGS), task.hidden_size)
        # Only the row this task reads must be finite: another pooling's overflow is not this item's failure.
        if pooled.shape != expected or not np.isfinite(pooled[protocol.pooling_row(task.pooling)]).all():
            raise RequestError(f"{protocol.POOLED_HIDDEN} must be {expected[0]} x {expected[1]} values per item with "
                               f"a finite {task.pooling!r} row (the one this task reads), got {list(pooled.shape)}")
        if task.kind not in READS_TOKENS:
            return task, HeadInput(pooled)
        return task, self._token_input(item, task, pooled)

    def _token_input(self, item: Item, task, pooled) -> HeadInput:
        """A token task's states, its text's words and each token's word, checked against each other (the
        request's longest item sets both lengths: a shorter item's padded tokens have word -1)."""
        states = item.array(protocol.TOKEN_HIDDEN)
        first = item.sequence(protocol.WORD_INDEX)
        words = split_words(self.step.text(item, protocol.WORD_TEXT))
        if states.ndim != 2 or states.shape[1] != task.hidden_size:
            raise RequestError(f"{protocol.TOKEN_HIDDEN} must be [N, S, {task.hidden_size}], got "
                               f"{[item.count, *states.shape]}")
        if len(first) != states.shape[0] or first.max(initial=-1) >= len(words.spans) or first.min(initial=0) < -1:
            raise RequestError(f"{protocol.WORD_INDEX} must give each of the {states.shape[0]} tokens a word of "
                               f"{protocol.WORD_TEXT} ({len(words.spans)} words) or -1")
        return HeadInput(pooled, states, words, first)

    @staticmethod
    def _run(batch):
        return head_answers([task for task, _ in batch], [inputs for _, inputs in batch])

    def _outputs(self, result, ks):
        mine = [result[k] for k in ks]
        return [self.step.stacked(protocol.LOGITS, [a.values for a in mine], fill=np.nan),
                self.step.bytes_output(protocol.LABEL, [a.label for a in mine]),
                self.step.bytes_output(protocol.ANSWER, [a.json for a in mine])]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._prepare, self._run, self._outputs)

    def finalize(self):
        self.step.close()
