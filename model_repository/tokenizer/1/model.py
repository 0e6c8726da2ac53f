"""Triton python model: TEXT (+ TEXT_PAIR), TASK -> token ids, truncated to the task's max length."""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from exporter import interface as io
from exporter.repository import read_repository
from exporter.runtime import TaskRegistry, Tokenization, decode_text, model_parameters, respond_each


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        model_dir = Path(args["model_repository"])
        repo = read_repository(model_dir.parent.parent)  # REPO/models/tokenizer
        buckets = tuple(int(b) for b in params.get("buckets", "").split(",") if b)
        self.tokens = Tokenization(repo.tokenizer_dir, repo.uses_token_type_ids, buckets)
        self.tasks = TaskRegistry((model_dir / params["store"]).resolve(), with_rows=False)
        self.outputs = io.token_inputs(repo.uses_token_type_ids)

    def _one(self, request):
        text = decode_text(pb_utils.get_input_tensor_by_name(request, io.TEXT).as_numpy().reshape(-1)[0], io.TEXT)
        pair_tensor = pb_utils.get_input_tensor_by_name(request, io.TEXT_PAIR)
        pair = None
        if pair_tensor is not None:
            pair = decode_text(pair_tensor.as_numpy().reshape(-1)[0], io.TEXT_PAIR) or None
        name = decode_text(pb_utils.get_input_tensor_by_name(request, io.TASK).as_numpy().reshape(-1)[0], io.TASK)
        task = self.tasks.get(name)
        encoded = self.tokens.encode(text, pair, task.max_length)
        return pb_utils.InferenceResponse([pb_utils.Tensor(n, encoded[n][None, :]) for n in self.outputs])

    def execute(self, requests):
        self.tasks.refresh()
        return respond_each(requests, self._one, pb_utils)
