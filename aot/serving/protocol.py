"""The tensors that flow between the client and the steps of the served ensemble: protocol version 8 (what each
version changed: docs/formats.md, "Protocol history").

Client -> ensemble `aot`:
    TEXT          BYTES [1]   UTF-8 text (at most the repository's `max_text_bytes`)
    TEXT_PAIR     BYTES [1]   optional second text (pair tasks)
    TASK          BYTES [1]   task name (its latest published version), or `<name>@<id>`: exactly that version
                              while the store holds it (else 404)
  or, instead of TEXT (+ TEXT_PAIR), the token ids the client made with the repository's tokenizer (aot.Client(
  tokenizer=...)), truncated to the task's max_length: the tokenizer step checks them and passes them on
    input_ids, attention_mask (and token_type_ids where the architecture has them), INT64 [S]
ensemble -> client:
    TASK_VERSION  BYTES [1]   the task version `<name>@<id>` that produced the answer
    ANSWER        BYTES [1]   JSON: the answer of the task's kind (aot.serving.kinds), without the version; sent
                              only to a request that asks for it (a client that names no outputs gets them all)
    LOGITS        FP32  [n]   the head's output: a classifier's or multi-label task's logits (n labels), a regressor's
                              score (1), an embedding (d), a token task's logits of each word's first token (W x n);
                              a request's items of different widths: each row zero past its own LOGITS_WIDTH
    LOGITS_WIDTH  INT32 [1]   how many of the item's LOGITS are its own
    LABEL         BYTES [1]   the arg-max label name (the score, as text, for regression; a multi-label task's
                              labels as a JSON list; empty for token and embedding tasks)

model `task_list` (no inputs) -> client:
    TASKS         BYTES [1]   JSON: {"tasks": [{name, version, kind, storage, labels, max_length, method, metric,
                              dev, source}], "errors": {name: why its requests fail}}: what the server serves now

Between the steps of the GPU ensembles (on CPU, `aot` and `vanilla` are each one step: only the client's tensors
above cross the server):

tokenizer -> later steps:
    TASK_VERSION  BYTES [1]   the exact task version `<name>@<id>` TASK resolved to. The tokenizer is the only
                              step that resolves a name; every later step serves exactly this version or fails the
                              request, so a re-export between two steps never pairs one version's table with
                              another's head.
    input_ids, attention_mask (and token_type_ids where the architecture has them), INT64 [S]; S is the
        sequence's own length (CPU) or its length rounded up to a bucket (GPU).
    word_index    INT32 [S]      (to the head) for a token task, the word each token starts (-1: a special token or
                                 a word's later piece; aot.serving.words.first_pieces); [1] holding -1 for other kinds
    word_text     BYTES [1]      (to the head) a token task's text, whose words the entities' offsets point into;
                                 empty for other kinds
lookup -> backbone (native GPU backends; with the torch engine the python backbone step does the lookup itself and
takes TASK_VERSION instead), in the repository's bias interface (serving option `bias_interface`):
  rows (default):
    aot_rows      FP16  [U*L*d]  the rows of P for the request's U distinct tokens, token-major [U, L, d], flat
    aot_index     INT32 [S]      for each token, which of the U rows it takes (padding takes row 0)
    backbone (inside the graph): aot_row_offsets INT32 [B+1], the accumulated element counts of the batch's aot_rows
    with a leading zero (Triton's BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO), turns local rows into global ones.
  dense:
    aot_bias      FP16  [S, L, d]  each token's row (aot_rows[aot_index]; padding takes row 0), S the bucketed
                                   length: fixed shapes per bucket, so TensorRT replays a captured CUDA graph
backbone -> head:
    pooled_hidden FP32  [K, d]   the final hidden states pooled each way in POOLINGS (K of them; P names the
                                 prompt table): row 0 the first token's, row 1 the mean over the attention mask;
                                 the head of a pooled kind reads its task's row
    token_hidden  FP32  [S, d]   every token's final state, what a token task's head reads: a native backend (ONNX
                                 Runtime, TensorRT) sends it for every request (S*d*4 bytes); the python backbone step
                                 (torch engine) only for token tasks, [1, d] zeros for the others

A request whose parameters (a JSON object) hold PROBE_PARAMETER is the supervisor's liveness probe: every python
step answers it at once with no outputs and counts it nowhere. A request whose parameters hold ANSWERS_PARAMETER:
"compact" gets ANSWER's JSON only for the items whose answer the other outputs do not carry (a token task's entities,
a multi-label task's scores by label); for the others, ANSWER is their kind's name as a JSON string ("classification",
"regression", "embedding"), and aot.Client builds the answer from LOGITS, LOGITS_WIDTH and LABEL by the server's
own rule (aot.serving.kinds.KindSpec.carried): the server writes no JSON for most texts.

Per request the rows interface moves U*L*d*2 + S*4 bytes; the dense one S*L*d*2 (U <= S distinct tokens). The
backbone hands the head K*d*4 bytes (pooled_hidden) and token_hidden; the tokenizer hands it S*4 + the text's bytes
(word_index, word_text) for a token task, 4 + 0 otherwise.
"""

from __future__ import annotations

import numpy as np

PROTOCOL_VERSION = 8

TEXT, TEXT_PAIR, TASK, TASK_VERSION = "TEXT", "TEXT_PAIR", "TASK", "TASK_VERSION"
LOGITS, LABEL, TASKS, ANSWER = "LOGITS", "LABEL", "TASKS", "ANSWER"
LOGITS_WIDTH = "LOGITS_WIDTH"
HEAD_OUTPUTS = (ANSWER, LOGITS, LOGITS_WIDTH, LABEL)  # what the head step answers (TASK_VERSION: the tokenizer's)
INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS = "input_ids", "attention_mask", "token_type_ids"
AOT_ROWS, AOT_INDEX, AOT_ROW_OFFSETS = "aot_rows", "aot_index", "aot_row_offsets"
AOT_BIAS = "aot_bias"
PROBE_PARAMETER = "aot_probe"  # a request parameter: marks the supervisor's liveness probe (see above)
ANSWERS_PARAMETER, COMPACT_ANSWERS = "aot-answers", "compact"  # a request parameter: ANSWER where needed (see above)
# How the lookup hands a request's bias to a native backbone (see above): what the AoT graph's inputs are.
BIAS_INTERFACES = ("rows", "dense")
POOLED_HIDDEN = "pooled_hidden"
TOKEN_HIDDEN = "token_hidden"
WORD_INDEX, WORD_TEXT = "word_index", "word_text"
# How a task turns the final hidden states into the one vector its head reads; the backbone computes every one, in
# this order, so tasks that pool differently share one backbone. `cls`: the first token (BERT, RoBERTa); `mean`:
# the average over the attention mask (sentence-transformers models are trained with it).
POOLINGS = ("cls", "mean")
# What a task recorded before pooling was a setting (an artifact or task version without `pooling`) was trained on.
POOLING_BEFORE_V3 = "cls"


def pooling_row(pooling: str) -> int:
    """The row of `pooling` in pooled_hidden: the one check of a pooling name, wherever one is read."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}: expected one of {', '.join(POOLINGS)}")
    return POOLINGS.index(pooling)

# The one definition of every numeric tensor's dtype; BYTES tensors are numpy object arrays.
TOKEN_DTYPE = np.dtype(np.int64)
ROWS_DTYPE = np.dtype(np.float16)
INDEX_DTYPE = np.dtype(np.int32)
HIDDEN_DTYPE = np.dtype(np.float32)
LOGITS_DTYPE = np.dtype(np.float32)
DTYPES = {INPUT_IDS: TOKEN_DTYPE, ATTENTION_MASK: TOKEN_DTYPE, TOKEN_TYPE_IDS: TOKEN_DTYPE, AOT_ROWS: ROWS_DTYPE,
          AOT_BIAS: ROWS_DTYPE, AOT_INDEX: INDEX_DTYPE, AOT_ROW_OFFSETS: INDEX_DTYPE, POOLED_HIDDEN: HIDDEN_DTYPE, LOGITS: LOGITS_DTYPE,
          TOKEN_HIDDEN: HIDDEN_DTYPE, WORD_INDEX: INDEX_DTYPE, LOGITS_WIDTH: INDEX_DTYPE}
BYTES = "BYTES"
_TRITON_TYPES = {"int64": "INT64", "int32": "INT32", "float16": "FP16", "float32": "FP32"}


def triton_type(name: str) -> str:
    """The Triton data type of a protocol tensor ("BYTES" for text tensors)."""
    if name not in DTYPES:
        return BYTES
    return _TRITON_TYPES[DTYPES[name].name]


def token_inputs(uses_token_type_ids: bool) -> list[str]:
    """The backbone's token inputs for an architecture (Optimum-style: one place knows them)."""
    return [INPUT_IDS, ATTENTION_MASK] + ([TOKEN_TYPE_IDS] if uses_token_type_ids else [])


def bias_inputs(interface: str) -> list[str]:
    """The AoT graph's bias inputs in `interface` (aot_row_offsets is the batch input Triton adds to the rows)."""
    if interface not in BIAS_INTERFACES:
        raise ValueError(f"unknown bias interface {interface!r}: expected one of {', '.join(BIAS_INTERFACES)}")
    return [AOT_ROWS, AOT_INDEX, AOT_ROW_OFFSETS] if interface == "rows" else [AOT_BIAS]


def lookup_bytes(unique_tokens: int, seq_len: int, num_layers: int, hidden: int) -> int:
    return unique_tokens * num_layers * hidden * ROWS_DTYPE.itemsize + seq_len * INDEX_DTYPE.itemsize


def dense_bias_bytes(seq_len: int, num_layers: int, hidden: int) -> int:
    """The dense interface's aot_bias of one request (`seq_len`: its bucketed length on a GPU)."""
    return seq_len * num_layers * hidden * ROWS_DTYPE.itemsize
