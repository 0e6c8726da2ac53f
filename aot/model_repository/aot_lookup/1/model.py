"""Triton python model: the AoT lookup of the native GPU ensemble. TASK_VERSION, token ids -> the request's bias in
the repository's bias interface: the rows of P for its distinct tokens + each token's row (`rows`), or each token's
row itself, rows[index] (`dense`); its batch's misses filled together in the task pool.

`pool_storage: torch` (the GPU config, KIND_GPU): the pool lives in device memory (aot.serving_torch.engine.DeviceRows
on this instance's GPU); a request's rows are gathered there and handed to the backbone as a GPU tensor through
DLPack, device to device. `pool_storage: host`: the pool is a numpy buffer and rows go out as host tensors. Rows a
pool does not hold (no pool, a version that left the manifest) are read or computed from storage, on the host."""


from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from aot.serving import protocol
from aot.serving.columns import RequestInputs, TaskColumn
from aot.serving.engine import EncoderBatch
from aot.serving.stages import find_rows
from aot.serving.steps import Step, model_parameters


@dataclass
class LookupPart:
    """A request's token tensors [N, S], checked, and its items' task versions."""

    tokens: dict[str, np.ndarray]
    tasks: TaskColumn

    @property
    def count(self) -> int:
        return len(self.tokens[protocol.INPUT_IDS])

    @property
    def width(self) -> int:
        return self.tokens[protocol.INPUT_IDS].shape[1]


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

    def _read(self, inputs: RequestInputs, column: TaskColumn) -> LookupPart:
        column.tasks, column.index = self.step.pinned(inputs)
        return LookupPart(inputs.tokens(self.step.repo), column)

    def _run(self, parts: list[LookupPart]):
        """The batch's rows in one pool call (its misses filled together), gathered on the pool's device, with each
        token's row among them; rows the pool does not hold come from storage."""
        batch = EncoderBatch.joined([p.tokens for p in parts])
        find_rows(batch, TaskColumn.joined([p.tasks for p in parts]), self.step.repo.vocab_size, self.step.pool,
                  self.step.tasks)
        rows = batch.rows
        if all(isinstance(r, np.ndarray) for r in rows):
            return np.concatenate(rows), batch, parts
        import torch

        device = next(r.device for r in rows if not isinstance(r, np.ndarray))
        return torch.cat([torch.as_tensor(r, device=device) for r in rows]), batch, parts

    def _tensor(self, name: str, value):
        """Host arrays as they are; a torch tensor (the device pool's gather) through DLPack, without a copy. The
        tensor itself, not a capsule: given an object with __dlpack__, the backend synchronizes with the stream that
        produced it before it reads it."""
        if isinstance(value, np.ndarray):
            return self.step.output(name, np.ascontiguousarray(value))
        return pb_utils.Tensor.from_dlpack(name, value.contiguous())

    def _outputs(self, result, k: int, rows: range, request):
        """Dense: the request's items' biases, [N, S, L, d] (as long as its token ids). Rows: one item per request
        (the tokenizer refuses more: the graph adds one row offset per request): its distinct tokens' rows, flat, and
        each token's row among them."""
        table, batch, parts = result
        index = batch.index[rows.start:rows.stop, :parts[k].width]
        if self.dense:
            return [self._tensor(protocol.AOT_BIAS, table[index if isinstance(table, np.ndarray) else
                                                          self._on(table, index)])]
        unique, local = np.unique(index[0][: int(batch.lengths[rows.start])], return_inverse=True)
        mine = np.zeros(index.shape[1], protocol.INDEX_DTYPE)
        mine[: len(local)] = local
        picked = table[unique] if isinstance(table, np.ndarray) else table[self._on(table, unique)]
        return [self._tensor(protocol.AOT_ROWS, picked.reshape(1, -1)),
                self.step.output(protocol.AOT_INDEX, mine[None, :])]

    @staticmethod
    def _on(table, index: np.ndarray):
        import torch

        return torch.as_tensor(index, device=table.device)

    def execute(self, requests):
        self.step.refresh()
        return self.step.respond_batch(requests, self._read, self._run, self._outputs)

    def finalize(self):
        self.step.close()
