"""A batch's answers as each request's output tensors (protocol): LOGITS, LABEL, TASK_VERSION and ANSWER, each a
slice of arrays built once per batch (aot.serving.heads.HeadOutputs); ANSWER's JSON is written only for a request
that asks for that output (Triton passes each request's requested outputs: every output when a client names none).

LOGITS of a request whose items have outputs of different widths (tasks of different label counts, a token task's
words) is [N, W], each row zero past its item's own width, which LOGITS_WIDTH gives (zero, not NaN: a bare NaN is
not JSON, and Triton's HTTP front end writes tensors as JSON).
"""

from __future__ import annotations

import json

import numpy as np

from aot.serving import protocol
from aot.serving.columns import TaskColumn
from aot.serving.heads import HeadOutputs
from aot.serving.kinds import KINDS

KIND_NAMES = {kind: json.dumps(kind).encode() for kind in KINDS}  # a compact ANSWER, written once


class BatchAnswers:
    """The answers of a batch's items (rows of `heads`), by request."""

    def __init__(self, tasks: TaskColumn, heads: HeadOutputs):
        self.heads = heads
        self.versions = np.array([t.version.encode() for t in tasks.tasks], dtype=np.object_)[tasks.index]

    def tensors(self, step, rows: range, requested: set[str] | None, version: bool = True,
                compact: bool = False) -> list:
        """The output tensors of a request whose items are `rows` of the batch (`requested`: the outputs it asks for,
        None for all; `version`: with TASK_VERSION, which the GPU ensembles' head step leaves to the tokenizer's;
        `compact`: ANSWER the kind's name where LOGITS and LABEL carry the answer, protocol.ANSWERS_PARAMETER)."""
        heads, cut = self.heads, slice(rows.start, rows.stop)
        width = int(heads.widths[cut].max())
        out = [step.output(protocol.LOGITS, np.ascontiguousarray(heads.values[cut, :width])),
               step.output(protocol.LOGITS_WIDTH, heads.widths[cut, None].astype(protocol.INDEX_DTYPE)),
               step.output(protocol.LABEL, heads.labels[cut, None])]
        if version:
            out.append(step.output(protocol.TASK_VERSION, self.versions[cut, None]))
        if requested is None or protocol.ANSWER in requested:
            bodies = [KIND_NAMES[body] if isinstance(body, str) else json.dumps(body).encode()
                      for body in heads.bodies(rows, compact)]
            out.append(step.output(protocol.ANSWER, np.array(bodies, dtype=np.object_)[:, None]))
        return out
