"""Triton python model: the AoT lookup of the native GPU ensemble. TASK_VERSION, token ids -> the request's bias in
the repository's bias interface: the rows of P for its distinct tokens + each token's row (`rows`), or each token's
row itself, rows[index] (`dense`); its batch's misses filled together in the task pool.

`pool_storage: torch` (the GPU config, KIND_GPU): the pool lives in device memory (aot.serving_torch.engine.DeviceRows
on this instance's GPU); a request's rows are gathered there and handed to the backbone as a GPU tensor through
DLPack, device to device. `pool_storage: host`: the pool is a numpy buffer and rows go out as host tensors. Rows a
pool does not hold (no pool, a version that left the manifest) are read or computed from storage, on the host."""

import numpy as np
import triton_python_backend_utils as pb_utils

from aot.serving import protocol
from aot.serving.engine import Prepared
from aot.serving.items import Item
from aot.serving.steps import RequestContext, Step, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.device = None
        storage = None
        if params.get("pool_storage", "host") == "torch":
            from aot.serving_torch.engine import DeviceRows

            self.device = "cpu" if params.get("device", "cpu") == "cpu" else \
                f"cuda:{args.get('model_instance_device_id', '0')}"
            if self.device != "cpu":
                import torch

                # The backend copies outputs on the current device: make it this instance's GPU (KIND_GPU makes one
                # instance per GPU).
                torch.cuda.set_device(self.device)
            storage = DeviceRows(self.device)
        self.step = Step(args, pb_utils, "aot_lookup", parts="rows", pool_storage=storage)
        self.dense = self.step.options.bias_interface == "dense"
        where = f"torch memory on {self.device}, out through DLPack" if self.device else "host memory"
        pb_utils.Logger.log_info(f"aot_lookup: task pool rows in {where}")

    def _prepare(self, item: Item, ctx: RequestContext) -> Prepared:
        task = self.step.task_version(item, ctx)
        return Prepared.for_task(self.step.tokens(item), task)

    def _run(self, batch: list[Prepared]):
        """The batch's rows in one pool call (its misses filled together), gathered on the pool's device; rows the
        pool does not hold come from storage. Dense: each token's row, gathered straight from the pool's slots (on
        the GPU for the device pool)."""
        wanted = [(p.task, p.unique) for p in batch]
        if self.dense:
            return self.step.tasks.rows_many(wanted, indexes=[p.index for p in batch])
        rows = self.step.tasks.rows_many(wanted)
        return [(r.reshape(1, -1), p.index[None, :]) for r, p in zip(rows, batch)]

    def _tensor(self, name: str, value):
        """Host arrays as they are; a torch tensor (the device pool's gather) through DLPack, without a copy. The
        tensor itself, not a capsule: given an object with __dlpack__, the backend synchronizes with the stream that
        produced it before it reads it."""
        if isinstance(value, np.ndarray):
            return self.step.output(name, value)
        return pb_utils.Tensor.from_dlpack(name, value.contiguous())

    def _outputs(self, out, ks):
        """Dense: the request's items' biases, [N, S, L, d] (its items share the length the tokenizer padded them
        to). Rows: one item per request (the tokenizer refuses more: the graph adds one row offset per request)."""
        if self.dense:
            mine = [out[k] for k in ks]
            if isinstance(mine[0], np.ndarray):
                return [self._tensor(protocol.AOT_BIAS, np.stack(mine))]
            import torch

            return [self._tensor(protocol.AOT_BIAS, torch.stack(mine))]
        (k,) = ks
        rows, index = out[k]
        return [self._tensor(protocol.AOT_ROWS, rows), self.step.output(protocol.AOT_INDEX, index)]

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._prepare, self._run, self._outputs)

    def finalize(self):
        self.step.close()
