"""The tensors that flow between the steps of the served ensemble: protocol version 1.

Client -> ensemble `aot`:
    TEXT        BYTES [1]   UTF-8 text
    TEXT_PAIR   BYTES [1]   optional second text (pair tasks)
    TASK        BYTES [1]   task name
ensemble -> client:
    LOGITS      FP32  [n]   n = the task's number of labels (1 for regression)
    LABEL       BYTES [1]   the arg-max label name (the score, as text, for regression)

tokenizer -> lookup/backbone:  input_ids, attention_mask (and token_type_ids where the architecture has them),
    INT64 [S]; S is the sequence's own length (CPU) or its length rounded up to a bucket (GPU).
lookup -> backbone (GPU; on CPU the python backbone step does the lookup itself and takes TASK instead):
    aot_rows    FP16  [U*L*d]  the rows of P for the request's U distinct tokens, token-major [U, L, d], flat
    aot_index   INT32 [S]      for each token, which of the U rows it takes (padding takes row 0)
backbone (inside the graph): aot_row_offsets INT32 [B+1], the accumulated element counts of the batch's aot_rows
    with a leading zero (Triton's BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO), turns local rows into global ones.
backbone -> head:
    cls_hidden  FP32  [d]      the first token's final hidden state

Per request the lookup moves U*L*d*2 + S*4 bytes instead of the dense S*L*d*4 of a per-token bias tensor.
"""

PROTOCOL_VERSION = 1

TEXT, TEXT_PAIR, TASK = "TEXT", "TEXT_PAIR", "TASK"
LOGITS, LABEL = "LOGITS", "LABEL"
INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS = "input_ids", "attention_mask", "token_type_ids"
AOT_ROWS, AOT_INDEX, AOT_ROW_OFFSETS = "aot_rows", "aot_index", "aot_row_offsets"
CLS_HIDDEN = "cls_hidden"

ROWS_DTYPE = "float16"
INDEX_DTYPE = "int32"


def token_inputs(uses_token_type_ids: bool) -> list[str]:
    """The backbone's token inputs for an architecture (Optimum-style: one place knows them)."""
    return [INPUT_IDS, ATTENTION_MASK] + ([TOKEN_TYPE_IDS] if uses_token_type_ids else [])


def lookup_bytes(unique_tokens: int, seq_len: int, num_layers: int, hidden: int) -> int:
    return unique_tokens * num_layers * hidden * 2 + seq_len * 4


def dense_bias_bytes(seq_len: int, num_layers: int, hidden: int) -> int:
    return seq_len * num_layers * hidden * 4
