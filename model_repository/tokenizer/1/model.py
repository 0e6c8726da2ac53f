"""Triton python model: TEXT (+ TEXT_PAIR), TASK -> token ids (truncated to the task's max length) and the
TASK_VERSION every later step serves (the only step that resolves a task name).

A client that tokenized on its own side (aot.Client(tokenizer=...)) sends input_ids, attention_mask (and
token_type_ids) instead of TEXT: they are checked (the backbone's ranges, at most the task's max length) and passed
on. Each request is checked on its own; the texts of a batch are then tokenized in one call per max length."""

import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.errors import RequestError
from serving.steps import Step
from serving.tokenization import Tokenization, is_blank


class TritonPythonModel:
    def initialize(self, args):
        self.step = Step(args, pb_utils, "tokenizer")
        buckets = tuple(int(b) for b in self.step.parameters.get("buckets", "").split(",") if b)
        self.tokens = Tokenization(self.step.repo.tokenizer_dir, self.step.repo.uses_token_type_ids, buckets)
        self.outputs = protocol.token_inputs(self.step.repo.uses_token_type_ids)

    def _prepare(self, request, ctx):
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
    def _pair_mismatch(task, paired: bool) -> bool:
        """A pair sent to a task trained on single texts, or none to a pair task, would silently change the answer
        (`has_pair` None: a version exported before it was recorded accepts both)."""
        has_pair = task.meta.get("has_pair")
        return has_pair is not None and has_pair != paired

    def _run(self, batch):
        """The texts of the batch in one encode_batch per max length (truncation is the task's); token ids as sent."""
        out = [tokens if tokens is None else self.tokens.to_bucket(tokens) for _, _, tokens in batch]
        by_length: dict[int, list[int]] = {}
        for k, (task, texts, _) in enumerate(batch):
            if texts is not None:
                by_length.setdefault(task.max_length, []).append(k)
        for max_length, ks in by_length.items():
            for k, encoded in zip(ks, self.tokens.encode_batch([batch[k][1] for k in ks], max_length)):
                out[k] = encoded
        return [(task.version, tensors) for (task, _, _), tensors in zip(batch, out)]

    def _outputs(self, encoded, k):
        version, tensors = encoded[k]
        return [self.step.output(n, tensors[n][None, :]) for n in self.outputs] + [
            self.step.bytes_output(protocol.TASK_VERSION, version)]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._prepare, self._run, self._outputs)
