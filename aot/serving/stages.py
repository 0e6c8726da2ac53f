"""What the served python steps compute, as three stages the model files compose:

    TextInputs  TEXT (+ TEXT_PAIR), TASK -> the task version the request is pinned to and its token ids (or the
                token ids a client tokenized itself, checked); a token task's words and each token's word too
    Encoder     token ids (+ for AoT the task's rows of P, looked up here) -> pooled_hidden (+ a token task's
                token_hidden)
    head_answers  each request's own task head by its kind (aot.serving.heads) -> ANSWER, LOGITS, LABEL

The GPU ensembles run each stage in its own step (tokenizer, backbone, head: the tokenizer and head in several
instances beside one engine on the GPU). The CPU configs run all three in one step (aot/model_repository/fused): one
hop through the server instead of three, which is most of what the server spends per request outside the engine on
a CPU (`aot bench tax`, docs/benchmarks.md, "The serving tax"). Both shapes run the same code, so they answer alike.

Every stage takes a whole batch: `prepare` checks one request (a RequestError fails that request alone), the
`run`-like calls compute the batch at once (one encode_batch per max length, one pool call, the encoder split by
length, one head call per task version).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from aot.serving import protocol
from aot.serving.answers import READS_TOKENS
from aot.serving.engine import Engine, Prepared, find_engine, instance_threads
from aot.serving.errors import RequestError
from aot.serving.items import Item
from aot.serving.pool import RowStorage
from aot.serving.steps import RequestContext
from aot.serving.tasks import ServedTask
from aot.serving.tokenization import (
    Tokenization,
    given_pair,
    is_blank,
    pair_mismatch,
    tokenizer_threads,
    use_tokenizer_threads,
)
from aot.serving.words import Words


def step_engine(parameters: dict[str, str]) -> Engine:
    """The engine a step's config names (parameter `engine`, ONNX Runtime if absent), registered (aot.serving.engine)."""
    return find_engine(parameters.get("engine", "onnx"))


def pool_storage(parameters: dict[str, str]) -> RowStorage | None:
    """Where a step's task pool keeps its rows: where its engine wants them (None: host memory)."""
    engine = step_engine(parameters)
    return None if engine.storage is None else engine.storage(parameters["device"])


@dataclass
class TextRequest:
    """One request as the first stage checked it: its task version, and either its text (+ pair) to tokenize or
    the token tensors the client sent (`tokens`, checked)."""

    task: ServedTask
    text: str | None = None
    pair: str | None = None
    tokens: dict[str, np.ndarray] | None = None


@dataclass
class TokenizedText:
    """A request's token tensors and, for a token task, its text's words and the word each token starts (-1:
    none), what its head needs to answer with entities in the text."""

    tokens: dict[str, np.ndarray]
    words: Words | None = None
    first: np.ndarray | None = None


class TextInputs:
    """The first stage, the only one that resolves a task name: each request's task version, then its token ids,
    truncated to that task's max length exactly as in training and `aot predict`."""

    def __init__(self, step, buckets: tuple[int, ...] = ()):
        """`buckets`: lengths the token tensors are padded up to (native GPU backends); () keeps each sequence's own
        length."""
        self.step = step
        self.tokens = Tokenization(step.repo.tokenizer_dir, step.repo.uses_token_type_ids, buckets)
        threads = tokenizer_threads(step.parameters.get("device") == "cuda", step.instances)
        use_tokenizer_threads(threads)
        step.pb.Logger.log_info(f"{step.name}: the tokenizer encodes a batch on {threads} thread(s)")

    def prepare(self, item: Item, ctx: RequestContext) -> TextRequest:
        """The item's task version (pinned in `ctx`) and its text or token ids, checked."""
        step = self.step
        text = step.text(item, protocol.TEXT, required=False)
        ids = item.array(protocol.INPUT_IDS, required=False)
        if (text is None) == (ids is None):
            raise RequestError(f"send either {protocol.TEXT} or {protocol.INPUT_IDS} (token ids tokenized by the "
                               "client), not both and not neither")
        pair = given_pair(step.text(item, protocol.TEXT_PAIR, required=False))
        task = step.resolve(item)
        ctx.version = task.version
        if ids is not None and task.kind in READS_TOKENS:
            raise RequestError(f"task {task.name!r} tags tokens: send {protocol.TEXT} (its entities are found in the "
                               "text), not token ids")
        if ids is not None:
            if pair is not None:
                raise RequestError(f"send {protocol.TEXT_PAIR} with {protocol.TEXT}: token ids already hold the pair")
            tokens = step.tokens(item)
            if len(tokens[protocol.INPUT_IDS]) > task.max_length:
                raise RequestError(f"{protocol.INPUT_IDS} has {len(tokens[protocol.INPUT_IDS])} tokens: task "
                                   f"{task.name!r} reads at most {task.max_length}")
            if protocol.TOKEN_TYPE_IDS in tokens:  # a second segment is the pair (architectures with token types)
                paired = bool(tokens[protocol.TOKEN_TYPE_IDS].any())
                if pair_mismatch(task.meta.get("has_pair"), paired):
                    raise RequestError(f"task {task.name!r} was trained on "
                                       + ("single texts: these token ids hold a second segment" if paired else
                                          "text pairs: these token ids hold no second segment (token_type_ids 1)"))
            return TextRequest(task, tokens=tokens)
        if pair_mismatch(task.meta.get("has_pair"), pair is not None):
            raise RequestError(f"task {task.name!r} was trained on " + (
                f"single texts: send no {protocol.TEXT_PAIR}" if pair is not None else
                f"text pairs: send {protocol.TEXT_PAIR} too"))
        if is_blank(text):
            raise RequestError(f"{protocol.TEXT} is empty (or only whitespace, control or zero-width characters)")
        return TextRequest(task, text, pair)

    def encode(self, batch: list[TextRequest]) -> list[TokenizedText]:
        """Each prepared request's token tensors (encode_texts)."""
        return encode_texts(self.tokens, batch)


def encode_texts(tokens: Tokenization, batch: list[TextRequest]) -> list[TokenizedText]:
    """Each checked request's token tensors: the texts of the batch in one encode_batch per max length (the
    truncation is each task's; a token task's words in one call of their own), token ids as sent (padded to the
    bucket). A function of its own: the repository's CPU engine in process (aot.exporter.cpu_engine) encodes as
    served."""
    out = [None if r.tokens is None else TokenizedText(tokens.to_bucket(r.tokens)) for r in batch]
    by_length: dict[tuple[int, bool], list[int]] = {}
    for k, r in enumerate(batch):
        if r.tokens is None:
            by_length.setdefault((r.task.max_length, r.task.kind in READS_TOKENS), []).append(k)
    for (max_length, words), ks in by_length.items():
        if words:
            for k, (tensors, w, first) in zip(ks, tokens.encode_words([batch[k].text for k in ks], max_length)):
                out[k] = TokenizedText(tensors, w, first)
            continue
        texts = [(batch[k].text, batch[k].pair) for k in ks]
        for k, encoded in zip(ks, tokens.encode_batch(texts, max_length)):
            out[k] = TokenizedText(encoded)
    return out


class Encoder:
    """The backbone by the step's engine (aot.serving.engine: parameter `engine`), on one batch of token tensors; for
    AoT it also looks each request's rows of P up (its task pool, or the task's storage) in this process, so the rows
    never cross to another step (the native GPU ensemble alone, whose engine is not Python, gets them from its
    aot_lookup step, over DLPack in device memory).

    - engine `onnx` (and `tensorrt` served locally): ONNX Runtime (aot.serving.engine.BackboneRunner), the batch split
      into runs of similar length; parameter `onnx_file`, the graph's path under the models folder.
    - engine `torch` (registered by aot.serving_torch.engine, which the model file imports): PyTorch with the task pool
      on the same device, the gather inside the encoder's forward (CUDA graphs per bucket on a GPU); parameter
      `device`.
    `threads` (parameter): the engine's CPU threads (0: this host's cores shared among the step's instances)."""

    def __init__(self, step, aot: bool, log=None):
        self.step, self.aot = step, aot
        params = step.parameters
        self.engine = step_engine(params)
        threads = int(params.get("threads", "0")) or instance_threads(step.instances)
        self.runner = self.engine.build(step, aot, threads, log)
        # an engine that replays CUDA graphs counts the batches it ran eagerly (aot_engine_eager_batches_total)
        self._eager = getattr(self.runner, "eager_batches", None)
        if self._eager is not None:
            step.metrics.eager_batches(0)

    def prepare(self, task: ServedTask | None, tokens: dict[str, np.ndarray]) -> Prepared:
        """One request as the engine takes it (engine_request)."""
        return engine_request(task, tokens, self.aot)

    def prepare_many(self, tasks: list[ServedTask], tokens: list[dict[str, np.ndarray]]) -> list[Prepared]:
        """A batch's requests as the engine takes them, in one pass (engine_requests)."""
        return engine_requests(tasks, tokens, self.aot)

    def run(self, batch: list[Prepared]) -> np.ndarray:
        """The pooled states [B, P, d] of the batch, in its order (and each request's token states, `states`, where
        it wants them): its rows (or pool slots, for an engine that gathers from the pool itself) in one pool call,
        its misses filled together; then the encoder."""
        if self.aot:
            requests = [(p.task, p.unique) for p in batch]
            if self.engine.gathers_slots:
                for p, slots in zip(batch, self.step.tasks.pool_slots(requests)):
                    p.slots, p.rows = slots, p.task.rows(p.unique) if slots is None else None
            else:
                for p, rows in zip(batch, self.step.tasks.rows_many(requests), strict=True):
                    p.rows = rows
        cpu = time.process_time()
        pooled = self.runner.run(batch)
        self.step.metrics.engine_time(time.process_time() - cpu)
        if self._eager is not None and self.runner.eager_batches != self._eager:
            self.step.metrics.eager_batches(self.runner.eager_batches - self._eager)
            self._eager = self.runner.eager_batches
        return pooled


def engine_requests(tasks: list[ServedTask], tokens: list[dict[str, np.ndarray]], aot: bool = True) -> list[Prepared]:
    """engine_request of a batch: for AoT every request's distinct tokens found in one vectorised pass."""
    prepared = Prepared.for_tasks(tokens, tasks) if aot else [Prepared(t) for t in tokens]
    for p, task in zip(prepared, tasks, strict=True):
        p.want_states = task is None or task.kind in READS_TOKENS
    return prepared


def engine_request(task: ServedTask | None, tokens: dict[str, np.ndarray], aot: bool = True) -> Prepared:
    """One request as the engine takes it: its token tensors, and for AoT its task and the request's distinct tokens
    with each token's row among them (its rows still to come). A token task's (or, with no task known, any) request
    asks for every token's state too."""
    prepared = Prepared.for_task(tokens, task) if aot else Prepared(tokens)
    prepared.want_states = task is None or task.kind in READS_TOKENS
    return prepared
