"""What the served python steps compute, as stages the model files compose, each on a whole batch in columns:

    TextInputs  TEXT (+ TEXT_PAIR), TASK -> each request's task versions and its texts (or the token ids a client
                tokenized itself, checked): `read`, one request; `encode`, the batch's texts in one tokenizer call
                per max length, into one EncoderBatch (a token task's words and each token's word too)
    Encoder     the EncoderBatch (+ for AoT each token's row of P, found here in one pass) -> pooled states (+ a
                token task's token states; + the heads' outputs, for an engine with device heads)
    heads       each item's task head by its kind (aot.serving.heads) -> LOGITS, LABEL, ANSWER (aot.serving.outputs)

The GPU ensembles of the native backends run each stage in its own step (tokenizer, backbone, head). The CPU configs
and the torch engine run all three in one step (aot/model_repository/fused): one hop through the server instead of
three, which is most of what the server spends per request outside the engine (`aot bench tax`, docs/benchmarks.md,
"The serving tax"). Both shapes run the same code, so they answer alike.

A request's checks (`read`) refuse that request alone (RequestError); the batch's work is done once per batch: one
task resolution per distinct task name of a request, one tokenizer call per max length, one pass to find the rows of
P, one engine call, one head call per task version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from aot.serving import protocol
from aot.serving.columns import RequestInputs, TaskColumn, refuse_first
from aot.serving.engine import EncoderBatch, EncoderOutput, Engine, find_engine, instance_threads
from aot.serving.errors import RequestError
from aot.serving.pool import RowStorage
from aot.serving.tokenization import BLANK_TEXT, Tokenization, is_blank, tokenizer_threads, use_tokenizer_threads
from aot.serving.words import Words


def step_engine(parameters: dict[str, str]) -> Engine:
    """The engine a step's config names (parameter `engine`, ONNX Runtime if absent), registered (aot.serving.engine)."""
    return find_engine(parameters.get("engine", "onnx"))


def pool_storage(parameters: dict[str, str]) -> RowStorage | None:
    """Where a step's task pool keeps its rows: where its engine wants them (None: host memory)."""
    engine = step_engine(parameters)
    return None if engine.storage is None else engine.storage(parameters["device"])


@dataclass
class TextPart:
    """One request as the first stage read it: its items' task versions, and either their texts (+ pairs, None
    where absent) to tokenize or the token tensors [N, S] the client sent (checked)."""

    tasks: TaskColumn
    texts: list[str] | None = None
    pairs: list[str | None] | None = None
    tokens: dict[str, np.ndarray] | None = None
    compact: bool = False  # ANSWER only where the other outputs do not carry it (protocol.ANSWERS_PARAMETER)

    @property
    def count(self) -> int:
        return len(self.tasks.index)


@dataclass
class TextBatch:
    """A batch's items in columns: their task versions, their token tensors as the engine takes them, and for a
    token task's items their words (`words[k]`, None for other items) and the word each token starts (`first` [B, S],
    -1: none; None when the batch holds no token task)."""

    tasks: TaskColumn
    encoder: EncoderBatch
    words: list[Words | None] = field(default_factory=list)
    first: np.ndarray | None = None


class TextInputs:
    """The first stage, the only one that resolves a task name: each request's task versions, then its token ids,
    truncated to each task's max length exactly as in training and `aot predict`."""

    def __init__(self, step, buckets: tuple[int, ...] = ()):
        """`buckets`: lengths the token tensors are padded up to (native GPU backends); () keeps the batch's own."""
        self.step = step
        self.tokens = Tokenization(step.repo.tokenizer_dir, step.repo.uses_token_type_ids, buckets)
        threads = tokenizer_threads(step.parameters.get("device") == "cuda", step.instances)
        use_tokenizer_threads(threads)
        step.pb.Logger.log_info(f"{step.name}: the tokenizer encodes a batch on {threads} thread(s)")
        step.facts(tokenizer_threads=threads)

    def read(self, inputs: RequestInputs, column: TaskColumn) -> TextPart:
        """The request's items checked: their task versions (into `column`, for the step's metrics), and their texts
        or token ids."""
        step, limit = self.step, self.step.options.max_text_bytes
        texts = inputs.texts(protocol.TEXT, limit, required=False)
        has_ids = inputs.array(protocol.INPUT_IDS) is not None
        if (texts is None) != has_ids:
            raise RequestError(f"send either {protocol.TEXT} or {protocol.INPUT_IDS} (token ids tokenized by the "
                               "client), not both and not neither", item=0)
        pairs = inputs.texts(protocol.TEXT_PAIR, limit, required=False)
        if pairs is not None:
            pairs = [None if is_blank(p) else p for p in pairs]
        column.tasks, column.index = step.resolve(inputs)
        if has_ids:
            return TextPart(column, tokens=self._client_tokens(inputs, column, pairs), compact=inputs.compact_answers)
        checks = []
        if pairs is not None or any(t.has_pair for t in column.tasks):  # a pair sent, or a task that takes one
            paired = np.array([p is not None for p in pairs]) if pairs is not None else np.zeros(inputs.count, bool)
            pairing = column.pairing()
            checks.append(((pairing >= 0) & (pairing != paired), lambda k: f"task {column.task(k).name!r} was trained "
                           "on " + (f"single texts: send no {protocol.TEXT_PAIR}" if paired[k] else
                                    f"text pairs: send {protocol.TEXT_PAIR} too")))
        checks.append((np.fromiter(map(is_blank, texts), bool, inputs.count), lambda k: BLANK_TEXT))
        refuse_first(checks)
        return TextPart(column, texts, pairs, compact=inputs.compact_answers)

    def _client_tokens(self, inputs: RequestInputs, column: TaskColumn, pairs) -> dict[str, np.ndarray]:
        """Token ids a client sent, checked against each item's task (what holds for a task, once per task)."""
        def of_tasks(bad: list[bool]) -> np.ndarray:
            """Which items have a task of `bad` (one per task)."""
            return np.array(bad)[column.index] if any(bad) else np.zeros(inputs.count, bool)

        tasks = column.tasks
        refuse_first([(of_tasks([t.spec.reads_tokens for t in tasks]),
                       lambda k: f"task {column.task(k).name!r} tags tokens: send {protocol.TEXT} (its entities are "
                                 "found in the text), not token ids"),
                      (np.array([p is not None for p in pairs]) if pairs is not None else np.zeros(inputs.count, bool),
                       lambda k: f"send {protocol.TEXT_PAIR} with {protocol.TEXT}: token ids already hold the pair")])
        tokens = inputs.tokens(self.step.repo)
        width = tokens[protocol.INPUT_IDS].shape[1]
        checks = [(of_tasks([width > t.max_length for t in tasks]), lambda k: f"{protocol.INPUT_IDS} has {width} "
                   f"tokens: task {column.task(k).name!r} reads at most {column.task(k).max_length}")]
        if protocol.TOKEN_TYPE_IDS in tokens:  # a second segment is the pair (architectures with token types)
            paired = tokens[protocol.TOKEN_TYPE_IDS].any(1)
            if paired.any() or any(t.has_pair for t in tasks):
                pairing = column.pairing()
                checks.append(((pairing >= 0) & (pairing != paired), lambda k: f"task {column.task(k).name!r} was "
                               "trained on " + ("single texts: these token ids hold a second segment" if paired[k]
                                                else "text pairs: these token ids hold no second segment "
                                                     "(token_type_ids 1)")))
        refuse_first(checks)
        return tokens

    def encode(self, parts: list[TextPart]) -> TextBatch:
        """The batch's items as one EncoderBatch (encode_parts)."""
        return encode_parts(self.tokens, parts)


def encode_parts(tokens: Tokenization, parts: list[TextPart]) -> TextBatch:
    """A batch's items as one EncoderBatch: the texts of each (max length, kind reads tokens) in one tokenizer call,
    a token task's words in a call of their own, token ids as sent; all padded to the batch's longest. A function of
    its own: the repository's CPU engine in process (aot.exporter.cpu_engine) encodes as served."""
    tasks = TaskColumn.joined([p.tasks for p in parts])
    starts = np.cumsum([0] + [p.count for p in parts])
    longest, reads_tokens = tasks.of("max_length"), tasks.of("reads_tokens", bool)
    pieces: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []  # (rows, their tensors [n, S])
    texts: dict[int, tuple[str, str | None]] = {}
    for part, start in zip(parts, starts[:-1].tolist(), strict=True):
        if part.tokens is not None:
            pieces.append((np.arange(start, start + part.count), tokens.to_bucket(part.tokens)))
        else:
            pairs = part.pairs or [None] * part.count
            texts.update(zip(range(start, start + part.count), zip(part.texts, pairs, strict=True), strict=True))
    words: list[Words | None] = [None] * int(starts[-1])
    first_pieces = []
    if texts:
        rows = np.fromiter(texts, np.int64, len(texts))
        keys = longest[rows] * 2 + reads_tokens[rows]
        for key in np.unique(keys).tolist():
            mine = rows[keys == key]
            if key % 2:
                tensors, found, first = tokens.encode_words([texts[k][0] for k in mine.tolist()], key // 2)
                for k, w in zip(mine.tolist(), found, strict=True):
                    words[k] = w
                first_pieces.append((mine, first))
            else:
                tensors = tokens.encode_batch([texts[k][0] for k in mine.tolist()],
                                                   [texts[k][1] for k in mine.tolist()], key // 2)
            pieces.append((mine, tensors))
    encoder = _joined(pieces, int(starts[-1]), tokens.pad_id)
    encoder.want_states = reads_tokens
    first = None
    if first_pieces:
        first = np.full(encoder.tokens[protocol.INPUT_IDS].shape, -1, protocol.INDEX_DTYPE)
        for rows, values in first_pieces:
            first[rows, :values.shape[1]] = values
    return TextBatch(tasks, encoder, words, first)


def _joined(pieces: list[tuple[np.ndarray, dict[str, np.ndarray]]], size: int, pad_id: int) -> EncoderBatch:
    """One EncoderBatch of `size` rows from pieces (their rows, their tensors [n, S_i]), padded to the longest."""
    if len(pieces) == 1 and len(pieces[0][0]) == size and (pieces[0][0] == np.arange(size)).all():
        tokens = pieces[0][1]
    else:
        width = max(t[protocol.INPUT_IDS].shape[1] for _, t in pieces)
        tokens = {}
        for name in pieces[0][1]:
            tokens[name] = np.full((size, width), pad_id if name == protocol.INPUT_IDS else 0, protocol.TOKEN_DTYPE)
            for rows, tensors in pieces:
                tokens[name][rows, :tensors[name].shape[1]] = tensors[name]
    return EncoderBatch(tokens, tokens[protocol.ATTENTION_MASK].sum(1), np.zeros(size, bool))


class Encoder:
    """The backbone by the step's engine (aot.serving.engine: parameter `engine`), on one batch; for AoT it also finds
    each token's row of P (its task pool's slot, or a row read or computed from the task's storage) in this process,
    so the rows never cross to another step (the native GPU ensemble alone, whose engine is not Python, gets them from
    its aot_lookup step, over DLPack in device memory).

    - engine `onnx` (and `tensorrt` served locally): ONNX Runtime (aot.serving.engine.BackboneRunner), the batch split
      into runs of similar length; parameter `onnx_file`, the graph's path under the models folder.
    - engine `torch` (registered by aot.serving_torch.engine, which the model file imports): PyTorch with the task pool
      on the same device, the gather inside the encoder's forward (CUDA graphs per bucket on a GPU, the heads of
      pooled kinds inside them); parameter `device`.
    `threads` (parameter): the engine's CPU threads (0: this host's cores shared among the step's instances)."""

    def __init__(self, step, aot: bool, log=None, heads: bool = True):
        """`heads`: the engine may run the pooled kinds' heads on its device (the fused step; not the backbone step,
        whose head is a step of its own)."""
        self.step, self.aot = step, aot
        params = step.parameters
        self.engine = step_engine(params)
        threads = int(params.get("threads", "0")) or instance_threads(step.instances)
        self.runner = self.engine.build(step, aot, threads, log, heads=heads)
        # an engine that replays CUDA graphs counts the batches it ran eagerly (aot_engine_eager_batches_total)
        self._eager = getattr(self.runner, "eager_batches", None)
        if self._eager is not None:
            step.metrics.eager_batches(0)
        self.heads = getattr(self.runner, "heads", None)  # device heads (aot.serving.heads.HeadSlots), if any

    def run(self, batch: EncoderBatch, tasks: TaskColumn | None = None) -> EncoderOutput:
        """The batch through the engine: for AoT each token's row of P found first (bias); the heads' slots of an
        engine with device heads."""
        if self.aot:
            find_rows(batch, tasks, self.step.repo.vocab_size, self.step.pool, self.step.tasks,
                      slots=self.engine.gathers_slots)
        if self.heads is not None and tasks is not None:
            batch.head_slots = self.heads.slots(tasks.tasks)[tasks.index]
        cpu = time.process_time()
        out = self.runner.run(batch)
        self.step.metrics.engine_time(time.process_time() - cpu)
        if self._eager is not None and self.runner.eager_batches != self._eager:
            self.step.metrics.eager_batches(self.runner.eager_batches - self._eager)
            self._eager = self.runner.eager_batches
        return out


def find_rows(batch: EncoderBatch, tasks: TaskColumn, vocab_size: int, pool=None, registry=None,
              slots: bool = False) -> None:
    """Each token's row of P (batch.index, batch.rows): the batch's distinct (task, token) pairs found in one pass,
    each task version's rows in one call of the task pool through the step's task `registry` (its misses filled
    together), or read or computed from each version's storage without one. With `slots` (an engine that gathers
    from the pool itself) and every version in the pool, `index` holds pool slots; otherwise the batch gets rows of
    its own, one block per version: gathered from the pool, or from storage."""
    ids, mask = batch.tokens[protocol.INPUT_IDS], batch.tokens[protocol.ATTENTION_MASK].astype(bool)
    keys, inverse = np.unique((tasks.index[:, None] * vocab_size + ids)[mask], return_inverse=True)
    bounds = np.searchsorted(keys // vocab_size, np.arange(len(tasks.tasks) + 1))
    wanted = [(task, keys[bounds[t]:bounds[t + 1]] - t * vocab_size) for t, task in enumerate(tasks.tasks)]
    found = registry.pool_slots(wanted) if registry is not None else [None] * len(wanted)
    index = np.empty(ids.shape, np.int64)
    if slots and all(s is not None for s in found):
        index[mask] = np.concatenate(found)[inverse]
        batch.rows = None
    else:
        index[mask] = inverse
        batch.rows = [pool.gather(s) if s is not None else task.rows(token_ids)
                      for (task, token_ids), s in zip(wanted, found, strict=True) if len(token_ids)]
    batch.index = np.where(mask, index, index[:, :1])
