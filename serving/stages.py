"""What the served python steps compute, as three stages the model files compose:

    TextInputs  TEXT (+ TEXT_PAIR), TASK -> the task version the request is pinned to and its token ids (or the
                token ids a client tokenized itself, checked)
    Encoder     token ids (+ for AoT the task's rows of P, looked up here) -> pooled_hidden
    head_answers  each request's own task head on its pooling -> LOGITS, LABEL

The GPU ensembles run each stage in its own step (tokenizer, backbone, head: the tokenizer and head in several
instances beside one engine on the GPU). The CPU configs run all three in one step (model_repository/fused): one
hop through the server instead of three, which is most of what the server spends per request outside the engine on
a CPU (`aot bench tax`, docs/benchmarks.md section 6). Both shapes run the same code, so they answer alike.

Every stage takes a whole batch: `prepare` checks one request (a RequestError fails that request alone), the
`run`-like calls compute the batch at once (one encode_batch per max length, one pool call, the encoder split by
length, one head call per task version).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from serving import protocol
from serving.errors import RequestError
from serving.tasks import ServedTask, token_index
from serving.tokenization import Tokenization, is_blank


def pool_storage(parameters: dict[str, str]):
    """Where a step's task pool keeps its rows: host memory (None), or torch memory on the torch engine's device
    (serving_torch is imported only then)."""
    if parameters.get("engine", "onnx") != "torch":
        return None
    from serving_torch.engine import DeviceRows

    return DeviceRows(parameters["device"])


class TextInputs:
    """The first stage, the only one that resolves a task name: each request's task version, then its token ids,
    truncated to that task's max length exactly as in training and `aot predict`."""

    def __init__(self, step, buckets: tuple[int, ...] = ()):
        """`buckets`: lengths the token tensors are padded up to (native GPU backends); () keeps each sequence's own
        length."""
        self.step = step
        self.tokens = Tokenization(step.repo.tokenizer_dir, step.repo.uses_token_type_ids, buckets)

    def prepare(self, request, ctx) -> tuple[ServedTask, tuple[str, str | None] | None, dict | None]:
        """(task, (text, pair), None) or (task, None, the client's token tensors), checked."""
        step = self.step
        text = step.text(request, protocol.TEXT, required=False)
        ids = step.tensor(request, protocol.INPUT_IDS, required=False)
        if (text is None) == (ids is None):
            raise RequestError(f"send either {protocol.TEXT} or {protocol.INPUT_IDS} (token ids tokenized by the "
                               "client), not both and not neither")
        pair = step.text(request, protocol.TEXT_PAIR, required=False)
        pair = None if pair is None or is_blank(pair) else pair
        task = step.tasks.resolve(step.task_name(request))
        ctx["version"] = task.version
        if ids is not None:
            if pair is not None:
                raise RequestError(f"send {protocol.TEXT_PAIR} with {protocol.TEXT}: token ids already hold the pair")
            tokens = step.tokens(request)
            if len(tokens[protocol.INPUT_IDS]) > task.max_length:
                raise RequestError(f"{protocol.INPUT_IDS} has {len(tokens[protocol.INPUT_IDS])} tokens: task "
                                   f"{task.name!r} reads at most {task.max_length}")
            if protocol.TOKEN_TYPE_IDS in tokens:  # a second segment is the pair (architectures with token types)
                paired = bool(tokens[protocol.TOKEN_TYPE_IDS].any())
                if self._pair_mismatch(task, paired):
                    raise RequestError(f"task {task.name!r} was trained on "
                                       + ("single texts: these token ids hold a second segment" if paired else
                                          "text pairs: these token ids hold no second segment (token_type_ids 1)"))
            return task, None, tokens
        if self._pair_mismatch(task, pair is not None):
            raise RequestError(f"task {task.name!r} was trained on " + (
                f"single texts: send no {protocol.TEXT_PAIR}" if pair is not None else
                f"text pairs: send {protocol.TEXT_PAIR} too"))
        if is_blank(text):
            raise RequestError(f"{protocol.TEXT} is empty (or only whitespace, control or zero-width characters)")
        return task, (text, pair), None

    @staticmethod
    def _pair_mismatch(task: ServedTask, paired: bool) -> bool:
        """A pair sent to a task trained on single texts, or none to a pair task, would silently change the answer
        (`has_pair` None: a version exported before it was recorded accepts both)."""
        has_pair = task.meta.get("has_pair")
        return has_pair is not None and has_pair != paired

    def encode(self, batch: list[tuple]) -> list[dict[str, np.ndarray]]:
        """Each prepared request's token tensors: the texts of the batch in one encode_batch per max length (the
        truncation is each task's), token ids as sent (padded to the bucket)."""
        out = [tokens if tokens is None else self.tokens.to_bucket(tokens) for _, _, tokens in batch]
        by_length: dict[int, list[int]] = {}
        for k, (task, texts, _) in enumerate(batch):
            if texts is not None:
                by_length.setdefault(task.max_length, []).append(k)
        for max_length, ks in by_length.items():
            for k, encoded in zip(ks, self.tokens.encode_batch([batch[k][1] for k in ks], max_length)):
                out[k] = encoded
        return out


class Encoder:
    """The backbone by the repository's engine, on one batch of token tensors; for AoT it also looks each request's
    rows of P up (its task pool, or the task's storage) in this process, so no rows cross between processes.

    - engine `onnx` (and `tensorrt` served locally): ONNX Runtime (serving.engine.BackboneRunner), the batch split
      into runs of similar length; parameter `onnx_file`, the graph's path under the models folder.
    - engine `torch`: PyTorch (serving_torch.engine.TorchBackbone) with the task pool on the same device, the gather
      inside the encoder's forward (CUDA graphs per bucket on a GPU); parameter `device`.
    `threads` (parameter): the engine's CPU threads (0: this host's cores shared among the step's instances)."""

    def __init__(self, step, aot: bool, log=None):
        self.step, self.aot = step, aot
        params = step.parameters
        self.torch = params.get("engine", "onnx") == "torch"
        threads = int(params.get("threads", "0")) or max(len(os.sched_getaffinity(0)) // step.instances, 1)
        if self.torch:
            from serving_torch.engine import TorchBackbone

            repo, options = step.repo, step.options
            self.runner = TorchBackbone(repo.encoder_dir, repo.uses_token_type_ids, aot, params["device"], threads,
                                        options.buckets, options.max_batch_size)
            if step.pool is not None:
                self.runner.pool_rows = step.pool.buffer
            eager = self.runner.capture_all()  # CUDA: every bucket's graph now, not on live requests
            if self.runner.graphs and log is not None:
                log(f"{step.step}: {len(self.runner.captured())} CUDA graphs captured"
                    + (f"; buckets run eagerly: {eager}" if eager else ""))
        else:
            from serving.engine import BackboneRunner

            self.runner = BackboneRunner(Path(step.repo.models) / params["onnx_file"], threads=threads)

    def prepare(self, task: ServedTask | None, tokens: dict[str, np.ndarray]) -> dict:
        """One request as the engine takes it: its token tensors, and for AoT its task and the request's distinct
        tokens with each token's row among them."""
        request = dict(tokens)
        if self.aot:
            request["task"] = task
            request["unique"], request[protocol.AOT_INDEX] = token_index(tokens[protocol.INPUT_IDS],
                                                                         tokens[protocol.ATTENTION_MASK])
        return request

    def run(self, batch: list[dict]) -> np.ndarray:
        """The pooled states [B, P, d] of the batch, in its order: its rows (or pool slots) in one pool call, its
        misses filled together; then the encoder."""
        if self.torch:
            return self._run_torch(batch)
        if self.aot:
            rows = self.step.tasks.rows_many([(r["task"], r["unique"]) for r in batch])
            for r, rows_of in zip(batch, rows):
                r[protocol.AOT_ROWS] = rows_of.reshape(-1)
        return self.runner.run(batch)

    def _run_torch(self, batch: list[dict]) -> np.ndarray:
        from serving_torch.engine import Prepared

        names = protocol.token_inputs(self.step.repo.uses_token_type_ids)
        prepared = [Prepared({n: r[n] for n in names}) for r in batch]
        if self.aot:
            requests = [(r["task"], r["unique"]) for r in batch]
            for p, r, slots in zip(prepared, batch, self.step.tasks.pool_slots(requests)):
                p.index, p.slots = r[protocol.AOT_INDEX], slots
                if slots is None:
                    p.rows = r["task"].rows(r["unique"])
        return self.runner.run(prepared)


def head_answers(tasks: list[ServedTask], pooled: list[np.ndarray]) -> list[tuple[np.ndarray, str]]:
    """Each request's (logits [1, n], label) from its pooled states [1, P, d]: each task version's head runs once
    over that version's requests of the batch (ServedTask.logits on the stacked states), on its task's pooling.
    States that are not finite raise (never a NaN answer with a label)."""
    groups: dict[str, list[int]] = {}
    for k, task in enumerate(tasks):
        groups.setdefault(task.version, []).append(k)
    out: list = [None] * len(tasks)
    for ks in groups.values():
        task = tasks[ks[0]]
        states = np.concatenate([pooled[k] for k in ks])
        if not np.isfinite(states[:, protocol.pooling_row(task.pooling)]).all():
            # the engine overflowed: a server fault; the step retries the batch request by request, so only the
            # requests whose own states are not finite fail
            raise FloatingPointError(f"the encoder's {task.pooling!r} states are not finite")
        logits = task.logits(states)
        for k, row in zip(ks, logits):
            out[k] = (row[None, :], task.label(row))
    return out
