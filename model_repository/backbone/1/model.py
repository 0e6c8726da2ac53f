"""Triton python model: the backbone, by the repository's engine (the local server has no native backends).

- `engine: onnx` (CPU configs of an ONNX/TensorRT repository): ONNX Runtime, batched exactly as Triton's native
  backend batches (serving.engine.BackboneRunner), so the same ONNX file serves the GPU config and this one.
- `engine: torch` (`aot export backbone --format torch`, CPU or CUDA by the `device` parameter): PyTorch
  (serving_torch.engine.TorchBackbone) with the task pool on the same device; the bias gather runs inside the
  encoder's forward (on CUDA: inside a captured CUDA graph per bucket).

The AoT variant also does the lookup (TASK_VERSION + token ids -> rows of P) here, in this process: on CPU a
separate lookup step would only add an IPC hop and a stub's CPU time per request (measured: 0.87x of the vanilla
ensemble's throughput with it). Each request is checked on its own and fails alone.
"""

import triton_python_backend_utils as pb_utils

from serving import protocol
from serving.steps import Step, model_parameters
from serving.tasks import token_index


class TritonPythonModel:
    def initialize(self, args):
        self.aot = args["model_name"] == "backbone"
        params = model_parameters(args)
        self.torch = params.get("engine", "onnx") == "torch"
        storage = None
        if self.torch:
            from serving_torch.engine import DeviceRows

            storage = DeviceRows(params["device"])
        self.step = Step(args, pb_utils, args["model_name"], tasks="rows" if self.aot else "none",
                         pool_storage=storage)
        threads = int(params.get("threads", "0"))
        if self.torch:
            from serving_torch.engine import TorchBackbone

            options = self.step.options
            self.runner = TorchBackbone(self.step.repo.encoder_dir, self.step.repo.uses_token_type_ids, self.aot,
                                        params["device"], threads, options.buckets, options.max_batch_size)
            if self.step.pool is not None:
                self.runner.pool_rows = self.step.pool.buffer
            eager = self.runner.capture_all()  # CUDA: every bucket's graph now, not on live requests
            if self.runner.graphs:
                pb_utils.Logger.log_info(f"{args['model_name']}: {len(self.runner.captured())} CUDA graphs captured"
                                         + (f"; buckets run eagerly: {eager}" if eager else ""))
        else:
            from serving.engine import BackboneRunner

            onnx = self.step.model_dir / args["model_version"] / params["onnx_file"]
            self.runner = BackboneRunner(onnx, threads=threads)

    def _prepare(self, request, ctx) -> dict:
        task = self.step.task_version(request, ctx) if self.step.tasks is not None else None  # first: metrics
        tensors = self.step.tokens(request)
        if task is not None:
            tensors["task"] = task
            tensors["unique"], tensors[protocol.AOT_INDEX] = token_index(tensors[protocol.INPUT_IDS],
                                                                         tensors[protocol.ATTENTION_MASK])
        return tensors

    def _run(self, batch: list[dict]):
        """The batch's rows (or pool slots) in one pool call, its misses filled together; then the encoder."""
        if self.torch:
            return self._run_torch(batch)
        if self.step.tasks is not None:
            rows = self.step.tasks.rows_many([(r["task"], r["unique"]) for r in batch])
            for r, rows_of in zip(batch, rows):
                r[protocol.AOT_ROWS] = rows_of.reshape(-1)
        return self.runner.run(batch)

    def _run_torch(self, batch: list[dict]):
        from serving_torch.engine import Prepared

        names = protocol.token_inputs(self.step.repo.uses_token_type_ids)
        prepared = [Prepared({n: r[n] for n in names}) for r in batch]
        if self.step.tasks is not None:
            requests = [(r["task"], r["unique"]) for r in batch]
            for p, r, slots in zip(prepared, batch, self.step.tasks.pool_slots(requests)):
                p.index, p.slots = r[protocol.AOT_INDEX], slots
                if slots is None:
                    p.rows = r["task"].rows(r["unique"])
        return self.runner.run(prepared)

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(
            requests, self._prepare, self._run,
            lambda pooled, k: [self.step.output(protocol.POOLED_HIDDEN, pooled[k:k + 1])])
