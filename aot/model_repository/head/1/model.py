"""Triton python model: each item's own task head (the version the tokenizer pinned) by its task's kind, so a batch
may mix tasks and kinds (aot.serving.heads): a pooled kind's head on its task's pooling, a token task's on every
token's state (token_hidden) with the words the tokenizer found (word_index, word_text). Each request is checked
as a whole; then each task version's items of the batch go through its head in one call."""

from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from aot.serving import protocol
from aot.serving.columns import RequestInputs, TaskColumn, refuse_first
from aot.serving.engine import EncoderOutput
from aot.serving.errors import RequestError
from aot.serving.heads import head_outputs
from aot.serving.outputs import BatchAnswers
from aot.serving.steps import Step
from aot.serving.words import Words, split_words


@dataclass
class HeadPart:
    """A request at the head: its items' task versions, pooled states [N, K, d] and, when it holds a token task's
    items, every token's state [N, S, d], each token's word [N, S] and each item's words (None for other kinds)."""

    tasks: TaskColumn
    pooled: np.ndarray
    states: np.ndarray | None = None
    first: np.ndarray | None = None
    words: list[Words | None] | None = None
    compact: bool = False  # ANSWER only where the other outputs do not carry it (protocol.ANSWERS_PARAMETER)

    @property
    def count(self) -> int:
        return len(self.pooled)


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "head", parts="head")

    def _read(self, inputs: RequestInputs, column: TaskColumn) -> HeadPart:
        column.tasks, column.index = self.step.pinned(inputs)
        pooled = inputs.rows(protocol.POOLED_HIDDEN)
        hidden = {t.hidden_size for t in column.tasks}
        rows = column.of("pooling")
        if pooled.ndim != 3 or pooled.shape[1] != len(protocol.POOLINGS) or {pooled.shape[2]} != hidden:
            raise RequestError(f"{protocol.POOLED_HIDDEN} must be {len(protocol.POOLINGS)} x {min(hidden)} values "
                               f"per item, got {list(pooled.shape[1:])}", item=0)
        chosen = pooled[np.arange(len(pooled)), [protocol.pooling_row(p) for p in rows]]
        # Only the row this task reads must be finite: another pooling's overflow is not this item's failure.
        refuse_first([(~np.isfinite(chosen).all(1), lambda k: f"{protocol.POOLED_HIDDEN} must have a finite "
                                                                 f"{rows[k]!r} row (the one this task reads)")])
        tokens = column.of("reads_tokens", bool)
        if not tokens.any():
            return HeadPart(column, pooled, compact=inputs.compact_answers)
        return self._token_inputs(inputs, column, pooled, tokens)

    def _token_inputs(self, inputs: RequestInputs, column: TaskColumn, pooled, tokens) -> HeadPart:
        """A token task's states, its text's words and each token's word, checked against each other (the
        request's longest item sets both lengths: a shorter item's padded tokens have word -1)."""
        states = inputs.rows(protocol.TOKEN_HIDDEN)
        first = inputs.rows(protocol.WORD_INDEX)
        texts = inputs.texts(protocol.WORD_TEXT, self.step.options.max_text_bytes)
        hidden = column.tasks[0].hidden_size
        if states.ndim != 3 or states.shape[2] != hidden:
            raise RequestError(f"{protocol.TOKEN_HIDDEN} must be [N, S, {hidden}], got {list(states.shape)}", item=0)
        if first.ndim != 2 or first.shape[1] != states.shape[1]:
            raise RequestError(f"{protocol.WORD_INDEX} must give each of the {states.shape[1]} tokens a word of "
                               f"{protocol.WORD_TEXT} or -1", item=0)
        words = [split_words(t) if tokens[k] else None for k, t in enumerate(texts)]
        counts = np.array([len(w.spans) if w is not None else 0 for w in words])
        refuse_first([(tokens & ((first.max(1) >= counts) | (first.min(1) < -1)),
                       lambda k: f"{protocol.WORD_INDEX} must give each of the {states.shape[1]} tokens a word of "
                                 f"{protocol.WORD_TEXT} ({counts[k]} words) or -1")])
        return HeadPart(column, pooled, states, first, words, inputs.compact_answers)

    @staticmethod
    def _run(parts: list[HeadPart]) -> tuple[BatchAnswers, list[HeadPart]]:
        tasks = TaskColumn.joined([p.tasks for p in parts])
        pooled = np.concatenate([p.pooled for p in parts])
        width = max((p.states.shape[1] for p in parts if p.states is not None), default=0)
        states, first, lengths = None, None, np.zeros(len(pooled), np.int64)
        words: list[Words | None] = []
        if width:
            states = np.zeros((len(pooled), width, pooled.shape[-1]), protocol.HIDDEN_DTYPE)
            first = np.full((len(pooled), width), -1, protocol.INDEX_DTYPE)
        at = 0
        for p in parts:
            if p.states is not None:
                states[at:at + p.count, :p.states.shape[1]] = p.states
                first[at:at + p.count, :p.first.shape[1]] = p.first
                lengths[at:at + p.count] = p.states.shape[1]
            words += p.words or [None] * p.count
            at += p.count
        heads = head_outputs(tasks.groups(), EncoderOutput(pooled, states), lengths, words, first)
        return BatchAnswers(tasks, heads), parts

    def _outputs(self, result, k: int, rows: range, request):
        answers, parts = result
        return answers.tensors(self.step, rows, self.step.requested(request), version=False, compact=parts[k].compact)

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._read, self._run, self._outputs)

    def finalize(self):
        self.step.close()
